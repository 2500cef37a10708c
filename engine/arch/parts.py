"""The seam between the decoder's layer loop and the parts a layer is built from (a mixer, an FFN): the config
they read, the buffers they compute in, and where they load their weights from.

A layer part reads the normed input `chunk.h` and writes its output to `chunk.delta`; the loop around it does
the norms and residual adds. A part kind is a class with the four members of `LayerPart`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Protocol

import numpy as np

from engine.arch.common import WeightLoader, hparam, rope_inv_freq
from engine.backend import ROPE_NORMAL, Array, Backend, KVCache, RopeTable, WeightHandle
from engine.errors import EngineError
from engine.gguf_file import GGUFFile, GGUFTensor
from engine.kv_cache import RecurrentCache, WindowedCache

ATTENTION = "attention"
GATED_ATTENTION = "gated_attention"  # the hybrids' attention: an output gate per head, KV only for these layers
DELTANET = "deltanet"  # Gated DeltaNet, a recurrent mixer with a fixed-size state (engine/arch/deltanet.py)
DENSE = "dense"
MOE = "moe"
MOE_SHARED = "moe_shared"  # routed experts plus a shared expert scaled by a sigmoid gate


@dataclass(frozen=True)
class Experts:
    """A routed mixture of experts: each token runs `top_k` of `count` gated FFNs of width `width`."""

    count: int
    top_k: int
    width: int
    normalize_weights: bool  # renormalize the top_k routing weights to sum to 1
    shared_width: int = 0  # of the shared expert ("moe_shared" layers)


@dataclass(frozen=True)
class DeltaNetShape:
    """The Gated DeltaNet layers' geometry."""

    conv_kernel: int
    n_k_heads: int  # query and key heads
    n_v_heads: int  # value heads, and heads of the state
    head_k_dim: int
    head_v_dim: int
    tiled: bool  # value head h reads key head h % n_k_heads (qwen35 files), else h // (n_v / n_k) (qwen3next)

    @property
    def conv_dim(self) -> int:
        """Channels of the convolution: the query, key and value heads."""
        return 2 * self.n_k_heads * self.head_k_dim + self.value_dim

    @property
    def value_dim(self) -> int:
        return self.n_v_heads * self.head_v_dim


@dataclass(frozen=True)
class DecoderConfig:
    """Everything the decoder needs to know about a model; a family module fills it from the GGUF."""

    n_layers: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rot_dim: int
    rope_base: float
    rms_eps: float
    vocab_size: int
    context_length: int
    attn_scale: float  # attention scores are q.k * attn_scale
    ffn_width: int  # of the dense FFN (0 where no layer has one)
    mixer_kinds: tuple[str, ...]  # per layer, a key of decoder.MIXERS
    ffn_kinds: tuple[str, ...]  # per layer, a key of decoder.FFNS
    rope_style: str = ROPE_NORMAL
    qkv_bias: bool = False  # Qwen2
    qk_norm: bool = False  # per-head RMSNorm of Q and K before the rotary (Qwen3, Gemma 3)
    post_norms: bool = False  # Gemma 3: each part's output is RMS-normed before the residual add
    activation: str = "silu"  # of the gated FFNs: "silu" or "gelu_tanh"
    embed_scale: float = 1.0
    sliding_window: int = 0
    sliding_layers: tuple[bool, ...] = ()  # True where a layer attends within the window (Gemma 3); () none
    local_rope_base: float = 0.0  # the sliding layers' own rotary base, unscaled
    experts: Experts | None = None  # for the "moe" and "moe_shared" FFNs
    deltanet: DeltaNetShape | None = None  # for the "deltanet" mixer
    ffn_norm: str = "ffn_norm"  # the FFN's input norm tensor (the hybrids name it post_attention_norm)

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    def sliding(self, layer: int) -> bool:
        return bool(self.sliding_layers) and self.sliding_layers[layer]

    def slot(self, layer: int) -> int:
        """The layer's place in its cache: among the recurrent layers for a DeltaNet layer, else among the others
        (a hybrid model keeps KV entries for its attention layers only)."""
        recurrent = self.mixer_kinds[layer] == DELTANET
        return sum((kind == DELTANET) == recurrent for kind in self.mixer_kinds[:layer])

    def recurrent_shape(self) -> DeltaNetShape:
        """The geometry of the "deltanet" layers, or EngineError where the config has none."""
        if self.deltanet is None:
            raise EngineError("The decoder config has Gated DeltaNet layers but no `deltanet` geometry.")
        return self.deltanet

    def moe(self) -> Experts:
        """The experts of the "moe" FFN layers, or EngineError where the config has none."""
        if self.experts is None:
            raise EngineError("The decoder config has mixture-of-experts layers but no `experts` geometry.")
        return self.experts


