"""Thin launchers of the CUDA kernels in engine/kernels/*.cu, built through CuPy's NVRTC once per process.

CuPy keeps the compiled binaries in its on-disk kernel cache (keyed by the full source), so a second process
loads them without compiling. Every launcher works on CuPy arrays and launches on the current CuPy stream; none
allocates memory, so a sequence of them can be captured into a CUDA graph. Importing this module needs CuPy.

Inside `programmatic_launches()` (a decode graph being captured, on a Hopper or newer GPU) kernels launch with
programmatic stream serialization through the driver's cuLaunchKernelEx: in the graph each kernel is scheduled
while its predecessor runs and waits in `grid_dependency_sync` (quant_blocks.cuh) instead of at launch.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
from dataclasses import dataclass
from typing import Any

import cupy
import numpy as np
from cupy_backends.cuda.libs import cublas
from gguf import GGMLQuantizationType as T

from engine.kernels import kernel_names as N
from engine.kernels import sources
from engine.kernels.gpu_layout import FLOAT_TYPES, KERNEL_SUFFIX, PLANE_ORDER, PLANES, planar_layout, to_planar

WARPS = 4  # warps per block of the matrix-vector and attention kernels
# Decode attention: grid.z blocks per head (on sm_90+ one cluster, attention.cu ATTN_CLUSTER), times 4 warps = 32
# splits of the key range.
ATTN_Z_SPLITS = 8
HEAD_DIMS = N.HEAD_DIMS
ACT_SILU, ACT_GELU_TANH = 0, 1

i32, i64, f32 = np.int32, np.int64, np.float32
LOG2_E = 1.4426950408889634  # attention works in base 2


@functools.cache
def module(name: str, sweep: bool = False) -> cupy.RawModule:
    """One module's kernels, loaded once (its globals are then the ones its kernels use). sweep: the copy that also
    holds the kernels only benchmark sweeps launch (kernel_names.SWEEP_OPTION)."""
    return cupy.RawModule(code=sources.source(name), options=sources.OPTIONS + ((N.SWEEP_OPTION,) if sweep else ()))


@functools.cache
def kernel(module_name: str, name: str) -> Any:
    return module(module_name, name in N.SWEEP_ONLY).get_function(name)


@functools.cache
def _capability() -> int:
    """The current GPU's compute capability as major * 10 + minor (90 for an H100 or H200)."""
    return int(cupy.cuda.Device().compute_capability)


# ---- launching ---------------------------------------------------------------------------------------------

class _LaunchAttribute(ctypes.Structure):  # CUlaunchAttribute: an id, then a 64-byte value union at offset 8
    _fields_ = [("id", ctypes.c_uint), ("pad", ctypes.c_uint), ("value", ctypes.c_int * 16)]


class _LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared_mem", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_LaunchAttribute)), ("n_attrs", ctypes.c_uint)]


_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CUlaunchAttributeID
_C_TYPES = {np.dtype(np.int32): ctypes.c_int32, np.dtype(np.int64): ctypes.c_int64,
            np.dtype(np.float32): ctypes.c_float, np.dtype(np.uintp): ctypes.c_uint64}
_programmatic = [False]


@functools.cache
def _libcuda() -> ctypes.CDLL | None:
    """The CUDA driver library under its Linux name, or None where it is not found."""
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None


@functools.cache
def _launch_ex() -> Any:
    """The driver's cuLaunchKernelEx when this GPU supports programmatic dependent launch (sm_90+) and the driver
    library has it (12.0 or newer), else None: kernels then launch the ordinary way."""
    fn = getattr(_libcuda(), "cuLaunchKernelEx", None)
    if _capability() < 90 or fn is None:
        return None
    fn.argtypes = [ctypes.POINTER(_LaunchConfig), ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return fn


@contextlib.contextmanager
def programmatic_launches():
    """Kernels launched within may overlap the tail of the kernel before them (see the module docstring)."""
    _programmatic[0] = _launch_ex() is not None
    try:
        yield
    finally:
        _programmatic[0] = False


def _c_value(arg: Any) -> Any:
    if isinstance(arg, cupy.ndarray):
        return ctypes.c_void_p(arg.data.ptr)
    return _C_TYPES[arg.dtype](arg)


def launch(module_name: str, name: str, grid: tuple[int, ...], block: tuple[int, ...], args: tuple[Any, ...],
           shared_mem: int = 0) -> None:
    """Launch one kernel on the current stream; args are CuPy arrays and NumPy scalars of the kernel's types."""
    fn = kernel(module_name, name)
    if not _programmatic[0]:
        fn(grid, block, args, shared_mem=shared_mem)
        return
    grid, block = (tuple(grid) + (1, 1))[:3], (tuple(block) + (1, 1))[:3]
    attr = _LaunchAttribute(_PROGRAMMATIC_STREAM_SERIALIZATION)
    attr.value[0] = 1
    config = _LaunchConfig(grid, block, shared_mem, cupy.cuda.get_current_stream().ptr, ctypes.pointer(attr), 1)
    values = [_c_value(a) for a in args]
    params = (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values])
    status = _launch_ex()(ctypes.byref(config), fn.kernel.ptr, params, None)
    if status != 0:
        raise RuntimeError(f"cuLaunchKernelEx of {name} failed with CUDA error {status}")


@dataclass
class GpuWeight:
    """A weight in device memory as the GGUF stores it: planar quantized blocks, or the float values."""

    name: str
    shape: tuple[int, ...]
    qtype: T
    data: Any  # cupy uint8 planar buffer (quantized) or typed array (float types)
    planes: tuple[Any, ...]  # the q, h, s, d plane views the kernels take (absent planes repeat q)

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)

    @property
    def quantized(self) -> bool:
        return self.qtype in PLANES

    @property
    def suffix(self) -> str:
        return KERNEL_SUFFIX[self.qtype]

    def args(self) -> tuple[Any, ...]:
        return self.planes if self.quantized else (self.data,)


def to_device(host: np.ndarray) -> Any:
    """A device copy of a host array, copied from where it lies. (cupy.asarray stages through CuPy's pool of
    page-locked buffers, which keeps every size it was asked for: loading a 30B-A3B model left 6.8 GB of them.)"""
    host = np.ascontiguousarray(host)
    data = cupy.empty(host.shape, host.dtype)
    data.set(host)
    return data


def upload_weight(name: str, qtype: T, shape: tuple[int, ...], raw: np.ndarray) -> GpuWeight:
    """Copy a tensor's GGUF bytes to the device (quantized blocks regrouped into planes, nothing expanded)."""
    if qtype in FLOAT_TYPES:
        data = to_device(np.asarray(raw).view(FLOAT_TYPES[qtype]).reshape(shape))
        return GpuWeight(name, tuple(shape), qtype, data, (data,))
    buf, layout = to_planar(raw, qtype)
    data = to_device(buf)
    views = {p: data[o : o + n] for p, (o, n) in layout.offsets.items()}
    planes = tuple(views.get(p, views["q"]) for p in PLANE_ORDER)
    return GpuWeight(name, tuple(shape), qtype, data, planes)


def _blocks(n: int, per_block: int) -> int:
    return (n + per_block - 1) // per_block


# ---- matrix-vector (decode) --------------------------------------------------------------------------

