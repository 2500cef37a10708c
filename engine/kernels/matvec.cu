// Matrix-vector products for decode: out[r] = W[r, :] . x for one token, on the weights as the GGUF stores them.
//
// Quantized weights: x is first quantized to int8 blocks of 32 (quantize_q8, once per input vector), then
// each warp walks R rows, each lane one group of 32 weights at a time, and multiplies 4 int8 pairs per dp4a
// instruction. The block scales come in as floats:  sum_e w_e x_e = dx * (sc0 * S_lo + sc1 * S_hi) + mn * xs,
// where S are the integer dot products of the halves and xs = dx * sum(xq) is precomputed per block.
// The gate/up variant computes two matrices against the same x and writes silu(gate) * up (SwiGLU) or
// gelu_tanh(gate) * up, so the FFN hidden vector is written once.

// Activations to int8 blocks (the two-level scheme of quantize_group in quant_blocks.cuh), one warp a group.
extern "C" __global__ void quantize_q8(const float* __restrict__ x, signed char* __restrict__ xq,
                                       signed char* __restrict__ xq2, float2* __restrict__ xds, int n_groups) {
    grid_dependency_sync();
    const int g = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (g >= n_groups) return;
    quantize_group(x[(long)g * 32 + (threadIdx.x & 31)], g, xq, xq2, xds);
}

__device__ __forceinline__ int dot8(const int (&w)[8], int t0, const int4& x) {
    int acc = dp4a(w[t0], x.x, 0);
    acc = dp4a(w[t0 + 1], x.y, acc);
    acc = dp4a(w[t0 + 2], x.z, acc);
    return dp4a(w[t0 + 3], x.w, acc);
}

// sum_e w_e x_e for one group, x given as its two quantization levels (see quantize_q8).
__device__ __forceinline__ float group_dot(const int (&w)[8], const int4 (&x)[4], const float (&sc)[2], float mn,
                                           float2 ds) {
    const int lo = 254 * dot8(w, 0, x[0]) + dot8(w, 0, x[2]);
    const int hi = 254 * dot8(w, 4, x[1]) + dot8(w, 4, x[3]);
    return ds.x * (1.0f / 254.0f) * (sc[0] * (float)lo + sc[1] * (float)hi) + mn * ds.y;
}

// Rows row0 .. row0 + R - 1 (those < m) of NW matrices times x, over the groups g = first, first + step, ...
// (one lane's share); acc[j * R + r] gets matrix j, row row0 + r. The R rows share each load of x.
template <class B, int NW, int R>
__device__ __forceinline__ void row_dots(const Planes* w, int row0, int m, int k, int first, int step,
                                         const signed char* __restrict__ xq, const signed char* __restrict__ xq2,
                                         const float2* __restrict__ xds, float (&acc)[NW * R]) {
    const int n_groups = k / 32;
#pragma unroll 2
    for (int g = first; g < n_groups; g += step) {
        const int4 xv[4] = {__ldg(reinterpret_cast<const int4*>(xq + 32 * (long)g)),
                            __ldg(reinterpret_cast<const int4*>(xq + 32 * (long)g + 16)),
                            __ldg(reinterpret_cast<const int4*>(xq2 + 32 * (long)g)),
                            __ldg(reinterpret_cast<const int4*>(xq2 + 32 * (long)g + 16))};
        const float2 ds = __ldg(xds + g);
#pragma unroll
        for (int r = 0; r < R; ++r) {
            if (R > 1 && row0 + r >= m) break;
#pragma unroll
            for (int j = 0; j < NW; ++j) {
                int q[8];
                float sc[2], mn;
                decode_group<B>(w[j], row0 + r, k, g, q, sc, mn);
                acc[j * R + r] += group_dot(q, xv, sc, mn, ds);
            }
        }
    }
}

// In a captured decode graph a kernel is scheduled while its predecessor still runs (grid_dependency_sync). The
// weights never depend on that predecessor, so before waiting each warp asks L2 for the first bytes of its rows
// (what its first loads will read): the wait then overlaps those reads instead of preceding them. Only the head
// of each row: prefetching whole rows of a large matrix would evict itself from L2 before use.
#define PREFETCH_ROW_BYTES 2048

