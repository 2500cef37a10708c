"""A mixture of experts' routed FFN on the CPU: what the CPU backend runs, and what the GPU backend hands to the
CPU for the layers whose experts live in RAM.

One token (decode): the three stacked matrices each take one parallel product over the chosen experts' slabs
(engine/cpu/products.py expert_products), so a layer wakes the thread pool three times, not three times per expert.
A chunk of tokens: one pass per expert some token chose, over the tokens that chose it, through the tiled BLAS
products (a token picks an expert once); the experts run on a pool of threads, each dequantizing its own tiles.
"""

from __future__ import annotations

import functools
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from threadpoolctl import threadpool_limits

from engine.cpu import ops, products
from engine.cpu.weights import CpuWeight, activation_for, product


def moe_ffn(x: np.ndarray, gate: CpuWeight, up: CpuWeight, down: CpuWeight, ids: np.ndarray, weights: np.ndarray,
            out: np.ndarray, activation: str, threads: int | None = None) -> None:
    """out (n, d) = for each token, sum_j weights[i, j] * down[e] @ (act(gate[e] @ x[i]) * (up[e] @ x[i])), e =
    ids[i, j] (the contract of Backend.moe_ffn); `threads` for the one-token products (default products.threads())."""
    threads = threads or products.threads()
    if x.shape[0] == 1 and all(w.planes is not None for w in (gate, up, down)):
        _one_token(x[0], gate, up, down, ids[0], weights[0], out[0], activation, threads)
        return
    f, d = gate.shape[1], down.shape[1]

    def expert_output(expert: int) -> tuple[np.ndarray, np.ndarray]:
        """The weighted output of one expert for the tokens that chose it, and their rows."""
        rows, slots = np.nonzero(ids == expert)
        xe = x[rows]
        act = activation_for(xe, gate, up)
        hidden, up_out, down_out = (np.empty((len(rows), n), np.float32) for n in (f, f, d))
        product(gate, xe, hidden, expert * f, (expert + 1) * f, act)
        product(up, xe, up_out, expert * f, (expert + 1) * f, act)
        ops.apply_glu(hidden, up_out, activation)
        product(down, hidden, down_out, expert * d, (expert + 1) * d)
        return rows, down_out * weights[rows, slots, None]

    chosen = np.unique(ids).tolist()
    if threads > 1 and len(chosen) > 1:
        # Experts in parallel, each on one BLAS thread: their products are small, their dequantization is the work.
        with threadpool_limits(limits=1, user_api="blas"):
            parts = list(_pool(threads).map(expert_output, chosen))
    else:
        parts = [expert_output(e) for e in chosen]
    out[...] = 0
    for rows, part in parts:  # summed in expert order, whatever the threads
        out[rows] += part


@functools.lru_cache(maxsize=4)
def _pool(threads: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=threads, thread_name_prefix="strata-experts")


def _one_token(x: np.ndarray, gate: CpuWeight, up: CpuWeight, down: CpuWeight, ids: np.ndarray, weights: np.ndarray,
               out: np.ndarray, activation: str, threads: int) -> None:
    top_k, f, d = len(ids), gate.shape[1], down.shape[1]
    act = products.activation(x)
    hidden, up_out, down_out = (np.empty(top_k * n, np.float32) for n in (f, f, d))
    products.expert_products(gate.planes, act, ids, hidden, False, threads)
    products.expert_products(up.planes, act, ids, up_out, False, threads)
    ops.apply_glu(hidden, up_out, activation)
    products.expert_products(down.planes, products.activation(hidden.reshape(top_k, f)), ids, down_out, True, threads)
    np.matmul(weights, down_out.reshape(top_k, d), out=out)  # weights: float32 (Backend.moe_ffn)
