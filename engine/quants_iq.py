"""Block layouts and NumPy dequantizers of the GGML i-quants (IQ1 to IQ4), with their lookup tables.

The i-quants store indices into fixed grids of 4 or 8 values instead of the values themselves. The grids are
facts of the format; the `gguf` package publishes them as data (each grid as hexadecimal text of 2- or 3-bit
level indices plus the list of levels), and this module decodes that data at import time into plain tables
that kernels can upload as they are: row i of IQ2XXS_GRID is llama.cpp's iq2xxs_grid[i] as 8 bytes.
"""

from collections.abc import Callable

import gguf.quants
import numpy as np
from gguf import GGMLQuantizationType as T

from engine.quant_fields import bits_little, f16_field, interleaved_nibbles, split_bits

QK_K = 256


def _decode_grid(published: type) -> np.ndarray:
    """One grid from gguf's packed form: hex text whose bytes hold level indices, lowest bits first."""
    levels = np.array(published.grid_map)
    index_bits = (len(levels) - 1).bit_length()
    per_byte = 8 // index_bits
    packed = np.frombuffer(bytes.fromhex(published.grid_hex.decode("ascii")), dtype=np.uint8)
    indices = split_bits(packed, 8 // per_byte) & np.uint8((1 << index_bits) - 1)
    dtype = np.int8 if levels.min() < 0 else np.uint8
    return levels.astype(dtype)[indices.T.reshape(published.grid_shape)]


IQ2XXS_GRID = _decode_grid(gguf.quants.IQ2_XXS)  # (256, 8) of 8, 25, 43
IQ2XS_GRID = _decode_grid(gguf.quants.IQ2_XS)  # (512, 8)
IQ2S_GRID = _decode_grid(gguf.quants.IQ2_S)  # (1024, 8)
IQ3XXS_GRID = _decode_grid(gguf.quants.IQ3_XXS)  # (256, 4) of 4, 12, ..., 62
IQ3S_GRID = _decode_grid(gguf.quants.IQ3_S)  # (512, 4) of 1, 3, ..., 15
IQ1S_GRID = _decode_grid(gguf.quants.IQ1_S)  # (2048, 8) of -1, 0, 1
IQ4NL_VALUES = np.array(gguf.quants.IQ4_NL.kvalues, dtype=np.int8)  # (16,) non-linear 4-bit levels

# 7 stored sign bits per 8 values; the 8th makes the count of minus signs even (llama.cpp's ksigns_iq2xs).
_seven = np.arange(128, dtype=np.uint8)
KSIGNS = _seven | ((np.unpackbits(_seven[:, None], axis=1).sum(axis=1, dtype=np.uint8) & np.uint8(1)) << np.uint8(7))

# As float32 +1/-1 per value: from a 7-bit sign index and from a plain byte of 8 sign bits.
_SIGNS_OF_INDEX = np.where(bits_little(KSIGNS[:, None]), np.float32(-1), np.float32(1))
_SIGNS_OF_BYTE = np.where(bits_little(np.arange(256, dtype=np.uint8)[:, None]), np.float32(-1), np.float32(1))

_GRIDS_F32 = {
    name: grid.astype(np.float32)
    for name, grid in (
        ("iq2xxs", IQ2XXS_GRID),
        ("iq2xs", IQ2XS_GRID),
        ("iq2s", IQ2S_GRID),
        ("iq3xxs", IQ3XXS_GRID),
        ("iq1s", IQ1S_GRID),
    )
}
_IQ4NL_F32 = IQ4NL_VALUES.astype(np.float32)
_IQ1_DELTA = np.float32(0.125)

IQ_LAYOUTS: dict[T, tuple[int, int]] = {
    T.IQ4_NL: (32, 2 + 16),  # d, 32 nibbles indexing IQ4NL_VALUES
    T.IQ4_XS: (QK_K, 2 + 2 + 4 + 128),  # d, top 2 bits of 8 scales, low 4 bits of 8 scales, nibbles
    T.IQ3_XXS: (QK_K, 2 + 64 + 32),  # d, grid indices, per 32 values: 4 sign indices and a scale
    T.IQ3_S: (QK_K, 2 + 64 + 8 + 32 + 4),  # d, grid indices, their 9th bits, sign bits, scales
    T.IQ2_XXS: (QK_K, 2 + 64),  # d, per 32 values: 4 grid indices, 4 sign indices and a scale
    T.IQ2_XS: (QK_K, 2 + 64 + 8),  # d, 9-bit grid index + 7-bit sign index per 8 values, scales
    T.IQ2_S: (QK_K, 2 + 32 + 32 + 8 + 8),  # d, grid indices, sign bits, their top 2 bits, scales
    T.IQ1_S: (QK_K, 2 + 32 + 16),  # d, grid indices, per 32 values: their top 3 bits, scale, delta sign
    T.IQ1_M: (QK_K, 32 + 16 + 8),  # grid indices, their top 3 bits and delta signs, scales holding d
}


def _iq4_nl(blocks: np.ndarray) -> np.ndarray:
    q = split_bits(blocks[:, 2:], 4).reshape(blocks.shape[0], 32)
    return f16_field(blocks, 0) * _IQ4NL_F32[q]


def iq4_xs_fields(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """IQ4_XS's indices into IQ4NL_VALUES (n, 8, 32), each 32 values' 6-bit scale minus 32 (n, 8) int8 and d (n, 1)
    float32: value = (d * scale) * IQ4NL_VALUES[index]."""
    n = blocks.shape[0]
    high = (blocks[:, 2:4].view("<u2") >> np.arange(0, 16, 2, dtype=np.uint16)) & np.uint16(3)
    scales = (interleaved_nibbles(blocks[:, 4:8]) | (high.astype(np.uint8) << np.uint8(4))).astype(np.int8)
    return split_bits(blocks[:, 8:].reshape(n, 8, 16), 4).reshape(n, 8, 32), scales - np.int8(32), f16_field(blocks, 0)


def _iq4_xs(blocks: np.ndarray) -> np.ndarray:
    q, scales, d = iq4_xs_fields(blocks)
    dl = (d * scales.astype(np.float32)).reshape(-1, 8, 1)
    return (dl * _IQ4NL_F32[q]).reshape(-1, QK_K)


def _sign_indices(words: np.ndarray) -> np.ndarray:
    """The four 7-bit sign indices in the low 28 bits of each 32-bit word: (...) -> (..., 4)."""
    return (words[..., None] >> np.arange(0, 28, 7, dtype=np.uint32)) & np.uint32(0x7F)


def _iq2_xxs(blocks: np.ndarray) -> np.ndarray:
    n = blocks.shape[0]
    # per 32 values: 4 grid-index bytes, then a word of 4 sign indices and a 4-bit scale on top
    groups = blocks[:, 2:].reshape(n, 8, 8)
    words = groups[:, :, 4:].view("<u4")[..., 0]
    db = f16_field(blocks, 0) * (np.float32(0.5) + (words >> np.uint32(28)).astype(np.float32)) * np.float32(0.25)
    grid = _GRIDS_F32["iq2xxs"][groups[:, :, :4]]
    signs = _SIGNS_OF_INDEX[_sign_indices(words)]
    return (db.reshape(n, 8, 1, 1) * grid * signs).reshape(n, QK_K)


def _iq2_scales(blocks: np.ndarray, offset: int) -> np.ndarray:
    """IQ2_XS/IQ2_S: 16 four-bit scales, one per 16 values, as (n, 16, 1, 1) multipliers of d."""
    scales = interleaved_nibbles(blocks[:, offset:offset + 8]).astype(np.float32)
    db = f16_field(blocks, 0) * (np.float32(0.5) + scales) * np.float32(0.25)
    return db.reshape(blocks.shape[0], 16, 1, 1)


def _iq2_xs(blocks: np.ndarray) -> np.ndarray:
    n = blocks.shape[0]
    words = blocks[:, 2:66].view("<u2")
    grid = _GRIDS_F32["iq2xs"][words & np.uint16(0x1FF)].reshape(n, 16, 2, 8)
    signs = _SIGNS_OF_INDEX[words >> np.uint16(9)].reshape(n, 16, 2, 8)
    return (_iq2_scales(blocks, 66) * grid * signs).reshape(n, QK_K)


def _iq2_s(blocks: np.ndarray) -> np.ndarray:
    n = blocks.shape[0]
    # each byte of bytes 66-73 holds the top 2 bits of 4 consecutive grid indices
    high = split_bits(blocks[:, 66:74], 2).swapaxes(1, 2).reshape(n, 32)
    index = blocks[:, 2:34].astype(np.uint16) | (high.astype(np.uint16) << np.uint16(8))
    grid = _GRIDS_F32["iq2s"][index].reshape(n, 16, 2, 8)
    signs = _SIGNS_OF_BYTE[blocks[:, 34:66]].reshape(n, 16, 2, 8)
    return (_iq2_scales(blocks, 74) * grid * signs).reshape(n, QK_K)


def _iq3_xxs(blocks: np.ndarray) -> np.ndarray:
    n = blocks.shape[0]
    words = blocks[:, 66:98].view("<u4")
    db = f16_field(blocks, 0) * (np.float32(0.5) + (words >> np.uint32(28)).astype(np.float32)) * np.float32(0.5)
    grid = _GRIDS_F32["iq3xxs"][blocks[:, 2:66]].reshape(n, 8, 4, 8)
    signs = _SIGNS_OF_INDEX[_sign_indices(words)]
    return (db.reshape(n, 8, 1, 1) * grid * signs).reshape(n, QK_K)


def iq3_s_fields(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """IQ3_S's signed levels (n, 8, 32) int8 in [-15, 15] (grid values under their sign bits), each 32 values' odd
    scale 1 + 2 s (n, 8) int8 and d (n, 1) float32: value = (d * scale) * level."""
    n = blocks.shape[0]
    index = blocks[:, 2:66].astype(np.uint16) | (bits_little(blocks[:, 66:74]).astype(np.uint16) << np.uint16(8))
    grid = IQ3S_GRID[index].reshape(n, 8, 32).astype(np.int8)
    levels = np.where(bits_little(blocks[:, 74:106]).reshape(n, 8, 32).astype(bool), -grid, grid)
    odd = (np.uint8(1) + np.uint8(2) * interleaved_nibbles(blocks[:, 106:110])).astype(np.int8)
    return levels, odd, f16_field(blocks, 0)


def _iq3_s(blocks: np.ndarray) -> np.ndarray:
    levels, odd, d = iq3_s_fields(blocks)
    db = (d * odd.astype(np.float32)).reshape(-1, 8, 1)
    return (db * levels.astype(np.float32)).reshape(-1, QK_K)


def _iq1_values(dl: np.ndarray, index: np.ndarray, minus_delta: np.ndarray) -> np.ndarray:
    """dl * (grid + delta) for groups of 8 values; the shapes of dl and minus_delta broadcast per group."""
    delta = np.where(minus_delta, -_IQ1_DELTA, _IQ1_DELTA)[..., None]
    return dl[..., None] * (_GRIDS_F32["iq1s"][index] + delta)


def _iq1_s(blocks: np.ndarray) -> np.ndarray:
    n = blocks.shape[0]
    # per 32 values, a 16-bit word: 4 x 3 top index bits, a 3-bit scale, the delta's sign on top
    words = blocks[:, 34:50].view("<u2")
    top = (words[..., None] >> np.arange(0, 12, 3, dtype=np.uint16)) & np.uint16(7)
    index = blocks[:, 2:34].reshape(n, 8, 4).astype(np.uint16) | (top << np.uint16(8))
    odd = np.uint16(2) * ((words >> np.uint16(12)) & np.uint16(7)) + np.uint16(1)
    dl = (f16_field(blocks, 0) * odd.astype(np.float32))[..., None]
    minus_delta = (words & np.uint16(0x8000)).astype(bool)[..., None]
    return _iq1_values(dl, index, minus_delta).reshape(n, QK_K)


def _iq1_m(blocks: np.ndarray) -> np.ndarray:
    n = blocks.shape[0]
    words = blocks[:, 48:56].view("<u2")
    # the fp16 d is spread over the top nibbles of the 4 scale words, lowest nibble first
    d_bits = (words >> np.uint16(12)) << np.arange(0, 16, 4, dtype=np.uint16)
    d = np.bitwise_or.reduce(d_bits, axis=1).view("<f2").astype(np.float32)
    scales = ((words[..., None] >> np.arange(0, 12, 3, dtype=np.uint16)) & np.uint16(7)).reshape(n, 16)
    dl = d[:, None] * (np.uint16(2) * scales + np.uint16(1)).astype(np.float32)
    # per 8 values, a nibble: the grid index's top 3 bits and, on top, the delta's sign
    nibbles = interleaved_nibbles(blocks[:, 32:48])
    index = blocks[:, :32].astype(np.uint16) | ((nibbles & np.uint8(7)).astype(np.uint16) << np.uint16(8))
    minus_delta = (nibbles & np.uint8(8)).astype(bool)
    values = _iq1_values(dl.reshape(n, 16, 1), index.reshape(n, 16, 2), minus_delta.reshape(n, 16, 2))
    return values.reshape(n, QK_K)


IQ_DEQUANTIZERS: dict[T, Callable[[np.ndarray], np.ndarray]] = {
    T.IQ4_NL: _iq4_nl,
    T.IQ4_XS: _iq4_xs,
    T.IQ3_XXS: _iq3_xxs,
    T.IQ3_S: _iq3_s,
    T.IQ2_XXS: _iq2_xxs,
    T.IQ2_XS: _iq2_xs,
    T.IQ2_S: _iq2_s,
    T.IQ1_S: _iq1_s,
    T.IQ1_M: _iq1_m,
}