__device__ __forceinline__ void prefetch_l2(const u8* base, long lo, long hi) {
    const unsigned long a = (reinterpret_cast<unsigned long>(base + lo) & ~127UL) + 128UL * (threadIdx.x & 31);
    if (a < reinterpret_cast<unsigned long>(base + min(hi, lo + PREFETCH_ROW_BYTES)))
        prefetch_l2_line(reinterpret_cast<const void*>(a));
}

template <class B>
__device__ __forceinline__ void prefetch_rows(const Planes& p, long row0, int rows, int k) {
    const long bpr = k / B::QK;
    for (long b = row0 * bpr; b < (row0 + rows) * bpr; b += bpr) {
        prefetch_l2(p.q, b * B::QB, (b + bpr) * B::QB);
        if (B::HB) prefetch_l2(p.h, b * B::HB, (b + bpr) * B::HB);
        if (B::SB) prefetch_l2(p.s, b * B::SB, (b + bpr) * B::SB);
        if (B::DB) prefetch_l2(p.d, b * B::DB, (b + bpr) * B::DB);
    }
}

// Block `block` of 4 warps covers 4 / WPR row sets of R rows; the WPR warps of a row set split its groups (more
// loads in flight for long rows) and add up through shared memory. NW = 2 is the fused gate/up pair:
// out = act(gate.x) * (up.x).
template <class B, int NW, int WPR, int R>
__device__ __forceinline__ void matvec_q(const Planes* w, const signed char* xq, const signed char* xq2,
                                         const float2* xds, float* __restrict__ out, int m, int k, int act,
                                         int block) {
    __shared__ float part[NW * R][4];
    const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
    const int row0 = (block * (4 / WPR) + warp / WPR) * R;
    if (row0 < m && warp % WPR == 0)
#pragma unroll
        for (int j = 0; j < NW; ++j) prefetch_rows<B>(w[j], row0, min(R, m - row0), k);
    grid_dependency_sync();
    float acc[NW * R];
#pragma unroll
    for (int j = 0; j < NW * R; ++j) acc[j] = 0.0f;
    if (row0 < m) row_dots<B, NW, R>(w, row0, m, k, (warp % WPR) * 32 + lane, 32 * WPR, xq, xq2, xds, acc);
#pragma unroll
    for (int j = 0; j < NW * R; ++j) acc[j] = warp_sum(acc[j]);
    if (WPR > 1) {
        if (lane == 0)
#pragma unroll
            for (int j = 0; j < NW * R; ++j) part[j][warp] = acc[j];
        __syncthreads();
#pragma unroll
        for (int j = 0; j < NW * R; ++j) {
            float total = 0.0f;
            for (int s = 0; s < WPR; ++s) total += part[j][warp - warp % WPR + s];
            acc[j] = total;
        }
    }
    if (lane == 0 && warp % WPR == 0)
#pragma unroll
        for (int r = 0; r < R; ++r)
            if (row0 + r < m) out[row0 + r] = NW == 2 ? activate(acc[r], act) * acc[R + r] : acc[r];
}

// Fused gate/up for decode that also quantizes its output for the down projection: a block of 16 warps makes 32
// consecutive outputs (two rows a warp), which are exactly one int8 group. m must be a multiple of 32.
template <class B>
__device__ __forceinline__ void matvec_glu_q8(const Planes* w, const signed char* xq, const signed char* xq2,
                                              const float2* xds, float* __restrict__ out, int k, int act,
                                              signed char* oq, signed char* oq2, float2* ods) {
    __shared__ float vals[32];
    const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
    prefetch_rows<B>(w[0], blockIdx.x * 32 + 2 * warp, 2, k);
    prefetch_rows<B>(w[1], blockIdx.x * 32 + 2 * warp, 2, k);
    grid_dependency_sync();
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    row_dots<B, 2, 2>(w, blockIdx.x * 32 + 2 * warp, blockIdx.x * 32 + 32, k, lane, 32, xq, xq2, xds, acc);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const float g = warp_sum(acc[r]), u = warp_sum(acc[2 + r]);
        if (lane == 0) vals[2 * warp + r] = activate(g, act) * u;
    }
    __syncthreads();
    if (warp == 0) {
        const float v = vals[lane];
        out[blockIdx.x * 32 + lane] = v;
        quantize_group(v, blockIdx.x, oq, oq2, ods);
    }
}

