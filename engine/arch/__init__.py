"""Architecture registry: `general.architecture` -> the module that runs it.

Every family module reads its hyper-parameters from the GGUF into a DecoderConfig (engine/arch/parts.py) and
runs on the one decoder (engine/arch/decoder.py), whose load_weights, new_workspace, new_cache and forward it
exports; a module is an `Architecture`. The hybrid Gated DeltaNet families (engine/arch/qwen35.py) too: their cache
is a RecurrentCache (engine/kv_cache.py), KV entries for their attention layers and states for the others.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Protocol, runtime_checkable

from engine.arch import gemma3, llama, qwen3, qwen3moe, qwen35
from engine.errors import EngineError

if TYPE_CHECKING:
    from engine.arch.decoder import DecoderWeights, Workspace
    from engine.arch.parts import DecoderConfig
    from engine.backend import Array, Backend, KVCache
    from engine.gguf_file import GGUFFile
    from engine.kv_cache import RecurrentCache, WindowedCache


@runtime_checkable
class Architecture(Protocol):
    """What the engine calls to run a model, the same for every backend."""

    def read_config(self, gguf: GGUFFile) -> DecoderConfig:
        """The hyper-parameters, with n_layers, n_kv_heads, head_dim, vocab_size and context_length."""
        ...

    def load_weights(
        self,
        gguf: GGUFFile,
        config: DecoderConfig,
        backend: Backend,
        max_positions: int,
        on_progress: Callable[[int, int, str], None] | None = None,
        should_cancel: Callable[[], bool] | None = None,
        host_expert_layers: frozenset[int] = frozenset(),
    ) -> DecoderWeights:
        """Every tensor uploaded, reporting (done, total, message) until done == total; the routed experts of the
        host_expert_layers kept in RAM for the CPU."""
        ...

    def new_cache(self, config: DecoderConfig, backend: Backend, max_tokens: int, kind: str = "full",
                  chunk: int = 1) -> KVCache | RecurrentCache | WindowedCache:
        """The cache a forward pass of up to `chunk` tokens fills: KV entries of `kind` (engine.backend.KV_CACHE_TYPES)
        (sliding-window layers' for their window only where that is fewer positions), and recurrent states where the
        model has them."""
        ...

    def new_workspace(self, config: DecoderConfig, backend: Backend, max_chunk: int) -> Workspace:
        """Buffers with .ids (1 + max_chunk,) int32 (the first position, then the token ids; .start and .tokens view
        it), .logits (1, vocab) float32 and .max_chunk."""
        ...

    def forward(
        self,
        config: DecoderConfig,
        weights: DecoderWeights,
        ws: Workspace,
        backend: Backend,
        cache: KVCache | RecurrentCache | WindowedCache,
        n: int,
        logits_out: Array | None = None,
    ) -> Array:
        """The logits of ws.tokens[:n] at positions ws.start[0]..: the last token's, or every token's in logits_out."""
        ...


ARCHITECTURES: dict[str, Architecture] = {
    "gemma3": gemma3,
    "llama": llama,
    "qwen2": qwen3,
    "qwen3": qwen3,
    "qwen3moe": qwen3moe,
    "qwen35": qwen35,
    "qwen35moe": qwen35,
    "qwen3next": qwen35,
}


def architecture_module(name: str, model: str = "This model") -> Architecture:
    """The module for a GGUF `general.architecture`, or EngineError saying which are supported."""
    module = ARCHITECTURES.get(name)
    if module is None:
        raise EngineError(
            f"{model} uses the {name!r} architecture, which this engine cannot run. "
            f"Supported architectures: {', '.join(sorted(ARCHITECTURES))}. Pick a model of one of these."
        )
    return module
