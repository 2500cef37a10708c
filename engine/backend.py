"""The array backend protocol: the small set of fused operations an architecture module calls.

An architecture module (engine/arch/*.py) describes a forward pass as a sequence of calls on a `Backend`;
the same code runs on NumPy (engine/backend_numpy.py) and CuPy (engine/backend_cupy.py).

Conventions every backend follows:

- Destination passing. Ops write into caller-owned `out=` arrays and return None (except `sample`).
  Activations live in a workspace the caller allocates once per model with `empty` for the largest prompt
  chunk; a chunk of n tokens uses views `buf[:n]`. Nothing in an op allocates memory the caller sees, so
  the GPU backend can capture one decode step in a CUDA graph and replay it (`compile_step`).
- Dtypes. Activations, norm weights and logits are float32. Token ids and positions are int32. The KV
  cache dtype is the backend's choice (float16 on the GPU, float32 on the CPU) or q8_0 when asked for (half the
  GPU's bytes); ops convert on write/read.
- Shapes are written in row-major (NumPy) order. A weight W of shape (m, k) is GGUF's ne = [k, m]: each of
  its m rows holds k values and `linear` computes x @ W.T.
- Positions come in as a backend array `start` of shape (1,) int32: the position of the first token of the
  chunk (= number of tokens already in the KV cache). Token i of the chunk sits at position start[0] + i.
  Keeping it in device memory lets a captured graph replay at every position; the host writes it with
  `copy_into` before each step.
- Choosing a backend: engine/model.py imports engine.backend_cupy lazily and expects `CupyBackend()` and
  `unavailable_reason() -> str | None` there (None when CuPy and a usable NVIDIA GPU are present, otherwise
  a plain sentence saying why not, shown to the person as the reason the CPU was chosen).
- "Array" below means the backend's array type (numpy.ndarray or cupy.ndarray). Inputs may be views;
  `out` is always a C-contiguous array or a leading-rows view `buf[:n]` of one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol

import numpy as np

from engine.errors import EngineError
from engine.gguf_file import GGUFTensor

Array = Any

@dataclass(frozen=True)
class MemoryInUse:
    """Bytes a backend holds for its model (uploads, caches, workspaces): host RAM and GPU memory."""

    host_bytes: int = 0
    device_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        return self.host_bytes + self.device_bytes


@dataclass
class ExpertCacheStats:
    """The GPU backend's cache of hot experts for the layers whose experts live in RAM (engine/expert_cache.py)."""

    slots_per_layer: int
    layers: int  # layers in RAM with slots (a layer of types the GPU cannot read has none)
    device_bytes: int
    experts_cached: int
    picks: int  # experts chosen by decoded tokens in those layers, as counted so far
    hits: int  # of them, the ones the cache held
    recent_hit_rate: float | None  # of the picks between the last two reads of the counts (a few dozen tokens)
    swaps: int  # experts uploaded into the cache


ROPE_NORMAL = "normal"  # rotate adjacent pairs (x[2i], x[2i+1]): llama GGUF, whose Q/K rows are permuted for it
ROPE_NEOX = "neox"  # rotate halves (x[i], x[i + rot_dim/2]): qwen2/qwen3/gemma3


@dataclass(frozen=True)
class SamplingParams:
    """How `Backend.sample` picks a token. Applied in this order (the order Hugging Face uses):

    1. repeat_penalty (1.0 = off): for every distinct id in `recent_tokens`, a logit > 0 is divided by it,
       a logit <= 0 multiplied by it.
    2. temperature <= 0: return the argmax (lowest id on ties); nothing below applies.
    3. logits / temperature.
    4. top_k > 0: keep the k highest logits (ties broken by lower id first).
    5. softmax over the kept tokens; top_p < 1: keep the smallest prefix, in descending probability, whose
       probability sum is >= top_p (always at least one token).
    6. min_p > 0: keep tokens whose probability is >= min_p * the highest probability.
    7. renormalize; with the kept tokens sorted by descending probability (ties: lower id first) and c their
       cumulative sum, return the first token whose c > uniform * c[-1].
    """

    temperature: float  # every field is given: the defaults live in engine.generate.GenerationSettings
    top_k: int
    top_p: float
    min_p: float
    repeat_penalty: float


