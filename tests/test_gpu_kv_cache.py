"""The KV cache's forms on the GPU (engine/kernels: rope.cu, attention.cu, flash_attention.cu) against the NumPy
reference on fresh random inputs. q8_0: the cache write rounds as reference.quantize_q8_0 (GGUF's Q8_0), and every
attention kernel reads the values the cache stands for (q times its group's scale); whole tiny models with a q8_0
cache against the same models with the fp16 one. Rings (a sliding-window layer's cache of fewer rows than
positions, position j in row j mod rows): writes and reads across the wrap, fp16 and q8_0 (needs CuPy and a GPU)."""

import sys
from pathlib import Path

import numpy as np
import pytest
from gpu_support import require_gpu
from gguf import GGMLQuantizationType as T

from engine import load_model
from engine.kernels import reference

cp = require_gpu()
pytestmark = pytest.mark.gpu

from engine.kernels import cuda as K  # noqa: E402  (needs CuPy)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.make_synthetic_gguf import write_model  # noqa: E402


def rel(got, expect):
    return float(np.abs(got - expect).max() / np.abs(expect).max())


def as_read(values):
    """The values a q8_0 cache stands for as the kernels read them: fp16 of q times scale."""
    return values.astype(np.float16).astype(np.float32)


def q8_cache(rng, kv, max_tokens, hd):
    """A random float32 cache rounded to q8_0: (the values it stands for as read, device int8 rows, device
    scales)."""
    values = (rng.standard_normal((kv, max_tokens, hd)) * rng.uniform(0.2, 3.0, (kv, max_tokens, 1))).astype(np.float32)
    q, d = reference.quantize_q8_0(values)
    return as_read(reference.dequantize_q8_0(q, d)), cp.asarray(q), cp.asarray(d)


def assert_rows_rounded(q_dev, d_dev, expect_values):
    """Rows the kernel wrote against the q8_0 rounding of the reference's values: the same scales (fp16), and quants
    equal but where the GPU's float32 rotation fell on the other side of a rounding boundary (one step)."""
    q_ref, d_ref = reference.quantize_q8_0(expect_values)
    assert rel(d_dev.astype(np.float32), d_ref.astype(np.float32)) < 1e-3
    step = np.abs(q_dev.astype(np.int32) - q_ref.astype(np.int32))
    assert step.max() <= 1 and (step == 0).mean() > 0.99


@pytest.mark.parametrize("neox", [False, True])
@pytest.mark.parametrize("hd", [64, 128, 256])
def test_rope_store_kv_rounds_to_q8_0(neox, hd):
    rng = np.random.default_rng()
    n, heads, kv, max_tokens, start = 7, 8, 2, 64, 21
    rot = hd - 16
    qkv = (rng.standard_normal((n, (heads + 2 * kv) * hd)) * 2).astype(np.float32)
    cos, sin = reference.rope_tables((1.0 / 10000 ** (np.arange(0, rot, 2) / rot)).astype(np.float32), max_tokens)
    _, kq, kd = q8_cache(rng, kv, max_tokens, hd)
    _, vq, vd = q8_cache(rng, kv, max_tokens, hd)
    before = [a.get() for a in (kq, kd, vq, vd)]
    dev = cp.asarray(qkv)
    views = (dev[:, : heads * hd].reshape(n, heads, hd), dev[:, heads * hd : (heads + kv) * hd].reshape(n, kv, hd),
             dev[:, (heads + kv) * hd :].reshape(n, kv, hd))
    K.rope_store_kv(*views, cp.asarray(cos), cp.asarray(sin), neox, kq, vq, cp.asarray([start], cp.int32), (kd, vd))
    q, k, v = (qkv[:, : heads * hd].reshape(n, heads, hd), qkv[:, heads * hd : (heads + kv) * hd].reshape(n, kv, hd),
               qkv[:, (heads + kv) * hd :].reshape(n, kv, hd))
    kc, vc = np.zeros((kv, max_tokens, hd), np.float32), np.zeros((kv, max_tokens, hd), np.float32)
    reference.rope_store_kv(q, k, v, cos, sin, "neox" if neox else "normal", kc, vc, start)
    assert rel(dev.get(), qkv) < 1e-5
    rows = slice(start, start + n)
    assert_rows_rounded(kq.get()[:, rows], kd.get()[:, rows], kc[:, rows])
    assert_rows_rounded(vq.get()[:, rows], vd.get()[:, rows], vc[:, rows])
    others = np.ones(max_tokens, bool)
    others[rows] = False
    for got, old in zip((kq, kd, vq, vd), before):
        assert np.array_equal(got.get()[:, others], old[:, others]), "only the chunk's rows are written"


