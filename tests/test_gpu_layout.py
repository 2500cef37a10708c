"""The GPU weight layout and the GPU-only reference steps, checked without a GPU."""

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from engine import quants
from engine.kernels import reference
from engine.kernels.gpu_layout import ALIGN, PLANES, from_planar, random_blocks, to_planar
from engine.quants_iq import IQ3S_GRID, IQ4NL_VALUES


@pytest.mark.parametrize("qtype", list(PLANES))
def test_planes_cover_each_block_exactly_once(qtype):
    _, block_bytes = quants.block_layout(qtype)
    covered = sorted(b for lo, hi in PLANES[qtype].values() for b in range(lo, hi))
    assert covered == list(range(block_bytes))


@pytest.mark.parametrize("qtype", list(PLANES))
def test_planar_round_trip_and_alignment(qtype):
    rng = np.random.default_rng(1)
    raw = random_blocks(qtype, 37, rng)
    buf, layout = to_planar(raw, qtype)
    assert np.array_equal(from_planar(buf, layout, qtype), raw)
    for offset, _ in layout.offsets.values():
        assert offset % ALIGN == 0
    q_bytes = PLANES[qtype]["q"][1] - PLANES[qtype]["q"][0]
    assert q_bytes % 16 == 0, "the kernels read each block's quant bytes with 16-byte loads"


def test_q4_k_planes_decode_as_the_kernels_read_them():
    """BlockQ4_K (quant_blocks.cuh) reads sub-block j from 16 bytes of its own (weight i in the low nibble of byte
    i, weight i + 16 in the high one) and d, dmin, scales from one 16-byte S entry; that reading of the planes must
    give the GGUF's values."""
    n = 5
    raw = random_blocks(T.Q4_K, n, np.random.default_rng(5))
    buf, layout = to_planar(raw, T.Q4_K)
    (s_at, s_len), (q_at, q_len) = layout.offsets["s"], layout.offsets["q"]
    s_plane, q_plane = buf[s_at : s_at + s_len].reshape(n, 16), buf[q_at : q_at + q_len].reshape(n, 8, 16)
    d, dmin = (s_plane[:, :4].copy().view(np.float16).astype(np.float32)).T
    sc = s_plane[:, 4:].astype(np.uint32)
    low6 = lambda i: sc[:, i] & 63  # noqa: E731
    scale = np.stack([low6(j) if j < 4 else (sc[:, j + 4] & 15) | ((sc[:, j - 4] >> 6) << 4) for j in range(8)], 1)
    mins = np.stack([low6(j + 4) if j < 4 else (sc[:, j + 4] >> 4) | ((sc[:, j] >> 6) << 4) for j in range(8)], 1)
    q = np.concatenate([q_plane & 15, q_plane >> 4], axis=2).astype(np.float32)  # (n, sub-block, weight)
    values = d[:, None, None] * scale[:, :, None] * q - dmin[:, None, None] * mins[:, :, None]
    assert np.array_equal(values.reshape(-1), quants.dequantize(raw, T.Q4_K, (n * 256,)))


@pytest.mark.parametrize("qtype", list(PLANES))
def test_random_blocks_decode_to_finite_values(qtype):
    elements, _ = quants.block_layout(qtype)
    raw = random_blocks(qtype, 64, np.random.default_rng(2))
    values = quants.dequantize(raw, qtype, (64 * elements,))
    assert np.isfinite(values).all() and np.abs(values).max() > 0


def test_quantize_q8_two_levels_are_within_their_steps():
    x = np.random.default_rng(3).standard_normal((4, 256)).astype(np.float32)
    q, q2, d, s = reference.quantize_q8(x)
    assert q.dtype == q2.dtype == np.int8 and d.shape == (4, 8) and s.shape == (4, 8)
    step = d.reshape(-1, 1).astype(np.float64)
    one_level = q.reshape(-1, 32) * step
    assert np.all(np.abs(one_level - x.reshape(-1, 32)) <= step * 0.5 + 1e-7)
    assert np.abs(q).max() == 127
    both = reference.dequantize_q8(q, q2, d).reshape(-1, 32)
    assert np.all(np.abs(both - x.reshape(-1, 32)) <= step / 508 + 1e-6 * np.abs(x.reshape(-1, 32)))
    assert np.allclose(s.reshape(-1), both.sum(axis=1), rtol=1e-5)


def test_quantize_q8_of_zeros_is_zero():
    q, q2, d, s = reference.quantize_q8(np.zeros((1, 64), np.float32))
    assert not q.any() and not q2.any() and not d.any() and not s.any()


