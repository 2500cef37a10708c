"""The one decoder every family runs, as backend calls:

    embed (times the config's embedding scale)
    per layer: rms_norm (layer 0) or add_rms_norm (the previous output's residual add fused with this norm)
               -> mixer -> [rms_norm of its output, post_norms] -> add_rms_norm (residual add, the FFN's norm)
               -> FFN -> [rms_norm of its output, post_norms]
    add_rms_norm (the last residual add, output norm) -> the output head on the last token only (on every token
    when the caller asks for all logits)

The GPU backend captures a decode step as a CUDA graph and was tuned on exactly this sequence. A family module
only fills a DecoderConfig (engine/arch/parts.py); a new mixer or FFN kind is one LayerPart class entered in
MIXERS or FFNS (kind names are unique across both), which the layer loop runs without knowing it. GGUF norm
weights are used as stored (llama.cpp's converter already adds Gemma's +1).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from engine.arch.attention import Attention
from engine.arch.common import WeightLoader
from engine.arch.deltanet import DeltaNet
from engine.arch.ffn import DenseFFN, MoeFFN, SharedMoeFFN
from engine.arch.gated_attention import GatedAttention
from engine.arch.parts import (ATTENTION, DELTANET, DENSE, GATED_ATTENTION, MOE, MOE_SHARED, Buffers, Chunk,
                               DecoderConfig, LayerPart, LayerSource)
from engine.backend import Array, Backend, KVCache, WeightHandle
from engine.errors import EngineError
from engine.gguf_file import GGUFFile
from engine.kv_cache import RecurrentCache, WindowedCache

MIXERS: dict[str, type[LayerPart]] = {ATTENTION: Attention, GATED_ATTENTION: GatedAttention, DELTANET: DeltaNet}
FFNS: dict[str, type[LayerPart]] = {DENSE: DenseFFN, MOE: MoeFFN, MOE_SHARED: SharedMoeFFN}


@dataclass
class Layer:
    mixer_norm: WeightHandle
    mixer: LayerPart
    post_mixer_norm: WeightHandle | None
    ffn_norm: WeightHandle
    ffn: LayerPart
    post_ffn_norm: WeightHandle | None


@dataclass
class DecoderWeights:
    token_embd: WeightHandle
    layers: list[Layer]
    output_norm: WeightHandle
    output: WeightHandle  # token_embd itself when the embeddings are tied


@dataclass
class Workspace:
    """Activation buffers for chunks of up to `max_chunk` tokens, allocated once."""

    ids: Array  # (1 + max_chunk,) int32: the chunk's first position, then its token ids; set by the caller in one copy
    tokens: Array  # ids[1:], the token ids
    start: Array  # ids[:1], the position of the chunk's first token
    x: Array  # (max_chunk, hidden) residual stream
    h: Array  # (max_chunk, hidden) normed input of the next part
    delta: Array  # (max_chunk, hidden) a part's output, added to x by the next fused norm
    logits: Array  # (1, vocab) of the chunk's last token
    max_chunk: int
    parts: dict[str, Buffers]  # each part kind's own buffers, by kind

    def chunk(self, n: int) -> Chunk:
        parts = {kind: buffers.first(n) for kind, buffers in self.parts.items()}
        return Chunk(n, self.tokens[:n], self.start, self.x[:n], self.h[:n], self.delta[:n], parts)


def part_kinds(config: DecoderConfig) -> dict[str, type[LayerPart]]:
    """The part kinds the config's layers use, by name; EngineError for one the decoder does not have."""
    if not len(config.mixer_kinds) == len(config.ffn_kinds) == config.n_layers:
        raise EngineError(f"The decoder config names the parts of {len(config.mixer_kinds)} and "
                          f"{len(config.ffn_kinds)} layers, but the model has {config.n_layers}.")
    used: dict[str, type[LayerPart]] = {}
    for what, table, registry, kinds in (("a mixer", "MIXERS", MIXERS, config.mixer_kinds),
                                         ("an FFN", "FFNS", FFNS, config.ffn_kinds)):
        for layer, kind in enumerate(kinds):
            if kind not in registry:
                raise EngineError(f"Layer {layer} asks for {what} of kind {kind!r}, which the decoder does not have "
                                  f"(it has {', '.join(sorted(registry))}); enter its class in {table} in "
                                  "engine/arch/decoder.py.")
            used[kind] = registry[kind]
    return used


def load_weights(
    gguf: GGUFFile,
    config: DecoderConfig,
    backend: Backend,
    max_positions: int,
    on_progress: Callable[[int, int, str], None] | None = None,
    should_cancel: Callable[[], bool] | None = None,
    host_expert_layers: frozenset[int] = frozenset(),
) -> DecoderWeights:
    """host_expert_layers: the MoE layers whose routed experts stay in RAM, computed by the CPU."""
    c = config
    kinds = part_kinds(c)
    has_output = "output.weight" in gguf.tensors
    norms = 2 + 2 * c.post_norms
    per_layer = (kinds[m].uploads(c) + kinds[f].uploads(c) + norms for m, f in zip(c.mixer_kinds, c.ffn_kinds))
    loader = WeightLoader(backend, 2 + has_output + sum(per_layer), on_progress, should_cancel)
    source = LayerSource(gguf, c, loader, max_positions, host_expert_layers)
    token_embd = loader.upload(gguf.tensor("token_embd.weight"))
    layers = []
    for i in range(c.n_layers):
        # Keyword arguments run in the order written: the mixer's tensors first, then the norms, then the FFN's.
        layers.append(Layer(
            mixer=kinds[c.mixer_kinds[i]].load(source, i),
            mixer_norm=source.upload(i, "attn_norm.weight"),
            post_mixer_norm=source.upload(i, "post_attention_norm.weight") if c.post_norms else None,
            ffn_norm=source.upload(i, f"{c.ffn_norm}.weight"),
            ffn=kinds[c.ffn_kinds[i]].load(source, i),
            post_ffn_norm=source.upload(i, "post_ffw_norm.weight") if c.post_norms else None,
        ))
    output_norm = loader.upload(gguf.tensor("output_norm.weight"))
    output = loader.upload(gguf.tensor("output.weight")) if has_output else token_embd
    source.make_ropes()
    return DecoderWeights(token_embd, layers, output_norm, output)


