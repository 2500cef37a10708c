"""Installs from a Hugging Face-compatible server (tests/hf_server.py on 127.0.0.1, reached through HF_ENDPOINT):
the real huggingface_hub code path, with dropped connections, server errors, wrong bytes, kills and cancels."""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from install_support import (  # noqa: F401  (fixtures)
    catalog, finish, hf_file, hub, installers, make_model, part_size, settled, small_disk, store, wait_for,
)
from setup_logic.errors import NotEnoughDiskError, SetupError
from setup_logic.install import DISK_MARGIN_BYTES
from setup_logic.sources import RetryPolicy, human_bytes
from setup_logic.store import Store

MB = 1_000_000
REPO_ROOT = Path(__file__).resolve().parents[1]


def download_children() -> list[psutil.Process]:
    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            if any(arg.endswith("hf_fetch.py") for arg in child.cmdline()):
                found.append(child)
        except psutil.NoSuchProcess:
            pass
    return found


def leftovers(store: Store, model_id: str) -> list[str]:
    """Files in the model's folder besides the model files and the installer's own notes."""
    return sorted(p.name for p in (store.models_dir / model_id).rglob("*")
                  if not p.name.endswith(".gguf") and p.name not in (".verified.json", ".install.lock"))


def test_full_install_registers_verified_files(hub, store, installers):
    data = os.urandom(3 * MB)
    model = make_model("m", [hf_file(hub, "m.gguf", data)])
    installer = installers(store, catalog(model))
    progress = finish(installer, installer.start("m").model_id)
    assert progress.state == "installed", progress.error
    assert progress.bytes_done == progress.bytes_total == len(data)
    entry = store.get_installed("m")
    assert entry.sha256 == [hashlib.sha256(data).hexdigest()]
    assert Path(entry.files[0]).read_bytes() == data
    assert store.model_path("m") == store.models_dir / "m" / "m.gguf"
    assert hub.served("m.gguf") == len(data)
    assert leftovers(store, "m") == []
    # A second start finds it installed at once, without asking the server anything.
    asked = len(hub.requests)
    assert installer.start("m").state == "installed"
    assert len(hub.requests) == asked


def test_dropped_connection_resumes_without_downloading_again(hub, store, installers):
    data = os.urandom(6 * MB)
    hub.knobs.drop_after["m.gguf"] = 4 * MB
    installer = installers(store, catalog(make_model("m", [hf_file(hub, "m.gguf", data)])))
    progress = finish(installer, installer.start("m").model_id)
    assert progress.state == "installed", progress.error
    ranges = [r for method, _, r, _ in hub.requests if method == "GET"]
    assert ranges[0] is None and ranges[1].startswith("bytes=") and int(ranges[1][6:-1]) > 3 * MB
    assert hub.served("m.gguf") < 1.1 * len(data)
    assert store.get_installed("m") is not None


def test_server_errors_are_retried_with_backoff(hub, store, installers):
    data = os.urandom(MB)
    hub.knobs.fail_next = 2
    # Each wait outlasts wait()'s half-second look at the progress, so a look sees the retry's message (the tests'
    # fast policy waited 50-100 ms, which a look could miss).
    slow_enough = RetryPolicy(attempts=3, base_delay_s=1.0, max_delay_s=1.0)
    installer = installers(store, catalog(make_model("m", [hf_file(hub, "m.gguf", data)])), retry=slow_enough)
    notes: list[str] = []
    installer.start("m")
    progress = installer.wait("m", 60, on_progress=lambda p: notes.append(p.message))
    assert progress.state == "installed", progress.error
    assert [m for m, *_ in hub.requests[:3]] == ["HEAD", "HEAD", "HEAD"]  # two answered 500, the third worked
    assert any("retrying in" in n and "500" in n for n in notes), notes


def test_server_errors_that_last_fail_clearly(hub, store, installers):
    hub.knobs.fail_next = 100
    installer = installers(store, catalog(make_model("m", [hf_file(hub, "m.gguf", os.urandom(1000))])))
    progress = finish(installer, installer.start("m").model_id)
    assert progress.state == "failed"
    assert progress.error.startswith("Could not download m.gguf from http://127.0.0.1:")
    assert "after 3 tries (last: the server answered 500)" in progress.error
    assert "run install again" in progress.error
    assert store.get_installed("m") is None


