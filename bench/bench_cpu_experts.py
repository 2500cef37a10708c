"""Speed of one mixture-of-experts layer on the CPU (engine/cpu/experts.py), the work the GPU backend hands to the
CPU for experts kept in RAM: one token (three parallel range products) and a prompt chunk (one pass per expert,
dequantized tiles and BLAS, the experts over a thread pool). Random Q4_K gate/up and Q6_K down experts of
Qwen3-30B-A3B's shape by default; layers are cycled so the weights come from RAM, not the cache. One JSON line per
(case, threads): the median and best microseconds, and for one token the GB/s of the chosen experts' planes.

    python bench/bench_cpu_experts.py [--experts 128] [--width 768] [--hidden 2048] [--layers 4] [--chunk 512]
                                      [--threads 1,2] [--repeats 20]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as T

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_cpu_products import random_blocks  # noqa: E402
from engine.cpu import experts  # noqa: E402
from engine.cpu.weights import load  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    e, f, d, k = args.experts, args.width, args.hidden, args.top_k

    def stacked(qtype: T, rows: int, cols: int):
        return load("w", random_blocks(qtype, e * rows, cols, rng), qtype, (e, rows, cols))

    layers = [(stacked(T.Q4_K, f, d), stacked(T.Q4_K, f, d), stacked(T.Q6_K, d, f)) for _ in range(args.layers)]
    chosen_bytes = sum(w.nbytes for w in layers[0]) * k // e

    def routes(n: int) -> np.ndarray:
        return np.stack([rng.choice(e, k, replace=False) for _ in range(n)]).astype(np.int32)

    for n, repeats in ((1, args.repeats), (args.chunk, max(2, args.repeats // 10))):
        x = rng.standard_normal((n, d)).astype(np.float32)
        mix = np.full((n, k), 1 / k, np.float32)
        out = np.empty((n, d), np.float32)
        for threads in (int(t) for t in args.threads.split(",")):
            ids = [routes(n) for _ in range(repeats + 1)]
            experts.moe_ffn(x, *layers[0], ids[0], mix, out, "silu", threads)  # compile, wake the pools
            times = []
            for i in range(repeats):
                t = time.perf_counter()
                experts.moe_ffn(x, *layers[i % args.layers], ids[i + 1], mix, out, "silu", threads)
                times.append(time.perf_counter() - t)
            best, median = min(times), float(np.median(times))
            line = {"case": "one token" if n == 1 else f"chunk of {n}", "threads": threads, "cpu_count": os.cpu_count(),
                    "experts": e, "top_k": k, "width": f, "hidden": d, "us_median": round(median * 1e6, 1),
                    "us_best": round(best * 1e6, 1)}
            if n == 1:
                line["chosen_gb_per_s_median"] = round(chosen_bytes / median / 1e9, 2)
            else:
                line["tokens_per_s_median"] = round(n / median, 1)
            print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
