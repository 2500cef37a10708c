"""The hot-expert cache (the GPU backend's side of issue 18 item 4): for each layer whose routed experts live in RAM,
a few slots of GPU memory hold the experts that layer picks most, so a decode step computes those on the GPU while
the CPU computes the rest.

What is kept: per layer in RAM, `slots` experts' gate, up and down matrices in the GPU layout (gpu_layout.py: the
planes of a (slots, rows, k) stack, which the decode products read as any stacked experts), the map expert -> slot
(-1: in RAM only) on the device, and each expert's picks, counted by the decode step's own kernel
(sampling.cu moe_cache_ids) together with the picks the cache held.

`refresh` runs on the main thread between decode steps and never waits for the GPU. Every REFRESH_STEPS steps it
moves one batch of swaps a stage on: it folds in the counts a copy it started before brought back and plans the
swaps toward each layer's best-scoring experts (engine/hot_experts.py, which says how); a worker thread reads the
new experts from the file and repacks them into page-locked staging; the next refresh drops the displaced experts
from the map (steps queued before still read them, steps after have the CPU compute them) and has a copy stream,
once the stream has passed that map, upload the new ones into their slots; a later refresh maps them once the copy
is done, and plans again.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import cupy
import cupyx
import numpy as np

from engine import quants
from engine.backend import ExpertCacheStats
from engine.cpu.weights import CpuWeight
from engine.gguf_file import GGUFTensor
from engine.hot_experts import ExpertScores, Swap, plan_swaps
from engine.kernels import cuda as K
from engine.kernels.gpu_layout import PLANE_ORDER, PLANES, PlanarLayout, planar_layout, to_planar

REFRESH_STEPS = 8  # decode steps between refreshes


@dataclass
class CachedLayer:
    """One layer's cache: its row of the map and counts, and the slots' weights (None where it has no slots)."""

    row: int
    slot_of: cupy.ndarray  # (experts,) int32
    uses: cupy.ndarray  # (experts + 1,) uint32
    weights: tuple[K.GpuWeight, K.GpuWeight, K.GpuWeight] | None
    stacks: tuple[PlanarLayout, ...]  # where each slot stack's planes lie in its buffer
    sources: tuple[GGUFTensor, GGUFTensor, GGUFTensor]  # the file's gate, up and down stacks, read per expert

    @property
    def expert_nbytes(self) -> int:
        """Bytes of one expert's three matrices in the GPU layout (planes padded as to_planar pads them)."""
        return sum(planar_layout(t.qtype, t.nbytes // self.slot_of.size // quants.block_layout(t.qtype)[1]).nbytes
                   for t in self.sources)

    def planar(self, which: int, expert: int) -> tuple[np.ndarray, PlanarLayout]:
        """Expert `expert`'s matrix `which` (gate, up, down) from the file, in the GPU layout."""
        tensor = self.sources[which]
        per = tensor.nbytes // self.slot_of.size
        return to_planar(tensor.read(expert * per, per), tensor.qtype)


class ExpertCache:
    """The cache of `slots` experts for each layer whose experts live in RAM; the layers join in the order the model
    loads them (`add`)."""

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self._layers: dict[int, CachedLayer] = {}  # id of the layer's gate CpuWeight -> its cache
        self._rows: list[CachedLayer] = []
        self._slot_of = np.zeros((0, 0), np.int64)  # (layers, experts): the map as last uploaded
        self.scores = ExpertScores()
        self._copy = cupy.cuda.Stream(non_blocking=True)
        self._events = {name: cupy.cuda.Event(disable_timing=True) for name in ("map", "loaded", "uses")}
        self._pinned: dict[str, np.ndarray] = {}
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="strata-expert-cache")
        self._repacking: Future | None = None  # a batch of swaps being read and repacked on the worker
        self._loading: list[Swap] | None = None  # a batch being copied to its slots
        self._uses_copied = False  # a copy of the counts has been started
        self._steps = 0
        self.swaps = 0

    @property
    def nbytes(self) -> int:
        return sum(sum(w.nbytes for w in c.weights) for c in self._layers.values() if c.weights is not None)

    def add(self, held: tuple[CpuWeight, CpuWeight, CpuWeight], sources: tuple[GGUFTensor, ...]) -> None:
        """Register a layer's experts, kept in RAM as `held` (gate, up, down) and read from the file's `sources`
        for the slots; allocates the layer's slots."""
        gate, up, down = held
        experts = gate.shape[0]
        weights, stacks = None, ()
        if self.slots and all(w.qtype in PLANES for w in (gate, up, down)) and gate.qtype == up.qtype:
            stacks = tuple(planar_layout(w.qtype, self.slots * _blocks_per_expert(w)) for w in (gate, up, down))
            weights = tuple(_slot_stack(w, self.slots, layout) for w, layout in zip((gate, up, down), stacks))
        cached = CachedLayer(len(self._rows), cupy.full(experts, -1, cupy.int32), cupy.zeros(experts + 1, cupy.uint32),
                             weights, stacks, sources)
        self._layers[id(gate)] = cached
        self._rows.append(cached)
        self._slot_of = np.concatenate([self._slot_of.reshape(-1, experts), np.full((1, experts), -1, np.int64)])
        self.scores.add_layer(experts)
        self._pinned.clear()  # sized by the layers

    def stats(self) -> ExpertCacheStats:
        return ExpertCacheStats(
            slots_per_layer=self.slots, layers=sum(c.weights is not None for c in self._rows), device_bytes=self.nbytes,
            experts_cached=self.cached_experts(), picks=self.scores.picks, hits=self.scores.hits,
            recent_hit_rate=self.scores.recent_hit_rate, swaps=self.swaps)

    def layer(self, gate: CpuWeight) -> CachedLayer:
        return self._layers[id(gate)]

    def cached_experts(self) -> int:
        return int((self._slot_of >= 0).sum())

    # ---- refresh, on the main thread between decode steps ----

    def refresh(self, stream: cupy.cuda.Stream) -> None:
        """Every REFRESH_STEPS calls: move the batch of swaps in flight on a stage (repacked -> copying -> mapped),
        and once none is, fold in the latest counts and start the next batch."""
        self._steps += 1
        if self._steps % REFRESH_STEPS or not self._rows:
            return
        if self._repacking is not None:
            if self._repacking.done():
                self._copy_in(*self._repacking.result(), stream)  # raises what the repacking raised
                self._repacking = None
            return
        if self._loading is not None:
            if not self._events["loaded"].done:
                return
            final = self._slot_of.copy()
            for s in self._loading:
                final[s.layer, s.new] = s.slot
            stream.wait_event(self._events["loaded"])
            self._upload_map(final, stream)
            self._loading = None
        if self._read_uses(stream):
            movable = np.array([c.weights is not None for c in self._rows])
            score = np.where(movable[:, None], self.scores.score, 0.0)  # a layer without slots has no newcomers
            swaps = plan_swaps(score, self._slot_of, self.slots)
            if swaps:
                staging = self._pinned_bytes(sum(self._rows[s.layer].expert_nbytes for s in swaps))
                self._repacking = self._worker.submit(self._repack, swaps, staging)

    def _read_uses(self, stream: cupy.cuda.Stream) -> bool:
        """Fold in the counts the previous copy brought back (False while none has) and start the next copy."""
        pinned = self._pinned_array("uses", np.zeros((len(self._rows), self._slot_of.shape[1] + 1), np.uint32))
        event = self._events["uses"]
        ready = self._uses_copied and event.done
        if ready:
            self.scores.fold(pinned)
        if ready or not self._uses_copied:
            for c, row in zip(self._rows, pinned):
                cupy.cuda.runtime.memcpyAsync(row.ctypes.data, c.uses.data.ptr, row.nbytes,
                                              cupy.cuda.runtime.memcpyDeviceToHost, stream.ptr)
            event.record(stream)
            self._uses_copied = True
        return ready

    def _repack(self, swaps: list[Swap], staging: np.ndarray) -> tuple[list[Swap], list[tuple]]:
        """On the worker thread: each new expert's three matrices read from the file into `staging` in the GPU
        layout; returns where each lies (layer cache, slot, matrix, offset in staging, layout)."""
        placed, at = [], 0
        for s in swaps:
            cached = self._rows[s.layer]
            for which in range(3):
                buf, layout = cached.planar(which, s.new)
                staging[at : at + buf.nbytes] = buf
                placed.append((cached, s.slot, which, at, layout))
                at += buf.nbytes
        return swaps, placed

    def _copy_in(self, swaps: list[Swap], placed: list[tuple], stream: cupy.cuda.Stream) -> None:
        """Drop the displaced experts from the map, then copy the repacked ones into their slots on the copy stream
        once the steps before that map are done."""
        dropped = self._slot_of.copy()
        for s in swaps:
            if s.old >= 0:
                dropped[s.layer, s.old] = -1
        self._upload_map(dropped, stream)
        self._copy.wait_event(self._events["map"])
        staging = self._pinned["staging"]
        for cached, slot, which, at, layout in placed:
            data, stack = cached.weights[which].data, cached.stacks[which]
            for plane, (offset, nbytes) in layout.offsets.items():  # an expert's plane is a slot's share of the stack's
                cupy.cuda.runtime.memcpyAsync(data.data.ptr + stack.offsets[plane][0] + slot * nbytes,
                                              staging.ctypes.data + at + offset, nbytes,
                                              cupy.cuda.runtime.memcpyHostToDevice, self._copy.ptr)
        self._events["loaded"].record(self._copy)
        self._loading = swaps
        self.swaps += len(swaps)

    def _upload_map(self, slot_of: np.ndarray, stream: cupy.cuda.Stream) -> None:
        pinned = self._pinned_array("map", slot_of.astype(np.int32))
        self._events["map"].synchronize()  # its previous copy has read the buffer
        pinned[...] = slot_of
        for c, row in zip(self._rows, pinned):
            cupy.cuda.runtime.memcpyAsync(c.slot_of.data.ptr, row.ctypes.data, row.nbytes,
                                          cupy.cuda.runtime.memcpyHostToDevice, stream.ptr)
        self._events["map"].record(stream)
        self._slot_of = slot_of

    def _pinned_array(self, name: str, like: np.ndarray) -> np.ndarray:
        if name not in self._pinned:
            self._pinned[name] = cupyx.zeros_pinned(like.shape, like.dtype)
        return self._pinned[name]

    def _pinned_bytes(self, nbytes: int) -> np.ndarray:
        """The staging buffer, free here: a batch starts only once the last one's copies are done."""
        held = self._pinned.get("staging")
        if held is None or held.nbytes < nbytes:
            held = self._pinned["staging"] = cupyx.empty_pinned(nbytes, np.uint8)
        return held

    def close(self) -> None:
        """Finish the work in flight and let go of the slots and buffers."""
        self._worker.shutdown(wait=True)
        self._copy.synchronize()
        self._layers.clear()
        self._rows.clear()
        self._pinned.clear()


def _blocks_per_expert(w: CpuWeight) -> int:
    _, rows, k = w.shape
    return rows * k // quants.block_layout(w.qtype)[0]


def _slot_stack(w: CpuWeight, slots: int, layout: PlanarLayout) -> K.GpuWeight:
    """A zeroed (slots, rows, k) stack of w's type in the GPU layout."""
    data = cupy.zeros(layout.nbytes, cupy.uint8)
    views = {p: data[o : o + n] for p, (o, n) in layout.offsets.items()}
    planes = tuple(views.get(p, views["q"]) for p in PLANE_ORDER)
    return K.GpuWeight(f"{w.name} (cache)", (slots, w.shape[1], w.shape[2]), w.qtype, data, planes)