def test_linear_q8_is_close_to_linear():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((1, 128)).astype(np.float32)
    w = rng.standard_normal((16, 128)).astype(np.float32)
    exact, approx = np.empty((1, 16), np.float32), np.empty((1, 16), np.float32)
    reference.linear(x, w, exact)
    reference.linear_q8(x, w, approx)
    assert 0 < np.linalg.norm(approx - exact) / np.linalg.norm(exact) < 1e-4


def test_gguf_types_the_gpu_backend_takes():
    assert set(PLANES) == {T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K, T.Q3_K, T.IQ4_XS, T.IQ3_S}


def _planes(qtype, n, seed):
    raw = random_blocks(qtype, n, np.random.default_rng(seed))
    buf, layout = to_planar(raw, qtype)
    planes = {name: buf[at : at + size].reshape(n, -1) for name, (at, size) in layout.offsets.items()}
    d = planes["d"][:, :2].copy().view(np.float16).astype(np.float32)  # (n, 1)
    return raw, planes, d


def _bits(plane, i):
    return (plane >> np.uint8(i)) & np.uint8(1)


def _q3_k_as_read(n):
    """BlockQ3_K's reading: group (half h, j) of a super-block from qs[32 h ..] bits 2j and hmask bit 4h + j; the
    6-bit scale of sub-block i from byte i % 8's nibble i / 8 and byte 8 + i % 4's bits 2 (i / 4)."""
    raw, p, d = _planes(T.Q3_K, n, 6)
    q, h, sc = p["q"].reshape(n, 2, 32), p["h"], p["s"].astype(np.int32)
    groups = [(((q[:, half] >> np.uint8(2 * j)) & 3).astype(np.int32) + 4 * _bits(h, 4 * half + j) - 4)
              for half in range(2) for j in range(4)]
    scale = np.stack([(sc[:, i % 8] >> 4 * (i // 8) & 15 | (sc[:, 8 + i % 4] >> 2 * (i // 4) & 3) << 4) - 32
                      for i in range(16)], 1)
    values = np.stack(groups, 1).reshape(n, 16, 16) * scale[:, :, None] * d[:, :, None]
    return raw, values


def _iq4_xs_as_read(n):
    """BlockIQ4_XS's reading: sub-block j's 16 bytes, low nibbles then high ones, as indices into the 16 levels;
    its scale from scales_l's nibble and scales_h's two bits."""
    raw, p, d = _planes(T.IQ4_XS, n, 7)
    q, sc = p["q"].reshape(n, 8, 16), p["s"].astype(np.int32)
    index = np.concatenate([q & 15, q >> 4], axis=2)
    high = sc[:, 0] | sc[:, 1] << 8
    scale = np.stack([(sc[:, 2 + j // 2] >> 4 * (j % 2) & 15 | (high >> 2 * j & 3) << 4) - 32 for j in range(8)], 1)
    return raw, IQ4NL_VALUES[index].astype(np.float32) * scale[:, :, None] * d[:, :, None]


def _iq3_s_as_read(n):
    """BlockIQ3_S's reading: sub-block j's eight grid rows qs[8 j + i] + 256 (bit i of qh[j]), each row's four levels
    negated by bits 4i .. 4i + 3 of the sign word at signs[4 j ..]; scale 1 + 2 (nibble j % 2 of scales[j / 2])."""
    raw, p, d = _planes(T.IQ3_S, n, 8)
    q, qh, signs, sc = p["q"].reshape(n, 8, 8), p["h"][:, :8], p["h"][:, 8:].reshape(n, 8, 4), p["s"]
    rows = q.astype(np.int32) | (np.stack([_bits(qh, i) for i in range(8)], 2).astype(np.int32) << 8)
    levels = IQ3S_GRID[rows].astype(np.float32).reshape(n, 8, 32)  # (block, sub-block, weight 4i + e)
    negative = np.unpackbits(signs, axis=2, bitorder="little").astype(bool)
    scale = 1 + 2 * np.stack([sc[:, j // 2] >> 4 * (j % 2) & 15 for j in range(8)], 1).astype(np.float32)
    return raw, np.where(negative, -levels, levels) * scale[:, :, None] * d[:, :, None]


@pytest.mark.parametrize("qtype,as_read", [(T.Q3_K, _q3_k_as_read), (T.IQ4_XS, _iq4_xs_as_read),
                                           (T.IQ3_S, _iq3_s_as_read)], ids=lambda x: getattr(x, "name", ""))
def test_planes_decode_as_the_kernels_read_them(qtype, as_read):
    """The GPU's Q3_K, IQ4_XS and IQ3_S (quant_blocks.cuh) read their planes as written out here; that reading must
    give the values of gguf's dequantizer."""
    raw, values = as_read(5)
    assert np.array_equal(values.reshape(-1), quants.dequantize(raw, qtype, (5 * 256,)))
