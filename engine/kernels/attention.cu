// Causal grouped-query attention over the fp16 KV cache.
//
// attention_partial: each warp one (query, head, split) item; a decode query spreads its keys over 32 warps of 8
// blocks, a prompt chunk's queries take one warp each (four consecutive queries of a head per block share their
// K/V rows through L1). The splits are then merged and normalized (merge_splits): for decode by the head's 8
// blocks as one cluster (attention_decode, sm_90+) or by the head's last block to finish (older GPUs), either of
// which also quantizes the output for the output projection; for a prompt chunk by attention_combine.
// attention_decode also does rope_store_kv's work for its token (rotating q and k, storing k and v), which saves
// that launch. Deep decode steps (on sm_90 from cuda.DEEP_DECODE_KEYS on, before it for caches of SPLIT_CONTEXT
// positions or more) are split by KV head instead, each block serving a KV head's whole query group so the keys are
// read once: attention_decode_deep on tensor cores (sm_80+), attention_decode_split before sm_80. Prompt chunks on
// sm_80+ go to flash_attention.cu instead of attention_partial.
//
// Key ranges come from start[0] in device memory, so one captured graph serves every position; splits past
// the range are empty and leave max = -inf, sum = 0.

#define MAX_SPLITS 64

// One output dim merged from n_splits partial results: sum_s value(s) 2^(m_s - M) / sum_s l_s 2^(m_s - M), M the
// largest m_s (an empty split, max -inf and sum 0, adds nothing). m and l: the splits' maxima and sums.
template <class Value>
__device__ __forceinline__ float merge_splits(const float* m, const float* l, int n_splits, Value value) {
    // Four partial maxima and sums: dependent chains a quarter as long (a decode query's 32 splits).
    float mx[4] = {NEG_INF, NEG_INF, NEG_INF, NEG_INF};
    float num[4] = {0.0f, 0.0f, 0.0f, 0.0f}, den[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll 8
    for (int s0 = 0; s0 < n_splits; s0 += 4)
#pragma unroll
        for (int j = 0; j < 4; ++j)
            if (s0 + j < n_splits) mx[j] = fmaxf(mx[j], m[s0 + j]);
    const float top = fmaxf(fmaxf(mx[0], mx[1]), fmaxf(mx[2], mx[3]));
#pragma unroll 8  // every load issued before the first is used
    for (int s0 = 0; s0 < n_splits; s0 += 4)
#pragma unroll
        for (int j = 0; j < 4; ++j)
            if (s0 + j < n_splits) {
                const float f = exp2f(m[s0 + j] - top);
                den[j] += l[s0 + j] * f;
                num[j] += value(s0 + j) * f;
            }
    return ((num[0] + num[1]) + (num[2] + num[3])) / ((den[0] + den[1]) + (den[2] + den[3]));
}

// Merge the n_splits partial results p of one (query, head) (each acc[hd], m, l), the block's threads over the
// dims (a whole warp per 32 of them). With xq each warp also quantizes its 32 outputs (groups first_group ..) for
// the output projection. Reads through L2 (__ldcg): in the last-block decode form other blocks wrote p during
// this kernel.
__device__ __forceinline__ void combine_splits(const float* p, int n_splits, int hd, float* out, signed char* xq,
                                               signed char* xq2, float2* xds, long first_group) {
    __shared__ float sm[MAX_SPLITS], sl[MAX_SPLITS];
    for (int s = threadIdx.x; s < n_splits; s += blockDim.x) {
        sm[s] = __ldcg(p + s * (hd + 2) + hd);
        sl[s] = __ldcg(p + s * (hd + 2) + hd + 1);
    }
    __syncthreads();
    for (int d0 = 0; d0 + (int)(threadIdx.x & ~31u) < hd; d0 += blockDim.x) {  // whole warps
        const int d = d0 + threadIdx.x;
        const float o = merge_splits(sm, sl, n_splits, [&](int s) { return __ldcg(p + s * (hd + 2) + d); });
        out[d] = o;
        if (xq != nullptr) quantize_group(o, first_group + d / 32, xq, xq2, xds);
    }
}

// One block's partial result for each query head h < group of its KV head, from its 4 warps' (acc, max, sum) in
// shared memory (acc[(w rows + h) HD + d], m[w rows + h], l likewise) and, where own_s is not null, the step's own
// token (score own_s[h], value own_v): HD + 2 floats at part + h n_splits (HD + 2), the block's split's place.
template <int HD>
__device__ __forceinline__ void store_block_partial(const float* acc, const float* m, const float* l, int rows,
                                                    const float* own_s, const float* own_v, int group, float* part,
                                                    int n_splits) {
    for (int i = threadIdx.x; i < group * (HD + 2); i += blockDim.x) {
        const int h = i / (HD + 2), d = i % (HD + 2);
        float top = own_s != nullptr ? own_s[h] : NEG_INF, f[5];
#pragma unroll
        for (int w = 0; w < 4; ++w) top = fmaxf(top, m[w * rows + h]);
#pragma unroll
        for (int w = 0; w < 4; ++w) f[w] = exp2f(m[w * rows + h] - top);
        f[4] = own_s != nullptr ? exp2f(own_s[h] - top) : 0.0f;
        float v = d == HD ? top : 0.0f;
        if (d != HD) {
#pragma unroll
            for (int w = 0; w < 4; ++w) v += (d < HD ? acc[(w * rows + h) * HD + d] : l[w * rows + h]) * f[w];
            if (own_s != nullptr) v += (d < HD ? own_v[d] : 1.0f) * f[4];
        }
        part[(long)h * n_splits * (HD + 2) + d] = v;
    }
}

// attention_decode_split's merge. After every block of a KV head wrote its partial results (part: per query head of
// the group, n_splits of HD + 2 floats, the first `active` of them written): the head's last block to finish
// (counted in done[kvh], left at zero for the next launch) merges them and quantizes the output. All heads of the group at once: each warp takes a
// head's maxima and sums (a lane per split) and leaves each split's weight, exp2(m_s - top) / sum, in shared
// memory; then every thread sums its MERGE_OUTPUTS outputs' values over the splits, loading MERGE_SPLITS splits'
// values at once, so the merge takes a round trip to L2 per MERGE_SPLITS splits (the last block to finish does it
// alone, while the rest of the GPU waits: with two splits' values in flight it took 13.7 us of a 22 us kernel, 33
// splits of a group of 8 heads, H100).
#define MERGE_OUTPUTS 8
#define MERGE_SPLITS 8
template <int HD>
__device__ __forceinline__ void merge_group_splits(const float* part, u32* done, int kvh, int group, int n_splits,
                                                   int active, float* out, signed char* xq, signed char* xq2,
                                                   float2* xds) {
    constexpr int ROW = HD + 2;
    __shared__ bool last;
    __shared__ float weight[16][MAX_SPLITS];
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        last = atomicAdd(done + kvh, 1u) == active - 1;
        if (last) done[kvh] = 0;
    }
    __syncthreads();
    if (!last) return;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const float* base = part + (long)kvh * group * n_splits * ROW;
    for (int h = warp; h < group; h += blockDim.x >> 5) {
        float m[MAX_SPLITS / 32], l[MAX_SPLITS / 32];
#pragma unroll
        for (int j = 0; j < MAX_SPLITS / 32; ++j) {
            const int sp = lane + 32 * j;
            m[j] = sp < active ? __ldcg(base + ((long)h * n_splits + sp) * ROW + HD) : NEG_INF;
            l[j] = sp < active ? __ldcg(base + ((long)h * n_splits + sp) * ROW + HD + 1) : 0.0f;
        }
        float top = NEG_INF, den = 0.0f;
#pragma unroll
        for (int j = 0; j < MAX_SPLITS / 32; ++j) top = fmaxf(top, m[j]);
        top = warp_max(top);
#pragma unroll
        for (int j = 0; j < MAX_SPLITS / 32; ++j) den += l[j] * exp2f(m[j] - top);
        den = warp_sum(den);
#pragma unroll
        for (int j = 0; j < MAX_SPLITS / 32; ++j) weight[h][lane + 32 * j] = exp2f(m[j] - top) / den;
    }
    __syncthreads();
    // Outputs i = i0 + r blockDim.x: a warp's 32 lanes hold 32 consecutive dims of one head (HD a multiple of 32),
    // the group quantize_group takes.
    for (int i0 = threadIdx.x; i0 < group * HD; i0 += MERGE_OUTPUTS * blockDim.x) {
        float acc[MERGE_OUTPUTS] = {};
        for (int s0 = 0; s0 < active; s0 += MERGE_SPLITS) {
            float v[MERGE_SPLITS][MERGE_OUTPUTS];
#pragma unroll
            for (int s = 0; s < MERGE_SPLITS; ++s)
#pragma unroll
                for (int r = 0; r < MERGE_OUTPUTS; ++r) {
                    const int i = i0 + r * blockDim.x;
                    v[s][r] = s0 + s < active && i < group * HD
                                  ? __ldcg(base + ((long)(i / HD) * n_splits + s0 + s) * ROW + i % HD) : 0.0f;
                }
            // (An output past the group weighs its zero value by some head's weight: % 16 keeps the row in range.)
#pragma unroll
            for (int s = 0; s < MERGE_SPLITS; ++s)
#pragma unroll
                for (int r = 0; r < MERGE_OUTPUTS; ++r)
                    if (s0 + s < active) acc[r] = fmaf(v[s][r], weight[(i0 + r * blockDim.x) / HD % 16][s0 + s], acc[r]);
        }
#pragma unroll
        for (int r = 0; r < MERGE_OUTPUTS; ++r) {
            const int i = i0 + r * blockDim.x;
            if (i >= group * HD) break;  // the same for the 32 lanes of a warp
            const long o = (long)kvh * group * HD + i;
            out[o] = acc[r];
            if (xq != nullptr) quantize_group(acc[r], o / 32, xq, xq2, xds);
        }
    }
}

