"""Which activation each of the GPU backend's two int8 sets holds (engine/backend_cupy.py), as plain Python so
the CPU tests can check it.

A one-token product reads its input as int8 groups. The kernel that writes that input (a norm, attention, the
gate/up pair) also writes its groups into one of two sets, so the products after it need no quantize launch;
two sets let a kernel read one while it writes the other. The groups stay right only while nothing writes the
array they were made from, so the backend tells `Q8Sets` about every array an op writes (`written`) before the
op runs, and a set whose array overlaps one is forgotten. Arrays are known by their memory span.
"""

from __future__ import annotations

Span = tuple[int, int]  # [first byte, end byte) an array's elements lie in


def span(ptr: int, shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int) -> Span:
    """The bytes an array of this address, shape and strides (in bytes, any sign) can touch."""
    if 0 in shape:
        return (ptr, ptr)
    lo = ptr + sum((n - 1) * s for n, s in zip(shape, strides) if s < 0)
    hi = ptr + sum((n - 1) * s for n, s in zip(shape, strides) if s > 0) + itemsize
    return (lo, hi)


def _overlap(a: Span, b: Span) -> bool:
    return a[0] < b[1] and b[0] < a[1]


class Q8Sets:
    """The span each int8 set holds the groups of (None: nothing usable), and the set used last."""

    def __init__(self) -> None:
        self._holds: list[Span | None] = [None, None]
        self._last = 0

    def forget(self) -> None:
        """Nothing is held: after a captured graph replays (its writes happen where Python does not see them),
        and before a decode step runs, so that the step's graph never reuses groups made outside it."""
        self._holds = [None, None]

    def written(self, spans: list[Span]) -> None:
        """An op is about to write these spans: groups made from any array overlapping them are stale."""
        for i, held in enumerate(self._holds):
            if held is not None and any(_overlap(held, s) for s in spans):
                self._holds[i] = None

    def read(self, x: Span) -> tuple[int, bool]:
        """(set, fresh) for a product reading x: the set holding x's groups (fresh), or, to quantize x into,
        the set not used last (so the groups just made or read stay), recorded as holding x."""
        if x in self._holds:
            self._last = self._holds.index(x)
            return self._last, True
        return self._take(x), False

    def produce(self, out: Span) -> int:
        """The set a kernel writing `out` also writes out's groups to: not the one used last, which the same
        kernel may be reading."""
        return self._take(out)

    def _take(self, x: Span) -> int:
        self._last = 1 - self._last
        self._holds[self._last] = x
        return self._last
