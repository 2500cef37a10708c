"""Times the hot GPU kernels on their own (an H200 is what it was written for): the decode matrix-vector
product per weight type (plain and programmatic launches), the prompt path's two ways to multiply a chunk
(our kernel on dequantized tiles, and dequantize + cuBLAS), and a mixture's experts over a chunk both ways (a
product per token and expert, and the grouped products).

Prints one JSON line per measurement. Decode launches are captured in a CUDA graph and replayed, rotating over
enough weight copies that they do not fit in L2, so the time is the kernel's, not Python's or the cache's.
matvec_shapes also times the kernel shapes the backend never picks (kernel_names.SWEEP_SHAPES): the first launch
of one builds the sweep copy of matvec.cu that holds them. delta: a hybrid model's delta rule over a prompt chunk, token
by token and chunked.
Usage: python bench/gpu_kernels.py [copy] [read] [matvec] [matvec_shapes] [prompt] [moe] [delta]
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

import cupy as cp
import numpy as np
from gguf import GGMLQuantizationType as T

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine import quants  # noqa: E402
from engine.kernels import cuda as K  # noqa: E402
from engine.kernels import kernel_names as N  # noqa: E402
from engine.kernels.gpu_layout import random_blocks  # noqa: E402

L2_BYTES = 60 * 2**20
BANDWIDTH = 4.3e12


def timed_eager(launch, reps: int = 10) -> float:
    """Median seconds of one `launch()` launched directly (for cuBLAS, which CuPy cannot capture)."""
    launch()
    times = []
    for _ in range(reps):
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record()
        launch()
        b.record()
        b.synchronize()
        times.append(cp.cuda.get_elapsed_time(a, b) / 1e3)
    return float(np.median(times))


def timed_graph(launch, reps: int = 20, pdl: bool = False) -> float:
    """Median seconds of one `launch()` (which may launch several kernels), replayed from a CUDA graph; with pdl
    the graph is captured as decode graphs are (K.programmatic_launches: each kernel overlaps its predecessor's
    tail)."""
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        launch()
        stream.begin_capture()
        with K.programmatic_launches() if pdl else contextlib.nullcontext():
            for _ in range(reps):
                launch()
        graph = stream.end_capture()
        graph.launch(stream)
        stream.synchronize()
        times = []
        for _ in range(7):
            a, b = cp.cuda.Event(), cp.cuda.Event()
            a.record(stream)
            graph.launch(stream)
            b.record(stream)
            b.synchronize()
            times.append(cp.cuda.get_elapsed_time(a, b) / 1e3 / reps)
    return float(np.median(times))


def weight_copies(qtype, m, k, rng):
    elements, block_bytes = quants.block_layout(qtype)
    raw = random_blocks(qtype, m * k // elements, rng)
    copies = max(2, -(-3 * L2_BYTES // raw.nbytes))
    return [K.upload_weight("w", qtype, (m, k), raw) for _ in range(copies)], raw.nbytes


MATVEC_SHAPES = [*N.SHAPES["matvec"], *N.SWEEP_SHAPES["matvec"], "stream"]
# fused with the int8 quantization of its output, or followed by it
GLU_SHAPES = ["fused", *N.SHAPES["matvec_glu"], *N.SWEEP_SHAPES["matvec_glu"]]


def bench_matvec(rng, every_shape: bool = False):
    """Each decode product of the 8B and 1.2B shapes. By default: its default kernel shape (K.matvec_shape,
    K.glu_shape), launched plainly and with programmatic dependent launch (where a kernel prefetches its weights
    while its predecessor runs). every_shape: every kernel shape of Q4_0 and Q4_K, programmatic launch only (as
    decode graphs run). The gate/up pair includes the int8 quantization of its output for the down product."""
    shapes = {"8B qkv": (6144, 4096), "8B o": (4096, 4096), "8B ffn_down": (4096, 14336),
              "8B ffn_gate+up": (14336, 4096), "1.2B qkv": (3072, 2048), "1.2B ffn_down": (2048, 8192),
              "1.2B ffn_gate+up": (8192, 2048), "8B head": (128256, 4096)}
    for qtype in (T.Q4_0, T.Q4_K) if every_shape else (T.Q4_0, T.Q4_K, T.Q6_K):
        for label, (m, k) in shapes.items():
            if every_shape and "head" in label:
                continue
            ws, nbytes = weight_copies(qtype, m, k, rng)
            x = cp.asarray(rng.standard_normal(k).astype(np.float32))
            q8, q8_out = K.Q8.empty(k), K.Q8.empty(m)
            out = cp.empty(m, cp.float32)
            K.quantize_q8(x, q8)
            glu = "gate" in label
            default = K.glu_shape(m, k, qtype) if glu else K.matvec_shape(m, k, qtype)
            runs = [(shape, True) for shape in (GLU_SHAPES if glu else MATVEC_SHAPES)] if every_shape else [
                (default, False), (default, True)]
            for shape, pdl in runs:
                if glu:
                    def launch(shape=shape):
                        for i in range(0, len(ws) - 1, 2):
                            K.matvec_glu(ws[i], ws[i + 1], x, q8, out, K.ACT_SILU, q8_out, shape)
                    per, read = len(ws) // 2, 2 * nbytes
                else:
                    def launch(shape=shape):
                        for w in ws:
                            K.matvec(w, x, q8, out, shape)
                    per, read = len(ws), nbytes
                t = timed_graph(launch, pdl=pdl) / per
                print(json.dumps({"kernel": "matvec", "type": qtype.name, "shape": label, "m": m, "k": k,
                                  "variant": shape, "pdl": pdl,
                                  "us": round(t * 1e6, 2), "GB/s": round(read / t / 1e9, 1),
                                  "fraction_of_4.3TB/s": round(read / t / BANDWIDTH, 3)}), flush=True)


PROMPT_SHAPES = {"135M qkv": (960, 576), "135M o": (576, 576), "135M ffn_gate+up": (1536, 576),
                 "135M ffn_down": (576, 1536), "1.2B qkv": (3072, 2048), "1.2B o": (2048, 2048),
                 "1.2B ffn_gate+up": (8192, 2048), "1.2B ffn_down": (2048, 8192), "8B qkv": (6144, 4096),
                 "8B o": (4096, 4096), "8B ffn_gate+up": (14336, 4096), "8B ffn_down": (4096, 14336)}


def bench_prompt(rng):
    """Each prompt-chunk product of the three Llama shapes both ways, launched as the prompt path launches them
    (eager, timed by events, so on small products the host's launches are part of the time): matmul.cu's one
    kernel on dequantized tiles (gate and up together, with the activation), and to_f16 + dequantize to scratch
    + cuBLAS per matrix (then the activation)."""
    for qtype in (T.Q4_0, T.Q4_K):
        for label, (m, k) in PROMPT_SHAPES.items():
            glu = "gate" in label
            elements, _ = quants.block_layout(qtype)
            ws = [K.upload_weight("w", qtype, (m, k), random_blocks(qtype, m * k // elements, rng))
                  for _ in range(2 if glu else 1)]
            scratch = cp.empty((m, k), cp.float16)
            for n in (128, 512):
                x = cp.asarray(rng.standard_normal((n, k)).astype(np.float32))
                xh = cp.empty((n, k), cp.float16)
                outs = [cp.empty((n, m), cp.float32) for _ in ws]

                def tiles():
                    if glu:
                        K.matmul_glu(ws[0], ws[1], x, outs[0], K.ACT_SILU)
                    else:
                        K.matmul(ws[0], x, outs[0])

                def dequant_cublas():
                    for w, out in zip(ws, outs):
                        K.to_f16(x, xh)
                        K.dequant(w, scratch)
                        K.gemm_f16(xh, scratch, out)
                    if glu:
                        K.glu(outs[0], outs[1], outs[0], K.ACT_SILU)

                t_tiles, t_cublas = timed_eager(tiles), timed_eager(dequant_cublas)
                flops = 2.0 * n * m * k * len(ws)
                print(json.dumps({"kernel": "prompt_product", "type": qtype.name, "shape": label, "n": n, "m": m,
                                  "k": k, "tiles_us": round(t_tiles * 1e6, 1),
                                  "dequant_cublas_us": round(t_cublas * 1e6, 1),
                                  "tiles_TFLOP/s": round(flops / t_tiles / 1e12, 1),
                                  "dequant_cublas_TFLOP/s": round(flops / t_cublas / 1e12, 1),
                                  "default": "tiles" if K.tiled(x, ws[0], outs[0]) else "dequant_cublas"}), flush=True)


# Mixture layers: (n_experts, top_k, hidden, expert width); gate/up Q4_K, down Q6_K as in the Q4_K_M files.
MOE_SHAPES = {"Qwen3-30B-A3B": (128, 8, 2048, 768), "Qwen3.6-35B-A3B": (256, 8, 2048, 512)}


def bench_moe(rng):
    """One mixture layer's experts over chunks of n tokens (uniform random routing, which spreads the slots evenly;
    real routing is skewed), eager as the prompt path launches them: a product per (token, expert) against the
    grouped products. Weight bytes are those of the experts the chunk uses."""
    from engine import backend_cupy
    from engine.gguf_file import GGUFTensor

    backend = backend_cupy.CupyBackend()
    default = backend_cupy.GROUPED_MIN_SLOTS_PER_EXPERT
    for label, (n_experts, top_k, d, f) in MOE_SHAPES.items():
        handles = []
        for name, qtype, shape in (("gate", T.Q4_K, (n_experts, f, d)), ("up", T.Q4_K, (n_experts, f, d)),
                                   ("down", T.Q6_K, (n_experts, d, f))):
            raw = random_blocks(qtype, int(np.prod(shape)) // quants.block_layout(qtype)[0], rng, typical=0.05)
            handles.append(backend.upload(GGUFTensor(name, qtype, shape, raw)))
        expert_bytes = sum(h.nbytes for h in handles) / n_experts
        for n in (2, 4, 8, 16, 32, 64, 128, 512, 2048):
            ids = np.stack([rng.permutation(n_experts)[:top_k] for _ in range(n)]).astype(np.int32)
            with backend.stream:
                x = cp.asarray(rng.standard_normal((n, d)).astype(np.float32))
                dev_ids, weights = cp.asarray(ids), cp.asarray(rng.random((n, top_k)).astype(np.float32))
                out, scratch = cp.empty((n, d), cp.float32), cp.empty((n, top_k, 2 * f), cp.float32)
            row = {"kernel": "moe_chunk", "shape": label, "n": n}
            for form, threshold in (("per_slot", 10**9), ("grouped", 0)):
                backend_cupy.GROUPED_MIN_SLOTS_PER_EXPERT = threshold
                with backend.stream:
                    t = timed_eager(lambda: backend.moe_ffn(x, *handles, dev_ids, weights, out, scratch))
                row[f"{form}_us"] = round(t * 1e6, 1)
                row[f"{form}_TFLOP/s"] = round(6.0 * n * top_k * d * f / t / 1e12, 2)
                row[f"{form}_weights_TB/s"] = round(len(np.unique(ids)) * expert_bytes / t / 1e12, 3)
            print(json.dumps(row), flush=True)
    backend_cupy.GROUPED_MIN_SLOTS_PER_EXPERT = default
    backend.close()


# Gated DeltaNet mixers: (key heads, value heads, key head size, value head size).
DELTA_SHAPES = {"Qwen3.6-35B-A3B": (16, 32, 128, 128), "Qwen3.8-27B": (16, 48, 128, 128)}


def bench_delta(rng):
    """The delta rule of one recurrent layer over a prompt chunk of n tokens, both forms: token by token (the decode
    kernel) and chunked on tensor cores (delta_chunk_prep + delta_chunk_state), eager as the prompt path launches
    them, with the chunked form's relative error against the token-by-token one."""
    for label, (n_k, n_v, dk, dv) in DELTA_SHAPES.items():
        for n in (16, 32, 64, 128, 512):
            with cp.cuda.Stream(non_blocking=True):
                qkv = cp.asarray(rng.standard_normal((n, 2 * n_k * dk + n_v * dv)).astype(np.float32))
                ba = cp.asarray(rng.standard_normal((n, 2 * n_v)).astype(np.float32))
                dt_bias = cp.asarray(rng.standard_normal(n_v).astype(np.float32))
                ssm_a = cp.asarray(-np.exp(rng.standard_normal(n_v)).astype(np.float32))
                start = cp.asarray((rng.standard_normal((n_v, dk, dv)) * 0.1).astype(np.float32))
                state, out = start.copy(), cp.empty((n, n_v * dv), cp.float32)
                scratch = tuple(cp.empty(shape, dtype) for shape, dtype in zip(
                    N.delta_chunk_scratch(n, n_v, dk, dv), N.DELTA_CHUNK_SCRATCH_TYPES))
                row = {"kernel": "delta_rule", "shape": label, "n": n}
                forms = {"token": lambda: K.gated_delta_net(qkv, ba, dt_bias, ssm_a, state, out, n_k, True),
                         "chunked": lambda: K.gated_delta_net_chunked(qkv, ba, dt_bias, ssm_a, state, out, n_k, True,
                                                                      scratch)}
                results = {}
                for form, launch in forms.items():
                    state[...] = start
                    launch()
                    results[form] = cp.asnumpy(out)
                    row[f"{form}_us"] = round(timed_eager(launch) * 1e6, 1)
                want = results["token"]
                row["chunked_relative_error"] = float(np.linalg.norm(results["chunked"] - want) / np.linalg.norm(want))
                print(json.dumps(row), flush=True)


