"""The CUDA source text of each kernel module as it is compiled: the i-quants' lookup tables (written here from
engine/quants_iq.py's, which come from the gguf package's data), the shared header (quant_blocks.cuh), and for the
modules on tensor cores tensor_cores.cuh, prepended to engine/kernels/<name>.cu, so NVRTC needs no include path
and CuPy's compile cache sees every byte. Plain Python, so the CPU tests can compile the same text
(tests/test_kernel_sources.py)."""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np

from engine.quants_iq import IQ3S_GRID, IQ4NL_VALUES

DIR = Path(__file__).parent
HEADER = "quant_blocks.cuh"
TENSOR_CORE_HEADER = "tensor_cores.cuh"
TENSOR_CORE_MODULES = ("attention", "flash_attention", "hybrid", "matmul")
STREAM_ROWS = 2  # rows an iteration of the streamed decode products (matvec.cu matvec_stream)
OPTIONS = ("-std=c++17", f"-DSTREAM_ROWS={STREAM_ROWS}")


def names() -> list[str]:
    """Every kernel module: the .cu files here."""
    return sorted(p.stem for p in DIR.glob("*.cu"))


@functools.cache
def iq_tables() -> str:
    """IQ3S_GRID: a grid row's four levels as the bytes of one little-endian word; IQ4NL_LEVELS: the 16 int8 levels,
    four to a word (quant_blocks.cuh BlockIQ3_S, iq4nl_levels)."""

    def words(values: np.ndarray) -> str:
        return ", ".join(f"0x{w:08x}u" for w in np.ascontiguousarray(values).view("<u4").reshape(-1))

    return (f"__device__ const unsigned int IQ3S_GRID[{len(IQ3S_GRID)}] = {{{words(IQ3S_GRID.astype(np.uint8))}}};\n"
            f"constexpr unsigned int IQ4NL_LEVELS[4] = {{{words(IQ4NL_VALUES.astype(np.int8))}}};\n")


def source(name: str) -> str:
    headers = (HEADER, TENSOR_CORE_HEADER) if name in TENSOR_CORE_MODULES else (HEADER,)
    return "\n".join([iq_tables(), *((DIR / part).read_text() for part in (*headers, f"{name}.cu"))])
