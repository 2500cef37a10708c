"""Prompt and output speed of a GGUF model on the engine (an H200 is what it was written for); not a test.

Prints one JSON line per model: model, tensor types, GPU, prompt length, context, prompt tokens/s, output
tokens/s (the best of --repeats runs, the median beside it), the bandwidth floor of a decode step (bytes of
weights read per token over the memory bandwidth measured here: a 1 GiB device-to-device copy on the GPU, 4.3 TB/s
on an H200; the host's read bandwidth for the CPU backend) and the fraction of it reached. The prompt is random token ids (speed does
not depend on them); the output is greedy, made the way a chat makes it (generate.sampled_tokens: picked on the
GPU, each step queued before the id it feeds comes back to the host), for a fixed number of tokens.

The output is measured at the prompt's depth: --prompt 8192 times a prompt of 8,192 tokens, then output from
position 8,192 on. --attention chunk sends prompt chunks through attention.cu's older chunk path instead of flash
attention (the before of a comparison); --decode-attention forces decode attention's kernel; --variant captures the
decode graphs with a variant of bench/decode_variants.py (a sweep's deep kernel tiles or forms). --experts-in-ram N
keeps the routed experts of the first N MoE layers in RAM (the CPU computes them, but for --experts-over-bus of a
token's experts a layer, which the GPU reads over the bus); the line then adds the bytes of
those experts a token reads, this machine's host read bandwidth (measured here) and the fraction of that floor
reached, and the GPU memory in use (total minus free, as NVML counts it) and the process's resident RAM.

Usage: python bench/bench_gpu.py MODEL.gguf [MODEL.gguf ...] [--prompt 512] [--output 128] [--device cuda]
       [--repeats 5] [--attention flash|chunk] [--decode-attention auto|cluster|split|deep] [--experts-in-ram N]
       [--expert-cache-slots N] [--experts-over-bus N] [--kv-cache full|q8_0] [--variant SPEC]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import decode_variants  # noqa: E402
from engine import GenerationSettings, load_model  # noqa: E402
from engine.cpu.weights import CpuWeight  # noqa: E402
from engine.generate import prefill, sampled_tokens  # noqa: E402
from engine.sampler import Sampler  # noqa: E402

GREEDY = GenerationSettings(temperature=0.0).sampling()


def bytes_per_token(weights, top_k: int | None = None) -> tuple[int, int]:
    """Weight bytes one decode step reads: every weight of every layer and the output head (one embedding row
    aside); of stacked experts (3-D) only the top_k slabs a token uses. Returns (on the GPU, in RAM: the experts the
    CPU computes, in its layout)."""
    gpu, host = weights.output.nbytes, 0
    for layer in weights.layers:
        for handle in _handles(layer):
            read = handle.nbytes * top_k // handle.shape[0] if len(handle.shape) == 3 else handle.nbytes
            if isinstance(handle, CpuWeight):
                host += read
            else:
                gpu += read
    return gpu, host


def _handles(part):
    """The weight handles in a layer's dataclasses (any part kind), each once."""
    seen = set()

    def walk(x):
        if hasattr(x, "qtype") and hasattr(x, "nbytes"):
            if id(x) not in seen:
                seen.add(id(x))
                yield x
        elif isinstance(x, (list, tuple)):
            for item in x:
                yield from walk(item)
        elif dataclasses.is_dataclass(x) and not isinstance(x, type):
            for field in dataclasses.fields(x):
                yield from walk(getattr(x, field.name))

    return list(walk(part))


def rss_parts() -> dict[str, int]:
    """The resident set by kind (Linux): anonymous memory, mapped files, shared memory (pinned buffers may show here)."""
    status = Path("/proc/self/status")
    if not status.is_file():
        return {}
    fields = dict(line.split(":", 1) for line in status.read_text().splitlines() if ":" in line)
    return {f"process_{key.lower()}_bytes": int(fields[key].split()[0]) * 1024
            for key in ("RssAnon", "RssFile", "RssShmem") if key in fields}