// Kernels of one shape (WPR warps a row set of R rows, matvec_q): a product, and the gate/up pair.
#define MATVEC_ONE(name, B, shape, WPR, R)                                                                     \
    extern "C" __global__ void matvec_##name##shape(const u8* q, const u8* h, const u8* s, const u8* d,        \
                                                    const signed char* xq, const signed char* xq2,             \
                                                    const float2* xds, float* out, int m, int k) {             \
        const Planes w[1] = {{q, h, s, d}};                                                                    \
        matvec_q<B, 1, WPR, R>(w, xq, xq2, xds, out, m, k, 0, blockIdx.x);                                     \
    }
#define MATVEC_GLU(name, B, shape, WPR, R)                                                                     \
    extern "C" __global__ void matvec_glu_##name##shape(const u8* q, const u8* h, const u8* s, const u8* d,    \
                                                        const u8* q2, const u8* h2, const u8* s2, const u8* d2, \
                                                        const signed char* xq, const signed char* xq2,         \
                                                        const float2* xds, float* out, int m, int k, int act) { \
        const Planes w[2] = {{q, h, s, d}, {q2, h2, s2, d2}};                                                  \
        matvec_q<B, 2, WPR, R>(w, xq, xq2, xds, out, m, k, act, blockIdx.x);                                   \
    }

// The shapes cuda.py's matvec_shape and glu_shape pick (kernel_names.SHAPES), and the fused gate/up pair.
#define MATVEC_Q(name, B)                                                                                      \
    MATVEC_ONE(name, B, _w1, 1, 1)                                                                             \
    MATVEC_ONE(name, B, _w2, 2, 1)                                                                             \
    MATVEC_ONE(name, B, _w1_r2, 1, 2)                                                                          \
    MATVEC_ONE(name, B, _w2_r2, 2, 2)                                                                          \
    MATVEC_GLU(name, B, _w1, 1, 1)                                                                             \
    MATVEC_GLU(name, B, _w2, 2, 1)                                                                             \
    MATVEC_GLU(name, B, _w1_r2, 1, 2)                                                                          \
    extern "C" __global__ void __launch_bounds__(512) matvec_glu_q8_##name(                                    \
        const u8* q, const u8* h, const u8* s, const u8* d, const u8* q2, const u8* h2, const u8* s2,          \
        const u8* d2, const signed char* xq, const signed char* xq2, const float2* xds, float* out, int k,     \
        int act, signed char* oq, signed char* oq2, float2* ods) {                                             \
        const Planes w[2] = {{q, h, s, d}, {q2, h2, s2, d2}};                                                  \
        matvec_glu_q8<B>(w, xq, xq2, xds, out, k, act, oq, oq2, ods);                                          \
    }
FOR_EACH_QUANT(MATVEC_Q)

// Two products of one input in one launch, where a joined projection's runs differ in type (Q and K in Q4_K, V in
// Q6_K): a launch fewer, and the small one's blocks run beside the large one's instead of after them. Blocks below
// A's count make A's ma rows (shape WA, RA, as matvec_q), the rest B's mb rows, written after A's in out.
template <class A, int WA, int RA, class B, int WB, int RB>
__device__ __forceinline__ void matvec_pair(const Planes& a, const Planes& b, const signed char* xq,
                                            const signed char* xq2, const float2* xds, float* out, int ma, int mb,
                                            int k) {
    const int blocks_a = (ma * WA + 4 * RA - 1) / (4 * RA);
    if ((int)blockIdx.x < blocks_a)
        matvec_q<A, 1, WA, RA>(&a, xq, xq2, xds, out, ma, k, 0, blockIdx.x);
    else
        matvec_q<B, 1, WB, RB>(&b, xq, xq2, xds, out + ma, mb, k, 0, blockIdx.x - blocks_a);
}

#define MATVEC_PAIR_SHAPED(na, A, WA, RA, nb, B, WB, RB)                                                       \
    extern "C" __global__ void matvec_pair_##na##_w##WA##_r##RA##_##nb##_w##WB##_r##RB(                        \
        const u8* q, const u8* h, const u8* s, const u8* d, const u8* q2, const u8* h2, const u8* s2,          \
        const u8* d2, const signed char* xq, const signed char* xq2, const float2* xds, float* out, int ma,    \
        int mb, int k) {                                                                                       \
        matvec_pair<A, WA, RA, B, WB, RB>({q, h, s, d}, {q2, h2, s2, d2}, xq, xq2, xds, out, ma, mb, k);       \
    }
