// The hybrid Qwen families' own ops (engine/backend.py has each one's contract): the causal depthwise convolution
// with SiLU, the gated delta rule, and the sigmoid output gates of their attention and shared expert. A chunk
// of any length runs in one launch, so decode stays one graph and a prompt is not a launch per token.

constexpr int CONV_RUN = 16;  // tokens a thread of causal_conv_silu (cuda.CONV_RUN)

// A thread per channel and run of RUN tokens: out[t, c] = silu(sum_j w[c, j] window[t + j, c]) over the window
// [state; x] (rows -(K - 1) .. n - 1). A run loads its K - 1 + RUN window rows at once, so a prompt chunk is not
// one memory round trip a token (one thread walking 512 tokens took 228 us for the Qwen3.8-27B shape, H100). The
// first run's threads alone read the state, and they leave it holding the window's last K - 1 rows: out must not
// overlap x, which later runs still read. x and out may be column views (row strides).
template <int K, int RUN>
__device__ __forceinline__ void conv_silu(const float* __restrict__ x, long ldx, const float* __restrict__ w,
                                          float* __restrict__ state, float* __restrict__ out, long ldo, int n,
                                          int channels) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x, t0 = blockIdx.y * RUN;
    if (c >= channels) return;
    auto row = [&](int i) { return i < 0 ? state[(long)(K - 1 + i) * channels + c] : x[(long)i * ldx + c]; };
    float wk[K], win[K - 1 + RUN];
#pragma unroll
    for (int j = 0; j < K; ++j) wk[j] = w[(long)c * K + j];
#pragma unroll
    for (int j = 0; j < K - 1 + RUN; ++j) win[j] = t0 - (K - 1) + j < n ? row(t0 - (K - 1) + j) : 0.0f;
#pragma unroll
    for (int r = 0; r < RUN; ++r) {
        float acc = win[r + K - 1] * wk[K - 1];
#pragma unroll
        for (int j = 0; j < K - 1; ++j) acc += win[r + j] * wk[j];
        if (t0 + r < n) out[(long)(t0 + r) * ldo + c] = act_silu(acc);
    }
    if (blockIdx.y == 0) {
        float last[K - 1];
#pragma unroll
        for (int j = 0; j < K - 1; ++j) last[j] = row(n - (K - 1) + j);
#pragma unroll
        for (int j = 0; j < K - 1; ++j) state[(long)j * channels + c] = last[j];
    }
}

extern "C" __global__ void causal_conv_silu_4(const float* x, long ldx, const float* w, float* state, float* out,
                                              long ldo, int n, int channels) {
    grid_dependency_sync();
    conv_silu<4, CONV_RUN>(x, ldx, w, state, out, ldo, n, channels);
}

// A token's gates from its b and a logits: (beta = sigmoid(b), g = ssm_a softplus(a + dt_bias)), g the log of its
// decay (ssm_a is negative).
__device__ __forceinline__ float2 delta_gates(float b, float a, float dt_bias, float ssm_a) {
    const float x = a + dt_bias;
    return make_float2(1.0f / (1.0f + expf(-b)), ssm_a * (x > 20.0f ? x : log1pf(expf(x))));
}

