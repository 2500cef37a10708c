"""The GPU backend: weights stay quantized in device memory as the GGUF stores them, every op is one of our
CUDA kernels (engine/kernels/*.cu, launched through engine/kernels/cuda.py), and a decode step is captured once
as a CUDA graph and replayed (`compile_step`).

Decode (one token) multiplies with int8 dot products on the quantized blocks. Prompt chunks multiply on tensor
cores: small products in one kernel of ours that dequantizes weight tiles into shared memory (matmul.cu), large
ones by dequantizing the weight to an fp16 scratch for cuBLAS. Everything runs on one non-blocking
stream of the backend's own, whichever thread calls it. engine/model.py imports this module only when it
looks for a GPU, so CPU machines never need CuPy.
"""

from __future__ import annotations

import functools
import gc
import inspect
from typing import Any, Callable

import cupy
import cupyx
import numpy as np

from engine import quants
from engine.backend import (Q8_0_GROUP, ROPE_NEOX, ROPE_NORMAL, ExpertCacheStats, KVCache, MemoryInUse, RopeTable,
                            SamplingParams, check_kv_cache_type, linear_each, norm_qk,
                            route_after_product)
from engine.capabilities import GPU_KV_DTYPE, HOST_EXPERT_THREADS, MIN_COMPUTE_CAPABILITY, dequant_slice_rows
from engine import expert_stream
from engine.expert_cache import ExpertCache
from engine.cpu import experts as cpu_experts
from engine.cpu.weights import CpuWeight
from engine.cpu.weights import load as load_host_weight
from engine.errors import EngineError
from engine.gguf_file import GGUFTensor
from engine.kernels import cuda as K
from engine.kernels.gpu_layout import FLOAT_TYPES, PLANES, supported
from engine.kernels.kernel_names import DELTA_CHUNK_SCRATCH_TYPES, delta_chunk_scratch
from engine.kernels.kernel_names import DELTA_KEY_DIMS as N_DELTA_KEY_DIMS
from engine.kernels.host_calls import HostCalls
from engine.q8_sets import Q8Sets, Span, span

TOPK_MAX = 1024  # top-k above this (or top_k = 0) sorts the whole vocabulary instead
NO_TOKENS = np.zeros(0, np.int32)
ID_SLOTS = 4  # sample_feed's pinned slots; two would do for one step queued ahead
ACTIVATIONS = {"silu": K.ACT_SILU, "gelu_tanh": K.ACT_GELU_TANH}
# From this many (token, expert) slots an expert on average, a mixture's chunk runs as grouped products (each
# expert's weights read once a tile of its tokens) instead of a product per slot: on an H200 (bench/gpu_kernels.py
# moe) the grouped form won from 64 tokens on with 128 experts (4 a expert) and from 128 with 256, lost below.
GROUPED_MIN_SLOTS_PER_EXPERT = 4
# From this many tokens on, a chunk copies the experts a layer keeps in RAM to the GPU and computes them there; below,
# the CPU computes them where they are.
STREAM_MIN_TOKENS = 32
# Of a decode token's experts in a layer kept in RAM, when the GPU caches none of them, how many the GPU reads over
# the bus (expert_stream.over_bus) while the CPU computes the others from the same memory; of fewer misses it reads
# the same share (sampling.cu moe_cache_ids). A synthetic Qwen3-30B-A3B with 21 layers' experts in RAM (8 a token,
# 16 host cores; bench/RESULTS.md): 3 took the decode step from 12.31 to 7.98 ms on the H200 machine (2: 8.87), from
# 9.31 to 7.36 ms on an H100 machine (4: 9.09).
EXPERTS_OVER_BUS = 3


def unavailable_reason() -> str | None:
    """None when CuPy can run our kernels here; otherwise why not, as a sentence fragment."""
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except cupy.cuda.runtime.CUDARuntimeError as exc:
        return f"the NVIDIA driver could not be reached ({exc})"
    if count == 0:
        return "no NVIDIA GPU was found"
    props = cupy.cuda.runtime.getDeviceProperties(0)
    capability = (int(props["major"]), int(props["minor"]))
    if capability < MIN_COMPUTE_CAPABILITY:
        name = props["name"].decode(errors="replace")
        return (
            f"the GPU {name} has compute capability {capability[0]}.{capability[1]}, older than the "
            f"{MIN_COMPUTE_CAPABILITY[0]}.{MIN_COMPUTE_CAPABILITY[1]} this engine's kernels need"
        )
    return None


def _span(a: Any) -> Span:
    return span(a.data.ptr, a.shape, a.strides, a.itemsize)


