"""The official `mcp` client, spawning the installed `strata-mcp` over stdio, for the protocol tests."""

from __future__ import annotations

import os
import shutil
import sys
from contextlib import asynccontextmanager
from pathlib import Path

from mcp import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client


def server_command() -> str:
    found = shutil.which("strata-mcp", path=str(Path(sys.executable).parent)) or shutil.which("strata-mcp")
    assert found, "strata-mcp is not installed (pip install -e '.[test]')"
    return found


@asynccontextmanager
async def connect(data_dir: Path, **env_overrides: str):
    """A client session with a server whose data folder is `data_dir` and whose GPU is hidden."""
    # No hub token of the person running the tests reaches the server: the tests' hub is a fake one.
    inherited = {k: v for k, v in os.environ.items() if k != "HF_TOKEN"}
    env = {**inherited, "STRATA_DATA_DIR": str(data_dir), "CUDA_VISIBLE_DEVICES": "", **env_overrides}
    params = StdioServerParameters(command=server_command(), args=[], env=env)
    async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
        await session.initialize()
        yield session


def _text(result) -> str:
    return " ".join(getattr(c, "text", "") for c in result.content)


async def call(session: ClientSession, name: str, **args):
    """Call a tool that must succeed; return its structured result."""
    result = await session.call_tool(name, args, read_timeout_seconds=600)
    assert not result.is_error, f"{name} failed: {_text(result)}"
    assert result.structured_content is not None
    assert result.structured_content["summary"], f"{name} has no summary"
    return result.structured_content


async def call_error(session: ClientSession, name: str, **args) -> str:
    """Call a tool that must fail cleanly; return its message."""
    result = await session.call_tool(name, args, read_timeout_seconds=600)
    assert result.is_error, f"{name} should have failed"
    return _text(result)
