"""The data folder and the registry of installed models.

Layout under the data folder:
    installed.json            the registry (one InstalledModel per model id), written atomically
    installed.json.lock       serialises registry updates between threads and processes
    models/<model id>/        the model's files, their partial downloads and the installer's notes

Every path this project writes goes through `Store.resolve`, which refuses anything outside the data folder.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

import filelock
from pydantic import BaseModel, Field, ValidationError

from setup_logic.errors import SetupError

APP_NAME = "strata-mcp"
REGISTRY_NAME = "installed.json"
_MODEL_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
# Folders that must never become the data folder: filling them with model files could break the system.
_POSIX_SYSTEM_DIRS = ("/bin", "/boot", "/dev", "/etc", "/lib", "/lib32", "/lib64", "/proc", "/run", "/sbin",
                      "/sys", "/usr", "/var", "/snap")
_WINDOWS_SYSTEM_ENV = ("SystemRoot", "windir", "ProgramFiles", "ProgramFiles(x86)", "ProgramData", "ProgramW6432")
# The quick check of a file: its first block and blocks spread evenly to its end, hashed with its size.
SAMPLE_BLOCKS = 64
SAMPLE_BLOCK_BYTES = 64 << 10


class Fingerprint(BaseModel):
    """What a quick check compares: size and modification time, then a hash of sampled blocks if those changed."""

    size: int
    mtime_ns: int
    sample: str = Field(description="blake2b of the size, the first block and 63 more spread to the end.")


def sample_hash(path: Path) -> str:
    size = path.stat().st_size
    digest = hashlib.blake2b(str(size).encode(), digest_size=16)
    with path.open("rb") as f:
        if size <= SAMPLE_BLOCKS * SAMPLE_BLOCK_BYTES:
            digest.update(f.read())
        else:
            step = (size - SAMPLE_BLOCK_BYTES) / (SAMPLE_BLOCKS - 1)
            for i in range(SAMPLE_BLOCKS):
                f.seek(round(i * step))
                digest.update(f.read(SAMPLE_BLOCK_BYTES))
    return digest.hexdigest()


def fingerprint(path: Path) -> Fingerprint:
    st = path.stat()
    return Fingerprint(size=st.st_size, mtime_ns=st.st_mtime_ns, sample=sample_hash(path))


def unchanged(path: Path, recorded: Fingerprint, always_sample: bool = False) -> bool:
    """The quick check: size, and the sampled hash when the modification time moved (or always, if asked)."""
    st = path.stat()
    if st.st_size != recorded.size:
        return False
    if st.st_mtime_ns == recorded.mtime_ns and not always_sample:
        return True
    return sample_hash(path) == recorded.sample


class InstalledModel(BaseModel):
    """A model whose files were all checked: their size always, their sha256 where one was known (`verified`)."""

    id: str
    files: list[str] = Field(description="Absolute paths of the model's files; the first is the GGUF to open.")
    size_bytes: int = Field(description="Total size of the files in bytes.")
    sha256: list[str | None] = Field(description="sha256 of each file, in the order of `files`.")
    verified: bool = Field(True, description="False when some file had no published sha256 (from the catalog or the "
                                             "hub) to compare with: its size was checked, its content was not.")
    fingerprints: list[Fingerprint] = Field(default_factory=list,
                                            description="Each file's quick-check figures, in the order of `files`.")
    installed_at: str = Field(description="When the install finished (ISO 8601, UTC).")


def utc_now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def default_data_dir() -> Path:
    """STRATA_DATA_DIR if set, else the platform's folder for per-user application data."""
    override = os.environ.get("STRATA_DATA_DIR", "").strip()
    if override:
        path = Path(os.path.expandvars(override)).expanduser()
        if not path.is_absolute():
            raise SetupError(f"STRATA_DATA_DIR must be an absolute path, not {override!r}; set it to a folder "
                             "such as /mnt/big/strata-data or D:\\strata-data.")
        return path
    if sys.platform == "win32":
        base = os.environ.get("LOCALAPPDATA") or str(Path.home() / "AppData" / "Local")
        return Path(base) / APP_NAME
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Application Support" / APP_NAME
    return Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share") / APP_NAME


