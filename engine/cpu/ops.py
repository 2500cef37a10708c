"""The CPU backend's per-token ops besides the products, compiled by numba: at one token a step is hundreds of
small ops, and NumPy's few microseconds of dispatch per array operation added up to more than the products'
memory reads (engine/kernels/reference.py, which these follow, does the same work vectorized over tokens)."""

from __future__ import annotations

import math

import numpy as np
from numba import njit, types
from numba.extending import overload

_JIT = dict(nogil=True, fastmath=True, cache=True, error_model="numpy", boundscheck=False)
_F = np.float32


@njit(**_JIT)
def rms_norm(x, weight, eps, out):
    """out = x / sqrt(mean(x^2) + eps) * weight, row by row; x, out (n, d)."""
    n, d = x.shape
    for i in range(n):
        s = _F(0)
        for j in range(d):
            s += x[i, j] * x[i, j]
        inv = _F(1) / math.sqrt(s / _F(d) + _F(eps))
        for j in range(d):
            out[i, j] = x[i, j] * inv * weight[j]


@njit(**_JIT)
def add_rms_norm(x, residual, weight, eps, out):
    n, d = x.shape
    for i in range(n):
        for j in range(d):
            residual[i, j] += x[i, j]
    rms_norm(residual, weight, eps, out)


@njit(**_JIT)
def _rotate(x, cos, sin, neox):
    """x (d,) in place by one position's cos/sin (half,): pairs (i, i + half) for NeoX, (2 i, 2 i + 1) otherwise."""
    half = cos.shape[0]
    for i in range(half):
        a_at, b_at = (i, i + half) if neox else (2 * i, 2 * i + 1)
        a, b = x[a_at], x[b_at]
        x[a_at] = a * cos[i] - b * sin[i]
        x[b_at] = b * cos[i] + a * sin[i]


# Scales of a q8_0 KV cache are float16, which numba's CPU target cannot hold: the kernels take their bits (a uint16
# view) and convert them here, as NumPy does.
@njit(**_JIT)
def half_to_float(h):
    """A float16's bits (uint16) as float32."""
    h = np.uint32(h)
    sign, exponent, mantissa = (h & 0x8000) << 16, (h >> 10) & 0x1F, h & 0x3FF
    subnormal = _F(mantissa) * _F(2.0**-24)  # exponent 0: zero or a subnormal, exact
    normal = np.uint32(sign | ((exponent + np.uint32(112 if exponent < 31 else 224)) << 23) | (mantissa << 13))
    return normal.view(np.float32) if exponent else (-subnormal if sign else subnormal)


@njit(**{**_JIT, "fastmath": False})
def float_to_half(x):
    """The bits (uint16) of the float16 nearest float32 x, ties to even, beyond its range infinity (NumPy's astype)."""
    bits = np.float32(x).view(np.uint32)
    sign = np.uint16((bits >> 16) & 0x8000)
    exponent, mantissa = (bits >> 23) & 0xFF, bits & 0x7FFFFF
    if exponent == 255:
        return sign | np.uint16(0x7C00 | (0x200 if mantissa else 0))
    if exponent >= 113:  # a normal float16 or more: keep 10 of the 23 mantissa bits (a carry may raise the exponent)
        shift, value = 13, ((exponent - 112) << 10) | (mantissa >> 13)
        dropped = mantissa & 0x1FFF
    else:  # a subnormal float16: the value in units of 2^-24
        if exponent < 101:  # below 2^-25: rounds to zero
            return sign
        full = mantissa | 0x800000
        shift = 126 - exponent
        value, dropped = full >> shift, full & ((np.uint32(1) << shift) - 1)
    half = np.uint32(1) << (shift - 1)
    if dropped > half or (dropped == half and value & 1):
        value += 1
    return sign | np.uint16(min(value, 0x7C00))


@njit(**{**_JIT, "fastmath": False})
def _store(x, cache, scales, head, at):
    """x (d,) into the cache's row (head, at): as it is, or into a q8_0 cache (scales: the uint16 bits of its
    float16 scales) rounded as reference.quantize_q8_0 rounds it, without fastmath so the bits match."""
    if scales is None:
        cache[head, at] = x
        return
    for b in range(scales.shape[2]):
        amax = _F(0)
        for i in range(32 * b, 32 * b + 32):
            amax = max(amax, abs(x[i]))
        d = amax / _F(127)
        inv = _F(1) / d if d != 0 else _F(0)
        for i in range(32 * b, 32 * b + 32):
            s = x[i] * inv
            cache[head, at, i] = np.int8(math.copysign(math.floor(abs(s) + _F(0.5)), s))
        scales[head, at, b] = float_to_half(d)


@njit(**_JIT)
def _select(condition, a, b):
    """a if condition else b; written inline in _row's loop, numba's inlining warned of a variable out of scope."""
    return a if condition else b


def _row(cache, scales, head, at, buf):
    """The cache's row (head, at) as float32: the row itself, or a q8_0 row (scales: the uint16 bits of its float16
    ones) dequantized into buf."""


