"""The CPU backend's per-token ops besides the products, compiled by numba: at one token a step is hundreds of
small ops, and NumPy's few microseconds of dispatch per array operation added up to more than the products'
memory reads (engine/kernels/reference.py, which these follow, does the same work vectorized over tokens)."""

from __future__ import annotations

import math

import numpy as np
from numba import njit

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


@njit(**_JIT)
def rope_attention_one(q, k, v, cos, sin, neox, k_cache, v_cache, position, out, scale, window):
    """One token at `position`: rotate q (1, heads, d) and k (1, kv_heads, d), store k and v in the layer's
    cache (kv_heads, max_tokens, d), then causal attention over positions up to it (the last `window` when
    window > 0); out (1, heads * d). Each key and value row is read once for the group of query heads that share
    it, and the inner loops run over contiguous rows (the group's queries copied out first), so they vectorize."""
    heads, d = q.shape[1], q.shape[2]
    kv_heads = k.shape[1]
    group = heads // kv_heads
    for h in range(heads):
        _rotate(q[0, h], cos[position], sin[position], neox)
    for h in range(kv_heads):
        _rotate(k[0, h], cos[position], sin[position], neox)
        k_cache[h, position] = k[0, h]
        v_cache[h, position] = v[0, h]
    first = max(0, position - window + 1) if window > 0 else 0
    n = position + 1 - first
    scores = np.empty((group, n), _F)
    queries = np.empty((group, d), _F)
    mixed = np.empty((group, d), _F)
    for g in range(kv_heads):
        keys, values = k_cache[g], v_cache[g]
        for hh in range(group):
            for i in range(d):
                queries[hh, i] = q[0, g * group + hh, i] * _F(scale)
        for j in range(n):
            for hh in range(group):
                s = _F(0)
                for i in range(d):
                    s += queries[hh, i] * keys[first + j, i]
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
            for hh in range(group):
                p = scores[hh, j]
                for i in range(d):
                    mixed[hh, i] += p * values[first + j, i]
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

