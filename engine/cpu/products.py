"""Matrix-vector products on packed planes, split over threads by rows, and the activation layout they read.

A product is cut into row ranges only when it is big enough to pay for the hand-off to a worker (tens of
microseconds); each range runs a kernel that releases the GIL.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from engine.cpu import dot
from engine.cpu.layout import Planes

# Weights a product must read before it is split over threads.
PARALLEL_MIN_WEIGHTS = 1 << 21

_pool: ThreadPoolExecutor | None = None


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


def threads() -> int:
    return _CPUS


def matvec(planes: Planes, act: Activation, out: np.ndarray) -> None:
    """out (rows,) = planes @ x."""
    rows = planes.rows
    parts = min(threads(), max(1, rows * planes.k // PARALLEL_MIN_WEIGHTS))
    if parts == 1:
        _rows(planes, act, out, 0, rows)
        return
    bounds = np.linspace(0, rows, parts + 1).astype(int)
    futures = [_workers().submit(_rows, planes, act, out[a:b], a, b) for a, b in zip(bounds[1:-1], bounds[2:])]
    _rows(planes, act, out[: bounds[1]], 0, int(bounds[1]))
    for future in futures:
        future.result()


def _rows(planes: Planes, act: Activation, out: np.ndarray, r0: int, r1: int) -> None:
    if planes.family == "nibble":
        dot.nibble_rows(planes.lo, planes.hi, planes.d, planes.m, act.q, act.scale, act.sums, out, r0, r1)
    elif planes.family == "q8":
        dot.q8_rows(planes.lo, planes.d, act.q, act.scale, out, r0, r1)
    else:
        dot.q6k_rows(planes.lo, planes.hi, planes.d, act.q, act.scale, act.half_sums, out, r0, r1)


def _workers() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(max_workers=max(1, threads() - 1), thread_name_prefix="strata-cpu")
    return _pool
