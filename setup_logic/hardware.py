"""What this PC has: OS, CPU and its vector flags, RAM, free disk where the data folder lives, and GPUs.

Each probe is a small function taking what it reads as an argument (cpuinfo text, a sysfs root, an NVML module)
so tests can feed fakes. No GPU, no NVML, no /proc are normal results, never errors.
"""

from __future__ import annotations

import functools
import math
import os
import platform
import re
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType
from typing import Literal

import numpy as np
import psutil
from pydantic import BaseModel, Field

from setup_logic.engine_profile import EngineProfile

GIB = 1 << 30
# Rough rule for the verdict line only: a Q4_K_M file holds about 0.6 bytes per weight (Qwen3-8B: 5.03 GB for
# 8.19B), and ~3 GB of the card goes to the CUDA context, KV cache and workspace. fit.py does the real estimate.
_Q4_BYTES_PER_PARAM = 0.6
_GPU_RESERVE_BYTES = 3 * GIB
_LOW_DISK_BYTES = 10 * GIB
_SMALL_RAM_BYTES = 16 * GIB
# The RAM read test's buffer: far past any CPU's last-level cache (96-128 MB on the largest desktop parts), and a
# pass takes tens of milliseconds. It is measured only where RAM holds several times that free.
_RAM_TEST_BYTES = 512 << 20
_RAM_TEST_PASSES = 4


class OsInfo(BaseModel):
    name: str = Field(description="Linux, Windows, Darwin, ...")
    version: str = Field(description="distribution and kernel on Linux, release elsewhere")
    machine: str = Field(description="x86_64, AMD64, arm64, ...")
    wsl: bool = Field(description="Linux running under Windows' WSL")


class CpuInfo(BaseModel):
    model: str
    physical_cores: int | None
    logical_cores: int | None
    # None means unknown: the flags are read from /proc/cpuinfo on Linux only.
    avx: bool | None
    avx2: bool | None
    avx512f: bool | None
    fma: bool | None
    f16c: bool | None


class GpuInfo(BaseModel):
    index: int = Field(description="NVML index for NVIDIA, the DRM card number for AMD")
    vendor: Literal["nvidia", "amd"]
    name: str
    vram_total_bytes: int
    vram_free_bytes: int
    vram_used_bytes: int = Field(description="held by other programs right now (total - free)")
    driver_version: str | None
    compute_capability: str | None = Field(description='NVIDIA only, e.g. "8.9"')
    source: Literal["nvml", "sysfs"]


class PcReport(BaseModel):
    os: OsInfo
    cpu: CpuInfo
    ram_total_bytes: int
    ram_available_bytes: int
    disk_path: str = Field(description="the data folder, or its nearest existing parent, where disk space was measured")
    disk_free_bytes: int
    gpus: list[GpuInfo]
    ram_read_bytes_per_s: int | None = Field(
        None, description="RAM read bandwidth measured by the probe (every core summing a 512 MiB buffer, the best "
        "of a few passes); None when it was not measured"
    )
    verdict: str = Field(description="one line: what this PC can run")
    reasons: list[str] = Field(description="the facts behind the verdict, one sentence each")


def gb(n_bytes: int) -> str:
    """Bytes as GB the way Windows and GPU makers count them (2^30), e.g. "24 GB", "7.5 GB"."""
    value = n_bytes / GIB
    return f"{value:.0f} GB" if value >= 10 or value == int(value) else f"{value:.1f} GB"


def probe_os() -> OsInfo:
    name = platform.system() or "unknown"
    version = platform.release()
    wsl = False
    if name == "Linux":
        distro = _os_release_name(Path("/etc/os-release"))
        version = f"{distro}, kernel {version}" if distro else f"kernel {version}"
        wsl = "microsoft" in _read_text(Path("/proc/version")).lower()
    elif name == "Windows":
        version = platform.version()
    elif name == "Darwin":
        version = platform.mac_ver()[0] or version
    return OsInfo(name=name, version=version, machine=platform.machine(), wsl=wsl)


def _os_release_name(path: Path) -> str | None:
    for line in _read_text(path).splitlines():
        if line.startswith("PRETTY_NAME="):
            return line.split("=", 1)[1].strip().strip('"') or None
    return None


def parse_cpuinfo(text: str) -> tuple[str | None, set[str] | None]:
    """The CPU model and the first processor's flags from /proc/cpuinfo text (x86 `flags`, ARM `Features`)."""
    model = None
    flags = None
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if not sep:
            continue
        key = key.strip()
        if model is None and key in ("model name", "Model", "Hardware", "cpu model"):
            model = value.strip() or None
        elif flags is None and key in ("flags", "Features"):
            flags = set(value.split())
    return model, flags