@dataclass
class Q8:
    """One activation row quantized to two-level int8 groups (see quantize_group in quant_blocks.cuh)."""

    xq: Any  # (k,) int8
    xq2: Any  # (k,) int8
    xds: Any  # (k / 32, 2) float32: d and s of each group

    @classmethod
    def empty(cls, k: int) -> "Q8":
        return cls(cupy.empty(k, cupy.int8), cupy.empty(k, cupy.int8), cupy.empty((k // 32, 2), cupy.float32))

    def args(self) -> tuple[Any, Any, Any]:
        return self.xq, self.xq2, self.xds


_NO_Q8 = (np.uintp(0), np.uintp(0), np.uintp(0))


def q8_args(q8: Q8 | None) -> tuple[Any, ...]:
    return q8.args() if q8 is not None else _NO_Q8


def quantize_q8(x: Any, q8: Q8) -> None:
    """x (n, k) float32 contiguous -> q8 holding its n * k / 32 groups."""
    groups = x.size // 32
    launch("matvec", "quantize_q8", (_blocks(groups, 8),), (256,), (x, *q8.args(), i32(groups)))


# Several loads and shifts a group (quant_blocks.cuh): their own kernel shapes (timed for Q5_K and Q6_K; Q3_K and
# IQ3_S, which decode from several planes too, take them untimed).
HEAVY_DECODE = (T.Q5_K, T.Q6_K, T.Q3_K, T.IQ3_S)


def streamable(k: int) -> bool:
    """Whether rows of k weights fit matvec_stream's block of k / 32 threads (whole warps, at most 1024)."""
    return k % 1024 == 0 and k <= 32 * 1024


def matvec_shape(m: int, k: int, qtype: T) -> str | tuple[int, int]:
    """matvec's kernel shape for an (m, k) product, from timings on an H200 (bench/gpu_kernels.py,
    bench/RESULTS.md). Large products of the types that decode a group from one 16-byte load (the 32-weight
    blocks, and Q4_K as laid out on the GPU) run streamed where their rows fit one block (8B QKV 6.44 to 5.46 us,
    FFN down 13.24 to 12.63, output head 81.1 to 78.3; smaller ones were slower streamed); otherwise (warps per
    row set, rows per set): two rows sharing the loads of x and two warps a row set except on very tall
    matrices. Q5_K and Q6_K decode more per group and do best with one row, split over two warps only for long
    rows."""
    if qtype in HEAVY_DECODE:
        return (2 if k >= 8192 else 1), 1
    if m * k >= 24 * 2**20 and streamable(k):
        return "stream"
    return (1 if m >= 65536 else 2), (2 if m >= 3072 else 1)


def glu_shape(m: int, k: int, qtype: T) -> str | tuple[int, int]:
    """matvec_glu's kernel shape when it quantizes its output, from timings on an H200 (bench/gpu_kernels.py
    matvec_shapes): the fused kernel on small products; on large ones (the 8B FFN) a plain kernel shape, whose
    short blocks finish more evenly, and then quantize_q8."""
    if m * k < 32 * 2**20:
        return "fused"
    return (1, 2) if qtype in HEAVY_DECODE else (2, 1)


@functools.cache
def _resident_blocks(module_name: str, name: str, threads: int, shared: int = 0) -> int | None:
    """How many blocks of a kernel (of `shared` dynamic shared bytes) the whole GPU holds at once (the driver's
    occupancy answer), or None where the driver library is not found."""
    if _libcuda() is None:
        return None
    per_sm = ctypes.c_int()
    status = _libcuda().cuOccupancyMaxActiveBlocksPerMultiprocessor(
        ctypes.byref(per_sm), ctypes.c_void_p(kernel(module_name, name).kernel.ptr), ctypes.c_int(threads),
        ctypes.c_size_t(shared))
    if status != 0:
        raise RuntimeError(f"the occupancy query for {name} failed with CUDA error {status}")
    return per_sm.value * cupy.cuda.Device().attributes["MultiProcessorCount"]


def _stream_grid(w: GpuWeight, m: int, k: int) -> tuple[str, int]:
    """The streamed kernel and its grid for an (m, k) product: as many blocks as the GPU holds, or fewer when
    the rows run out. For N.LEAN_STREAM_TYPES, of the plain kernel and its 32-register form (more blocks a
    multiprocessor where registers bound them, at the cost of a few spilled bytes) the one that goes round its
    rows fewer times: the last round's blocks finish alone (8B FFN down: 6 rounds of 396 blocks, or 4 of 528)."""
    row_sets = _blocks(m, sources.STREAM_ROWS)
    names = [N.stream(w.qtype, form) for form in N.stream_forms(w.qtype)]
    grids = [(name, min(row_sets, _resident_blocks("matvec", name, k // 32) or row_sets)) for name in names]
    return min(grids, key=lambda g: _blocks(row_sets, g[1]))  # the first, the plain form, on a tie


def matvec(w: GpuWeight, x: Any, q8: Q8 | None, out: Any, shape: str | tuple[int, int] | None = None) -> None:
    """out (m,) = w (m, k) . x (k,); quantized weights read q8 (quantize_q8 of x), float ones read x. shape:
    "stream" (matvec.cu matvec_stream: a persistent grid of as many blocks of k / 32 threads as the GPU holds,
    where streamable(k)), or (warps per row set, rows per set): the warps split the set's groups, the set's rows
    (1, or 2 with 1 or 2 warps) share their loads of x. matvec_shape picks it by default."""
    m, k = w.shape
    if not w.quantized:
        launch("matvec", N.typed("matvec", w.qtype), (_blocks(m, WARPS),), (32 * WARPS,),
               (w.data, x, out, i32(m), i32(k)))
        return
    shape = shape or matvec_shape(m, k, w.qtype)
    args = (*w.args(), *q8.args(), out, i32(m), i32(k))
    if shape == "stream":
        if not streamable(k):
            raise ValueError(f"a streamed product needs rows of a multiple of 1024 weights up to 32768, not {k}")
        name, grid = _stream_grid(w, m, k)
        launch("matvec", name, (grid,), (k // 32,), args)
        return
    wpr, rows = shape
    launch("matvec", N.shaped("matvec", w.qtype, shape), (_blocks(m * wpr, WARPS * rows),),
           (32 * WARPS,), args)


def pair_shapes(a: GpuWeight, b: GpuWeight) -> tuple[tuple[int, int], tuple[int, int]] | None:
    """The shapes matvec_pair runs a and b in (matvec_shape's for each), or None where no pair kernel serves them:
    their types are not a pair of N.PAIR_TYPES, their rows differ in length, or one of them runs streamed."""
    if (a.qtype, b.qtype) not in N.PAIR_TYPES or a.shape[1] != b.shape[1]:
        return None
    shapes = (matvec_shape(*a.shape, a.qtype), matvec_shape(*b.shape, b.qtype))
    return shapes if shapes in N.PAIR_SHAPES else None


def matvec_pair(a: GpuWeight, b: GpuWeight, shapes: tuple[tuple[int, int], tuple[int, int]], q8: Q8,
                out: Any) -> None:
    """out (ma + mb,) = a (ma, k) . x, then b (mb, k) . x, in one launch (q8: quantize_q8 of x), in the shapes
    pair_shapes gave them."""
    (ma, k), mb = a.shape, b.shape[0]
    blocks = sum(_blocks(m * wpr, WARPS * rows) for m, (wpr, rows) in zip((ma, mb), shapes))
    launch("matvec", N.pair((a.qtype, b.qtype), shapes), (blocks,), (32 * WARPS,),
           (*a.args(), *b.args(), *q8.args(), out, i32(ma), i32(mb), i32(k)))


def matvec_glu(gate: GpuWeight, up: GpuWeight, x: Any, q8: Q8 | None, out: Any, act: int, q8_out: Q8 | None = None,
               shape: str | tuple[int, int] | None = None) -> None:
    """out (f,) = act(gate . x) * (up . x), both matrices read in one pass; with q8_out (quantized weights,
    f a multiple of 32) the result is also quantized there for the next product. shape: "fused", one kernel
    that quantizes 32 outputs a block as it writes them, or matvec's (warps per row set, rows per set), with
    quantize_q8 after it; glu_shape picks by default."""
    m, k = gate.shape
    if not gate.quantized:
        launch("matvec", N.typed("matvec_glu", gate.qtype), (_blocks(m, WARPS),), (32 * WARPS,),
               (*gate.args(), *up.args(), x, out, i32(m), i32(k), i32(act)))
        return
    shape = shape or (glu_shape(m, k, gate.qtype) if q8_out is not None else (1, 1))
    if shape == "fused":
        launch("matvec", N.typed("matvec_glu_q8", gate.qtype), (m // 32,), (512,),
               (*gate.args(), *up.args(), *q8.args(), out, i32(k), i32(act), *q8_out.args()))
        return
    wpr, rows = shape
    launch("matvec", N.shaped("matvec_glu", gate.qtype, shape), (_blocks(m * wpr, WARPS * rows),),
           (32 * WARPS,), (*gate.args(), *up.args(), *q8.args(), out, i32(m), i32(k), i32(act)))
    if q8_out is not None:
        quantize_q8(out, q8_out)


def moe_gate_up(gate: GpuWeight | CpuLayoutWeight, up: GpuWeight | CpuLayoutWeight, x: Any, q8: Q8 | None, ids: Any,
                hidden: Any, act: int) -> None:
    """hidden (n * top_k, f) = act(gate_e . x[token]) * (up_e . x[token]) for each token's chosen experts e =
    ids (n, top_k); gate, up: stacked (n_experts, f, k) weights of one type or layout; quantized ones read q8 (x's)."""
    _, f, k = gate.shape
    slots = ids.size
    src = q8.args() if gate.quantized else (x,)
    launch("matvec", N.moe("moe_gate_up", gate.suffix), (_blocks(f, WARPS), slots), (32 * WARPS,),
           (*gate.args(), *up.args(), *src, ids, i32(ids.shape[1]), hidden, i32(f), i32(k), i32(act)))


def moe_down(down: GpuWeight | CpuLayoutWeight, hidden: Any, q8: Q8 | None, ids: Any, weights: Any, out: Any) -> None:
    """out (n, d) = sum_j weights[:, j] * down_e . hidden[token * top_k + j], e = ids[:, j]; down: stacked
    (n_experts, d, f); quantized ones read q8 (hidden's)."""
    _, d, f = down.shape
    n, top_k = ids.shape
    src = q8.args() if down.quantized else (hidden,)
    launch("matvec", N.moe("moe_down", down.suffix), (_blocks(d, WARPS), n), (32 * WARPS,),
           (*down.args(), *src, ids, weights, i32(top_k), out, i32(d), i32(f)))


def router_route(router: GpuWeight, x: Any, logits: Any, n_experts: int, top_k: int, normalize: bool, weights_out: Any,
                 ids_out: Any, done: Any) -> None:
    """One token's logits (1, m) = x (1, k) . router (m, k) (float weights, k a multiple of 8), then moe_route of
    their first n_experts, in one launch (sampling.cu router_route); done: counters(1)."""
    m, k = router.shape
    launch("sampling", N.typed("router_route", router.qtype), (_blocks(m, WARPS),), (32 * WARPS,),
           (router.data, x, logits, i32(m), i32(k), i32(n_experts), i32(top_k), i32(1 if normalize else 0),
            weights_out, ids_out, done), shared_mem=4 * (n_experts + top_k))


def moe_route(logits: Any, top_k: int, normalize: bool, weights_out: Any, ids_out: Any) -> None:
    """Softmax of each row of logits (n, n_experts; rows may be strided), its top_k experts into
    ids_out/weights_out (n, top_k); one warp a token."""
    n, n_experts = logits.shape
    launch("sampling", "moe_route", (_blocks(n, WARPS),), (32 * WARPS,),
           (logits, i64(logits.strides[0] // 4), i32(n), i32(n_experts), i32(top_k), i32(1 if normalize else 0),
            weights_out, ids_out),
           shared_mem=4 * WARPS * n_experts)


# ---- dequantize, prompt-path products, embedding -------------------------------------------------------

def dequant(w: GpuWeight, out: Any, rows: Any = None, scale: float = 1.0, row_lo: int = 0) -> None:
    """out (n, k) fp16 or float32 = rows of w (rows[i], or row_lo + i) times scale."""
    n, k = out.shape
    half = out.dtype == cupy.float16
    per_thread = 32 if w.quantized else 8
    args = w.args()
    if row_lo:
        args = _row_slice(w, row_lo, row_lo + n)
    rows_arg = rows if rows is not None else np.uintp(0)
    launch("dequant", N.dequant(w.qtype, half), (_blocks(n * k // per_thread, 256),), (256,), (*args, rows_arg, out, i32(n), i32(k), f32(scale)))


def _row_slice(w: GpuWeight, lo: int, hi: int) -> tuple[Any, ...]:
    """Plane views of rows [lo, hi) of w, for dequantizing a large matrix a slice at a time."""
    m, k = w.shape
    if not w.quantized:
        return (w.data[lo:hi],)
    elements = 32 if w.qtype in (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0) else 256
    bpr = k // elements
    layout = planar_layout(w.qtype, m * bpr)
    views = {}
    for p, (o, _) in layout.offsets.items():
        lo_b, hi_b = PLANES[w.qtype][p]
        size = hi_b - lo_b
        views[p] = w.data[o + lo * bpr * size : o + hi * bpr * size]
    return tuple(views.get(p, views["q"]) for p in PLANE_ORDER)


MM_TOKENS, MM_ROWS = 64, 64  # matmul.cu's block tile
# Larger products go to dequantize + cuBLAS. At 512 tokens on an H200 (bench/gpu_kernels.py prompt, launched as the
# prompt path launches) our kernel took 23-45 us on the 135M model's products (up to 0.9M weights) against 38-78 us,
# slower only on its Q4_K down product (44.8 against 39.2); at 4M weights it tied (Q4_0) or lost (Q4_K, 65 against 39).
TILES_MAX_WEIGHTS = 2 * 2**20


def tiled(x: Any, w: GpuWeight, out: Any) -> bool:
    """Whether the prompt-chunk product out = x . w^T runs as matmul.cu's one kernel on dequantized tiles: a
    quantized weight, a GPU with mma.sync (compute capability 8.0), a product small enough that launches, not
    arithmetic, bound it (on larger ones cuBLAS's kernels are faster than ours and the dequantization is cheap
    beside them), and the row alignment of its vector loads and stores."""
    m, k = w.shape
    return (w.quantized and m * k <= TILES_MAX_WEIGHTS and m % 2 == 0 and mma_capable()
            and x.strides[1] == 4 and x.strides[0] % 16 == 0 and x.data.ptr % 16 == 0
            and out.strides[1] == 4 and out.strides[0] % 8 == 0 and out.data.ptr % 8 == 0)


def mma_capable() -> bool:
    return _capability() >= 80


def matmul(w: GpuWeight, x: Any, out: Any) -> None:
    """out (n, m) float32 = x (n, k) float32 . w (m, k)^T on tensor cores, w dequantized tile by tile (see tiled)."""
    n, k = x.shape
    m = w.shape[0]
    launch("matmul", N.typed("matmul", w.qtype), (_blocks(m, MM_ROWS), _blocks(n, MM_TOKENS)), (128,),
           (*w.args(), x, i64(x.strides[0] // 4), out, i64(out.strides[0] // 4), i32(n), i32(m), i32(k)))


def matmul_glu(gate: GpuWeight, up: GpuWeight, x: Any, out: Any, act: int) -> None:
    """out (n, f) = act(x . gate^T) * (x . up^T), both products in one kernel (gate and up of one type)."""
    n, k = x.shape
    m = gate.shape[0]
    launch("matmul", N.typed("matmul_glu", gate.qtype), (_blocks(m, MM_ROWS // 2), _blocks(n, MM_TOKENS)), (128,),
           (*gate.args(), *up.args(), x, i64(x.strides[0] // 4), out, i64(out.strides[0] // 4), i32(n), i32(m),
            i32(k), i32(act)))


def grouped(gate: GpuWeight, up: GpuWeight, down: GpuWeight) -> bool:
    """Whether a mixture's prompt chunk runs as grouped products (moe_group, grouped_matmul_glu, grouped_matmul,
    moe_combine): quantized experts, gate and up of one type, a GPU with mma.sync, even row counts for the paired
    stores."""
    return (gate.quantized and down.quantized and gate.qtype == up.qtype and mma_capable()
            and gate.shape[1] % 2 == 0 and down.shape[1] % 2 == 0)


def grouped_tiles(n_slots: int, n_experts: int) -> int:
    """Rows of moe_group's tile table: enough for any routing (each used expert adds at most one partial tile)."""
    return n_slots // MM_TOKENS + min(n_experts, n_slots)


def moe_group(ids: Any, n_experts: int, order: Any, where: Any, tiles: Any) -> None:
    """Sort a chunk's slots (ids (n, top_k)) by expert: order[pos] = slot, where[slot] = pos, tiles (rows, 3)."""
    launch("matmul", "moe_group", (1,), (1024,), (ids, i32(ids.size), i32(n_experts), i32(tiles.shape[0]), order,
                                                   where, tiles), shared_mem=8 * n_experts)


@dataclass
class CpuLayoutWeight:
    """Stacked experts in the CPU kernels' layout where the GPU reads them (engine/expert_stream.py): copied to device
    memory for a prompt chunk's grouped products, or in page-locked RAM, read over the bus by a decode step's
    expert products. Those kernels read them as they read a GpuWeight."""

    shape: tuple[int, ...]
    suffix: str  # one of kernel_names.HOST_LAYOUTS
    planes: tuple[Any, Any, Any, Any]  # addresses (np.uintp) of the q, h, s, d planes
    quantized = True

    def args(self) -> tuple[Any, ...]:
        return self.planes


def grouped_matmul_glu(gate: GpuWeight | CpuLayoutWeight, up: GpuWeight | CpuLayoutWeight, x: Any, tiles: Any,
                       order: Any, top_k: int, out: Any, act: int) -> None:
    """out (n_slots, f) fp16, sorted slot pos = act(gate_e . x[token]) * (up_e . x[token]), slot order[pos] =
    token * top_k + j routed to expert e; x (n, k) fp16; gate, up stacked (n_experts, f, k)."""
    _, f, k = gate.shape
    launch("matmul", N.grouped("grouped_matmul_glu", gate.suffix), (_blocks(f, MM_ROWS // 2), tiles.shape[0]), (128,),
           (*gate.args(), *up.args(), x, out, tiles, order, i32(top_k), i32(f), i32(k), i32(act)))


def grouped_matmul(w: GpuWeight | CpuLayoutWeight, x: Any, tiles: Any, out: Any) -> None:
    """out (n_slots, m) float32 = w_e . x[pos] for each sorted row pos of expert e; x (n_slots, k) fp16; w stacked
    (n_experts, m, k)."""
    _, m, k = w.shape
    launch("matmul", N.grouped("grouped_matmul", w.suffix), (_blocks(m, MM_ROWS), tiles.shape[0]), (128,),
           (*w.args(), x, out, tiles, i32(m), i32(k)))


def moe_combine(y: Any, where: Any, weights: Any, out: Any) -> None:
    """out (n, d) = sum_j weights[:, j] * y[where[token * top_k + j]]."""
    n, d = out.shape
    launch("matmul", "moe_combine", (_blocks(n * d, 256),), (256,), (y, where, weights, i32(n), i32(weights.shape[1]),
                                                                     i32(d), out))


_ONE, _ZERO = np.array(1.0, np.float32), np.array(0.0, np.float32)


def gemm_f16(a: Any, w: Any, out: Any) -> None:
    """out (n, m) float32 = a (n, k) fp16 @ w (m, k).T fp16, fp32 accumulation on tensor cores (cuBLAS).
    out may be a column slice of a wider row-major array (its row stride is passed as ldc)."""
    n, k = a.shape
    m = w.shape[0]
    ldc = out.strides[0] // 4
    cublas.gemmEx(
        cupy.cuda.device.get_cublas_handle(), cublas.CUBLAS_OP_T, cublas.CUBLAS_OP_N, m, n, k,
        _ONE.ctypes.data, w.data.ptr, cupy.cuda.runtime.CUDA_R_16F, k,
        a.data.ptr, cupy.cuda.runtime.CUDA_R_16F, k,
        _ZERO.ctypes.data, out.data.ptr, cupy.cuda.runtime.CUDA_R_32F, ldc,
        cublas.CUBLAS_COMPUTE_32F, cublas.CUBLAS_GEMM_DEFAULT_TENSOR_OP,
    )


def to_f16(x: Any, out: Any) -> None:
    launch("dequant", "f32_to_f16", (_blocks(x.size, 256),), (256,), (x, out, i64(x.size)))


def glu(gate: Any, up: Any, out: Any, act: int) -> None:
    launch("dequant", "glu", (_blocks(out.size, 256),), (256,), (gate, up, out, i64(out.size), i32(act)))


# ---- norms, rotary, attention --------------------------------------------------------------------------

def _norm_threads(d: int) -> int:
    return min(1024, max(32, 1 << (d - 1).bit_length())) if d < 1024 else 1024


def rms_norm(x: Any, w: Any, eps: float, out: Any, q8: Q8 | None = None) -> None:
    """Over the last axis of x (..., d); x and out may be strided views with contiguous rows. With q8 (out
    contiguous, d a multiple of 32) out is also quantized there."""
    d = x.shape[-1]
    inner = x.shape[-2] if x.ndim == 3 else 1
    rows = x.size // d
    x_stride = x.strides[0] // 4
    o_stride = out.strides[0] // 4
    launch("norms", "rms_norm", (rows,), (_norm_threads(d),),
           (x, w, out, i32(d), f32(eps), i32(inner), i64(x_stride), i64(o_stride), *q8_args(q8)))


def gated_rms_norm(x: Any, gate: Any, w: Any, eps: float, out: Any) -> None:
    """out = rms_norm(x) * w * silu(gate) over the last axis; x, gate, out (n, heads, d) views whose heads are
    consecutive rows of d (token strides free)."""
    n, heads, d = x.shape
    for a in (x, gate, out):
        if a.strides[1:] != (4 * d, 4):
            raise ValueError("gated_rms_norm needs each token's heads as consecutive rows")
    launch("norms", "gated_rms_norm", (n * heads,), (_norm_threads(d),),
           (x, gate, w, out, i32(d), f32(eps), i32(heads), i64(x.strides[0] // 4), i64(gate.strides[0] // 4),
            i64(out.strides[0] // 4)))


ADD_NORM_MAX = 4 * 4 * 1024  # widest row add_rms_norm keeps in registers (NORM_CHUNKS in norms.cu)


def add_rms_norm(x: Any, residual: Any, w: Any, eps: float, out: Any, q8: Q8 | None = None) -> None:
    """residual += x; out = rms_norm(residual) * w over rows of d (a multiple of 32, at most ADD_NORM_MAX)."""
    n, d = x.shape
    threads = min(1024, 32 * _blocks(d // 4, 32))
    launch("norms", "add_rms_norm", (n,), (threads,), (x, residual, w, out, i32(d), f32(eps), *q8_args(q8)))


def _cache(k_cache, v_cache, scales) -> tuple[str, tuple]:
    """One layer's KV cache as the kernels take it: its form (a KV_CACHE_TYPES name) and the arguments: the rows
    (KV, max_tokens, hd), fp16 or int8, then a q8_0 cache's scales (KV, max_tokens, hd / 32) or null pointers.
    scales: (k_scale, v_scale) of a q8_0 cache, else None."""
    if scales is None:
        return "full", (k_cache, v_cache, np.uintp(0), np.uintp(0))
    return "q8_0", (k_cache, v_cache, *scales)


def rope_store_kv(q, k, v, cos, sin, neox: bool, k_cache, v_cache, start, scales=None) -> None:
    """q (n, H, hd), k, v (n, KV, hd) strided views; k_cache/v_cache one layer's (KV, max_tokens, hd) (_cache)."""
    n, n_heads, hd = q.shape
    n_kv = k.shape[1]
    rot = 2 * cos.shape[1]
    kv, cache = _cache(k_cache, v_cache, scales)
    launch("rope", N.rope_store(kv), (n, n_heads + n_kv), (hd,),
           (q, k, v, i64(q.strides[0] // 4), i64(k.strides[0] // 4), i64(v.strides[0] // 4), i32(n_heads), i32(n_kv),
            i32(hd), i32(rot), cos, sin, i32(1 if neox else 0), *cache, i32(k_cache.shape[1]), start))


def attention_splits(n: int) -> tuple[int, int]:
    """(grid z, warps per query) of the two-kernel form: one query spreads its keys over 32 warps, a chunk's
    queries use one each."""
    return (ATTN_Z_SPLITS, 4) if n == 1 else (1, 1)


def cluster_decode_attention() -> bool:
    """Whether decode attention merges its splits inside a thread-block cluster (attention_decode, sm_90+)."""
    return _capability() >= N.PER_HEAD_DIM["attention_decode"][1]


def _qk_norm_args(qk_norm: tuple[Any, Any, float] | None) -> tuple[Any, Any, Any]:
    if qk_norm is None:
        return np.uintp(0), np.uintp(0), f32(0.0)
    q_norm, k_norm, eps = qk_norm
    return q_norm, k_norm, f32(eps)


def attention_decode(q, k, v, cos, sin, neox: bool, k_cache, v_cache, start, out, scale: float, window: int,
                     q8: Q8 | None = None, scales=None, qk_norm: tuple[Any, Any, float] | None = None) -> None:
    """One token's rope_store_kv and attention in one kernel with no scratch: q (1, H, hd), k, v (1, KV, hd)
    strided views, as the QKV projection left them (neither is rotated in place); out (1, H*hd). Each head's
    ATTN_Z_SPLITS blocks are one cluster (attention.cu ATTN_CLUSTER), which merges their 32 splits, and with q8
    also quantizes the output for the output projection. qk_norm: (q weights (hd,), k weights (hd,), eps), the
    per-head RMS norms q and k take first, or None. Needs cluster_decode_attention()."""
    _, n_heads, hd = q.shape
    n_kv, max_tokens = k_cache.shape[0], k_cache.shape[1]
    kv, cache = _cache(k_cache, v_cache, scales)
    launch("attention", N.per_head_dim("attention_decode", hd, kv), (n_heads, 1, ATTN_Z_SPLITS), (128,),
           (q, k, v, cos, sin, i32(2 * cos.shape[1]), i32(1 if neox else 0), *cache, i32(max_tokens),
            i32(n_heads), i32(n_kv), start, i32(window), f32(scale * LOG2_E), out, *q8_args(q8),
            *_qk_norm_args(qk_norm)))


SPLIT_MIN_KEYS, MAX_SPLITS = 128, 64  # attention.cu: fewest keys a decode split takes, most splits a merge reads
SPLIT_BLOCKS_PER_SM = 2
SPLIT_CONTEXT = 8192  # before sm_90: caches from this many positions decode with a split form
# sm_90: decode steps from this position on take attention_decode_deep, by head size. Heads of 128: in the model's
# decode step (H100, session 25, bench/profile_decode.py) the cluster kernel took 20.6 us a layer at 1,024 keys
# (Qwen3-30B-A3B) and 31.7 at 2,048 (Qwen3-8B), the deep kernel 18.7 at 4,096 (30B) and 25.0 at 8,192 (8B), and it
# takes no longer at fewer keys. Heads of 64 and 256 keep 4,096, which session 7 chose from kernels alone on heads of
# 128 (cluster 14.4 us against deep 15.3 at 2,047 keys, 24.8 against 16.9 at 4,095; H200); not measured for them.
DEEP_DECODE_KEYS = {64: 4096, 128: 2048, 256: 4096}
DEEP_WARPS = 4  # attention.cu DEEP_WARPS
# Most splits of a KV head's keys for attention_decode_deep. When its last block merged every split alone, 4 KV heads
# at 4,095 keys took 19.39 us at the 33 splits of one wave, 17.61 at 24 (H100, s14call2_attention.jsonl); with the
# head's blocks merging together 13.35 us at 16, 13.34 at 24, 13.11 at 32 (H100, caches read from memory,
# bench/results/2026-12-06_s15call1_attention.jsonl).
DEEP_MAX_SPLITS = 24


def decode_splits(max_tokens: int, n_kv: int) -> int:
    """Splits of each KV head's keys for attention_decode_split: enough blocks for SPLIT_BLOCKS_PER_SM a
    multiprocessor at the deepest position the cache holds (fewer are active at shallower ones)."""
    sms = cupy.cuda.Device().attributes["MultiProcessorCount"]
    return max(1, min(MAX_SPLITS, _blocks(max_tokens, SPLIT_MIN_KEYS), _blocks(SPLIT_BLOCKS_PER_SM * sms, n_kv)))


def deep_decode_from(head_dim: int) -> float:
    """The decode position from which steps of a model with heads of `head_dim` take a graph of their own, with the
    deep form of decode attention (never before sm_90)."""
    return DEEP_DECODE_KEYS[head_dim] if cluster_decode_attention() else float("inf")


def decode_attention_form(n_heads: int, n_kv: int, max_tokens: int, deep: bool, kv: str = "full") -> str:
    """Which kernel a decode step's attention runs: "deep" (attention_decode_deep: tensor cores, GQA groups of at
    most 16) or "split" (attention_decode_split, without tensor cores, groups of at most 8) for a deep step on
    sm_90+ (deep_decode_from) or, before sm_90, for caches of at least SPLIT_CONTEXT positions; else "cluster"
    (attention_decode, sm_90+) or "partial" (attention's two-kernel form). A q8_0 cache (kv) takes the deep kernel
    at every depth where it runs: it converts whole tiles in shared memory, where the others convert each row they
    read (8B shape on an H100: 12.27 us against the cluster kernel's 17.13 at 511 keys, 9.98 against 9.54 at the
    first position; bench/results/2026-12-05_s9call3_kvq8_attention.jsonl)."""
    group = n_heads // n_kv
    split = "deep" if mma_capable() and group <= 16 else "split" if group <= 8 else None
    if kv == "q8_0" and split == "deep":
        return split
    if cluster_decode_attention():
        return split if deep and split else "cluster"
    return split if split and max_tokens >= SPLIT_CONTEXT else "partial"


def attention_decode_split(q, k, v, cos, sin, neox: bool, k_cache, v_cache, start, out, scale: float, window: int,
                           part, done, q8: Q8 | None = None, splits: int | None = None, scales=None) -> None:
    """attention_decode's work (one token's rotary embedding, cache write and attention) by blocks of a KV head
    and a split of its keys, each serving the head's whole GQA group (at most 8 query heads): part, float32
    scratch of H*splits*(hd+2); done = counters(KV). splits: decode_splits by default."""
    _, n_heads, hd = q.shape
    n_kv, max_tokens = k_cache.shape[0], k_cache.shape[1]
    g = 4 if n_heads // n_kv <= 4 else 8
    splits = splits or decode_splits(max_tokens, n_kv)
    kv, cache = _cache(k_cache, v_cache, scales)
    launch("attention", N.per_group("attention_decode_split", hd, g, kv), (splits, n_kv), (128,),
           (q, k, v, cos, sin, i32(2 * cos.shape[1]), i32(1 if neox else 0), *cache, i32(max_tokens),
            i32(n_heads), i32(n_kv), start, i32(window), f32(scale * LOG2_E), part, done, out, *q8_args(q8)))


@functools.cache
def _deep_kernel(hd: int, tiles: tuple[int, int], kv: str = "full", form: str | None = None) -> tuple[str, int, int]:
    """(name, dynamic shared bytes, blocks the GPU holds at once) of attention_decode_deep with these tiles (or its
    sweep copy of kernel_names.DEEP_FORMS); the kernel is allowed its shared memory (above the default 48 KB) here,
    once."""
    if form is not None and (hd, tiles, kv) != (128, N.DEEP_TILES[128], "full"):
        raise ValueError("the deep kernel's sweep forms are built for heads of 128, the default tiles and an fp16 "
                         "cache only")
    name = N.DEEP_FORMS[form] if form is not None else N.deep_decode(hd, tiles, kv)
    kt, stages = tiles
    tile = kt * (hd + 8) * 2  # keys or values as fp16 rows, padded
    if kv == "full":
        shared = DEEP_WARPS * stages * 2 * tile  # each warp's buffers of keys and values
    else:  # each warp's buffers of q8_0 keys and values (values, then scales), and the fp16 tiles they become
        shared = DEEP_WARPS * (stages * 2 * (kt * hd + kt * hd // 16 + 16) + 2 * tile)
    fn = kernel("attention", name)
    fn.max_dynamic_shared_size_bytes = shared
    wave = _resident_blocks("attention", name, 32 * DEEP_WARPS, shared)
    if wave is None:  # by shared memory alone, the kernel's limit
        attributes = cupy.cuda.Device().attributes
        per_block = shared + fn.attributes["shared_size_bytes"] + 1024  # the 1 KB the GPU reserves a block
        wave = max(1, attributes["MaxSharedMemoryPerMultiprocessor"] // per_block) * attributes["MultiProcessorCount"]
    return name, shared, wave


def deep_decode_wave(hd: int, tiles: tuple[int, int] | None = None, kv: str = "full") -> int:
    """Blocks of attention_decode_deep the GPU holds at once: a launch takes at most that many."""
    return _deep_kernel(hd, tiles or N.DEEP_TILES[hd], kv)[2]


def deep_decode_splits(max_tokens: int, n_kv: int, hd: int, tiles: tuple[int, int] | None = None,
                       kv: str = "full") -> int:
    """Splits of each KV head's keys for attention_decode_deep: at most one wave of the blocks the GPU holds at
    once (a block past it doubled the time: 65.8 us against 48.1 at 32K keys, 8B shape, H200) at the deepest
    position the cache holds and at most DEEP_MAX_SPLITS, each split at least a tile per warp (fewer are active at
    shallower positions)."""
    tiles = tiles or N.DEEP_TILES[hd]
    one_wave = deep_decode_wave(hd, tiles, kv) // n_kv
    return max(1, min(DEEP_MAX_SPLITS, _blocks(max_tokens, DEEP_WARPS * tiles[0]), one_wave))


def attention_decode_deep(q, k, v, cos, sin, neox: bool, k_cache, v_cache, start, out, scale: float, window: int,
                          part, done, q8: Q8 | None = None, splits: int | None = None,
                          tiles: tuple[int, int] | None = None, scales=None, form: str | None = None,
                          qk_norm: tuple[Any, Any, float] | None = None) -> None:
    """attention_decode_split's work on tensor cores with each warp's keys and values streamed through shared
    memory (sm_80+, GQA groups of at most 16): part, float32 scratch of H*splits*(hd+2); done = counters(2 KV).
    splits: deep_decode_splits by default, at most MAX_SPLITS and one wave of blocks (a KV head's blocks wait for
    each other before they merge); tiles: (keys a warp's tile, stages), kernel_names.DEEP_TILES' by default (others
    for bench sweeps); form: a sweep copy of kernel_names.DEEP_FORMS (bench); qk_norm: as
    attention_decode's."""
    _, n_heads, hd = q.shape
    n_kv, max_tokens = k_cache.shape[0], k_cache.shape[1]
    tiles = tiles or N.DEEP_TILES[hd]
    kv, cache = _cache(k_cache, v_cache, scales)
    name, shared, wave = _deep_kernel(hd, tiles, kv, form)
    splits = splits or deep_decode_splits(max_tokens, n_kv, hd, tiles, kv)
    if splits > MAX_SPLITS or splits * n_kv > wave:
        raise ValueError(f"attention_decode_deep takes at most {MAX_SPLITS} splits and one wave of blocks "
                         f"({wave} on this GPU), not {splits} splits of {n_kv} KV heads")
    launch("attention", name, (splits, n_kv), (32 * DEEP_WARPS,),
           (q, k, v, cos, sin, i32(2 * cos.shape[1]), i32(1 if neox else 0), *cache, i32(max_tokens),
            i32(n_heads), i32(n_kv), start, i32(window), f32(scale * LOG2_E), part, done, out, *q8_args(q8),
            *_qk_norm_args(qk_norm)),
           shared_mem=shared)


def counters(n: int) -> Any:
    """n completion counters for kernels whose last block to finish does a step more (it leaves its counter at
    zero again, so one zeroed buffer serves every launch)."""
    return cupy.zeros(n, cupy.uint32)


def attention(q, k_cache, v_cache, start, out, scale: float, window: int, part, q8: Q8 | None = None,
              done: Any = None, scales=None) -> None:
    """q (n, H, hd) strided view; out (n, H*hd); part: float32 scratch of n*H*splits*(hd+2) (attention_splits).
    One query (decode) needs done = counters(H): each head's last block merges its splits, and with q8 also
    quantizes the output there for the output projection. A chunk's splits are merged by a second kernel."""
    n, n_heads, hd = q.shape
    n_kv, max_tokens = k_cache.shape[0], k_cache.shape[1]
    z, wpq = attention_splits(n)
    decode = (done, out, *q8_args(q8)) if n == 1 else (np.uintp(0),) * 5
    kv, cache = _cache(k_cache, v_cache, scales)
    launch("attention", N.per_head_dim("attention_partial", hd, kv), (n_heads, _blocks(n, 4 // wpq), z), (128,),
           (q, i64(q.strides[0] // 4), *cache, i32(max_tokens), i32(n_heads), i32(n_kv), start,
            i32(n), i32(window), f32(scale * LOG2_E), i32(wpq), part, *decode))
    if n > 1:
        launch("attention", "attention_combine", (n, n_heads), (32 * _blocks(hd, 32),),
               (part, i32(n_heads), i32(hd), i32(z * wpq), out, i64(out.strides[0] // 4)))


FLASH_ROWS = 64  # (token, query head) rows of a flash-attention block (flash_attention.cu FA_ROWS)


def flash_attention_capable(n_heads: int, n_kv: int) -> bool:
    """Whether prompt chunks attend on tensor cores (flash_attention.cu): a GPU with mma.sync m16n8k16 and
    cp.async (compute capability 8.0; older ones keep attention()'s chunk path), and a GQA group that fits the
    rows of one block."""
    return mma_capable() and n_heads // n_kv <= FLASH_ROWS


def flash_attention(q, k_cache, v_cache, start, out, scale: float, window: int, scales=None) -> None:
    """A prompt chunk's attention in one kernel with no scratch: q (n, H, hd) strided view (rows 8-byte aligned),
    its keys and values already in the cache (rope_store_kv); out (n, H*hd), rows 8-byte aligned. One block per
    KV head and FLASH_ROWS // group tokens. Needs flash_attention_capable."""
    n, n_heads, hd = q.shape
    n_kv, max_tokens = k_cache.shape[0], k_cache.shape[1]
    tokens = FLASH_ROWS // (n_heads // n_kv)
    kv, cache = _cache(k_cache, v_cache, scales)
    launch("flash_attention", N.per_head_dim("flash_attention", hd, kv), (_blocks(n, tokens), n_kv), (128,),
           (q, i64(q.strides[0] // 4), *cache, i32(max_tokens), i32(n_heads), i32(n_kv), start, i32(n),
            i32(window), f32(scale * LOG2_E), out, i64(out.strides[0] // 4)))


# ---- sampling ------------------------------------------------------------------------------------------

def repeat_penalty(logits, out, ids, n_ids: int, penalty: float) -> None:
    vocab = logits.size
    launch("sampling", "repeat_penalty", (_blocks(vocab, 256),), (256,), (logits, out, ids, i32(n_ids), f32(penalty), i32(vocab)))


def _feed_args(feed: tuple[Any, int] | None) -> tuple[Any, Any]:
    """feed = (ids, position): the picker also writes [position, id] to ids[:2] (sampling.cu)."""
    return (feed[0], i32(feed[1])) if feed is not None else (np.uintp(0), i32(0))


ARGMAX_BLOCKS = 64


def argmax_scratch() -> Any:
    """What argmax needs between its blocks: zeroed once, left zeroed by every launch."""
    return cupy.zeros(2 * ARGMAX_BLOCKS + 1, cupy.uint32)


def argmax(v, out_id, scratch, feed: tuple[Any, int] | None = None) -> None:
    """out_id[0] = the argmax of v (lowest id on ties); out_id may be pinned host memory (written directly)."""
    launch("sampling", "argmax", (ARGMAX_BLOCKS,), (1024,), (v, i32(v.size), scratch, out_id, *_feed_args(feed)))


def topk(v, k: int, out_v, out_id) -> None:
    """The k best of v (consumed) into out_v/out_id, best first, ties to the lower id."""
    launch("sampling", "topk", (1,), (1024,), (v, i32(v.size), i32(k), out_v, out_id))


def sample_sorted(vals, ids, n: int, temperature: float, top_p: float, min_p: float, u: float, out_id,
                  feed: tuple[Any, int] | None = None) -> None:
    launch("sampling", "sample_sorted", (1,), (1024,),
           (vals, ids, i32(n), f32(1.0 / temperature), f32(top_p), f32(min_p), f32(u), out_id, *_feed_args(feed)))


# ---- hybrid models' recurrent layers (hybrid.cu) ------------------------------------------------------------

CONV_KERNEL = 4  # the convolution width hybrid.cu is built for (every qwen35 / qwen3next file's)
CONV_RUN = 16  # tokens a thread of causal_conv_silu_4 (hybrid.cu CONV_RUN)


def causal_conv_silu(x: Any, w: Any, state: Any, out: Any) -> None:
    """x, out (n, channels) with row strides, not overlapping; w (channels, CONV_KERNEL) float32; state
    (CONV_KERNEL - 1, channels)."""
    n, channels = x.shape
    launch("hybrid", "causal_conv_silu_4", (_blocks(channels, 128), _blocks(n, CONV_RUN)), (128,),
           (x, i64(x.strides[0] // 4), w, state, out, i64(out.strides[0] // 4), i32(n), i32(channels)))


def gated_delta_net(qkv: Any, ba: Any, dt_bias: Any, ssm_a: Any, state: Any, out: Any, n_k: int, tiled: bool) -> None:
    """See engine/backend.py gated_delta_net; state (H, dk, dv) float32, dk one of kernel_names.DELTA_KEY_DIMS."""
    n = qkv.shape[0]
    n_v, dk, dv = state.shape
    threads = 32 * _blocks(max(dk, dv), 32)
    launch("hybrid", N.delta_rule(dk), (n_v,), (threads,),
           (qkv, i64(qkv.strides[0] // 4), ba, i64(ba.strides[0] // 4), dt_bias, ssm_a, state, out,
            i64(out.strides[0] // 4), i32(n), i32(n_k), i32(n_v), i32(dv), i32(1 if tiled else 0)))


def delta_step(qkv: Any, z: Any, ba: Any, conv_w: Any, conv_state: Any, dt_bias: Any, ssm_a: Any, norm_w: Any,
               eps: float, state: Any, out: Any, n_k: int, tiled: bool, done: Any, q8: Q8 | None = None) -> None:
    """One token through causal_conv_silu, gated_delta_net and gated_rms_norm in one launch: qkv (conv_dim,), z
    (H dv,), ba (2 H,) the projection's parts; conv_w (conv_dim, CONV_KERNEL); conv_state (CONV_KERNEL - 1,
    conv_dim); state (H, dk, dv); out (H dv,) the normed output, with q8 (dv a multiple of 32) also its int8 groups;
    done = counters(n_k)."""
    n_v, dk, dv = state.shape
    launch("hybrid", N.delta_step(dk), (n_v,), (32 * _blocks(max(dk, dv), 32),),
           (qkv, z, ba, conv_w, conv_state, dt_bias, ssm_a, norm_w, f32(eps), state, out, i32(n_k), i32(n_v), i32(dv),
            i32(1 if tiled else 0), done, *q8_args(q8)))


DELTA_COLUMNS = 32  # state columns a block of delta_chunk_state (hybrid.cu DCOLS)
# Fewer tokens go token by token: on an H100 at the Qwen3.6-35B-A3B shape 16 tokens took 39.4 us that way against
# 67.7 chunked, 32 tokens 70.0 against 52.4 (bench/gpu_kernels.py delta).
DELTA_CHUNK_MIN_TOKENS = 32
_DELTA_PREP_THREADS = 256


def delta_chunked(n: int, dk: int, dv: int) -> bool:
    """Whether gated_delta_net_chunked takes n tokens of these heads on this GPU (else gated_delta_net does)."""
    return (n >= DELTA_CHUNK_MIN_TOKENS and dk in N.DELTA_CHUNK_KEY_DIMS and dv % DELTA_COLUMNS == 0
            and _capability() >= N.DELTA_CHUNK_OLDEST)


@functools.cache
def _delta_chunk_kernels(dk: int) -> tuple[str, int, str, int]:
    """The two kernels' names and dynamic shared memory (the layouts hybrid.cu describes above delta_chunk_prep and
    delta_chunk_state), allowed."""
    dc = N.DELTA_CHUNK
    lt, ld, lp, lv = dc + 4, dk + 8, dc + 8, DELTA_COLUMNS + 8
    prep_bytes = 4 * (2 * dk * lt + dc * (dc + 1) + 2 * dc)
    state_bytes = 2 * (3 * dc * ld + dc * lp + dc * lv + dk * lv)
    prep, state = N.delta_chunk("prep", dk), N.delta_chunk("state", dk)
    kernel("hybrid", prep).max_dynamic_shared_size_bytes = prep_bytes
    kernel("hybrid", state).max_dynamic_shared_size_bytes = state_bytes
    return prep, prep_bytes, state, state_bytes


def gated_delta_net_chunked(qkv: Any, ba: Any, dt_bias: Any, ssm_a: Any, state: Any, out: Any, n_k: int, tiled: bool,
                            scratch: tuple[Any, ...]) -> None:
    """gated_delta_net's result by chunks of N.DELTA_CHUNK tokens (delta_chunked says when); scratch: arrays of
    kernel_names.delta_chunk_scratch's shapes and types. out's rows must be an even number of floats apart (float2
    stores)."""
    n = qkv.shape[0]
    n_v, dk, dv = state.shape
    u, wqk, p, last = scratch
    prep, prep_bytes, state_kernel, state_bytes = _delta_chunk_kernels(dk)
    launch("hybrid", prep, (_blocks(n, N.DELTA_CHUNK), n_v), (_DELTA_PREP_THREADS,),
           (qkv, i64(qkv.strides[0] // 4), ba, i64(ba.strides[0] // 4), dt_bias, ssm_a, i32(n), i32(n_k), i32(n_v),
            i32(dv), i32(1 if tiled else 0), u, wqk, p, last), shared_mem=prep_bytes)
    launch("hybrid", state_kernel, (n_v, dv // DELTA_COLUMNS), (128,),
           (u, wqk, p, last, state, out, i64(out.strides[0] // 4), i32(n), i32(n_v), i32(dv)), shared_mem=state_bytes)


def sigmoid_gate(x: Any, gate: Any, out: Any, accumulate: bool) -> None:
    """out = x * sigmoid(gate) or out += that; x, out (n, m), gate (n, m) or (n, 1), each with its row stride."""
    n, m = x.shape
    launch("hybrid", "sigmoid_gate", (_blocks(n * m, 256),), (256,),
           (x, i64(x.strides[0] // 4), gate, i64(gate.strides[0] // 4), i32(gate.shape[1]), out,
            i64(out.strides[0] // 4), i32(n), i32(m), i32(1 if accumulate else 0)))


# ---- host calls (host_call.cu) -------------------------------------------------------------------------------

def host_call(state: np.ndarray, job: int) -> None:
    """Announce job `job` in `state` (page-locked, engine/kernels/host_calls.py) and hold the stream until the host
    answers. Launched plainly, never as a programmatic launch: nothing may start before the call is answered."""
    kernel("host_call", "host_call")((1,), (1,), (np.uintp(state.ctypes.data), i64(job)))


def host_call_post(state: np.ndarray, job: int) -> None:
    """Announce job `job` without waiting; the stream's next work runs beside the host's (host_call_wait ends it)."""
    kernel("host_call", "host_call_post")((1,), (1,), (np.uintp(state.ctypes.data), i64(job)))


def host_call_wait(state: np.ndarray) -> None:
    """Hold the stream until the host answers the call posted last (launched plainly, as host_call)."""
    kernel("host_call", "host_call_wait")((1,), (1,), (np.uintp(state.ctypes.data),))


def add_host_answer(out: Any, answer: np.ndarray, add: bool, extra: Any = None) -> None:
    """out (+)= answer (+ extra), answer a page-locked float32 array the size of out the GPU reads over the bus,
    extra (optional) another device array of that size."""
    launch("host_call", "add_host_answer", (_blocks(out.size, 256),), (256,),
           (out, np.uintp(answer.ctypes.data), np.uintp(0) if extra is None else extra, i32(out.size),
            i32(1 if add else 0)))


def moe_cache_ids(ids: Any, weights: Any, slot_of: Any, bus: int, slots: Any, bus_ids: Any, host_ids: np.ndarray,
                  host_weights: np.ndarray, uses: Any) -> None:
    """One token's picks ids/weights (1, top_k) split by the cache map slot_of (n_experts,): slots (top_k,) for the
    GPU's cache, the first misses in bus_ids (top_k,) for the GPU to read over the bus (`bus` of top_k misses, the
    same share of fewer), host_ids/host_weights (page-locked, top_k) for the CPU, uses (n_experts + 1,) counted;
    reference.moe_cache_ids is the rule."""
    top_k = ids.size
    if top_k > 32:
        raise ValueError(f"moe_cache_ids takes at most 32 picks a token, not {top_k}")
    launch("sampling", "moe_cache_ids", (1,), (32,),
           (ids, weights, slot_of, i32(top_k), i32(slot_of.size), i32(bus), slots, bus_ids,
            np.uintp(host_ids.ctypes.data), np.uintp(host_weights.ctypes.data), uses))
