"""The NumPy backend's ops on quantized weights against engine/kernels/reference.py on the same weights
dequantized by gguf: one token (the kernels) and several (dequantized tiles), experts sliced out of stacks."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

from engine.backend_numpy import NumpyBackend
from engine.cpu import ops
from engine.gguf_file import GGUFTensor
from engine.kernels import reference


def _upload(backend, name, qtype, shape, rng):
    raw = quantize(rng.standard_normal(shape).astype(np.float32), qtype)
    values = dequantize(raw, qtype).reshape(shape)
    return backend.upload(GGUFTensor(name, qtype, shape, raw.reshape(-1))), values


def _close(got, want, x_abs_sum):
    # float32 sums of up to a few hundred terms (values below 4), and for one token the activations rounded to
    # int16 (1/65534 of a group's largest value): far inside this, far outside any wrong row
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * x_abs_sum)


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q8_0, T.Q5_1], ids=lambda t: t.name)
def test_moe_ffn_and_gated_ffn_on_quantized_weights(qtype, n):
    rng = np.random.default_rng(8)
    backend = NumpyBackend()
    experts, k, f, top_k = 4, 64, 96, 2
    (gate, g), (up, u), (down, d) = (_upload(backend, name, qtype, shape, rng) for name, shape in
                                     (("g", (experts, f, k)), ("u", (experts, f, k)), ("d", (experts, k, f))))
    assert gate.planes is not None and gate.nbytes < g.nbytes / 2  # kept quantized, not as float32
    x = rng.standard_normal((n, k)).astype(np.float32)
    ids = np.array([[2, 0], [3, 2], [1, 0]][:n], np.int32)
    mix = rng.random((n, top_k)).astype(np.float32)
    out, want = np.full((n, k), np.nan, np.float32), np.empty((n, k), np.float32)
    backend.moe_ffn(x, gate, up, down, ids, mix, out, np.empty((n, top_k, 2 * f), np.float32))
    reference.moe_ffn(x, g, u, d, ids, mix, want, None)
    _close(out, want, 200 * np.abs(x).sum())

    (gate2, g2), (up2, u2) = _upload(backend, "g2", qtype, (f, k), rng), _upload(backend, "u2", qtype, (f, k), rng)
    out, want = np.empty((n, f), np.float32), np.empty((n, f), np.float32)
    backend.gated_ffn(x, gate2, up2, out, np.empty((n, f), np.float32), "gelu_tanh")
    reference.gated_ffn(x, g2, u2, want, np.empty((n, f), np.float32), "gelu_tanh")
    _close(out, want, 200 * np.abs(x).sum())


def test_embed_dequantizes_the_rows_it_gathers():
    rng = np.random.default_rng(9)
    backend = NumpyBackend()
    table, values = _upload(backend, "token_embd", T.Q8_0, (50, 64), rng)
    tokens = np.array([3, 49, 3, 0], np.int32)
    out = np.empty((4, 64), np.float32)
    backend.embed(table, tokens, out, scale=2.0)
    np.testing.assert_array_equal(out, values[tokens] * np.float32(2.0))


# (position, window, heads, KV heads, head size, NeoX rotation): GQA groups 1-4, a sliding window inside the range,
# the first position (the token alone), SmolLM2's head size 64 and Qwen's 128.
@pytest.mark.parametrize("position,window,heads,kv,hd,neox",
                         [(0, 0, 4, 4, 64, False), (300, 0, 9, 3, 64, True), (300, 40, 8, 2, 128, False),
                          (77, 0, 4, 1, 128, True)])
def test_one_token_attention_matches_the_reference(position, window, heads, kv, hd, neox):
    """A decode step's attention (rotary embedding, cache write, attention over the cache) against the reference's
    rope_store_kv then attention on copies of the same inputs."""
    rng = np.random.default_rng()
    max_tokens = 512
    q, k, v = (rng.standard_normal((1, n, hd)).astype(np.float32) for n in (heads, kv, kv))
    kc, vc = (rng.standard_normal((kv, max_tokens, hd)).astype(np.float32) for _ in range(2))
    cos, sin = reference.rope_tables((1.0 / 10000 ** (np.arange(0, hd, 2) / hd)).astype(np.float32), max_tokens)
    scale = 1 / np.sqrt(hd)
    want_q, want_k, want_kc, want_vc = q.copy(), k.copy(), kc.copy(), vc.copy()
    reference.rope_store_kv(want_q, want_k, v, cos, sin, "neox" if neox else "normal", want_kc, want_vc, position)
    want = np.empty((1, heads * hd), np.float32)
    reference.attention(want_q, want_kc, want_vc, position, want, scale, window)
    got = np.full((1, heads * hd), np.nan, np.float32)
    ops.rope_store_one(q, k, v, cos, sin, neox, kc, vc, position)
    ops.attend_one(q, kc, vc, position, got, scale, window)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6)
    for splits in (2, 3):  # positions divided among threads, the parts merged (some parts empty at position 0)
        split = np.full((1, heads * hd), np.nan, np.float32)
        ops.attend_one(q, kc, vc, position, split, scale, window, None, None, splits)
        np.testing.assert_allclose(split, want, rtol=0, atol=2e-6)
    # The value lands as it came; the key rotated (numba may fuse the rotation's multiply-adds: float32 rounding).
    assert np.array_equal(vc, want_vc)
    np.testing.assert_allclose(kc, want_kc, rtol=0, atol=1e-6)
