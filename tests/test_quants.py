"""engine.quants against gguf.quants.dequantize, the reference nobody here wrote: bit-identical output on random
blocks that exercise every quant bit pattern."""

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

import engine.quants
import engine.quants_iq as iq
from engine.errors import EngineError
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
    T.MXFP4: (),  # its e8m0 scale byte is finite whatever its value
    T.IQ4_NL: (0,),
    T.IQ4_XS: (0,),
    T.IQ3_XXS: (0,),
    T.IQ3_S: (0,),
    T.IQ2_XXS: (0,),
    T.IQ2_XS: (0,),
    T.IQ2_S: (0,),
    T.IQ1_S: (0,),
    T.IQ1_M: (),  # its fp16 is spread over the top nibbles of bytes 48-55, see random_blocks
}
# Scale bytes that are not fp16 fields, left out of the every-byte-value check.
OTHER_SCALE_BYTES = {T.MXFP4: slice(0, 1), T.IQ1_M: slice(48, 56)}
QUANTIZED = sorted(FP16_FIELDS, key=lambda t: t.value)
BLOCKS_PER_TEST = 2048
GRID_TYPES = {T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S, T.IQ1_S, T.IQ1_M}


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
    if qtype == T.MXFP4:
        # e8m0 exponents up to 252 keep 12 * 2^(e - 128) finite; 0 and 1 give subnormal scales
        blocks[:, 0] = rng.integers(0, 253, size=n_blocks)
    if qtype == T.IQ1_M:
        d = random_fp16(rng, n_blocks).view(np.uint16)[:, None]
        words = blocks[:, 48:56].view("<u2")
        words[:] = (words & 0x0FFF) | (((d >> np.array([0, 4, 8, 12], np.uint16)) & 0xF) << 12)
        # gguf's IQ1_M always applies the minus delta (an operator-precedence slip in its quants.py):
        # set every delta sign bit so that it is right; test_iq1_delta_signs covers the clear bit.
        blocks[:, 32:48] |= 0x88
    return blocks


def quant_bytes(qtype: T, blocks: np.ndarray) -> np.ndarray:
    """The block bytes that are not scales."""
    keep = np.ones(blocks.shape[1], dtype=bool)
    for offset in FP16_FIELDS[qtype]:
        keep[offset:offset + 2] = False
    keep[OTHER_SCALE_BYTES.get(qtype, slice(0, 0))] = False
    return blocks[:, keep]


