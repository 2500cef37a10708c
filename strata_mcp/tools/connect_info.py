"""connect_info: how other apps reach the local endpoint, with settings ready to paste."""

from __future__ import annotations

from mcp.types import ToolAnnotations
from pydantic import BaseModel, Field

from strata_mcp.http.serving import LOCALHOST, remembered_port
from strata_mcp.runtime import Runtime
from strata_mcp.tooling import Reporter, ToolInput, ToolSpec

KEY_PLACEHOLDER = "<your API key>"
NO_KEY = "local"  # clients insist on some key; a local-only endpoint takes any


class ConnectInfoInput(ToolInput):
    """connect_info takes no arguments."""


class ConnectInfoOutput(BaseModel):
    summary: str
    running: bool = Field(description="Whether the endpoint answers now (start with serve=true starts it).")
    openai_base_url: str | None = Field(None, description="For OpenAI clients: base_url, ending in /v1.")
    anthropic_base_url: str | None = Field(None, description="For Anthropic clients and Claude Code: no /v1.")
    model: str | None = Field(None, description="The model name to send (the loaded model's id).")
    api_key_required: bool
    examples: dict[str, str] = Field(default_factory=dict, description="Settings and snippets per app, ready to paste.")


def _examples(openai_url: str, anthropic_url: str, model: str, key: str) -> dict[str, str]:
    return {
        "claude_code": (
            f"export ANTHROPIC_BASE_URL={anthropic_url}\nexport ANTHROPIC_AUTH_TOKEN={key}\n"
            f"export ANTHROPIC_MODEL={model}\nexport ANTHROPIC_DEFAULT_HAIKU_MODEL={model}\nclaude"
        ),
        "open_webui": (
            f"Admin Settings > Connections > OpenAI API: URL {openai_url}, key {key} "
            f"(from Docker: use http://host.docker.internal:{openai_url.rsplit(':', 1)[1]})"
        ),
        "continue": (
            f"models:\n  - name: {model}\n    provider: openai\n    model: {model}\n"
            f"    apiBase: {openai_url}\n    apiKey: {key}"
        ),
        "aider": f"aider --openai-api-base {openai_url} --openai-api-key {key} --model openai/{model}",
        "openai_python": (
            f"from openai import OpenAI\nclient = OpenAI(base_url={openai_url!r}, api_key={key!r})\n"
            f"reply = client.chat.completions.create(model={model!r}, "
            "messages=[{'role': 'user', 'content': 'Hello'}])\nprint(reply.choices[0].message.content)"
        ),
        "anthropic_python": (
            f"from anthropic import Anthropic\nclient = Anthropic(base_url={anthropic_url!r}, api_key={key!r})\n"
            f"reply = client.messages.create(model={model!r}, max_tokens=512, "
            "messages=[{'role': 'user', 'content': 'Hello'}])\nprint(reply.content[0].text)"
        ),
        "curl": (
            f"curl {openai_url}/chat/completions -H 'Content-Type: application/json' -H 'Authorization: Bearer {key}' "
            f"-d '{{\"model\": \"{model}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hello\"}}]}}'"
        ),
    }


def run(runtime: Runtime, args: ConnectInfoInput, reporter: Reporter) -> ConnectInfoOutput:
    server = runtime.http
    model = runtime.slot.model_id if runtime.slot.state in ("loading", "ready", "busy") else None
    if server is None:
        port = remembered_port(runtime)
        where = f"http://{LOCALHOST}:{port}" if port else None
        summary = ("The endpoint is not running; call start with serve=true (or run `strata serve MODEL`) to "
                   "serve " + (f"at {where}." if where else "the loaded model on 127.0.0.1."))
        return ConnectInfoOutput(
            summary=summary, running=False, openai_base_url=f"{where}/v1" if where else None,
            anthropic_base_url=where, model=model, api_key_required=False,
        )
    base = server.base_url
    key_required = server.api_key is not None
    name = model or "<model id>"
    examples = _examples(f"{base}/v1", base, name, KEY_PLACEHOLDER if key_required else NO_KEY)
    key_note = "an API key is required (the one the server was started with)" if key_required else "any API key works"
    summary = (f"Serving {name} at {base}: OpenAI base URL {base}/v1, Anthropic base URL {base} ({key_note}); "
               "examples holds settings for Claude Code, Open WebUI, Continue, aider and the Python clients.")
    return ConnectInfoOutput(
        summary=summary, running=True, openai_base_url=f"{base}/v1", anthropic_base_url=base, model=model,
        api_key_required=key_required, examples=examples,
    )


SPEC = ToolSpec(
    name="connect_info",
    title="How to connect other apps",
    description=(
        "The local OpenAI- and Anthropic-compatible endpoint's base URLs, the model name to use, whether a key "
        "is needed, and ready-to-paste settings for Claude Code (environment variables), Open WebUI, Continue, "
        "aider, curl and the openai / anthropic Python clients. The key itself is never shown."
    ),
    input_model=ConnectInfoInput,
    output_model=ConnectInfoOutput,
    run=run,
    annotations=ToolAnnotations(readOnlyHint=True, openWorldHint=False),
)
