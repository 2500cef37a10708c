"""Host side of sampling: the seeded random stream and the repeat-penalty window. The choice itself is the
backend's `sample` op (NumPy reference in engine/kernels/reference.py), so a GPU can pick on the device."""

from __future__ import annotations

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
    """Picks tokens with fixed settings; the same seed gives the same choices."""

    def __init__(self, backend: Backend, params: SamplingParams, seed: int | None = None):
        check_sampling(params)
        self._backend = backend
        self.params = params
        self._rng = np.random.default_rng(seed)

    def next_token(self, logits, history: list[int]) -> int:
        """A token id from logits (vocab,) given every token so far (for the repeat penalty)."""
        recent = np.asarray(history[-REPEAT_PENALTY_WINDOW:], dtype=np.int32)
        return self._backend.sample(logits, self.params, recent, float(self._rng.random()))
