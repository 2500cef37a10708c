"""Pydantic views of the engine slot that start, stop and status share."""

from __future__ import annotations

import dataclasses
import typing

from pydantic import BaseModel, ConfigDict, Field, create_model

from engine import GenerationResult
from setup_logic.fit import MemoryEstimate
from strata_mcp.runtime import EngineSlot, EngineState, measure_memory


class MemoryReport(BaseModel):
    process_rss_bytes: int = Field(description="Resident memory of the server process now.")
    process_growth_bytes: int | None = Field(None, description="How much the process grew since just before the load.")
    gpu_used_bytes: int | None = Field(None, description="Memory in use on the first NVIDIA GPU (NVML), all processes.")
    gpu_growth_bytes: int | None = Field(None, description="How much GPU memory use grew since just before the load.")
    engine_host_bytes: int | None = Field(None, description="Host memory the engine's own buffers hold.")
    engine_device_bytes: int | None = Field(None, description="GPU memory the engine's own buffers hold.")
    estimated_after_load_bytes: int | None = Field(
        None, description="choose_model's estimate of the growth right after loading (RAM on the CPU, VRAM on the GPU)."
    )
    estimated_full_context_bytes: int | None = Field(
        None, description="The same estimate once the whole context is in use (the CPU fills its KV cache lazily)."
    )


class LoadProgressView(BaseModel):
    done: int
    total: int
    message: str


def _timings_model() -> type[BaseModel]:
    """The engine's GenerationResult without the text and finish reason: derived, so the two cannot drift apart."""
    hints = typing.get_type_hints(GenerationResult)
    fields = {
        f.name: (hints[f.name], Field(description=TIMING_NOTES.get(f.name)))
        for f in dataclasses.fields(GenerationResult) if f.name not in ("text", "finish_reason")
    }
    return create_model(
        "ChatTimings", __config__=ConfigDict(from_attributes=True), __doc__="Token counts and speeds of one chat.", **fields
    )


TIMING_NOTES = {
    "cached_prompt_tokens": "Prompt tokens reused from the previous turn's KV cache.",
    "prompt_tokens_per_second": "Uncached prompt tokens per second of prompt processing.",
    "output_tokens_per_second": "Generated tokens per second of decoding.",
}
ChatTimings = _timings_model()


class ExpertCacheView(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    slots_per_layer: int = Field(description="experts of each layer in RAM the GPU holds as well")
    layers: int = Field(description="layers in RAM with such slots")
    device_bytes: int
    experts_cached: int = Field(description="slots filled so far (the cache fills as tokens are decoded)")
    picks: int = Field(description="experts picked by decoded tokens in those layers so far")
    hits: int = Field(description="of those picks, the ones the GPU computed from its cache")
    recent_hit_rate: float | None = Field(description="the share of the last few dozen tokens' picks the cache served")
    swaps: int = Field(description="experts copied into the cache so far")


class EngineStatus(BaseModel):
    state: EngineState
    model: str | None = None
    backend: str | None = None
    backend_reason: str | None = None
    context_length: int | None = None
    kv_cache_type: str | None = Field(None, description="full (fp16 on the GPU, float32 on the CPU) or q8_0")
    prompt_chunk: int | None = Field(None, description="the most prompt tokens the engine runs at once")
    expert_layers_in_ram: int | None = Field(
        None, description="MoE layers whose routed experts live in RAM, computed by the CPU (the rest is on the GPU)"
    )
    expert_cache: ExpertCacheView | None = Field(
        None, description="the GPU's cache of the most picked experts of the layers in RAM, and how often it served"
    )
    load_progress: LoadProgressView | None = None
    load_seconds: float | None = None
    error: str | None = None
    memory: MemoryReport | None = None
    last_chat: ChatTimings | None = None


def memory_report(slot: EngineSlot, estimate: MemoryEstimate | None = None) -> MemoryReport:
    now = measure_memory()
    before = slot.memory_before_load
    report = MemoryReport(process_rss_bytes=now.process_rss_bytes, gpu_used_bytes=now.gpu_used_bytes)
    if estimate is not None:
        on_gpu = estimate.level != "cpu"
        report.estimated_after_load_bytes = estimate.vram_bytes if on_gpu else estimate.ram_after_load_bytes
        report.estimated_full_context_bytes = estimate.vram_bytes if on_gpu else estimate.ram_bytes
    if before is not None:
        report.process_growth_bytes = now.process_rss_bytes - before.process_rss_bytes
        if now.gpu_used_bytes is not None and before.gpu_used_bytes is not None:
            report.gpu_growth_bytes = now.gpu_used_bytes - before.gpu_used_bytes
    if slot.model is not None:
        used = slot.model.memory_in_use()
        report.engine_host_bytes, report.engine_device_bytes = used.host_bytes, used.device_bytes
    return report


def engine_status(slot: EngineSlot, estimate: MemoryEstimate | None = None) -> EngineStatus:
    status = EngineStatus(state=slot.state, model=slot.model_id, error=slot.error, load_seconds=slot.load_seconds)
    if slot.state == "loading":
        status.load_progress = LoadProgressView(done=slot.load.done, total=slot.load.total, message=slot.load.message)
    if slot.model is not None:
        info = slot.model.info
        status.backend, status.backend_reason, status.context_length = info.backend, info.backend_reason, info.context_length
        status.kv_cache_type, status.prompt_chunk = info.kv_cache_type, info.prompt_chunk
        status.expert_layers_in_ram = info.expert_layers_in_ram or None
        cache = slot.model.expert_cache()
        if cache is not None:
            status.expert_cache = ExpertCacheView.model_validate(cache)
    if slot.state != "stopped":
        status.memory = memory_report(slot, estimate)
    if slot.last_chat is not None:
        status.last_chat = ChatTimings.model_validate(slot.last_chat)
    return status
