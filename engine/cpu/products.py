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

    q: np.ndarray  # (n, k) int16
    scale: np.ndarray  # (n, groups) float32: value = scale * q within a 32-value group
    sums: np.ndarray  # (n, groups): each group's sum of values (what an offset multiplies)
    half_sums: np.ndarray  # (n, 2, groups): each group's first and last 16 values summed (Q6_K)
    source: np.ndarray  # the x it was made from (a copy)


def activation(x: np.ndarray) -> Activation:
    """x: (k,) float32, or (n, k) rows, k a multiple of 32."""
    rows = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, x.shape[-1])
    return Activation(*dot.quantize_activations(rows), source=x.copy())


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
    if not (big and _run_parallel(planes, act, out, _split(planes.rows, blocks), blocks)):
        _rows(planes, act, out, 0, planes.rows)


@functools.lru_cache(maxsize=256)
def _split(rows: int, blocks: int) -> np.ndarray:
    """`blocks` ranges covering the rows of one matrix, in order."""
    edges = np.linspace(0, rows, blocks + 1).round().astype(np.int64)
    return np.stack([edges[:-1], edges[1:], edges[:-1], np.zeros(blocks, np.int64)], axis=1)


def expert_products(planes: Planes, act: Activation, experts: np.ndarray, out: np.ndarray, own_rows: bool,
                    threads_used: int) -> None:
    """out (len(experts) * f,) = each chosen expert's slab of f rows times x, slot by slot: the stacked weight's rows
    [e f, (e + 1) f) for e = experts[j] into out[j f : (j + 1) f], with activation row j when `own_rows` (the down
    projection of each expert's own hidden state), else row 0. Slots are cut so every thread gets equal work."""
    slots = len(experts)
    pieces = max(1, threads_used // math.gcd(threads_used, slots))
    ranges = _expert_ranges(experts, out.shape[0] // slots, pieces, own_rows)
    if not _run_parallel(planes, act, out, ranges, threads_used):
        for r0, r1, o, a in ranges:
            _rows(planes, act, out[o : o + r1 - r0], int(r0), int(r1), int(a))


@numba.njit(nogil=True, cache=True)
def _expert_ranges(experts, f, pieces, own_rows):
    """expert_products' ranges, each slot's f rows in `pieces` runs (in numba: the same in NumPy took 39 us, three
    times a layer, on the 2-core VM)."""
    out = np.empty((experts.shape[0] * pieces, 4), np.int64)
    for j in range(experts.shape[0]):
        for p in range(pieces):
            i, lo, hi = j * pieces + p, p * f // pieces, (p + 1) * f // pieces
            out[i, 0] = experts[j] * f + lo
            out[i, 1] = experts[j] * f + hi
            out[i, 2] = j * f + lo
            out[i, 3] = j if own_rows else 0
    return out


def _run_parallel(planes: Planes, act: Activation, out: np.ndarray, ranges: np.ndarray, threads_used: int) -> bool:
    """The ranges on numba's thread pool; False when this machine has no thread-safe threading layer for it."""
    global _parallel
    if not _parallel:
        return False
    try:
        numba.set_num_threads(min(threads_used, numba.config.NUMBA_NUM_THREADS))
        if planes.family == "nibble":
            dot.nibble_ranges(planes.lo, planes.hi, planes.d, planes.m, act.q, act.scale, act.sums, out, ranges)
        elif planes.family == "nibble_k":
            dot.nibble_k_ranges(planes.lo, planes.hi, planes.d, planes.sup, act.q, act.scale, act.sums, out, ranges)
        elif planes.family == "q8":
            dot.q8_ranges(planes.lo, planes.d, act.q, act.scale, out, ranges)
        else:
            dot.q6k_ranges(planes.lo, planes.hi, planes.d, planes.sup, act.q, act.scale, act.half_sums, out, ranges)
    except ValueError as exc:  # no OpenMP or TBB for numba here: every product on the calling thread
        if "threading layer" not in str(exc):
            raise
        _parallel = False
        return False
    return True


def _rows(planes: Planes, act: Activation, out: np.ndarray, r0: int, r1: int, a: int = 0) -> None:
    if planes.family == "nibble":
        dot.nibble_rows(planes.lo, planes.hi, planes.d, planes.m, act.q[a], act.scale[a], act.sums[a], out, r0, r1)
    elif planes.family == "nibble_k":
        dot.nibble_k_rows(planes.lo, planes.hi, planes.d, planes.sup, act.q[a], act.scale[a], act.sums[a], out, r0, r1)
    elif planes.family == "q8":
        dot.q8_rows(planes.lo, planes.d, act.q[a], act.scale[a], out, r0, r1)
    else:
        dot.q6k_rows(planes.lo, planes.hi, planes.d, planes.sup, act.q[a], act.scale[a], act.half_sums[a], out, r0, r1)
