"""The endpoint's MCP side through the official `mcp` client: start serve=true, connect_info, logs and
benchmark on the spawned `strata-mcp`, with the `openai` client talking to the same loaded model."""

from __future__ import annotations

import openai
import pytest
from mcp_support import call, call_error, connect

from setup_logic.hardware import probe_cpu

pytestmark = [pytest.mark.anyio, pytest.mark.slow]


@pytest.fixture
def anyio_backend():
    return "asyncio"


async def test_serve_connect_logs_and_benchmark(installed_data_dir):
    async with connect(installed_data_dir) as session:
        idle = await call(session, "connect_info")
        assert idle["running"] is False and "serve=true" in idle["summary"]
        assert (await call(session, "logs"))["lines"] == []
        assert "start" in (await call_error(session, "benchmark")).lower()

        started = await call(session, "start", device="cpu", wait_seconds=300, serve=True)
        base = started["endpoint"]
        assert started["engine"]["state"] == "ready" and base.startswith("http://127.0.0.1:")
        assert (await call(session, "start", device="cpu", serve=True))["endpoint"] == base  # already serving

        info = await call(session, "connect_info")
        assert info["running"] and info["api_key_required"] is False
        assert (info["openai_base_url"], info["anthropic_base_url"], info["model"]) == (
            f"{base}/v1", base, "smollm2-135m-instruct")
        assert set(info["examples"]) == {"claude_code", "open_webui", "continue", "aider", "openai_python",
                                         "anthropic_python", "curl"}
        assert f"ANTHROPIC_BASE_URL={base}" in info["examples"]["claude_code"]

        # Closed here: an unclosed client closes its connections from __del__, in whichever test's loop runs then.
        async with openai.AsyncOpenAI(base_url=info["openai_base_url"], api_key="local", max_retries=0) as client:
            reply = await client.chat.completions.create(
                model=info["model"], messages=[{"role": "user", "content": "What is the capital of France?"}],
                max_tokens=8, temperature=0,
            )
        assert "Paris" in reply.choices[0].message.content
        status = await call(session, "status")  # the MCP side sees the request the HTTP side served
        assert status["engine"]["last_chat"]["completion_tokens"] == reply.usage.completion_tokens

        lines = (await call(session, "logs", lines=20))["lines"]
        assert any("loaded smollm2-135m-instruct on numpy" in line for line in lines)
        assert any("POST /v1/chat/completions smollm2-135m-instruct" in line for line in lines)
        assert len((await call(session, "logs", lines=1))["lines"]) == 1

        bench = await call(session, "benchmark", max_tokens=16)
        assert bench["output_tokens"] == 16 and bench["output_tokens_per_second"] > 0
        assert bench["prompt_tokens"] > 200 and bench["prompt_tokens_per_second"] > 0
        assert bench["machine"] == probe_cpu().model and bench["backend"] == "numpy"
        assert any("benchmark:" in line for line in (await call(session, "logs", lines=5))["lines"])