// The gated delta rule, one block per value head h, token after token: thread v owns column v of the head's
// state S (DK x dv, in registers all chunk long), so S^T k and S^T q are sums inside the thread. Per token the
// block stages the head's query and key (and their sums of squares) in shared memory, double-buffered so that one
// barrier a token suffices: a buffer is rewritten two tokens later, after every thread passed the barrier between.
//   q, k = L2-normalised (eps 1e-6), q times DK^-1/2; beta = sigmoid(b); decay = exp(ssm_a softplus(a + dt_bias));
//   S = decay S;  S += k (beta (v - S^T k))^T;  o = S^T q.
// qkv rows: n_k query heads, n_k key heads, then n_v value heads of dv; ba rows: n_v b logits, then n_v a logits.
template <int DK>
__device__ __forceinline__ void delta_rule(const float* __restrict__ qkv, long ld_qkv, const float* __restrict__ ba,
                                           long ld_ba, const float* __restrict__ dt_bias,
                                           const float* __restrict__ ssm_a, float* __restrict__ state,
                                           float* __restrict__ out, long ld_out, int n, int n_k, int n_v, int dv,
                                           int tiled) {
    constexpr int KW = (DK + 31) / 32;  // warps holding the query and key
    __shared__ float qs[2][DK], ks[2][DK], sums[2][2][KW];
    const int h = blockIdx.x, v = threadIdx.x, warp = v / 32, lane = v & 31;
    const int kh = tiled ? h % n_k : h / (n_v / n_k);
    const bool owner = v < dv;
    float* st = state + (long)h * DK * dv + v;
    float S[DK];
#pragma unroll
    for (int i = 0; i < DK; ++i) S[i] = owner ? st[(long)i * dv] : 0.0f;
    const float* qh = qkv + (long)kh * DK;
    const float* kk = qkv + (long)(n_k + kh) * DK;
    const float* vh = qkv + 2L * n_k * DK + (long)h * dv + v;
    const float bias = dt_bias[h], a_scale = ssm_a[h];
    for (int t = 0; t < n; ++t) {
        const int b = t & 1;
        if (warp < KW) {
            float qv = 0.0f, kv = 0.0f;
            if (v < DK) {
                qv = qh[t * ld_qkv + v];
                kv = kk[t * ld_qkv + v];
                qs[b][v] = qv;
                ks[b][v] = kv;
            }
            qv = warp_sum(qv * qv);
            kv = warp_sum(kv * kv);
            if (lane == 0) {
                sums[b][0][warp] = qv;
                sums[b][1][warp] = kv;
            }
        }
        const float vt = owner ? vh[t * ld_qkv] : 0.0f;
        const float2 gates = delta_gates(ba[t * ld_ba + h], ba[t * ld_ba + n_v + h], bias, a_scale);
        const float beta = gates.x, decay = expf(gates.y);
        __syncthreads();
        float nq = 0.0f, nk = 0.0f;
#pragma unroll
        for (int w = 0; w < KW; ++w) {
            nq += sums[b][0][w];
            nk += sums[b][1][w];
        }
        const float rq = rsqrtf(nq + 1e-6f) * rsqrtf((float)DK), rk = rsqrtf(nk + 1e-6f);
        float skv = 0.0f;
#pragma unroll
        for (int i = 0; i < DK; ++i) {
            S[i] *= decay;
            skv += S[i] * ks[b][i];
        }
        const float delta = beta * (vt - skv * rk) * rk;  // times rk once more: the update's k is normalised too
        float o = 0.0f;
#pragma unroll
        for (int i = 0; i < DK; ++i) {
            S[i] += ks[b][i] * delta;
            o += S[i] * qs[b][i];
        }
        if (owner) out[t * ld_out + (long)h * dv + v] = o * rq;
    }
    if (owner) {
#pragma unroll
        for (int i = 0; i < DK; ++i) st[(long)i * dv] = S[i];
    }
}

#define DELTA_RULE(DK)                                                                                              \
    extern "C" __global__ void __launch_bounds__(256) gated_delta_net_##DK(                                         \
        const float* qkv, long ld_qkv, const float* ba, long ld_ba, const float* dt_bias, const float* ssm_a,       \
        float* state, float* out, long ld_out, int n, int n_k, int n_v, int dv, int tiled) {                       \
        grid_dependency_sync();                                                                                     \
        delta_rule<DK>(qkv, ld_qkv, ba, ld_ba, dt_bias, ssm_a, state, out, ld_out, n, n_k, n_v, dv, tiled);         \
    }
DELTA_RULE(16)
DELTA_RULE(32)
DELTA_RULE(64)
DELTA_RULE(128)

// Channel c's causal convolution for one token: silu(sum_j w[c, j] window[j]) over the window [old; x], old being
// the K - 1 earlier inputs the state holds (loaded by the caller: they can be read before the inputs are ready).
template <int K>
__device__ __forceinline__ float conv_token(float x, const float* __restrict__ w, long c, const float (&old)[K - 1]) {
    float acc = x * w[c * K + K - 1];
#pragma unroll
    for (int j = 0; j < K - 1; ++j) acc += old[j] * w[c * K + j];
    return act_silu(acc);
}

// The convolution state's column c after a token x: the window shifted by one.
template <int K>
__device__ __forceinline__ void conv_store(float* state, long c, int channels, const float (&old)[K - 1], float x) {
#pragma unroll
    for (int j = 0; j < K - 2; ++j) state[j * (long)channels + c] = old[j + 1];
    state[(K - 2) * (long)channels + c] = x;
}

