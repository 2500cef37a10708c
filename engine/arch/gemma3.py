"""Gemma 3 (text): the decoder with Qwen3's attention (rotary on halves, QK-norm) and these differences: the
embeddings are scaled by sqrt(hidden); each part's output is RMS-normed before the residual add
(post_attention_norm, post_ffw_norm); the FFN is GELU-tanh gated; layers alternate between sliding-window
attention with their own rotary base (10000, unscaled) and global attention (the file's base and scaling),
every `pattern`-th layer global."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from engine.arch.common import hparam
from engine.arch.decoder import forward, load_weights, new_cache, new_workspace
from engine.arch.parts import DecoderConfig, read_decoder_config
from engine.backend import ROPE_NEOX
from engine.gguf_file import GGUFFile

__all__ = ["read_config", "load_weights", "new_workspace", "new_cache", "forward"]

DEFAULT_SLIDING_PATTERN = 6  # llama.cpp's for Gemma 3 files that do not state one: 5 local layers, then 1 global
DEFAULT_LOCAL_ROPE_BASE = 10000.0


def _sliding_layers(gguf: GGUFFile, n_layers: int) -> tuple[bool, ...]:
    pattern = gguf.get("gemma3.attention.sliding_window_pattern", DEFAULT_SLIDING_PATTERN)
    if isinstance(pattern, int):
        return tuple((i + 1) % pattern != 0 for i in range(n_layers))
    return tuple(bool(x) for x in pattern)  # a per-layer array, as newer converters write it


def read_config(gguf: GGUFFile) -> DecoderConfig:
    base = read_decoder_config(gguf, rope_base=1000000.0, rms_eps=1e-6)
    # Gemma 3 scales scores by query_pre_attn_scalar^-0.5, which is head_dim except in the 27B model
    # (62 layers), where it is hidden / heads; GGUF does not store it, so this follows llama.cpp.
    scalar = base.hidden // base.n_heads if base.n_layers == 62 else base.head_dim
    return replace(
        base,
        rope_style=ROPE_NEOX,
        qk_norm=True,
        post_norms=True,
        activation="gelu_tanh",
        # transformers rounds the scale to the activation dtype before multiplying; float32 here.
        embed_scale=float(np.float32(np.sqrt(base.hidden))),
        attn_scale=1.0 / float(np.sqrt(scalar)),
        sliding_window=int(hparam(gguf, "attention.sliding_window")),
        sliding_layers=_sliding_layers(gguf, base.n_layers),
        local_rope_base=float(hparam(gguf, "rope.freq_base_swa", DEFAULT_LOCAL_ROPE_BASE)),
    )
