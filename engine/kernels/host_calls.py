"""Python functions run by the CPU at a point of a CUDA stream, capturable in a CUDA graph (a host node).

The GPU backend computes the experts that live in RAM this way: the stream copies a token's activation to pinned
memory, a host call runs the CPU kernels on it, the stream copies the result back, and the decode step stays one
graph with no Python round trip between its layers. CuPy's own `Stream.launch_host_func` releases its callback
after the first call, which a graph replaying it would then call freed; here the callback lives as long as the
table: the driver's `cuLaunchHostFunc` gets one C callback for the whole table and the job's index as its data.
"""

from __future__ import annotations

import ctypes
import os
import queue
import threading
from typing import Callable

_CALLBACK = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


# CUDA's primary-context schedule flags (CU_CTX_SCHED_*): how a host thread waits for the GPU.
SCHEDULE_AUTO, SCHEDULE_BLOCKING = 0, 4


def _driver() -> ctypes.CDLL:
    return ctypes.CDLL("nvcuda.dll" if os.name == "nt" else "libcuda.so.1")


def set_schedule(flag: int) -> bool:
    """Set how host threads wait for the current GPU; False where the driver refuses (older drivers do once the
    context is live), which leaves the schedule as it was."""
    driver, device = _driver(), ctypes.c_int()
    if driver.cuCtxGetDevice(ctypes.byref(device)):
        return False
    return driver.cuDevicePrimaryCtxSetFlags_v2(device, ctypes.c_uint(flag)) == 0


class HostCalls:
    """A table of jobs a stream can call. The driver's callback thread hands each job to a worker thread of ours and
    waits for it: OpenMP threads started from the driver's thread ran the CPU's expert products at half the speed
    they reach from a thread of ours (H200 machine, 1,138 against 582-713 us a layer). A job's exception is kept
    (the driver cannot take it) and raised by `check`, which the backend calls wherever it waits for the stream.

    While a table exists, threads waiting for the GPU sleep instead of spinning (SCHEDULE_BLOCKING): the jobs' CPU
    products use every core, and a spinning wait on one of them stalled them all (16 threads: 12.1 ms a layer against
    0.96 ms blocking; H200 machine, bench/bench_host_experts.py)."""

    def __init__(self) -> None:
        set_schedule(SCHEDULE_BLOCKING)
        driver = _driver()
        self._launch = driver.cuLaunchHostFunc
        self._launch.argtypes = [ctypes.c_void_p, _CALLBACK, ctypes.c_void_p]
        self._launch.restype = ctypes.c_int
        self._jobs: list[Callable[[], None]] = []
        self._index: dict[object, int] = {}
        self._error: BaseException | None = None
        self._todo: queue.SimpleQueue[int | None] = queue.SimpleQueue()
        self._done = threading.Semaphore(0)
        self._worker = threading.Thread(target=self._work, name="strata-host-calls", daemon=True)
        self._worker.start()
        self._callback = _CALLBACK(self._run)  # kept: the driver holds its address

    def _run(self, data: int | None) -> None:
        """On the driver's thread: the job runs on the worker; the stream goes on when it is done."""
        self._todo.put(data or 0)
        self._done.acquire()

    def _work(self) -> None:
        while (index := self._todo.get()) is not None:
            try:
                self._jobs[index]()
            except BaseException as exc:  # noqa: BLE001 - nothing above the driver's thread could catch it
                self._error = self._error or exc
            self._done.release()

    def launch(self, stream_ptr: int, key: object, job: Callable[[], None]) -> None:
        """Queue `job` on the stream; the same key reuses the job registered first (a graph keeps calling it)."""
        index = self._index.get(key)
        if index is None:
            index = self._index[key] = len(self._jobs)
            self._jobs.append(job)
        status = self._launch(ctypes.c_void_p(stream_ptr), self._callback, ctypes.c_void_p(index))
        if status:
            raise RuntimeError(f"cuLaunchHostFunc failed with CUDA driver error {status}")

    def check(self) -> None:
        """Raise the first exception a job raised since the last check."""
        error, self._error = self._error, None
        if error is not None:
            raise error

    def close(self) -> None:
        """End the worker (after the stream has finished its calls) and let waits spin again."""
        self._todo.put(None)
        set_schedule(SCHEDULE_AUTO)
