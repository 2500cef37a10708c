"""Hugging Face installs through the MCP tools: the real huggingface_hub path against the fake hub."""

from __future__ import annotations

import json
import signal
import anyio
import psutil
import pytest
from hf_server import HfTestServer
from mcp_support import call, connect

from setup_logic.catalog import get_model

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

REPO = "strata-test/SmolLM2-135M-Instruct-GGUF"
MODEL = "smollm2-135m-instruct-hf"


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture
def hub(smollm2_gguf):
    with HfTestServer() as server:
        server.add_file(REPO, smollm2_gguf.name, smollm2_gguf.read_bytes())
        yield server


@pytest.fixture
def extra_catalog(tmp_path, hub, smollm2_gguf):
    """The embedded model's entry, re-pointed at the fake hub (same bytes, same sha256)."""
    entry = get_model("smollm2-135m-instruct").model_dump(mode="json")
    entry["id"] = MODEL
    entry["files"] = [{
        "name": smollm2_gguf.name, "size": smollm2_gguf.stat().st_size, "sha256": entry["files"][0]["sha256"],
        "source": "huggingface", "repo": REPO, "path": smollm2_gguf.name,
    }]
    path = tmp_path / "extra-catalog.json"
    path.write_text(json.dumps({"models": [entry]}))
    return path


def connect_to_hub(tmp_path, hub, extra_catalog):
    return connect(tmp_path / "data", HF_ENDPOINT=hub.url, STRATA_EXTRA_CATALOG=str(extra_catalog))


async def first_bytes(session) -> dict:
    """Follow the install until its first bytes are on disk: on a busy machine the download may start late."""
    with anyio.fail_after(120):
        while True:
            running = await call(session, "install", model=MODEL, confirm=True, wait_seconds=0.2)
            if running["progress"]["bytes_done"] > 0 or running["action"] != "installing":
                return running


async def test_dropped_connection_resumes_and_the_model_runs(tmp_path, hub, extra_catalog, smollm2_gguf):
    size = smollm2_gguf.stat().st_size
    hub.knobs.drop_after[smollm2_gguf.name] = size // 3
    async with connect_to_hub(tmp_path, hub, extra_catalog) as session:
        plan = await call(session, "install", model=MODEL)
        assert plan["plan"]["download_bytes"] == size
        done = await call(session, "install", model=MODEL, confirm=True, wait_seconds=300)
        assert done["action"] == "installed", done["summary"]
        # The retry resumed with a Range request instead of starting over.
        assert size <= hub.served(smollm2_gguf.name) < 1.1 * size
        await call(session, "start", model=MODEL, device="cpu", wait_seconds=300)
        answer = await call(session, "chat", prompt="What is the capital of France?", temperature=0, max_tokens=16)
        assert "Paris" in answer["text"]


async def test_wrong_bytes_are_refused_and_nothing_is_registered(tmp_path, hub, extra_catalog, smollm2_gguf):
    hub.knobs.wrong_bytes.add(smollm2_gguf.name)
    async with connect_to_hub(tmp_path, hub, extra_catalog) as session:
        result = await call(session, "install", model=MODEL, confirm=True, wait_seconds=300)
        assert result["action"] == "failed"
        assert smollm2_gguf.name in result["progress"]["error"] and "sha256" in result["progress"]["error"]
        status = await call(session, "status")
        assert status["installed"] == []


async def test_cancel_then_resume_through_the_tools(tmp_path, hub, extra_catalog, smollm2_gguf):
    size = smollm2_gguf.stat().st_size
    hub.knobs.bytes_per_s = 20e6
    async with connect_to_hub(tmp_path, hub, extra_catalog) as session:
        running = await first_bytes(session)
        assert running["action"] == "installing"
        assert 0 < running["progress"]["bytes_done"] < size
        cancelled = await call(session, "install", model=MODEL, cancel=True)
        assert cancelled["action"] == "cancelled"
        await anyio.sleep(0.5)
        served_before = hub.served(smollm2_gguf.name)
        hub.knobs.bytes_per_s = None
        done = await call(session, "install", model=MODEL, confirm=True, wait_seconds=300)
        assert done["action"] == "installed", done["summary"]
        resumed = hub.served(smollm2_gguf.name) - served_before
        assert resumed < size - running["progress"]["bytes_done"] + (1 << 20)
        assert [m["id"] for m in (await call(session, "status"))["installed"]] == [MODEL]


async def test_server_killed_mid_download_resumes_after_restart(tmp_path, hub, extra_catalog, smollm2_gguf):
    size = smollm2_gguf.stat().st_size
    hub.knobs.bytes_per_s = 20e6
    seen = {}
    with pytest.raises(Exception):  # the session dies with its server; assertions come after this block
        async with connect_to_hub(tmp_path, hub, extra_catalog) as session:
            seen["running"] = await first_bytes(session)
            seen["servers"] = [p for p in psutil.Process().children(recursive=True) if "strata-mcp" in " ".join(p.cmdline())]
            seen["servers"][0].send_signal(signal.SIGKILL)
            await call(session, "status")
    running = seen["running"]
    assert running["action"] == "installing" and running["progress"]["bytes_done"] > 0
    assert len(seen["servers"]) == 1 and not seen["servers"][0].is_running()
    await anyio.sleep(1.0)  # the download child notices its parent is gone and exits
    kept = hub.served(smollm2_gguf.name)
    hub.knobs.bytes_per_s = None
    async with connect_to_hub(tmp_path, hub, extra_catalog) as session:
        done = await call(session, "install", model=MODEL, confirm=True, wait_seconds=300)
        assert done["action"] == "installed", done["summary"]
    assert hub.served(smollm2_gguf.name) - kept < size - running["progress"]["bytes_done"] + (1 << 20)
