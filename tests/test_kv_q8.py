"""The q8_0 KV cache (issue 19 item 5): its rounding against gguf's Q8_0, the CPU backend's attention on it against
the reference on the values it holds, and the embedded SmolLM2 model's answers and logits with it."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

from engine.backend import KVCache
from engine.backend_numpy import NumpyBackend
from engine.cpu import ops
from engine.errors import EngineError
from engine.kernels import reference


def test_quantize_q8_0_is_ggufs_q8_0():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((5, 3, 128)).astype(np.float32) * np.float32(10.0) ** rng.integers(-6, 4, (5, 3, 1))
    x[1, 2, 32:64] = 0  # an all-zero group: scale 0, values 0
    x[2, 0, :32] = np.float32(3e-7)  # a scale below float16's normal range
    q, d = reference.quantize_q8_0(x)
    assert q.dtype == np.int8 and d.dtype == np.float16 and d.shape == (5, 3, 4)
    blocks = quantize(x.reshape(-1, 128), T.Q8_0).reshape(-1, 34)  # per block: fp16 scale, then 32 int8
    np.testing.assert_array_equal(d.reshape(-1), blocks[:, :2].copy().view(np.float16).reshape(-1))
    np.testing.assert_array_equal(q.reshape(-1), blocks[:, 2:].copy().view(np.int8).reshape(-1))
    want = dequantize(blocks.reshape(15, -1), T.Q8_0).reshape(x.shape)
    np.testing.assert_array_equal(reference.dequantize_q8_0(q, d), want)
    assert not reference.dequantize_q8_0(q, d)[1, 2, 32:64].any()


def test_float16_conversions_match_numpy():
    bits = np.arange(65536, dtype=np.uint16)
    halves = bits.view(np.float16).astype(np.float32)
    got = np.array([ops.half_to_float(b) for b in bits], np.float32)
    finite = ~np.isnan(halves)
    np.testing.assert_array_equal(got[finite].view(np.uint32), halves[finite].view(np.uint32))
    assert np.isnan(got[~finite]).all()
    # Every float16, the points halfway between neighbours (ties go to even), random values across the whole range.
    rng = np.random.default_rng(2)
    ordered = np.sort(halves[finite & (halves >= 0)])
    x = np.concatenate([ordered, (ordered[:-1] + ordered[1:]) / 2, [65519.99, 65520.0, 1e30],
                        rng.standard_normal(20000) * 10.0 ** rng.uniform(-9, 5.5, 20000)]).astype(np.float32)
    x = np.concatenate([x, -x])
    got = np.array([int(ops.float_to_half(v)) for v in x], np.uint16)
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(got, x.astype(np.float16).view(np.uint16))


def test_kv_cache_of_q8_0_and_unknown_kinds():
    backend = NumpyBackend()
    cache = backend.kv_cache(3, 2, 64, 10, "q8_0")
    assert cache.kind == "q8_0" and cache.k.dtype == np.int8 and cache.k_scale.dtype == np.float16
    assert cache.k_scale.shape == (3, 2, 10, 2)
    assert cache.nbytes == 2 * 3 * 2 * 10 * 64 * 34 // 32
    assert backend.kv_cache(3, 2, 64, 10).nbytes == 2 * 3 * 2 * 10 * 64 * 4
    with pytest.raises(EngineError, match="one of 'full', 'q8_0', not 'q4_0'"):
        backend.kv_cache(3, 2, 64, 10, "q4_0")


def _q8_cache(rng, layers, kv, max_tokens, hd) -> KVCache:
    """A q8_0 cache filled with random rounded values (positions past those in use hold garbage too)."""
    k, ks = reference.quantize_q8_0(rng.standard_normal((layers, kv, max_tokens, hd)).astype(np.float32))
    v, vs = reference.quantize_q8_0(rng.standard_normal((layers, kv, max_tokens, hd)).astype(np.float32))
    return KVCache(k, v, ks, vs)


def _held(cache: KVCache, layer: int) -> tuple[np.ndarray, np.ndarray]:
    return (reference.dequantize_q8_0(cache.k[layer], cache.k_scale[layer]),
            reference.dequantize_q8_0(cache.v[layer], cache.v_scale[layer]))


# (tokens, start position, window, heads, KV heads, head size): prompt chunks (GQA, a sliding window, a chunk at
# position 0) and one-token decode steps, head sizes 64 and 128.
@pytest.mark.parametrize("n,start,window,heads,kv,hd", [
    (7, 0, 0, 4, 4, 64), (9, 40, 0, 8, 2, 128), (12, 100, 16, 6, 3, 64),
    (1, 0, 0, 4, 2, 64), (1, 300, 0, 9, 3, 64), (1, 200, 48, 8, 2, 128), (1, 77, 0, 4, 1, 128),
])
def test_rope_attention_on_a_q8_0_cache_matches_the_reference(n, start, window, heads, kv, hd):
    """The backend stores the rotated key and the value rounded as quantize_q8_0 rounds them and attends over what
    the cache then holds: the reference's attention on the dequantized cache."""
    rng = np.random.default_rng(n * 1000 + start)
    layer, max_tokens = 1, 320
    cache = _q8_cache(rng, 2, kv, max_tokens, hd)
    before = _held(cache, layer)
    q, k, v = (rng.standard_normal((n, m, hd)).astype(np.float32) for m in (heads, kv, kv))
    cos, sin = reference.rope_tables((1.0 / 10000 ** (np.arange(0, hd, 2) / hd)).astype(np.float32), max_tokens)
    rope = NumpyBackend().rope_table((1.0 / 10000 ** (np.arange(0, hd, 2) / hd)).astype(np.float32), max_tokens)
    want_q, want_k = q.copy(), k.copy()
    reference.rotate(want_q, cos[start : start + n], sin[start : start + n], "neox")
    reference.rotate(want_k, cos[start : start + n], sin[start : start + n], "neox")
    scale = 1 / np.sqrt(hd)
    out = np.full((n, heads * hd), np.nan, np.float32)
    NumpyBackend().rope_attention(q, k, v, rope, "neox", cache, layer, np.array([start], np.int32), out, scale, window)

    # The backend's rotation (numba may fuse its multiply-adds) and the rows it stored: exactly quantize_q8_0's.
    np.testing.assert_allclose(q, want_q, rtol=0, atol=1e-5)
    np.testing.assert_allclose(k, want_k, rtol=0, atol=1e-5)
    rows = slice(start, start + n)
    for got, scales, x in ((cache.k[layer], cache.k_scale[layer], k), (cache.v[layer], cache.v_scale[layer], v)):
        want_q8, want_d = reference.quantize_q8_0(x.transpose(1, 0, 2))
        np.testing.assert_array_equal(got[:, rows], want_q8)
        np.testing.assert_array_equal(scales[:, rows], want_d)
    held_k, held_v = _held(cache, layer)
    for held, old in ((held_k, before[0]), (held_v, before[1])):  # nothing else written
        np.testing.assert_array_equal(np.delete(held, np.arange(start, start + n), axis=1),
                                      np.delete(old, np.arange(start, start + n), axis=1))

    want = np.empty((n, heads * hd), np.float32)
    reference.attention(q, held_k, held_v, start, want, scale, window)
    np.testing.assert_allclose(out, want, rtol=0, atol=3e-6)
    # and the rounding matters: the same attention over the unrounded keys and values differs
    exact_k, exact_v = held_k.copy(), held_v.copy()
    exact_k[:, rows], exact_v[:, rows] = k.transpose(1, 0, 2), v.transpose(1, 0, 2)
    unrounded = np.empty_like(want)
    reference.attention(q, exact_k, exact_v, start, unrounded, scale, window)
    assert np.abs(unrounded - want).max() > 1e-4