// One token of the mixer's core in one launch (decode): causal_conv_silu, the delta rule and gated_rms_norm above,
// for n = 1. A block per value head h, thread i: the convolution of its key head's query and key channel i and of
// its own value channel i, the delta rule's step on state column i, and the gated RMS norm of the head's output
// (out = rms_norm(o) * norm_w * silu(z)); with xq it also writes out's int8 groups for the output projection. The
// state, the convolution's window and the weights are read before grid_dependency_sync (only this kernel writes the
// states, a step earlier). Every block of a key head convolves its query and key; the last of them to count itself
// in done[kh] (zero before, left at zero) stores those channels' window, after every one of them has read it.
template <int DK, int K>
__device__ __forceinline__ void delta_step(const float* __restrict__ qkv, const float* __restrict__ z,
                                           const float* __restrict__ ba, const float* __restrict__ conv_w,
                                           float* conv_state, const float* __restrict__ dt_bias,
                                           const float* __restrict__ ssm_a, const float* __restrict__ norm_w,
                                           float eps, float* state, float* __restrict__ out, int n_k, int n_v,
                                           int dv, int tiled, u32* done, signed char* xq, signed char* xq2,
                                           float2* xds) {
    __shared__ float qs[DK], ks[DK], red[32];
    __shared__ bool last;
    const int h = blockIdx.x, i = threadIdx.x;
    const int kh = tiled ? h % n_k : h / (n_v / n_k);
    const int channels = 2 * n_k * DK + n_v * dv;
    const long cq = (long)kh * DK + i, ck = (long)(n_k + kh) * DK + i, cv = 2L * n_k * DK + (long)h * dv + i;
    const bool keyed = i < DK, owner = i < dv;
    float* st = state + (long)h * DK * dv + i;
    float S[DK], old_q[K - 1] = {}, old_k[K - 1] = {}, old_v[K - 1] = {};
#pragma unroll
    for (int j = 0; j < DK; ++j) S[j] = owner ? st[(long)j * dv] : 0.0f;
#pragma unroll
    for (int j = 0; j < K - 1; ++j) {
        if (keyed) {
            old_q[j] = conv_state[j * (long)channels + cq];
            old_k[j] = conv_state[j * (long)channels + ck];
        }
        if (owner) old_v[j] = conv_state[j * (long)channels + cv];
    }
    grid_dependency_sync();

    float q = 0.0f, k = 0.0f, v = 0.0f;
    if (keyed) {
        q = conv_token<K>(qkv[cq], conv_w, cq, old_q);
        k = conv_token<K>(qkv[ck], conv_w, ck, old_k);
        qs[i] = q;
        ks[i] = k;
    }
    if (owner) {
        const float x = qkv[cv];
        v = conv_token<K>(x, conv_w, cv, old_v);
        conv_store<K>(conv_state, cv, channels, old_v, x);
    }
    const float nq = block_sum(q * q, red), nk = block_sum(k * k, red);  // its barriers publish qs and ks
    if (i == 0) {
        __threadfence();  // this block's reads of the window come before its count
        last = atomicAdd(&done[kh], 1u) == (u32)(n_v / n_k - 1);
        if (last) done[kh] = 0;
    }
    __syncthreads();
    if (last && keyed) {
        conv_store<K>(conv_state, cq, channels, old_q, qkv[cq]);
        conv_store<K>(conv_state, ck, channels, old_k, qkv[ck]);
    }

    const float rq = rsqrtf(nq + 1e-6f) * rsqrtf((float)DK), rk = rsqrtf(nk + 1e-6f);
    const float2 gates = delta_gates(ba[h], ba[n_v + h], dt_bias[h], ssm_a[h]);
    const float decay = expf(gates.y);
    float skv = 0.0f;
#pragma unroll
    for (int j = 0; j < DK; ++j) {
        S[j] *= decay;
        skv += S[j] * ks[j];
    }
    const float delta = gates.x * (v - skv * rk) * rk;  // times rk once more: the update's k is normalised too
    float o = 0.0f;
#pragma unroll
    for (int j = 0; j < DK; ++j) {
        S[j] += ks[j] * delta;
        o += S[j] * qs[j];
    }
    if (owner) {
#pragma unroll
        for (int j = 0; j < DK; ++j) st[(long)j * dv] = S[j];
    }
    o = owner ? o * rq : 0.0f;
    const float inv = rsqrtf(block_sum(o * o, red) / (float)dv + eps);
    if (!owner) return;  // whole warps when dv is a multiple of 32, as xq needs
    const long at = (long)h * dv + i;
    const float y = o * inv * norm_w[i] * act_silu(z[at]);
    out[at] = y;
    if (xq != nullptr) quantize_group(y, at / 32, xq, xq2, xds);
}

