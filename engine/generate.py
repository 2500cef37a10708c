"""Generation as a handful of plain functions named after the steps: prefill, decode_one_token, sampled_tokens,
generate."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import numpy as np

from engine.arch import Architecture
from engine.arch.decoder import DecoderWeights, Workspace
from engine.arch.parts import DecoderConfig
from engine.backend import Backend, KVCache, SamplingParams
from engine.errors import DamagedModel, EngineError
from engine.kv_cache import CachedTokens, RecurrentCache, WindowedCache
from engine.sampler import Sampler
from engine.tokenizer import Tokenizer


@dataclass
class GenerationSettings:
    """How to generate. temperature 0 means greedy; top_k 0, top_p 1, min_p 0 and repeat_penalty 1 are off."""

    max_tokens: int = 512
    temperature: float = 0.7
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False  # keep going past end-of-turn tokens (for benchmarks of a fixed length)

    def sampling(self) -> SamplingParams:
        return SamplingParams(self.temperature, self.top_k, self.top_p, self.min_p, self.repeat_penalty)


@dataclass
class GenerationResult:
    text: str
    finish_reason: str  # "stop" (end-of-turn token or stop string), "length" or "cancelled"
    prompt_tokens: int
    cached_prompt_tokens: int  # leading prompt tokens whose KV entries were reused from the previous call
    completion_tokens: int
    prompt_seconds: float  # prefill of the uncached prompt tokens, up to the first generated token
    decode_seconds: float
    prompt_tokens_per_second: float  # uncached prompt tokens / prompt_seconds
    output_tokens_per_second: float  # tokens from decode steps / decode_seconds


@dataclass
class ModelState:
    """Everything a forward pass needs, owned by one LoadedModel."""

    arch: Architecture
    config: DecoderConfig
    weights: DecoderWeights
    workspace: Workspace
    cache: KVCache | RecurrentCache | WindowedCache
    backend: Backend
    cached: CachedTokens
    decode_step: Callable[[int], None]  # forward of ws.tokens[:1] at ws.start (given), possibly a replayed CUDA graph


def run_chunk(state: ModelState, tokens: list[int], start: int, logits_out=None):
    """Forward tokens at positions start.. (at most workspace.max_chunk of them); returns backend logits."""
    ws = state.workspace
    n = len(tokens)
    _begin_at(state, start)
    state.backend.copy_into(ws.ids[: n + 1], np.asarray([start, *tokens], dtype=np.int32))
    return state.arch.forward(state.config, state.weights, ws, state.backend, state.cache, n, logits_out)


def _begin_at(state: ModelState, position: int) -> None:
    """A pass at position 0 starts a new sequence: a hybrid model's recurrent states start from zeros."""
    if position == 0 and isinstance(state.cache, RecurrentCache):
        state.cache.reset()


def prefill(state: ModelState, prompt: list[int], should_stop: Callable[[], bool] | None = None):
    """Bring the cache to hold `prompt`, reusing its longest cached prefix. Returns (last token's logits,
    tokens reused), or (None, reused) when should_stop asked to stop between chunks.

    The last prompt token always runs as a decode step, whatever was cached: its logits then come from the same
    kernels every time (on the CPU, one-token products round their activation to int16, chunks do not), so a
    seeded answer does not change with what the cache held."""
    check_fits(state, len(prompt))
    reused = state.cached.reusable_prefix(prompt)
    recurrent = isinstance(state.cache, RecurrentCache)
    if recurrent or isinstance(state.cache, WindowedCache):
        reused = state.cache.rewind(reused, len(state.cached))
    state.cached.keep(reused)
    chunk = state.workspace.max_chunk
    for begin in range(reused, len(prompt) - 1, chunk):
        if should_stop is not None and should_stop():
            return None, reused
        tokens = prompt[begin : min(begin + chunk, len(prompt) - 1)]
        run_chunk(state, tokens, begin)
        state.cached.append(tokens)
    logits = decode_one_token(state, prompt[-1])
    if recurrent:
        state.cache.save(len(prompt))
    return logits, reused


def decode_one_token(state: ModelState, token: int):
    """Append one token to the cache and return the logits (vocab,) for the token after it."""
    ws = state.workspace
    _begin_at(state, len(state.cached))
    state.backend.copy_into(ws.ids[:2], np.asarray([len(state.cached), token], dtype=np.int32))
    state.decode_step(len(state.cached))
    state.cached.append([token])
    return ws.logits[0]


