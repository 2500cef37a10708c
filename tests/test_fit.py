import subprocess
import sys

import pytest

from setup_logic.catalog import get_model, load_catalog
from engine import capabilities
from setup_logic.engine_profile import EngineProfile
from setup_logic.choice import recommend
from setup_logic.fit import (Preferences, activation_floats_per_token, estimate_memory, fit_model, kv_cache_bytes,
                             workspace_bytes)
from setup_logic.hardware import GIB, CpuInfo, GpuInfo, OsInfo, PcReport, gb

MIB = 1 << 20
COMMON_TYPES = {"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"}
ARCHS = {"llama", "qwen3", "qwen3moe", "gemma3", "qwen2"}
# The engine's own profile, widened to every architecture the catalog's fit cases need.
REAL = EngineProfile(**capabilities.profile())
# The table below was written for a CPU path holding float32 weights; the engine now keeps them quantized.
ENGINE = REAL.model_copy(update={"supported_architectures": ARCHS, "gpu_architectures": ARCHS,
                                 "supported_tensor_types": COMMON_TYPES, "gpu_tensor_types": COMMON_TYPES,
                                 "cpu_weights_dequantized_to_f32": True, "experts_in_ram": False})
# The planned engine: experts may live in RAM, computed by the CPU, with or without a float32 copy.
MOE_F32 = ENGINE.model_copy(update={"experts_in_ram": True})
MOE_QUANT = ENGINE.model_copy(update={"experts_in_ram": True, "cpu_weights_dequantized_to_f32": False})
TODAY = ENGINE.model_copy(update={"supported_architectures": {"llama"}, "gpu_architectures": {"llama"},
                                  "supported_tensor_types": {"F32", "Q4_1", "Q8_0"}})


def pc(ram_gb, available_gb, gpus=(), avx2=True, capability="8.9", ram_read=None) -> PcReport:
    cpu = CpuInfo(model="test CPU", physical_cores=8, logical_cores=16, avx=True, avx2=avx2, avx512f=False,
                  fma=True, f16c=True)
    cards = [
        GpuInfo(index=i, vendor="nvidia", name=name, vram_total_bytes=int(total * GIB),
                vram_free_bytes=int(free * GIB), vram_used_bytes=int((total - free) * GIB), driver_version="570.86",
                compute_capability=capability, source="nvml")
        for i, (name, total, free) in enumerate(gpus)
    ]
    return PcReport(os=OsInfo(name="Linux", version="test", machine="x86_64", wsl=False), cpu=cpu,
                    ram_total_bytes=int(ram_gb * GIB), ram_available_bytes=int(available_gb * GIB), disk_path="/",
                    disk_free_bytes=500 * GIB, gpus=cards, ram_read_bytes_per_s=ram_read, verdict="", reasons=[])


def test_kv_cache_formula():
    qwen = get_model("qwen3-8b")
    assert kv_cache_bytes(qwen, 8192, 2) == 36 * 2 * 8 * 128 * 8192 * 2 == 1_207_959_552
    # Hybrid attention: only the 16 full-attention layers of 64 keep a KV cache.
    hybrid = get_model("qwen3.8-27b")
    assert kv_cache_bytes(hybrid, 8192, 2) == 16 * 2 * 4 * 256 * 8192 * 2


def test_sliding_window_layers_count_their_ring_only():
    """Gemma 3 12B: 8 global layers keep every position, the 40 sliding ones window + chunk - 1 (the engine's
    WindowedCache), once the context is longer than that; so at 32K its fp16 KV cache is about a sixth of 48 full
    layers', and a 12 GB card holds a much longer context."""
    gemma = get_model("gemma-3-12b-it")
    per_position = 2 * 8 * 256 * 2
    assert kv_cache_bytes(gemma, 32768, 2, 512) == (8 * 32768 + 40 * (1024 + 511)) * per_position
    assert kv_cache_bytes(gemma, 1000, 2, 512) == 48 * 1000 * per_position  # shorter than the ring: as before
    estimate = estimate_memory(gemma, 32768, "gpu", REAL)
    assert estimate.kv_cache_bytes == (8 * 32768 + 40 * (1024 + REAL.gpu_prefill_chunk - 1)) * per_position
    fit = fit_model(gemma, pc(32, 26, [("RTX 3060", 12, 11.5)]), Preferences(), REAL)
    assert fit.level == "gpu" and fit.largest_context_that_fits > 32768


def test_a_q8_0_kv_cache_takes_34_bytes_per_32_values_so_a_longer_context_fits():
    """q8_0 on either device: 17/32 of the GPU's fp16 KV bytes, 17/64 of the CPU's float32 ones; the largest context
    that fits grows (to the model's own limit for an 8B model on a 12 GB card)."""
    qwen = get_model("qwen3-8b")
    full, q8 = (estimate_memory(qwen, 32768, "gpu", REAL, kv_cache=kind) for kind in ("full", "q8_0"))
    assert q8.kv_cache_bytes * 32 == full.kv_cache_bytes * 17 and full.vram_bytes - q8.vram_bytes > 2 * GIB
    assert q8.kv_cache_type == "q8_0" and "(q8_0, 32768 tokens)" in q8.explanation
    full, q8 = (estimate_memory(qwen, 4096, "cpu", REAL, kv_cache=kind) for kind in ("full", "q8_0"))
    assert q8.kv_cache_bytes * 64 == full.kv_cache_bytes * 17
    for card, full_largest, q8_largest in ((("RTX 3060", 12, 11.5), 39497, 40960), (("RTX 4060", 8, 7.5), 11922, 22374)):
        fits = [fit_model(qwen, pc(32, 26, [card]), Preferences(kv_cache=kind), REAL) for kind in ("full", "q8_0")]
        assert [(f.level, f.largest_context_that_fits) for f in fits] == [("gpu", full_largest), ("gpu", q8_largest)]
    assert q8_largest < 2 * full_largest and qwen.context_max == 40960