#define DELTA_STEP(DK)                                                                                              \
    extern "C" __global__ void __launch_bounds__(256) delta_step_##DK(                                              \
        const float* qkv, const float* z, const float* ba, const float* conv_w, float* conv_state,                  \
        const float* dt_bias, const float* ssm_a, const float* norm_w, float eps, float* state, float* out, int n_k, \
        int n_v, int dv, int tiled, u32* done, signed char* xq, signed char* xq2, float2* xds) {                    \
        delta_step<DK, 4>(qkv, z, ba, conv_w, conv_state, dt_bias, ssm_a, norm_w, eps, state, out, n_k, n_v, dv,    \
                          tiled, done, xq, xq2, xds);                                                               \
    }
DELTA_STEP(16)
DELTA_STEP(32)
DELTA_STEP(64)
DELTA_STEP(128)

// ---- the delta rule's chunked form, for prompts (sm_80+: tensor cores) ----
// engine/kernels/reference.py delta_rule_chunked has the math. delta_chunk_prep, a block per (chunk of DC tokens,
// value head), all chunks at once: normalised q and k, gamma (the running sum of g inside the chunk), the strictly
// lower system A = beta_i (k_i . k_j) e^(gamma_i - gamma_j) and its forward substitution, in float32, then for the
// second kernel: U (float32) and -W, Q e^gamma, K e^(gamma_last - gamma) and P = lower (q_i . k_j) e^(gamma_i -
// gamma_j) in fp16, and e^gamma_last. delta_chunk_state, a block per (value head, DCOLS columns of its state; the
// columns of S evolve apart), goes through the chunks in order with S in float32 accumulators:
//   V' = U - W S;  O = (Q e^gamma) S + P V';  S = e^gamma_last S + (K e^(gamma_last - gamma))^T V'.
// Tokens past n get beta = 0, g = 0 and zero q and k: they change nothing.
constexpr int DC = 64;     // tokens a chunk
constexpr int DCOLS = 32;  // state columns a block of delta_chunk_state
constexpr int DELTA_PREP_THREADS = 256;