def new_cache(config: DecoderConfig, backend: Backend, max_tokens: int, kind: str = "full",
              chunk: int = 1) -> KVCache | RecurrentCache | WindowedCache:
    """The KV cache of every layer, of `kind` (engine.backend.KV_CACHE_TYPES); with sliding-window layers and more
    positions than window + chunk - 1 (chunk: the most tokens a forward pass takes), a WindowedCache whose sliding
    layers keep only those; with DeltaNet layers, a RecurrentCache: KV entries for the other layers only and the
    recurrent layers' states (zeros), each layer at its config.slot."""
    c = config
    n_recurrent = c.mixer_kinds.count(DELTANET)
    ring = c.sliding_window + chunk - 1
    if any(c.sliding_layers) and max_tokens > ring:
        sliding = [c.sliding(i) for i in range(c.n_layers)]
        n_sliding = sum(sliding)
        slots = tuple((s, sliding[:i].count(s)) for i, s in enumerate(sliding))
        return WindowedCache(backend.kv_cache(c.n_layers - n_sliding, c.n_kv_heads, c.head_dim, max_tokens, kind),
                             backend.kv_cache(n_sliding, c.n_kv_heads, c.head_dim, ring, kind), c.sliding_window, slots)
    if not n_recurrent:
        return backend.kv_cache(c.n_layers, c.n_kv_heads, c.head_dim, max_tokens, kind)
    s = c.deltanet
    conv = (n_recurrent, s.conv_kernel - 1, s.conv_dim)
    ssm = (n_recurrent, s.n_v_heads, s.head_k_dim, s.head_v_dim)
    cache = RecurrentCache(
        kv=backend.kv_cache(c.n_layers - n_recurrent, c.n_kv_heads, c.head_dim, max_tokens, kind),
        conv=backend.empty(conv), ssm=backend.empty(ssm), saved_conv=backend.empty(conv), saved_ssm=backend.empty(ssm),
        assign=backend.assign,
    )
    cache.reset()
    return cache


def new_workspace(config: DecoderConfig, backend: Backend, max_chunk: int) -> Workspace:
    # Allocated in the order a layer uses them, the placement in device memory the decode step was tuned with.
    c, e, kinds = config, backend.empty, part_kinds(config)

    def buffers(used: tuple[str, ...]) -> dict[str, Buffers]:
        return {kind: kinds[kind].buffers(c, backend, max_chunk) for kind in dict.fromkeys(used)}

    ids = e((1 + max_chunk,), np.int32)
    x, h = e((max_chunk, c.hidden)), e((max_chunk, c.hidden))
    parts = buffers(c.mixer_kinds)
    delta = e((max_chunk, c.hidden))
    parts |= buffers(c.ffn_kinds)
    logits = e((1, c.vocab_size))
    return Workspace(ids, ids[1:], ids[:1], x, h, delta, logits, max_chunk, parts)


def forward(
    config: DecoderConfig,
    weights: DecoderWeights,
    ws: Workspace,
    backend: Backend,
    cache: KVCache | RecurrentCache | WindowedCache,
    n: int,
    logits_out: Array | None = None,
) -> Array:
    """Run the n tokens in ws.tokens[:n] at positions ws.start[0] + i, filling the KV cache (and advancing the
    recurrent states, which the caller resets for a chunk at position 0). Returns the last token's logits
    (ws.logits), or every token's logits in logits_out (n, vocab) when given."""
    c = config
    chunk = ws.chunk(n)
    x, h, delta = chunk.x, chunk.h, chunk.delta
    backend.embed(weights.token_embd, chunk.tokens, x, c.embed_scale)
    for i, layer in enumerate(weights.layers):
        if i == 0:
            backend.rms_norm(x, layer.mixer_norm, c.rms_eps, h)
        else:
            backend.add_rms_norm(delta, x, layer.mixer_norm, c.rms_eps, h)
        layer.mixer.run(c, chunk, backend, cache, i)
        if layer.post_mixer_norm is not None:
            backend.rms_norm(delta, layer.post_mixer_norm, c.rms_eps, delta)
        backend.add_rms_norm(delta, x, layer.ffn_norm, c.rms_eps, h)
        layer.ffn.run(c, chunk, backend, cache, i)
        if layer.post_ffn_norm is not None:
            backend.rms_norm(delta, layer.post_ffn_norm, c.rms_eps, delta)
    backend.add_rms_norm(delta, x, weights.output_norm, c.rms_eps, h)
    if logits_out is None:
        backend.linear(h[n - 1 : n], weights.output, ws.logits)
        return ws.logits
    backend.linear(h, weights.output, logits_out)
    return logits_out