def grid_indices(qtype: T, blocks: np.ndarray) -> tuple[np.ndarray, int]:
    """The grid rows the blocks of an i-quant select, and the grid's size (restated from the formats)."""
    n = blocks.shape[0]
    shifts = np.arange(0, 8, 2, dtype=np.uint8)[:, None]
    if qtype == T.IQ2_XXS:
        return blocks[:, 2:].reshape(n, 8, 8)[:, :, :4], 256
    if qtype == T.IQ2_XS:
        return blocks[:, 2:66].view("<u2") & 511, 512
    if qtype == T.IQ2_S:
        high = (blocks[:, 66:74, None] >> shifts.T) & 3
        return blocks[:, 2:34].astype(np.uint16) | (high.reshape(n, 32).astype(np.uint16) << 8), 1024
    if qtype == T.IQ3_XXS:
        return blocks[:, 2:66], 256
    if qtype == T.IQ3_S:
        high = np.unpackbits(blocks[:, 66:74], axis=1, bitorder="little")
        return blocks[:, 2:66].astype(np.uint16) | (high.astype(np.uint16) << 8), 512
    if qtype == T.IQ1_S:
        words = blocks[:, 34:50].view("<u2")
        high = (words[:, :, None] >> np.array([0, 3, 6, 9], np.uint16)) & 7
        return blocks[:, 2:34].astype(np.uint16) | (high.reshape(n, 32) << 8), 2048
    if qtype == T.IQ1_M:
        high = np.stack((blocks[:, 32:48] & 7, (blocks[:, 32:48] >> 4) & 7), axis=-1)
        return blocks[:, :32].astype(np.uint16) | (high.reshape(n, 32).astype(np.uint16) << 8), 2048
    raise AssertionError(f"{qtype.name} has no grid")


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
    if qtype in GRID_TYPES:
        indices, grid_size = grid_indices(qtype, blocks)
        assert np.array_equal(np.unique(indices), np.arange(grid_size))
    rows = 8
    shape = (rows, BLOCKS_PER_TEST // rows * elements)
    ours = dequantize(blocks.reshape(-1), qtype, shape)
    reference = gguf.quants.dequantize(blocks.reshape(rows, -1), qtype)
    assert_bit_identical(ours, reference)


def test_float_types_match_gguf_bit_for_bit():
    rng = np.random.default_rng(1)
    f32 = (rng.standard_normal(240) * 10.0 ** rng.uniform(-30, 30, 240)).astype(np.float32)
    f32[:4] = [0.0, -0.0, np.inf, -np.inf]
    f16 = random_fp16(rng, 240)
    f16[8:10] = [np.inf, -np.inf]
    bf16 = (f32.view(np.uint32) >> 16).astype(np.uint16)
    for qtype, stored in ((T.F32, f32), (T.F16, f16), (T.BF16, bf16)):
        ours = dequantize(stored.view(np.uint8), qtype, (6, 40))
        reference = gguf.quants.dequantize(stored.view(np.uint8).reshape(6, -1), qtype)
        assert_bit_identical(ours, reference)
    # bf16 is the top half of an f32
    widened = dequantize(bf16.view(np.uint8), T.BF16, (240,)).view(np.uint32)
    assert np.array_equal(widened, f32.view(np.uint32) & np.uint32(0xFFFF0000))


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
    assert issubclass(TensorSizeError, ValueError) and issubclass(TensorSizeError, EngineError)


def test_unsupported_type_is_a_clear_error():
    with pytest.raises(UnsupportedTensorType, match=r"TQ1_0 is not supported.*Q4_K") as excinfo:
        dequantize(np.zeros(54, dtype=np.uint8), T.TQ1_0, (256,))
    assert isinstance(excinfo.value, ValueError) and isinstance(excinfo.value, EngineError)
    with pytest.raises(UnsupportedTensorType):
        block_layout(T.TQ1_0)
    with pytest.raises(UnsupportedTensorType, match="9999"):
        quantized_nbytes(9999, (32,))


def test_iq_tables_equal_gguf_and_llama_cpp():
    for published, ours in (
        (gguf.quants.IQ2_XXS, iq.IQ2XXS_GRID),
        (gguf.quants.IQ2_XS, iq.IQ2XS_GRID),
        (gguf.quants.IQ2_S, iq.IQ2S_GRID),
        (gguf.quants.IQ3_XXS, iq.IQ3XXS_GRID),
        (gguf.quants.IQ3_S, iq.IQ3S_GRID),
        (gguf.quants.IQ1_S, iq.IQ1S_GRID),
    ):
        published.init_grid()
        assert np.array_equal(ours, published.grid.reshape(published.grid_shape)), published.__name__
    assert np.array_equal(iq.KSIGNS, np.frombuffer(gguf.quants.IQ2_XXS.ksigns, dtype=np.uint8))
    assert np.array_equal(iq.IQ4NL_VALUES, gguf.quants.IQ4_NL.kvalues)
    # first entries as llama.cpp's ggml-common.h writes them (little-endian packed rows)
    assert iq.IQ2XXS_GRID.view("<u8")[:2, 0].tolist() == [0x0808080808080808, 0x080808080808082B]
    assert iq.IQ3XXS_GRID.view("<u4")[:2, 0].tolist() == [0x04040404, 0x04040414]
    assert iq.IQ3S_GRID.view("<u4")[0, 0] == 0x01010101
    assert iq.IQ1S_GRID.view("<u8")[:2, 0].tolist() == [0xFFFFFFFFFFFFFFFF, 0xFFFFFFFFFFFFFF01]
    assert iq.KSIGNS[:4].tolist() == [0, 129, 130, 3]


def test_iq1_delta_signs():
    grid0 = iq.IQ1S_GRID[0].astype(np.float32)
    # IQ1_S, d = 1: the first 32 values with scale 1 and +delta, the next 32 with scale 3 and -delta
    block = np.zeros(50, dtype=np.uint8)
    block[:2] = np.array([1.0], np.float16).view(np.uint8)
    block[34:38] = np.array([0x0000, 0x9000], dtype="<u2").view(np.uint8)
    values = dequantize(block, T.IQ1_S, (256,))
    assert np.array_equal(values[:32], np.tile(grid0 + 0.125, 4))
    assert np.array_equal(values[32:64], np.tile(3 * (grid0 - 0.125), 4))
    # IQ1_M, d = 1 in the top nibbles of the scale words: per byte of bytes 32-47, the low nibble's
    # top bit (clear: +delta) covers 8 values and the high nibble's (set: -delta) the next 8
    block = np.zeros(56, dtype=np.uint8)
    block[32:48] = 0x80
    block[48:56] = np.array([0x0002, 0x0000, 0xC000, 0x3000], dtype="<u2").view(np.uint8)
    values = dequantize(block, T.IQ1_M, (256,)).reshape(32, 8)
    expected = np.where(np.arange(32)[:, None] % 2 == 0, grid0 + 0.125, grid0 - 0.125)
    expected[:2] *= 5  # the first 3-bit scale, 2, makes the first 16 values 2 * 2 + 1 times d
    assert np.array_equal(values, expected.astype(np.float32))
