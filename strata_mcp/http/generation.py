"""What both APIs share between a parsed request and the engine: the model check, the prompt (the GGUF's chat
template, with the tool definitions), stop sequences, the queue, streaming from the engine's thread to the
event loop, the cancel when the client goes away, and the log line of every request."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from engine import GenerationSettings, LoadedModel
from engine.generate import StopStringFilter
from strata_mcp.http.tool_calls import ToolCall, parse_tool_calls, template_supports_tools
from strata_mcp.reports import ChatTimings
from strata_mcp.runtime import USER_ERRORS, GaveUp, ModelUnavailable, Runtime


class ApiError(Exception):
    """A request the endpoint refuses; each API writes it in its own error shape."""

    def __init__(self, status: int, kind: str, message: str, code: str | None = None):
        super().__init__(message)
        self.status, self.kind, self.message, self.code = status, kind, message, code


def api_error(exc: BaseException) -> ApiError:
    """The ApiError for what running a request raised: a full context or bad messages are the request's
    fault (400), no model is the server's state (503)."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, ModelUnavailable):
        return ApiError(503, "unavailable", str(exc), "model_not_loaded")
    if isinstance(exc, USER_ERRORS):
        return ApiError(400, "invalid_request", str(exc))
    return ApiError(500, "server", f"The engine failed: {exc!r}. `strata logs` shows the server's log.")


def loaded_model_id(runtime: Runtime, requested: str | None) -> str:
    """The id of the loaded model, which the request must name (or leave out)."""
    slot = runtime.slot
    if slot.state not in ("ready", "busy") or slot.model_id is None:
        state = "still loading" if slot.state == "loading" else "loaded"
        raise ApiError(503, "unavailable", f"No model is {state} yet; start one with the start tool or "
                       "`strata serve MODEL`, then retry.", "model_not_loaded")
    if requested and requested != slot.model_id:
        raise ApiError(404, "not_found", f"The model {requested!r} is not loaded here; use {slot.model_id!r} "
                       "(GET /v1/models lists it).", "model_not_found")
    return slot.model_id


@dataclass
class Job:
    """One request, in the engine's terms: messages (chat) or prompt (raw text), tools, settings, stops."""

    model_id: str
    settings: GenerationSettings
    messages: list[dict[str, Any]] | None = None
    prompt: str | None = None
    tools: list[dict[str, Any]] | None = None
    stop: list[str] = field(default_factory=list)

    def prompt_tokens(self, model: LoadedModel) -> list[int]:
        """The prompt as the engine runs it: a raw prompt as text, a conversation through the model's chat template
        (with the tool definitions), what its messages say encoded as plain text."""
        if self.messages is None:
            return model.tokenizer.encode(self.prompt or "")
        template = model.chat_template
        if template is None:
            raise ApiError(400, "invalid_request", f"{self.model_id} is a base model with no chat template; "
                           "send a raw prompt to /v1/completions instead.")
        if self.tools and not template_supports_tools(template.source):
            raise ApiError(400, "invalid_request", f"The chat template of {self.model_id} has no place for tools; "
                           "send the request without tools, or load a model that supports them (Qwen3).")
        return model.chat_tokens(self.messages, tools=self.tools or None)


@dataclass
class Outcome:
    text: str
    finish: str  # "stop" (end of turn), "stop_sequence", "length", "tool_calls" or "cancelled"
    stop_sequence: str | None
    tool_calls: list[ToolCall]
    prompt_tokens: int
    completion_tokens: int
    timings: ChatTimings


class _StopSequences:
    """The request's stop strings, watched here rather than in the engine so the answer can say which one
    ended it (the engine is asked to stop as soon as one appears)."""

    def __init__(self, stops: list[str], on_text: Callable[[str], None]):
        self._stops = stops
        self._raw = ""
        self._filter = StopStringFilter(stops, on_text)
        self.matched: str | None = None

    def feed(self, piece: str) -> None:
        if self.matched is not None:
            return
        self._raw += piece
        if self._filter.feed(piece):
            cut = len(self._filter.text)
            self.matched = next(s for s in self._stops if s and self._raw.startswith(s, cut))

    def finish(self) -> str:
        self._filter.finish()
        return self._filter.text


def count_prompt_tokens(runtime: Runtime, job: Job) -> int:
    model = runtime.slot.model
    if model is None:
        raise ModelUnavailable("No model is loaded; start one and retry.")
    return len(job.prompt_tokens(model))


