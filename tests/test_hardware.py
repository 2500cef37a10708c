from pathlib import Path
from types import SimpleNamespace

import pytest

from engine import capabilities
from setup_logic import hardware
from setup_logic.engine_profile import EngineProfile
from setup_logic.hardware import (
    GIB, CpuInfo, GpuInfo, best_gpu, disk_free, judge, parse_cpuinfo, probe, probe_amd, probe_cpu, probe_nvidia,
)

ENGINE = EngineProfile(**capabilities.profile())

INTEL_CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Core(TM) i7-9700K CPU @ 3.60GHz
flags\t\t: fpu vme sse sse2 ssse3 fma sse4_1 sse4_2 avx f16c avx2 bmi2
bugs\t\t: spectre_v1

processor\t: 1
model name\t: Intel(R) Core(TM) i7-9700K CPU @ 3.60GHz
flags\t\t: fpu avx avx2 avx512f
"""

OLD_CPUINFO = """processor\t: 0
model name\t: Intel(R) Core(TM) i7-2600 CPU @ 3.40GHz
flags\t\t: fpu sse sse2 ssse3 sse4_1 sse4_2 popcnt avx
"""

ARM_CPUINFO = """processor\t: 0
BogoMIPS\t: 108.00
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp
CPU implementer\t: 0x41
"""


def test_parse_cpuinfo_reads_model_and_first_processors_flags():
    model, flags = parse_cpuinfo(INTEL_CPUINFO)
    assert model == "Intel(R) Core(TM) i7-9700K CPU @ 3.60GHz"
    assert {"avx", "avx2", "fma", "f16c"} <= flags
    assert "avx512f" not in flags  # only processor 0's line counts


def test_probe_cpu_flags_on_linux():
    cpu = probe_cpu(INTEL_CPUINFO, system="Linux")
    assert (cpu.avx, cpu.avx2, cpu.avx512f, cpu.fma, cpu.f16c) == (True, True, False, True, True)
    old = probe_cpu(OLD_CPUINFO, system="Linux")
    assert old.model.startswith("Intel(R) Core(TM) i7-2600")
    assert (old.avx, old.avx2, old.fma) == (True, False, False)
    assert cpu.logical_cores >= 1


def test_probe_cpu_arm_has_no_x86_flags_and_a_fallback_name():
    cpu = probe_cpu(ARM_CPUINFO, system="Linux")
    assert cpu.avx2 is False and cpu.avx is False
    assert cpu.model


def test_probe_cpu_elsewhere_says_unknown_instead_of_guessing():
    cpu = probe_cpu(INTEL_CPUINFO, system="Windows")
    assert (cpu.avx, cpu.avx2, cpu.avx512f, cpu.fma, cpu.f16c) == (None,) * 5


def test_disk_free_uses_nearest_existing_parent(tmp_path):
    path, free = disk_free(tmp_path / "not" / "yet" / "there")
    assert path == tmp_path
    assert free > 0


class FakeNvmlError(Exception):
    pass


def fake_nvml(devices, fail_init=False, fail_device=None, name_as_bytes=False):
    """An object with the pynvml functions probe_nvidia calls; devices are (name, total, free, (major, minor))."""
    calls = []

    def init():
        calls.append("init")
        if fail_init:
            raise FakeNvmlError("Driver Not Loaded")

    def handle(index):
        if index == fail_device:
            raise FakeNvmlError("GPU is lost")
        return index

    def name(h):
        return devices[h][0].encode() if name_as_bytes else devices[h][0]

    def memory(h):
        _, total, free, _ = devices[h]
        return SimpleNamespace(total=total, free=free, used=total - free)

    return SimpleNamespace(
        NVMLError=FakeNvmlError,
        nvmlInit=init,
        nvmlShutdown=lambda: calls.append("shutdown"),
        nvmlSystemGetDriverVersion=lambda: b"570.86.15" if name_as_bytes else "570.86.15",
        nvmlDeviceGetCount=lambda: len(devices),
        nvmlDeviceGetHandleByIndex=handle,
        nvmlDeviceGetName=name,
        nvmlDeviceGetMemoryInfo=memory,
        nvmlDeviceGetCudaComputeCapability=lambda h: devices[h][3],
        calls=calls,
    )


def test_probe_nvidia_reads_every_field():
    nvml = fake_nvml([("NVIDIA GeForce RTX 4090", 24 * GIB, 22 * GIB, (8, 9)),
                      ("NVIDIA GeForce RTX 3060", 12 * GIB, 12 * GIB, (8, 6))], name_as_bytes=True)
    gpus, notes = probe_nvidia(nvml)
    assert notes == []
    assert [g.name for g in gpus] == ["NVIDIA GeForce RTX 4090", "NVIDIA GeForce RTX 3060"]
    first = gpus[0]
    assert (first.vram_total_bytes, first.vram_free_bytes, first.vram_used_bytes) == (24 * GIB, 22 * GIB, 2 * GIB)
    assert (first.driver_version, first.compute_capability, first.source) == ("570.86.15", "8.9", "nvml")
    assert nvml.calls == ["init", "shutdown"]


def test_probe_nvidia_without_driver_is_no_gpu_with_a_note():
    gpus, notes = probe_nvidia(fake_nvml([], fail_init=True))
    assert gpus == []
    assert "Driver Not Loaded" in notes[0] and "update its driver" in notes[0]


def test_probe_nvidia_skips_a_broken_device_and_says_so():
    nvml = fake_nvml([("A", 8 * GIB, 8 * GIB, (7, 5)), ("B", 8 * GIB, 8 * GIB, (7, 5))], fail_device=0)
    gpus, notes = probe_nvidia(nvml)
    assert [g.name for g in gpus] == ["B"]
    assert "GPU 0" in notes[0] and "GPU is lost" in notes[0]
    assert nvml.calls[-1] == "shutdown"


def write_card(root: Path, name: str, files: dict[str, str]):
    device = root / name / "device"
    device.mkdir(parents=True)
    for file, text in files.items():
        (device / file).write_text(text)


def test_probe_amd_reads_sysfs(tmp_path):
    write_card(tmp_path, "card1", {"vendor": "0x1002\n", "device": "0x744c\n",
                                   "mem_info_vram_total": f"{24 * GIB}\n", "mem_info_vram_used": f"{GIB}\n"})
    write_card(tmp_path, "card0", {"vendor": "0x8086\n", "mem_info_vram_total": "1000\n"})  # Intel iGPU
    write_card(tmp_path, "card2", {"vendor": "0x1002\n", "product_name": "Radeon RX 7600\n",
                                   "mem_info_vram_total": f"{8 * GIB}\n"})
    write_card(tmp_path, "card1-DP-1", {"vendor": "0x1002\n"})  # a connector, not a card
    write_card(tmp_path, "card3", {"vendor": "0x1002\n"})  # no VRAM figure: not an amdgpu device
    gpus = probe_amd(tmp_path)
    assert [(g.index, g.name) for g in gpus] == [(1, "AMD GPU (PCI device 0x744c)"), (2, "Radeon RX 7600")]
    assert (gpus[0].vram_total_bytes, gpus[0].vram_used_bytes, gpus[0].vram_free_bytes) == (24 * GIB, GIB, 23 * GIB)
    assert gpus[1].vram_free_bytes == 8 * GIB and gpus[1].source == "sysfs"


def cpu(avx2=True):
    return CpuInfo(model="x", physical_cores=8, logical_cores=16, avx=True, avx2=avx2, avx512f=False, fma=True, f16c=True)


def nvidia(name="RTX 4090", total=24, free=23.5, cc="8.9", index=0):
    return GpuInfo(index=index, vendor="nvidia", name=name, vram_total_bytes=int(total * GIB),
                   vram_free_bytes=int(free * GIB), vram_used_bytes=int((total - free) * GIB),
                   driver_version="570", compute_capability=cc, source="nvml")


def test_verdict_for_a_24_gb_card():
    verdict, reasons = judge(cpu(), [nvidia()], 64 * GIB, 50 * GIB, 500 * GIB, ENGINE)
    assert verdict == "NVIDIA RTX 4090 with 24 GB: models up to ~35B dense in Q4 run on the GPU"
    assert reasons == ["64 GB of RAM, 50 GB available now."]


def test_a_measured_ram_bandwidth_is_a_reason():
    _, reasons = judge(cpu(), [nvidia()], 64 * GIB, 50 * GIB, 500 * GIB, ENGINE, ram_read_bytes_per_s=40 * 10**9)
    assert "RAM reads about 37 GB/s (measured): it sets the speed of models whose experts stay in RAM." in reasons


def test_verdict_names_vram_held_by_other_programs():
    verdict, reasons = judge(cpu(), [nvidia(total=12, free=4, name="RTX 3060")], 32 * GIB, 20 * GIB, 500 * GIB, ENGINE)
    assert verdict.startswith("NVIDIA RTX 3060 with 12 GB: models up to ~1B")
    assert "Other programs already use 8 GB of its VRAM, so 4 GB is free" in reasons[0]


def test_verdict_without_gpu_and_without_avx2():
    verdict, reasons = judge(cpu(avx2=False), [], 8 * GIB, 6 * GIB, 5 * GIB, ENGINE)
    assert verdict == "No usable GPU: the CPU path runs small models only"
    assert "AVX2 missing: CPU inference will be slow." in reasons
    assert any("Under 16 GB of RAM" in r for r in reasons)
    assert any("Only 5 GB free where the data folder lives" in r for r in reasons)


def test_amd_and_too_old_nvidia_cards_are_explained_not_used():
    amd = GpuInfo(index=1, vendor="amd", name="Radeon RX 7900 XTX", vram_total_bytes=24 * GIB,
                  vram_free_bytes=24 * GIB, vram_used_bytes=0, driver_version=None, compute_capability=None,
                  source="sysfs")
    kepler = nvidia(name="Tesla K80", total=12, free=12, cc="3.7")
    assert best_gpu([amd, kepler], ENGINE) is None
    verdict, reasons = judge(cpu(), [amd, kepler], 32 * GIB, 30 * GIB, 500 * GIB, ENGINE)
    assert verdict.startswith("No usable GPU")
    assert any("AMD GPU" in r and "NVIDIA GPUs (CUDA)" in r for r in reasons)
    assert any("Tesla K80" in r and "3.7" in r for r in reasons)


def test_a_card_between_cuda_12_and_the_kernels_needs_is_not_used():
    # CUDA 12 runs Pascal, but the engine's kernels need the profile's 7.5: a GTX 1080 must not count as usable.
    pascal = nvidia(name="GTX 1080", total=8, free=7.5, cc="6.1")
    assert best_gpu([pascal], ENGINE) is None
    verdict, reasons = judge(cpu(), [pascal], 32 * GIB, 30 * GIB, 500 * GIB, ENGINE)
    assert verdict.startswith("No usable GPU")
    assert any("GTX 1080" in r and "6.1" in r and "7.5" in r for r in reasons)
    assert best_gpu([nvidia(name="RTX 2080", cc="7.5")], ENGINE) is not None


def test_best_gpu_is_the_one_with_most_free_vram():
    small = nvidia(name="RTX 3060", total=12, free=11, index=0)
    big_busy = nvidia(name="RTX 4080", total=16, free=6, index=1)
    assert best_gpu([small, big_busy], ENGINE) is small


def test_probe_assembles_a_report_without_a_gpu(monkeypatch, tmp_path):
    monkeypatch.setattr(hardware, "probe_nvidia", lambda: ([], ["NVML did not start (test)."]))
    monkeypatch.setattr(hardware, "probe_amd", lambda: [])
    report = probe(tmp_path / "data", ENGINE)
    assert report.gpus == []
    assert report.disk_path == str(tmp_path)
    assert report.ram_total_bytes >= report.ram_available_bytes > 0
    assert report.verdict.startswith("No usable GPU")
    assert report.reasons[-1] == "NVML did not start (test)."
    assert report.ram_read_bytes_per_s > 0
    assert f"RAM reads about {hardware.gb(report.ram_read_bytes_per_s)}/s (measured)" in " ".join(report.reasons)


@pytest.mark.parametrize("n_bytes,text", [(24 * GIB, "24 GB"), (int(7.5 * GIB), "7.5 GB"), (int(12.4 * GIB), "12 GB")])
def test_gb_formatting(n_bytes, text):
    assert hardware.gb(n_bytes) == text
