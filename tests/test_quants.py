"""engine.quants against gguf.quants.dequantize, the reference nobody here wrote: bit-identical output on random
blocks that exercise every quant bit pattern."""

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

import engine.quants
from engine.quants import (
    SUPPORTED_TYPES,
    TensorSizeError,
    UnsupportedTensorType,
    block_layout,
    dequantize,
    quantized_nbytes,
)

# Byte offsets of each type's fp16 scale fields: the test overwrites them with finite values so that
# random bytes never make inf or NaN scales (which would hide mismatches behind NaN != NaN).
FP16_FIELDS = {
    T.Q4_0: (0,),
    T.Q4_1: (0, 2),
    T.Q5_0: (0,),
    T.Q5_1: (0, 2),
    T.Q8_0: (0,),
    T.Q2_K: (80, 82),
    T.Q3_K: (108,),
    T.Q4_K: (0, 2),
    T.Q5_K: (0, 2),
    T.Q6_K: (208,),
}
QUANTIZED = sorted(FP16_FIELDS, key=lambda t: t.value)
BLOCKS_PER_TEST = 2048


def random_fp16(rng: np.random.Generator, n: int) -> np.ndarray:
    """Finite fp16 of both signs and magnitudes 1e-4 .. 10, zero and subnormals included."""
    values = rng.standard_normal(n) * 10.0 ** rng.uniform(-4, 1, n)
    values[:8] = [0.0, -0.0, 6e-8, -6e-8, 1e-5, 65504.0 / 4096, -1.0, 1.0]
    return values.astype(np.float16)


def random_blocks(qtype: T, n_blocks: int, seed: int) -> np.ndarray:
    """(n_blocks, bytes per block) of random quants with valid fp16 scales."""
    rng = np.random.default_rng(seed)
    nbytes = gguf.GGML_QUANT_SIZES[qtype][1]
    blocks = rng.integers(0, 256, size=(n_blocks, nbytes), dtype=np.uint8)
    for offset in FP16_FIELDS[qtype]:
        blocks[:, offset:offset + 2] = random_fp16(rng, n_blocks).view(np.uint8).reshape(n_blocks, 2)
    return blocks


def quant_bytes(qtype: T, blocks: np.ndarray) -> np.ndarray:
    """The block bytes that are not fp16 scales."""
    keep = np.ones(blocks.shape[1], dtype=bool)
    for offset in FP16_FIELDS[qtype]:
        keep[offset:offset + 2] = False
    return blocks[:, keep]


def assert_bit_identical(ours: np.ndarray, reference: np.ndarray) -> None:
    assert ours.dtype == np.float32 and ours.shape == reference.shape
    assert not np.isnan(reference).any()
    mismatched = ours.view(np.uint32) != reference.astype(np.float32).view(np.uint32)
    assert not mismatched.any(), f"{mismatched.sum()} values differ, first at {np.argwhere(mismatched)[0]}"


