"""GGML tensor block layouts and NumPy dequantizers: the CPU reference for every weight type we load.

A quantized row is a run of fixed-size blocks; each block holds `elements` values in `bytes` bytes. Every
dequantizer here takes all blocks of a tensor at once as a (n_blocks, bytes) uint8 array and returns
(n_blocks, elements) float32, doing the float arithmetic in the same order as ggml so the results are
bit-identical to `gguf.quants.dequantize`. The i-quants live in `engine.quants_iq`.
"""

from collections.abc import Callable

import numpy as np
from gguf import GGMLQuantizationType as T

from engine.errors import EngineError
from engine.quant_fields import bits_little, f16_field, split_bits
from engine.quants_iq import IQ_DEQUANTIZERS, IQ_LAYOUTS

QK_K = 256  # elements of a k-quant or i-quant super-block

# (elements per block, bytes per block); the byte counts are the sums of the block's fields, in order.
_LAYOUTS: dict[T, tuple[int, int]] = {
    T.F32: (1, 4),
    T.F16: (1, 2),
    T.BF16: (1, 2),
    T.Q4_0: (32, 2 + 16),  # d, 32 nibbles
    T.Q4_1: (32, 2 + 2 + 16),  # d, m, 32 nibbles
    T.Q5_0: (32, 2 + 4 + 16),  # d, 32 high bits, 32 nibbles
    T.Q5_1: (32, 2 + 2 + 4 + 16),  # d, m, 32 high bits, 32 nibbles
    T.Q8_0: (32, 2 + 32),  # d, 32 int8
    T.Q2_K: (QK_K, 16 + 64 + 2 + 2),  # 4-bit scale/min pairs, 2-bit quants, d, dmin
    T.Q3_K: (QK_K, 32 + 64 + 12 + 2),  # high-bit mask, 2-bit quants, 6-bit scales, d
    T.Q4_K: (QK_K, 2 + 2 + 12 + 128),  # d, dmin, 6-bit scales and mins, nibbles
    T.Q5_K: (QK_K, 2 + 2 + 12 + 32 + 128),  # d, dmin, 6-bit scales and mins, high bits, nibbles
    T.Q6_K: (QK_K, 128 + 64 + 16 + 2),  # low nibbles, high 2 bits, int8 scales, d
    T.MXFP4: (32, 1 + 16),  # power-of-two scale (e8m0), 32 fp4 (e2m1) codes
    **IQ_LAYOUTS,
}

# Elements dequantized per step: bounds the temporaries at a few tens of MB whatever the tensor size.
_CHUNK_ELEMENTS = 1 << 20


class UnsupportedTensorType(EngineError, ValueError):
    """A GGML tensor type this engine cannot read (an EngineError, so callers can show it as it is)."""

    def __init__(self, qtype: object):
        name = getattr(qtype, "name", repr(qtype))
        supported = ", ".join(sorted(t.name for t in SUPPORTED_TYPES))
        super().__init__(
            f"tensor type {name} is not supported by this engine; use a model file whose weights are "
            f"one of: {supported}"
        )


class TensorSizeError(EngineError, ValueError):
    """The bytes given for a tensor do not fit its type and shape."""


def block_layout(qtype: T) -> tuple[int, int]:
    """(elements per block, bytes per block) of a GGML tensor type."""
    return _LAYOUTS[_checked_type(qtype)]


def quantized_nbytes(qtype: T, shape: tuple[int, ...]) -> int:
    """Bytes a tensor of this type and numpy-order shape (last dimension contiguous) occupies."""
    elements, nbytes = block_layout(qtype)
    if len(shape) == 0 or any(int(n) < 0 for n in shape):
        raise TensorSizeError(f"tensor shape {tuple(shape)} is not a valid shape of one or more dimensions")
    row = int(shape[-1])
    if row % elements:
        raise TensorSizeError(
            f"a {T(qtype).name} tensor's rows must hold a multiple of {elements} values, "
            f"but shape {tuple(shape)} has rows of {row}"
        )
    return int(np.prod(shape, dtype=np.int64)) // elements * nbytes