// delta_chunk_prep's float32 scratch in shared memory (cuda.py sizes it): k and q transposed ([DK][DC + 4], so a
// thread's four tokens are one aligned float4), the system A ([DC][DC + 1]), beta and gamma.
template <int DK>
__device__ __forceinline__ void delta_chunk_prep(const float* __restrict__ qkv, long ld_qkv,
                                                 const float* __restrict__ ba, long ld_ba,
                                                 const float* __restrict__ dt_bias, const float* __restrict__ ssm_a,
                                                 int n, int n_k, int n_v, int dv, int tiled, float* __restrict__ u,
                                                 u16* __restrict__ wqk, u16* __restrict__ p, float* __restrict__ last) {
    constexpr int LT = DC + 4, LA = DC + 1;
    extern __shared__ float4 prep_smem[];
    float* kt = reinterpret_cast<float*>(prep_smem);
    float* qt = kt + DK * LT;
    float* a = qt + DK * LT;
    float* beta = a + DC * LA;
    float* gamma = beta + DC;
    const int c = blockIdx.x, h = blockIdx.y, tid = threadIdx.x, warp = tid / 32, lane = tid & 31;
    const int t0 = c * DC, kh = tiled ? h % n_k : h / (n_v / n_k);
    const long ch = (long)c * n_v + h;
    for (int r = warp; r < DC; r += DELTA_PREP_THREADS / 32) {
        const bool in = t0 + r < n;
        const float* row = qkv + (long)(in ? t0 + r : 0) * ld_qkv;
        float qv[DK / 32], kv[DK / 32], sq = 0.0f, sk = 0.0f;
#pragma unroll
        for (int i = 0; i < DK / 32; ++i) {
            qv[i] = in ? row[kh * DK + 32 * i + lane] : 0.0f;
            kv[i] = in ? row[(n_k + kh) * DK + 32 * i + lane] : 0.0f;
            sq += qv[i] * qv[i];
            sk += kv[i] * kv[i];
        }
        const float rq = rsqrtf(warp_sum(sq) + 1e-6f) * rsqrtf((float)DK), rk = rsqrtf(warp_sum(sk) + 1e-6f);
#pragma unroll
        for (int i = 0; i < DK / 32; ++i) {
            qt[(32 * i + lane) * LT + r] = qv[i] * rq;
            kt[(32 * i + lane) * LT + r] = kv[i] * rk;
        }
        if (lane == 0) {
            float b = 0.0f, g = 0.0f;
            if (in) {
                const float2 gates = delta_gates(ba[(long)(t0 + r) * ld_ba + h], ba[(long)(t0 + r) * ld_ba + n_v + h],
                                                 dt_bias[h], ssm_a[h]);
                b = gates.x;
                g = gates.y;
            }
            beta[r] = b;
            gamma[r] = g;
        }
    }
    __syncthreads();
    if (warp == 0) {  // gamma: the running sum of g, two tokens a lane
        const float g0 = gamma[2 * lane], g1 = gamma[2 * lane + 1];
        float sum = g0 + g1;
#pragma unroll
        for (int o = 1; o < 32; o *= 2) {
            const float y = __shfl_up_sync(0xFFFFFFFFu, sum, o);
            if (lane >= o) sum += y;
        }
        gamma[2 * lane] = sum - g1;
        gamma[2 * lane + 1] = sum;
    }
    __syncthreads();
    {  // A and P: thread (ti, tj) a 4 x 4 tile of tokens (4 ti + x, 4 tj + y); tiles above the diagonal are zero
        const int ti = tid / 16, tj = tid % 16;
        float kk[4][4] = {}, qk[4][4] = {};
        if (tj <= ti) {
            for (int d = 0; d < DK; ++d) {
                const float4 ki = *reinterpret_cast<const float4*>(kt + d * LT + 4 * ti);
                const float4 qi = *reinterpret_cast<const float4*>(qt + d * LT + 4 * ti);
                const float4 kj = *reinterpret_cast<const float4*>(kt + d * LT + 4 * tj);
                const float kis[4] = {ki.x, ki.y, ki.z, ki.w}, qis[4] = {qi.x, qi.y, qi.z, qi.w};
                const float kjs[4] = {kj.x, kj.y, kj.z, kj.w};
#pragma unroll
                for (int x = 0; x < 4; ++x)
#pragma unroll
                    for (int y = 0; y < 4; ++y) {
                        kk[x][y] += kis[x] * kjs[y];
                        qk[x][y] += qis[x] * kjs[y];
                    }
            }
        }
#pragma unroll
        for (int x = 0; x < 4; ++x) {
            const int i = 4 * ti + x;
            u32 row[2];
#pragma unroll
            for (int y = 0; y < 4; ++y) {
                const int j = 4 * tj + y;
                const float decay = j <= i ? expf(gamma[i] - gamma[j]) : 0.0f;
                a[i * LA + j] = j < i ? beta[i] * kk[x][y] * decay : 0.0f;
                qk[x][y] *= decay;
            }
            row[0] = half2_bits(qk[x][0], qk[x][1]);
            row[1] = half2_bits(qk[x][2], qk[x][3]);
            *reinterpret_cast<uint2*>(p + (ch * DC + i) * DC + 4 * tj) = make_uint2(row[0], row[1]);
        }
    }
    __syncthreads();
    // [U W] = (I + A)^-1 [beta V, beta K e^gamma] by forward substitution, a column a thread.
    for (int col = tid; col < dv + DK; col += DELTA_PREP_THREADS) {
        const bool value = col < dv;
        const float* vcol = qkv + 2L * n_k * DK + (long)h * dv + col;
        float x[DC];
#pragma unroll
        for (int i = 0; i < DC; ++i) {
            float r;
            if (value)
                r = t0 + i < n ? beta[i] * vcol[(long)(t0 + i) * ld_qkv] : 0.0f;
            else
                r = beta[i] * kt[(col - dv) * LT + i] * expf(gamma[i]);
#pragma unroll
            for (int j = 0; j < i; ++j) r -= a[i * LA + j] * x[j];
            x[i] = r;
        }
        if (value) {
#pragma unroll
            for (int i = 0; i < DC; ++i) u[(ch * DC + i) * dv + col] = x[i];
        } else {
#pragma unroll
            for (int i = 0; i < DC; ++i) wqk[(ch * 3 * DC + i) * DK + col - dv] = f2h(-x[i]);
        }
    }
    for (int e = tid; e < DC * DK; e += DELTA_PREP_THREADS) {
        const int i = e / DK, d = e % DK;
        wqk[(ch * 3 + 1) * DC * DK + e] = f2h(qt[d * LT + i] * expf(gamma[i]));
        wqk[(ch * 3 + 2) * DC * DK + e] = f2h(kt[d * LT + i] * expf(gamma[DC - 1] - gamma[i]));
    }
    if (tid == 0) last[ch] = expf(gamma[DC - 1]);
}