def _system_dirs() -> list[Path]:
    if sys.platform == "win32":
        return [Path(os.environ[name]).resolve() for name in _WINDOWS_SYSTEM_ENV if os.environ.get(name)]
    return [Path(p) for p in _POSIX_SYSTEM_DIRS]


@contextmanager
def writing(where: Path) -> Iterator[None]:
    """Turn a data folder that cannot be written (read-only, not a folder, no permission) into one sentence."""
    try:
        yield
    except (PermissionError, NotADirectoryError, FileExistsError, IsADirectoryError) as exc:
        raise SetupError(f"Cannot write to {exc.filename or where} ({exc.strerror}); make the data folder {where} "
                         "a writable folder, or set STRATA_DATA_DIR to one.") from None
    except OSError as exc:
        if exc.errno != errno.EROFS:
            raise
        raise SetupError(f"The data folder {where} is on a read-only drive; set STRATA_DATA_DIR to a folder on a "
                         "writable drive.") from None


def write_json_atomic(path: Path, data: Any) -> None:
    """Write JSON so that a reader sees the old or the new file, never half of one (temp file + os.replace)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def nearest_existing(path: Path) -> Path:
    while not path.exists() and path.parent != path:
        path = path.parent
    return path


class Store:
    """The data folder: where model files live and which models count as installed."""

    def __init__(self, data_dir: Path | None = None) -> None:
        raw = Path(data_dir) if data_dir is not None else default_data_dir()
        if not raw.is_absolute():
            raise SetupError(f"The data folder must be an absolute path, not {str(raw)!r}; give a full path.")
        # Resolved once: a data folder that is itself a link (e.g. to a bigger drive) is fine.
        self.data_dir = raw.resolve()
        for system_dir in _system_dirs():
            if self.data_dir == system_dir or self.data_dir.is_relative_to(system_dir):
                raise SetupError(f"The data folder {self.data_dir} is inside the system folder {system_dir}; "
                                 "choose a folder in your home directory or on a data drive (STRATA_DATA_DIR).")
        self.models_dir = self.data_dir / "models"
        self.registry_path = self.data_dir / REGISTRY_NAME
        self.registry_warning: str | None = None

    def resolve(self, relative: str) -> Path:
        """The absolute path of `relative` inside the data folder; anything that could leave it is refused."""
        if not relative or "\0" in relative:
            raise SetupError(f"The path {relative!r} is empty or holds a NUL character; give a path inside "
                             f"the data folder {self.data_dir}.")
        posix, windows = PurePosixPath(relative), PureWindowsPath(relative)
        if posix.is_absolute() or windows.anchor:
            raise SetupError(f"The path {relative!r} is absolute; give a path relative to the data folder "
                             f"{self.data_dir}.")
        if ".." in posix.parts or ".." in windows.parts:
            raise SetupError(f"The path {relative!r} contains '..'; give a path that stays inside the data "
                             f"folder {self.data_dir}.")
        # resolve() follows every link that exists, so a link pointing out of the folder is caught here.
        target = (self.data_dir / relative).resolve()
        if target != self.data_dir and not target.is_relative_to(self.data_dir):
            raise SetupError(f"The path {relative!r} leads to {target}, outside the data folder {self.data_dir} "
                             "(through a link); remove that link or choose another data folder.")
        return target

    def model_dir(self, model_id: str) -> Path:
        if not _MODEL_ID.fullmatch(model_id):
            raise SetupError(f"{model_id!r} is not a valid model id; use the id from the catalog "
                             "(letters, digits, '.', '_' and '-').")
        return self.resolve(f"models/{model_id}")

    def free_disk_bytes(self) -> int:
        """Free bytes on the drive that holds (or will hold) the data folder."""
        return shutil.disk_usage(nearest_existing(self.data_dir)).free

    def _read_registry(self) -> dict[str, InstalledModel]:
        try:
            raw = self.registry_path.read_bytes()
        except FileNotFoundError:
            return {}
        except IsADirectoryError:
            raise SetupError(f"The list of installed models {self.registry_path} is a folder, not a file; move that "
                             "folder away (installed models are found again by running install).") from None
        except PermissionError:
            raise SetupError(f"The list of installed models {self.registry_path} cannot be read (permission "
                             "denied); give your user access to it, or set STRATA_DATA_DIR to another "
                             "folder.") from None
        try:
            entries = json.loads(raw)["models"]
            return {model_id: InstalledModel.model_validate(entry) for model_id, entry in entries.items()}
        except (ValueError, KeyError, TypeError, AttributeError, ValidationError, RecursionError) as exc:
            # Keep the damaged bytes for a person to look at; the model files are untouched, and installing a
            # model again re-verifies its files on disk instead of downloading them.
            kept = self.registry_path.with_name(f"{REGISTRY_NAME}.damaged-{int(time.time())}")
            with writing(self.data_dir):
                os.replace(self.registry_path, kept)
            self.registry_warning = (
                f"The list of installed models {self.registry_path} could not be read ({type(exc).__name__}) "
                f"and was kept as {kept.name}; run install again for each model you had: files already on "
                "disk are verified, not downloaded again.")
            return {}

    @contextmanager
    def _registry_lock(self) -> Iterator[None]:
        with writing(self.data_dir):
            self.data_dir.mkdir(parents=True, exist_ok=True)
            lock = filelock.FileLock(self.data_dir / f"{REGISTRY_NAME}.lock", thread_local=False)
            lock.acquire()
        try:
            yield
        finally:
            lock.release()

    def installed(self) -> list[InstalledModel]:
        """Registered models whose files are all still there with their registered total size."""
        if not self.registry_path.exists():
            return []
        with self._registry_lock():  # a damaged registry is moved aside: not while another process rewrites it
            entries = self._read_registry()
        return [entry for entry in entries.values() if self._files_intact(entry)]

    def changed_files(self, entry: InstalledModel, always_sample: bool = False) -> list[str]:
        """Files of an installed model that fail the quick check (none for an entry older than fingerprints)."""
        return [name for name, recorded in zip(entry.files, entry.fingerprints, strict=False)
                if not unchanged(Path(name), recorded, always_sample)]

    def get_installed(self, model_id: str) -> InstalledModel | None:
        return next((entry for entry in self.installed() if entry.id == model_id), None)

    def model_path(self, model_id: str) -> Path:
        """The GGUF to open for an installed model (its first file)."""
        entry = self.get_installed(model_id)
        if entry is None:
            raise SetupError(f"The model {model_id} is not installed (or its files changed); run install "
                             f"for {model_id} first.")
        changed = self.changed_files(entry)
        if changed:
            raise SetupError(f"{Path(changed[0]).name} of {model_id} changed on disk since it was installed (its "
                             f"contents differ); run install for {model_id} again to repair it.")
        return Path(entry.files[0])

    def register(self, entry: InstalledModel) -> None:
        with self._registry_lock():
            entries = self._read_registry()
            entries[entry.id] = entry
            self._write_registry(entries)

    def unregister(self, model_id: str) -> None:
        if not self.registry_path.exists():
            return
        with self._registry_lock():
            entries = self._read_registry()
            if entries.pop(model_id, None) is not None:
                self._write_registry(entries)

    def _write_registry(self, entries: dict[str, InstalledModel]) -> None:
        with writing(self.data_dir):
            write_json_atomic(self.registry_path,
                              {"models": {model_id: e.model_dump() for model_id, e in sorted(entries.items())}})

    def _files_intact(self, entry: InstalledModel) -> bool:
        total = 0
        for name in entry.files:
            path = Path(name)
            if not path.is_file() or not path.resolve().is_relative_to(self.data_dir):
                return False
            total += path.stat().st_size
        return total == entry.size_bytes
