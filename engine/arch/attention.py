"""The attention mixer: grouped-query attention with rotary positions and the KV cache.

Backend calls: the Q/K/V projection (one product when the three matrices could be stacked, with Qwen2's bias)
-> per-head RMSNorm of Q and K where the config has QK-norm (over the (n, heads, head_dim) views of the
projection output) -> rotary with the KV-cache write and attention (within the sliding window on Gemma 3's
local layers, which rotate with their own table) -> output projection.

Rotary styles: llama.cpp's converter permutes Llama's Q/K rows so that adjacent-pair rotation ('normal') on
them equals Hugging Face's rotate_half on the original weights; Qwen's and Gemma's rows are stored unpermuted
and rotate by halves ('neox').
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.arch.common import JoinedProjection
from engine.arch.parts import ATTENTION, Buffers, Chunk, DecoderConfig, LayerSource
from engine.backend import Array, Backend, KVCache, RopeTable, WeightHandle
from engine.kv_cache import WindowedCache


@dataclass
class AttentionBuffers(Buffers):
    qkv: Array  # (max_chunk, q_dim + 2 kv_dim): the projection output
    q: Array  # (max_chunk, n_heads, head_dim) view of qkv
    k: Array  # (max_chunk, n_kv_heads, head_dim) view of qkv
    v: Array  # (max_chunk, n_kv_heads, head_dim) view of qkv
    out: Array  # (max_chunk, q_dim): attention output, the input of the output projection


@dataclass
class Attention:
    qkv: JoinedProjection  # Q, K and V (with Qwen2's biases)
    qk_norm: tuple[WeightHandle, WeightHandle] | None  # per-head RMSNorm weights of Q and K
    out: WeightHandle
    rope: RopeTable
    window: int  # 0: attend to every earlier position

    @staticmethod
    def uploads(config: DecoderConfig) -> int:
        return 4 + 3 * config.qkv_bias + 2 * config.qk_norm

    @classmethod
    def load(cls, source: LayerSource, layer: int) -> Attention:
        c = source.config
        parts = [source.tensor(layer, f"attn_{x}.weight") for x in "qkv"]
        biases = [source.tensor(layer, f"attn_{x}.bias") for x in "qkv"] if c.qkv_bias else None
        sliding = c.sliding(layer)
        return cls(
            qkv=JoinedProjection.load(source.loader, f"blk.{layer}.attn_qkv.weight", parts, biases=biases),
            qk_norm=(source.upload(layer, "attn_q_norm.weight"), source.upload(layer, "attn_k_norm.weight"))
            if c.qk_norm else None,
            out=source.upload(layer, "attn_output.weight"),
            rope=source.rope(sliding),
            window=c.sliding_window if sliding else 0,
        )

    @staticmethod
    def buffers(config: DecoderConfig, backend: Backend, max_chunk: int) -> AttentionBuffers:
        c = config
        qkv = backend.empty((max_chunk, c.q_dim + 2 * c.kv_dim))
        return AttentionBuffers(
            qkv=qkv,
            q=qkv[:, : c.q_dim].reshape(max_chunk, c.n_heads, c.head_dim),
            k=qkv[:, c.q_dim : c.q_dim + c.kv_dim].reshape(max_chunk, c.n_kv_heads, c.head_dim),
            v=qkv[:, c.q_dim + c.kv_dim :].reshape(max_chunk, c.n_kv_heads, c.head_dim),
            out=backend.empty((max_chunk, c.q_dim)),
        )

    def run(self, config: DecoderConfig, chunk: Chunk, backend: Backend, cache: KVCache | WindowedCache,
            layer: int) -> None:
        c = config
        kv, index = cache.layer(layer)
        b: AttentionBuffers = chunk.parts[ATTENTION]
        self.qkv.run(backend, chunk.h, b.qkv)
        backend.rope_attention(b.q, b.k, b.v, self.rope, c.rope_style, kv, index, chunk.start, b.out, c.attn_scale,
                               self.window, (*self.qk_norm, c.rms_eps) if self.qk_norm is not None else None)
        backend.linear(b.out, self.out, chunk.delta)
