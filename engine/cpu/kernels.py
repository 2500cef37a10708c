"""Matrix-vector products on the planes of engine/cpu/layout.py, compiled by numba: one kernel per family.

Each kernel computes out[r] = row r . x for rows [r0, r1), GIL released, so engine/cpu/products.py can run
row ranges on several threads. Inner loops walk the groups of one plane byte index j (contiguous), which
LLVM vectorizes into 8- or 16-lane float FMAs; two rules keep it that way:
- every bit field is cast back to uint8 before it becomes a float (numba widens integer arithmetic to int64,
  and int64 -> float32 has no vector conversion on AVX2);
- the sums stay in float32 over one row's groups (`s`), then one reduction applies the group scales.
The activation is float32, not int8: numba emits no int8 dot-product instructions, and a float FMA on the
widened quants is as fast as the int32 multiplies it would take, with no activation rounding.
"""

from __future__ import annotations

import numpy as np
from numba import njit

_JIT = dict(nogil=True, fastmath=True, cache=True, error_model="numpy", boundscheck=False)
_F = np.float32
_U8 = np.uint8


@njit(inline="always", **_JIT)
def _nibbles(s, q, x0, x1):
    for b in range(s.shape[0]):
        v = q[b]
        s[b] += _F(_U8(v & _U8(15))) * x0[b] + _F(_U8(v >> _U8(4))) * x1[b]


@njit(inline="always", **_JIT)
def _nibbles_high_bit(s, q, h0, h1, shift, x0, x1):
    for b in range(s.shape[0]):
        v = q[b]
        a = _U8(_U8(v & _U8(15)) | _U8(_U8(_U8(h0[b] >> shift) & _U8(1)) << _U8(4)))
        c = _U8(_U8(v >> _U8(4)) | _U8(_U8(_U8(h1[b] >> shift) & _U8(1)) << _U8(4)))
        s[b] += _F(a) * x0[b] + _F(c) * x1[b]


@njit(inline="always", **_JIT)
def _nibbles_two_bits(s0, s1, q, h0, h1, shift, x0, x1):
    for b in range(s0.shape[0]):
        v = q[b]
        a = _U8(_U8(v & _U8(15)) | _U8(_U8(_U8(h0[b] >> shift) & _U8(3)) << _U8(4)))
        c = _U8(_U8(v >> _U8(4)) | _U8(_U8(_U8(h1[b] >> shift) & _U8(3)) << _U8(4)))
        s0[b] += _F(a) * x0[b]
        s1[b] += _F(c) * x1[b]


@njit(inline="always", **_JIT)
def _int8(s, q, x):
    for b in range(s.shape[0]):
        s[b] += _F(q[b]) * x[b]


@njit(**_JIT)
def nibble_rows(lo, hi, d, m, xt, xs, out, r0, r1):
    """value = d * (nibble | high bit << 4) + m; xt: x as (32, groups), xs: x's sum per group."""
    groups = xt.shape[1]
    s = np.empty(groups, _F)
    five = hi.shape[1] > 0
    for r in range(r0, r1):
        s[:] = 0
        for j in range(16):
            if five:
                _nibbles_high_bit(s, lo[r, j], hi[r, j >> 3], hi[r, 2 + (j >> 3)], _U8(j & 7), xt[j], xt[j + 16])
            else:
                _nibbles(s, lo[r, j], xt[j], xt[j + 16])
        acc = _F(0)
        for b in range(groups):
            acc += d[r, b] * s[b] + m[r, b] * xs[b]
        out[r - r0] = acc


@njit(**_JIT)
def q8_rows(q, d, xt, out, r0, r1):
    """value = d * q, q int8 (32, groups) a row."""
    groups = xt.shape[1]
    s = np.empty(groups, _F)
    for r in range(r0, r1):
        s[:] = 0
        for j in range(32):
            _int8(s, q[r, j], xt[j])
        acc = _F(0)
        for b in range(groups):
            acc += d[r, b] * s[b]
        out[r - r0] = acc


