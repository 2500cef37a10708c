"""The decoder's seams: every registered family is an `Architecture`, layer part kinds come from the decoder's
registries (an unknown one is refused in one sentence), and loading reports progress up to its total exactly."""

from __future__ import annotations

import inspect
from dataclasses import replace

import pytest

from engine.arch import ARCHITECTURES, Architecture
from engine.arch.decoder import load_weights, new_workspace
from engine.backend_numpy import NumpyBackend
from engine.errors import EngineError
from engine.gguf_file import GGUFFile
from gguf_convert import write_gguf
from test_engine_arch_tiny import _build, _randomize_norms

PROTOCOL_METHODS = ("read_config", "load_weights", "new_workspace", "forward")


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_every_registered_family_is_an_architecture(name):
    module = ARCHITECTURES[name]
    assert isinstance(module, Architecture)
    for method in PROTOCOL_METHODS:
        expected = list(inspect.signature(getattr(Architecture, method)).parameters)[1:]  # without self
        assert list(inspect.signature(getattr(module, method)).parameters) == expected, (name, method)


@pytest.fixture(scope="module", params=["qwen3moe", "gemma3"])
def tiny(request, tmp_path_factory, smollm2_gguf):
    import torch

    torch.manual_seed(0)
    hf = _build(request.param).eval()
    _randomize_norms(hf)
    path = write_gguf(hf, request.param, tmp_path_factory.mktemp(request.param) / "tiny.gguf", smollm2_gguf)
    gguf = GGUFFile(path)
    yield gguf
    gguf.close()


def test_load_progress_reaches_its_total_exactly(tiny):
    seen = []
    arch = ARCHITECTURES[tiny.architecture]
    arch.load_weights(tiny, arch.read_config(tiny), NumpyBackend(), 64, lambda done, total, _: seen.append((done, total)))
    totals = {total for _, total in seen}
    assert len(totals) == 1 and seen[-1][0] == totals.pop()
    assert [done for done, _ in seen] == sorted(done for done, _ in seen)


@pytest.mark.parametrize("field, kind, message", [
    ("mixer_kinds", "mamba", "Layer 1 asks for a mixer of kind 'mamba'.*it has attention, deltanet, gated_attention"),
    ("ffn_kinds", "shared_moe", "Layer 1 asks for an FFN of kind 'shared_moe'.*it has dense, moe, moe_shared"),
])
def test_an_unknown_part_kind_is_refused(tiny, field, kind, message):
    config = ARCHITECTURES[tiny.architecture].read_config(tiny)
    kinds = list(getattr(config, field))
    kinds[1] = kind
    config = replace(config, **{field: tuple(kinds)})
    with pytest.raises(EngineError, match=message):
        load_weights(tiny, config, NumpyBackend(), 64)
    with pytest.raises(EngineError, match=message):
        new_workspace(config, NumpyBackend(), 8)


def test_moe_layers_without_experts_are_refused(tiny):
    config = ARCHITECTURES[tiny.architecture].read_config(tiny)
    config = replace(config, ffn_kinds=("moe",) * config.n_layers, experts=None)
    with pytest.raises(EngineError, match="mixture-of-experts layers but no `experts`"):
        new_workspace(config, NumpyBackend(), 8)
    config = replace(config, ffn_kinds=("dense",) * config.n_layers, mixer_kinds=("deltanet",) * config.n_layers)
    with pytest.raises(EngineError, match="Gated DeltaNet layers but no `deltanet`"):
        new_workspace(config, NumpyBackend(), 8)


def test_a_joined_projection_runs_one_product_for_each_run_of_one_type():
    """Parts of types Q8_0, Q8_0, Q4_0, Q4_0, Q8_0 (as a Q4_K_M file's Q, K and V differ): three matrices, the
    outputs where each part's rows are, biases joined alike; the products equal gguf's dequantized rows times x."""
    import gguf.quants
    import numpy as np
    from gguf import GGMLQuantizationType as T

    from engine.arch.common import JoinedProjection, WeightLoader
    from engine.gguf_file import GGUFTensor

    rng = np.random.default_rng(0)
    types, rows = [T.Q8_0, T.Q8_0, T.Q4_0, T.Q4_0, T.Q8_0], [32, 64, 32, 96, 32]
    values = [rng.standard_normal((m, 256)).astype(np.float32) for m in rows]
    parts = [GGUFTensor(f"p{i}", t, v.shape, gguf.quants.quantize(v, t).reshape(-1))
             for i, (t, v) in enumerate(zip(types, values))]
    bias_values = [rng.standard_normal(m).astype(np.float32) for m in rows]
    biases = [GGUFTensor(f"b{i}", T.F32, b.shape, b.view(np.uint8)) for i, b in enumerate(bias_values)]
    backend = NumpyBackend()
    loader = WeightLoader(backend, 2 * len(parts), None, None)
    joined = JoinedProjection.load(loader, "joined", parts, biases=biases)
    assert len(joined.weights) == 3 and joined.bounds == [0, 96, 224, 256]
    assert loader.done == 2 * len(parts)
    x = rng.standard_normal((3, 256)).astype(np.float32)
    out = np.full((3, 260), np.nan, np.float32)
    joined.run(backend, x, out)
    dense = np.concatenate([gguf.quants.dequantize(p.raw, p.qtype).reshape(p.shape) for p in parts])
    want = x.astype(np.float64) @ dense.T.astype(np.float64) + np.concatenate(bias_values)
    assert np.isnan(out[:, 256:]).all()
    np.testing.assert_allclose(out[:, :256], want, rtol=0, atol=2e-2 * np.abs(want).max())
