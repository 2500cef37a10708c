// Causal grouped-query attention over the fp16 KV cache.
//
// attention_partial: each warp one (query, head, split) item; a decode query spreads its keys over 32 warps of 8
// blocks, a prompt chunk's queries take one warp each (four consecutive queries of a head per block share their
// K/V rows through L1). The splits are then merged and normalized (merge_splits): for decode by the head's 8
// blocks as one cluster (attention_decode, sm_90+) or by the head's last block to finish (older GPUs), either of
// which also quantizes the output for the output projection; for a prompt chunk by attention_combine.
// attention_decode also does rope_store_kv's work for its token (rotating q and k, storing k and v), which saves
// that launch. Before sm_90, a decode step over a cache of SPLIT_CONTEXT positions or more is split by KV head
// instead (attention_decode_split, below: each block serves a KV head's whole query group, so the keys are read
// once). Prompt chunks on sm_80+ go to flash_attention.cu instead of attention_partial.
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
    template <bool EARLY = false>
    __device__ static void load(const u16* __restrict__ kbase, int j0, int hi, uint4 (&kv)[N]) {
        const int lane = threadIdx.x & 31;
#pragma unroll
        for (int i = 0; i < N; ++i) {
            const int j = j0 + i * KPI + lane / LPK;
            const uint4* p = reinterpret_cast<const uint4*>(kbase + (long)j * HD) + lane % LPK;
            if (j < hi) kv[i] = EARLY ? ld16_early(p) : __ldg(p);
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
template <int HD, bool PRELOADED>
__device__ __forceinline__ void warp_attend(const float* qs, const u16* __restrict__ kbase,
                                            const u16* __restrict__ vbase, int lo, int hi, uint4 (&kv)[HD / 8],
                                            float (&acc)[HD / 32], float& m, float& l) {
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
        if (!PRELOADED || j0 > lo) KeyTile<HD>::load(kbase, j0, hi, kv);
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
#pragma unroll
            for (int t = 0; t < VT; ++t)
#pragma unroll
                for (int c = 0; c < WPL; ++c)
                    vv[t][c] = jj + t < cnt
                                   ? __ldg(reinterpret_cast<const u32*>(vbase + (long)(j0 + jj + t) * HD) + 32 * c + lane)
                                   : 0u;
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
// rot and style), and where this block stores them in the cache (null in all but one q head of each KV group).
struct NewToken {
    const float *k, *v, *cos, *sin;
    int rot, neox;
    u16 *k_store, *v_store;
};

// The step's own key (rotated) and value as the cache holds them: fp16 pairs, word c of a lane being dims
// 64 c + 2 lane and + 1. Read right after the wait, with the query, so their loads share one trip to L2.
template <int HD>
struct NewKV {
    u32 k[HD / 64], v[HD / 64];

    __device__ void load(const NewToken& nt) {
        const int lane = threadIdx.x & 31;
#pragma unroll
        for (int c = 0; c < HD / 64; ++c) {
            const int d = 64 * c + 2 * lane;
            k[c] = f2h(rotated(nt.k, d, nt.rot, nt.neox, nt.cos, nt.sin)) |
                   (u32)f2h(rotated(nt.k, d + 1, nt.rot, nt.neox, nt.cos, nt.sin)) << 16;
            v[c] = f2h(nt.v[d]) | (u32)f2h(nt.v[d + 1]) << 16;
        }
    }

    __device__ void store(const NewToken& nt) const {
        if (nt.k_store == nullptr) return;
#pragma unroll
        for (int c = 0; c < HD / 64; ++c) {
            reinterpret_cast<u32*>(nt.k_store)[32 * c + (threadIdx.x & 31)] = k[c];
            reinterpret_cast<u32*>(nt.v_store)[32 * c + (threadIdx.x & 31)] = v[c];
        }
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
template <int HD, bool DECODE>
__device__ __forceinline__ void attend_split(const float* __restrict__ q, long q_stride,
                                             const u16* __restrict__ k_cache, const u16* __restrict__ v_cache,
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
    const u16* kbase = k_cache + (long)kvh * max_tokens * HD;
    const u16* vbase = v_cache + (long)kvh * max_tokens * HD;
    // Keys and values before start[0] (set before the step) are cached before the kernel before this one runs.
    // So while it finishes, a decode warp asks L2 for its rows (and with DECODE loads the first key it scores).
    if (n == 1) {
        const char* kb = reinterpret_cast<const char*>(kbase + (long)lo * HD);
        const char* vb = reinterpret_cast<const char*>(vbase + (long)lo * HD);
        for (long off = 128L * lane; off < (long)(cached_hi - lo) * HD * 2; off += 32 * 128) {
            prefetch_l2_line(kb + off);
            prefetch_l2_line(vb + off);
        }
    }
    uint4 kv[HD / 8];
    if (DECODE) KeyTile<HD>::template load<true>(kbase, lo, cached_hi, kv);
    grid_dependency_sync();

    // Every load (q, and the step's own key and value) before any store, so they make one trip to L2 together:
    // the compiler cannot move a load past the cache store, which might alias it.
    const float* qr = q + qi * q_stride + (long)head * HD;
    float qv[HD / 32];
#pragma unroll
    for (int i = 0; i < HD / 32; ++i) {
        const int d = lane + 32 * i;
        qv[i] = (DECODE ? rotated(qr, d, nt.rot, nt.neox, nt.cos, nt.sin) : qr[d]) * scale_log2;
    }
    const bool own = DECODE && lo <= pos && pos < hi;  // the split holding the step's own token
    NewKV<HD> nkv;
    if (own) nkv.load(nt);
#pragma unroll
    for (int i = 0; i < HD / 32; ++i) qs[warp][lane + 32 * i] = qv[i];
    if (own) nkv.store(nt);
    __syncwarp();
    warp_attend<HD, DECODE>(qs[warp], kbase, vbase, lo, cached_hi, kv, acc, m, l);
    if (own) nkv.attend(qs[warp], acc, m, l);
}

template <int HD>
__device__ __forceinline__ void attention_partial_impl(const float* __restrict__ q, long q_stride,
                                                       const u16* __restrict__ k_cache,
                                                       const u16* __restrict__ v_cache, int max_tokens,
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
    attend_split<HD, false>(q, q_stride, k_cache, v_cache, max_tokens, n_heads, n_kv, start, n, window,
                            scale_log2, qi, head, split, n_splits, NewToken{}, acc, m, l);
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

#define ATTENTION_PARTIAL(HD)                                                                                  \
    extern "C" __global__ void attention_partial_##HD(                                                        \
        const float* q, long q_stride, const u16* k_cache, const u16* v_cache, int max_tokens, int n_heads,  \
        int n_kv, const int* start, int n, int window, float scale_log2, int wpq, float* part, u32* done,    \
        float* out, signed char* xq, signed char* xq2, float2* xds) {                                         \
        attention_partial_impl<HD>(q, q_stride, k_cache, v_cache, max_tokens, n_heads, n_kv, start, n, window, \
                                   scale_log2, wpq, part, done, out, xq, xq2, xds);                            \
    }
ATTENTION_PARTIAL(64)
ATTENTION_PARTIAL(128)
ATTENTION_PARTIAL(256)

// Decode at depth: a block per (KV head, split of the keys) serves every query head of the group, so each key and
// value row is read once a step rather than once per query head, and the splits (grid x) fill the GPU at any
// depth the cache holds. The grid is sized for the longest range; a step's keys go to as few splits as take at
// least SPLIT_MIN_KEYS each (a multiple of 32), and the other blocks exit at once. The block's 4 warps take the
// split's 32-key tiles in turn (each key tile scored against every query of the group, each value row weighted
// for all of them), merge in shared memory and leave one partial result per query head in part; the KV head's
// last block to finish (counted in done[kvh], left at zero) merges the splits and quantizes the output
// (combine_splits). The step's own token is rotated, stored and attended as in attention_decode.
#define SPLIT_MIN_KEYS 128

template <int HD, int G>
__device__ __forceinline__ void attention_decode_split_impl(
    const float* __restrict__ q, const float* k_new, const float* v_new, const float* cos_t, const float* sin_t,
    int rot, int neox, u16* k_cache, u16* v_cache, int max_tokens, int n_heads, int n_kv, const int* start,
    int window, float scale_log2, int kvh, int split, int n_splits, float* part, u32* done, float* out,
    signed char* xq, signed char* xq2, float2* xds) {
    constexpr int WPL = HD / 64, VT = 8;
    __shared__ float qs[G][HD], wacc[4][G][HD], wm[4][G], wl[4][G];
    __shared__ bool last;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int group = n_heads / n_kv;
    const int pos = start[0];
    const int first = window > 0 ? max(0, pos - window + 1) : 0;
    const int len = pos + 1 - first;
    const int per = max(SPLIT_MIN_KEYS, (len + 32 * n_splits - 1) / (32 * n_splits) * 32);
    const int active = (len + per - 1) / per;
    if (split >= active) return;
    const int lo = first + split * per, hi = min(lo + per, pos + 1), cached_hi = min(hi, pos);
    const u16* kbase = k_cache + (long)kvh * max_tokens * HD;
    const u16* vbase = v_cache + (long)kvh * max_tokens * HD;
    // The cached rows are final before the kernel before this one runs: ask L2 for them while it finishes.
    for (long off = 128L * threadIdx.x; off < (long)(cached_hi - lo) * HD * 2; off += 128L * blockDim.x) {
        prefetch_l2_line(reinterpret_cast<const char*>(kbase + (long)lo * HD) + off);
        prefetch_l2_line(reinterpret_cast<const char*>(vbase + (long)lo * HD) + off);
    }
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
        KeyTile<HD>::load(kbase, j0, cached_hi, kv);
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
#pragma unroll
            for (int t = 0; t < VT; ++t)
#pragma unroll
                for (int c = 0; c < WPL; ++c)
                    vv[t][c] = jj + t < cnt
                                   ? __ldg(reinterpret_cast<const u32*>(vbase + (long)(j0 + jj + t) * HD) + 32 * c + lane)
                                   : 0u;
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
        const long row = ((long)kvh * max_tokens + pos) * HD;
        const NewToken nt = {k_new + (long)kvh * HD, v_new + (long)kvh * HD, cos_p, sin_p, rot, neox,
                             k_cache + row, v_cache + row};
        NewKV<HD> nkv;
        nkv.load(nt);
        nkv.store(nt);
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
    for (int i = threadIdx.x; i < group * (HD + 2); i += blockDim.x) {
        const int h = i / (HD + 2), d = i % (HD + 2);
        const float top = fmaxf(fmaxf(wm[0][h], wm[1][h]), fmaxf(wm[2][h], wm[3][h]));
        float v = d == HD ? top : 0.0f;
        if (d != HD)
#pragma unroll
            for (int w = 0; w < 4; ++w) v += (d < HD ? wacc[w][h][d] : wl[w][h]) * exp2f(wm[w][h] - top);
        part[((long)(kvh * group + h) * n_splits + split) * (HD + 2) + d] = v;
    }
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        last = atomicAdd(done + kvh, 1u) == active - 1;
        if (last) done[kvh] = 0;
    }
    __syncthreads();
    if (!last) return;
    for (int h = 0; h < group; ++h) {
        const int head = kvh * group + h;
        if (h > 0) __syncthreads();  // combine_splits' shared maxima and sums are read before they are rewritten
        combine_splits(part + (long)head * n_splits * (HD + 2), active, HD, out + (long)head * HD, xq, xq2, xds,
                       (long)head * HD / 32);
    }
}

#define ATTENTION_DECODE_SPLIT(HD, G)                                                                           \
    extern "C" __global__ void __launch_bounds__(128) attention_decode_split_##HD##_g##G(                       \
        const float* q, const float* k_new, const float* v_new, const float* cos_t, const float* sin_t, int rot, \
        int neox, u16* k_cache, u16* v_cache, int max_tokens, int n_heads, int n_kv, const int* start,         \
        int window, float scale_log2, float* part, u32* done, float* out, signed char* xq, signed char* xq2,   \
        float2* xds) {                                                                                         \
        attention_decode_split_impl<HD, G>(q, k_new, v_new, cos_t, sin_t, rot, neox, k_cache, v_cache,          \
                                           max_tokens, n_heads, n_kv, start, window, scale_log2, blockIdx.y,    \
                                           blockIdx.x, gridDim.x, part, done, out, xq, xq2, xds);               \
    }
ATTENTION_DECODE_SPLIT(64, 4)
ATTENTION_DECODE_SPLIT(64, 8)
ATTENTION_DECODE_SPLIT(128, 4)
ATTENTION_DECODE_SPLIT(128, 8)
ATTENTION_DECODE_SPLIT(256, 4)
ATTENTION_DECODE_SPLIT(256, 8)

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

template <int HD>
__device__ __forceinline__ void attention_decode_impl(const float* q, const float* k_new, const float* v_new,
                                                      const float* cos_t, const float* sin_t, int rot, int neox,
                                                      u16* k_cache, u16* v_cache, int max_tokens, int n_heads,
                                                      int n_kv, const int* start, int window, float scale_log2,
                                                      float* out, signed char* xq, signed char* xq2, float2* xds) {
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
    const long row = ((long)kvh * max_tokens + pos) * HD;
    const bool store = head % group == 0;
    const NewToken nt = {k_new + (long)kvh * HD, v_new + (long)kvh * HD, cos_t + (long)pos * (rot / 2),
                         sin_t + (long)pos * (rot / 2), rot, neox, store ? k_cache + row : nullptr,
                         store ? v_cache + row : nullptr};
    u32 rank;
    asm("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
    const int split = 4 * rank + warp;
    float acc[HD / 32], m, l;
    attend_split<HD, true>(q, 0, k_cache, v_cache, max_tokens, n_heads, n_kv, start, 1, window, scale_log2, 0,
                           head, split, N_SPLITS, nt, acc, m, l);
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

#define ATTENTION_DECODE(HD)                                                                                   \
    extern "C" __global__ void __cluster_dims__(1, 1, ATTN_CLUSTER) attention_decode_##HD(                    \
        const float* q, const float* k_new, const float* v_new, const float* cos_t, const float* sin_t, int rot, \
        int neox, u16* k_cache, u16* v_cache, int max_tokens, int n_heads, int n_kv, const int* start,         \
        int window, float scale_log2, float* out, signed char* xq, signed char* xq2, float2* xds) {          \
        attention_decode_impl<HD>(q, k_new, v_new, cos_t, sin_t, rot, neox, k_cache, v_cache, max_tokens,      \
                                  n_heads, n_kv, start, window, scale_log2, out, xq, xq2, xds);               \
    }
ATTENTION_DECODE(64)
ATTENTION_DECODE(128)
ATTENTION_DECODE(256)
#endif

// One block per (query, head), one thread per dim (prompt chunks: a query's splits are its warps).
extern "C" __global__ void attention_combine(const float* __restrict__ part, int n_heads, int hd, int n_splits,
                                             float* __restrict__ out, long out_stride) {
    grid_dependency_sync();
    const int qi = blockIdx.x, head = blockIdx.y;
    combine_splits(part + ((long)qi * n_heads + head) * n_splits * (hd + 2), n_splits, hd,
                   out + qi * out_stride + (long)head * hd, nullptr, nullptr, nullptr, 0);
}
