"""The starlette app: both APIs on one engine, behind the API key when the server has one."""

from __future__ import annotations

from starlette.applications import Starlette

from strata_mcp.http import anthropic, openai
from strata_mcp.runtime import Runtime


def build_app(runtime: Runtime, api_key: str | None) -> Starlette:
    app = Starlette(routes=[*openai.routes(), *anthropic.routes()])
    app.state.runtime = runtime
    app.state.api_key = api_key
    return app
