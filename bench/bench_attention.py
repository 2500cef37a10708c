"""Attention kernels alone on the GPU, at the depths long prompts and long conversations reach; not a test.

Prints one JSON line per (kernel, depth): a prompt chunk's attention over a cache already holding `depth`
positions, by flash attention (engine/kernels/flash_attention.cu) and by attention.cu's chunk path, in
microseconds and TFLOP/s (2 products of 2 flops per query, key and head dim), timed with CUDA events over launches
queued back to back after a warm-up; and one decode step's attention (rotary, cache write and output quantization
included) by attention_decode, attention_decode_split at several split counts and attention_decode_deep with each
of its tile shapes (kernel_names.DEEP_TILES and DEEP_SWEEP; the default tiles also at 8 and 16 splits; its registers and spilled bytes as `regs` and
`local_bytes`), in microseconds and the TB/s of the keys and values it reads, timed as a replayed graph (graph_us),
with each kernel's largest output difference to the first kernel's (attention_decode on sm_90) as `max_diff`.
--kv-cache q8_0 times the kernels' q8_0 forms on a cache of random quants and scales (deep decode: its default
tiles only). --layers N gives the decode kernels N caches, one launch after another each reading the next, as a
model's layers do: with N caches larger than L2 every launch reads its keys from memory, not from L2. --phases
(head size 128) adds, per depth, the timeline of the deep kernel's blocks (kernel_names.DEEP_FORMS['phases']) in
the last launch of a replayed graph: for each phase (0 entry, 1 after grid_dependency_sync, 2 queries loaded, 3 keys
done, 4 own token and the warps' merge, 5 partial result stored, 6 done, the KV head's last block having merged the
splits), microseconds from the first block's entry by the global timer (median and latest block), and each phase's
own duration by the SM clock (median and longest).

Usage: python bench/bench_attention.py [--heads 32] [--kv-heads 8] [--head-dim 128] [--chunk 512]
       [--depths 0,7680,32256] [--kv-cache full|q8_0] [--layers 1] [--phases]
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import sys
from pathlib import Path

import cupy
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bench_gpu import gpu_name  # noqa: E402
from engine.kernels import cuda as K  # noqa: E402
from engine.kernels import kernel_names as N  # noqa: E402


def timed_us(launch, reps: int) -> float:
    launch()
    begin, end = cupy.cuda.Event(), cupy.cuda.Event()
    begin.record()
    for _ in range(reps):
        launch()
    end.record()
    end.synchronize()
    return cupy.cuda.get_elapsed_time(begin, end) * 1e3 / reps


def graph_us(launch, reps: int) -> float:
    """Microseconds a launch, `reps` of them captured into one graph as a decode step captures its kernels
    (programmatic launches) and replayed after a warm-up."""
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        launch()
        stream.begin_capture()
        with K.programmatic_launches():
            for _ in range(reps):
                launch()
        graph = stream.end_capture()
        graph.launch(stream)
        begin, end = cupy.cuda.Event(), cupy.cuda.Event()
        begin.record(stream)
        graph.launch(stream)
        end.record(stream)
        end.synchronize()
    return cupy.cuda.get_elapsed_time(begin, end) * 1e3 / reps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--depths", default="0,7680,32256")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--kv-cache", choices=("full", "q8_0"), default="full")
    parser.add_argument("--layers", type=int, default=1, help="caches the decode launches take in turn")
    parser.add_argument("--phases", action="store_true", help="the deep kernel's timeline (head size 128)")
    args = parser.parse_args()
    h, kv, hd, n = args.heads, args.kv_heads, args.head_dim, args.chunk
    depths = [int(d) for d in args.depths.split(",")]
    max_tokens = max(depths) + n
    rng = np.random.default_rng(0)

    def cache() -> tuple:  # (keys, values, scales or None)
        if args.kv_cache == "q8_0":
            kc, vc = (cupy.asarray(rng.integers(-127, 128, (kv, max_tokens, hd), np.int8)) for _ in range(2))
            return kc, vc, tuple(cupy.asarray(rng.uniform(0.005, 0.03, (kv, max_tokens, hd // 32)).astype(np.float16))
                                 for _ in range(2))
        return (*(cupy.asarray(rng.standard_normal((kv, max_tokens, hd)).astype(np.float16)) for _ in range(2)), None)

    caches = [cache() for _ in range(args.layers)]
    kc, vc, scales = caches[0]
    row_bytes = hd + hd // 16 if args.kv_cache == "q8_0" else 2 * hd
    q = cupy.asarray(rng.standard_normal((n, h, hd)).astype(np.float32))
    out = cupy.empty((n, h * hd), cupy.float32)
    part = cupy.empty(n * h * (hd + 2), cupy.float32)
    start = cupy.zeros(1, cupy.int32)
    scale = 1.0 / np.sqrt(hd)
    shape = {"gpu": gpu_name(), "heads": h, "kv_heads": kv, "head_dim": hd, "kv_cache": args.kv_cache}
    for depth in depths:
        start.fill(depth)
        keys = n * depth + n * (n + 1) // 2  # (query, key) pairs the causal mask keeps
        flops = 4.0 * keys * hd * h
        kernels = {
            "flash_attention": lambda: K.flash_attention(q, kc, vc, start, out, scale, 0, scales),
            "attention_partial+combine": lambda: K.attention(q, kc, vc, start, out, scale, 0, part, scales=scales),
        }
        for name, launch in kernels.items():
            us = timed_us(launch, args.reps)
            print(json.dumps({**shape, "kernel": name, "chunk": n, "depth": depth, "us": round(us, 1),
                              "tflops": round(flops / us / 1e6, 1)}), flush=True)
    qkv = cupy.asarray(rng.standard_normal((1, (h + 2 * kv) * hd)).astype(np.float32))
    q1 = qkv[:, : h * hd].reshape(1, h, hd)
    k1 = qkv[:, h * hd : (h + kv) * hd].reshape(1, kv, hd)
    v1 = qkv[:, (h + kv) * hd :].reshape(1, kv, hd)
    angles = np.outer(np.arange(max_tokens), 1e4 ** (-np.arange(hd // 2) / (hd // 2)))
    cos, sin = cupy.asarray(np.cos(angles).astype(np.float32)), cupy.asarray(np.sin(angles).astype(np.float32))
    out1 = cupy.empty((1, h * hd), cupy.float32)
    q8 = K.Q8.empty(h * hd)
    done = K.counters(2 * kv)  # attention_decode_split's and attention_decode_deep's
    decode, extra = {}, {}  # name -> its launch on each cache

    def per_cache(fn, *before, after=(), **kwargs) -> list:
        return [functools.partial(fn, *before, kc_, vc_, start, out1, scale, 0, *after, scales=sc_, **kwargs)
                for kc_, vc_, sc_ in caches]

    if K.cluster_decode_attention():
        decode["attention_decode"] = [functools.partial(K.attention_decode, q1, k1, v1, cos, sin, True, kc_, vc_,
                                                        start, out1, scale, 0, q8, sc_) for kc_, vc_, sc_ in caches]
    for splits in sorted({K.decode_splits(max_tokens, kv), 16, 32, 64}):
        part_s = cupy.empty(h * splits * (hd + 2), cupy.float32)
        decode[f"attention_decode_split/{splits}"] = per_cache(K.attention_decode_split, q1, k1, v1, cos, sin, True,
                                                               after=(part_s, done, q8, splits))
    deep_parts = {}
    if K.mma_capable():
        sweep = N.DEEP_SWEEP.get(hd, ()) if scales is None else ()
        for tiles in (N.DEEP_TILES[hd], *sweep):
            default = K.deep_decode_splits(max_tokens, kv, hd, tiles, args.kv_cache)
            # The default tiles also at other split counts (within one wave): fewer partial results to merge, or
            # more blocks reading keys.
            one_wave = K.deep_decode_wave(hd, tiles, args.kv_cache) // kv
            others = (8, 16, 24, 32) if tiles == N.DEEP_TILES[hd] else ()
            for splits in sorted({default, *(s for s in others if s <= one_wave)}):
                part_d = deep_parts.setdefault(splits, cupy.empty(h * splits * (hd + 2), cupy.float32))
                name = f"attention_decode_deep/kt{tiles[0]}_s{tiles[1]}/{splits}"
                decode[name] = per_cache(K.attention_decode_deep, q1, k1, v1, cos, sin, True,
                                         after=(part_d, done, q8, splits, tiles))
                fn = K.kernel("attention", N.deep_decode(hd, tiles, args.kv_cache))
                extra[name] = {"regs": fn.attributes["num_regs"], "local_bytes": fn.attributes["local_size_bytes"]}
    phased = None
    if args.phases and K.mma_capable() and hd == 128 and scales is None:
        splits = K.deep_decode_splits(max_tokens, kv, hd)
        phased = per_cache(K.attention_decode_deep, q1, k1, v1, cos, sin, True,
                           after=(deep_parts[splits], done, q8, splits), form="phases")
    for depth in sorted(d for d in set(depths + [511, 1023, 2047, 4095, 6143, 8191, max_tokens - 1]) if d < max_tokens):
        start.fill(depth)
        kv_bytes = 2 * kv * (depth + 1) * row_bytes
        reference = None
        for name, launches in decode.items():
            launches[0]()
            got = out1.get()
            reference = got if reference is None else reference
            diff = {"max_diff": float(np.abs(got - reference).max())}
            us = graph_us(cycling(launches), args.reps * 5)
            print(json.dumps({**shape, "kernel": name, "depth": depth, "layers": args.layers, "us": round(us, 2),
                              "kv_tb_per_s": round(kv_bytes / us / 1e6, 3), **diff, **extra.get(name, {})}),
                  flush=True)
        if phased:
            print(json.dumps({**shape, "kernel": N.DEEP_FORMS["phases"], "depth": depth, "layers": args.layers,
                              **timeline(phased, args.reps)}), flush=True)


def cycling(launches: list):
    """One launch a call, each on the next cache."""
    turn = itertools.cycle(launches)
    return lambda: next(turn)()


def deep_record():
    """The phased deep kernel's record (kernel_names.DEEP_FORMS['phases'], attention.cu deep_phases), zeroed before any
    stream's next launch: per block (a KV head's MAX_SPLITS rows, 16 KV heads), the global timer then the SM clock
    at each of its 8 phases."""
    record = cupy.ndarray((K.MAX_SPLITS * 16, 2, 8), cupy.uint64,
                          K.module("attention", sweep=True).get_global("deep_phases"))
    record.fill(0)
    cupy.cuda.Device().synchronize()
    return record


def deep_timeline(record) -> dict:
    """The timeline of the blocks of the last phased launch that wrote `record` (zeroed before it: blocks past the
    active splits record nothing)."""
    cupy.cuda.Device().synchronize()
    raw = record.get().astype(np.int64)
    ns, clocks = raw[:, 0], raw[:, 1]
    ran = ns[:, 6] > 0
    ns, clocks = ns[ran], clocks[ran]
    khz = cupy.cuda.Device().attributes["ClockRate"]
    since = (ns[:, :7] - ns[:, 0].min()) / 1e3
    own = np.diff(clocks[:, :7], axis=1) / khz * 1e3  # us
    return {"blocks": int(ran.sum()),
            "since_entry_us_median": [round(float(x), 2) for x in np.median(since, axis=0)],
            "since_entry_us_latest": [round(float(x), 2) for x in since.max(axis=0)],
            "phase_us_median": [round(float(x), 2) for x in np.median(own, axis=0)],
            "phase_us_longest": [round(float(x), 2) for x in own.max(axis=0)]}


def timeline(launches: list, reps: int) -> dict:
    """The phased deep kernel's blocks in the last launch of a replayed graph (bench_attention's --phases)."""
    record = deep_record()
    graph_us(cycling(launches), reps)
    return deep_timeline(record)


if __name__ == "__main__":
    main()