def _check_fits(model: LoadedModel, prompt_tokens: int) -> None:
    context = model.info.context_length
    if prompt_tokens >= context:
        raise ApiError(400, "invalid_request", f"The prompt is {prompt_tokens} tokens but the context holds only "
                       f"{context}, with room for the answer; shorten the conversation, or load the model with a "
                       "longer context_length.", "context_length_exceeded")


def _run(runtime: Runtime, job: Job, emit: Callable[[str, Any], None], gone: threading.Event) -> Outcome:
    """Wait for the engine, then generate; emit("start", prompt tokens) and emit("text", piece) as it goes."""
    with runtime.queued_chat(gone.is_set) as (model, cancel):
        prompt = job.prompt_tokens(model)
        _check_fits(model, len(prompt))
        emit("start", len(prompt))
        stops = _StopSequences(job.stop, lambda piece: emit("text", piece))
        result = model.generate(
            prompt, job.settings, on_text=stops.feed,
            should_stop=lambda: stops.matched is not None or gone.is_set() or cancel.is_set(),
        )
    text = stops.finish()
    finish = "stop_sequence" if stops.matched is not None else result.finish_reason
    calls: list[ToolCall] = []
    if job.tools:
        text, calls = parse_tool_calls(text)
        if calls:
            finish = "tool_calls"
    timings = ChatTimings.model_validate(result)
    runtime.record_chat(model, result)
    return Outcome(text, finish, stops.matched, calls, result.prompt_tokens, result.completion_tokens, timings)


class Generation:
    """A job on its own thread, its events handed to the event loop: ("start", prompt tokens), ("text",
    piece)... then ("done", Outcome). cancel() (the client went away) leaves the queue or stops the engine."""

    def __init__(self, runtime: Runtime, job: Job, endpoint: str):
        self._runtime, self._job, self._endpoint = runtime, job, endpoint
        self._gone = threading.Event()
        self._queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        loop = asyncio.get_running_loop()

        def emit(kind: str, value: Any) -> None:
            try:
                loop.call_soon_threadsafe(self._queue.put_nowait, (kind, value))
            except RuntimeError:  # the server's loop has closed: nobody is listening any more
                pass

        def body() -> None:
            try:
                outcome = _run(runtime, job, emit, self._gone)
            except GaveUp:
                runtime.log.info("%s: the client left while waiting in the queue", endpoint)
                return
            except BaseException as exc:  # handed to the request's task, which answers with it
                runtime.log.warning("%s failed: %s", endpoint, exc)
                emit("error", exc)
                return
            self._log(outcome)
            emit("done", outcome)

        threading.Thread(target=body, name="http-generation", daemon=True).start()

    def _log(self, o: Outcome) -> None:
        finish = "cancelled (the client left)" if self._gone.is_set() and o.finish == "cancelled" else o.finish
        t = o.timings
        self._runtime.log.info(
            "%s %s: %d prompt tokens (%d cached) at %.0f tokens/s, %d output tokens at %.1f tokens/s, %s",
            self._endpoint, self._job.model_id, t.prompt_tokens, t.cached_prompt_tokens,
            t.prompt_tokens_per_second, t.completion_tokens, t.output_tokens_per_second, finish,
        )

    def cancel(self) -> None:
        self._gone.set()

    async def events(self) -> AsyncIterator[tuple[str, Any]]:
        try:
            while True:
                kind, value = await self._queue.get()
                if kind == "error":
                    raise api_error(value)
                yield kind, value
                if kind == "done":
                    return
        finally:
            self._gone.set()  # stopped listening early (the client left): stop the engine too

    async def _watching(self, receive, awaitable):
        """Await `awaitable`, cancelling the generation if the client disconnects meanwhile (while it waits
        in the queue, say)."""

        async def cancel_on_disconnect() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            self.cancel()

        watcher = asyncio.ensure_future(cancel_on_disconnect())
        try:
            return await awaitable
        finally:
            watcher.cancel()

    async def started(self, receive) -> tuple[AsyncIterator[tuple[str, Any]], int]:
        """Wait for the generation to start and return (the rest of its events, prompt tokens). An error before
        the start (a full context, no model) thus still gets its own HTTP status, not a broken stream."""
        events = self.events()
        _, prompt_tokens = await self._watching(receive, anext(events))  # ("start", tokens) comes first
        return events, prompt_tokens

    async def outcome(self, receive) -> Outcome:
        """The finished answer."""

        async def last() -> Outcome:
            async for kind, value in self.events():
                if kind == "done":
                    return value
            raise ApiError(500, "server", "The generation ended without an answer.")

        return await self._watching(receive, last())
