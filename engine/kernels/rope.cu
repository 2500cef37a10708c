// Rotary embedding fused with the KV-cache write: one block per (token, head), one thread per dim; q heads rotate
// in place, k heads rotate in place and go to the fp16 cache with their v. Position = start[0] + token, read from
// device memory so a captured graph replays at any position. (Decode on sm_90+ does this inside
// attention_decode instead.)

extern "C" __global__ void rope_store_kv(float* q, float* k, const float* __restrict__ v, long q_stride,
                                         long k_stride, long v_stride, int n_heads, int n_kv, int hd, int rot,
                                         const float* __restrict__ cos_t, const float* __restrict__ sin_t,
                                         int neox, u16* __restrict__ k_cache, u16* __restrict__ v_cache,
                                         int max_tokens, const int* __restrict__ start) {
    grid_dependency_sync();
    const int tok = blockIdx.x, head = blockIdx.y, d = threadIdx.x;
    const int pos = start[0] + tok;
    const bool is_q = head < n_heads;
    const int kvh = head - n_heads;
    float* x = is_q ? q + tok * q_stride + (long)head * hd : k + tok * k_stride + (long)kvh * hd;
    const float y = rotated(x, d, rot, neox, cos_t + (long)pos * (rot / 2), sin_t + (long)pos * (rot / 2));
    __syncthreads();  // every dim read before any is overwritten
    x[d] = y;
    if (is_q) return;
    const long dst = ((long)kvh * max_tokens + pos) * hd + d;
    k_cache[dst] = f2h(y);
    v_cache[dst] = f2h(v[tok * v_stride + (long)kvh * hd + d]);
}
