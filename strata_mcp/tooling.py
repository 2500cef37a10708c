"""How a tool is declared once and served twice: over MCP and in the `strata` CLI.

A tool is a `ToolSpec`: a pydantic input model, a pydantic output model and a plain
synchronous `run(runtime, args, reporter)` function. The MCP side runs `run` on a worker
thread, turns the reporter's progress into `notifications/progress`, and turns a
client's cancellation into `reporter.cancelled()`; the CLI calls `run` directly.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any

import anyio
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.types import ToolAnnotations
from pydantic import BaseModel, Field, ValidationError

from strata_mcp.runtime import USER_ERRORS, Runtime, UserError

PROGRESS_INTERVAL_S = 0.25


class Reporter:
    """Progress and cancellation as a tool body sees them, whoever called it."""

    def __init__(self, on_progress: Callable[[float, float | None, str], None] | None = None):
        self._on_progress = on_progress
        self._cancel = threading.Event()
        self.latest: tuple[float, float | None, str] | None = None

    def progress(self, done: float, total: float | None = None, message: str = "") -> None:
        self.latest = (done, total, message)
        if self._on_progress is not None:
            self._on_progress(done, total, message)

    def cancel(self) -> None:
        self._cancel.set()

    def cancelled(self) -> bool:
        return self._cancel.is_set()

    @property
    def cancel_event(self) -> threading.Event:
        return self._cancel


@dataclass(frozen=True)
class ToolSpec:
    name: str
    title: str
    description: str
    input_model: type[BaseModel]
    output_model: type[BaseModel]
    run: Callable[[Runtime, Any, Reporter], BaseModel]
    annotations: ToolAnnotations


def validation_message(error: ValidationError) -> str:
    """One readable sentence per problem, naming the argument."""
    parts = []
    for item in error.errors():
        where = ".".join(str(p) for p in item["loc"]) or "arguments"
        parts.append(f"{where}: {item['msg']}")
    return "Invalid arguments: " + "; ".join(parts) + "."


def parse_args(spec: ToolSpec, raw: dict[str, Any]) -> BaseModel:
    try:
        return spec.input_model.model_validate(raw)
    except ValidationError as exc:
        raise UserError(validation_message(exc)) from None


def _signature_from_model(model: type[BaseModel]) -> list[inspect.Parameter]:
    """Flat tool parameters taken from the input model's fields, so the model is the one schema."""
    params = []
    for name, field in model.model_fields.items():
        annotation = Annotated[(field.annotation, *field.metadata, Field(description=field.description))]
        default = inspect.Parameter.empty if field.is_required() else field.get_default(call_default_factory=True)
        params.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation))
    return params


async def _run_in_thread(spec: ToolSpec, runtime: Runtime, args: BaseModel, ctx: Context) -> BaseModel:
    """Run the tool body on a thread; pump its progress to the client; stop it on cancellation."""
    reporter = Reporter()
    outcome: dict[str, Any] = {}
    finished = threading.Event()

    def body() -> None:
        try:
            outcome["result"] = spec.run(runtime, args, reporter)
        except BaseException as exc:  # handed to the event loop below
            outcome["error"] = exc
        finally:
            finished.set()

    threading.Thread(target=body, name=f"tool-{spec.name}", daemon=True).start()
    sent: tuple[float, float | None, str] | None = None
    last_progress = -1.0

    async def send_latest() -> None:
        nonlocal sent, last_progress
        latest = reporter.latest
        if latest is not None and latest != sent:
            # The spec asks for strictly increasing progress values.
            value = max(latest[0], last_progress + 1e-6)
            await ctx.report_progress(value, latest[1], latest[2] or None)
            sent, last_progress = latest, value

    try:
        while not finished.is_set():
            await anyio.sleep(PROGRESS_INTERVAL_S)
            await send_latest()
    finally:
        if not finished.is_set():
            reporter.cancel()  # the client cancelled: the body sees it and winds down cleanly
    await send_latest()  # work shorter than one interval still reports where it ended
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]


def register(server: MCPServer, runtime: Runtime, spec: ToolSpec) -> None:
    async def tool(ctx: Context, **raw: Any) -> BaseModel:
        try:
            args = parse_args(spec, raw)
            return await _run_in_thread(spec, runtime, args, ctx)
        except USER_ERRORS as exc:
            raise ToolError(str(exc)) from None

    ctx_param = inspect.Parameter("ctx", inspect.Parameter.KEYWORD_ONLY, annotation=Context)
    tool.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [ctx_param, *_signature_from_model(spec.input_model)], return_annotation=spec.output_model
    )
    tool.__name__ = spec.name
    server.add_tool(
        tool,
        name=spec.name,
        title=spec.title,
        description=spec.description,
        annotations=spec.annotations,
        structured_output=True,
    )
