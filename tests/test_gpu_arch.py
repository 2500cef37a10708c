"""Every architecture on the GPU backend against the CPU path (needs CuPy and an NVIDIA GPU): the tiny random
transformers models of tests/test_engine_arch_tiny.py, with 64-dim heads (a head size the attention kernels
have), written to GGUF and loaded on both paths.

Logits: max |GPU - CPU| over each position's logit range below 1e-2. The GPU's prompt path rounds both operands
of every product to fp16 (unit roundoff 4.9e-4) with fp32 accumulation, and keeps the KV cache in fp16; over 2 to
6 layers that gives errors of a few 1e-3 of the range, while a wrong op (a missing bias, norm or window) gives
errors of the order of the range itself. Greedy continuations (the GPU's through its captured decode graph) must
be identical for 16 tokens, or first differ only where the CPU path's top two logits are within 0.05.
"""

import sys
from pathlib import Path

import numpy as np
import pytest
from gpu_support import require_gpu
from gguf import GGMLQuantizationType as T

from engine import GenerationSettings, load_model
from engine.errors import EngineError
from engine.generate import decode_one_token, prefill
from gguf_convert import write_gguf
from test_engine_arch_tiny import ARCHS, GGUF_ARCH, PROMPTS, _build, _randomize_norms, _round_matrices_to_f16

cp = require_gpu()
pytestmark = pytest.mark.gpu

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.make_synthetic_gguf import write_model  # noqa: E402

HEAD_DIM = 64
LOGIT_TOLERANCE = 1e-2
GREEDY_TOKENS = 16
GREEDY = GenerationSettings(temperature=0.0).sampling()


@pytest.fixture(scope="module", params=ARCHS)
def pair(request, tmp_path_factory, tokenizer_source):
    import torch

    torch.manual_seed(0)
    arch = request.param
    hf = _build(arch, head_dim=HEAD_DIM).eval()
    _randomize_norms(hf)
    f16 = arch.endswith("-f16")
    if f16:
        _round_matrices_to_f16(hf)
    path = tmp_path_factory.mktemp(arch) / f"tiny-{arch}.gguf"
    write_gguf(hf, GGUF_ARCH.get(arch, arch), path, tokenizer_source, f16=f16)
    cpu = load_model(path, device="cpu", context_length=256)
    gpu = load_model(path, device="cuda", context_length=256)
    assert gpu.info.backend == "cupy"
    yield arch, cpu, gpu
    gpu.close()
    cpu.close()


@pytest.mark.parametrize("prompt", PROMPTS)
def test_prompt_logits_match_cpu(pair, prompt):
    arch, cpu, gpu = pair
    ids = cpu.tokenizer.encode(prompt)
    ours, _ = gpu.prompt_logits(ids, all_positions=True)
    theirs, _ = cpu.prompt_logits(ids, all_positions=True)
    assert np.isfinite(ours).all()
    spread = theirs.max(axis=-1) - theirs.min(axis=-1)
    error = float(np.max(np.abs(ours - theirs).max(axis=-1) / spread))
    print(f"{arch}: prompt logits max |GPU - CPU| / logit range = {error:.2e}")
    assert error < LOGIT_TOLERANCE


def _greedy(model, ids):
    state = model._state
    none = np.zeros(0, np.int32)
    logits, _ = prefill(state, list(ids))
    tokens = [state.backend.sample(logits, GREEDY, none, 0.0)]
    for _ in range(GREEDY_TOKENS - 1):
        tokens.append(state.backend.sample(decode_one_token(state, tokens[-1]), GREEDY, none, 0.0))
    return tokens


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_continuation_matches_cpu(pair, prompt):
    arch, cpu, gpu = pair
    ids = cpu.tokenizer.encode(prompt)
    ours, theirs = _greedy(gpu, ids), _greedy(cpu, ids)
    if ours == theirs:
        # Both caches now hold the same tokens: one more decode step compares the decode path's logits.
        a = gpu._state.backend.to_host(decode_one_token(gpu._state, theirs[-1]))
        b = decode_one_token(cpu._state, theirs[-1])
        error = float(np.abs(a - b).max() / np.ptp(b))
        print(f"{arch}: greedy identical; next decode logits max |GPU - CPU| / logit range = {error:.2e}")
        assert error < LOGIT_TOLERANCE
        return
    first = next(i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b)
    logits, _ = cpu.prompt_logits(ids + theirs[:first])
    top2 = np.sort(logits)[-2:]
    print(f"{arch}: first difference at token {first}; CPU top-2 logit gap {top2[1] - top2[0]:.4f}")
    assert top2[1] - top2[0] < 0.05


def test_types_without_a_gpu_kernel_are_refused_at_load(tmp_path):
    path = tmp_path / "q2k.gguf"
    write_model(path, dict(hidden=256, layers=1, ffn=512, heads=4, kv_heads=2, vocab=300, tied=False), T.Q2_K, "q2k")
    with pytest.raises(EngineError) as refused:
        load_model(path, device="cuda", context_length=64)
    message = str(refused.value)
    assert "Q2_K" in message and "token_embd.weight" in message and "device='cpu'" in message


@pytest.mark.parametrize("kv_cache", ["full", "q8_0"])
def test_sliding_window_ring_matches_cpu(tmp_path, tokenizer_source, kv_cache):
    """The tiny Gemma 3 (window 5) with more context than window + chunk - 1 positions (the GPU given the CPU's
    512-token chunks, as its own are the whole context here): its sliding layers keep a ring (engine/kv_cache.py
    WindowedCache; held to transformers on the CPU by tests/test_engine_gemma3.py), which a 700-token prompt and the
    decode steps after it wrap; the GPU's logits and greedy tokens against the CPU path's."""
    import torch

    from engine.kv_cache import WindowedCache

    torch.manual_seed(0)
    hf = _build("gemma3", head_dim=HEAD_DIM).eval()
    _randomize_norms(hf)
    path = tmp_path / "tiny-gemma3.gguf"
    write_gguf(hf, "gemma3", path, tokenizer_source, context_length=1024)
    cpu = load_model(path, device="cpu", context_length=1024, kv_cache_type=kv_cache)
    gpu = load_model(path, device="cuda", context_length=1024, kv_cache_type=kv_cache, prompt_chunk=512)
    try:
        for model in (cpu, gpu):
            cache = model._state.cache
            assert isinstance(cache, WindowedCache) and cache.ring.max_tokens == 5 + 511
        ids = np.random.default_rng(1).integers(3, cpu.info.vocab_size, 700).tolist()
        ours, _ = gpu.prompt_logits(ids, all_positions=True)
        theirs, _ = cpu.prompt_logits(ids, all_positions=True)
        spread = theirs.max(axis=-1) - theirs.min(axis=-1)
        error = float(np.max(np.abs(ours - theirs).max(axis=-1) / spread))
        print(f"gemma3 ring ({kv_cache}): prompt logits max |GPU - CPU| / logit range = {error:.2e}")
        # Each side rounds its own keys and values to q8_0 (from fp16 on the GPU, float32 on the CPU), so an element
        # near a rounding boundary lands a level apart: the q8_0 bound of tests/test_gpu_kv_cache.py.
        assert error < (LOGIT_TOLERANCE if kv_cache == "full" else 2e-2)
        ours, theirs = _greedy(gpu, ids), _greedy(cpu, ids)
        if ours != theirs:
            first = next(i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b)
            top2 = np.sort(cpu.prompt_logits(ids + theirs[:first])[0])[-2:]
            assert top2[1] - top2[0] < 0.05
    finally:
        gpu.close()
        cpu.close()
