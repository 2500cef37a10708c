// Matrix-vector products for decode: out[r] = W[r, :] . x for one token, on the weights as the GGUF stores them.
//
// Quantized weights: x is first quantized to int8 blocks of 32 (quantize_q8, once per input vector), then
// each warp walks R rows, each lane one group of 32 weights at a time, and multiplies 4 int8 pairs per dp4a
// instruction. The block scales come in as floats:  sum_e w_e x_e = dx * (sc0 * S_lo + sc1 * S_hi) + mn * xs,
// where S are the integer dot products of the halves and xs = dx * sum(xq) is precomputed per block.
// The gate/up variant computes two matrices against the same x and writes silu(gate) * up (SwiGLU) or
// gelu_tanh(gate) * up, so the FFN hidden vector is written once.

// One warp per group of 32 activations: int8 values xq = rint(x * 127 / amax), scale dx = amax / 127 and
// xs = dx * sum(xq). Matches reference.quantize_q8 bit for bit (IEEE division and rounding, no fast math).
extern "C" __global__ void quantize_q8(const float* __restrict__ x, signed char* __restrict__ xq,
                                       float2* __restrict__ xds, int n_groups) {
    const int g = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    const int lane = threadIdx.x & 31;
    if (g >= n_groups) return;
    const float v = x[(long)g * 32 + lane];
    const float amax = warp_max(fabsf(v));
    const float d = amax / 127.0f;
    const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
    const int q = (int)rintf(v * id);
    xq[(long)g * 32 + lane] = (signed char)q;
    const float s = warp_sum((float)q);
    if (lane == 0) xds[g] = make_float2(d, d * s);
}

__device__ __forceinline__ float group_dot(const int (&w)[8], const int4& x0, const int4& x1, const float (&sc)[2],
                                           float mn, float2 ds) {
    int lo = dp4a(w[0], x0.x, 0);
    lo = dp4a(w[1], x0.y, lo);
    lo = dp4a(w[2], x0.z, lo);
    lo = dp4a(w[3], x0.w, lo);
    int hi = dp4a(w[4], x1.x, 0);
    hi = dp4a(w[5], x1.y, hi);
    hi = dp4a(w[6], x1.z, hi);
    hi = dp4a(w[7], x1.w, hi);
    return ds.x * (sc[0] * (float)lo + sc[1] * (float)hi) + mn * ds.y;
}

// NW: 1 for a plain product, 2 for the fused gate/up pair. act: 0 silu, 1 gelu_tanh.
template <class B, int R, int NW>
__device__ __forceinline__ void matvec_q(const Planes* w, const signed char* __restrict__ xq,
                                         const float2* __restrict__ xds, float* __restrict__ out, int m, int k,
                                         int act) {
    const int warp = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    const int lane = threadIdx.x & 31;
    const int row0 = warp * R;
    if (row0 >= m) return;
    float acc[NW][R];
#pragma unroll
    for (int j = 0; j < NW; ++j)
#pragma unroll
        for (int r = 0; r < R; ++r) acc[j][r] = 0.0f;
    const int n_groups = k / 32;
#pragma unroll 2
    for (int g = lane; g < n_groups; g += 32) {
        const int4 x0 = __ldg(reinterpret_cast<const int4*>(xq + 32 * (long)g));
        const int4 x1 = __ldg(reinterpret_cast<const int4*>(xq + 32 * (long)g + 16));
        const float2 ds = __ldg(xds + g);
#pragma unroll
        for (int r = 0; r < R; ++r) {
            if (row0 + r < m) {
#pragma unroll
                for (int j = 0; j < NW; ++j) {
                    int q[8];
                    float sc[2], mn;
                    decode_group<B>(w[j], row0 + r, k, g, q, sc, mn);
                    acc[j][r] += group_dot(q, x0, x1, sc, mn, ds);
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
        float a = warp_sum(acc[0][r]);
        if (NW == 2) {
            const float u = warp_sum(acc[NW - 1][r]);
            a = activate(a, act) * u;
        }
        if (lane == 0 && row0 + r < m) out[row0 + r] = a;
    }
}

#define MATVEC_Q(name, B)                                                                                      \
    extern "C" __global__ void matvec_##name##_r1(const u8* q, const u8* h, const u8* s, const u8* d,        \
                                                  const signed char* xq, const float2* xds, float* out, int m, \
                                                  int k) {                                                     \
        const Planes w[1] = {{q, h, s, d}};                                                                    \
        matvec_q<B, 1, 1>(w, xq, xds, out, m, k, 0);                                                           \
    }                                                                                                          \
    extern "C" __global__ void matvec_##name##_r2(const u8* q, const u8* h, const u8* s, const u8* d,        \
                                                  const signed char* xq, const float2* xds, float* out, int m, \
                                                  int k) {                                                     \
        const Planes w[1] = {{q, h, s, d}};                                                                    \
        matvec_q<B, 2, 1>(w, xq, xds, out, m, k, 0);                                                           \
    }                                                                                                          \
    extern "C" __global__ void matvec_glu_##name(const u8* q, const u8* h, const u8* s, const u8* d,         \
                                                 const u8* q2, const u8* h2, const u8* s2, const u8* d2,      \
                                                 const signed char* xq, const float2* xds, float* out, int m,  \
                                                 int k, int act) {                                             \
        const Planes w[2] = {{q, h, s, d}, {q2, h2, s2, d2}};                                                  \
        matvec_q<B, 1, 2>(w, xq, xds, out, m, k, act);                                                         \
    }
FOR_EACH_QUANT(MATVEC_Q)

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
    extern "C" __global__ void matvec_##name(const W::T* w, const float* x, float* out, int m, int k) {       \
        const W::T* ws[1] = {w};                                                                               \
        matvec_f<W, 1>(ws, x, out, m, k, 0);                                                                   \
    }                                                                                                          \
    extern "C" __global__ void matvec_glu_##name(const W::T* w, const W::T* w2, const float* x, float* out,  \
                                                 int m, int k, int act) {                                      \
        const W::T* ws[2] = {w, w2};                                                                           \
        matvec_f<W, 2>(ws, x, out, m, k, act);                                                                 \
    }
FOR_EACH_FLOAT(MATVEC_F)
