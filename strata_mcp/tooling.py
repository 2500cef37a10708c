"""How a tool is declared once and served twice: over MCP and in the `strata` CLI.

A tool is a `ToolSpec`: a pydantic input model, a pydantic output model and a plain
synchronous `run(runtime, args, reporter)` function. The MCP side runs `run` on a worker
thread (anyio), forwards the reporter's progress as `notifications/progress` as it comes,
and turns a client's cancellation into `reporter.cancelled()`; the CLI calls `run` directly.
Whatever goes wrong reaches the caller as one line of sentences (`failure_sentence`).
"""

from __future__ import annotations

import inspect
import logging
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any

import anyio
import anyio.lowlevel
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError, UnexpectedToolError
from mcp.types import CallToolResult, TextContent, ToolAnnotations
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from strata_mcp.runtime import USER_ERRORS, Runtime, UserError

log = logging.getLogger(__name__)
MAX_MESSAGE_CHARS = 400
MAX_PROBLEMS_SHOWN = 3


class Reporter:
    """Progress and cancellation as a tool body sees them, whoever called it."""

    def __init__(self, on_progress: Callable[[float, float | None, str], None] | None = None):
        self._on_progress = on_progress
        self._cancel = threading.Event()

    def progress(self, done: float, total: float | None = None, message: str = "") -> None:
        if self._on_progress is not None:
            self._on_progress(done, total, message)

    def cancel(self) -> None:
        self._cancel.set()

    def cancelled(self) -> bool:
        return self._cancel.is_set()


class ToolInput(BaseModel):
    """A tool's arguments: an unknown one is refused by name, not silently dropped."""

    model_config = ConfigDict(extra="forbid")


@dataclass(frozen=True)
class ToolSpec:
    name: str
    title: str
    description: str
    input_model: type[BaseModel]
    output_model: type[BaseModel]
    run: Callable[[Runtime, Any, Reporter], BaseModel]
    annotations: ToolAnnotations


# -- one line for every failure ------------------------------------------------------------------

def _squash(text: str, limit: int) -> str:
    text = re.sub(r"\s+", " ", text).strip()
    return text if len(text) <= limit else text[: limit - 3].rstrip() + "..."


def one_line(text: str) -> str:
    """`text` on one line, at most MAX_MESSAGE_CHARS long, ending with a full stop."""
    text = _squash(text, MAX_MESSAGE_CHARS - 1)
    return text if text.endswith(".") else text + "."


def _name(loc: tuple) -> str:
    where = ".".join(str(p) for p in loc)
    return repr(where[:40] + "...") if len(where) > 40 or not where.isprintable() else where


def _problem(spec: ToolSpec, item: dict) -> str:
    where = _name(item["loc"])
    if item["type"] == "missing":
        return f"{where} is required"
    if item["type"] == "extra_forbidden":
        known = ", ".join(spec.input_model.model_fields) or "no arguments"
        return f"{where} is not an argument of {spec.name} (it takes {known})"
    message = item["msg"].removeprefix("Value error, ")
    return f"{where}: {message}" if where else message[:1].upper() + message[1:]


def validation_message(spec: ToolSpec, error: ValidationError) -> str:
    """One sentence per problem, each naming the argument (not pydantic's multi-line dump)."""
    problems = [_problem(spec, item) + "." for item in error.errors(include_url=False)]
    if len(problems) > MAX_PROBLEMS_SHOWN:
        problems[MAX_PROBLEMS_SHOWN:] = [f"{len(problems) - MAX_PROBLEMS_SHOWN} more problem(s) after these."]
    return one_line(" ".join(problems))


def parse_args(spec: ToolSpec, raw: dict[str, Any]) -> BaseModel:
    try:
        return spec.input_model.model_validate(raw)
    except ValidationError as exc:
        raise UserError(validation_message(spec, exc)) from None


