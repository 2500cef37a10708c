"""GPU tests need CuPy and an NVIDIA GPU; without either, a test module skips as a whole, saying which."""

import pytest


def require_gpu():
    """The cupy module, or a module-level skip."""
    cp = pytest.importorskip("cupy")
    try:
        count = cp.cuda.runtime.getDeviceCount()
    except cp.cuda.runtime.CUDARuntimeError:
        count = 0
    if count == 0:
        pytest.skip("no NVIDIA GPU", allow_module_level=True)
    return cp