// The pairs kernel_names.PAIR_TYPES lists, in the shapes cuda.matvec_shape gives them (PAIR_SHAPES).
#define MATVEC_PAIR(na, A, nb, B)                                                                              \
    MATVEC_PAIR_SHAPED(na, A, 1, 1, nb, B, 1, 1)                                                               \
    MATVEC_PAIR_SHAPED(na, A, 2, 1, nb, B, 1, 1)                                                               \
    MATVEC_PAIR_SHAPED(na, A, 2, 2, nb, B, 1, 1)                                                               \
    MATVEC_PAIR_SHAPED(na, A, 1, 1, nb, B, 2, 1)                                                               \
    MATVEC_PAIR_SHAPED(na, A, 2, 1, nb, B, 2, 1)                                                               \
    MATVEC_PAIR_SHAPED(na, A, 2, 2, nb, B, 2, 1)
MATVEC_PAIR(q4_k, BlockQ4_K, q6_k, BlockQ6_K)
MATVEC_PAIR(q5_k, BlockQ5_K, q6_k, BlockQ6_K)
MATVEC_PAIR(q3_k, BlockQ3_K, q5_k, BlockQ5_K)

#ifdef SWEEP_KERNELS
// Shapes only bench/gpu_kernels.py's sweeps launch (kernel_names.SWEEP_SHAPES): a module copy of their own.
#define MATVEC_SWEEP(name, B)                                                                                  \
    MATVEC_ONE(name, B, _w4, 4, 1)                                                                             \
    MATVEC_GLU(name, B, _w4, 4, 1)                                                                             \
    MATVEC_GLU(name, B, _w2_r2, 2, 2)
FOR_EACH_QUANT(MATVEC_SWEEP)
#endif

// Streamed decode products, for large matrices: a persistent grid whose blocks have one thread per group of a row
// (k / 32 threads), so each thread holds its group of x in registers for the whole kernel and its loop reads
// weights only: STREAM_ROWS consecutive rows an iteration, their loads issued together, a block's rows
// gridDim.x * STREAM_ROWS apart. The block's warps add up their row sums through shared memory (two buffers, so
// one barrier an iteration). STREAM_ROWS comes from the compile options (engine/kernels/sources.py). Each type
// also has a form held to 32 registers (a few bytes spill), whose blocks fit more to a multiprocessor where
// registers bound them; cuda._stream_grid picks between the two.
template <class B>
__device__ __forceinline__ void matvec_stream(const Planes& w, const signed char* xq, const signed char* xq2,
                                              const float2* xds, float* __restrict__ out, int m, int k) {
    constexpr int R = STREAM_ROWS;
    __shared__ float part[2][32][R];
    const int g = threadIdx.x, warp = g / 32, lane = g & 31, warps = blockDim.x / 32;
    const long bpr = k / B::QK;
    if (lane % 8 == 0)  // ask L2 for the lines of the first rows' quant bytes that this warp reads
#pragma unroll
        for (int r = 0; r < R; ++r)
            if (blockIdx.x * R + r < m)
                prefetch_l2_line(w.q + (blockIdx.x * R + r) * bpr * B::QB + g * (B::QB * 32 / B::QK));
    grid_dependency_sync();
    const int4 xv[4] = {__ldg(reinterpret_cast<const int4*>(xq + 32 * g)),
                        __ldg(reinterpret_cast<const int4*>(xq + 32 * g + 16)),
                        __ldg(reinterpret_cast<const int4*>(xq2 + 32 * g)),
                        __ldg(reinterpret_cast<const int4*>(xq2 + 32 * g + 16))};
    const float2 ds = __ldg(xds + g);
    int buf = 0;
    for (int row0 = blockIdx.x * R; row0 < m; row0 += gridDim.x * R, buf ^= 1) {
        float acc[R];
#pragma unroll
        for (int r = 0; r < R; ++r) {
            acc[r] = 0.0f;
            if (row0 + r < m) {
                int q[8];
                float sc[2], mn;
                decode_group<B>(w, row0 + r, k, g, q, sc, mn);
                acc[r] = group_dot(q, xv, sc, mn, ds);
            }
        }
#pragma unroll
        for (int r = 0; r < R; ++r) acc[r] = warp_sum(acc[r]);
        if (lane == 0)
#pragma unroll
            for (int r = 0; r < R; ++r) part[buf][warp][r] = acc[r];
        __syncthreads();
        if (g < R && row0 + g < m) {
            float total = 0.0f;
            for (int s = 0; s < warps; ++s) total += part[buf][s][g];
            out[row0 + g] = total;
        }
    }
}

