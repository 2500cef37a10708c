"""GPU decode-step variants a bench switches on by name, for graphs captured after the switch; not a test.

A variant is "KTxSTAGES[xSPLITS]" (the deep attention kernel with tiles of kernel_names.DEEP_TILES or DEEP_SWEEP,
heads of 128, SPLITS in place of cuda.deep_decode_splits'), a sweep form of kernel_names.DEEP_FORMS (e.g. "late",
the default tiles and splits), "expert-prefetch" (the experts' gate/up products asking L2 for the down products'
rows: backend_cupy.EXPERT_PREFETCH), "deep" (the deep kernel's graph at every position, not only from
cuda.DEEP_DECODE_KEYS on) or "default".
"""

from __future__ import annotations

import functools
from typing import Callable


def switch(spec: str, backend=None) -> Callable[[], None]:
    """Make graphs captured from now on run `spec` (for `backend` too where one is loaded: the backend reads
    expert_prefetch when it captures; a backend made later takes EXPERT_PREFETCH). Returns what undoes it."""
    from engine import backend_cupy
    from engine.kernels import cuda
    from engine.kernels import kernel_names as N

    launch, splits_of, prefetch = cuda.attention_decode_deep, cuda.deep_decode_splits, backend_cupy.EXPERT_PREFETCH
    deep_from = cuda.DEEP_DECODE_KEYS
    tiles, fixed, deep = N.DEEP_TILES[128], None, launch
    if spec in N.DEEP_FORMS:
        deep = functools.partial(launch, form=spec)
    elif spec == "deep":
        cuda.DEEP_DECODE_KEYS = 0
    elif spec not in ("default", "expert-prefetch"):
        try:
            kt, stages, *rest = (int(v) for v in spec.split("x"))
        except ValueError:
            raise ValueError(f"no decode variant {spec!r}: KTxSTAGES[xSPLITS], default, deep, expert-prefetch or one of "
                             f"{sorted(N.DEEP_FORMS)}") from None
        tiles, fixed = (kt, stages), rest[0] if rest else None
        deep = functools.partial(launch, tiles=tiles)

    def splits_for(max_tokens, n_kv, hd, _tiles=None, kv="full"):  # as the backend and the launcher call it
        return fixed or splits_of(max_tokens, n_kv, hd, tiles, kv)

    cuda.attention_decode_deep, cuda.deep_decode_splits = deep, splits_for
    backend_cupy.EXPERT_PREFETCH = spec == "expert-prefetch"
    if backend is not None:
        backend.expert_prefetch = backend_cupy.EXPERT_PREFETCH

    def undo() -> None:
        cuda.attention_decode_deep, cuda.deep_decode_splits, cuda.DEEP_DECODE_KEYS = launch, splits_of, deep_from
        backend_cupy.EXPERT_PREFETCH = prefetch
        if backend is not None:
            backend.expert_prefetch = prefetch

    return undo
