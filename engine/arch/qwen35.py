"""Qwen3.5 / 3.6 / 3.8 (qwen35 dense, qwen35moe) and Qwen3-Next (qwen3next) as backend calls. qwen3next has the
same layers as qwen35moe; only its DeltaNet tensors are laid out differently (engine/arch/deltanet.py reads both).

Layer i is a Gated DeltaNet layer (engine/arch/deltanet.py) where `attention.recurrent_layers` says so (in files
written before that key: unless (i + 1) % full_attention_interval == 0; the converter writes 4 there whatever the
model's layer_types), otherwise gated full attention: one projection gives the query, a per-head output gate,
keys and values -> per-head RMSNorm of Q and K -> rotary on the first rope.dimension_count dims of each head,
halves ('neox') -> grouped-query attention over the KV cache, which only these layers have -> times
sigmoid(gate) -> output projection. Either mixer is followed by the residual add fused with `post_attention_norm` and the FFN: SwiGLU in dense files, in MoE
files routed experts (softmax, top-k, renormalized) plus a shared expert scaled by sigmoid(ffn_gate_inp_shexp . h).

The files store every norm weight + 1 (the models scale by 1 + weight) except `ssm_norm`, so they are plain
RMSNorm weights here. Text positions are the same on MRoPE's three axes, so the rotary is the ordinary one and
`rope.dimension_sections` does not matter. MTP layers (`nextn_predict_layers`, after the others) are not run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from engine.arch import deltanet
from engine.arch.common import WeightLoader, concat_rows, hparam, rope_inv_freq
from engine.arch.parts import read_decoder_config
from engine.backend import ROPE_NEOX, Array, Backend, RopeTable, WeightHandle
from engine.errors import EngineError
from engine.gguf_file import GGUFFile
from engine.kv_cache import RecurrentCache

__all__ = ["read_config", "load_weights", "new_workspace", "new_cache", "forward"]


@dataclass(frozen=True)
class HybridConfig:
    n_layers: int
    hidden: int
    ffn: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rot_dim: int
    rope_base: float
    rms_eps: float
    vocab_size: int
    context_length: int
    recurrent_layers: tuple[bool, ...]  # per layer: Gated DeltaNet (True) or gated attention
    conv_kernel: int
    n_k_heads: int  # DeltaNet query/key heads
    n_v_heads: int  # DeltaNet value heads (and state heads)
    head_k_dim: int
    head_v_dim: int
    tiled: bool  # value head h reads key head h % n_k_heads (qwen35 files), else h // (n_v / n_k) (qwen3next)
    n_experts: int  # 0 in dense files
    top_k: int
    expert_ffn: int
    shared_ffn: int
    normalize_weights: bool = True

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    def recurrent(self, i: int) -> bool:
        return self.recurrent_layers[i]

    @property
    def n_recurrent(self) -> int:
        return sum(map(self.recurrent, range(self.n_layers)))

    @property
    def conv_dim(self) -> int:
        return 2 * self.n_k_heads * self.head_k_dim + self.n_v_heads * self.head_v_dim


def read_config(gguf: GGUFFile) -> HybridConfig:
    d = read_decoder_config(gguf, rope_base=10000000.0, rms_eps=1e-6, ffn_width=0)
    fields = dict(n_layers=d.n_layers - int(hparam(gguf, "nextn_predict_layers", 0)), hidden=d.hidden, ffn=d.ffn_width,
                  n_heads=d.n_heads, n_kv_heads=d.n_kv_heads, head_dim=d.head_dim, rot_dim=d.rot_dim,
                  rope_base=d.rope_base, rms_eps=d.rms_eps, vocab_size=d.vocab_size, context_length=d.context_length)
    n_v = int(hparam(gguf, "ssm.time_step_rank"))
    n_k = int(hparam(gguf, "ssm.group_count"))
    n_experts = int(hparam(gguf, "expert_count", 0))
    top_k = int(hparam(gguf, "expert_used_count", 0))
    if n_k <= 0 or n_v % n_k or (n_experts and not 0 < top_k <= n_experts):
        raise EngineError(
            f"The model file {gguf.path.name} has inconsistent recurrent-layer or expert counts; the file is damaged "
            "or not a supported model."
        )
    n_layers = fields["n_layers"]
    recurrent = gguf.get(f"{gguf.architecture}.attention.recurrent_layers")
    if recurrent is None:
        interval = int(hparam(gguf, "full_attention_interval", 4))
        recurrent = [(i + 1) % interval != 0 for i in range(n_layers)]
    return HybridConfig(
        **fields,
        recurrent_layers=tuple(bool(r) for r in recurrent[:n_layers]),
        conv_kernel=int(hparam(gguf, "ssm.conv_kernel")),
        n_k_heads=n_k,
        n_v_heads=n_v,
        head_k_dim=int(hparam(gguf, "ssm.state_size")),
        head_v_dim=int(hparam(gguf, "ssm.inner_size")) // n_v,
        tiled=gguf.architecture != "qwen3next",
        n_experts=n_experts,
        top_k=top_k,
        expert_ffn=int(hparam(gguf, "expert_feed_forward_length", 0)),
        shared_ffn=int(hparam(gguf, "expert_shared_feed_forward_length", 0)),
    )


@dataclass
class GatedAttention:
    # Rows: the query of every head, then every head's output gate, then keys, then values: one matrix, or four
    # where the file stores K or V in another type than Q (llama.cpp's Q4_K_M keeps some attn_v in Q6_K).
    qkv: list[WeightHandle]
    q_norm: WeightHandle
    k_norm: WeightHandle
    out: WeightHandle


@dataclass
class Workspace:
    """Activation buffers for chunks of up to `max_chunk` tokens, allocated once."""

    ids: Array  # (1 + max_chunk,) int32: the chunk's first position, then its token ids
    tokens: Array  # ids[1:]
    start: Array  # ids[:1]
    x: Array  # (max_chunk, hidden) residual stream
    h: Array  # (max_chunk, hidden) normed input of the next part
    delta: Array  # (max_chunk, hidden) a part's output, added to x by the next fused norm
    attn: Array  # (max_chunk, q_dim)
    ffn: Array  # (max_chunk, dense or shared expert width)
    ffn_scratch: Array
    logits: Array  # (1, vocab)
    max_chunk: int
    extra: dict[str, Array]


@dataclass
class HybridLayer:
    attn_norm: WeightHandle
    mixer: Any  # GatedAttention or deltanet.DeltaNetWeights
    post_norm: WeightHandle
    ffn: list[WeightHandle]  # dense: gate, up, down
    router: WeightHandle | None = None  # (n_experts, hidden)
    gate_exps: WeightHandle | None = None
    up_exps: WeightHandle | None = None
    down_exps: WeightHandle | None = None
    shared_gate: WeightHandle | None = None  # (1, hidden)


@dataclass
class HybridWeights:
    token_embd: WeightHandle
    layers: list[HybridLayer]
    output_norm: WeightHandle
    output: WeightHandle
    rope: RopeTable


def load_attention(gguf: GGUFFile, config: HybridConfig, loader: WeightLoader, i: int) -> GatedAttention:
    def t(name: str):
        return gguf.tensor(f"blk.{i}.{name}")

    # The file interleaves each head's query and gate rows; splitting them apart keeps each a contiguous block.
    q = t("attn_q.weight")
    heads = np.arange(q.shape[0]).reshape(config.n_heads, 2, config.head_dim)
    query = deltanet.select_rows(f"blk.{i}.attn_q.weight", q, heads[:, 0].reshape(-1))
    gate = deltanet.select_rows(f"blk.{i}.attn_q_gate.weight", q, heads[:, 1].reshape(-1))
    parts = [query, gate, t("attn_k.weight"), t("attn_v.weight")]
    fused = concat_rows(f"blk.{i}.attn_qkv.weight", parts)
    if fused is not None:
        qkv = [loader.upload(fused, counts_as=3)]
    else:  # the query and gate halves of attn_q count as one file tensor
        qkv = [loader.upload(p, counts_as=int(j != 1)) for j, p in enumerate(parts)]
    return GatedAttention(
        qkv=qkv,
        q_norm=loader.upload(t("attn_q_norm.weight")),
        k_norm=loader.upload(t("attn_k_norm.weight")),
        out=loader.upload(t("attn_output.weight")),
    )


def _load_layer(gguf: GGUFFile, config: HybridConfig, loader: WeightLoader, i: int) -> HybridLayer:
    def up(name: str) -> WeightHandle:
        return loader.upload(gguf.tensor(f"blk.{i}.{name}.weight"))

    attn_norm = up("attn_norm")
    if config.recurrent(i):
        mixer = deltanet.load_mixer(gguf, loader, i, config.n_k_heads)
    else:
        mixer = load_attention(gguf, config, loader, i)
    post_norm = up("post_attention_norm")
    if f"blk.{i}.ffn_gate_inp.weight" not in gguf.tensors:
        return HybridLayer(attn_norm, mixer, post_norm, [up(f"ffn_{x}") for x in ("gate", "up", "down")])
    experts = [up(x) for x in ("ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")]
    shared = [up(f"ffn_{x}_shexp") for x in ("gate", "up", "down")]
    return HybridLayer(attn_norm, mixer, post_norm, shared, *experts, shared_gate=up("ffn_gate_inp_shexp"))


def load_weights(
    gguf: GGUFFile,
    config: HybridConfig,
    backend: Backend,
    max_positions: int,
    on_progress: Callable[[int, int, str], None] | None = None,
    should_cancel: Callable[[], bool] | None = None,
) -> HybridWeights:
    mtp = tuple(f"blk.{i}." for i in range(config.n_layers, int(hparam(gguf, "block_count"))))
    total = sum(not name.startswith(mtp) for name in gguf.tensors) if mtp else len(gguf.tensors)
    loader = WeightLoader(backend, total, on_progress, should_cancel)
    layers = [_load_layer(gguf, config, loader, i) for i in range(config.n_layers)]
    token_embd = loader.upload(gguf.tensor("token_embd.weight"))
    output_norm = loader.upload(gguf.tensor("output_norm.weight"))
    output = loader.upload(gguf.tensor("output.weight")) if "output.weight" in gguf.tensors else token_embd
    rope = backend.rope_table(rope_inv_freq(gguf, config.rot_dim, config.rope_base), max_positions)
    return HybridWeights(token_embd, layers, output_norm, output, rope)


def new_workspace(config: HybridConfig, backend: Backend, max_chunk: int) -> Workspace:
    e = backend.empty
    ffn = config.shared_ffn if config.n_experts else config.ffn
    ids = e((1 + max_chunk,), np.int32)
    rows = [e((max_chunk, config.hidden)) for _ in range(3)]
    ws = Workspace(ids, ids[1:], ids[:1], *rows, e((max_chunk, config.q_dim)), e((max_chunk, ffn)), e((max_chunk, ffn)),
                   e((1, config.vocab_size)), max_chunk, {})
    value_dim = config.n_v_heads * config.head_v_dim
    ws.extra = {
        "proj": e((max_chunk, max(2 * config.q_dim + 2 * config.kv_dim, config.conv_dim + value_dim + 2 * config.n_v_heads))),
        "mixed": e((max_chunk, config.conv_dim)),
        "core": e((max_chunk, value_dim)),
    }
    if config.n_experts:
        ws.extra |= {
            "router_logits": e((max_chunk, config.n_experts)),
            "expert_weights": e((max_chunk, config.top_k)),
            "expert_ids": e((max_chunk, config.top_k), np.int32),
            "expert_scratch": e((max_chunk, config.top_k, 2 * config.expert_ffn)),
            "shared_out": e((max_chunk, config.hidden)),
            "shared_gate": e((max_chunk, 1)),
        }
    return ws


def new_cache(config: HybridConfig, backend: Backend, max_tokens: int) -> RecurrentCache:
    """KV entries for the attention layers only, and the recurrent layers' states (see RecurrentCache)."""
    n_attention = config.n_layers - config.n_recurrent
    conv = (config.n_recurrent, config.conv_kernel - 1, config.conv_dim)
    ssm = (config.n_recurrent, config.n_v_heads, config.head_k_dim, config.head_v_dim)
    cache = RecurrentCache(
        kv=backend.kv_cache(n_attention, config.n_kv_heads, config.head_dim, max_tokens),
        conv=backend.empty(conv), ssm=backend.empty(ssm), saved_conv=backend.empty(conv), saved_ssm=backend.empty(ssm),
    )
    cache.reset()
    return cache


