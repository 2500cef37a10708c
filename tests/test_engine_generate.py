"""Generation with the real SmolLM2 on the CPU: stop conditions, streaming, KV prefix reuse, limits, lifecycle."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from engine import Cancelled, EngineError, GenerationSettings, load_model
from engine.generate import StopStringFilter, decode_one_token, prefill
from engine.kernels import reference
from engine.sampler import REPEAT_PENALTY_WINDOW

pytestmark = pytest.mark.slow  # loads the real model

GREEDY = GenerationSettings(temperature=0, max_tokens=24)
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def model(smollm2_gguf):
    loaded = load_model(smollm2_gguf, device="cpu", context_length=256)
    yield loaded
    loaded.close()


def test_stop_string_filter_holds_back_and_cuts():
    pieces = []
    f = StopStringFilter(["</end>", "STOP"], pieces.append)
    assert not f.feed("Hello </")
    assert pieces == ["Hello "]  # "</" could start "</end>": held back
    assert not f.feed("b> ST")
    assert "".join(pieces) == "Hello </b> "
    assert f.feed("OP and more")
    assert f.text == "Hello </b> " and "".join(pieces) == f.text


def test_chat_answers_and_stops_at_end_of_turn(model):
    pieces = []
    result = model.chat(QUESTION, GREEDY, on_text=pieces.append)
    assert "Paris" in result.text
    assert result.finish_reason == "stop" and result.completion_tokens < GREEDY.max_tokens
    assert "".join(pieces) == result.text and "<|im_end|>" not in result.text
    assert result.prompt_tokens == len(model.tokenizer.encode(model.render_chat(QUESTION)))
    assert result.prompt_tokens_per_second > 0 and result.output_tokens_per_second > 0


def test_stop_string_ends_text_before_it(model):
    pieces = []
    result = model.chat(QUESTION, GenerationSettings(temperature=0, max_tokens=24, stop=["Paris"]), on_text=pieces.append)
    assert result.finish_reason == "stop"
    assert "Paris" not in result.text and result.text and "".join(pieces) == result.text


def test_max_tokens_gives_length(model):
    result = model.complete("Once upon a time", GenerationSettings(temperature=0, max_tokens=5))
    assert result.finish_reason == "length" and result.completion_tokens == 5


@pytest.mark.parametrize("prompt", ["🎉🎉🎉🎉🎉🎉", "日本語の文章：東京は"])
def test_streamed_text_never_splits_a_character(model, prompt):
    # SmolLM2 spells these one byte-token at a time, so characters span several tokens.
    pieces = []
    result = model.complete(prompt, GenerationSettings(temperature=0, max_tokens=16), on_text=pieces.append)
    assert "".join(pieces) == result.text and len(pieces) >= 5
    assert all(piece and "\ufffd" not in piece for piece in pieces)


def test_follow_up_reuses_the_cache_and_answers_the_same(model):
    first = model.chat(QUESTION, GREEDY)
    follow_up = QUESTION + [{"role": "assistant", "content": first.text}, {"role": "user", "content": "And of Italy?"}]
    reused = model.chat(follow_up, GREEDY)
    assert reused.cached_prompt_tokens > first.prompt_tokens
    model.prompt_logits([0, 0], all_positions=True)  # leaves nothing of the conversation in the cache
    fresh = model.chat(follow_up, GREEDY)
    assert fresh.cached_prompt_tokens == 0 and fresh.text == reused.text


def test_prefix_reuse_gives_the_logits_of_a_fresh_run(model):
    ids = model.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 3)
    fresh = model.prompt_logits(ids, all_positions=True)[0][-1]
    model.prompt_logits(ids[:10], all_positions=True)
    reused_logits, reused = model.prompt_logits(ids)
    assert reused == 10
    assert np.abs(reused_logits - fresh).max() < 1e-4 * (fresh.max() - fresh.min())


def test_seeded_sampling_is_reproducible(model):
    settings = GenerationSettings(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=1234, max_tokens=12)
    assert model.complete("My favourite colour is", settings).text == model.complete("My favourite colour is", settings).text


def test_should_stop_cancels(model):
    checks = itertools.count(1)
    result = model.complete("Count: 1, 2, 3,", GenerationSettings(temperature=0, max_tokens=50),
                            should_stop=lambda: next(checks) > 3)
    assert result.finish_reason == "cancelled" and result.completion_tokens < 50


def test_prompt_longer_than_context_is_explained(model):
    with pytest.raises(EngineError, match=r"prompt is \d+ tokens but the context holds only 256"):
        model.complete("word " * 300, GREEDY)


def test_generation_stops_at_the_end_of_the_context(model):
    prompt = "one two " * 120
    n = len(model.tokenizer.encode(prompt))
    result = model.complete(prompt, GenerationSettings(temperature=0, max_tokens=200))
    assert result.finish_reason == "length" and n + result.completion_tokens <= 256 + 1


def test_info_and_memory(model, smollm2_gguf):
    info = model.info
    assert (info.architecture, info.backend, info.context_length, info.max_context_length) == ("llama", "numpy", 256, 8192)
    assert info.n_layers == 30 and info.vocab_size == 49152 and info.tensor_types["Q4_1"] == 210
    assert info.kv_cache_bytes == 2 * 30 * 3 * 256 * 64 * 4
    # The CPU keeps the weights quantized: about the file's size (float scales add a little), not 4 bytes a weight.
    assert smollm2_gguf.stat().st_size < info.weight_bytes < 1.2 * smollm2_gguf.stat().st_size
    assert "CPU" in info.backend_reason
    assert model.memory_in_use().host_bytes >= info.weight_bytes + info.kv_cache_bytes


def test_context_limits_are_checked_before_loading(smollm2_gguf):
    with pytest.raises(EngineError, match="longer than .* supports \\(8192 tokens\\)"):
        load_model(smollm2_gguf, device="cpu", context_length=100_000)
    with pytest.raises(EngineError, match="positive"):
        load_model(smollm2_gguf, device="cpu", context_length=0)
    with pytest.raises(EngineError, match="device must be"):
        load_model(smollm2_gguf, device="tpu")
    with pytest.raises(EngineError, match="prompt_chunk must be a positive number of tokens, not 0"):
        load_model(smollm2_gguf, device="cpu", prompt_chunk=0)


def test_a_prompt_in_small_chunks_gives_one_chunk_s_logits(model, smollm2_gguf):
    """The same prompt in chunks of 40 tokens (the last ragged), each attending over the cache the earlier ones left."""
    ids = model.tokenizer.encode("one two three four " * 30)
    small = load_model(smollm2_gguf, device="cpu", context_length=256, prompt_chunk=40)
    try:
        assert small._state.workspace.max_chunk == 40 and len(ids) > 3 * 40 and len(ids) % 40
        got, want = small.prompt_logits(ids)[0], model.prompt_logits(ids)[0]
    finally:
        small.close()
    assert np.abs(got - want).max() < 1e-4 * (want.max() - want.min())


def test_load_progress_cancel_and_close(smollm2_gguf):
    seen = []
    with pytest.raises(Cancelled):
        load_model(smollm2_gguf, device="cpu", on_progress=lambda d, t, m: seen.append((d, t)),
                   should_cancel=lambda: len(seen) >= 5)
    assert len(seen) == 5 and seen[-1][1] == 272

    seen.clear()
    loaded = load_model(smollm2_gguf, device="cpu", context_length=64, on_progress=lambda d, t, m: seen.append((d, t)))
    assert seen[-1] == (272, 272) and [d for d, _ in seen] == sorted(d for d, _ in seen)
    loaded.close()
    loaded.close()
    assert loaded.memory_in_use().total_bytes == 0
    with pytest.raises(EngineError, match="closed"):
        loaded.complete("hi", GREEDY)


def test_repeat_penalty_generation_matches_a_step_by_step_loop(model):
    """With a repeat penalty each pick needs the history on the host (Sampler.feed picks at once); the tokens must
    be those of a plain loop over prefill, decode_one_token and the reference sampler with the same window."""
    settings = GenerationSettings(temperature=0, repeat_penalty=1.5, max_tokens=10, ignore_eos=True)
    prompt = "one two one two one two one two"
    ids = model.tokenizer.encode(prompt)
    result = model.complete(prompt, settings)
    model.prompt_logits([0, 0], all_positions=True)  # nothing of that prompt left to reuse
    state = model._state
    logits, _ = prefill(state, ids)
    history = list(ids)
    for _ in range(settings.max_tokens):
        recent = np.asarray(history[-REPEAT_PENALTY_WINDOW:], np.int32)
        history.append(reference.sample(logits, settings.sampling(), recent, 0.0))
        logits = decode_one_token(state, history[-1])
    assert result.text == model.tokenizer.decode(history[len(ids):])
    plain = model.complete(prompt, GenerationSettings(temperature=0, max_tokens=10, ignore_eos=True))
    assert plain.text != result.text, "the penalty should change this repetitive continuation"


def test_nan_logits_are_reported_as_a_damaged_model(smollm2_gguf, tmp_path):
    # A file changed on disk (here the final norm's weights overwritten with NaN) must not give an empty answer:
    # the first logits are checked, and the cache that produced them is dropped.
    from gguf import GGUFReader

    from engine import DamagedModel

    damaged = tmp_path / "damaged.gguf"
    damaged.write_bytes(smollm2_gguf.read_bytes())
    tensor = next(t for t in GGUFReader(damaged).tensors if t.name == "output_norm.weight")
    with damaged.open("r+b") as f:
        f.seek(tensor.data_offset)
        f.write(np.full(tensor.n_elements, np.nan, np.float32).tobytes())
    model = load_model(damaged, device="cpu", context_length=128)
    try:
        with pytest.raises(DamagedModel, match="invalid numbers"):
            model.complete("Hello", GenerationSettings(max_tokens=4, temperature=0))
        assert len(model._live_state().cached) == 0
    finally:
        model.close()