def test_wrong_bytes_are_refused_named_and_removed(hub, store, installers):
    data = os.urandom(2 * MB)
    hub.knobs.wrong_bytes.add("m.gguf")
    installer = installers(store, catalog(make_model("m", [hf_file(hub, "m.gguf", data)])))
    progress = finish(installer, installer.start("m").model_id)
    assert progress.state == "failed"
    assert progress.error.startswith("m.gguf failed its check: its sha256 is ")
    assert hashlib.sha256(data).hexdigest() in progress.error and "nothing was installed" in progress.error
    assert store.get_installed("m") is None
    assert list((store.models_dir / "m").glob("m.gguf*")) == []
    # The next run downloads it again, and this time it is right.
    hub.knobs.wrong_bytes.clear()
    progress = finish(installer, installer.start("m").model_id)
    assert progress.state == "installed", progress.error
    assert hub.served("m.gguf") == 2 * len(data)


def test_killed_download_process_resumes_from_its_partial_bytes(hub, store, installers):
    data = os.urandom(6 * MB)
    hub.knobs.bytes_per_s = 6 * MB
    # A retry delay long enough to count what the server sent before the kill apart from the resume.
    installer = installers(store, catalog(make_model("m", [hf_file(hub, "m.gguf", data)])),
                           retry=RetryPolicy(attempts=3, base_delay_s=1.5))
    installer.start("m")
    wait_for(lambda: part_size(store, "m", "m.gguf") > 2 * MB, what="2 MB on disk")
    [child] = download_children()
    on_disk = part_size(store, "m", "m.gguf")
    child.send_signal(signal.SIGKILL)
    child.wait(10)
    served_before = settled(lambda: hub.served("m.gguf"), quiet_s=0.2)
    hub.knobs.bytes_per_s = None
    progress = finish(installer, "m")
    assert progress.state == "installed", progress.error
    [resumed_at] = [int(r[6:-1]) for m, _, r, _ in hub.requests if m == "GET" and r]
    assert resumed_at >= on_disk
    assert hub.served("m.gguf") - served_before == len(data) - resumed_at
    assert hub.served("m.gguf") < 1.1 * len(data)


CRASHING_SERVER = """
import json, sys
sys.path.insert(0, {tests!r})
from install_support import catalog, make_model
from setup_logic.catalog import ModelFile
from setup_logic.install import Installer
from setup_logic.store import Store
model = make_model("m", [ModelFile.model_validate(json.loads({file!r}))])
installer = Installer(Store({data!r}), catalog_lookup=catalog(model))
installer.start("m")
installer.wait("m", 60)
"""


