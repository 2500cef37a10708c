"""Write a Hugging Face transformers model (a tiny random one, in the tests) to GGUF the way llama.cpp's
converter lays it out: llama.cpp's tensor names, the Q/K row permutation of llama, the +1 Gemma folds into
its norm weights, the stacked expert tensors of MoE models, Llama 3's rope_freqs, each architecture's
metadata keys, and for the hybrid Gated DeltaNet families (qwen35, qwen35moe, qwen3next) what llama.cpp's
conversion/qwen.py does to them (see _hybrid_tensors). The tokenizer metadata is copied from another GGUF, so
token ids mean the same on both sides.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter

# transformers' per-layer names -> llama.cpp's, for the layer parts every architecture here shares.
_LAYER_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "input_layernorm": "attn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",
}
# Where the norm after attention sits: before the MLP in llama/qwen, around the block outputs in Gemma 3.
_NORMS = {
    "gemma3": {
        "post_attention_layernorm": "post_attention_norm",
        "pre_feedforward_layernorm": "ffn_norm",
        "post_feedforward_layernorm": "post_ffw_norm",
    },
}
_DEFAULT_NORMS = {"post_attention_layernorm": "ffn_norm"}


def _permute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's Q/K permutation for llama: within each head, the rows of the first and second half are
    interleaved, so that rotating adjacent pairs equals Hugging Face's rotate_half."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_factors(config) -> np.ndarray:
    """The per-frequency divisors llama.cpp stores as rope_freqs.weight for Llama 3's rope scaling."""
    rope = config.rope_parameters
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    inv_freq = 1.0 / rope["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    old_len = rope["original_max_position_embeddings"]
    low_wavelen = old_len / rope["low_freq_factor"]
    high_wavelen = old_len / rope["high_freq_factor"]
    factors = []
    for wavelen in 2 * math.pi / inv_freq:
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(rope["factor"])
        else:
            smooth = (old_len / wavelen - rope["low_freq_factor"]) / (rope["high_freq_factor"] - rope["low_freq_factor"])
            factors.append(1.0 / ((1 - smooth) / rope["factor"] + smooth))
    return np.array(factors, dtype=np.float32)


def _copy_tokenizer(writer: GGUFWriter, source: Path, chat_template: str | None = None) -> None:
    reader = GGUFReader(source)
    for name, field in reader.fields.items():
        if not name.startswith("tokenizer.") or (chat_template is not None and name == "tokenizer.chat_template"):
            continue
        kind = field.types[0]
        if kind == GGUFValueType.ARRAY:
            writer.add_key_value(name, field.contents(), kind, sub_type=field.types[-1])
        else:
            writer.add_key_value(name, field.contents(), kind)
    if chat_template is not None:
        writer.add_chat_template(chat_template)


HYBRID_ARCHS = ("qwen35", "qwen35moe", "qwen3next")


def _metadata(writer: GGUFWriter, arch: str, config, context_length: int) -> None:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    u32 = GGUFValueType.UINT32
    f32 = GGUFValueType.FLOAT32
    values = {
        "context_length": (context_length, u32),
        "block_count": (config.num_hidden_layers, u32),
        "embedding_length": (config.hidden_size, u32),
        "attention.head_count": (config.num_attention_heads, u32),
        "attention.head_count_kv": (config.num_key_value_heads, u32),
        "attention.key_length": (head_dim, u32),
        "attention.value_length": (head_dim, u32),
        "attention.layer_norm_rms_epsilon": (config.rms_norm_eps, f32),
        "rope.dimension_count": (head_dim, u32),
    }
    if getattr(config, "intermediate_size", None) is not None:  # qwen35moe's config has none
        values["feed_forward_length"] = (config.intermediate_size, u32)
    rope = config.rope_parameters
    if arch == "gemma3":
        values["rope.freq_base"] = (rope["full_attention"]["rope_theta"], f32)
        values["attention.sliding_window"] = (config.sliding_window, u32)
    else:
        values["rope.freq_base"] = (rope["rope_theta"], f32)
    if arch in HYBRID_ARCHS:
        values.update(_hybrid_metadata(arch, config, head_dim))
    if arch in ("qwen3moe", "qwen35moe", "qwen3next"):
        values["expert_count"] = (config.num_experts, u32)
        values["expert_used_count"] = (config.num_experts_per_tok, u32)
        values["expert_feed_forward_length"] = (config.moe_intermediate_size, u32)
    for key, (value, kind) in values.items():
        writer.add_key_value(f"{arch}.{key}", value, kind)
    if arch in HYBRID_ARCHS:
        writer.add_array(f"{arch}.attention.recurrent_layers", [t == "linear_attention" for t in config.layer_types])
    if arch in ("qwen35", "qwen35moe"):
        # Written by the converter even when the config names no MRoPE sections (text positions ignore them).
        writer.add_array(f"{arch}.rope.dimension_sections", [11, 11, 10, 0])


def _hybrid_metadata(arch: str, config, head_dim: int) -> dict:
    u32 = GGUFValueType.UINT32
    values = {
        "rope.dimension_count": (int(head_dim * config.rope_parameters.get("partial_rotary_factor", 0.25)), u32),
        "ssm.conv_kernel": (config.linear_conv_kernel_dim, u32),
        "ssm.state_size": (config.linear_key_head_dim, u32),
        "ssm.group_count": (config.linear_num_key_heads, u32),
        "ssm.time_step_rank": (config.linear_num_value_heads, u32),
        "ssm.inner_size": (config.linear_value_head_dim * config.linear_num_value_heads, u32),
        # What the model's config says, or 4: transformers folds it into layer_types, which the file has as
        # attention.recurrent_layers.
        "full_attention_interval": (getattr(config, "full_attention_interval", 4), u32),
    }
    if arch != "qwen35":
        values["expert_shared_feed_forward_length"] = (config.shared_expert_intermediate_size, u32)
    return values


def _tensors(arch: str, config, state: dict[str, np.ndarray]):
    """(gguf name, float32 array) pairs in llama.cpp's layout."""
    if arch in HYBRID_ARCHS:
        yield from _hybrid_tensors(arch, config, state)
        return
    norms = _NORMS.get(arch, _DEFAULT_NORMS)
    layer = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")
    for name, w in state.items():
        if name == "model.embed_tokens.weight":
            yield "token_embd.weight", w
        elif name == "model.norm.weight":
            yield "output_norm.weight", w + 1 if arch == "gemma3" else w
        elif name == "lm_head.weight":
            if not getattr(config, "tie_word_embeddings", False):
                yield "output.weight", w
        elif name.endswith("mlp.experts.gate_up_proj"):
            i = name.split(".")[2]
            gate, up = np.split(w, 2, axis=1)  # transformers stacks gate then up along the rows
            yield f"blk.{i}.ffn_gate_exps.weight", gate
            yield f"blk.{i}.ffn_up_exps.weight", up
        elif name.endswith("mlp.experts.down_proj"):
            yield f"blk.{name.split('.')[2]}.ffn_down_exps.weight", w
        else:
            match = layer.match(name)
            if match is None:
                raise ValueError(f"no GGUF name for {name}")
            i, part, kind = match.groups()
            base = _LAYER_NAMES.get(part) or norms.get(part)
            if base is None:
                raise ValueError(f"no GGUF name for {name}")
            if arch == "llama" and base in ("attn_q", "attn_k"):
                heads = config.num_attention_heads if base == "attn_q" else config.num_key_value_heads
                w = _permute_rows(w, heads)
            if arch == "gemma3" and base.endswith("norm"):
                w = w + 1  # Gemma scales by (1 + weight); llama.cpp stores the sum
            yield f"blk.{i}.{base}.{kind}", w


_HYBRID_NAMES = {
    "linear_attn.in_proj_qkv": "attn_qkv",
    "linear_attn.in_proj_z": "attn_gate",
    "linear_attn.in_proj_b": "ssm_beta",
    "linear_attn.in_proj_a": "ssm_alpha",
    "linear_attn.in_proj_ba": "ssm_ba",
    "linear_attn.A_log": "ssm_a",
    "linear_attn.dt_bias": "ssm_dt.bias",
    "linear_attn.conv1d": "ssm_conv1d",
    "linear_attn.norm": "ssm_norm",
    "linear_attn.out_proj": "ssm_out",
    "post_attention_layernorm": "post_attention_norm",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}


def _tiled_value_heads(w: np.ndarray, axis: int, n_k: int, head_dim: int) -> np.ndarray:
    """llama.cpp's qwen35 value-head order: transformers groups value heads by key head (k0: v0 v1, k1: v2 v3);
    the file tiles them (v0 v2 v1 v3), so that value head h reads key head h % n_k."""
    w = np.moveaxis(w, axis, 0)
    per_k = w.shape[0] // head_dim // n_k
    w = w.reshape(n_k, per_k, head_dim, *w.shape[1:]).swapaxes(0, 1).reshape(w.shape)
    return np.moveaxis(w, 0, axis)


def _hybrid_tensors(arch: str, config, state: dict[str, np.ndarray]):
    """What conversion/qwen.py writes for these families: `ssm_a` = -exp(A_log); every norm weight + 1 (the
    models scale by 1 + weight) except the DeltaNet output norm `ssm_norm`; the conv kernel squeezed to
    (channels, 4); qwen3next's fused in_proj_qkvz split into attn_qkv (all q heads, all k heads, all v heads) and
    attn_gate, its in_proj_ba kept as one `ssm_ba`; in qwen35/qwen35moe files the value heads tiled
    (_tiled_value_heads) in every tensor that has them, when there are more value than key heads."""
    import torch

    n_k, n_v = config.linear_num_key_heads, config.linear_num_value_heads
    dk, dv = config.linear_key_head_dim, config.linear_value_head_dim
    tile = arch != "qwen3next" and n_v != n_k
    key_dim = n_k * dk
    layer = re.compile(r"^model\.layers\.(\d+)\.(.+?)(\.weight)?$")
    for name, w in state.items():
        match = layer.match(name)
        if match is None or "mlp.experts" in name:
            # Embeddings, output and experts as for qwen3moe; the final norm + 1 like the others.
            yield from _tensors("qwen3moe", config, {name: w + 1 if name == "model.norm.weight" else w})
            continue
        i, part, suffix = match.groups()
        if part == "linear_attn.in_proj_qkvz":
            groups = w.reshape(n_k, -1, w.shape[1])
            sizes = np.cumsum([dk, dk, n_v // n_k * dv])
            q, k, v, z = np.split(groups, sizes, axis=1)
            yield f"blk.{i}.attn_qkv.weight", np.concatenate([x.reshape(-1, w.shape[1]) for x in (q, k, v)])
            yield f"blk.{i}.attn_gate.weight", z.reshape(-1, w.shape[1])
            continue
        if tile:
            if part in ("linear_attn.in_proj_qkv", "linear_attn.conv1d"):  # only their value rows
                w = np.concatenate([w[: 2 * key_dim], _tiled_value_heads(w[2 * key_dim :], 0, n_k, dv)])
            elif part == "linear_attn.in_proj_z":
                w = _tiled_value_heads(w, 0, n_k, dv)
            elif part in ("linear_attn.in_proj_b", "linear_attn.in_proj_a", "linear_attn.A_log", "linear_attn.dt_bias"):
                w = _tiled_value_heads(w, 0, n_k, 1)
            elif part == "linear_attn.out_proj":
                w = _tiled_value_heads(w, 1, n_k, dv)
        if part == "linear_attn.A_log":
            w = -torch.exp(torch.from_numpy(w)).numpy()  # torch's float32 exp, to the last bit of the converter's
        elif part == "linear_attn.conv1d":
            w = w.reshape(w.shape[0], -1)
        elif part.endswith("norm") and part != "linear_attn.norm":
            w = w + 1
        base = _HYBRID_NAMES.get(part) or _LAYER_NAMES.get(part)
        if base is None:
            raise ValueError(f"no GGUF name for {name}")
        # A_log and dt_bias have no ".weight": the file names them blk.N.ssm_a and blk.N.ssm_dt.bias.
        yield f"blk.{i}.{base}{suffix or ''}", w


def write_gguf(
    model, arch: str, path: Path, tokenizer_source: Path, context_length: int = 256, f16: bool = False,
    chat_template: str | None = None,
) -> Path:
    """Write `model` (a transformers causal LM) as a GGUF of architecture `arch` at `path`; with f16 the
    matrices are stored as F16 (norms, biases, the router and the DeltaNet convolution stay F32, as llama.cpp's
    converter keeps them); chat_template replaces the tokenizer source's template."""
    config = model.config
    state = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    writer = GGUFWriter(str(path), arch)
    writer.add_name(f"tiny-{arch}")
    _metadata(writer, arch, config, context_length)
    _copy_tokenizer(writer, tokenizer_source, chat_template)
    for name, w in _tensors(arch, config, state):
        w = np.ascontiguousarray(w, dtype=np.float32)
        if f16 and w.ndim >= 2 and "ffn_gate_inp" not in name and "ssm_conv1d" not in name:
            writer.add_tensor(name, w.astype(np.float16), raw_dtype=GGMLQuantizationType.F16)
        else:
            writer.add_tensor(name, w)
    rope = config.rope_parameters
    if arch == "llama" and rope.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", llama3_rope_factors(config))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_tokenizer_gguf(source: Path, path: Path) -> Path:
    """A GGUF of `source`'s tokenizer metadata alone (no tensors): a small stand-in for `write_gguf`'s
    tokenizer_source where the whole model file cannot travel (the GPU machine)."""
    writer = GGUFWriter(str(path), GGUFReader(source).fields["general.architecture"].contents())
    _copy_tokenizer(writer, source)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return path