@njit(**_JIT)
def q6k_rows(lo, hi, d, xt, xh, out, r0, r1):
    """value = d[half] * ((nibble | 2 high bits << 4) - 32); xh: x's sum per half group, (2, groups)."""
    groups = xt.shape[1]
    s0 = np.empty(groups, _F)
    s1 = np.empty(groups, _F)
    for r in range(r0, r1):
        s0[:] = 0
        s1[:] = 0
        for j in range(16):
            shift = _U8(2 * (j & 3))
            _nibbles_two_bits(s0, s1, lo[r, j], hi[r, j >> 2], hi[r, 4 + (j >> 2)], shift, xt[j], xt[j + 16])
        acc = _F(0)
        for b in range(groups):
            acc += d[r, 0, b] * (s0[b] - _F(32) * xh[0, b]) + d[r, 1, b] * (s1[b] - _F(32) * xh[1, b])
        out[r - r0] = acc


@njit(**_JIT)
def activation_layout(x):
    """x (k,) -> (x as (32, groups), each group's sum, each half group's sum as (2, groups))."""
    groups = x.shape[0] // 32
    xt = np.empty((32, groups), _F)
    sums = np.empty(groups, _F)
    halves = np.empty((2, groups), _F)
    for b in range(groups):
        a = _F(0)
        c = _F(0)
        for j in range(16):
            xt[j, b] = x[b * 32 + j]
            xt[j + 16, b] = x[b * 32 + 16 + j]
            a += x[b * 32 + j]
            c += x[b * 32 + 16 + j]
        halves[0, b] = a
        halves[1, b] = c
        sums[b] = a + c
    return xt, sums, halves


# Unpacking writes values for BLAS and for embeddings: exact float32 steps in ggml's order (no fastmath, so no
# fused multiply-add), which keeps the values bit-identical to gguf's dequantizers.
_EXACT = dict(_JIT, fastmath=False)


@njit(**_EXACT)
def nibble_unpack(lo, hi, d, m, rows, out):
    groups = lo.shape[2]
    five = hi.shape[1] > 0
    for i in range(rows.shape[0]):
        r = rows[i]
        for b in range(groups):
            for j in range(16):
                v = lo[r, j, b]
                a = _U8(v & _U8(15))
                c = _U8(v >> _U8(4))
                if five:
                    shift = _U8(j & 7)
                    a = _U8(a | _U8(_U8(_U8(hi[r, j >> 3, b] >> shift) & _U8(1)) << _U8(4)))
                    c = _U8(c | _U8(_U8(_U8(hi[r, 2 + (j >> 3), b] >> shift) & _U8(1)) << _U8(4)))
                out[i, b * 32 + j] = _F(a) * d[r, b] + m[r, b]
                out[i, b * 32 + 16 + j] = _F(c) * d[r, b] + m[r, b]


@njit(**_EXACT)
def q8_unpack(q, d, rows, out):
    groups = q.shape[2]
    for i in range(rows.shape[0]):
        r = rows[i]
        for b in range(groups):
            for j in range(32):
                out[i, b * 32 + j] = _F(q[r, j, b]) * d[r, b]


@njit(**_EXACT)
def q6k_unpack(lo, hi, d, rows, out):
    groups = lo.shape[2]
    for i in range(rows.shape[0]):
        r = rows[i]
        for b in range(groups):
            for j in range(16):
                v = lo[r, j, b]
                shift = _U8(2 * (j & 3))
                a = _U8(_U8(v & _U8(15)) | _U8(_U8(_U8(hi[r, j >> 2, b] >> shift) & _U8(3)) << _U8(4)))
                c = _U8(_U8(v >> _U8(4)) | _U8(_U8(_U8(hi[r, 4 + (j >> 2), b] >> shift) & _U8(3)) << _U8(4)))
                out[i, b * 32 + j] = d[r, 0, b] * _F(np.int32(a) - np.int32(32))
                out[i, b * 32 + 16 + j] = d[r, 1, b] * _F(np.int32(c) - np.int32(32))