# (start, window, head dim, neox, rotated dims, query heads, KV heads): GQA groups 1-8, sliding windows, the first
# position, depths whose splits hold ragged key counts.
DECODE_CASES = [(0, 0, 64, False, 64, 8, 2), (300, 0, 128, False, 128, 32, 8), (300, 100, 64, True, 48, 6, 2),
                (2000, 0, 128, True, 128, 32, 4), (200, 0, 256, False, 192, 8, 1), (45, 0, 256, True, 256, 4, 4)]


def decode_launchers():
    """Each decode form the backend may choose on this GPU: name -> launch(*args, scales=...) (check_decode's)."""
    forms = {}

    def partial(q, k, v, cos, sin, neox, kc, vc, start, out, scale, window, scales):
        n_heads, hd = q.shape[1], q.shape[2]
        K.rope_store_kv(q, k, v, cos, sin, neox, kc, vc, start, scales)
        part = cp.empty(n_heads * K.ATTN_Z_SPLITS * 4 * (hd + 2), cp.float32)
        K.attention(q, kc, vc, start, out, scale, window, part, done=K.counters(n_heads), scales=scales)

    def split(*args, scales):
        heads, hd, kv = args[0].shape[1], args[0].shape[2], args[6].shape[0]
        if heads // kv > 8:
            pytest.skip("the split kernel serves groups of at most 8")
        part = cp.empty(heads * 8 * (hd + 2), cp.float32)
        K.attention_decode_split(*args, part, K.counters(kv), splits=8, scales=scales)

    def deep(*args, scales):
        heads, hd, kv, max_tokens = args[0].shape[1], args[0].shape[2], args[6].shape[0], args[6].shape[1]
        n = K.deep_decode_splits(max_tokens, kv, hd, kv="q8_0" if scales else "full")
        part = cp.empty(heads * n * (hd + 2), cp.float32)
        K.attention_decode_deep(*args, part, K.counters(2 * kv), splits=n, scales=scales)

    forms["partial"], forms["split"] = partial, split
    if K.mma_capable():
        forms["deep"] = deep
    if K.cluster_decode_attention():
        forms["cluster"] = lambda *args, scales: K.attention_decode(*args, scales=scales)
    return forms