// merge_group_splits' work shared by the KV head's blocks instead of left to its last one (attention_decode_deep):
// after writing its partial results each of the head's `active` blocks counts itself in done[kvh] and waits until
// all have (the launch is one wave, cuda.deep_decode_splits, so every block is resident and the wait ends); then
// warp w of the block of split b merges slices c = DEEP_WARPS b + w, + DEEP_WARPS active, ... of the group's HD / 32
// slices of 32 dims a head, a lane a dim, and quantizes them for the output projection. Lane s holds split s's (and
// s + 32's) maximum and sum, every split's value of a lane's dim is loaded at once, so the merge is about one round
// trip to L2. done[n_kv + kvh] counts the blocks leaving; the last zeroes both counts for the next launch.
template <int HD, int WARPS>
__device__ __forceinline__ void merge_splits_together(const float* part, u32* done, int kvh, int n_kv, int group,
                                                      int n_splits, int split, int active, float* out,
                                                      signed char* xq, signed char* xq2, float2* xds) {
    constexpr int ROW = HD + 2, SLICES = HD / 32;
    static_assert(MAX_SPLITS == 64, "a lane holds two splits' maxima and sums");
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        atomicAdd(done + kvh, 1u);
        u32 arrived = 0;
        do asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(arrived) : "l"(done + kvh) : "memory");
        while (arrived < (u32)active);
    }
    __syncthreads();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    for (int c = WARPS * split + warp; c < group * SLICES; c += WARPS * active) {
        const int h = c / SLICES, d = 32 * (c % SLICES) + lane;
        const float* rows = part + ((long)kvh * group + h) * n_splits * ROW;
        float m[2], l[2], v[2][32];
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            const int sp = lane + 32 * j;
            m[j] = sp < active ? __ldcg(rows + (long)sp * ROW + HD) : NEG_INF;
            l[j] = sp < active ? __ldcg(rows + (long)sp * ROW + HD + 1) : 0.0f;
            if (32 * j < active)
#pragma unroll
                for (int s = 0; s < 32; ++s)
                    v[j][s] = 32 * j + s < active ? __ldcg(rows + (long)(32 * j + s) * ROW + d) : 0.0f;
        }
        const float top = warp_max(fmaxf(m[0], m[1]));
        float w[2] = {exp2f(m[0] - top), exp2f(m[1] - top)};
        const float den = warp_sum(l[0] * w[0] + l[1] * w[1]);
        float acc = 0.0f;
#pragma unroll
        for (int j = 0; j < 2; ++j)
            if (32 * j < active)
#pragma unroll
                for (int s = 0; s < 32; ++s) acc = fmaf(v[j][s], __shfl_sync(0xFFFFFFFFu, w[j], s), acc);
        acc /= den;
        const long o = ((long)kvh * group + h) * HD + d;
        out[o] = acc;
        if (xq != nullptr) quantize_group(acc, o / 32, xq, xq2, xds);
    }
    if (threadIdx.x == 0 && atomicAdd(done + n_kv + kvh, 1u) == (u32)active - 1) {
        done[kvh] = 0;
        done[n_kv + kvh] = 0;
    }
}

// A warp holds 32 keys of a head as HD / 8 loads of 16 bytes a lane: HD / 8 consecutive lanes read one key row
// (a lane 8 dims), so each load instruction reads whole rows. (One row a lane touched 32 rows an instruction: on
// an H200, 8B-shaped decode attention took 9.94 us that way and 8.88 coalesced, bench/RESULTS.md.)
// kv[i] holds dims 8 (lane % LPK) .. + 7 of key j0 + i * KPI + lane / LPK (when below hi).
template <int HD>
struct KeyTile {
    static constexpr int LPK = HD / 8;   // lanes a key row
    static constexpr int KPI = 32 / LPK;  // key rows a load instruction
    static constexpr int N = HD / 8;      // loads for 32 keys

    // EARLY: issued before grid_dependency_sync (ld16_early), so it overlaps the kernel before.
    template <bool EARLY = false, class Rows>
    __device__ static void load(const Rows& keys, int j0, int hi, uint4 (&kv)[N]) {
        const int lane = threadIdx.x & 31;
        const long r0 = keys.row(j0);
#pragma unroll
        for (int i = 0; i < N; ++i) {
            const int d = i * KPI + lane / LPK;
            if (j0 + d < hi) kv[i] = keys.template load8<EARLY>(keys.step(r0, d), 8 * (lane % LPK));
        }
    }

    // Lane L's score: q . key j0 + L (NEG_INF past hi); q8 holds the query's dims 8 (lane % LPK) .. + 7.
    __device__ static float scores(const float (&q8)[8], const uint4 (&kv)[N], int j0, int hi) {
        const int lane = threadIdx.x & 31;
        float s = NEG_INF;
#pragma unroll
        for (int i = 0; i < N; ++i) {
            float part = 0.0f;
            if (j0 + i * KPI + lane / LPK < hi) {
                const u32 w[4] = {kv[i].x, kv[i].y, kv[i].z, kv[i].w};
#pragma unroll
                for (int t = 0; t < 4; ++t) {
                    part = fmaf(q8[2 * t], h2f_lo(w[t]), part);
                    part = fmaf(q8[2 * t + 1], h2f_hi(w[t]), part);
                }
            }
#pragma unroll
            for (int o = LPK / 2; o > 0; o >>= 1) part += __shfl_xor_sync(0xFFFFFFFFu, part, o);
            const float mine = __shfl_sync(0xFFFFFFFFu, part, (lane % KPI) * LPK);
            if (i == lane / KPI && j0 + lane < hi) s = mine;
        }
        return s;
    }
};

