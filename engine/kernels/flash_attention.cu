// Causal grouped-query attention of a prompt chunk over the KV cache on tensor cores (flash attention, sm_80+).
//
// A block takes one KV head and FA_ROWS (token, query head) rows: consecutive tokens of the chunk, each with all
// the query heads that share the KV head, so a K/V tile staged in shared memory serves the whole GQA group. Each
// of the 4 warps owns 16 rows: its queries stay in registers as mma A fragments, the scores of a key tile
// (mma.sync m16n8k16, fp32) get an online softmax in base 2, and the probabilities are repacked in registers as
// the A fragments of P.V, so no score matrix is ever stored. K and V tiles arrive by cp.async into one buffer
// each: V of a tile loads while its scores are computed, the next K while its softmax and P.V run. Key tiles past
// the block's last query position are never visited; only tiles the causal diagonal or the sliding window cross
// are masked element by element.
//
// The chunk's first position comes from start[0] in device memory (its keys and values already stored in the
// cache by rope_store_kv). A q8_0 cache's tiles arrive by cp.async too, into a staging buffer in which each thread
// owns the chunks it copies: once its own copies landed it turns them into the fp16 tile, before the barrier the
// fp16 form has there anyway.

constexpr int FA_ROWS = 64;  // (token, query head) rows a block; cuda.py FLASH_ROWS
constexpr int FA_THREADS = 128;

// Keys (or values) j0 .. j0 + KT - 1 of one KV head, on their way into a shared tile of rows padded to D + 8 halves
// (ldmatrix's eight row addresses then fall in distinct banks); rows from `end` on are zeros. fp16 rows go straight
// into the tile; a q8_0 cache's as 16-byte chunks of int8 values (16 dims of a row) and the 4 bytes holding each
// chunk's scale, into the thread's own places in raw_q and raw_s, which finish_tile converts.
template <int D, int KT, bool Q8>
__device__ __forceinline__ void load_tile(u16 (*tile)[D + 8], u8* raw_q, u32* raw_s, const CacheRows<D, Q8>& rows,
                                          int j0, int end) {
    constexpr int PER_ROW = Q8 ? D / 16 : D / 8;
    const long first = rows.row(j0);  // the tile's rows step from here (CacheRows::step)
#pragma unroll
    for (int i = 0; i < KT * PER_ROW / FA_THREADS; ++i) {
        const int c = i * FA_THREADS + threadIdx.x;
        const int row = c / PER_ROW;
        const long j = j0 + row < end ? rows.step(first, row) : first;
        if constexpr (Q8) {
            const int col = 16 * (c % PER_ROW);
            copy16(raw_q + 16 * c, rows.data + j * D + col, j0 + row < end);
            const u32* scales = reinterpret_cast<const u32*>(rows.scale);
            copy_small<4>(raw_s + c, scales + (j * (D / 32) + col / 32) / 2, j0 + row < end);
        } else {
            const int col = 8 * (c % PER_ROW);
            copy16(&tile[row][col], reinterpret_cast<const u16*>(rows.data) + j * D + col, j0 + row < end);
        }
    }
    copies_commit();
}

// A q8_0 tile's chunks this thread copied (load_tile, landed) as fp16 in the tile.
template <int D, int KT>
__device__ __forceinline__ void finish_tile(u16 (*tile)[D + 8], const u8* raw_q, const u32* raw_s) {
    constexpr int PER_ROW = D / 16;
#pragma unroll
    for (int i = 0; i < KT * PER_ROW / FA_THREADS; ++i) {
        const int c = i * FA_THREADS + threadIdx.x;
        const int row = c / PER_ROW, col = 16 * (c % PER_ROW);
        const int half = (col / 32) & 1;  // the scale's place in its word (a row has an even number of scales)
        const u32 s2 = both_halves((u16)(raw_s[c] >> (16 * half)));
        const uint4 q = *reinterpret_cast<const uint4*>(raw_q + 16 * c);
        *reinterpret_cast<uint4*>(&tile[row][col]) = q8_half8(make_uint2(q.x, q.y), s2);
        *reinterpret_cast<uint4*>(&tile[row][col + 8]) = q8_half8(make_uint2(q.z, q.w), s2);
    }
}

