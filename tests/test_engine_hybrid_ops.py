"""The hybrid families' parts on their own: the Gated DeltaNet references against transformers' torch ones and
against each other, the recurrent state's snapshot rules, the tests' converter against gguf-py's tensor names,
the `qwen35` pre-tokenizer against transformers' Qwen3.5 tokenizer, and the CPU-only choice of backend."""

from __future__ import annotations

import re

import gguf
import numpy as np
import pytest

from engine.backend_numpy import NumpyBackend
from engine.capabilities import profile
from engine.errors import EngineError
from engine.kernels import reference
from engine.kv_cache import RecurrentCache

rng = np.random.default_rng(0)


def _random_rule_inputs(n: int, heads: int = 4, dk: int = 16, dv: int = 8):
    q = rng.standard_normal((n, heads, dk)).astype(np.float32)
    k = rng.standard_normal((n, heads, dk)).astype(np.float32)
    q /= np.linalg.norm(q, axis=-1, keepdims=True)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((n, heads, dv)).astype(np.float32)
    beta = rng.uniform(0, 1, (n, heads)).astype(np.float32)
    g = -rng.uniform(0, 1.5, (n, heads)).astype(np.float32)
    state = rng.standard_normal((heads, dk, dv)).astype(np.float32)
    return q, k, v, beta, g, state


def _relative(a, b) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.mark.parametrize("n", [1, 5, 64, 150])
def test_chunked_and_recurrent_forms_agree(n):
    q, k, v, beta, g, state = _random_rule_inputs(n)
    s_rec, s_chunk = state.copy(), state.copy()
    o_rec, o_chunk = np.empty_like(v), np.empty_like(v)
    reference.delta_rule_recurrent(q, k, v, beta, g, s_rec, o_rec)
    reference.delta_rule_chunked(q, k, v, beta, g, s_chunk, o_chunk)
    assert _relative(o_chunk, o_rec) < 1e-5
    assert _relative(s_chunk, s_rec) < 1e-5


def test_delta_rule_matches_transformers():
    import torch
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    q, k, v, beta, g, state = _random_rule_inputs(150)
    theirs, their_state = torch_chunk_gated_delta_rule(
        *(torch.from_numpy(x)[None] for x in (q, k, v, g, beta)),
        initial_state=torch.from_numpy(state)[None], output_final_state=True, use_qk_l2norm_in_kernel=False,
    )
    # transformers scales q by dk^-1/2 inside; the reference takes it scaled (delta_rule_inputs does that).
    out = np.empty_like(v)
    reference.delta_rule_chunked(q * q.shape[-1] ** -0.5, k, v, beta, g, state, out)
    assert _relative(out, theirs[0].numpy()) < 1e-5
    assert _relative(state, their_state[0].numpy()) < 1e-5


def test_causal_conv_continues_from_its_state():
    import torch

    channels, kernel, n = 12, 4, 10
    x = rng.standard_normal((n, channels)).astype(np.float32)
    weight = rng.standard_normal((channels, kernel)).astype(np.float32)
    conv = torch.nn.functional.conv1d(torch.from_numpy(x.T)[None], torch.from_numpy(weight)[:, None], padding=kernel - 1,
                                      groups=channels)[0, :, :n]
    expected = torch.nn.functional.silu(conv).numpy().T
    # Two chunks (7 tokens, then 3) through the rolling state give the convolution of the whole sequence.
    state = np.zeros((kernel - 1, channels), np.float32)
    out = np.empty_like(x)
    reference.causal_conv_silu(x[:7], weight, state, out[:7])
    reference.causal_conv_silu(x[7:], weight, state, out[7:])
    assert _relative(out, expected) < 1e-5
    assert np.array_equal(state, x[-3:])


def test_gates_follow_the_file_conventions():
    # ssm_a is stored as -exp(A_log); value head h reads key head h % n_k when tiled, h // (n_v / n_k) when not.
    n_k, n_v, dk, dv = 2, 4, 4, 3
    qkv = rng.standard_normal((1, 2 * n_k * dk + n_v * dv)).astype(np.float32)
    ba = rng.standard_normal((1, 2 * n_v)).astype(np.float32)
    dt_bias = rng.standard_normal(n_v).astype(np.float32)
    a_log = rng.standard_normal(n_v).astype(np.float32)
    _, k_tiled, _, beta, g = reference.delta_rule_inputs(qkv, ba, dt_bias, -np.exp(a_log), n_k, dk, tiled=True)
    _, k_grouped, *_ = reference.delta_rule_inputs(qkv, ba, dt_bias, -np.exp(a_log), n_k, dk, tiled=False)
    keys = qkv[0, n_k * dk : 2 * n_k * dk].reshape(n_k, dk)
    keys = keys / np.linalg.norm(keys, axis=-1, keepdims=True)
    assert np.allclose(k_tiled[0], keys[[0, 1, 0, 1]], atol=1e-6)
    assert np.allclose(k_grouped[0], keys[[0, 0, 1, 1]], atol=1e-6)
    assert np.allclose(beta[0], 1 / (1 + np.exp(-ba[0, :n_v])))
    assert np.allclose(g[0], -np.exp(a_log) * np.log1p(np.exp(ba[0, n_v:] + dt_bias)), rtol=1e-5)


