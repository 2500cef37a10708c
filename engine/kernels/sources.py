"""The CUDA source text of each kernel module as it is compiled: the shared header (quant_blocks.cuh) prepended
to engine/kernels/<name>.cu, so NVRTC needs no include path and CuPy's compile cache sees every byte. Plain
Python, so the CPU tests can compile the same text (tests/test_kernel_sources.py)."""

from __future__ import annotations

from pathlib import Path

DIR = Path(__file__).parent
HEADER = "quant_blocks.cuh"
OPTIONS = ("-std=c++17",)


def names() -> list[str]:
    """Every kernel module: the .cu files here."""
    return sorted(p.stem for p in DIR.glob("*.cu"))


def source(name: str) -> str:
    return (DIR / HEADER).read_text() + "\n" + (DIR / f"{name}.cu").read_text()
