"""The stdio MCP server: one Runtime, its tools, and (when start is asked to serve) the HTTP endpoint."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from strata_mcp import __version__
from strata_mcp.runtime import Runtime, UserError, open_runtime
from strata_mcp.tooling import ToolServer
from strata_mcp.tools import ALL_TOOLS

INSTRUCTIONS = """\
Strata runs a language model locally on this PC, in its own engine; nothing leaves the machine.
The usual flow, one step at a time:
1. check_pc - what the PC has (RAM, GPU, disk) and a verdict.
2. choose_model - the best model that fits for the person's goal (code, chat, speed, quality), with why.
3. install model=<id> - without confirm you get a plan (download size, disk); show it to the person, then
   install again with confirm=true. It downloads in the background; call install again (confirm=true) to
   follow progress until action is 'installed'.
4. start model=<id> - loads it (GPU if available); wait until state is 'ready'.
5. chat prompt=... or messages=[...] - answers; temperature 0 for deterministic output.
6. status - what is loaded, memory, speeds, installs.   7. stop - unload and free memory.
Other apps (Claude Code, Open WebUI, Continue, aider, scripts) can use the model too: start with serve=true
opens an OpenAI- and Anthropic-compatible endpoint on 127.0.0.1; connect_info gives the URLs and settings to
paste; logs shows the server's log (loads, requests, errors); benchmark measures tokens/s on this machine.
Every result starts with a one-line summary; errors say what to do next.
The embedded default model (smollm2-135m-instruct, 98 MB) is tiny: good to test the chain, not for real work.
"""


def build_server(runtime: Runtime | None, startup_error: str | None = None) -> ToolServer:
    """The server; without a runtime every tool answers with `startup_error` (the client still connects)."""
    server = ToolServer("strata-mcp", version=__version__, instructions=INSTRUCTIONS, startup_error=startup_error)
    for spec in ALL_TOOLS:
        server.add_spec(runtime, spec)
    return server


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="strata-mcp", description="Strata MCP server (stdio).")
    parser.add_argument("--data-dir", type=Path, default=None, help="Where models live (default: STRATA_DATA_DIR or the user data folder).")
    args = parser.parse_args(argv)
    # stdout carries the protocol; logs go to stderr.
    logging.basicConfig(stream=sys.stderr, level=logging.WARNING)
    try:
        server = build_server(open_runtime(args.data_dir))
    except UserError as exc:
        server = build_server(None, str(exc))
    server.run("stdio")


if __name__ == "__main__":
    main()
