"""Architecture registry: `general.architecture` -> the module that runs it.

An architecture module provides plain functions (no layer classes), the same for every backend:

    read_config(gguf) -> config      with n_layers, n_kv_heads, head_dim, vocab_size, context_length
    load_weights(gguf, config, backend, max_positions, on_progress, should_cancel) -> weights
    new_workspace(config, backend, max_chunk) -> workspace with .ids (1 + max_chunk,) int32 (the first position,
                                                 then the token ids; .start and .tokens view it), .logits (1, vocab)
                                                 float32 and .max_chunk
    forward(config, weights, workspace, backend, cache, n, logits_out=None) -> logits

and optionally new_cache(config, backend, max_tokens) -> cache, for models whose state is more than a KVCache
(engine.kv_cache.RecurrentCache); without it the loader allocates a KVCache for every layer.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from engine.errors import EngineError

ARCHITECTURES = {
    "gemma3": "engine.arch.gemma3",
    "llama": "engine.arch.llama",
    "qwen2": "engine.arch.qwen3",
    "qwen3": "engine.arch.qwen3",
    "qwen3moe": "engine.arch.qwen3moe",
    "qwen35": "engine.arch.qwen35",
    "qwen35moe": "engine.arch.qwen35",
    "qwen3next": "engine.arch.qwen35",
}


def architecture_module(name: str, model: str = "This model") -> ModuleType:
    """The module for a GGUF `general.architecture`, or EngineError saying which are supported."""
    module = ARCHITECTURES.get(name)
    if module is None:
        raise EngineError(
            f"{model} uses the {name!r} architecture, which this engine cannot run. "
            f"Supported architectures: {', '.join(sorted(ARCHITECTURES))}. Pick a model of one of these."
        )
    return importlib.import_module(module)
