"""A small Hugging Face-compatible file server for the tests (stdlib only, threaded, on 127.0.0.1).

It answers what huggingface_hub 2.4 asks when downloading one file (read from its source:
`get_hf_file_metadata` sends HEAD /{repo}/resolve/{revision}/{path} and reads X-Repo-Commit, X-Linked-Etag or
ETag, X-Linked-Size or Content-Length; `http_get` sends GET on the same address, with `Range: bytes=N-` to
resume), with the hub's error headers (X-Error-Code) for unknown repos, revisions and files. The download path
calls no /api/ endpoint, so none is served.

Knobs let a test misbehave on purpose: fail the next requests, drop a connection after N bytes, pause, throttle,
serve wrong bytes. Counters tell what was served.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote

RESOLVE = re.compile(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$")
SEND_BLOCK = 64 << 10


@dataclass
class HostedFile:
    data: bytes
    lfs: bool
    sha256: str = ""
    git_sha1: str = ""

    def __post_init__(self) -> None:
        self.sha256 = hashlib.sha256(self.data).hexdigest()
        self.git_sha1 = hashlib.sha1(b"blob %d\0" % len(self.data) + self.data).hexdigest()

    @property
    def etag(self) -> str:
        return self.sha256 if self.lfs else self.git_sha1


@dataclass
class Knobs:
    fail_next: int = 0                                             # the next K requests answer `fail_status`
    fail_status: int = 500
    drop_after: dict[str, int] = field(default_factory=dict)       # path -> close the next GET after N bytes
    pause_after: dict[str, tuple[int, float]] = field(default_factory=dict)  # path -> (N bytes, seconds), once
    wrong_bytes: set[str] = field(default_factory=set)             # paths whose body has one byte flipped
    bytes_per_s: float | None = None                               # throttle every body


class _QuietServer(ThreadingHTTPServer):
    def handle_error(self, request: object, client_address: object) -> None:
        """Clients that hang up (a killed or cancelled download) are part of the tests, not errors."""
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class HfTestServer:
    """Start with `with HfTestServer() as hub:`; point HF_ENDPOINT at `hub.url`."""

    def __init__(self) -> None:
        self.files: dict[tuple[str, str], HostedFile] = {}
        self.commits: dict[str, str] = {}
        self.knobs = Knobs()
        self.bytes_served: dict[str, int] = {}
        self.requests: list[tuple[str, str, str | None, str | None]] = []  # method, path, Range, Authorization
        self.lock = threading.Lock()
        self._httpd = _QuietServer(("127.0.0.1", 0), _make_handler(self))
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="hf-test-server", daemon=True)

    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    def add_file(self, repo: str, path: str, data: bytes, lfs: bool = True) -> HostedFile:
        self.commits.setdefault(repo, hashlib.sha1(repo.encode()).hexdigest())
        hosted = HostedFile(data, lfs)
        self.files[(repo, path)] = hosted
        return hosted

    def served(self, path: str) -> int:
        with self.lock:
            return self.bytes_served.get(path, 0)

    def __enter__(self) -> HfTestServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


def _make_handler(hub: HfTestServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:  # keep test output clean
            pass

        def do_HEAD(self) -> None:
            self._serve(body=False)

        def do_GET(self) -> None:
            self._serve(body=True)

        def _error(self, status: int, code: str | None = None, commit: str | None = None) -> None:
            payload = json.dumps({"error": code or f"status {status}"}).encode()
            self.send_response(status)
            if code:
                self.send_header("X-Error-Code", code)
            if commit:
                self.send_header("X-Repo-Commit", commit)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(payload)

        def _serve(self, body: bool) -> None:
            with hub.lock:
                hub.requests.append((self.command, self.path, self.headers.get("Range"),
                                     self.headers.get("Authorization")))
                failing = hub.knobs.fail_next > 0
                if failing:
                    hub.knobs.fail_next -= 1
            if failing:
                return self._error(hub.knobs.fail_status)
            match = RESOLVE.match(self.path)
            if not match:
                return self._error(404)
            repo, revision, path = unquote(match[1]), unquote(match[2]), unquote(match[3])
            commit = hub.commits.get(repo)
            if commit is None:
                return self._error(404, "RepoNotFound")
            if revision not in ("main", commit):
                return self._error(404, "RevisionNotFound")
            hosted = hub.files.get((repo, path))
            if hosted is None:
                return self._error(404, "EntryNotFound", commit)
            self._send_file(path, hosted, commit, body)

        def _send_file(self, path: str, hosted: HostedFile, commit: str, body: bool) -> None:
            data = hosted.data
            if path in hub.knobs.wrong_bytes:
                data = bytes([data[0] ^ 0xFF]) + data[1:]
            size, start, end = len(data), 0, len(data) - 1
            ranged = self.headers.get("Range")
            if body and ranged:
                m = re.fullmatch(r"bytes=(\d+)-(\d*)", ranged.strip())
                if m is None or int(m[1]) >= size:
                    self.send_response(416)
                    self.send_header("Content-Range", f"bytes */{size}")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                start, end = int(m[1]), min(int(m[2]), size - 1) if m[2] else size - 1
            self.send_response(206 if body and ranged else 200)
            self.send_header("Content-Length", str(end - start + 1))
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("ETag", f'"{hosted.etag}"')
            self.send_header("X-Repo-Commit", commit)
            if hosted.lfs:
                self.send_header("X-Linked-Size", str(size))
                self.send_header("X-Linked-Etag", f'"{hosted.sha256}"')
            if body and ranged:
                self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
            self.end_headers()
            if body:
                self._send_body(path, data[start:end + 1])

        def _send_body(self, path: str, body: bytes) -> None:
            with hub.lock:
                drop = hub.knobs.drop_after.pop(path, None)
                pause = hub.knobs.pause_after.pop(path, None)
            sent, began = 0, time.monotonic()
            while sent < len(body):
                block = body[sent:sent + SEND_BLOCK]
                if drop is not None and sent + len(block) > drop:
                    block = block[:drop - sent]
                if pause is not None and sent + len(block) > pause[0]:
                    block = block[:max(pause[0] - sent, 0)]
                try:
                    self.wfile.write(block)
                    self.wfile.flush()
                except (BrokenPipeError, ConnectionResetError):
                    break
                sent += len(block)
                with hub.lock:
                    hub.bytes_served[path] = hub.bytes_served.get(path, 0) + len(block)
                if drop is not None and sent >= drop:
                    self.close_connection = True  # the body ends short: the client sees a dropped connection
                    return
                if pause is not None and sent >= pause[0]:
                    time.sleep(pause[1])
                    pause = None
                if hub.knobs.bytes_per_s:
                    time.sleep(max(0.0, sent / hub.knobs.bytes_per_s - (time.monotonic() - began)))

    return Handler
