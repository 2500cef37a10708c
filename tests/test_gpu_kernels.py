"""Every CUDA kernel against its NumPy reference on fresh random inputs (needs CuPy and an NVIDIA GPU).

Outputs are poisoned with NaN before each launch, so an element a kernel fails to write shows up as NaN.
Tolerances (relative error of the whole output): float32 arithmetic 1e-5, fp16 operands 1e-2.
"""

import numpy as np
import pytest
from gpu_support import rel, require_gpu
from gguf import GGMLQuantizationType as T

from engine import quants
from engine.backend import SamplingParams
from engine.kernels import kernel_names as N
from engine.kernels import reference, sources
from engine.kernels.gpu_layout import FLOAT_TYPES, PLANES, random_blocks

cp = require_gpu()
pytestmark = pytest.mark.gpu

from engine.kernels import cuda as K  # noqa: E402  (needs CuPy)
import cupyx  # noqa: E402

QUANT_TYPES = list(PLANES)
ALL_TYPES = QUANT_TYPES + list(FLOAT_TYPES)




def poisoned(shape, dtype=np.float32):
    return cp.full(shape, np.nan, dtype)


def random_weight(qtype, m, k, rng):
    """(GGUF bytes, float32 values) of a random (m, k) weight."""
    if qtype in FLOAT_TYPES:
        values = rng.standard_normal((m, k)).astype(np.float32)
        if qtype == T.BF16:
            raw = (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(-1)
        else:
            raw = values.astype(FLOAT_TYPES[qtype]).view(np.uint8).reshape(-1)
    else:
        elements, _ = quants.block_layout(qtype)
        raw = random_blocks(qtype, m * k // elements, rng)
    return raw, quants.dequantize(raw, qtype, (m, k)).astype(np.float32)


def q8_input(x):
    q, q2, d, _ = reference.quantize_q8(x)
    return reference.dequantize_q8(q, q2, d)


def assert_q8_of(q8, values):
    """q8 (a K.Q8) holds exactly reference.quantize_q8 of values (a host array)."""
    q, q2, d, s = reference.quantize_q8(np.asarray(values, np.float32).reshape(1, -1))
    n = q.size
    assert np.array_equal(q8.xq[:n].get(), q.reshape(-1)) and np.array_equal(q8.xq2[:n].get(), q2.reshape(-1))
    assert np.array_equal(q8.xds[: n // 32].get(), np.stack([d.reshape(-1), s.reshape(-1)], axis=1))


def test_quantize_q8_is_bit_exact():
    rng = np.random.default_rng()
    x = (rng.standard_normal((3, 4096)) * rng.uniform(0.1, 10)).astype(np.float32)
    x[0, :32] = 0.0  # an all-zero group
    q8 = K.Q8.empty(x.size)
    q8.xds[...] = np.nan
    K.quantize_q8(cp.asarray(x), q8)
    assert_q8_of(q8, x)


@pytest.mark.parametrize("wpr,rows", [(1, 1), (2, 1), (4, 1), (1, 2), (2, 2)])
@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_matvec(qtype, wpr, rows):
    rng = np.random.default_rng()
    m, k = 1003, 2048  # m not a multiple of the rows a block covers
    raw, w = random_weight(qtype, m, k, rng)
    x = rng.standard_normal(k).astype(np.float32)
    gw = K.upload_weight("w", qtype, (m, k), raw)
    xd = cp.asarray(x)
    q8 = K.Q8.empty(k)
    K.quantize_q8(xd, q8)
    out = poisoned(m)
    if gw.quantized:
        K.matvec(gw, xd, q8, out, (wpr, rows))
        expect = w.astype(np.float64) @ q8_input(x)
    else:
        K.matvec(gw, xd, None, out)
        expect = w.astype(np.float64) @ x
    assert rel(out.get(), expect) < 1e-5


@pytest.mark.parametrize("shapes", N.PAIR_SHAPES)
@pytest.mark.parametrize("types", N.PAIR_TYPES, ids=lambda t: f"{t[0].name}-{t[1].name}")
def test_matvec_pair(types, shapes):
    """Two products in one launch, each part in its shape, the second's rows right after the first's; rows that
    end inside a block on both sides. Then through the backend's linears, which picks the pair kernel itself."""
    rng = np.random.default_rng()
    (ma, mb), k = (1003, 517), 2048
    parts = [random_weight(t, m, k, rng) for t, m in zip(types, (ma, mb))]
    gws = [K.upload_weight(f"w{j}", t, (m, k), raw) for j, (t, m, (raw, _)) in enumerate(zip(types, (ma, mb), parts))]
    x = rng.standard_normal(k).astype(np.float32)
    q8 = K.Q8.empty(k)
    K.quantize_q8(cp.asarray(x), q8)
    expect = np.concatenate([w for _, w in parts]).astype(np.float64) @ q8_input(x)
    out = poisoned(ma + mb + 1)
    blocks = sum(-(-m * wpr // (4 * rows)) for m, (wpr, rows) in zip((ma, mb), shapes))
    K.launch("matvec", N.pair(types, shapes), (blocks,), (128,),
             (*gws[0].args(), *gws[1].args(), *q8.args(), out, np.int32(ma), np.int32(mb), np.int32(k)))
    result = out.get()
    assert rel(result[:-1], expect) < 1e-5 and np.isnan(result[-1])  # nothing written past the second's rows

    from engine.backend_cupy import CupyBackend
    from engine.gguf_file import GGUFTensor

    backend = CupyBackend()
    handles = [backend.upload(GGUFTensor(f"w{j}", t, (m, k), raw))
               for j, (t, m, (raw, _)) in enumerate(zip(types, (ma, mb), parts))]
    assert K.pair_shapes(*handles) is not None  # these sizes take the pair kernel on their own
    with backend.stream:
        out = poisoned((1, ma + mb))
        xd = cp.asarray(x).reshape(1, k)
    backend.linears(xd, handles, out)
    assert rel(backend.to_host(out)[0], expect) < 1e-5
    backend.close()


def rel_to_terms(out, w, x) -> float:
    """Largest |out - w @ x| a row over that row's sum of |terms|, the scale of float rounding in a dot product
    (a relative error over a single row is unbounded where its terms cancel)."""
    w, x = np.asarray(w, np.float64), np.asarray(x, np.float64)
    out = np.asarray(out, np.float64)
    assert not np.isnan(out).any(), "NaN in the output: an element was not written or the math broke"
    return float(np.max(np.abs(out - w @ x) / (np.abs(w) @ np.abs(x))))


@pytest.mark.parametrize("m,k", [(5003, 6144), (1, 2048)])
@pytest.mark.parametrize("form", ["", "_lean"])
@pytest.mark.parametrize("qtype", QUANT_TYPES, ids=lambda t: t.name)
def test_matvec_stream(qtype, form, m, k):
    """Both forms of the streamed product (plain, and at 32 registers): more row pairs than the persistent grid
    has blocks (each block goes round several times, the last pair incomplete since m is odd), and a single row
    (half an iteration). Then the form K.matvec picks, on the same inputs."""
    rng = np.random.default_rng()
    raw, w = random_weight(qtype, m, k, rng)
    gw = K.upload_weight("w", qtype, (m, k), raw)
    x = rng.standard_normal(k).astype(np.float32)
    q8 = K.Q8.empty(k)
    K.quantize_q8(cp.asarray(x), q8)
    name = f"matvec_stream{form}_{gw.suffix}"
    blocks = K._resident_blocks("matvec", name, k // 32)
    assert blocks is not None
    if m > 1000:
        assert blocks * sources.STREAM_ROWS < m, "each block would take one iteration"
    grid = min(blocks, -(-m // sources.STREAM_ROWS))
    expect = q8_input(x)
    out = poisoned(m)
    K.launch("matvec", name, (grid,), (k // 32,), (*gw.args(), *q8.args(), out, np.int32(m), np.int32(k)))
    assert rel_to_terms(out.get(), w, expect) < 1e-6
    out = poisoned(m)
    K.matvec(gw, None, q8, out, "stream")
    assert rel_to_terms(out.get(), w, expect) < 1e-6


def test_matvec_stream_refuses_rows_its_block_cannot_hold():
    raw, _ = random_weight(T.Q4_0, 4, 576, np.random.default_rng())
    gw = K.upload_weight("w", T.Q4_0, (4, 576), raw)
    q8 = K.Q8.empty(576)
    with pytest.raises(ValueError, match="multiple of 1024"):
        K.matvec(gw, None, q8, poisoned(4), "stream")


@pytest.mark.parametrize("act", [K.ACT_SILU, K.ACT_GELU_TANH])
@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_K, T.Q6_K, T.F16], ids=lambda t: t.name)
def test_matvec_glu(qtype, act):
    rng = np.random.default_rng()
    m, k = 544, 1024  # a multiple of 32 for the variant that quantizes its output
    (rg, wg), (ru, wu) = random_weight(qtype, m, k, rng), random_weight(qtype, m, k, rng)
    x = rng.standard_normal(k).astype(np.float32)
    gate, up = K.upload_weight("g", qtype, (m, k), rg), K.upload_weight("u", qtype, (m, k), ru)
    xd = cp.asarray(x)
    q8 = K.Q8.empty(k)
    K.quantize_q8(xd, q8)
    xin = q8_input(x) if gate.quantized else x.astype(np.float64)
    g, u = wg.astype(np.float64) @ xin, wu.astype(np.float64) @ xin
    with np.errstate(over="ignore"):
        a = g / (1 + np.exp(-g)) if act == K.ACT_SILU else 0.5 * g * (1 + np.tanh(0.7978845608028654 * (g + 0.044715 * g**3)))
    out = poisoned(m)
    K.matvec_glu(gate, up, xd, q8 if gate.quantized else None, out, act)
    assert rel(out.get(), a * u) < 1e-5
    if gate.quantized:  # every kernel shape, each also quantizing its output for the down projection
        for shape in ("fused", (1, 1), (2, 1), (4, 1), (1, 2), (2, 2)):
            out2, q8_out = poisoned(m), K.Q8.empty(m)
            K.matvec_glu(gate, up, xd, q8, out2, act, q8_out, shape)
            assert rel(out2.get(), a * u) < 1e-5, shape
            assert_q8_of(q8_out, out2.get())


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_dequant_rows_and_embedding_gather(qtype):
    rng = np.random.default_rng()
    m, k = 96, 512
    raw, w = random_weight(qtype, m, k, rng)
    gw = K.upload_weight("w", qtype, (m, k), raw)
    out32 = poisoned((m, k))
    K.dequant(gw, out32)
    assert rel(out32.get(), w) < 1e-6
    out16 = poisoned((m, k), cp.float16)
    K.dequant(gw, out16)
    assert rel(out16.get(), w) < 1e-3
    part = poisoned((m - 40, k), cp.float16)
    K.dequant(gw, part, row_lo=40)
    assert rel(part.get(), w[40:]) < 1e-3
    tokens = rng.integers(0, m, 17).astype(np.int32)
    emb = poisoned((17, k))
    K.dequant(gw, emb, rows=cp.asarray(tokens), scale=1.5)
    expect = np.empty((17, k), np.float32)
    reference.embed(w, tokens, expect, 1.5)
    assert rel(emb.get(), expect) < 1e-6


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_K, T.Q8_0], ids=lambda t: t.name)
def test_prompt_product_dequant_then_cublas(qtype):
    rng = np.random.default_rng()
    n, m, k = 77, 640, 1024
    raw, w = random_weight(qtype, m, k, rng)
    x = rng.standard_normal((n, k)).astype(np.float32)
    gw = K.upload_weight("w", qtype, (m, k), raw)
    wh, xh = cp.empty((m, k), cp.float16), cp.empty((n, k), cp.float16)
    K.dequant(gw, wh)
    K.to_f16(cp.asarray(x), xh)
    wide = poisoned((n, m + 64))
    K.gemm_f16(xh, wh, wide[:, 32 : 32 + m])  # into a column slice of a wider array, as the QKV views are
    assert rel(wide[:, 32 : 32 + m].get(), x.astype(np.float64) @ w.T.astype(np.float64)) < 1e-2
    assert np.isnan(wide[:, :32].get()).all() and np.isnan(wide[:, 32 + m :].get()).all()


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K], ids=lambda t: t.name)
def test_prompt_product_a_row_slice_at_a_time(qtype, monkeypatch):
    """A weight larger than the dequantization scratch (made small here) goes through the backend's prompt product
    in row slices of DEQUANT_SLICE_ROWS multiples, each into its own columns of the output, the last one ragged."""
    from engine import backend_cupy, capabilities

    rng = np.random.default_rng()
    n, m, k = 77, 650, 1024
    monkeypatch.setattr(capabilities, "DEQUANT_SCRATCH_ELEMENTS", 300 * k)
    monkeypatch.setattr(K, "TILES_MAX_WEIGHTS", 0)  # every product through dequantize + cuBLAS
    assert capabilities.dequant_slice_rows(m, k) == 256
    raw, w = random_weight(qtype, m, k, rng)
    x = rng.standard_normal((n, k)).astype(np.float32)
    backend = backend_cupy.CupyBackend()
    gw = K.upload_weight("w", qtype, (m, k), raw)
    out = poisoned((n, m))
    backend.linear(cp.asarray(x), gw, out)
    backend.synchronize()
    assert rel(out.get(), x.astype(np.float64) @ w.T.astype(np.float64)) < 1e-2
    backend.close()


@pytest.mark.parametrize("qtype", QUANT_TYPES, ids=lambda t: t.name)
def test_prompt_product_on_dequantized_tiles(qtype):
    rng = np.random.default_rng()
    elements, _ = quants.block_layout(qtype)
    n, m, k = 77, 650, (1056 if elements == 32 else 1280)  # no dimension a multiple of its tile (k: 32-weight types)
    raw, w = random_weight(qtype, m, k, rng)
    x = rng.standard_normal((n, k)).astype(np.float32)
    gw = K.upload_weight("w", qtype, (m, k), raw)
    wide = poisoned((n, m + 64))
    view = wide[:, 32 : 32 + m]  # a column slice of a wider array, as the QKV views are
    assert K.tiled(cp.asarray(x), gw, view)
    K.matmul(gw, cp.asarray(x), view)
    assert rel(view.get(), x.astype(np.float64) @ w.T.astype(np.float64)) < 1e-2
    assert np.isnan(wide[:, :32].get()).all() and np.isnan(wide[:, 32 + m :].get()).all()


@pytest.mark.parametrize("act", [K.ACT_SILU, K.ACT_GELU_TANH])
@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q5_1, T.Q4_K, T.Q6_K], ids=lambda t: t.name)
def test_prompt_gate_up_on_dequantized_tiles(qtype, act):
    rng = np.random.default_rng()
    n, m, k = 70, 330, 512
    (rg, wg), (ru, wu) = random_weight(qtype, m, k, rng), random_weight(qtype, m, k, rng)
    x = rng.standard_normal((n, k)).astype(np.float32)
    gate, up = K.upload_weight("g", qtype, (m, k), rg), K.upload_weight("u", qtype, (m, k), ru)
    out = poisoned((n, m))
    K.matmul_glu(gate, up, cp.asarray(x), out, act)
    g, u = x.astype(np.float64) @ wg.T, x.astype(np.float64) @ wu.T
    with np.errstate(over="ignore"):
        a = g / (1 + np.exp(-g)) if act == K.ACT_SILU else 0.5 * g * (1 + np.tanh(0.7978845608028654 * (g + 0.044715 * g**3)))
    assert rel(out.get(), a * u) < 1e-2


def test_glu_elementwise():
    rng = np.random.default_rng()
    g, u = rng.standard_normal((5, 300)).astype(np.float32), rng.standard_normal((5, 300)).astype(np.float32)
    out = poisoned((5, 300))
    K.glu(cp.asarray(g), cp.asarray(u), out, K.ACT_SILU)
    assert rel(out.get(), g / (1 + np.exp(-g.astype(np.float64))) * u) < 1e-5


@pytest.mark.parametrize("d", [64, 576, 640, 4096, 8192, 16384])
def test_rms_norm_and_add_rms_norm(d):
    rng = np.random.default_rng()
    n = 9
    x, r = (rng.standard_normal((n, d)).astype(np.float32) for _ in range(2))
    w = rng.standard_normal(d).astype(np.float32)
    out = poisoned((n, d))
    K.rms_norm(cp.asarray(x), cp.asarray(w), 1e-5, out)
    expect = np.empty_like(x)
    reference.rms_norm(x, w, 1e-5, expect)
    assert rel(out.get(), expect) < 1e-5
    res_d, out = cp.asarray(r), poisoned((n, d))
    K.add_rms_norm(cp.asarray(x), res_d, cp.asarray(w), 1e-5, out)
    reference.add_rms_norm(x, r, w, 1e-5, expect)
    assert rel(res_d.get(), r) < 1e-6
    assert rel(out.get(), expect) < 1e-5
    # One-row variants that also quantize their output for the next product.
    one, q8 = poisoned((1, d)), K.Q8.empty(d)
    K.rms_norm(cp.asarray(x[:1]), cp.asarray(w), 1e-5, one, q8)
    assert_q8_of(q8, one.get())
    K.add_rms_norm(cp.asarray(x[1:2]), cp.asarray(r[1:2]), cp.asarray(w), 1e-5, one, q8)
    assert_q8_of(q8, one.get())


def test_rms_norm_per_head_on_strided_view():
    rng = np.random.default_rng()
    n, heads, hd, width = 5, 4, 64, 4 * 64 + 128
    buf = rng.standard_normal((n, width)).astype(np.float32)
    w = rng.standard_normal(hd).astype(np.float32)
    dev = cp.asarray(buf)
    view = dev[:, : heads * hd].reshape(n, heads, hd)
    K.rms_norm(view, cp.asarray(w), 1e-6, view)
    expect = buf.copy()
    v = expect[:, : heads * hd].reshape(n, heads, hd)
    reference.rms_norm(v.copy(), w, 1e-6, v)
    assert rel(dev.get(), expect) < 1e-5


@pytest.mark.parametrize("neox", [False, True])
def test_rope_store_kv(neox):
    rng = np.random.default_rng()
    n, heads, kv, hd, rot, max_tokens, start = 7, 8, 2, 64, 48, 64, 21
    width = (heads + 2 * kv) * hd
    qkv = rng.standard_normal((n, width)).astype(np.float32)
    inv_freq = (1.0 / 10000 ** (np.arange(0, rot, 2) / rot)).astype(np.float32)
    cos, sin = reference.rope_tables(inv_freq, max_tokens)
    kc = cp.asarray(rng.standard_normal((kv, max_tokens, hd)).astype(np.float16))
    vc = cp.asarray(rng.standard_normal((kv, max_tokens, hd)).astype(np.float16))
    kc_ref, vc_ref = kc.get().astype(np.float32), vc.get().astype(np.float32)
    dev = cp.asarray(qkv)
    views = (dev[:, : heads * hd].reshape(n, heads, hd), dev[:, heads * hd : (heads + kv) * hd].reshape(n, kv, hd),
             dev[:, (heads + kv) * hd :].reshape(n, kv, hd))
    K.rope_store_kv(*views, cp.asarray(cos), cp.asarray(sin), neox, kc, vc, cp.asarray([start], cp.int32))
    q, k, v = (qkv[:, : heads * hd].reshape(n, heads, hd), qkv[:, heads * hd : (heads + kv) * hd].reshape(n, kv, hd),
               qkv[:, (heads + kv) * hd :].reshape(n, kv, hd))
    reference.rope_store_kv(q, k, v, cos, sin, "neox" if neox else "normal", kc_ref, vc_ref, start)
    assert rel(dev.get(), qkv) < 1e-5
    assert rel(kc.get(), kc_ref) < 1e-3 and rel(vc.get(), vc_ref) < 1e-3


def attention_case(rng, n, start, window, hd, heads, kv, max_tokens=512):
    kc = rng.standard_normal((kv, max_tokens, hd)).astype(np.float16)
    vc = rng.standard_normal((kv, max_tokens, hd)).astype(np.float16)
    qkv = rng.standard_normal((n, heads * hd + 16)).astype(np.float32)
    q = qkv[:, : heads * hd].reshape(n, heads, hd)
    expect = np.empty((n, heads * hd), np.float32)
    scale = 1 / np.sqrt(hd)
    reference.attention(q, kc.astype(np.float32), vc.astype(np.float32), start, expect, scale, window)
    qd = cp.asarray(qkv)[:, : heads * hd].reshape(n, heads, hd)
    return (qd, cp.asarray(kc), cp.asarray(vc), cp.asarray([start], cp.int32)), scale, expect


@pytest.mark.parametrize("n,start,window,hd", [(1, 0, 0, 64), (1, 300, 0, 128), (1, 300, 100, 64), (37, 50, 0, 64),
                                                (130, 0, 0, 128), (20, 90, 33, 64), (1, 200, 0, 256), (9, 3, 0, 256)])
def test_attention(n, start, window, hd):
    rng = np.random.default_rng()
    heads, kv = 8, 2
    tensors, scale, expect = attention_case(rng, n, start, window, hd, heads, kv)
    z, wpq = K.attention_splits(n)
    part = cp.empty(n * heads * z * wpq * (hd + 2), cp.float32)
    out = poisoned((n, heads * hd))
    done = K.counters(heads) if n == 1 else None
    K.attention(*tensors, out, scale, window, part, done=done)
    assert rel(out.get(), expect) < 1e-5
    if n == 1:  # decode: each head's last block merges, and on a second launch also quantizes the output
        assert not done.get().any(), "the merging blocks leave their counters at zero"
        q8 = K.Q8.empty(heads * hd)
        out[...] = np.nan
        K.attention(*tensors, out, scale, window, part, q8, done)
        assert rel(out.get(), expect) < 1e-5
        assert_q8_of(q8, out.get())


DECODE_CASES = [(0, 0, 64, False, 64), (300, 0, 128, False, 128), (300, 100, 64, True, 48), (2000, 0, 128, True, 128),
                (200, 0, 256, False, 192), (45, 0, 256, True, 256)]


@pytest.mark.skipif(not K.cluster_decode_attention(), reason="attention_decode needs sm_90 or newer")
@pytest.mark.parametrize("start,window,hd,neox,rot", DECODE_CASES)
def test_attention_decode(start, window, hd, neox, rot):
    """One token's rotary embedding, cache write and attention in one kernel."""
    check_decode(K.attention_decode, start, window, hd, neox, rot, 8, 2)


# GQA groups 1-8 (3 and 5 leave query slots of a block unused); 8 splits of 2048 positions: at start 2000 all take
# 256 keys, at 300 three take 128 and the rest exit, at 0 one holds only the step's own token.
@pytest.mark.parametrize("heads,kv", [(8, 2), (16, 2), (6, 2), (4, 4), (10, 2)])
@pytest.mark.parametrize("start,window,hd,neox,rot", DECODE_CASES)
def test_attention_decode_split(start, window, hd, neox, rot, heads, kv):
    """attention_decode's work by blocks of a KV head and a split of its keys, merged by the last to finish."""
    done = K.counters(kv)

    def launch(*args, q8=None):
        part = cp.empty(heads * 8 * (hd + 2), cp.float32)
        K.attention_decode_split(*args, part, done, q8, splits=8)
        assert not done.get().any(), "the merging blocks leave their counters at zero"

    check_decode(launch, start, window, hd, neox, rot, heads, kv)


@pytest.mark.skipif(not K.mma_capable(), reason="attention_decode_deep needs sm_80 or newer")
@pytest.mark.parametrize("splits", [8, None])
@pytest.mark.parametrize("heads,kv", [(8, 2), (16, 2), (6, 2), (4, 4), (10, 2), (32, 2)])
@pytest.mark.parametrize("start,window,hd,neox,rot", DECODE_CASES)
def test_attention_decode_deep(start, window, hd, neox, rot, heads, kv, splits):
    """The same work on tensor cores, each warp's key tiles streamed through shared memory: GQA groups 1-16, 8
    splits (some exiting at once, one holding only the step's own token at start 0) or as many as the GPU holds."""
    done = K.counters(2 * kv)

    def launch(*args, q8=None):
        n = splits or K.deep_decode_splits(2048, kv, hd)
        part = cp.empty(heads * n * (hd + 2), cp.float32)
        K.attention_decode_deep(*args, part, done, q8, splits=n)
        assert not done.get().any(), "the merging blocks leave their counters at zero"

    # q and the probabilities enter the tensor cores as fp16.
    check_decode(launch, start, window, hd, neox, rot, heads, kv, tol=2e-3)


@pytest.mark.skipif(not K.mma_capable(), reason="attention_decode_deep needs sm_80 or newer")
@pytest.mark.parametrize("tiles", [None, *N.DEEP_SWEEP[128]])
@pytest.mark.parametrize("heads,kv", [(32, 8), (32, 4), (64, 4)])
def test_attention_decode_deep_tile_shapes(tiles, heads, kv):
    """Every tile shape bench/bench_attention.py times, at today's models' GQA shapes (Qwen3-8B, Qwen3-30B-A3B)."""
    done = K.counters(2 * kv)

    def launch(*args, q8=None):
        n = K.deep_decode_splits(2048, kv, 128, tiles)
        part = cp.empty(heads * n * (128 + 2), cp.float32)
        K.attention_decode_deep(*args, part, done, q8, splits=n, tiles=tiles)

    check_decode(launch, 1900, 0, 128, True, 128, heads, kv, tol=2e-3)


@pytest.mark.skipif(not K.mma_capable(), reason="attention_decode_deep needs sm_80 or newer")
@pytest.mark.parametrize("form", sorted(N.DEEP_FORMS))
@pytest.mark.parametrize("heads,kv", [(32, 8), (32, 4)])
@pytest.mark.parametrize("splits", [None, 2], ids=["default-splits", "2-splits"])
def test_attention_decode_deep_sweep_forms(form, heads, kv, splits):
    """The deep kernel's sweep-only forms (timeline recorded, tiles fetched by bulk copies, by bulk copies only where
    a split's keys are few) compute what the backend's form does, with the default's splits (on an H100 or H200
    128 keys each at 1,901, where "short" takes bulk copies) and with 2 (960 each, where it does not)."""
    if form in ("bulk", "short") and not K.cluster_decode_attention():
        pytest.skip("bulk copies need sm_90 or newer")
    done = K.counters(2 * kv)

    def launch(*args, q8=None):
        n = splits or K.deep_decode_splits(2048, kv, 128)
        part = cp.empty(heads * n * (128 + 2), cp.float32)
        K.attention_decode_deep(*args, part, done, q8, splits=n, form=form)

    check_decode(launch, 1900, 0, 128, True, 128, heads, kv, tol=2e-3)


@pytest.mark.parametrize("form", ["cluster", "deep"])
@pytest.mark.parametrize("start,window,hd,neox,rot", DECODE_CASES)
def test_attention_decode_takes_the_qk_norm_in(form, start, window, hd, neox, rot):
    """The decode kernels that apply Qwen3's per-head q and k RMS norms themselves (Backend.rope_attention's
    qk_norm), against the reference's norms then rope and attention; GQA groups of 4 and 16 for the deep form."""
    if form == "cluster":
        if not K.cluster_decode_attention():
            pytest.skip("attention_decode needs sm_90 or newer")
        check_decode(K.attention_decode, start, window, hd, neox, rot, 8, 2, qk_norm=True)
        return
    if not K.mma_capable():
        pytest.skip("attention_decode_deep needs sm_80 or newer")
    for heads, kv in ((8, 2), (32, 2)):
        done = K.counters(2 * kv)

        def launch(*args, q8=None, qk_norm=None):
            n = K.deep_decode_splits(2048, kv, hd)
            part = cp.empty(heads * n * (hd + 2), cp.float32)
            K.attention_decode_deep(*args, part, done, q8, splits=n, qk_norm=qk_norm)

        check_decode(launch, start, window, hd, neox, rot, heads, kv, tol=2e-3, qk_norm=True)


def check_decode(launch, start, window, hd, neox, rot, heads, kv, tol=1e-5, qk_norm=False):
    """launch(q, k, v, cos, sin, neox, k_cache, v_cache, start, out, scale, window, q8=None) against the
    reference's rope_store_kv then attention (keys and values rounded to the cache's fp16 as the kernel uses them),
    within relative error tol. qk_norm: q and k of unlike scales per head take random per-head RMS norms first
    (the reference's rms_norm; the launch gets qk_norm=(q weights, k weights, eps))."""
    rng = np.random.default_rng()
    max_tokens = 2048
    qkv = rng.standard_normal((1, (heads + 2 * kv) * hd + 16)).astype(np.float32)
    norms = {}
    if qk_norm:
        qkv[:, : (heads + kv) * hd] *= np.repeat(rng.uniform(0.1, 8.0, heads + kv), hd).astype(np.float32)
        weights = rng.uniform(0.5, 1.5, (2, hd)).astype(np.float32)
        norms = {"qk_norm": (cp.asarray(weights[0]), cp.asarray(weights[1]), 1e-6)}
    inv_freq = (1.0 / 10000 ** (np.arange(0, rot, 2) / rot)).astype(np.float32)
    cos, sin = reference.rope_tables(inv_freq, max_tokens)
    kc = rng.standard_normal((kv, max_tokens, hd)).astype(np.float16)
    vc = rng.standard_normal((kv, max_tokens, hd)).astype(np.float16)

    def split(buf):
        return (buf[:, : heads * hd].reshape(1, heads, hd), buf[:, heads * hd : (heads + kv) * hd].reshape(1, kv, hd),
                buf[:, (heads + kv) * hd : (heads + 2 * kv) * hd].reshape(1, kv, hd))

    q, k, v = split(qkv.copy())
    if qk_norm:
        reference.rms_norm(q, weights[0], 1e-6, q)
        reference.rms_norm(k, weights[1], 1e-6, k)
    kc_ref, vc_ref = kc.astype(np.float32), vc.astype(np.float32)
    reference.rope_store_kv(q, k, v, cos, sin, "neox" if neox else "normal", kc_ref, vc_ref, start)
    kc_ref, vc_ref = (c.astype(np.float16).astype(np.float32) for c in (kc_ref, vc_ref))
    expect = np.empty((1, heads * hd), np.float32)
    scale = 1 / np.sqrt(hd)
    reference.attention(q, kc_ref, vc_ref, start, expect, scale, window)

    kc_dev, vc_dev = cp.asarray(kc), cp.asarray(vc)
    args = (*split(cp.asarray(qkv)), cp.asarray(cos), cp.asarray(sin), neox, kc_dev, vc_dev,
            cp.asarray([start], cp.int32))
    out = poisoned((1, heads * hd))
    launch(*args, out, scale, window, **norms)
    assert rel(out.get(), expect) < tol
    assert rel(kc_dev.get()[:, start], kc_ref[:, start]) < 1e-3
    assert np.array_equal(vc_dev.get()[:, start], vc_ref[:, start].astype(np.float16))
    others = np.arange(max_tokens) != start
    assert np.array_equal(kc_dev.get()[:, others], kc[:, others]), "only the token's own cache row is written"
    assert np.array_equal(vc_dev.get()[:, others], vc[:, others])
    q8 = K.Q8.empty(heads * hd)
    out[...] = np.nan
    launch(*args, out, scale, window, q8=q8, **norms)  # again (as a graph replays): the same result
    assert rel(out.get(), expect) < tol
    assert_q8_of(q8, out.get())


def test_argmax_and_repeat_penalty():
    rng = np.random.default_rng()
    vocab = 49152
    logits = rng.standard_normal(vocab).astype(np.float32)
    logits[[100, 20000]] = logits.max() + 1.0  # a tie: the lower id wins
    out_id, scratch = cp.full(1, -1, cp.int32), K.argmax_scratch()
    K.argmax(cp.asarray(logits), out_id, scratch)
    assert int(out_id.get()[0]) == 100
    assert not scratch[-1].get(), "the last block leaves the arrival count at zero for the next launch"
    # Again on the same scratch, the id written straight to pinned host memory and fed to a decode step's ids.
    logits[40000] = logits.max() + 1.0
    host, ids = cupyx.empty_pinned((1,), np.int32), cp.zeros(2, cp.int32)
    K.argmax(cp.asarray(logits), np.uintp(host.ctypes.data), scratch, (ids, 123))
    cp.cuda.get_current_stream().synchronize()
    assert int(host[0]) == 40000 and ids.get().tolist() == [123, 40000]
    recent = np.array([100, 5, 5, 20000, 7], np.int32)
    pen = poisoned(vocab)
    K.repeat_penalty(cp.asarray(logits), pen, cp.asarray(recent), recent.size, 1.3)
    expect = logits.copy()
    ids = np.unique(recent)
    expect[ids] = np.where(expect[ids] > 0, expect[ids] / 1.3, expect[ids] * 1.3)
    assert np.array_equal(pen.get(), expect)


@pytest.mark.parametrize("top_k,top_p,min_p,temp", [(40, 0.95, 0.05, 0.7), (1, 1.0, 0.0, 1.0), (200, 0.5, 0.0, 1.3),
                                                    (1000, 1.0, 0.2, 0.5)])
def test_topk_then_sample_matches_reference(top_k, top_p, min_p, temp):
    rng = np.random.default_rng()
    vocab = 32000
    logits = (rng.standard_normal(vocab) * 3).astype(np.float32)
    params = SamplingParams(temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p, repeat_penalty=1.0)
    vals, ids, out_id = cp.empty(top_k, cp.float32), cp.empty(top_k, cp.int32), cp.empty(1, cp.int32)
    K.topk(cp.asarray(logits), top_k, vals, ids)
    order = np.argsort(-logits, kind="stable")[:top_k]
    assert np.array_equal(ids.get(), order) and np.array_equal(vals.get(), logits[order])
    agree = 0
    draws = rng.random(200)
    for u in draws:
        K.sample_sorted(vals, ids, top_k, temp, top_p, min_p, float(u), out_id)
        agree += int(out_id.get()[0]) == reference.sample(logits, params, np.zeros(0, np.int32), float(u))
    assert agree >= 199, f"{agree}/200 draws agree with the reference"
