"""logs: the last lines of the server's own log (loads, HTTP requests, errors, timings)."""

from __future__ import annotations

from mcp.types import ToolAnnotations
from pydantic import BaseModel, Field

from strata_mcp.runtime import Runtime
from strata_mcp.server_log import log_path, tail
from strata_mcp.tooling import Reporter, ToolInput, ToolSpec


class LogsInput(ToolInput):
    lines: int = Field(50, ge=1, le=1000, description="How many of the newest lines to return.")


class LogsOutput(BaseModel):
    summary: str
    path: str = Field(description="The log file (it rotates: older lines move to .1, .2, .3 beside it).")
    lines: list[str] = Field(description="Oldest first.")


def run(runtime: Runtime, args: LogsInput, reporter: Reporter) -> LogsOutput:
    path = log_path(runtime.store)
    lines = tail(path, args.lines)
    summary = f"The last {len(lines)} lines of the log." if lines else f"Nothing logged yet ({path})."
    return LogsOutput(summary=summary, path=str(path), lines=lines)


SPEC = ToolSpec(
    name="logs",
    title="Server log",
    description=(
        "The last lines of Strata's own log: model loads, every HTTP request to the local endpoint (tokens, "
        "speeds, why it stopped), errors. Use it when an app connected to the endpoint misbehaves."
    ),
    input_model=LogsInput,
    output_model=LogsOutput,
    run=run,
    annotations=ToolAnnotations(readOnlyHint=True, openWorldHint=False),
)
