"""Download one Hugging Face file into a partial file that survives cancels, crashes and restarts.

Run by `sources.py` as a child process of our own (`python hf_fetch.py <json spec>`), so that a cancel can end it
at once and a crash of the server leaves only bytes that are safe to resume from. It imports nothing from this
project, only the standard library and huggingface_hub, so it runs from any working folder.

huggingface_hub 2.4's `hf_hub_download` writes to a temporary file with a random name and deletes it when a download
fails, so it cannot resume after a cancel or a crash. This script uses huggingface_hub's own pieces instead:
`get_hf_file_metadata` (HEAD: size, etag, commit, final location) and `http_get`, which resumes a file from a
given offset with a Range request and retries dropped connections.

With "resolve_only" in the spec it stops after the HEAD. The last line written to stdout is a JSON object:
{"ok": true, "commit": ..., "sha256": ...} (the commit the revision names, and the hub's LFS sha256 or null) or
{"ok": false, "kind": ..., "detail": ..., "status": ...}; kind "transient" may be retried, any other kind needs a
person.
"""

from __future__ import annotations

import errno
import json
import os
import sys
import threading
from pathlib import Path
from urllib.parse import urlparse

import filelock
import httpx2
from huggingface_hub import constants, get_hf_file_metadata, hf_hub_url
from huggingface_hub.errors import (
    FileMetadataError,
    GatedRepoError,
    HfHubHTTPError,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.file_download import http_get
from huggingface_hub.utils import build_hf_headers

# Small chunks (the library's default is 10 MB): a drop or a kill loses at most one chunk of received bytes, and the
# file grows smoothly for the progress.
CHUNK_BYTES = 256 << 10
# An older child of ours may still be finishing after its parent died; wait this long for its lock.
LOCK_WAIT_S = 30.0


class FetchProblem(Exception):
    def __init__(self, kind: str, detail: str, status: int | None = None) -> None:
        super().__init__(detail)
        self.kind, self.detail, self.status = kind, detail, status


def exit_when_parent_dies() -> None:
    """The parent holds our stdin open; end at once when it closes (the parent ended, even by SIGKILL)."""

    def watch() -> None:
        sys.stdin.buffer.read()
        os._exit(3)

    threading.Thread(target=watch, daemon=True).start()


def same_origin(a: str, b: str) -> bool:
    pa, pb = urlparse(a), urlparse(b)
    return (pa.scheme, pa.hostname, pa.port) == (pb.scheme, pb.hostname, pb.port)


def fetch(spec: dict) -> dict:
    url = hf_hub_url(spec["repo"], spec["path"], revision=spec["revision"], endpoint=spec["endpoint"])
    meta = get_hf_file_metadata(url, endpoint=spec["endpoint"], library_name="strata-mcp")
    size, sha256 = spec["size"], spec["sha256"]
    if size is None:  # the catalog gives only a rounded size: the hub's figure is the exact one
        size = meta.size
    if size is None:
        raise FetchProblem("not_hub", "the server did not give the file's size")
    if meta.size is not None and meta.size != size:
        raise FetchProblem("size_mismatch", f"the server has {meta.size} bytes, the catalog expects {size}")
    etag = meta.etag or ""
    if sha256 and len(etag) == 64 and etag != sha256:
        raise FetchProblem("sha_mismatch", f"the server's sha256 is {etag}, the catalog expects {sha256}")
    # An LFS file's etag is its sha256; a small file kept in git has its git sha1 (40 hex) instead.
    resolved = {"commit": meta.commit_hash, "sha256": etag if len(etag) == 64 else None}
    if spec.get("resolve_only"):
        return resolved

    part = Path(spec["part"])
    notes = part.with_name(part.name + ".json")
    lock = filelock.FileLock(part.with_name(part.name + ".lock"), timeout=LOCK_WAIT_S)  # sources.part_lock_path
    try:
        lock.acquire()
    except filelock.Timeout:
        raise FetchProblem("busy", f"another download is still writing {part}") from None
    try:
        try:
            recorded = json.loads(notes.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            recorded = {}
        # Bytes from another version of the file (or from nobody knows where) must not be resumed.
        keep = recorded.get("etag") == etag and recorded.get("size") == size
        if not keep:
            notes.write_text(json.dumps({"etag": etag, "size": size, "commit": meta.commit_hash}), encoding="utf-8")
        # Buffered: its writer retries a short write (a nearly full disk) instead of dropping the rest of a chunk,
        # so the file stays a prefix of the real one whatever happens.
        with open(part, "ab" if keep else "wb") as f:
            if f.tell() > size:
                f.seek(0)
                f.truncate()
            headers = build_hf_headers(library_name="strata-mcp", headers={"Accept-Encoding": "identity"})
            if not same_origin(url, meta.location):
                headers.pop("authorization", None)  # a signed CDN address must not receive the token
            http_get(meta.location, f, resume_size=f.tell(), headers=headers, expected_size=size,
                     displayed_filename=part.name)
    finally:
        lock.release()
    return resolved


def classify(exc: BaseException) -> FetchProblem:
    if isinstance(exc, FetchProblem):
        return exc
    if isinstance(exc, GatedRepoError):
        return FetchProblem("auth", "the repository is gated: its license must be accepted", 403)
    if isinstance(exc, (RepositoryNotFoundError, RevisionNotFoundError, RemoteEntryNotFoundError)):
        return FetchProblem("not_found", type(exc).__name__.removesuffix("Error"), exc.response.status_code)
    if isinstance(exc, HfHubHTTPError):
        status = exc.response.status_code
        kind = "auth" if status in (401, 403) else "transient" if status in (408, 429) or status >= 500 else "http"
        return FetchProblem(kind, f"the server answered {status}", status)
    if isinstance(exc, httpx2.HTTPError):
        return FetchProblem("transient", f"network error: {type(exc).__name__}: {exc}")
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)):
        return FetchProblem("disk_full", str(exc))
    if isinstance(exc, OSError) and exc.errno == errno.EFBIG:
        return FetchProblem("file_too_large", str(exc))
    if isinstance(exc, FileMetadataError):
        return FetchProblem("not_hub", str(exc).splitlines()[0])
    if type(exc) is OSError and exc.errno is None:
        # http_get's "Consistency check failed": the body ended early without a network error; resume it.
        return FetchProblem("transient", str(exc).splitlines()[0])
    return FetchProblem("error", f"{type(exc).__name__}: {exc}")


def main(argv: list[str]) -> int:
    exit_when_parent_dies()
    constants.DOWNLOAD_CHUNK_SIZE = CHUNK_BYTES
    try:
        resolved = fetch(json.loads(argv[1]))
    except Exception as exc:  # every failure becomes one JSON line for the parent
        problem = classify(exc)
        print(json.dumps({"ok": False, "kind": problem.kind, "detail": problem.detail, "status": problem.status}),
              flush=True)
        return 1
    print(json.dumps({"ok": True, **resolved}), flush=True)
    return 0


if __name__ == "__main__":
    code = main(sys.argv)
    sys.stdout.flush()
    # Skip interpreter shutdown: it would wait for the stdin watcher's lock and then abort.
    os._exit(code)
