// Token sampling on the GPU; only the chosen id goes back to the host. Follows SamplingParams in
// engine/backend.py: repeat penalty, then argmax (temperature <= 0) or top-k candidates (ties: lower id
// first), softmax at the temperature, top-p, min-p, and the pick against one uniform number.

// out = logits with the repeat penalty applied to every id listed in ids (duplicates count once, as the
// membership test sees each vocabulary entry once).
extern "C" __global__ void repeat_penalty(const float* __restrict__ logits, float* __restrict__ out,
                                          const int* __restrict__ ids, int n_ids, float penalty, int vocab) {
    grid_dependency_sync();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= vocab) return;
    float v = logits[i];
    for (int t = 0; t < n_ids; ++t) {
        if (__ldg(ids + t) == i) {
            v = v > 0.0f ? v / penalty : v * penalty;
            break;
        }
    }
    out[i] = v;
}

// (value, id) order: higher value first, then lower id.
__device__ __forceinline__ bool better(float v, int i, float bv, int bi) { return v > bv || (v == bv && i < bi); }

// Block-wide best (value, id) of the per-thread candidates; every thread gets the result.
__device__ void block_best(float& v, int& i, float* sv, int* si) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xFFFFFFFFu, v, o);
        const int oi = __shfl_xor_sync(0xFFFFFFFFu, i, o);
        if (better(ov, oi, v, i)) { v = ov; i = oi; }
    }
    const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
    if (lane == 0) { sv[warp] = v; si[warp] = i; }
    __syncthreads();
    v = lane < blockDim.x / 32 ? sv[lane] : NEG_INF;
    i = lane < blockDim.x / 32 ? si[lane] : 0x7FFFFFFF;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xFFFFFFFFu, v, o);
        const int oi = __shfl_xor_sync(0xFFFFFFFFu, i, o);
        if (better(ov, oi, v, i)) { v = ov; i = oi; }
    }
    __syncthreads();
}

// The best of the entries first, first + stride, ... below n, skipping those already taken (value set to -inf by
// topk).
__device__ __forceinline__ void local_best(const float* v, int n, int first, int stride, float& bv, int& bi) {
    bv = NEG_INF;
    bi = 0x7FFFFFFF;
    for (int i = first; i < n; i += stride)
        if (better(v[i], i, bv, bi)) { bv = v[i]; bi = i; }
}

__device__ __forceinline__ void emit(int id, int* __restrict__ out_id, int* __restrict__ feed, int position) {
    out_id[0] = id;
    if (feed != nullptr) {
        feed[0] = position;
        feed[1] = id;
    }
}