# Chosen by the scales' type when compiled: numba types both sides of an `is None` test on an array, whose returns (an
# int8 row, a float32 one) would not unify.
@overload(_row, jit_options=_JIT, inline="always")
def _row_for(cache, scales, head, at, buf):
    if isinstance(scales, (types.NoneType, types.Omitted)):
        return lambda cache, scales, head, at, buf: cache[head, at]

    def dequantized(cache, scales, head, at, buf):
        d = buf.size
        values = cache[head, at]
        bits = scales[head, at]
        # 64 values (two scales) at a time through 1-D slices, the loop LLVM vectorizes: one over 32 values, or over
        # the 3-D array, ran scalar and 6-20x slower.
        for c in range(0, d, 64):
            low = half_to_float(bits[c >> 5])
            high = half_to_float(bits[min(c + 32, d - 32) >> 5])
            part = values[c : c + 64]
            out = buf[c : c + 64]
            for i in range(out.size):
                out[i] = _F(part[i]) * _select(i < 32, low, high)
        return buf

    return dequantized


@njit(**_JIT)
def rope_attention_one(q, k, v, cos, sin, neox, k_cache, v_cache, position, out, scale, window, k_scale=None,
                       v_scale=None):
    """One token at `position`: rotate q (1, heads, d) and k (1, kv_heads, d), store k and v in the layer's
    cache (kv_heads, max_tokens, d), then causal attention over positions up to it (the last `window` when
    window > 0); out (1, heads * d). A q8_0 cache passes its int8 rows and the uint16 bits of its scales
    (kv_heads, max_tokens, d / 32): the token is stored rounded, then attended as the cache holds it. Each key and
    value row is read once for the group of query heads that share it, and the inner loops run over contiguous rows
    (the group's queries copied out first), so they vectorize. Position j lives in row j mod max_tokens (a ring:
    engine/backend.py rope_attention)."""
    heads, d = q.shape[1], q.shape[2]
    kv_heads = k.shape[1]
    group = heads // kv_heads
    rows = k_cache.shape[1]
    for h in range(heads):
        _rotate(q[0, h], cos[position], sin[position], neox)
    for h in range(kv_heads):
        _rotate(k[0, h], cos[position], sin[position], neox)
        _store(k[0, h], k_cache, k_scale, h, position % rows)
        _store(v[0, h], v_cache, v_scale, h, position % rows)
    first = max(0, position - window + 1) if window > 0 else 0
    n = position + 1 - first
    scores = np.empty((group, n), _F)
    queries = np.empty((group, d), _F)
    mixed = np.empty((group, d), _F)
    row = np.empty(d, _F)
    for g in range(kv_heads):
        for hh in range(group):
            for i in range(d):
                queries[hh, i] = q[0, g * group + hh, i] * _F(scale)
        for j in range(n):
            key = _row(k_cache, k_scale, g, (first + j) % rows, row)
            for hh in range(group):
                s = _F(0)
                for i in range(d):
                    s += queries[hh, i] * key[i]
                scores[hh, j] = s
        for hh in range(group):
            top = scores[hh].max()
            total = _F(0)
            for j in range(n):
                scores[hh, j] = math.exp(scores[hh, j] - top)
                total += scores[hh, j]
            for j in range(n):
                scores[hh, j] /= total
        mixed[:] = 0
        for j in range(n):
            value = _row(v_cache, v_scale, g, (first + j) % rows, row)
            for hh in range(group):
                p = scores[hh, j]
                for i in range(d):
                    mixed[hh, i] += p * value[i]
        for hh in range(group):
            h = g * group + hh
            for i in range(d):
                out[0, h * d + i] = mixed[hh, i]


def is_gelu(activation: str) -> bool:
    """glu's `gelu` flag for an activation's name, "silu" or "gelu_tanh"."""
    if activation not in ("silu", "gelu_tanh"):
        raise ValueError(f"unknown activation {activation!r}")
    return activation == "gelu_tanh"


def apply_glu(gate: np.ndarray, up: np.ndarray, activation: str) -> None:
    """gate = act(gate) * up in place (contiguous arrays), act "silu" or "gelu_tanh"."""
    glu(gate, up, is_gelu(activation))


@njit(**{**_JIT, "fastmath": {"contract"}})
def glu(gate, up, gelu):
    """gate = act(gate) * up in place over (n, f) rows: silu, or gelu_tanh when `gelu` (reference.activate's
    formulas). Without fastmath's approximate division the vector loop and its scalar remainder give the same bits, so
    a slice gives what the whole array does (engine/cpu/dot.py computes it a thread's rows at a time)."""
    flat_g, flat_u = gate.reshape(-1), up.reshape(-1)
    for i in range(flat_g.size):
        g = flat_g[i]
        # Written so nothing overflows: fastmath assumes no infinities (exp(100) would give NaN, not 0).
        if gelu:
            t = min(max(_F(0.7978845608028654) * (g + _F(0.044715) * g * g * g), _F(-20.0)), _F(20.0))
            a = _F(0.5) * g * (_F(1.0) + math.tanh(t))
        else:
            e = math.exp(-abs(g))
            a = g / (_F(1.0) + e) if g >= 0 else g * e / (_F(1.0) + e)
        flat_g[i] = a * flat_u[i]