class WeightHandle(Protocol):
    """A weight tensor after `Backend.upload`. The backend decides how it is stored (quantized on both;
    float32 for float tensors and vectors on the CPU); callers only pass it back into ops."""

    name: str
    shape: tuple[int, ...]  # row-major logical shape, e.g. (m, k) for a matrix, (k,) for a norm weight
    nbytes: int  # bytes the stored form takes in the backend's memory


@dataclass
class RopeTable:
    """Rotary cos/sin for positions [0, max_positions) made by `Backend.rope_table`, in backend memory."""

    cos: Array  # (max_positions, rot_dim / 2) float32
    sin: Array

    @property
    def rot_dim(self) -> int:
        """Leading dims of each head that rotate (== head_dim for full rotary)."""
        return 2 * self.cos.shape[1]

    @property
    def max_positions(self) -> int:
        return self.cos.shape[0]

    @property
    def nbytes(self) -> int:
        return int(self.cos.nbytes + self.sin.nbytes)


# The KV cache's element types: "full" is fp16 on the GPU and float32 on the CPU; "q8_0" keeps each 32 values of a
# row as int8 under an fp16 scale (GGUF's Q8_0 block: 34 bytes for 32 values), about half the GPU's bytes.
KV_CACHE_TYPES = ("full", "q8_0")
Q8_0_GROUP = 32


def check_kv_cache_type(kind: str, name: str = "The KV cache type") -> None:
    """Raise EngineError, in a sentence naming the types there are, unless kind is one of KV_CACHE_TYPES."""
    if kind not in KV_CACHE_TYPES:
        raise EngineError(f"{name} must be one of {', '.join(map(repr, KV_CACHE_TYPES))}, not {kind!r}.")


@dataclass
class KVCache:
    """Keys and values of every layer, made by `Backend.kv_cache`.

    Layout: `k` and `v` have shape (n_layers, n_kv_heads, max_tokens, head_dim) and the backend's cache dtype, or
    int8 for a q8_0 cache, whose `k_scale` and `v_scale` (n_layers, n_kv_heads, max_tokens, head_dim / 32) float16
    hold each 32 values' scale: the cache holds q * scale, as `reference.quantize_q8_0` rounds. Only
    `rope_attention` writes and reads them; the positions in use are the caller's bookkeeping (the cache does not
    know its own length).
    """

    k: Array
    v: Array
    k_scale: Array | None = None
    v_scale: Array | None = None

    n_layers = property(lambda self: self.k.shape[0])
    n_kv_heads = property(lambda self: self.k.shape[1])
    max_tokens = property(lambda self: self.k.shape[2])
    head_dim = property(lambda self: self.k.shape[3])
    dtype = property(lambda self: np.dtype(self.k.dtype))
    kind = property(lambda self: "q8_0" if self.k_scale is not None else "full")

    @property
    def nbytes(self) -> int:
        scales = 0 if self.k_scale is None else self.k_scale.nbytes + self.v_scale.nbytes
        return int(self.k.nbytes + self.v.nbytes + scales)

    def layer(self, i: int) -> tuple[KVCache, int]:
        """Where model layer i's entries are (a cache and its layer): here, at i (engine/kv_cache.py WindowedCache
        keeps two caches)."""
        return self, i


