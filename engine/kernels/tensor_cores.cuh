// Tensor cores (mma.sync m16n8k16, ldmatrix) and asynchronous copies (cp.async), sm_80 and newer: callers send
// older GPUs to other paths. Prepended, after quant_blocks.cuh, to the modules sources.TENSOR_CORE_MODULES names.

__device__ __forceinline__ void ldsm_x4(u32 (&r)[4], const u16* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"((u32)__cvta_generic_to_shared(p)));
}

__device__ __forceinline__ void ldsm_x4_trans(u32 (&r)[4], const u16* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"((u32)__cvta_generic_to_shared(p)));
}

// The A fragment of rows r0 .. r0 + 15, columns 16 kk .. 16 kk + 15 of a row-major fp16 matrix in shared memory
// (rows ld halves apart).
__device__ __forceinline__ void ldsm_a(u32 (&a)[4], const u16* base, int ld, int r0, int kk) {
    const int lane = threadIdx.x & 31;
    ldsm_x4(a, base + (r0 + (lane & 15)) * ld + 16 * kk + (lane >> 4) * 8);
}

// The B fragments of rows 16 kk .. 16 kk + 15 of a k-major fp16 matrix in shared memory (rows ld halves apart):
// b[0], b[1] for columns 8 nb .. 8 nb + 7, b[2], b[3] for the next 8.
__device__ __forceinline__ void ldsm_b_pair(u32 (&b)[4], const u16* base, int ld, int kk, int nb) {
    const int lane = threadIdx.x & 31;
    ldsm_x4_trans(b, base + (16 * kk + (lane & 7) + ((lane >> 3) & 1) * 8) * ld + 8 * nb + (lane >> 4) * 8);
}

// c += a (16 x 16, row) . b (16 x 8, col), fp16 inputs, fp32 accumulation.
__device__ __forceinline__ void mma_f16(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
#if __CUDA_ARCH__ >= 800
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
    __trap();
#endif
}

// c[nb] += a . (columns 8 nb .. 8 nb + 7 of rows 16 kk .. 16 kk + 15 of B) for every nb: B a k-major fp16 matrix in
// shared memory, as for ldsm_b_pair.
template <int NB>
__device__ __forceinline__ void mma_b_row(float (&c)[NB][4], const u32 (&a)[4], const u16* bs, int ld, int kk) {
#pragma unroll
    for (int nb = 0; nb < NB; nb += 2) {
        u32 b[4];
        ldsm_b_pair(b, bs, ld, kk, nb);
        mma_f16(c[nb], a, b[0], b[1]);
        mma_f16(c[nb + 1], a, b[2], b[3]);
    }
}

__device__ __forceinline__ u32 half2_bits(float a, float b) { return (u32)f2h(a) | ((u32)f2h(b) << 16); }

// 16 bytes from global to shared memory, bypassing L1; zeros where !fill (rows past a range).
__device__ __forceinline__ void copy16(void* dst, const void* src, bool fill) {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"((u32)__cvta_generic_to_shared(dst)), "l"(src),
                 "r"(fill ? 16 : 0)
                 : "memory");
#else
    *reinterpret_cast<uint4*>(dst) = fill ? __ldg(reinterpret_cast<const uint4*>(src)) : make_uint4(0, 0, 0, 0);
#endif
}

// BYTES (4, 8 or 16) likewise; those below 16 through L1 (cp.async.cg takes 16 only).
template <int BYTES>
__device__ __forceinline__ void copy_small(void* dst, const void* src, bool fill) {
    static_assert(BYTES == 4 || BYTES == 8 || BYTES == 16, "cp.async copies 4, 8 or 16 bytes");
    if constexpr (BYTES == 16) {
        copy16(dst, src, fill);
    } else {
#if __CUDA_ARCH__ >= 800
        asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;"
                     ::"r"((u32)__cvta_generic_to_shared(dst)), "l"(src), "n"(BYTES), "r"(fill ? BYTES : 0)
                     : "memory");
#else
        for (int i = 0; i < BYTES / 4; ++i)
            reinterpret_cast<u32*>(dst)[i] = fill ? __ldg(reinterpret_cast<const u32*>(src) + i) : 0u;
#endif
    }
}

__device__ __forceinline__ void copies_commit() {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}

// Wait until at most PENDING of this thread's committed copy groups are still in flight.
template <int PENDING = 0>
__device__ __forceinline__ void copies_wait() {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_group %0;" ::"n"(PENDING) : "memory");
#endif
}

// Hopper's bulk copies (the tensor memory accelerator), which a sweep-only form of the deep decode kernel takes in
// place of cp.async: an instruction a row, its bytes counted on an mbarrier in shared memory rather than by the
// thread's copy groups. Before sm_90 they trap.
__device__ __forceinline__ void bulk_barrier_init(unsigned long long* bar) {
#if __CUDA_ARCH__ >= 900
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n\tfence.mbarrier_init.release.cluster;"
                 ::"r"((u32)__cvta_generic_to_shared(bar)) : "memory");
