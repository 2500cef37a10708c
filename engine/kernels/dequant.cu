// Dequantization of whole rows: into an fp16 scratch matrix for the prompt path (then one cuBLAS product on
// tensor cores), and into float32 rows gathered by token id for the embedding lookup.
//
// out[r, :] = W[rows ? rows[r] : r, :] * scale; one thread per group of 32 weights (quantized types) or 8
// weights (float types), so each thread writes 64 or 16 contiguous bytes of fp16.

template <bool HALF_OUT>
__device__ __forceinline__ void store32(void* out, long off, const float (&v)[32]) {
    if (HALF_OUT) {
        uint4* o = reinterpret_cast<uint4*>(reinterpret_cast<u16*>(out) + off);
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            u32 u[4];
#pragma unroll
            for (int t = 0; t < 4; ++t)
                u[t] = (u32)f2h(v[8 * c + 2 * t]) | ((u32)f2h(v[8 * c + 2 * t + 1]) << 16);
            o[c] = make_uint4(u[0], u[1], u[2], u[3]);
        }
    } else {
        float4* o = reinterpret_cast<float4*>(reinterpret_cast<float*>(out) + off);
#pragma unroll
        for (int c = 0; c < 8; ++c) o[c] = make_float4(v[4 * c], v[4 * c + 1], v[4 * c + 2], v[4 * c + 3]);
    }
}

template <class B, bool HALF_OUT>
__device__ __forceinline__ void dequant_q(const Planes& p, const int* __restrict__ rows, void* out, int n_rows,
                                          int k, float scale) {
    const long t = (long)blockIdx.x * blockDim.x + threadIdx.x;
    const int gpr = k / 32;
    if (t >= (long)n_rows * gpr) return;
    const int r = (int)(t / gpr), g = (int)(t % gpr);
    const long src = rows ? rows[r] : r;
    int q[8];
    float sc[2], mn;
    decode_group<B>(p, src, k, g, q, sc, mn);
    float v[32];
#pragma unroll
    for (int e = 0; e < 32; ++e) {
        const int byte = (q[e / 4] >> (8 * (e % 4))) & 0xFF;
        v[e] = (sc[e / 16] * (float)(signed char)byte + mn) * scale;
    }
    store32<HALF_OUT>(out, (long)r * k + 32 * (long)g, v);
}

#define DEQUANT_Q(name, B)                                                                                     \
    extern "C" __global__ void dequant_##name##_f16(const u8* q, const u8* h, const u8* s, const u8* d,      \
                                                    const int* rows, u16* out, int n_rows, int k, float scale) { \
        grid_dependency_sync();                                                                                  \
        dequant_q<B, true>(Planes{q, h, s, d}, rows, out, n_rows, k, scale);                                    \
    }                                                                                                          \
    extern "C" __global__ void dequant_##name##_f32(const u8* q, const u8* h, const u8* s, const u8* d,      \
                                                    const int* rows, float* out, int n_rows, int k,            \
                                                    float scale) {                                             \
        grid_dependency_sync();                                                                                \
        dequant_q<B, false>(Planes{q, h, s, d}, rows, out, n_rows, k, scale);                                   \
    }
FOR_EACH_QUANT(DEQUANT_Q)

template <class W, bool HALF_OUT>
__device__ __forceinline__ void dequant_f(const typename W::T* w, const int* __restrict__ rows, void* out,
                                          int n_rows, int k, float scale) {
    const long t = (long)blockIdx.x * blockDim.x + threadIdx.x;
    const int cpr = k / 8;
    if (t >= (long)n_rows * cpr) return;
    const int r = (int)(t / cpr), c = (int)(t % cpr);
    const long src = rows ? rows[r] : r;
    float v[8];
    W::load8(w, src * k + 8 * (long)c, v);
    const long off = (long)r * k + 8 * (long)c;
    if (HALF_OUT) {
        u32 u[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) u[e] = (u32)f2h(v[2 * e] * scale) | ((u32)f2h(v[2 * e + 1] * scale) << 16);
        *reinterpret_cast<uint4*>(reinterpret_cast<u16*>(out) + off) = make_uint4(u[0], u[1], u[2], u[3]);
    } else {
        float4* o = reinterpret_cast<float4*>(reinterpret_cast<float*>(out) + off);
        o[0] = make_float4(v[0] * scale, v[1] * scale, v[2] * scale, v[3] * scale);
        o[1] = make_float4(v[4] * scale, v[5] * scale, v[6] * scale, v[7] * scale);
    }
}

#define DEQUANT_F(name, W)                                                                                     \
    extern "C" __global__ void dequant_##name##_f16(const W::T* w, const int* rows, u16* out, int n_rows,     \
                                                    int k, float scale) {                                     \
        grid_dependency_sync();                                                                               \
        dequant_f<W, true>(w, rows, out, n_rows, k, scale);                                                     \
    }                                                                                                          \
    extern "C" __global__ void dequant_##name##_f32(const W::T* w, const int* rows, float* out, int n_rows,   \
                                                    int k, float scale) {                                     \
        grid_dependency_sync();                                                                               \
        dequant_f<W, false>(w, rows, out, n_rows, k, scale);                                                    \
    }
FOR_EACH_FLOAT(DEQUANT_F)

// Float32 activations to fp16 (the other operand of the prompt-path product) and back.
extern "C" __global__ void f32_to_f16(const float* __restrict__ x, u16* __restrict__ y, long n) {
    grid_dependency_sync();
    const long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = f2h(x[i]);
}

// out = act(gate) * up over n elements, for the prompt path where gate and up come from two products.
extern "C" __global__ void glu(const float* __restrict__ gate, const float* __restrict__ up, float* out, long n,
                               int act) {
    grid_dependency_sync();
    const long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    out[i] = activate(gate[i], act) * up[i];
}
