"""The Llama architecture (Llama 2/3, SmolLM2, TinyLlama, Mistral without sliding window) as backend calls.

Per layer: RMSNorm -> fused QKV projection -> rotary ('normal' pairs: llama.cpp's converter permutes the Q/K
rows so that adjacent-pair rotation on them equals Hugging Face's rotate_half on the original weights) with the
KV-cache write -> grouped-query attention -> output projection -> residual add fused with the FFN norm ->
SwiGLU -> down projection, whose residual add is fused with the next layer's norm.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from engine.arch.common import (
    TransformerConfig,
    Workspace,
    WeightLoader,
    concat_rows,
    new_workspace,
    read_transformer_fields,
    rope_inv_freq,
)
from engine.backend import ROPE_NORMAL, Backend, KVCache, RopeTable, WeightHandle
from engine.gguf_file import GGUFFile

__all__ = ["read_config", "load_weights", "new_workspace", "forward"]


def read_config(gguf: GGUFFile) -> TransformerConfig:
    return TransformerConfig(**read_transformer_fields(gguf, rope_base=10000.0, rms_eps=1e-5))


@dataclass
class LlamaLayer:
    attn_norm: WeightHandle
    qkv: list[WeightHandle]  # one fused (q_dim + 2 kv_dim, hidden) matrix, or q, k, v separately
    attn_out: WeightHandle
    ffn_norm: WeightHandle
    gate: WeightHandle
    up: WeightHandle
    down: WeightHandle


@dataclass
class LlamaWeights:
    token_embd: WeightHandle
    layers: list[LlamaLayer]
    output_norm: WeightHandle
    output: WeightHandle  # token_embd itself when the embeddings are tied
    rope: RopeTable


def count_uploads(gguf: GGUFFile, config: TransformerConfig) -> int:
    """How many progress steps `load_weights` reports: one per GGUF tensor it uses."""
    return 2 + ("output.weight" in gguf.tensors) + 9 * config.n_layers


def load_weights(
    gguf: GGUFFile,
    config: TransformerConfig,
    backend: Backend,
    max_positions: int,
    on_progress: Callable[[int, int, str], None] | None = None,
    should_cancel: Callable[[], bool] | None = None,
) -> LlamaWeights:
    loader = WeightLoader(backend, count_uploads(gguf, config), on_progress, should_cancel)
    token_embd = loader.upload(gguf.tensor("token_embd.weight"))
    layers = []
    for i in range(config.n_layers):
        def t(name: str, i: int = i):
            return gguf.tensor(f"blk.{i}.{name}.weight")

        q, k, v = t("attn_q"), t("attn_k"), t("attn_v")
        fused = concat_rows(f"blk.{i}.attn_qkv.weight", [q, k, v])
        qkv = [loader.upload(fused, counts_as=3)] if fused is not None else [loader.upload(x) for x in (q, k, v)]
        layers.append(
            LlamaLayer(
                attn_norm=loader.upload(t("attn_norm")),
                qkv=qkv,
                attn_out=loader.upload(t("attn_output")),
                ffn_norm=loader.upload(t("ffn_norm")),
                gate=loader.upload(t("ffn_gate")),
                up=loader.upload(t("ffn_up")),
                down=loader.upload(t("ffn_down")),
            )
        )
    output_norm = loader.upload(gguf.tensor("output_norm.weight"))
    output = loader.upload(gguf.tensor("output.weight")) if "output.weight" in gguf.tensors else token_embd
    rope = backend.rope_table(rope_inv_freq(gguf, config.rot_dim, config.rope_base), max_positions)
    return LlamaWeights(token_embd, layers, output_norm, output, rope)


def _project_qkv(backend: Backend, layer: LlamaLayer, h, qkv, config: TransformerConfig) -> None:
    if len(layer.qkv) == 1:
        backend.linear(h, layer.qkv[0], qkv)
        return
    bounds = [0, config.q_dim, config.q_dim + config.kv_dim, config.q_dim + 2 * config.kv_dim]
    for weight, lo, hi in zip(layer.qkv, bounds, bounds[1:]):
        backend.linear(h, weight, qkv[:, lo:hi])


def forward(
    config: TransformerConfig,
    weights: LlamaWeights,
    ws: Workspace,
    backend: Backend,
    cache: KVCache,
    n: int,
    logits_out=None,
):
    """Run the n tokens in ws.tokens[:n] at positions ws.start[0] + i, filling the KV cache.

    Writes the last token's logits to ws.logits and returns it, or, given logits_out (n, vocab), every
    token's logits there (used to compare with a reference)."""
    c = config
    x, h, qkv, attn, delta = ws.x[:n], ws.h[:n], ws.qkv[:n], ws.attn[:n], ws.delta[:n]
    q = qkv[:, : c.q_dim].reshape(n, c.n_heads, c.head_dim)
    k = qkv[:, c.q_dim : c.q_dim + c.kv_dim].reshape(n, c.n_kv_heads, c.head_dim)
    v = qkv[:, c.q_dim + c.kv_dim :].reshape(n, c.n_kv_heads, c.head_dim)
    scale = 1.0 / float(np.sqrt(c.head_dim))

    backend.embed(weights.token_embd, ws.tokens[:n], x)
    for i, layer in enumerate(weights.layers):
        if i == 0:
            backend.rms_norm(x, layer.attn_norm, c.rms_eps, h)
        else:
            backend.add_rms_norm(delta, x, layer.attn_norm, c.rms_eps, h)
        _project_qkv(backend, layer, h, qkv, c)
        backend.rope_attention(q, k, v, weights.rope, ROPE_NORMAL, cache, i, ws.start, attn, scale)
        backend.linear(attn, layer.attn_out, delta)
        backend.add_rms_norm(delta, x, layer.ffn_norm, c.rms_eps, h)
        backend.gated_ffn(h, layer.gate, layer.up, ws.ffn[:n], ws.ffn_scratch[:n], "silu")
        backend.linear(ws.ffn[:n], layer.down, delta)
    backend.add_rms_norm(delta, x, weights.output_norm, c.rms_eps, h)
    if logits_out is None:
        backend.linear(h[n - 1 : n], weights.output, ws.logits)
        return ws.logits
    backend.linear(h, weights.output, logits_out)
    return logits_out
