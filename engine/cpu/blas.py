"""BLAS's thread count limited around a piece of work. threadpoolctl's `threadpool_limits` finds the loaded
libraries anew on each use (it reads /proc/self/maps): about 1 ms a decode step on the 2-core CPU VM, where a step
of SmolLM2 takes about 10. One controller, made at the first use (NumPy's BLAS is loaded by then), serves every
later one."""

from __future__ import annotations

import functools
from contextlib import AbstractContextManager

from threadpoolctl import ThreadpoolController


@functools.cache
def _controller() -> ThreadpoolController:
    return ThreadpoolController()


def blas_threads(limit: int) -> AbstractContextManager:
    """Inside the returned context manager BLAS uses at most `limit` threads."""
    return _controller().limit(limits=limit, user_api="blas")
