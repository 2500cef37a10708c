"""The Anthropic-compatible API: POST /v1/messages and POST /v1/messages/count_tokens."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from engine import GenerationSettings
from strata_mcp.http.generation import ApiError, Generation, Job, Outcome, count_prompt_tokens, loaded_model_id
from strata_mcp.http.tool_calls import ToolCallHold
from strata_mcp.http.web import EventStream, handler, read_json, sse

_ERROR_TYPES = {
    "invalid_request": "invalid_request_error", "not_found": "not_found_error", "auth": "authentication_error",
    "unavailable": "overloaded_error", "server": "api_error",
}
_STOP_REASONS = {"stop": "end_turn", "stop_sequence": "stop_sequence", "length": "max_tokens",
                 "tool_calls": "tool_use", "cancelled": "end_turn"}


def error_body(error: ApiError) -> dict[str, Any]:
    return {"type": "error", "error": {"type": _ERROR_TYPES[error.kind], "message": error.message}}


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")  # cache_control and other fields this server has no use for


class TextBlock(_Open):
    type: Literal["text"]
    text: str


class ToolUseBlock(_Open):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(_Open):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool = False

    def text(self) -> str:
        text = self.content if isinstance(self.content, str) else "".join(b.text for b in self.content)
        return f"Error: {text}" if self.is_error else text


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock, Field(discriminator="type")]


class Message(_Open):
    role: Literal["user", "assistant"]
    content: str | list[Block]

    def for_template(self) -> list[dict[str, Any]]:
        """Engine messages: tool results become `tool` messages (before the user's text), tool uses the
        assistant message's tool_calls."""
        if isinstance(self.content, str):
            return [{"role": self.role, "content": self.content}]
        text = "".join(b.text for b in self.content if isinstance(b, TextBlock))
        if self.role == "assistant":
            calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": b.input}}
                     for b in self.content if isinstance(b, ToolUseBlock)]
            return [{"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})}]
        results = [{"role": "tool", "content": b.text(), "tool_call_id": b.tool_use_id}
                   for b in self.content if isinstance(b, ToolResultBlock)]
        return results + ([{"role": "user", "content": text}] if text or not results else [])


class Tool(_Open):
    name: str
    description: str | None = None
    input_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})

    def for_template(self) -> dict[str, Any]:
        function = {"name": self.name, "description": self.description or "", "parameters": self.input_schema}
        return {"type": "function", "function": function}


class CountRequest(_Open):
    model: str | None = None
    system: str | list[TextBlock] | None = None
    messages: list[Message] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: dict[str, Any] | None = None

    def conversation(self) -> list[dict[str, Any]]:
        messages = [m for message in self.messages for m in message.for_template()]
        if self.system:
            system = self.system if isinstance(self.system, str) else "".join(b.text for b in self.system)
            messages.insert(0, {"role": "system", "content": system})
        return messages

    def tool_definitions(self) -> list[dict[str, Any]] | None:
        if not self.tools or (self.tool_choice or {}).get("type") == "none":
            return None
        return [t.for_template() for t in self.tools]


class MessagesRequest(CountRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] = Field(default_factory=list, max_length=16)
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    stream: bool = False

    def job(self, runtime) -> Job:
        defaults = GenerationSettings()
        settings = GenerationSettings(
            max_tokens=self.max_tokens,
            temperature=defaults.temperature if self.temperature is None else self.temperature,
            top_p=self.top_p or defaults.top_p, top_k=defaults.top_k if self.top_k is None else self.top_k,
        )
        return Job(loaded_model_id(runtime, self.model), settings, messages=self.conversation(),
                   tools=self.tool_definitions(), stop=list(self.stop_sequences))


def _content(o: Outcome) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = [{"type": "text", "text": o.text}] if o.text or not o.tool_calls else []
    return blocks + [{"type": "tool_use", "id": c.id, "name": c.name, "input": c.arguments} for c in o.tool_calls]


def _usage(o: Outcome) -> dict[str, Any]:
    return {"input_tokens": o.prompt_tokens, "output_tokens": o.completion_tokens,
            "cache_read_input_tokens": o.timings.cached_prompt_tokens}


def _message_head(model: str, input_tokens: int) -> dict[str, Any]:
    return {"id": f"msg_{uuid.uuid4().hex[:24]}", "type": "message", "role": "assistant", "model": model,
            "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": input_tokens, "output_tokens": 0}}


async def messages(request: Request) -> Response:
    runtime = request.app.state.runtime
    body = await read_json(request, MessagesRequest)
    job = body.job(runtime)
    generation = Generation(runtime, job, "POST /v1/messages")
    if not body.stream:
        o = await generation.outcome(request.receive)
        head = _message_head(job.model_id, o.prompt_tokens)
        return JSONResponse({**head, "content": _content(o), "stop_reason": _STOP_REASONS[o.finish],
                             "stop_sequence": o.stop_sequence, "usage": _usage(o)})
    events, prompt_tokens = await generation.started(request.receive)
    return EventStream(generation, _message_events(events, job, prompt_tokens))


async def _message_events(events: AsyncIterator, job: Job, prompt_tokens: int) -> AsyncIterator[str]:
    def event(name: str, data: dict[str, Any]) -> str:
        return sse({"type": name, **data}, name)

    yield event("message_start", {"message": _message_head(job.model_id, prompt_tokens)})
    yield event("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}})
    hold = ToolCallHold() if job.tools else None
    async for kind, value in events:
        if kind == "text":
            text = hold.feed(value) if hold else value
            if text:
                yield event("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": text}})
        elif kind == "done":
            if hold and not value.tool_calls and (rest := hold.rest()):
                yield event("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": rest}})
            yield event("content_block_stop", {"index": 0})
            for index, call in enumerate(value.tool_calls, 1):
                block = {"type": "tool_use", "id": call.id, "name": call.name, "input": {}}
                yield event("content_block_start", {"index": index, "content_block": block})
                delta = {"type": "input_json_delta", "partial_json": json.dumps(call.arguments)}
                yield event("content_block_delta", {"index": index, "delta": delta})
                yield event("content_block_stop", {"index": index})
            delta = {"stop_reason": _STOP_REASONS[value.finish], "stop_sequence": value.stop_sequence}
            yield event("message_delta", {"delta": delta, "usage": {"output_tokens": value.completion_tokens}})
            yield event("message_stop", {})


async def count_tokens(request: Request) -> Response:
    runtime = request.app.state.runtime
    body = await read_json(request, CountRequest)
    job = Job(loaded_model_id(runtime, body.model), GenerationSettings(), messages=body.conversation(),
              tools=body.tool_definitions())
    return JSONResponse({"input_tokens": count_prompt_tokens(runtime, job)})


def routes() -> list[Route]:
    return [
        Route("/v1/messages", handler(messages, error_body), methods=["POST"]),
        Route("/v1/messages/count_tokens", handler(count_tokens, error_body), methods=["POST"]),
    ]