def sampled_tokens(state: ModelState, sampler: Sampler, logits, limit: int) -> Iterator[int]:
    """Up to `limit` tokens: the first picked from `logits`, each later one from the decode step that feeds the one
    before, as long as the context has room. On an asynchronous backend the step feeding token t is queued before
    t is read back, so with a sampler that leaves the pick on the device (no repeat penalty) the caller's work on
    t, such as detokenizing and looking for stop strings, overlaps the device's step; t is in state.cached once
    that step is queued, so a caller that stops after t has its KV entry all the same. A synchronous backend runs
    a step only when the caller asks for the token after t: nothing is computed ahead in vain."""
    ws, cached = state.workspace, state.cached
    ahead = state.backend.asynchronous
    pending = sampler.feed(logits, ws.ids, len(cached))
    for n in range(limit):
        more = n + 1 < limit and len(cached) < cached.capacity
        queued = more and ahead
        if queued:
            state.decode_step(len(cached))
            following = sampler.feed(ws.logits[0], ws.ids, len(cached) + 1)
        token = pending()
        if queued:
            cached.append([token])
        yield token
        if not more:
            return
        if not queued:
            state.decode_step(len(cached))
            cached.append([token])
            following = sampler.feed(ws.logits[0], ws.ids, len(cached))
        pending = following


def check_fits(state: ModelState, n_tokens: int) -> None:
    if n_tokens == 0:
        raise EngineError("The prompt is empty; give the model some text to continue.")
    if n_tokens > state.cached.capacity:
        raise EngineError(
            f"The prompt is {n_tokens} tokens but the context holds only {state.cached.capacity}. "
            "Shorten the conversation, or load the model with a longer context_length."
        )


def check_finite(state: ModelState, logits) -> None:
    """Raise DamagedModel when the logits hold NaN or infinity (and forget the cache that produced them): sound
    weights never give these, so the file is damaged, and sampling from them would only give empty answers."""
    if np.isfinite(state.backend.to_host(logits)).all():
        return
    state.cached.clear()
    raise DamagedModel(
        "The model produced invalid numbers (NaN or infinity) for this prompt, so its weights are damaged; verify "
        "its file or download it again before using it."
    )


class StopStringFilter:
    """Passes text on as it grows, holding back any tail that could still become a stop string, and cuts the
    text before the first stop string."""

    def __init__(self, stops: list[str], on_text: Callable[[str], None] | None):
        self._stops = [s for s in stops if s]
        self._on_text = on_text
        self.text = ""
        self._emitted = 0

    def _emit(self, end: int) -> None:
        if end > self._emitted:
            if self._on_text is not None:
                self._on_text(self.text[self._emitted : end])
            self._emitted = end

    def feed(self, piece: str) -> bool:
        """Add text; True when it completed a stop string (the text then ends just before it)."""
        self.text += piece
        hits = [i for i in (self.text.find(s, self._emitted) for s in self._stops) if i >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self._emit(len(self.text))
            return True
        hold = 0
        for s in self._stops:
            for k in range(min(len(s) - 1, len(self.text) - self._emitted), hold, -1):
                if self.text.endswith(s[:k]):
                    hold = k
                    break
        self._emit(len(self.text) - hold)
        return False

    def finish(self) -> None:
        self._emit(len(self.text))


def generate(
    state: ModelState,
    tokenizer: Tokenizer,
    prompt: list[int],
    settings: GenerationSettings,
    stop_ids: set[int],
    on_text: Callable[[str], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> GenerationResult:
    """Prefill the prompt, then sample until an end-of-turn token, a stop string, max_tokens, the end of the
    context, or should_stop."""
    if settings.max_tokens < 1:
        raise EngineError(f"max_tokens must be at least 1, not {settings.max_tokens}.")
    sampler = Sampler(state.backend, settings.sampling(), settings.seed, prompt)
    started = time.perf_counter()
    logits, reused = prefill(state, prompt, should_stop)
    if logits is not None:
        check_finite(state, logits)
    if logits is None:
        elapsed = time.perf_counter() - started
        return GenerationResult("", "cancelled", len(prompt), reused, 0, elapsed, 0.0, 0.0, 0.0)
    tokens = sampled_tokens(state, sampler, logits, settings.max_tokens)
    token = next(tokens)
    prompt_seconds = time.perf_counter() - started

    text = StopStringFilter(settings.stop, on_text)
    decoder = tokenizer.stream_decoder()
    completion, steps, finish = 0, 0, "length"
    decode_started = time.perf_counter()
    while True:
        if token in stop_ids and not settings.ignore_eos:
            finish = "stop"
            break
        completion += 1
        if text.feed(decoder.push(token)):
            finish = "stop"
            break
        if should_stop is not None and should_stop():
            finish = "cancelled"
            break
        token = next(tokens, None)
        if token is None:  # max_tokens, or the context is full
            break
        steps += 1
    # Bytes of a character the last token left unfinished are dropped rather than shown as U+FFFD.
    text.finish()
    decode_seconds = time.perf_counter() - decode_started
    processed = len(prompt) - reused
    return GenerationResult(
        text=text.text,
        finish_reason=finish,
        prompt_tokens=len(prompt),
        cached_prompt_tokens=reused,
        completion_tokens=completion,
        prompt_seconds=prompt_seconds,
        decode_seconds=decode_seconds,
        prompt_tokens_per_second=processed / prompt_seconds if prompt_seconds > 0 else 0.0,
        output_tokens_per_second=steps / decode_seconds if decode_seconds > 0 and steps else 0.0,
    )