#define MATVEC_STREAM_FORM(name, B, form, bounds)                                                              \
    extern "C" __global__ void bounds matvec_stream##form##_##name(                                            \
        const u8* q, const u8* h, const u8* s, const u8* d, const signed char* xq, const signed char* xq2,     \
        const float2* xds, float* out, int m, int k) {                                                         \
        matvec_stream<B>({q, h, s, d}, xq, xq2, xds, out, m, k);                                               \
    }
#define MATVEC_STREAM(name, B) MATVEC_STREAM_FORM(name, B, , )
#define MATVEC_STREAM_LEAN(name, B) MATVEC_STREAM_FORM(name, B, _lean, __launch_bounds__(1024, 2))
FOR_EACH_QUANT(MATVEC_STREAM)
MATVEC_STREAM_LEAN(q4_0, BlockQ4_0)  // kernel_names.LEAN_STREAM_TYPES
#ifdef SWEEP_KERNELS
// The 32-register form of the other types: never chosen, kept to be measured.
MATVEC_STREAM_LEAN(q4_1, BlockQ4_1)
MATVEC_STREAM_LEAN(q5_0, BlockQ5_0)
MATVEC_STREAM_LEAN(q5_1, BlockQ5_1)
MATVEC_STREAM_LEAN(q8_0, BlockQ8_0)
MATVEC_STREAM_LEAN(q4_k, BlockQ4_K)
MATVEC_STREAM_LEAN(q5_k, BlockQ5_K)
MATVEC_STREAM_LEAN(q6_k, BlockQ6_K)
MATVEC_STREAM_LEAN(q3_k, BlockQ3_K)
MATVEC_STREAM_LEAN(iq4_xs, BlockIQ4_XS)
MATVEC_STREAM_LEAN(iq3_s, BlockIQ3_S)
#endif

// Float weights: x stays float32; each lane reads 8 weights (16 bytes for fp16/bf16) per step.
template <class W, int NW>
__device__ __forceinline__ void matvec_f(const typename W::T* const* w, const float* __restrict__ x,
                                         float* __restrict__ out, int m, int k, int act) {
    const int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    const int lane = threadIdx.x & 31;
    if (row >= m) return;
    float acc[NW];
#pragma unroll
    for (int j = 0; j < NW; ++j) acc[j] = 0.0f;
    for (int c = lane; c < k / 8; c += 32) {
        const float4 xa = __ldg(reinterpret_cast<const float4*>(x + 8 * (long)c));
        const float4 xb = __ldg(reinterpret_cast<const float4*>(x + 8 * (long)c + 4));
        const float xv[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};
#pragma unroll
        for (int j = 0; j < NW; ++j) {
            float v[8];
            W::load8(w[j], (long)row * k + 8 * (long)c, v);
#pragma unroll
            for (int e = 0; e < 8; ++e) acc[j] = fmaf(v[e], xv[e], acc[j]);
        }
    }
    float a = warp_sum(acc[0]);
    if (NW == 2) {
        const float u = warp_sum(acc[NW - 1]);
        a = activate(a, act) * u;
    }
    if (lane == 0) out[row] = a;
}

#define MATVEC_F(name, W)                                                                                      \
    extern "C" __global__ void matvec_##name(const W::T* w, const float* x, float* out, int m, int k) {        \
        grid_dependency_sync();                                                                                \
        const W::T* ws[1] = {w};                                                                               \
        matvec_f<W, 1>(ws, x, out, m, k, 0);                                                                   \
    }                                                                                                          \
    extern "C" __global__ void matvec_glu_##name(const W::T* w, const W::T* w2, const float* x, float* out,    \
                                                 int m, int k, int act) {                                      \
        grid_dependency_sync();                                                                                \
        const W::T* ws[2] = {w, w2};                                                                           \
        matvec_f<W, 2>(ws, x, out, m, k, act);                                                                 \
    }
FOR_EACH_FLOAT(MATVEC_F)

