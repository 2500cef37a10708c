"""Which tokens the KV cache holds, so a new prompt can reuse the longest prefix it shares with them, and the
state of hybrid models, whose recurrent layers can only go back to a saved point."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


class CachedTokens:
    """Token ids whose keys and values are in the cache, at positions 0..len-1."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.tokens: list[int] = []

    def __len__(self) -> int:
        return len(self.tokens)

    def reusable_prefix(self, prompt: list[int]) -> int:
        """How many leading prompt tokens are already cached. At least one token is always left to run, since
        the model must produce logits for the last prompt token."""
        limit = min(len(self.tokens), len(prompt) - 1)
        n = 0
        while n < limit and self.tokens[n] == prompt[n]:
            n += 1
        return n

    def keep(self, n: int) -> None:
        """Forget everything after the first n tokens (their cache entries get overwritten later)."""
        del self.tokens[n:]

    def append(self, tokens: list[int]) -> None:
        self.tokens.extend(tokens)

    def clear(self) -> None:
        self.tokens.clear()


@dataclass
class WindowedCache:
    """The cache of a model whose sliding-window layers (Gemma 3: five of six) attend to the last `window`
    positions only: `full` holds the other layers' keys and values for every position, `ring` the sliding layers'
    for the last ring.max_tokens positions (position p in row p mod ring.max_tokens), window + chunk - 1 of them, so
    a chunk of up to `chunk` tokens never overwrites a row a query of it attends to. `slots[i]`: model layer i's
    (sliding, index among its kind)."""

    full: Any  # engine.backend.KVCache
    ring: Any
    window: int
    slots: tuple[tuple[bool, int], ...]

    @property
    def nbytes(self) -> int:
        return int(self.full.nbytes + self.ring.nbytes)

    def layer(self, i: int) -> tuple[Any, int]:
        sliding, index = self.slots[i]
        return (self.ring if sliding else self.full), index

    def rewind(self, reusable: int, live: int) -> int:
        """How many of the `reusable` leading tokens (which the `live` cached tokens begin with) can be reused: the
        positions a prompt resumed there attends to in the sliding layers (reusable - window + 1 on) must still be
        in the ring, which holds the last ring.max_tokens of the live ones; otherwise none."""
        oldest = live - self.ring.max_tokens  # the earliest live position the ring still holds
        return reusable if max(0, reusable - self.window + 1) >= oldest else 0


@dataclass
class RecurrentCache:
    """A hybrid model's state. `kv` holds the keys and values of its attention layers only (numbered among
    themselves); each recurrent layer instead keeps a fixed-size state standing for the whole prefix: `conv`
    (n_recurrent, kernel - 1, channels), the last inputs of its causal convolution, and `ssm` (n_recurrent,
    v_heads, dk, dv), its delta-rule state. The live state stands for every token in CachedTokens; a chunk at
    position 0 starts from zeros (`reset`).

    Unlike KV entries such a state cannot be cut back to a shorter prefix, so one copy is kept: the state at the
    end of the last prompt (`save`), where the next turn of a chat reuses from when the reply does not come back
    token for token (re-tokenized, edited or regenerated). A prompt reuses the live state, that copy, or nothing.
    """

    kv: Any  # engine.backend.KVCache
    conv: Any
    ssm: Any
    saved_conv: Any
    saved_ssm: Any
    assign: Callable[[Any, Any], None]  # the backend's assign: copies queue with its other work
    saved_at: int | None = None  # tokens the copy stands for; None: no copy

    @property
    def nbytes(self) -> int:
        return int(self.kv.nbytes + 2 * (self.conv.nbytes + self.ssm.nbytes))

    def reset(self) -> None:
        self.assign(self.conv, 0)
        self.assign(self.ssm, 0)
        self.saved_at = None

    def save(self, n_tokens: int) -> None:
        self.assign(self.saved_conv, self.conv)
        self.assign(self.saved_ssm, self.ssm)
        self.saved_at = n_tokens

    def rewind(self, reusable: int, live: int) -> int:
        """How many of the `reusable` leading tokens (which the `live` tokens of the state begin with) can be
        reused, after restoring the state that stands for them."""
        if reusable >= live:
            return live
        if self.saved_at is not None and self.saved_at <= reusable:
            self.assign(self.conv, self.saved_conv)
            self.assign(self.ssm, self.saved_ssm)
            return self.saved_at
        self.saved_at = None  # the tokens after the cut change, and the copy with them
        return 0
