"""stop: unload the model and free its memory."""

from __future__ import annotations

from mcp.types import ToolAnnotations
from pydantic import BaseModel, Field

from strata_mcp.reports import MemoryReport, memory_report
from strata_mcp.runtime import EngineSlot, Runtime
from strata_mcp.tooling import Reporter, ToolInput, ToolSpec


class StopInput(ToolInput):
    force: bool = Field(False, description="Also cancel a chat that is running (otherwise stop refuses while busy).")


class StopOutput(BaseModel):
    summary: str
    stopped_model: str | None
    memory_before: MemoryReport | None = Field(None, description="Memory just before unloading.")
    memory_after: MemoryReport | None = Field(None, description="Memory after unloading, measured (RSS and NVML), not assumed.")


def run(runtime: Runtime, args: StopInput, reporter: Reporter) -> StopOutput:
    slot = runtime.slot
    if slot.state == "stopped":
        return StopOutput(summary="No model was loaded; nothing to stop.", stopped_model=None)
    before = memory_report(slot)
    previous = runtime.stop_model(args.force)
    after = memory_report(EngineSlot(memory_before_load=previous.memory_before_load))
    freed = before.process_rss_bytes - after.process_rss_bytes
    gpu = ""
    if before.gpu_used_bytes is not None and after.gpu_used_bytes is not None:
        gpu = f", GPU memory in use fell by {(before.gpu_used_bytes - after.gpu_used_bytes) / 2**20:.0f} MiB"
    return StopOutput(
        summary=f"Stopped {previous.model_id}; process memory fell by {freed / 2**20:.0f} MiB{gpu}.",
        stopped_model=previous.model_id,
        memory_before=before,
        memory_after=after,
    )


SPEC = ToolSpec(
    name="stop",
    title="Stop (unload) the model",
    description=(
        "Unload the loaded model and free its RAM and GPU memory; reports memory before and after, measured. "
        "Refuses while a chat is running unless force=true, which cancels that chat first."
    ),
    input_model=StopInput,
    output_model=StopOutput,
    run=run,
    annotations=ToolAnnotations(readOnlyHint=False, destructiveHint=True, idempotentHint=True, openWorldHint=False),
)
