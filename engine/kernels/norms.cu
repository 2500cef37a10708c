// RMSNorm over the last axis, and the residual add fused with the next RMSNorm (one pass over the row
// instead of three). One block per row; rows may be strided views: row r lives at
// (r / inner) * outer_stride + (r % inner) * d, so per-head norms over a (tokens, heads, head_dim) view of a
// wider projection need no copy.

__device__ __forceinline__ long row_offset(int r, int d, int inner, long outer_stride) {
    return (long)(r / inner) * outer_stride + (long)(r % inner) * d;
}

// After a block wrote its row of out (contiguous, d a multiple of 32): its int8 groups for the next product,
// so decode needs no separate quantization launch. xq == nullptr skips this.
__device__ __forceinline__ void quantize_row(const float* row, int d, long first_group, signed char* xq,
                                             signed char* xq2, float2* xds) {
    if (xq == nullptr) return;
    __syncthreads();
    const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
    for (int g = warp; g < d / 32; g += blockDim.x / 32)
        quantize_group(row[32 * g + lane], first_group + g, xq, xq2, xds);
}

extern "C" __global__ void rms_norm(const float* x, const float* __restrict__ w, float* out, int d, float eps,
                                    int inner, long x_stride, long out_stride, signed char* xq,
                                    signed char* xq2, float2* xds) {
    grid_dependency_sync();
    __shared__ float red[32];
    const float* xr = x + row_offset(blockIdx.x, d, inner, x_stride);
    float* yr = out + row_offset(blockIdx.x, d, inner, out_stride);
    float ss = 0.0f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) ss += xr[i] * xr[i];
    const float inv = rsqrtf(block_sum(ss, red) / (float)d + eps);
    for (int i = threadIdx.x; i < d; i += blockDim.x) yr[i] = xr[i] * inv * w[i];
    quantize_row(yr, d, (long)blockIdx.x * (d / 32), xq, xq2, xds);
}

// The DeltaNet output norm: out = rms_norm(x) * w * silu(gate) per head (rows of d, `inner` heads a token, each
// array with its own token stride); out may be x.
extern "C" __global__ void gated_rms_norm(const float* x, const float* __restrict__ gate, const float* __restrict__ w,
                                          float* out, int d, float eps, int inner, long x_stride, long gate_stride,
                                          long out_stride) {
    grid_dependency_sync();
    __shared__ float red[32];
    const float* xr = x + row_offset(blockIdx.x, d, inner, x_stride);
    const float* gr = gate + row_offset(blockIdx.x, d, inner, gate_stride);
    float* yr = out + row_offset(blockIdx.x, d, inner, out_stride);
    float ss = 0.0f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) ss += xr[i] * xr[i];
    const float inv = rsqrtf(block_sum(ss, red) / (float)d + eps);
    for (int i = threadIdx.x; i < d; i += blockDim.x) yr[i] = xr[i] * inv * w[i] * act_silu(gr[i]);
}

// The int8 groups of 32 values held 4 per thread by 8 consecutive threads (sub = 0..7 within the group): with
// quantize_group's arithmetic (Q8Scale), the group's max and sums over 8 lanes instead of 32. Every lane of
// the warp must call it (shuffles), so out-of-range lanes pass zeros and write nothing (store false).
__device__ __forceinline__ void quantize_group4(float4 v, long g, int sub, bool store, signed char* xq,
                                                signed char* xq2, float2* xds) {
    const float e[4] = {v.x, v.y, v.z, v.w};
    float amax = fmaxf(fmaxf(fabsf(e[0]), fabsf(e[1])), fmaxf(fabsf(e[2]), fabsf(e[3])));
#pragma unroll
    for (int o = 1; o < 8; o <<= 1) amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, o));
    const Q8Scale scale(amax);
    float sq = 0.0f, sq2 = 0.0f;
    u32 pq = 0, pq2 = 0;
#pragma unroll
    for (int t = 0; t < 4; ++t) {
        float q, q2;
        scale.levels(e[t], q, q2);
        pq |= ((u32)(int)q & 0xFFu) << (8 * t);
        pq2 |= ((u32)(int)q2 & 0xFFu) << (8 * t);
        sq += q;
        sq2 += q2;
    }
#pragma unroll
    for (int o = 1; o < 8; o <<= 1) {
        sq += __shfl_xor_sync(0xFFFFFFFFu, sq, o);
        sq2 += __shfl_xor_sync(0xFFFFFFFFu, sq2, o);
    }
    if (!store) return;
    reinterpret_cast<u32*>(xq)[g * 8 + sub] = pq;
    reinterpret_cast<u32*>(xq2)[g * 8 + sub] = pq2;
    if (sub == 0) xds[g] = scale.ds(254 * (int)sq + (int)sq2);
}

#define NORM_CHUNKS 4  // float4 chunks a thread keeps in registers: rows up to 4 * 4 * 1024 values

// residual += x; out = rms_norm(residual) * w. Rows are contiguous (n, d) arrays, d a multiple of 32 and at most
// 16384; a block of d / 4 threads (rounded up to whole warps, at most 1024) keeps its row in registers as float4
// chunks, so the row is read once and the int8 groups come from 8 threads each.
extern "C" __global__ void add_rms_norm(const float* __restrict__ x, float* __restrict__ residual,
                                        const float* __restrict__ w, float* __restrict__ out, int d, float eps,
                                        signed char* xq, signed char* xq2, float2* xds) {
    const long base = (long)blockIdx.x * d;
    const int n4 = d / 4;
    // The norm weights never depend on the kernel before: their loads overlap its tail (grid_dependency_sync).
    float4 wv[NORM_CHUNKS];
#pragma unroll
    for (int c = 0; c < NORM_CHUNKS; ++c) {
        const int i = threadIdx.x + c * blockDim.x;
        const uint4 u = i < n4 ? ld16_early(w + 4 * i) : make_uint4(0, 0, 0, 0);
        wv[c] = make_float4(__uint_as_float(u.x), __uint_as_float(u.y), __uint_as_float(u.z), __uint_as_float(u.w));
    }
    grid_dependency_sync();
    __shared__ float red[32];
    const float4* x4 = reinterpret_cast<const float4*>(x + base);
    float4* r4 = reinterpret_cast<float4*>(residual + base);
    float4 v[NORM_CHUNKS];
    float ss = 0.0f;
#pragma unroll
    for (int c = 0; c < NORM_CHUNKS; ++c) {
        const int i = threadIdx.x + c * blockDim.x;
        v[c] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (i < n4) {
            const float4 a = r4[i], b = x4[i];
            v[c] = make_float4(a.x + b.x, a.y + b.y, a.z + b.z, a.w + b.w);
            r4[i] = v[c];
            ss += v[c].x * v[c].x + v[c].y * v[c].y + v[c].z * v[c].z + v[c].w * v[c].w;
        }
    }
    const float inv = rsqrtf(block_sum(ss, red) / (float)d + eps);
#pragma unroll
    for (int c = 0; c < NORM_CHUNKS; ++c) {
        const int i = threadIdx.x + c * blockDim.x;
        if (c * blockDim.x >= n4) break;  // uniform over the block
        float4 o = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (i < n4) {
            o = make_float4(v[c].x * inv * wv[c].x, v[c].y * inv * wv[c].y, v[c].z * inv * wv[c].z,
                            v[c].w * inv * wv[c].w);
            reinterpret_cast<float4*>(out + base)[i] = o;
        }
        if (xq != nullptr) quantize_group4(o, (base + 4L * i) / 32, i & 7, i < n4, xq, xq2, xds);
    }
}