// The argmax (lowest id on ties) over a grid of blocks, each taking a strided share of v: each block leaves its
// best in scratch (values as float bits in [0, blocks), ids in [blocks, 2 blocks)), and the last block to count
// itself in at scratch[2 blocks] (zero before the launch, reset by that block) picks the best of those. One
// block would read the whole vocabulary through one SM.
extern "C" __global__ void argmax(const float* __restrict__ v, int n, unsigned* scratch, int* __restrict__ out_id,
                                  int* __restrict__ feed, int position) {
    grid_dependency_sync();
    __shared__ float sv[32];
    __shared__ int si[32];
    __shared__ bool last;
    float bv;
    int bi;
    local_best(v, n, blockIdx.x * blockDim.x + threadIdx.x, gridDim.x * blockDim.x, bv, bi);
    block_best(bv, bi, sv, si);
    const unsigned blocks = gridDim.x;
    if (threadIdx.x == 0) {
        scratch[blockIdx.x] = __float_as_uint(bv);
        scratch[blocks + blockIdx.x] = (unsigned)bi;
        __threadfence();
        last = atomicAdd(scratch + 2 * blocks, 1u) == blocks - 1;
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    bv = threadIdx.x < blocks ? __uint_as_float(__ldcg(scratch + threadIdx.x)) : NEG_INF;
    bi = threadIdx.x < blocks ? (int)__ldcg(scratch + blocks + threadIdx.x) : 0x7FFFFFFF;
    block_best(bv, bi, sv, si);
    if (threadIdx.x == 0) {
        scratch[2 * blocks] = 0;
        // All-NaN logits leave no candidate; answer id 0 rather than an id outside the vocabulary.
        emit(bi == 0x7FFFFFFF ? 0 : bi, out_id, feed, position);
    }
}

// One block: the k best entries of v in order. v is consumed (taken entries become -inf); only the thread
// that owned the winner rescans its entries each round, so a round costs one block reduction.
extern "C" __global__ void topk(float* __restrict__ v, int n, int k, float* __restrict__ out_v,
                                int* __restrict__ out_id) {
    grid_dependency_sync();
    __shared__ float sv[32];
    __shared__ int si[32];
    float mv;
    int mi;
    local_best(v, n, threadIdx.x, blockDim.x, mv, mi);
    for (int r = 0; r < k; ++r) {
        float bv = mv;
        int bi = mi;
        block_best(bv, bi, sv, si);
        if (threadIdx.x == 0) { out_v[r] = bv; out_id[r] = bi == 0x7FFFFFFF ? 0 : bi; }
        if (bi != 0x7FFFFFFF && bi % blockDim.x == threadIdx.x) {
            v[bi] = NEG_INF;
            local_best(v, n, threadIdx.x, blockDim.x, mv, mi);
        }
    }
}

// Inclusive block scan of one value per thread; returns the scan and sets total.
__device__ float block_scan(float x, float* sh, float& total) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x & 31, n_warps = blockDim.x / 32;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const float y = __shfl_up_sync(0xFFFFFFFFu, x, o);
        if (lane >= o) x += y;
    }
    if (lane == 31) sh[warp] = x;
    __syncthreads();
    if (warp == 0) {
        float w = lane < n_warps ? sh[lane] : 0.0f;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const float y = __shfl_up_sync(0xFFFFFFFFu, w, o);
            if (lane >= o) w += y;
        }
        if (lane < n_warps) sh[lane] = w;
    }
    __syncthreads();
    if (warp > 0) x += sh[warp - 1];
    total = sh[n_warps - 1];
    __syncthreads();
    return x;
}

// First index i < n where prefix_sum(p)[i] > target (or >= when inclusive_eq), else n. p_i is recomputed as
// exp((vals[i] - vals[0]) * inv_temp).
__device__ int first_cross(const float* vals, int n, float inv_temp, float target, bool ge, float* sh, int* found) {
    if (threadIdx.x == 0) *found = n;
    __syncthreads();
    float run = 0.0f;
    for (int base = 0; base < n; base += blockDim.x) {
        const int i = base + threadIdx.x;
        const float p = i < n ? expf((vals[i] - vals[0]) * inv_temp) : 0.0f;
        float total;
        const float c = run + block_scan(p, sh, total);
        if (i < n && (ge ? c >= target : c > target)) atomicMin(found, i);
        run += total;
        __syncthreads();
        if (*found < n) break;
    }
    return *found;
}