def test_the_kv_cache_types_are_the_engines():
    from typing import get_args

    from engine.backend import KV_CACHE_TYPES
    from engine.backend_numpy import NumpyBackend
    from setup_logic.engine_profile import KvCacheType

    assert get_args(KvCacheType) == KV_CACHE_TYPES
    cache = NumpyBackend().kv_cache(2, 4, 128, 64, "q8_0")
    assert cache.nbytes == 2 * 2 * 4 * 128 * 64 * REAL.kv_bytes_per_element_q8_0


def test_cpu_estimate_holds_float32_weights_and_counts_file_pages_as_reclaimable():
    smol = get_model("smollm2-135m-instruct")
    e = estimate_memory(smol, 2048, "cpu", TODAY)
    assert e.ram_weights_bytes == 134_515_008 * 4
    assert e.kv_cache_bytes == 30 * 2 * 3 * 64 * 2048 * 4
    assert e.vram_bytes == 0 and e.gpu_overhead_bytes == 0
    assert e.reclaimable_file_bytes == smol.file_bytes
    assert e.ram_required_bytes == e.ram_weights_bytes + e.kv_cache_bytes + e.workspace_bytes + e.ram_overhead_bytes
    assert e.ram_bytes == e.ram_required_bytes + smol.file_bytes
    assert e.ram_after_load_bytes == e.ram_required_bytes - e.kv_cache_bytes - e.workspace_bytes
    assert "float32 weights" in e.explanation and "2048 tokens" in e.explanation
    quantized = estimate_memory(smol, 2048, "cpu", TODAY.model_copy(update={"cpu_weights_dequantized_to_f32": False}))
    # The kernels' layout: Q4_1 with float32 scales, 24 bytes a group against 20, the larger of its types' ratios.
    assert quantized.ram_weights_bytes == round(smol.file_bytes * 24 / 20) and quantized.reclaimable_file_bytes == 0


def test_gpu_estimate_uploads_the_quantized_file():
    qwen = get_model("qwen3-8b")
    e = estimate_memory(qwen, 8192, "gpu", ENGINE)
    assert e.gpu_weights_bytes == 5_027_783_488 and e.ram_weights_bytes == 0
    assert e.vram_bytes == e.gpu_weights_bytes + e.kv_cache_bytes + e.workspace_bytes + e.gpu_overhead_bytes
    assert e.prompt_chunk == ENGINE.gpu_prefill_chunk == 2048
    assert e.workspace_bytes == workspace_bytes(qwen, 8192, ENGINE, on_gpu=True)
    # Chunk for chunk, the GPU's attention keeps partial sums, not the chunk's scores against the whole context as
    # NumPy does, and the GPU's prompt path holds fp16 scratch: the gate matrix dequantized, and the chunk's FFN
    # activations.
    fp16_scratch = 2 * (12288 * 4096 + 512 * 12288)
    gpu_512 = workspace_bytes(qwen, 8192, ENGINE, on_gpu=True, prompt_chunk=512)
    assert workspace_bytes(qwen, 8192, ENGINE, on_gpu=False) - gpu_512 == 4 * 512 * 32 * (8192 - 130) - fp16_scratch
    # A token more a chunk: its activations, its attention's partial sums and its fp16 copy of the widest input.
    per_token = 4 * activation_floats_per_token(qwen) + 4 * 32 * 130 + 2 * 12288
    assert e.workspace_bytes - gpu_512 == (2048 - 512) * per_token
    assert 600 * MIB <= e.gpu_overhead_bytes <= 700 * MIB
    assert e.ram_required_bytes == e.ram_overhead_bytes < 1 * GIB
    assert e.ram_bytes == e.ram_required_bytes + qwen.file_bytes
    assert e.ram_after_load_bytes == e.ram_required_bytes
    assert e.explanation.startswith("GPU: weights 4.7 GB + KV cache 1.1 GB (8192 tokens)")


def test_recurrent_state_is_counted_on_the_gpu():
    e = estimate_memory(get_model("qwen3.8-27b"), 4096, "gpu", ENGINE)
    assert e.recurrent_state_bytes == 156_893_184
    assert e.vram_bytes == (e.gpu_weights_bytes + e.kv_cache_bytes + e.recurrent_state_bytes + e.workspace_bytes
                            + e.gpu_overhead_bytes)
    assert "recurrent state" in e.explanation


def test_experts_split_between_gpu_and_ram():
    coder = get_model("qwen3-coder-30b-a3b-instruct")
    half = estimate_memory(coder, 8192, "gpu+ram", MOE_QUANT, expert_layers_in_ram=24)  # of 48
    in_ram = round(coder.expert_bytes / 2)
    assert half.gpu_weights_bytes == coder.file_bytes - in_ram
    # The CPU layout's bytes, at the largest ratio among the model's types (Q4_K, Q5_K, Q6_K, Q8_0): Q8_0's.
    assert half.ram_weights_bytes == round(in_ram * 36 / 34)
    assert half.reclaimable_file_bytes == coder.file_bytes
    f32 = estimate_memory(coder, 8192, "gpu+ram", MOE_F32, expert_layers_in_ram=24)
    assert f32.ram_weights_bytes == round(28.991029248e9 * 4 / 2)
    more = estimate_memory(coder, 8192, "gpu+ram", MOE_QUANT, expert_layers_in_ram=40)
    assert more.vram_bytes < half.vram_bytes and more.ram_required_bytes > half.ram_required_bytes
    assert more.ram_bytes - more.ram_required_bytes == half.ram_bytes - half.ram_required_bytes  # the file, read once
    assert "(the experts of 24 layers in RAM)" in half.explanation
    assert half.ram_expert_bytes_per_token == round(half.ram_weights_bytes * 8 / 128)  # 8 of 128 experts a token
    # The GPU also holds the buffer a long prompt copies one RAM layer's experts into (their CPU layout).
    assert half.expert_staging_bytes == round(half.ram_weights_bytes / 24)
    assert half.vram_bytes == (half.gpu_weights_bytes + half.expert_staging_bytes + half.kv_cache_bytes
                               + half.workspace_bytes + half.gpu_overhead_bytes + half.recurrent_state_bytes)
    assert estimate_memory(coder, 8192, "gpu", MOE_QUANT).expert_staging_bytes == 0
    # Q3_K's own layout on the CPU: 14.5 bytes a group against the file's 13.75, beside Q6_K's 26.5 against 26.25:
    # the largest ratio among the file's types.
    q3 = get_model("qwen3-30b-a3b")
    all_in_ram = estimate_memory(q3, 8192, "gpu+ram", MOE_QUANT, expert_layers_in_ram=q3.n_layers)
    assert all_in_ram.ram_weights_bytes == round(q3.expert_bytes * 116 / 110)


