"""The engine's SmolLM2 logits and greedy text against Hugging Face transformers on the same GGUF."""

from __future__ import annotations

import numpy as np
import pytest
from transformers_reference import load_reference_model, reference_logits

from engine import GenerationSettings, load_model

PROMPTS = [
    "The capital of France is Paris. The capital of Germany is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "<|im_start|>user\nWrite a haiku about the sea, in English, please.<|im_end|>\n<|im_start|>assistant\n",
]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine_model(smollm2_gguf):
    model = load_model(smollm2_gguf, device="cpu", context_length=1024)
    yield model
    model.close()


@pytest.fixture(scope="module")
def hf_model(smollm2_gguf):
    return load_reference_model(smollm2_gguf)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_logits_match_transformers_at_every_position(engine_model, hf_model, prompt):
    ids = engine_model.tokenizer.encode(prompt)
    ours, reused = engine_model.prompt_logits(ids, all_positions=True)
    theirs = reference_logits(hf_model, ids)
    assert ours.shape == theirs.shape == (len(ids), engine_model.info.vocab_size) and reused == 0
    diff = np.abs(ours - theirs).max(axis=-1)
    spread = theirs.max(axis=-1) - theirs.min(axis=-1)
    assert np.all(diff < 1e-3 * spread), f"worst relative difference {np.max(diff / spread):.2e}"


@pytest.mark.parametrize("prompt", PROMPTS)
def test_decode_steps_match_transformers(engine_model, hf_model, prompt):
    # One token at a time through the cache (the decode path) gives the same logits as the full sequence.
    ids = engine_model.tokenizer.encode(prompt)
    theirs = reference_logits(hf_model, ids)
    engine_model.prompt_logits(ids[:2], all_positions=True)
    for k in range(3, len(ids) + 1):
        ours, reused = engine_model.prompt_logits(ids[:k])
        assert reused == k - 1
        spread = theirs[k - 1].max() - theirs[k - 1].min()
        assert np.abs(ours - theirs[k - 1]).max() < 1e-3 * spread


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_continuation_matches_transformers(engine_model, hf_model, prompt):
    import torch

    ids = engine_model.tokenizer.encode(prompt)
    with torch.no_grad():
        out = hf_model.generate(
            torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=32, do_sample=False, eos_token_id=[engine_model.tokenizer.eos_id], pad_token_id=0,
        )[0, len(ids):].tolist()
    expected = engine_model.tokenizer.decode([t for t in out if t != engine_model.tokenizer.eos_id])
    result = engine_model.complete(prompt, GenerationSettings(temperature=0, max_tokens=32))
    assert result.text == expected
    assert result.completion_tokens == len([t for t in out if t != engine_model.tokenizer.eos_id])
    assert result.finish_reason == ("stop" if engine_model.tokenizer.eos_id in out else "length")
