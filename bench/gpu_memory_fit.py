"""GPU memory the engine really takes against setup_logic.fit.estimate_memory's "gpu" estimate; not a test.

For each model, in a fresh process (so the CUDA context, kernels and cuBLAS count, as they do for a person's
first load): GPU memory in use (NVML, else the driver's free memory) before anything touches CUDA, after
load_model(device="cuda", context_length=4096), after a 520-token prompt and a short greedy answer, and after
close(). `measure` prints one JSON line of readings per model (on the GPU machine, which lacks setup_logic's
dependencies); `compare` adds the estimate and its parts and the ratio estimate / growth (anywhere).

Usage: python bench/gpu_memory_fit.py measure smollm2-135m-instruct=FILE gemma-3-270m=FILE synthetic-8b=FILE
       python bench/gpu_memory_fit.py compare MEASURED.jsonl
(a catalog id names the catalog entry to estimate; synthetic-8b is the Llama 8B geometry of
bench/make_synthetic_gguf.py, estimated from that geometry and the file's size).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

CONTEXT = 4096
PROMPT_TOKENS = 520  # over one prefill chunk (512), so every prompt-path buffer is allocated


def gpu_used_bytes() -> tuple[int, str]:
    try:
        import pynvml

        pynvml.nvmlInit()
        return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).used), "nvml"
    except Exception:  # noqa: BLE001 - no NVML here: the driver's own figure through CuPy
        import cupy

        free, total = cupy.cuda.runtime.memGetInfo()
        return int(total - free), "cudaMemGetInfo"


def catalog_entry(m: dict):
    from setup_logic.catalog import ModelFile, get_model

    if m["model"] != "synthetic-8b":
        return get_model(m["model"])
    base = get_model("smollm2-135m-instruct")
    return base.model_copy(update=dict(
        id="synthetic-8b", name=m["file"], architecture="llama", quant="Q4_K", tensor_types=m["tensor_types"],
        params_b=m["params"] / 1e9, n_layers=32, n_embd=4096, n_ff=14336, n_heads=32, n_kv_heads=8, head_dim=128,
        vocab_size=m["vocab"], context_max=8192,
        files=[ModelFile(name=m["file"], size=m["file_bytes"], source="huggingface", repo="synthetic", path=m["file"])],
    ))


def estimate(m: dict) -> dict:
    from engine import capabilities
    from setup_logic.engine_profile import EngineProfile
    from setup_logic.fit import estimate_memory

    e = estimate_memory(catalog_entry(m), CONTEXT, "gpu", EngineProfile(**capabilities.profile()))
    return {k: getattr(e, k) for k in ("vram_bytes", "gpu_weights_bytes", "kv_cache_bytes", "workspace_bytes", "gpu_overhead_bytes")}


def file_facts(path: Path) -> dict:
    from gguf import GGUFReader

    reader = GGUFReader(path)
    return {
        "file": path.name,
        "file_bytes": path.stat().st_size,
        "params": sum(int(np.prod(t.shape)) for t in reader.tensors),
        "vocab": int(next(t for t in reader.tensors if t.name == "token_embd.weight").shape[1]),
        "tensor_types": sorted({t.tensor_type.name for t in reader.tensors}),
    }


def measure(model_id: str, path: Path) -> dict:
    """Runs in the child process: nothing has touched CUDA before the first reading."""
    used0, source = gpu_used_bytes()
    import cupy

    from engine import GenerationSettings, load_model

    pool = cupy.get_default_memory_pool()
    model = load_model(path, device="cuda", context_length=CONTEXT)
    used_load = gpu_used_bytes()[0]
    pool_load = (int(pool.used_bytes()), int(pool.total_bytes()))
    ids = np.random.default_rng(0).integers(3, model.info.vocab_size, PROMPT_TOKENS).tolist()
    model.prompt_logits(ids)
    model.complete("Hello", GenerationSettings(temperature=0, max_tokens=16, ignore_eos=True))
    used_gen = gpu_used_bytes()[0]
    pool_gen = (int(pool.used_bytes()), int(pool.total_bytes()))
    weights, kv = model.info.weight_bytes, model.info.kv_cache_bytes
    model.close()
    used_close = gpu_used_bytes()[0]
    return {
        "source": source,
        "used_before": used0,
        "growth_after_load": used_load - used0,
        "growth_after_generation": used_gen - used0,
        "pool_used_after_load": pool_load[0], "pool_held_after_load": pool_load[1],
        "pool_used_after_generation": pool_gen[0], "pool_held_after_generation": pool_gen[1],
        "engine_weight_bytes": weights, "engine_kv_cache_bytes": kv,
        "outside_pool_after_generation": used_gen - used0 - pool_gen[1],
        "returned_by_close": used_gen - used_close,
        "kept_after_close": used_close - used0,
    }


def main() -> None:
    command, args = sys.argv[1], sys.argv[2:]
    if command == "--child":
        print(json.dumps(measure(args[0], Path(args[1]))))
    elif command == "measure":
        for arg in args:
            model_id, _, file = arg.partition("=")
            child = subprocess.run([sys.executable, __file__, "--child", model_id, file], capture_output=True, text=True)
            if child.returncode != 0:
                print(json.dumps({"model": model_id, "error": child.stderr[-2000:]}), flush=True)
                continue
            measured = json.loads(child.stdout.strip().splitlines()[-1])
            print(json.dumps({"model": model_id, **file_facts(Path(file)), "context": CONTEXT, "measured": measured}), flush=True)
    elif command == "compare":
        for line in Path(args[0]).read_text().splitlines():
            m = json.loads(line)
            if "measured" not in m:
                continue
            est = estimate(m)
            ratio = est["vram_bytes"] / m["measured"]["growth_after_generation"]
            print(json.dumps({**m, "estimate": est, "estimate_over_measured": round(ratio, 3)}))
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main()
