"""check_pc: what this PC has, and whether it can run a local model."""

from __future__ import annotations

from mcp.types import ToolAnnotations
from pydantic import BaseModel, Field

from setup_logic.hardware import PcReport, probe
from strata_mcp.runtime import Runtime, engine_profile
from strata_mcp.tooling import Reporter, ToolInput, ToolSpec


class CheckPcInput(ToolInput):
    """check_pc takes no arguments."""


class CheckPcOutput(BaseModel):
    summary: str = Field(description="One line: the verdict.")
    pc: PcReport


def run(runtime: Runtime, args: CheckPcInput, reporter: Reporter) -> CheckPcOutput:
    report = probe(runtime.store.data_dir, engine_profile())
    return CheckPcOutput(summary=report.verdict, pc=report)


SPEC = ToolSpec(
    name="check_pc",
    title="Check this PC",
    description=(
        "Inspect this PC for running a local language model: OS, CPU and its vector flags (AVX2, AVX-512), "
        "RAM and its read bandwidth (measured), free disk where models are stored, NVIDIA/AMD GPUs with VRAM, "
        "driver and compute capability, and a verdict with reasons. No GPU is a normal result: small models then "
        "run on the CPU. Call this first, then choose_model."
    ),
    input_model=CheckPcInput,
    output_model=CheckPcOutput,
    run=run,
    annotations=ToolAnnotations(readOnlyHint=True, openWorldHint=False),
)
