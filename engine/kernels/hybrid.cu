// The hybrid Qwen families' own ops (engine/backend.py has each one's contract): the causal depthwise convolution
// with SiLU, the gated delta rule, and the sigmoid output gates of their attention and shared expert. A chunk
// of any length runs in one launch, so decode stays one graph and a prompt is not a launch per token.

// One thread per channel, the last K - 1 inputs in registers: out[t, c] = silu(sum_j w[c, j] window[t + j, c])
// over the window [state; x]; the state keeps the last K - 1 rows. x and out may be column views (row strides).
template <int K>
__device__ __forceinline__ void conv_silu(const float* __restrict__ x, long ldx, const float* __restrict__ w,
                                          float* __restrict__ state, float* __restrict__ out, long ldo, int n,
                                          int channels) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= channels) return;
    float wk[K], win[K - 1];
#pragma unroll
    for (int j = 0; j < K; ++j) wk[j] = w[(long)c * K + j];
#pragma unroll
    for (int j = 0; j < K - 1; ++j) win[j] = state[(long)j * channels + c];
    for (int t = 0; t < n; ++t) {
        const float xt = x[t * ldx + c];
        float acc = xt * wk[K - 1];
#pragma unroll
        for (int j = 0; j < K - 1; ++j) acc += win[j] * wk[j];
        out[t * ldo + c] = act_silu(acc);
#pragma unroll
        for (int j = 0; j < K - 2; ++j) win[j] = win[j + 1];
        win[K - 2] = xt;
    }
#pragma unroll
    for (int j = 0; j < K - 1; ++j) state[(long)j * channels + c] = win[j];
}

extern "C" __global__ void causal_conv_silu_4(const float* x, long ldx, const float* w, float* state, float* out,
                                              long ldo, int n, int channels) {
    grid_dependency_sync();
    conv_silu<4>(x, ldx, w, state, out, ldo, n, channels);
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
        const float beta = 1.0f / (1.0f + expf(-ba[t * ld_ba + h]));
        const float x = ba[t * ld_ba + n_v + h] + bias;
        const float decay = expf(a_scale * (x > 20.0f ? x : log1pf(expf(x))));
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