// One warp's share of attention for one query: keys lo..hi-1, 32 at a time (lane j scores key j, then every
// lane accumulates the weighted values of its own dims), online softmax in base 2. qs: the query times
// scale * log2(e). Leaves the unnormalized output, the max m and the sum l; acc[2 c + e] is dim 64 c + 2 lane + e
// (each lane reads the values two fp16 at a time).
// With PRELOADED, kv holds keys lo .. lo + 31 (KeyTile), loaded by the caller; other keys are loaded here.
template <int HD, bool PRELOADED, class Rows>
__device__ __forceinline__ void warp_attend(const float* qs, const Rows& keys, const Rows& values, int lo, int hi,
                                            uint4 (&kv)[HD / 8], float (&acc)[HD / 32], float& m, float& l) {
    constexpr int WPL = HD / 64;              // 32-bit words (fp16 pairs) of a value row per lane
    // Value rows loaded together: in a decode graph on an H200, 8 beat 32 at head dim 64 (the step 10% faster)
    // and matched 16 and 32 at head dim 128.
    constexpr int VT = 8;
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int i = 0; i < 2 * WPL; ++i) acc[i] = 0.0f;
    m = NEG_INF;
    l = 0.0f;
    float q8[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) q8[e] = qs[8 * (lane % KeyTile<HD>::LPK) + e];
    for (int j0 = lo; j0 < hi; j0 += 32) {
        const int j = j0 + lane;
        if (!PRELOADED || j0 > lo) KeyTile<HD>::load(keys, j0, hi, kv);
        const float s = KeyTile<HD>::scores(q8, kv, j0, hi);
        const float m_new = fmaxf(m, warp_max(s));
        const float corr = exp2f(m - m_new);
        const float p = j < hi ? exp2f(s - m_new) : 0.0f;
        l = l * corr + warp_sum(p);
#pragma unroll
        for (int i = 0; i < 2 * WPL; ++i) acc[i] *= corr;
        const int cnt = min(32, hi - j0);
        for (int jj = 0; jj < cnt; jj += VT) {
            u32 vv[VT][WPL];
            const long r0 = values.row(j0 + jj);
#pragma unroll
            for (int t = 0; t < VT; ++t)
#pragma unroll
                for (int c = 0; c < WPL; ++c)
                    vv[t][c] = jj + t < cnt ? values.load2(values.step(r0, t), 64 * c + 2 * lane) : 0u;
#pragma unroll
            for (int t = 0; t < VT; ++t) {
                const float pj = jj + t < cnt ? __shfl_sync(0xFFFFFFFFu, p, (jj + t) & 31) : 0.0f;
#pragma unroll
                for (int c = 0; c < WPL; ++c) {
                    acc[2 * c] = fmaf(pj, h2f_lo(vv[t][c]), acc[2 * c]);
                    acc[2 * c + 1] = fmaf(pj, h2f_hi(vv[t][c]), acc[2 * c + 1]);
                }
            }
        }
        m = m_new;
    }
}

// This decode step's own token, for attention_decode, which fuses the rotary embedding and the cache write: its k
// and v as the QKV projection left them (k not yet rotated), the rotary table rows of its position (rope.cu's
// rot and style), and where this block stores them in the cache (null in all but one q head of each KV group):
// the rows, and for a q8_0 cache their scales. q_norm, k_norm: the per-head RMS norms' weights (QK-norm, eps
// norm_eps) that q and k take before rotating, fused here too; null for models without them.
struct NewToken {
    const float *k, *v, *cos, *sin;
    int rot, neox;
    void *k_store, *v_store;
    u16 *k_scale_store, *v_scale_store;
    const float *q_norm, *k_norm;
    float norm_eps;
};

// The step's own key (rotated) and value as the cache holds them: fp16 pairs, word c of a lane being dims
// 64 c + 2 lane and + 1 (with Q8 the fp16 of their q8_0 values, and the int8 pairs and scales to store). Read right
// after the wait, with the query, so their loads share one trip to L2.
template <int HD, bool Q8>
struct NewKV {
    u32 k[HD / 64], v[HD / 64];
    Q8Pair kq[Q8 ? HD / 64 : 1], vq[Q8 ? HD / 64 : 1];

    __device__ void load(const NewToken& nt) {
        const int lane = threadIdx.x & 31;
        const float inv = nt.k_norm != nullptr ? head_inv_rms<HD>(nt.k, nt.norm_eps) : 1.0f;
#pragma unroll
        for (int c = 0; c < HD / 64; ++c) {
            const int d = 64 * c + 2 * lane;
            const float k0 = rotated(nt.k, d, nt.rot, nt.neox, nt.cos, nt.sin, nt.k_norm) * inv;
            const float k1 = rotated(nt.k, d + 1, nt.rot, nt.neox, nt.cos, nt.sin, nt.k_norm) * inv;
            if constexpr (Q8) {  // a group of 32 dims is 16 lanes' pairs
                kq[c] = q8_round_pair(k0, k1, 16);
                vq[c] = q8_round_pair(nt.v[d], nt.v[d + 1], 16);
                k[c] = kq[c].value;
                v[c] = vq[c].value;
            } else {
                k[c] = f2h(k0) | (u32)f2h(k1) << 16;
                v[c] = f2h(nt.v[d]) | (u32)f2h(nt.v[d + 1]) << 16;
            }
        }
    }

    __device__ void store(const NewToken& nt) const {
        if (nt.k_store == nullptr) return;
        const int lane = threadIdx.x & 31;
#pragma unroll
        for (int c = 0; c < HD / 64; ++c) {
            if constexpr (Q8) {
                reinterpret_cast<u16*>(nt.k_store)[32 * c + lane] = kq[c].q;
                reinterpret_cast<u16*>(nt.v_store)[32 * c + lane] = vq[c].q;
                if (lane % 16 == 0) {
                    nt.k_scale_store[2 * c + lane / 16] = kq[c].scale;
                    nt.v_scale_store[2 * c + lane / 16] = vq[c].scale;
                }
            } else {
                reinterpret_cast<u32*>(nt.k_store)[32 * c + lane] = k[c];
                reinterpret_cast<u32*>(nt.v_store)[32 * c + lane] = v[c];
            }
        }
    }

    // Where KV head kvh's row at pos is stored (k_new, v_new: the step's projections of every KV head).
    __device__ static NewToken token(const float* k_new, const float* v_new, int kvh, int pos, const float* cos_p,
                                     const float* sin_p, int rot, int neox, void* k_cache, void* v_cache,
                                     u16* k_scale, u16* v_scale, int max_tokens, bool store,
                                     const float* q_norm = nullptr, const float* k_norm = nullptr,
                                     float norm_eps = 0.0f) {
        const long row = (long)kvh * max_tokens + cache_row(pos, max_tokens);
        constexpr int ROW_BYTES = CacheRows<HD, Q8>::ROW_BYTES;
        return {k_new + (long)kvh * HD, v_new + (long)kvh * HD, cos_p, sin_p, rot, neox,
                store ? static_cast<char*>(k_cache) + row * ROW_BYTES : nullptr,
                store ? static_cast<char*>(v_cache) + row * ROW_BYTES : nullptr,
                store && Q8 ? k_scale + row * (HD / 32) : nullptr, store && Q8 ? v_scale + row * (HD / 32) : nullptr,
                q_norm, k_norm, norm_eps};
    }

    // The split kernels' own token: KV head kvh's key (normed where k_norm, rotated) and value of the step at pos,
    // stored in the cache.
    __device__ static NewKV store_own(const float* k_new, const float* v_new, int kvh, int pos, const float* cos_p,
                                      const float* sin_p, int rot, int neox, void* k_cache, void* v_cache,
                                      u16* k_scale, u16* v_scale, int max_tokens, const float* k_norm = nullptr,
                                      float norm_eps = 0.0f) {
        const NewToken nt = token(k_new, v_new, kvh, pos, cos_p, sin_p, rot, neox, k_cache, v_cache, k_scale,
                                  v_scale, max_tokens, true, nullptr, k_norm, norm_eps);
        NewKV nkv;
        nkv.load(nt);
        nkv.store(nt);
        return nkv;
    }

    // Fold the token into a warp's online softmax (see warp_attend).
    __device__ void attend(const float* qs, float (&acc)[HD / 32], float& m, float& l) const {
        const int lane = threadIdx.x & 31;
        float dot = 0.0f, vals[HD / 32];
#pragma unroll
        for (int c = 0; c < HD / 64; ++c) {
            const int d = 64 * c + 2 * lane;
            dot = fmaf(qs[d + 1], h2f_hi(k[c]), fmaf(qs[d], h2f_lo(k[c]), dot));
            vals[2 * c] = h2f_lo(v[c]);
            vals[2 * c + 1] = h2f_hi(v[c]);
        }
        const float s = warp_sum(dot);
        const float m_new = fmaxf(m, s);
        const float corr = exp2f(m - m_new), p = exp2f(s - m_new);
        l = l * corr + p;
#pragma unroll
        for (int i = 0; i < HD / 32; ++i) acc[i] = fmaf(p, vals[i], acc[i] * corr);
        m = m_new;
    }
};