def test_estimate_refuses_impossible_placements():
    with pytest.raises(ValueError, match="not a mixture of experts"):
        estimate_memory(get_model("qwen3-8b"), 4096, "gpu+ram", MOE_F32, expert_layers_in_ram=1)
    for layers in (0, 49):
        with pytest.raises(ValueError, match="between 1 and 48"):
            estimate_memory(get_model("qwen3-30b-a3b"), 4096, "gpu+ram", MOE_F32, expert_layers_in_ram=layers)
    with pytest.raises(ValueError, match="at least 1"):
        estimate_memory(get_model("qwen3-8b"), 0, "gpu", ENGINE)


@pytest.mark.parametrize("card", [("RTX 3060", 12, 11.5), ("RTX 3080", 10, 9.5)], ids=lambda c: c[0])
def test_a_30b_a3b_on_a_12_gb_card_keeps_the_experts_of_the_fewest_layers_in_ram(card):
    """The engine's own profile: the fewest layers whose experts go to RAM so the rest fits the card (at the
    shortest prompt chunk), then the longest chunk that moves no more there, and a card that cannot hold even the
    parts that never leave the GPU is refused with what it would need."""
    model, prefs = get_model("qwen3-coder-30b-a3b-instruct"), Preferences(context_length=8192)
    fit = fit_model(model, pc(64, 58, [card]), prefs, REAL)
    layers, chunk = fit.memory.expert_layers_in_ram, fit.memory.prompt_chunk
    assert fit.level == "gpu+ram" and 1 <= layers < 48 and fit.context_length == 8192
    budget = 0.95 * card[2] * GIB
    assert fit.memory.vram_bytes <= budget
    fewer = estimate_memory(model, 8192, "gpu+ram", REAL, expert_layers_in_ram=layers - 1,
                            prompt_chunk=REAL.prefill_chunk)
    assert fewer.vram_bytes > budget
    assert f"with the experts of {layers} of its layers in RAM" in fit.reason
    assert REAL.prefill_chunk <= chunk <= REAL.gpu_prefill_chunk
    if chunk < REAL.gpu_prefill_chunk:
        longer = estimate_memory(model, 8192, "gpu+ram", REAL, expert_layers_in_ram=layers, prompt_chunk=2 * chunk)
        assert longer.vram_bytes > budget
    # What the whole layers and the chunk leave of the card holds each RAM layer's most picked experts: as many as
    # fit (the 10 GB card's leftover holds one).
    slots = fit.memory.expert_cache_slots
    assert slots > 0 or card[1] == 12
    assert slots == 0 or f"the GPU also holds the {slots} experts each of those layers picks most" in fit.reason
    one_more = estimate_memory(model, 8192, "gpu+ram", REAL, expert_layers_in_ram=layers, expert_cache_slots=slots + 1,
                               prompt_chunk=chunk)
    assert one_more.vram_bytes > budget
    assert fit.memory.expert_cache_bytes == round(model.expert_bytes * layers / 48 * slots / 128)
    uncached = estimate_memory(model, 8192, "gpu+ram", REAL, expert_layers_in_ram=layers)
    # (each side rounds once, from different products: a byte apart at most)
    assert abs(fit.memory.ram_expert_bytes_per_token - uncached.ram_expert_bytes_per_token * (1 - slots / 128)) <= 1
    without = fit_model(model, pc(64, 58, [card]), prefs,
                        REAL.model_copy(update={"hot_expert_cache": False}))
    assert without.memory.expert_cache_slots == 0 and without.memory.expert_layers_in_ram == layers
    small = fit_model(model, pc(16, 12, [("GT 1030", 2, 1.2)]), prefs, REAL)
    assert small.level == "none" and "of RAM with its experts in RAM" in small.reason


def test_largest_context_is_exactly_the_boundary():
    busy = pc(32, 26, [("RTX 4090", 24, 3.8)])
    fit = fit_model(get_model("qwen3-4b"), busy, Preferences(), ENGINE)
    assert fit.level == "gpu" and fit.context_length == fit.largest_context_that_fits < 8192
    budget = 0.95 * 3.8 * GIB
    qwen, largest = get_model("qwen3-4b"), fit.largest_context_that_fits
    # The boundary is the shortest prompt chunk's: a longer one spends memory the context could have.
    assert fit.memory.prompt_chunk == ENGINE.prefill_chunk
    assert estimate_memory(qwen, largest, "gpu", ENGINE, prompt_chunk=ENGINE.prefill_chunk).vram_bytes <= budget
    assert estimate_memory(qwen, largest + 1, "gpu", ENGINE, prompt_chunk=ENGINE.prefill_chunk).vram_bytes > budget
    assert estimate_memory(qwen, largest, "gpu", ENGINE, prompt_chunk=2 * ENGINE.prefill_chunk).vram_bytes > budget


