// RMSNorm over the last axis, and the residual add fused with the next RMSNorm (one pass over the row
// instead of three). One block per row; rows may be strided views: row r lives at
// (r / inner) * outer_stride + (r % inner) * d, so per-head norms over a (tokens, heads, head_dim) view of a
// wider projection need no copy.

__device__ __forceinline__ float block_sum(float v, float* red) {
    v = warp_sum(v);
    const int warp = threadIdx.x / 32, lane = threadIdx.x & 31, n_warps = blockDim.x / 32;
    if (lane == 0) red[warp] = v;
    __syncthreads();
    v = lane < n_warps ? red[lane] : 0.0f;
    v = warp_sum(v);
    __syncthreads();
    return v;
}

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
    __shared__ float red[32];
    const float* xr = x + row_offset(blockIdx.x, d, inner, x_stride);
    float* yr = out + row_offset(blockIdx.x, d, inner, out_stride);
    float ss = 0.0f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) ss += xr[i] * xr[i];
    const float inv = rsqrtf(block_sum(ss, red) / (float)d + eps);
    for (int i = threadIdx.x; i < d; i += blockDim.x) yr[i] = xr[i] * inv * w[i];
    quantize_row(yr, d, (long)blockIdx.x * (d / 32), xq, xq2, xds);
}

// residual += x; out = rms_norm(residual) * w. Rows are contiguous (n, d) arrays.
extern "C" __global__ void add_rms_norm(const float* __restrict__ x, float* __restrict__ residual,
                                        const float* __restrict__ w, float* __restrict__ out, int d, float eps,
                                        signed char* xq, signed char* xq2, float2* xds) {
    __shared__ float red[32];
    const long base = (long)blockIdx.x * d;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        const float v = residual[base + i] + x[base + i];
        residual[base + i] = v;
        ss += v * v;
    }
    const float inv = rsqrtf(block_sum(ss, red) / (float)d + eps);
    for (int i = threadIdx.x; i < d; i += blockDim.x) out[base + i] = residual[base + i] * inv * w[i];
    quantize_row(out + base, d, (long)blockIdx.x * (d / 32), xq, xq2, xds);
}