// Warp `warp` of the block attends query qi of head `head` over split `split` of n_splits of its key range,
// leaving the unnormalized output acc, the max m and the sum l (see warp_attend). HD is the head dimension (64,
// 128 or 256): a compile-time size lets the loads of a key row and of a value tile be issued together rather
// than one dependent load at a time. DECODE (attention_decode): load the first key before waiting for the kernel
// before (it then stays in registers across the wait: twice the registers, which the one-wave decode grid can
// afford), and rotate q and take the step's own key and value from nt rather than from the cache.
template <int HD, bool DECODE, bool Q8>
__device__ __forceinline__ void attend_split(const float* __restrict__ q, long q_stride, const void* k_cache,
                                             const void* v_cache, const u16* k_scale, const u16* v_scale,
                                             int max_tokens, int n_heads, int n_kv, const int* __restrict__ start,
                                             int n, int window, float scale_log2, int qi, int head, int split,
                                             int n_splits, const NewToken& nt, float (&acc)[HD / 32], float& m,
                                             float& l) {
    __shared__ float qs[4][HD];
    const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
    const int kvh = head / (n_heads / n_kv);
    const int pos = start[0] + qi;
    const int first = window > 0 ? max(0, pos - window + 1) : 0;
    const int len = pos + 1 - first;
    const int per = (len + n_splits - 1) / n_splits;
    const int lo = first + split * per;
    const int hi = min(lo + per, pos + 1);
    const int cached_hi = DECODE ? min(hi, pos) : hi;  // the cache holds the decode step's own token only later
    const CacheRows<HD, Q8> keys(k_cache, k_scale, kvh, max_tokens), values(v_cache, v_scale, kvh, max_tokens);
    // Keys and values before start[0] (set before the step) are cached before the kernel before this one runs.
    // So while it finishes, a decode warp asks L2 for its rows (and with DECODE loads the first key it scores).
    if (n == 1) {
        keys.prefetch(lo, cached_hi, lane, 32);
        values.prefetch(lo, cached_hi, lane, 32);
    }
    uint4 kv[HD / 8];
    if (DECODE) KeyTile<HD>::template load<true>(keys, lo, cached_hi, kv);
    grid_dependency_sync();

    // Every load (q, and the step's own key and value) before any store, so they make one trip to L2 together:
    // the compiler cannot move a load past the cache store, which might alias it.
    const float* qr = q + qi * q_stride + (long)head * HD;
    const float q_scale = DECODE && nt.q_norm != nullptr ? head_inv_rms<HD>(qr, nt.norm_eps) * scale_log2 : scale_log2;
    float qv[HD / 32];
#pragma unroll
    for (int i = 0; i < HD / 32; ++i) {
        const int d = lane + 32 * i;
        qv[i] = (DECODE ? rotated(qr, d, nt.rot, nt.neox, nt.cos, nt.sin, nt.q_norm) : qr[d]) * q_scale;
    }
    const bool own = DECODE && lo <= pos && pos < hi;  // the split holding the step's own token
    NewKV<HD, Q8> nkv;
    if (own) nkv.load(nt);
#pragma unroll
    for (int i = 0; i < HD / 32; ++i) qs[warp][lane + 32 * i] = qv[i];
    if (own) nkv.store(nt);
    __syncwarp();
    warp_attend<HD, DECODE>(qs[warp], keys, values, lo, cached_hi, kv, acc, m, l);
    if (own) nkv.attend(qs[warp], acc, m, l);
}

template <int HD, bool Q8>
__device__ __forceinline__ void attention_partial_impl(const float* __restrict__ q, long q_stride,
                                                       const void* k_cache, const void* v_cache,
                                                       const u16* k_scale, const u16* v_scale, int max_tokens,
                                                       int n_heads, int n_kv, const int* __restrict__ start, int n,
                                                       int window, float scale_log2, int wpq,
                                                       float* __restrict__ part, u32* done, float* out,
                                                       signed char* xq, signed char* xq2, float2* xds) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
    const int head = blockIdx.x;
    const int qi = blockIdx.y * (4 / wpq) + warp / wpq;
    const int n_splits = gridDim.z * wpq;
    const int split = blockIdx.z * wpq + warp % wpq;
    if (qi >= n) return;
    float acc[HD / 32], m, l;
    attend_split<HD, false, Q8>(q, q_stride, k_cache, v_cache, k_scale, v_scale, max_tokens, n_heads, n_kv, start, n,
                                window, scale_log2, qi, head, split, n_splits, NewToken{}, acc, m, l);
    float* mine = part + (((long)qi * n_heads + head) * n_splits + split) * (HD + 2);
#pragma unroll
    for (int c = 0; c < HD / 64; ++c)
        reinterpret_cast<float2*>(mine + 64 * c)[lane] = make_float2(acc[2 * c], acc[2 * c + 1]);
    if (lane == 0) {
        mine[HD] = m;
        mine[HD + 1] = l;
    }
    if (done == nullptr) return;
    // Decode before sm_90: the last of the head's blocks to finish (counted in done[head], which it leaves at
    // zero) merges the splits, which saves the combine kernel's launch.
    __shared__ bool last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        last = atomicAdd(done + head, 1u) == gridDim.z - 1;
        if (last) done[head] = 0;
    }
    __syncthreads();
    if (last)
        combine_splits(part + (long)head * n_splits * (HD + 2), n_splits, HD, out + (long)head * HD, xq, xq2, xds,
                       (long)head * HD / 32);
}

// KV: the cache's form in the name (kernel_names.KV_SUFFIX: "" fp16, "_q8" q8_0); scales: q8_0's, else unused.
#define ATTENTION_PARTIAL(HD, Q8, KV)                                                                          \
    extern "C" __global__ void attention_partial_##HD##KV(                                                    \
        const float* q, long q_stride, const void* k_cache, const void* v_cache, const u16* k_scale,         \
        const u16* v_scale, int max_tokens, int n_heads, int n_kv, const int* start, int n, int window,      \
        float scale_log2, int wpq, float* part, u32* done, float* out, signed char* xq, signed char* xq2,    \
        float2* xds) {                                                                                         \
        attention_partial_impl<HD, Q8>(q, q_stride, k_cache, v_cache, k_scale, v_scale, max_tokens, n_heads,  \
                                       n_kv, start, n, window, scale_log2, wpq, part, done, out, xq, xq2, xds); \
    }
#define ATTENTION_PARTIAL_KV(HD) ATTENTION_PARTIAL(HD, false, ) ATTENTION_PARTIAL(HD, true, _q8)
ATTENTION_PARTIAL_KV(64)
ATTENTION_PARTIAL_KV(128)
ATTENTION_PARTIAL_KV(256)

// Decode at depth: a block per (KV head, split of the keys) serves every query head of the group, so each key and
// value row is read once a step rather than once per query head, and the splits (grid x) fill the GPU at any
// depth the cache holds. The grid is sized for the longest range; a step's keys go to as few splits as take at
// least SPLIT_MIN_KEYS each (a multiple of 32), and the other blocks exit at once. The block's 4 warps take the
// split's 32-key tiles in turn (each key tile scored against every query of the group, each value row weighted
// for all of them), merge in shared memory and leave one partial result per query head in part; the KV head's
// last block to finish (counted in done[kvh], left at zero) merges the splits and quantizes the output
// (combine_splits). The step's own token is rotated, stored and attended as in attention_decode.
#define SPLIT_MIN_KEYS 128

