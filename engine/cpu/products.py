"""Matrix-vector products on packed blocks, split over cores by rows, and the activation layout they read.

A product big enough to pay for waking other cores (a few microseconds through numba's OpenMP or TBB pool) runs
as one row range per thread; a smaller one runs on the calling thread. Both release the GIL. Half the cores take
part: every thread waits for the slowest at the end of a product, and a core that another program is using stalls
it (SmolLM2 on the 2-core machine with a test run beside it: 56 tokens/s on one thread, 17-19 on two).
"""

from __future__ import annotations

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
    """One token's activation as the kernels read it, quantized once and shared by every product on it."""

    q: np.ndarray  # (k,) int16
    scale: np.ndarray  # (groups,) float32: value = scale * q within a 32-value group
    sums: np.ndarray  # (groups,): each group's sum of values (what an offset multiplies)
    half_sums: np.ndarray  # (2, groups): each group's first and last 16 values summed (Q6_K)
    source: np.ndarray  # the x it was made from (a copy)


def activation(x: np.ndarray) -> Activation:
    """x: (k,) float32, k a multiple of 32."""
    return Activation(*dot.quantize_activation(x), source=x.copy())


_CPUS = os.cpu_count() or 1
_parallel = True  # until numba finds no thread-safe threading layer on this machine


def threads() -> int:
    return max(1, _CPUS // 2)


def matvec(planes: Planes, act: Activation, out: np.ndarray) -> None:
    """out (rows,) = planes @ x."""
    global _parallel
    blocks = min(threads(), planes.rows)
    if _parallel and blocks > 1 and planes.rows * planes.k >= PARALLEL_MIN_WEIGHTS:
        try:
            numba.set_num_threads(min(blocks, numba.config.NUMBA_NUM_THREADS))
            _blocks(planes, act, out, blocks)
            return
        except ValueError as exc:  # no OpenMP or TBB for numba here: every product on the calling thread
            if "threading layer" not in str(exc):
                raise
            _parallel = False
    _rows(planes, act, out, 0, planes.rows)


def _rows(planes: Planes, act: Activation, out: np.ndarray, r0: int, r1: int) -> None:
    if planes.family == "nibble":
        dot.nibble_rows(planes.lo, planes.hi, planes.d, planes.m, act.q, act.scale, act.sums, out, r0, r1)
    elif planes.family == "q8":
        dot.q8_rows(planes.lo, planes.d, act.q, act.scale, out, r0, r1)
    else:
        dot.q6k_rows(planes.lo, planes.hi, planes.d, act.q, act.scale, act.half_sums, out, r0, r1)


def _blocks(planes: Planes, act: Activation, out: np.ndarray, blocks: int) -> None:
    if planes.family == "nibble":
        dot.nibble_blocks(planes.lo, planes.hi, planes.d, planes.m, act.q, act.scale, act.sums, out, blocks)
    elif planes.family == "q8":
        dot.q8_blocks(planes.lo, planes.d, act.q, act.scale, out, blocks)
    else:
        dot.q6k_blocks(planes.lo, planes.hi, planes.d, act.q, act.scale, act.half_sums, out, blocks)