# q8_0 moves SmolLM2's logits by 0.75-2% of their range at the last prompt position (this prompt, test_engine_logits'
# other two, a chat asking for three rivers of Europe and one asking for the capital of France), enough to flip a near
# tie: greedy text parted after a few words for the rivers and the capitals, at the first token for France (0.08
# logits between "The" and "L"); here it does not.
PROMPT = "<|im_start|>user\nWrite a haiku about the sea, in English, please.<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.slow
def test_smollm2_answers_the_same_with_a_q8_0_cache(smollm2_gguf):
    """Greedy text unchanged (18 tokens to the end of the turn), and the last prompt position's logits within a small
    share of their range of those with the full (float32) cache; the q8_0 cache takes 34/128 of its bytes."""
    from engine import GenerationSettings, load_model

    results = {}
    for kind in ("full", "q8_0"):
        model = load_model(smollm2_gguf, device="cpu", context_length=512, kv_cache_type=kind)
        try:
            ids = model.tokenizer.encode(PROMPT)
            logits, _ = model.prompt_logits(ids, all_positions=True)
            text = model.complete(PROMPT, GenerationSettings(temperature=0, max_tokens=24))
            results[kind] = logits[-1], text, model.info
        finally:
            model.close()
    (full, full_text, full_info), (q8, q8_text, q8_info) = results["full"], results["q8_0"]
    assert q8_info.kv_cache_type == "q8_0" and full_info.kv_cache_type == "full"
    assert q8_info.kv_cache_bytes * 128 == full_info.kv_cache_bytes * 34
    assert q8_text.text == full_text.text and q8_text.completion_tokens == full_text.completion_tokens >= 16
    relative = np.abs(q8 - full).max() / (full.max() - full.min())
    print(f"\nSmolLM2 q8_0 KV cache: max |logit difference| at the prompt's last position = {relative:.2e} of the "
          f"logit range ({np.abs(q8 - full).max():.4f} of {full.max() - full.min():.2f})")
    assert 0 < relative < 0.02


def test_an_unknown_kv_cache_type_is_refused_before_loading(tmp_path):
    from engine import load_model

    with pytest.raises(EngineError, match="kv_cache_type must be one of 'full', 'q8_0', not 'fp8'"):
        load_model(tmp_path / "missing.gguf", device="cpu", kv_cache_type="fp8")