#else
    __trap();
#endif
}

// The barrier's one arrival, expecting `bytes` of copies before its phase completes.
__device__ __forceinline__ void bulk_expect(unsigned long long* bar, u32 bytes) {
#if __CUDA_ARCH__ >= 900
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
                 ::"r"((u32)__cvta_generic_to_shared(bar)), "r"(bytes) : "memory");
#else
    __trap();
#endif
}

// `bytes` (a multiple of 16, both ends 16-byte aligned) from global to shared memory, counted on bar. The fence
// orders this thread's earlier reads of the buffer before the copy's writes.
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, u32 bytes, unsigned long long* bar) {
#if __CUDA_ARCH__ >= 900
    asm volatile("fence.proxy.async.shared::cta;\n\t"
                 "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 ::"r"((u32)__cvta_generic_to_shared(dst)), "l"(src), "r"(bytes),
                 "r"((u32)__cvta_generic_to_shared(bar)) : "memory");
#else
    __trap();
#endif
}

// Wait until the barrier's phase of this parity (0 for its first use, then alternating) has completed.
__device__ __forceinline__ void bulk_wait(unsigned long long* bar, u32 parity) {
#if __CUDA_ARCH__ >= 900
    asm volatile("{\n\t.reg .pred done;\n"
                 "BULK_WAIT_%=:\n\t"
                 "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n\t"
                 "@!done bra BULK_WAIT_%=;\n\t}"
                 ::"r"((u32)__cvta_generic_to_shared(bar)), "r"(parity) : "memory");
#else
    __trap();
#endif
}

// ---- one key tile of attention on tensor cores, for a warp's 16 query rows ----
// The rows' queries are mma A fragments qa (fp16, pre-scaled to base 2); a lane holds rows g = lane / 4 and g + 8,
// columns 2 t, 2 t + 1 (t = lane % 4) of each 8-wide block. ks and vs: KT keys and values of D halves in shared
// memory, rows `ld` halves apart (padded so ldmatrix's eight row addresses fall in distinct banks).

// s[nb][2 h + e] = score of row g + 8 h with key 8 nb + 2 t + e of the tile.
template <int D, int KT>
__device__ __forceinline__ void tile_scores(const u32 (&qa)[D / 16][4], const u16* ks, int ld, float (&s)[KT / 8][4]) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int nb = 0; nb < KT / 8; ++nb) s[nb][0] = s[nb][1] = s[nb][2] = s[nb][3] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk)
#pragma unroll
        for (int nb = 0; nb < KT / 8; nb += 2) {
            u32 b[4];
            ldsm_x4(b, ks + (8 * nb + (lane & 7) + (lane >> 4) * 8) * ld + 16 * kk + ((lane >> 3) & 1) * 8);
            mma_f16(s[nb], qa[kk], b[0], b[1]);
            mma_f16(s[nb + 1], qa[kk], b[2], b[3]);
        }
}

// The online softmax of the (masked) scores: m and l per row (l this lane's share of the row's sum), o rescaled,
// and the probabilities as the A fragments pa of P.V.
template <int D, int KT>
__device__ __forceinline__ void tile_softmax(const float (&s)[KT / 8][4], float (&m)[2], float (&l)[2],
                                             float (&o)[D / 8][4], u32 (&pa)[KT / 16][4]) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        float mx = NEG_INF;
#pragma unroll
        for (int nb = 0; nb < KT / 8; ++nb) mx = fmaxf(mx, fmaxf(s[nb][2 * h], s[nb][2 * h + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xFFFFFFFFu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xFFFFFFFFu, mx, 2));
        const float m_new = fmaxf(m[h], mx);
        const float base = m_new == NEG_INF ? 0.0f : m_new;  // a row with every key so far masked
        const float corr = exp2f(m[h] - base);
        m[h] = m_new;
        float sum = 0.0f;
#pragma unroll
        for (int nb = 0; nb < KT / 8; ++nb) {
            const float p0 = exp2f(s[nb][2 * h] - base), p1 = exp2f(s[nb][2 * h + 1] - base);
            sum += p0 + p1;
            // Keys 16 kk .. + 15 are score blocks 2 kk (a0, a1) and 2 kk + 1 (a2, a3).
            pa[nb / 2][2 * (nb & 1) + h] = half2_bits(p0, p1);
        }
        l[h] = l[h] * corr + sum;
#pragma unroll
        for (int db = 0; db < D / 8; ++db) {
            o[db][2 * h] *= corr;
            o[db][2 * h + 1] *= corr;
        }
    }
}

// o += P.V; o[db][2 h + e] is row g + 8 h, dim 8 db + 2 t + e.
template <int D, int KT>
__device__ __forceinline__ void tile_values(const u32 (&pa)[KT / 16][4], const u16* vs, int ld, float (&o)[D / 8][4]) {
#pragma unroll
    for (int kk = 0; kk < KT / 16; ++kk) mma_b_row(o, pa[kk], vs, ld, kk);
}