// One block over candidates sorted best first: softmax at the temperature, keep the top-p prefix and the
// min-p prefix (probabilities are decreasing, so both are prefixes), pick the first kept candidate whose
// cumulative probability exceeds u times the kept total.
extern "C" __global__ void sample_sorted(const float* __restrict__ vals, const int* __restrict__ ids, int n,
                                         float inv_temp, float top_p, float min_p, float u,
                                         int* __restrict__ out_id, int* __restrict__ feed, int position) {
    grid_dependency_sync();
    __shared__ float sh[32];
    __shared__ int found;
    float total = 0.0f;
    for (int base = 0; base < n; base += blockDim.x) {
        const int i = base + threadIdx.x;
        float t;
        block_scan(i < n ? expf((vals[i] - vals[0]) * inv_temp) : 0.0f, sh, t);
        total += t;
    }
    int keep = n;
    if (top_p < 1.0f) keep = min(keep, first_cross(vals, n, inv_temp, top_p * total, true, sh, &found) + 1);
    if (min_p > 0.0f) {
        // p_i / p_0 >= min_p, p_0 = 1 here; the first index that fails ends the kept prefix.
        if (threadIdx.x == 0) found = n;
        __syncthreads();
        for (int i = threadIdx.x; i < n; i += blockDim.x)
            if (expf((vals[i] - vals[0]) * inv_temp) < min_p) atomicMin(&found, i);
        __syncthreads();
        keep = min(keep, max(found, 1));
        __syncthreads();
    }
    float kept = 0.0f;
    for (int base = 0; base < keep; base += blockDim.x) {
        const int i = base + threadIdx.x;
        float t;
        block_scan(i < keep ? expf((vals[i] - vals[0]) * inv_temp) : 0.0f, sh, t);
        kept += t;
    }
    const int pick = first_cross(vals, keep, inv_temp, u * kept, false, sh, &found);
    if (threadIdx.x == 0) emit(ids[min(pick, keep - 1)], out_id, feed, position);
}

// Mixture-of-experts routing of one token by one warp (engine/backend.py moe_route): p = softmax of the router
// logits in float32, the top_k experts by p (highest first, ties: lower id), their p divided by the picked sum when
// normalize. p: n_experts floats of shared memory. Taken entries are set to -1 (below any probability); an id stays
// in range even for NaN logits.
__device__ void route_token(const float* row, int n_experts, int top_k, int normalize, float* p,
                            float* __restrict__ weights_out, int* __restrict__ ids_out) {
    const int lane = threadIdx.x & 31;
    float m = NEG_INF;
    for (int i = lane; i < n_experts; i += 32) m = fmaxf(m, __ldcg(row + i));
    m = warp_max(m);
    float sum = 0.0f;
    for (int i = lane; i < n_experts; i += 32) {
        p[i] = expf(__ldcg(row + i) - m);
        sum += p[i];
    }
    sum = warp_sum(sum);
    for (int i = lane; i < n_experts; i += 32) p[i] /= sum;
    __syncwarp();
    float picked = 0.0f;
    for (int j = 0; j < top_k; ++j) {
        float bv = -0.5f;
        int bi = 0x7FFFFFFF;
        for (int i = lane; i < n_experts; i += 32)
            if (better(p[i], i, bv, bi)) { bv = p[i]; bi = i; }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(0xFFFFFFFFu, bv, o);
            const int oi = __shfl_xor_sync(0xFFFFFFFFu, bi, o);
            if (better(ov, oi, bv, bi)) { bv = ov; bi = oi; }
        }
        if (bi >= n_experts) bi = j;
        if (lane == 0) {
            ids_out[j] = bi;
            weights_out[j] = p[bi];
            picked += p[bi];
            p[bi] = -1.0f;
        }
        __syncwarp();
    }
    if (lane == 0 && normalize)
        for (int j = 0; j < top_k; ++j) weights_out[j] /= picked;
}

// A block-wide reduction (max, or sum) of every thread's v; red: 32 floats of shared memory.
template <bool MAX>
__device__ __forceinline__ float block_reduce(float v, float* red) {
    v = MAX ? warp_max(v) : warp_sum(v);
    __syncthreads();  // red is free (an earlier reduction's readers are done)
    if ((threadIdx.x & 31) == 0) red[threadIdx.x / 32] = v;
    __syncthreads();
    v = red[0];
    for (int w = 1; w < blockDim.x / 32; ++w) v = MAX ? fmaxf(v, red[w]) : v + red[w];
    return v;
}

