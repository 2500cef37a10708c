"""Flash attention of prompt chunks on tensor cores (engine/kernels/flash_attention.cu) against the NumPy reference
on fresh random inputs, a 4K-token prompt through a tiny model against the older chunk path, and decode steps past
K.DEEP_DECODE_KEYS' position (their own graph, keys split over the GPU) against the cluster kernel (needs CuPy and a
GPU of compute capability 8.0 or newer)."""

import sys
from pathlib import Path

import numpy as np
import pytest
from gpu_support import require_gpu
from gguf import GGMLQuantizationType as T

from engine import load_model
from engine.kernels import reference

cp = require_gpu()
pytestmark = pytest.mark.gpu

from engine.kernels import cuda as K  # noqa: E402  (needs CuPy)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.make_synthetic_gguf import write_model  # noqa: E402

if not K.flash_attention_capable(1, 1):
    pytest.skip("flash attention needs compute capability 8.0 or newer", allow_module_level=True)


# (tokens, start, window, head dim, query heads, KV heads, cache positions): ragged chunk ends (not a multiple of a
# block's tokens), GQA ratios 1-8 (3 and 5 leave rows of a block unused), a causal boundary inside a key tile
# (start 50, 17, 300), a chunk filling the cache to its last position, and sliding windows.
CASES = [
    (37, 50, 0, 64, 8, 2, 512),
    (64, 0, 0, 128, 4, 4, 512),
    (100, 300, 0, 128, 32, 8, 512),
    (129, 0, 0, 128, 16, 2, 512),
    (50, 17, 0, 128, 6, 2, 512),
    (77, 200, 0, 64, 10, 2, 512),
    (61, 3, 0, 128, 8, 2, 64),
    (200, 1000, 0, 256, 8, 1, 1536),
    (90, 400, 100, 256, 4, 1, 512),
    (70, 300, 128, 64, 9, 3, 512),
    (2, 0, 0, 64, 2, 1, 64),
]


@pytest.mark.parametrize("n,start,window,hd,heads,kv,max_tokens", CASES)
def test_flash_attention_matches_reference(n, start, window, hd, heads, kv, max_tokens):
    rng = np.random.default_rng()
    # q a strided view into a wider row (as the QKV projection leaves it), out a column slice of a wider array.
    qkv = (rng.standard_normal((n, (heads + 2 * kv) * hd)) * 2).astype(np.float32)
    q = qkv[:, : heads * hd].reshape(n, heads, hd)
    kc = rng.standard_normal((kv, max_tokens, hd)).astype(np.float16)
    vc = rng.standard_normal((kv, max_tokens, hd)).astype(np.float16)
    scale = 1.0 / np.sqrt(hd)
    expect = np.empty((n, heads * hd), np.float32)
    reference.attention(q, kc.astype(np.float32), vc.astype(np.float32), start, expect, scale, window)

    dq = cp.asarray(qkv)[:, : heads * hd].reshape(n, heads, hd)
    wide = cp.full((n, heads * hd + 64), cp.nan, cp.float32)
    out = wide[:, 32 : 32 + heads * hd]
    K.flash_attention(dq, cp.asarray(kc), cp.asarray(vc), cp.asarray([start], cp.int32), out, scale, window)
    got = cp.asnumpy(wide)
    assert np.isnan(got[:, :32]).all() and np.isnan(got[:, 32 + heads * hd :]).all()  # nothing written outside
    # q and the probabilities enter the tensor cores as fp16: errors of a few fp16 ulps of the output.
    err = np.abs(got[:, 32 : 32 + heads * hd] - expect).max()
    assert err < 4e-3, err


