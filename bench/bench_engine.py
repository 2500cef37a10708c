"""Engine speed on one model: load time, prompt tokens/s and output tokens/s. One JSON line per run.

    python bench/bench_engine.py MODEL.gguf [--device auto|cpu|cuda] [--prompt-tokens 512] [--output-tokens 128]
                                            [--runs 3] [--context 2048]

Each run sends a fresh prompt (nothing reused from the KV cache) of exactly --prompt-tokens tokens and
generates exactly --output-tokens tokens greedily (end-of-turn tokens ignored).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine import EngineError, GenerationSettings, load_model  # noqa: E402 - after the path fix above
from engine.cpu import products  # noqa: E402

FILLER = (
    "The history of the printing press begins in the fifteenth century, when movable type changed how books "
    "were made, sold and read across Europe. Workshops spread from city to city, and with them new ideas. "
)


def machine_description() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    blas = np.show_config(mode="dicts").get("Build Dependencies", {}).get("blas", {}).get("name", "unknown")
    return {
        "cpu": cpu,
        "cpu_cores": os.cpu_count(),
        "ram_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "os": platform.platform(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "blas": blas,
    }


def prompt_of(model, n_tokens: int, run: int) -> str:
    """Text that encodes to exactly n_tokens, different for each run so no cache prefix is shared."""
    text = f"Run {run}. " + FILLER * (n_tokens // 20 + 2)
    ids = model.tokenizer.encode(text)
    while len(ids) > n_tokens:
        text = model.tokenizer.decode(ids[:n_tokens])
        ids = model.tokenizer.encode(text)
    return text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", type=Path)
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--context", type=int, default=2048)
    args = parser.parse_args()

    try:
        rss_before = psutil.Process().memory_info().rss
        started = time.perf_counter()
        model = load_model(args.model, device=args.device, context_length=args.context)
        load_seconds = time.perf_counter() - started
        rss_growth = psutil.Process().memory_info().rss - rss_before
    except EngineError as exc:
        print(json.dumps({"error": str(exc)}))
        return 1
    settings = GenerationSettings(temperature=0, max_tokens=args.output_tokens, ignore_eos=True)
    machine = machine_description()
    for run in range(args.runs):
        result = model.complete(prompt_of(model, args.prompt_tokens, run), settings)
        print(json.dumps({
            "model": model.info.name,
            "file": args.model.name,
            "architecture": model.info.architecture,
            "tensor_types": model.info.tensor_types,
            "backend": model.info.backend,
            "device": args.device,
            "context": model.info.context_length,
            "run": run,
            "prompt_tokens": result.prompt_tokens,
            "cached_prompt_tokens": result.cached_prompt_tokens,
            "prompt_tokens_per_second": round(result.prompt_tokens_per_second, 1),
            "output_tokens": result.completion_tokens,
            "output_tokens_per_second": round(result.output_tokens_per_second, 2),
            "load_seconds": round(load_seconds, 2),
            "weight_bytes": model.info.weight_bytes,
            "file_bytes": args.model.stat().st_size,
            # what loading added to the process (weights, caches, workspace; file pages the engine keeps mapped)
            "rss_growth_after_load_bytes": rss_growth,
            "cpu_product_threads": products.threads(),  # STRATA_CPU_THREADS, else half the cores
            "machine": machine,
        }), flush=True)
    model.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
