"""Host side of sampling: the seeded random stream and the repeat-penalty window. The choice itself is the
backend's `sample` op (NumPy reference in engine/kernels/reference.py), so a GPU can pick on the device."""

from __future__ import annotations

from collections import deque
from typing import Callable, Sequence

import numpy as np

from engine.backend import Backend, SamplingParams
from engine.errors import EngineError

# Like llama.cpp's default penalty_last_n: the penalty looks at the last 64 tokens, prompt included.
REPEAT_PENALTY_WINDOW = 64


def check_sampling(params: SamplingParams) -> None:
    """EngineError for a setting outside its meaningful range."""
    if params.temperature < 0:
        raise EngineError(f"temperature must be 0 (greedy) or more, not {params.temperature}.")
    if params.top_k < 0:
        raise EngineError(f"top_k must be 0 (off) or a positive number of tokens, not {params.top_k}.")
    if not 0.0 < params.top_p <= 1.0:
        raise EngineError(f"top_p must be in (0, 1] (1 = off), not {params.top_p}.")
    if not 0.0 <= params.min_p <= 1.0:
        raise EngineError(f"min_p must be in [0, 1] (0 = off), not {params.min_p}.")
    if params.repeat_penalty <= 0:
        raise EngineError(f"repeat_penalty must be positive (1.0 = off), not {params.repeat_penalty}.")


class Sampler:
    """Picks tokens with fixed settings; the same seed gives the same choices. Keeps the recent tokens the repeat
    penalty looks at: those of `history` (the prompt), then each token it picks."""

    def __init__(self, backend: Backend, params: SamplingParams, seed: int | None = None, history: Sequence[int] = ()):
        check_sampling(params)
        self._backend = backend
        self.params = params
        self._rng = np.random.default_rng(seed)
        self._recent = deque(history[-REPEAT_PENALTY_WINDOW:], maxlen=REPEAT_PENALTY_WINDOW)

    def next_token(self, logits) -> int:
        """A token id from logits (vocab,)."""
        recent = np.fromiter(self._recent, np.int32, len(self._recent))
        token = self._backend.sample(logits, self.params, recent, float(self._rng.random()))
        self._recent.append(token)
        return token

    def feed(self, logits, ids, position: int) -> Callable[[], int]:
        """Pick a token from logits and write [position, token] into ids[:2], the next decode step's input;
        returns a function that gives the token. Without a repeat penalty the pick stays on the device until
        that function is called (Backend.sample_feed); with one, it needs the host's history and is made now."""
        if self.params.repeat_penalty == 1.0:
            return self._backend.sample_feed(logits, self.params, float(self._rng.random()), ids, position)
        token = self.next_token(logits)
        self._backend.copy_into(ids[:2], np.asarray([position, token], np.int32))
        return lambda: token
