"""Qwen2 and Qwen3 (dense): the decoder with rotary on halves ('neox': llama.cpp stores Qwen's Q/K rows
unpermuted), a fused Q/K/V bias where the file has one (Qwen2) and per-head RMSNorm of Q and K where it has
their norm weights (Qwen3's QK-norm)."""

from __future__ import annotations

from dataclasses import replace

from engine.arch.decoder import forward, load_weights, new_cache, new_workspace
from engine.arch.parts import DecoderConfig, read_decoder_config
from engine.backend import ROPE_NEOX
from engine.gguf_file import GGUFFile

__all__ = ["read_config", "load_weights", "new_workspace", "new_cache", "forward"]


def read_config(gguf: GGUFFile) -> DecoderConfig:
    return replace(
        read_decoder_config(gguf, rope_base=1000000.0, rms_eps=1e-6, ffn_width=0),
        rope_style=ROPE_NEOX,
        qkv_bias="blk.0.attn_q.bias" in gguf.tensors,
        qk_norm="blk.0.attn_q_norm.weight" in gguf.tensors,
    )