# One row per made-up PC: (PC, goal, engine, extra preferences) -> (chosen id, level, context, words in the why).
TABLE = [
    ("8 GB RAM, no GPU", pc(8, 6), "chat", ENGINE, {},
     ("gemma-3-1b-it", "cpu", 8192, ["Runs on the CPU:", "of the 6 GB RAM available", "best model for chat"])),
    ("16 GB RAM, no GPU, no AVX2", pc(16, 13, avx2=False), "chat", ENGINE, {},
     ("gemma-3-1b-it", "cpu", 8192, ["Runs on the CPU", "AVX2 missing: CPU inference will be slow"])),
    # The NumPy CPU path reads float32 weights: models past ~2.5B parameters would answer at under 2 tokens/s.
    ("32 GB RAM, no GPU", pc(32, 28), "code", ENGINE, {},
     ("gemma-3-1b-it", "cpu", 8192, ["Runs on the CPU:", "of the 28 GB", "tokens/s", "no model made for code"])),
    ("64 GB RAM, no GPU", pc(64, 58), "quality", ENGINE, {},
     ("gemma-3-1b-it", "cpu", 8192, ["Runs on the CPU", "highest-quality"])),
    ("16 GB RAM, 8 GB card", pc(16, 12, [("RTX 4060", 8, 7.5)]), "speed", ENGINE, {},
     ("llama-3.2-3b-instruct", "gpu", 8192, ["Runs on the GPU (RTX 4060)", "fastest useful model", "1.9 GB"])),
    ("32 GB RAM, 8 GB card", pc(32, 26, [("RTX 4060", 8, 7.5)]), "code", ENGINE, {},
     ("qwen3-8b", "gpu", 8192, ["Runs on the GPU (RTX 4060): 6.9 GB of the 7.5 GB free VRAM"])),
    ("32 GB RAM, 12 GB card", pc(32, 26, [("RTX 3060", 12, 11.5)]), "chat", ENGINE, {},
     ("qwen3-14b", "gpu", 8192, ["Runs on the GPU (RTX 3060)", "best model for chat"])),
    ("64 GB RAM, 16 GB card", pc(64, 55, [("RTX 4080", 16, 15.3)]), "chat", ENGINE, {},
     ("qwen3-30b-a3b", "gpu", 8192, ["Runs on the GPU (RTX 4080): 14 GB of the 15 GB free VRAM"])),
    ("64 GB RAM, 24 GB card", pc(64, 55, [("RTX 4090", 24, 23.5)]), "code", ENGINE, {},
     ("qwen3-coder-30b-a3b-instruct", "gpu", 8192, ["Runs on the GPU (RTX 4090): 18 GB", "best model for code"])),
    ("128 GB RAM, 24 GB card", pc(128, 120, [("RTX 4090", 24, 23.5)]), "chat", ENGINE, {},
     ("qwen3-32b", "gpu", 8192, ["Runs on the GPU (RTX 4090): 22 GB of the 24 GB free VRAM"])),
    ("24 GB card, other programs hold 20.5 GB", pc(32, 26, [("RTX 4090", 24, 3.5)]), "chat", ENGINE, {},
     ("llama-3.2-3b-instruct", "gpu", 6739, ["of the 3.5 GB free VRAM", "context reduced from 8192 to fit"])),
    ("24 GB card, 32768 tokens asked", pc(32, 26, [("RTX 4090", 24, 23.5)]), "chat", ENGINE,
     {"context_length": 32768}, ("qwen3-30b-a3b-q4-k-m", "gpu", 32768, ["with 32768 tokens of context"])),
    ("no GPU detected, 12 GB VRAM override", pc(32, 26), "chat", ENGINE, {"vram_bytes_override": 12 * GIB},
     ("qwen3-14b", "gpu", 8192, ["the GPU given by the VRAM override", "of the 12 GB free VRAM"])),
    ("12 GB card, RAM override 8 GB", pc(128, 120, [("RTX 3060", 12, 11.5)]), "code", MOE_F32,
     {"ram_bytes_override": 8 * GIB}, ("qwen3-14b", "gpu", 8192, ["Runs on the GPU (RTX 3060)"])),
    ("12 GB card, 128 GB RAM, float32 experts in RAM", pc(128, 120, [("RTX 3060", 12, 11.5)]), "code", MOE_F32, {},
     ("qwen3-coder-30b-a3b-instruct", "gpu+ram", 8192, ["with the experts of 23 of its layers in RAM"])),
    ("8 GB card, 32 GB RAM, quantized experts in RAM", pc(32, 26, [("RTX 4060", 8, 7.5)]), "code", MOE_QUANT, {},
     ("qwen3-coder-30b-a3b-instruct", "gpu+ram", 8192, ["with the experts of 35 of its layers in RAM"])),
]


@pytest.mark.parametrize("label,report,goal,engine,extra,expected", TABLE, ids=[row[0] for row in TABLE])
def test_recommendation_table(label, report, goal, engine, extra, expected):
    model_id, level, context, words = expected
    rec = recommend(report, load_catalog(), Preferences(goal=goal, **extra), engine)
    choice = rec.choice
    assert (choice.model_id, choice.level, choice.context_length) == (model_id, level, context), choice.why
    for word in words:
        assert word in choice.why
    assert rec.summary.startswith(choice.name)
    assert choice.memory.context_length == context
    # Every alternative fits too, and none of them is the choice.
    assert all(a.model_id != model_id and a.level in ("gpu", "gpu+ram", "cpu") for a in rec.alternatives)
    # Supported models are either chosen, alternatives or explained as not fitting.
    listed = {model_id} | {a.model_id for a in rec.alternatives} | {r.id for r in rec.not_fitting}
    assert listed | {r.id for r in rec.not_supported} == {m.id for m in load_catalog()}


