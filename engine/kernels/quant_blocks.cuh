// GGML quantized block layouts, decoded once here and shared by the matrix-vector, dequantize and embedding
// kernels. Prepended to those sources by engine/kernels/cuda.py (NVRTC needs no include path that way, and
// CuPy's compile cache sees every byte of the source).
//
// Weights arrive "planar" (engine/kernels/gpu_layout.py): the bytes of each GGUF block are split by field into
// up to four planes so the big planes can be read with aligned 16-byte loads:
//   Q: the low quant bits, H: the high bits, S: sub-block scales, D: the fp16 block scale(s).
// Block b of a tensor owns bytes [b * XB, (b + 1) * XB) of plane X. The planes hold the GGUF bytes, with Q4_K's
// rearranged (see BlockQ4_K).
//
// Every decoder yields one group of 32 consecutive weights as 8 words of packed int8 values q (byte e of the
// group is weight e, little-endian words), with  weight[e] = sc[e / 16] * q[e] + mn.  That form serves an
// int8 dot product against an activation block quantized the same way (dp4a) and plain dequantization alike.

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;

struct Planes {
    const u8* q;
    const u8* h;
    const u8* s;
    const u8* d;
};

// Programmatic dependent launch (sm_90 and newer): a kernel launched with it (engine/kernels/cuda.py, inside a
// captured decode graph) may be scheduled while the kernel before it still runs. Every kernel calls this first:
// it waits until the previous kernel has finished and its writes are visible, then lets the next kernel be
// scheduled, so launch latency overlaps work. For an ordinary launch or an older GPU it does nothing.
__device__ __forceinline__ void grid_dependency_sync() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ float h2f(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ u16 f2h(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

__device__ __forceinline__ float bf2f(u16 b) { return __uint_as_float(((u32)b) << 16); }

// The two fp16 values packed in a 32-bit word: the low half, then the high half.
__device__ __forceinline__ float h2f_lo(u32 w) { return h2f((u16)(w & 0xFFFF)); }
__device__ __forceinline__ float h2f_hi(u32 w) { return h2f((u16)(w >> 16)); }

// Ask L2 for the 128-byte line holding p (no register waits for it).
__device__ __forceinline__ void prefetch_l2_line(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }

__device__ __forceinline__ int dp4a(int a, int b, int c) {
    int d;
    asm("dp4a.s32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

__device__ __forceinline__ uint4 ld16(const u8* p) { return __ldg(reinterpret_cast<const uint4*>(p)); }

// A 16-byte load meant to overlap the previous kernel's tail, issued before grid_dependency_sync. It must not be a
// read-only (.nc, __ldg) load: ptxas moves those past griddepcontrol.wait (sm_90 SASS, nvcc 13), and the load
// then follows the wait instead of overlapping it. A plain ld.global stays where it is written.
__device__ __forceinline__ uint4 ld16_early(const void* p) {
    uint4 v;
    asm volatile("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}
__device__ __forceinline__ u32 ld4(const u8* p) { return __ldg(reinterpret_cast<const u32*>(p)); }
__device__ __forceinline__ u16 ld2(const u8* p) { return __ldg(reinterpret_cast<const u16*>(p)); }

// Subtract c from each byte of a word whose bytes are all <= 127 (c <= 128): with each top bit set first no
// byte borrows from its neighbour, and flipping the top bit back yields the two's-complement int8 result.
__device__ __forceinline__ u32 sub_bytes(u32 q, u32 c) {
    return ((q | 0x80808080u) - c * 0x01010101u) ^ 0x80808080u;
}

// Bits 0..3 of h moved to bit 0 of bytes 0..3. The four shifted copies of h do not overlap, so the multiply has
// no carries.
__device__ __forceinline__ u32 spread4(u32 h) { return ((h & 0xFu) * 0x00204081u) & 0x01010101u; }
// The same at bit 4 (the fifth quant bit of four consecutive weights).
__device__ __forceinline__ u32 spread4_to_bit4(u32 h) { return spread4(h) << 4; }
// The same as whole bytes: 0xFF where the bit is set, 0 where it is clear.
__device__ __forceinline__ u32 byte_masks4(u32 h) { return spread4(h) * 0xFFu; }

// 32 nibbles from one 16-byte load: weight i < 16 the low nibble of byte i, weight i + 16 its high nibble.
__device__ __forceinline__ void nibbles16(const u8* p, int (&w)[8]) {
    const uint4 a = ld16(p);
    const u32 v[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
    for (int t = 0; t < 4; ++t) {
        w[t] = v[t] & 0x0F0F0F0Fu;
        w[t + 4] = (v[t] >> 4) & 0x0F0F0F0Fu;
    }
}

__device__ __forceinline__ void words8(const u8* p, u32 (&w)[8]) {
    const uint4 a = ld16(p), b = ld16(p + 16);
    w[0] = a.x; w[1] = a.y; w[2] = a.z; w[3] = a.w;
    w[4] = b.x; w[5] = b.y; w[6] = b.z; w[7] = b.w;
}

// Q4_0: d (fp16) | qs[16]; weight i = low nibble of qs[i], weight i + 16 = high nibble; value d * (q - 8),
// yielded as d * q - 8 d: the offset moves into mn (one product with the activations' sum in a dot product)
// instead of eight byte subtractions a group, which decode-time products on an H200 are short of instructions for.
struct BlockQ4_0 {
    static constexpr int QK = 32, QB = 16, HB = 0, SB = 0, DB = 2;
    __device__ static void group(const Planes& p, long blk, int, int (&w)[8], float (&sc)[2], float& mn) {
        nibbles16(p.q + blk * QB, w);
        sc[0] = sc[1] = h2f(ld2(p.d + blk * DB));
        mn = -8.0f * sc[0];
    }
};

// Q4_1: d, m (fp16) | qs[16]; value d * q + m.
struct BlockQ4_1 {
    static constexpr int QK = 32, QB = 16, HB = 0, SB = 0, DB = 4;
    __device__ static void group(const Planes& p, long blk, int, int (&w)[8], float (&sc)[2], float& mn) {
        nibbles16(p.q + blk * QB, w);
        const u32 dm = ld4(p.d + blk * DB);
        sc[0] = sc[1] = h2f_lo(dm);
        mn = h2f_hi(dm);
    }
};

// Q5_0: d | qh (32 bits, bit j = fifth bit of weight j) | qs[16]; value d * (q - 16) = d * q - 16 d (as Q4_0).
struct BlockQ5_0 {
    static constexpr int QK = 32, QB = 16, HB = 4, SB = 0, DB = 2;
    __device__ static void group(const Planes& p, long blk, int, int (&w)[8], float (&sc)[2], float& mn) {
        const uint4 a = ld16(p.q + blk * QB);
        const u32 v[4] = {a.x, a.y, a.z, a.w};
        const u32 qh = ld4(p.h + blk * HB);
#pragma unroll
        for (int t = 0; t < 4; ++t) {
            w[t] = (v[t] & 0x0F0F0F0Fu) | spread4_to_bit4(qh >> (4 * t));
            w[t + 4] = ((v[t] >> 4) & 0x0F0F0F0Fu) | spread4_to_bit4(qh >> (16 + 4 * t));
        }
        sc[0] = sc[1] = h2f(ld2(p.d + blk * DB));
        mn = -16.0f * sc[0];
    }
};

// Q5_1: d, m | qh | qs[16]; value d * q + m.
struct BlockQ5_1 {
    static constexpr int QK = 32, QB = 16, HB = 4, SB = 0, DB = 4;
    __device__ static void group(const Planes& p, long blk, int, int (&w)[8], float (&sc)[2], float& mn) {
        const uint4 a = ld16(p.q + blk * QB);
        const u32 v[4] = {a.x, a.y, a.z, a.w};
        const u32 qh = ld4(p.h + blk * HB);
#pragma unroll
        for (int t = 0; t < 4; ++t) {
            w[t] = (v[t] & 0x0F0F0F0Fu) | spread4_to_bit4(qh >> (4 * t));
            w[t + 4] = ((v[t] >> 4) & 0x0F0F0F0Fu) | spread4_to_bit4(qh >> (16 + 4 * t));
        }
        const u32 dm = ld4(p.d + blk * DB);
        sc[0] = sc[1] = h2f_lo(dm);
        mn = h2f_hi(dm);
    }
};

// Q8_0: d | qs[32] int8; value d * q.
struct BlockQ8_0 {
    static constexpr int QK = 32, QB = 32, HB = 0, SB = 0, DB = 2;
    __device__ static void group(const Planes& p, long blk, int, int (&w)[8], float (&sc)[2], float& mn) {
        u32 v[8];
        words8(p.q + blk * QB, v);
#pragma unroll
        for (int t = 0; t < 8; ++t) w[t] = v[t];
        sc[0] = sc[1] = h2f(ld2(p.d + blk * DB));
        mn = 0.0f;
    }
};

// The 6-bit scale and min of sub-block j of a Q4_K/Q5_K super-block, from its 12 packed scale bytes as three
// little-endian words (bytes 0..3: low 6 bits of scales 0..3 and top 2 bits of scales 4..7; bytes 4..7 the same
// for the mins; bytes 8..11: low 4 bits of scale 4+i and min 4+i).
__device__ __forceinline__ void k_scale_min(u32 s0, u32 s1, u32 s2, int j, float& sc, float& mv) {
    auto byte = [&](int i) -> u32 { return ((i < 4 ? s0 : (i < 8 ? s1 : s2)) >> (8 * (i & 3))) & 0xFFu; };
    u32 a, b;
    if (j < 4) {
        a = byte(j) & 63u;
        b = byte(j + 4) & 63u;
    } else {
        a = (byte(j + 4) & 0xFu) | ((byte(j - 4) >> 6) << 4);
        b = (byte(j + 4) >> 4) | ((byte(j) >> 6) << 4);
    }
    sc = (float)a;
    mv = (float)b;
}

// Q4_K: d, dmin | scales[12] | qs[128]; value d * sc_j * q - dmin * m_j for sub-block j. In the GGUF, sub-block
// j has the low (j even) or high (j odd) nibbles of qs[32 (j/2) ..]; on the GPU (gpu_layout.py REARRANGED) it
// has 16 bytes of its own arranged as Q4_0's, and the S plane holds d, dmin and the scales: two loads a group.
struct BlockQ4_K {
    static constexpr int QK = 256, QB = 128, HB = 0, SB = 16, DB = 0;
    __device__ static void group(const Planes& p, long blk, int sub, int (&w)[8], float (&sc)[2], float& mn) {
        nibbles16(p.q + blk * QB + 16 * sub, w);
        const uint4 ds = ld16(p.s + blk * SB);
        float s, m;
        k_scale_min(ds.y, ds.z, ds.w, sub, s, m);
        sc[0] = sc[1] = h2f_lo(ds.x) * s;
        mn = -h2f_hi(ds.x) * m;
    }
};

// Q5_K: as Q4_K plus qh[32]: bit j of qh[l] is the fifth bit of weight l of sub-block j.
struct BlockQ5_K {
    static constexpr int QK = 256, QB = 128, HB = 32, SB = 12, DB = 4;
    __device__ static void group(const Planes& p, long blk, int sub, int (&w)[8], float (&sc)[2], float& mn) {
        u32 v[8], hv[8];
        words8(p.q + blk * QB + 32 * (sub >> 1), v);
        words8(p.h + blk * HB, hv);
        const int shift = (sub & 1) * 4;
#pragma unroll
        for (int t = 0; t < 8; ++t) w[t] = ((v[t] >> shift) & 0x0F0F0F0Fu) | (((hv[t] >> sub) & 0x01010101u) << 4);
        float s, m;
        const u8* ps = p.s + blk * SB;
        k_scale_min(ld4(ps), ld4(ps + 4), ld4(ps + 8), sub, s, m);
        const u32 dm = ld4(p.d + blk * DB);
        sc[0] = sc[1] = h2f_lo(dm) * s;
        mn = -h2f_hi(dm) * m;
    }
};

// Q6_K: ql[128] | qh[64] | scales[16] (int8, one per 16 weights) | d. Half n (128 weights) uses ql[64n..],
// qh[32n..]; its group g takes the low (g < 2) or high nibbles of ql[64n + 32 (g & 1) ..] and bits 2g, 2g+1
// of qh[32n ..]; value d * scale * (q - 32).
struct BlockQ6_K {
    static constexpr int QK = 256, QB = 128, HB = 64, SB = 16, DB = 2;
    __device__ static void group(const Planes& p, long blk, int sub, int (&w)[8], float (&sc)[2], float& mn) {
        const int n = sub >> 2, g = sub & 3;
        u32 v[8], hv[8];
        words8(p.q + blk * QB + 64 * n + 32 * (g & 1), v);
        words8(p.h + blk * HB + 32 * n, hv);
        const int lshift = (g >> 1) * 4, hshift = 2 * g;
#pragma unroll
        for (int t = 0; t < 8; ++t)
            w[t] = sub_bytes(((v[t] >> lshift) & 0x0F0F0F0Fu) | (((hv[t] >> hshift) & 0x03030303u) << 4), 32);
        const float d = h2f(ld2(p.d + blk * DB));
        const u8* s = p.s + blk * SB + 8 * n + 2 * g;
        sc[0] = d * (float)(signed char)__ldg(s);
        sc[1] = d * (float)(signed char)__ldg(s + 1);
        mn = 0.0f;
    }
};

// Q3_K: hmask[32] | qs[64] | scales[12] | d. Half n (128 weights) uses qs[32 n ..]; its group j takes bits 2j, 2j+1
// of those 32 bytes and bit 4n + j of hmask[0..31], q = low bits - (high bit ? 0 : 4), in [-4, 3]. Its two 16-weight
// halves are sub-blocks 8n + 2j and 8n + 2j + 1, each with a 6-bit scale (sub-block i: the nibble i / 8 of byte i % 8
// and bits 2 (i / 4) of byte 8 + i % 4); value d * (scale - 32) * q.
struct BlockQ3_K {
    static constexpr int QK = 256, QB = 64, HB = 32, SB = 12, DB = 2;
    __device__ static float scale(const u8* s, int i) {
        const int low = (__ldg(s + i % 8) >> (4 * (i / 8))) & 0xF, high = (__ldg(s + 8 + i % 4) >> (2 * (i / 4))) & 3;
        return (float)((low | high << 4) - 32);
    }
    __device__ static void group(const Planes& p, long blk, int sub, int (&w)[8], float (&sc)[2], float& mn) {
        const int n = sub >> 2, j = sub & 3;
        u32 v[8], hv[8];
        words8(p.q + blk * QB + 32 * n, v);
        words8(p.h + blk * HB, hv);
#pragma unroll
        for (int t = 0; t < 8; ++t)
            w[t] = sub_bytes(((v[t] >> (2 * j)) & 0x03030303u) | (((hv[t] >> (4 * n + j)) & 0x01010101u) << 2), 4);
        const float d = h2f(ld2(p.d + blk * DB));
        const u8* s = p.s + blk * SB;
        sc[0] = d * scale(s, 8 * n + 2 * j);
        sc[1] = d * scale(s, 8 * n + 2 * j + 1);
        mn = 0.0f;
    }
};

// IQ4_XS: d | scales_h (2 high bits of sub-block j's 6-bit scale at bits 2j) | scales_l[4] (its low 4 bits, nibble
// j % 2 of byte j / 2) | qs[128]: sub-block j's weight l < 16 is the low nibble of qs[16 j + l], weight l + 16 its
// high nibble, each an index into the 16 non-linear levels (IQ4NL_LEVELS, generated by kernels/sources.py); value
// d * (scale - 32) * level.
__device__ __forceinline__ u32 iq4nl_levels(u32 idx) {  // four indices (bytes, 0..15) -> their int8 levels
    const u32 sel = (idx & 0x7u) | ((idx >> 4) & 0x70u) | ((idx >> 8) & 0x700u) | ((idx >> 12) & 0x7000u);
    const u32 low = __byte_perm(IQ4NL_LEVELS[0], IQ4NL_LEVELS[1], sel), high = __byte_perm(IQ4NL_LEVELS[2], IQ4NL_LEVELS[3], sel);
    const u32 upper = byte_masks4(((idx >> 3) & 1u) | ((idx >> 10) & 2u) | ((idx >> 17) & 4u) | ((idx >> 24) & 8u));
    return (low & ~upper) | (high & upper);
}

struct BlockIQ4_XS {
    static constexpr int QK = 256, QB = 128, HB = 0, SB = 6, DB = 2;
    __device__ static void group(const Planes& p, long blk, int sub, int (&w)[8], float (&sc)[2], float& mn) {
        nibbles16(p.q + blk * QB + 16 * sub, w);
#pragma unroll
        for (int t = 0; t < 8; ++t) w[t] = iq4nl_levels(w[t]);
        const u8* s = p.s + blk * SB;
        const int high = ((__ldg(s) | __ldg(s + 1) << 8) >> (2 * sub)) & 3, low = (__ldg(s + 2 + sub / 2) >> (4 * (sub & 1))) & 0xF;
        sc[0] = sc[1] = h2f(ld2(p.d + blk * DB)) * (float)((low | high << 4) - 32);
        mn = 0.0f;
    }
};

// IQ3_S: d | qs[64] | qh[8] | signs[32] | scales[4]. Sub-block j's weights 4i .. 4i + 3 (i < 8) are the four levels
// (1, 3, .., 15) of grid row qs[8 j + i] + 256 (bit i of qh[j]) (IQ3S_GRID, generated by kernels/sources.py), negated
// where bits 4i .. 4i + 3 of the little-endian word signs[4 j ..] are set; value d * (1 + 2 scale) * level, the
// scale nibble j % 2 of scales[j / 2]. On the GPU the H plane holds qh then signs.
struct BlockIQ3_S {
    static constexpr int QK = 256, QB = 64, HB = 40, SB = 4, DB = 2;
    __device__ static void group(const Planes& p, long blk, int sub, int (&w)[8], float (&sc)[2], float& mn) {
        const uint2 q = __ldg(reinterpret_cast<const uint2*>(p.q + blk * QB + 8 * sub));
        const u32 qh = __ldg(p.h + blk * HB + sub), signs = ld4(p.h + blk * HB + 8 + 4 * sub);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const u32 row = (((i < 4 ? q.x : q.y) >> (8 * (i & 3))) & 0xFFu) | (((qh >> i) & 1u) << 8);
            const u32 negative = byte_masks4(signs >> (4 * i));
            w[i] = __vsub4(__ldg(IQ3S_GRID + row) ^ negative, negative);
        }
        const int scale = (__ldg(p.s + blk * SB + sub / 2) >> (4 * (sub & 1))) & 0xF;
        sc[0] = sc[1] = h2f(ld2(p.d + blk * DB)) * (float)(1 + 2 * scale);
        mn = 0.0f;
    }
};

// Decode group g (0-based along the row) of row `row` of a matrix with k columns.
template <class B>
__device__ __forceinline__ void decode_group(const Planes& p, long row, int k, int g, int (&w)[8], float (&sc)[2],
                                             float& mn) {
    constexpr int GPB = B::QK / 32;  // groups per block
    const long blk = row * (long)(k / B::QK) + g / GPB;
    B::group(p, blk, g % GPB, w, sc, mn);
}

// Experts kept in RAM for the CPU (engine/cpu/layout.py), streamed to the GPU for a prompt chunk or read over the
// bus by a decode step, are read in that layout: 32-value groups row after row. A 4-bit group is 16 bytes, value j
// in the low nibble of byte j and value j + 16 in the high one (FIFTH: plus 4 bytes a group, bit i the fifth bit
// of value i). Planes: q = lo, h = hi, s = m or sup, d = d. "nibble": value = d * q + m, float32 d and m a group.
// "nibble_k": d holds a group's 6-bit scale and min (two bytes), sup each 8 groups' float32 super-block d and dmin,
// value = (d_s * scale) * q - dmin_s * min. "q6k": those 16 bytes plus 8 (bits 2s, 2s + 1 of byte t the top bits of value t + 8s), d an int8
// scale per 16 values, sup each 8 groups' float32 d, value = (d_s * scale) * (q - 32). "q3k": 8 bytes of two low
// bits (arranged as q6k's top ones) and 4 of third bits (bit i: value i), q6k's d and sup, value = (d_s * scale) *
// (q - 4). "q8": 32 int8 and a float32 d. A row holds whole super-blocks, so group blk's super-block is blk / 8.
template <bool FIFTH>
__device__ __forceinline__ void host_nibbles(const Planes& p, long blk, int (&w)[8]) {
    const uint4 a = ld16(p.q + 16 * blk);
    const u32 v[4] = {a.x, a.y, a.z, a.w};
    const u32 qh = FIFTH ? ld4(p.h + 4 * blk) : 0u;
#pragma unroll
    for (int t = 0; t < 4; ++t) {
        w[t] = (v[t] & 0x0F0F0F0Fu) | spread4_to_bit4(qh >> (4 * t));
        w[t + 4] = ((v[t] >> 4) & 0x0F0F0F0Fu) | spread4_to_bit4(qh >> (16 + 4 * t));
    }
}

template <bool FIFTH>
struct HostNibble {
    static constexpr int QK = 32;
    __device__ static void group(const Planes& p, long blk, int, int (&w)[8], float (&sc)[2], float& mn) {
        host_nibbles<FIFTH>(p, blk, w);
        sc[0] = sc[1] = __ldg(reinterpret_cast<const float*>(p.d) + blk);
        mn = __ldg(reinterpret_cast<const float*>(p.s) + blk);
    }
};

template <bool FIFTH>
struct HostNibbleK {
    static constexpr int QK = 32;
    __device__ static void group(const Planes& p, long blk, int, int (&w)[8], float (&sc)[2], float& mn) {
        host_nibbles<FIFTH>(p, blk, w);
        const u32 scale_min = ld2(p.d + 2 * blk);
        const float2 sup = __ldg(reinterpret_cast<const float2*>(p.s) + (blk >> 3));
        sc[0] = sc[1] = sup.x * (float)(scale_min & 0xFFu);
        mn = -(sup.y * (float)(scale_min >> 8));
    }
};

// Values 4t .. 4t + 3 of a group's 8 bytes of two-bit values (bits 2s, 2s + 1 of byte j: value j + 8s), a byte each:
// bytes 4 (t & 1) .. + 3, bits 2 (t >> 1).
__device__ __forceinline__ u32 two_bits4(uint2 v, int t) {
    return (((t & 1) ? v.y : v.x) >> (2 * (t >> 1))) & 0x03030303u;
}

// "q6k" and "q3k": an int8 scale for each 16 values of group blk under its 8 groups' float32 d, no offset.
__device__ __forceinline__ void int8_half_scales(const Planes& p, long blk, float (&sc)[2], float& mn) {
    const u32 scales = ld2(p.d + 2 * blk);
    const float sup = __ldg(reinterpret_cast<const float*>(p.s) + (blk >> 3));
    sc[0] = sup * (float)(signed char)(scales & 0xFFu);
    sc[1] = sup * (float)(signed char)(scales >> 8);
    mn = 0.0f;
}

struct HostQ6K {
    static constexpr int QK = 32;
    __device__ static void group(const Planes& p, long blk, int, int (&w)[8], float (&sc)[2], float& mn) {
        const uint4 a = ld16(p.q + 16 * blk);
        const u32 v[4] = {a.x, a.y, a.z, a.w};
        const uint2 hv = __ldg(reinterpret_cast<const uint2*>(p.h + 8 * blk));
#pragma unroll
        for (int t = 0; t < 8; ++t) {
            w[t] = sub_bytes(((v[t & 3] >> (4 * (t >> 2))) & 0x0F0F0F0Fu) | (two_bits4(hv, t) << 4), 32);
        }
        int8_half_scales(p, blk, sc, mn);
    }
};

struct HostQ3K {
    static constexpr int QK = 32;
    __device__ static void group(const Planes& p, long blk, int, int (&w)[8], float (&sc)[2], float& mn) {
        const uint2 low = __ldg(reinterpret_cast<const uint2*>(p.q + 8 * blk));
        const u32 third = ld4(p.h + 4 * blk);
#pragma unroll
        for (int t = 0; t < 8; ++t) w[t] = sub_bytes(two_bits4(low, t) | (spread4(third >> (4 * t)) << 2), 4);
        int8_half_scales(p, blk, sc, mn);
    }
};

struct HostQ8 {
    static constexpr int QK = 32;
    __device__ static void group(const Planes& p, long blk, int, int (&w)[8], float (&sc)[2], float& mn) {
        u32 v[8];
        words8(p.q + 32 * blk, v);
#pragma unroll
        for (int t = 0; t < 8; ++t) w[t] = v[t];
        sc[0] = sc[1] = __ldg(reinterpret_cast<const float*>(p.d) + blk);
        mn = 0.0f;
    }
};

// Instantiate MACRO(name, BlockType) for every quantized type.
#define FOR_EACH_QUANT(MACRO)   \
    MACRO(q4_0, BlockQ4_0)      \
    MACRO(q4_1, BlockQ4_1)      \
    MACRO(q5_0, BlockQ5_0)      \
    MACRO(q5_1, BlockQ5_1)      \
    MACRO(q8_0, BlockQ8_0)      \
    MACRO(q4_k, BlockQ4_K)      \
    MACRO(q5_k, BlockQ5_K)      \
    MACRO(q6_k, BlockQ6_K)      \
    MACRO(q3_k, BlockQ3_K)      \
    MACRO(iq4_xs, BlockIQ4_XS)  \
    MACRO(iq3_s, BlockIQ3_S)

// Instantiate MACRO(name, BlockType) for every layout of experts kept in RAM (kernel_names.HOST_LAYOUTS).
#define FOR_EACH_HOST_LAYOUT(MACRO)          \
    MACRO(cpu_nibble, HostNibble<false>)     \
    MACRO(cpu_nibble5, HostNibble<true>)     \
    MACRO(cpu_nibble_k, HostNibbleK<false>)  \
    MACRO(cpu_nibble5_k, HostNibbleK<true>)  \
    MACRO(cpu_q6k, HostQ6K)                  \
    MACRO(cpu_q3k, HostQ3K)                  \
    MACRO(cpu_q8, HostQ8)

// Float weight types, 8 consecutive values per read: WORDS16 16-byte words, which unpack8 turns into floats (apart,
// so that a kernel can load the words early and unpack them later).
struct WF32 {
    typedef float T;
    static constexpr int WORDS16 = 2;
    __device__ static void unpack8(const uint4 (&u)[WORDS16], float (&v)[8]) {
        const u32 w[8] = {u[0].x, u[0].y, u[0].z, u[0].w, u[1].x, u[1].y, u[1].z, u[1].w};
#pragma unroll
        for (int e = 0; e < 8; ++e) v[e] = __uint_as_float(w[e]);
    }
    __device__ static void load8(const float* p, long i, float (&v)[8]) {
        const uint4 u[2] = {__ldg(reinterpret_cast<const uint4*>(p + i)),
                            __ldg(reinterpret_cast<const uint4*>(p + i + 4))};
        unpack8(u, v);
    }
};

template <bool BF>
struct WHalf {
    typedef u16 T;
    static constexpr int WORDS16 = 1;
    __device__ static void unpack8(const uint4 (&a)[WORDS16], float (&v)[8]) {
        const u32 u[4] = {a[0].x, a[0].y, a[0].z, a[0].w};
#pragma unroll
        for (int t = 0; t < 4; ++t) {
            v[2 * t] = BF ? bf2f((u16)(u[t] & 0xFFFF)) : h2f((u16)(u[t] & 0xFFFF));
            v[2 * t + 1] = BF ? bf2f((u16)(u[t] >> 16)) : h2f((u16)(u[t] >> 16));
        }
    }
    __device__ static void load8(const u16* p, long i, float (&v)[8]) {
        const uint4 u[1] = {__ldg(reinterpret_cast<const uint4*>(p + i))};
        unpack8(u, v);
    }
};
typedef WHalf<false> WF16;
typedef WHalf<true> WBF16;

#define FOR_EACH_FLOAT(MACRO) \
    MACRO(f32, WF32)          \
    MACRO(f16, WF16)          \
    MACRO(bf16, WBF16)

template <class T>
__device__ __forceinline__ T warp_sum(T v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, o);
    return v;
}

// The warp's largest v and the warp's sum of an int: one redux instruction each on sm_80 and newer (floats
// compared as ints after flipping the magnitude bits of negatives, which orders them as numbers), five shuffles
// before. Both exact, so either path gives the same bits (a NaN is not ordered; no caller passes one on purpose).
__device__ __forceinline__ float warp_max(float v) {
#if __CUDA_ARCH__ >= 800
    const int i = __float_as_int(v), m = __reduce_max_sync(0xFFFFFFFFu, i < 0 ? i ^ 0x7FFFFFFF : i);
    return __int_as_float(m < 0 ? m ^ 0x7FFFFFFF : m);
#else
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xFFFFFFFFu, v, o));
    return v;
#endif
}

// The sum of v over the block (every thread gets it; red: 32 floats of shared memory).
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

__device__ __forceinline__ int warp_sum_int(int v) {
#if __CUDA_ARCH__ >= 800
    return __reduce_add_sync(0xFFFFFFFFu, v);
#else
    return warp_sum(v);
#endif
}

// FFN activations: 0 = silu (SwiGLU), 1 = gelu with the tanh approximation (GeGLU).
__device__ __forceinline__ float act_silu(float g) { return g / (1.0f + expf(-g)); }

__device__ __forceinline__ float act_gelu_tanh(float g) {
    const float c = 0.7978845608028654f;  // sqrt(2 / pi)
    return 0.5f * g * (1.0f + tanhf(c * (g + 0.044715f * g * g * g)));
}

__device__ __forceinline__ float activate(float g, int act) { return act == 0 ? act_silu(g) : act_gelu_tanh(g); }

#define NEG_INF __int_as_float(0xff800000)

// Dim d of a head x after the rotary embedding with angle row (c, s) of its position (half = rot / 2 angles).
// style 0 ("normal", llama GGUF): pair j is dims (2j, 2j+1); style 1 ("neox"): dims (j, j + rot/2); a pair (a, b)
// becomes (a cos - b sin, a sin + b cos). Dims at and past rot pass through unchanged. With w, of x * w (a per-head
// RMS norm's weights; its 1 / rms, one factor for the whole head, is the caller's to apply).
__device__ __forceinline__ float rotated(const float* x, int d, int rot, int neox, const float* c, const float* s,
                                         const float* w = nullptr) {
    auto at = [&](int i) { return w != nullptr ? x[i] * w[i] : x[i]; };
    if (d >= rot) return at(d);
    const int half = rot / 2;
    const int j = neox ? d % half : d / 2;
    const float a = at(neox ? j : 2 * j), b = at(neox ? j + half : 2 * j + 1);
    return (neox ? d < half : (d & 1) == 0) ? a * c[j] - b * s[j] : a * s[j] + b * c[j];
}

// 1 / rms of a head of HD values (x + 32 i + lane, i < HD / 32, in every lane of a warp) for an RMS norm with eps, as
// norms.cu's rms_norm divides by it.
template <int HD>
__device__ __forceinline__ float head_inv_rms(const float* x, float eps) {
    float ss = 0.0f;
#pragma unroll
    for (int i = 0; i < HD / 32; ++i) ss = fmaf(x[32 * i + (threadIdx.x & 31)], x[32 * i + (threadIdx.x & 31)], ss);
    return rsqrtf(warp_sum(ss) / HD + eps);
}

// Two-level int8 quantization of a group of 32 activations with largest magnitude amax:
//   q = rint(v * 127 / amax), d = amax / 127, then the remainder r = v - q d as q2 = rint(r * 254 / d), so
//   v ~= d * (q + q2 / 254) within d / 508 (1.5e-5 of amax), and s = d * (254 sum(q) + sum(q2)) / 254.
// Matches reference.quantize_q8 bit for bit (IEEE division and rounding, no contraction into FMA).
struct Q8Scale {
    float d, id, id2;
    __device__ explicit Q8Scale(float amax)
        : d(amax / 127.0f), id(amax > 0.0f ? 127.0f / amax : 0.0f), id2(amax > 0.0f ? 254.0f / d : 0.0f) {}
    __device__ void levels(float v, float& q, float& q2) const {
        q = rintf(__fmul_rn(v, id));
        q2 = fminf(127.0f, fmaxf(-127.0f, rintf(__fmul_rn(__fsub_rn(v, __fmul_rn(q, d)), id2))));
    }
    // (d, s) from total = 254 sum(q) + sum(q2).
    __device__ float2 ds(int total) const { return make_float2(d, __fmul_rn(d, (float)total) / 254.0f); }
};

// One group g, a value v a lane (threadIdx.x & 31).
__device__ __forceinline__ void quantize_group(float v, long g, signed char* xq, signed char* xq2, float2* xds) {
    const int lane = threadIdx.x & 31;
    const Q8Scale scale(warp_max(fabsf(v)));
    float q, q2;
    scale.levels(v, q, q2);
    xq[g * 32 + lane] = (signed char)(int)q;
    xq2[g * 32 + lane] = (signed char)(int)q2;
    const int total = warp_sum_int(254 * (int)q + (int)q2);
    if (lane == 0) xds[g] = scale.ds(total);
}

// ---- the KV cache's rows: fp16, or q8_0 (half the bytes), for attention.cu, flash_attention.cu and rope.cu ----

// Two signed bytes as exact fp16 values, in two instructions: a byte biased to unsigned (u = q + 128) under the byte
// 0x64 is the fp16 1024 + u, and 1152 taken off leaves q. The pair: bytes 0 and 1 of w (HIGH: 2 and 3).
template <bool HIGH = false>
__device__ __forceinline__ u32 i8_pair_f16(u32 w) {
    u32 h = __byte_perm(w ^ 0x80808080u, 0x64646464u, HIGH ? 0x4342 : 0x4140);
    asm("sub.f16x2 %0, %0, %1;" : "+r"(h) : "r"(0x64806480u));
    return h;
}

// Int8 values times their scale as fp16: one fp16 product rounds q * scale once, as f2h(q * scale) would. s2: the
// scale's fp16 bits in both halves.
template <bool HIGH = false>
__device__ __forceinline__ u32 q8_pair(u32 w, u32 s2) {
    u32 h = i8_pair_f16<HIGH>(w);
    asm("mul.f16x2 %0, %0, %1;" : "+r"(h) : "r"(s2));
    return h;
}

__device__ __forceinline__ u32 both_halves(u16 h) { return h * 0x10001u; }

// Eight int8 values times their scale, as four fp16 pairs.
__device__ __forceinline__ uint4 q8_half8(uint2 q, u32 s2) {
    return make_uint4(q8_pair(q.x, s2), q8_pair<true>(q.x, s2), q8_pair(q.y, s2), q8_pair<true>(q.y, s2));
}

// The row of a KV head's cache holding position j: j itself, or in a cache of fewer rows than positions (a
// sliding-window layer's ring, engine/kv_cache.py) j mod rows, in 32 bits (positions are ints; a 64-bit modulo is a
// long instruction sequence, which the compiler may run even where the branch is not taken).
__device__ __forceinline__ long cache_row(long j, int rows) {
    return j < rows ? j : (long)((unsigned)j % (unsigned)rows);
}

// KV head kvh's keys or values as the cache holds them, `rows` rows (cache_row): fp16, or with Q8 q8_0 (int8 values
// and, in `scale`, an fp16 scale for each 32 of them; a value is q * scale, read as fp16 like the others, so the
// attention kernels compute on both alike). Rows are read 8 dims (4 fp16 pairs) or 2 dims (a pair) at a time.
template <int HD, bool Q8>
struct CacheRows {
    static constexpr int ROW_BYTES = Q8 ? HD : 2 * HD;
    const char* data;
    const u16* scale;
    int rows;

    __device__ CacheRows(const void* cache, const u16* scales, int kvh, int max_tokens)
        : data(reinterpret_cast<const char*>(cache) + (long)kvh * max_tokens * ROW_BYTES),
          scale(Q8 ? scales + (long)kvh * max_tokens * (HD / 32) : nullptr), rows(max_tokens) {}

    __device__ long row(long j) const { return cache_row(j, rows); }

    // The row d positions after row r (0 <= d < rows): a run of positions read one after another maps its first
    // position once (row) and steps from there with a select, so the run's loads carry no modulo and stay together.
    __device__ long step(long r, int d) const { return r + d < rows ? r + d : r + d - rows; }

    // Ask L2 for the lines of positions lo .. hi - 1 (at most `rows` of them, wrapping in a ring), thread t of n.
    __device__ void prefetch(int lo, int hi, int t, int n) const {
        const long at = row(lo), len = hi - lo, before_wrap = min(len, (long)rows - at);
        for (long off = 128L * t; off < before_wrap * ROW_BYTES; off += 128L * n)
            prefetch_l2_line(data + at * ROW_BYTES + off);
        for (long off = 128L * t; off < (len - before_wrap) * ROW_BYTES; off += 128L * n) prefetch_l2_line(data + off);
    }

    // Dims col .. col + 7 of row j (a row, not a position: see row and step; col a multiple of 8). EARLY: an fp16
    // row's load before grid_dependency_sync.
    template <bool EARLY = false>
    __device__ uint4 load8(long j, int col) const {
        if constexpr (Q8) {
            return q8_half8(__ldg(reinterpret_cast<const uint2*>(data + j * HD + col)),
                            both_halves(__ldg(scale + j * (HD / 32) + col / 32)));
        } else {
            const void* p = data + (j * HD + col) * 2;
            return EARLY ? ld16_early(p) : __ldg(reinterpret_cast<const uint4*>(p));
        }
    }

    // Dims d, d + 1 of row j (a row, as for load8; d even).
    __device__ u32 load2(long j, int d) const {
        if constexpr (Q8)
            return q8_pair(__ldg(reinterpret_cast<const u16*>(data + j * HD + d)),
                           both_halves(__ldg(scale + j * (HD / 32) + d / 32)));
        else
            return __ldg(reinterpret_cast<const u32*>(data + (j * HD + d) * 2));
    }
};

// The q8_0 rounding of x, whose group of 32 values spans `width` lanes of the warp (aligned): d = the group's
// largest |x| / 127, q = x / d rounded half away from zero (GGUF's Q8_0, reference.quantize_q8_0). Every lane gets
// its group's d; amax: this lane's largest |x|.
__device__ __forceinline__ float q8_scale(float amax, int width) {
    for (int o = width / 2; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, o));
    return amax / 127.0f;
}
__device__ __forceinline__ int q8_round(float x, float d) { return (int)roundf(x * (d != 0.0f ? 1.0f / d : 0.0f)); }

// Two values of a group of 32 spread over `width` lanes, rounded to q8_0: the int8 pair (the bytes of a u16), the
// group's fp16 scale, and the pair as the cache's readers see it (fp16 of q * scale).
struct Q8Pair {
    u16 q, scale;
    u32 value;
};
__device__ __forceinline__ Q8Pair q8_round_pair(float a, float b, int width) {
    const float d = q8_scale(fmaxf(fabsf(a), fabsf(b)), width);
    const u16 q = (u16)((q8_round(a, d) & 0xFF) | (q8_round(b, d) & 0xFF) << 8);
    const u16 dh = f2h(d);
    return {q, dh, q8_pair(q, both_halves(dh))};
}