def _op(*writes: str) -> Callable[[Callable], Callable]:
    """A backend op that writes the arrays passed as the parameters named `writes`: int8 groups made from them
    are forgotten before it runs (Q8Sets), and it runs with the backend's stream as CuPy's current stream (in
    any calling thread). Every public method that queues work is one, so no write can leave stale groups."""

    def decorate(method: Callable) -> Callable:
        params = list(inspect.signature(method).parameters)[1:]
        unknown = set(writes) - set(params)
        if unknown:
            raise TypeError(f"{method.__name__} has no parameter {', '.join(sorted(unknown))}")
        where = [(params.index(name), name) for name in writes]

        @functools.wraps(method)
        def wrapper(self: CupyBackend, *args, **kwargs):
            arrays = [args[i] if i < len(args) else kwargs.get(name) for i, name in where]
            self._q8_holds.written([_span(a) for a in arrays if a is not None])
            with self.stream:
                return method(self, *args, **kwargs)

        return wrapper

    return decorate


class CupyBackend:
    """Implements engine.backend.Backend on an NVIDIA GPU."""

    name = "cupy"
    asynchronous = True

    def __init__(self) -> None:
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self._held: list[Any] = []
        self._max_k = 32
        # Decode-only buffers (reused by every replay of the captured graph, so never reallocated after it).
        # Two sets of int8 activations: an op can read one while it writes the quantized result into the other.
        self._q8: list[K.Q8] = []
        self._q8_holds = Q8Sets()
        self._decode_scratch: dict[str, Any] = {}
        # Prompt-path and sampling scratch, grown as needed outside graphs.
        self._scratch: dict[str, Any] = {}
        self._graphs: list[Any] = []
        self._deep_decode = False  # the graph being made is for deep positions (compile_step)
        self.deep_from = float("inf")  # decode positions from which steps take the deep graph (set with the KV cache)
        self._id_slots: tuple[np.ndarray, list[Any]] | None = None  # sample_feed's pinned ids and their events
        self._id_next = 0
        self._host_calls: HostCalls | None = None  # made when a layer's experts are placed in RAM
        self._host_weights: list[CpuWeight] = []
        self._host_sources: list[GGUFTensor] = []  # the file's tensors of _host_weights, for the expert cache
        self._expert_cache = ExpertCache(0)  # GPU slots for the hottest experts of each layer kept in RAM
        self._host_stage: dict[str, np.ndarray] = {}  # pinned: one token's expert input and output
        self._expert_stream: expert_stream.ExpertStream | None = None  # made with a chunk's first streamed layer
        self.experts_over_bus = EXPERTS_OVER_BUS  # read when a decode step's graph is made
        self._bus_weights: dict[int, tuple[K.CpuLayoutWeight, ...]] = {}  # id of a layer's gate -> its over_bus views
        self._closed = False

    # ---- memory ----

    def _hold(self, obj: Any) -> Any:
        self._held.append(obj)
        return obj

    def _buffer(self, key: str, size: int, dtype: Any) -> Any:
        buf = self._scratch.get(key)
        if buf is None or buf.size < size:
            buf = self._scratch[key] = cupy.empty(size, dtype)
        return buf[:size]

    @_op()
    def empty(self, shape: tuple[int, ...], dtype: Any = np.float32) -> Any:
        return self._hold(cupy.empty(shape, dtype))

    @_op("dst")
    def copy_into(self, dst: Any, src: np.ndarray) -> None:
        dst.set(np.ascontiguousarray(src, dtype=dst.dtype), stream=self.stream)

    @_op("dst")
    def assign(self, dst: Any, src: Any) -> None:
        dst[...] = src

    @_op()
    def to_host(self, x: Any) -> np.ndarray:
        # Wait first, without the GIL: a copy into pageable memory might wait for a host call while holding it.
        self.synchronize()
        return cupy.asnumpy(x, stream=self.stream, blocking=True)

    @_op()
    def upload(self, tensor: GGUFTensor, host: bool = False) -> K.GpuWeight | CpuWeight:
        shape = tuple(int(s) for s in tensor.shape)
        if host:
            return self._upload_host(tensor, shape)
        # Vectors, and float32 matrices of rows too short for the products (the DeltaNet convolution's taps), are
        # plain float32 values, read by the ops that take them.
        if len(shape) == 1 or (tensor.qtype == quants.T.F32 and shape[-1] % 32):
            values = quants.dequantize(tensor.raw, tensor.qtype, shape).astype(np.float32)
            return self._hold(K.GpuWeight(tensor.name, shape, quants.T.F32, K.to_device(values), ()))
        # 3-D tensors are the stacked experts of a mixture of experts: whole rows, so stored like a matrix.
        if not supported(tensor.qtype) or len(shape) not in (2, 3):
            raise EngineError(
                f"Tensor {tensor.name} is stored as {tensor.qtype.name} with shape {shape}, which the GPU backend "
                f"cannot use (it takes {', '.join(t.name for t in (*FLOAT_TYPES, *PLANES))} matrices). "
                "The CPU path runs it: use device='cpu', or pick a GGUF quantized with one of these types."
            )
        if shape[-1] % 32:
            raise EngineError(
                f"Tensor {tensor.name} has rows of {shape[-1]} values; the GPU backend needs a multiple of 32. "
                "Run this model on the CPU with device='cpu'."
            )
        self._max_k = max(self._max_k, shape[-1])  # sizes the int8 activations of one-token products
        return self._hold(K.upload_weight(tensor.name, tensor.qtype, shape, tensor.raw))

    @_op()
    def rope_table(self, inv_freq: np.ndarray, max_positions: int, attn_factor: float = 1.0) -> RopeTable:
        angles = np.outer(np.arange(max_positions, dtype=np.float64), inv_freq.astype(np.float64))
        cos = K.to_device((np.cos(angles) * attn_factor).astype(np.float32))
        sin = K.to_device((np.sin(angles) * attn_factor).astype(np.float32))
        return self._hold(RopeTable(cos, sin))

    @_op()
    def kv_cache(self, n_layers: int, n_kv_heads: int, head_dim: int, max_tokens: int, kind: str = "full") -> KVCache:
        if head_dim not in K.HEAD_DIMS:
            raise EngineError(
                f"This model's attention heads have {head_dim} dims; the GPU backend supports "
                f"{', '.join(map(str, K.HEAD_DIMS))}. Run it on the CPU with device='cpu'."
            )
        check_kv_cache_type(kind)
        self.deep_from = K.deep_decode_from(head_dim)
        if kind == "full":
            shape = (n_layers, n_kv_heads, max_tokens, head_dim)
            return self._hold(KVCache(cupy.zeros(shape, GPU_KV_DTYPE), cupy.zeros(shape, GPU_KV_DTYPE)))
        shape = (n_layers, n_kv_heads, max_tokens, head_dim)
        scales = shape[:3] + (head_dim // Q8_0_GROUP,)
        return self._hold(KVCache(cupy.zeros(shape, cupy.int8), cupy.zeros(shape, cupy.int8),
                                  cupy.zeros(scales, cupy.float16), cupy.zeros(scales, cupy.float16)))

    def _upload_host(self, tensor: GGUFTensor, shape: tuple[int, ...]) -> CpuWeight:
        """A mixture's stacked experts kept in RAM in the CPU kernels' layout (engine/cpu), for `moe_ffn`."""
        if len(shape) != 3:
            raise EngineError(f"Only a mixture's stacked expert tensors can stay in RAM, not {tensor.name} {shape}.")
        try:
            weight = load_host_weight(tensor.name, tensor.raw, tensor.qtype, shape)
        except (quants.UnsupportedTensorType, quants.TensorSizeError) as exc:
            raise EngineError(f"Tensor {tensor.name} cannot be kept in RAM for the CPU: {exc}.") from None
        if weight.planes is not None:
            weight.planes = expert_stream.pin(weight.planes)
        self._max_k = max(self._max_k, shape[-1])  # the products reading experts over the bus quantize x too
        if self._host_calls is None:
            self._host_calls = HostCalls()
        self._host_weights.append(weight)
        self._host_sources.append(tensor)
        if len(self._host_weights) % 3 == 0:  # a layer's gate, up and down (MoeFFN.load's order)
            self._expert_cache.add(tuple(self._host_weights[-3:]), tuple(self._host_sources[-3:]))
        return weight

    @_op()
    def keep_hot_experts(self, slots: int) -> None:
        """Before the experts kept in RAM are uploaded: GPU slots for each such layer's most used experts."""
        self._expert_cache.close()
        self._expert_cache = ExpertCache(slots)

    def expert_cache_stats(self) -> ExpertCacheStats:
        return self._expert_cache.stats()

    def memory_in_use(self) -> MemoryInUse:
        """Bytes in CuPy's pool for this process, and the experts (and their pinned staging) kept in RAM."""
        host = sum(w.nbytes for w in self._host_weights) + sum(a.nbytes for a in self._host_stage.values())
        return MemoryInUse(host_bytes=host, device_bytes=int(cupy.get_default_memory_pool().used_bytes()))

    def synchronize(self) -> None:
        self.stream.synchronize()
        if self._host_calls is not None:
            self._host_calls.check()

    def compile_step(self, step: Callable[[], None]) -> Callable[[int], None]:
        """The first call runs `step` directly (compiling kernels and sizing scratch), then captures it as a CUDA
        graph whose kernels overlap their predecessors' tails (K.programmatic_launches); later calls replay the
        graph: one launch per decode step, no host synchronization in it. Deep positions (from deep_from on) get a
        graph of their own, whose decode attention splits the keys of each KV head over the GPU."""
        graphs: dict[bool, Any] = {}

        def run(position: int) -> None:
            # The graph reuses only int8 groups its own kernels made; its replays write where Q8Sets cannot see.
            self._q8_holds.forget()
            deep = position >= self.deep_from
            if deep in graphs:
                if self._host_calls is not None:
                    self._host_calls.arm()
                    self._expert_cache.refresh(self.stream)
                graphs[deep].launch(self.stream)
                return
            self._deep_decode = deep
            with self.stream:
                step()
                self._q8_holds.forget()
                self.stream.begin_capture()
                try:
                    with K.programmatic_launches():
                        step()
                finally:
                    captured = self.stream.end_capture()
            graphs[deep] = captured
            self._graphs.append(captured)

        return run

    def close(self) -> None:
        """Drop every array and graph and hand CuPy's cached blocks back to the driver."""
        if self._closed:
            return
        self._closed = True
        self.stream.synchronize()
        self._held.clear()
        self._scratch.clear()
        self._graphs.clear()
        self._q8 = []
        self._q8_holds.forget()
        self._decode_scratch.clear()
        self._id_slots = None
        self._host_weights.clear()
        self._host_sources.clear()
        self._bus_weights.clear()
        self._expert_cache.close()
        self._host_stage.clear()
        self._expert_stream = None
        if self._host_calls is not None:
            self._host_calls.close()
        gc.collect()  # arrays kept alive only by reference cycles go back to the pool before it is emptied
        cupy.get_default_memory_pool().free_all_blocks()
        cupy.get_default_pinned_memory_pool().free_all_blocks()

    # ---- ops ----

    @_op("out")
    def embed(self, table: K.GpuWeight, tokens: Any, out: Any, scale: float = 1.0) -> None:
        K.dequant(table, out, rows=tokens, scale=scale)

    @_op("out")
    def rms_norm(self, x: Any, weight: K.GpuWeight, eps: float, out: Any) -> None:
        K.rms_norm(x, weight.data, eps, out, self._quantize_output(out))

    @_op("residual", "out")
    def add_rms_norm(self, x: Any, residual: Any, weight: K.GpuWeight, eps: float, out: Any) -> None:
        if x.shape[-1] > K.ADD_NORM_MAX:
            raise EngineError(
                f"This model's hidden size {x.shape[-1]} is above the {K.ADD_NORM_MAX} the GPU backend's norm kernel "
                "handles. Run it on the CPU with device='cpu'."
            )
        K.add_rms_norm(x, residual, weight.data, eps, out, self._quantize_output(out))

    def _q8_sets(self) -> list[K.Q8]:
        if not self._q8:
            self._q8 = [K.Q8.empty(self._max_k), K.Q8.empty(self._max_k)]
        return self._q8

    def _quantize_output(self, out: Any) -> K.Q8 | None:
        """For a one-token output another decode product will read: the int8 set the producing kernel should
        also write (not the one holding its input), recorded as holding `out`. Otherwise None."""
        if out.ndim != 2 or out.shape[0] != 1 or out.shape[1] % 32 or not out.flags.c_contiguous:
            return None
        return self._q8_sets()[self._q8_holds.produce(_span(out))]

    def _quantized_input(self, x: Any) -> K.Q8:
        """int8 groups of the one-row x: made by the kernel that wrote x, or quantized here once for the
        several products that read it."""
        index, fresh = self._q8_holds.read(_span(x))
        q8 = self._q8_sets()[index]
        if not fresh:
            K.quantize_q8(x, q8)
        return q8

    @_op("out")
    def linear(self, x: Any, weight: K.GpuWeight, out: Any, bias: K.GpuWeight | None = None) -> None:
        if x.shape[0] == 1:
            q8 = self._quantized_input(x) if weight.quantized else None
            K.matvec(weight, x, q8, out)
        else:
            self._prompt_linear(x, weight, out)
        if bias is not None:
            out += bias.data

    @_op("out")
    def linears(self, x: Any, weights: list[K.GpuWeight], out: Any, biases: list[K.GpuWeight] | None = None) -> None:
        shapes = K.pair_shapes(*weights) if x.shape[0] == 1 and biases is None and len(weights) == 2 else None
        if shapes is not None:
            K.matvec_pair(*weights, shapes, self._quantized_input(x), out)
            return
        linear_each(self, x, weights, out, biases)

    def _prompt_linear(self, x: Any, weight: K.GpuWeight, out: Any) -> None:
        if K.tiled(x, weight, out):
            K.matmul(weight, x, out)
            return
        n, k = x.shape
        m = weight.shape[0]
        xh = self._buffer("x_f16", n * k, cupy.float16).reshape(n, k)
        K.to_f16(x, xh)
        rows = dequant_slice_rows(m, k)
        wh = self._buffer("w_f16", rows * k, cupy.float16)
        for lo in range(0, m, rows):
            hi = min(m, lo + rows)
            part = wh[: (hi - lo) * k].reshape(hi - lo, k)
            K.dequant(weight, part, row_lo=lo)
            K.gemm_f16(xh, part, out[:, lo:hi])

    @_op("out", "scratch")
    def gated_ffn(self, x: Any, gate: K.GpuWeight, up: K.GpuWeight, out: Any, scratch: Any, activation: str = "silu") -> None:
        act = ACTIVATIONS.get(activation)
        if act is None:
            raise EngineError(f"The activation {activation!r} is not supported on the GPU (silu, gelu_tanh).")
        if x.shape[0] == 1 and gate.qtype == up.qtype:
            if not gate.quantized:
                K.matvec_glu(gate, up, x, None, out, act)
                return
            q8 = self._quantized_input(x)
            K.matvec_glu(gate, up, x, q8, out, act, self._quantize_output(out) if out.shape[1] % 32 == 0 else None)
            return
        if gate.qtype == up.qtype and K.tiled(x, gate, out):
            K.matmul_glu(gate, up, x, out, act)
            return
        self.linear(x, gate, out)
        self.linear(x, up, scratch)
        K.glu(out, scratch, out, act)

    @_op("weights_out", "ids_out")
    def moe_route(self, router_logits: Any, top_k: int, normalize: bool, weights_out: Any, ids_out: Any) -> None:
        K.moe_route(router_logits, top_k, normalize, weights_out, ids_out)

    @_op("logits_out", "weights_out", "ids_out")
    def route_experts(self, x: Any, router: K.GpuWeight, n_experts: int, top_k: int, normalize: bool, logits_out: Any,
                      weights_out: Any, ids_out: Any) -> None:
        if x.shape[0] == 1 and not router.quantized and router.shape[1] % 8 == 0:
            K.router_route(router, x, logits_out, n_experts, top_k, normalize, weights_out, ids_out,
                           self._decode_buffer("router_done", 1, cupy.uint32, zeroed=True))
            return
        route_after_product(self, x, router, n_experts, top_k, normalize, logits_out, weights_out, ids_out)

    @_op("out", "scratch")
    def moe_ffn(self, x, gate_exps: K.GpuWeight | CpuWeight, up_exps: K.GpuWeight | CpuWeight,
                down_exps: K.GpuWeight | CpuWeight, ids, weights, out, scratch, activation: str = "silu") -> None:
        act = ACTIVATIONS.get(activation)
        if act is None:
            raise EngineError(f"The activation {activation!r} is not supported on the GPU (silu, gelu_tanh).")
        n, top_k = ids.shape
        f = gate_exps.shape[1]
        hidden = scratch.reshape(-1)[: n * top_k * f].reshape(n * top_k, f)
        if isinstance(gate_exps, CpuWeight):
            layer = (gate_exps, up_exps, down_exps)
            if n >= STREAM_MIN_TOKENS and K.mma_capable() and expert_stream.streamable(layer):
                self._streamed_moe(x, layer, ids, weights, out, hidden, act)
            else:
                self._moe_on_host(x, *layer, ids, weights, out, hidden, activation)
            return
        if gate_exps.qtype != up_exps.qtype:
            raise EngineError(
                f"The expert tensors {gate_exps.name} ({gate_exps.qtype.name}) and {up_exps.name} "
                f"({up_exps.qtype.name}) differ in type, which the GPU backend cannot pair. Run this model on the "
                "CPU with device='cpu'."
            )
        if ids.size >= GROUPED_MIN_SLOTS_PER_EXPERT * gate_exps.shape[0] and K.grouped(gate_exps, up_exps, down_exps):
            self._grouped_moe(x, gate_exps, up_exps, down_exps, ids, weights, out, hidden, act)
            return
        self._expert_products(x, gate_exps, up_exps, down_exps, ids, weights, out, hidden, act)

    def _expert_products(self, x, gate: K.GpuWeight, up: K.GpuWeight, down: K.GpuWeight, ids, weights, out, hidden,
                         act: int) -> None:
        """out = the chosen experts' weighted sum, a product per (token, expert) slot; an id below 0 adds nothing."""
        n = x.shape[0]
        x_q8 = h_q8 = None
        if gate.quantized:
            x_q8 = self._quantized_input(x) if n == 1 else self._q8_scratch(self._buffer, "moe_x", x.size)
            if n > 1:
                K.quantize_q8(x, x_q8)
        K.moe_gate_up(gate, up, x, x_q8, ids, hidden, act)
        if down.quantized:
            # A prompt chunk's scratch grows as needed; decode's keeps the address its captured graph holds.
            h_q8 = self._q8_scratch(self._buffer if n > 1 else self._decode_buffer, "moe_hidden", hidden.size)
            K.quantize_q8(hidden, h_q8)
        K.moe_down(down, hidden, h_q8, ids, weights, out)

    def _grouped_moe(self, x, gate: K.GpuWeight, up: K.GpuWeight, down: K.GpuWeight, ids, weights, out, hidden,
                     act: int) -> None:
        """A prompt chunk's experts as grouped products: the slots sorted by expert, each expert's weights read once
        a tile of up to 64 of its slots, the down products' rows summed back per token. The products take fp16
        activations (their tensor cores do), so x is rounded once here and the hidden rows are kept in fp16, in
        the float32 scratch's memory."""
        n_experts = gate.shape[0]
        slots = ids.size
        xh = self._buffer("x_f16", x.size, cupy.float16).reshape(x.shape)
        K.to_f16(x, xh)
        hidden = hidden.reshape(-1).view(cupy.float16)[: hidden.size].reshape(hidden.shape)
        order = self._buffer("moe_order", slots, cupy.int32)
        where = self._buffer("moe_where", slots, cupy.int32)
        tiles = self._buffer("moe_tiles", 3 * K.grouped_tiles(slots, n_experts), cupy.int32).reshape(-1, 3)
        y = self._buffer("moe_y", slots * out.shape[1], cupy.float32).reshape(slots, -1)
        K.moe_group(ids, n_experts, order, where, tiles)
        K.grouped_matmul_glu(gate, up, xh, tiles, order, ids.shape[1], hidden, act)
        K.grouped_matmul(down, hidden, tiles, y)
        K.moe_combine(y, where, weights, out)

    def _streamed_moe(self, x, layer: tuple[CpuWeight, CpuWeight, CpuWeight], ids, weights, out, hidden,
                      act: int) -> None:
        """A chunk's experts of a layer kept in RAM, copied to the GPU (engine/expert_stream.py) and computed there as
        grouped products; the next such layer's copy starts as soon as these kernels are done."""
        if self._expert_stream is None:
            self._expert_stream = expert_stream.ExpertStream(self._host_weights)
        gate, up, down = self._expert_stream.take(layer, self.stream)
        self._grouped_moe(x, gate, up, down, ids, weights, out, hidden, act)
        last = max(i for i, w in enumerate(self._host_weights) if any(w is mine for mine in layer))
        following = self._host_weights[last + 1 : last + 4]  # the next layer's experts: uploaded a layer at a time
        self._expert_stream.done(self.stream, following if len(following) == 3 else None)

    def _moe_on_host(self, x, gate: CpuWeight, up: CpuWeight, down: CpuWeight, ids, weights, out, hidden,
                     activation: str) -> None:
        """The experts of a layer kept in RAM. One token: the experts the layer's cache holds (engine/expert_cache.py)
        and experts_over_bus of every top_k of the others, read in place over the bus, run on the GPU while the CPU
        computes the rest, handed over in a host call (engine/kernels/host_calls.py, which a decode step's graph
        captures): the step stays one graph; the CPU's activations are int8 per 32 values, as this backend's own
        kernels round them. A prompt chunk: this thread waits for the routing and the CPU computes every expert."""
        if x.shape[0] > 1:
            self.synchronize()
            xh, idh, wh = (cupy.asnumpy(a, stream=self.stream, blocking=True) for a in (x, ids, weights))
            result = np.empty(out.shape, np.float32)
            cpu_experts.moe_ffn(xh, gate, up, down, idh, wh, result, activation, HOST_EXPERT_THREADS)
            out.set(result, stream=self.stream)
            return
        stage = self._stage({"x": x, "ids": ids, "weights": weights, "out": out})
        cache = self._expert_cache.layer(gate)
        slots = self._decode_buffer("moe_cache_slots", ids.size, cupy.int32).reshape(ids.shape)
        bus_ids = self._decode_buffer("moe_bus_ids", ids.size, cupy.int32).reshape(ids.shape)
        over_bus = self._over_bus((gate, up, down))
        K.moe_cache_ids(ids, weights, cache.slot_of, self.experts_over_bus if over_bus else 0, slots, bus_ids,
                        stage["ids"], stage["weights"], cache.uses)
        cupy.cuda.runtime.memcpyAsync(stage["x"].ctypes.data, x.data.ptr, x.nbytes,
                                      cupy.cuda.runtime.memcpyDeviceToHost, self.stream.ptr)

        def job() -> None:
            cpu_experts.moe_ffn(stage["x"], gate, up, down, stage["ids"], stage["weights"], stage["out"], activation,
                                HOST_EXPERT_THREADS, bits=8)

        self._host_calls.post((id(gate), id(up), id(down), activation), job)
        act = ACTIVATIONS[activation]
        if cache.weights is not None:
            self._expert_products(x, *cache.weights, slots, weights, out, hidden, act)
        bus_out = None
        if over_bus:  # into out, or beside the cached experts' sum
            bus_out = out if cache.weights is None else self._decode_buffer("moe_bus_out", out.size, cupy.float32)
            self._expert_products(x, *over_bus, bus_ids, weights, bus_out.reshape(out.shape), hidden, act)
        self._host_calls.wait()
        K.add_host_answer(out, stage["out"], add=cache.weights is not None or bus_out is not None,
                          extra=None if bus_out is out else bus_out)

    def _over_bus(self, layer: tuple[CpuWeight, CpuWeight, CpuWeight]) -> tuple[K.CpuLayoutWeight, ...]:
        """The layer's experts as the GPU reads them over the bus, or () where it does not (experts_over_bus 0, or
        layouts the kernels lack)."""
        if not self.experts_over_bus or not expert_stream.streamable(layer):
            return ()
        key = id(layer[0])
        if key not in self._bus_weights:
            self._bus_weights[key] = tuple(expert_stream.over_bus(w) for w in layer)
        return self._bus_weights[key]

    def _stage(self, like: dict[str, Any]) -> dict[str, np.ndarray]:
        """Pinned host arrays shaped as the given one-token arrays, shared by every layer whose experts are in RAM
        (the stream runs the layers in order); made once, since a captured graph keeps their addresses."""
        if not self._host_stage:
            self._host_stage = {name: cupyx.empty_pinned(a.shape, a.dtype) for name, a in like.items()}
        return self._host_stage

    @staticmethod
    def _q8_scratch(buffer: Callable[[str, int, Any], Any], key: str, size: int) -> K.Q8:
        """int8 activations of `size` values in scratch from `buffer` (_buffer or _decode_buffer)."""
        return K.Q8(buffer(f"{key}_q", size, cupy.int8), buffer(f"{key}_q2", size, cupy.int8),
                    buffer(f"{key}_ds", size // 16, cupy.float32).reshape(-1, 2))

    # ---- hybrid models' recurrent layers ----

    @_op("conv_state", "state", "mixed", "out")
    def delta_mixer(self, qkv, z, ba, conv: K.GpuWeight, conv_state, dt_bias: K.GpuWeight, ssm_a: K.GpuWeight,
                    norm: K.GpuWeight, eps: float, state, mixed, out, n_k_heads: int, tiled: bool) -> None:
        if conv.qtype != quants.T.F32 or conv.shape[1] != K.CONV_KERNEL:
            raise EngineError(f"The GPU backend runs float32 convolutions of width {K.CONV_KERNEL}, not {conv.name} "
                              f"({conv.qtype.name}, {conv.shape}). Run this model on the CPU with device='cpu'.")
        if state.shape[1] not in N_DELTA_KEY_DIMS:
            raise EngineError(f"The GPU backend's delta rule takes key heads of {', '.join(map(str, N_DELTA_KEY_DIMS))}"
                              f" values, not {state.shape[1]}. Run this model on the CPU with device='cpu'.")
        n, (n_v, dk, dv) = qkv.shape[0], state.shape
        if n == 1:
            done = self._decode_buffer("delta_done", n_k_heads, cupy.uint32, zeroed=True)
            q8 = self._quantize_output(out) if dv % 32 == 0 else None
            K.delta_step(qkv, z, ba, conv.data, conv_state, dt_bias.data, ssm_a.data, norm.data, eps, state, out,
                         n_k_heads, tiled, done, q8)
            return
        K.causal_conv_silu(qkv, conv.data, conv_state, mixed)
        if K.delta_chunked(n, dk, dv):
            shapes = zip(("u", "wqk", "p", "last"), delta_chunk_scratch(n, n_v, dk, dv), DELTA_CHUNK_SCRATCH_TYPES)
            scratch = tuple(self._buffer(f"delta_{name}", int(np.prod(shape)), dtype).reshape(shape)
                            for name, shape, dtype in shapes)
            K.gated_delta_net_chunked(mixed, ba, dt_bias.data, ssm_a.data, state, out, n_k_heads, tiled, scratch)
        else:
            K.gated_delta_net(mixed, ba, dt_bias.data, ssm_a.data, state, out, n_k_heads, tiled)
        heads = out.reshape(n, n_v, dv)
        K.gated_rms_norm(heads, z.reshape(n, n_v, dv), norm.data, eps, heads)

    @_op("out")
    def sigmoid_gate(self, x, gate, out, accumulate: bool = False) -> None:
        K.sigmoid_gate(x, gate, out, accumulate)

    @_op("q", "k", "out")
    def rope_attention(self, q, k, v, rope: RopeTable, style: str, cache: KVCache, layer: int, start, out,
                       scale: float, window: int = 0,
                       qk_norm: tuple[K.GpuWeight, K.GpuWeight, float] | None = None) -> None:
        if style not in (ROPE_NORMAL, ROPE_NEOX):
            raise EngineError(f"Unknown rotary style {style!r}.")
        kc, vc, neox = cache.k[layer], cache.v[layer], style == ROPE_NEOX
        scales = (cache.k_scale[layer], cache.v_scale[layer]) if cache.k_scale is not None else None
        n, n_heads, hd = q.shape
        n_kv, max_tokens = kc.shape[0], kc.shape[1]
        form = K.decode_attention_form(n_heads, n_kv, max_tokens, self._deep_decode, cache.kind) if n == 1 else None
        norms = None  # the QK-norm, for the decode kernels that take it in (two launches fewer)
        if qk_norm is not None and form in ("deep", "cluster"):
            norms = (qk_norm[0].data, qk_norm[1].data, qk_norm[2])
        elif qk_norm is not None:
            norm_qk(self, q, k, qk_norm)
        if form in ("deep", "split"):  # blocks of a KV head's whole group and a split of its keys, then merged
            deep = form == "deep"
            splits = (K.deep_decode_splits(max_tokens, n_kv, hd, kv=cache.kind) if deep
                      else K.decode_splits(max_tokens, n_kv))
            part = self._decode_buffer("attn_split_part", n_heads * splits * (hd + 2), cupy.float32)
            done = self._decode_buffer("attn_split_done", 2 * n_kv, cupy.uint32, zeroed=True)
            (K.attention_decode_deep if deep else K.attention_decode_split)(
                q, k, v, rope.cos, rope.sin, neox, kc, vc, start, out, scale, window, part, done,
                self._quantize_output(out), splits, scales=scales, **({"qk_norm": norms} if deep else {}))
            return
        if form == "cluster":  # one kernel, the splits merged inside each head's cluster
            K.attention_decode(q, k, v, rope.cos, rope.sin, neox, kc, vc, start, out, scale, window,
                               self._quantize_output(out), scales, norms)
            return
        K.rope_store_kv(q, k, v, rope.cos, rope.sin, neox, kc, vc, start, scales)
        if n > 1 and K.flash_attention_capable(n_heads, n_kv):  # a prompt chunk on tensor cores
            K.flash_attention(q, kc, vc, start, out, scale, window, scales)
            return
        z, wpq = K.attention_splits(n)
        size = n * n_heads * z * wpq * (hd + 2)  # partial results of the key-range splits
        if n == 1:
            K.attention(q, kc, vc, start, out, scale, window, self._decode_buffer("attn_part", size, cupy.float32),
                        self._quantize_output(out), self._decode_buffer("attn_done", n_heads, cupy.uint32, zeroed=True),
                        scales)
        else:
            K.attention(q, kc, vc, start, out, scale, window, self._buffer("attn_part", size, cupy.float32),
                        scales=scales)

    def _decode_buffer(self, key: str, size: int, dtype: Any, zeroed: bool = False) -> Any:
        """Scratch a decode step uses: allocated on the step's first (uncaptured) run and never regrown after it,
        since a captured graph keeps its address; separate from the prompt path's scratch, which grows. zeroed:
        completion counters (K.counters), which their kernels leave at zero."""
        buf = self._decode_scratch.get(key)
        if buf is None or buf.size < size:
            buf = self._decode_scratch[key] = (cupy.zeros if zeroed else cupy.empty)(size, dtype)
        return buf[:size]

    def _pick(self, logits: Any, params: SamplingParams, recent_tokens: np.ndarray, uniform: float, chosen: Any,
              feed: tuple[Any, int] | None = None) -> None:
        """Queue the sampling kernels; the id lands in chosen (device or pinned host int32), and in feed (K.argmax)."""
        vocab = logits.size
        if params.repeat_penalty != 1.0 and len(recent_tokens):
            ids = np.unique(np.asarray(recent_tokens, np.int32))
            dev_ids = self._buffer("sample_recent", ids.size, cupy.int32)
            dev_ids.set(ids, stream=self.stream)
            work = self._buffer("sample_logits", vocab, cupy.float32)
            K.repeat_penalty(logits, work, dev_ids, ids.size, params.repeat_penalty)
        elif params.temperature <= 0:  # argmax only reads: no copy
            work = logits
        else:
            work = self._buffer("sample_logits", vocab, cupy.float32)
            cupy.copyto(work, logits)  # top-k consumes its input
        if params.temperature <= 0:
            if "argmax" not in self._scratch:
                self._scratch["argmax"] = K.argmax_scratch()
            K.argmax(work, chosen, self._scratch["argmax"], feed)
        else:
            k = params.top_k if 0 < params.top_k < vocab else vocab
            if k <= TOPK_MAX:
                vals = self._buffer("sample_vals", k, cupy.float32)
                ids = self._buffer("sample_ids", k, cupy.int32)
                K.topk(work, k, vals, ids)
            else:
                order = cupy.argsort(-work)[:k]
                vals, ids = work[order], order.astype(cupy.int32)
            K.sample_sorted(vals, ids, k, params.temperature, params.top_p, params.min_p, uniform, chosen, feed)

    @_op()
    def sample(self, logits: Any, params: SamplingParams, recent_tokens: np.ndarray, uniform: float) -> int:
        chosen = self._buffer("sample_id", 1, cupy.int32)
        self._pick(logits, params, recent_tokens, uniform, chosen)
        return int(self.to_host(chosen)[0])

    @_op("ids")
    def sample_feed(
        self, logits: Any, params: SamplingParams, uniform: float, ids: Any, position: int
    ) -> Callable[[], int]:
        # The picking kernel writes the id straight into a pinned host slot (host memory the GPU addresses
        # directly), so nothing but that kernel sits between two decode steps. A ring of slots, each with its
        # event: a later token never overwrites a slot whose id has not been read (the caller reads each id
        # before queuing the step after next).
        if self._id_slots is None:
            events = [cupy.cuda.Event(disable_timing=True) for _ in range(ID_SLOTS)]
            self._id_slots = (cupyx.empty_pinned((ID_SLOTS,), np.int32), events)
        host, events = self._id_slots
        slot = self._id_next = (self._id_next + 1) % ID_SLOTS
        self._pick(logits, params, NO_TOKENS, uniform, np.uintp(host[slot:].ctypes.data), (ids, position))
        events[slot].record(self.stream)

        def result() -> int:
            events[slot].synchronize()
            if self._host_calls is not None:
                self._host_calls.check()
            return int(host[slot])

        return result
