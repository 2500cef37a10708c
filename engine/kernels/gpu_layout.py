"""How the GPU backend lays out a GGUF tensor's quantized blocks in device memory (host side, NumPy only).

Each block's fields are split into up to four planes (Q: low quant bits, H: high bits, S: sub-block scales,
D: fp16 block scales) so that every block's quant bytes start on a 16-byte boundary and a kernel can read them
with one wide load (GGUF blocks of 18, 22 or 34 bytes cannot be). The bytes are the GGUF's, regrouped, with one
exception made for the decode kernels' loads: Q4_K keeps its fp16 d and dmin with the scales (one 16-byte S
entry a block) and stores each 32-weight sub-block's nibbles in 16 bytes of their own, arranged as Q4_0 does
(REARRANGED), so that no two lanes load the same quant bytes. engine/kernels/quant_blocks.cuh decodes these
planes; its per-type Q/H/S/D byte counts must match PLANES.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType as T

from engine import quants

# Per type: plane name -> (first byte, end byte) of that field inside one GGUF block.
PLANES: dict[T, dict[str, tuple[int, int]]] = {
    T.Q4_0: {"d": (0, 2), "q": (2, 18)},
    T.Q4_1: {"d": (0, 4), "q": (4, 20)},
    T.Q5_0: {"d": (0, 2), "h": (2, 6), "q": (6, 22)},
    T.Q5_1: {"d": (0, 4), "h": (4, 8), "q": (8, 24)},
    T.Q8_0: {"d": (0, 2), "q": (2, 34)},
    T.Q4_K: {"s": (0, 16), "q": (16, 144)},
    T.Q5_K: {"d": (0, 4), "s": (4, 16), "h": (16, 48), "q": (48, 176)},
    T.Q6_K: {"q": (0, 128), "h": (128, 192), "s": (192, 208), "d": (208, 210)},
    T.Q3_K: {"h": (0, 32), "q": (32, 96), "s": (96, 108), "d": (108, 110)},
    T.IQ4_XS: {"d": (0, 2), "s": (2, 8), "q": (8, 136)},
    T.IQ3_S: {"d": (0, 2), "q": (2, 66), "h": (66, 106), "s": (106, 110)},  # h: qh, then signs
}
# Where the fp16 block scales (d, and m or dmin where present) lie inside a GGUF block.
FP16_SCALES: dict[T, tuple[int, int]] = {**{t: f["d"] for t, f in PLANES.items() if "d" in f}, T.Q4_K: (0, 4)}


def _q4_k_by_sub_block(q: np.ndarray) -> np.ndarray:
    """(n, 128) Q4_K quant bytes, where the 32 bytes of pair p hold sub-block 2p in their low nibbles and 2p + 1
    in their high nibbles, to 16 bytes a sub-block: weight i in the low nibble of byte i, i + 16 in the high."""
    pairs = q.reshape(-1, 4, 32)
    out = np.empty((pairs.shape[0], 4, 2, 16), np.uint8)
    for half, sub in enumerate((pairs & 0xF, pairs >> 4)):
        out[:, :, half] = sub[:, :, :16] | (sub[:, :, 16:] << 4)
    return out.reshape(-1, 128)


def _q4_k_by_pair(q: np.ndarray) -> np.ndarray:
    """The inverse of _q4_k_by_sub_block."""
    subs = q.reshape(-1, 8, 16)
    weights = np.concatenate([subs & 0xF, subs >> 4], axis=2).reshape(-1, 4, 2, 32)
    return (weights[:, :, 0] | (weights[:, :, 1] << 4)).reshape(-1, 128)


# Planes whose bytes are rearranged within each block on the way to the GPU: (type, plane) -> (there, back).
REARRANGED = {(T.Q4_K, "q"): (_q4_k_by_sub_block, _q4_k_by_pair)}

FLOAT_TYPES = {T.F32: np.float32, T.F16: np.float16, T.BF16: np.uint16}
KERNEL_SUFFIX = {
    T.F32: "f32", T.F16: "f16", T.BF16: "bf16", T.Q4_0: "q4_0", T.Q4_1: "q4_1", T.Q5_0: "q5_0",
    T.Q5_1: "q5_1", T.Q8_0: "q8_0", T.Q4_K: "q4_k", T.Q5_K: "q5_k", T.Q6_K: "q6_k", T.Q3_K: "q3_k",
    T.IQ4_XS: "iq4_xs", T.IQ3_S: "iq3_s",
}
PLANE_ORDER = ("q", "h", "s", "d")
ALIGN = 256  # each plane starts on this boundary inside the one device buffer


@dataclass(frozen=True)
class PlanarLayout:
    """Where each plane of a tensor lies in one byte buffer: name -> (offset, nbytes)."""

    offsets: dict[str, tuple[int, int]]
    nbytes: int


def supported(qtype: T) -> bool:
    return qtype in PLANES or qtype in FLOAT_TYPES


def planar_layout(qtype: T, n_blocks: int) -> PlanarLayout:
    offsets, at = {}, 0
    for name in PLANE_ORDER:
        if name in PLANES[qtype]:
            lo, hi = PLANES[qtype][name]
            offsets[name] = (at, (hi - lo) * n_blocks)
            at += -(-(hi - lo) * n_blocks // ALIGN) * ALIGN
    return PlanarLayout(offsets, at)


def to_planar(raw: np.ndarray, qtype: T) -> tuple[np.ndarray, PlanarLayout]:
    """The blocks of `raw` (a tensor's GGUF bytes) regrouped into one uint8 buffer of planes."""
    _, block_bytes = quants.block_layout(qtype)
    blocks = np.asarray(raw, dtype=np.uint8).reshape(-1, block_bytes)
    layout = planar_layout(qtype, blocks.shape[0])
    buf = np.zeros(layout.nbytes, np.uint8)
    for name, (offset, nbytes) in layout.offsets.items():
        lo, hi = PLANES[qtype][name]
        field = blocks[:, lo:hi]
        if (qtype, name) in REARRANGED:
            field = REARRANGED[qtype, name][0](field)
        buf[offset : offset + nbytes] = field.reshape(-1)
    return buf, layout


def from_planar(buf: np.ndarray, layout: PlanarLayout, qtype: T) -> np.ndarray:
    """The GGUF bytes back from a planar buffer (the inverse of to_planar)."""
    _, block_bytes = quants.block_layout(qtype)
    first = next(iter(layout.offsets))
    lo, hi = PLANES[qtype][first]
    n_blocks = layout.offsets[first][1] // (hi - lo)
    blocks = np.empty((n_blocks, block_bytes), np.uint8)
    for name, (offset, nbytes) in layout.offsets.items():
        lo, hi = PLANES[qtype][name]
        field = buf[offset : offset + nbytes].reshape(n_blocks, hi - lo)
        if (qtype, name) in REARRANGED:
            field = REARRANGED[qtype, name][1](field)
        blocks[:, lo:hi] = field
    return blocks.reshape(-1)


def random_blocks(qtype: T, n_blocks: int, rng: np.random.Generator, typical: float = 0.02) -> np.ndarray:
    """GGUF bytes of n_blocks random blocks whose fp16 scales (the D fields) are set so the decoded values have
    a standard deviation near `typical`: inputs for kernel tests and for synthetic speed-test models (random
    networks with much larger weights overflow float16 activations)."""
    _, block_bytes = quants.block_layout(qtype)
    blocks = rng.integers(0, 256, size=(n_blocks, block_bytes), dtype=np.uint8)
    lo, hi = FP16_SCALES[qtype]
    blocks[:, lo:hi] = rng.standard_normal((n_blocks, (hi - lo) // 2)).astype(np.float16).view(np.uint8)
    sample = blocks[: min(n_blocks, 256)]
    spread = float(np.std(quants.dequantize(sample.reshape(-1), qtype, (sample.size // block_bytes * quants.block_layout(qtype)[0],))))
    # Every decoded value is linear in the D fields (d, and m or dmin where present).
    scales = blocks[:, lo:hi].copy().view(np.float16).astype(np.float32) * np.float32(typical / spread)
    blocks[:, lo:hi] = scales.astype(np.float16).view(np.uint8)
    return blocks.reshape(-1)
