"""Compile every CUDA kernel module the engine launches from on this GPU, in parallel, into CuPy's disk cache; not a
test.

A process's first launch from a module compiles it through NVRTC (tens of seconds for attention.cu and matvec.cu),
which a benchmark under a time limit then pays inside its limit; after this, each process loads the binaries.
Each tree of sources has its own cache entries, so run it once per tree (an A/B's older tree too). Prints one JSON
line: the modules, seconds in all, and each module's seconds.

Usage: python bench/compile_kernels.py [--sweep] [--tree DIR]
  --sweep: also the copies holding the benchmark sweeps' kernels; --tree: the sources of another checkout's engine/
  (an A/B's older tree) instead of this one's
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path


def compile_module(job: tuple[str, str, bool]) -> tuple[str, float]:
    tree, name, sweep = job
    sys.path.insert(0, tree)
    from engine.kernels import cuda

    t = time.perf_counter()
    cuda.module(name, sweep).compile()
    return f"{name}{' (sweep)' if sweep else ''}", round(time.perf_counter() - t, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--tree", type=Path, default=Path(__file__).resolve().parent.parent)
    args = parser.parse_args()
    tree = str(args.tree.resolve())
    sys.path.insert(0, tree)
    import cupy

    from engine.kernels import kernel_names as N

    modules = sorted(N.built(int(cupy.cuda.Device().compute_capability)))
    sweeps = sorted(N.built(75, sweep=True)) if args.sweep else []
    jobs = [(tree, m, False) for m in modules] + [(tree, m, True) for m in sweeps]
    t = time.perf_counter()
    # Processes, not threads (NVRTC holds a lock within a process), started fresh: this one has initialised CUDA.
    with ProcessPoolExecutor(max_workers=len(jobs), mp_context=multiprocessing.get_context("spawn")) as pool:
        seconds = dict(pool.map(compile_module, jobs))
    print(json.dumps({"tree": tree, "modules": len(jobs), "seconds": round(time.perf_counter() - t, 1), "each": seconds}),
          flush=True)


if __name__ == "__main__":
    main()
