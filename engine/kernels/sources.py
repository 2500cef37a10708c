"""The CUDA source text of each kernel module as it is compiled: the shared header (quant_blocks.cuh), and for the
modules on tensor cores tensor_cores.cuh, prepended to engine/kernels/<name>.cu, so NVRTC needs no include path
and CuPy's compile cache sees every byte. Plain Python, so the CPU tests can compile the same text
(tests/test_kernel_sources.py)."""

from __future__ import annotations

from pathlib import Path

DIR = Path(__file__).parent
HEADER = "quant_blocks.cuh"
TENSOR_CORE_HEADER = "tensor_cores.cuh"
TENSOR_CORE_MODULES = ("attention", "flash_attention", "hybrid", "matmul")
STREAM_ROWS = 2  # rows an iteration of the streamed decode products (matvec.cu matvec_stream)
OPTIONS = ("-std=c++17", f"-DSTREAM_ROWS={STREAM_ROWS}")


def names() -> list[str]:
    """Every kernel module: the .cu files here."""
    return sorted(p.stem for p in DIR.glob("*.cu"))


def source(name: str) -> str:
    headers = (HEADER, TENSOR_CORE_HEADER) if name in TENSOR_CORE_MODULES else (HEADER,)
    return "\n".join((DIR / part).read_text() for part in (*headers, f"{name}.cu"))
