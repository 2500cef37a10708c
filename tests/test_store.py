"""The data folder: where it is, which paths it refuses, and the registry of installed models."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from install_support import read_only_folder  # noqa: F401  (fixture)
from setup_logic.errors import SetupError
from setup_logic.store import InstalledModel, Store, default_data_dir


def test_default_data_dir_follows_strata_data_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("STRATA_DATA_DIR", str(tmp_path / "strata-data"))
    assert default_data_dir() == tmp_path / "strata-data"
    assert Store().data_dir == (tmp_path / "strata-data").resolve()
    monkeypatch.setenv("STRATA_DATA_DIR", "relative/dir")
    with pytest.raises(SetupError, match="STRATA_DATA_DIR must be an absolute path"):
        default_data_dir()


@pytest.mark.skipif(sys.platform != "linux", reason="the Linux default")
def test_default_data_dir_on_linux(monkeypatch, tmp_path):
    monkeypatch.delenv("STRATA_DATA_DIR", raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    assert default_data_dir() == tmp_path / "strata-mcp"
    monkeypatch.delenv("XDG_DATA_HOME")
    assert default_data_dir() == Path.home() / ".local" / "share" / "strata-mcp"


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX system folders")
def test_a_system_folder_is_refused_as_data_folder():
    with pytest.raises(SetupError, match="inside the system folder /etc"):
        Store(Path("/etc/strata-data"))


def test_store_creates_nothing(tmp_path):
    store = Store(tmp_path / "data")
    assert store.installed() == []
    assert store.get_installed("x") is None
    assert store.free_disk_bytes() > 0
    assert not (tmp_path / "data").exists()


@pytest.mark.parametrize("bad, why", [
    ("../outside", "contains '..'"),
    ("models/../../outside", "contains '..'"),
    ("/etc/passwd", "is absolute"),
    ("C:\\Windows\\evil", "is absolute"),
    ("\\\\server\\share\\x", "is absolute"),
    ("", "is empty"),
    ("a\0b", "NUL"),
])
def test_resolve_refuses_paths_that_leave_the_folder(tmp_path, bad, why):
    store = Store(tmp_path / "data")
    with pytest.raises(SetupError, match=why):
        store.resolve(bad)


def test_resolve_refuses_a_link_that_leads_outside(tmp_path):
    store = Store(tmp_path / "data")
    store.models_dir.mkdir(parents=True)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (store.models_dir / "evil").symlink_to(outside)
    with pytest.raises(SetupError, match="outside the data folder"):
        store.resolve("models/evil/model.gguf")
    with pytest.raises(SetupError, match="outside the data folder"):
        store.model_dir("evil")
    # A link that stays inside is fine.
    (store.models_dir / "real").mkdir()
    (store.models_dir / "alias").symlink_to(store.models_dir / "real")
    assert store.resolve("models/alias/m.gguf") == store.models_dir / "real" / "m.gguf"


@pytest.mark.parametrize("bad_id", ["../x", "a/b", ".hidden", "", "x" * 200])
def test_model_ids_must_be_one_plain_name(tmp_path, bad_id):
    with pytest.raises(SetupError, match="not a valid model id"):
        Store(tmp_path / "data").model_dir(bad_id)


def _install_fake(store: Store, model_id: str, content: bytes) -> InstalledModel:
    folder = store.model_dir(model_id)
    folder.mkdir(parents=True)
    (folder / "m.gguf").write_bytes(content)
    entry = InstalledModel(id=model_id, files=[str(folder / "m.gguf")], size_bytes=len(content),
                           sha256=[None], installed_at="2026-01-01T00:00:00+00:00")
    store.register(entry)
    return entry


def test_registry_round_trip_and_integrity(tmp_path):
    store = Store(tmp_path / "data")
    entry = _install_fake(store, "m1", b"gguf bytes")
    _install_fake(store, "m2", b"other")
    assert {e.id for e in Store(tmp_path / "data").installed()} == {"m1", "m2"}
    assert store.model_path("m1") == Path(entry.files[0])
    # No temp file is left next to the registry.
    assert sorted(p.name for p in store.data_dir.iterdir()) == ["installed.json", "installed.json.lock", "models"]

    # A truncated file no longer counts as installed, and model_path says what to do.
    Path(entry.files[0]).write_bytes(b"gguf")
    assert [e.id for e in store.installed()] == ["m2"]
    with pytest.raises(SetupError, match="run install for m1 first"):
        store.model_path("m1")

    store.unregister("m2")
    assert store.installed() == []
    assert "m1" in json.loads(store.registry_path.read_text())["models"]


def test_a_corrupt_registry_is_kept_aside_and_reported(tmp_path):
    store = Store(tmp_path / "data")
    _install_fake(store, "m1", b"gguf bytes")
    store.registry_path.write_text('{"models": {"m1": {"id": "m1", "fi')  # cut short, e.g. by a crash elsewhere
    assert store.installed() == []
    kept = [p for p in store.data_dir.iterdir() if p.name.startswith("installed.json.damaged-")]
    assert len(kept) == 1 and kept[0].read_text() == '{"models": {"m1": {"id": "m1", "fi'
    assert "could not be read" in store.registry_warning and "run install again" in store.registry_warning
    assert (store.models_dir / "m1" / "m.gguf").read_bytes() == b"gguf bytes"
    # The registry works again from here on.
    _install_fake(store, "m2", b"x")
    assert [e.id for e in store.installed()] == ["m2"]


def test_registry_writes_are_atomic(tmp_path, monkeypatch):
    store = Store(tmp_path / "data")
    _install_fake(store, "m1", b"one")
    before = store.registry_path.read_bytes()

    def crash(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError):
        _install_fake(store, "m2", b"two")
    monkeypatch.undo()
    assert store.registry_path.read_bytes() == before
    assert [p.name for p in store.data_dir.iterdir() if p.suffix == ".tmp"] == []


def _entry(store: Store, model_id: str = "m1") -> InstalledModel:
    return InstalledModel(id=model_id, files=[str(store.models_dir / model_id / "m.gguf")], size_bytes=1,
                          sha256=[None], installed_at="2026-01-01T00:00:00+00:00")


def test_a_read_only_data_folder_is_one_sentence_and_still_reads(read_only_folder):
    store = Store(read_only_folder)
    assert store.installed() == [] and store.get_installed("m1") is None
    with pytest.raises(SetupError) as info:
        store.register(_entry(store))
    message = str(info.value)
    assert message.endswith(f"make the data folder {read_only_folder} a writable folder, or set STRATA_DATA_DIR "
                            "to one.") or message == (f"The data folder {read_only_folder} is on a read-only drive; "
                                                      "set STRATA_DATA_DIR to a folder on a writable drive.")
    assert "\n" not in message


def test_a_data_folder_below_a_file_is_one_sentence(tmp_path):
    (tmp_path / "a-file").write_text("x")
    store = Store(tmp_path / "a-file" / "data")
    assert store.installed() == []
    with pytest.raises(SetupError, match=r"^Cannot write to .*a-file/data \(Not a directory\); make the data "
                                         r"folder .* a writable folder, or set STRATA_DATA_DIR to one\.$"):
        store.register(_entry(store))


def test_a_registry_that_is_a_folder_is_one_sentence(tmp_path):
    store = Store(tmp_path / "data")
    store.registry_path.mkdir(parents=True)
    with pytest.raises(SetupError, match=r"^The list of installed models .*installed\.json is a folder, not a "
                                         r"file; move that folder away"):
        store.installed()
    with pytest.raises(SetupError, match="is a folder, not a file"):
        store.register(_entry(store))


def test_a_registry_nested_too_deep_for_json_is_kept_aside_as_damaged(tmp_path):
    store = Store(tmp_path / "data")
    store.data_dir.mkdir(parents=True)
    store.registry_path.write_text('{"models": ' + "[" * 200_000)
    assert store.installed() == []
    assert "could not be read (RecursionError)" in store.registry_warning
    assert len([p for p in store.data_dir.iterdir() if p.name.startswith("installed.json.damaged-")]) == 1
    assert not store.registry_path.exists()
