"""GGUF blocks repacked at load into the blocks the CPU kernels read, and back to float32 rows.

Every supported type becomes 32-value groups, stored row by row, a row's groups one after another. In the 16
bytes of a 4-bit group, byte j holds value j in its low nibble and value j + 16 in its high nibble (GGUF's own
order for Q4_0), so a kernel widens a group to 32 bytes with one mask and one shift. Families:

- "nibble" (Q4_0, Q4_1, Q5_0, Q5_1): value = d[b] * (lo | hi << 4) + m[b], d and m float32; the optional `hi`
  holds 4 bytes a group, bit i of their little-endian word the fifth bit of value i.
- "nibble_k" (Q4_K, Q5_K): the same lo and hi, and the block's own scales: d holds each group's 6-bit sub-block
  scale and min (uint8), `sup` each 256-value super-block's fp16 d and dmin as float32, and value =
  (sup_d * scale) * q - sup_dmin * min, the float32 steps of gguf's dequantizer.
- "q8" (Q8_0): value = d[b] * q, 32 int8 a group.
- "q2k" (Q2_K): value = (sup_d * (d[2 b + half] & 15)) * q - sup_dmin * (d[2 b + half] >> 4), q in [0, 3] in
  the nibbles, d the file's byte of scale and min for each 16 values, `sup` each super-block's d and dmin as float32
  (rows, groups / 8, 2): 19 bytes a group against the file's 10.5, read by the nibble kernels' steps.
- "iq4" (IQ4_XS): value = (sup[b // 8] * d[b]) * IQ4NL_VALUES[nibble], d each group's 6-bit scale minus 32 (int8),
  `sup` the super-block's fp16 d as float32; the kernels read IQ4NL_VALUES + 128 (unsigned) and take 128 times the
  group's activation sum off, as the other unsigned families take their offsets.
- "q6k" (Q6_K, IQ3_S): value = (sup[b // 8] * d[2 b + half]) * ((lo | hi2 << 4) - 32), d the int8 scale of each 16
  values, `hi` 8 bytes a group, bits 2 s..2 s + 1 of byte t the top bits of value t + 8 s. An IQ3_S level (a grid
  value under its sign, in [-15, 15]) is stored as level + 32 under its group's odd scale 1 + 2 s (both halves of
  the group): gguf's own float32 steps, read by the Q6_K kernels, at twice the file's bytes.
- "q3k" (Q3_K): value = (sup[b // 8] * d[2 b + half]) * ((lo2 | hi << 2) - 4), a quant in [-4, 3] stored plus 4
  under its 6-bit scale minus 32 (int8, "q6k"'s d and sup): `lo` 8 bytes a group of its two low bits (bits 2 s..2 s
  + 1 of byte t: value t + 8 s, as "q6k" keeps its top ones), `hi` 4 bytes a group of third bits (bit i: value i).

The K-quants keep about their file's size (Q4_K 19 bytes a group against 18, Q5_K 23 against 22, Q6_K 26.5
against 26.25, Q3_K 14.5 against 13.75): a mixture's experts kept in RAM are read from there at every token. The
legacy types keep float32
scales (24 bytes a Q4_0 group against 18): the default CPU model's weights, their kernels left as measured.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType as T

from engine.cpu import unpack as unpack_rows
from engine.quant_fields import bits_little, f16_field, split_bits
from engine.quants import block_layout, q2_k_fields, q3_k_fields
from engine.quants_iq import IQ4NL_VALUES, iq3_s_fields, iq4_xs_fields

GROUP = 32
SUPER = 8  # groups in a K-quant super-block (256 values)
NIBBLE_TYPES = frozenset({T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1})
K_NIBBLE_TYPES = frozenset({T.Q4_K, T.Q5_K})
PACKED_TYPES = NIBBLE_TYPES | K_NIBBLE_TYPES | {T.Q8_0, T.Q6_K, T.Q3_K, T.Q2_K, T.IQ4_XS, T.IQ3_S}
# Bytes a group and bytes a super-block of each packed type.
_BYTES = {T.Q4_0: (24, 0), T.Q4_1: (24, 0), T.Q5_0: (28, 0), T.Q5_1: (28, 0), T.Q8_0: (36, 0),
          T.Q4_K: (18, 8), T.Q5_K: (22, 8), T.Q6_K: (26, 4), T.Q3_K: (14, 4), T.Q2_K: (18, 8),
          T.IQ4_XS: (17, 4), T.IQ3_S: (26, 4)}


@dataclass
class Planes:
    """One matrix (rows, k) in the kernels' layout; `family` picks the kernel. A plane a family does not use has
    shape (rows, 0)."""

    family: str  # "nibble", "nibble_k", "q8", "q6k", "q3k", "q2k" or "iq4"
    k: int
    lo: np.ndarray  # uint8 (rows, 16 groups); int8 (rows, 32 groups) for "q8"; uint8 (rows, 8 groups) for "q3k"
    hi: np.ndarray  # uint8 (rows, 4 groups) of fifth (or "q3k"'s third) bits, or (rows, 0); (rows, 8 groups) for "q6k"
    # float32 (rows, groups) for "nibble" and "q8"; uint8 (rows, 2 groups), each group's 6-bit scale then its min,
    # for "nibble_k"; int8 (rows, groups) for "iq4"; int8 (rows, 2 groups), the scale of each 16 values, for "q6k"
    # and "q3k";
    # uint8 (rows, 2 groups), the scale and min of each 16 values, for "q2k"
    d: np.ndarray
    m: np.ndarray  # float32 (rows, groups) of offsets for "nibble"
    # float32 of the fp16 super-block scales: (rows, groups / 8, 2), d and dmin, for "nibble_k" and "q2k";
    # (rows, groups / 8) for "iq4", "q6k" and "q3k"
    sup: np.ndarray

    @property
    def rows(self) -> int:
        return self.lo.shape[0]

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in self.arrays())

    def arrays(self) -> tuple[np.ndarray, ...]:
        """lo, hi, d, m, sup: the order of the fields."""
        return self.lo, self.hi, self.d, self.m, self.sup

    def slice_rows(self, start: int, stop: int) -> "Planes":
        """A view of rows [start, stop) (a stacked expert's matrix is a run of rows)."""
        return Planes(self.family, self.k, *(a[start:stop] for a in self.arrays()))


def packed_nbytes(qtype: T, rows: int, k: int) -> int:
    """Bytes `pack` gives a (rows, k) matrix of a PACKED_TYPES type."""
    per_group, per_super = _BYTES[T(qtype)]
    groups = k // GROUP
    return rows * (groups * per_group + groups // SUPER * per_super)


def pack(raw: np.ndarray, qtype: T, rows: int, k: int) -> Planes:
    """Repack the GGUF bytes of a (rows, k) matrix of a PACKED_TYPES type."""
    _, block_bytes = block_layout(qtype)
    blocks = np.ascontiguousarray(raw).reshape(-1).view(np.uint8).reshape(-1, block_bytes)
    groups = k // GROUP
    none = np.zeros((rows, 0), np.float32)
    if qtype == T.Q8_0:
        q = blocks[:, 2:].view(np.int8).reshape(rows, -1)
        return Planes("q8", k, np.ascontiguousarray(q), np.zeros((rows, 0), np.uint8),
                      f16_field(blocks, 0).reshape(rows, groups), none, none)
    if qtype == T.Q6_K:
        return _pack_q6k(blocks, rows, k)
    if qtype == T.Q3_K:
        q, scales, d = q3_k_fields(blocks)
        q = (q + np.int8(4)).view(np.uint8).reshape(-1, GROUP)
        return Planes("q3k", k, _two_bit_bytes(q).reshape(rows, -1),
                      np.packbits(q >> np.uint8(2), axis=-1, bitorder="little").reshape(rows, -1),
                      np.ascontiguousarray(scales).reshape(rows, -1), none, d.reshape(rows, -1))
    if qtype == T.IQ3_S:
        levels, odd, d = iq3_s_fields(blocks)
        return _q6k_planes((levels + np.int8(32)).view(np.uint8).reshape(-1, GROUP), np.repeat(odd, 2, axis=1), d,
                           rows, k)
    if qtype == T.Q2_K:
        q, scales, d, dmin = q2_k_fields(blocks)
        return Planes("q2k", k, _nibble_bytes(q.reshape(-1, GROUP)).reshape(rows, -1), np.zeros((rows, 0), np.uint8),
                      np.ascontiguousarray(scales).reshape(rows, 2 * groups), none,
                      np.concatenate((d, dmin), axis=1).reshape(rows, groups // SUPER, 2))
    if qtype == T.IQ4_XS:
        index, scales, d = iq4_xs_fields(blocks)
        return Planes("iq4", k, _nibble_bytes(index.reshape(-1, GROUP)).reshape(rows, -1), np.zeros((rows, 0), np.uint8),
                      scales.reshape(rows, groups), none, d.reshape(rows, -1))
    if qtype in K_NIBBLE_TYPES:
        q, scales_mins, sup = _k_nibble_values(blocks, qtype)
        d, m, family = scales_mins.reshape(rows, 2 * groups), none, "nibble_k"
        sup = sup.reshape(rows, groups // SUPER, 2)
    else:
        q, d, m = _nibble_values(blocks, qtype)
        d, m, sup, family = d.reshape(rows, groups), m.reshape(rows, groups), none, "nibble"
    if qtype in (T.Q5_0, T.Q5_1, T.Q5_K):
        hi = np.packbits(q >> np.uint8(4), axis=-1, bitorder="little").reshape(rows, -1)
    else:
        hi = np.zeros((rows, 0), np.uint8)
    return Planes(family, k, _nibble_bytes(q).reshape(rows, -1), hi, d, m, sup)


def unpack(planes: Planes, rows: np.ndarray | slice, out: np.ndarray) -> None:
    """Write the float32 values of the selected rows into out (n, k), C-contiguous."""
    picked = np.arange(planes.rows)[rows] if isinstance(rows, slice) else np.asarray(rows, np.int64)
    if planes.family == "nibble":
        unpack_rows.nibble_rows(planes.lo, planes.hi, planes.d, planes.m, picked, out)
    elif planes.family == "nibble_k":
        unpack_rows.nibble_k_rows(planes.lo, planes.hi, planes.d, planes.sup, picked, out)
    elif planes.family == "q8":
        unpack_rows.q8_rows(planes.lo, planes.d, picked, out)
    elif planes.family == "q2k":
        unpack_rows.q2k_rows(planes.lo, planes.d, planes.sup, picked, out)
    elif planes.family == "iq4":
        unpack_rows.iq4_rows(planes.lo, planes.d, planes.sup, IQ4NL_VALUES, picked, out)
    elif planes.family == "q3k":
        unpack_rows.q3k_rows(planes.lo, planes.hi, planes.d, planes.sup, picked, out)
    else:
        unpack_rows.q6k_rows(planes.lo, planes.hi, planes.d, planes.sup, picked, out)


def _nibble_bytes(q: np.ndarray) -> np.ndarray:
    """Values (n, 32) -> (n, 16) bytes: value j's low 4 bits in byte j's low nibble, value j + 16's in its high one."""
    return (q[:, :16] & np.uint8(15)) | ((q[:, 16:] & np.uint8(15)) << np.uint8(4))


def _nibble_values(blocks: np.ndarray, qtype: T) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Unsigned quants (n_groups, 32) and each group's float32 scale and offset, for Q4_0, Q4_1, Q5_0 and Q5_1."""
    d = f16_field(blocks, 0)[:, 0]
    offset = 4 if qtype in (T.Q4_1, T.Q5_1) else 2
    five = qtype in (T.Q5_0, T.Q5_1)
    qs = blocks[:, offset + (4 if five else 0):]
    q = split_bits(qs, 4).reshape(-1, GROUP)
    if five:
        q |= bits_little(blocks[:, offset:offset + 4]) << np.uint8(4)
    if offset == 4:
        m = f16_field(blocks, 2)[:, 0]
    else:
        m = -(16.0 if five else 8.0) * d
    return q, d, m.astype(np.float32)


def _k_nibble_values(blocks: np.ndarray, qtype: T) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: unsigned quants (n_groups, 32), each group's 6-bit scale and min (n_groups, 2) and each block's
    float32 d and dmin (n_blocks, 2)."""
    n = blocks.shape[0]
    scales, mins = _k_scales_mins(blocks[:, 4:16])  # (n, 8) each
    qs = blocks[:, 16:144] if qtype == T.Q4_K else blocks[:, 48:176]
    q = split_bits(qs.reshape(n, 4, 32), 4).reshape(n, 8, 32)  # 32 bytes hold two sub-blocks, low nibbles first
    if qtype == T.Q5_K:
        q |= split_bits(blocks[:, 16:48], 1).reshape(n, 8, 32) << np.uint8(4)
    sup = np.concatenate((f16_field(blocks, 0), f16_field(blocks, 2)), axis=1)
    return q.reshape(-1, GROUP), np.stack((scales, mins), axis=-1).reshape(-1, 2), sup


def _k_scales_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 six-bit scales and 8 six-bit mins of Q4_K/Q5_K, from their 12 packed bytes."""
    a, b, c = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = np.concatenate((a & np.uint8(0x3F), (c & np.uint8(0x0F)) | ((a >> np.uint8(6)) << np.uint8(4))), axis=1)
    mins = np.concatenate((b & np.uint8(0x3F), (c >> np.uint8(4)) | ((b >> np.uint8(6)) << np.uint8(4))), axis=1)
    return scales, mins


def _pack_q6k(blocks: np.ndarray, rows: int, k: int) -> Planes:
    n = blocks.shape[0]
    low = split_bits(blocks[:, :128].reshape(n, 2, 64), 4).reshape(n, 2, 128)
    high = split_bits(blocks[:, 128:192].reshape(n, 2, 32), 2).reshape(n, 2, 128)
    q = (low | (high << np.uint8(4))).reshape(-1, GROUP)  # 0-63, value + 32
    scales = np.ascontiguousarray(blocks[:, 192:208]).view(np.int8)  # (n, 16): one per 16 values
    return _q6k_planes(q, scales, f16_field(blocks, 208), rows, k)


def _q6k_planes(q: np.ndarray, scales: np.ndarray, d: np.ndarray, rows: int, k: int) -> Planes:
    """The "q6k" planes of values q + 32 (n_groups, 32) in 0-63, int8 scales (n_blocks, 16) and d (n_blocks, 1)."""
    return Planes("q6k", k, _nibble_bytes(q).reshape(rows, -1), _two_bit_bytes(q >> np.uint8(4)).reshape(rows, -1),
                  scales.reshape(rows, -1), np.zeros((rows, 0), np.float32), d.reshape(rows, -1))


def _two_bit_bytes(q: np.ndarray) -> np.ndarray:
    """Values (n, 32) -> (n, 8) bytes of their low two bits: bits 2 s..2 s + 1 of byte t hold value t + 8 s's."""
    part = (q & np.uint8(3)).reshape(-1, 4, 8)  # [group, s, t]
    return part[:, 0] | (part[:, 1] << np.uint8(2)) | (part[:, 2] << np.uint8(4)) | (part[:, 3] << np.uint8(6))
