"""The mixture-of-experts ops of the NumPy backend against their documented semantics, written out per token,
and the SentencePiece tokenizer's refusal of vocabularies it does not know the rules of."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFWriter

from engine.backend_numpy import NumpyBackend
from engine.errors import EngineError
from engine.gguf_file import GGUFFile, GGUFTensor
from engine.tokenizer import Tokenizer


def _route(logits: np.ndarray, top_k: int, normalize: bool):
    backend = NumpyBackend()
    weights = backend.empty((logits.shape[0], top_k))
    ids = backend.empty((logits.shape[0], top_k), np.int32)
    backend.moe_route(logits, top_k, normalize, weights, ids)
    return weights, ids


def test_route_picks_highest_probabilities_and_renormalizes():
    logits = np.array([[0.0, 3.0, 1.0, 2.0], [5.0, -1.0, 4.0, 0.0]], np.float32)
    probs = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    weights, ids = _route(logits, 2, normalize=False)
    assert ids.tolist() == [[1, 3], [0, 2]]
    np.testing.assert_allclose(weights, np.take_along_axis(probs, ids.astype(np.int64), axis=1), rtol=1e-6)
    normalized, same_ids = _route(logits, 2, normalize=True)
    assert np.array_equal(same_ids, ids)
    np.testing.assert_allclose(normalized.sum(axis=1), 1.0, rtol=1e-6)
    np.testing.assert_allclose(normalized[0, 0] / normalized[0, 1], probs[0, 1] / probs[0, 3], rtol=1e-5)


def test_route_experts_routes_the_router_product():
    """route_experts: the router's product, a row after the experts' computed but not routed, then the routing."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((5, 32)).astype(np.float32)
    x = rng.standard_normal((3, 32)).astype(np.float32)
    backend = NumpyBackend()
    router = backend.upload(GGUFTensor("blk.0.ffn_gate_inp.weight", GGMLQuantizationType.F32, (5, 32),
                                       w.view(np.uint8).reshape(-1)))
    logits, weights, ids = backend.empty((3, 5)), backend.empty((3, 2)), backend.empty((3, 2), np.int32)
    backend.route_experts(x, router, 4, 2, True, logits, weights, ids)
    np.testing.assert_allclose(logits, x @ w.T, rtol=1e-5, atol=1e-6)
    assert ids.tolist() == np.argsort(-(x @ w[:4].T), axis=1, kind="stable")[:, :2].tolist()
    np.testing.assert_allclose(weights.sum(axis=1), 1.0, rtol=1e-6)


def test_route_breaks_ties_by_lower_expert_id():
    weights, ids = _route(np.zeros((1, 8), np.float32), 3, normalize=True)
    assert ids.tolist() == [[0, 1, 2]]
    np.testing.assert_allclose(weights, 1 / 3, rtol=1e-6)


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_moe_ffn_is_the_weighted_sum_of_the_chosen_experts(activation):
    rng = np.random.default_rng(1)
    n, experts, k, f, top_k = 6, 8, 16, 12, 3
    backend = NumpyBackend()

    def weight(name, *shape):
        data = rng.standard_normal(shape).astype(np.float32)
        return backend.upload(GGUFTensor(name, GGMLQuantizationType.F32, shape, data.view(np.uint8).reshape(-1))), data

    (gate, g), (up, u), (down, d) = weight("g", experts, f, k), weight("u", experts, f, k), weight("d", experts, k, f)
    x = rng.standard_normal((n, k)).astype(np.float32)
    ids = np.stack([rng.choice(experts, top_k, replace=False) for _ in range(n)]).astype(np.int32)
    mix = rng.random((n, top_k)).astype(np.float32)
    out = np.full((n, k), np.nan, np.float32)
    backend.moe_ffn(x, gate, up, down, ids, mix, out, np.empty((n, top_k, 2 * f), np.float32), activation)

    def act(v):
        if activation == "silu":
            return v / (1 + np.exp(-v))
        return 0.5 * v * (1 + np.tanh(np.sqrt(2 / np.pi) * (v + 0.044715 * v**3)))

    expected = np.zeros((n, k))
    for i in range(n):
        for j in range(top_k):
            e = ids[i, j]
            expected[i] += mix[i, j] * d[e] @ (act(g[e] @ x[i]) * (u[e] @ x[i]))
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-4)


def test_sentencepiece_vocabulary_of_an_unknown_family_is_refused(tmp_path):
    path = tmp_path / "spm-llama.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(["<unk>", "<s>", "</s>", "\u2581a"])
    writer.add_token_types([2, 3, 3, 1])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(EngineError, match="SentencePiece tokenizer, which this engine supports for gemma"):
        Tokenizer(GGUFFile(path))


def test_expert_layers_in_ram_are_checked_at_load(tmp_path):
    """load_model(expert_layers_in_ram=N) names the MoE layers whose experts stay in RAM on the GPU; on the CPU
    everything is in RAM already, so a valid N changes nothing there, and an impossible one is refused."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from bench.make_synthetic_gguf import write_model
    from engine import load_model

    moe = tmp_path / "moe.gguf"
    write_model(moe, dict(arch="qwen3moe", hidden=64, layers=3, ffn=32, heads=2, kv_heads=1, head_dim=32, vocab=300,
                          tied=False, experts=4, experts_used=2, context=64), GGMLQuantizationType.Q8_0, "moe")
    model = load_model(moe, device="cpu", expert_layers_in_ram=3)
    assert model.info.expert_layers_in_ram == 0 and model.info.host_weight_bytes == 0
    model.close()
    for bad, words in ((4, "only 3 mixture-of-experts layers"), (-1, "0 or more"), (1.5, "whole number")):
        with pytest.raises(EngineError, match=words):
            load_model(moe, device="cpu", expert_layers_in_ram=bad)
    dense = tmp_path / "dense.gguf"
    write_model(dense, dict(hidden=64, layers=2, ffn=128, heads=2, kv_heads=1, vocab=300, tied=True),
                GGMLQuantizationType.Q8_0, "dense")
    with pytest.raises(EngineError, match="has no mixture-of-experts layers"):
        load_model(dense, device="cpu", expert_layers_in_ram=1)
