"""One MoE layer's experts on the CPU, called from the main thread and from a host node of a captured CUDA graph (as
the GPU backend calls the experts it keeps in RAM), by thread count: what the decode step pays for running the CPU's
part inside the graph. Random Q4_K gate/up and Q6_K down experts of Qwen3-30B-A3B's shape, LAYERS copies cycled so
the weights come from RAM. Needs CuPy and an NVIDIA GPU; one JSON line per measurement. (The 2026-12-02 probe logs
in bench/results were made by this script's first form, which kept its numbers in the same keys.)

--sync sets how the main thread waits for the stream (CUDA's schedule flag; the engine's HostCalls block): a spinning
wait takes a core from the CPU's products. --gpu-us puts a kernel of about that many microseconds between the host
calls, as a decode step's attention and router are; --driver calls through the driver's host functions as the engine
did before (DriverCalls) instead of HostCalls. Activations are int8, as the GPU backend's host calls round them.

    python bench/bench_host_experts.py [--layers 8] [--threads 16,15,14,12] [--sync auto|spin|yield|block]
                                       [--gpu-us 0] [--driver]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import queue
import sys
import threading
import time
from pathlib import Path

import cupy
import numpy as np
from gguf import GGMLQuantizationType as T

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_cpu_products import random_blocks  # noqa: E402
from engine.cpu import experts  # noqa: E402
from engine.cpu.weights import load  # noqa: E402
from engine.kernels.host_calls import HostCalls, set_schedule  # noqa: E402

E, F, D, K = 128, 768, 2048, 8
SCHEDULE = {"auto": 0, "spin": 1, "yield": 2, "block": 4}  # CU_CTX_SCHED_* flags
BUSY = r"""extern "C" __global__ void busy(long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) {}
}"""


class DriverCalls:
    """The former way (before 2026-12-02, session 6) for an A/B: the driver's host functions (cuLaunchHostFunc) call
    a C callback on the driver's thread, which hands the job to a worker thread of ours and waits for it."""

    def __init__(self) -> None:
        callback_type = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
        self._launch = ctypes.CDLL("libcuda.so.1").cuLaunchHostFunc
        self._launch.argtypes = [ctypes.c_void_p, callback_type, ctypes.c_void_p]
        self._jobs: list = []
        self._todo: queue.SimpleQueue = queue.SimpleQueue()
        self._done = threading.Semaphore(0)
        threading.Thread(target=self._work, daemon=True).start()
        self._callback = callback_type(self._run)

    def _run(self, data) -> None:
        self._todo.put(data or 0)
        self._done.acquire()

    def _work(self) -> None:
        while True:
            self._jobs[self._todo.get()]()
            self._done.release()

    def launch(self, key, job) -> None:
        self._jobs.append(job)
        self._launch(ctypes.c_void_p(cupy.cuda.get_current_stream().ptr), self._callback,
                     ctypes.c_void_p(len(self._jobs) - 1))

    def arm(self) -> None:
        pass

    def check(self) -> None:
        pass

    def close(self) -> None:
        pass


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--threads", default="16,15,14,12")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--sync", choices=tuple(SCHEDULE), default="auto")
    parser.add_argument("--gpu-us", type=float, default=0.0)
    parser.add_argument("--driver", action="store_true")
    args = parser.parse_args()
    rng = np.random.default_rng(0)

    def stacked(qtype: T, rows: int, cols: int):
        return load("w", random_blocks(qtype, E * rows, cols, rng), qtype, (E, rows, cols))

    t = time.perf_counter()
    layers = [(stacked(T.Q4_K, F, D), stacked(T.Q4_K, F, D), stacked(T.Q6_K, D, F)) for _ in range(args.layers)]
    print(json.dumps({"build_s": round(time.perf_counter() - t, 1), "layer_bytes": sum(w.nbytes for w in layers[0])}),
          flush=True)
    x = rng.standard_normal((1, D)).astype(np.float32)
    mix = np.full((1, K), 1 / K, np.float32)
    out = np.empty((1, D), np.float32)
    # A new routing at every call, so the chosen experts come from RAM, not from the last level cache (300 MB there).
    routings, calls_made = [np.sort(rng.choice(E, K, replace=False)).astype(np.int32)[None] for _ in range(1024)], [0]
    stream = cupy.cuda.Stream(non_blocking=True)
    calls, engine_calls = (DriverCalls(), HostCalls()) if args.driver else (HostCalls(),) * 2  # the schedule it sets
    busy = cupy.RawKernel(BUSY, "busy")
    cycles = int(args.gpu_us * cupy.cuda.runtime.deviceGetAttribute(cupy.cuda.runtime.cudaDevAttrClockRate, 0) / 1e3)
    if not set_schedule(SCHEDULE[args.sync]):  # after HostCalls, which sets its own
        raise RuntimeError(f"the driver refused the schedule flag {args.sync}")
    for threads in (int(n) for n in args.threads.split(",")):
        def layer(i: int, threads: int = threads) -> None:
            calls_made[0] += 1
            experts.moe_ffn(x, *layers[i], routings[calls_made[0] % len(routings)], mix, out, "silu", threads, bits=8)

        with stream:
            stream.begin_capture()
            for i in range(args.layers):
                if cycles:
                    busy((1,), (32,), (np.int64(cycles),))
                calls.launch((i, threads), lambda i=i: layer(i))
            graph = stream.end_capture()
            graph.launch(stream)
            stream.synchronize()
            t = time.perf_counter()
            for _ in range(args.repeats):
                calls.arm()
                graph.launch(stream)
            stream.synchronize()
        calls.check()
        in_graph = (time.perf_counter() - t) / args.repeats / args.layers
        times = []
        for r in range(4 * args.layers):
            t = time.perf_counter()
            layer(r % args.layers)
            times.append(time.perf_counter() - t)
        print(json.dumps({"sync": args.sync, "threads": threads, "gpu_us_between": args.gpu_us, "driver_host_functions": args.driver,
                          "host_call_moe_us_per_layer": round(in_graph * 1e6 - args.gpu_us, 1),
                          "main_thread_moe_us(median,min)": [round(float(np.median(times)) * 1e6, 1),
                                                             round(min(times) * 1e6, 1)]}), flush=True)
    engine_calls.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
