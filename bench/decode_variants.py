"""GPU decode-step variants a bench switches on by name, for graphs captured after the switch; not a test.

A variant is "KTxSTAGES[xSPLITS]" (the deep attention kernel with tiles of kernel_names.DEEP_TILES or DEEP_SWEEP,
heads of 128, SPLITS in place of cuda.deep_decode_splits'), a sweep form of kernel_names.DEEP_FORMS (e.g. "bulk",
the default tiles and splits), "deep" (the deep kernel's graph at every position, not only from
cuda.DEEP_DECODE_KEYS' on) or "default".
"""

from __future__ import annotations

import functools
from typing import Callable


def switch(spec: str, backend=None) -> Callable[[], None]:
    """Make graphs captured from now on run `spec` (for `backend` too where one is loaded: it set its deep_from
    with its KV cache). Returns what undoes it."""
    from engine.kernels import cuda
    from engine.kernels import kernel_names as N

    launch, splits_of, deep_keys = cuda.attention_decode_deep, cuda.deep_decode_splits, cuda.DEEP_DECODE_KEYS
    if spec in N.DEEP_FORMS:
        cuda.attention_decode_deep = functools.partial(launch, form=spec)
    elif spec == "deep":
        cuda.DEEP_DECODE_KEYS = dict.fromkeys(deep_keys, 0)
    elif spec != "default":
        try:
            kt, stages, *rest = (int(v) for v in spec.split("x"))
        except ValueError:
            raise ValueError(f"no decode variant {spec!r}: KTxSTAGES[xSPLITS], default, deep or one of "
                             f"{sorted(N.DEEP_FORMS)}") from None
        tiles, fixed = (kt, stages), rest[0] if rest else None

        def splits_for(max_tokens, n_kv, hd, _tiles=None, kv="full"):  # as the backend and the launcher call it
            return fixed or splits_of(max_tokens, n_kv, hd, tiles, kv)

        cuda.attention_decode_deep, cuda.deep_decode_splits = functools.partial(launch, tiles=tiles), splits_for
    loaded_from = backend.deep_from if backend is not None else None
    if backend is not None and spec == "deep":
        backend.deep_from = 0

    def undo() -> None:
        cuda.attention_decode_deep, cuda.deep_decode_splits, cuda.DEEP_DECODE_KEYS = launch, splits_of, deep_keys
        if backend is not None:
            backend.deep_from = loaded_from

    return undo
