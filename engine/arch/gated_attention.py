"""The hybrid Qwen families' full attention: one projection gives the query, a per-head output gate, keys and
values -> per-head RMSNorm of Q and K -> rotary on the first rot_dim dims of each head (halves) -> grouped-query
attention over the KV cache, which only these layers have in a hybrid model -> times sigmoid(gate) -> output
projection. The file interleaves each head's query and gate rows in attn_q; they are split apart at load so that
each is a contiguous block of the projection output."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.arch.common import JoinedProjection
from engine.arch.deltanet import select_rows
from engine.arch.parts import GATED_ATTENTION, Buffers, Chunk, DecoderConfig, LayerSource
from engine.backend import Array, Backend, RopeTable, WeightHandle
from engine.kv_cache import RecurrentCache


@dataclass
class GatedAttentionBuffers(Buffers):
    proj: Array  # (max_chunk, 2 q_dim + 2 kv_dim): queries, gates, keys, values
    out: Array  # (max_chunk, q_dim)


@dataclass
class GatedAttention:
    # Rows: the query of every head, then every head's output gate, then keys, then values: one matrix, or four
    # where the file stores K or V in another type than Q (llama.cpp's Q4_K_M keeps some attn_v in Q6_K).
    qkv: JoinedProjection  # the query, its gate, K and V
    q_norm: WeightHandle
    k_norm: WeightHandle
    out: WeightHandle
    rope: RopeTable
    slot: int  # the layer's place among the attention layers (the KV cache's layers)

    @staticmethod
    def uploads(config: DecoderConfig) -> int:
        return 6  # attn_q (query and gate), attn_k, attn_v, the two norms, attn_output

    @classmethod
    def load(cls, source: LayerSource, layer: int) -> GatedAttention:
        c, loader = source.config, source.loader
        q = source.tensor(layer, "attn_q.weight")
        heads = np.arange(q.shape[0]).reshape(c.n_heads, 2, c.head_dim)
        query = select_rows(f"blk.{layer}.attn_q.weight", q, heads[:, 0].reshape(-1))
        gate = select_rows(f"blk.{layer}.attn_q_gate.weight", q, heads[:, 1].reshape(-1))
        parts = [query, gate, source.tensor(layer, "attn_k.weight"), source.tensor(layer, "attn_v.weight")]
        # the query and gate halves of attn_q count as one file tensor
        qkv = JoinedProjection.load(loader, f"blk.{layer}.attn_qkv.weight", parts, counts=[1, 0, 1, 1])
        return cls(qkv, source.upload(layer, "attn_q_norm.weight"), source.upload(layer, "attn_k_norm.weight"),
                   source.upload(layer, "attn_output.weight"), source.rope(False), c.slot(layer))

    @staticmethod
    def buffers(config: DecoderConfig, backend: Backend, max_chunk: int) -> GatedAttentionBuffers:
        c = config
        return GatedAttentionBuffers(backend.empty((max_chunk, 2 * c.q_dim + 2 * c.kv_dim)),
                                     backend.empty((max_chunk, c.q_dim)))

    def run(self, config: DecoderConfig, chunk: Chunk, backend: Backend, cache: RecurrentCache, layer: int) -> None:
        c, n = config, chunk.n
        b: GatedAttentionBuffers = chunk.parts[GATED_ATTENTION]
        bounds = [0, c.q_dim, 2 * c.q_dim, 2 * c.q_dim + c.kv_dim, 2 * c.q_dim + 2 * c.kv_dim]
        self.qkv.run(backend, chunk.h, b.proj)
        q = b.proj[:, : bounds[1]].reshape(n, c.n_heads, c.head_dim)
        gate = b.proj[:, bounds[1] : bounds[2]]
        k = b.proj[:, bounds[2] : bounds[3]].reshape(n, c.n_kv_heads, c.head_dim)
        v = b.proj[:, bounds[3] :].reshape(n, c.n_kv_heads, c.head_dim)
        backend.rope_attention(q, k, v, self.rope, c.rope_style, cache.kv, self.slot, chunk.start, b.out, c.attn_scale,
                               qk_norm=(self.q_norm, self.k_norm, c.rms_eps))
        backend.sigmoid_gate(b.out, gate, b.out)
        backend.linear(b.out, self.out, chunk.delta)
