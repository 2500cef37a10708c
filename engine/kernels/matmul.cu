// Prompt-chunk products on tensor cores, straight from the quantized planes: each block dequantizes a tile of
// weight rows to fp16 in shared memory, brings the matching tile of activations there as fp16, and multiplies them
// with mma.sync (fp32 accumulation). One launch per product, where the other prompt path (dequantize to a scratch
// matrix, then cuBLAS) takes three: on small models the prompt is bound by launches.
//
// out (n, m) = x (n, k) . W (m, k)^T. A block covers MM_TOKENS tokens and MM_ROWS rows of shared memory tile; four
// warps each compute 32 tokens x 32 tile rows. The gate/up variant loads 16 gate rows, then the same 16 up rows, in
// each warp's 32 tile rows, so one thread holds gate and up of the same output and applies the activation before
// storing: a block there covers MM_ROWS / 2 outputs.
//
// Pipelined over K steps: while the tensor cores take step kt, step kt + 1's weight groups are in flight to
// registers and its activations to shared memory (cp.async for fp16 activations; float32 ones go through registers
// and are rounded on the way in). Weights become fp16 in three instructions a pair (i8_pair_f16, one fp16 fma with
// the group's scale and offset), not through float conversions, which run at a quarter of the ALU's rate.
//
// Grouped form (a mixture's prompt chunk): the chunk's (token, expert) slots sorted by expert (moe_group), each
// block one tile of up to MM_TOKENS sorted slots of one expert, so an expert's weights are read once a tile, not
// once a slot. Its fp16 activation rows are gathered (gate/up read the token's row of x) or the sorted rows
// themselves (down reads the fp16 hidden rows gate/up wrote in sorted order); outputs are written in sorted order.

constexpr int MM_TOKENS = 64, MM_ROWS = 64, MM_K = 64;
constexpr int MM_LD = MM_K + 8;  // padded row (144 bytes): ldmatrix's eight row addresses hit distinct banks

// Tile row j (0..MM_ROWS-1) of block bx: which matrix (0 = W or gate, 1 = up) and which of its rows.
template <bool GLU>
__device__ __forceinline__ int tile_row(int bx, int j, int& which) {
    if (!GLU) {
        which = 0;
        return bx * MM_ROWS + j;
    }
    which = (j >> 4) & 1;
    return bx * (MM_ROWS / 2) + (j >> 5) * 16 + (j & 15);
}

// Where a block's tile reads and writes: x row of tile token t = xrow[t] (t < count), output row out0 + t, and the
// first row of the weight (an expert's, in a stacked tensor).
struct Tile {
    const int* xrow;  // shared memory, MM_TOKENS entries
    int count;
    long out0;
    long w0;
};

// A thread's weight group of a K step (tile row threadIdx.x / 2, group threadIdx.x % 2 of the step), as
// decode_group yields it: value i = sc[i / 16] * (signed byte i of w) + mn.
struct WeightGroup {
    int w[8];
    float sc[2], mn;
};

// Branch-free (rows and groups past the matrix read its last ones and are zeroed by their scales), so the loads
// stay in flight while the tensor cores work.
template <class B, bool GLU>
__device__ __forceinline__ void fetch_weights(const Planes& p0, const Planes& p1, const Tile& tile, int m, int k,
                                              int kt, WeightGroup& g) {
    const int t = threadIdx.x;
    const int group = kt * (MM_K / 32) + (t & 1);
    int which;
    const int row = tile_row<GLU>(blockIdx.x, t >> 1, which);
    // Field by field: a selected struct would go through local memory.
    const Planes p{which ? p1.q : p0.q, which ? p1.h : p0.h, which ? p1.s : p0.s, which ? p1.d : p0.d};
    decode_group<B>(p, tile.w0 + min(row, m - 1), k, min(group, k / 32 - 1), g.w, g.sc, g.mn);
    if (row >= m || group >= k / 32) g.sc[0] = g.sc[1] = g.mn = 0.0f;
}

template <bool HIGH>
__device__ __forceinline__ u32 scaled_pair(u32 w, u32 sc2, u32 mn2) {
    u32 h = i8_pair_f16<HIGH>(w);
    asm("fma.rn.f16x2 %0, %0, %1, %2;" : "+r"(h) : "r"(sc2), "r"(mn2));
    return h;
}

