"""The real Gemma-3-270M Q4_K_M: our logits and tokenizer against Hugging Face transformers on the same GGUF."""

from __future__ import annotations

import numpy as np
import pytest
from test_tokenizer import CORPUS
from transformers_reference import load_reference_model, reference_logits

from engine import load_model

PROMPTS = [
    "The capital of France is Paris. The capital of Germany is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "<start_of_turn>user\nWrite a haiku about the sea, in English, please.<end_of_turn>\n<start_of_turn>model\n",
]
GEMMA_TEXT = [
    "<start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n",
    "  two  spaces   three\n\n\n and\ttabs\t\t",
    "<unused0> [multimodal] <pad> <mask>",
]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine_model(gemma3_gguf):
    model = load_model(gemma3_gguf, device="cpu", context_length=512)
    yield model
    model.close()


@pytest.fixture(scope="module")
def hf_model(gemma3_gguf):
    return load_reference_model(gemma3_gguf)


@pytest.fixture(scope="module")
def hf_tokenizer(gemma3_gguf):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(gemma3_gguf.parent, gguf_file=gemma3_gguf.name)


def test_the_file_is_gemma3(engine_model):
    assert engine_model.info.architecture == "gemma3"
    assert engine_model.info.n_layers == 18 and engine_model.info.vocab_size == 262144


@pytest.mark.parametrize("prompt", PROMPTS)
def test_logits_match_transformers(engine_model, hf_model, prompt):
    ids = engine_model.tokenizer.encode(prompt)
    assert ids[0] == engine_model.tokenizer.bos_id
    ours, _ = engine_model.prompt_logits(ids, all_positions=True)
    theirs = reference_logits(hf_model, ids)
    assert ours.shape == theirs.shape == (len(ids), 262144)
    spread = theirs.max(axis=-1) - theirs.min(axis=-1)
    error = float(np.max(np.abs(ours - theirs).max(axis=-1) / spread))
    print(f"gemma-3-270m: max |diff| / logit range = {error:.2e}")
    assert error < 1e-3
    assert np.array_equal(ours.argmax(axis=-1), theirs.argmax(axis=-1))


@pytest.mark.parametrize("text", CORPUS + GEMMA_TEXT)
def test_tokenization_matches_transformers(engine_model, hf_tokenizer, text):
    ours = engine_model.tokenizer
    assert ours.encode(text) == hf_tokenizer.encode(text)
    ids = ours.encode(text, add_bos=False)
    assert ids == hf_tokenizer.encode(text, add_special_tokens=False)
    assert ours.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=False) == text


def test_greedy_continuation_matches_transformers(engine_model, hf_model):
    import torch

    from engine import GenerationSettings

    prompt = PROMPTS[2]
    tokenizer = engine_model.tokenizer
    stops = [tokenizer.eos_id, tokenizer.token_id("<end_of_turn>")]
    ids = tokenizer.encode(prompt)
    with torch.no_grad():
        out = hf_model.generate(
            torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=16, do_sample=False, eos_token_id=stops, pad_token_id=0,
        )[0, len(ids):].tolist()
    kept = [t for t in out if t not in stops]
    result = engine_model.complete(prompt, GenerationSettings(temperature=0, max_tokens=16))
    assert result.text == tokenizer.decode(kept)
    assert result.completion_tokens == len(kept)


def test_sliding_layers_keep_a_ring_and_match_transformers_past_it(gemma3_gguf, hf_model):
    """With more context than the window and a chunk (512 + 512 - 1 positions), the sliding layers keep only that
    many rows (engine/kv_cache.py WindowedCache) and wrap: a prompt past the wrap, and greedy decode steps after it,
    still give transformers' logits and tokens."""
    import torch

    model = load_model(gemma3_gguf, device="cpu", context_length=2048)
    try:
        cache = model._state.cache
        ring = cache.ring.max_tokens
        assert ring == 512 + 512 - 1 and cache.full.max_tokens == 2048
        assert cache.ring.n_layers == 15 and cache.full.n_layers == 3  # 5 sliding layers of every 6
        ids = model.tokenizer.encode(" ".join(PROMPTS) * 30)[: ring + 300]
        ours, _ = model.prompt_logits(ids, all_positions=True)
        # Against transformers in float64: a few positions of this periodic text are sensitive to rounding (at the
        # worst, 1019, transformers' own float32 run is 1.4e-4 of the logit range off its float64 one, ours 8.7e-4),
        # while a window one position too short or too long puts the logits 3.4e-2 off.
        theirs = reference_logits(load_reference_model(gemma3_gguf).double(), ids)
        spread = theirs.max(axis=-1) - theirs.min(axis=-1)
        error = float(np.max(np.abs(ours - theirs).max(axis=-1) / spread))
        print(f"gemma-3-270m, {len(ids)} tokens through a ring of {ring}: max |diff| / logit range = {error:.2e}")
        assert error < 2e-3
        with torch.no_grad():
            expect = hf_model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                       max_new_tokens=8, do_sample=False, pad_token_id=0)[0, len(ids):].tolist()
        got = []
        for _ in range(8):
            logits, reused = model.prompt_logits(ids + got)  # reuses the cached prefix: one decode step each
            assert reused == len(ids) + len(got) - 1
            got.append(int(np.argmax(logits)))
        assert got == expect
        # A prompt that goes back further than the ring still holds starts over, with the same logits.
        short = ids[: ring // 2] + [ids[5]]
        again, reused = model.prompt_logits(short)
        assert reused == 0
        fresh = load_model(gemma3_gguf, device="cpu", context_length=2048)
        try:
            assert np.allclose(again, fresh.prompt_logits(short)[0], atol=1e-5 * float(spread.max()))
        finally:
            fresh.close()
    finally:
        model.close()