def test_a_crashed_server_leaves_a_partial_file_that_a_new_installer_resumes(hub, store, installers, tmp_path):
    data = os.urandom(6 * MB)
    file = hf_file(hub, "m.gguf", data)
    hub.knobs.bytes_per_s = 6 * MB
    script = CRASHING_SERVER.format(tests=str(REPO_ROOT / "tests"), file=file.model_dump_json(),
                                    data=str(store.data_dir))
    server = subprocess.Popen([sys.executable, "-c", script], cwd=REPO_ROOT,
                              env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    try:
        wait_for(lambda: part_size(store, "m", "m.gguf") > 2 * MB, what="2 MB on disk")
        orphan = psutil.Process(server.pid).children()[0]
        server.send_signal(signal.SIGKILL)
        server.wait(10)
        # Our download process notices that its parent died and ends by itself.
        orphan.wait(10)
    finally:
        if server.poll() is None:
            server.kill()
    hub.knobs.bytes_per_s = None
    kept = part_size(store, "m", "m.gguf")
    assert kept > 2 * MB
    installer = installers(store, catalog(make_model("m", [file])))
    assert installer.plan("m").files[0].already_have_bytes == kept
    progress = finish(installer, installer.start("m").model_id)
    assert progress.state == "installed", progress.error
    assert hub.served("m.gguf") < 1.1 * len(data)


def test_cancel_stops_at_once_and_a_new_start_resumes(hub, store, installers):
    data = os.urandom(6 * MB)
    hub.knobs.bytes_per_s = 4 * MB
    installer = installers(store, catalog(make_model("m", [hf_file(hub, "m.gguf", data)])))
    installer.start("m")
    wait_for(lambda: part_size(store, "m", "m.gguf") > MB, what="1 MB on disk")
    began = time.monotonic()
    progress = installer.cancel("m")
    assert time.monotonic() - began < 2.0
    assert progress.state == "cancelled" and "kept" in progress.message
    assert download_children() == []
    kept = part_size(store, "m", "m.gguf")
    time.sleep(0.3)
    assert part_size(store, "m", "m.gguf") == kept > MB  # nothing writes any more
    assert store.get_installed("m") is None
    hub.knobs.bytes_per_s = None
    progress = finish(installer, installer.start("m").model_id)
    assert progress.state == "installed", progress.error
    assert hub.served("m.gguf") < 1.1 * len(data)


def test_two_starts_share_one_job(hub, store, installers):
    hub.knobs.bytes_per_s = 4 * MB
    installer = installers(store, catalog(make_model("m", [hf_file(hub, "m.gguf", os.urandom(2 * MB))])))
    first = installer.start("m")
    second = installer.start("m")
    assert second.started_at == first.started_at
    assert len(installer.jobs()) == 1
    hub.knobs.bytes_per_s = None
    assert finish(installer, "m").state == "installed"
    assert [m for m, *_ in hub.requests] == ["HEAD", "HEAD", "GET"]  # the plan's question, then the download


def test_a_stall_is_reported_then_the_download_goes_on(hub, store, installers):
    hub.knobs.pause_after["m.gguf"] = (MB, 2.0)
    installer = installers(store, catalog(make_model("m", [hf_file(hub, "m.gguf", os.urandom(2 * MB))])),
                           stall_seconds=0.8)
    seen = []
    installer.start("m")
    progress = installer.wait("m", 60, on_progress=seen.append)
    assert progress.state == "installed", progress.error
    # The pause after 1 MB is reported (a slow start of the download on a busy machine may be reported too).
    stalled = [p for p in seen if p.stalled and p.bytes_done > 0]
    assert stalled and stalled[0].message.startswith("no data has arrived for")
    assert stalled[0].bytes_done < 2 * MB


def test_progress_reports_rate_and_eta(hub, store, installers):
    hub.knobs.bytes_per_s = 2 * MB
    installer = installers(store, catalog(make_model("m", [hf_file(hub, "m.gguf", os.urandom(4 * MB))])))
    installer.start("m")
    seen = []
    installer.wait("m", 60, on_progress=seen.append)
    moving = [p for p in seen if p.state == "downloading" and p.rate_bytes_per_s]
    assert moving, seen
    mid = moving[len(moving) // 2]
    # Never above the server's pace; below it where a busy machine reads slower.
    assert 0 < mid.rate_bytes_per_s < 3 * MB
    assert mid.eta_seconds == pytest.approx((mid.bytes_total - mid.bytes_done) / mid.rate_bytes_per_s)
    assert f", {human_bytes(mid.rate_bytes_per_s)}/s, about " in mid.message and "left" in mid.message


def test_split_gguf_installs_as_one_model(hub, store, installers):
    names = [f"Model-Q4_K_M-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    blobs = [os.urandom(MB + i) for i in range(3)]
    files = [hf_file(hub, n, b, path=f"Q4_K_M/{n}") for n, b in zip(names, blobs, strict=True)]
    installer = installers(store, catalog(make_model("split", files)))
    plan = installer.plan("split")
    assert plan.download_bytes == sum(map(len, blobs)) and len(plan.files) == 3
    progress = finish(installer, installer.start("split").model_id)
    assert progress.state == "installed", progress.error
    entry = store.get_installed("split")
    assert [Path(p).name for p in entry.files] == names
    assert entry.size_bytes == sum(map(len, blobs))
    assert store.model_path("split").name == names[0]
    assert [Path(p).read_bytes() for p in entry.files] == blobs


def test_plan_writes_nothing(hub, store, installers, tmp_path):
    installer = installers(store, catalog(make_model("m", [hf_file(hub, "m.gguf", os.urandom(MB))])))
    plan = installer.plan("m")
    assert not store.data_dir.exists()
    # The plan asks the hub (HEAD) which commit main names now; the download will fetch that commit.
    commit = hub.commits["test-org/test-model"]
    assert hub.requests == [("HEAD", "/test-org/test-model/resolve/main/m.gguf", None, None)]
    assert plan.files[0].revision == commit
    assert plan.download_bytes == MB and not plan.already_installed and plan.enough_disk
    assert plan.disk_needed_bytes == MB + DISK_MARGIN_BYTES
    assert plan.summary.startswith("Plan: install Test model m (Q4_1, 1 file(s)): 1.0 MB to download;")
    assert plan.summary.endswith(f"needed). From test-org/test-model at commit {commit}. Nothing was written yet; "
                                 "confirm to start.")
    # With a partial download present, the plan counts it and still writes nothing.
    folder = store.models_dir / "m"
    folder.mkdir(parents=True)
    (folder / "m.gguf.part").write_bytes(b"x" * 1000)
    before = {p: p.stat().st_mtime_ns for p in store.data_dir.rglob("*")}
    plan = installer.plan("m")
    assert plan.files[0].already_have_bytes == 1000 and plan.download_bytes == MB - 1000
    assert {p: p.stat().st_mtime_ns for p in store.data_dir.rglob("*")} == before


def test_plan_and_start_refuse_when_the_disk_is_short(hub, store, installers, monkeypatch):
    installer = installers(store, catalog(make_model("m", [hf_file(hub, "m.gguf", os.urandom(MB))])))
    monkeypatch.setattr(store, "free_disk_bytes", lambda: 500 * MB)
    plan = installer.plan("m")
    assert not plan.enough_disk and plan.disk_free_bytes == 500 * MB
    assert plan.summary.startswith("Not enough free disk space for Test model m: about 1.1 GB needed at ")
    assert plan.summary.endswith("500.0 MB free; free some space or set STRATA_DATA_DIR to a folder on a bigger "
                                 "drive.")
    with pytest.raises(NotEnoughDiskError, match="Not enough free disk space"):
        installer.start("m")
    assert not store.data_dir.exists() and {m for m, *_ in hub.requests} == {"HEAD"}


def test_paths_that_leave_the_data_folder_are_refused(hub, store, installers, tmp_path):
    bad = hf_file(hub, "m.gguf", os.urandom(1000))
    bad.name = "../../escaped.gguf"
    installer = installers(store, catalog(make_model("bad", [bad])))
    with pytest.raises(SetupError, match=re.escape("contains '..'")):
        installer.plan("bad")
    with pytest.raises(SetupError, match=re.escape("contains '..'")):
        installer.start("bad")
    # A model folder that is a link to somewhere else is refused too.
    outside = tmp_path / "outside"
    outside.mkdir()
    store.models_dir.mkdir(parents=True)
    (store.models_dir / "m").symlink_to(outside)
    installer = installers(store, catalog(make_model("m", [hf_file(hub, "m.gguf", os.urandom(1000))])))
    with pytest.raises(SetupError, match="outside the data folder"):
        installer.start("m")
    assert list(outside.iterdir()) == [] and hub.requests == []
    # So is a partial file that is a link to a file elsewhere.
    (store.models_dir / "p").mkdir()
    (store.models_dir / "p" / "m.gguf.part").symlink_to(outside / "victim")
    installer = installers(store, catalog(make_model("p", [hf_file(hub, "m.gguf", os.urandom(1000))])))
    with pytest.raises(SetupError, match="outside the data folder"):
        installer.start("p")
    assert list(outside.iterdir()) == [] and hub.requests == []


def test_missing_repo_fails_at_once_with_what_to_do(hub, store, installers):
    file = hf_file(hub, "m.gguf", os.urandom(1000))
    file.repo = "test-org/no-such-repo"
    installer = installers(store, catalog(make_model("m", [file])))
    # Found out when planning, before anything is written.
    with pytest.raises(SetupError) as info:
        installer.start("m")
    assert str(info.value).startswith("m.gguf was not found at test-org/no-such-repo (m.gguf at main) on ")
    assert "(RepositoryNotFound)" in str(info.value) and "check HF_ENDPOINT" in str(info.value)
    assert len(hub.requests) == 1 and not store.data_dir.exists()  # not retried


def test_hf_token_set_after_import_is_sent(hub, store, installers, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_testtoken123")
    installer = installers(store, catalog(make_model("m", [hf_file(hub, "m.gguf", os.urandom(1000))])))
    assert finish(installer, installer.start("m").model_id).state == "installed"
    assert {auth for *_, auth in hub.requests} == {"Bearer hf_testtoken123"}


def test_catalog_pin_that_no_longer_matches_the_hub_is_refused(hub, store, installers):
    file = hf_file(hub, "m.gguf", os.urandom(1000))
    hub.add_file(file.repo, "m.gguf", os.urandom(1000))  # the repository changed since the catalog was written
    installer = installers(store, catalog(make_model("m", [file])))
    with pytest.raises(SetupError) as info:
        installer.plan("m")
    assert str(info.value).startswith("m.gguf from test-org/test-model (m.gguf at main) on http://127.0.0.1:")
    assert "does not match the catalog (the server's sha256 is " in str(info.value)
    assert [m for m, *_ in hub.requests] == ["HEAD"]


def test_a_rounded_catalog_size_takes_the_exact_size_from_the_hub(hub, store, installers):
    data = os.urandom(1_234_567)
    file = hf_file(hub, "m.gguf", data, sha256=False)
    file.size, file.size_exact = 1_200_000, False
    installer = installers(store, catalog(make_model("m", [file])))
    progress = finish(installer, installer.start("m").model_id)
    assert progress.state == "installed", progress.error
    assert progress.bytes_total == len(data)
    assert store.get_installed("m").size_bytes == len(data)


def test_files_already_in_place_are_verified_not_downloaded(hub, store, installers):
    data = os.urandom(MB)
    installer = installers(store, catalog(make_model("m", [hf_file(hub, "m.gguf", data)])))
    # As if copied by hand, or left by an install whose registry entry was lost.
    (store.models_dir / "m").mkdir(parents=True)
    (store.models_dir / "m" / "m.gguf").write_bytes(data)
    assert installer.plan("m").download_bytes == 0
    progress = finish(installer, installer.start("m").model_id)
    assert progress.state == "installed", progress.error
    assert hub.requests == []
    # A file with the right size but the wrong bytes is replaced.
    store.unregister("m")
    (store.models_dir / "m" / "m.gguf").write_bytes(os.urandom(MB))
    progress = finish(installer, installer.start("m").model_id)
    assert progress.state == "installed", progress.error
    assert (store.models_dir / "m" / "m.gguf").read_bytes() == data and hub.served("m.gguf") == MB


def test_the_packaged_smollm2_gguf_installs_from_the_hub(hub, store, installers, smollm2_gguf):
    data = smollm2_gguf.read_bytes()
    file = hf_file(hub, "SmolLM2-135M-Instruct.Q4_1.gguf", data, repo="HuggingFaceTB/SmolLM2-135M-Instruct-GGUF")
    assert file.sha256 == "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    installer = installers(store, catalog(make_model("smollm2", [file])))
    progress = finish(installer, installer.start("smollm2").model_id)
    assert progress.state == "installed", progress.error
    installed = store.model_path("smollm2")
    assert installed.stat().st_size == len(data)
    assert installed.read_bytes()[:4] == b"GGUF"
    assert json.loads((store.models_dir / "smollm2" / ".verified.json").read_text())[file.name]["sha256"] == \
        file.sha256


def test_a_full_disk_fails_clearly_and_keeps_the_partial_file(hub, installers, small_disk, monkeypatch):
    mount_point, remount = small_disk
    store = Store(mount_point / "data")
    # The check before the start passed; then something else filled the drive.
    monkeypatch.setattr(store, "free_disk_bytes", lambda: 1 << 40)
    data = os.urandom(4 * MB)
    installer = installers(store, catalog(make_model("m", [hf_file(hub, "m.gguf", data)])))
    progress = finish(installer, installer.start("m").model_id)
    assert progress.state == "failed"
    assert progress.error.startswith(f"The disk holding {store.models_dir / 'm'} filled up while downloading m.gguf;")
    assert "free some space" in progress.error and "already downloaded are kept." in progress.error
    kept = part_size(store, "m", "m.gguf")
    assert kept > MB
    assert store.get_installed("m") is None
    served_before = hub.served("m.gguf")
    remount("16m")
    progress = finish(installer, installer.start("m").model_id)
    assert progress.state == "installed", progress.error
    [resumed_at] = [int(r[6:-1]) for m, _, r, _ in hub.requests if m == "GET" and r]
    assert resumed_at == kept
    assert hub.served("m.gguf") - served_before == len(data) - kept
    assert store.model_path("m").read_bytes() == data


def test_a_second_installer_on_the_same_folder_is_refused_while_one_runs(hub, store, installers):
    hub.knobs.bytes_per_s = 2 * MB
    lookup = catalog(make_model("m", [hf_file(hub, "m.gguf", os.urandom(2 * MB))]))
    first, other = installers(store, lookup), installers(store, lookup)
    first.start("m")
    with pytest.raises(SetupError, match=r"Another program is installing m into .* right now; wait for it"):
        other.start("m")
    hub.knobs.bytes_per_s = None
    assert finish(first, "m").state == "installed"
    assert other.start("m").state == "installed"


def test_jobs_progress_and_their_errors(hub, store, installers):
    installer = installers(store, catalog(make_model("m", [hf_file(hub, "m.gguf", os.urandom(1000))])))
    assert installer.progress("m") is None and installer.jobs() == []
    with pytest.raises(SetupError, match=re.escape("No install of m was started, so there is nothing to cancel.")):
        installer.cancel("m")
    with pytest.raises(SetupError, match=re.escape("No install of m was started; start it first.")):
        installer.wait("m", 1)
    finish(installer, installer.start("m").model_id)
    fresh = installers(store, installer.catalog_lookup)
    done = fresh.start("m")  # installed before: reported at once, and kept as the model's job
    assert done.state == "installed" and done.bytes_done == done.bytes_total == 1000
    assert fresh.progress("m") == done and fresh.jobs() == [done]
    assert fresh.cancel("m").state == "installed"
