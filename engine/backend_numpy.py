"""The CPU backend: weights kept quantized (engine/cpu), the other ops from engine/kernels/reference.py.

One-token products run engine/cpu's kernels on the packed GGUF blocks; prompt chunks dequantize a few rows
at a time and use the BLAS NumPy links against. A model takes about its file size in RAM.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import numpy as np

from engine import quants
from engine.backend import (Q8_0_GROUP, ROPE_NEOX, KVCache, MemoryInUse, RopeTable, SamplingParams, check_kv_cache_type,
                            linear_each, norm_qk, route_after_product)
from engine.capabilities import CPU_KV_DTYPE
from engine.cpu import experts, ops, products
from engine.cpu.blas import blas_threads
from engine.cpu.weights import CpuWeight, activation_for, load, product, rows_f32
from engine.errors import EngineError
from engine.gguf_file import GGUFTensor
from engine.kernels import reference


class NumpyBackend:
    """Implements engine.backend.Backend on the CPU."""

    name = "numpy"
    asynchronous = False
    kv_dtype = CPU_KV_DTYPE

    def __init__(self) -> None:
        self._held: list[Any] = []

    def _hold(self, obj: Any) -> Any:
        self._held.append(obj)
        return obj

    # ---- memory ----

    def empty(self, shape: tuple[int, ...], dtype: Any = np.float32) -> np.ndarray:
        return self._hold(np.empty(shape, dtype=dtype))

    def copy_into(self, dst: np.ndarray, src: np.ndarray) -> None:
        dst[...] = src

    def assign(self, dst: np.ndarray, src: np.ndarray | float) -> None:
        dst[...] = src

    def to_host(self, x: np.ndarray) -> np.ndarray:
        return np.array(x, copy=True)

    def upload(self, tensor: GGUFTensor, host: bool = False) -> CpuWeight:
        """Every weight lives in RAM here, so `host` changes nothing."""
        try:
            weight = load(tensor.name, tensor.raw, tensor.qtype, tuple(tensor.shape))
        except quants.UnsupportedTensorType as exc:
            raise EngineError(f"Tensor {tensor.name} cannot be loaded: {exc}.") from None
        except quants.TensorSizeError as exc:
            raise EngineError(f"Tensor {tensor.name} is damaged ({exc}); download the model again.") from None
        return self._hold(weight)

    def rope_table(self, inv_freq: np.ndarray, max_positions: int, attn_factor: float = 1.0) -> RopeTable:
        return self._hold(RopeTable(*reference.rope_tables(inv_freq, max_positions, attn_factor)))

    def kv_cache(self, n_layers: int, n_kv_heads: int, head_dim: int, max_tokens: int, kind: str = "full") -> KVCache:
        check_kv_cache_type(kind)
        shape = (n_layers, n_kv_heads, max_tokens, head_dim)
        if kind == "full":
            return self._hold(KVCache(np.zeros(shape, self.kv_dtype), np.zeros(shape, self.kv_dtype)))
        if head_dim % Q8_0_GROUP:
            raise EngineError(f"A q8_0 KV cache needs a head size that is a multiple of {Q8_0_GROUP}, not "
                              f"{head_dim}; use the full KV cache.")
        scales = shape[:3] + (head_dim // Q8_0_GROUP,)
        return self._hold(KVCache(np.zeros(shape, np.int8), np.zeros(shape, np.int8),
                                  np.zeros(scales, np.float16), np.zeros(scales, np.float16)))

    def memory_in_use(self) -> MemoryInUse:
        return MemoryInUse(host_bytes=sum(int(obj.nbytes) for obj in self._held))

    def synchronize(self) -> None:
        return None

    def compile_step(self, step: Callable[[], None]) -> Callable[[int], None]:
        """The decode step (at any position) on fewer BLAS threads: its products are matrix-vector and memory-bound, and OpenBLAS
        threads that spin-wait collapse when other programs share the cores (20 vs 2 tokens/s measured on a busy
        2-core machine). Prompt chunks, which are compute-bound, keep every thread."""
        threads = max(1, (os.cpu_count() or 2) // 2)

        def limited_step(position: int) -> None:
            with blas_threads(threads):
                step()

        return limited_step

    def close(self) -> None:
        self._held.clear()

    # ---- ops ----

    def embed(self, table: CpuWeight, tokens: np.ndarray, out: np.ndarray, scale: float = 1.0) -> None:
        rows_f32(table, tokens, out)
        if scale != 1.0:
            out *= np.float32(scale)

    def rms_norm(self, x: np.ndarray, weight: CpuWeight, eps: float, out: np.ndarray) -> None:
        if x.ndim == 2:
            ops.rms_norm(x, weight.dense, eps, out)
        else:  # per-head norms on (n, heads, d) views, which need not reshape without a copy
            reference.rms_norm(x, weight.dense, eps, out)

    def add_rms_norm(self, x, residual, weight: CpuWeight, eps: float, out) -> None:
        ops.add_rms_norm(x, residual, weight.dense, eps, out)

    def linear(self, x, weight: CpuWeight, out, bias: CpuWeight | None = None) -> None:
        product(weight, x, out)
        if bias is not None:
            out += bias.dense

    def linears(self, x, weights: list[CpuWeight], out, biases: list[CpuWeight] | None = None) -> None:
        linear_each(self, x, weights, out, biases)

    def gated_ffn(self, x, gate: CpuWeight, up: CpuWeight, out, scratch, activation: str = "silu") -> None:
        act = activation_for(x, gate, up)
        product(gate, x, out, act=act)
        product(up, x, scratch, act=act)
        ops.apply_glu(out, scratch, activation)

    def moe_route(self, router_logits, top_k: int, normalize: bool, weights_out, ids_out) -> None:
        reference.moe_route(router_logits, top_k, normalize, weights_out, ids_out)

    def route_experts(self, x, router: CpuWeight, n_experts: int, top_k: int, normalize: bool, logits_out,
                      weights_out, ids_out) -> None:
        route_after_product(self, x, router, n_experts, top_k, normalize, logits_out, weights_out, ids_out)

    def moe_ffn(self, x, gate_exps: CpuWeight, up_exps: CpuWeight, down_exps: CpuWeight, ids, weights, out, scratch, activation: str = "silu") -> None:
        experts.moe_ffn(x, gate_exps, up_exps, down_exps, ids, weights, out, activation)  # scratch: the GPU's space

    def rope_attention(self, q, k, v, rope: RopeTable, style: str, cache: KVCache, layer: int, start, out,
                       scale: float, window: int = 0, qk_norm: tuple[CpuWeight, CpuWeight, float] | None = None) -> None:
        if qk_norm is not None:
            norm_qk(self, q, k, qk_norm)
        kc, vc, p = cache.k[layer], cache.v[layer], int(start[0])
        ks, vs = (None, None) if cache.k_scale is None else (cache.k_scale[layer], cache.v_scale[layer])
        if q.shape[0] == 1:
            bits = (None, None) if ks is None else (ks.view(np.uint16), vs.view(np.uint16))  # numba has no float16
            ops.rope_store_one(q, k, v, rope.cos, rope.sin, style == ROPE_NEOX, kc, vc, p, *bits)
            # Past a few hundred positions the keys and values outweigh a product's weights: split them as the
            # products split rows (SmolLM2's shape, 600 positions, 2 threads of the 2-core VM: 40 us against 71).
            length = min(p + 1, window) if window > 0 else p + 1
            big = 2 * length * kc.shape[0] * kc.shape[2] >= products.PARALLEL_MIN_WEIGHTS
            splits = products.threads() if big else 1
            if not (splits > 1 and products.parallel_call(ops.attend_one, q, kc, vc, p, out, scale, window, *bits,
                                                          splits, threads=splits)):
                ops.attend_one(q, kc, vc, p, out, scale, window, *bits)
            return
        reference.rope_store_kv(q, k, v, rope.cos, rope.sin, style, kc, vc, p, ks, vs)
        # The positions some query attends to, from `first` on, as the cache holds them (a ring's in order).
        length = p + q.shape[0]
        first = max(0, p - window + 1) if window > 0 and length > kc.shape[1] else 0
        rows = np.arange(first, length) % kc.shape[1] if first else slice(0, length)
        kc, vc = kc[:, rows], vc[:, rows]
        if ks is not None:
            kc, vc = reference.dequantize_q8_0(kc, ks[:, rows]), reference.dequantize_q8_0(vc, vs[:, rows])
        reference.attention(q, kc, vc, p - first, out, scale, window)

    def delta_mixer(self, qkv, z, ba, conv: CpuWeight, conv_state, dt_bias: CpuWeight, ssm_a: CpuWeight,
                    norm: CpuWeight, eps: float, state, mixed, out, n_k_heads: int, tiled: bool) -> None:
        reference.delta_mixer(qkv, z, ba, conv.dense, conv_state, dt_bias.dense, ssm_a.dense, norm.dense, eps, state,
                              mixed, out, n_k_heads, tiled)

    def sigmoid_gate(self, x, gate, out, accumulate: bool = False) -> None:
        reference.sigmoid_gate(x, gate, out, accumulate)

    def sample(self, logits, params: SamplingParams, recent_tokens: np.ndarray, uniform: float) -> int:
        return reference.sample(logits, params, recent_tokens, uniform)

    def sample_feed(self, logits, params: SamplingParams, uniform: float, ids, position: int) -> Callable[[], int]:
        token = reference.sample(logits, params, np.zeros(0, np.int32), uniform)
        ids[:2] = position, token
        return lambda: token
