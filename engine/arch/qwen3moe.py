"""Qwen3-MoE as backend calls: Qwen3's attention (engine/arch/qwen3.py) with a routed mixture of experts in
place of the dense MLP and no shared expert.

Per layer, after the FFN norm: router logits (a linear layer, ffn_gate_inp) -> softmax in float32, the
top-k experts, their weights renormalized to sum to 1 -> each token's chosen experts only, SwiGLU on the
stacked `ffn_gate_exps`/`ffn_up_exps`, `ffn_down_exps`, summed with the routing weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from engine.arch import qwen3
from engine.arch import common
from engine.arch.common import Workspace, WeightLoader, hparam
from engine.arch.qwen3 import AttentionWeights, QwenConfig, QwenWeights
from engine.backend import Backend, KVCache, WeightHandle
from engine.errors import EngineError
from engine.gguf_file import GGUFFile


@dataclass(frozen=True)
class MoeConfig(QwenConfig):
    n_experts: int
    top_k: int
    expert_ffn: int
    normalize_weights: bool


def read_config(gguf: GGUFFile) -> MoeConfig:
    base = qwen3.read_config(gguf)
    n_experts = int(hparam(gguf, "expert_count"))
    top_k = int(hparam(gguf, "expert_used_count"))
    if not 0 < top_k <= n_experts:
        raise EngineError(
            f"The model file {gguf.path.name} routes each token to {top_k} of {n_experts} experts, which is "
            "impossible; the file is damaged or not a supported model."
        )
    expert_ffn = int(hparam(gguf, "expert_feed_forward_length", gguf.tensor("blk.0.ffn_gate_exps.weight").shape[1]))
    return MoeConfig(
        **vars(base),
        n_experts=n_experts,
        top_k=top_k,
        expert_ffn=expert_ffn,
        normalize_weights=bool(hparam(gguf, "expert_weights_norm", True)),
    )


@dataclass
class MoeLayer:
    attn: AttentionWeights
    router: WeightHandle  # (n_experts, hidden)
    gate_exps: WeightHandle  # (n_experts, expert_ffn, hidden)
    up_exps: WeightHandle
    down_exps: WeightHandle  # (n_experts, hidden, expert_ffn)


def load_weights(
    gguf: GGUFFile,
    config: MoeConfig,
    backend: Backend,
    max_positions: int,
    on_progress: Callable[[int, int, str], None] | None = None,
    should_cancel: Callable[[], bool] | None = None,
) -> QwenWeights:
    total = qwen3.shared_uploads(gguf) + config.n_layers * (qwen3.attention_uploads(config) + 4)
    loader = WeightLoader(backend, total, on_progress, should_cancel)
    layers = []
    for i in range(config.n_layers):
        attn = qwen3.load_attention(gguf, config, loader, i)
        parts = [loader.upload(gguf.tensor(f"blk.{i}.{name}.weight")) for name in ("ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")]
        layers.append(MoeLayer(attn, *parts))
    return qwen3.load_shared(gguf, config, backend, loader, layers, max_positions)


def new_workspace(config: MoeConfig, backend: Backend, max_chunk: int) -> Workspace:
    # The dense FFN buffers go unused; the experts work in their own scratch.
    ws = common.new_workspace(config, backend, max_chunk, ffn_width=1)
    ws.extra = {
        "router_logits": backend.empty((max_chunk, config.n_experts)),
        "expert_weights": backend.empty((max_chunk, config.top_k)),
        "expert_ids": backend.empty((max_chunk, config.top_k), np.int32),
        "expert_scratch": backend.empty((max_chunk, config.top_k, 2 * config.expert_ffn)),
    }
    return ws


def moe_block(config: MoeConfig, layer: MoeLayer, ws: Workspace, backend: Backend, n: int) -> None:
    e = ws.extra
    h = ws.h[:n]
    backend.linear(h, layer.router, e["router_logits"][:n])
    backend.moe_route(e["router_logits"][:n], config.top_k, config.normalize_weights, e["expert_weights"][:n], e["expert_ids"][:n])
    backend.moe_ffn(
        h, layer.gate_exps, layer.up_exps, layer.down_exps, e["expert_ids"][:n], e["expert_weights"][:n],
        ws.delta[:n], e["expert_scratch"][:n], "silu",
    )


def forward(config: MoeConfig, weights: QwenWeights, ws: Workspace, backend: Backend, cache: KVCache, n: int, logits_out=None):
    """Run the n tokens in ws.tokens[:n] at positions ws.start[0] + i, filling the KV cache. Returns the last
    token's logits (ws.logits), or every token's logits in logits_out (n, vocab) when given."""
    return qwen3.run_layers(config, weights, ws, backend, cache, n, logits_out, moe_block)