def read_decoder_config(gguf: GGUFFile, rope_base: float, rms_eps: float, ffn_width: int | None = None) -> DecoderConfig:
    """A plain decoder (Llama's: attention and a dense SwiGLU FFN in every layer) from the metadata; the
    arguments are the family's defaults for keys a file may leave out (`ffn_width` None: the file must give
    it). Families change what differs with dataclasses.replace."""
    n_heads = int(hparam(gguf, "attention.head_count"))
    hidden = int(hparam(gguf, "embedding_length"))
    head_dim = int(hparam(gguf, "attention.key_length", hidden // n_heads))
    n_layers = int(hparam(gguf, "block_count"))
    return DecoderConfig(
        n_layers=n_layers,
        hidden=hidden,
        n_heads=n_heads,
        n_kv_heads=int(hparam(gguf, "attention.head_count_kv", n_heads)),
        head_dim=head_dim,
        rot_dim=int(hparam(gguf, "rope.dimension_count", head_dim)),
        rope_base=float(hparam(gguf, "rope.freq_base", rope_base)),
        rms_eps=float(hparam(gguf, "attention.layer_norm_rms_epsilon", rms_eps)),
        vocab_size=int(gguf.tensor("token_embd.weight").shape[0]),
        context_length=int(hparam(gguf, "context_length")),
        attn_scale=1.0 / float(np.sqrt(head_dim)),
        ffn_width=int(hparam(gguf, "feed_forward_length", ffn_width)),
        mixer_kinds=(ATTENTION,) * n_layers,
        ffn_kinds=(DENSE,) * n_layers,
    )


@dataclass
class Buffers:
    """A part kind's activation buffers, each with max_chunk leading rows."""

    def first(self, n: int) -> Buffers:
        """The same buffers viewed for a chunk of n tokens."""
        return type(self)(**{f.name: getattr(self, f.name)[:n] for f in fields(self)})


@dataclass
class Chunk:
    """The workspace viewed for the n tokens of one forward pass (made once per pass)."""

    n: int
    tokens: Array  # (n,) int32
    start: Array  # (1,) int32, the position of the first token
    x: Array  # (n, hidden) residual stream
    h: Array  # (n, hidden) normed input of the current part
    delta: Array  # (n, hidden) the part's output, added to x by the next fused norm
    parts: dict[str, Any]  # each part kind's Buffers, by kind


@dataclass
class LayerSource:
    """What a part loads from: the file, the config, the loader that counts progress, and the rotary tables."""

    gguf: GGUFFile
    config: DecoderConfig
    loader: WeightLoader
    max_positions: int
    host_expert_layers: frozenset[int] = frozenset()  # layers whose routed experts live in RAM (the CPU runs them)
    _ropes: dict[bool, RopeTable] = field(default_factory=dict)

    def tensor(self, layer: int, name: str) -> GGUFTensor:
        return self.gguf.tensor(f"blk.{layer}.{name}")

    def upload(self, layer: int, name: str, host: bool = False) -> WeightHandle:
        return self.loader.upload(self.tensor(layer, name), host=host)

    def rope(self, sliding: bool) -> RopeTable:
        """The global layers' table (the file's base and scaling) or the sliding layers' (their base, unscaled),
        one shared by every layer that rotates with it; filled by `make_ropes`."""
        return self._ropes.setdefault(sliding, RopeTable(None, None))

    def make_ropes(self) -> None:
        """Fill the tables asked for, once every weight is uploaded: the decode step was tuned with them after the
        weights in device memory (made among layer 0's weights, with the workspace in another order, the 1.2B
        Q4_0 model decoded 0.3% slower on the H200)."""
        c = self.config
        for sliding in sorted(self._ropes):
            base = c.local_rope_base if sliding else c.rope_base
            made = self.loader.backend.rope_table(rope_inv_freq(self.gguf, c.rot_dim, base, scaled=not sliding),
                                                  self.max_positions)
            self._ropes[sliding].cos, self._ropes[sliding].sin = made.cos, made.sin


class LayerPart(Protocol):
    """A mixer or an FFN: one layer's weights of that kind, and what the kind computes with them."""

    @staticmethod
    def uploads(config: DecoderConfig) -> int:
        """Progress steps `load` reports for one layer."""
        ...

    @classmethod
    def load(cls, source: LayerSource, layer: int) -> LayerPart: ...

    @staticmethod
    def buffers(config: DecoderConfig, backend: Backend, max_chunk: int) -> Buffers:
        """The kind's activation buffers, allocated once per model and shared by its layers."""
        ...

    def run(self, config: DecoderConfig, chunk: Chunk, backend: Backend,
            cache: KVCache | RecurrentCache | WindowedCache,
            layer: int) -> None:
        """From chunk.h to chunk.delta; `cache` is a RecurrentCache in models with DeltaNet layers."""
        ...