def _cache() -> RecurrentCache:
    shape_conv, shape_ssm = (2, 3, 5), (2, 2, 4, 4)
    cache = RecurrentCache(kv=None, conv=np.zeros(shape_conv), ssm=np.zeros(shape_ssm), saved_conv=np.zeros(shape_conv),
                           saved_ssm=np.zeros(shape_ssm), assign=NumpyBackend().assign)
    return cache


def test_recurrent_cache_reuses_the_live_state_the_snapshot_or_nothing():
    cache = _cache()
    cache.ssm[...] = 1
    cache.save(10)  # the end of a prompt of 10 tokens
    cache.ssm[...] = 2  # then 5 generated tokens: the live state stands for 15
    assert cache.rewind(15, 15) == 15 and cache.ssm.max() == 2  # the whole conversation continues
    assert cache.rewind(12, 15) == 10 and cache.ssm.max() == 1  # the reply changed: back to the prompt's end
    assert cache.rewind(9, 10) == 0  # the prompt itself changed: nothing to reuse...
    assert cache.saved_at is None  # ...and the snapshot no longer matches the tokens that follow
    cache.save(4)
    cache.reset()
    assert cache.saved_at is None and cache.ssm.max() == 0 and cache.conv.max() == 0


def test_converter_writes_llama_cpp_tensor_names(tmp_path, smollm2_gguf):
    import torch

    from gguf_convert import write_gguf
    from test_engine_hybrid import _build

    torch.manual_seed(0)
    for arch in ("qwen35", "qwen35moe", "qwen3next"):
        path = write_gguf(_build(arch), arch, tmp_path / f"{arch}.gguf", smollm2_gguf)
        reader = gguf.GGUFReader(path)
        model_arch = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == arch)
        known = {gguf.TENSOR_NAMES[t] for t in gguf.MODEL_TENSORS[model_arch]}
        for tensor in reader.tensors:
            base = re.sub(r"^blk\.\d+\.", "blk.{bid}.", tensor.name.removesuffix(".weight").removesuffix(".bias"))
            assert base in known, (arch, tensor.name)
        names = {t.name for t in reader.tensors}
        assert ("blk.0.ssm_ba.weight" in names) == (arch == "qwen3next")
        assert ("blk.0.ssm_beta.weight" in names) == (arch != "qwen3next")
        assert "blk.0.ssm_a" in names and "blk.1.attn_q.weight" in names and "blk.1.attn_qkv.weight" not in names
        assert reader.fields[f"{arch}.full_attention_interval"].contents() == 4


def test_qwen35_pre_tokenizer_matches_transformers(tmp_path, smollm2_gguf):
    from gguf import GGUFReader, GGUFWriter
    from transformers import Qwen3_5Tokenizer

    from engine.gguf_file import GGUFFile
    from engine.tokenizer import Tokenizer

    # SmolLM2's vocabulary under Qwen3.5's pre-tokenizer name, against transformers' Qwen3.5 tokenizer on the same
    # vocabulary: combining marks stay in their words, digits split one by one.
    source = GGUFReader(smollm2_gguf)
    writer = GGUFWriter(str(tmp_path / "qwen35-vocab.gguf"), "qwen35")
    for name, field in source.fields.items():
        if name.startswith("tokenizer.") and name != "tokenizer.ggml.pre":
            kind = field.types[0]
            sub = {"sub_type": field.types[-1]} if kind == gguf.GGUFValueType.ARRAY else {}
            writer.add_key_value(name, field.contents(), kind, **sub)
    writer.add_key_value("tokenizer.ggml.pre", "qwen35", gguf.GGUFValueType.STRING)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    ours = Tokenizer(GGUFFile(tmp_path / "qwen35-vocab.gguf"))
    tokens = source.fields["tokenizer.ggml.tokens"].contents()
    merges = [tuple(m.split(" ", 1)) for m in source.fields["tokenizer.ggml.merges"].contents()]
    theirs = Qwen3_5Tokenizer(vocab={t: i for i, t in enumerate(tokens)}, merges=merges)
    for text in ["x̃y and ẍ!̃ 2026 café", "def f(n):\n    return n+12345  # ok"]:
        assert ours.encode(text) == theirs(text, add_special_tokens=False)["input_ids"], text


