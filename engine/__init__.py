"""The in-process inference engine: GGUF models on NumPy (CPU) or CuPy (NVIDIA GPU). Knows nothing of MCP."""

from engine.backend import MemoryInUse
from engine.errors import Cancelled, DamagedModel, EngineError
from engine.generate import GenerationResult, GenerationSettings
from engine.gguf_file import GGUFSummary, read_gguf_summary
from engine.model import LoadedModel, ModelInfo, load_model

__all__ = [
    "Cancelled",
    "DamagedModel",
    "EngineError",
    "GGUFSummary",
    "GenerationResult",
    "GenerationSettings",
    "LoadedModel",
    "MemoryInUse",
    "ModelInfo",
    "load_model",
    "read_gguf_summary",
]
