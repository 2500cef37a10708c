"""The engine's public face: load_model() and the LoadedModel it returns."""

from __future__ import annotations

import importlib
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import psutil

from engine.arch import architecture_module
from engine.arch.parts import MOE, MOE_SHARED, DecoderConfig
from engine.backend import Backend, ExpertCacheStats, MemoryInUse, check_kv_cache_type
from engine.backend_numpy import NumpyBackend
from engine.capabilities import DEFAULT_CONTEXT, prompt_chunk as backend_prompt_chunk
from engine.chat_template import ChatTemplate
from engine.cpu.weights import held_nbytes
from engine.errors import EngineError
from engine.generate import GenerationResult, GenerationSettings, ModelState, generate, prefill, run_chunk
from engine.gguf_file import GGUFFile
from engine.kv_cache import CachedTokens
from engine.tokenizer import Tokenizer

# Tokens that end an assistant turn in common chat templates, besides the file's own EOS/EOT ids.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<end_of_turn>", "<|endoftext|>", "<|end|>")


@dataclass
class ModelInfo:
    architecture: str
    name: str
    context_length: int  # the context in use (KV cache size in tokens)
    max_context_length: int  # what the model was trained for
    n_layers: int
    vocab_size: int
    tensor_types: dict[str, int]
    backend: str  # "numpy" or "cupy"
    backend_reason: str
    weight_bytes: int
    kv_cache_type: str  # one of engine.backend.KV_CACHE_TYPES
    kv_cache_bytes: int
    prompt_chunk: int  # the most prompt tokens run in one forward pass (the workspace's rows)
    expert_layers_in_ram: int  # MoE layers whose routed experts live in RAM and run on the CPU (GPU backend)
    host_weight_bytes: int  # of weight_bytes, what lives in RAM beside the GPU (those experts)
    expert_cache_slots: int  # GPU slots for the most used experts of each such layer (engine/expert_cache.py)
    has_chat_template: bool  # base models have none: they only continue plain text


def select_backend(device: str) -> tuple[Backend, str]:
    """The backend for device "auto", "cpu" or "cuda", and a sentence saying why it was chosen."""
    if device not in ("auto", "cpu", "cuda"):
        raise EngineError(f"device must be 'auto', 'cpu' or 'cuda', not {device!r}.")
    if device == "cpu":
        return NumpyBackend(), "The CPU (NumPy) backend was requested."
    try:
        gpu = importlib.import_module("engine.backend_cupy")
        reason = gpu.unavailable_reason()
    except ImportError as exc:
        gpu = None
        if exc.name == "engine.backend_cupy":
            reason = "this installation of the engine has no GPU backend"
        elif (exc.name or "").startswith("cupy"):
            reason = "CuPy is not installed (install the package's 'cuda' extra to use an NVIDIA GPU)"
        else:
            reason = f"the GPU backend cannot be imported ({exc})"
    if reason is None:
        return gpu.CupyBackend(), "An NVIDIA GPU with CuPy is available, so the model runs on the GPU."
    if device == "cuda":
        raise EngineError(f"device='cuda' was requested, but {reason}. Use device='auto' or 'cpu' instead.")
    return NumpyBackend(), f"Running on the CPU with NumPy because {reason}."


def _check_cpu_memory(gguf: GGUFFile, backend: Backend) -> None:
    # Refuse early rather than swap or be killed: the CPU backend keeps about the file's bytes (float tensors
    # as float32).
    if backend.name != "numpy":
        return
    needed = sum(held_nbytes(t.qtype, tuple(t.shape)) for t in gguf.tensors.values())
    available = psutil.virtual_memory().available
    if needed > 0.9 * available:
        raise EngineError(
            f"{gguf.path.name} needs about {needed / 2**30:.1f} GiB of RAM on the CPU, but only "
            f"{available / 2**30:.1f} GiB is free. Use a smaller model or a machine with an NVIDIA GPU."
        )


def _host_expert_layers(config: DecoderConfig, count: Any, name: str) -> frozenset[int]:
    """The first `count` mixture-of-experts layers, whose experts are to stay in RAM; EngineError when impossible."""
    if not isinstance(count, int) or isinstance(count, bool) or count < 0:
        raise EngineError(f"expert_layers_in_ram must be a whole number of layers, 0 or more, not {count!r}.")
    moe_layers = [i for i, kind in enumerate(config.ffn_kinds) if kind in (MOE, MOE_SHARED)]
    if count > len(moe_layers):
        what = f"only {len(moe_layers)} mixture-of-experts layers" if moe_layers else "no mixture-of-experts layers"
        raise EngineError(f"{name} has {what}, so the experts of {count} layers cannot be kept in RAM. "
                          f"Use expert_layers_in_ram={len(moe_layers)} or less.")
    return frozenset(moe_layers[:count])


