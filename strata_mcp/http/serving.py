"""The endpoint's lifecycle: uvicorn on a thread of this process (so HTTP and the MCP tools share the one
loaded model), its address, and the port remembered in the data folder."""

from __future__ import annotations

import ipaddress
import json
import socket
import threading
import time
from dataclasses import dataclass

import uvicorn

from setup_logic.store import write_json_atomic
from strata_mcp.http.app import build_app
from strata_mcp.runtime import Runtime, UserError

SETTINGS_FILE = "http.json"
LOCALHOST = "127.0.0.1"
START_TIMEOUT_S = 30.0


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def remembered_port(runtime: Runtime) -> int | None:
    path = runtime.store.resolve(SETTINGS_FILE)
    try:
        port = json.loads(path.read_text()).get("port")
    except (OSError, ValueError, AttributeError):
        return None
    return port if isinstance(port, int) and 0 < port < 65536 else None


def check_binding(host: str, api_key: str | None) -> None:
    """Refuse an address beyond this machine without an API key."""
    if not is_loopback(host) and not api_key:
        raise UserError(f"Serving on {host} lets other machines in; give an API key (--api-key or STRATA_API_KEY) "
                        "so only those who have it get answers, or serve on 127.0.0.1.")


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


@dataclass
class HttpServer:
    host: str
    port: int
    api_key: str | None
    _runtime: Runtime
    _server: uvicorn.Server
    _thread: threading.Thread

    @property
    def base_url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        if self._runtime.http is self:
            self._runtime.http = None


def _socket_for(runtime: Runtime, host: str, port: int | None) -> socket.socket:
    """A socket bound to the port asked for, else the remembered one, else a free one (then remembered)."""
    if port is not None:
        try:
            return _bind(host, port)
        except OSError as exc:
            raise UserError(f"Port {port} on {host} cannot be used ({exc.strerror}); pick another port, or leave "
                            "it out to use a free one.") from None
    remembered = remembered_port(runtime)
    if remembered is not None:
        try:
            return _bind(host, remembered)
        except OSError:  # taken by another program since: take a new one and remember that
            pass
    sock = _bind(host, 0)
    runtime.store.data_dir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(runtime.store.resolve(SETTINGS_FILE), {"port": sock.getsockname()[1]})
    return sock


def serve(runtime: Runtime, host: str = LOCALHOST, port: int | None = None, api_key: str | None = None) -> HttpServer:
    """Start the endpoint (or return the running one when it already has this address)."""
    running = runtime.http
    if running is not None:
        if running.host == host and port in (None, running.port) and running.api_key == api_key:
            return running
        raise UserError(f"The endpoint already runs at {running.base_url}; stop the server to start it elsewhere.")
    check_binding(host, api_key)
    sock = _socket_for(runtime, host, port)
    config = uvicorn.Config(build_app(runtime, api_key), log_level="warning", lifespan="off", access_log=False)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="http-endpoint", daemon=True)
    thread.start()
    # uvicorn offers no start callback; its `started` flag turns true once the socket accepts.
    deadline = time.monotonic() + START_TIMEOUT_S
    while not server.started and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.02)
    if not server.started:
        sock.close()
        raise UserError("The HTTP endpoint did not start; `strata logs` shows why.")
    runtime.http = HttpServer(host, sock.getsockname()[1], api_key, runtime, server, thread)
    runtime.log.info("HTTP endpoint at %s (%s)", runtime.http.base_url, "API key required" if api_key else "no key")
    return runtime.http
