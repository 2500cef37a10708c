"""The mixture-of-experts kernels against their NumPy references (needs CuPy and an NVIDIA GPU), on fresh random
inputs with NaN-poisoned outputs: routing (softmax, top-k, renormalization, on rows that may be strided), the
expert FFN at one token, at a short
chunk (a product per token and expert) and at a longer one (grouped products: uniform routing, and a skewed one
where one expert takes more than a tile of tokens and others none), and the one-token FFN captured in a CUDA graph
and replayed with new expert ids written to device memory in between; a token's experts kept in RAM read over the
bus by the GPU, beside the CPU's share, and the rule that splits a token's picks between the GPU's cache, the bus
and the CPU.

Tolerances: routing ids exact and weights within 1e-5 (float32 softmax in another summation order); the expert
FFN within 1e-4 relative error against the reference run on the two-level int8 activations the kernels read
(float32 arithmetic otherwise; the hidden vector's own quantization adds ~1.5e-5), 1e-5 for float weights; the
grouped products (fp16 activations and dequantized weights on tensor cores, float32 sums) within 2e-3 of the
reference on float32 activations.
"""

import numpy as np
import pytest
from gpu_support import rel, require_gpu
from gguf import GGMLQuantizationType as T

from engine import quants
from engine.gguf_file import GGUFTensor
from engine.kernels import reference
from engine.kernels.gpu_layout import random_blocks

cp = require_gpu()
pytestmark = pytest.mark.gpu

from engine.backend_cupy import GROUPED_MIN_SLOTS_PER_EXPERT, STREAM_MIN_TOKENS, CupyBackend  # noqa: E402




def q8_values(x):
    q, q2, d, _ = reference.quantize_q8(x)
    return reference.dequantize_q8(q, q2, d).astype(np.float32)


