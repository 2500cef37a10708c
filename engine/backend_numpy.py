"""The CPU backend: weights dequantized to float32 at load, every op from engine/kernels/reference.py.

Meant for small models (the float32 copy of a 135M-parameter model is about 0.5 GB); matrix products go to
the BLAS NumPy links against.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
from threadpoolctl import threadpool_limits

from engine import quants
from engine.backend import KVCache, MemoryInUse, RopeTable, SamplingParams
from engine.capabilities import CPU_KV_DTYPE
from engine.errors import EngineError
from engine.gguf_file import GGUFTensor
from engine.kernels import reference


@dataclass
class NumpyWeight:
    name: str
    shape: tuple[int, ...]
    data: np.ndarray  # float32, `shape`

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)


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

    def to_host(self, x: np.ndarray) -> np.ndarray:
        return np.array(x, copy=True)

    def upload(self, tensor: GGUFTensor) -> NumpyWeight:
        try:
            data = quants.dequantize(tensor.raw, tensor.qtype, tensor.shape)
        except quants.UnsupportedTensorType as exc:
            raise EngineError(f"Tensor {tensor.name} cannot be loaded: {exc}.") from None
        except quants.TensorSizeError as exc:
            raise EngineError(f"Tensor {tensor.name} is damaged ({exc}); download the model again.") from None
        return self._hold(NumpyWeight(tensor.name, tuple(tensor.shape), np.ascontiguousarray(data, dtype=np.float32)))

    def rope_table(self, inv_freq: np.ndarray, max_positions: int, attn_factor: float = 1.0) -> RopeTable:
        return self._hold(RopeTable(*reference.rope_tables(inv_freq, max_positions, attn_factor)))

    def kv_cache(self, n_layers: int, n_kv_heads: int, head_dim: int, max_tokens: int) -> KVCache:
        shape = (n_layers, n_kv_heads, max_tokens, head_dim)
        return self._hold(KVCache(np.zeros(shape, self.kv_dtype), np.zeros(shape, self.kv_dtype)))

    def memory_in_use(self) -> MemoryInUse:
        return MemoryInUse(host_bytes=sum(int(obj.nbytes) for obj in self._held))

    def synchronize(self) -> None:
        return None

    def compile_step(self, step: Callable[[], None]) -> Callable[[], None]:
        """The decode step on fewer BLAS threads: its products are matrix-vector and memory-bound, and OpenBLAS
        threads that spin-wait collapse when other programs share the cores (20 vs 2 tokens/s measured on a busy
        2-core machine). Prompt chunks, which are compute-bound, keep every thread."""
        threads = max(1, (os.cpu_count() or 2) // 2)

        def limited_step() -> None:
            with threadpool_limits(limits=threads, user_api="blas"):
                step()

        return limited_step

    def close(self) -> None:
        self._held.clear()

    # ---- ops ----

    def embed(self, table: NumpyWeight, tokens: np.ndarray, out: np.ndarray, scale: float = 1.0) -> None:
        reference.embed(table.data, tokens, out, scale)

    def rms_norm(self, x: np.ndarray, weight: NumpyWeight, eps: float, out: np.ndarray) -> None:
        reference.rms_norm(x, weight.data, eps, out)

    def add_rms_norm(self, x, residual, weight: NumpyWeight, eps: float, out) -> None:
        reference.add_rms_norm(x, residual, weight.data, eps, out)

    def linear(self, x, weight: NumpyWeight, out, bias: NumpyWeight | None = None) -> None:
        reference.linear(x, weight.data, out, None if bias is None else bias.data)

    def gated_ffn(self, x, gate: NumpyWeight, up: NumpyWeight, out, scratch, activation: str = "silu") -> None:
        reference.gated_ffn(x, gate.data, up.data, out, scratch, activation)

    def moe_route(self, router_logits, top_k: int, normalize: bool, weights_out, ids_out) -> None:
        reference.moe_route(router_logits, top_k, normalize, weights_out, ids_out)

    def moe_ffn(self, x, gate_exps: NumpyWeight, up_exps: NumpyWeight, down_exps: NumpyWeight, ids, weights, out, scratch, activation: str = "silu") -> None:
        reference.moe_ffn(x, gate_exps.data, up_exps.data, down_exps.data, ids, weights, out, scratch, activation)

    def rope_attention(self, q, k, v, rope: RopeTable, style: str, cache: KVCache, layer: int, start, out,
                       scale: float, window: int = 0) -> None:
        kc, vc, p = cache.k[layer], cache.v[layer], int(start[0])
        reference.rope_store_kv(q, k, v, rope.cos, rope.sin, style, kc, vc, p)
        reference.attention(q, kc, vc, p, out, scale, window)

    def causal_conv_silu(self, x, weight: NumpyWeight, state, out) -> None:
        reference.causal_conv_silu(x, weight.data, state, out)

    def gated_delta_net(self, qkv, ba, dt_bias: NumpyWeight, ssm_a: NumpyWeight, state, out, n_k_heads: int,
                        tiled: bool) -> None:
        reference.gated_delta_net(qkv, ba, dt_bias.data, ssm_a.data, state, out, n_k_heads, tiled)

    def gated_rms_norm(self, x, gate, weight: NumpyWeight, eps: float, out) -> None:
        reference.gated_rms_norm(x, gate, weight.data, eps, out)

    def sigmoid_gate(self, x, gate, out, accumulate: bool = False) -> None:
        reference.sigmoid_gate(x, gate, out, accumulate)

    def sample(self, logits, params: SamplingParams, recent_tokens: np.ndarray, uniform: float) -> int:
        return reference.sample(logits, params, recent_tokens, uniform)

    def sample_feed(self, logits, params: SamplingParams, uniform: float, ids, position: int) -> Callable[[], int]:
        token = reference.sample(logits, params, np.zeros(0, np.int32), uniform)
        ids[:2] = position, token
        return lambda: token
