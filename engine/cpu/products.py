"""Matrix-vector products on packed blocks, split over cores by rows, and the activation layout they read.

A product big enough to pay for waking other cores (a few microseconds through numba's OpenMP or TBB pool) runs
as one row range per thread; a smaller one runs on the calling thread. Both release the GIL. Half the cores take
part: every thread waits for the slowest at the end of a product, and a core that another program is using stalls
it (SmolLM2 on the 2-core machine with a test run beside it: 56 tokens/s on one thread, 17-19 on two).
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass

import numba
import numpy as np

from engine.cpu import dot
from engine.cpu.layout import Planes

# Weights a product must read before it is split over cores: SmolLM2's 576x576 (331,776) gained a quarter on two.
PARALLEL_MIN_WEIGHTS = 1 << 17


@dataclass
class Activation:
    """Activation rows as the kernels read them, quantized once and shared by every product on them."""

    q: np.ndarray  # (n, k) int16, or int8 (engine/cpu/dot.py says which products take which)
    scale: np.ndarray  # (n, groups) float32: value = scale * q within a 32-value group
    sums: np.ndarray  # (n, groups): each group's sum of values (what an offset multiplies)
    half_sums: np.ndarray  # (n, 2, groups): each group's first and last 16 values summed (Q6_K)
    source: np.ndarray  # the x it was made from (a copy)

    def arrays(self) -> tuple[np.ndarray, ...]:
        """What the kernels take: q, scale, sums, half_sums."""
        return self.q, self.scale, self.sums, self.half_sums


def activation(x: np.ndarray, bits: int = 16) -> Activation:
    """x: (k,) float32, or (n, k) rows, k a multiple of 32, rounded to `bits` (16 or 8) per 32 values."""
    rows = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, x.shape[-1])
    q = np.empty(rows.shape, np.int16 if bits == 16 else np.int8)
    return Activation(q, *dot.quantize_activations(rows, q, (1 << (bits - 1)) - 1), source=x.copy())


_CPUS = os.cpu_count() or 1
_parallel = True  # until numba finds no thread-safe threading layer on this machine


_THREADS = max(1, int(os.environ.get("STRATA_CPU_THREADS") or _CPUS // 2))


def threads() -> int:
    """Threads a product runs on: STRATA_CPU_THREADS (read at import) when set, else half the cores."""
    return _THREADS


def matvec(planes: Planes, act: Activation, out: np.ndarray) -> None:
    """out (rows,) = planes @ x, x the activation's first row."""
    blocks = min(threads(), planes.rows)
    big = blocks > 1 and planes.rows * planes.k >= PARALLEL_MIN_WEIGHTS
    w, x, code = planes.arrays(), act.arrays(), _code(planes)
    if not (big and parallel_call(dot.row_ranges, code, w, x, out, _split(planes.rows, blocks), threads=blocks)):
        dot.family_rows(code, w, x, 0, out, 0, planes.rows)


@functools.lru_cache(maxsize=256)
def _split(rows: int, blocks: int) -> np.ndarray:
    """`blocks` ranges covering the rows of one matrix, in order."""
    edges = np.linspace(0, rows, blocks + 1).round().astype(np.int64)
    return np.stack([edges[:-1], edges[1:], edges[:-1], np.zeros(blocks, np.int64)], axis=1)


def expert_glu(gate: Planes, up: Planes, act: Activation, experts: np.ndarray, hidden: np.ndarray, gelu: bool,
               threads_used: int) -> None:
    """hidden (len(experts) * f,) = act(gate slab . x) * (up slab . x) for each chosen expert, slot by slot, in one
    pass over the threads (act: silu, or gelu_tanh when `gelu`)."""
    ranges = _slot_ranges(experts, hidden.shape[0] // len(experts), threads_used)
    up_out = np.empty_like(hidden)
    args = (_code(gate), gate.arrays(), _code(up), up.arrays(), act.arrays(), hidden, up_out)
    if not parallel_call(dot.glu_ranges, *args, ranges, gelu, threads=threads_used):
        for r in ranges:
            dot.glu_range(*args, r, gelu)


def expert_mix(down: Planes, act: Activation, experts: np.ndarray, weights: np.ndarray, out: np.ndarray,
               threads_used: int) -> None:
    """out (d,) = sum over slots j of weights[j] * (expert experts[j]'s slab of d rows . activation row j), each
    thread a run of the d rows over every slot, the slots summed in order (the same bits on any thread count)."""
    ranges = _split(out.shape[0], min(threads_used, out.shape[0]))
    args = (_code(down), down.arrays(), act.arrays(), experts, weights, out.shape[0], out)
    if not parallel_call(dot.mix_ranges, *args, ranges, threads=threads_used):
        for r in ranges:
            dot.mix_range(*args, r)


def _code(planes: Planes) -> int:
    return dot.FAMILY_CODES[planes.family]


def _slot_ranges(experts: np.ndarray, f: int, threads_used: int) -> np.ndarray:
    """Each chosen expert's slab of f rows cut so every thread gets equal work, all on activation row 0."""
    slots = len(experts)
    return _expert_ranges(experts, f, max(1, threads_used // math.gcd(threads_used, slots)))


@numba.njit(nogil=True, cache=True)
def _expert_ranges(experts, f, pieces):
    """_slot_ranges' ranges, each slot's f rows in `pieces` runs (in numba: the same in NumPy took 39 us a call on
    the 2-core VM)."""
    out = np.zeros((experts.shape[0] * pieces, 4), np.int64)
    for j in range(experts.shape[0]):
        for p in range(pieces):
            i, lo, hi = j * pieces + p, p * f // pieces, (p + 1) * f // pieces
            out[i, 0] = experts[j] * f + lo
            out[i, 1] = experts[j] * f + hi
            out[i, 2] = j * f + lo
    return out


def parallel_call(kernel, *args, threads: int) -> bool:
    """kernel(*args) on numba's thread pool; False when this machine has no thread-safe threading layer for it."""
    global _parallel
    if not _parallel:
        return False
    try:
        numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
        kernel(*args)
    except ValueError as exc:  # no OpenMP or TBB for numba here: every product on the calling thread
        if "threading layer" not in str(exc):
            raise
        _parallel = False
        return False
    return True
