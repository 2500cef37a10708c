"""Experts kept in RAM, streamed to the GPU for a prompt chunk (the GPU backend's side of issue 18 item 5).

A chunk of many tokens uses nearly every expert of a layer, and the GPU computes them far faster than the CPU, so
such a chunk copies the layer's expert planes (the CPU kernels' layout, engine/cpu/layout.py, kept page-locked so
the copy runs at the bus's speed and asynchronously) into one device staging buffer, where matmul.cu's grouped
products read that layout. The copies run on their own stream, each as soon as the kernels reading the buffer's
previous layer are done, so they overlap the compute stream's other work (attention, the experts on the GPU); the
buffer holds one layer, which the fit counts in GPU memory (fit.py).

A decode step's GPU reads a few of a token's experts in place instead (`over_bus`), over the bus, while the CPU
computes the others from the same memory: the two paths' bandwidths add.
"""

from __future__ import annotations

from typing import Sequence

import cupy
import cupyx
import numpy as np

from engine.cpu import layout
from engine.cpu.weights import CpuWeight
from engine.kernels.cuda import CpuLayoutWeight
from engine.kernels.kernel_names import HOST_LAYOUTS

ALIGN = 256  # each plane's start inside the pinned buffer and the staging buffer


def _padded(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def span(planes: layout.Planes) -> int:
    """Bytes of the pinned buffer `pin` puts these planes in (and of their copy on the device)."""
    return sum(_padded(a.nbytes) for a in planes.arrays())


def pin(planes: layout.Planes) -> layout.Planes:
    """The same planes in one page-locked buffer, one after another at ALIGN boundaries, in Planes.arrays()'s
    order (an empty one takes no room)."""
    buffer = cupyx.empty_pinned(span(planes), np.uint8)
    views, at = [], 0
    for a in planes.arrays():
        view = buffer[at : at + a.nbytes].view(a.dtype).reshape(a.shape)
        view[...] = a
        views.append(view)
        at += _padded(a.nbytes)
    return layout.Planes(planes.family, planes.k, *views)


def suffix(planes: layout.Planes) -> str:
    """The grouped kernels' name for this layout (kernel_names.HOST_LAYOUTS)."""
    fifth_bits = planes.family in ("nibble", "nibble_k") and planes.hi.shape[1] > 0
    return "cpu_" + (planes.family.replace("nibble", "nibble5") if fifth_bits else planes.family)


def streamable(weights: Sequence[CpuWeight]) -> bool:
    """Whether the grouped kernels read these experts: packed planes of layouts they have, gate and up of one."""
    if any(w.planes is None or suffix(w.planes) not in HOST_LAYOUTS for w in weights):
        return False
    gate, up = weights[0], weights[1]
    return suffix(gate.planes) == suffix(up.planes)


def over_bus(w: CpuWeight) -> CpuLayoutWeight:
    """w's planes where `pin` put them, in page-locked RAM, which a GPU kernel reads over the bus."""
    return _at(w, [a.ctypes.data for a in w.planes.arrays()])


def _at(w: CpuWeight, addresses: Sequence[int]) -> CpuLayoutWeight:
    """w as the GPU kernels read it, its lo, hi, d, m and sup planes at these addresses."""
    lo, hi, d, m, sup = (np.uintp(a) for a in addresses)
    # The kernels' s plane: the offsets of "nibble", the super-block scales of the K-quant families.
    s = sup if w.planes.sup.size else m
    return CpuLayoutWeight(w.shape, suffix(w.planes), (lo, hi, s, d))


class ExpertStream:
    """One device buffer for a layer's experts, filled on a copy stream; `take` before a layer's grouped products,
    `done` after them (with the next layer to prefetch, if any)."""

    def __init__(self, weights: Sequence[CpuWeight]) -> None:
        sizes = sorted((span(w.planes) for w in weights if w.planes is not None), reverse=True)
        self.buffer = cupy.empty(sum(sizes[:3]), cupy.uint8)  # a layer's gate, up and down at most
        self.copy = cupy.cuda.Stream(non_blocking=True)
        self.copied = cupy.cuda.Event(disable_timing=True)
        self.freed = cupy.cuda.Event(disable_timing=True)
        self.holds: dict[int, CpuLayoutWeight] = {}  # id of each weight in the buffer (or on its way) -> its copy

    @property
    def nbytes(self) -> int:
        return int(self.buffer.nbytes)

    def take(self, layer: Sequence[CpuWeight], stream: cupy.cuda.Stream) -> list[CpuLayoutWeight]:
        """The layer's experts on the device; `stream` waits for their copy."""
        if any(id(w) not in self.holds for w in layer):
            self._fill(layer)
        stream.wait_event(self.copied)
        return [self.holds[id(w)] for w in layer]

    def done(self, stream: cupy.cuda.Stream, following: Sequence[CpuWeight] | None) -> None:
        """The kernels reading the buffer are queued on `stream`; start copying `following` once they finish."""
        stream.record(self.freed)
        if following:
            self._fill(following)

    def _fill(self, layer: Sequence[CpuWeight]) -> None:
        self.copy.wait_event(self.freed)
        self.holds, at = {}, 0
        for w in layer:
            base = self.buffer.data.ptr + at
            cupy.cuda.runtime.memcpyAsync(base, w.planes.lo.ctypes.data, span(w.planes),
                                          cupy.cuda.runtime.memcpyHostToDevice, self.copy.ptr)
            offsets = np.cumsum([0] + [_padded(a.nbytes) for a in w.planes.arrays()])
            self.holds[id(w)] = _at(w, [base + int(o) for o in offsets[:5]])
            at += span(w.planes)
        self.copy.record(self.copied)