def failure_sentence(tool: str, exc: BaseException) -> str:
    """What the caller reads: the sentence of an error a person can fix, else a bug report request."""
    if isinstance(exc, USER_ERRORS):
        return one_line(str(exc))
    detail = _squash(f"{type(exc).__name__}: {str(exc).strip().rstrip('.')}", MAX_MESSAGE_CHARS // 2)
    return f"{tool} failed unexpectedly: {detail}; this is a bug, report it."


# -- serving over MCP ------------------------------------------------------------------------------

class _ProgressForwarder:
    """Hands the body's progress to the event loop as it comes. The body's thread blocks on the loop only when
    no update is waiting to be sent, so a fast producer (a chat's tokens) is never held up per token."""

    def __init__(self, ctx: Context):
        self._ctx = ctx
        self._token = anyio.lowlevel.current_token()
        self._lock = threading.Lock()
        self._latest: tuple[float, float | None, str] | None = None
        self._waiting = False
        self._wake = anyio.Event()
        self._last_value = -1.0

    def push(self, done: float, total: float | None, message: str) -> None:
        with self._lock:
            self._latest = (done, total, message)
            if self._waiting:
                return
            self._waiting = True
        anyio.from_thread.run_sync(lambda: self._wake.set(), token=self._token)

    async def send_pending(self) -> None:
        with self._lock:
            latest, self._latest, self._waiting = self._latest, None, False
        if latest is not None:
            # The spec asks for strictly increasing progress values.
            value = max(latest[0], self._last_value + 1e-6)
            self._last_value = value
            await self._ctx.report_progress(value, latest[1], latest[2] or None)

    async def forward(self) -> None:
        while True:
            await self._wake.wait()
            self._wake = anyio.Event()
            await self.send_pending()


async def run_on_thread(spec: ToolSpec, runtime: Runtime, args: BaseModel, ctx: Context) -> BaseModel:
    """Run the tool body on a worker thread while a task forwards its progress; a cancelled request tells the body
    through `reporter.cancelled()` and leaves it to wind down on its thread."""
    forwarder = _ProgressForwarder(ctx)
    reporter = Reporter(forwarder.push)

    def body() -> tuple[BaseModel | None, Exception | None]:
        try:
            return spec.run(runtime, args, reporter), None
        except Exception as exc:  # raised below, outside the task group (which would wrap it in a group)
            return None, exc

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(forwarder.forward)
        try:
            result, error = await anyio.to_thread.run_sync(body, abandon_on_cancel=True)
        except anyio.get_cancelled_exc_class():
            reporter.cancel()
            raise
        tasks.cancel_scope.cancel()
    if error is not None:
        raise error
    await forwarder.send_pending()  # work that ended before the forwarder ran still reports where it ended
    return result


def _signature_from_model(model: type[BaseModel]) -> list[inspect.Parameter]:
    """Flat tool parameters taken from the input model's fields, so the model is the one schema."""
    params = []
    for name, field in model.model_fields.items():
        annotation = Annotated[(field.annotation, *field.metadata, Field(description=field.description))]
        default = inspect.Parameter.empty if field.is_required() else field.get_default(call_default_factory=True)
        params.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation))
    return params


def _error_result(message: str) -> CallToolResult:
    return CallToolResult(content=[TextContent(type="text", text=message)], is_error=True)


class ToolServer(MCPServer):
    """An MCP server whose tools are ToolSpecs: arguments are checked by the tool's own input model, and every
    failure (a bad argument, an error a person can fix, a crash, a data folder that could not be opened) comes
    back as one line, not the SDK's "Error executing tool X" or pydantic's multi-line dump."""

    def __init__(self, *args: Any, startup_error: str | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.specs: dict[str, ToolSpec] = {}
        self.startup_error = startup_error

    def add_spec(self, runtime: Runtime | None, spec: ToolSpec) -> None:
        async def tool(ctx: Context, **raw: Any) -> BaseModel:
            return await run_on_thread(spec, runtime, parse_args(spec, raw), ctx)

        ctx_param = inspect.Parameter("ctx", inspect.Parameter.KEYWORD_ONLY, annotation=Context)
        tool.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
            [ctx_param, *_signature_from_model(spec.input_model)], return_annotation=spec.output_model
        )
        tool.__name__ = spec.name
        self.specs[spec.name] = spec
        self.add_tool(tool, name=spec.name, title=spec.title, description=spec.description,
                      annotations=spec.annotations, structured_output=True)

    async def call_tool(self, name: str, arguments: dict[str, Any], context: Context | None = None):
        spec = self.specs.get(name)
        if spec is None:
            return await super().call_tool(name, arguments, context)
        if self.startup_error is not None:
            return _error_result(self.startup_error)
        try:
            parse_args(spec, arguments)  # first, so the SDK's own check never answers with its dump
            return await super().call_tool(name, arguments, context)
        except UserError as exc:
            return _error_result(str(exc))
        except ToolError as exc:
            cause = exc.__cause__ or exc
            if isinstance(cause, ValidationError) and not isinstance(exc, UnexpectedToolError):  # the SDK's argument check
                return _error_result(validation_message(spec, cause))
            if not isinstance(cause, USER_ERRORS):
                log.error("Tool %s crashed", name, exc_info=cause)
            return _error_result(failure_sentence(name, cause))
