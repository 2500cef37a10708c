"""Qwen2 and Qwen3 (dense) as backend calls; qwen3moe reuses the attention half from here.

Per layer: RMSNorm -> fused QKV projection (+ the fused Q/K/V bias Qwen2 has) -> per-head RMSNorm of Q and K
(Qwen3's QK-norm, run over the (n, heads, head_dim) views of the projection output) -> rotary on halves
('neox': llama.cpp stores Qwen's Q/K rows unpermuted) with the KV-cache write -> grouped-query attention ->
output projection -> residual add fused with the FFN norm -> SwiGLU -> down projection.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from engine.arch.common import (
    TransformerConfig,
    Workspace,
    WeightLoader,
    concat_rows,
    concat_vectors,
    new_workspace,
    read_transformer_fields,
    rope_inv_freq,
)
from engine.backend import ROPE_NEOX, Backend, KVCache, RopeTable, WeightHandle
from engine.gguf_file import GGUFFile

__all__ = ["read_config", "load_weights", "new_workspace", "forward"]


@dataclass(frozen=True)
class QwenConfig(TransformerConfig):
    qkv_bias: bool  # Qwen2: Q, K and V projections carry a bias
    qk_norm: bool  # Qwen3: per-head RMSNorm of Q and K before the rotary


def read_config(gguf: GGUFFile) -> QwenConfig:
    return QwenConfig(
        **read_transformer_fields(gguf, rope_base=1000000.0, rms_eps=1e-6, ffn=0),
        qkv_bias="blk.0.attn_q.bias" in gguf.tensors,
        qk_norm="blk.0.attn_q_norm.weight" in gguf.tensors,
    )


@dataclass
class AttentionWeights:
    attn_norm: WeightHandle
    qkv: list[WeightHandle]  # one fused (q_dim + 2 kv_dim, hidden) matrix, or q, k, v separately
    qkv_bias: list[WeightHandle] | None  # matching the split of `qkv`
    q_norm: WeightHandle | None
    k_norm: WeightHandle | None
    attn_out: WeightHandle
    ffn_norm: WeightHandle


@dataclass
class QwenLayer:
    attn: AttentionWeights
    gate: WeightHandle
    up: WeightHandle
    down: WeightHandle


@dataclass
class QwenWeights:
    token_embd: WeightHandle
    layers: list[Any]  # QwenLayer here; qwen3moe's own layer type there
    output_norm: WeightHandle
    output: WeightHandle  # token_embd itself when the embeddings are tied
    rope: RopeTable


def attention_uploads(config: QwenConfig) -> int:
    """Progress steps `load_attention` reports for one layer."""
    return 6 + 3 * config.qkv_bias + 2 * config.qk_norm


def load_attention(gguf: GGUFFile, config: QwenConfig, loader: WeightLoader, i: int) -> AttentionWeights:
    def t(name: str):
        return gguf.tensor(f"blk.{i}.{name}")

    parts = [t(f"attn_{x}.weight") for x in "qkv"]
    fused = concat_rows(f"blk.{i}.attn_qkv.weight", parts)
    qkv = [loader.upload(fused, counts_as=3)] if fused is not None else [loader.upload(p) for p in parts]
    bias = None
    if config.qkv_bias:
        biases = [t(f"attn_{x}.bias") for x in "qkv"]
        if len(qkv) == 1:
            bias = [loader.upload(concat_vectors(f"blk.{i}.attn_qkv.bias", biases), counts_as=3)]
        else:
            bias = [loader.upload(b) for b in biases]
    return AttentionWeights(
        attn_norm=loader.upload(t("attn_norm.weight")),
        qkv=qkv,
        qkv_bias=bias,
        q_norm=loader.upload(t("attn_q_norm.weight")) if config.qk_norm else None,
        k_norm=loader.upload(t("attn_k_norm.weight")) if config.qk_norm else None,
        attn_out=loader.upload(t("attn_output.weight")),
        ffn_norm=loader.upload(t("ffn_norm.weight")),
    )


def load_shared(
    gguf: GGUFFile,
    config: QwenConfig,
    backend: Backend,
    loader: WeightLoader,
    layers: list[Any],
    max_positions: int,
) -> QwenWeights:
    """The weights around the layers: embeddings, final norm, output, rotary table."""
    token_embd = loader.upload(gguf.tensor("token_embd.weight"))
    output_norm = loader.upload(gguf.tensor("output_norm.weight"))
    output = loader.upload(gguf.tensor("output.weight")) if "output.weight" in gguf.tensors else token_embd
    rope = backend.rope_table(rope_inv_freq(gguf, config.rot_dim, config.rope_base), max_positions)
    return QwenWeights(token_embd, layers, output_norm, output, rope)


def shared_uploads(gguf: GGUFFile) -> int:
    return 2 + ("output.weight" in gguf.tensors)


def load_weights(
    gguf: GGUFFile,
    config: QwenConfig,
    backend: Backend,
    max_positions: int,
    on_progress: Callable[[int, int, str], None] | None = None,
    should_cancel: Callable[[], bool] | None = None,
) -> QwenWeights:
    total = shared_uploads(gguf) + config.n_layers * (attention_uploads(config) + 3)
    loader = WeightLoader(backend, total, on_progress, should_cancel)
    layers = []
    for i in range(config.n_layers):
        attn = load_attention(gguf, config, loader, i)
        ffn = [loader.upload(gguf.tensor(f"blk.{i}.ffn_{x}.weight")) for x in ("gate", "up", "down")]
        layers.append(QwenLayer(attn, *ffn))
    return load_shared(gguf, config, backend, loader, layers, max_positions)


def attention_block(
    config: QwenConfig,
    rope: RopeTable,
    a: AttentionWeights,
    ws: Workspace,
    backend: Backend,
    cache: KVCache,
    i: int,
    n: int,
    scale: float,
    window: int = 0,
) -> None:
    """From the normed input ws.h to the attention block's output in ws.delta (Gemma 3 shares this with its
    own rotary table, scale and sliding window per layer)."""
    c = config
    h, qkv = ws.h[:n], ws.qkv[:n]
    if len(a.qkv) == 1:
        backend.linear(h, a.qkv[0], qkv, a.qkv_bias[0] if a.qkv_bias else None)
    else:
        bounds = [0, c.q_dim, c.q_dim + c.kv_dim, c.q_dim + 2 * c.kv_dim]
        for j, (weight, lo, hi) in enumerate(zip(a.qkv, bounds, bounds[1:])):
            backend.linear(h, weight, qkv[:, lo:hi], a.qkv_bias[j] if a.qkv_bias else None)
    q = qkv[:, : c.q_dim].reshape(n, c.n_heads, c.head_dim)
    k = qkv[:, c.q_dim : c.q_dim + c.kv_dim].reshape(n, c.n_kv_heads, c.head_dim)
    v = qkv[:, c.q_dim + c.kv_dim :].reshape(n, c.n_kv_heads, c.head_dim)
    if c.qk_norm:
        backend.rms_norm(q, a.q_norm, c.rms_eps, q)
        backend.rms_norm(k, a.k_norm, c.rms_eps, k)
    backend.rope_attention(q, k, v, rope, ROPE_NEOX, cache, i, ws.start, ws.attn[:n], scale, window)
    backend.linear(ws.attn[:n], a.attn_out, ws.delta[:n])


def dense_ffn(config: QwenConfig, layer: QwenLayer, ws: Workspace, backend: Backend, n: int) -> None:
    backend.gated_ffn(ws.h[:n], layer.gate, layer.up, ws.ffn[:n], ws.ffn_scratch[:n], "silu")
    backend.linear(ws.ffn[:n], layer.down, ws.delta[:n])


def run_layers(config, weights: QwenWeights, ws: Workspace, backend: Backend, cache: KVCache, n: int, logits_out, ffn_block):
    """The forward pass with `ffn_block(config, layer, ws, backend, n)` turning ws.h into ws.delta."""
    c = config
    x, h, delta = ws.x[:n], ws.h[:n], ws.delta[:n]
    backend.embed(weights.token_embd, ws.tokens[:n], x)
    for i, layer in enumerate(weights.layers):
        if i == 0:
            backend.rms_norm(x, layer.attn.attn_norm, c.rms_eps, h)
        else:
            backend.add_rms_norm(delta, x, layer.attn.attn_norm, c.rms_eps, h)
        attention_block(c, weights.rope, layer.attn, ws, backend, cache, i, n, 1.0 / float(np.sqrt(c.head_dim)))
        backend.add_rms_norm(delta, x, layer.attn.ffn_norm, c.rms_eps, h)
        ffn_block(c, layer, ws, backend, n)
    backend.add_rms_norm(delta, x, weights.output_norm, c.rms_eps, h)
    if logits_out is None:
        backend.linear(h[n - 1 : n], weights.output, ws.logits)
        return ws.logits
    backend.linear(h, weights.output, logits_out)
    return logits_out


def forward(config: QwenConfig, weights: QwenWeights, ws: Workspace, backend: Backend, cache: KVCache, n: int, logits_out=None):
    """Run the n tokens in ws.tokens[:n] at positions ws.start[0] + i, filling the KV cache. Returns the last
    token's logits (ws.logits), or every token's logits in logits_out (n, vocab) when given."""
    return run_layers(config, weights, ws, backend, cache, n, logits_out, dense_ffn)