template <int D, bool Q8>
__device__ __forceinline__ void flash_attention_impl(const float* __restrict__ q, long q_stride, const void* k_cache,
                                                     const void* v_cache, const u16* k_scale, const u16* v_scale,
                                                     int max_tokens, int n_heads, int n_kv,
                                                     const int* __restrict__ start, int n, int window,
                                                     float scale_log2, float* __restrict__ out, long out_stride) {
    constexpr int KT = D <= 128 ? 64 : 32;  // keys a tile (head dim 256: fewer, for registers and shared memory)
    constexpr int DK = D / 16, DN = D / 8, KN = KT / 8;
    __shared__ __align__(16) u16 ks[KT][D + 8];
    __shared__ __align__(16) u16 vs[KT][D + 8];
    __shared__ __align__(16) u8 raw_q[Q8 ? KT * D : 16];  // a q8_0 tile on its way (load_tile)
    __shared__ u32 raw_s[Q8 ? KT * D / 16 : 1];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int group = n_heads / n_kv, kvh = blockIdx.y;
    const int tokens = FA_ROWS / group;                       // tokens a block
    const int t0 = (gridDim.x - 1 - blockIdx.x) * tokens;     // the longest key ranges start first
    grid_dependency_sync();
    const int first = start[0];
    const int pos_lo = first + t0, pos_hi = first + min(t0 + tokens, n) - 1;

    // This thread's two rows (g and g + 8 of its warp's 16): their position, head, and whether they are real
    // (a row past the chunk or past tokens * group computes on a clamped token and stores nothing).
    int pos[2], head[2], tok[2];
    bool real[2];
    u32 qa[DK][4];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = 16 * warp + g + 8 * h;
        tok[h] = min(t0 + r / group, n - 1);
        real[h] = r < tokens * group && t0 + r / group < n;
        pos[h] = first + tok[h];
        head[h] = kvh * group + r % group;
        const float* qr = q + (long)tok[h] * q_stride + (long)head[h] * D + 2 * t;
#pragma unroll
        for (int kk = 0; kk < DK; ++kk) {
            const float2 lo = __ldg(reinterpret_cast<const float2*>(qr + 16 * kk));
            const float2 hi = __ldg(reinterpret_cast<const float2*>(qr + 16 * kk + 8));
            qa[kk][h] = half2_bits(lo.x * scale_log2, lo.y * scale_log2);     // A fragment: a0 / a1 rows g / g + 8,
            qa[kk][2 + h] = half2_bits(hi.x * scale_log2, hi.y * scale_log2);  // a2 / a3 the same 8 dims on
        }
    }

    const CacheRows<D, Q8> kb(k_cache, k_scale, kvh, max_tokens), vb(v_cache, v_scale, kvh, max_tokens);
    const int end = pos_hi + 1;
    const int j_first = (window > 0 ? max(0, pos_lo - window + 1) : 0) / KT * KT;
    float o[DN][4] = {};
    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.0f, 0.0f};
    load_tile<D, KT, Q8>(ks, raw_q, raw_s, kb, j_first, end);
    for (int j0 = j_first; j0 < end; j0 += KT) {
        copies_wait();
        if constexpr (Q8) finish_tile<D, KT>(ks, raw_q, raw_s);  // every warp is past its scores on the last tile
        __syncthreads();  // K tile landed; every warp is past its P.V on the previous V tile
        load_tile<D, KT, Q8>(vs, raw_q, raw_s, vb, j0, end);

        float s[KN][4];
        tile_scores<D, KT>(qa, &ks[0][0], D + 8, s);
        // s[nb][2 h + e]: row g + 8 h, key j0 + 8 nb + 2 t + e.
        if (j0 + KT - 1 > pos_lo || (window > 0 && j0 <= pos_hi - window)) {
#pragma unroll
            for (int nb = 0; nb < KN; ++nb)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int key = j0 + 8 * nb + 2 * t + (e & 1), p = pos[e >> 1];
                    if (key > p || (window > 0 && key <= p - window)) s[nb][e] = NEG_INF;
                }
        }
        u32 pa[KT / 16][4];
        tile_softmax<D, KT>(s, m, l, o, pa);
        copies_wait();
        if constexpr (Q8) finish_tile<D, KT>(vs, raw_q, raw_s);  // every warp is past its P.V on the last tile
        __syncthreads();  // V tile landed; every warp is past its scores on this K tile
        if (j0 + KT < end) load_tile<D, KT, Q8>(ks, raw_q, raw_s, kb, j0 + KT, end);
        tile_values<D, KT>(pa, &vs[0][0], D + 8, o);
    }

    // o[db][2 h + e]: row g + 8 h, dim 8 db + 2 t + e; the row's sum is spread over the 4 lanes of its quad.
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        float sum = l[h];
        sum += __shfl_xor_sync(0xFFFFFFFFu, sum, 1);
        sum += __shfl_xor_sync(0xFFFFFFFFu, sum, 2);
        if (!real[h]) continue;
        const float inv = 1.0f / sum;
        float* orow = out + (long)tok[h] * out_stride + (long)head[h] * D + 2 * t;
#pragma unroll
        for (int db = 0; db < DN; ++db)
            *reinterpret_cast<float2*>(orow + 8 * db) = make_float2(o[db][2 * h] * inv, o[db][2 * h + 1] * inv);
    }
}

// KV: the cache's form in the name (kernel_names.KV_SUFFIX); scales: a q8_0 cache's, else unused.
#define FLASH_ATTENTION(D, Q8, KV)                                                                                \
    extern "C" __global__ void __launch_bounds__(FA_THREADS) flash_attention_##D##KV(                           \
        const float* q, long q_stride, const void* k_cache, const void* v_cache, const u16* k_scale,              \
        const u16* v_scale, int max_tokens, int n_heads, int n_kv, const int* start, int n, int window,           \
        float scale_log2, float* out, long out_stride) {                                                          \
        flash_attention_impl<D, Q8>(q, q_stride, k_cache, v_cache, k_scale, v_scale, max_tokens, n_heads, n_kv,   \
                                    start, n, window, scale_log2, out, out_stride);                               \
    }
#define FLASH_ATTENTION_KV(D) FLASH_ATTENTION(D, false, ) FLASH_ATTENTION(D, true, _q8)
FLASH_ATTENTION_KV(64)
FLASH_ATTENTION_KV(128)
FLASH_ATTENTION_KV(256)
