"""The hybrid Gated DeltaNet families (qwen35, qwen35moe, qwen3next) against Hugging Face transformers: tiny random
models written to GGUF as llama.cpp's converter writes them (tests/gguf_convert.py) must give transformers' logits,
its greedy continuation, and the same tokens for a two-turn chat as for one prompt holding both turns."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from engine import GenerationSettings, load_model
from gguf_convert import write_gguf

VOCAB = 49152  # SmolLM2's, whose tokenizer the tiny models borrow
GREEDY_TOKENS = 16
SHORT = "The capital of France is Paris. The capital of Germany is"
# More than two chunks of 64 tokens, so the chunked delta rule carries its state across chunks.
LONG = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n" * 6


def _build(arch: str, **sizes):
    """sizes: config fields to change (the GPU tests use head sizes their kernels have)."""
    import transformers as tf

    # Two key heads and four value heads, so the order of the value heads (tiled or grouped) matters; eight layers,
    # attention at layers 1 and 7, where full_attention_interval's default (4) would not put it.
    layer_types = ["linear_attention"] * 8
    layer_types[1] = layer_types[7] = "full_attention"
    common = dict(
        layer_types=layer_types,
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, max_position_embeddings=512, initializer_range=0.1, tie_word_embeddings=False,
        rms_norm_eps=1e-6,
    )
    moe = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
    for key, value in sizes.items():
        (moe if key in moe else common)[key] = value
    if arch == "qwen35":
        return tf.Qwen3_5ForCausalLM(tf.Qwen3_5TextConfig(**common, intermediate_size=96))
    if arch == "qwen35moe":
        return tf.Qwen3_5MoeForCausalLM(tf.Qwen3_5MoeTextConfig(**common, **moe))
    return tf.Qwen3NextForCausalLM(tf.Qwen3NextConfig(**common, **moe, intermediate_size=96))


def _randomize(model):
    # Fresh norms are zeros (scaled by 1 + w) or ones, and A_log / dt_bias constant-ish: random values make a wrong
    # +1, sign or head order visible.
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(("A_log", "dt_bias")):
                p.add_(torch.randn_like(p) * 0.3)


ARCHS = ["qwen35", "qwen35moe", "qwen3next"]


@pytest.fixture(scope="module", params=ARCHS)
def pair(request, tmp_path_factory, smollm2_gguf):
    import torch

    torch.manual_seed(0)
    torch.set_num_threads(2)
    arch = request.param
    hf = _build(arch).eval()
    _randomize(hf)
    path = write_gguf(hf, arch, tmp_path_factory.mktemp(arch) / f"tiny-{arch}.gguf", smollm2_gguf, context_length=512)
    progress = []
    ours = load_model(path, device="cpu", context_length=512, on_progress=lambda done, total, _: progress.append((done, total)))
    yield arch, hf, ours, (path, progress)
    ours.close()


def test_load_reports_every_tensor_and_keeps_kv_for_attention_layers_only(pair):
    _, hf, ours, (path, progress) = pair
    assert progress[-1] == (len(gguf.GGUFReader(path).tensors),) * 2
    c = hf.config
    n_attention = c.layer_types.count("full_attention")
    n_recurrent = c.num_hidden_layers - n_attention
    kv = 2 * n_attention * c.num_key_value_heads * 512 * c.head_dim * 4
    conv_dim = 2 * c.linear_num_key_heads * c.linear_key_head_dim + c.linear_num_value_heads * c.linear_value_head_dim
    conv = n_recurrent * (c.linear_conv_kernel_dim - 1) * conv_dim * 4
    ssm = n_recurrent * c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim * 4
    assert ours.info.kv_cache_bytes == kv + 2 * (conv + ssm)  # the live recurrent state and its snapshot


def _hf_logits(hf, ids):
    import torch

    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float().numpy()


def _hf_greedy(hf, ids, n):
    import torch

    with torch.no_grad():
        return hf.generate(
            torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0,
        )[0, len(ids):].tolist()


def _relative_error(ours: np.ndarray, theirs: np.ndarray) -> float:
    spread = theirs.max(axis=-1) - theirs.min(axis=-1)
    return float(np.max(np.abs(ours - theirs).max(axis=-1) / spread))


@pytest.mark.parametrize("prompt", [SHORT, LONG])
def test_logits_match_transformers(pair, prompt):
    arch, hf, ours, _ = pair
    ids = ours.tokenizer.encode(prompt)
    assert prompt == SHORT or len(ids) > 128
    mine, _ = ours.prompt_logits(ids, all_positions=True)
    theirs = _hf_logits(hf, ids)
    assert mine.shape == theirs.shape == (len(ids), VOCAB)
    error = _relative_error(mine, theirs)
    print(f"{arch}: max |diff| / logit range = {error:.2e}")
    assert error < 1e-3


@pytest.mark.parametrize("prompt", [SHORT, LONG])
def test_greedy_continuation_matches_transformers(pair, prompt):
    arch, hf, ours, _ = pair
    ids = ours.tokenizer.encode(prompt)
    expected = _hf_greedy(hf, ids, GREEDY_TOKENS)
    # After the prompt each step reuses the live recurrent state and runs one token (the recurrent form).
    tokens = list(ids)
    for _ in range(GREEDY_TOKENS):
        logits, reused = ours.prompt_logits(tokens)
        assert reused == len(tokens) - 1 or len(tokens) == len(ids)
        tokens.append(int(np.argmax(logits)))
    assert tokens[len(ids):] == expected


QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = GenerationSettings(temperature=0, max_tokens=GREEDY_TOKENS, ignore_eos=True)


def _fresh_chat(ours, messages):
    ours.prompt_logits([0, 0], all_positions=True)  # a run from position 0: the recurrent state starts over
    result = ours.chat(messages, GREEDY)
    assert result.cached_prompt_tokens == 0
    return result


def test_two_turn_chat_gives_the_tokens_of_one_prompt(pair):
    _, _, ours, _ = pair
    first = ours.chat(QUESTION, GREEDY)
    follow_up = QUESTION + [{"role": "assistant", "content": first.text}, {"role": "user", "content": "And of Italy?"}]
    second = ours.chat(follow_up, GREEDY)
    # The second turn starts from a kept state: the live one (the reply came back token for token) or the copy
    # at the end of the first prompt.
    assert second.cached_prompt_tokens >= first.prompt_tokens
    assert second.text == _fresh_chat(ours, follow_up).text


def test_edited_reply_restarts_from_the_end_of_the_previous_prompt(pair):
    _, _, ours, _ = pair
    first = ours.chat(QUESTION, GREEDY)
    edited = QUESTION + [{"role": "assistant", "content": "Lyon, I think."}, {"role": "user", "content": "Sure?"}]
    second = ours.chat(edited, GREEDY)
    # The recurrent state cannot be cut back inside the reply: it comes back from the snapshot at the prompt's end.
    assert second.cached_prompt_tokens == first.prompt_tokens
    assert second.text == _fresh_chat(ours, edited).text
