"""Every CUDA kernel module compiles, on a machine without a GPU: NVRTC (from the nvidia-cuda-nvrtc wheel of the
test extra) builds the exact text and options the GPU backend builds at run time (engine/kernels/sources.py),
to PTX for the oldest GPU the backend accepts (compute capability 7.5) and for Hopper. A kernel that would not
compile is caught here, before it reaches a GPU machine, and so is a name the launchers in cuda.py can build that
no macro instantiates (the PTX's entry names are the judge)."""

import ast
import ctypes
import functools
import re
from pathlib import Path

import nvidia
import pytest

from engine.kernels import kernel_names, sources

MODULES = sources.names()
ARCHS = ["compute_75", "compute_90"]
EXPECTED = {"attention", "dequant", "flash_attention", "matmul", "matvec", "norms", "rope", "sampling"}


@functools.cache
def nvrtc() -> ctypes.CDLL:
    for base in nvidia.__path__:
        for lib in sorted(Path(base).glob("*/lib/libnvrtc.so*")):
            if "builtins" not in lib.name:
                return ctypes.CDLL(str(lib))
    raise AssertionError("libnvrtc was not found under the nvidia package: reinstall the test extra (pip install -e '.[test]')")


def compile_ptx(name: str, arch: str, options: tuple[str, ...] = sources.OPTIONS) -> tuple[int, str, str]:
    """(NVRTC's status, its log, the PTX) of one module."""
    lib = nvrtc()
    program = ctypes.c_void_p()
    code = sources.source(name).encode()
    assert lib.nvrtcCreateProgram(ctypes.byref(program), code, f"{name}.cu".encode(), 0, None, None) == 0
    encoded = [o.encode() for o in (*options, f"--gpu-architecture={arch}")]
    status = lib.nvrtcCompileProgram(program, len(encoded), (ctypes.c_char_p * len(encoded))(*encoded))
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(program, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(program, log)
    ptx = b""
    if status == 0:
        lib.nvrtcGetPTXSize(program, ctypes.byref(size))
        buf = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetPTX(program, buf)
        ptx = buf.value
    lib.nvrtcDestroyProgram(ctypes.byref(program))
    return status, log.value.decode(errors="replace"), ptx.decode(errors="replace")


@functools.cache
def compiled(name: str, arch: str, sweep: bool = False) -> tuple[int, str, str]:
    """compile_ptx of the module as the backend builds it, or (sweep) as a benchmark sweep's launch does."""
    return compile_ptx(name, arch, sources.OPTIONS + ((kernel_names.SWEEP_OPTION,) if sweep else ()))


def entries(name: str, arch: str, sweep: bool = False) -> set[str]:
    """The kernel entry names in the module's PTX."""
    status, log, ptx = compiled(name, arch, sweep)
    assert status == 0, log
    return set(re.findall(r"\.entry\s+(\w+)\s*\(", ptx))


def test_every_kernel_module_is_checked():
    assert EXPECTED <= set(MODULES)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name", MODULES)
def test_kernel_module_compiles(name, arch):
    status, log, _ = compiled(name, arch)
    assert status == 0, f"{name}.cu does not compile for {arch}:\n{log}"
    assert "warning" not in log, log


def test_a_broken_kernel_is_reported(monkeypatch):
    """The check can fail: a call to an undeclared function is a compile error with its message in the log."""
    original = sources.source
    monkeypatch.setattr(sources, "source", lambda name: original(name) + "\n__global__ void broken() { undeclared(); }\n")
    status, log, _ = compile_ptx("rope", "compute_90")
    assert status != 0 and "undeclared" in log


CUDA_PY = Path(sources.__file__).with_name("cuda.py")


def launched_literals() -> set[tuple[str, str]]:
    """(module, kernel) of every launch in cuda.py whose kernel name is written out as a string."""
    found = set()
    for node in ast.walk(ast.parse(CUDA_PY.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") in ("launch", "kernel"):
            module, name = node.args[:2]
            if isinstance(name, ast.Constant):
                found.add((module.value, name.value))
    return found


N = kernel_names
# One name of each kernel_names function's making, from the kind a call in cuda.py passes (if it takes one).
SAMPLE = {
    "typed": lambda kind: N.typed(kind, N.PER_TYPE[kind][1][0]),
    "grouped": lambda kind: N.grouped(kind, N.HOST_LAYOUTS[0]),
    "moe": lambda kind: N.moe(kind, N.HOST_LAYOUTS[0]),
    "shaped": lambda kind: N.shaped(kind, N.QUANT_TYPES[0], N.SHAPES[kind][0]),
    "per_head_dim": lambda kind: N.per_head_dim(kind, N.HEAD_DIMS[0]),
    "per_group": lambda kind: N.per_group(kind, N.HEAD_DIMS[0], 4),
    "stream": lambda: N.stream(N.QUANT_TYPES[0], ""),
    "dequant": lambda: N.dequant(N.QUANT_TYPES[0], True),
    "delta_rule": lambda: N.delta_rule(N.DELTA_KEY_DIMS[0]),
    "rope_store": lambda: N.rope_store(),
}


def test_cuda_py_builds_kernel_names_only_through_kernel_names():
    """Names are string literals or kernel_names' functions, with kinds its data knows and launched from the
    module that builds them: an f-string in cuda.py is an error message, nothing else, so kernel_names.built()
    covers every name the launchers can build."""
    tree = ast.parse(CUDA_PY.read_text())
    in_raise = {id(n) for r in ast.walk(tree) if isinstance(r, ast.Raise) for n in ast.walk(r)}
    stray = [ast.unparse(n) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) and id(n) not in in_raise]
    assert not stray, f"names built outside kernel_names: {stray}"
    built = N.built(90)
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
             and getattr(n.func.value, "id", "") == "N" and n.func.attr in SAMPLE]
    assert len(calls) >= 16
    for call in calls:
        kind = [a.value for a in call.args[:1] if isinstance(a, ast.Constant)]
        name = SAMPLE[call.func.attr](*kind)  # a kind that the data lacks raises here
        for launch in ast.walk(tree):
            if isinstance(launch, ast.Call) and getattr(launch.func, "id", "") == "launch" and launch.args[1] is call:
                assert name in built[launch.args[0].value], ast.unparse(launch)
    assert len(launched_literals()) >= 10


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name", MODULES)
def test_every_kernel_name_the_launchers_build_is_compiled(name, arch):
    """Against the .entry names in the PTX NVRTC makes: each name kernel_names builds (every type, shape and form
    cuda.py passes) and each literal cuda.py launches is in its module; the sweep-only shapes are not, and are
    in the sweep copy that a launch of one of them builds."""
    capability = int(arch.removeprefix("compute_"))
    have = entries(name, arch)
    want = kernel_names.built(capability).get(name, set()) | {k for m, k in launched_literals() if m == name}
    assert want and not want - have, f"{name}.cu ({arch}) lacks {sorted(want - have)}"
    sweep = kernel_names.built(capability, sweep=True).get(name, set())
    assert not sweep & have, f"{name}.cu builds sweep-only kernels into the backend's module: {sorted(sweep & have)}"
    if sweep:
        assert not sweep - entries(name, arch, sweep=True)
