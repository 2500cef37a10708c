"""What this engine runs and the limits it works under, as plain data: the one place these facts are written.

The backends and the loader read their limits from here, and `profile()` hands the same values to callers that
choose models (they must not need a GPU, or even the engine's backends, to ask).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from engine.arch import ARCHITECTURES
from engine.backend import Q8_0_GROUP
from engine.kernels.gpu_layout import FLOAT_TYPES, PLANES
from engine.kernels.kernel_names import DELTA_CHUNK
from engine.quants import SUPPORTED_TYPES

# The CuPy backend's kernels use warp-level matrix instructions and int8 dot products of Turing and newer.
MIN_COMPUTE_CAPABILITY = (7, 5)
# Used when the caller gives no context length and the model allows more.
DEFAULT_CONTEXT = 8192
# Tokens of a prompt run in one forward pass, which sizes the activation workspace. The CPU path holds a layer's
# scores for the chunk against the whole context, so its chunks stay short. The GPU's prompt products dequantize
# each weight to fp16 once a chunk (for cuBLAS), which longer chunks spread over more tokens: from 512 to 2,048
# tokens a chunk, the Qwen3.8-27B shape's 4,096-token prompt went from 4,757 to 7,292 tokens/s and Qwen3-8B's
# 8,192-token one from 14,247 to 20,246 (H100, bench/results/2026-12-07_s20call3_bench.jsonl).
CPU_PROMPT_CHUNK = 512
GPU_PROMPT_CHUNK = 2048
# The GPU prompt path dequantizes one weight (or a row slice of a larger one) to this many fp16 values of scratch.
DEQUANT_SCRATCH_ELEMENTS = 64 * 2**20
# A weight larger than that is dequantized and multiplied a row slice at a time, each slice writing its own columns
# of the output: a multiple of this many rows, so every slice's columns start 16-byte aligned, as cuBLAS's fast
# kernels store them (Qwen3.8-27B's FFN matrices, 89M weights, take two slices).
DEQUANT_SLICE_ROWS = 128
# KV cache element types: fp16 on the GPU; float32 on the CPU, exact with respect to its float32 activations.
# Threads the CPU computes the experts kept in RAM with, while the GPU waits for them: every core but one (H200
# machine, 16 cores, one layer's experts from a host call: 884 us on 15 threads, 1,023 on 14, 1,101 on 12, while the
# thread waiting on the stream spun; bench/results/2026-12-02_ram_*). That thread now sleeps (host_calls.HostCalls),
# and a probe then gave 957 us on 16 threads against 1,091 on 15, but no whole-model run on 16 has finished within
# 180 s (sessions 5 and 6): every core busy leaves none for the driver and the host-call thread.
HOST_EXPERT_THREADS = int(os.environ.get("STRATA_CPU_THREADS") or max(1, (os.cpu_count() or 2) - 1))
# RAM the CPU kernels' layout (engine/cpu/layout.py) takes per byte of the file, for each type it repacks (the others
# keep their file's bytes): the legacy types hold float32 group scales, the K-quants their own 8-bit ones under
# float32 super-block scales, Q3_K its own two- and one-bit planes, IQ3_S the Q6_K layout (tests/test_cpu_kernels.py
# holds each type to its ratio). The fit counts experts kept in RAM at the largest ratio among a model's types, a
# whole model on the CPU at its quant's.
CPU_BYTES_PER_FILE_BYTE = {"Q4_0": 24 / 18, "Q4_1": 24 / 20, "Q5_0": 28 / 22, "Q5_1": 28 / 24, "Q8_0": 36 / 34,
                           "Q4_K": 152 / 144, "Q5_K": 184 / 176, "Q6_K": 212 / 210, "Q3_K": 116 / 110,
                           "Q2_K": 152 / 84, "IQ4_XS": 140 / 136, "IQ3_S": 212 / 110}
GPU_KV_DTYPE = np.dtype(np.float16)
CPU_KV_DTYPE = np.dtype(np.float32)
# A q8_0 KV cache (kv_cache_type="q8_0"), on either device: each 32 values as int8 under one fp16 scale.
Q8_0_KV_BYTES_PER_ELEMENT = (Q8_0_GROUP + 2) / Q8_0_GROUP


def dequant_slice_rows(m: int, k: int) -> int:
    """Rows of an (m, k) weight the GPU prompt path dequantizes at a time: all m where the scratch holds them, else
    the most it holds in whole DEQUANT_SLICE_ROWS (or as many rows as it holds, for rows too long for that)."""
    rows = DEQUANT_SCRATCH_ELEMENTS // k
    if rows >= m:
        return m
    return rows // DEQUANT_SLICE_ROWS * DEQUANT_SLICE_ROWS if rows >= DEQUANT_SLICE_ROWS else max(1, rows)


def prompt_chunk(backend_name: str, asked: int | None = None) -> int:
    """The most prompt tokens a backend ("numpy" or "cupy") runs at once: `asked`, else its default; the CPU path
    never more than its own (its attention's scores grow with chunk x context)."""
    if backend_name == "cupy":
        return asked or GPU_PROMPT_CHUNK
    return min(asked or CPU_PROMPT_CHUNK, CPU_PROMPT_CHUNK)


def architectures() -> set[str]:
    """GGUF `general.architecture` values the engine runs, on the CPU and on the GPU."""
    return set(ARCHITECTURES)


def gpu_architectures() -> set[str]:
    """The architectures the GPU backend runs: every one (the hybrids' recurrent layers too, engine/kernels/hybrid.cu)."""
    return architectures()


def cpu_tensor_types() -> set[str]:
    """Tensor types the CPU path reads (every type it can dequantize)."""
    return {t.name for t in SUPPORTED_TYPES}


def gpu_tensor_types() -> set[str]:
    """Tensor types the GPU kernels compute on; a model with others is refused on the GPU at load."""
    return {t.name for t in (*PLANES, *FLOAT_TYPES)}


def profile() -> dict[str, Any]:
    """Every fact a model chooser needs about this engine, keyed as setup_logic's EngineProfile fields."""
    return {
        "supported_architectures": architectures(),
        "supported_tensor_types": cpu_tensor_types(),
        "gpu_tensor_types": gpu_tensor_types(),
        "gpu_architectures": gpu_architectures(),
        "min_compute_capability": MIN_COMPUTE_CAPABILITY,
        # The CPU path keeps the quantized weights, about the file's size (engine/cpu/layout.py).
        "cpu_weights_dequantized_to_f32": False,
        "cpu_bytes_per_file_byte": CPU_BYTES_PER_FILE_BYTE,
        # The packed types (those with a layout ratio) and the float ones; the CPU dequantizes others row by row.
        "cpu_kernel_types": {*CPU_BYTES_PER_FILE_BYTE, *(t.name for t in FLOAT_TYPES)},
        "kv_bytes_per_element_gpu": GPU_KV_DTYPE.itemsize,
        "kv_bytes_per_element_cpu": CPU_KV_DTYPE.itemsize,
        "kv_bytes_per_element_q8_0": Q8_0_KV_BYTES_PER_ELEMENT,
        "prefill_chunk": CPU_PROMPT_CHUNK,
        "gpu_prefill_chunk": GPU_PROMPT_CHUNK,
        "default_context": DEFAULT_CONTEXT,
        "dequant_scratch_elements": DEQUANT_SCRATCH_ELEMENTS,
        "gpu_delta_chunk": DELTA_CHUNK,
        "experts_in_ram": True,
        "hot_expert_cache": True,  # engine/expert_cache.py
    }
