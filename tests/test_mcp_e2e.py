"""The whole chain through the official `mcp` client, spawning the installed `strata-mcp` over stdio."""

from __future__ import annotations

import anyio
import pytest
from conftest import register_model
from mcp_support import call, call_error, connect

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

TOOLS = {"check_pc", "choose_model", "install", "start", "chat", "status", "stop", "connect_info", "logs", "benchmark"}


@pytest.fixture
def anyio_backend():
    return "asyncio"


async def test_tools_list_has_both_schemas(tmp_path):
    async with connect(tmp_path / "data") as session:
        listed = (await session.list_tools()).tools
    assert {t.name for t in listed} == TOOLS
    for tool in listed:
        assert tool.input_schema["type"] == "object", tool.name
        assert tool.output_schema and "summary" in tool.output_schema["properties"], tool.name
        assert tool.description
    by_name = {t.name: t for t in listed}
    assert by_name["check_pc"].annotations.read_only_hint is True
    assert by_name["status"].annotations.read_only_hint is True
    assert by_name["choose_model"].annotations.read_only_hint is True
    assert by_name["install"].annotations.open_world_hint is True
    assert by_name["stop"].annotations.destructive_hint is True
    assert set(by_name["chat"].input_schema["properties"]) >= {"messages", "prompt", "temperature", "max_tokens", "stop"}


async def test_whole_chain(tmp_path, smollm2_gguf):
    data = tmp_path / "data"
    progress: list[float] = []

    async def on_progress(value, total, message):
        progress.append(value)

    async with connect(data) as session:
        pc = await call(session, "check_pc")
        assert pc["pc"]["ram_total_bytes"] > 0 and pc["pc"]["verdict"]

        choice = await call(session, "choose_model", goal="chat")
        fitting = [choice["choice"]["model_id"]] + [a["model_id"] for a in choice["alternatives"]]
        assert "smollm2-135m-instruct" in fitting

        plan = await call(session, "install", model="smollm2-135m-instruct")
        assert plan["action"] == "plan" and plan["plan"]["download_bytes"] > 90_000_000
        assert not any(data.rglob("*.gguf")), "a plan must write nothing"

        await call_error(session, "chat", prompt="hello")  # nothing loaded yet

        installed = await session.call_tool(
            "install", {"model": "smollm2-135m-instruct", "confirm": True, "wait_seconds": 600},
            read_timeout_seconds=900, progress_callback=on_progress,
        )
        assert not installed.is_error, installed.content
        assert installed.structured_content["action"] == "installed"
        assert progress == sorted(progress) and len(set(progress)) == len(progress)

        load_progress: list[str] = []

        async def on_load_progress(value, total, message):
            load_progress.append(message)

        started_result = await session.call_tool(
            "start", {"model": "smollm2-135m-instruct", "device": "cpu", "wait_seconds": 300},
            read_timeout_seconds=600, progress_callback=on_load_progress,
        )
        started = started_result.structured_content
        assert started["engine"]["state"] == "ready"
        assert load_progress, "start sent no progress while loading"
        offered = {c["model_id"]: c for c in [choice["choice"], *choice["alternatives"]]}
        assert started["engine"]["context_length"] == offered["smollm2-135m-instruct"]["context_length"]
        assert started["engine"]["backend"] == "numpy"
        memory = started["engine"]["memory"]
        # The fit's estimate is the one choose_model uses: it must match what loading really cost.
        assert abs(memory["process_growth_bytes"] / memory["estimated_after_load_bytes"] - 1) < 0.15, memory

        streamed: list[str] = []

        async def on_text(value, total, message):
            streamed.append(message)

        answer_result = await session.call_tool(
            "chat", {"prompt": "What is the capital of France?", "temperature": 0, "max_tokens": 32},
            read_timeout_seconds=600, progress_callback=on_text,
        )
        answer = answer_result.structured_content
        assert "Paris" in answer["text"]
        assert streamed and answer["text"].startswith(streamed[-1][:10]), streamed
        assert answer["timings"]["completion_tokens"] > 0 and answer["timings"]["output_tokens_per_second"] > 0

        follow_up = await call(
            session, "chat", temperature=0, max_tokens=16,
            messages=[
                {"role": "user", "content": "What is the capital of France?"},
                {"role": "assistant", "content": answer["text"]},
                {"role": "user", "content": "And of Germany?"},
            ],
        )
        assert follow_up["timings"]["cached_prompt_tokens"] > 0

        status = await call(session, "status")
        assert status["engine"]["state"] == "ready"
        assert status["engine"]["last_chat"]["completion_tokens"] == follow_up["timings"]["completion_tokens"]
        assert [m["id"] for m in status["installed"]] == ["smollm2-135m-instruct"]

        stopped = await call(session, "stop")
        assert stopped["stopped_model"] == "smollm2-135m-instruct"
        assert (await call(session, "status"))["engine"]["state"] == "stopped"