__device__ __forceinline__ void store_weights(const WeightGroup& g, u16 (*ws)[MM_LD]) {
    const int t = threadIdx.x;
    const u32 mn2 = both_halves(f2h(g.mn));
    uint4* dst = reinterpret_cast<uint4*>(&ws[t >> 1][32 * (t & 1)]);
#pragma unroll
    for (int c = 0; c < 4; ++c) {
        const u32 sc2 = both_halves(f2h(g.sc[c / 2])), lo = g.w[2 * c], hi = g.w[2 * c + 1];
        dst[c] = make_uint4(scaled_pair<false>(lo, sc2, mn2), scaled_pair<true>(lo, sc2, mn2),
                            scaled_pair<false>(hi, sc2, mn2), scaled_pair<true>(hi, sc2, mn2));
    }
}

// A K step's activation tile, MM_TOKENS rows of MM_K values: fetched during the step before, stored at its start.
template <class X>
struct ActivationTile;

// float32 activations: eight float4 registers a thread, rounded to fp16 on the way into shared memory.
template <>
struct ActivationTile<float> {
    static constexpr int LOADS = MM_TOKENS * MM_K / 4 / 128;
    float4 v[LOADS];
    __device__ void fetch(const float* __restrict__ x, long ldx, const Tile& tile, int k, int kt, u16 (*)[MM_LD]) {
#pragma unroll
        for (int i = 0; i < LOADS; ++i) {
            const int f = i * 128 + threadIdx.x;
            const int tok = f / (MM_K / 4), kk = kt * MM_K + 4 * (f % (MM_K / 4));
            v[i] = tok < tile.count && kk < k ? __ldg(reinterpret_cast<const float4*>(x + tile.xrow[tok] * ldx + kk))
                                             : make_float4(0.f, 0.f, 0.f, 0.f);
        }
    }
    __device__ void store(u16 (*xs)[MM_LD]) const {
#pragma unroll
        for (int i = 0; i < LOADS; ++i) {
            const int f = i * 128 + threadIdx.x;
            *reinterpret_cast<uint2*>(&xs[f / (MM_K / 4)][4 * (f % (MM_K / 4))]) =
                make_uint2(half2_bits(v[i].x, v[i].y), half2_bits(v[i].z, v[i].w));
        }
    }
};

// fp16 activations: copied to shared memory by cp.async, 16 bytes at a time; nothing held in registers.
template <>
struct ActivationTile<u16> {
    static constexpr int COPIES = MM_TOKENS * MM_K / 8 / 128;
    __device__ void fetch(const u16* __restrict__ x, long ldx, const Tile& tile, int k, int kt, u16 (*xs)[MM_LD]) {
#pragma unroll
        for (int i = 0; i < COPIES; ++i) {
            const int f = i * 128 + threadIdx.x;
            const int tok = f / (MM_K / 8), col = 8 * (f % (MM_K / 8)), kk = kt * MM_K + col;
            const bool fill = tok < tile.count && kk < k;
            copy16(&xs[tok][col], x + (fill ? tile.xrow[tok] * ldx + kk : 0), fill);
        }
        copies_commit();
    }
    __device__ void store(u16 (*)[MM_LD]) const { copies_wait<0>(); }
};

__device__ __forceinline__ void store_pair(float* out, float2 v) { *reinterpret_cast<float2*>(out) = v; }
__device__ __forceinline__ void store_pair(u16* out, float2 v) { *reinterpret_cast<u32*>(out) = half2_bits(v.x, v.y); }

