// Rotary embedding fused with the KV-cache write: one block per (token, head), one thread per dim; q heads rotate
// in place, k heads rotate in place and go to the cache with their v: fp16, or q8_0 (rope_store_kv_q8: a warp's
// 32 dims are one group, the scales go to k_scale and v_scale), in the row cache_row gives. Position = start[0] +
// token, read from device memory so a captured graph replays at any position. (Decode does this inside its
// attention kernel instead.)

template <bool Q8>
__device__ __forceinline__ void rope_store_kv_impl(float* q, float* k, const float* __restrict__ v, long q_stride,
                                                   long k_stride, long v_stride, int n_heads, int hd, int rot,
                                                   const float* __restrict__ cos_t, const float* __restrict__ sin_t,
                                                   int neox, void* k_cache, void* v_cache, u16* k_scale,
                                                   u16* v_scale, int max_tokens, const int* __restrict__ start) {
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
    const long dst = ((long)kvh * max_tokens + cache_row(pos, max_tokens)) * hd + d;
    const float vd = v[tok * v_stride + (long)kvh * hd + d];
    if constexpr (Q8) {
        const float dk = q8_scale(fabsf(y), 32), dv = q8_scale(fabsf(vd), 32);
        static_cast<signed char*>(k_cache)[dst] = (signed char)q8_round(y, dk);
        static_cast<signed char*>(v_cache)[dst] = (signed char)q8_round(vd, dv);
        if ((d & 31) == 0) {
            k_scale[dst / 32] = f2h(dk);
            v_scale[dst / 32] = f2h(dv);
        }
    } else {
        static_cast<u16*>(k_cache)[dst] = f2h(y);
        static_cast<u16*>(v_cache)[dst] = f2h(vd);
    }
}

#define ROPE_STORE_KV(Q8, KV)                                                                                  \
    extern "C" __global__ void rope_store_kv##KV(float* q, float* k, const float* v, long q_stride, long k_stride, \
                                                 long v_stride, int n_heads, int n_kv, int hd, int rot,         \
                                                 const float* cos_t, const float* sin_t, int neox, void* k_cache, \
                                                 void* v_cache, u16* k_scale, u16* v_scale, int max_tokens,     \
                                                 const int* start) {                                            \
        rope_store_kv_impl<Q8>(q, k, v, q_stride, k_stride, v_stride, n_heads, hd, rot, cos_t, sin_t, neox,      \
                               k_cache, v_cache, k_scale, v_scale, max_tokens, start);                          \
    }
ROPE_STORE_KV(false, )
ROPE_STORE_KV(true, _q8)