@pytest.mark.parametrize("qtype", QUANTIZED, ids=lambda t: t.name)
def test_quantized_types_match_gguf_bit_for_bit(qtype):
    elements, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    blocks = random_blocks(qtype, BLOCKS_PER_TEST, seed=qtype.value)
    # every byte value in the quant fields, hence every nibble, 2-bit field and bit pattern
    assert np.unique(quant_bytes(qtype, blocks)).size == 256
    rows = 8
    shape = (rows, BLOCKS_PER_TEST // rows * elements)
    ours = dequantize(blocks.reshape(-1), qtype, shape)
    reference = gguf.quants.dequantize(blocks.reshape(rows, -1), qtype)
    assert_bit_identical(ours, reference)


def test_float_types_match_gguf_bit_for_bit():
    rng = np.random.default_rng(1)
    values = (rng.standard_normal((6, 40)) * 10.0 ** rng.uniform(-30, 30, (6, 40))).astype(np.float32)
    values[0, :4] = [0.0, -0.0, np.inf, -np.inf]
    for qtype, stored in (
        (T.F32, values),
        (T.F16, np.concatenate((random_fp16(rng, 236), [np.inf, -np.inf, 0, 0])).astype(np.float16).reshape(6, 40)),
        (T.BF16, (values.view(np.uint32) >> 16).astype(np.uint16)),
    ):
        raw = stored.view(np.uint8).reshape(-1)
        ours = dequantize(raw, qtype, values.shape)
        reference = gguf.quants.dequantize(stored.view(np.uint8) if qtype == T.BF16 else stored, qtype)
        assert_bit_identical(ours, reference)
    bf16 = dequantize((values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8), T.BF16, values.shape)
    assert np.array_equal(bf16.view(np.uint32), values.view(np.uint32) & np.uint32(0xFFFF0000))


def test_known_values():
    # Q4_0 block with d = 0.5 and nibbles 0..15 (low) and 15..0 (high): values (q - 8) * d
    qs = (np.arange(16) | ((15 - np.arange(16)) << 4)).astype(np.uint8)
    block = np.concatenate((np.array([0.5], np.float16).view(np.uint8), qs))
    expected = (np.concatenate((np.arange(16), 15 - np.arange(16))) - 8) * 0.5
    assert np.array_equal(dequantize(block, T.Q4_0, (32,)), expected.astype(np.float32))
    # Q8_0 with d = 2: the int8 quants doubled
    q8 = np.arange(-16, 16, dtype=np.int8)
    block = np.concatenate((np.array([2.0], np.float16).view(np.uint8), q8.view(np.uint8)))
    assert np.array_equal(dequantize(block, T.Q8_0, (1, 32)), (q8.astype(np.float32) * 2).reshape(1, 32))


def test_accepts_memmap_and_typed_arrays_and_many_chunks(tmp_path, monkeypatch):
    blocks = random_blocks(T.Q6_K, 64, seed=7)
    path = tmp_path / "tensor.bin"
    blocks.tofile(path)
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    reference = gguf.quants.dequantize(blocks.reshape(4, -1), T.Q6_K)
    whole = dequantize(raw, T.Q6_K, (4, 16 * 256))
    # a chunk of 3 blocks: the last chunk is partial, and every chunk must land in its place
    monkeypatch.setattr(engine.quants, "_CHUNK_ELEMENTS", 3 * 256)
    chunked = dequantize(raw, T.Q6_K, (4, 16 * 256))
    assert_bit_identical(whole, reference)
    assert_bit_identical(chunked, reference)
    # gguf's reader hands F32 tensors over as float32 arrays: their bytes are what counts
    values = np.random.default_rng(2).standard_normal((3, 5)).astype(np.float32)
    assert np.array_equal(dequantize(values, T.F32, (3, 5)), values)


def test_block_layouts_match_gguf():
    for qtype in SUPPORTED_TYPES:
        assert block_layout(qtype) == gguf.GGML_QUANT_SIZES[qtype], qtype.name
    assert quantized_nbytes(T.Q4_K, (3, 512)) == 3 * 2 * 144
    assert quantized_nbytes(T.Q8_0, (2, 4, 64)) == 16 * 34
    assert quantized_nbytes(T.F16, (7,)) == 14


def test_wrong_byte_count_is_a_clear_error():
    raw = np.zeros(2 * 18 - 1, dtype=np.uint8)
    with pytest.raises(TensorSizeError, match=r"Q4_0 tensor of shape \(2, 32\) takes 36 bytes, but 35 were given"):
        dequantize(raw, T.Q4_0, (2, 32))
    with pytest.raises(TensorSizeError, match="multiple of 256 values"):
        dequantize(np.zeros(144, dtype=np.uint8), T.Q4_K, (1, 128))
    assert issubclass(TensorSizeError, ValueError)


def test_unsupported_type_is_a_clear_error():
    with pytest.raises(UnsupportedTensorType, match=r"TQ1_0 is not supported.*Q4_K") as excinfo:
        dequantize(np.zeros(54, dtype=np.uint8), T.TQ1_0, (256,))
    assert isinstance(excinfo.value, ValueError)
    with pytest.raises(UnsupportedTensorType):
        block_layout(T.TQ1_0)
    with pytest.raises(UnsupportedTensorType, match="9999"):
        quantized_nbytes(9999, (32,))