template <int HD, int G, bool Q8>
__device__ __forceinline__ void attention_decode_split_impl(
    const float* __restrict__ q, const float* k_new, const float* v_new, const float* cos_t, const float* sin_t,
    int rot, int neox, void* k_cache, void* v_cache, u16* k_scale, u16* v_scale, int max_tokens, int n_heads,
    int n_kv, const int* start, int window, float scale_log2, int kvh, int split, int n_splits, float* part, u32* done,
    float* out, signed char* xq, signed char* xq2, float2* xds) {
    constexpr int WPL = HD / 64, VT = 8;
    __shared__ float qs[G][HD], wacc[4][G][HD], wm[4][G], wl[4][G];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int group = n_heads / n_kv;
    const int pos = start[0];
    const int first = window > 0 ? max(0, pos - window + 1) : 0;
    const int len = pos + 1 - first;
    const int per = max(SPLIT_MIN_KEYS, (len + 32 * n_splits - 1) / (32 * n_splits) * 32);
    const int active = (len + per - 1) / per;
    if (split >= active) return;
    const int lo = first + split * per, hi = min(lo + per, pos + 1), cached_hi = min(hi, pos);
    const CacheRows<HD, Q8> keys(k_cache, k_scale, kvh, max_tokens), values(v_cache, v_scale, kvh, max_tokens);
    // The cached rows are final before the kernel before this one runs: ask L2 for them while it finishes.
    keys.prefetch(lo, cached_hi, threadIdx.x, blockDim.x);
    values.prefetch(lo, cached_hi, threadIdx.x, blockDim.x);
    grid_dependency_sync();
    const float* cos_p = cos_t + (long)pos * (rot / 2);
    const float* sin_p = sin_t + (long)pos * (rot / 2);
    for (int i = threadIdx.x; i < group * HD; i += blockDim.x)
        qs[i / HD][i % HD] = rotated(q + (long)(kvh * group + i / HD) * HD, i % HD, rot, neox, cos_p, sin_p) * scale_log2;
    __syncthreads();

    float acc[G][2 * WPL], m[G], l[G];
#pragma unroll
    for (int h = 0; h < G; ++h) {
        m[h] = NEG_INF;
        l[h] = 0.0f;
#pragma unroll
        for (int i = 0; i < 2 * WPL; ++i) acc[h][i] = 0.0f;
    }
    for (int j0 = lo + 32 * warp; j0 < cached_hi; j0 += 128) {
        uint4 kv[HD / 8];
        KeyTile<HD>::load(keys, j0, cached_hi, kv);
        float p[G];
#pragma unroll
        for (int h = 0; h < G; ++h) {
            if (h >= group) break;
            float q8[8];
#pragma unroll
            for (int e = 0; e < 8; ++e) q8[e] = qs[h][8 * (lane % KeyTile<HD>::LPK) + e];
            const float s = KeyTile<HD>::scores(q8, kv, j0, cached_hi);
            const float m_new = fmaxf(m[h], warp_max(s));
            const float corr = exp2f(m[h] - m_new);
            p[h] = j0 + lane < cached_hi ? exp2f(s - m_new) : 0.0f;
            l[h] = l[h] * corr + warp_sum(p[h]);
#pragma unroll
            for (int i = 0; i < 2 * WPL; ++i) acc[h][i] *= corr;
            m[h] = m_new;
        }
        const int cnt = min(32, cached_hi - j0);
        for (int jj = 0; jj < cnt; jj += VT) {
            u32 vv[VT][WPL];
            const long r0 = values.row(j0 + jj);
#pragma unroll
            for (int t = 0; t < VT; ++t)
#pragma unroll
                for (int c = 0; c < WPL; ++c)
                    vv[t][c] = jj + t < cnt ? values.load2(values.step(r0, t), 64 * c + 2 * lane) : 0u;
#pragma unroll
            for (int h = 0; h < G; ++h) {
                if (h >= group) break;
#pragma unroll
                for (int t = 0; t < VT; ++t) {
                    const float pj = __shfl_sync(0xFFFFFFFFu, p[h], (jj + t) & 31);
#pragma unroll
                    for (int c = 0; c < WPL; ++c) {
                        acc[h][2 * c] = fmaf(pj, h2f_lo(vv[t][c]), acc[h][2 * c]);
                        acc[h][2 * c + 1] = fmaf(pj, h2f_hi(vv[t][c]), acc[h][2 * c + 1]);
                    }
                }
            }
        }
    }
    if (warp == 0 && hi == pos + 1) {  // the split holding the step's own token
        const NewKV<HD, Q8> nkv = NewKV<HD, Q8>::store_own(k_new, v_new, kvh, pos, cos_p, sin_p, rot, neox, k_cache,
                                                          v_cache, k_scale, v_scale, max_tokens);
#pragma unroll
        for (int h = 0; h < G; ++h)
            if (h < group) nkv.attend(qs[h], acc[h], m[h], l[h]);
    }

    // The warps' results merged into the block's, one partial (acc, m, l) per query head: acc[h][2 c + e] is dim
    // 64 c + 2 lane + e (warp_attend). Values past a row's keys are zero (vv), so a split of fewer keys adds nothing.
#pragma unroll
    for (int h = 0; h < G; ++h) {
        if (h >= group) break;
#pragma unroll
        for (int c = 0; c < WPL; ++c)
            reinterpret_cast<float2*>(&wacc[warp][h][64 * c])[lane] = make_float2(acc[h][2 * c], acc[h][2 * c + 1]);
        if (lane == 0) {
            wm[warp][h] = m[h];
            wl[warp][h] = l[h];
        }
    }
    __syncthreads();
    store_block_partial<HD>(&wacc[0][0][0], &wm[0][0], &wl[0][0], G, nullptr, nullptr, group,
                            part + ((long)kvh * group * n_splits + split) * (HD + 2), n_splits);
    merge_group_splits<HD>(part, done, kvh, group, n_splits, active, out, xq, xq2, xds);
}

#define ATTENTION_DECODE_SPLIT(HD, G, Q8, KV)                                                                   \
    extern "C" __global__ void __launch_bounds__(128) attention_decode_split_##HD##_g##G##KV(                   \
        const float* q, const float* k_new, const float* v_new, const float* cos_t, const float* sin_t, int rot, \
        int neox, void* k_cache, void* v_cache, u16* k_scale, u16* v_scale, int max_tokens, int n_heads,       \
        int n_kv, const int* start, int window, float scale_log2, float* part, u32* done, float* out,          \
        signed char* xq, signed char* xq2, float2* xds) {                                                      \
        attention_decode_split_impl<HD, G, Q8>(q, k_new, v_new, cos_t, sin_t, rot, neox, k_cache, v_cache,      \
                                               k_scale, v_scale, max_tokens, n_heads, n_kv, start, window,      \
                                               scale_log2, blockIdx.y, blockIdx.x, gridDim.x, part, done, out,  \
                                               xq, xq2, xds);                                                   \
    }
#define ATTENTION_DECODE_SPLIT_KV(HD, G) ATTENTION_DECODE_SPLIT(HD, G, false, ) ATTENTION_DECODE_SPLIT(HD, G, true, _q8)
ATTENTION_DECODE_SPLIT_KV(64, 4)
ATTENTION_DECODE_SPLIT_KV(64, 8)
ATTENTION_DECODE_SPLIT_KV(128, 4)
ATTENTION_DECODE_SPLIT_KV(128, 8)
ATTENTION_DECODE_SPLIT_KV(256, 4)
ATTENTION_DECODE_SPLIT_KV(256, 8)

// Decode at depth on tensor cores (sm_80+): blocks of a KV head and a split of its keys as in
// attention_decode_split (GQA groups of up to 16 query heads), but each warp streams its own key tiles of KT keys
// (tiles w, w + 4, ... of the split) through STAGES buffers of shared memory by cp.async, so STAGES - 1 tiles of
// keys and values are in flight while it computes one: the group's queries are the 16 rows of an mma A fragment
// (fp16, rows past the group zero), scores and P.V run on mma.sync as in flash_attention.cu, with an online softmax
// per warp. The first tiles load before grid_dependency_sync (the cached rows are final before the kernel before
// this one runs). At the end the warps' results and the step's own token (rotated, stored and attended here) are
// merged into one partial result per query head, and the KV head's blocks merge the splits together
// (merge_splits_together).
constexpr int DEEP_WARPS = 4;

// Keys (or values) j0 .. j0 + KT - 1 into a warp's shared tile of rows padded to D + 8 halves (ldmatrix's eight
// row addresses then fall in distinct banks); rows from `end` on are zeros, so a masked key's value adds nothing.
template <int D, int KT>
__device__ __forceinline__ void warp_load_rows(u16* tile, const CacheRows<D, false>& rows, int j0, int end) {
    constexpr int PER_ROW = D / 8;
    const int lane = threadIdx.x & 31;
    const long first = rows.row(j0);  // the tile's rows step from here (CacheRows::step)
#pragma unroll
    for (int i = 0; i < KT * PER_ROW / 32; ++i) {
        const int c = 32 * i + lane, row = c / PER_ROW, col = 8 * (c % PER_ROW);
        const bool in = j0 + row < end;
        copy16(tile + row * (D + 8) + col, rows.data + (in ? rows.step(first, row) : first) * rows.ROW_BYTES + 2 * col, in);
    }
}

// The same tile of keys and values by bulk copies (the DEEP_BULK form; 16-key tiles, so a lane a row: keys on lanes
// 0-15, values on 16-31), counted on bar; the lanes of rows from `end` on write their zeros themselves.
template <int D, int KT>
__device__ __forceinline__ void warp_bulk_rows(u16* tile, const CacheRows<D, false>& keys,
                                               const CacheRows<D, false>& values, int j0, int end,
                                               unsigned long long* bar) {
    static_assert(2 * KT == 32, "a lane a row");
    const int lane = threadIdx.x & 31, row = lane % KT, in = min(KT, end - j0);
    const CacheRows<D, false>& rows = lane < KT ? keys : values;
    u16* dst = tile + (lane < KT ? 0 : KT * (D + 8)) + row * (D + 8);
    if (lane == 0) bulk_expect(bar, 2 * in * rows.ROW_BYTES);
    __syncwarp();
    if (row < in) {
        bulk_copy(dst, rows.data + rows.step(rows.row(j0), row) * rows.ROW_BYTES, rows.ROW_BYTES, bar);
    } else {
#pragma unroll
        for (int c = 0; c < D / 8; ++c) reinterpret_cast<uint4*>(dst)[c] = make_uint4(0, 0, 0, 0);
    }
}

