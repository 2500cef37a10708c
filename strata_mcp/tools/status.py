"""status: what is loaded, what it is doing, memory, last speeds, installs."""

from __future__ import annotations

from mcp.types import ToolAnnotations
from pydantic import BaseModel, Field

from setup_logic.install import InstallProgress
from setup_logic.store import InstalledModel
from strata_mcp.reports import EngineStatus, engine_status
from strata_mcp.runtime import Runtime
from strata_mcp.tooling import Reporter, ToolInput, ToolSpec


class StatusInput(ToolInput):
    """status takes no arguments."""


class StatusOutput(BaseModel):
    summary: str
    engine: EngineStatus
    installed: list[InstalledModel]
    installs: list[InstallProgress] = Field(description="Install jobs of this server run, finished or not.")
    data_dir: str
    warnings: list[str] = Field(default_factory=list, description="Problems found on the way, e.g. a damaged list of installed models.")


def run(runtime: Runtime, args: StatusInput, reporter: Reporter) -> StatusOutput:
    slot = runtime.slot
    engine = engine_status(slot, runtime.memory_estimate(slot))
    installed = runtime.store.installed()
    installs = runtime.installer.jobs()
    if engine.state == "stopped":
        head = "No model loaded"
    else:
        head = f"{engine.model}: {engine.state}" + (f" on {engine.backend}" if engine.backend else "")
        head += " with a q8_0 KV cache" if engine.kv_cache_type == "q8_0" else ""
    running = [j for j in installs if j.state in ("queued", "downloading", "verifying")]
    unverified = sum(not m.verified for m in installed)
    summary = (f"{head}; {len(installed)} model(s) installed" + (f" ({unverified} unverified)" if unverified else "")
               + (f"; {len(running)} install(s) running" if running else "") + ".")
    warnings = [runtime.store.registry_warning] if runtime.store.registry_warning else []
    return StatusOutput(
        summary=summary, engine=engine, installed=installed, installs=installs,
        data_dir=str(runtime.store.data_dir), warnings=warnings,
    )


SPEC = ToolSpec(
    name="status",
    title="Status",
    description=(
        "What the engine is doing (stopped, loading, ready, busy, failed), which model on which backend, "
        "memory in use (measured, next to the estimate), the last chat's speeds, the installed models and "
        "any install in progress."
    ),
    input_model=StatusInput,
    output_model=StatusOutput,
    run=run,
    annotations=ToolAnnotations(readOnlyHint=True, openWorldHint=False),
)
