"""A weight as the CPU backend holds it, and the products on it.

Float tensors and vectors are float32 arrays. The types the kernels read are packed planes (about the file's
size); any other quantized type keeps its GGUF bytes. One-token products run the kernels on the planes;
prompt chunks, and types without a kernel, dequantize a few rows at a time into a bounded float32 tile and
hand it to BLAS, which a chunk of many tokens keeps busy enough to hide the dequantization.
"""

from __future__ import annotations

from dataclasses import dataclass

import threading

import numpy as np
from gguf import GGMLQuantizationType as T

from engine import quants
from engine.cpu import layout, products

# float32 values of the dequantized tile a prompt product works through (16 MB).
TILE_ELEMENTS = 1 << 22

_FLOAT_TYPES = frozenset({T.F32, T.F16, T.BF16})
# Per thread: the prompt tile and the last one-token activation.
_local = threading.local()


@dataclass
class CpuWeight:
    name: str
    shape: tuple[int, ...]
    qtype: T
    dense: np.ndarray | None = None  # float32 `shape`
    planes: layout.Planes | None = None  # matrices of PACKED_TYPES, as (rows, k)
    blocks: np.ndarray | None = None  # GGUF bytes as (rows, bytes a row), for the other quantized types

    @property
    def nbytes(self) -> int:
        held = self.dense if self.dense is not None else self.planes if self.planes is not None else self.blocks
        return int(held.nbytes)

    def __post_init__(self) -> None:
        self.k = self.shape[-1]
        self.rows = int(np.prod(self.shape[:-1], dtype=np.int64))  # as (rows, k); read on every product


def held_nbytes(qtype: T, shape: tuple[int, ...]) -> int:
    """Bytes `load` keeps for a tensor of this type and shape (the same rules, without the data)."""
    qtype = T(qtype)
    if qtype in _FLOAT_TYPES or len(shape) == 1:
        return 4 * int(np.prod(shape, dtype=np.int64))
    if qtype in layout.PACKED_TYPES:
        return layout.packed_nbytes(qtype, int(np.prod(shape[:-1], dtype=np.int64)), int(shape[-1]))
    return quants.quantized_nbytes(qtype, shape)


def load(name: str, raw: np.ndarray, qtype: T, shape: tuple[int, ...]) -> CpuWeight:
    """Raises quants.UnsupportedTensorType / quants.TensorSizeError like quants.dequantize."""
    qtype = T(qtype)
    if qtype in _FLOAT_TYPES or len(shape) == 1:
        dense = np.ascontiguousarray(quants.dequantize(raw, qtype, shape), dtype=np.float32)
        return CpuWeight(name, tuple(shape), qtype, dense=dense)
    expected = quants.quantized_nbytes(qtype, shape)  # checks the type and the shape
    data = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    if data.size != expected:
        raise quants.TensorSizeError(
            f"a {qtype.name} tensor of shape {tuple(shape)} takes {expected} bytes, but {data.size} were given"
        )
    rows, k = int(np.prod(shape[:-1], dtype=np.int64)), int(shape[-1])
    if qtype in layout.PACKED_TYPES:
        return CpuWeight(name, tuple(shape), qtype, planes=layout.pack(data, qtype, rows, k))
    return CpuWeight(name, tuple(shape), qtype, blocks=data.reshape(rows, -1))


def rows_f32(w: CpuWeight, rows: np.ndarray | slice, out: np.ndarray) -> None:
    """out (n, k) = the float32 values of the selected rows (of the matrix seen as (rows, k))."""
    if w.dense is not None:
        out[...] = w.dense.reshape(-1, w.k)[rows]
    elif w.planes is not None:
        layout.unpack(w.planes, rows, out)
    else:
        selected = w.blocks[rows]
        out[...] = quants.dequantize(selected, w.qtype, (selected.shape[0], w.k))


def activation_for(x: np.ndarray, *weights: CpuWeight) -> products.Activation | None:
    """The kernel layout of a one-token x, made once for several products on it (None when none needs it)."""
    if x.shape[0] == 1 and any(w.planes is not None for w in weights):
        return _activation(x[0])
    return None


def _activation(x: np.ndarray) -> products.Activation:
    """The last activation made on this thread when x has the same values (q, k and v read the same x)."""
    last = getattr(_local, "activation", None)
    # Only a view of the buffer the last one came from is compared value by value (q, k and v read the same rows);
    # any other x is made anew, which is never wrong and skips a comparison that nearly always fails.
    owner = x if x.base is None else x.base
    if last is None or _local.owner is not owner or not np.array_equal(last.source, x):
        last = _local.activation = products.activation(x)
        _local.owner = owner
    return last


def product(w: CpuWeight, x: np.ndarray, out: np.ndarray, start: int = 0, stop: int | None = None,
            act: products.Activation | None = None) -> None:
    """out (n, stop - start) = x (n, k) @ rows [start, stop) of w, transposed. `act`: x[0]'s kernel layout,
    when the caller has it (it is made here otherwise)."""
    stop = w.rows if stop is None else stop
    if w.dense is not None:
        np.matmul(x, w.dense.reshape(-1, w.k)[start:stop].T, out=out)
    elif w.planes is not None and x.shape[0] == 1:
        planes = w.planes if start == 0 and stop == w.rows else w.planes.slice_rows(start, stop)
        products.matvec(planes, act or _activation(x[0]), out[0])
    else:
        tile = max(1, TILE_ELEMENTS // w.k)
        scratch = _scratch(min(tile, stop - start) * w.k)
        for a in range(start, stop, tile):
            b = min(a + tile, stop)
            values = scratch[: (b - a) * w.k].reshape(b - a, w.k)
            rows_f32(w, slice(a, b), values)
            if b - a == out.shape[1] and out.flags.c_contiguous:
                np.matmul(x, values.T, out=out)
            else:  # NumPy's matmul leaves BLAS for a strided out: a contiguous result, then a copy
                out[:, a - start : b - start] = x @ values.T


def _scratch(elements: int) -> np.ndarray:
    """This thread's tile, grown to the largest size asked (at most TILE_ELEMENTS)."""
    tile = getattr(_local, "tile", None)
    if tile is None or tile.size < elements:
        tile = _local.tile = np.empty(elements, np.float32)
    return tile
