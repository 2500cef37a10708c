"""The OpenAI-compatible API: GET /v1/models, POST /v1/chat/completions, POST /v1/completions."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from engine import GenerationSettings
from strata_mcp.http.generation import ApiError, Generation, Job, Outcome, loaded_model_id
from strata_mcp.http.tool_calls import ToolCallHold
from strata_mcp.http.web import EventStream, handler, read_json, sse

_ERROR_TYPES = {
    "invalid_request": "invalid_request_error", "not_found": "invalid_request_error",
    "auth": "authentication_error", "unavailable": "server_error", "server": "server_error",
}
_FINISH = {"stop": "stop", "stop_sequence": "stop", "length": "length", "tool_calls": "tool_calls", "cancelled": "stop"}


def error_body(error: ApiError) -> dict[str, Any]:
    return {"error": {"message": error.message, "type": _ERROR_TYPES[error.kind], "param": None, "code": error.code}}


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")  # clients send fields this server has no use for


class TextPart(_Open):
    type: Literal["text"]
    text: str


class FunctionCall(_Open):
    name: str
    arguments: str


class ToolCallIn(_Open):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Open):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None

    def for_template(self) -> dict[str, Any]:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or [])
        message: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": text}
        if self.tool_calls:
            message["tool_calls"] = [c.model_dump(include={"id", "type", "function"}) for c in self.tool_calls]
        if self.tool_call_id:
            message["tool_call_id"] = self.tool_call_id
        return message


class Function(_Open):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(_Open):
    type: Literal["function"]
    function: Function


class StreamOptions(_Open):
    include_usage: bool = False


class Sampling(_Open):
    model: str | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    max_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Literal[1] = 1

    def job(self, runtime, max_tokens: int | None, **kinds) -> Job:
        model_id = loaded_model_id(runtime, self.model)
        context = runtime.slot.model.info.context_length
        defaults = GenerationSettings()
        settings = GenerationSettings(
            max_tokens=max_tokens or context,  # no limit asked: up to the end of the context
            temperature=defaults.temperature if self.temperature is None else self.temperature,
            top_p=self.top_p or defaults.top_p, seed=self.seed,
        )
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > 16:
            raise ApiError(400, "invalid_request", "stop holds more than 16 sequences; send at most 16.")
        return Job(model_id, settings, stop=stops, **kinds)


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list[Tool] | None = None
    tool_choice: Any = None

    def chat_job(self, runtime) -> Job:
        tools = None if self.tool_choice == "none" or not self.tools else [t.model_dump() for t in self.tools]
        return self.job(runtime, self.max_completion_tokens or self.max_tokens,
                        messages=[m.for_template() for m in self.messages], tools=tools)


class CompletionRequest(Sampling):
    prompt: str


def _usage(o: Outcome) -> dict[str, Any]:
    return {
        "prompt_tokens": o.prompt_tokens, "completion_tokens": o.completion_tokens,
        "total_tokens": o.prompt_tokens + o.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": o.timings.cached_prompt_tokens},
    }


def _tool_calls(o: Outcome) -> list[dict[str, Any]]:
    return [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
            for c in o.tool_calls]


def _message(o: Outcome) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": o.text if o.text or not o.tool_calls else None}
    if o.tool_calls:
        message["tool_calls"] = _tool_calls(o)
    return message


def _head(kind: str, prefix: str, model: str) -> dict[str, Any]:
    return {"id": f"{prefix}{uuid.uuid4().hex}", "object": kind, "created": int(time.time()), "model": model}


async def models(request: Request) -> Response:
    slot = request.app.state.runtime.slot
    data = []
    if slot.state in ("ready", "busy") and slot.model_id:
        data.append({"id": slot.model_id, "object": "model", "created": int(time.time()), "owned_by": "strata"})
    return JSONResponse({"object": "list", "data": data})


async def chat_completions(request: Request) -> Response:
    runtime = request.app.state.runtime
    body = await read_json(request, ChatRequest)
    job = body.chat_job(runtime)
    generation = Generation(runtime, job, "POST /v1/chat/completions")
    if not body.stream:
        o = await generation.outcome(request.receive)
        head = _head("chat.completion", "chatcmpl-", job.model_id)
        choice = {"index": 0, "message": _message(o), "finish_reason": _FINISH[o.finish], "logprobs": None}
        return JSONResponse({**head, "choices": [choice], "usage": _usage(o)})
    events, _ = await generation.started(request.receive)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return EventStream(generation, _chat_chunks(events, job, include_usage))


async def _chat_chunks(events: AsyncIterator, job: Job, include_usage: bool) -> AsyncIterator[str]:
    head = _head("chat.completion.chunk", "chatcmpl-", job.model_id)

    def chunk(delta: dict[str, Any], finish: str | None = None) -> str:
        return sse({**head, "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]})

    yield chunk({"role": "assistant", "content": ""})
    hold = ToolCallHold() if job.tools else None
    async for kind, value in events:
        if kind == "text":
            text = hold.feed(value) if hold else value
            if text:
                yield chunk({"content": text})
        elif kind == "done":
            if value.tool_calls:
                calls = [{"index": i, **call} for i, call in enumerate(_tool_calls(value))]
                yield chunk({"tool_calls": calls})
            elif hold and (rest := hold.rest()):
                yield chunk({"content": rest})
            yield chunk({}, _FINISH[value.finish])
            if include_usage:
                yield sse({**head, "choices": [], "usage": _usage(value)})
    yield sse("[DONE]")


async def completions(request: Request) -> Response:
    runtime = request.app.state.runtime
    body = await read_json(request, CompletionRequest)
    job = body.job(runtime, body.max_tokens, prompt=body.prompt)
    generation = Generation(runtime, job, "POST /v1/completions")
    head = _head("text_completion", "cmpl-", job.model_id)
    if not body.stream:
        o = await generation.outcome(request.receive)
        choice = {"index": 0, "text": o.text, "finish_reason": _FINISH[o.finish], "logprobs": None}
        return JSONResponse({**head, "choices": [choice], "usage": _usage(o)})
    events, _ = await generation.started(request.receive)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)

    async def chunks() -> AsyncIterator[str]:
        async for kind, value in events:
            if kind == "text":
                yield sse({**head, "choices": [{"index": 0, "text": value, "finish_reason": None, "logprobs": None}]})
            elif kind == "done":
                yield sse({**head, "choices": [{"index": 0, "text": "", "finish_reason": _FINISH[value.finish], "logprobs": None}]})
                if include_usage:
                    yield sse({**head, "choices": [], "usage": _usage(value)})
        yield sse("[DONE]")

    return EventStream(generation, chunks())


def routes() -> list[Route]:
    return [
        Route("/v1/models", handler(models, error_body), methods=["GET"]),
        Route("/v1/chat/completions", handler(chat_completions, error_body), methods=["POST"]),
        Route("/v1/completions", handler(completions, error_body), methods=["POST"]),
    ]
