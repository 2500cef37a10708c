// Rotary embedding fused with the KV-cache write: one block per (token, head); q heads rotate in place, k heads
// rotate in place and go to the fp16 cache with their v. Position = start[0] + token, read from device memory
// so a captured graph replays at any position.
//
// style 0 ("normal", llama GGUF): pair j is dims (2j, 2j+1); style 1 ("neox"): dims (j, j + rot/2).
// Dims at and past `rot` pass through unchanged.

extern "C" __global__ void rope_store_kv(float* q, float* k, const float* __restrict__ v, long q_stride,
                                         long k_stride, long v_stride, int n_heads, int n_kv, int hd, int rot,
                                         const float* __restrict__ cos_t, const float* __restrict__ sin_t,
                                         int neox, u16* __restrict__ k_cache, u16* __restrict__ v_cache,
                                         int max_tokens, const int* __restrict__ start) {
    grid_dependency_sync();
    const int tok = blockIdx.x, head = blockIdx.y;
    const int pos = start[0] + tok;
    const bool is_q = head < n_heads;
    const int kvh = head - n_heads;
    float* x = is_q ? q + tok * q_stride + (long)head * hd : k + tok * k_stride + (long)kvh * hd;
    const int half = rot / 2;
    const float* c = cos_t + (long)pos * half;
    const float* s = sin_t + (long)pos * half;
    for (int j = threadIdx.x; j < half; j += blockDim.x) {
        const int i0 = neox ? j : 2 * j, i1 = neox ? j + half : 2 * j + 1;
        const float a = x[i0], b = x[i1];
        x[i0] = a * c[j] - b * s[j];
        x[i1] = a * s[j] + b * c[j];
    }
    if (is_q) return;
    __syncthreads();
    const long dst = ((long)kvh * max_tokens + pos) * hd;
    const float* vr = v + tok * v_stride + (long)kvh * hd;
    for (int i = threadIdx.x; i < hd; i += blockDim.x) {
        k_cache[dst + i] = f2h(x[i]);
        v_cache[dst + i] = f2h(vr[i]);
    }
}
