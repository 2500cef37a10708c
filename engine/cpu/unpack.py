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
def _nibble_group(lo, hi, r, b, scale, offset, row_out):
    """Group b of row r: value = q * scale + offset, the fifth bits from hi when it has any."""
    for j in range(16):
        v = lo[r, 16 * b + j]
        a = _U8(v & _U8(15))
        c = _U8(v >> _U8(4))
        if hi.shape[1] > 0:
            a |= _U8(_U8(_U8(hi[r, 4 * b + (j >> 3)] >> _U8(j & 7)) & _U8(1)) << _U8(4))
            c |= _U8(_U8(_U8(hi[r, 4 * b + 2 + (j >> 3)] >> _U8(j & 7)) & _U8(1)) << _U8(4))
        row_out[b * 32 + j] = _F(a) * scale + offset
        row_out[b * 32 + 16 + j] = _F(c) * scale + offset


@njit(**_EXACT)
def nibble_rows(lo, hi, d, m, rows, out):
    for i in range(rows.shape[0]):
        r = rows[i]
        for b in range(d.shape[1]):
            _nibble_group(lo, hi, r, b, d[r, b], m[r, b], out[i])


@njit(**_EXACT)
def nibble_k_rows(lo, hi, d, sup, rows, out):
    """gguf's Q4_K / Q5_K steps: scale = d * sc and offset = -(dmin * mn), each one float32 product."""
    for i in range(rows.shape[0]):
        r = rows[i]
        for b in range(d.shape[1] // 2):
            s = b >> 3
            scale = sup[r, s, 0] * _F(d[r, 2 * b])
            offset = -(sup[r, s, 1] * _F(d[r, 2 * b + 1]))
            _nibble_group(lo, hi, r, b, scale, offset, out[i])


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
