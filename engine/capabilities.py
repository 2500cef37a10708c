"""What this engine runs, as plain data for callers that choose models (they must not need a GPU to ask)."""

from __future__ import annotations

from engine.arch import ARCHITECTURES
from engine.kernels.gpu_layout import FLOAT_TYPES, PLANES
from engine.quants import SUPPORTED_TYPES


def architectures() -> set[str]:
    """GGUF `general.architecture` values the engine runs, on the CPU and on the GPU."""
    return set(ARCHITECTURES)


def cpu_tensor_types() -> set[str]:
    """Tensor types the CPU path reads (every type it can dequantize)."""
    return {t.name for t in SUPPORTED_TYPES}


def gpu_tensor_types() -> set[str]:
    """Tensor types the GPU kernels compute on; a model with others is refused on the GPU at load."""
    return {t.name for t in (*PLANES, *FLOAT_TYPES)}
