"""GPU tests need CuPy and an NVIDIA GPU; without either, a test module skips as a whole, saying which."""

import numpy as np
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


def rel(a, b) -> float:
    """Relative error of a GPU result a against the reference b (norm of the difference over b's); a NaN in a is an
    element never written (outputs start poisoned) or broken math."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert not np.isnan(a).any(), "NaN in the output: an element was not written or the math broke"
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))