def gpu_copy_bytes_per_s(reps: int = 5) -> float:
    """This GPU's memory bandwidth: bytes read and written a second by a 1 GiB device-to-device copy, the best of
    `reps` (4.3e12 on an H200, shared/reference/engine-anchors.md)."""
    import cupy

    a = cupy.empty(2**30, cupy.uint8)
    b = cupy.empty_like(a)
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    best = float("inf")
    for _ in range(reps + 1):  # the first copy warms up
        start.record()
        cupy.copyto(b, a)
        end.record()
        end.synchronize()
        best = min(best, cupy.cuda.get_elapsed_time(start, end) / 1e3)
    nbytes = a.nbytes
    del a, b
    cupy.get_default_memory_pool().free_all_blocks()  # or the GPU memory measured next counts the 2 GiB
    return 2 * nbytes / best


def host_read_bytes_per_s(gib: int = 2, reps: int = 5) -> float:
    """This machine's RAM read bandwidth: a parallel sum over `gib` GiB on every core, the best of `reps`."""
    import numba

    @numba.njit(parallel=True, cache=False)
    def total(a):
        s = 0
        for i in numba.prange(a.shape[0]):
            s += a[i]
        return s

    data = np.ones(gib * 2**30 // 8, np.uint64)
    numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
    total(data)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        total(data)
        best = min(best, time.perf_counter() - t)
    return data.nbytes / best


def graph_step_ms(state, reps: int = 50) -> float:
    """Device time of one decode step alone: the captured graph replayed back to back, timed with events (the
    rest of a token's time is the host's: feeding the token, sampling, reading the id back)."""
    import cupy

    stream, position = state.backend.stream, len(state.cached)
    state.decode_step(position)
    begin, end = cupy.cuda.Event(), cupy.cuda.Event()
    begin.record(stream)
    for _ in range(reps):
        state.decode_step(position)
    end.record(stream)
    end.synchronize()
    return round(cupy.cuda.get_elapsed_time(begin, end) / reps, 4)


def decode_breakdown_us(state, reps: int = 20) -> dict[str, float]:
    """Device time of each op of one decode step (layer 0, one token at the current position), each op captured
    `reps` times into its own graph and replayed."""
    from engine.backend import ROPE_NORMAL

    backend, ws, c, w, cache = state.backend, state.workspace, state.config, state.weights, state.cache
    layer, chunk = w.layers[0], ws.chunk(1)
    attn, ffn, a, f = layer.mixer, layer.ffn, chunk.parts["attention"], chunk.parts["dense"]
    x, h, delta = chunk.x, chunk.h, chunk.delta
    ops = {
        "embed": lambda: backend.embed(w.token_embd, chunk.tokens, x),
        "add_rms_norm+q8": lambda: backend.add_rms_norm(delta, x, layer.mixer_norm, c.rms_eps, h),
        "qkv": lambda: attn.qkv.run(backend, h, a.qkv),
        "rope+attention+q8": lambda: backend.rope_attention(a.q, a.k, a.v, attn.rope, ROPE_NORMAL, cache, 0, ws.start, a.out, 0.1),
        "attn_out": lambda: backend.linear(a.out, attn.out, delta),
        "gate_up+q8": lambda: backend.gated_ffn(h, ffn.gate, ffn.up, f.act, f.scratch),
        "down": lambda: backend.linear(f.act, ffn.down, delta),
        "head": lambda: backend.linear(h, w.output, ws.logits),
    }
    return {name: _replay_us(backend, op, reps) for name, op in ops.items()}


def moe_breakdown_us(state, reps: int = 20) -> dict[str, float]:
    """Like decode_breakdown_us for the mixture-of-experts half of a qwen3moe layer (layer 0): the norm in front,
    router product with the routing, and the chosen experts' FFN (gate/up, int8 quantization of the hidden vector, down)."""
    backend, c, layer, chunk = state.backend, state.config, state.weights.layers[0], state.workspace.chunk(1)
    ffn, e, b, h = layer.ffn, c.experts, chunk.parts["moe"], chunk.h
    ops = {
        "add_rms_norm+q8": lambda: backend.add_rms_norm(chunk.delta, chunk.x, layer.ffn_norm, c.rms_eps, h),
        "router+route": lambda: backend.route_experts(h, ffn.router, e.count, e.top_k, e.normalize_weights,
                                                      b.router_logits, b.weights, b.ids),
        "experts": lambda: backend.moe_ffn(h, ffn.gate_exps, ffn.up_exps, ffn.down_exps, b.ids, b.weights, chunk.delta,
                                           b.scratch),
    }
    return {name: _replay_us(backend, op, reps) for name, op in ops.items()}


def _replay_us(backend, op, reps: int) -> float:
    """Microseconds per call of op, captured `reps` times into one graph and replayed once (after a warm-up)."""
    import cupy

    with backend.stream:
        op()
        backend.stream.begin_capture()
        for _ in range(reps):
            op()
        graph = backend.stream.end_capture()
        graph.launch(backend.stream)
        begin, end = cupy.cuda.Event(), cupy.cuda.Event()
        begin.record(backend.stream)
        graph.launch(backend.stream)
        end.record(backend.stream)
        end.synchronize()
    return round(cupy.cuda.get_elapsed_time(begin, end) * 1e3 / reps, 2)


def gpu_name() -> str:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    except Exception:  # noqa: BLE001 - a CPU-only machine has no GPU name to report
        return "none"


def run(path: Path, prompt_len: int, output_len: int, device: str, repeats: int, experts_in_ram: int = 0,
        expert_cache_slots: int = 0, kv_cache: str = "full", prompt_chunk: int | None = None) -> dict:
    model = load_model(path, device=device, context_length=prompt_len + output_len + 8,
                       expert_layers_in_ram=experts_in_ram, expert_cache_slots=expert_cache_slots,
                       kv_cache_type=kv_cache, prompt_chunk=prompt_chunk)
    state = model._state
    backend = state.backend
    rng = np.random.default_rng(0)
    prompt = rng.integers(2, model.info.vocab_size, prompt_len).tolist()

    def timed_prefill() -> tuple[float, object]:
        state.cached.clear()
        backend.synchronize()
        t = time.perf_counter()
        logits, _ = prefill(state, prompt)
        backend.synchronize()
        return time.perf_counter() - t, logits

    def timed_decode(first_logits) -> float:
        """Seconds for output_len decode steps, made as a chat makes them (generate.sampled_tokens); the pick from
        the prompt's logits is timed too."""
        t = time.perf_counter()
        for _ in sampled_tokens(state, Sampler(backend, GREEDY), first_logits, output_len + 1):
            pass
        return time.perf_counter() - t

    timed_decode(timed_prefill()[1])  # warm-up: kernel compilation, cuBLAS, graph capture
    runs = []
    for _ in range(repeats):
        seconds, logits = timed_prefill()
        runs.append((seconds, timed_decode(logits)))
    # Best of the repeats (host jitter only ever adds time), with the median next to it.
    prompt_s, output_s = min(r[0] for r in runs), min(r[1] for r in runs)
    median_output_s = float(np.median([r[1] for r in runs]))
    step_ms = graph_step_ms(state) if backend.name == "cupy" else None
    # The same step captured with ordinary launches (no programmatic dependent launch), for comparison.
    plain_ms = None
    if backend.name == "cupy":
        forward = functools.partial(state.arch.forward, state.config, state.weights, state.workspace, backend, state.cache, 1)
        plain_ms = round(_replay_us(backend, forward, 10) / 1e3, 4)
    # Per-op breakdowns exist for Llama's layer and the experts' half of a qwen3moe layer.
    breakdowns = {"llama": decode_breakdown_us, "qwen3moe": moe_breakdown_us}
    breakdown = breakdowns.get(model.info.architecture) if backend.name == "cupy" else None
    breakdown = breakdown(state) if breakdown is not None else None
    gpu_bytes, host_bytes = bytes_per_token(state.weights, state.config.experts and state.config.experts.top_k)
    per_token = gpu_bytes + host_bytes
    output_tps = output_len / output_s
    bandwidth = gpu_copy_bytes_per_s() if backend.name == "cupy" else host_read_bytes_per_s()
    floor_tps = bandwidth / per_token
    placement = {}
    if host_bytes and backend.name == "cupy":  # on the CPU backend every weight is a CpuWeight
        import cupy
        import psutil

        free, total = cupy.cuda.runtime.memGetInfo()
        host_bw = host_read_bytes_per_s()
        # A token's floor: its GPU bytes at the GPU's bandwidth, then its RAM experts at the host's.
        split_floor = 1 / (gpu_bytes / bandwidth + host_bytes / host_bw)
        placement = {
            "expert_layers_in_ram": model.info.expert_layers_in_ram,
            # The cache as the last timed run left it (it fills and adapts over the warm-up and the runs).
            "expert_cache": dataclasses.asdict(model.expert_cache()),
            "experts_over_bus": backend.experts_over_bus,
            "host_expert_bytes_per_token": host_bytes,
            "host_read_gb_per_s": round(host_bw / 1e9, 1),
            "split_floor_output_tokens_per_s": round(split_floor, 1),
            "fraction_of_split_floor": round(output_tps / split_floor, 3),
            "gpu_memory_used_bytes": int(total - free),
            "host_weight_bytes": model.info.host_weight_bytes,
            "process_rss_bytes": psutil.Process().memory_info().rss,
            **rss_parts(),
        }
    result = {
        "model": model.info.name,
        "file": path.name,
        "tensor_types": model.info.tensor_types,
        "gpu": gpu_name() if backend.name == "cupy" else "cpu",
        "backend": backend.name,
        "prompt_tokens": prompt_len,
        "output_tokens": output_len,
        "context": model.info.context_length,
        "prompt_chunk": state.workspace.max_chunk,
        "kv_cache": kv_cache,
        "kv_cache_bytes": model.info.kv_cache_bytes,
        "prompt_tokens_per_s": round(prompt_len / prompt_s, 1),
        "output_tokens_per_s": round(output_tps, 1),
        "output_tokens_per_s_median": round(output_len / median_output_s, 1),
        "repeats": repeats,
        "architecture": model.info.architecture,
        "bytes_per_token": per_token,
        "floor_bandwidth_gb_per_s": round(bandwidth / 1e9, 1),
        "floor_output_tokens_per_s": round(floor_tps, 1),
        "fraction_of_floor": round(output_tps / floor_tps, 3),
        "gpu_ms_per_decode_step": step_ms,
        "gpu_ms_per_decode_step_without_pdl": plain_ms,
        # Output time per token beyond the graph step: the pick, and host time the pipeline does not hide.
        "ms_per_token_beyond_step": round(output_s / output_len * 1e3 - step_ms, 3) if step_ms is not None else None,
        "decode_op_us_layer0": breakdown,
        **placement,
    }
    model.close()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+", type=Path)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--output", type=int, default=128)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--repeats", type=int, default=5, help="timed prompt + output runs; the best is reported")
    parser.add_argument("--attention", choices=("flash", "chunk"), default="flash",
                        help="prompt-chunk attention on a GPU: flash attention, or attention.cu's older chunk path")
    parser.add_argument("--decode-attention", choices=("auto", "cluster", "split", "deep"), default="auto",
                        help="decode attention's kernel on a GPU (cuda.decode_attention_form picks by default)")
    parser.add_argument("--experts-in-ram", type=int, default=0,
                        help="MoE layers whose routed experts stay in RAM, computed by the CPU (the first N)")
    parser.add_argument("--expert-cache-slots", type=int, default=0,
                        help="GPU slots for the most used experts of each layer kept in RAM (engine/expert_cache.py)")
    parser.add_argument("--experts-over-bus", type=int,
                        help="of a token's experts in a RAM layer, how many the GPU reads over the bus (default: the "
                             "backend's EXPERTS_OVER_BUS)")
    parser.add_argument("--kv-cache", choices=("full", "q8_0"), default="full", help="the KV cache's element type")
    parser.add_argument("--prompt-chunk", type=int, help="the most prompt tokens run at once (default: the engine's)")
    parser.add_argument("--variant", default="default",
                        help="a GPU decode-step variant of bench/decode_variants.py (sweeps: deep tiles, forms)")
    args = parser.parse_args()
    if args.device == "cuda":
        from engine import backend_cupy
        from engine.kernels import cuda

        if args.experts_over_bus is not None:
            backend_cupy.EXPERTS_OVER_BUS = args.experts_over_bus

        if args.attention == "chunk":
            cuda.flash_attention_capable = lambda n_heads, n_kv: False
        if args.decode_attention != "auto":
            cuda.decode_attention_form = lambda n_heads, n_kv, max_tokens, deep, kv="full": args.decode_attention
        decode_variants.switch(args.variant)
    for path in args.models:
        result = run(path, args.prompt, args.output, args.device, args.repeats, args.experts_in_ram,
                     args.expert_cache_slots, args.kv_cache, args.prompt_chunk)
        print(json.dumps({**result, "prompt_attention": args.attention, "decode_attention": args.decode_attention,
                          "variant": args.variant}), flush=True)


if __name__ == "__main__":
    main()
