"""Python functions run by the CPU at a point of a CUDA stream, capturable in a CUDA graph.

The GPU backend computes the experts that live in RAM this way: the stream copies a token's activation to pinned
memory, a one-thread kernel (host_call.cu) announces the call in page-locked memory and waits for the answer, a
thread of ours that watches that memory runs the job and answers, and the stream copies the result back, so a decode
step stays one graph with no Python round trip between its layers.

The driver's own host functions (cuLaunchHostFunc) did the same at 270-350 us more a call than the job took, once
GPU work ran between the calls as it does in a decode step (H200 machine under gVisor, a 60 us kernel between calls:
790-960 us a layer in the graph against 520-690 on the main thread; bench/bench_host_experts.py): the driver's
thread sleeps while the GPU works, and waking it, then ours, is what those calls paid. Our thread spins while calls
come (SPIN_S after the last one, longer than a token's gap between decode steps) and otherwise checks every IDLE_S;
`arm` wakes it at once, which the backend does before it launches work that holds host calls.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from typing import Callable

import cupyx
import numpy as np
from llvmlite import binding, ir
from numba import njit, types
from numba.extending import intrinsic

from engine.kernels import cuda

# CUDA's primary-context schedule flags (CU_CTX_SCHED_*): how a host thread waits for the GPU.
SCHEDULE_AUTO, SCHEDULE_BLOCKING = 0, 4
SPIN_S = 0.02  # seconds our thread spins for calls after the last one
IDLE_S = 0.01  # how often it looks when idle and not armed (a call nobody armed for waits at most this long)
_POLLS = 4096  # looks at the flags per spin between checks of the clock (well under a millisecond)
_X86 = binding.get_process_triple().startswith(("x86_64", "i686", "i386"))


def _driver() -> ctypes.CDLL:
    return ctypes.CDLL("nvcuda.dll" if os.name == "nt" else "libcuda.so.1")


def set_schedule(flag: int) -> bool:
    """Set how host threads wait for the current GPU; False where the driver refuses (older drivers do once the
    context is live), which leaves the schedule as it was."""
    driver, device = _driver(), ctypes.c_int()
    if driver.cuCtxGetDevice(ctypes.byref(device)):
        return False
    return driver.cuDevicePrimaryCtxSetFlags_v2(device, ctypes.c_uint(flag)) == 0


@intrinsic
def _flag(typingctx, state, index):
    """state[index] read atomically (acquire): the GPU writes it, and a plain load could be hoisted out of a loop."""

    def codegen(context, builder, sig, args):
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        return builder.load_atomic(builder.gep(data, [args[1]]), "acquire", 8)

    return types.int64(state, types.int64), codegen


@intrinsic
def _answer_flag(typingctx, state, index, value):
    """state[index] = value, written atomically (release): what the job wrote is visible first."""

    def codegen(context, builder, sig, args):
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        builder.store_atomic(args[2], builder.gep(data, [args[1]]), "release", 8)
        return context.get_dummy_value()

    return types.none(state, types.int64, types.int64), codegen


@intrinsic
def _pause(typingctx):
    """The x86 spin-wait hint (nothing elsewhere)."""

    def codegen(context, builder, sig, args):
        if _X86:
            builder.call(ir.Function(builder.module, ir.FunctionType(ir.VoidType(), []), "llvm.x86.sse2.pause"), [])
        return context.get_dummy_value()

    return types.none(), codegen


@njit(nogil=True, cache=True)
def _next_call(state, answered, polls):
    """The count of calls made, once it passes `answered` or after `polls` looks."""
    for _ in range(polls):
        made = _flag(state, 0)
        if made != answered:
            return made
        _pause()
    return answered


@njit(nogil=True, cache=True)
def _answer(state, call):
    _answer_flag(state, 2, call)


class HostCalls:
    """A table of jobs a stream can call. A job's exception is kept (the GPU cannot take it) and raised by `check`,
    which the backend calls wherever it waits for the stream.

    While a table exists, threads waiting for the GPU sleep instead of spinning (SCHEDULE_BLOCKING): the jobs' CPU
    products use every core, and a spinning wait on one of them stalled them all (16 threads: 12.1 ms a layer against
    0.96 ms blocking; H200 machine, bench/bench_host_experts.py)."""

    def __init__(self) -> None:
        set_schedule(SCHEDULE_BLOCKING)
        self._state = cupyx.zeros_pinned(3, np.int64)  # calls made, the latest's job, calls answered
        self._jobs: list[Callable[[], None]] = []
        self._index: dict[object, int] = {}
        self._error: BaseException | None = None
        self._armed = threading.Event()
        self._closing = False
        self._worker = threading.Thread(target=self._work, name="strata-host-calls", daemon=True)
        self._worker.start()

    def _work(self) -> None:
        answered, last = 0, time.perf_counter()
        while True:
            spinning = time.perf_counter() - last < SPIN_S
            made = _next_call(self._state, answered, _POLLS if spinning else 1)
            if made != answered:
                try:
                    self._jobs[int(self._state[1])]()
                except BaseException as exc:  # noqa: BLE001 - nothing on the GPU could catch it
                    self._error = self._error or exc
                answered, last = made, time.perf_counter()
                _answer(self._state, answered)
            elif not spinning:
                if self._closing:
                    return
                if self._armed.wait(IDLE_S):
                    self._armed.clear()
                    last = time.perf_counter()

    def arm(self) -> None:
        """Calls are coming: have the thread spin for them now."""
        self._armed.set()

    def launch(self, key: object, job: Callable[[], None]) -> None:
        """Queue `job` on the current stream; the same key reuses the job registered first (a graph keeps calling
        it)."""
        cuda.host_call(self._state, self._registered(key, job))

    def post(self, key: object, job: Callable[[], None]) -> None:
        """Queue the start of `job` (as launch) without holding the stream: the GPU work queued next runs beside
        it, until `wait`."""
        cuda.host_call_post(self._state, self._registered(key, job))

    def wait(self) -> None:
        """Hold the stream until the job posted last is done."""
        cuda.host_call_wait(self._state)

    def _registered(self, key: object, job: Callable[[], None]) -> int:
        index = self._index.get(key)
        if index is None:
            index = self._index[key] = len(self._jobs)
            self._jobs.append(job)
        self.arm()
        return index

    def check(self) -> None:
        """Raise the first exception a job raised since the last check."""
        error, self._error = self._error, None
        if error is not None:
            raise error

    def close(self) -> None:
        """End the thread (after the stream has finished its calls) and let waits spin again."""
        self._closing = True
        self.arm()
        self._worker.join()
        set_schedule(SCHEDULE_AUTO)
