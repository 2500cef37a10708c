"""Where a GPU decode step's time goes, kernel by kernel (needs PyTorch for its CUPTI profiler); not a test.

Loads a GGUF on the GPU, runs a prompt of --prompt random tokens, then replays the captured decode graph --reps
times under torch.profiler. Prints one JSON line: the graph step's device time (events, as bench_gpu.py times it),
the step's busy span (first kernel start to last kernel end), and per step for each kernel (largest critical time
first) and in total: launches; microseconds from start to end (with programmatic launches that includes waiting
for the kernel before); critical microseconds, the part of the span it alone accounts for (past the end of every
kernel before it); and microseconds the GPU idled before it. Critical and idle times sum to the span.
--deep-phases (a step deep enough for attention_decode_deep, heads of 128, fp16 cache) runs the deep kernel's
phased copy (kernel_names.DEEP_FORMS['phases']) in the graph and adds the last layer's attention timeline of one more
step, as bench_attention.py --phases gives it for the kernel alone ("deep_phases"). --prefill profiles the prompt
instead: one prefill of --prompt tokens (after an untimed one), its kernels as above over the whole prompt, with its
wall time (host clock, to the last kernel's end). --carveout P: every kernel prefers P percent of its
multiprocessor's L1 as shared memory (CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT), so kernels of unlike
shared memory need not wait for an SM to be reconfigured before they share it. --variants V ... then captures the
decode graph again with each listed variant (bench/decode_variants.py: deep kernel tiles and splits, its sweep forms,
the deep graph at every depth) and prints a line for each: its step's device time and, per step, the deep kernel's
times and the experts' products' (critical_path), on the one loaded model.

Usage: python bench/profile_decode.py MODEL.gguf [--prompt 512] [--reps 20] [--experts-in-ram N] [--top 25]
       [--deep-phases] [--carveout P] [--prefill] [--variants default 16x2x32 bulk deep]
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import decode_variants  # noqa: E402
from bench.bench_gpu import gpu_name, graph_step_ms  # noqa: E402
from engine import load_model  # noqa: E402
from engine.generate import prefill  # noqa: E402


def kernel_times(state, reps: int) -> tuple[dict[str, list[float]], float]:
    """critical_path of the kernels of `reps` graph replays, each synchronized alone (so replays do not overlap)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    backend, position = state.backend, len(state.cached)
    state.decode_step(position)
    backend.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            state.decode_step(position)
            backend.synchronize()
    torch.cuda.synchronize()
    return critical_path([(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
                          if e.device_type.name == "CUDA"])


def prefill_times(state, prompt: list[int]) -> tuple[dict[str, list[float]], float, float]:
    """critical_path of one prefill's kernels (a first prefill, untimed, compiles and sizes everything), its span
    and its wall milliseconds."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    for _ in range(2):  # the first compiles; the second, profiled, starts from an empty cache like it
        state.cached.clear()
        state.backend.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            start = time.perf_counter()
            prefill(state, prompt)
            state.backend.synchronize()
            wall_ms = (time.perf_counter() - start) * 1e3
        torch.cuda.synchronize()
    totals, span = critical_path([(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
                                  if e.device_type.name == "CUDA"], new_replay_gap=float("inf"))
    return totals, span, wall_ms


def step_variants(state, variants: list[str], reps: int) -> list[dict]:
    """The decode step with each of `variants` (bench/decode_variants.py), captured again in turn: its device time,
    and per step the launches, microseconds and critical microseconds (critical_path) of the deep kernel and of the
    experts' products."""
    def times(totals, prefix):
        return [[round(v / reps, 2) for v in values[:3]] for name, values in totals.items() if name.startswith(prefix)]

    rows = []
    for spec in variants:
        undo = decode_variants.switch(spec, state.backend)
        try:
            state.decode_step = state.backend.compile_step(functools.partial(
                state.arch.forward, state.config, state.weights, state.workspace, state.backend, state.cache, 1))
            step_ms = graph_step_ms(state)
            totals, _ = kernel_times(state, reps)
        finally:
            undo()
        deep = times(totals, "attention_decode_deep")
        rows.append({"variant": spec, "gpu_ms_per_decode_step": step_ms,
                     "deep_launches_us_critical_us": deep[0] if deep else None,
                     "moe_gate_up_launches_us_critical_us": (times(totals, "moe_gate_up") or [None])[0],
                     "moe_down_launches_us_critical_us": (times(totals, "moe_down") or [None])[0]})
    return rows


def critical_path(kernels: list[tuple[str, float, float]], new_replay_gap: float = 50.0):
    """From kernels' (name, start us, end us): per name, [launches, microseconds from start to end, microseconds on
    the critical path, microseconds the GPU idled before it], and the median busy span of a replay (a gap of
    new_replay_gap us or more between kernels starts a new one: replays are separated by host synchronizations).
    Critical and idle times of a replay sum to its span."""
    totals: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0, 0.0])
    spans, begin, end = [], None, None
    for name, start, stop in sorted(kernels, key=lambda k: k[1]):
        if begin is None or start - end >= new_replay_gap:
            if begin is not None:
                spans.append(end - begin)
            begin = end = start
        t = totals[name]
        t[0] += 1
        t[1] += stop - start
        # With programmatic launches a kernel starts while its predecessor runs and waits for it: the time it
        # alone adds to the step is what lies past everything before it; the GPU idled for any gap before it.
        t[2] += max(0.0, stop - max(start, end))
        t[3] += max(0.0, start - end)
        end = max(end, stop)
    if begin is not None:
        spans.append(end - begin)
    return dict(totals), float(np.median(spans)) if spans else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--experts-in-ram", type=int, default=0)
    parser.add_argument("--top", type=int, default=25, help="kernels listed (the rest are summed as 'other')")
    parser.add_argument("--deep-phases", action="store_true", help="the deep attention kernel's timeline in the model")
    parser.add_argument("--carveout", type=int, help="percent of L1 every kernel prefers as shared memory")
    parser.add_argument("--prefill", action="store_true", help="profile the prompt's prefill, not a decode step")
    parser.add_argument("--variants", nargs="+",
                        help="decode steps timed in turn after (bench/decode_variants.py)")
    args = parser.parse_args()
    from engine.kernels import cuda

    if args.deep_phases:  # the backend looks the launcher up at each capture
        decode_variants.switch("phases")
    if args.carveout is not None:
        fetch = cuda.kernel

        @functools.cache
        def kernel(module_name: str, name: str):
            fn = fetch(module_name, name)
            fn.preferred_shared_memory_carveout = args.carveout
            return fn

        cuda.kernel = kernel
    model = load_model(args.model, device="cuda", context_length=args.prompt + 64,
                       expert_layers_in_ram=args.experts_in_ram)
    state = model._state
    prompt = np.random.default_rng(0).integers(2, model.info.vocab_size, args.prompt).tolist()
    phases = {}
    if args.prefill:
        totals, span_us, wall_ms = prefill_times(state, prompt)
        args.reps = 1
        phases = {"prefill_ms": round(wall_ms, 2), "prompt_tokens_per_s": round(args.prompt / wall_ms * 1e3, 1)}
        step_ms = None
    else:
        prefill(state, prompt)
        step_ms = graph_step_ms(state)
        totals, span_us = kernel_times(state, args.reps)
    if args.deep_phases:
        from bench.bench_attention import deep_record, deep_timeline

        record = deep_record()
        state.decode_step(len(state.cached))
        phases["deep_phases"] = deep_timeline(record)
    fields = ("launches", "us", "critical_us", "idle_before_us")
    per_step = sorted(([name, *(v / args.reps for v in values)] for name, values in totals.items()),
                      key=lambda row: -row[3])
    rest = per_step[args.top:]
    if rest:
        per_step = per_step[: args.top] + [["other", *(sum(row[i] for row in rest) for i in range(1, 5))]]
    listed = [{"kernel": row[0], **{f: round(v, 2) for f, v in zip(fields, row[1:])}} for row in per_step]
    total = {f: round(sum(row[i] for row in per_step), 1) for i, f in enumerate(fields, 1)}
    print(json.dumps({
        "model": model.info.name, "file": args.model.name, "gpu": gpu_name(), "depth": args.prompt,
        "experts_in_ram": args.experts_in_ram, "carveout": args.carveout, "gpu_ms_per_decode_step": step_ms, "busy_span_us": round(span_us, 1),
        "per_step": total, "kernels": listed, **phases,
    }), flush=True)
    if args.variants and not args.prefill:
        for row in step_variants(state, args.variants, args.reps):
            print(json.dumps({"model": model.info.name, "file": args.model.name, "gpu": gpu_name(), "depth": args.prompt,
                              **row}), flush=True)
    model.close()


if __name__ == "__main__":
    main()