// route_token's work by a whole block, in a fixed number of steps rather than top_k rounds of a warp's argmax: p
// (n_experts floats of shared memory) as there, then each entry's rank in the (p descending, id ascending) order,
// counted against every other entry, and the entries ranked below top_k write themselves. picked: top_k floats of
// shared memory, red: 32. A NaN p ranks below every number, so ids stay distinct and in range. The logits are read
// through L2 (__ldcg): in router_route other blocks of the same kernel wrote them.
__device__ void route_block(const float* row, int n_experts, int top_k, int normalize, float* p, float* picked,
                            float* red, float* __restrict__ weights_out, int* __restrict__ ids_out) {
    float m = NEG_INF;
    for (int i = threadIdx.x; i < n_experts; i += blockDim.x) m = fmaxf(m, p[i] = __ldcg(row + i));
    m = block_reduce<true>(m, red);
    float sum = 0.0f;
    for (int i = threadIdx.x; i < n_experts; i += blockDim.x) sum += p[i] = expf(p[i] - m);
    sum = block_reduce<false>(sum, red);
    for (int i = threadIdx.x; i < n_experts; i += blockDim.x) {
        const float v = p[i] / sum;
        p[i] = v == v ? v : -1.0f;
    }
    __syncthreads();
    for (int i = threadIdx.x; i < n_experts; i += blockDim.x) {
        const float v = p[i];
        int rank = 0;
#pragma unroll 8
        for (int j = 0; j < n_experts; ++j) rank += better(p[j], j, v, i);
        if (rank < top_k) {
            ids_out[rank] = i;
            picked[rank] = v;
        }
    }
    __syncthreads();
    if (threadIdx.x < top_k) {
        float total = 0.0f;  // in route_token's order
        for (int j = 0; j < top_k; ++j) total += picked[j];
        weights_out[threadIdx.x] = normalize ? picked[threadIdx.x] / total : picked[threadIdx.x];
    }
}

// route_token for each token, one warp a token, 4 tokens a block, so no step waits on a block-wide barrier. stride:
// the logits' row stride (a router whose product also holds the shared expert's gate has a column more).
extern "C" __global__ void moe_route(const float* __restrict__ logits, long stride, int n_tokens, int n_experts,
                                     int top_k, int normalize, float* __restrict__ weights_out,
                                     int* __restrict__ ids_out) {
    grid_dependency_sync();
    extern __shared__ float shared[];
    const int warp = threadIdx.x / 32;
    const long token = (long)blockIdx.x * (blockDim.x / 32) + warp;
    if (token >= n_tokens) return;
    route_token(logits + token * stride, n_experts, top_k, normalize, shared + warp * n_experts,
                weights_out + token * top_k, ids_out + token * top_k);
}

