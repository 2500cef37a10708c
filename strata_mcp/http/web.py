"""Starlette pieces both APIs share: the API key check, JSON bodies read into pydantic models, and the
server-sent-events response that cancels its generation when the client goes away."""

from __future__ import annotations

import hmac
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from strata_mcp.http.generation import ApiError, Generation, api_error

M = TypeVar("M", bound=BaseModel)


def check_key(request: Request) -> None:
    """Refuse the request unless it carries the server's API key (when it has one), as `Authorization:
    Bearer KEY` (OpenAI clients) or `x-api-key: KEY` (Anthropic clients)."""
    expected: str | None = request.app.state.api_key
    if expected is None:
        return
    given = request.headers.get("x-api-key")
    auth = request.headers.get("authorization", "")
    if given is None and auth[:7].lower() == "bearer ":
        given = auth[7:].strip()
    if given is None or not hmac.compare_digest(given.encode(), expected.encode()):
        raise ApiError(401, "auth", "The API key is missing or wrong; send the key this server was started with "
                       "(Authorization: Bearer KEY, or x-api-key: KEY).", "invalid_api_key")


def _validation_message(error: ValidationError) -> str:
    parts = []
    for item in error.errors():
        where = ".".join(str(p) for p in item["loc"]) or "body"
        parts.append(f"{where}: {item['msg']}")
    return "Invalid request: " + "; ".join(parts) + "."


async def read_json(request: Request, model: type[M]) -> M:
    try:
        data = await request.json()
    except ValueError:
        raise ApiError(400, "invalid_request", "The request body is not valid JSON; send a JSON object.") from None
    if not isinstance(data, dict):
        raise ApiError(400, "invalid_request", "The request body must be a JSON object.")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ApiError(400, "invalid_request", _validation_message(exc)) from None


def handler(
    endpoint: Callable[[Request], Awaitable[Response]], error_body: Callable[[ApiError], dict[str, Any]]
) -> Callable[[Request], Awaitable[Response]]:
    """An endpoint behind the key check, with every refusal written in its API's error shape."""

    async def run(request: Request) -> Response:
        try:
            check_key(request)
            return await endpoint(request)
        except Exception as exc:  # every failure leaves as an error body of the API, never as a traceback
            error = api_error(exc)
            log = request.app.state.runtime.log
            if error.status >= 500 and not isinstance(exc, ApiError):
                log.exception("%s %s failed", request.method, request.url.path)
            else:
                log.warning("%s %s refused (%d): %s", request.method, request.url.path, error.status, error.message)
            return JSONResponse(error_body(error), status_code=error.status)

    return run


def sse(data: Any, event: str | None = None) -> str:
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


class EventStream(StreamingResponse):
    """text/event-stream of `chunks`; however the response ends (a client that disconnects included), its
    generation is cancelled, so the engine is free for the next request."""

    def __init__(self, generation: Generation, chunks: AsyncIterator[str]):
        super().__init__(chunks, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._generation = generation

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._generation.cancel()

