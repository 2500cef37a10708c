"""Gemma 3 (text) as backend calls.

Differences from Qwen3, whose attention block it shares: the embeddings are scaled by sqrt(hidden); each block's
output is RMS-normed before the residual add (post_attention_norm, post_ffw_norm); the MLP is GELU-tanh
gated; layers alternate between sliding-window attention with their own rotary base (10000, unscaled) and
global attention (the file's base and scaling), every `pattern`-th layer global. GGUF norm weights already
include Gemma's +1 (llama.cpp's converter adds it), so the plain rms_norm applies.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from engine.arch.common import (
    TransformerConfig,
    Workspace,
    WeightLoader,
    hparam,
    new_workspace,
    read_transformer_fields,
    rope_inv_freq,
)
from engine.arch.qwen3 import AttentionWeights, attention_block, attention_uploads, load_attention
from engine.backend import Backend, KVCache, RopeTable, WeightHandle
from engine.gguf_file import GGUFFile

__all__ = ["read_config", "load_weights", "new_workspace", "forward"]

DEFAULT_SLIDING_PATTERN = 6  # llama.cpp's for Gemma 3 files that do not state one: 5 local layers, then 1 global
DEFAULT_LOCAL_ROPE_BASE = 10000.0


@dataclass(frozen=True)
class GemmaConfig(TransformerConfig):
    local_rope_base: float  # sliding-window layers; rope_base is the global layers'
    sliding_window: int
    sliding_layers: tuple[bool, ...]  # True where the layer attends within the sliding window
    attn_scale: float
    qkv_bias: bool = False
    qk_norm: bool = True


def _sliding_layers(gguf: GGUFFile, n_layers: int) -> tuple[bool, ...]:
    pattern = gguf.get("gemma3.attention.sliding_window_pattern", DEFAULT_SLIDING_PATTERN)
    if isinstance(pattern, int):
        return tuple((i + 1) % pattern != 0 for i in range(n_layers))
    return tuple(bool(x) for x in pattern)  # a per-layer array, as newer converters write it


def read_config(gguf: GGUFFile) -> GemmaConfig:
    fields = read_transformer_fields(gguf, rope_base=1000000.0, rms_eps=1e-6)
    n_layers, hidden, n_heads = fields["n_layers"], fields["hidden"], fields["n_heads"]
    # Gemma 3 scales scores by query_pre_attn_scalar^-0.5, which is head_dim except in the 27B model
    # (62 layers), where it is hidden / heads; GGUF does not store it, so this follows llama.cpp.
    attn_scale = 1.0 / float(np.sqrt(hidden // n_heads if n_layers == 62 else fields["head_dim"]))
    return GemmaConfig(
        **fields,
        local_rope_base=float(hparam(gguf, "rope.freq_base_swa", DEFAULT_LOCAL_ROPE_BASE)),
        sliding_window=int(hparam(gguf, "attention.sliding_window")),
        sliding_layers=_sliding_layers(gguf, n_layers),
        attn_scale=attn_scale,
    )


@dataclass
class GemmaLayer:
    attn: AttentionWeights
    post_attn_norm: WeightHandle
    gate: WeightHandle
    up: WeightHandle
    down: WeightHandle
    post_ffn_norm: WeightHandle


@dataclass
class GemmaWeights:
    token_embd: WeightHandle
    layers: list[GemmaLayer]
    output_norm: WeightHandle
    output: WeightHandle  # token_embd itself when the embeddings are tied
    global_rope: RopeTable
    local_rope: RopeTable


def load_weights(
    gguf: GGUFFile,
    config: GemmaConfig,
    backend: Backend,
    max_positions: int,
    on_progress: Callable[[int, int, str], None] | None = None,
    should_cancel: Callable[[], bool] | None = None,
) -> GemmaWeights:
    has_output = "output.weight" in gguf.tensors
    total = 2 + has_output + config.n_layers * (attention_uploads(config) + 5)
    loader = WeightLoader(backend, total, on_progress, should_cancel)
    layers = []
    for i in range(config.n_layers):
        def t(name: str, i: int = i):
            return loader.upload(gguf.tensor(f"blk.{i}.{name}.weight"))

        attn = load_attention(gguf, config, loader, i)
        layers.append(GemmaLayer(attn, t("post_attention_norm"), t("ffn_gate"), t("ffn_up"), t("ffn_down"), t("post_ffw_norm")))
    token_embd = loader.upload(gguf.tensor("token_embd.weight"))
    output_norm = loader.upload(gguf.tensor("output_norm.weight"))
    output = loader.upload(gguf.tensor("output.weight")) if has_output else token_embd
    global_rope = backend.rope_table(rope_inv_freq(gguf, config.rot_dim, config.rope_base), max_positions)
    local_rope = backend.rope_table(rope_inv_freq(gguf, config.rot_dim, config.local_rope_base, scaled=False), max_positions)
    return GemmaWeights(token_embd, layers, output_norm, output, global_rope, local_rope)


def forward(config: GemmaConfig, weights: GemmaWeights, ws: Workspace, backend: Backend, cache: KVCache, n: int, logits_out=None):
    """Run the n tokens in ws.tokens[:n] at positions ws.start[0] + i, filling the KV cache. Returns the last
    token's logits (ws.logits), or every token's logits in logits_out (n, vocab) when given."""
    c = config
    x, h, delta = ws.x[:n], ws.h[:n], ws.delta[:n]
    # transformers rounds the scale to the activation dtype before multiplying; float32 here.
    backend.embed(weights.token_embd, ws.tokens[:n], x, float(np.float32(np.sqrt(c.hidden))))
    for i, layer in enumerate(weights.layers):
        if i == 0:
            backend.rms_norm(x, layer.attn.attn_norm, c.rms_eps, h)
        else:
            backend.add_rms_norm(delta, x, layer.attn.attn_norm, c.rms_eps, h)
        sliding = c.sliding_layers[i]
        rope = weights.local_rope if sliding else weights.global_rope
        attention_block(c, rope, layer.attn, ws, backend, cache, i, n, c.attn_scale, c.sliding_window if sliding else 0)
        backend.rms_norm(delta, layer.post_attn_norm, c.rms_eps, delta)
        backend.add_rms_norm(delta, x, layer.attn.ffn_norm, c.rms_eps, h)
        backend.gated_ffn(h, layer.gate, layer.up, ws.ffn[:n], ws.ffn_scratch[:n], "gelu_tanh")
        backend.linear(ws.ffn[:n], layer.down, delta)
        backend.rms_norm(delta, layer.post_ffn_norm, c.rms_eps, delta)
    backend.add_rms_norm(delta, x, weights.output_norm, c.rms_eps, h)
    if logits_out is None:
        backend.linear(h[n - 1 : n], weights.output, ws.logits)
        return ws.logits
    backend.linear(h, weights.output, logits_out)
    return logits_out