// delta_chunk_state's shared memory (fp16; cuda.py sizes it): -W, Q e^gamma and K e^(gamma_last - gamma)
// ([DC][DK + 8] each), P ([DC][DC + 8]), V' ([DC][DCOLS + 8]) and S ([DK][DCOLS + 8]); the padding puts ldmatrix's
// eight rows in distinct banks.
// Four warps: warp w computes tokens 16 w .. 16 w + 15 of V' and O, and rows 16 (MT w + m) + 0..15 of S.
template <int DK>
__device__ __forceinline__ void delta_chunk_state(const float* __restrict__ u, const u16* __restrict__ wqk,
                                                  const u16* __restrict__ p, const float* __restrict__ last,
                                                  float* __restrict__ state, float* __restrict__ out, long ld_out,
                                                  int n, int n_v, int dv) {
    constexpr int LD = DK + 8, LP = DC + 8, LV = DCOLS + 8, MT = DK / 64, NB = DCOLS / 8;
    extern __shared__ float4 state_smem[];
    u16* ws = reinterpret_cast<u16*>(state_smem);
    u16* ps = ws + 3 * DC * LD;
    u16* vs = ps + DC * LP;
    u16* ss = vs + DC * LV;
    const u16* qs = ws + DC * LD;
    const u16* ks = qs + DC * LD;
    const int h = blockIdx.x, col0 = blockIdx.y * DCOLS, tid = threadIdx.x;
    const int warp = tid / 32, lane = tid & 31, g = lane / 4, t = lane % 4, r0 = 16 * warp;
    float* st = state + (long)h * DK * dv + col0;
    // This thread's rows of S in its accumulator fragments: m of this warp's MT row tiles, hh the upper or lower 8.
    const auto srow = [&](int m, int hh) { return 16 * (MT * warp + m) + g + 8 * hh; };
    float s[MT][NB][4];
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int nb = 0; nb < NB; ++nb)
#pragma unroll
            for (int e = 0; e < 4; ++e)
                s[m][nb][e] = st[(long)srow(m, e / 2) * dv + 8 * nb + 2 * t + (e & 1)];
    for (int c = 0; c * DC < n; ++c) {
        const long ch = (long)c * n_v + h;
        for (int e = tid; e < 3 * DC * DK / 8; e += 128)
            copy16(ws + (e / (DK / 8)) * LD + 8 * (e % (DK / 8)), wqk + ch * 3 * DC * DK + 8L * e, true);
        for (int e = tid; e < DC * DC / 8; e += 128)
            copy16(ps + (e / (DC / 8)) * LP + 8 * (e % (DC / 8)), p + ch * DC * DC + 8L * e, true);
        copies_commit();
#pragma unroll
        for (int m = 0; m < MT; ++m)
#pragma unroll
            for (int nb = 0; nb < NB; ++nb)
#pragma unroll
                for (int hh = 0; hh < 2; ++hh)
                    *reinterpret_cast<u32*>(ss + srow(m, hh) * LV + 8 * nb + 2 * t) =
                        half2_bits(s[m][nb][2 * hh], s[m][nb][2 * hh + 1]);
        float v[NB][4], o[NB][4];
#pragma unroll
        for (int nb = 0; nb < NB; ++nb)
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
                const float2 x = *reinterpret_cast<const float2*>(u + (ch * DC + r0 + g + 8 * hh) * dv + col0 +
                                                                  8 * nb + 2 * t);
                v[nb][2 * hh] = x.x;
                v[nb][2 * hh + 1] = x.y;
                o[nb][2 * hh] = o[nb][2 * hh + 1] = 0.0f;
            }
        copies_wait<0>();
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < DK / 16; ++kk) {  // V' = U + (-W) S and O = (Q e^gamma) S, each B fragment of S read once
            u32 aw[4], aq[4];
            ldsm_a(aw, ws, LD, r0, kk);
            ldsm_a(aq, qs, LD, r0, kk);
#pragma unroll
            for (int nb = 0; nb < NB; nb += 2) {
                u32 b[4];
                ldsm_b_pair(b, ss, LV, kk, nb);
                mma_f16(v[nb], aw, b[0], b[1]);
                mma_f16(v[nb + 1], aw, b[2], b[3]);
                mma_f16(o[nb], aq, b[0], b[1]);
                mma_f16(o[nb + 1], aq, b[2], b[3]);
            }
        }