// Mixture of experts: each token's chosen experts only, read from the stacked ffn_*_exps tensors, where expert
// e's matrix is rows [e * rows_per_expert, (e + 1) * rows_per_expert) of one (n_experts * rows, k) weight. The
// expert ids are read on the device (from moe_route), so a decode step stays one graph with no host sync.
// An id below 0 marks an expert computed elsewhere (the CPU, for a layer whose experts live in RAM and are only
// partly cached on the GPU: engine/expert_cache.py); it adds nothing.
// A "dot" (float weights) is one warp's product of weight row `row` with activation row `xrow`: `partial` is this
// lane's share, the call the warp's sum in every lane.
template <class W>
struct FDot {
    const typename W::T* w;
    const float* x;
    int k;
    __device__ float operator()(long row, long xrow) const { return warp_sum(partial(row, xrow)); }
    __device__ float partial(long row, long xrow) const {
        float acc = 0.0f;
        for (int c = threadIdx.x & 31; c < k / 8; c += 32) {
            const float4 xa = __ldg(reinterpret_cast<const float4*>(x + xrow * k + 8 * (long)c));
            const float4 xb = __ldg(reinterpret_cast<const float4*>(x + xrow * k + 8 * (long)c + 4));
            const float xv[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};
            float v[8];
            W::load8(w, row * k + 8 * (long)c, v);
#pragma unroll
            for (int e = 0; e < 8; ++e) acc = fmaf(v[e], xv[e], acc);
        }
        return acc;
    }
};

// grid (f / 4 rounded up, n * top_k), 4 warps a row each: hidden[slot, r] = act(gate_e[r] . x) * (up_e[r] . x)
// for slot = token * top_k + j and e = ids[slot].
template <class D>
__device__ __forceinline__ void moe_gate_up(const D& gate, const D& up, const int* __restrict__ ids, int top_k,
                                            float* __restrict__ hidden, int f, int act) {
    const int slot = blockIdx.y;
    const int r = blockIdx.x * 4 + threadIdx.x / 32, e = __ldg(ids + slot);
    if (r >= f || e < 0) return;
    const long row = (long)e * f + r;
    const float g = gate(row, slot / top_k), u = up(row, slot / top_k);
    if ((threadIdx.x & 31) == 0) hidden[(long)slot * f + r] = activate(g, act) * u;
}

// grid (d / 4 rounded up, n): out[token, r] = sum_j weights[slot] * (down_e[r] . hidden[slot]); each output is
// written once, so no atomics and the sum's order is fixed.
template <class D>
__device__ __forceinline__ void moe_down(const D& down, const int* __restrict__ ids,
                                         const float* __restrict__ weights, int top_k, float* __restrict__ out,
                                         int d) {
    const int token = blockIdx.y;
    const int r = blockIdx.x * 4 + threadIdx.x / 32;
    if (r >= d) return;
    // Lane shares of all experts first, one warp sum at the end: no shuffles between the experts' loads.
    float total = 0.0f;
#pragma unroll 4
    for (int j = 0; j < top_k; ++j) {
        const long slot = (long)token * top_k + j;
        const int e = __ldg(ids + slot);
        if (e >= 0) total += __ldg(weights + slot) * down.partial((long)e * d + r, slot);
    }
    total = warp_sum(total);
    if ((threadIdx.x & 31) == 0) out[(long)token * d + r] = total;
}

// Quantized weights, against int8 activations (the token's x, or the hidden rows of its slots). gate/up: the two
// matrices' groups in one loop, so each lane has both rows' loads in flight at once. down: the lanes take the
// (expert, group) pairs of all the token's experts in turn (k / 32 groups a row, 24 for a 768-wide expert, would
// leave a quarter of the lanes idle one expert at a time), each weighted as it is summed; a lane's order is fixed.
template <class B>
__device__ __forceinline__ void moe_gate_up_q(const Planes (&w)[2], const signed char* __restrict__ xq,
                                              const signed char* __restrict__ xq2, const float2* __restrict__ xds,
                                              const int* __restrict__ ids, int top_k, float* __restrict__ hidden,
                                              int f, int k, int act) {
    const int slot = blockIdx.y, r = blockIdx.x * 4 + threadIdx.x / 32, e = __ldg(ids + slot);
    if (r >= f || e < 0) return;
    const long g0 = (long)(slot / top_k) * (k / 32);
    float acc[2] = {0.0f, 0.0f};
    row_dots<B, 2, 1>(w, e * f + r, f, k, threadIdx.x & 31, 32, xq + 32 * g0, xq2 + 32 * g0,
                      xds + g0, acc);
    const float g = warp_sum(acc[0]), u = warp_sum(acc[1]);
    if ((threadIdx.x & 31) == 0) hidden[(long)slot * f + r] = activate(g, act) * u;
}