// q8_0: rows j0 .. j0 + KT - 1's int8 values (KT D bytes), then each row's scales (D / 16 bytes), into a warp's raw
// tile; rows from `end` on are zeros.
template <int D, int KT>
__device__ __forceinline__ void warp_load_q8(u8* raw, const CacheRows<D, true>& rows, int j0, int end) {
    const int lane = threadIdx.x & 31;
    const long first = rows.row(j0);  // the tile's rows step from here (CacheRows::step)
#pragma unroll
    for (int c = lane; c < KT * D / 16; c += 32) {
        const int row = c / (D / 16);
        const bool in = j0 + row < end;
        copy16(raw + 16 * c, rows.data + (in ? rows.step(first, row) : first) * D + 16 * (c % (D / 16)), in);
    }
    for (int row = lane; row < KT; row += 32) {
        const bool in = j0 + row < end;
        copy_small<D / 16>(raw + KT * D + row * (D / 16), rows.scale + (in ? rows.step(first, row) : first) * (D / 32), in);
    }
}

// A raw q8_0 tile (warp_load_q8) as the fp16 tile the other form loads: rows padded to D + 8 halves.
template <int D, int KT>
__device__ __forceinline__ void warp_convert_q8(u16* tile, const u8* raw) {
    const u16* scales = reinterpret_cast<const u16*>(raw + KT * D);
#pragma unroll
    for (int c = threadIdx.x & 31; c < KT * D / 8; c += 32) {
        const int row = c / (D / 8), col = 8 * (c % (D / 8));
        const u32 s2 = both_halves(scales[row * (D / 32) + col / 32]);
        const uint2 q = *reinterpret_cast<const uint2*>(raw + row * D + col);
        *reinterpret_cast<uint4*>(tile + row * (D + 8) + col) = q8_half8(q, s2);
    }
}

// The shared memory a warp of attention_decode_deep uses: STAGES x (keys, values), as fp16 tiles or raw q8_0 ones,
// and for q8_0 the fp16 tiles it converts the current stage into (cuda._deep_kernel sizes the launch alike).
template <int D, int KT, int STAGES, bool Q8>
struct DeepTiles {
    static constexpr int TILE = KT * (D + 8);       // halves of an fp16 tile
    static constexpr int RAW = KT * D + KT * D / 16;  // bytes of a raw q8_0 tile
    static constexpr int STAGE_BYTES = Q8 ? 2 * RAW : 4 * TILE;
    static constexpr int WARP_BYTES = STAGES * STAGE_BYTES + (Q8 ? 4 * TILE : 0);
};

#ifdef SWEEP_KERNELS
// The phased sweep kernel's timeline (bench/bench_attention.py --phases): per block (split + splits * KV head), the
// global timer and the SM's clock at DEEP_PHASES points.
#define DEEP_PHASES 8
__device__ unsigned long long deep_phases[MAX_SPLITS * 16 * DEEP_PHASES * 2];
#endif

// Phase i of a block's timeline, for the phased sweep kernel only (thread 0 of the block records it).
template <bool PHASES>
__device__ __forceinline__ void deep_phase(int i) {
#ifdef SWEEP_KERNELS
    if (PHASES && threadIdx.x == 0) {
        unsigned long long ns;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(ns));
        unsigned long long* p = deep_phases + ((long)blockIdx.y * gridDim.x + blockIdx.x) * DEEP_PHASES * 2;
        p[i] = ns;
        p[DEEP_PHASES + i] = clock64();
    }
#endif
}

// The deep kernel's forms: the one the backend launches, and sweep-only copies (kernel_names.DEEP_FORMS) that record
// their timeline (deep_phases), fetch their tiles by bulk copies (sm_90+, fp16 caches, 16-key tiles), or do so only
// where a split holds at most DEEP_BULK_KEYS keys (a choice the whole launch makes alike).
enum DeepForm { DEEP_PLAIN, DEEP_TIMED, DEEP_BULK, DEEP_SHORT };
// Bulk copies against cp.async in the model's decode step (H100, session 25): the Qwen3-30B-A3B shape's step 3.1%
// shorter at 192 keys a split, even at 384, 6.7% longer at 704; the Qwen3-8B shape's 1.9% longer at 576.
#define DEEP_BULK_KEYS 256

