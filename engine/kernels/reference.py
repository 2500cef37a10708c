"""NumPy reference of every backend op (see engine/backend.py for the exact contracts).

The CPU backend runs these directly on float32 weights; the GPU tests compare each CUDA kernel with them.
Everything is vectorized: float32 matrix products go to BLAS, nothing loops over tokens or elements in Python.
"""

from __future__ import annotations

import numpy as np

from engine.backend import ROPE_NEOX, ROPE_NORMAL, SamplingParams


def embed(table: np.ndarray, tokens: np.ndarray, out: np.ndarray, scale: float = 1.0) -> None:
    np.take(table, tokens, axis=0, out=out)
    if scale != 1.0:
        out *= np.float32(scale)


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float, out: np.ndarray) -> None:
    # Mean of squares in float32, as transformers computes it for float32 models.
    inv = 1.0 / np.sqrt(np.mean(np.square(x), axis=-1, keepdims=True) + np.float32(eps))
    np.multiply(x, inv, out=out)
    out *= weight


def add_rms_norm(x: np.ndarray, residual: np.ndarray, weight: np.ndarray, eps: float, out: np.ndarray) -> None:
    residual += x
    rms_norm(residual, weight, eps, out)


def linear(x: np.ndarray, weight: np.ndarray, out: np.ndarray, bias: np.ndarray | None = None) -> None:
    np.matmul(x, weight.T, out=out)
    if bias is not None:
        out += bias


def _gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.tanh(np.float32(0.7978845608028654) * (x + np.float32(0.044715) * x * x * x)))


def gated_ffn(
    x: np.ndarray,
    gate: np.ndarray,
    up: np.ndarray,
    out: np.ndarray,
    scratch: np.ndarray,
    activation: str = "silu",
) -> None:
    np.matmul(x, gate.T, out=out)
    np.matmul(x, up.T, out=scratch)
    activate(out, activation)
    out *= scratch


def activate(out: np.ndarray, activation: str) -> None:
    """out = act(out) in place: "silu" or "gelu_tanh" (the gated FFNs' activations)."""
    if activation == "silu":
        # silu(g) = g * sigmoid(g) = g / (1 + exp(-g)); exp overflow to inf gives the right limit 0.
        with np.errstate(over="ignore"):
            out /= 1.0 + np.exp(-out)
    elif activation == "gelu_tanh":
        out[...] = _gelu_tanh(out)
    else:
        raise ValueError(f"unknown activation {activation!r}")