// A decode step's router product and its routing in one launch (engine/backend.py route_experts, one token): a
// warp a row of the router's float weights (m rows: the experts', then any more, such as a shared expert's gate),
// logits = w . x; then the last block to finish (done: a counter it leaves at zero again) routes the token on the
// first n_experts logits (route_block). The weights never depend on the kernel before, so each lane loads its first
// ROUTER_EARLY groups of 8 weights before grid_dependency_sync (plain loads: see ld16_early), and the wait overlaps
// them. Session 14's one-launch router, with neither the early loads nor route_block, cost what the product and
// moe_route cost apart; with both, a synthetic Qwen3-30B-A3B's decode step at 4,096 keys fell from 2.9725 to 2.7846
// ms (H100, bench/results/2026-12-07_s22call3_ab.jsonl). n_experts + top_k floats of dynamic shared memory.
#define ROUTER_EARLY 8
template <class W>
__device__ __forceinline__ void router_route(const typename W::T* w, const float* __restrict__ x, float* logits,
                                             int m, int k, int n_experts, int top_k, int normalize,
                                             float* __restrict__ weights_out, int* __restrict__ ids_out, u32* done) {
    extern __shared__ float probs[];  // n_experts, then top_k picked
    __shared__ float red[32];
    __shared__ bool last;
    const int lane = threadIdx.x & 31, row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, groups = k / 8;
    const typename W::T* wr = w + (long)row * k;
    uint4 early[ROUTER_EARLY][W::WORDS16];
#pragma unroll
    for (int i = 0; i < ROUTER_EARLY; ++i)
        if (row < m && lane + 32 * i < groups)
#pragma unroll
            for (int u = 0; u < W::WORDS16; ++u)
                early[i][u] = ld16_early(wr + 8 * (lane + 32 * i) + u * 8 / W::WORDS16);
    grid_dependency_sync();
    if (row < m) {
        float acc = 0.0f;
        auto add = [&](int c, const float (&v)[8]) {
            const float4 xa = __ldg(reinterpret_cast<const float4*>(x + 8 * c));
            const float4 xb = __ldg(reinterpret_cast<const float4*>(x + 8 * c + 4));
            const float xv[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};
#pragma unroll
            for (int e = 0; e < 8; ++e) acc = fmaf(v[e], xv[e], acc);
        };
#pragma unroll
        for (int i = 0; i < ROUTER_EARLY; ++i)
            if (lane + 32 * i < groups) {
                float v[8];
                W::unpack8(early[i], v);
                add(lane + 32 * i, v);
            }
        for (int c = lane + 32 * ROUTER_EARLY; c < groups; c += 32) {
            float v[8];
            W::load8(w, (long)row * k + 8 * c, v);
            add(c, v);
        }
        acc = warp_sum(acc);
        if (lane == 0) {
            logits[row] = acc;
            __threadfence();  // visible to the last block before this block's count
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(done, 1u) == gridDim.x - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    route_block(logits, n_experts, top_k, normalize, probs, probs + n_experts, red, weights_out, ids_out);
    if (threadIdx.x == 0) *done = 0;
}

#define ROUTER_ROUTE(name, W)                                                                                  \
    extern "C" __global__ void router_route_##name(const W::T* w, const float* x, float* logits, int m, int k,  \
                                                   int n_experts, int top_k, int normalize, float* weights_out, \
                                                   int* ids_out, u32* done) {                                  \
        router_route<W>(w, x, logits, m, k, n_experts, top_k, normalize, weights_out, ids_out, done);           \
    }
FOR_EACH_FLOAT(ROUTER_ROUTE)

// One token's chosen experts of a layer whose experts live in RAM, some cached on the GPU (engine/expert_cache.py):
// slot_of[e] is expert e's slot in the layer's cache or -1. The GPU computes the cached ones (slots, -1 for the
// others) and the first of the others, reading them over the bus (bus_ids, -1 for the rest); the host the rest,
// from page-locked memory this writes directly (host_ids, -1 for the others, and the routing weights). The bus
// takes `bus` of top_k misses, and of fewer misses the same share, rounded to nearest, so a cache hit takes work
// off the host's cores and the bus alike (the first `bus` misses would leave the host idle at a high hit rate).
// uses[e] counts expert e's picks and uses[n_experts] the picks the cache held. One thread a pick (top_k <= 32).
extern "C" __global__ void moe_cache_ids(const int* __restrict__ ids, const float* __restrict__ weights,
                                         const int* __restrict__ slot_of, int top_k, int n_experts, int bus,
                                         int* __restrict__ slots, int* __restrict__ bus_ids, volatile int* host_ids,
                                         volatile float* host_weights, unsigned* __restrict__ uses) {
    grid_dependency_sync();
    const int j = threadIdx.x;
    const int e = j < top_k ? ids[j] : 0, s = j < top_k ? slot_of[e] : 0;
    const unsigned missed = __ballot_sync(0xFFFFFFFFu, s < 0);
    if (j >= top_k) return;
    const int share = (__popc(missed) * bus + top_k / 2) / top_k;
    const bool over_bus = s < 0 && __popc(missed & ((1u << j) - 1u)) < share;
    slots[j] = s;
    bus_ids[j] = over_bus ? e : -1;
    host_ids[j] = s < 0 && !over_bus ? e : -1;
    host_weights[j] = weights[j];
    atomicAdd(uses + e, 1u);
    if (s >= 0) atomicAdd(uses + n_experts, 1u);
    __threadfence_system();  // the host's share is in its memory before the host call that hands it over
}