async def test_bad_input_is_a_clear_error(tmp_path):
    data = tmp_path / "data"
    async with connect(data) as session:
        message = await call_error(session, "install", model="no-such-model")
        assert "no-such-model" in message and "smollm2-135m-instruct" in message

        message = await call_error(session, "start", model="smollm2-135m-instruct")
        assert "install" in message.lower()

        message = await call_error(session, "chat", prompt="hi")
        assert "start" in message.lower()

        message = await call_error(session, "chat", prompt="hi", messages=[{"role": "user", "content": "hi"}])
        assert "either messages or prompt" in message

        message = await call_error(session, "chat", prompt="hi", max_tokens="many")
        assert "max_tokens" in message

        message = await call_error(session, "choose_model", goal="poetry")
        assert "goal" in message

        message = await call_error(session, "start", model="smollm2-135m-instruct", kv_cache="q4_0")
        assert message.startswith("kv_cache:") and "'full'" in message and "'q8_0'" in message

        status = await call(session, "status")
        assert status["installed"] == [] and status["engine"]["state"] == "stopped"
    assert not any(data.rglob("*.gguf"))


async def test_start_with_a_q8_0_kv_cache_reports_it_and_answers(installed_data_dir):
    async with connect(installed_data_dir) as session:
        started = await call(session, "start", device="cpu", context_length=1024, kv_cache="q8_0", wait_seconds=300)
        assert started["engine"]["kv_cache_type"] == "q8_0" and "in a q8_0 KV cache" in started["summary"]
        assert started["engine"]["prompt_chunk"] == 512  # the CPU path's
        answer = await call(session, "chat", prompt="Write a haiku about the sea.", temperature=0, max_tokens=16)
        assert "sea" in answer["text"].lower() and answer["timings"]["completion_tokens"] == 16
        status = await call(session, "status")
        assert status["engine"]["kv_cache_type"] == "q8_0" and "with a q8_0 KV cache" in status["summary"]
        await call(session, "stop")


async def test_cancelled_chat_leaves_the_model_ready(installed_data_dir):
    async with connect(installed_data_dir) as session:
        await call(session, "start", device="cpu", wait_seconds=300)
        with anyio.move_on_after(1.0):
            await session.call_tool("chat", {"prompt": "Write a long story.", "max_tokens": 2000, "temperature": 0})
        # 2000 tokens take minutes on the CPU; the cancelled chat must release the model within seconds.
        states = []
        for _ in range(40):
            states.append((await call(session, "status"))["engine"]["state"])
            if states[-1] == "ready":
                break
            await anyio.sleep(0.25)
        assert states[-1] == "ready", states
        answer = await call(session, "chat", prompt="Say hi.", max_tokens=4, temperature=0)
        assert answer["timings"]["completion_tokens"] >= 1
        stopped = await call(session, "stop")
        assert stopped["stopped_model"] == "smollm2-135m-instruct"


async def test_stop_refuses_a_running_chat_unless_forced(installed_data_dir):
    async with connect(installed_data_dir) as session, anyio.create_task_group() as tg:
        await call(session, "start", device="cpu", wait_seconds=300)
        results = {}

        async def long_chat():
            results["chat"] = await session.call_tool(
                "chat", {"prompt": "Count to a thousand.", "max_tokens": 2000, "temperature": 0}, read_timeout_seconds=600
            )

        tg.start_soon(long_chat)
        for _ in range(40):
            if (await call(session, "status"))["engine"]["state"] == "busy":
                break
            await anyio.sleep(0.1)
        refused = await call_error(session, "stop")
        assert "force" in refused
        stopped = await call(session, "stop", force=True)
        assert stopped["stopped_model"] == "smollm2-135m-instruct"
    chat = results["chat"]
    assert not chat.is_error and chat.structured_content["finish_reason"] == "cancelled"


async def test_gemma_base_model_continues_text(tmp_path, gemma3_gguf):
    data = tmp_path / "data"
    register_model(data, "gemma-3-270m", gemma3_gguf)
    async with connect(data) as session:
        offered = await call(session, "choose_model", goal="speed")
        assert "gemma-3-270m" not in [m["id"] for m in offered["not_supported"]]
        started = await call(session, "start", model="gemma-3-270m", device="cpu", wait_seconds=300)
        assert started["engine"]["state"] == "ready"
        refused = await call_error(session, "chat", prompt="Hello")
        assert "raw=true" in refused
        text = await call(session, "chat", prompt="The capital of France is", raw=True, temperature=0, max_tokens=8)
        assert text["timings"]["completion_tokens"] >= 1 and text["text"].strip()


async def test_truncated_model_file_is_named_and_nothing_is_loaded(tmp_path, smollm2_gguf):
    data = tmp_path / "data"
    truncated = tmp_path / smollm2_gguf.name
    truncated.write_bytes(smollm2_gguf.read_bytes()[: 40_000_000])
    register_model(data, "smollm2-135m-instruct", truncated)
    async with connect(data) as session:
        started = await call(session, "start", model="smollm2-135m-instruct", device="cpu", wait_seconds=120)
        assert started["engine"]["state"] == "failed"
        assert smollm2_gguf.name in started["engine"]["error"] and smollm2_gguf.name in started["summary"]
        message = await call_error(session, "chat", prompt="hi")
        assert smollm2_gguf.name in message
        status = await call(session, "status")
        assert status["engine"]["state"] == "failed"
        assert (await call(session, "stop"))["stopped_model"] == "smollm2-135m-instruct"
        assert (await call(session, "status"))["engine"]["state"] == "stopped"
