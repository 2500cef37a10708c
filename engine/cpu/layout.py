"""GGUF blocks repacked at load into the blocks the CPU kernels read, and back to float32 rows.

Every supported type becomes 32-value groups, stored row by row, a row's groups one after another. In the 16
bytes of a 4-bit group, byte j holds value j in its low nibble and value j + 16 in its high nibble (GGUF's own
order for Q4_0), so a kernel widens a group to 32 bytes with one mask and one shift. Types:

- "nibble" (Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K): value = d[b] * (lo | hi << 4) + m[b]; the optional `hi` holds
  4 bytes a group, bit i of their little-endian word the fifth bit of value i. K-quant sub-block scales and mins
  are folded into d and m (float32), so one kernel reads all six types.
- "q8" (Q8_0): value = d[b] * q, 32 int8 a group.
- "q6k" (Q6_K): value = d[2 b + half] * ((lo | hi2 << 4) - 32), `hi` 8 bytes a group, bits 2 s..2 s + 1 of byte
  t the top bits of value t + 8 s; one scale per 16 values.

Float scales take more room than GGUF's fp16 / 6-bit ones: 0.75 bytes a weight for the 4-bit types against
0.5625-0.625 in the file, a price paid for one simple kernel per family.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType as T

from engine.cpu import unpack as unpack_rows
from engine.quant_fields import bits_little, f16_field, split_bits
from engine.quants import block_layout

GROUP = 32
NIBBLE_TYPES = frozenset({T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q4_K, T.Q5_K})
PACKED_TYPES = NIBBLE_TYPES | {T.Q8_0, T.Q6_K}


@dataclass
class Planes:
    """One matrix (rows, k) in the kernels' layout; `family` picks the kernel."""

    family: str  # "nibble", "q8" or "q6k"
    k: int
    lo: np.ndarray  # uint8 (rows, 16 groups); int8 (rows, 32 groups) for "q8"
    hi: np.ndarray  # uint8 (rows, 4 groups or 0) for "nibble", (rows, 8 groups) for "q6k", (rows, 0) for "q8"
    d: np.ndarray  # float32 (rows, groups); (rows, 2 groups) for "q6k"
    m: np.ndarray  # float32 (rows, groups); (rows, 0) when the family has no offset

    @property
    def rows(self) -> int:
        return self.lo.shape[0]

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in (self.lo, self.hi, self.d, self.m))

    def slice_rows(self, start: int, stop: int) -> "Planes":
        """A view of rows [start, stop) (a stacked expert's matrix is a run of rows)."""
        m = self.m[start:stop] if self.m.shape[1] else self.m
        return Planes(self.family, self.k, self.lo[start:stop], self.hi[start:stop], self.d[start:stop], m)


def packed_nbytes(qtype: T, rows: int, k: int) -> int:
    """Bytes `pack` gives a (rows, k) matrix of a PACKED_TYPES type: the planes and the float32 scales."""
    per_group = {T.Q8_0: 32 + 4, T.Q6_K: 16 + 8 + 2 * 4, T.Q5_0: 16 + 4 + 8, T.Q5_1: 16 + 4 + 8, T.Q5_K: 16 + 4 + 8}
    return rows * (k // GROUP) * per_group.get(T(qtype), 16 + 8)


def pack(raw: np.ndarray, qtype: T, rows: int, k: int) -> Planes:
    """Repack the GGUF bytes of a (rows, k) matrix of a PACKED_TYPES type."""
    _, block_bytes = block_layout(qtype)
    blocks = np.ascontiguousarray(raw).reshape(-1).view(np.uint8).reshape(-1, block_bytes)
    groups = k // GROUP
    if qtype == T.Q8_0:
        q = blocks[:, 2:].view(np.int8).reshape(rows, -1)
        return Planes("q8", k, np.ascontiguousarray(q), np.zeros((rows, 0), np.uint8),
                      f16_field(blocks, 0).reshape(rows, groups), np.zeros((rows, 0), np.float32))
    if qtype == T.Q6_K:
        return _pack_q6k(blocks, rows, k)
    q, d, m = _nibble_values(blocks, qtype)  # q: (rows * groups, 32) values 0-31; d, m: (rows * groups,)
    if qtype in (T.Q5_0, T.Q5_1, T.Q5_K):
        hi = np.packbits(q >> np.uint8(4), axis=-1, bitorder="little").reshape(rows, -1)
    else:
        hi = np.zeros((rows, 0), np.uint8)
    return Planes("nibble", k, _nibble_bytes(q).reshape(rows, -1), hi, d.reshape(rows, groups), m.reshape(rows, groups))


def unpack(planes: Planes, rows: np.ndarray | slice, out: np.ndarray) -> None:
    """Write the float32 values of the selected rows into out (n, k), C-contiguous."""
    picked = np.arange(planes.rows)[rows] if isinstance(rows, slice) else np.asarray(rows, np.int64)
    if planes.family == "nibble":
        unpack_rows.nibble_rows(planes.lo, planes.hi, planes.d, planes.m, picked, out)
    elif planes.family == "q8":
        unpack_rows.q8_rows(planes.lo, planes.d, picked, out)
    else:
        unpack_rows.q6k_rows(planes.lo, planes.hi, planes.d, picked, out)


def _nibble_bytes(q: np.ndarray) -> np.ndarray:
    """Values (n, 32) -> (n, 16) bytes: value j's low 4 bits in byte j's low nibble, value j + 16's in its high one."""
    return (q[:, :16] & np.uint8(15)) | ((q[:, 16:] & np.uint8(15)) << np.uint8(4))


def _nibble_values(blocks: np.ndarray, qtype: T) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Unsigned quants (n_groups, 32) and each group's float32 scale and offset, for the nibble types."""
    if qtype in (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1):
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
    n = blocks.shape[0]
    scales, mins = _k_scales_mins(blocks[:, 4:16])  # (n, 8) each
    d = f16_field(blocks, 0) * scales.astype(np.float32)
    m = -(f16_field(blocks, 2) * mins.astype(np.float32))
    qs = blocks[:, 16:144] if qtype == T.Q4_K else blocks[:, 48:176]
    q = split_bits(qs.reshape(n, 4, 32), 4).reshape(n, 8, 32)  # 32 bytes hold two sub-blocks, low nibbles first
    if qtype == T.Q5_K:
        q |= split_bits(blocks[:, 16:48], 1).reshape(n, 8, 32) << np.uint8(4)
    return q.reshape(-1, GROUP), d.reshape(-1), m.reshape(-1)


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
    scales = blocks[:, 192:208].view(np.int8).astype(np.float32) * f16_field(blocks, 208)  # (n, 16): per 16 values
    top = (q >> np.uint8(4)).reshape(-1, 4, 8)  # [group, s, t]: value t + 8 s
    hi = top[:, 0] | (top[:, 1] << np.uint8(2)) | (top[:, 2] << np.uint8(4)) | (top[:, 3] << np.uint8(6))
    return Planes("q6k", k, _nibble_bytes(q).reshape(rows, -1), hi.reshape(rows, -1), scales.reshape(rows, -1),
                  np.zeros((rows, 0), np.float32))
