"""Rows of the packed blocks (engine/cpu/layout.py) back to float32, compiled by numba: for BLAS on prompt chunks
and for embeddings.

The values are exact float32 steps in ggml's order (no fastmath, so no fused multiply-add), which keeps them
bit-identical to gguf's dequantizers.
"""

from __future__ import annotations

import numpy as np
from numba import njit

_EXACT = dict(nogil=True, fastmath=False, cache=True, error_model="numpy", boundscheck=False)
_F = np.float32
_U8 = np.uint8


@njit(**_EXACT)
def _nibble_row(lo, hi, r, five, scale, offset, out):
    """Row r's values into out (k,): value = (nibble | fifth bit << 4) * scale[b] + offset[b] in group b."""
    for b in range(scale.shape[0]):
        for j in range(16):
            v = lo[r, 16 * b + j]
            a = _U8(v & _U8(15))
            c = _U8(v >> _U8(4))
            if five:
                a |= _U8(_U8(_U8(hi[r, 4 * b + (j >> 3)] >> _U8(j & 7)) & _U8(1)) << _U8(4))
                c |= _U8(_U8(_U8(hi[r, 4 * b + 2 + (j >> 3)] >> _U8(j & 7)) & _U8(1)) << _U8(4))
            out[b * 32 + j] = _F(a) * scale[b] + offset[b]
            out[b * 32 + 16 + j] = _F(c) * scale[b] + offset[b]


@njit(**_EXACT)
def nibble_rows(lo, hi, d, m, rows, out):
    five = hi.shape[1] > 0
    for i in range(rows.shape[0]):
        _nibble_row(lo, hi, rows[i], five, d[rows[i]], m[rows[i]], out[i])


@njit(**_EXACT)
def nibble_k_rows(lo, hi, d, sup, rows, out):
    """nibble_rows with gguf's Q4_K / Q5_K scale = d * sc and offset = -(dmin * mn), each one float32 product. A
    row's scales and offsets go first into vectors: read from there, the values' loop vectorizes (4x faster here)."""
    groups = d.shape[1] // 2
    five = hi.shape[1] > 0
    scale = np.empty(groups, _F)
    offset = np.empty(groups, _F)
    for i in range(rows.shape[0]):
        r = rows[i]
        for b in range(groups):
            scale[b] = sup[r, b >> 3, 0] * _F(d[r, 2 * b])
            offset[b] = -(sup[r, b >> 3, 1] * _F(d[r, 2 * b + 1]))
        _nibble_row(lo, hi, r, five, scale, offset, out[i])


@njit(**_EXACT)
def q2k_rows(lo, d, sup, rows, out):
    """gguf's Q2_K steps: scale = d * sc and offset = dmin * mn, each one float32 product, then scale * q - offset."""
    groups = d.shape[1] // 2
    for i in range(rows.shape[0]):
        r = rows[i]
        for b in range(groups):
            for half in range(2):
                byte = d[r, 2 * b + half]
                scale = sup[r, b >> 3, 0] * _F(byte & _U8(15))
                offset = sup[r, b >> 3, 1] * _F(byte >> _U8(4))
                for j in range(16):  # byte j holds value j in its low nibble, value j + 16 in its high one
                    v = lo[r, 16 * b + j]
                    q = v & _U8(15) if half == 0 else v >> _U8(4)
                    out[i, b * 32 + 16 * half + j] = scale * _F(q) - offset


@njit(**_EXACT)
def iq4_rows(lo, d, sup, values, rows, out):
    """gguf's IQ4_XS steps: scale = d * (sc - 32), one float32 product, times the level the nibble picks."""
    groups = d.shape[1]
    for i in range(rows.shape[0]):
        r = rows[i]
        for b in range(groups):
            scale = sup[r, b >> 3] * _F(d[r, b])
            for j in range(16):
                v = lo[r, 16 * b + j]
                out[i, b * 32 + j] = scale * _F(values[v & _U8(15)])
                out[i, b * 32 + 16 + j] = scale * _F(values[v >> _U8(4)])


@njit(**_EXACT)
def q8_rows(q, d, rows, out):
    groups = d.shape[1]
    for i in range(rows.shape[0]):
        r = rows[i]
        for b in range(groups):
            for j in range(32):
                out[i, b * 32 + j] = _F(q[r, 32 * b + j]) * d[r, b]


@njit(**_EXACT)
def q6k_rows(lo, hi, d, sup, rows, out):
    """gguf's Q6_K steps: scale = d * sc, one float32 product, times q - 32."""
    groups = d.shape[1] // 2
    for i in range(rows.shape[0]):
        r = rows[i]
        for b in range(groups):
            first = sup[r, b >> 3] * _F(d[r, 2 * b])
            second = sup[r, b >> 3] * _F(d[r, 2 * b + 1])
            for j in range(16):
                v = lo[r, 16 * b + j]
                t = j & 7
                a = _U8(_U8(v & _U8(15)) | _U8(_U8(_U8(hi[r, 8 * b + t] >> _U8(2 * (j >> 3))) & _U8(3)) << _U8(4)))
                c = _U8(_U8(v >> _U8(4)) | _U8(_U8(_U8(hi[r, 8 * b + t] >> _U8(4 + 2 * (j >> 3))) & _U8(3)) << _U8(4)))
                out[i, b * 32 + j] = first * _F(np.int32(a) - np.int32(32))
                out[i, b * 32 + 16 + j] = second * _F(np.int32(c) - np.int32(32))


@njit(**_EXACT)
def q3k_rows(lo, hi, d, sup, rows, out):
    """gguf's Q3_K steps: scale = d * sc, one float32 product, times q (stored plus 4: its two low bits at bits
    2 s..2 s + 1 of byte t for value t + 8 s, its third bit at bit i of the group's 4 hi bytes for value i)."""
    groups = d.shape[1] // 2
    for i in range(rows.shape[0]):
        r = rows[i]
        for b in range(groups):
            for j in range(32):
                low = _U8(_U8(lo[r, 8 * b + (j & 7)] >> _U8(2 * (j >> 3))) & _U8(3))
                third = _U8(_U8(hi[r, 4 * b + (j >> 3)] >> _U8(j & 7)) & _U8(1))
                scale = sup[r, b >> 3] * _F(d[r, 2 * b + (j >> 4)])
                out[i, b * 32 + j] = scale * _F(np.int32(_U8(low | _U8(third << _U8(2)))) - np.int32(4))