def attention_block(config: HybridConfig, a: GatedAttention, rope: RopeTable, ws: Workspace, backend: Backend,
                    cache: RecurrentCache, slot: int, n: int) -> None:
    c = config
    proj = ws.extra["proj"][:n]
    bounds = [0, c.q_dim, 2 * c.q_dim, 2 * c.q_dim + c.kv_dim, 2 * c.q_dim + 2 * c.kv_dim]
    if len(a.qkv) == 1:
        backend.linear(ws.h[:n], a.qkv[0], proj[:, : bounds[-1]])
    else:
        for weight, lo, hi in zip(a.qkv, bounds, bounds[1:]):
            backend.linear(ws.h[:n], weight, proj[:, lo:hi])
    q = proj[:, : c.q_dim].reshape(n, c.n_heads, c.head_dim)
    gate = proj[:, c.q_dim : 2 * c.q_dim]
    k = proj[:, 2 * c.q_dim : 2 * c.q_dim + c.kv_dim].reshape(n, c.n_kv_heads, c.head_dim)
    v = proj[:, 2 * c.q_dim + c.kv_dim : 2 * c.q_dim + 2 * c.kv_dim].reshape(n, c.n_kv_heads, c.head_dim)
    backend.rms_norm(q, a.q_norm, c.rms_eps, q)
    backend.rms_norm(k, a.k_norm, c.rms_eps, k)
    attn = ws.attn[:n]
    backend.rope_attention(q, k, v, rope, ROPE_NEOX, cache.kv, slot, ws.start, attn, 1.0 / float(np.sqrt(c.head_dim)))
    backend.sigmoid_gate(attn, gate, attn)
    backend.linear(attn, a.out, ws.delta[:n])


