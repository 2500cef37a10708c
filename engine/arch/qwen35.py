"""Qwen3.5 / 3.6 / 3.8 (qwen35 dense, qwen35moe) and Qwen3-Next (qwen3next) on the decoder. qwen3next has the same
layers as qwen35moe; only its DeltaNet tensors are laid out differently (engine/arch/deltanet.py reads both).

Layer i's mixer is Gated DeltaNet (engine/arch/deltanet.py) where `attention.recurrent_layers` says so (in files
written before that key: unless (i + 1) % full_attention_interval == 0; the converter writes 4 there whatever the
model's layer_types), otherwise gated full attention (engine/arch/gated_attention.py) with QK-norm and the rotary
on halves. Its FFN, behind `post_attention_norm`, is SwiGLU in dense files and in MoE files routed experts
(softmax, top-k, renormalized) plus a shared expert scaled by sigmoid(ffn_gate_inp_shexp . h).

The files store every norm weight + 1 (the models scale by 1 + weight) except `ssm_norm`, so they are plain
RMSNorm weights here. Text positions are the same on MRoPE's three axes, so the rotary is the ordinary one and
`rope.dimension_sections` does not matter. MTP layers (`nextn_predict_layers`, after the others) are not run.
"""

from __future__ import annotations

from dataclasses import replace

from engine.arch.common import hparam
from engine.arch.decoder import forward, load_weights, new_cache, new_workspace
from engine.arch.parts import (DELTANET, DENSE, GATED_ATTENTION, MOE_SHARED, DecoderConfig, DeltaNetShape, Experts,
                               read_decoder_config)
from engine.backend import ROPE_NEOX
from engine.errors import EngineError
from engine.gguf_file import GGUFFile

__all__ = ["read_config", "load_weights", "new_workspace", "new_cache", "forward"]


def read_config(gguf: GGUFFile) -> DecoderConfig:
    base = read_decoder_config(gguf, rope_base=10000000.0, rms_eps=1e-6, ffn_width=0)
    n_layers = base.n_layers - int(hparam(gguf, "nextn_predict_layers", 0))
    n_v = int(hparam(gguf, "ssm.time_step_rank"))
    n_k = int(hparam(gguf, "ssm.group_count"))
    count = int(hparam(gguf, "expert_count", 0))
    top_k = int(hparam(gguf, "expert_used_count", 0))
    if n_k <= 0 or n_v % n_k or (count and not 0 < top_k <= count):
        raise EngineError(
            f"The model file {gguf.path.name} has inconsistent recurrent-layer or expert counts; the file is damaged "
            "or not a supported model."
        )
    recurrent = gguf.get(f"{gguf.architecture}.attention.recurrent_layers")
    if recurrent is None:
        interval = int(hparam(gguf, "full_attention_interval", 4))
        recurrent = [(i + 1) % interval != 0 for i in range(n_layers)]
    deltanet = DeltaNetShape(
        conv_kernel=int(hparam(gguf, "ssm.conv_kernel")),
        n_k_heads=n_k,
        n_v_heads=n_v,
        head_k_dim=int(hparam(gguf, "ssm.state_size")),
        head_v_dim=int(hparam(gguf, "ssm.inner_size")) // n_v,
        tiled=gguf.architecture != "qwen3next",
    )
    experts = None
    if count:
        experts = Experts(count, top_k, int(hparam(gguf, "expert_feed_forward_length", 0)), normalize_weights=True,
                          shared_width=int(hparam(gguf, "expert_shared_feed_forward_length", 0)))
    return replace(
        base,
        n_layers=n_layers,
        rope_style=ROPE_NEOX,
        mixer_kinds=tuple(DELTANET if r else GATED_ATTENTION for r in recurrent[:n_layers]),
        ffn_kinds=(MOE_SHARED if count else DENSE,) * n_layers,
        experts=experts,
        deltanet=deltanet,
        ffn_norm="post_attention_norm",
    )