def bench_copy():
    a = cp.empty(2**30, cp.uint8)
    b = cp.empty_like(a)
    t = timed_graph(lambda: cp.copyto(b, a), reps=5)
    print(json.dumps({"kernel": "device_copy", "GB": 1.07, "TB/s (read+write)": round(2 * a.nbytes / t / 1e12, 2)}))


READ_SOURCE = r"""
extern "C" __global__ void read_all(const uint4* __restrict__ p, long n, unsigned* out) {
    unsigned acc = 0;
    const long step = (long)gridDim.x * blockDim.x;
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    for (; i + 3 * step < n; i += 4 * step) {
        const uint4 a = __ldg(p + i), b = __ldg(p + i + step), c = __ldg(p + i + 2 * step), d = __ldg(p + i + 3 * step);
        acc ^= a.x ^ a.w ^ b.y ^ b.z ^ c.x ^ c.w ^ d.y ^ d.z;
    }
    for (; i < n; i += step) acc ^= __ldg(p + i).x;
    if (acc == 0x12345678u) out[0] = acc;  // keeps the loads; practically never taken
}
"""


def bench_read():
    """The read ceiling at the decode products' sizes: a kernel that only reads (16-byte loads, four in flight a
    thread, 8 blocks of 256 threads a multiprocessor), rotating over copies that do not fit in L2."""
    kernel = cp.RawKernel(READ_SOURCE, "read_all")
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    out = cp.zeros(1, cp.uint32)
    for label, nbytes in (("8B o", 9_437_184), ("8B ffn_down", 33_030_144), ("8B ffn_gate+up", 66_060_288),
                          ("1 GiB", 2**30)):
        bufs = [cp.zeros(nbytes // 16 * 16, cp.uint8) for _ in range(max(2, -(-3 * L2_BYTES // nbytes)))]

        def launch():
            for b in bufs:
                kernel((8 * sms,), (256,), (b, np.int64(b.size // 16), out))
        t = timed_graph(launch) / len(bufs)
        print(json.dumps({"kernel": "read", "shape": label, "bytes": nbytes, "us": round(t * 1e6, 2),
                          "TB/s": round(nbytes / t / 1e12, 3), "fraction_of_4.3TB/s": round(nbytes / t / BANDWIDTH, 3)}),
              flush=True)


def main() -> None:
    rng = np.random.default_rng(0)
    print(json.dumps({"gpu": cp.cuda.runtime.getDeviceProperties(0)["name"].decode(), "cupy": cp.__version__}))
    parts = sys.argv[1:] or ["copy", "matvec", "prompt"]
    if "copy" in parts:
        bench_copy()
    if "read" in parts:
        bench_read()
    if "matvec" in parts:
        bench_matvec(rng)
    if "matvec_shapes" in parts:
        bench_matvec(rng, every_shape=True)
    if "prompt" in parts:
        bench_prompt(rng)
    if "moe" in parts:
        bench_moe(rng)
    if "delta" in parts:
        bench_delta(rng)


if __name__ == "__main__":
    main()