template <class B>
__device__ __forceinline__ void moe_down_q(const Planes& w, const signed char* __restrict__ xq,
                                           const signed char* __restrict__ xq2, const float2* __restrict__ xds,
                                           const int* __restrict__ ids, const float* __restrict__ weights,
                                           int top_k, float* __restrict__ out, int d, int f) {
    const int token = blockIdx.y, r = blockIdx.x * 4 + threadIdx.x / 32;
    if (r >= d) return;
    const int n_groups = f / 32;
    float total = 0.0f;
#pragma unroll 4
    for (int i = threadIdx.x & 31; i < top_k * n_groups; i += 32) {
        const int j = i / n_groups, g = i % n_groups;
        const long slot = (long)token * top_k + j, gx = slot * n_groups + g;
        const int e = __ldg(ids + slot);
        if (e < 0) continue;
        int q[8];
        float sc[2], mn;
        decode_group<B>(w, (long)e * d + r, f, g, q, sc, mn);
        const int4 xv[4] = {__ldg(reinterpret_cast<const int4*>(xq + 32 * gx)),
                            __ldg(reinterpret_cast<const int4*>(xq + 32 * gx + 16)),
                            __ldg(reinterpret_cast<const int4*>(xq2 + 32 * gx)),
                            __ldg(reinterpret_cast<const int4*>(xq2 + 32 * gx + 16))};
        total += __ldg(weights + slot) * group_dot(q, xv, sc, mn, __ldg(xds + gx));
    }
    total = warp_sum(total);
    if ((threadIdx.x & 31) == 0) out[(long)token * d + r] = total;
}

#define MOE_Q(name, B)                                                                                         \
    extern "C" __global__ void moe_gate_up_##name(const u8* q, const u8* h, const u8* s, const u8* d,          \
                                                  const u8* q2, const u8* h2, const u8* s2, const u8* d2,      \
                                                  const signed char* xq, const signed char* xq2,               \
                                                  const float2* xds, const int* ids, int top_k, float* hidden, \
                                                  int f, int k, int act) {                                     \
        grid_dependency_sync();                                                                                \
        const Planes w[2] = {{q, h, s, d}, {q2, h2, s2, d2}};                                                  \
        moe_gate_up_q<B>(w, xq, xq2, xds, ids, top_k, hidden, f, k, act);                                      \
    }                                                                                                          \
    extern "C" __global__ void moe_down_##name(const u8* q, const u8* h, const u8* s, const u8* d,             \
                                               const signed char* xq, const signed char* xq2, const float2* xds, \
                                               const int* ids, const float* weights, int top_k, float* out,    \
                                               int dim, int f) {                                               \
        grid_dependency_sync();                                                                                \
        moe_down_q<B>(Planes{q, h, s, d}, xq, xq2, xds, ids, weights, top_k, out, dim, f);                     \
    }
FOR_EACH_QUANT(MOE_Q)
FOR_EACH_HOST_LAYOUT(MOE_Q)  // a decode step's experts read over the bus from page-locked RAM

#define MOE_F(name, W)                                                                                         \
    extern "C" __global__ void moe_gate_up_##name(const W::T* w, const W::T* w2, const float* x, const int* ids, \
                                                  int top_k, float* hidden, int f, int k, int act) {           \
        grid_dependency_sync();                                                                                \
        const FDot<W> gate{w, x, k}, up{w2, x, k};                                                             \
        moe_gate_up(gate, up, ids, top_k, hidden, f, act);                                                     \
    }                                                                                                          \
    extern "C" __global__ void moe_down_##name(const W::T* w, const float* hidden, const int* ids,             \
                                               const float* weights, int top_k, float* out, int dim, int f) {  \
        grid_dependency_sync();                                                                                \
        const FDot<W> down{w, hidden, f};                                                                      \
        moe_down(down, ids, weights, top_k, out, dim);                                                         \
    }
FOR_EACH_FLOAT(MOE_F)