def stacked(name, qtype, shape, rng):
    """A GGUFTensor of stacked experts (n_experts, rows, cols) and its float32 values."""
    count = int(np.prod(shape))
    if qtype in (T.F32, T.F16):
        values = rng.standard_normal(shape).astype(np.float32) * 0.05
        raw = values.astype(np.float16 if qtype == T.F16 else np.float32).view(np.uint8).reshape(-1)
    else:
        raw = random_blocks(qtype, count // quants.block_layout(qtype)[0], rng, typical=0.05)
    return GGUFTensor(name, qtype, shape, raw), quants.dequantize(raw, qtype, shape).astype(np.float32)


def routes(n, n_experts, top_k, rng):
    ids = np.stack([rng.permutation(n_experts)[:top_k] for _ in range(n)]).astype(np.int32)
    weights = rng.random((n, top_k)).astype(np.float32)
    return ids, weights


@pytest.mark.parametrize("n_experts,top_k,normalize,extra", [(128, 8, True, 0), (8, 2, True, 0), (60, 4, False, 0),
                                                               (128, 8, True, 1)])
def test_moe_route(n_experts, top_k, normalize, extra):
    """extra: columns after each row's logits (the shared expert's gate, computed in the router's product)."""
    rng = np.random.default_rng()
    backend = CupyBackend()
    n = 37
    product = (rng.standard_normal((n, n_experts + extra)) * 2).astype(np.float32)
    logits = product[:, :n_experts]
    with backend.stream:  # the backend's stream does not wait for the default one
        weights, ids = cp.full((n, top_k), np.nan, cp.float32), cp.full((n, top_k), -1, cp.int32)
        dev_logits = cp.asarray(product)[:, :n_experts]
    backend.moe_route(dev_logits, top_k, normalize, weights, ids)
    want_w, want_ids = np.empty((n, top_k), np.float32), np.empty((n, top_k), np.int32)
    reference.moe_route(logits, top_k, normalize, want_w, want_ids)
    backend.synchronize()
    assert np.array_equal(ids.get(), want_ids)
    assert rel(weights.get(), want_w) < 1e-5
    backend.close()


@pytest.mark.parametrize("qtype", [T.F32, T.F16, T.BF16])
@pytest.mark.parametrize("n_experts,top_k,normalize,extra,k", [(128, 8, True, 0, 2048), (8, 2, True, 0, 64),
                                                                (60, 4, False, 1, 4096), (128, 8, True, 1, 96)])
def test_route_experts_one_token(qtype, n_experts, top_k, normalize, extra, k):
    """A decode step's router product and routing in one kernel (router_route): the logits against x @ W.T of the
    weights as stored, the picks against moe_route's reference on those logits. Rows of 64 and 96 values leave
    lanes without weights; 4,096 has more than the loads made before the wait. Three tokens in turn: the kernel's
    counter must be back at zero for the next."""
    rng = np.random.default_rng()
    backend = CupyBackend()
    m = n_experts + extra
    values = (rng.standard_normal((m, k)) * 0.1).astype(np.float32)
    if qtype == T.BF16:
        raw = (values.view(np.uint32) >> 16).astype(np.uint16)
        values = (raw.astype(np.uint32) << 16).view(np.float32)
    else:
        raw = values.astype(np.float16 if qtype == T.F16 else np.float32)
        values = raw.astype(np.float32)
    router = backend.upload(GGUFTensor("blk.0.ffn_gate_inp.weight", qtype, (m, k), raw.view(np.uint8).reshape(-1)))
    for _ in range(3):
        x = rng.standard_normal((1, k)).astype(np.float32)
        with backend.stream:
            x_dev, logits = cp.asarray(x), cp.full((1, m), np.nan, cp.float32)
            weights, ids = cp.full((1, top_k), np.nan, cp.float32), cp.full((1, top_k), -1, cp.int32)
        backend.route_experts(x_dev, router, n_experts, top_k, normalize, logits, weights, ids)
        got = backend.to_host(logits)
        assert rel(got, x.astype(np.float64) @ values.T.astype(np.float64)) < 1e-5
        want_w, want_ids = np.empty((1, top_k), np.float32), np.empty((1, top_k), np.int32)
        reference.moe_route(got[:, :n_experts], top_k, normalize, want_w, want_ids)
        assert np.array_equal(ids.get(), want_ids)
        assert rel(weights.get(), want_w) < 1e-5
    backend.close()


MIXES = [(T.Q4_K, T.Q6_K), (T.Q4_0, T.Q8_0), (T.Q5_K, T.Q5_1), (T.F16, T.F16), (T.F32, T.F32)]
# Experts kept in RAM, in every layout of the CPU's kernels that the GPU reads (kernel_names.HOST_LAYOUTS).
HOST_MIXES = [*MIXES[:3], (T.Q3_K, T.Q4_K)]


def run_moe_ffn(backend, handles, x, ids, weights, f):
    """The backend's moe_ffn on host arrays, into NaN-poisoned output and scratch; the result on the host."""
    n, top_k = ids.shape
    with backend.stream:
        out = cp.full(x.shape, np.nan, cp.float32)
        scratch = cp.full((n, top_k, 2 * f), np.nan, cp.float32)
        args = [cp.asarray(a) for a in (ids, weights)]
    # x through an op, so the backend knows it is new: a fresh array at the address of an earlier call's x would
    # otherwise be read through that x's int8 groups, which the backend keeps while nothing it runs writes there.
    x_dev = backend.empty(x.shape)
    backend.copy_into(x_dev, x)
    backend.moe_ffn(x_dev, *handles, *args, out, scratch)
    return backend.to_host(out)


def skewed_routes(n, n_experts, top_k, rng):
    """Expert 0 in every token's choice (n > 64 slots: several tiles), the rest drawn from the first half of the
    experts, so the second half gets no token."""
    ids = np.stack([np.concatenate([[0], 1 + rng.permutation(n_experts // 2 - 1)[: top_k - 1]]) for _ in range(n)])
    return ids.astype(np.int32), rng.random((n, top_k)).astype(np.float32)


@pytest.mark.parametrize("n,routing", [(1, routes), (7, routes), (100, routes), (150, skewed_routes)],
                         ids=["1", "7", "100", "150-skewed"])
@pytest.mark.parametrize("gate_type,down_type", MIXES, ids=lambda t: t.name)
def test_moe_ffn(gate_type, down_type, n, routing):
    rng = np.random.default_rng()
    backend = CupyBackend()
    n_experts, top_k, f, d = 16, 4, 512, 768
    gate, gate_f = stacked("gate_exps", gate_type, (n_experts, f, d), rng)
    up, up_f = stacked("up_exps", gate_type, (n_experts, f, d), rng)
    down, down_f = stacked("down_exps", down_type, (n_experts, d, f), rng)
    handles = [backend.upload(t) for t in (gate, up, down)]
    x = rng.standard_normal((n, d)).astype(np.float32)
    ids, weights = routing(n, n_experts, top_k, rng)
    out = run_moe_ffn(backend, handles, x, ids, weights, f)
    want = np.empty((n, d), np.float32)
    quantized = gate_type not in (T.F16, T.F32)
    grouped = n * top_k >= GROUPED_MIN_SLOTS_PER_EXPERT * n_experts and quantized
    reference.moe_ffn(q8_values(x) if quantized and not grouped else x, gate_f, up_f, down_f, ids, weights, want, None)
    error = rel(out, want)
    print(f"{gate_type.name}/{down_type.name} n={n}{' grouped' if grouped else ''}: relative error {error:.2e}")
    assert error < (2e-3 if grouped else 1e-4 if quantized else 1e-5)
    backend.close()


@pytest.mark.parametrize("gate_type,down_type", HOST_MIXES, ids=lambda t: t.name)
def test_moe_ffn_of_experts_in_ram_streamed_to_the_gpu(gate_type, down_type):
    """Experts kept in RAM in the CPU kernels' layout: a chunk of STREAM_MIN_TOKENS or more copies each layer's to the
    GPU, where the grouped products read that layout (all seven: the K-quants' 4- and 5-bit planes with 8-bit group
    scales under float32 super-block ones, Q6_K's, Q3_K's, the legacy 4- and 5-bit planes with float32 scales,
    Q8_0's); two
    layers in turn, so the second is the prefetched copy and the first is copied again into the same buffer."""
    rng = np.random.default_rng()
    backend = CupyBackend()
    n_experts, top_k, f, d, n = 16, 4, 512, 768, max(100, STREAM_MIN_TOKENS)
    layers = []
    for _ in range(2):
        gate, gate_f = stacked("gate_exps", gate_type, (n_experts, f, d), rng)
        up, up_f = stacked("up_exps", gate_type, (n_experts, f, d), rng)
        down, down_f = stacked("down_exps", down_type, (n_experts, d, f), rng)
        layers.append(([backend.upload(t, host=True) for t in (gate, up, down)], (gate_f, up_f, down_f)))
    for handles, floats in layers + layers[:1]:
        x = rng.standard_normal((n, d)).astype(np.float32)
        ids, weights = skewed_routes(n, n_experts, top_k, rng)
        want = np.empty((n, d), np.float32)
        reference.moe_ffn(x, *floats, ids, weights, want, None)
        error = rel(run_moe_ffn(backend, handles, x, ids, weights, f), want)
        print(f"{gate_type.name}/{down_type.name} n={n} streamed from RAM: relative error {error:.2e}")
        assert error < 2e-3
    backend.close()


@pytest.mark.parametrize("top_k", [4, 8])
def test_moe_cache_ids_splits_a_token_s_picks_between_cache_bus_and_host(top_k):
    """sampling.cu moe_cache_ids against reference.moe_cache_ids: every bus count 0..top_k, caches holding none, some
    and all of the picks (random maps, fresh picks each trial): slots, bus ids and host ids exact, the host's
    weights the picks', and the counts of picks and of cache hits."""
    import cupyx

    from engine.kernels import cuda as K

    rng = np.random.default_rng()
    n_experts = 64
    host_ids, host_weights = cupyx.empty_pinned(top_k, np.int32), cupyx.empty_pinned(top_k, np.float32)
    for bus in range(top_k + 1):
        for cached in (0.0, 0.3, 0.7, 1.0):
            ids = rng.choice(n_experts, top_k, replace=False).astype(np.int32)
            weights = rng.random(top_k).astype(np.float32)
            slot_of = np.where(rng.random(n_experts) < cached, rng.integers(0, 32, n_experts), -1).astype(np.int32)
            slots, bus_ids = cp.full(top_k, 7, cp.int32), cp.full(top_k, 7, cp.int32)
            host_ids[...], host_weights[...] = 7, np.nan
            uses = cp.zeros(n_experts + 1, cp.uint32)
            K.moe_cache_ids(cp.asarray(ids[None]), cp.asarray(weights[None]), cp.asarray(slot_of), bus, slots, bus_ids,
                            host_ids, host_weights, uses)
            cp.cuda.get_current_stream().synchronize()
            want = reference.moe_cache_ids(ids, slot_of, bus)
            for name, got, expected in zip(("slots", "bus ids", "host ids"), (slots.get(), bus_ids.get(), host_ids),
                                           want):
                assert np.array_equal(got, expected), f"{name}: {got} != {expected} (bus {bus}, map {slot_of[ids]})"
            assert np.array_equal(host_weights, weights)
            counts = np.bincount(ids, minlength=n_experts)
            assert np.array_equal(uses.get(), np.append(counts, (slot_of[ids] >= 0).sum()).astype(np.uint32))


@pytest.mark.parametrize("bus", [4, 2])
@pytest.mark.parametrize("gate_type,down_type", HOST_MIXES, ids=lambda t: t.name)
def test_moe_ffn_decode_reads_experts_in_ram_over_the_bus(gate_type, down_type, bus):
    """One token's experts kept in RAM (page-locked, the CPU kernels' layout): the GPU reads `bus` of its 4 experts
    in place over the bus (the decode products built for those layouts) and the CPU computes the others; two tokens
    in turn. All 4 over the bus: within the GPU kernels' 1e-4 of the reference; 2 and 2: within 2e-2 (the CPU rounds
    its activations to one int8 level: up to 8.8e-3 measured on an H100)."""
    rng = np.random.default_rng()
    backend = CupyBackend()
    backend.experts_over_bus = bus
    n_experts, top_k, f, d = 16, 4, 512, 768
    tensors = [stacked(name, qtype, shape, rng) for name, qtype, shape in
               (("gate_exps", gate_type, (n_experts, f, d)), ("up_exps", gate_type, (n_experts, f, d)),
                ("down_exps", down_type, (n_experts, d, f)))]
    handles = [backend.upload(t, host=True) for t, _ in tensors]
    for _ in range(2):
        x = rng.standard_normal((1, d)).astype(np.float32)
        ids, weights = routes(1, n_experts, top_k, rng)
        want = np.empty((1, d), np.float32)
        reference.moe_ffn(q8_values(x), *(v for _, v in tensors), ids, weights, want, None)
        error = rel(run_moe_ffn(backend, handles, x, ids, weights, f), want)
        print(f"{gate_type.name}/{down_type.name}, {bus} of {top_k} experts over the bus: relative error {error:.2e}")
        assert error < (1e-4 if bus == top_k else 2e-2)
    backend.close()


def test_moe_ffn_decode_replays_in_a_graph_with_new_expert_ids():
    rng = np.random.default_rng()
    backend = CupyBackend()
    n_experts, top_k, f, d = 32, 8, 256, 512
    gate, gate_f = stacked("gate_exps", T.Q4_K, (n_experts, f, d), rng)
    up, up_f = stacked("up_exps", T.Q4_K, (n_experts, f, d), rng)
    down, down_f = stacked("down_exps", T.Q6_K, (n_experts, d, f), rng)
    handles = [backend.upload(t) for t in (gate, up, down)]
    norm = backend.upload(GGUFTensor("norm", T.F32, (d,), np.ones(d, np.float32).view(np.uint8)))
    x_in, x, ids, weights = backend.empty((1, d)), backend.empty((1, d)), backend.empty((1, top_k), np.int32), backend.empty((1, top_k))
    out, scratch = backend.empty((1, d)), backend.empty((1, top_k, 2 * f))

    def step():
        # As in a model: the norm in front writes the FFN input and its int8 form, which the experts read.
        backend.rms_norm(x_in, norm, 1e-6, x)
        backend.moe_ffn(x, *handles, ids, weights, out, scratch)

    run = backend.compile_step(step)
    for replay in range(4):  # the first call runs directly and captures, the later ones replay the graph
        xv = rng.standard_normal((1, d)).astype(np.float32)
        iv, wv = routes(1, n_experts, top_k, rng)
        for dst, src in ((x_in, xv), (ids, iv), (weights, wv)):
            backend.copy_into(dst, src)
        with backend.stream:
            out.fill(np.nan)
        run(0)
        normed = np.empty_like(xv)
        reference.rms_norm(xv, np.ones(d, np.float32), 1e-6, normed)
        want = np.empty((1, d), np.float32)
        reference.moe_ffn(q8_values(normed), gate_f, up_f, down_f, iv, wv, want, None)
        assert rel(backend.to_host(out), want) < 1e-4, f"call {replay}"
    backend.close()


TINY_MOE = dict(arch="qwen3moe", hidden=256, layers=4, ffn=256, heads=4, kv_heads=2, head_dim=64, vocab=300,
                tied=False, experts=16, experts_used=4, context=512)


def tiny_moe(tmp_path, router_skew=0.0):
    """A qwen3moe model in llama.cpp's Q4_K_M mix (bench/make_synthetic_gguf.py, random weights)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from bench.make_synthetic_gguf import type_mix, write_model

    path = tmp_path / f"tiny-moe-{router_skew}.gguf"
    write_model(path, TINY_MOE, type_mix("Q4_K_M"), "tiny-moe", seed=3, router_skew=router_skew)
    return path


def greedy_run(path, prompt, tokens, **load):
    """The prompt's logits, `tokens` greedy tokens (decode through the captured graph) and the loaded model's info
    and expert cache's state."""
    from engine import GenerationSettings, load_model
    from engine.generate import decode_one_token, prefill

    greedy = GenerationSettings(temperature=0.0).sampling()
    model = load_model(path, device="cuda", context_length=128, **load)
    state, none = model._state, np.zeros(0, np.int32)
    logits, _ = prefill(state, prompt)
    first = state.backend.to_host(logits)
    out = [state.backend.sample(logits, greedy, none, 0.0)]
    for _ in range(tokens - 1):
        out.append(state.backend.sample(decode_one_token(state, out[-1]), greedy, none, 0.0))
    info, cache = model.info, model.expert_cache()
    model.close()
    return first, out, info, cache


def assert_same_or_tied(path, prompt, tokens, base_tokens):
    """tokens equal base_tokens, or first differ where the all-GPU model's top two logits are within 0.05."""
    from engine import load_model

    if tokens == base_tokens:
        return
    first = next(i for i, (a, b) in enumerate(zip(tokens, base_tokens)) if a != b)
    model = load_model(path, device="cuda", context_length=128)
    top2 = np.sort(model.prompt_logits(prompt + base_tokens[:first])[0])[-2:]
    model.close()
    assert top2[1] - top2[0] < 0.05, f"differs at token {first}"


def test_experts_in_ram_give_the_all_gpu_model_s_tokens(tmp_path):
    """The tiny mixture loaded all on the GPU and with the experts of some or all of its layers in RAM, computed by
    the CPU (a prompt chunk on float32 rows, a decoded token on int8 activations as on the GPU): a 40-token prompt's
    logits within 1e-2 of the logit range, and 16 greedy tokens (decode through the captured graph with its host
    calls) identical, or first differing where the all-GPU model's top two logits are within 0.05. Reports what the
    load placed in RAM."""
    path = tiny_moe(tmp_path)
    prompt = np.random.default_rng(4).integers(2, 300, 40).tolist()
    base, base_tokens, _, _ = greedy_run(path, prompt, 16)
    for layers in (2, 4):
        logits, tokens, info, _ = greedy_run(path, prompt, 16, expert_layers_in_ram=layers)
        assert info.expert_layers_in_ram == layers and info.host_weight_bytes > 0
        error = float(np.abs(logits - base).max() / np.ptp(base))
        print(f"{layers} of 4 layers' experts in RAM ({info.host_weight_bytes} bytes): prompt logits differ by "
              f"{error:.2e} of the range; greedy {'identical' if tokens == base_tokens else 'differs'}")
        assert error < 1e-2
        assert_same_or_tied(path, prompt, tokens, base_tokens)


@pytest.mark.parametrize("slots", [5, 16])
def test_the_hot_expert_cache_fills_serves_and_keeps_the_tokens(tmp_path, monkeypatch, slots):
    """Experts in RAM with GPU slots for each layer's most picked (engine/expert_cache.py), refreshed every step so
    the cache fills and swaps within the run (skewed routing): 48 greedy tokens equal the all-GPU model's (or first
    differ at a near tie), the cache holds experts and served picks, and with a slot for every expert it served at
    least three quarters of the last window's picks (all but those of experts first picked then)."""
    from engine import expert_cache

    monkeypatch.setattr(expert_cache, "REFRESH_STEPS", 1)
    path = tiny_moe(tmp_path, router_skew=2.0)
    prompt = np.random.default_rng(5).integers(2, 300, 24).tolist()
    _, base_tokens, _, _ = greedy_run(path, prompt, 48)
    _, tokens, info, cache = greedy_run(path, prompt, 48, expert_layers_in_ram=4, expert_cache_slots=slots)
    print(f"{slots} slots a layer: {cache}; greedy {'identical' if tokens == base_tokens else 'differs'}")
    assert info.expert_cache_slots == slots and cache.layers == 4 and cache.device_bytes > 0
    assert cache.swaps > 0 and 0 < cache.experts_cached <= 4 * slots and 0 < cache.hits < cache.picks
    if slots == 16:  # every expert picked so far has a slot once its copy is mapped; only newcomers miss
        assert cache.recent_hit_rate >= 0.75
    assert_same_or_tied(path, prompt, tokens, base_tokens)


class InlineExecutor:
    """A stand-in for the expert cache's worker: each job runs when submitted, so a refresh finds it done."""

    def __init__(self, **_):
        pass

    def submit(self, job, *args):
        from concurrent.futures import Future

        done = Future()
        done.set_result(job(*args))
        return done

    def shutdown(self, **_):
        pass


def decode_logits(path, prompt, tokens, **load):
    """The logits of decoding `tokens` one by one after the prompt (teacher-forced, through the captured graph),
    the device idle after each step, so with InlineExecutor the cache's refreshes find every copy done and the
    cache holds the same experts at each step in every run that routes alike."""
    from engine import load_model
    from engine.generate import decode_one_token, prefill

    model = load_model(path, device="cuda", context_length=128, **load)
    state = model._state
    prefill(state, prompt)
    logits = []
    for t in tokens:
        logits.append(state.backend.to_host(decode_one_token(state, t)).reshape(-1))
        cp.cuda.Device().synchronize()
    model.close()
    return np.stack(logits)


@pytest.mark.parametrize("slots", [0, 5])
def test_experts_read_over_the_bus_match_the_cpu_s(tmp_path, monkeypatch, slots):
    """Every layer's experts in RAM, two of each token's four read by the GPU over the bus and the rest computed by
    the CPU (with slots: those the cache does not hold, refreshed every step), against the same placement with the
    CPU computing them all: 16 teacher-forced decode steps' logits, each against the all-GPU model's. The bus's
    share runs the GPU's own kernels, so its logits are no further from the all-GPU ones than the CPU's (whose
    activations round to one int8 level); a wrong read would be far off. The cache's worker runs inline, so both
    runs cache the same experts step by step (with the worker in its thread, what the cache held at a step could
    differ between the two runs, and one H100 run measured 1.6e-3 of the range for the CPU's against 8.8e-3)."""
    from engine import backend_cupy, expert_cache

    monkeypatch.setattr(expert_cache, "REFRESH_STEPS", 1)
    monkeypatch.setattr(expert_cache, "ThreadPoolExecutor", InlineExecutor)
    path = tiny_moe(tmp_path, router_skew=2.0 if slots else 0.0)
    rng = np.random.default_rng(6)
    prompt, tokens = rng.integers(2, 300, 24).tolist(), rng.integers(2, 300, 16).tolist()
    base = decode_logits(path, prompt, tokens)
    placed = dict(expert_layers_in_ram=4, expert_cache_slots=slots)
    cpu = decode_logits(path, prompt, tokens, **placed)
    monkeypatch.setattr(backend_cupy, "EXPERTS_OVER_BUS", 2)
    bus = decode_logits(path, prompt, tokens, **placed)
    cpu_error, bus_error = (float(np.abs(x - base).max() / np.ptp(base)) for x in (cpu, bus))
    print(f"{slots} slots a layer: decode logits off the all-GPU model's by {cpu_error:.2e} of the range with the "
          f"CPU computing the experts, {bus_error:.2e} with 2 a token over the bus")
    assert bus_error <= 1.5 * cpu_error + 1e-5


def test_a_failing_host_call_is_raised_where_the_stream_is_waited_for():
    """An exception inside the CPU's part of a decode step cannot reach the GPU: it is kept and raised by the
    next synchronize, and the stream goes on."""
    backend = CupyBackend()
    from engine.kernels.host_calls import HostCalls

    calls = HostCalls()

    def fail():
        raise ValueError("expert kernel failed")

    with backend.stream:
        calls.launch("fail", fail)
    backend.stream.synchronize()
    with pytest.raises(ValueError, match="expert kernel failed"):
        calls.check()
    calls.check()  # raised once
    calls.close()
    backend.close()


def test_host_calls_run_in_stream_order_in_a_graph_replayed_after_an_idle_pause():
    """Jobs run between the stream's kernels, in order, from a captured graph too, also when the graph comes after
    the host thread has stopped spinning (it then finds the call on its next idle look, or is armed)."""
    import time

    import cupy

    from engine.kernels import host_calls
    from engine.kernels.host_calls import HostCalls

    calls, seen = HostCalls(), []
    stream = cupy.cuda.Stream(non_blocking=True)
    value = cupy.zeros(1, np.float32)
    with stream:
        stream.begin_capture()
        for i in range(3):
            value += 1  # the job must see the kernels queued before it, and none after
            calls.launch(("job", i), lambda i=i: seen.append((i, float(value.get(stream=cupy.cuda.Stream.null)[0]))))
        graph = stream.end_capture()
    for replay in range(3):
        if replay == 2:
            time.sleep(2 * host_calls.SPIN_S)  # idle: the next call is found by a look, not a spin
        graph.launch(stream)
        stream.synchronize()
    calls.check()
    assert [i for i, _ in seen] == [0, 1, 2] * 3
    assert [v for _, v in seen] == [float(n) for n in range(1, 10)]
    calls.close()