@pytest.mark.parametrize("form", ["partial", "split", "deep", "cluster"])
@pytest.mark.parametrize("start,window,hd,neox,rot,heads,kv", DECODE_CASES)
def test_decode_attention_on_a_q8_0_cache(form, start, window, hd, neox, rot, heads, kv):
    """One token's rotary embedding, q8_0 cache write and attention: the row stored as the reference rounds it, the
    output against the reference's attention over the values the cache stands for."""
    launch = decode_launchers().get(form)
    if launch is None:
        pytest.skip(f"the {form} kernel does not run on this GPU")
    rng = np.random.default_rng()
    max_tokens = 2048
    qkv = rng.standard_normal((1, (heads + 2 * kv) * hd + 16)).astype(np.float32)
    cos, sin = reference.rope_tables((1.0 / 10000 ** (np.arange(0, rot, 2) / rot)).astype(np.float32), max_tokens)
    kc, kq, kd = q8_cache(rng, kv, max_tokens, hd)
    vc, vq, vd = q8_cache(rng, kv, max_tokens, hd)

    def split3(buf):
        return (buf[:, : heads * hd].reshape(1, heads, hd), buf[:, heads * hd : (heads + kv) * hd].reshape(1, kv, hd),
                buf[:, (heads + kv) * hd : (heads + 2 * kv) * hd].reshape(1, kv, hd))

    q, k, v = split3(qkv.copy())
    new_k, new_v = kc.copy(), vc.copy()
    reference.rope_store_kv(q, k, v, cos, sin, "neox" if neox else "normal", new_k, new_v, start)
    row_k, row_v = new_k[:, start].copy(), new_v[:, start].copy()
    for c in (new_k, new_v):  # the step's own row as the cache holds it
        c[:, start] = as_read(reference.dequantize_q8_0(*reference.quantize_q8_0(c[:, start])))
    expect = np.empty((1, heads * hd), np.float32)
    scale = 1 / np.sqrt(hd)
    reference.attention(q, new_k, new_v, start, expect, scale, window)

    out = cp.full((1, heads * hd), cp.nan, cp.float32)
    args = (*split3(cp.asarray(qkv)), cp.asarray(cos), cp.asarray(sin), neox, kq, vq, cp.asarray([start], cp.int32),
            out, scale, window)
    kq_before = kq.get()
    launch(*args, scales=(kd, vd))
    # On tensor cores q and the probabilities enter as fp16 too.
    assert rel(out.get(), expect) < (2e-3 if form == "deep" else 1e-5)
    assert_rows_rounded(kq.get()[:, start], kd.get()[:, start], row_k)
    assert_rows_rounded(vq.get()[:, start], vd.get()[:, start], row_v)
    others = np.arange(max_tokens) != start
    assert np.array_equal(kq.get()[:, others], kq_before[:, others]), "only the token's own cache row is written"


FLASH_CASES = [(37, 50, 0, 64, 8, 2, 512), (100, 300, 0, 128, 32, 8, 512), (129, 0, 0, 128, 16, 2, 512),
               (200, 1000, 0, 256, 8, 1, 1536), (90, 400, 100, 256, 4, 1, 512), (70, 300, 128, 64, 9, 3, 512)]


@pytest.mark.skipif(not K.flash_attention_capable(1, 1), reason="flash attention needs compute capability 8.0")
@pytest.mark.parametrize("n,start,window,hd,heads,kv,max_tokens", FLASH_CASES)
def test_flash_attention_on_a_q8_0_cache(n, start, window, hd, heads, kv, max_tokens):
    rng = np.random.default_rng()
    qkv = (rng.standard_normal((n, (heads + 2 * kv) * hd)) * 2).astype(np.float32)
    q = qkv[:, : heads * hd].reshape(n, heads, hd)
    kc, kq, kd = q8_cache(rng, kv, max_tokens, hd)
    vc, vq, vd = q8_cache(rng, kv, max_tokens, hd)
    scale = 1.0 / np.sqrt(hd)
    expect = np.empty((n, heads * hd), np.float32)
    reference.attention(q, kc, vc, start, expect, scale, window)
    out = cp.full((n, heads * hd), cp.nan, cp.float32)
    K.flash_attention(cp.asarray(qkv)[:, : heads * hd].reshape(n, heads, hd), kq, vq, cp.asarray([start], cp.int32),
                      out, scale, window, (kd, vd))
    # q and the probabilities enter the tensor cores as fp16: errors of a few fp16 ulps of the output.
    err = np.abs(out.get() - expect).max() / np.abs(vc).max()
    assert err < 4e-3, err


def ring_image(values, rows, last):
    """The rows of a ring holding positions last - rows + 1 .. last of a linear cache (kv, positions, hd)."""
    image = np.zeros(values.shape[:1] + (rows,) + values.shape[2:], values.dtype)
    for p in range(max(0, last - rows + 1), last + 1):
        image[:, p % rows] = values[:, p]
    return image


def device_cache(values, kind):
    """(device rows, scales or None, the values as the kernels read them) of a float32 cache in this form."""
    if kind == "full":
        return cp.asarray(values.astype(np.float16)), None, as_read(values)
    q, d = reference.quantize_q8_0(values)
    return cp.asarray(q), cp.asarray(d), as_read(reference.dequantize_q8_0(q, d))


