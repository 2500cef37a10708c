"""Every architecture against Hugging Face transformers: a tiny model with random weights, written to GGUF by
tests/gguf_convert.py, must give the same logits in our engine and the same 16-token greedy continuation."""

from __future__ import annotations

import numpy as np
import pytest

from engine import load_model
from gguf_convert import write_gguf

PROMPTS = [
    "The capital of France is Paris. The capital of Germany is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
]
VOCAB = 49152  # SmolLM2's, whose tokenizer the tiny models borrow
GREEDY_TOKENS = 16


def _small_config(**extra):
    base = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        initializer_range=0.1,
        tie_word_embeddings=False,
    )
    base.update(extra)
    return base


def _build(arch: str, head_dim: int = 16):
    """The tiny model of `arch`; tests/test_gpu_arch.py asks for head_dim 64, a head size the GPU kernels have."""
    import transformers as tf

    def _small(**extra):
        return _small_config(head_dim=head_dim, **extra)

    if arch == "qwen2":
        return tf.Qwen2ForCausalLM(tf.Qwen2Config(**_small(rms_norm_eps=1e-6)))
    if arch in ("qwen3", "qwen3-f16"):
        return tf.Qwen3ForCausalLM(tf.Qwen3Config(**_small(rms_norm_eps=1e-6, tie_word_embeddings=True)))
    if arch == "llama":
        return tf.LlamaForCausalLM(tf.LlamaConfig(**_small(rms_norm_eps=1e-5)))
    if arch == "llama3":
        # Llama 3's rotary scaling with a short original context, so that the low-, mid- and high-frequency
        # bands of the 16-dim heads all occur (written as llama.cpp does: a rope_freqs tensor).
        rope = dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=64)
        return tf.LlamaForCausalLM(tf.LlamaConfig(**_small(rms_norm_eps=1e-5, rope_parameters=rope)))
    if arch == "qwen3moe":
        # 8 experts, 2 per token, every layer sparse: routing decides which weights a token sees.
        config = tf.Qwen3MoeConfig(
            **_small(rms_norm_eps=1e-6, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                     norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
        )
        return tf.Qwen3MoeForCausalLM(config)
    if arch == "gemma3":
        # Six layers: five sliding-window layers (window 5, shorter than the prompts) and one global layer.
        config = tf.Gemma3TextConfig(
            **_small(num_hidden_layers=6, sliding_window=5, query_pre_attn_scalar=head_dim, rms_norm_eps=1e-6, tie_word_embeddings=True)
        )
        return tf.Gemma3ForCausalLM(config)
    raise ValueError(arch)


def _randomize_norms(model):
    # Fresh norms are all ones (Gemma's all zeros); random ones make a wrong norm layout visible.
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.3)


def _round_matrices_to_f16(model):
    # The F16 file then holds exactly the reference's weights, so the comparison stays exact.
    import torch

    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.copy_(p.half().float())


ARCHS = ["llama", "llama3", "qwen2", "qwen3", "qwen3-f16", "qwen3moe", "gemma3"]
GGUF_ARCH = {"llama3": "llama", "qwen3-f16": "qwen3"}


@pytest.fixture(scope="module", params=ARCHS)
def pair(request, tmp_path_factory, smollm2_gguf):
    import torch

    torch.manual_seed(0)
    torch.set_num_threads(2)
    arch = request.param
    hf = _build(arch).eval()
    _randomize_norms(hf)
    f16 = arch.endswith("-f16")
    if f16:
        _round_matrices_to_f16(hf)
    path = write_gguf(hf, GGUF_ARCH.get(arch, arch), tmp_path_factory.mktemp(arch) / f"tiny-{arch}.gguf", smollm2_gguf, f16=f16)
    ours = load_model(path, device="cpu", context_length=256)
    yield arch, hf, ours
    ours.close()


def _hf_logits(hf, ids):
    import torch

    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float().numpy()


def _relative_error(ours: np.ndarray, theirs: np.ndarray) -> float:
    spread = theirs.max(axis=-1) - theirs.min(axis=-1)
    return float(np.max(np.abs(ours - theirs).max(axis=-1) / spread))


@pytest.mark.parametrize("prompt", PROMPTS)
def test_logits_match_transformers(pair, prompt):
    arch, hf, ours = pair
    ids = ours.tokenizer.encode(prompt)
    mine, _ = ours.prompt_logits(ids, all_positions=True)
    theirs = _hf_logits(hf, ids)
    assert mine.shape == theirs.shape == (len(ids), VOCAB)
    assert ("F16" in ours.info.tensor_types) == arch.endswith("-f16")
    error = _relative_error(mine, theirs)
    print(f"{arch}: max |diff| / logit range = {error:.2e}")
    assert error < 1e-3


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_continuation_matches_transformers(pair, prompt):
    import torch

    arch, hf, ours = pair
    ids = ours.tokenizer.encode(prompt)
    with torch.no_grad():
        expected = hf.generate(
            torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=GREEDY_TOKENS, min_new_tokens=GREEDY_TOKENS, do_sample=False, pad_token_id=0,
        )[0, len(ids):].tolist()
    # Each step reuses the cached prefix, so after the prompt every token runs the one-token decode path.
    tokens = list(ids)
    for _ in range(GREEDY_TOKENS):
        logits, _ = ours.prompt_logits(tokens)
        tokens.append(int(np.argmax(logits)))
    assert tokens[len(ids):] == expected