def _expert_cache_slots(config: DecoderConfig, slots: Any, name: str) -> int:
    """expert_cache_slots, checked; EngineError when it cannot be."""
    if not isinstance(slots, int) or isinstance(slots, bool) or slots < 0:
        raise EngineError(f"expert_cache_slots must be a whole number of experts, 0 or more, not {slots!r}.")
    if slots and not any(kind in (MOE, MOE_SHARED) for kind in config.ffn_kinds):
        raise EngineError(f"{name} is not a mixture of experts, so it has no experts to cache: use "
                          "expert_cache_slots=0.")
    if slots > (experts := config.moe().count if slots else 0):
        raise EngineError(f"expert_cache_slots={slots} is more than the {experts} experts a layer of {name} has; "
                          f"use {experts} or less.")
    return slots


class LoadedModel:
    """A model ready to generate. Calls are serialized: one generation at a time."""

    def __init__(self, gguf: GGUFFile, state: ModelState, tokenizer: Tokenizer, template: ChatTemplate | None, info: ModelInfo):
        self.info = info
        self.tokenizer = tokenizer
        self._state: ModelState | None = state
        self._template = template
        self._lock = threading.Lock()
        self._stop_ids = {tokenizer.eos_id} - {None}
        self._stop_ids |= {gguf.get(k) for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")} - {None}
        self._stop_ids |= {i for i in map(tokenizer.token_id, END_OF_TURN_TOKENS) if i in tokenizer.special_ids}
        self._all_logits = None

    def _live_state(self) -> ModelState:
        if self._state is None:
            raise EngineError("This model has been closed; load it again to use it.")
        return self._state

    @property
    def chat_template(self) -> ChatTemplate | None:
        """The GGUF's chat template; None for a base model, which only continues plain text."""
        return self._template

    def render_chat(self, messages: list[dict[str, Any]], **variables: Any) -> str:
        """The prompt text the chat template makes of messages (with the assistant turn opened); variables such as
        `tools` go to the template."""
        return self._require_template().render(messages, add_generation_prompt=True, **variables)

    def chat_tokens(self, messages: list[dict[str, Any]], **variables: Any) -> list[int]:
        """The prompt tokens of a conversation. What the messages say is text: control tokens come only from the
        chat template, never from a message that spells one."""
        segments = self._require_template().render_segments(messages, self.tokenizer.holds_control_text, **variables)
        return self.tokenizer.encode_segments(segments)

    def _require_template(self) -> ChatTemplate:
        if self._template is None:
            raise EngineError(f"{self.info.name} has no chat template; use complete() with a raw prompt instead.")
        return self._template

    def chat(
        self,
        messages: list[dict[str, Any]],
        settings: GenerationSettings | None = None,
        on_text: Callable[[str], None] | None = None,
        should_stop: Callable[[], bool] | None = None,
    ) -> GenerationResult:
        """Answer a conversation. The KV cache of the longest token prefix shared with the previous call is
        reused, so a follow-up turn only processes the new tokens."""
        return self.generate(self.chat_tokens(messages), settings, on_text, should_stop)

    def complete(
        self,
        prompt: str,
        settings: GenerationSettings | None = None,
        on_text: Callable[[str], None] | None = None,
        should_stop: Callable[[], bool] | None = None,
    ) -> GenerationResult:
        """Continue raw text (no chat template)."""
        if not isinstance(prompt, str):
            raise EngineError("The prompt must be text.")
        return self.generate(self.tokenizer.encode(prompt), settings, on_text, should_stop)

    def generate(
        self,
        prompt: list[int],
        settings: GenerationSettings | None = None,
        on_text: Callable[[str], None] | None = None,
        should_stop: Callable[[], bool] | None = None,
    ) -> GenerationResult:
        """Continue prompt tokens (from chat_tokens or the tokenizer), reusing the cached prefix."""
        with self._lock:
            state = self._live_state()
            return generate(state, self.tokenizer, prompt, settings or GenerationSettings(), self._stop_ids, on_text, should_stop)

    def prompt_logits(self, tokens: list[int], all_positions: bool = False) -> tuple[np.ndarray, int]:
        """Run tokens and return (logits, reused): the last token's logits (vocab,) after reusing the cached
        prefix, or with all_positions every token's logits (n, vocab) from a fresh start (reused = 0)."""
        with self._lock:
            state = self._live_state()
            if not all_positions:
                logits, reused = prefill(state, list(tokens))
                return state.backend.to_host(logits), reused
            state.cached.clear()
            chunk = state.workspace.max_chunk
            if self._all_logits is None or len(self._all_logits) < min(chunk, len(tokens)):
                self._all_logits = state.backend.empty((min(chunk, len(tokens)), self.info.vocab_size))
            rows = []
            for begin in range(0, len(tokens), chunk):
                part = list(tokens[begin : begin + chunk])
                run_chunk(state, part, begin, self._all_logits[: len(part)])
                state.cached.append(part)
                rows.append(state.backend.to_host(self._all_logits[: len(part)]))
            return np.concatenate(rows), 0

    def memory_in_use(self) -> MemoryInUse:
        """What the backend holds (nothing once closed)."""
        if self._state is None:
            return MemoryInUse()
        return self._state.backend.memory_in_use()

    def expert_cache(self) -> ExpertCacheStats | None:
        """What the GPU's cache of hot experts holds and how often it served, for a model with experts in RAM."""
        if self._state is None or not self.info.expert_layers_in_ram:
            return None
        return self._state.backend.expert_cache_stats()

    def close(self) -> None:
        """Free weights, cache and workspace. Waits for a running generation (stop it with should_stop first).
        Safe to call twice."""
        with self._lock:
            if self._state is not None:
                backend = self._state.backend
                # Drop the model's arrays first, so closing the backend can hand their memory back to the driver.
                self._state = None
                self._all_logits = None
                backend.close()


def load_model(
    path: str | Path,
    *,
    device: str = "auto",
    context_length: int | None = None,
    on_progress: Callable[[int, int, str], None] | None = None,
    should_cancel: Callable[[], bool] | None = None,
    expert_layers_in_ram: int = 0,
    expert_cache_slots: int = 0,
    kv_cache_type: str = "full",
    prompt_chunk: int | None = None,
) -> LoadedModel:
    """Open a GGUF, pick a backend and upload the weights. on_progress gets (tensors done, total, message);
    should_cancel returning True stops the load with `Cancelled` (an EngineError). expert_layers_in_ram: on the GPU,
    keep the routed experts of the first that many mixture-of-experts layers in RAM, where the CPU computes them
    (the rest of the model stays on the GPU); on the CPU everything is in RAM anyway. expert_cache_slots: GPU
    memory for that many of each such layer's experts, the ones its tokens pick most (engine/expert_cache.py).
    kv_cache_type: "full" (fp16 on the GPU, float32 on the CPU) or "q8_0" (34 bytes per 32 values: half the GPU's
    KV memory, so a longer context fits; the logits change slightly). prompt_chunk: the most prompt tokens run at
    once, which sizes the workspace (capabilities.prompt_chunk: by default the backend's; the CPU path takes at
    most its own)."""
    check_kv_cache_type(kv_cache_type, "kv_cache_type")
    if prompt_chunk is not None and (not isinstance(prompt_chunk, int) or prompt_chunk < 1):
        raise EngineError(f"prompt_chunk must be a positive number of tokens, not {prompt_chunk!r}.")
    gguf = GGUFFile(path)
    try:
        arch = architecture_module(gguf.architecture, f"The model {gguf.path.name}")
        config = arch.read_config(gguf)
        max_context = int(config.context_length)
        if context_length is None:
            context = min(max_context, DEFAULT_CONTEXT)
        elif not isinstance(context_length, int) or context_length < 1:
            raise EngineError(f"context_length must be a positive number of tokens, not {context_length!r}.")
        elif context_length > max_context:
            raise EngineError(
                f"context_length {context_length} is longer than {gguf.path.name} supports ({max_context} tokens). "
                f"Use {max_context} or less."
            )
        else:
            context = context_length
        tokenizer = Tokenizer(gguf)
        template = ChatTemplate.from_gguf(gguf)
        host_layers = _host_expert_layers(config, expert_layers_in_ram, gguf.path.name)
        _expert_cache_slots(config, expert_cache_slots, gguf.path.name)
        backend, reason = select_backend(device)
        if backend.name == "numpy":
            host_layers = frozenset()
        slots = _expert_cache_slots(config, expert_cache_slots, gguf.path.name) if host_layers else 0
        if slots:
            backend.keep_hot_experts(slots)  # the GPU backend's, which alone keeps experts in RAM beside a GPU
        try:
            _check_cpu_memory(gguf, backend)
            weights = arch.load_weights(gguf, config, backend, context, on_progress, should_cancel, host_layers)
            memory = backend.memory_in_use()
            weight_bytes = memory.total_bytes
            chunk = min(backend_prompt_chunk(backend.name, prompt_chunk), context)
            cache = arch.new_cache(config, backend, context, kv_cache_type, chunk)
            workspace = arch.new_workspace(config, backend, chunk)
        except MemoryError:
            backend.close()
            raise EngineError(f"Not enough memory to load {gguf.path.name}; free memory or use a smaller model.") from None
        except BaseException:
            backend.close()
            raise

        def decode_step() -> None:
            arch.forward(config, weights, workspace, backend, cache, 1)

        state = ModelState(arch, config, weights, workspace, cache, backend, CachedTokens(context), backend.compile_step(decode_step))
        summary = gguf.summary()
        info = ModelInfo(
            architecture=summary.architecture,
            name=summary.name,
            context_length=context,
            max_context_length=max_context,
            n_layers=config.n_layers,
            vocab_size=config.vocab_size,
            tensor_types=summary.tensor_types,
            backend=backend.name,
            backend_reason=reason,
            weight_bytes=weight_bytes,
            kv_cache_type=kv_cache_type,
            kv_cache_bytes=cache.nbytes,
            prompt_chunk=chunk,
            expert_layers_in_ram=len(host_layers),
            host_weight_bytes=memory.host_bytes if host_layers else 0,
            expert_cache_slots=slots,
            has_chat_template=template is not None,
        )
        return LoadedModel(gguf, state, tokenizer, template, info)
    finally:
        gguf.close()  # everything needed is uploaded or copied (or the load failed): drop the file mapping
