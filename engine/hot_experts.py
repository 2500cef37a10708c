"""Which experts the GPU's cache should hold (engine/expert_cache.py): scores from counted picks, and the swaps that
move each layer's slots toward its best-scoring experts. Plain NumPy, so the CPU tests check the policy.

A score decays by DECAY at each fold of new counts and adds the expert's new picks, so it follows a conversation's
drift without forgetting a hot expert over a few quiet steps. A resident expert leaves only for one scoring
HYSTERESIS times more, so two experts of about equal use do not take turns in a slot.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

DECAY = 0.95  # a score's weight after one fold: with a fold each 8 tokens, picks of about 110 tokens back count half
MAX_SWAPS = 16  # experts a batch uploads (about 3 MB and a few ms of repacking each, for Qwen3-30B-A3B)
HYSTERESIS = 1.25  # how much more a newcomer must score than the resident it displaces


@dataclass(frozen=True)
class Swap:
    layer: int  # row of the cache's map
    slot: int
    old: int  # the expert leaving the slot, -1 for a free slot
    new: int


class ExpertScores:
    """Scores of each layer's experts from cumulative pick counts (layers, experts + 1): uint32 counts that wrap,
    the last column the picks the cache held."""

    def __init__(self) -> None:
        self.score = np.zeros((0, 0))
        self._last = np.zeros((0, 0), np.uint32)
        self.picks = self.hits = 0
        self.recent = (0, 0)  # (picks, hits) of the last fold

    def add_layer(self, experts: int) -> None:
        self.score = np.concatenate([self.score.reshape(-1, experts), np.zeros((1, experts))])
        self._last = np.concatenate([self._last.reshape(-1, experts + 1), np.zeros((1, experts + 1), np.uint32)])

    def fold(self, counts: np.ndarray) -> None:
        new = (counts - self._last).astype(np.int64)  # uint32 differences wrap as the counts do
        self._last = counts.copy()
        self.score = self.score * DECAY + new[:, :-1]
        picks, hits = int(new[:, :-1].sum()), int(new[:, -1].sum())
        self.picks, self.hits, self.recent = self.picks + picks, self.hits + hits, (picks, hits)

    @property
    def recent_hit_rate(self) -> float | None:
        picks, hits = self.recent
        return round(hits / picks, 4) if picks else None


def plan_swaps(score: np.ndarray, slot_of: np.ndarray, capacity: int, max_swaps: int = MAX_SWAPS,
               hysteresis: float = HYSTERESIS) -> list[Swap]:
    """The uploads that bring each layer's cache closer to its `capacity` best-scoring experts: score (layers,
    experts) float, slot_of (layers, experts) int (-1 where not cached). Free slots fill first; a resident outside
    the best leaves for a newcomer scoring `hysteresis` times more. At most max_swaps, the largest gains first."""
    if capacity <= 0:
        return []
    gains: list[tuple[float, Swap]] = []
    for layer, (s, held) in enumerate(zip(score, slot_of)):
        best = np.argsort(-s, kind="stable")[:capacity]
        best_set = set(best.tolist())
        newcomers = [int(e) for e in best if s[e] > 0 and held[e] < 0]
        free = sorted(set(range(capacity)) - set(held[held >= 0].tolist()))
        leaving = sorted((int(e) for e in np.flatnonzero(held >= 0) if e not in best_set), key=lambda e: s[e])
        for e in newcomers:
            if free:
                gains.append((float(s[e]), Swap(layer, free.pop(0), -1, e)))
            elif leaving and s[e] > hysteresis * s[leaving[0]]:
                old = leaving.pop(0)
                gains.append((float(s[e] - s[old]), Swap(layer, int(held[old]), old, e)))
    gains.sort(key=lambda g: -g[0])
    return [swap for _, swap in gains[:max_swaps]]


