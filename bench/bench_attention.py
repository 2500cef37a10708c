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
tiles only).

Usage: python bench/bench_attention.py [--heads 32] [--kv-heads 8] [--head-dim 128] [--chunk 512]
       [--depths 0,7680,32256] [--kv-cache full|q8_0]
"""

from __future__ import annotations

import argparse
import functools
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
    args = parser.parse_args()
    h, kv, hd, n = args.heads, args.kv_heads, args.head_dim, args.chunk
    depths = [int(d) for d in args.depths.split(",")]
    max_tokens = max(depths) + n
    rng = np.random.default_rng(0)
    if args.kv_cache == "q8_0":
        kc, vc = (cupy.asarray(rng.integers(-127, 128, (kv, max_tokens, hd), np.int8)) for _ in range(2))
        scales = tuple(cupy.asarray(rng.uniform(0.005, 0.03, (kv, max_tokens, hd // 32)).astype(np.float16))
                       for _ in range(2))
        row_bytes = hd + hd // 16
    else:
        kc, vc = (cupy.asarray(rng.standard_normal((kv, max_tokens, hd)).astype(np.float16)) for _ in range(2))
        scales, row_bytes = None, 2 * hd
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
    done = K.counters(kv)
    decode, extra = {}, {}
    if K.cluster_decode_attention():
        decode["attention_decode"] = functools.partial(K.attention_decode, q1, k1, v1, cos, sin, True, kc, vc, start,
                                                       out1, scale, 0, q8, scales)
    for splits in sorted({K.decode_splits(max_tokens, kv), 16, 32, 64}):
        part_s = cupy.empty(h * splits * (hd + 2), cupy.float32)
        decode[f"attention_decode_split/{splits}"] = functools.partial(
            K.attention_decode_split, q1, k1, v1, cos, sin, True, kc, vc, start, out1, scale, 0, part_s, done, q8, splits,
            scales=scales)
    if K.mma_capable():
        sweep = N.DEEP_SWEEP.get(hd, ()) if scales is None else ()
        for tiles in (N.DEEP_TILES[hd], *sweep):
            default = K.deep_decode_splits(max_tokens, kv, hd, tiles, args.kv_cache)
            # The default tiles also at fewer splits: fewer partial results for the last block to merge.
            for splits in sorted({default, *(s for s in (8, 16) if s < default and tiles == N.DEEP_TILES[hd])}):
                part_d = cupy.empty(h * splits * (hd + 2), cupy.float32)
                decode[f"attention_decode_deep/kt{tiles[0]}_s{tiles[1]}/{splits}"] = functools.partial(
                    K.attention_decode_deep, q1, k1, v1, cos, sin, True, kc, vc, start, out1, scale, 0, part_d, done,
                    q8, splits, tiles, scales)
                fn = K.kernel("attention", N.deep_decode(hd, tiles, args.kv_cache))
                extra[next(reversed(decode))] = {"regs": fn.attributes["num_regs"],
                                                 "local_bytes": fn.attributes["local_size_bytes"]}
    for depth in sorted(d for d in set(depths + [511, 1023, 2047, 4095, 6143, 8191, max_tokens - 1]) if d < max_tokens):
        start.fill(depth)
        kv_bytes = 2 * kv * (depth + 1) * row_bytes
        reference = None
        for name, launch in decode.items():
            launch()
            got = out1.get()
            reference = got if reference is None else reference
            diff = {"max_diff": float(np.abs(got - reference).max())}
            us = graph_us(launch, args.reps * 5)
            print(json.dumps({**shape, "kernel": name, "depth": depth, "us": round(us, 2),
                              "kv_tb_per_s": round(kv_bytes / us / 1e6, 3), **diff, **extra.get(name, {})}),
                  flush=True)


if __name__ == "__main__":
    main()
