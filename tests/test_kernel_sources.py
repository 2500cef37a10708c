"""Every CUDA kernel module compiles, on a machine without a GPU: NVRTC (from the nvidia-cuda-nvrtc wheel of the
test extra) builds the exact text and options the GPU backend builds at run time (engine/kernels/sources.py),
to PTX for the oldest GPU the backend accepts (compute capability 7.5) and for Hopper. A kernel that would not
compile is caught here, before it reaches a GPU machine."""

import ctypes
import functools
from pathlib import Path

import nvidia
import pytest

from engine.kernels import sources

MODULES = sources.names()
EXPECTED = {"attention", "dequant", "flash_attention", "matmul", "matvec", "norms", "rope", "sampling"}


@functools.cache
def nvrtc() -> ctypes.CDLL:
    for base in nvidia.__path__:
        for lib in sorted(Path(base).glob("*/lib/libnvrtc.so*")):
            if "builtins" not in lib.name:
                return ctypes.CDLL(str(lib))
    raise AssertionError("libnvrtc was not found under the nvidia package: reinstall the test extra (pip install -e '.[test]')")


def compile_log(name: str, arch: str) -> tuple[int, str]:
    lib = nvrtc()
    program = ctypes.c_void_p()
    code = sources.source(name).encode()
    assert lib.nvrtcCreateProgram(ctypes.byref(program), code, f"{name}.cu".encode(), 0, None, None) == 0
    options = [o.encode() for o in (*sources.OPTIONS, f"--gpu-architecture={arch}")]
    status = lib.nvrtcCompileProgram(program, len(options), (ctypes.c_char_p * len(options))(*options))
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(program, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(program, log)
    lib.nvrtcDestroyProgram(ctypes.byref(program))
    return status, log.value.decode(errors="replace")


def test_every_kernel_module_is_checked():
    assert EXPECTED <= set(MODULES)


@pytest.mark.parametrize("arch", ["compute_75", "compute_90"])
@pytest.mark.parametrize("name", MODULES)
def test_kernel_module_compiles(name, arch):
    status, log = compile_log(name, arch)
    assert status == 0, f"{name}.cu does not compile for {arch}:\n{log}"
    assert "warning" not in log, log


def test_a_broken_kernel_is_reported(monkeypatch):
    """The check can fail: a call to an undeclared function is a compile error with its message in the log."""
    original = sources.source
    monkeypatch.setattr(sources, "source", lambda name: original(name) + "\n__global__ void broken() { undeclared(); }\n")
    status, log = compile_log("rope", "compute_90")
    assert status != 0 and "undeclared" in log