def ffn_block(config: HybridConfig, layer: HybridLayer, ws: Workspace, backend: Backend, n: int) -> None:
    h = ws.h[:n]
    gate, up, down = layer.ffn
    if layer.router is None:
        backend.gated_ffn(h, gate, up, ws.ffn[:n], ws.ffn_scratch[:n], "silu")
        backend.linear(ws.ffn[:n], down, ws.delta[:n])
        return
    e = ws.extra
    backend.linear(h, layer.router, e["router_logits"][:n])
    backend.moe_route(e["router_logits"][:n], config.top_k, config.normalize_weights, e["expert_weights"][:n],
                      e["expert_ids"][:n])
    backend.moe_ffn(h, layer.gate_exps, layer.up_exps, layer.down_exps, e["expert_ids"][:n], e["expert_weights"][:n],
                    ws.delta[:n], e["expert_scratch"][:n], "silu")
    backend.gated_ffn(h, gate, up, ws.ffn[:n], ws.ffn_scratch[:n], "silu")
    shared_out, shared_gate = ws.extra["shared_out"][:n], ws.extra["shared_gate"][:n]
    backend.linear(ws.ffn[:n], down, shared_out)
    backend.linear(h, layer.shared_gate, shared_gate)
    backend.sigmoid_gate(shared_out, shared_gate, ws.delta[:n], accumulate=True)