template <int D, int KT, int STAGES, bool Q8, int FORM = DEEP_PLAIN>
__device__ __forceinline__ void attention_decode_deep_impl(
    const float* __restrict__ q, const float* k_new, const float* v_new, const float* cos_t, const float* sin_t,
    int rot, int neox, void* k_cache, void* v_cache, u16* k_scale, u16* v_scale, int max_tokens, int n_heads,
    int n_kv, const int* start, int window, float scale_log2, int kvh, int split, int n_splits, float* part,
    u32* done, float* out, signed char* xq, signed char* xq2, float2* xds, const float* q_norm, const float* k_norm,
    float norm_eps) {
    using Smem = DeepTiles<D, KT, STAGES, Q8>;
    constexpr int ROW = D + 8, TILE = Smem::TILE, DK = D / 16, DN = D / 8, KN = KT / 8, UNIT = DEEP_WARPS * KT;
    static_assert(DEEP_WARPS == 4, "store_block_partial merges 4 warps");
    static_assert(Smem::WARP_BYTES >= 16 * D * 4, "the merge reuses the tiles");
    constexpr bool MAY_BULK = FORM == DEEP_BULK || FORM == DEEP_SHORT;
    static_assert(!MAY_BULK || !Q8, "bulk copies take fp16 tiles");
    extern __shared__ __align__(16) u8 smem[];  // warp w's from smem + w WARP_BYTES
    __shared__ __align__(16) float qs[16][D];
    __shared__ float wm[DEEP_WARPS][16], wl[DEEP_WARPS][16], own_s[16], own_v[D];
    __shared__ float q_squares[16][D / 32];  // with q_norm: each warp's sum of squares of a query head's 32 dims
    __shared__ unsigned long long stage_bars[MAY_BULK ? DEEP_WARPS * STAGES : 1];  // the bulk copies' own
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int group = n_heads / n_kv, pos = start[0];
    const int first = window > 0 ? max(0, pos - window + 1) : 0;
    const int len = pos + 1 - first;
    const int per = max(UNIT, (len + UNIT * n_splits - 1) / (UNIT * n_splits) * UNIT);
    const int active = (len + per - 1) / per;
    if (split >= active) return;
    const bool bulk = FORM == DEEP_BULK || (FORM == DEEP_SHORT && per <= DEEP_BULK_KEYS);
    const int lo = first + split * per, hi = min(lo + per, pos + 1), cached_hi = min(hi, pos);
    const CacheRows<D, Q8> keys(k_cache, k_scale, kvh, max_tokens), values(v_cache, v_scale, kvh, max_tokens);
    u8* mine = smem + warp * Smem::WARP_BYTES;
    deep_phase<FORM == DEEP_TIMED>(0);
    // The warp's tile i: keys lo + (warp + DEEP_WARPS i) KT .., in buffer i % STAGES. Every call commits a group
    // (empty past the range), so waiting for all but the newest STAGES - 1 groups always means tile i landed.
    unsigned long long* bars = stage_bars + (MAY_BULK ? warp * STAGES : 0);
    auto fetch = [&](int i) {
        const int j0 = lo + (warp + DEEP_WARPS * i) * KT;
        if constexpr (MAY_BULK) {
            if (bulk) {  // only tiles that hold keys, each waited for below
                if (j0 < cached_hi)
                    warp_bulk_rows<D, KT>(reinterpret_cast<u16*>(mine + (i % STAGES) * Smem::STAGE_BYTES), keys,
                                          values, j0, cached_hi, bars + i % STAGES);
                return;
            }
        }
        if (j0 < cached_hi) {
            u8* buf = mine + (i % STAGES) * Smem::STAGE_BYTES;
            if constexpr (Q8) {
                warp_load_q8<D, KT>(buf, keys, j0, cached_hi);
                warp_load_q8<D, KT>(buf + Smem::RAW, values, j0, cached_hi);
            } else {
                warp_load_rows<D, KT>(reinterpret_cast<u16*>(buf), keys, j0, cached_hi);
                warp_load_rows<D, KT>(reinterpret_cast<u16*>(buf) + TILE, values, j0, cached_hi);
            }
        }
        copies_commit();
    };
    if (bulk) {
        if (lane < STAGES) bulk_barrier_init(bars + lane);
        __syncwarp();
    }
#pragma unroll
    for (int i = 0; i < STAGES - 1; ++i) fetch(i);
    grid_dependency_sync();
    deep_phase<FORM == DEEP_TIMED>(1);

    const float* cos_p = cos_t + (long)pos * (rot / 2);
    const float* sin_p = sin_t + (long)pos * (rot / 2);
    // The queries in three passes: every thread's values loaded at once (one trip to L2, not one a value), times
    // the QK-norm's weights, into qs, with each warp's sum of squares of its 32 dims of a head (h and d / 32 are
    // warp-uniform); then each value rotated from qs (its pair may be another thread's) and scaled by its head's
    // 1 / rms, and written back.
    constexpr int QR = 16 * D / (32 * DEEP_WARPS);  // a thread's values: i = threadIdx.x + 32 DEEP_WARPS r
    float x[QR];
#pragma unroll
    for (int r = 0; r < QR; ++r) {
        const int i = threadIdx.x + r * 32 * DEEP_WARPS, h = i / D, d = i % D;
        x[r] = h < group ? q[(long)(kvh * group + h) * D + d] : 0.0f;
    }
#pragma unroll
    for (int r = 0; r < QR; ++r) {
        const int i = threadIdx.x + r * 32 * DEEP_WARPS, h = i / D, d = i % D;
        qs[h][d] = q_norm != nullptr ? x[r] * q_norm[d] : x[r];
        if (q_norm != nullptr) {
            const float squares = warp_sum(x[r] * x[r]);
            if (lane == 0) q_squares[h][d / 32] = squares;
        }
    }
    __syncthreads();
#pragma unroll
    for (int r = 0; r < QR; ++r) {
        const int i = threadIdx.x + r * 32 * DEEP_WARPS, h = i / D, d = i % D;
        float squares = 0.0f;
#pragma unroll
        for (int j = 0; j < D / 32; ++j) squares += q_squares[h][j];
        const float inv = q_norm != nullptr ? rsqrtf(squares / D + norm_eps) : 1.0f;
        x[r] = rotated(qs[h], d, rot, neox, cos_p, sin_p) * inv * scale_log2;
    }
    __syncthreads();
#pragma unroll
    for (int r = 0; r < QR; ++r) {
        const int i = threadIdx.x + r * 32 * DEEP_WARPS;
        qs[i / D][i % D] = x[r];
    }
    __syncthreads();
    u32 qa[DK][4];  // A fragments: a0 / a1 rows g / g + 8 at dims 16 kk + 2 t, a2 / a3 the same 8 dims on
#pragma unroll
    for (int kk = 0; kk < DK; ++kk)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const float* r = &qs[g + 8 * h][16 * kk + 2 * t];
            qa[kk][h] = half2_bits(r[0], r[1]);
            qa[kk][2 + h] = half2_bits(r[8], r[9]);
        }
    deep_phase<FORM == DEEP_TIMED>(2);
    // The split holding the step's own token rotates and stores it and scores it here, before its keys: its warp 0
    // then takes the longest, but no other warp waits for it until the end.
    const bool own = hi == pos + 1;
    if (own && warp == 0) {
        const NewKV<D, Q8> nkv = NewKV<D, Q8>::store_own(k_new, v_new, kvh, pos, cos_p, sin_p, rot, neox, k_cache,
                                                        v_cache, k_scale, v_scale, max_tokens, k_norm, norm_eps);
        for (int h = 0; h < group; ++h) {
            float dot = 0.0f;
#pragma unroll
            for (int c = 0; c < D / 64; ++c) {
                const int d = 64 * c + 2 * lane;
                dot = fmaf(qs[h][d + 1], h2f_hi(nkv.k[c]), fmaf(qs[h][d], h2f_lo(nkv.k[c]), dot));
            }
            dot = warp_sum(dot);
            if (lane == 0) own_s[h] = dot;
        }
#pragma unroll
        for (int c = 0; c < D / 64; ++c) {
            own_v[64 * c + 2 * lane] = h2f_lo(nkv.v[c]);
            own_v[64 * c + 2 * lane + 1] = h2f_hi(nkv.v[c]);
        }
    }

    float o[DN][4] = {};
    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.0f, 0.0f};
    const int n_tiles = (cached_hi - lo + KT - 1) / KT;
    for (int i = 0; warp + DEEP_WARPS * i < n_tiles; ++i) {
        fetch(i + STAGES - 1);
        if (bulk) {
            bulk_wait(bars + i % STAGES, (i / STAGES) & 1);
        } else {
            copies_wait<STAGES - 1>();
        }
        __syncwarp();  // every lane's copies of tile i are visible to the warp
        const int j0 = lo + (warp + DEEP_WARPS * i) * KT;
        const u8* stage = mine + (i % STAGES) * Smem::STAGE_BYTES;
        const u16* ks = reinterpret_cast<const u16*>(stage);
        if constexpr (Q8) {
            u16* converted = reinterpret_cast<u16*>(mine + STAGES * Smem::STAGE_BYTES);
            warp_convert_q8<D, KT>(converted, stage);
            warp_convert_q8<D, KT>(converted + TILE, stage + Smem::RAW);
            __syncwarp();
            ks = converted;
        }
        const u16* vs = ks + TILE;
        float s[KN][4];
        tile_scores<D, KT>(qa, ks, ROW, s);
        // s[nb][2 h + e]: row g + 8 h, key j0 + 8 nb + 2 t + e; every tile holds a key below cached_hi.
        if (j0 + KT > cached_hi)
#pragma unroll
            for (int nb = 0; nb < KN; ++nb)
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    if (j0 + 8 * nb + 2 * t + (e & 1) >= cached_hi) s[nb][e] = NEG_INF;
        u32 pa[KT / 16][4];
        tile_softmax<D, KT>(s, m, l, o, pa);
        tile_values<D, KT>(pa, vs, ROW, o);
        __syncwarp();  // every lane is done with buffer i % STAGES before the next fetch refills it
    }
    copies_wait<0>();  // the empty groups of fetches past the range
    deep_phase<FORM == DEEP_TIMED>(3);

    // The warps' results through shared memory (the tiles' space): o[db][2 h + e] is row g + 8 h, dim 8 db + 2 t + e;
    // a row's sum is spread over the 4 lanes of its quad.
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        l[h] += __shfl_xor_sync(0xFFFFFFFFu, l[h], 1);
        l[h] += __shfl_xor_sync(0xFFFFFFFFu, l[h], 2);
    }
    __syncthreads();
    float* wacc = reinterpret_cast<float*>(smem);  // [DEEP_WARPS][16][D]
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = g + 8 * h;
        if (r >= group) continue;
#pragma unroll
        for (int db = 0; db < DN; ++db)
            *reinterpret_cast<float2*>(&wacc[(warp * 16 + r) * D + 8 * db + 2 * t]) = make_float2(o[db][2 * h], o[db][2 * h + 1]);
        if (t == 0) {
            wm[warp][r] = m[h];
            wl[warp][r] = l[h];
        }
    }
    __syncthreads();
    deep_phase<FORM == DEEP_TIMED>(4);
    store_block_partial<D>(wacc, &wm[0][0], &wl[0][0], 16, own ? own_s : nullptr, own_v, group,
                           part + ((long)kvh * group * n_splits + split) * (D + 2), n_splits);
    deep_phase<FORM == DEEP_TIMED>(5);
    merge_splits_together<D, DEEP_WARPS>(part, done, kvh, n_kv, group, n_splits, split, active, out, xq, xq2, xds);
    deep_phase<FORM == DEEP_TIMED>(6);
}