def test_runners_up_are_ranked_and_explained():
    rec = recommend(pc(64, 55, [("RTX 4090", 24, 23.5)]), load_catalog(), Preferences(goal="code"), ENGINE)
    assert [a.model_id for a in rec.alternatives[:4]] == ["qwen3-32b", "qwen3-30b-a3b-q4-k-m", "qwen3-30b-a3b",
                                                         "qwen3-14b"]
    assert all(a.why.startswith("Runs on the GPU (RTX 4090)") for a in rec.alternatives)
    # The models the test engine cannot run are listed with what is missing, never picked.
    unsupported = {r.id: r.reason for r in rec.not_supported}
    assert unsupported["qwen3.8-27b"] == "Needs the qwen35 architecture, which the engine does not run yet."
    assert unsupported["gpt-oss-20b"] == (
        "Needs the gpt-oss architecture and the tensor type MXFP4, which the engine does not run yet.")


def test_todays_engine_runs_only_the_embedded_llama_model():
    rec = recommend(pc(64, 55, [("RTX 4090", 24, 23.5)]), load_catalog(), Preferences(), TODAY)
    assert rec.choice.model_id == "smollm2-135m-instruct" and rec.alternatives == []
    reasons = {r.id: r.reason for r in rec.not_supported}
    assert reasons["gemma-3-270m"] == (
        "Needs the gemma3 architecture and tensor types Q4_K, Q5_0, Q6_K, which the engine does not run yet.")
    assert reasons["llama-3.2-3b-instruct"] == "Needs tensor types Q4_K, Q6_K, which the engine does not run yet."
    assert len(reasons) == len(load_catalog()) - 1


def test_nothing_fits_a_tiny_pc():
    rec = recommend(pc(1, 0.5), load_catalog(), Preferences(), ENGINE)
    assert rec.choice is None and rec.alternatives == []
    assert rec.summary.startswith("No supported model in the catalog fits this PC")
    smol = next(r for r in rec.not_fitting if r.id == "smollm2-135m-instruct")
    assert smol.reason.startswith("Too big for this PC even with 2048 tokens of context: it needs")
    assert "of RAM on the CPU (0.5 GB available)" in smol.reason


def test_context_longer_than_the_model_allows_is_refused_per_model():
    prefs = Preferences(goal="code", context_length=49152)
    rec = recommend(pc(64, 55, [("RTX 4090", 24, 23.5)]), load_catalog(), prefs, ENGINE)
    assert rec.choice.model_id == "qwen3-coder-30b-a3b-instruct"  # 262,144 tokens; the Qwen3 dense stop at 40,960
    reason = next(r.reason for r in rec.not_fitting if r.id == "qwen3-8b")
    assert reason == "It handles at most 40960 tokens of context, fewer than the 49152 asked for."
    # Longer still, the coder's KV cache no longer fits the card: asked-for contexts are never cut. Gemma 3 12B's
    # does (its sliding-window layers keep only their window), so the best other model is now a bigger one.
    rec = recommend(pc(64, 55, [("RTX 4090", 24, 23.5)]), load_catalog(), Preferences(goal="code", context_length=65536), ENGINE)
    assert rec.choice.model_id == "gemma-3-12b-it" and rec.choice.context_length == 65536
    assert "no model made for code fits, so the best other model" in rec.choice.why
    reason = next(r.reason for r in rec.not_fitting if r.id == "qwen3-coder-30b-a3b-instruct")
    assert reason.startswith("Too big for the GPU even with 65536 tokens of context: it needs 23 GB of VRAM on the GPU")
    assert "Too slow on this PC's CPU" in reason


def test_small_models_keep_their_own_maximum():
    fit = fit_model(get_model("gemma-3-1b-it"), pc(64, 55), Preferences(), ENGINE)
    assert fit.level == "cpu" and fit.largest_context_that_fits == 32768


def test_installed_models_are_flagged():
    rec = recommend(pc(32, 26, [("RTX 4060", 8, 7.5)]), load_catalog(), Preferences(goal="code"), ENGINE,
                    installed_ids={"qwen3-8b"})
    assert rec.choice.installed and not any(a.installed for a in rec.alternatives)


def test_models_too_slow_for_the_cpu_path_are_explained():
    rec = recommend(pc(128, 120), load_catalog(), Preferences(goal="quality"), ENGINE)
    slow = {r.id: r.reason for r in rec.not_fitting}
    assert "Too slow on this PC's CPU" in slow["qwen3-8b"] and "tokens/s" in slow["qwen3-8b"]
    assert "on an NVIDIA GPU it would run far faster" in slow["qwen3-8b"]
    assert rec.choice is not None and rec.choice.level == "cpu"