def test_hybrids_run_on_both_paths():
    assert {"qwen35", "qwen35moe", "qwen3next"} <= profile()["supported_architectures"]
    assert {"qwen35", "qwen35moe", "qwen3next"} <= profile()["gpu_architectures"]


def test_choose_model_offers_the_catalogs_hybrids_on_the_gpu():
    from setup_logic.catalog import load_catalog
    from setup_logic.engine_profile import EngineProfile
    from setup_logic.choice import recommend
    from setup_logic.fit import Preferences
    from test_fit import pc

    engine = EngineProfile(**profile())
    hybrids = {m.id for m in load_catalog() if m.architecture in ("qwen35", "qwen35moe", "qwen3next")}
    assert hybrids
    rec = recommend(pc(64, 55, [("RTX 4090", 24, 23.5)]), load_catalog(), Preferences(goal="code"), engine)
    assert not hybrids & {r.id for r in rec.not_supported}
    offered = {c.model_id: c for c in ([rec.choice] if rec.choice else []) + rec.alternatives}
    on_gpu = {m for m in offered.keys() & hybrids if offered[m].level in ("gpu", "gpu+ram")}
    assert on_gpu, {m: offered[m].level for m in offered.keys() & hybrids}


def test_older_files_place_attention_by_the_interval_and_mtp_layers_are_left_out(tmp_path):
    from gguf import GGUFWriter

    from engine.arch import qwen35
    from engine.gguf_file import GGUFFile

    # A file without attention.recurrent_layers, with one MTP layer after its four layers.
    writer = GGUFWriter(str(tmp_path / "old.gguf"), "qwen35")
    u32 = gguf.GGUFValueType.UINT32
    for key, value in {"block_count": 5, "nextn_predict_layers": 1, "context_length": 256, "embedding_length": 8,
                       "feed_forward_length": 16, "attention.head_count": 2, "attention.head_count_kv": 1,
                       "attention.key_length": 4, "ssm.conv_kernel": 4, "ssm.state_size": 4, "ssm.group_count": 1,
                       "ssm.time_step_rank": 2, "ssm.inner_size": 8, "full_attention_interval": 2}.items():
        writer.add_key_value(f"qwen35.{key}", value, u32)
    writer.add_tensor("token_embd.weight", np.zeros((10, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    file = GGUFFile(tmp_path / "old.gguf")
    config = qwen35.read_config(file)
    file.close()
    assert config.n_layers == 4 and config.mixer_kinds == ("deltanet", "gated_attention") * 2
    assert config.deltanet.tiled and config.experts is None and config.deltanet.head_v_dim == 4
    assert [config.slot(i) for i in range(4)] == [0, 0, 1, 1]


def test_projections_stored_in_different_types_load_apart_and_give_the_same_logits(tmp_path, smollm2_gguf, monkeypatch):
    import torch

    from engine import load_model
    from engine.arch import common
    from gguf_convert import write_gguf
    from test_engine_hybrid import _build

    # llama.cpp's Q4_K_M keeps some attn_v (and may keep ssm_beta/alpha) in another type than their neighbours: the
    # matrices then cannot share one fused projection. Refusing to join any two takes that path on the same weights.
    torch.manual_seed(0)
    path = write_gguf(_build("qwen35"), "qwen35", tmp_path / "qwen35.gguf", smollm2_gguf)
    fused = load_model(path, device="cpu", context_length=256)
    ids = fused.tokenizer.encode("The capital of France is Paris. The capital of Germany is")
    expected, _ = fused.prompt_logits(ids, all_positions=True)
    fused.close()
    monkeypatch.setattr(common, "joinable", lambda tensors: len(tensors) == 1)  # every projection apart
    progress = []
    apart = load_model(path, device="cpu", context_length=256, on_progress=lambda done, total, _: progress.append((done, total)))
    logits, _ = apart.prompt_logits(ids, all_positions=True)
    products = {type(layer.mixer).__name__: len((getattr(layer.mixer, "qkv", None) or layer.mixer.weights.in_proj).weights)
                for layer in apart._state.weights.layers}
    apart.close()
    assert products == {"DeltaNet": 3, "GatedAttention": 4}
    assert progress[-1][0] == progress[-1][1]
    # The same sums in another blocking of the matrix products: equal to float32 rounding.
    assert np.abs(logits - expected).max() / (expected.max() - expected.min()) < 1e-5
