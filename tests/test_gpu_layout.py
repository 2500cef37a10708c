"""The GPU weight layout and the GPU-only reference steps, checked without a GPU."""

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from engine import quants
from engine.kernels import reference
from engine.kernels.gpu_layout import ALIGN, PLANES, from_planar, random_blocks, to_planar


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
    assert set(PLANES) == {T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K}
