"""The GPU backend's int8 activation bookkeeping (engine/q8_sets.py), without a GPU: NumPy views of one
workspace buffer stand in for the device arrays, a snapshot of an array's values stands in for the int8 groups
a kernel made of it, and NumPy's own memory-overlap test is the judge of which writes touch what."""

import ast
from pathlib import Path

import numpy as np
import pytest

from engine.q8_sets import Q8Sets, span


def span_of(a: np.ndarray):
    return span(a.ctypes.data, a.shape, a.strides, a.itemsize)


def overlap(a, b) -> bool:
    return a[0] < b[1] and b[0] < a[1]


def random_view(buf: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """A view of a (rows, cols) buffer: row and column ranges with steps of either sign, maybe transposed."""
    views = []
    for n in buf.shape:
        lo, hi = sorted(rng.integers(0, n + 1, 2))
        step = int(rng.integers(1, 4)) * (1 if rng.random() < 0.7 else -1)
        reverse = slice(hi - 1 if hi > 0 else None, lo - 1 if lo > 0 else None, step)
        views.append(slice(lo, hi, step) if step > 0 else reverse)
    view = buf[tuple(views)]
    return view.T if rng.random() < 0.3 else view


def test_a_span_covers_every_element_and_overlaps_whenever_memory_is_shared():
    rng = np.random.default_rng(0)
    buf = np.zeros((37, 64), np.float32)
    for _ in range(3000):
        a, b = random_view(buf, rng), random_view(buf, rng)
        lo, hi = span_of(a)
        if a.size:
            addresses = a.ctypes.data + (np.indices(a.shape).reshape(a.ndim, -1).T * a.strides).sum(axis=1)
            assert lo <= addresses.min() and addresses.max() + a.itemsize <= hi
        if np.shares_memory(a, b):
            assert overlap(span_of(a), span_of(b))


class Workspace:
    """A decode step's arrays as views of one buffer, the int8 sets as snapshots of the values quantized, and
    the count of quantize launches the backend would make."""

    def __init__(self, d: int = 64):
        self.buf = np.zeros(8 * d, np.float32)
        self.x, self.h, self.attn, self.delta = (self.buf[i * d : (i + 1) * d].reshape(1, d) for i in range(4))
        self.qkv = self.buf[4 * d : 7 * d].reshape(1, 3 * d)
        self.ffn = self.buf[7 * d :].reshape(1, d)
        self.sets = Q8Sets()
        self.groups: list[np.ndarray | None] = [None, None]
        self.quantized = 0
        self.rng = np.random.default_rng(1)

    def write(self, *arrays: np.ndarray) -> None:
        """What the backend's _op does before an op, then the op's writes."""
        self.sets.written([span_of(a) for a in arrays])
        for a in arrays:
            a[...] = self.rng.standard_normal(a.shape)

    def read(self, x: np.ndarray) -> int:
        index, fresh = self.sets.read(span_of(x))
        if fresh:
            assert np.array_equal(self.groups[index], x), "stale int8 groups were reused"
        else:
            self.quantized += 1
            self.groups[index] = x.copy()
        return index

    def produce(self, out: np.ndarray, reading: int | None = None) -> None:
        """A kernel that writes out and its groups (a fused op also reads the set `reading`)."""
        self.write(out)
        index = self.sets.produce(span_of(out))
        assert index != reading, "a kernel would overwrite the int8 groups it reads"
        self.groups[index] = out.copy()

    def layer(self, first: bool) -> None:
        """One llama layer of a decode step, as engine/arch/llama.py calls the backend."""
        if first:
            self.produce(self.h)  # rms_norm
        else:
            self.write(self.x)  # add_rms_norm's residual
            self.produce(self.h)
        self.read(self.h)
        self.write(self.qkv)  # linear
        self.produce(self.attn)  # rope_attention
        self.read(self.attn)
        self.write(self.delta)
        self.write(self.x)
        self.produce(self.h)  # add_rms_norm
        self.produce(self.ffn, reading=self.read(self.h))  # gated_ffn, fused
        self.read(self.ffn)
        self.write(self.delta)


def test_a_decode_step_reuses_every_group_its_kernels_made():
    ws = Workspace()
    ws.write(ws.x)  # embed
    for i in range(4):
        ws.layer(first=i == 0)
    ws.write(ws.x)
    ws.produce(ws.h)
    ws.read(ws.h[0:1])  # the output head reads the last row
    assert ws.quantized == 0


def test_a_write_to_a_quantized_array_forces_quantizing_it_again():
    ws = Workspace()
    ws.produce(ws.h)
    ws.write(ws.buf[ws.h.size - 1 : ws.h.size + 3])  # a view that shares one value with h
    ws.read(ws.h)
    assert ws.quantized == 1


def test_groups_made_for_one_read_serve_the_next_reads_and_two_arrays_stay_held():
    ws = Workspace()
    ws.write(ws.h, ws.attn)
    for x in (ws.h, ws.h, ws.attn, ws.h, ws.attn):
        ws.read(x)
    assert ws.quantized == 2


def test_forget_drops_everything():
    ws = Workspace()
    ws.produce(ws.h)
    ws.sets.forget()
    ws.read(ws.h)
    assert ws.quantized == 1


def test_random_ops_never_reuse_stale_groups():
    ws = Workspace()
    views = [ws.x, ws.h, ws.attn, ws.delta, ws.qkv[:, :64], ws.qkv[:, 64:128], ws.ffn]
    rng = np.random.default_rng(2)
    for _ in range(5000):
        a = views[rng.integers(len(views))]
        op = rng.integers(4)
        if op == 0:
            ws.read(a)
        elif op == 1:
            ws.produce(a)
        elif op == 2:
            ws.produce(a, reading=ws.read(views[rng.integers(len(views))]))
        else:
            ws.write(random_view(ws.buf.reshape(8, -1), rng))
    assert 0 < ws.quantized < 5000


BACKEND = Path(__file__).resolve().parent.parent / "engine" / "backend_cupy.py"


def test_every_backend_op_declares_what_it_writes():
    """Each public method of CupyBackend that takes arguments goes through _op (which forgets the groups of what
    it writes), except compile_step, which only wraps ops."""
    tree = ast.parse(BACKEND.read_text())
    backend = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "CupyBackend")
    methods = [f for f in backend.body if isinstance(f, ast.FunctionDef) and not f.name.startswith("_")]
    unchecked = [f.name for f in methods if len(f.args.args) > 1 and f.name != "compile_step"
                 and not any(isinstance(d, ast.Call) and getattr(d.func, "id", "") == "_op" for d in f.decorator_list)]
    assert len(methods) > 10 and not unchecked, f"not _op: {unchecked}"
    assert "_q8_of" not in BACKEND.read_text(), "no op resets the int8 bookkeeping by hand"


@pytest.mark.parametrize("shape,strides,expect", [((0, 4), (16, 4), (100, 100)), ((2, 3), (-12, 4), (88, 112))])
def test_span_of_empty_and_reversed_arrays(shape, strides, expect):
    assert span(100, shape, strides, 4) == expect
