"""An in-process HTTP endpoint on a loaded model, for the HTTP tests (the MCP tests spawn the real server)."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

from strata_mcp.http.serving import serve
from strata_mcp.runtime import Runtime


@contextmanager
def endpoint(data_dir: Path, model_id: str | None, context_length: int = 1024, **serve_args):
    """(runtime, server) with model_id loaded on the CPU (None: no model) and served on a free port."""
    runtime = Runtime(data_dir)
    if model_id is not None:
        runtime.start_model(model_id, "cpu", context_length)
        slot = runtime.wait_until_loaded(600, lambda: False, lambda *_: None)
        assert slot.state == "ready", slot.error
    server = serve(runtime, **serve_args)
    try:
        yield runtime, server
    finally:
        server.stop()
        runtime.stop_model(force=True)