class Backend(Protocol):
    """The operations an architecture module may call. See the module docstring for conventions."""

    name: str  # "numpy" or "cupy"
    # True when ops only queue work on a device that runs apart from the host (generation then queues the next
    # decode step before reading the token it feeds); False when each op is done when it returns.
    asynchronous: bool

    # ---- memory -------------------------------------------------------------------------------------

    def empty(self, shape: tuple[int, ...], dtype: Any = np.float32) -> Array:
        """A new uninitialized C-contiguous array in backend memory."""

    def copy_into(self, dst: Array, src: np.ndarray) -> None:
        """Copy host array `src` into backend array `dst` of the same shape (converting dtype). Used to set
        the token ids and `start` of the next step without changing the buffers a graph captured."""

    def assign(self, dst: Array, src: Array | float) -> None:
        """dst[...] = src (an array of this backend, or a number), in order with the backend's other work."""

    def to_host(self, x: Array) -> np.ndarray:
        """A host NumPy copy of `x` (waits for pending work on the GPU)."""

    def upload(self, tensor: GGUFTensor, host: bool = False) -> WeightHandle:
        """Take a tensor from the GGUF file (its raw bytes, GGML type and logical shape) into backend memory; with
        `host`, into RAM for the CPU to compute on (a mixture's stacked experts that do not fit on the GPU: only
        `moe_ffn` takes such a handle).

        Must accept at least F32, F16, BF16, Q4_0, Q4_1, Q8_0 and the K-quants Q4_K, Q5_K, Q6_K; raises
        EngineError naming the tensor and its type otherwise.
        """

    def rope_table(self, inv_freq: np.ndarray, max_positions: int, attn_factor: float = 1.0) -> RopeTable:
        """Precompute rotary tables: angle[p, i] = p * inv_freq[i] for p < max_positions, i < rot_dim/2;
        cos and sin of it, each multiplied by attn_factor. `inv_freq` is float32 (rot_dim/2,), computed by
        the architecture (it folds in base, any rope_freqs tensor or frequency scaling)."""

    def kv_cache(self, n_layers: int, n_kv_heads: int, head_dim: int, max_tokens: int, kind: str = "full") -> KVCache:
        """Allocate the KV cache (see `KVCache` for the layout); kind is one of KV_CACHE_TYPES."""

    def memory_in_use(self) -> MemoryInUse:
        """What this backend's uploads, caches and workspaces hold."""

    def synchronize(self) -> None:
        """Wait until all queued work is done (no-op on the CPU)."""

    def compile_step(self, step: Callable[[], None]) -> Callable[[int], None]:
        """Return a callable with the same effect as `step`, given the position the step decodes (the GPU
        backend keeps one graph for shallow positions and one for deep ones). `step` must only call ops on fixed
        buffers (its inputs set with `copy_into` beforehand), so the GPU backend may capture it as a CUDA graph
        on the first call and replay it afterwards."""

    def close(self) -> None:
        """Free everything this backend allocated. Safe to call twice."""

    # ---- ops ----------------------------------------------------------------------------------------

    def embed(self, table: WeightHandle, tokens: Array, out: Array, scale: float = 1.0) -> None:
        """out[i, :] = table[tokens[i], :] * scale.

        table: (vocab, d) any supported type; tokens: (n,) int32; out: (n, d) float32.
        """

    def rms_norm(self, x: Array, weight: WeightHandle, eps: float, out: Array) -> None:
        """out = x / sqrt(mean(x**2, axis=-1) + eps) * weight, over the last axis.

        x: (..., d) float32 (e.g. (n, d), or (n, heads, head_dim) for per-head q/k norms); weight: (d,);
        out: same shape as x, may be x itself (in place).
        """

    def add_rms_norm(self, x: Array, residual: Array, weight: WeightHandle, eps: float, out: Array) -> None:
        """Residual add fused with the next norm: residual += x, then out = rms_norm(residual) * weight.

        x, residual, out: (n, d) float32; residual is updated in place; out must not alias x or residual.
        """

    def linear(self, x: Array, weight: WeightHandle, out: Array, bias: WeightHandle | None = None) -> None:
        """out = x @ weight.T (+ bias).

        x: (n, k) float32; weight: (m, k) any supported type; bias: (m,) or None; out: (n, m) float32,
        must not alias x.
        """

    def linears(self, x: Array, weights: list[WeightHandle], out: Array,
                biases: list[WeightHandle] | None = None) -> None:
        """`linear` of each weight in turn, their outputs side by side: out[:, lo_j:hi_j] = x @ weights[j].T (+
        biases[j]), lo_0 = 0 and hi_j - lo_j weights[j]'s rows (a backend may run some of them as one product).

        x: (n, k) float32; out: (n, sum of the rows) float32, must not alias x.
        """

    def gated_ffn(
        self,
        x: Array,
        gate: WeightHandle,
        up: WeightHandle,
        out: Array,
        scratch: Array,
        activation: str = "silu",
    ) -> None:
        """out = act(x @ gate.T) * (x @ up.T): SwiGLU (activation "silu") or GeGLU ("gelu_tanh").

        x: (n, k) float32; gate, up: (f, k); out, scratch: (n, f) float32. `scratch` is working space whose
        contents afterwards are unspecified; neither may alias x.
        """

    def moe_route(self, router_logits: Array, top_k: int, normalize: bool, weights_out: Array, ids_out: Array) -> None:
        """Pick each token's experts from its router logits.

        p = softmax(router_logits[i]) in float32; ids_out[i] = the top_k experts by p, highest first (ties:
        lower id first); weights_out[i] = p at those ids, divided by their sum when `normalize`.
        router_logits: (n, n_experts) float32; weights_out: (n, top_k) float32; ids_out: (n, top_k) int32.
        """

    def route_experts(self, x: Array, router: WeightHandle, n_experts: int, top_k: int, normalize: bool,
                      logits_out: Array, weights_out: Array, ids_out: Array) -> None:
        """The router's product, then the routing (a backend may run both as one): logits_out = x @ router.T, then
        `moe_route` of its first n_experts columns into weights_out and ids_out.

        x: (n, k) float32; router: (m, k), m >= n_experts (rows after the experts', such as a shared expert's gate,
        are computed, not routed); logits_out: (n, m) float32.
        """

    def moe_ffn(
        self,
        x: Array,
        gate_exps: WeightHandle,
        up_exps: WeightHandle,
        down_exps: WeightHandle,
        ids: Array,
        weights: Array,
        out: Array,
        scratch: Array,
        activation: str = "silu",
    ) -> None:
        """Mixture-of-experts gated FFN over stacked expert matrices, only the chosen experts computed:

            out[i] = sum_j weights[i, j] * down_exps[e] @ (act(gate_exps[e] @ x[i]) * (up_exps[e] @ x[i])),
            e = ids[i, j], act as in `gated_ffn`.

        x: (n, k) float32; gate_exps, up_exps: (n_experts, f, k) and down_exps: (n_experts, d, f), GGUF's
        stacked `ffn_*_exps` tensors (each expert's matrix is a contiguous slab of whole rows); ids: (n, top_k)
        int32; weights: (n, top_k) float32; out: (n, d) float32, must not alias x; scratch: (n, top_k, 2 f)
        float32 working space whose contents afterwards are unspecified.
        """

    def rope_attention(
        self,
        q: Array,
        k: Array,
        v: Array,
        rope: RopeTable,
        style: str,
        cache: KVCache,
        layer: int,
        start: Array,
        out: Array,
        scale: float,
        window: int = 0,
        qk_norm: tuple[WeightHandle, WeightHandle, float] | None = None,
    ) -> None:
        """Causal grouped-query attention of a chunk of n tokens at positions p = start[0] + i, with the rotary
        embedding and the KV-cache write (one op, so a backend may fuse them). qk_norm: (q weights, k weights, eps)
        of per-head RMS norms that q and k take first (`rms_norm` over each head's head_dim values, as Qwen3's
        QK-norm), or None; q and k may be left normed or not.

        q: (n, n_heads, head_dim) float32; k, v: (n, n_kv_heads, head_dim) float32 (views into the projection
        output, rows strided by its width, are fine). Only the first rope.rot_dim dims of each head rotate. style
        is ROPE_NORMAL (pairs (2j, 2j+1) rotate by angle j) or ROPE_NEOX (pairs (j, j + rot_dim/2)):
            (a, b) -> (a*cos - b*sin, a*sin + b*cos).
        Then cache.k[layer, :, r(p), :] = rotated k[i] and cache.v[layer, :, r(p), :] = v[i], and query i attends to
        cache positions j <= p (and j > p - window when window > 0, a sliding window), position j in row
        r(j) = j mod cache.max_tokens: a cache of fewer rows than positions is a ring, which window > 0 and
        cache.max_tokens >= window + n - 1 make enough (the rows a chunk overwrites are outside every window). n_heads must be a multiple
        of cache.n_kv_heads; query head h uses KV head h // (n_heads // n_kv_heads). Scores are
        (rotated q . k) * scale, softmax in float32. out: (n, n_heads * head_dim) float32, head-major (head h in
        columns [h*head_dim, (h+1)*head_dim)). q and k may be left rotated or not.
        The caller guarantees start[0] + n <= rope.max_positions, and start[0] + n <= cache.max_tokens or a ring.
        """

    def sample(self, logits: Array, params: SamplingParams, recent_tokens: np.ndarray, uniform: float) -> int:
        """Pick the next token id from logits (vocab,) float32 as `SamplingParams` describes and return it to
        the host. recent_tokens: host int32 array of the ids the repeat penalty applies to (may be empty);
        uniform: a number in [0, 1) drawn by the caller's seeded generator. Does not modify logits."""

    def sample_feed(
        self, logits: Array, params: SamplingParams, uniform: float, ids: Array, position: int
    ) -> Callable[[], int]:
        """Pick like `sample` (params.repeat_penalty must be 1: the history it needs stays on the host) and write
        [position, id] into ids[:2], the next decode step's input (the workspace's ids). Returns a function that
        gives the id on the host. The GPU backend returns before the id is known, so a decode step queued before
        that function is called runs while the host works on the token before it."""

    # ---- hybrid models' recurrent layers (Gated DeltaNet: qwen35, qwen35moe, qwen3next) --------------

    def delta_mixer(
        self, qkv: Array, z: Array, ba: Array, conv: WeightHandle, conv_state: Array, dt_bias: WeightHandle,
        ssm_a: WeightHandle, norm: WeightHandle, eps: float, state: Array, mixed: Array, out: Array, n_k_heads: int,
        tiled: bool,
    ) -> None:
        """A Gated DeltaNet mixer's core over a chunk of n tokens, between its input and output projections,
        continuing from `conv_state` and `state` (H value heads, dk, dv):

          1. causal depthwise convolution with SiLU, from the inputs before the chunk:
               w = [conv_state; qkv] (n + K - 1 rows);  mixed[t, c] = silu(sum_j conv[c, j] w[t + j, c]);
               conv_state = w[-(K - 1):];
          2. the gated delta rule on mixed's heads:
               q, k = L2-normalised (eps 1e-6) query and key heads, q also scaled by dk^-1/2;
               beta = sigmoid(b), g = ssm_a * softplus(a + dt_bias)   (ssm_a as GGUF stores it: -exp(A_log));
               per token t and value head h, with S = state[h]:
                 S = exp(g[t, h]) S;  S += k[t, h] (beta[t, h] (v[t, h] - S^T k[t, h]))^T;  o[t, h] = S^T q[t, h];
          3. out[t, h] = rms_norm(o[t, h]) * norm * silu(z[t, h])   (eps `eps`).

        qkv: (n, conv_dim) float32, conv_dim = 2 n_k_heads dk + H dv: n_k_heads query heads, as many key heads, then H
        value heads; value head h reads key head h % n_k_heads when `tiled` (llama.cpp's qwen35 files order them so),
        else h // (H / n_k_heads) (qwen3next files). z: (n, H dv); ba: (n, 2 H), b (beta logits) then a (decay
        logits); qkv, z and ba may be column views of one projection. conv: (conv_dim, K), GGUF's `ssm_conv1d` ne =
        [K, conv_dim]; conv_state: (K - 1, conv_dim) float32, oldest first, zeros at a sequence's start; dt_bias, ssm_a:
        (H,); norm: (dv,); state: (H, dk, dv) float32, zeros at a sequence's start; both states updated in place.
        mixed: (n, conv_dim) float32 scratch (a backend may leave it unwritten); out: (n, H dv) float32, head-major.
        Accumulation in float32; a backend may run the delta rule one token at a time or in whole chunks
        (engine/kernels/reference.py has both forms, which agree to float32 rounding; the GPU's chunked form takes
        fp16 operands in its products, about 3e-4 relative).
        """

    def sigmoid_gate(self, x: Array, gate: Array, out: Array, accumulate: bool = False) -> None:
        """out = x * sigmoid(gate), or out += x * sigmoid(gate) when `accumulate`.

        x, out: (n, m) float32, out may be x (when not accumulating); gate: (n, m), or (n, 1) broadcast over the row
        (the gated attention output and the shared expert's gate). Inputs may be column views of wider rows.
        """


def norm_qk(backend: Backend, q: Array, k: Array, qk_norm: tuple[WeightHandle, WeightHandle, float]) -> None:
    """Backend.rope_attention's qk_norm applied to q and k in place, by `rms_norm`, for a form that does not take it."""
    q_norm, k_norm, eps = qk_norm
    backend.rms_norm(q, q_norm, eps, q)
    backend.rms_norm(k, k_norm, eps, k)


def route_after_product(backend: Backend, x: Array, router: WeightHandle, n_experts: int, top_k: int,
                        normalize: bool, logits_out: Array, weights_out: Array, ids_out: Array) -> None:
    """Backend.route_experts as `linear`, then `moe_route`."""
    backend.linear(x, router, logits_out)
    backend.moe_route(logits_out[:, :n_experts], top_k, normalize, weights_out, ids_out)


def linear_each(backend: Backend, x: Array, weights: list[WeightHandle], out: Array,
                biases: list[WeightHandle] | None = None) -> None:
    """Backend.linears as one `linear` a weight."""
    lo = 0
    for j, weight in enumerate(weights):
        hi = lo + weight.shape[0]
        backend.linear(x, weight, out[:, lo:hi], biases[j] if biases else None)
        lo = hi