@pytest.mark.parametrize("form", ["partial", "split", "deep", "cluster"])
@pytest.mark.parametrize("kind", ["full", "q8_0"])
@pytest.mark.parametrize("hd", [64, 128])
def test_decode_attention_across_a_ring(form, kind, hd):
    """One decode step on a ring whose window spans the wrap: the token's row goes to position mod rows, and the
    window's keys and values are read from both ends of the ring."""
    launch = decode_launchers().get(form)
    if launch is None:
        pytest.skip(f"the {form} kernel does not run on this GPU")
    rng = np.random.default_rng()
    heads, kv, window = 8, 2, 100
    rows = window + 37
    start = 5 * rows + 20  # the window: positions start - 99 .. start, in rows 58 .. 136 and 0 .. 20
    qkv = rng.standard_normal((1, (heads + 2 * kv) * hd)).astype(np.float32)
    cos, sin = reference.rope_tables((1.0 / 10000 ** (np.arange(0, hd, 2) / hd)).astype(np.float32), start + 1)
    k_lin, v_lin = (rng.standard_normal((kv, start + 1, hd)).astype(np.float32) for _ in range(2))
    kc, ks, k_read = device_cache(ring_image(k_lin, rows, start - 1), kind)
    vc, vs, v_read = device_cache(ring_image(v_lin, rows, start - 1), kind)
    scales = None if ks is None else (ks, vs)
    q, k, v = (qkv[:, a:b].reshape(1, -1, hd).copy() for a, b in ((0, heads * hd), (heads * hd, (heads + kv) * hd),
                                                                   ((heads + kv) * hd, None)))
    new_k, new_v = np.zeros((kv, start + 1, hd), np.float32), np.zeros((kv, start + 1, hd), np.float32)
    reference.rope_store_kv(q, k, v, cos, sin, "neox", new_k, new_v, start)
    for lin, read, new in ((k_lin, k_read, new_k), (v_lin, v_read, new_v)):  # what the kernels read, position-wise
        for p in range(start - rows + 1, start):
            lin[:, p] = read[:, p % rows]
        own = new[:, start]
        lin[:, start] = as_read(own if kind == "full" else reference.dequantize_q8_0(*reference.quantize_q8_0(own)))
    expect = np.empty((1, heads * hd), np.float32)
    reference.attention(q, k_lin, v_lin, start, expect, 1 / np.sqrt(hd), window)
    out = cp.full((1, heads * hd), cp.nan, cp.float32)
    dev = cp.asarray(qkv)
    args = (dev[:, : heads * hd].reshape(1, heads, hd), dev[:, heads * hd : (heads + kv) * hd].reshape(1, kv, hd),
            dev[:, (heads + kv) * hd :].reshape(1, kv, hd), cp.asarray(cos), cp.asarray(sin), True, kc, vc,
            cp.asarray([start], cp.int32), out, 1 / np.sqrt(hd), window)
    launch(*args, scales=scales)
    assert rel(out.get(), expect) < (2e-3 if form == "deep" else 1e-5)
    stored = kc.get()[:, start % rows]
    if kind == "full":
        assert rel(stored.astype(np.float32), new_k[:, start]) < 1e-3
    else:
        assert_rows_rounded(stored, ks.get()[:, start % rows], new_k[:, start])


@pytest.mark.skipif(not K.flash_attention_capable(1, 1), reason="flash attention needs compute capability 8.0")
@pytest.mark.parametrize("kind", ["full", "q8_0"])
@pytest.mark.parametrize("n,window,hd", [(70, 100, 128), (33, 64, 64), (130, 200, 256)])
def test_flash_attention_across_a_ring(kind, n, window, hd):
    """A prompt chunk on a ring of window + n - 1 rows (engine/kv_cache.py WindowedCache's size) holding the
    chunk's own rows and the window before it, wrapped."""
    rng = np.random.default_rng()
    heads, kv = 8, 2
    rows = window + n - 1
    start = 3 * rows + 10
    q = (rng.standard_normal((n, heads, hd)) * 2).astype(np.float32)
    k_lin, v_lin = (rng.standard_normal((kv, start + n, hd)).astype(np.float32) for _ in range(2))
    kc, ks, k_read = device_cache(ring_image(k_lin, rows, start + n - 1), kind)
    vc, vs, v_read = device_cache(ring_image(v_lin, rows, start + n - 1), kind)
    for lin, read in ((k_lin, k_read), (v_lin, v_read)):
        for p in range(start + n - rows, start + n):
            lin[:, p] = read[:, p % rows]
    expect = np.empty((n, heads * hd), np.float32)
    reference.attention(q, k_lin, v_lin, start, expect, 1 / np.sqrt(hd), window)
    out = cp.full((n, heads * hd), cp.nan, cp.float32)
    K.flash_attention(cp.asarray(q), kc, vc, cp.asarray([start], cp.int32), out, 1 / np.sqrt(hd), window,
                      None if ks is None else (ks, vs))
    err = np.abs(out.get() - expect).max() / np.abs(v_lin).max()
    assert err < 4e-3, err