template <class B, bool GLU, class X, class O>
__device__ __forceinline__ void matmul_q(const Planes& p0, const Planes& p1, const X* __restrict__ x, long ldx,
                                         O* __restrict__ out, long ldo, const Tile& tile, int m, int k, int act) {
    __shared__ __align__(16) u16 ws[2][MM_ROWS][MM_LD];
    __shared__ __align__(16) u16 xs[2][MM_TOKENS][MM_LD];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int wm = warp >> 1, wn = warp & 1;  // this warp's 32 tokens and 32 tile rows
    const bool busy = wm * 32 < tile.count;   // a warp whose tokens all lie past the tile skips the products
    float acc[2][4][4] = {};
    const int steps = (k + MM_K - 1) / MM_K;
    WeightGroup g;
    ActivationTile<X> xt;
    fetch_weights<B, GLU>(p0, p1, tile, m, k, 0, g);
    xt.fetch(x, ldx, tile, k, 0, xs[0]);
    for (int kt = 0; kt < steps; ++kt) {
        // Two buffers, one barrier a step: buffer b is written before step kt's barrier by threads that have passed
        // step kt - 1's, which every warp reaches only after its products on b in step kt - 2; the copies into
        // b ^ 1 start after step kt's barrier, which follows every warp's products on b ^ 1 in step kt - 1.
        const int b = kt & 1;
        store_weights(g, ws[b]);
        xt.store(xs[b]);
        __syncthreads();
        if (kt + 1 < steps) {
            fetch_weights<B, GLU>(p0, p1, tile, m, k, kt + 1, g);
            xt.fetch(x, ldx, tile, k, kt + 1, xs[b ^ 1]);
        }
        if (!busy) continue;
#pragma unroll
        for (int ks = 0; ks < MM_K / 16; ++ks) {
            u32 a[2][4], w[2][4];
#pragma unroll
            for (int mi = 0; mi < 2; ++mi)
                ldsm_x4(a[mi], &xs[b][wm * 32 + mi * 16 + (lane & 15)][ks * 16 + (lane >> 4) * 8]);
#pragma unroll
            for (int nj = 0; nj < 2; ++nj)
                ldsm_x4(w[nj], &ws[b][wn * 32 + nj * 16 + (lane & 7) + (lane >> 4) * 8][ks * 16 + ((lane >> 3) & 1) * 8]);
#pragma unroll
            for (int mi = 0; mi < 2; ++mi)
#pragma unroll
                for (int nb = 0; nb < 4; ++nb) mma_f16(acc[mi][nb], a[mi], w[nb >> 1][2 * (nb & 1)], w[nb >> 1][2 * (nb & 1) + 1]);
        }
    }
    // acc[mi][nb] = {(token r, tile row c), (r, c + 1), (r + 8, c), (r + 8, c + 1)}, r = lane / 4, c = 2 (lane % 4).
#pragma unroll
    for (int mi = 0; mi < 2; ++mi)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int t = wm * 32 + mi * 16 + (lane >> 2) + 8 * h;
            if (t >= tile.count) continue;
#pragma unroll
            for (int nb = 0; nb < (GLU ? 2 : 4); ++nb) {
                int which;
                const int row = tile_row<GLU>(blockIdx.x, wn * 32 + nb * 8 + 2 * (lane & 3), which);
                if (row >= m) continue;
                float2 v = make_float2(acc[mi][nb][2 * h], acc[mi][nb][2 * h + 1]);
                if (GLU) {
                    v.x = activate(v.x, act) * acc[mi][nb + 2][2 * h];
                    v.y = activate(v.y, act) * acc[mi][nb + 2][2 * h + 1];
                }
                store_pair(out + (tile.out0 + t) * ldo + row, v);
            }
        }
}

// The dense form's tile: tokens blockIdx.y * MM_TOKENS.. of x and out.
__device__ __forceinline__ Tile dense_tile(int* xrow, int n) {
    const int first = blockIdx.y * MM_TOKENS;
    if (threadIdx.x < MM_TOKENS) xrow[threadIdx.x] = first + threadIdx.x;
    __syncthreads();
    return Tile{xrow, min(MM_TOKENS, n - first), first, 0};
}

// The grouped form's tile blockIdx.y of the table moe_group wrote ({expert, first sorted position, end}; expert -1
// past the last tile): gathered rows order[pos] / top_k of x, or the sorted rows themselves when top_k is 0.
__device__ __forceinline__ bool grouped_tile(int* xrow, const int* __restrict__ tiles, const int* __restrict__ order,
                                             int top_k, int m, Tile& tile) {
    const int* entry = tiles + 3 * blockIdx.y;
    const int expert = __ldg(entry), first = __ldg(entry + 1);
    if (expert < 0) return false;
    const int pos = first + threadIdx.x;
    if (threadIdx.x < MM_TOKENS) xrow[threadIdx.x] = top_k ? __ldg(order + min(pos, __ldg(entry + 2) - 1)) / top_k : pos;
    __syncthreads();
    tile = Tile{xrow, __ldg(entry + 2) - first, first, (long)expert * m};
    return true;
}

#define MATMUL_Q(name, B)                                                                                          \
    extern "C" __global__ void __launch_bounds__(128) matmul_##name(                                               \
        const u8* q, const u8* h, const u8* s, const u8* d, const float* x, long ldx, float* out, long ldo, int n, \
        int m, int k) {                                                                                            \
        grid_dependency_sync();                                                                                    \
        __shared__ int xrow[MM_TOKENS];                                                                            \
        const Planes p{q, h, s, d};                                                                                \
        matmul_q<B, false>(p, p, x, ldx, out, ldo, dense_tile(xrow, n), m, k, 0);                                  \
    }                                                                                                              \
    extern "C" __global__ void __launch_bounds__(128) matmul_glu_##name(                                           \
        const u8* gq, const u8* gh, const u8* gs, const u8* gd, const u8* uq, const u8* uh, const u8* us,           \
        const u8* ud, const float* x, long ldx, float* out, long ldo, int n, int m, int k, int act) {              \
        grid_dependency_sync();                                                                                    \
        __shared__ int xrow[MM_TOKENS];                                                                            \
        matmul_q<B, true>(Planes{gq, gh, gs, gd}, Planes{uq, uh, us, ud}, x, ldx, out, ldo, dense_tile(xrow, n), m, \
                          k, act);                                                                                 \
    }
