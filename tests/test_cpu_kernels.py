"""engine/cpu against gguf's own dequantizers: every packed type's product against a float64 product of
`gguf.quants.dequantize`, the repacked rows bit-identical to it, and the prompt (tiled BLAS) path.

Error bound. A one-token product first rounds x to int16 per 32 values (scale = the group's largest |x| / 32767),
so it computes sum(w * x') exactly where |x - x'| <= scale / 2: that part of the
error is at most sum over groups of scale / 2 * sum |w|. The integer group sums are exact; the float steps after
them (scales, the per-group offset terms, the sum over groups) add at most (2 G + 40) u T (first order), G the
groups in a row, u = 2**-24 and T the sum over the row of (|d q| + |m|) |x'| <= (|w| + 2 |m|) (|x| + scale / 2),
where |m| is bounded from the block's own fp16 fields below.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

from engine import capabilities
from engine.cpu import experts, layout, products, weights
from engine.quants import block_layout, quantized_nbytes

U = 2.0**-24
QUANTIZABLE = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0]  # gguf.quants.quantize writes these
# Byte offsets of their fp16 scales.
RANDOM_BLOCKS = {T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,), T.Q3_K: (108,), T.Q2_K: (80, 82), T.IQ4_XS: (0,),
                 T.IQ3_S: (0,)}
SHAPES = [(37, 512), (3, 4096), (129, 768)]  # rows not divisible by threads or vector widths
CASES = [(t, shape) for t in (*QUANTIZABLE, *RANDOM_BLOCKS) for shape in SHAPES] + [(t, (5, 32)) for t in QUANTIZABLE]


def _f16(blocks, offset):
    return np.abs(blocks[:, offset : offset + 2].view("<f2").astype(np.float64)[:, 0])


def _weight(qtype: T, rows: int, k: int, rng) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """GGUF bytes (rows, bytes), their float64 values (rows, k) and a bound of |offset| per value."""
    elements, nbytes = block_layout(qtype)
    if qtype in QUANTIZABLE:
        raw = quantize(rng.standard_normal((rows, k)).astype(np.float32) * rng.uniform(0.1, 3), qtype)
    else:
        raw = rng.integers(0, 256, (rows, k // elements * nbytes), dtype=np.uint8)
        scales = raw.reshape(-1, nbytes)
        for offset in RANDOM_BLOCKS[qtype]:
            scales[:, offset : offset + 2] = rng.uniform(1e-3, 2e-2, (scales.shape[0], 1)).astype("<f2").view(np.uint8)
    blocks = raw.reshape(-1, nbytes)
    offsets = np.repeat(_offset_bound(qtype, blocks), elements).reshape(rows, k)
    return raw.reshape(rows, -1), dequantize(raw, qtype).astype(np.float64).reshape(rows, k), offsets


def _offset_bound(qtype: T, blocks: np.ndarray) -> np.ndarray:
    """A bound of |offset| for each block (rows of GGUF bytes), from its own fp16 fields."""
    return {
        T.Q4_0: lambda: 8 * _f16(blocks, 0),
        T.Q4_1: lambda: _f16(blocks, 2),
        T.Q5_0: lambda: 16 * _f16(blocks, 0),
        T.Q5_1: lambda: _f16(blocks, 2),
        T.Q8_0: lambda: 0 * _f16(blocks, 0),
        T.Q4_K: lambda: 63 * _f16(blocks, 2),  # dmin times a 6-bit min
        T.Q5_K: lambda: 63 * _f16(blocks, 2),
        T.Q6_K: lambda: 32 * 128 * _f16(blocks, 208),  # d times an int8 scale, times the -32 of the quants
        T.Q3_K: lambda: 4 * 32 * _f16(blocks, 108),  # d times a 6-bit scale minus 32, times the -4 of the quants
        T.IQ4_XS: lambda: 128 * 32 * _f16(blocks, 0),  # the levels read plus 128, under scales within [-32, 31]
        T.Q2_K: lambda: 15 * _f16(blocks, 82),  # dmin times a 4-bit min
        T.IQ3_S: lambda: 32 * 31 * _f16(blocks, 0),  # Q6_K's layout again, under odd scales up to 31
    }[qtype]()


def _check(got, values, offsets, x, groups_per_row, limit=32767):
    """got (rows,) against values (rows, k) @ x (1, k), x rounded to integers up to `limit` (int16, or int8: 127)."""
    x64 = x[0].astype(np.float64)
    want = values @ x64
    half_step = np.repeat(np.abs(x64).reshape(-1, 32).max(axis=1) / limit / 2, 32) * (1 + 1e-6)
    terms = (np.abs(values) + 2 * offsets) @ (np.abs(x64) + half_step)
    bound = np.abs(values) @ half_step + (2 * groups_per_row + 40) * U * terms
    assert np.all(np.abs(got - want) <= bound), np.max(np.abs(got - want) / bound)


@pytest.mark.parametrize("bits", [16, 8])
@pytest.mark.parametrize(("qtype", "shape"), CASES, ids=lambda c: getattr(c, "name", str(c)))
def test_matvec_matches_gguf_dequantize_then_float64_product(qtype, shape, bits):
    """int8 activations take VNNI's vpdpbusd where the CPU has it (dot._VNNI), vpmaddubsw on AVX2 alone
    (dot.quad_sums_fit), else int16 steps."""
    rows, k = shape
    rng = np.random.default_rng(hash((qtype.name, shape, bits)) % 2**32)
    raw, values, offsets = _weight(qtype, rows, k, rng)
    x = rng.standard_normal((1, k)).astype(np.float32)
    planes = layout.pack(raw, qtype, rows, k)
    out = np.full(rows, np.nan, np.float32)
    products.matvec(planes, products.activation(x[0], bits), out)
    _check(out, values, offsets, x, k // 32, (1 << (bits - 1)) - 1)


FP16_FIELDS = {T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2), **RANDOM_BLOCKS}


@pytest.mark.parametrize("value", [1.0, -1.0])
@pytest.mark.parametrize("qtype", FP16_FIELDS, ids=lambda t: t.name)
def test_int8_products_of_the_largest_quants_and_values(qtype, value):
    """Every quant bit set and every int8 value at 127 (or -127): the largest pairs vpmaddubsw sums into int16 on
    AVX2 (dot.quad_sums_fit's families), and IQ4's levels, which it leaves to the int16 steps, stay exact."""
    rows, k = 3, 512
    elements, nbytes = block_layout(qtype)
    blocks = np.full((rows * k // elements, nbytes), 0xFF, np.uint8)
    for offset in FP16_FIELDS[qtype]:
        blocks[:, offset : offset + 2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    raw = blocks.reshape(rows, -1)
    values = dequantize(raw, qtype).astype(np.float64).reshape(rows, k)
    x = np.full((1, k), value, np.float32)
    out = np.full(rows, np.nan, np.float32)
    products.matvec(layout.pack(raw, qtype, rows, k), products.activation(x[0], 8), out)
    offsets = np.repeat(_offset_bound(qtype, blocks), elements).reshape(rows, k)
    _check(out, values, offsets, x, k // 32, 127)


@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q6_K], ids=lambda t: t.name)
def test_rows_split_over_threads_give_the_same_product(qtype, monkeypatch):
    rng = np.random.default_rng(3)
    raw, values, offsets = _weight(qtype, 101, 512, rng)
    x = rng.standard_normal((1, 512)).astype(np.float32)
    planes = layout.pack(raw, qtype, 101, 512)
    act = products.activation(x[0])
    whole = np.empty(101, np.float32)
    products.matvec(planes, act, whole)
    monkeypatch.setattr(products, "PARALLEL_MIN_WEIGHTS", 1)
    monkeypatch.setattr(products, "threads", lambda: 3)
    split = np.full(101, np.nan, np.float32)
    products.matvec(planes, act, split)
    np.testing.assert_array_equal(split, whole)  # the same kernel on each row, whichever thread runs it
    _check(split, values, offsets, x, 16)


@pytest.mark.parametrize("qtype", [*QUANTIZABLE, *RANDOM_BLOCKS], ids=lambda t: t.name)
def test_repacked_rows_are_bit_identical_to_gguf(qtype):
    rng = np.random.default_rng(4)
    raw, values, _ = _weight(qtype, 9, 512, rng)
    planes = layout.pack(raw, qtype, 9, 512)
    out = np.empty((9, 512), np.float32)
    layout.unpack(planes, slice(0, 9), out)
    np.testing.assert_array_equal(out, values.astype(np.float32))
    picked = np.array([7, 0, 7, 3])
    gathered = np.empty((4, 512), np.float32)
    layout.unpack(planes, picked, gathered)
    np.testing.assert_array_equal(gathered, values[picked].astype(np.float32))


UNPACKED_SCALES = {T.IQ3_XXS: (0,)}  # types without a kernel, and the byte offsets of their fp16 scales


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q8_0, *UNPACKED_SCALES], ids=lambda t: t.name)
def test_prompt_products_over_row_tiles_and_row_ranges(qtype, monkeypatch):
    """n > 1 tokens, and every type without a kernel (kept as GGUF bytes), go through dequantized tiles."""
    monkeypatch.setattr(weights, "TILE_ELEMENTS", 3 * 512)  # 3 rows a tile: tiles that do not divide the rows
    rng = np.random.default_rng(5)
    rows, k = 20, 512
    if qtype in UNPACKED_SCALES:
        elements, nbytes = block_layout(qtype)
        raw = rng.integers(0, 256, (rows, k // elements * nbytes), dtype=np.uint8)
        for at in UNPACKED_SCALES[qtype]:
            raw.reshape(-1, nbytes)[:, at : at + 2] = rng.uniform(1e-3, 1e-2, (rows * k // elements, 1)).astype("<f2").view(np.uint8)
        values = dequantize(raw, qtype).astype(np.float64).reshape(rows, k)
    else:
        raw, values, offsets = _weight(qtype, rows, k, rng)
    w = weights.load("w", raw, qtype, (2, 10, k))  # stacked like two experts
    assert (w.planes is not None) == (qtype in layout.PACKED_TYPES)
    for n in (1, 4):
        x = rng.standard_normal((n, k)).astype(np.float32)
        out = np.full((n, 7), np.nan, np.float32)
        weights.product(w, x, out, 11, 18)
        if n == 1 and w.planes is not None:  # one token: the kernels on int16 activations
            _check(out[0], values[11:18], offsets[11:18], x, k // 32)
            continue
        want = x.astype(np.float64) @ values[11:18].T
        # float32 rows exact, then a float32 product of k terms in any order: (k - 1) u times the sum of |terms|
        assert np.all(np.abs(out - want) <= k * U * (np.abs(x) @ np.abs(values[11:18]).T))


@pytest.mark.parametrize("bits", [16, 8])
@pytest.mark.parametrize(("gate_type", "up_type", "down_type"),
                         [(T.Q4_K, T.Q4_K, T.Q6_K), (T.Q4_0, T.Q4_0, T.Q8_0), (T.Q5_K, T.Q6_K, T.Q5_0)],
                         ids=lambda t: t.name)
def test_one_token_experts_match_gguf_dequantize_then_float64(gate_type, up_type, down_type, bits):
    """The one-token mixture (gate and up in one parallel pass, then down weighted and summed per row,
    engine/cpu/experts.py) against the float64 mixture of gguf's dequantized experts; the same bits on 1, 3 and 16
    threads (every row is the same kernel, whichever range holds it)."""
    rng = np.random.default_rng(11)
    count, f, d, top_k = 6, 256, 512, 4  # K-quant rows hold whole 256-value blocks
    shapes = {"gate": (gate_type, f, d), "up": (up_type, f, d), "down": (down_type, d, f)}
    made = {name: _weight(qtype, count * rows, k, rng) for name, (qtype, rows, k) in shapes.items()}
    held = {name: weights.load(name, made[name][0], qtype, (count, rows, k)) for name, (qtype, rows, k) in shapes.items()}
    x = rng.standard_normal((1, d)).astype(np.float32)
    ids = np.array([[4, 0, 5, 2]], np.int32)
    mix = rng.random((1, top_k)).astype(np.float32)
    outs = []
    for threads in (1, 3, 16):
        out = np.full((1, d), np.nan, np.float32)
        experts.moe_ffn(x, held["gate"], held["up"], held["down"], ids, mix, out, "silu", threads, bits)
        outs.append(out)
    np.testing.assert_array_equal(outs[1], outs[0])
    np.testing.assert_array_equal(outs[2], outs[0])
    g, u, dn = (made[name][1].reshape(count, -1, made[name][1].shape[1]) for name in ("gate", "up", "down"))
    want, size = np.zeros(d), np.zeros(d)
    x64 = x[0].astype(np.float64)
    for j, e in enumerate(ids[0]):
        gate = g[e] @ x64
        hidden = gate / (1 + np.exp(-gate)) * (u[e] @ x64)
        want += mix[0, j] * dn[e] @ hidden
        size += mix[0, j] * np.abs(dn[e]) @ np.abs(hidden)
    # Two roundings of the activations, each by at most half a step (1/65534 of a group's largest value for int16,
    # 1/254 for int8), and float32 sums: 2e-5 and 7e-3 seen.
    bound = 2e-4 if bits == 16 else 2e-2
    assert np.all(np.abs(outs[0][0] - want) <= bound * size.max()), np.max(np.abs(outs[0][0] - want) / size.max())


def test_a_chunk_s_experts_give_the_same_bits_on_a_thread_pool():
    """Prompt chunks run one pass per chosen expert (dequantized tiles, BLAS), the experts spread over threads: the
    same bits as one thread, and the float64 mixture of gguf's dequantized experts within float32 rounding."""
    rng = np.random.default_rng(12)
    count, f, d, n, top_k = 5, 64, 128, 7, 2
    shapes = {"gate": (T.Q4_0, f, d), "up": (T.Q4_0, f, d), "down": (T.Q8_0, d, f)}
    made = {name: _weight(qtype, count * rows, k, rng) for name, (qtype, rows, k) in shapes.items()}
    held = {name: weights.load(name, made[name][0], qtype, (count, rows, k)) for name, (qtype, rows, k) in shapes.items()}
    x = rng.standard_normal((n, d)).astype(np.float32)
    ids = np.stack([rng.choice(count, top_k, replace=False) for _ in range(n)]).astype(np.int32)
    mix = rng.random((n, top_k)).astype(np.float32)
    one, pooled = np.full((n, d), np.nan, np.float32), np.full((n, d), np.nan, np.float32)
    experts.moe_ffn(x, held["gate"], held["up"], held["down"], ids, mix, one, "silu", 1)
    experts.moe_ffn(x, held["gate"], held["up"], held["down"], ids, mix, pooled, "silu", 3)
    np.testing.assert_array_equal(pooled, one)
    g, u, dn = (made[name][1].reshape(count, -1, made[name][1].shape[1]) for name in ("gate", "up", "down"))
    for i in range(n):
        want, size = np.zeros(d), np.zeros(d)
        for j, e in enumerate(ids[i]):
            gate = g[e] @ x[i].astype(np.float64)
            hidden = gate / (1 + np.exp(-gate)) * (u[e] @ x[i].astype(np.float64))
            want += mix[i, j] * dn[e] @ hidden
            size += mix[i, j] * np.abs(dn[e]) @ np.abs(hidden)
        assert np.all(np.abs(one[i] - want) <= 1e-5 * size.max())


@pytest.mark.parametrize("n", [1, 3])
def test_experts_marked_below_zero_are_left_to_the_gpu(n):
    """An id below 0 is an expert the GPU's cache computes (engine/expert_cache.py): the CPU's mixture is then exactly
    the sum over the other picks (one token and a chunk), and zero when the GPU holds them all."""
    rng = np.random.default_rng(13)
    count, f, d, top_k = 6, 256, 256, 4
    shapes = {"gate": (T.Q4_K, f, d), "up": (T.Q4_K, f, d), "down": (T.Q6_K, d, f)}
    held = {name: weights.load(name, _weight(qtype, count * rows, k, rng)[0], qtype, (count, rows, k))
            for name, (qtype, rows, k) in shapes.items()}
    x = rng.standard_normal((n, d)).astype(np.float32)
    ids = np.stack([rng.choice(count, top_k, replace=False) for _ in range(n)]).astype(np.int32)
    mix = rng.random((n, top_k)).astype(np.float32)
    marked = ids.copy()
    marked[:, 1::2] = -1
    kept = ids[:, ::2].copy()
    got, want = np.full((n, d), np.nan, np.float32), np.full((n, d), np.nan, np.float32)
    experts.moe_ffn(x, held["gate"], held["up"], held["down"], marked, mix, got, "silu", 2, 8)
    experts.moe_ffn(x, held["gate"], held["up"], held["down"], kept, mix[:, ::2].copy(), want, "silu", 2, 8)
    np.testing.assert_array_equal(got, want)
    assert np.abs(want).max() > 0
    experts.moe_ffn(x, held["gate"], held["up"], held["down"], np.full_like(ids, -1), mix, got, "silu", 2, 8)
    assert not got.any()


# Bytes a packed 32-value group takes: the legacy types' float32 scale (and offset); the K-quants' own 8-bit scale
# (and min) and a share of the float32 super-block scales of every 8 groups (Q4_K: 16 + 1 + 1 + 8 / 8).
GROUP_BYTES = {T.Q4_0: 24, T.Q4_1: 24, T.Q5_0: 28, T.Q5_1: 28, T.Q8_0: 36, T.Q4_K: 19, T.Q5_K: 23, T.Q6_K: 26.5,
               T.Q3_K: 14.5, T.Q2_K: 19, T.IQ4_XS: 17.5, T.IQ3_S: 26.5}


@pytest.mark.parametrize("qtype", [*QUANTIZABLE, *RANDOM_BLOCKS], ids=lambda t: t.name)
def test_packed_weights_take_about_the_file_size(qtype):
    rng = np.random.default_rng(6)
    raw, _, _ = _weight(qtype, 64, 1024, rng)
    w = weights.load("w", raw, qtype, (64, 1024))
    assert w.planes is not None and w.dense is None and w.nbytes == GROUP_BYTES[qtype] * 64 * 1024 // 32
    if qtype in RANDOM_BLOCKS:  # the K-quants within 12% of their file; IQ3_S (in Q6_K's layout) and Q2_K
        assert w.nbytes <= (2 if qtype in (T.IQ3_S, T.Q2_K) else 1.12) * raw.nbytes  # within twice it


def test_the_engine_profile_gives_each_packed_type_s_bytes_per_file_byte():
    """What the fit counts experts kept in RAM at (engine/capabilities.py)."""
    assert set(capabilities.CPU_BYTES_PER_FILE_BYTE) == {t.name for t in layout.PACKED_TYPES}
    for qtype in layout.PACKED_TYPES:
        ratio = layout.packed_nbytes(qtype, 3, 1024) / quantized_nbytes(qtype, (3, 1024))
        assert capabilities.CPU_BYTES_PER_FILE_BYTE[qtype.name] == pytest.approx(ratio, rel=1e-12), qtype


@pytest.mark.parametrize("qtype", [*QUANTIZABLE, *RANDOM_BLOCKS, T.IQ4_XS, T.F16], ids=lambda t: t.name)
def test_the_memory_check_counts_what_the_load_keeps(qtype):
    """engine/model.py refuses a model from held_nbytes before loading it: it must be what load keeps."""
    elements, nbytes = block_layout(qtype)
    shape = (3, 6, 512)
    raw = np.zeros(3 * 6 * 512 // elements * nbytes, np.uint8)
    assert weights.held_nbytes(qtype, shape) == weights.load("w", raw, qtype, shape).nbytes
    assert weights.held_nbytes(qtype, (512,)) == weights.load("v", raw[: 512 // elements * nbytes], qtype, (512,)).nbytes == 2048


def test_an_activation_is_reused_only_for_the_same_values():
    rng = np.random.default_rng(7)
    raw, values, offsets = _weight(T.Q8_0, 8, 64, rng)
    w = weights.load("w", raw, T.Q8_0, (8, 64))
    x = rng.standard_normal((1, 64)).astype(np.float32)
    first, second = np.empty((1, 8), np.float32), np.empty((1, 8), np.float32)
    weights.product(w, x, first)
    x *= 2  # the same buffer, new values: the products must not reuse the layout made for the old ones
    weights.product(w, x, second)
    np.testing.assert_allclose(second, 2 * first, rtol=1e-6)
    _check(second[0], values, offsets, x, 2)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_a_non_finite_activation_gives_non_finite_products(bad):
    """A damaged model's NaN must reach the logits (engine/generate.py reports it), not be rounded away."""
    rng = np.random.default_rng(8)
    raw, _, _ = _weight(T.Q4_0, 4, 64, rng)
    x = rng.standard_normal(64).astype(np.float32)
    x[40] = bad
    out = np.zeros(4, np.float32)
    products.matvec(layout.pack(raw, T.Q4_0, 4, 64), products.activation(x), out)
    assert not np.isfinite(out).any()


def test_the_portable_vector_code_gives_the_same_products(tmp_path):
    """Machines without AVX2 (ARM's NEON among them) run dot.py's plain LLVM vector code instead of the x86
    intrinsics: compiled here in a fresh process with STRATA_CPU_PORTABLE=1, it must pass the same bound."""
    script = tmp_path / "portable.py"
    script.write_text(
        "import sys\n"
        "import numpy as np\n"
        f"sys.path[:0] = [{str(Path(__file__).parent)!r}, {str(Path(__file__).parent.parent)!r}]\n"
        "import test_cpu_kernels as t\n"
        "from engine.cpu import dot\n"
        "assert not dot._AVX2\n"
        "for qtype, shape in t.CASES:\n"
        "    for bits in (16, 8):\n"
        "        t.test_matvec_matches_gguf_dequantize_then_float64_product(qtype, shape, bits)\n"
        "print('portable ok', len(t.CASES))\n"
    )
    env = {**os.environ, "STRATA_CPU_PORTABLE": "1"}
    run = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and f"portable ok {len(CASES)}" in run.stdout, run.stderr[-3000:]


def test_the_gpu_reads_q3_k_planes_as_the_cpu_writes_them():
    """HostQ3K (quant_blocks.cuh), the GPU's reading of Q3_K experts kept in RAM, restated with its word operations:
    a group's 8 bytes of low bits as two words, word t & 1 shifted by 2 (t >> 1) and masked a byte at a time for
    values 4t .. 4t + 3, its third bits spread one to a byte (spread4) and moved to bit 2, 4 taken off each byte;
    those values times their half group's scale must be the layout's own (layout.unpack, gguf's to the bit)."""
    rows, k = 3, 512
    raw, _, _ = _weight(T.Q3_K, rows, k, np.random.default_rng(9))
    planes = layout.pack(raw, T.Q3_K, rows, k)
    want = np.empty((rows, k), np.float32)
    layout.unpack(planes, slice(0, rows), want)
    groups = rows * k // 32
    low = np.ascontiguousarray(planes.lo).reshape(groups, 8).view("<u4")  # (groups, 2)
    third = np.ascontiguousarray(planes.hi).reshape(groups, 4).view("<u4")[:, 0]

    def spread4(h):
        return ((h & np.uint32(0xF)) * np.uint32(0x00204081)) & np.uint32(0x01010101)

    words = [((low[:, t & 1] >> np.uint32(2 * (t >> 1))) & np.uint32(0x03030303)) | (spread4(third >> np.uint32(4 * t))
                                                                                     << np.uint32(2))
             for t in range(8)]
    q = np.stack(words, 1).astype("<u4").view(np.uint8).astype(np.int32) - 4  # (groups, 32): value 4t + byte
    scale = planes.sup.reshape(-1)[np.arange(groups) // 8, None] * planes.d.reshape(groups, 2).astype(np.float32)
    got = np.repeat(scale, 16, axis=1) * q.astype(np.float32)
    assert q.min() >= -4 and q.max() <= 3
    np.testing.assert_array_equal(got.reshape(rows, k), want)
