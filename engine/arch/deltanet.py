"""The Gated DeltaNet mixer of the hybrid Qwen families (qwen35, qwen35moe, qwen3next) as backend calls.

Per recurrent layer, from the normed input h:
  one projection -> qkv (n_k query heads, n_k key heads, n_v value heads), z (the output gate, n_v heads) and
  the gate logits b, a (n_v each) -> causal depthwise convolution (kernel 4) of qkv with SiLU, continuing from the
  layer's convolution state -> the gated delta rule, continuing from the layer's delta-rule state -> RMSNorm of
  each head's output times silu(z) -> output projection.

How the files differ: qwen35/qwen35moe store `ssm_beta` and `ssm_alpha` and tile the value heads (value head h
reads key head h % n_k); qwen3next stores one `ssm_ba`, per key head its b then its a rows, and groups the value
heads (value head h reads key head h // (n_v / n_k)). Both store `ssm_a` as -exp(A_log) and `ssm_norm` as is.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine import quants
from engine.arch.common import JoinedProjection, WeightLoader, stack_rows
from engine.arch.parts import DELTANET, Buffers, Chunk, DecoderConfig, LayerSource
from engine.backend import Array, Backend, WeightHandle
from engine.gguf_file import GGUFFile, GGUFTensor
from engine.kv_cache import RecurrentCache


@dataclass
class DeltaNetWeights:
    in_proj: JoinedProjection  # the rows of qkv, z and b-then-a
    bounds: list[int]  # the column where each of the three parts of the projection output starts, and the end
    conv: WeightHandle  # (conv_dim, kernel)
    dt_bias: WeightHandle  # (n_v,)
    ssm_a: WeightHandle  # (n_v,), -exp(A_log)
    norm: WeightHandle  # (dv,)
    out: WeightHandle  # (hidden, n_v dv)


def select_rows(name: str, tensor: GGUFTensor, rows: np.ndarray) -> GGUFTensor:
    """A matrix of some of `tensor`'s rows, in the given order (quantized blocks never straddle rows)."""
    elements, block_bytes = quants.block_layout(tensor.qtype)
    row_bytes = tensor.shape[1] // elements * block_bytes
    raw = np.asarray(tensor.raw).reshape(tensor.shape[0], row_bytes)[rows].reshape(-1)
    return GGUFTensor(name, tensor.qtype, (len(rows), tensor.shape[1]), raw)


def gate_logits(gguf: GGUFFile, i: int, n_k_heads: int) -> tuple[GGUFTensor, int]:
    """The b rows then the a rows, one per value head, and how many file tensors they came from. qwen3next's
    ssm_ba holds, per key head, its value heads' b rows then their a rows."""
    fused = gguf.tensors.get(f"blk.{i}.ssm_ba.weight")
    if fused is None:
        parts = [gguf.tensor(f"blk.{i}.ssm_{x}.weight") for x in ("beta", "alpha")]
        return stack_rows(f"blk.{i}.ssm_beta_alpha.weight", parts), 2
    per_k = fused.shape[0] // 2 // n_k_heads
    groups = np.arange(fused.shape[0]).reshape(n_k_heads, 2, per_k)
    order = np.concatenate([groups[:, 0].reshape(-1), groups[:, 1].reshape(-1)])
    return select_rows(f"blk.{i}.ssm_ba.weight", fused, order), 1


def load_mixer(gguf: GGUFFile, loader: WeightLoader, i: int, n_k_heads: int) -> DeltaNetWeights:
    def t(name: str) -> GGUFTensor:
        return gguf.tensor(f"blk.{i}.{name}")

    ba, ba_count = gate_logits(gguf, i, n_k_heads)
    parts = [t("attn_qkv.weight"), t("attn_gate.weight"), ba]
    return DeltaNetWeights(
        in_proj=JoinedProjection.load(loader, f"blk.{i}.ssm_in.weight", parts, counts=[1, 1, ba_count]),
        bounds=[int(b) for b in np.cumsum([0] + [p.shape[0] for p in parts])],
        conv=loader.upload(t("ssm_conv1d.weight")),
        dt_bias=loader.upload(t("ssm_dt.bias")),
        ssm_a=loader.upload(t("ssm_a")),
        norm=loader.upload(t("ssm_norm.weight")),
        out=loader.upload(t("ssm_out.weight")),
    )


def mixer_block(
    w: DeltaNetWeights, h, proj, mixed, core, out, conv_state, ssm_state, backend: Backend, n_k_heads: int,
    tiled: bool, eps: float,
) -> None:
    """From the normed input h (n, hidden) to the mixer's output in `out` (n, hidden), advancing the layer's
    conv_state (kernel - 1, conv_dim) and ssm_state (n_v, dk, dv). proj: (n, conv_dim + n_v dv + 2 n_v),
    mixed: (n, conv_dim) and core: (n, n_v dv) are working buffers."""
    b = w.bounds
    w.in_proj.run(backend, h, proj)
    backend.delta_mixer(proj[:, : b[1]], proj[:, b[1] : b[2]], proj[:, b[2] : b[3]], w.conv, conv_state, w.dt_bias,
                        w.ssm_a, w.norm, eps, ssm_state, mixed, core, n_k_heads, tiled)
    backend.linear(core, w.out, out)


@dataclass
class DeltaNetBuffers(Buffers):
    proj: Array  # (max_chunk, conv_dim + value_dim + 2 n_v): qkv, z, then b and a
    mixed: Array  # (max_chunk, conv_dim): the convolved qkv
    core: Array  # (max_chunk, value_dim): the delta rule's output, normed in place


@dataclass
class DeltaNet:
    """The decoder's part for a Gated DeltaNet layer; `slot` is its state's place among the recurrent layers."""

    weights: DeltaNetWeights
    slot: int

    @staticmethod
    def uploads(config: DecoderConfig) -> int:
        # qkv, the output gate, b and a (one ssm_ba tensor in qwen3next files, whose heads are not tiled), the
        # convolution, dt_bias, A, the norm and the output projection
        return 8 + config.recurrent_shape().tiled

    @classmethod
    def load(cls, source: LayerSource, layer: int) -> DeltaNet:
        c = source.config
        return cls(load_mixer(source.gguf, source.loader, layer, c.recurrent_shape().n_k_heads), c.slot(layer))

    @staticmethod
    def buffers(config: DecoderConfig, backend: Backend, max_chunk: int) -> DeltaNetBuffers:
        s = config.recurrent_shape()
        return DeltaNetBuffers(backend.empty((max_chunk, s.conv_dim + s.value_dim + 2 * s.n_v_heads)),
                               backend.empty((max_chunk, s.conv_dim)), backend.empty((max_chunk, s.value_dim)))

    def run(self, config: DecoderConfig, chunk: Chunk, backend: Backend, cache: RecurrentCache, layer: int) -> None:
        b: DeltaNetBuffers = chunk.parts[DELTANET]
        s = config.deltanet
        mixer_block(self.weights, chunk.h, b.proj, b.mixed, b.core, chunk.delta, cache.conv[self.slot],
                    cache.ssm[self.slot], backend, s.n_k_heads, s.tiled, config.rms_eps)
