"""The CPU backend's per-token ops besides the products, compiled by numba: at one token a step is hundreds of
small ops, and NumPy's few microseconds of dispatch per array operation added up to more than the products'
memory reads (engine/kernels/reference.py, which these follow, does the same work vectorized over tokens)."""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange, types
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
def _attend_part(queries, k_cache, v_cache, k_scale, v_scale, g, lo, hi, acc, stats):
    """KV head g's query group (queries: (group, d), scaled) over cache positions lo .. hi - 1 (row p mod
    max_tokens): the unnormalized softmax-weighted values acc (group, d), and stats (group, 2), each row's largest
    score and sum of exp(score - it). Each key and value row is read once for the group, the inner loops run over
    contiguous rows, so they vectorize."""
    group, d = queries.shape
    rows = k_cache.shape[1]
    scores = np.empty((group, max(hi - lo, 1)), _F)
    row = np.empty(d, _F)
    for j in range(lo, hi):
        key = _row(k_cache, k_scale, g, j % rows, row)
        for hh in range(group):
            s = _F(0)
            for i in range(d):
                s += queries[hh, i] * key[i]
            scores[hh, j - lo] = s
    acc[:] = 0
    for hh in range(group):
        top = scores[hh, : hi - lo].max() if hi > lo else _F(-np.inf)
        total = _F(0)
        for j in range(hi - lo):
            scores[hh, j] = math.exp(scores[hh, j] - top)
            total += scores[hh, j]
        stats[hh, 0], stats[hh, 1] = top, total
    for j in range(lo, hi):
        value = _row(v_cache, v_scale, g, j % rows, row)
        for hh in range(group):
            p = scores[hh, j - lo]
            for i in range(d):
                acc[hh, i] += p * value[i]


@njit(parallel=True, **_JIT)
def _attend_parts(queries, k_cache, v_cache, k_scale, v_scale, first, n, acc, stats):
    """_attend_part for every (KV head, split) of acc (kv_heads, splits, group, d), the splits dividing positions
    first .. first + n - 1, on numba's threads."""
    splits = acc.shape[1]
    per = (n + splits - 1) // splits
    for item in prange(acc.shape[0] * splits):
        g, s = item // splits, item % splits
        lo = first + min(n, s * per)
        _attend_part(queries[g], k_cache, v_cache, k_scale, v_scale, g, lo, first + min(n, (s + 1) * per),
                     acc[g, s], stats[g, s])


@njit(**_JIT)
def rope_store_one(q, k, v, cos, sin, neox, k_cache, v_cache, position, k_scale=None, v_scale=None):
    """One token at `position`: rotate q (1, heads, d) and k (1, kv_heads, d) and store k and v in the layer's cache
    (kv_heads, max_tokens, d), position p in row p mod max_tokens (a ring: engine/backend.py rope_attention). A q8_0
    cache passes its int8 rows and the uint16 bits of its scales (kv_heads, max_tokens, d / 32): stored rounded."""
    rows = k_cache.shape[1]
    for h in range(q.shape[1]):
        _rotate(q[0, h], cos[position], sin[position], neox)
    for h in range(k.shape[1]):
        _rotate(k[0, h], cos[position], sin[position], neox)
        _store(k[0, h], k_cache, k_scale, h, position % rows)
        _store(v[0, h], v_cache, v_scale, h, position % rows)


@njit(**_JIT)
def attend_one(q, k_cache, v_cache, position, out, scale, window, k_scale=None, v_scale=None, splits=1):
    """The token at `position` (q rotated, its key and value stored: rope_store_one) attends to the positions up to
    it (the last `window` when window > 0) as the cache holds them; out (1, heads * d). With splits > 1 each KV
    head's positions are divided among numba's threads (the caller sets how many), the parts merged by their
    maxima."""
    heads, d = q.shape[1], q.shape[2]
    kv_heads = k_cache.shape[0]
    group = heads // kv_heads
    first = max(0, position - window + 1) if window > 0 else 0
    n = position + 1 - first
    queries = np.empty((kv_heads, group, d), _F)
    for h in range(heads):
        for i in range(d):
            queries[h // group, h % group, i] = q[0, h, i] * _F(scale)
    acc = np.empty((kv_heads, splits, group, d), _F)
    stats = np.empty((kv_heads, splits, group, 2), _F)
    if splits > 1:
        _attend_parts(queries, k_cache, v_cache, k_scale, v_scale, first, n, acc, stats)
    else:
        for g in range(kv_heads):
            _attend_part(queries[g], k_cache, v_cache, k_scale, v_scale, g, first, first + n, acc[g, 0], stats[g, 0])
    weights = np.empty(splits, _F)
    for h in range(heads):
        g, hh = h // group, h % group
        top = stats[g, :, hh, 0].max()
        for s in range(splits):  # an empty part (sum 0, max -inf) weighs nothing
            weights[s] = math.exp(stats[g, s, hh, 0] - top) if stats[g, s, hh, 1] > 0 else _F(0)
        total = _F(0)
        for s in range(splits):
            total += stats[g, s, hh, 1] * weights[s]
        for i in range(d):
            mixed = _F(0)
            for s in range(splits):
                mixed += acc[g, s, hh, i] * weights[s]
            out[0, h * d + i] = mixed / total


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