FOR_EACH_QUANT(MATMUL_Q)

#define GROUPED_Q(name, B)                                                                                         \
    extern "C" __global__ void __launch_bounds__(128) grouped_matmul_##name(                                       \
        const u8* q, const u8* h, const u8* s, const u8* d, const u16* x, float* out, const int* tiles, int m,     \
        int k) {                                                                                                   \
        grid_dependency_sync();                                                                                    \
        __shared__ int xrow[MM_TOKENS];                                                                            \
        Tile tile;                                                                                                 \
        if (!grouped_tile(xrow, tiles, nullptr, 0, m, tile)) return;                                               \
        const Planes p{q, h, s, d};                                                                                \
        matmul_q<B, false>(p, p, x, k, out, m, tile, m, k, 0);                                                     \
    }                                                                                                              \
    extern "C" __global__ void __launch_bounds__(128) grouped_matmul_glu_##name(                                   \
        const u8* gq, const u8* gh, const u8* gs, const u8* gd, const u8* uq, const u8* uh, const u8* us,           \
        const u8* ud, const u16* x, u16* out, const int* tiles, const int* order, int top_k, int m, int k,         \
        int act) {                                                                                                 \
        grid_dependency_sync();                                                                                    \
        __shared__ int xrow[MM_TOKENS];                                                                            \
        Tile tile;                                                                                                 \
        if (!grouped_tile(xrow, tiles, order, top_k, m, tile)) return;                                             \
        matmul_q<B, true>(Planes{gq, gh, gs, gd}, Planes{uq, uh, us, ud}, x, k, out, m, tile, m, k, act);          \
    }
FOR_EACH_QUANT(GROUPED_Q)
FOR_EACH_HOST_LAYOUT(GROUPED_Q)

// A mixture's chunk sorted by expert, for the grouped products; one block. ids (n_slots,) = the chosen expert of
// each slot (token * top_k + j). Writes order[pos] = the slot at sorted position pos, where[slot] = its position,
// and tiles (max_tiles, 3) = {expert, first position, end} for each run of up to MM_TOKENS positions of one expert,
// the rest {-1, 0, 0}. Slots of one expert keep no fixed order among themselves; each output row is computed
// alone, so the results do not depend on it.
extern "C" __global__ void moe_group(const int* __restrict__ ids, int n_slots, int n_experts, int max_tiles,
                                     int* __restrict__ order, int* __restrict__ where, int* __restrict__ tiles) {
    grid_dependency_sync();
    extern __shared__ int shared_counts[];
    int* count = shared_counts;         // slots an expert holds, then a cursor while placing them
    int* start = count + n_experts;     // its first sorted position
    for (int e = threadIdx.x; e < n_experts; e += blockDim.x) count[e] = 0;
    __syncthreads();
    for (int s = threadIdx.x; s < n_slots; s += blockDim.x) atomicAdd(&count[min(max(ids[s], 0), n_experts - 1)], 1);
    __syncthreads();
    if (threadIdx.x == 0) {
        int pos = 0, tile = 0;
        for (int e = 0; e < n_experts; ++e) {
            start[e] = pos;
            for (int first = pos; first < pos + count[e] && tile < max_tiles; first += MM_TOKENS, ++tile) {
                tiles[3 * tile] = e;
                tiles[3 * tile + 1] = first;
                tiles[3 * tile + 2] = min(first + MM_TOKENS, pos + count[e]);
            }
            pos += count[e];
            count[e] = 0;
        }
        for (; tile < max_tiles; ++tile) {
            tiles[3 * tile] = -1;
            tiles[3 * tile + 1] = tiles[3 * tile + 2] = 0;
        }
    }
    __syncthreads();
    for (int s = threadIdx.x; s < n_slots; s += blockDim.x) {
        const int e = min(max(ids[s], 0), n_experts - 1);
        const int pos = start[e] + atomicAdd(&count[e], 1);
        order[pos] = s;
        where[s] = pos;
    }
}

// out (n, d) = sum_j weights[t, j] * y[where[t * top_k + j]]: the down products' sorted rows summed back per token
// in the slots' order.
extern "C" __global__ void moe_combine(const float* __restrict__ y, const int* __restrict__ where,
                                       const float* __restrict__ weights, int n, int top_k, int d,
                                       float* __restrict__ out) {
    grid_dependency_sync();
    const long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long)n * d) return;
    const long t = i / d, c = i % d;
    float total = 0.0f;
    for (int j = 0; j < top_k; ++j) total += weights[t * top_k + j] * y[(long)where[t * top_k + j] * d + c];
    out[i] = total;
}
