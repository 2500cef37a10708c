"""The feed-forward parts: a dense gated FFN, and a routed mixture of experts (Qwen3-MoE, no shared expert).

Dense: gate and up products with the activation (SiLU or GELU-tanh) between them in one op -> down projection.
MoE: router logits (a linear layer, ffn_gate_inp) -> softmax in float32, the top-k experts, their weights
renormalized to sum to 1 where the file says so -> each token's chosen experts only, the gated FFN on the
stacked `ffn_gate_exps`/`ffn_up_exps`, `ffn_down_exps`, summed with the routing weights. The hybrids' MoE adds a
shared expert scaled by a sigmoid gate. A layer named in the
LayerSource's host_expert_layers keeps its three expert tensors in RAM, where the backend has the CPU compute them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.arch.common import stack_rows
from engine.arch.parts import DENSE, MOE, MOE_SHARED, Buffers, Chunk, DecoderConfig, LayerSource
from engine.backend import Array, Backend, KVCache, WeightHandle


@dataclass
class DenseBuffers(Buffers):
    act: Array  # (max_chunk, ffn_width): activation(gate) * up, the input of the down projection
    scratch: Array  # (max_chunk, ffn_width)


@dataclass
class DenseFFN:
    gate: WeightHandle
    up: WeightHandle
    down: WeightHandle

    @staticmethod
    def uploads(config: DecoderConfig) -> int:
        return 3

    @classmethod
    def load(cls, source: LayerSource, layer: int) -> DenseFFN:
        return cls(*(source.upload(layer, f"ffn_{x}.weight") for x in ("gate", "up", "down")))

    @staticmethod
    def buffers(config: DecoderConfig, backend: Backend, max_chunk: int) -> DenseBuffers:
        return DenseBuffers(backend.empty((max_chunk, config.ffn_width)), backend.empty((max_chunk, config.ffn_width)))

    def run(self, config: DecoderConfig, chunk: Chunk, backend: Backend, cache: KVCache, layer: int) -> None:
        b: DenseBuffers = chunk.parts[DENSE]
        backend.gated_ffn(chunk.h, self.gate, self.up, b.act, b.scratch, config.activation)
        backend.linear(b.act, self.down, chunk.delta)


@dataclass
class MoeBuffers(Buffers):
    router_logits: Array  # (max_chunk, experts)
    weights: Array  # (max_chunk, top_k) routing weights
    ids: Array  # (max_chunk, top_k) int32 chosen experts
    scratch: Array  # (max_chunk, top_k, 2 width)


@dataclass
class MoeFFN:
    router: WeightHandle  # (experts, hidden)
    gate_exps: WeightHandle  # (experts, width, hidden)
    up_exps: WeightHandle
    down_exps: WeightHandle  # (experts, hidden, width)
    top_k: int
    normalize_weights: bool

    @staticmethod
    def uploads(config: DecoderConfig) -> int:
        return 4

    @classmethod
    def load(cls, source: LayerSource, layer: int, router: WeightHandle | None = None) -> MoeFFN:
        """router: the router's weights as already uploaded (with more rows after the experts'), else the file's."""
        router = router or source.upload(layer, "ffn_gate_inp.weight")
        host = layer in source.host_expert_layers
        gate, up, down = (source.upload(layer, f"ffn_{name}_exps.weight", host) for name in ("gate", "up", "down"))
        e = source.config.moe()
        return cls(router, gate, up, down, e.top_k, e.normalize_weights)

    @staticmethod
    def buffers(config: DecoderConfig, backend: Backend, max_chunk: int, more_logits: int = 0) -> MoeBuffers:
        """more_logits: columns the router's product has after the experts' (a shared expert's gate)."""
        e = config.moe()
        return MoeBuffers(
            router_logits=backend.empty((max_chunk, e.count + more_logits)),
            weights=backend.empty((max_chunk, e.top_k)),
            ids=backend.empty((max_chunk, e.top_k), np.int32),
            scratch=backend.empty((max_chunk, e.top_k, 2 * e.width)),
        )

    def run(self, config: DecoderConfig, chunk: Chunk, backend: Backend, cache: KVCache, layer: int) -> None:
        self.routed(config, chunk, backend, chunk.parts[MOE])

    def routed(self, config: DecoderConfig, chunk: Chunk, backend: Backend, b: MoeBuffers) -> None:
        """The chosen experts' weighted sum into chunk.delta."""
        h = chunk.h
        backend.route_experts(h, self.router, config.moe().count, self.top_k, self.normalize_weights,
                              b.router_logits, b.weights, b.ids)
        backend.moe_ffn(h, self.gate_exps, self.up_exps, self.down_exps, b.ids, b.weights, chunk.delta, b.scratch,
                        config.activation)


@dataclass
class SharedMoeBuffers(MoeBuffers):
    # router_logits (max_chunk, experts + 1): the last column the logit of the shared expert's sigmoid gate
    act: Array  # (max_chunk, shared width): the shared expert's activation(gate) * up
    act_scratch: Array
    shared_out: Array  # (max_chunk, hidden)


@dataclass
class SharedMoeFFN:
    """Routed experts plus a shared expert that every token runs, scaled by sigmoid(ffn_gate_inp_shexp . h)
    (Qwen3.5 / Qwen3-Next MoE layers). The gate's row (ffn_gate_inp_shexp) follows the experts' rows in the router's
    matrix: one product computes both (a decode step's launch fewer)."""

    routed: MoeFFN
    shared: DenseFFN

    @staticmethod
    def uploads(config: DecoderConfig) -> int:
        return 8

    @classmethod
    def load(cls, source: LayerSource, layer: int) -> SharedMoeFFN:
        rows = [source.tensor(layer, f"ffn_gate_inp{x}.weight") for x in ("", "_shexp")]
        router = source.loader.upload(stack_rows(f"blk.{layer}.ffn_gate_inp+shexp.weight", rows), counts_as=2)
        routed = MoeFFN.load(source, layer, router)
        return cls(routed, DenseFFN(*(source.upload(layer, f"ffn_{x}_shexp.weight") for x in ("gate", "up", "down"))))

    @staticmethod
    def buffers(config: DecoderConfig, backend: Backend, max_chunk: int) -> SharedMoeBuffers:
        routed = MoeFFN.buffers(config, backend, max_chunk, more_logits=1)
        e = config.moe()
        return SharedMoeBuffers(
            **{f: getattr(routed, f) for f in ("router_logits", "weights", "ids", "scratch")},
            act=backend.empty((max_chunk, e.shared_width)), act_scratch=backend.empty((max_chunk, e.shared_width)),
            shared_out=backend.empty((max_chunk, config.hidden)),
        )

    def run(self, config: DecoderConfig, chunk: Chunk, backend: Backend, cache: KVCache, layer: int) -> None:
        b: SharedMoeBuffers = chunk.parts[MOE_SHARED]
        self.routed.routed(config, chunk, backend, b)
        s = self.shared
        backend.gated_ffn(chunk.h, s.gate, s.up, b.act, b.act_scratch, config.activation)
        backend.linear(b.act, s.down, b.shared_out)
        gate = config.moe().count
        backend.sigmoid_gate(b.shared_out, b.router_logits[:, gate : gate + 1], chunk.delta, accumulate=True)