def probe_cpu(cpuinfo_text: str | None = None, system: str | None = None) -> CpuInfo:
    """On Linux the model and flags come from /proc/cpuinfo; elsewhere the flags are unknown, not guessed."""
    system = system or platform.system()
    model = None
    flags = None
    if system == "Linux":
        if cpuinfo_text is None:
            cpuinfo_text = _read_text(Path("/proc/cpuinfo"))
        model, flags = parse_cpuinfo(cpuinfo_text)
    model = model or platform.processor() or platform.machine() or "unknown CPU"

    def has(flag: str) -> bool | None:
        return None if flags is None else flag in flags

    return CpuInfo(
        model=model,
        physical_cores=psutil.cpu_count(logical=False),
        logical_cores=psutil.cpu_count(logical=True),
        avx=has("avx"),
        avx2=has("avx2"),
        avx512f=has("avx512f"),
        fma=has("fma"),
        f16c=has("f16c"),
    )


@functools.cache  # once a process: check_pc, choose_model and start each probe, and the RAM does not change
def measure_ram_read() -> int:
    """Bytes/s this PC's RAM delivers to all cores: a thread a core sums its slice of the test buffer (NumPy's
    reductions release the GIL, so they run at once), the best of a few passes. On a 2-core EPYC VM it matched
    bench/bench_gpu.py's numba sum over 2 GiB round by round: 28-45 against 30-46 GB/s (2026-12-07, eight rounds in
    two runs, between which the VM's bandwidth moved)."""
    data = np.ones(_RAM_TEST_BYTES // 8)  # written, so every page is real RAM and not the OS's one shared zero page
    threads = os.cpu_count() or 1
    slices = np.array_split(data, threads)
    best = math.inf
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(_RAM_TEST_PASSES):
            start = time.perf_counter()
            list(pool.map(np.sum, slices))
            best = min(best, time.perf_counter() - start)
    return round(data.nbytes / best)


def disk_free(data_dir: Path) -> tuple[Path, int]:
    """Free bytes on the drive of data_dir, measured at its nearest existing parent (it may not exist yet)."""
    path = Path(data_dir).expanduser().absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path, shutil.disk_usage(path).free


def _text(value: bytes | str) -> str:
    # Older nvidia-ml-py releases return bytes, newer ones str.
    return value.decode() if isinstance(value, bytes) else value


def probe_nvidia(nvml: ModuleType | None = None) -> tuple[list[GpuInfo], list[str]]:
    """NVIDIA GPUs through NVML, plus notes on what could not be read. No driver or no NVML means no GPU."""
    if nvml is None:
        try:
            import pynvml as nvml
        except ImportError:
            return [], []
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as error:
        return [], [f"NVML did not start ({error}), so no NVIDIA GPU is visible; if this PC has one, update its driver."]
    gpus: list[GpuInfo] = []
    notes: list[str] = []
    try:
        driver = _text(nvml.nvmlSystemGetDriverVersion())
        for index in range(nvml.nvmlDeviceGetCount()):
            try:
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
                memory = nvml.nvmlDeviceGetMemoryInfo(handle)
                major, minor = nvml.nvmlDeviceGetCudaComputeCapability(handle)
                gpus.append(
                    GpuInfo(
                        index=index,
                        vendor="nvidia",
                        name=_text(nvml.nvmlDeviceGetName(handle)),
                        vram_total_bytes=memory.total,
                        vram_free_bytes=memory.free,
                        vram_used_bytes=memory.total - memory.free,
                        driver_version=driver,
                        compute_capability=f"{major}.{minor}",
                        source="nvml",
                    )
                )
            except nvml.NVMLError as error:
                notes.append(f"NVIDIA GPU {index} could not be read through NVML ({error}); it is left out.")
    except nvml.NVMLError as error:
        notes.append(f"NVML failed while listing GPUs ({error}); NVIDIA GPUs are left out.")
    finally:
        try:
            nvml.nvmlShutdown()
        except nvml.NVMLError:
            pass  # Shutting down a half-started NVML can fail; nothing is held that needs it.
    return gpus, notes


def probe_amd(drm_root: Path = Path("/sys/class/drm")) -> list[GpuInfo]:
    """AMD GPUs from Linux sysfs: cards with PCI vendor 0x1002 that report their VRAM (amdgpu driver)."""
    gpus = []
    cards = [p for p in drm_root.glob("card*") if re.fullmatch(r"card\d+", p.name)]
    for card in sorted(cards, key=lambda p: int(p.name[4:])):
        device = card / "device"
        if _read_text(device / "vendor").strip() != "0x1002":
            continue
        total = _read_int(device / "mem_info_vram_total")
        if not total:
            continue
        used = _read_int(device / "mem_info_vram_used") or 0
        name = _read_text(device / "product_name").strip()
        if not name:
            name = f"AMD GPU (PCI device {_read_text(device / 'device').strip() or 'unknown'})"
        gpus.append(
            GpuInfo(
                index=int(card.name[4:]),
                vendor="amd",
                name=name,
                vram_total_bytes=total,
                vram_free_bytes=total - used,
                vram_used_bytes=used,
                driver_version=None,
                compute_capability=None,
                source="sysfs",
            )
        )
    return gpus


def _read_text(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def _read_int(path: Path) -> int | None:
    text = _read_text(path).strip()
    return int(text) if text.isdigit() else None


def usable_by_engine(gpu: GpuInfo, engine: EngineProfile) -> bool:
    """The engine runs CUDA kernels through CuPy: only NVIDIA GPUs as new as its kernels need."""
    return gpu.vendor == "nvidia" and engine.gpu_usable(gpu.compute_capability)


def best_gpu(gpus: list[GpuInfo], engine: EngineProfile) -> GpuInfo | None:
    """The usable GPU with the most free VRAM (the engine runs on one GPU); ties go to the lower index."""
    usable = [g for g in gpus if usable_by_engine(g, engine)]
    return max(usable, key=lambda g: (g.vram_free_bytes, -g.index), default=None)


def _dense_q4_billions(vram_bytes: int) -> int:
    billions = max(0.0, vram_bytes - _GPU_RESERVE_BYTES) / _Q4_BYTES_PER_PARAM / 1e9
    return int(billions) if billions < 10 else int(billions) // 5 * 5


def judge(
    cpu: CpuInfo, gpus: list[GpuInfo], ram_total: int, ram_available: int, disk_free_bytes: int, engine: EngineProfile,
    ram_read_bytes_per_s: int | None = None,
) -> tuple[str, list[str]]:
    """The one-line verdict and the reasons behind it."""
    reasons = []
    gpu = best_gpu(gpus, engine)
    if gpu is not None:
        billions = _dense_q4_billions(gpu.vram_free_bytes)
        if billions >= 1:
            verdict = (
                f"NVIDIA {gpu.name} with {gb(gpu.vram_total_bytes)}: models up to ~{billions}B dense in Q4 "
                "run on the GPU"
            )
        else:
            verdict = f"NVIDIA {gpu.name} with {gb(gpu.vram_total_bytes)}: only very small models fit on the GPU"
        if gpu.vram_used_bytes > GIB:
            reasons.append(
                f"Other programs already use {gb(gpu.vram_used_bytes)} of its VRAM, so {gb(gpu.vram_free_bytes)} "
                "is free for a model; closing them makes room."
            )
    else:
        verdict = "No usable GPU: the CPU path runs small models only"
    for other in gpus:
        if other is gpu:
            continue
        if other.vendor == "amd":
            reasons.append(
                f"{other.name} ({gb(other.vram_total_bytes)}) is an AMD GPU; the engine runs on NVIDIA GPUs "
                "(CUDA) and the CPU, so it is not used."
            )
        elif not usable_by_engine(other, engine):
            reasons.append(
                f"NVIDIA {other.name} (compute capability {other.compute_capability}) is older than the "
                f"{engine.min_compute_capability_text} the engine's GPU kernels need, so it is not used; models "
                "run on the CPU instead."
            )
        else:
            reasons.append(f"NVIDIA {other.name} is not used: the engine runs on one GPU, the one with most free VRAM.")
    reasons.append(f"{gb(ram_total)} of RAM, {gb(ram_available)} available now.")
    if ram_read_bytes_per_s:
        reasons.append(
            f"RAM reads about {gb(ram_read_bytes_per_s)}/s (measured): it sets the speed of models whose experts stay "
            "in RAM."
        )
    if ram_total < _SMALL_RAM_BYTES:
        reasons.append("Under 16 GB of RAM: only small models fit in memory.")
    if cpu.avx2 is False:
        reasons.append("AVX2 missing: CPU inference will be slow.")
    elif cpu.avx2 is None:
        reasons.append("The CPU's vector flags (AVX2) are only read on Linux, so CPU speed is unknown here.")
    if disk_free_bytes < _LOW_DISK_BYTES:
        reasons.append(
            f"Only {gb(disk_free_bytes)} free where the data folder lives: free space or choose another "
            "folder (STRATA_DATA_DIR) for larger models."
        )
    return verdict, reasons


def probe(data_dir: Path, engine: EngineProfile) -> PcReport:
    """Check this PC for what `engine` can run; the disk figure is for the drive that holds data_dir."""
    cpu = probe_cpu()
    memory = psutil.virtual_memory()
    nvidia, notes = probe_nvidia()
    gpus = nvidia + (probe_amd() if platform.system() == "Linux" else [])
    disk_path, free = disk_free(data_dir)
    ram_read = measure_ram_read() if memory.available >= 4 * _RAM_TEST_BYTES else None
    verdict, reasons = judge(cpu, gpus, memory.total, memory.available, free, engine, ram_read)
    return PcReport(
        os=probe_os(),
        cpu=cpu,
        ram_total_bytes=memory.total,
        ram_available_bytes=memory.available,
        disk_path=os.fspath(disk_path),
        disk_free_bytes=free,
        gpus=gpus,
        ram_read_bytes_per_s=ram_read,
        verdict=verdict,
        reasons=reasons + notes,
    )
