"""How much memory a model needs in our engine and where it fits on this PC (choice.py picks among the models).

The estimate describes what the engine allocates (its EngineProfile says how it stores things), not a generic
rule of thumb:
- GPU path: the GGUF's quantized bytes are uploaded as they are; KV cache at the profile's element size (of the
  KV cache type asked for: q8_0 takes 34 bytes per 32 values on either device).
- CPU path: the quantized bytes kept as they are, or (a profile with cpu_weights_dequantized_to_f32) float32
  copies, 4 bytes per weight; KV cache at the profile's element size.
- Loading reads the file through a memory map once; those pages show in the process's memory but the OS can
  drop them, so they are reported and not required.
- A mixture of experts can keep its dense part and the experts of some layers on the GPU and the experts of the
  other layers in RAM, where the CPU computes them ("gpu+ram"), when the engine says it can; in RAM those experts
  take the CPU layout's bytes (the profile's cpu_bytes_per_file_byte, at the largest ratio among the model's tensor
  types: 1.06 times a Q4_K file's, 4/3 a Q4_0 file's), and the GPU keeps a
  buffer that one such layer's experts are copied into when a long prompt chunk computes them there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, Field

from setup_logic.catalog import CatalogModel
from setup_logic.engine_profile import EngineProfile, KvCacheType
from setup_logic.hardware import PcReport, best_gpu, gb

Level = Literal["gpu", "gpu+ram", "cpu"]
Goal = Literal["code", "chat", "speed", "quality"]

MIN_CONTEXT = 2048
MIB = 1 << 20
# The estimate is meant to be within ~15% of measured growth; keep 5% of the budget free on top of it so a
# model at the edge does not push the OS into swapping or the GPU out of memory.
_FIT_FRACTION = 0.95
# What a loaded model holds in RAM besides weights, KV cache and workspace: mostly the tokenizer and the
# vocabulary's metadata. Measured on the CPU path after load (the engine unmaps the GGUF once loaded), the process's
# growth less the weights the engine holds: 65.5 MB for SmolLM2's 49,152 tokens and 356 MB for Gemma 3's 262,144,
# i.e. about 1.35 KB per token (2026-12-02, the 2-core VM).
_RAM_BASE_BYTES = 4 * MIB
_RAM_PER_VOCAB_TOKEN = 1360
# CUDA context, loaded kernel modules and cuBLAS workspace on the GPU: 638-727 MB outside CuPy's pool measured on an
# H200 (CUDA 13, CuPy 14.2) for three models (bench/RESULTS.md); other cards and CUDA versions are unmeasured.
# The driver's host side in RAM is a typical figure, not measured against our engine.
_CUDA_CONTEXT_BYTES = 610 * MIB
_CUDA_HOST_BYTES = 300 * MIB
# The CPU path is bound by reading its weights once per token. Float32 weights through BLAS: about 10 GB/s on a
# 2-core EPYC cloud machine, decode on one BLAS thread (SmolLM2's 539 MB at 18-19 tokens/s, bench/bench_engine.py).
# Quantized weights through engine/cpu's kernels (int16 activations, one thread on that 2-core machine): 4.7-6.5
# GB/s of the file's bytes for 4096x14336 and 14336x4096 Q4 products (bench/results/2026-12-01_cpuint16_products_*).
# Below _MIN_TOKENS_PER_S an answer takes minutes, so such a level is not offered even when the model fits: the CPU
# path at these rates, or experts in RAM where this PC's measured RAM bandwidth over the expert bytes a token reads
# there (the CPU's or over the bus, RAM serves them all) bounds decode below it.
# Tensor types without a CPU kernel (EngineProfile.cpu_kernel_types) are dequantized a few rows at a time for BLAS:
# 0.046-0.095 GB/s of the file's bytes for IQ3_S (and Q2_K and IQ4_XS, before their kernels) experts' matrices on a
# 2-core EPYC VM, one thread, against 5.9-13.8 for the kernels' types on the same matrices
# (bench/results/2026-12-02_s6_cpu_tile_products.jsonl; IQ3_S, now in Q6_K's layout: 0.014 -> 3.1-3.2,
# bench/results/2026-12-06_s13_cpu_iq3s_products.jsonl).
_CPU_F32_BYTES_PER_S = 10e9
_CPU_QUANTIZED_BYTES_PER_S = 5e9
_CPU_TILE_BYTES_PER_S = 0.05e9
_MIN_TOKENS_PER_S = 2.0


class Preferences(BaseModel):
    goal: Goal = Field(default="chat", description="what matters most: code, chat, speed or quality")
    context_length: int | None = Field(default=None, ge=1, description="tokens of context wanted; None picks one")
    ram_bytes_override: int | None = Field(default=None, ge=0, description="RAM the model may use, instead of what is available now")
    vram_bytes_override: int | None = Field(default=None, ge=0, description="VRAM the model may use, instead of what is free now")
    kv_cache: KvCacheType = Field(
        default="full", description="the KV cache type: q8_0 takes about half the GPU's KV bytes, so a longer context fits"
    )


class MemoryEstimate(BaseModel):
    level: Level
    context_length: int
    expert_layers_in_ram: int | None = Field(
        description="MoE layers whose routed experts stay in RAM, computed by the CPU (gpu+ram); None otherwise"
    )
    gpu_weights_bytes: int
    ram_weights_bytes: int
    kv_cache_type: KvCacheType
    kv_cache_bytes: int
    recurrent_state_bytes: int
    prompt_chunk: int = Field(description="the most prompt tokens a forward pass runs, which sizes the workspace")
    workspace_bytes: int = Field(description="activations for one prompt chunk, attention scores, rotary tables")
    gpu_overhead_bytes: int = Field(description="CUDA context and libraries")
    ram_overhead_bytes: int = Field(description="GGUF metadata, tokenizer, and the CUDA driver's host side")
    reclaimable_file_bytes: int = Field(description="file pages read once while loading; counted, not required")
    ram_expert_bytes_per_token: int = Field(
        0, description="bytes of the experts kept in RAM that the CPU reads per generated token (gpu+ram)"
    )
    expert_staging_bytes: int = Field(
        0, description="GPU buffer a long prompt chunk copies one RAM layer's experts into (gpu+ram)"
    )
    expert_cache_slots: int = Field(
        0, description="experts of each RAM layer the GPU also holds: the ones its tokens pick most (gpu+ram)"
    )
    expert_cache_bytes: int = Field(0, description="GPU memory of those cached experts")
    vram_bytes: int = Field(description="total on the GPU")
    ram_bytes: int = Field(description="total the process grows by in RAM, reclaimable file pages included")
    ram_required_bytes: int = Field(description="RAM that must be available: ram_bytes without reclaimable pages")
    ram_after_load_bytes: int = Field(
        description="what the process has grown by right after loading: the file's pages are unmapped by then, and "
        "on the CPU path the KV cache and workspace are zero-filled lazily by the OS, so they join as the context "
        "fills up"
    )
    explanation: str


class FitResult(BaseModel):
    model_id: str
    level: Literal["gpu", "gpu+ram", "cpu", "none"]
    context_length: int | None
    largest_context_that_fits: int | None = Field(description="at this level; None when it does not fit")
    memory: MemoryEstimate | None
    tokens_per_s_bound: float | None = Field(
        None, description="an upper bound on decode speed with experts in RAM (gpu+ram): the measured RAM read "
        "bandwidth over the expert bytes a token reads there; None at other levels or when the bandwidth is unknown"
    )
    reason: str


def kv_cache_bytes(model: CatalogModel, context_length: int, bytes_per_element: float, chunk: int = 1) -> int:
    """Keys and values of the layers that keep them, for context_length positions; sliding-window layers keep only
    window + chunk - 1 where that is fewer (chunk: the engine's prefill chunk; engine/arch/decoder.py new_cache)."""
    layers = model.kv_layers or model.n_layers
    positions = layers * context_length
    ring = (model.sliding_window or 0) + chunk - 1
    if model.sliding_layers and context_length > ring:
        positions -= model.sliding_layers * (context_length - ring)
    return round(positions * 2 * model.n_kv_heads * model.head_dim * bytes_per_element)


def workspace_bytes(model: CatalogModel, context_length: int, engine: EngineProfile, on_gpu: bool,
                    prompt_chunk: int | None = None) -> int:
    """The buffers of one prompt chunk (activation_floats_per_token of them a token, and the last logits), the rotary
    cos/sin tables, and attention's working space: the NumPy reference holds one layer's scores for the chunk against
    the whole context, the GPU kernel only per-head partial sums (chunk x heads x (head_dim + 2)); on the GPU also
    the prompt path's fp16 scratch, a mixture's per-slot outputs and the chunked delta rule's scratch."""
    chunk = min(engine.prompt_chunk(on_gpu, prompt_chunk), context_length)
    q_dim = model.n_heads * model.head_dim
    kv_dim = model.n_kv_heads * model.head_dim
    rope = context_length * model.head_dim
    buffers = 4 * (chunk * activation_floats_per_token(model) + model.vocab_size + rope)
    if not on_gpu:
        return buffers + 4 * chunk * model.n_heads * context_length
    attention = chunk * model.n_heads * (model.head_dim + 2)
    # fp16 scratch of the prompt path: the largest dense matrix dequantized, and the chunk's activations.
    dense_ffn = 0 if model.is_moe else model.n_ff
    largest = max(dense_ffn, q_dim + 2 * kv_dim) * model.n_embd
    fp16 = min(largest, engine.dequant_scratch_elements) + chunk * max(model.n_ff, model.n_embd, q_dim)
    # The grouped expert products' output a (token, expert) slot, summed into the chunk's rows afterwards.
    slots = 4 * chunk * model.n_experts_used * model.n_embd if model.is_moe else 0
    return buffers + 4 * attention + 2 * fp16 + slots + delta_chunk_scratch_bytes(model, chunk, engine)


def activation_floats_per_token(model: CatalogModel) -> int:
    """float32 values a token of a prompt chunk holds in the engine's buffers (engine/arch: the residual, the normed
    input and a part's output; each mixer and feed-forward kind's own buffers)."""
    q_dim = model.n_heads * model.head_dim
    kv_dim = model.n_kv_heads * model.head_dim
    ffn = model.n_ff * (model.n_experts_used or 1)
    floats = 3 * model.n_embd + 2 * q_dim + 2 * kv_dim + 2 * ffn  # x, h, delta; QKV, attention out; FFN and scratch
    if model.is_moe:  # router logits, routing weights and expert ids
        floats += model.n_experts + 2 * model.n_experts_used
    if model.n_ff_shared:  # the shared expert's activation and scratch, its output, its gate's logit (the router's last column)
        floats += 2 * model.n_ff_shared + model.n_embd + 1
    la = model.linear_attention
    if la is not None:  # the gated attention's output gate; the DeltaNet projections, convolved q/k/v and output
        value_dim = la.value_heads * la.value_dim
        floats += q_dim + 2 * la.conv_channels + 2 * value_dim + 2 * la.value_heads
    return floats


def delta_chunk_scratch_bytes(model: CatalogModel, chunk: int, engine: EngineProfile) -> int:
    """The GPU's chunked delta rule's scratch for a prompt chunk of a hybrid (engine/kernels/kernel_names.py
    delta_chunk_scratch): per chunk of gpu_delta_chunk tokens and value head, U (float32), three fp16 planes of key
    width (-W, Q e^g, K e^(g_last - g)), the fp16 in-chunk products P, and one float32."""
    la = model.linear_attention
    if la is None:
        return 0
    c = engine.gpu_delta_chunk
    chunks = -(-chunk // c) * la.value_heads
    return chunks * (4 * c * la.value_dim + 2 * 3 * c * la.key_dim + 2 * c * c + 4)


def _cpu_layout_ratio(model: CatalogModel, engine: EngineProfile) -> float:
    """RAM per file byte of weights the CPU holds: the largest ratio among the model's tensor types (the catalog does
    not say which tensors use which)."""
    return max((engine.cpu_bytes_per_file_byte.get(t, 1.0) for t in model.tensor_types), default=1.0)


def _main_type_ratio(model: CatalogModel, engine: EngineProfile) -> float:
    """RAM per file byte of a whole model on the CPU: its quant label's own type's ratio ("Q4_K" of "UD-Q4_K_XL"),
    which holds the bulk of the weights (a mix's few tensors of other types move it little), else the largest."""
    label = model.quant.removeprefix("UD-")
    named = [t for t in model.tensor_types if label.startswith(t)]
    if not named:
        return _cpu_layout_ratio(model, engine)
    return engine.cpu_bytes_per_file_byte.get(max(named, key=len), 1.0)


def estimate_memory(
    model: CatalogModel,
    context_length: int,
    level: Level,
    engine: EngineProfile,
    expert_layers_in_ram: int | None = None,
    expert_cache_slots: int = 0,
    kv_cache: KvCacheType = "full",
    prompt_chunk: int | None = None,
) -> MemoryEstimate:
    """Bytes on the GPU and in RAM for running `model` with `context_length` tokens at `level`, its KV cache of type
    kv_cache, prompts in chunks of prompt_chunk tokens (the engine's default for the level when None; the CPU path
    takes at most its own).

    For "gpu+ram", expert_layers_in_ram is how many layers keep their routed experts in RAM (1 to n_layers), and
    expert_cache_slots how many of each such layer's experts the GPU holds as well (its most picked ones)."""
    if context_length < 1:
        raise ValueError("context_length must be at least 1")
    file_bytes = model.file_bytes
    chunk = min(engine.prompt_chunk(level != "cpu", prompt_chunk), context_length)
    workspace = workspace_bytes(model, context_length, engine, level != "cpu", chunk)
    ram_overhead = _RAM_BASE_BYTES + model.vocab_size * _RAM_PER_VOCAB_TOKEN
    f32 = engine.cpu_weights_dequantized_to_f32
    ram_expert_read = staging = cache = 0
    if level == "cpu":
        ram_weights = round(model.params_b * 1e9 * 4) if f32 else round(file_bytes * _main_type_ratio(model, engine))
        gpu_weights = gpu_overhead = 0
        kv = kv_cache_bytes(model, context_length, engine.kv_bytes_per_element(kv_cache, on_gpu=False), chunk)
    else:
        gpu_overhead = _CUDA_CONTEXT_BYTES
        ram_overhead += _CUDA_HOST_BYTES
        kv = kv_cache_bytes(model, context_length, engine.kv_bytes_per_element(kv_cache, on_gpu=True), chunk)
        if level == "gpu":
            expert_layers_in_ram = None
            gpu_weights, ram_weights = file_bytes, 0
        else:
            if not model.is_moe:
                raise ValueError(f"{model.id} is not a mixture of experts, so it cannot split experts into RAM")
            if expert_layers_in_ram is None or not 1 <= expert_layers_in_ram <= model.n_layers:
                raise ValueError(f"expert_layers_in_ram must be between 1 and {model.n_layers}")
            share = expert_layers_in_ram / model.n_layers
            ram_expert_file_bytes = round(model.expert_bytes * share)
            gpu_weights = file_bytes - ram_expert_file_bytes
            ratio = _cpu_layout_ratio(model, engine)
            if f32:
                ram_weights = round(model.expert_params_b * 1e9 * 4 * share)
            else:
                ram_weights = round(ram_expert_file_bytes * ratio)
            if not 0 <= expert_cache_slots <= model.n_experts:
                raise ValueError(f"expert_cache_slots must be between 0 and {model.n_experts}")
            cache = round(ram_expert_file_bytes * expert_cache_slots / model.n_experts)
            # What the CPU reads when routing is uniform; a trained router's hot experts leave it less.
            uncached = 1 - expert_cache_slots / model.n_experts
            ram_expert_read = round(ram_weights * model.n_experts_used / model.n_experts * uncached)
            staging = round(ram_expert_file_bytes * ratio / expert_layers_in_ram)
    state = model.recurrent_state_bytes
    on_gpu = level != "cpu"
    # Every page is read once to upload or repack it; the quantized CPU path holds its repacked copy, not the file.
    reclaimable = 0 if level == "cpu" and not f32 else file_bytes
    vram = gpu_weights + gpu_overhead + staging + cache + ((kv + state + workspace) if on_gpu else 0)
    ram_required = ram_weights + ram_overhead + (0 if on_gpu else kv + state + workspace)
    estimate = MemoryEstimate(
        level=level,
        context_length=context_length,
        expert_layers_in_ram=expert_layers_in_ram if level == "gpu+ram" else None,
        gpu_weights_bytes=gpu_weights,
        ram_weights_bytes=ram_weights,
        kv_cache_type=kv_cache,
        kv_cache_bytes=kv,
        recurrent_state_bytes=state,
        prompt_chunk=chunk,
        workspace_bytes=workspace,
        gpu_overhead_bytes=gpu_overhead,
        ram_overhead_bytes=ram_overhead,
        reclaimable_file_bytes=reclaimable,
        ram_expert_bytes_per_token=ram_expert_read,
        expert_staging_bytes=staging,
        expert_cache_slots=expert_cache_slots if level == "gpu+ram" else 0,
        expert_cache_bytes=cache,
        vram_bytes=vram,
        ram_bytes=ram_required + reclaimable,
        ram_required_bytes=ram_required,
        ram_after_load_bytes=ram_required - (0 if on_gpu else kv + workspace),
        explanation="",
    )
    estimate.explanation = _explain(estimate, f32)
    return estimate


def _explain(e: MemoryEstimate, f32: bool) -> str:
    kind = "" if e.kv_cache_type == "full" else f"{e.kv_cache_type}, "
    kv = f"KV cache {gb(e.kv_cache_bytes)} ({kind}{e.context_length} tokens)"
    state = f" + recurrent state {gb(e.recurrent_state_bytes)}" if e.recurrent_state_bytes else ""
    reclaim = f"; plus {gb(e.reclaimable_file_bytes)} of file pages read once while loading, which the OS can drop"
    if e.level == "cpu":
        kind = "float32 weights" if f32 else "weights"
        return (
            f"RAM: {kind} {gb(e.ram_weights_bytes)} + {kv}{state} + workspace {gb(e.workspace_bytes)} + tokenizer "
            f"and metadata {gb(e.ram_overhead_bytes)} = {gb(e.ram_required_bytes)}"
            + (reclaim if e.reclaimable_file_bytes else "")
            + "."
        )
    experts = ""
    if e.level == "gpu+ram":
        experts = (f" (the experts of {e.expert_layers_in_ram} layers in RAM) + a long prompt's copy of one such "
                   f"layer's experts {gb(e.expert_staging_bytes)}")
        if e.expert_cache_slots:
            experts += (f" + the {e.expert_cache_slots} most picked experts of each such layer "
                        f"{gb(e.expert_cache_bytes)}")
    ram_part = f"RAM: {gb(e.ram_required_bytes)}"
    if e.ram_weights_bytes:
        ram_part += f", of which {gb(e.ram_weights_bytes)} are the experts the CPU computes"
    return (
        f"GPU: weights {gb(e.gpu_weights_bytes)}{experts} + {kv}{state} + workspace {gb(e.workspace_bytes)} + CUDA "
        f"{gb(e.gpu_overhead_bytes)} = {gb(e.vram_bytes)}. {ram_part}{reclaim}."
    )


@dataclass(frozen=True)
class Budget:
    vram: int
    ram: int
    gpu_name: str
    avx2: bool | None
    ram_read_bytes_per_s: int | None
    kv_cache: KvCacheType  # not a budget, but what every estimate the fit makes needs along with it


def budget_for(report: PcReport, prefs: Preferences, engine: EngineProfile) -> Budget:
    gpu = best_gpu(report.gpus, engine)
    vram = prefs.vram_bytes_override if prefs.vram_bytes_override is not None else (gpu.vram_free_bytes if gpu else 0)
    ram = prefs.ram_bytes_override if prefs.ram_bytes_override is not None else report.ram_available_bytes
    name = gpu.name if gpu else "the GPU given by the VRAM override"
    return Budget(vram=vram, ram=ram, gpu_name=name, avx2=report.cpu.avx2,
                   ram_read_bytes_per_s=report.ram_read_bytes_per_s, kv_cache=prefs.kv_cache)


def _fits(e: MemoryEstimate, budget: Budget) -> bool:
    return e.vram_bytes <= budget.vram * _FIT_FRACTION and e.ram_required_bytes <= budget.ram * _FIT_FRACTION


def _expert_layers_in_ram(model: CatalogModel, context_length: int, engine: EngineProfile, budget: Budget,
                          chunk: int) -> int | None:
    """The fewest layers whose experts must move to RAM for the rest to fit the GPU (VRAM falls linearly with them);
    None when even every layer's experts in RAM leave too much on the GPU."""
    layers = model.n_layers
    least = estimate_memory(model, context_length, "gpu+ram", engine, expert_layers_in_ram=layers,
                            kv_cache=budget.kv_cache, prompt_chunk=chunk).vram_bytes
    room = budget.vram * _FIT_FRACTION
    if least > room:
        return None
    per_layer = model.expert_bytes / layers
    return max(1, min(layers, math.ceil((least + per_layer * layers - room) / per_layer)))


def _prompt_chunks(engine: EngineProfile, level: Level) -> list[int]:
    """The prompt chunks a placement may take, longest first: on the GPU the engine's default, halved down to the
    CPU's (a longer chunk spreads each weight's dequantization over more tokens, for more workspace); the CPU's own."""
    chunks = [engine.prompt_chunk(on_gpu=level != "cpu")]
    while chunks[-1] // 2 >= engine.prefill_chunk:
        chunks.append(chunks[-1] // 2)
    return chunks


def _place(model: CatalogModel, context_length: int, level: Level, engine: EngineProfile, budget: Budget):
    """The estimate of the placement that fits with the longest prompt chunk, or None. With experts in RAM, the
    fewest layers there (decode speed) come first: a chunk is taken only where it moves no more layers to RAM."""
    chunks = _prompt_chunks(engine, level)
    layers = None
    if level == "gpu+ram":
        layers = _expert_layers_in_ram(model, context_length, engine, budget, chunks[-1])
        if layers is None:
            return None
    for chunk in chunks:
        slots = 0
        if level == "gpu+ram":
            if _expert_layers_in_ram(model, context_length, engine, budget, chunk) != layers:
                continue
            slots = _expert_cache_slots(model, context_length, engine, budget, layers, chunk)
        estimate = estimate_memory(model, context_length, level, engine, expert_layers_in_ram=layers,
                                   expert_cache_slots=slots, kv_cache=budget.kv_cache, prompt_chunk=chunk)
        if _fits(estimate, budget):
            return estimate
    return None


def _expert_cache_slots(model: CatalogModel, context_length: int, engine: EngineProfile, budget: Budget,
                        layers: int, chunk: int) -> int:
    """How many of each RAM layer's experts the VRAM that whole layers leave can hold as well (the hot-expert
    cache; less than a layer's worth, spread over all of them)."""
    if not engine.hot_expert_cache:
        return 0
    left = budget.vram * _FIT_FRACTION - estimate_memory(model, context_length, "gpu+ram", engine,
                                                         expert_layers_in_ram=layers, kv_cache=budget.kv_cache,
                                                         prompt_chunk=chunk).vram_bytes
    per_slot = model.expert_bytes * layers / model.n_layers / model.n_experts  # one expert of each RAM layer
    return max(0, min(model.n_experts, math.floor(left / per_slot)))


def _largest_context(model: CatalogModel, level: Level, engine: EngineProfile, budget: Budget) -> int | None:
    """Binary search: memory only grows with the context, so the contexts that fit are 1..answer."""
    if _place(model, 1, level, engine, budget) is None:
        return None
    low, high = 1, model.context_max
    while low < high:
        middle = (low + high + 1) // 2
        if _place(model, middle, level, engine, budget) is None:
            high = middle - 1
        else:
            low = middle
    return low


def gpu_gap(model: CatalogModel, engine: EngineProfile) -> str | None:
    """Why the GPU path cannot run this model yet, or None when it can."""
    if model.architecture not in engine.gpu_architectures:
        return f"the GPU path does not run the {model.architecture} architecture yet"
    missing = sorted(set(model.tensor_types) - engine.gpu_tensor_types)
    if missing:
        return f"the GPU kernels do not cover its {', '.join(missing)} tensors yet"
    return None


def _levels(model: CatalogModel, engine: EngineProfile, budget: Budget) -> list[Level]:
    levels: list[Level] = []
    if budget.vram > 0 and gpu_gap(model, engine) is None:
        levels.append("gpu")
        if model.is_moe and engine.experts_in_ram and not cpu_tile_types(model, engine):  # the CPU computes those
            levels.append("gpu+ram")
    levels.append("cpu")
    return levels


def fit_model(model: CatalogModel, report: PcReport, prefs: Preferences, engine: EngineProfile) -> FitResult:
    """The fastest level at which the model runs with enough context, the context to use, and why."""
    return fit_within(model, budget_for(report, prefs, engine), prefs, engine)


def fit_within(model: CatalogModel, budget: Budget, prefs: Preferences, engine: EngineProfile) -> FitResult:
    wanted = prefs.context_length
    if wanted is not None and wanted > model.context_max:
        return FitResult(
            model_id=model.id, level="none", context_length=None, largest_context_that_fits=None, memory=None,
            reason=f"It handles at most {model.context_max} tokens of context, fewer than the {wanted} asked for.",
        )
    target = wanted or min(engine.default_context, model.context_max)
    floor = wanted or min(MIN_CONTEXT, model.context_max)
    too_slow: dict[Level, str] = {}
    for level in _levels(model, engine, budget):
        largest = _largest_context(model, level, engine, budget)
        estimate = None
        if largest is not None and largest >= floor:
            estimate = _place(model, min(target, largest), level, engine, budget)
        speed = _tokens_per_s(model, level, estimate, engine, budget)
        if speed is not None and speed < _MIN_TOKENS_PER_S:
            too_slow[level] = _why_too_slow(model, estimate, speed, engine, budget)
        elif estimate is not None:
            fits = _why_fits(estimate, target, budget, speed, gpu_gap(model, engine))
            return FitResult(
                model_id=model.id, level=level, context_length=estimate.context_length,
                largest_context_that_fits=largest, memory=estimate,
                tokens_per_s_bound=round(speed, 1) if level == "gpu+ram" and speed is not None else None,
                reason=" ".join([*too_slow.values(), fits]),  # why a faster level was passed over, first
            )
    return FitResult(
        model_id=model.id, level="none", context_length=None, largest_context_that_fits=None, memory=None,
        reason=_why_not(model, floor, engine, budget, too_slow),
    )


def _tokens_per_s(model: CatalogModel, level: Level, e: MemoryEstimate | None, engine: EngineProfile,
                  budget: Budget) -> float | None:
    """Decode speed where the fit can tell it: the CPU path's estimate (whatever the placement), or with experts in
    RAM the bound this PC's RAM sets, every expert byte a token reads there coming through it."""
    if level == "cpu":
        return cpu_tokens_per_second(model, engine, budget.ram_read_bytes_per_s)
    if level == "gpu+ram" and e is not None and budget.ram_read_bytes_per_s and e.ram_expert_bytes_per_token:
        return budget.ram_read_bytes_per_s / e.ram_expert_bytes_per_token
    return None


def cpu_bytes_read_per_token(model: CatalogModel, engine: EngineProfile) -> float:
    active = (model.active_params_b or model.params_b) * 1e9
    return active * 4 if engine.cpu_weights_dequantized_to_f32 else bytes_read_per_token(model)


def cpu_tile_types(model: CatalogModel, engine: EngineProfile) -> list[str]:
    """The model's tensor types the CPU has no kernel for (none when it keeps float32 weights)."""
    if engine.cpu_weights_dequantized_to_f32:
        return []
    return sorted(set(model.tensor_types) - engine.cpu_kernel_types)


def _cpu_kernel_bytes_per_s(model: CatalogModel, engine: EngineProfile) -> float:
    """Weight bytes/s the CPU path's products take in. A type without a CPU kernel counts for all the weights: the
    catalog does not say which tensors it holds, and a quant's own type holds the bulk of them."""
    if engine.cpu_weights_dequantized_to_f32:
        return _CPU_F32_BYTES_PER_S
    return _CPU_TILE_BYTES_PER_S if cpu_tile_types(model, engine) else _CPU_QUANTIZED_BYTES_PER_S


def cpu_tokens_per_second(model: CatalogModel, engine: EngineProfile, ram_read_bytes_per_s: int | None) -> float:
    """Rough decode speed of the CPU path: memory-bound, one pass over the weights per token, and never faster than
    this PC's RAM delivers them where that was measured."""
    rate = _cpu_kernel_bytes_per_s(model, engine)
    return min(rate, ram_read_bytes_per_s or rate) / cpu_bytes_read_per_token(model, engine)


def _why_too_slow(model: CatalogModel, e: MemoryEstimate | None, speed: float, engine: EngineProfile,
                  budget: Budget) -> str:
    if e is not None and e.level == "gpu+ram":
        where = f"the experts of {e.expert_layers_in_ram} of its layers"
        return f"Too slow with {where} in RAM: {_ram_speed(e, budget, speed)}."
    gpu_hint = "" if budget.vram > 0 or gpu_gap(model, engine) else "; on an NVIDIA GPU it would run far faster"
    tiles = cpu_tile_types(model, engine)
    why = (f"the CPU has no kernel for its {', '.join(tiles)} tensors and dequantizes them row by row, "
           if tiles else "")
    ram = budget.ram_read_bytes_per_s
    limit = ""
    if ram and ram < _cpu_kernel_bytes_per_s(model, engine):
        limit = f", as this PC's RAM reads {gb(ram)}/s (measured)"
    return (
        f"Too slow on this PC's CPU: {why}it reads {gb(cpu_bytes_read_per_token(model, engine))} of weights per "
        f"token, about {speed:.2f} tokens/s{limit}{gpu_hint}."
    )


def _ram_speed(e: MemoryEstimate, budget: Budget, speed: float | None) -> str:
    if speed is None:
        return (f"it reads {gb(e.ram_expert_bytes_per_token)} of them per generated token, so RAM bandwidth sets the "
                "speed")
    return (f"up to about {speed:.1f} tokens/s, as this PC's RAM reads {gb(budget.ram_read_bytes_per_s)}/s (measured) "
            f"and a token reads {gb(e.ram_expert_bytes_per_token)} of experts there")


def _why_fits(e: MemoryEstimate, target: int, budget: Budget, speed: float | None, gap: str | None) -> str:
    tokens = f"{e.context_length} tokens of context"
    if e.level == "gpu":
        text = f"Runs on the GPU ({budget.gpu_name}): {gb(e.vram_bytes)} of the {gb(budget.vram)} free VRAM with {tokens}"
    elif e.level == "gpu+ram":
        text = (
            f"Runs on the GPU ({budget.gpu_name}) with the experts of {e.expert_layers_in_ram} of its layers in RAM, "
            f"where the CPU computes most of them and the GPU reads a few a token over the bus: {gb(e.vram_bytes)} of "
            f"VRAM and {gb(e.ram_required_bytes)} of RAM with {tokens}"
        )
        if e.expert_cache_slots:
            text += (f"; the GPU also holds the {e.expert_cache_slots} experts each of those layers picks most, "
                     "which it computes itself")
        text += f"; {_ram_speed(e, budget, speed)}"
    else:
        where = ""
        if budget.vram > 0:
            where = f" because {gap}" if gap else " because it is too big for the GPU"
        text = f"Runs on the CPU{where}: {gb(e.ram_required_bytes)} of the {gb(budget.ram)} RAM available with {tokens}"
        text += f", about {speed:.0f} tokens/s"
        if budget.avx2 is False:
            text += "; AVX2 missing: CPU inference will be slow"
    if e.context_length < target:
        text += f"; context reduced from {target} to fit"
    return text + "."


def _why_not(model: CatalogModel, context: int, engine: EngineProfile, budget: Budget,
             too_slow: dict[Level, str]) -> str:
    """What each level would need, and why a level where the model fits is too slow (too_slow, by level)."""
    slow = " ".join(too_slow.values())
    gap = gpu_gap(model, engine)
    if budget.vram > 0 and gap is not None:
        cpu_part = slow or f"Too big for the CPU path: it needs {_cpu_need(model, context, engine, budget)}."
        return f"On the GPU: {gap}. {cpu_part}"
    needs = []
    if budget.vram > 0:  # the least it needs: the shortest prompt chunk the GPU takes
        least = engine.prefill_chunk
        gpu = estimate_memory(model, context, "gpu", engine, kv_cache=budget.kv_cache, prompt_chunk=least)
        needs.append(f"{gb(gpu.vram_bytes)} of VRAM on the GPU ({gb(budget.vram)} free)")
        if model.is_moe and engine.experts_in_ram and "gpu+ram" not in too_slow:
            split = estimate_memory(model, context, "gpu+ram", engine, expert_layers_in_ram=model.n_layers,
                                    kv_cache=budget.kv_cache, prompt_chunk=least)
            needs.append(
                f"{gb(split.vram_bytes)} of VRAM and {gb(split.ram_required_bytes)} of RAM with its experts in RAM"
            )
    where = "the GPU"
    if "cpu" not in too_slow:
        needs.append(_cpu_need(model, context, engine, budget))
        where = "this PC"
    if not needs:
        return slow
    text = f"Too big for {where} even with {context} tokens of context: it needs " + ", or ".join(needs) + "."
    return f"{text} {slow}" if slow else text


def _cpu_need(model: CatalogModel, context: int, engine: EngineProfile, budget: Budget) -> str:
    cpu = estimate_memory(model, context, "cpu", engine, kv_cache=budget.kv_cache)
    return f"{gb(cpu.ram_required_bytes)} of RAM on the CPU ({gb(budget.ram)} available)"


def bytes_read_per_token(model: CatalogModel) -> int:
    """Weights read to generate one token: the active parameters at the file's bits per weight."""
    active = model.active_params_b or model.params_b
    return round(model.file_bytes * active / model.params_b)
