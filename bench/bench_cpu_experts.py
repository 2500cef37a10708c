"""Speed of one mixture-of-experts layer on the CPU (engine/cpu/experts.py), the work the GPU backend hands to the
CPU for experts kept in RAM: one token (three parallel range products) and a prompt chunk (one pass per expert,
dequantized tiles and BLAS, the experts over a thread pool). Random Q4_K gate/up and Q6_K down experts of
Qwen3-30B-A3B's shape by default; layers are cycled so the weights come from RAM, not the cache. One JSON line per
(case, threads): the median and best microseconds, and for one token the GB/s of the chosen experts' planes and
the median microseconds of its parts (the activation's quantization, the gate/up pass, the down pass, the rest), for
each of --bits (the activations' rounding: 16, or 8 as for the experts the GPU backend keeps in RAM). --chunk 0
leaves the chunk out.

    python bench/bench_cpu_experts.py [--experts 128] [--width 768] [--hidden 2048] [--layers 4] [--chunk 512]
                                      [--threads 1,2] [--repeats 20] [--bits 16,8]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numba
import numpy as np
from gguf import GGMLQuantizationType as T

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_cpu_products import random_blocks  # noqa: E402
from engine.cpu import experts, products  # noqa: E402
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
    parser.add_argument("--bits", default="16", help="the one-token activations' bits, e.g. 16,8")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    e, f, d, k = args.experts, args.width, args.hidden, args.top_k

    def stacked(qtype: T, rows: int, cols: int):
        return load("w", random_blocks(qtype, e * rows, cols, rng), qtype, (e, rows, cols))

    layers = [(stacked(T.Q4_K, f, d), stacked(T.Q4_K, f, d), stacked(T.Q6_K, d, f)) for _ in range(args.layers)]
    chosen_bytes = sum(w.nbytes for w in layers[0]) * k // e

    def routes(n: int) -> np.ndarray:
        return np.stack([rng.choice(e, k, replace=False) for _ in range(n)]).astype(np.int32)

    cases = ((1, args.repeats), (args.chunk, max(2, args.repeats // 10)))
    for n, repeats in cases if args.chunk else cases[:1]:
        x = rng.standard_normal((n, d)).astype(np.float32)
        mix = np.full((n, k), 1 / k, np.float32)
        out = np.empty((n, d), np.float32)
        variants = [(int(t), int(b)) for t in args.threads.split(",") for b in (args.bits.split(",") if n == 1 else "16")]
        for threads, bits in variants:
            ids = [routes(n) for _ in range(repeats + 1)]
            experts.moe_ffn(x, *layers[0], ids[0], mix, out, "silu", threads, bits)  # compile, wake the pools
            times = []
            for i in range(repeats):
                t = time.perf_counter()
                experts.moe_ffn(x, *layers[i % args.layers], ids[i + 1], mix, out, "silu", threads, bits)
                times.append(time.perf_counter() - t)
            best, median = min(times), float(np.median(times))
            line = {"case": "one token" if n == 1 else f"chunk of {n}", "threads": threads, "cpu_count": os.cpu_count(),
                    "experts": e, "top_k": k, "width": f, "hidden": d, "us_median": round(median * 1e6, 1),
                    "us_best": round(best * 1e6, 1)}
            if n == 1:
                line["activation_bits"] = bits
                line["chosen_gb_per_s_median"] = round(chosen_bytes / median / 1e9, 2)
                line["parts_us_median"] = token_parts(layers, ids, x[0], threads, bits, median)
                line["threading_layer"] = numba.threading_layer()
            else:
                line["tokens_per_s_median"] = round(n / median, 1)
            print(json.dumps(line), flush=True)
    return 0


def token_parts(layers, ids, x, threads: int, bits: int, whole_s: float) -> dict[str, float]:
    """Median microseconds of each pass of experts.moe_ffn's one-token path, layers cycled as in the whole."""
    times: dict[str, list[float]] = {"activation": [], "gate_up": [], "down": []}
    for i in range(len(ids) - 1):
        gate, up, down = layers[i % len(layers)]
        chosen, f, d = ids[i + 1][0], gate.shape[1], down.shape[1]
        t = time.perf_counter()
        act = products.activation(x, bits)
        times["activation"].append(time.perf_counter() - t)
        hidden, out = np.empty(len(chosen) * f, np.float32), np.empty(d, np.float32)
        t = time.perf_counter()
        products.expert_glu(gate.planes, up.planes, act, chosen, hidden, False, threads)
        times["gate_up"].append(time.perf_counter() - t)
        act = products.activation(hidden.reshape(len(chosen), f), bits)
        mix = np.full(len(chosen), 1 / len(chosen), np.float32)
        t = time.perf_counter()
        products.expert_mix(down.planes, act, chosen, mix, out, threads)
        times["down"].append(time.perf_counter() - t)
    parts = {name: float(np.median(v)) for name, v in times.items()}
    parts["rest"] = whole_s - sum(parts.values())
    return {name: round(v * 1e6, 1) for name, v in parts.items()}


if __name__ == "__main__":
    raise SystemExit(main())