def test_flash_attention_reads_the_chunk_start_from_the_device():
    """One launch sequence serves any position: the kernel reads start[0] when it runs, not when it is launched."""
    rng = np.random.default_rng()
    n, heads, kv, hd = 40, 4, 2, 64
    q = rng.standard_normal((n, heads, hd)).astype(np.float32)
    kc = rng.standard_normal((kv, 256, hd)).astype(np.float16)
    vc = rng.standard_normal((kv, 256, hd)).astype(np.float16)
    start = cp.asarray([0], cp.int32)
    out = cp.empty((n, heads * hd), cp.float32)
    args = (cp.asarray(q), cp.asarray(kc), cp.asarray(vc), start, out, 0.125, 0)
    K.flash_attention(*args)
    start.fill(150)
    K.flash_attention(*args)
    expect = np.empty((n, heads * hd), np.float32)
    reference.attention(q, kc.astype(np.float32), vc.astype(np.float32), 150, expect, 0.125, 0)
    assert np.abs(cp.asnumpy(out) - expect).max() < 4e-3


def test_long_prompt_logits_match_the_older_chunk_path(tmp_path, monkeypatch):
    """A 4,096-token prompt (the GPU's chunks, each attending to every earlier one) through a tiny model: the logits at
    every position with flash attention equal those of attention.cu's chunk path within fp16 rounding."""
    path = tmp_path / "tiny.gguf"
    shape = dict(hidden=256, layers=2, ffn=768, heads=4, kv_heads=1, vocab=1000, tied=False)
    write_model(path, shape, T.Q8_0, "tiny", seed=int(np.random.default_rng().integers(1 << 30)))
    ids = np.random.default_rng().integers(2, 1000, 4096).tolist()
    model = load_model(path, device="cuda", context_length=4200)
    launches = []
    flash_attention = K.flash_attention
    monkeypatch.setattr(K, "flash_attention", lambda *args: (launches.append(1), flash_attention(*args)))
    flash, _ = model.prompt_logits(ids, all_positions=True)
    assert len(launches) == 2 * -(-4096 // model._state.workspace.max_chunk)  # every layer of every chunk
    monkeypatch.setattr(K, "flash_attention_capable", lambda n_heads, n_kv: False)
    older, _ = model.prompt_logits(ids, all_positions=True)
    model.close()
    spread = older.max() - older.min()
    diff = np.abs(flash - older).max()
    print(f"4096-token prompt: largest logit difference {diff:.2e} of a logit range {spread:.2f}")
    assert np.isfinite(flash).all() and diff < 2e-3 * spread


@pytest.mark.skipif(not K.cluster_decode_attention(), reason="the deep decode graph is sm_90's")
def test_deep_decode_attention_splits_the_keys_and_matches_the_cluster_kernel(tmp_path, monkeypatch):
    """Decode steps from K.DEEP_DECODE_KEYS' position on (for the tiny model's heads of 64) replay a graph of their
    own whose attention is attention_decode_deep; their logits equal the cluster kernel's (every step on the shallow
    graph) within fp16 rounding, on the step that captures the deep graph and on a replay of it."""
    path = tmp_path / "tiny.gguf"
    shape = dict(hidden=256, layers=2, ffn=768, heads=4, kv_heads=2, vocab=1000, tied=False)
    write_model(path, shape, T.Q8_0, "tiny", seed=int(np.random.default_rng().integers(1 << 30)))
    depth = K.DEEP_DECODE_KEYS[64]
    ids = np.random.default_rng().integers(2, 1000, depth + 6).tolist()
    split_launches = []
    split = K.attention_decode_deep
    monkeypatch.setattr(K, "attention_decode_deep", lambda *a, **kw: (split_launches.append(1), split(*a, **kw)))

    def decode_logits() -> list[np.ndarray]:
        model = load_model(path, device="cuda", context_length=depth + 64)
        try:
            return [model.prompt_logits(ids[:n])[0] for n in (len(ids) - 1, len(ids))]
        finally:
            model.close()

    deep = decode_logits()
    assert len(split_launches) == 2 * 2  # each layer once run directly, once captured; replays launch the graph
    monkeypatch.setattr(K, "deep_decode_from", lambda head_dim: float("inf"))
    shallow = decode_logits()
    assert len(split_launches) == 4
    for ours, theirs in zip(deep, shallow):
        spread = theirs.max() - theirs.min()
        diff = np.abs(ours - theirs).max()
        print(f"decode at depth {depth}: largest logit difference {diff:.2e} of a logit range {spread:.2f}")
        assert np.isfinite(ours).all() and diff < 2e-3 * spread
