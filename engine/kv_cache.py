"""Which tokens the KV cache holds, so a new prompt can reuse the longest prefix it shares with them."""

from __future__ import annotations


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
