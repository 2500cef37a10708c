"""Prompt and output speed of a GGUF model on the engine (an H200 is what it was written for); not a test.

Prints one JSON line per model: model, tensor types, GPU, prompt length, context, prompt tokens/s, output
tokens/s, the bandwidth floor of a decode step (bytes of weights read per token / 4.3 TB/s) and the fraction of
it reached. The prompt is random token ids (speed does not depend on them); the output is greedy, sampled on the
GPU the way a chat does (one id back to the host per token), for a fixed number of tokens.

Usage: python bench/bench_gpu.py MODEL.gguf [MODEL.gguf ...] [--prompt 512] [--output 128] [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine import load_model  # noqa: E402
from engine.backend import SamplingParams  # noqa: E402
from engine.generate import decode_one_token, prefill  # noqa: E402

BANDWIDTH = 4.3e12  # bytes/s, device-to-device copy measured on an H200 (shared/reference/engine-anchors.md)
GREEDY = SamplingParams(temperature=0.0)


def bytes_per_token(weights) -> int:
    """Weight bytes one decode step reads: every layer matrix and the output head (one embedding row aside)."""
    total = weights.output.nbytes
    for layer in weights.layers:
        for handle in (*layer.qkv, layer.attn_out, layer.gate, layer.up, layer.down):
            total += handle.nbytes
    return total


def gpu_name() -> str:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    except Exception:  # noqa: BLE001 - a CPU-only machine has no GPU name to report
        return "none"


def run(path: Path, prompt_len: int, output_len: int, device: str) -> dict:
    model = load_model(path, device=device, context_length=prompt_len + output_len + 8)
    state = model._state
    backend = state.backend
    rng = np.random.default_rng(0)
    prompt = rng.integers(2, model.info.vocab_size, prompt_len).tolist()
    none = np.zeros(0, np.int32)

    def timed_prefill() -> tuple[float, object]:
        state.cached.clear()
        backend.synchronize()
        t = time.perf_counter()
        logits, _ = prefill(state, prompt)
        backend.synchronize()
        return time.perf_counter() - t, logits

    def timed_decode(first_logits) -> float:
        token = backend.sample(first_logits, GREEDY, none, 0.0)
        t = time.perf_counter()
        for _ in range(output_len):
            logits = decode_one_token(state, token)
            token = backend.sample(logits, GREEDY, none, 0.0)
        return time.perf_counter() - t

    timed_decode(timed_prefill()[1])  # warm-up: kernel compilation, cuBLAS, graph capture
    runs = []
    for _ in range(2):
        seconds, logits = timed_prefill()
        runs.append((seconds, timed_decode(logits)))
    prompt_s, output_s = min(r[0] for r in runs), min(r[1] for r in runs)
    per_token = bytes_per_token(state.weights)
    output_tps = output_len / output_s
    floor_tps = BANDWIDTH / per_token
    result = {
        "model": model.info.name,
        "file": path.name,
        "tensor_types": model.info.tensor_types,
        "gpu": gpu_name() if backend.name == "cupy" else "cpu",
        "backend": backend.name,
        "prompt_tokens": prompt_len,
        "output_tokens": output_len,
        "context": model.info.context_length,
        "prompt_tokens_per_s": round(prompt_len / prompt_s, 1),
        "output_tokens_per_s": round(output_tps, 1),
        "bytes_per_token": per_token,
        "floor_output_tokens_per_s": round(floor_tps, 1),
        "fraction_of_floor": round(output_tps / floor_tps, 3),
    }
    model.close()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+", type=Path)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--output", type=int, default=128)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    for path in args.models:
        print(json.dumps(run(path, args.prompt, args.output, args.device)), flush=True)


if __name__ == "__main__":
    main()
