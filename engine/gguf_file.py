"""Open a GGUF model file (or the first file of a split set) with the `gguf` package.

Metadata is decoded lazily (the vocabulary arrays are large), tensors are memory-mapped views of the
file's bytes. Any damage a person can cause (a truncated download, a wrong file, a missing split part)
becomes an EngineError that names the file and says what to do.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType

from engine.errors import EngineError

_SPLIT_NAME = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
_REDOWNLOAD = "Download the model again (or pick another file)."


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor as stored: raw bytes (a read-only view of the mapped file), GGML type, logical shape.

    `shape` is row-major (NumPy order), i.e. GGUF's ne reversed: a matrix with ne = [k, m] has shape (m, k)
    and each of its m rows is k values long.
    """

    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]
    raw: np.ndarray
    file: Path | None = None  # where raw lies in a file (None for a tensor made in memory)
    offset: int = 0

    @property
    def nbytes(self) -> int:
        return int(self.raw.nbytes)

    def read(self, start: int, count: int) -> np.ndarray:
        """count bytes of the data from byte `start`: read from the file, so no mapping of it stays open (for what
        needs the bytes after the model's load has closed the file)."""
        if self.file is None:
            return np.asarray(self.raw).reshape(-1).view(np.uint8)[start : start + count].copy()
        with open(self.file, "rb") as f:
            f.seek(self.offset + start)
            data = f.read(count)
        if len(data) != count:
            raise EngineError(f"The model file {self.file} was cut short while in use; tensor {self.name} is no "
                              f"longer whole. {_REDOWNLOAD}")
        return np.frombuffer(data, np.uint8)

    @property
    def type_name(self) -> str:
        return self.qtype.name


@dataclass(frozen=True)
class GGUFSummary:
    """What a GGUF file says about itself, read without loading any weights."""

    path: str
    architecture: str
    name: str
    context_length: int | None
    tensor_count: int
    tensor_types: dict[str, int]
    file_size: int
    files: list[str] = field(default_factory=list)
    parameter_count: int = 0


def split_paths(path: Path) -> list[Path]:
    """All files of a split GGUF given its first part (`x-00001-of-00003.gguf`), or [path] if not split."""
    match = _SPLIT_NAME.match(path.name)
    if match is None:
        return [path]
    number, count = int(match["no"]), int(match["count"])
    if number != 1:
        first = path.with_name(f"{match['stem']}-00001-of-{match['count']}.gguf")
        raise EngineError(f"{path} is part {number} of a split GGUF model; open its first part, {first}.")
    paths = [path.with_name(f"{match['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = [p.name for p in paths if not p.is_file()]
    if missing:
        raise EngineError(
            f"The split GGUF model {path.name} needs {count} files, but {', '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} missing from {path.parent}. "
            "Download the missing parts into the same folder."
        )
    return paths


def _open_reader(path: Path) -> GGUFReader:
    if not path.is_file():
        raise EngineError(f"The model file {path} does not exist. Check the path, or install the model first.")
    try:
        reader = GGUFReader(path, "r")
    except (ValueError, IndexError, KeyError, OverflowError, UnicodeDecodeError) as exc:
        size = path.stat().st_size
        raise EngineError(
            f"The model file {path} ({size} bytes) is truncated or corrupt and cannot be read as GGUF "
            f"({exc}). {_REDOWNLOAD}"
        ) from None
    except OSError as exc:
        raise EngineError(f"The model file {path} cannot be opened ({exc.strerror}). Check its permissions.") from None
    size = len(reader.data)
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size:
            raise EngineError(
                f"The model file {path} is truncated: tensor {t.name} extends to byte "
                f"{t.data_offset + t.n_bytes} but the file has only {size} bytes. {_REDOWNLOAD}"
            )
    return reader


def _field_value(f) -> Any:
    main = f.types[0]
    if main == GGUFValueType.ARRAY:
        if f.types[-1] == GGUFValueType.STRING:
            return [bytes(f.parts[i]).decode("utf-8", errors="replace") for i in f.data]
        return np.concatenate([f.parts[i] for i in f.data]) if f.data else np.zeros(0)
    if main == GGUFValueType.STRING:
        return bytes(f.parts[-1]).decode("utf-8", errors="replace")
    return f.parts[-1].tolist()[0]


class GGUFFile:
    """A GGUF model, possibly split over several files: lazy metadata and memory-mapped tensors."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.paths = split_paths(self.path)
        self._readers = [_open_reader(p) for p in self.paths]
        self._fields = {name: f for name, f in self._readers[0].fields.items() if not name.startswith("GGUF.")}
        self._values: dict[str, Any] = {}
        self.tensors: dict[str, GGUFTensor] = {}
        for reader in self._readers:
            for t in reader.tensors:
                shape = tuple(int(d) for d in reversed(t.shape.tolist()))
                raw = reader.data[t.data_offset : t.data_offset + t.n_bytes]
                self.tensors[t.name] = GGUFTensor(t.name, GGMLQuantizationType(t.tensor_type), shape, raw,
                                                  Path(reader.data.filename), int(t.data_offset))
        expected = self.get("split.tensors.count")
        if expected is not None and expected != len(self.tensors):
            raise EngineError(
                f"The split GGUF model {self.path.name} should hold {expected} tensors but its parts hold "
                f"{len(self.tensors)}. One part is probably from another model or damaged; {_REDOWNLOAD}"
            )

    @property
    def architecture(self) -> str:
        return str(self.require("general.architecture"))

    @property
    def file_size(self) -> int:
        return sum(len(r.data) for r in self._readers)

    def get(self, key: str, default: Any = None) -> Any:
        """A metadata value (str, int, float, bool, list of str, or a NumPy array), or default."""
        if key not in self._values:
            f = self._fields.get(key)
            if f is None:
                return default
            self._values[key] = _field_value(f)
        return self._values[key]

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise EngineError(f"The model file {self.path.name} lacks the metadata key {key!r}. {_REDOWNLOAD}")
        return value

    def tensor(self, name: str) -> GGUFTensor:
        t = self.tensors.get(name)
        if t is None:
            raise EngineError(
                f"The model file {self.path.name} has no tensor {name!r}, which its architecture "
                f"({self.get('general.architecture')}) needs. The file is incomplete or not a supported model."
            )
        return t

    def tensor_types(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for t in self.tensors.values():
            counts[t.type_name] = counts.get(t.type_name, 0) + 1
        return dict(sorted(counts.items()))

    def summary(self) -> GGUFSummary:
        arch = self.architecture
        ctx = self.get(f"{arch}.context_length")
        return GGUFSummary(
            path=str(self.path),
            architecture=arch,
            name=str(self.get("general.name", self.path.stem)),
            context_length=int(ctx) if ctx is not None else None,
            tensor_count=len(self.tensors),
            tensor_types=self.tensor_types(),
            file_size=self.file_size,
            files=[str(p) for p in self.paths],
            parameter_count=sum(int(np.prod(t.shape)) for t in self.tensors.values()),
        )

    def close(self) -> None:
        """Drop the file mappings (tensors handed out keep their own references)."""
        self._readers = []
        self.tensors = {}


def read_gguf_summary(path: str | Path) -> GGUFSummary:
    """Architecture, name, context length, tensor count and types, file size of a GGUF, without loading
    weights. Raises EngineError naming the file if it is missing, truncated or corrupt."""
    gguf = GGUFFile(path)
    try:
        return gguf.summary()
    finally:
        gguf.close()
