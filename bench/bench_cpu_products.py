"""Speed of the CPU matrix-vector products (engine/cpu) on random weights: GB/s of weight bytes read (the
packed planes the kernels stream) and of the GGUF file's bytes for the same matrix. One JSON line per case. A type
without a kernel (IQ3_XXS, IQ2_S, ...) is timed through weights.product, which dequantizes rows into tiles for BLAS
("kernel": "tiles").

    python bench/bench_cpu_products.py [--shapes 4096x14336,14336x4096] [--types Q4_0,Q4_K] [--repeats 20]
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

from engine.cpu import products, weights  # noqa: E402 - after the path fix above
from engine.quants import block_layout  # noqa: E402


def random_blocks(qtype: T, rows: int, k: int, rng) -> np.ndarray:
    """Random GGUF bytes with small fp16 scales in every field that holds one (speed does not depend on values)."""
    elements, nbytes = block_layout(qtype)
    raw = rng.integers(0, 256, (rows * k // elements, nbytes), dtype=np.uint8)
    scale_offsets = {T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,), T.Q3_K: (108,), T.Q2_K: (80, 82), T.IQ3_S: (0,),
                     T.IQ4_XS: (0,)}.get(qtype, (0, 2) if elements == 32 else ())
    for at in scale_offsets:
        raw[:, at : at + 2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    return raw.reshape(-1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="4096x14336,14336x4096,576x1536")
    parser.add_argument("--types", default="Q4_0,Q4_K,Q6_K,Q8_0")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    for shape in args.shapes.split(","):
        rows, k = map(int, shape.split("x"))
        for name in args.types.split(","):
            qtype = T[name]
            raw = random_blocks(qtype, rows, k, rng)
            w = weights.load(name, raw, qtype, (rows, k))
            x = rng.standard_normal(k).astype(np.float32)
            out = np.empty(rows, np.float32)

            def run() -> None:
                if w.planes is not None:
                    products.matvec(w.planes, products.activation(x), out)
                else:
                    weights.product(w, x[None], out[None])

            run()  # compile or load from numba's cache
            best = float("inf")
            for _ in range(args.rounds):
                started = time.perf_counter()
                for _ in range(args.repeats):
                    run()
                best = min(best, (time.perf_counter() - started) / args.repeats)
            line = {"type": name, "rows": rows, "k": k, "kernel": "planes" if w.planes is not None else "tiles",
                    "threads": products.threads(), "cpu_count": os.cpu_count(), "best_us": round(best * 1e6, 1),
                    "file_bytes_gb_per_s": round(raw.nbytes / best / 1e9, 3)}
            if w.planes is not None:
                line["planes_gb_per_s"] = round(w.planes.nbytes / best / 1e9, 2)
            print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