def forward(config: HybridConfig, weights: HybridWeights, ws: Workspace, backend: Backend, cache: RecurrentCache, n: int,
            logits_out=None):
    """Run the n tokens in ws.tokens[:n] at positions ws.start[0] + i, filling the KV cache of the attention layers
    and advancing the recurrent states (from zeros when the chunk starts at position 0: reading the position on the
    host is cheap on the CPU, the only backend these models run on). Returns the last token's logits (ws.logits), or
    every token's logits in logits_out (n, vocab) when given."""
    c = config
    if int(backend.to_host(ws.start)[0]) == 0:
        cache.reset()
    x, h, delta = ws.x[:n], ws.h[:n], ws.delta[:n]
    e = ws.extra
    backend.embed(weights.token_embd, ws.tokens[:n], x)
    recurrent = attention = 0
    for i, layer in enumerate(weights.layers):
        if i == 0:
            backend.rms_norm(x, layer.attn_norm, c.rms_eps, h)
        else:
            backend.add_rms_norm(delta, x, layer.attn_norm, c.rms_eps, h)
        if c.recurrent(i):
            deltanet.mixer_block(
                layer.mixer, h, e["proj"][:n], e["mixed"][:n], e["core"][:n], delta, cache.conv[recurrent],
                cache.ssm[recurrent], backend, c.n_k_heads, c.tiled, c.rms_eps,
            )
            recurrent += 1
        else:
            attention_block(c, layer.mixer, weights.rope, ws, backend, cache, attention, n)
            attention += 1
        backend.add_rms_norm(delta, x, layer.post_norm, c.rms_eps, h)
        ffn_block(c, layer, ws, backend, n)
    backend.add_rms_norm(delta, x, weights.output_norm, c.rms_eps, h)
    if logits_out is None:
        backend.linear(h[n - 1 : n], weights.output, ws.logits)
        return ws.logits
    backend.linear(h, weights.output, logits_out)
    return logits_out