// NAME: kernel_names.deep_decode's; the shared memory the launch asks for: cuda._deep_kernel's.
#define ATTENTION_DECODE_DEEP(D, KT, STAGES, Q8, NAME) ATTENTION_DECODE_DEEP_P(D, KT, STAGES, Q8, DEEP_PLAIN, NAME)
#define ATTENTION_DECODE_DEEP_P(D, KT, STAGES, Q8, FORM, NAME)                                                \
    extern "C" __global__ void __launch_bounds__(32 * DEEP_WARPS) NAME(                                        \
        const float* q, const float* k_new, const float* v_new, const float* cos_t, const float* sin_t, int rot, \
        int neox, void* k_cache, void* v_cache, u16* k_scale, u16* v_scale, int max_tokens, int n_heads,       \
        int n_kv, const int* start, int window, float scale_log2, float* part, u32* done, float* out,          \
        signed char* xq, signed char* xq2, float2* xds, const float* q_norm, const float* k_norm,             \
        float norm_eps) {                                                                                      \
        attention_decode_deep_impl<D, KT, STAGES, Q8, FORM>(q, k_new, v_new, cos_t, sin_t, rot, neox, k_cache,\
                                                      v_cache, k_scale, v_scale, max_tokens, n_heads, n_kv,     \
                                                      start, window, scale_log2, blockIdx.y, blockIdx.x,        \
                                                      gridDim.x, part, done, out, xq, xq2, xds, q_norm, k_norm, \
                                                      norm_eps);                                                \
    }
ATTENTION_DECODE_DEEP(64, 64, 2, false, attention_decode_deep_64)
ATTENTION_DECODE_DEEP(128, 16, 4, false, attention_decode_deep_128)
ATTENTION_DECODE_DEEP(256, 16, 2, false, attention_decode_deep_256)
ATTENTION_DECODE_DEEP(64, 64, 2, true, attention_decode_deep_64_q8)
ATTENTION_DECODE_DEEP(128, 16, 4, true, attention_decode_deep_128_q8)
ATTENTION_DECODE_DEEP(256, 16, 2, true, attention_decode_deep_256_q8)
#ifdef SWEEP_KERNELS
// Tile sizes and depths of the pipeline only bench/bench_attention.py launches (kernel_names.DEEP_SWEEP).
ATTENTION_DECODE_DEEP(128, 16, 2, false, attention_decode_deep_128_kt16_s2)
ATTENTION_DECODE_DEEP(128, 16, 3, false, attention_decode_deep_128_kt16_s3)
ATTENTION_DECODE_DEEP(128, 16, 6, false, attention_decode_deep_128_kt16_s6)
ATTENTION_DECODE_DEEP(128, 32, 2, false, attention_decode_deep_128_kt32_s2)
ATTENTION_DECODE_DEEP(128, 32, 3, false, attention_decode_deep_128_kt32_s3)
ATTENTION_DECODE_DEEP_P(128, 16, 4, false, DEEP_TIMED, attention_decode_deep_128_phases)
ATTENTION_DECODE_DEEP_P(128, 16, 4, false, DEEP_BULK, attention_decode_deep_128_bulk)
ATTENTION_DECODE_DEEP_P(128, 16, 4, false, DEEP_SHORT, attention_decode_deep_128_short)
#endif

#if __CUDA_ARCH__ >= 900
// Decode on sm_90 and newer: a head's ATTN_CLUSTER blocks (grid z) form a thread-block cluster, which merges the
// splits through the blocks' shared memory instead of through global memory, a fence and a counter; each warp also
// loads its first keys before the wait (attend_split's DECODE). Every warp pushes its partial result into the
// shared memory of the blocks that merge it (block r merges dims 32 r .. 32 r + 31), so one cluster barrier
// separates the pushes from the merge and no block waits for the others' merges before it exits.
#define ATTN_CLUSTER 8

// Arrive at / wait on the cluster barrier in two halves: work between them overlaps the other blocks' arrival.
__device__ __forceinline__ void cluster_arrive() { asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory"); }
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory"); }

// Store v at p (a shared-memory address of this block) in block `rank` of the cluster.
__device__ __forceinline__ void st_cluster(float* p, u32 rank, float v) {
    u32 addr;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(addr) : "r"((u32)__cvta_generic_to_shared(p)), "r"(rank));
    asm volatile("st.shared::cluster.f32 [%0], %1;" ::"r"(addr), "f"(v) : "memory");
}

template <int HD, bool Q8>
__device__ __forceinline__ void attention_decode_impl(const float* q, const float* k_new, const float* v_new,
                                                      const float* cos_t, const float* sin_t, int rot, int neox,
                                                      void* k_cache, void* v_cache, u16* k_scale, u16* v_scale,
                                                      int max_tokens, int n_heads,
                                                      int n_kv, const int* start, int window, float scale_log2,
                                                      float* out, signed char* xq, signed char* xq2, float2* xds,
                                                      const float* q_norm, const float* k_norm, float norm_eps) {
    constexpr int N_SPLITS = 4 * ATTN_CLUSTER;
    static_assert(HD / 32 <= ATTN_CLUSTER, "one block merges each 32 dims");
    // In block r: split s's output on dims 32 r + i, its max and its sum (the merge's inputs, pushed by every warp).
    __shared__ float acc_in[N_SPLITS][32], m_in[N_SPLITS], l_in[N_SPLITS];
    // Remote shared memory may be written only once its block runs: every block arrives now and waits before
    // its first push, long after all have arrived.
    cluster_arrive();
    const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
    const int head = blockIdx.x;
    const int group = n_heads / n_kv, kvh = head / group, pos = start[0];
    const NewToken nt = NewKV<HD, Q8>::token(k_new, v_new, kvh, pos, cos_t + (long)pos * (rot / 2),
                                             sin_t + (long)pos * (rot / 2), rot, neox, k_cache, v_cache, k_scale,
                                             v_scale, max_tokens, head % group == 0, q_norm, k_norm, norm_eps);
    u32 rank;
    asm("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
    const int split = 4 * rank + warp;
    float acc[HD / 32], m, l;
    attend_split<HD, true, Q8>(q, 0, k_cache, v_cache, k_scale, v_scale, max_tokens, n_heads, n_kv, start, 1,
                               window, scale_log2, 0, head, split, N_SPLITS, nt, acc, m, l);
    cluster_wait();
    // acc[2 c + e] is dim 64 c + 2 lane + e (warp_attend): dims 32 r .. 32 r + 31 belong to block r = 2 c + lane / 16.
#pragma unroll
    for (int c = 0; c < HD / 64; ++c)
#pragma unroll
        for (int e = 0; e < 2; ++e) st_cluster(&acc_in[split][(2 * lane + e) % 32], 2 * c + lane / 16, acc[2 * c + e]);
    if (lane < HD / 32) {
        st_cluster(&m_in[split], lane, m);
        st_cluster(&l_in[split], lane, l);
    }
    cluster_arrive();
    cluster_wait();
    if (warp != 0 || rank >= HD / 32) return;
    const float o = merge_splits(m_in, l_in, N_SPLITS, [&](int s) { return acc_in[s][lane]; });
    out[(long)head * HD + 32 * rank + lane] = o;
    if (xq != nullptr) quantize_group(o, (long)head * HD / 32 + rank, xq, xq2, xds);
}

#define ATTENTION_DECODE(HD, Q8, KV)                                                                           \
    extern "C" __global__ void __cluster_dims__(1, 1, ATTN_CLUSTER) attention_decode_##HD##KV(                \
        const float* q, const float* k_new, const float* v_new, const float* cos_t, const float* sin_t, int rot, \
        int neox, void* k_cache, void* v_cache, u16* k_scale, u16* v_scale, int max_tokens, int n_heads,       \
        int n_kv, const int* start, int window, float scale_log2, float* out, signed char* xq, signed char* xq2, \
        float2* xds, const float* q_norm, const float* k_norm, float norm_eps) {                               \
        attention_decode_impl<HD, Q8>(q, k_new, v_new, cos_t, sin_t, rot, neox, k_cache, v_cache, k_scale,      \
                                      v_scale, max_tokens, n_heads, n_kv, start, window, scale_log2, out, xq,   \
                                      xq2, xds, q_norm, k_norm, norm_eps);                                     \
    }
#define ATTENTION_DECODE_KV(HD) ATTENTION_DECODE(HD, false, ) ATTENTION_DECODE(HD, true, _q8)
ATTENTION_DECODE_KV(64)
ATTENTION_DECODE_KV(128)
ATTENTION_DECODE_KV(256)
#endif

// One block per (query, head), one thread per dim (prompt chunks: a query's splits are its warps).
extern "C" __global__ void attention_combine(const float* __restrict__ part, int n_heads, int hd, int n_splits,
                                             float* __restrict__ out, long out_stride) {
    grid_dependency_sync();
    const int qi = blockIdx.x, head = blockIdx.y;
    combine_splits(part + ((long)qi * n_heads + head) * n_splits * (hd + 2), n_splits, hd,
                   out + qi * out_stride + (long)head * hd, nullptr, nullptr, nullptr, 0);
}