def tiny_model(tmp_path, kv_heads):
    path = tmp_path / "tiny.gguf"
    shape = dict(hidden=256, layers=2, ffn=768, heads=4, kv_heads=kv_heads, vocab=1000, tied=False)
    write_model(path, shape, T.Q8_0, "tiny", seed=int(np.random.default_rng().integers(1 << 30)))
    return path


def logit_gap(ours, theirs) -> tuple[float, float]:
    spread = float(theirs.max() - theirs.min())
    return float(np.abs(ours - theirs).max()), spread


def test_a_q8_0_cache_model_matches_the_fp16_cache(tmp_path):
    """A tiny model's logits over a 1,100-token prompt (three chunks on flash attention) and decode steps after it,
    with the q8_0 cache against the fp16 one: the difference the cache's rounding makes, bounded and printed."""
    path = tiny_model(tmp_path, kv_heads=2)
    ids = np.random.default_rng().integers(2, 1000, 1100).tolist()
    runs = {}
    for kind in ("full", "q8_0"):
        model = load_model(path, device="cuda", context_length=1200, kv_cache_type=kind)
        try:
            assert model.info.kv_cache_type == kind
            runs[kind] = [model.prompt_logits(ids, all_positions=True)[0]] + [
                model.prompt_logits(ids + ids[:n])[0] for n in (1, 2, 3)]  # decode steps reusing the prefix
        finally:
            model.close()
    for ours, theirs in zip(runs["q8_0"], runs["full"]):
        diff, spread = logit_gap(ours, theirs)
        print(f"q8_0 KV cache against fp16: largest logit difference {diff:.2e} of a logit range {spread:.2f}")
        assert np.isfinite(ours).all() and diff < 2e-2 * spread


@pytest.mark.skipif(not K.cluster_decode_attention(), reason="the cluster kernel is sm_90's")
def test_decode_on_a_q8_0_cache_matches_the_cluster_kernel(tmp_path, monkeypatch):
    """Decode steps past K.DEEP_DECODE_KEYS' position (heads of 64) on a q8_0 cache, on the kernel the backend
    picks for it (attention_decode_deep, its tiles converted in shared memory) against the cluster kernel on the same
    cache (its rows converted as read), within fp16 rounding."""
    path = tiny_model(tmp_path, kv_heads=2)
    depth = K.DEEP_DECODE_KEYS[64]
    ids = np.random.default_rng().integers(2, 1000, depth + 6).tolist()

    def decode_logits() -> list[np.ndarray]:
        model = load_model(path, device="cuda", context_length=depth + 64, kv_cache_type="q8_0")
        try:
            return [model.prompt_logits(ids[:n])[0] for n in (len(ids) - 1, len(ids))]
        finally:
            model.close()

    forms = []
    choose = K.decode_attention_form
    monkeypatch.setattr(K, "decode_attention_form", lambda *a: forms.append(choose(*a)) or forms[-1])
    picked = decode_logits()
    assert set(forms) == {"deep"}
    monkeypatch.setattr(K, "decode_attention_form", lambda *a: "cluster")
    cluster = decode_logits()
    for ours, theirs in zip(picked, cluster):
        diff, spread = logit_gap(ours, theirs)
        print(f"q8_0 cache, decode at depth {depth}: largest logit difference {diff:.2e} of {spread:.2f}")
        assert np.isfinite(ours).all() and diff < 2e-3 * spread