#pragma unroll
        for (int nb = 0; nb < NB; ++nb)
#pragma unroll
            for (int hh = 0; hh < 2; ++hh)
                *reinterpret_cast<u32*>(vs + (r0 + g + 8 * hh) * LV + 8 * nb + 2 * t) =
                    half2_bits(v[nb][2 * hh], v[nb][2 * hh + 1]);
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < DC / 16; ++kk) {  // O += P V'
            u32 ap[4];
            ldsm_a(ap, ps, LP, r0, kk);
            mma_b_row(o, ap, vs, LV, kk);
        }
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const int token = c * DC + r0 + g + 8 * hh;
            if (token < n) {
#pragma unroll
                for (int nb = 0; nb < NB; ++nb)
                    *reinterpret_cast<float2*>(out + token * ld_out + (long)h * dv + col0 + 8 * nb + 2 * t) =
                        make_float2(o[nb][2 * hh], o[nb][2 * hh + 1]);
            }
        }
        const float decay = last[ch];
#pragma unroll
        for (int m = 0; m < MT; ++m) {  // S = e^gamma_last S + (K e^(gamma_last - gamma))^T V'
#pragma unroll
            for (int nb = 0; nb < NB; ++nb)
#pragma unroll
                for (int e = 0; e < 4; ++e) s[m][nb][e] *= decay;
#pragma unroll
            for (int kk = 0; kk < DC / 16; ++kk) {
                u32 ak[4];  // the A fragment of K^T: ldmatrix transposes the token-major rows
                ldsm_x4_trans(ak, ks + (16 * kk + (lane >> 4) * 8 + (lane & 7)) * LD + 16 * (MT * warp + m) +
                                      ((lane >> 3) & 1) * 8);
                mma_b_row(s[m], ak, vs, LV, kk);
            }
        }
        __syncthreads();  // every warp is done with this chunk's shared memory
    }
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int nb = 0; nb < NB; ++nb)
#pragma unroll
            for (int e = 0; e < 4; ++e)
                st[(long)srow(m, e / 2) * dv + 8 * nb + 2 * t + (e & 1)] = s[m][nb][e];
}

#define DELTA_CHUNKED(DK)                                                                                           \
    extern "C" __global__ void __launch_bounds__(DELTA_PREP_THREADS) delta_chunk_prep_##DK(                         \
        const float* qkv, long ld_qkv, const float* ba, long ld_ba, const float* dt_bias, const float* ssm_a, int n, \
        int n_k, int n_v, int dv, int tiled, float* u, u16* wqk, u16* p, float* last) {                             \
        grid_dependency_sync();                                                                                     \
        delta_chunk_prep<DK>(qkv, ld_qkv, ba, ld_ba, dt_bias, ssm_a, n, n_k, n_v, dv, tiled, u, wqk, p, last);      \
    }                                                                                                               \
    extern "C" __global__ void __launch_bounds__(128) delta_chunk_state_##DK(                                       \
        const float* u, const u16* wqk, const u16* p, const float* last, float* state, float* out, long ld_out,     \
        int n, int n_v, int dv) {                                                                                   \
        grid_dependency_sync();                                                                                     \
        delta_chunk_state<DK>(u, wqk, p, last, state, out, ld_out, n, n_v, dv);                                     \
    }
DELTA_CHUNKED(64)
DELTA_CHUNKED(128)

// out = x * sigmoid(gate) (or out += that): x, out (n, m) and gate (n, m) or (n, 1), each with its row stride.
extern "C" __global__ void sigmoid_gate(const float* x, long ldx, const float* __restrict__ gate, long ldg,
                                        int gate_cols, float* out, long ldo, int n, int m, int accumulate) {
    grid_dependency_sync();
    const long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long)n * m) return;
    const long t = i / m, c = i % m;
    const float g = gate[t * ldg + (gate_cols == 1 ? 0 : c)];
    const float y = x[t * ldx + c] / (1.0f + expf(-g));
    out[t * ldo + c] = accumulate ? out[t * ldo + c] + y : y;
}