def test_types_without_a_gpu_kernel_keep_a_model_off_the_gpu():
    gpu_today = ENGINE.model_copy(update={"gpu_tensor_types": {"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                                                               "Q8_0", "Q4_K", "Q5_K", "Q6_K"}})
    rec = recommend(pc(64, 55, [("RTX 4080", 16, 15.3)]), load_catalog(), Preferences(goal="chat"), gpu_today)
    assert rec.choice.model_id != "qwen3-30b-a3b"  # its Q3_K tensors have no GPU kernel
    reason = next(r.reason for r in rec.not_fitting if r.id == "qwen3-30b-a3b")
    assert reason.startswith("On the GPU: the GPU kernels do not cover its Q3_K tensors yet.")
    assert "Too slow on this PC's CPU" in reason
    small = fit_model(get_model("qwen3-4b"), pc(64, 55, [("RTX 4080", 16, 15.3)]), Preferences(), gpu_today)
    assert small.level == "gpu"
    no_gemma = gpu_today.model_copy(update={"gpu_architectures": {"llama", "qwen3"}})
    gemma = fit_model(get_model("gemma-3-1b-it"), pc(64, 55, [("RTX 4080", 16, 15.3)]), Preferences(), no_gemma)
    assert gemma.level == "cpu"
    assert "because the GPU path does not run the gemma3 architecture yet" in gemma.reason


def test_budgets_come_from_the_best_gpu_and_available_ram():
    report = pc(64, 40, [("RTX 3060", 12, 11), ("RTX 4080", 16, 4)])
    rec = recommend(report, load_catalog(), Preferences(), ENGINE)
    assert rec.vram_budget_bytes == 11 * GIB and rec.ram_budget_bytes == 40 * GIB
    rec = recommend(report, load_catalog(), Preferences(vram_bytes_override=0, ram_bytes_override=GIB * 20), ENGINE)
    assert rec.vram_budget_bytes == 0 and rec.choice.level == "cpu"


def test_a_gpu_older_than_the_kernels_need_is_not_offered():
    # A Pascal card (compute capability 6.1): the engine's GPU kernels need 7.5, so the fit must plan for the CPU,
    # as `start` would then load there, rather than promise the GPU.
    pascal = pc(32, 26, [("GTX 1080", 8, 7.5)], capability="6.1")
    rec = recommend(pascal, load_catalog(), Preferences(), REAL)
    assert rec.vram_budget_bytes == 0
    assert rec.choice is not None and rec.choice.level == "cpu"
    turing = pc(32, 26, [("RTX 2080", 8, 7.5)], capability="7.5")
    assert recommend(turing, load_catalog(), Preferences(), REAL).choice.level in ("gpu", "gpu+ram")


def test_the_profile_is_what_the_engine_does(smollm2_gguf):
    # The profile's facts are the engine's own: a load without a context takes the profile's default, the
    # workspace holds the profile's prompt chunk, and the CPU cache has the profile's element size.
    from engine.model import load_model

    model = load_model(smollm2_gguf, device="cpu")
    try:
        assert model.info.context_length == min(REAL.default_context, model.info.max_context_length)
        state = model._live_state()
        assert state.workspace.max_chunk == REAL.prefill_chunk
        assert state.cache.dtype.itemsize == REAL.kv_bytes_per_element_cpu
    finally:
        model.close()


MEASURE = """
import sys, psutil
from engine.model import load_model
process = psutil.Process()
before = process.memory_info().rss
model = load_model(sys.argv[1], device="cpu", context_length=int(sys.argv[2]))
print(process.memory_info().rss - before)
"""


@pytest.mark.slow
@pytest.mark.parametrize(("model_id", "fixture", "context"), [
    ("smollm2-135m-instruct", "smollm2_gguf", 2048),
    ("smollm2-135m-instruct", "smollm2_gguf", 8192),
    ("gemma-3-270m", "gemma3_gguf", 4096),
])
def test_cpu_estimate_matches_what_the_engine_allocates(model_id, fixture, context, request):
    """Loading a model on the CPU grows the process by the estimate's ram_after_load_bytes, within 15%."""
    path = request.getfixturevalue(fixture)
    out = subprocess.run([sys.executable, "-c", MEASURE, str(path), str(context)], capture_output=True,
                         text=True, check=True)
    grown = int(out.stdout.strip().splitlines()[-1])
    engine = TODAY.model_copy(update={"cpu_weights_dequantized_to_f32": REAL.cpu_weights_dequantized_to_f32})
    estimate = estimate_memory(get_model(model_id), context, "cpu", engine)
    assert abs(grown - estimate.ram_after_load_bytes) <= 0.15 * grown, (grown, estimate.explanation)


def test_the_cpu_path_holds_quantized_weights_at_their_file_size():
    # The engine's own profile: the CPU keeps the GGUF's blocks in its kernels' layout, so a 3B model fits 8 GB of
    # RAM at about its file size (a K-quant's own byte scales; the legacy types' float32 scales take at most a third
    # more), and the speed the fit quotes comes from the quantized kernels' measured rate.
    rec = recommend(pc(8, 6.4), load_catalog(), Preferences(goal="chat"), REAL)
    choice = rec.choice
    assert choice is not None and choice.level == "cpu" and choice.quant.endswith("_K_M")
    assert choice.download_bytes < choice.memory.ram_weights_bytes <= 1.06 * choice.download_bytes
    assert "weights" in choice.memory.explanation and "float32" not in choice.memory.explanation
    assert "tokens/s" in choice.why
    assert all(a.download_bytes < a.memory.ram_weights_bytes <= 4 / 3 * a.download_bytes for a in rec.alternatives)


def test_start_loads_with_the_fits_placement(monkeypatch, tmp_path):
    """start's device, context and experts placement come from the same fit as choose_model's, within vram_gb when
    given; a vram_gb the model cannot fit in is refused with the fit's reason."""
    from types import SimpleNamespace

    from strata_mcp.runtime import UserError
    from strata_mcp.tools import start

    monkeypatch.setattr(start, "probe", lambda *args: pc(64, 58, [("RTX 4090", 24, 23.5)]))
    runtime = SimpleNamespace(store=SimpleNamespace(data_dir=tmp_path))
    coder = "qwen3-coder-30b-a3b-instruct"
    # It fits the card, with the GPU's longest prompt chunk.
    assert start._fitted(runtime, coder, start.StartInput(model=coder)) == ("auto", 8192, 0, 0, 2048)
    device, context, layers, slots, chunk = start._fitted(runtime, coder, start.StartInput(model=coder, vram_gb=11.5))
    # As choose_model's 12 GB card row says: 2,048-token chunks would move a layer more to RAM.
    assert (device, context, layers, slots, chunk) == ("auto", 8192, 23, 0, 1024)
    monkeypatch.setattr(start, "probe", lambda *args: pc(16, 12, [("RTX 4090", 24, 23.5)]))
    with pytest.raises(UserError, match="does not fit in 0.5 GB of GPU memory"):
        start._fitted(runtime, coder, start.StartInput(model=coder, vram_gb=0.5))
    # A q8_0 KV cache lets an 8B model hold 16K tokens in 7.5 GB, which the full cache cannot.
    qwen = start.StartInput(model="qwen3-8b", vram_gb=7.5, context_length=16384)
    with pytest.raises(UserError, match="does not fit in 7.5 GB"):
        start._fitted(runtime, "qwen3-8b", qwen)
    q8 = qwen.model_copy(update={"kv_cache": "q8_0"})
    assert start._fitted(runtime, "qwen3-8b", q8)[:4] == ("auto", 16384, 0, 0)
    assert start._fitted(runtime, "qwen3-8b", qwen.model_copy(update={"device": "cpu", "vram_gb": None}))[4] is None


def test_types_without_a_cpu_kernel_make_a_model_too_slow_for_the_cpu_and_keep_its_experts_off_ram():
    """IQ3_XXS has no CPU kernel: a token's products dequantize its rows for BLAS, two orders of magnitude slower than
    the kernels (fit.py), so the CPU path does not offer such a file, nor computes its experts for the GPU."""
    xxs = get_model("qwen3.6-35b-a3b").model_copy(
        update={"quant": "UD-IQ3_XXS", "tensor_types": ["F32", "IQ3_XXS", "Q4_K", "Q6_K", "Q8_0"]})
    fit = fit_model(xxs, pc(64, 60), Preferences(), REAL)
    assert fit.level == "none" and "the CPU has no kernel for its IQ3_XXS tensors" in fit.reason
    for kernels in ("qwen3-coder-30b-a3b-instruct", "qwen3-30b-a3b"):  # Q4_K/Q5_K/Q6_K/Q8_0, and Q3_K
        assert fit_model(get_model(kernels), pc(64, 60), Preferences(), REAL).level == "cpu"
    # Q3_K's layout takes about its file's bytes: 13 GB of Q3_K_S fits 23 GB of RAM on the CPU.
    assert fit_model(get_model("qwen3-30b-a3b"), pc(24, 23), Preferences(), REAL).level == "cpu"
    small = pc(64, 60, [("RTX 4070", 12, 11.5)])
    xxs_on_gpu = REAL.model_copy(update={"gpu_tensor_types": REAL.gpu_tensor_types | {"IQ3_XXS"}})
    assert fit_model(xxs, small, Preferences(context_length=8192), xxs_on_gpu).level != "gpu+ram"
    coder = fit_model(get_model("qwen3-coder-30b-a3b-instruct"), small, Preferences(context_length=8192), REAL)
    assert coder.level == "gpu+ram"


def test_qwen3_235b_a22b_is_offered_where_ram_and_vram_hold_it():
    """The 104 GB UD-Q3_K_XL file (Q3_K, Q4_K, Q5_K and Q6_K, each about its file's bytes in the CPU's layout) with
    most of its experts in RAM: a 24 GB card beside 96 GB of RAM, or a 12 GB one beside 128 GB; not 64 GB of RAM."""
    model = get_model("qwen3-235b-a22b")
    for ram, card in ((96, ("RTX 4090", 24, 23.5)), (128, ("RTX 3060", 12, 11.5))):
        fit = fit_model(model, pc(ram, ram - 6, [card]), Preferences(), REAL)
        assert fit.level == "gpu+ram" and fit.context_length == 8192, fit.reason
        assert fit.memory.ram_required_bytes <= 0.95 * (ram - 6) * GIB
        ratio = max(REAL.cpu_bytes_per_file_byte[t] for t in ("Q3_K", "Q4_K", "Q5_K", "Q6_K"))
        layers = fit.memory.expert_layers_in_ram
        assert fit.memory.ram_weights_bytes == round(round(model.expert_bytes * layers / model.n_layers) * ratio)
    assert fit_model(model, pc(64, 58, [("RTX 4090", 24, 23.5)]), Preferences(), REAL).level == "none"


def test_experts_in_ram_give_the_speed_this_pcs_ram_allows():
    """Every expert byte a token reads in RAM comes through it, so the measured bandwidth over those bytes bounds
    decode; the placement does not depend on it, and without a measurement the reason gives no number."""
    model, card = get_model("qwen3-30b-a3b"), ("RTX 3060", 12, 11.5)
    fit = fit_model(model, pc(64, 58, [card], ram_read=40 * 10**9), Preferences(), REAL)
    assert fit.level == "gpu+ram"
    per_token = fit.memory.ram_expert_bytes_per_token
    assert per_token > 0 and fit.tokens_per_s_bound == round(40e9 / per_token, 1)
    layers = fit.memory.expert_layers_in_ram
    assert (f"up to about {fit.tokens_per_s_bound:.1f} tokens/s, as this PC's RAM reads 37 GB/s (measured) and a "
            f"token reads {gb(per_token)} of experts there") in fit.reason
    unknown = fit_model(model, pc(64, 58, [card]), Preferences(), REAL)
    assert unknown.memory == fit.memory and unknown.tokens_per_s_bound is None
    assert "so RAM bandwidth sets the speed" in unknown.reason and "tokens/s" not in unknown.reason
    # RAM that gives 1.5 tokens/s: not offered with experts in RAM, and the CPU path, reading more there, neither.
    slow = fit_model(model, pc(64, 58, [card], ram_read=round(1.5 * per_token)), Preferences(), REAL)
    assert slow.level == "none" and slow.tokens_per_s_bound is None
    assert (f"Too slow with the experts of {layers} of its layers in RAM: up to about 1.5 tokens/s, as this PC's "
            "RAM reads") in slow.reason
    assert "Too slow on this PC's CPU" in slow.reason and "with its experts in RAM" not in slow.reason
    assert slow.reason.endswith(f"tokens/s, as this PC's RAM reads {gb(round(1.5 * per_token))}/s (measured).")
    rec = recommend(pc(64, 58, [card], ram_read=round(1.5 * per_token)), [model], Preferences(), REAL)
    assert rec.choice is None and rec.not_fitting[0].reason == slow.reason


def test_the_recommendation_of_a_model_with_experts_in_ram_says_how_fast_it_can_be():
    """Quality first: a 24 GB card beside 96 GB of RAM picks the 235B with most of its experts in RAM, and says the
    bound both in the summary and in why."""
    rec = recommend(pc(96, 90, [("RTX 4090", 24, 23.5)], ram_read=60 * 10**9), load_catalog(),
                    Preferences(goal="quality"), REAL)
    choice = rec.choice
    assert (choice.model_id, choice.level) == ("qwen3-235b-a22b", "gpu+ram")
    assert choice.tokens_per_s_bound == round(60e9 / choice.memory.ram_expert_bytes_per_token, 1)
    assert f"(up to about {choice.tokens_per_s_bound:.1f} tokens/s)" in rec.summary
    assert f"up to about {choice.tokens_per_s_bound:.1f} tokens/s, as this PC's RAM reads 56 GB/s" in choice.why


def test_iq3_s_runs_on_the_cpus_kernels_at_about_twice_its_file():
    """IQ3_S takes Q6_K's layout on the CPU (engine/cpu/layout.py): the 15.3 GB Qwen3.6-35B-A3B file is offered on
    the CPU of a 64 GB PC, holding about 1.93 times its bytes, and no longer fits 23 GB of RAM."""
    model = get_model("qwen3.6-35b-a3b")
    fit = fit_model(model, pc(64, 60), Preferences(), REAL)
    assert fit.level == "cpu"
    assert fit.memory.ram_weights_bytes == round(model.file_bytes * 212 / 110)
    assert fit_model(model, pc(24, 23), Preferences(), REAL).level == "none"


def _base_arrays(x, seen: dict) -> dict:
    """Every array under x (dataclasses, dicts, sequences), by its base array, whose bytes it shares."""
    import dataclasses

    import numpy as np

    if isinstance(x, np.ndarray):
        while x.base is not None:
            x = x.base
        seen[id(x)] = x
    elif dataclasses.is_dataclass(x):
        for f in dataclasses.fields(x):
            _base_arrays(getattr(x, f.name), seen)
    elif isinstance(x, (dict, list, tuple)):
        for v in x.values() if isinstance(x, dict) else x:
            _base_arrays(v, seen)
    return seen


@pytest.mark.parametrize("arch", ["qwen3", "qwen3moe", "qwen35", "qwen35moe"])
def test_workspace_counts_the_buffers_the_engine_allocates(tmp_path, arch):
    """A prompt chunk's buffers as the fit counts them (activation_floats_per_token a token and the last logits)
    against the engine's own workspace for a small synthetic model of each kind, loaded on the CPU: the same bytes,
    the chunk's token ids aside."""
    from bench.make_synthetic_gguf import type_mix, write_model
    from engine import load_model
    from setup_logic.fit import activation_floats_per_token

    shape = dict(arch=arch, hidden=256, layers=4, ffn=256, heads=4, kv_heads=1, head_dim=64, vocab=300, tied=False,
                 context=512)
    geometry = dict(n_embd=256, n_ff=256, n_heads=4, n_kv_heads=1, head_dim=64, vocab_size=300, n_layers=4,
                    kv_layers=None, linear_attention=None, recurrent_state_bytes=0, n_ff_shared=None)
    if arch.endswith("moe"):
        shape.update(experts=8, experts_used=2)
        geometry.update(n_experts=8, n_experts_used=2, expert_params_b=0.001)
    if arch.startswith("qwen35"):
        shape.update(rope_dims=16, linear=(2, 4, 64))
        geometry.update(linear_attention={"key_heads": 2, "value_heads": 4, "key_dim": 64, "value_dim": 64},
                        kv_layers=1)
    if arch == "qwen35moe":
        shape.update(shared=256)
        geometry.update(n_ff_shared=256)
    path = tmp_path / f"{arch}.gguf"
    write_model(path, shape, type_mix("Q4_K_M"), "synthetic")
    model = load_model(path, device="cpu", context_length=512)
    ws = model._state.workspace
    allocated = sum(a.nbytes for a in _base_arrays(ws, {}).values()) - ws.ids.nbytes
    model.close()
    entry = get_model("qwen3.8-27b").model_dump() | geometry
    catalog_model = type(get_model("qwen3.8-27b")).model_validate(entry)
    assert allocated == 4 * (ws.max_chunk * activation_floats_per_token(catalog_model) + shape["vocab"])


@pytest.mark.parametrize("model_id", ["qwen3.8-27b", "qwen3.6-35b-a3b"])
def test_the_delta_rules_gpu_scratch_is_counted(model_id):
    """The fit's count of the chunked delta rule's GPU scratch is the engine's (kernel_names.delta_chunk_scratch),
    and it is in the GPU workspace: at the 27B shape about 138 MB for a 2,048-token chunk."""
    import numpy as np

    from engine.kernels.kernel_names import DELTA_CHUNK_SCRATCH_TYPES, delta_chunk_scratch
    from setup_logic.fit import delta_chunk_scratch_bytes

    model = get_model(model_id)
    la, chunk = model.linear_attention, REAL.gpu_prefill_chunk
    engine = sum(int(np.prod(shape)) * np.dtype(t).itemsize for shape, t in
                 zip(delta_chunk_scratch(chunk, la.value_heads, la.key_dim, la.value_dim), DELTA_CHUNK_SCRATCH_TYPES))
    assert delta_chunk_scratch_bytes(model, chunk, REAL) == engine
    dense = model.model_copy(update={"linear_attention": None})
    gpu = workspace_bytes(model, 8192, REAL, on_gpu=True) - workspace_bytes(dense, 8192, REAL, on_gpu=True)
    assert gpu > engine
    if model_id == "qwen3.8-27b":
        assert 138e6 < engine < 139e6