def moe_route(router_logits: np.ndarray, top_k: int, normalize: bool, weights_out: np.ndarray, ids_out: np.ndarray) -> None:
    logits = router_logits.astype(np.float32, copy=False)
    probs = np.exp(logits - logits.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    # A stable sort of -p keeps lower ids first among equal probabilities.
    ids = np.argsort(-probs, axis=-1, kind="stable")[:, :top_k]
    picked = np.take_along_axis(probs, ids, axis=-1)
    if normalize:
        picked = picked / picked.sum(axis=-1, keepdims=True)
    weights_out[...] = picked
    ids_out[...] = ids


def moe_ffn(
    x: np.ndarray,
    gate_exps: np.ndarray,
    up_exps: np.ndarray,
    down_exps: np.ndarray,
    ids: np.ndarray,
    weights: np.ndarray,
    out: np.ndarray,
    scratch: np.ndarray,
    activation: str = "silu",
) -> None:
    """One pass per expert some token chose, over the tokens that chose it (a token picks an expert once).
    The gathered rows are temporaries here, so `scratch` (the GPU kernels' space) stays untouched."""
    out[...] = 0
    for expert in np.unique(ids):
        rows, slots = np.nonzero(ids == expert)
        xe = x[rows]
        hidden = xe @ gate_exps[expert].T
        activate(hidden, activation)
        hidden *= xe @ up_exps[expert].T
        out[rows] += (hidden @ down_exps[expert].T) * weights[rows, slots, None]


def moe_cache_ids(ids: np.ndarray, slot_of: np.ndarray, bus: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One token's picks ids (top_k,) split for a layer whose experts live in RAM, slot_of (n_experts,) the GPU
    cache's map (-1: not cached): (slots, bus_ids, host_ids), each (top_k,) with -1 where the pick goes elsewhere.
    Cached picks take their slot; of the misses, in pick order, the first round(misses * bus / top_k) (halves up)
    go over the bus and the rest to the host."""
    top_k = ids.size
    slots = slot_of[ids].astype(np.int32)
    missed = slots < 0
    share = (int(missed.sum()) * bus + top_k // 2) // top_k
    over_bus = missed & (np.cumsum(missed) <= share)
    return slots, np.where(over_bus, ids, -1).astype(np.int32), np.where(missed & ~over_bus, ids, -1).astype(np.int32)


def rope_tables(inv_freq: np.ndarray, max_positions: int, attn_factor: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin of p * inv_freq[i], each (max_positions, len(inv_freq)) float32, times attn_factor."""
    angles = np.outer(np.arange(max_positions, dtype=np.float64), inv_freq.astype(np.float64))
    return (np.cos(angles) * attn_factor).astype(np.float32), (np.sin(angles) * attn_factor).astype(np.float32)


def rotate(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, style: str) -> None:
    """Rotate x (n, heads, head_dim) in place; cos/sin are (n, rot_dim/2) for the tokens' positions."""
    half = cos.shape[-1]
    if style == ROPE_NORMAL:
        a, b = x[..., 0 : 2 * half : 2], x[..., 1 : 2 * half : 2]
    elif style == ROPE_NEOX:
        a, b = x[..., :half], x[..., half : 2 * half]
    else:
        raise ValueError(f"unknown rotary style {style!r}")
    c, s = cos[:, None, :], sin[:, None, :]
    a_old = a.copy()
    a *= c
    a -= b * s
    b *= c
    b += a_old * s


def rope_store_kv(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    cos: np.ndarray,
    sin: np.ndarray,
    style: str,
    k_cache: np.ndarray,
    v_cache: np.ndarray,
    start: int,
    k_scale: np.ndarray | None = None,
    v_scale: np.ndarray | None = None,
) -> None:
    """k_cache, v_cache: one layer's (n_kv_heads, max_tokens, head_dim), position p in row p mod max_tokens; a q8_0
    cache's int8 ones with their scales k_scale, v_scale (n_kv_heads, max_tokens, head_dim / 32) get k and v rounded
    by quantize_q8_0."""
    n = q.shape[0]
    c, s = cos[start : start + n], sin[start : start + n]
    rotate(q, c, s, style)
    rotate(k, c, s, style)
    at = np.arange(start, start + n) % k_cache.shape[1]
    for x, cache, scales in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        rows = x.transpose(1, 0, 2)
        if scales is None:
            cache[:, at, :] = rows
        else:
            cache[:, at, :], scales[:, at, :] = quantize_q8_0(rows)


def quantize_q8_0(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A q8_0 KV cache's rounding (GGUF's Q8_0, as gguf.quants quantizes it): per 32 values d = amax / 127,
    q = x / d rounded half away from zero, d kept as fp16. x: (..., k) float32, k a multiple of 32 -> q (..., k)
    int8 and d (..., k / 32) float16; the cache then holds q * d."""
    groups = x.reshape(-1, 32).astype(np.float32, copy=False)
    d = np.abs(groups).max(axis=1, keepdims=True) / np.float32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)
    scaled = groups * inv
    q = np.sign(scaled) * np.floor(np.abs(scaled) + np.float32(0.5))
    return q.astype(np.int8).reshape(x.shape), d.astype(np.float16).reshape(x.shape[:-1] + (x.shape[-1] // 32,))


def dequantize_q8_0(q: np.ndarray, d: np.ndarray) -> np.ndarray:
    """The float32 values a q8_0 cache holds: q (..., k) int8 times its group's scale d (..., k / 32)."""
    return (q.reshape(d.shape + (32,)).astype(np.float32) * d.astype(np.float32)[..., None]).reshape(q.shape)


def attention(
    q: np.ndarray,
    k_cache: np.ndarray,
    v_cache: np.ndarray,
    start: int,
    out: np.ndarray,
    scale: float,
    window: int = 0,
) -> None:
    """Causal grouped-query attention of q (n, heads, d) over one layer's cache (kv_heads, max_tokens, d)."""
    n, n_heads, d = q.shape
    n_kv = k_cache.shape[0]
    group = n_heads // n_kv
    length = start + n
    # Keys transposed into a contiguous copy: NumPy's stacked matmul on the transposed view ran 2x slower.
    keys_t = np.ascontiguousarray(k_cache[:, :length, :].transpose(0, 2, 1), dtype=np.float32)
    values = v_cache[:, :length, :].astype(np.float32, copy=False)
    # (n, kv, group, d) -> (kv, group * n, d): one matrix product per KV head covers all its query heads.
    qh = q.reshape(n, n_kv, group, d).transpose(1, 2, 0, 3).reshape(n_kv, group * n, d)
    scores = np.matmul(qh, keys_t)
    scores *= np.float32(scale)
    query_pos = start + np.arange(n)
    key_pos = np.arange(length)
    masked = key_pos[None, :] > query_pos[:, None]
    if window > 0:
        masked |= key_pos[None, :] <= query_pos[:, None] - window
    scores = scores.reshape(n_kv, group, n, length)
    scores += np.where(masked, np.float32(-np.inf), np.float32(0))  # broadcast over heads: no fancy indexing
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    mixed = np.matmul(scores.reshape(n_kv, group * n, length), values)
    out[...] = mixed.reshape(n_kv, group, n, d).transpose(2, 0, 1, 3).reshape(n, n_heads * d)


def sample(logits: np.ndarray, params: SamplingParams, recent_tokens: np.ndarray, uniform: float) -> int:
    """The token SamplingParams' documented steps pick (see engine/backend.py)."""
    scores = logits.astype(np.float32, copy=True)
    if params.repeat_penalty != 1.0 and len(recent_tokens):
        ids = np.unique(recent_tokens)
        picked = scores[ids]
        scores[ids] = np.where(picked > 0, picked / params.repeat_penalty, picked * params.repeat_penalty)
    if params.temperature <= 0:
        return int(np.argmax(scores))
    scores /= np.float32(params.temperature)
    if 0 < params.top_k < scores.size:
        # argpartition then a stable sort keeps the documented tie order (lower id first).
        candidates = np.argpartition(-scores, params.top_k - 1)[: params.top_k]
        threshold = scores[candidates].min()
        candidates = np.nonzero(scores >= threshold)[0]
    else:
        candidates = np.arange(scores.size)
    order = candidates[np.argsort(-scores[candidates], kind="stable")]
    if 0 < params.top_k < order.size:
        order = order[: params.top_k]
    probs = np.exp((scores[order] - scores[order[0]]).astype(np.float64))
    probs /= probs.sum()
    if params.top_p < 1.0:
        keep = int(np.searchsorted(np.cumsum(probs), params.top_p, side="left")) + 1
        probs = probs[: min(keep, probs.size)]
    if params.min_p > 0.0:
        probs = probs[probs >= params.min_p * probs[0]]
    cumulative = np.cumsum(probs)
    index = int(np.searchsorted(cumulative, uniform * cumulative[-1], side="right"))
    return int(order[min(index, probs.size - 1)])


def quantize_q8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The activation quantization in front of the GPU's int8 matrix-vector products, in two levels: per group
    of 32 values q = rint(x * (127 / amax)), d = amax / 127, then the remainder r = x - q d as
    q2 = rint(r * (254 / d)), so x ~= d (q + q2 / 254) within d / 508; s = d (254 sum(q) + sum(q2)) / 254.
    All in float32 as the kernel does. x: (..., k) float32, k a multiple of 32 -> q, q2 (..., k) int8 and
    d, s (..., k / 32) float32."""
    groups = x.reshape(-1, 32).astype(np.float32, copy=False)
    amax = np.abs(groups).max(axis=1)
    d = amax / np.float32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
        inv2 = np.where(amax > 0, np.float32(254) / d, np.float32(0)).astype(np.float32)
    q = np.rint(groups * inv[:, None])
    rest = groups - q * d[:, None]
    q2 = np.clip(np.rint(rest * inv2[:, None]), -127, 127)
    total = 254 * q.sum(axis=1, dtype=np.int32) + q2.sum(axis=1, dtype=np.int32)
    s = d * total.astype(np.float32) / np.float32(254)
    shape = x.shape[:-1] + (x.shape[-1] // 32,)
    return (q.astype(np.int8).reshape(x.shape), q2.astype(np.int8).reshape(x.shape), d.reshape(shape),
            s.reshape(shape))


def dequantize_q8(q: np.ndarray, q2: np.ndarray, d: np.ndarray) -> np.ndarray:
    """The activations quantize_q8's output stands for, in float64: d (q + q2 / 254) per group."""
    groups = q.reshape(-1, 32).astype(np.float64) + q2.reshape(-1, 32).astype(np.float64) / 254
    return (groups * d.reshape(-1, 1).astype(np.float64)).reshape(q.shape)


def linear_q8(x: np.ndarray, weight: np.ndarray, out: np.ndarray) -> None:
    """What the GPU's decode matrix-vector product computes: `linear` on x after quantize_q8 (weight float32)."""
    q, q2, d, _ = quantize_q8(x)
    np.matmul(dequantize_q8(q, q2, d).astype(np.float32), weight.T, out=out)


# ---- Gated DeltaNet (qwen35, qwen35moe, qwen3next) ----


def _silu(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return x / (1.0 + np.exp(-x))


def causal_conv_silu(x: np.ndarray, weight: np.ndarray, state: np.ndarray, out: np.ndarray) -> None:
    """out[t, c] = silu(sum_j weight[c, j] * w[t + j, c]) over the window w = [state; x]; then state = the last
    K - 1 rows of w. x, out: (n, channels); weight: (channels, K); state: (K - 1, channels), oldest row first."""
    n, k = x.shape[0], weight.shape[1]
    window = np.concatenate([state, x])
    acc = window[:n] * weight[:, 0]
    for j in range(1, k):
        acc += window[j : j + n] * weight[:, j]
    state[...] = window[n:]
    out[...] = _silu(acc)


def delta_rule_inputs(
    qkv: np.ndarray, ba: np.ndarray, dt_bias: np.ndarray, ssm_a: np.ndarray, n_k_heads: int, head_k_dim: int, tiled: bool
) -> tuple[np.ndarray, ...]:
    """q, k (n, v_heads, dk), v (n, v_heads, dv), beta and g (n, v_heads), all float32, from the convolved qkv
    (n, 2 n_k_heads dk + v_heads dv) and the gate logits ba (n, 2 v_heads: b, then a): q and k L2-normalised
    (eps 1e-6) and q scaled by dk^-1/2, beta = sigmoid(b), g = ssm_a * softplus(a + dt_bias) (ssm_a = -exp(A_log)).
    Value head h reads key head h % n_k_heads when `tiled` (qwen35 files), else h // (v_heads / n_k_heads)."""
    n = qkv.shape[0]
    v_heads = ba.shape[1] // 2
    key_dim = n_k_heads * head_k_dim
    q = qkv[:, :key_dim].reshape(n, n_k_heads, head_k_dim)
    k = qkv[:, key_dim : 2 * key_dim].reshape(n, n_k_heads, head_k_dim)
    v = qkv[:, 2 * key_dim :].reshape(n, v_heads, -1)
    q = q / np.sqrt(np.sum(q * q, axis=-1, keepdims=True) + np.float32(1e-6))
    k = k / np.sqrt(np.sum(k * k, axis=-1, keepdims=True) + np.float32(1e-6))
    q *= np.float32(head_k_dim**-0.5)
    heads = np.arange(v_heads) % n_k_heads if tiled else np.arange(v_heads) // (v_heads // n_k_heads)
    with np.errstate(over="ignore"):
        beta = 1.0 / (1.0 + np.exp(-ba[:, :v_heads]))
    g = ssm_a * np.logaddexp(np.float32(0), ba[:, v_heads:] + dt_bias)
    return q[:, heads], k[:, heads], v, beta.astype(np.float32), g.astype(np.float32)


def delta_rule_recurrent(q, k, v, beta, g, state: np.ndarray, out: np.ndarray) -> None:
    """The gated delta rule token by token (the decode form), per value head h with S = state[h] (dk, dv):
        S = exp(g_t) S;  S += k_t (beta_t (v_t - S^T k_t))^T;  o_t = S^T q_t.
    q, k: (n, H, dk); v: (n, H, dv); beta, g: (n, H); state: (H, dk, dv) float32, updated; out: (n, H, dv)."""
    for t in range(q.shape[0]):
        state *= np.exp(g[t])[:, None, None]
        delta = (v[t] - np.einsum("hkv,hk->hv", state, k[t])) * beta[t][:, None]
        state += k[t][:, :, None] * delta[:, None, :]
        out[t] = np.einsum("hkv,hk->hv", state, q[t])


def delta_rule_chunked(q, k, v, beta, g, state: np.ndarray, out: np.ndarray, chunk: int = 64) -> None:
    """The same result as delta_rule_recurrent, in chunks of `chunk` tokens (the prompt form): within a chunk,
    with gamma the cumulative sum of g and decay[i, j] = exp(gamma_i - gamma_j) for j <= i, the updates of all
    tokens come from one triangular solve, (I + strictly_lower(beta K K^T * decay)) [U W] = [beta V, beta K exp(gamma)];
    then per chunk, in order:
        V' = U - W S;  O = (Q exp(gamma)) S + (Q K^T * decay) V';  S = exp(gamma_last) S + (K exp(gamma_last - gamma))^T V'.
    Padding tokens (k = 0, g = 0) leave the state as it is."""
    n, heads, dk = k.shape
    dv = v.shape[2]
    pad = -n % chunk
    # (n, H, d) -> (H, chunks, chunk, d)
    def blocks(x):
        x = np.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1)).swapaxes(0, 1)
        return x.reshape(heads, -1, chunk, *x.shape[2:])

    q, k, v, beta, g = (blocks(x.astype(np.float32, copy=False)) for x in (q, k, v, beta, g))
    gamma = np.cumsum(g, axis=-1)
    lower = np.tril(np.ones((chunk, chunk), dtype=bool))
    # Only the lower triangle is exponentiated: above it gamma_i - gamma_j > 0 could overflow.
    decay = np.exp(np.where(lower, gamma[..., :, None] - gamma[..., None, :], -np.inf)).astype(np.float32)
    k_beta = k * beta[..., None]
    system = np.matmul(k_beta, k.swapaxes(-1, -2)) * decay
    system = np.tril(system, -1) + np.eye(chunk, dtype=np.float32)
    solved = np.linalg.solve(system, np.concatenate([v * beta[..., None], k_beta * np.exp(gamma)[..., None]], axis=-1))
    u, w = solved[..., :dv], solved[..., dv:]
    q_decayed = q * np.exp(gamma)[..., None]
    last = gamma[..., -1:]
    k_decayed = k * np.exp(last - gamma)[..., None]
    scores = np.matmul(q, k.swapaxes(-1, -2)) * decay
    result = np.empty((heads, q.shape[1], chunk, dv), np.float32)
    for c in range(q.shape[1]):
        v_new = u[:, c] - np.matmul(w[:, c], state)
        result[:, c] = np.matmul(q_decayed[:, c], state) + np.matmul(scores[:, c], v_new)
        state *= np.exp(last[:, c])[:, :, None]
        state += np.matmul(k_decayed[:, c].swapaxes(-1, -2), v_new)
    out[...] = result.reshape(heads, -1, dv)[:, :n].swapaxes(0, 1)


def gated_delta_net(
    qkv: np.ndarray, ba: np.ndarray, dt_bias: np.ndarray, ssm_a: np.ndarray, state: np.ndarray, out: np.ndarray,
    n_k_heads: int, tiled: bool,
) -> None:
    """See Backend.gated_delta_net: one token runs the recurrent form, more the chunked one."""
    q, k, v, beta, g = delta_rule_inputs(qkv, ba, dt_bias, ssm_a, n_k_heads, state.shape[1], tiled)
    heads_out = out.reshape(qkv.shape[0], state.shape[0], state.shape[2])
    if qkv.shape[0] == 1:
        delta_rule_recurrent(q, k, v, beta, g, state, heads_out)
    else:
        delta_rule_chunked(q, k, v, beta, g, state, heads_out)


def gated_rms_norm(x: np.ndarray, gate: np.ndarray, weight: np.ndarray, eps: float, out: np.ndarray) -> None:
    """out = rms_norm(x) * weight * silu(gate) over the last axis; x, gate, out: (..., d); out may be x."""
    rms_norm(x, weight, eps, out)
    out *= _silu(gate)


def delta_mixer(
    qkv: np.ndarray, z: np.ndarray, ba: np.ndarray, conv: np.ndarray, conv_state: np.ndarray, dt_bias: np.ndarray,
    ssm_a: np.ndarray, norm: np.ndarray, eps: float, state: np.ndarray, mixed: np.ndarray, out: np.ndarray,
    n_k_heads: int, tiled: bool,
) -> None:
    """See Backend.delta_mixer: the convolution, the delta rule and the gated norm in turn."""
    n, (heads, _, dv) = qkv.shape[0], state.shape
    causal_conv_silu(qkv, conv, conv_state, mixed)
    gated_delta_net(mixed, ba, dt_bias, ssm_a, state, out, n_k_heads, tiled)
    normed = out.reshape(n, heads, dv)
    gated_rms_norm(normed, z.reshape(n, heads, dv), norm, eps, normed)


def sigmoid_gate(x: np.ndarray, gate: np.ndarray, out: np.ndarray, accumulate: bool = False) -> None:
    """out = x * sigmoid(gate), or out += that when `accumulate`; gate (n, m) or (n, 1) broadcast over x (n, m)."""
    with np.errstate(over="ignore"):
        gated = x / (1.0 + np.exp(-gate))
    if accumulate:
        out += gated
    else:
        out[...] = gated