def dequantize(raw: np.ndarray, qtype: T, shape: tuple[int, ...]) -> np.ndarray:
    """The float32 values of a tensor stored as `raw` bytes of GGML type `qtype`, in numpy-order `shape`."""
    qtype = _checked_type(qtype)
    expected = quantized_nbytes(qtype, shape)
    data = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    if data.size != expected:
        raise TensorSizeError(
            f"a {qtype.name} tensor of shape {tuple(shape)} takes {expected} bytes, but {data.size} were given"
        )
    elements, nbytes = _LAYOUTS[qtype]
    blocks = data.reshape(-1, nbytes)
    out = np.empty((blocks.shape[0], elements), dtype=np.float32)
    step = max(1, _CHUNK_ELEMENTS // elements)
    dequantize_blocks = _DEQUANTIZERS[qtype]
    for start in range(0, blocks.shape[0], step):
        out[start:start + step] = dequantize_blocks(blocks[start:start + step])
    return out.reshape(shape)


def _checked_type(qtype: object) -> T:
    try:
        qtype = T(qtype)
    except ValueError:
        raise UnsupportedTensorType(qtype) from None
    if qtype not in SUPPORTED_TYPES:
        raise UnsupportedTensorType(qtype)
    return qtype


def _f32(blocks: np.ndarray) -> np.ndarray:
    return blocks.view("<f4")


def _f16(blocks: np.ndarray) -> np.ndarray:
    return blocks.view("<f2").astype(np.float32)


def _bf16(blocks: np.ndarray) -> np.ndarray:
    # bf16 is the top half of an f32
    return (blocks.view("<u2").astype(np.uint32) << np.uint32(16)).view(np.float32)


def _nibbles32(qs: np.ndarray) -> np.ndarray:
    """A 32-value block's nibbles: the low ones are values 0-15, the high ones 16-31."""
    return split_bits(qs, 4).reshape(qs.shape[0], 32)


def _q4_0(blocks: np.ndarray) -> np.ndarray:
    q = _nibbles32(blocks[:, 2:]).astype(np.int8) - np.int8(8)
    return f16_field(blocks, 0) * q.astype(np.float32)


def _q4_1(blocks: np.ndarray) -> np.ndarray:
    q = _nibbles32(blocks[:, 4:]).astype(np.float32)
    return f16_field(blocks, 0) * q + f16_field(blocks, 2)


def _five_bit(qh: np.ndarray, qs: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1 quants: bit j of the 32-bit little-endian `qh` is bit 4 of value j."""
    return _nibbles32(qs) | (bits_little(qh) << np.uint8(4))


def _q5_0(blocks: np.ndarray) -> np.ndarray:
    q = _five_bit(blocks[:, 2:6], blocks[:, 6:]).astype(np.int8) - np.int8(16)
    return f16_field(blocks, 0) * q.astype(np.float32)


def _q5_1(blocks: np.ndarray) -> np.ndarray:
    q = _five_bit(blocks[:, 4:8], blocks[:, 8:]).astype(np.float32)
    return f16_field(blocks, 0) * q + f16_field(blocks, 2)


def _q8_0(blocks: np.ndarray) -> np.ndarray:
    return blocks[:, 2:].view(np.int8).astype(np.float32) * f16_field(blocks, 0)


def _two_bit_256(qs: np.ndarray) -> np.ndarray:
    """Q2_K/Q3_K low quants, as 16 sub-blocks of 16: each 32-byte half holds 128 values, 4 per byte."""
    n = qs.shape[0]
    return split_bits(qs.reshape(n, 2, 32), 2).reshape(n, 16, 16)


def q2_k_fields(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Q2_K's quants (n, 16, 16) uint8 in [0, 3], each 16 values' byte (scale in the low nibble, min in the high),
    d and dmin (n, 1) float32: value = (d * scale) * quant - dmin * min."""
    return _two_bit_256(blocks[:, 16:80]), blocks[:, :16], f16_field(blocks, 80), f16_field(blocks, 82)


def _q2_k(blocks: np.ndarray) -> np.ndarray:
    q, scales, d, dmin = q2_k_fields(blocks)
    dl = (d * (scales & np.uint8(0x0F)).astype(np.float32)).reshape(-1, 16, 1)
    ml = (dmin * (scales >> np.uint8(4)).astype(np.float32)).reshape(-1, 16, 1)
    return (dl * q.astype(np.float32) - ml).reshape(-1, QK_K)


def q3_k_fields(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q3_K's quants (n, 16, 16) int8 in [-4, 3], the int8 scale of each 16 values (n, 16) and d (n, 1) float32:
    value = (d * scale) * quant."""
    n = blocks.shape[0]
    packed = blocks[:, 96:108]
    # 16 six-bit scales: low nibbles in bytes 0-7 (scale i or i + 8), top 2 bits in bytes 8-11
    low = split_bits(packed[:, :8], 4).reshape(n, 16)
    high = split_bits(packed[:, 8:], 2).reshape(n, 16)
    scales = (low | (high << np.uint8(4))).astype(np.int8) - np.int8(32)
    # a clear mask bit means the value is 4 lower
    hmask = split_bits(blocks[:, :32], 1).reshape(n, 16, 16)
    low_q = _two_bit_256(blocks[:, 32:96])
    q = low_q.astype(np.int8) - ((hmask ^ np.uint8(1)) << np.uint8(2)).astype(np.int8)
    return q, scales, f16_field(blocks, 108)


def _q3_k(blocks: np.ndarray) -> np.ndarray:
    q, scales, d = q3_k_fields(blocks)
    dl = (d * scales.astype(np.float32)).reshape(-1, 16, 1)
    return (dl * q.astype(np.float32)).reshape(-1, QK_K)


def _k_scales_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 six-bit scales and 8 six-bit mins of Q4_K/Q5_K, from their 12 packed bytes."""
    a, b, c = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = np.concatenate((a & np.uint8(0x3F), (c & np.uint8(0x0F)) | ((a >> np.uint8(6)) << np.uint8(4))), axis=1)
    mins = np.concatenate((b & np.uint8(0x3F), (c >> np.uint8(4)) | ((b >> np.uint8(6)) << np.uint8(4))), axis=1)
    return scales, mins


def _k_nibbles(qs: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K low quants as 8 sub-blocks of 32: each 32 bytes hold two sub-blocks, low nibbles first."""
    n = qs.shape[0]
    return split_bits(qs.reshape(n, 4, 32), 4).reshape(n, 8, 32)


def _scaled_minus_min(blocks: np.ndarray, q: np.ndarray) -> np.ndarray:
    n = blocks.shape[0]
    scales, mins = _k_scales_mins(blocks[:, 4:16])
    d = (f16_field(blocks, 0) * scales.astype(np.float32)).reshape(n, 8, 1)
    dm = (f16_field(blocks, 2) * mins.astype(np.float32)).reshape(n, 8, 1)
    return (d * q.astype(np.float32) - dm).reshape(n, QK_K)


def _q4_k(blocks: np.ndarray) -> np.ndarray:
    return _scaled_minus_min(blocks, _k_nibbles(blocks[:, 16:144]))


def _q5_k(blocks: np.ndarray) -> np.ndarray:
    n = blocks.shape[0]
    # bit k of byte j of the high-bit mask is bit 4 of value j of sub-block k
    high = split_bits(blocks[:, 16:48], 1).reshape(n, 8, 32)
    return _scaled_minus_min(blocks, _k_nibbles(blocks[:, 48:176]) | (high << np.uint8(4)))


def _q6_k(blocks: np.ndarray) -> np.ndarray:
    n = blocks.shape[0]
    # each half of 128 values: 64 bytes of low nibbles (2 per byte, 64 apart), 32 bytes of top 2 bits (4 per byte)
    low = split_bits(blocks[:, :128].reshape(n, 2, 64), 4).reshape(n, 2, 128)
    high = split_bits(blocks[:, 128:192].reshape(n, 2, 32), 2).reshape(n, 2, 128)
    q = ((low | (high << np.uint8(4))).astype(np.int8) - np.int8(32)).reshape(n, 16, 16)
    scales = blocks[:, 192:208].view(np.int8).astype(np.float32)
    d = (f16_field(blocks, 208) * scales).reshape(n, 16, 1)
    return (d * q.astype(np.float32)).reshape(n, QK_K)


# e2m1 codes doubled (sign bit on top), so that the e8m0 scale is taken at half its value
_MXFP4_VALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.int8).astype(np.float32)


def _mxfp4(blocks: np.ndarray) -> np.ndarray:
    e = blocks[:, :1].astype(np.uint32)
    # half of 2^(e - 127) as float32 bits; e < 2 gives subnormals
    half_scale = np.where(e < 2, np.uint32(0x00200000) << e, (e - np.uint32(1)) << np.uint32(23)).view(np.float32)
    return half_scale * _MXFP4_VALUES[_nibbles32(blocks[:, 1:])]


_DEQUANTIZERS: dict[T, Callable[[np.ndarray], np.ndarray]] = {
    T.F32: _f32,
    T.F16: _f16,
    T.BF16: _bf16,
    T.Q4_0: _q4_0,
    T.Q4_1: _q4_1,
    T.Q5_0: _q5_0,
    T.Q5_1: _q5_1,
    T.Q8_0: _q8_0,
    T.Q2_K: _q2_k,
    T.Q3_K: _q3_k,
    T.Q4_K: _q4_k,
    T.Q5_K: _q5_k,
    T.Q6_K: _q6_k,
    T.MXFP4: _mxfp4,
    **IQ_DEQUANTIZERS,
}

SUPPORTED_TYPES: frozenset[T] = frozenset(_DEQUANTIZERS)
