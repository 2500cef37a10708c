"""A mixture of experts' routed FFN on the CPU: what the CPU backend runs, and what the GPU backend hands to the
CPU for the layers whose experts live in RAM.

One token (decode): two parallel passes over the chosen experts' slabs (engine/cpu/products.py): gate and up
together, the activation applied where they are computed, then down, each thread a run of the output's rows over
every chosen expert, weighted and summed there; so a layer wakes the thread pool twice, not three times per expert.
A chunk of tokens: one pass per expert some token chose, over the tokens that chose it, through the tiled BLAS
products (a token picks an expert once); the experts run on a pool of threads, each dequantizing its own tiles.
"""

from __future__ import annotations

import functools
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from engine.cpu import ops, products
from engine.cpu.blas import blas_threads
from engine.cpu.weights import CpuWeight, activation_for, product


def moe_ffn(x: np.ndarray, gate: CpuWeight, up: CpuWeight, down: CpuWeight, ids: np.ndarray, weights: np.ndarray,
            out: np.ndarray, activation: str, threads: int | None = None, bits: int = 16) -> None:
    """out (n, d) = for each token, sum_j weights[i, j] * down[e] @ (act(gate[e] @ x[i]) * (up[e] @ x[i])), e =
    ids[i, j] (the contract of Backend.moe_ffn), where an id below 0 (an expert the GPU computes) adds nothing;
    `threads` for the one-token products (default products.threads()), which round their activations to `bits` (16,
    or 8 as the GPU backend's kernels do; engine/cpu/dot.py)."""
    threads = threads or products.threads()
    if x.shape[0] == 1 and all(w.planes is not None for w in (gate, up, down)):
        mine = ids[0] >= 0
        if not mine.any():
            out[...] = 0
        else:
            _one_token(x[0], gate, up, down, ids[0][mine], weights[0][mine], out[0], activation, threads, bits)
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

    chosen = np.unique(ids[ids >= 0]).tolist()
    if threads > 1 and len(chosen) > 1:
        # Experts in parallel, each on one BLAS thread: their products are small, their dequantization is the work.
        with blas_threads(1):
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
               out: np.ndarray, activation: str, threads: int, bits: int) -> None:
    hidden = np.empty(len(ids) * gate.shape[1], np.float32)
    products.expert_glu(gate.planes, up.planes, products.activation(x, bits), ids, hidden, ops.is_gelu(activation),
                        threads)
    hidden_act = products.activation(hidden.reshape(len(ids), -1), bits)
    products.expert_mix(down.planes, hidden_act, ids, weights, out, threads)
