"""Qwen3-MoE: Qwen3's decoder (engine/arch/qwen3.py) with a routed mixture of experts in place of the dense
FFN in every layer, and no shared expert."""

from __future__ import annotations

from dataclasses import replace

from engine.arch import qwen3
from engine.arch.common import hparam
from engine.arch.decoder import forward, load_weights, new_cache, new_workspace
from engine.arch.parts import MOE, DecoderConfig, Experts
from engine.errors import EngineError
from engine.gguf_file import GGUFFile

__all__ = ["read_config", "load_weights", "new_workspace", "new_cache", "forward"]


def read_config(gguf: GGUFFile) -> DecoderConfig:
    base = qwen3.read_config(gguf)
    count = int(hparam(gguf, "expert_count"))
    top_k = int(hparam(gguf, "expert_used_count"))
    if not 0 < top_k <= count:
        raise EngineError(
            f"The model file {gguf.path.name} routes each token to {top_k} of {count} experts, which is "
            "impossible; the file is damaged or not a supported model."
        )
    width = int(hparam(gguf, "expert_feed_forward_length", gguf.tensor("blk.0.ffn_gate_exps.weight").shape[1]))
    experts = Experts(count, top_k, width, normalize_weights=bool(hparam(gguf, "expert_weights_norm", True)))
    return replace(base, ffn_kinds=(MOE,) * base.n_layers, experts=experts)
