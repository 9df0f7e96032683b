// Sinkhorn-Knopp projection (OPS.md section 1) and the per-token coefficient
// activations of the mHC pre op (section 7), all tokens in one launch.
//
// Forward and unrolled backward: a group of G lanes per matrix (G a power of
// two chosen by the host: 1 for small N, up to 32), lane l holding rows
// l, l + G, l + 2G, ... in registers; row sums are local, column sums are a
// local sum then a butterfly over the G lanes.  Implicit backward: one thread
// per matrix (it needs the whole matrix for the n x n solve), or for n > 8 one
// warp per matrix with the matrices in shared memory.
//
// Forward per matrix L:  K = exp(L - rowmax(L));  num_iters times
//   row step    P_ij <- P_ij * (1 / (sum_k P_ik + eps))
//   column step P_ij <- P_ij * (1 / (sum_k P_kj + eps))
// (a fast reciprocal, within 2 ulp, then a multiply: a few roundings from the division).
// DS (convention="deepseek", OPS.md "DeepSeek-V4 convention"): the first row step is the
// softmax plus eps, P_ij <- K_ij * (1 / sum_k K_ik) + eps (no eps in the sum, which is >= 1).
//
// Unrolled backward: the exact vector-Jacobian product of that forward.  The
// forward is recomputed, keeping only the step denominators d (each lane those
// of its rows and of its columns j with j % G == l, in shared memory when they
// fit, else in a global scratch buffer); the
// reverse sweep rebuilds each step's input from its output as p = y * d.
// For y = p / d with d_i = sum_k p_ik + eps:  dp_ij = (gy_ij - sum_k gy_ik y_ik) / d_i.
// DS: the softmax start y = q + eps, q = K / d (d = sum_k K_ik) is the same with q for y:
// from u = g * y (see the reverse sweep) g = u / y (y >= eps > 0; g = 0 where y = 0, so
// eps = 0), w = g * q = u - eps g, and u_K = w - (sum_k w_ik) q.
// The row-max shift is part of the function: dL_ij = gK_ij K_ij - [j = argmax_i] sum_k gK_ik K_ik,
// so every row of dL sums to 0 (P does not change when a row of L is shifted).
//
// Implicit backward: the gradient of the converged projection,
//   dL = P * (G - a 1^T - 1 b^T),  diag(P1) a + P b = rowsum(P*G),  P^T a + diag(P^T 1) b = colsum(P*G),
// solved by the Schur complement (S + 1 1^T) b = rhs with S = diag(P^T 1) - P^T diag(1/P1) P
// (symmetric positive semi-definite, null vector 1) by Cholesky, then a = (r - P b) / P1.
#include "common.cuh"
// (the small-token tail below: the coefficient path's sums of squares)
#include "coeffs.cuh"

using mhc::i64;

// Full unrolling keeps the matrices in registers for small N; for large N it
// would only multiply code size (the arrays live in local memory anyway).
#define MHC_PRAGMA(x) _Pragma(#x)
#define MHC_UNROLL_N MHC_PRAGMA(unroll(N <= 8 ? N * N : 1))

namespace {

template <int N>
__device__ __forceinline__ void load_exp(const float* __restrict__ L, float (&P)[N * N], int (&amax)[N]) {
MHC_UNROLL_N
    for (int i = 0; i < N; ++i) {
        float m = L[i * N];
        int a = 0;
MHC_UNROLL_N
        for (int j = 1; j < N; ++j) {
            const float v = L[i * N + j];
            if (v > m) { m = v; a = j; }
        }
        amax[i] = a;
MHC_UNROLL_N
        for (int j = 0; j < N; ++j) P[i * N + j] = expf(L[i * N + j] - m);
    }
}

// num_iters row + column steps in place (one thread holds the whole matrix); DS: the
// first row step is the softmax plus eps.
template <int N, bool DS>
__device__ __forceinline__ void sinkhorn_iterate(float (&P)[N * N], int iters, float eps) {
    for (int it = 0; it < iters; ++it) {
        const bool softmax = DS && it == 0;
MHC_UNROLL_N
        for (int i = 0; i < N; ++i) {
            float s = 0.f;
MHC_UNROLL_N
            for (int j = 0; j < N; ++j) s += P[i * N + j];
            const float d = softmax ? s : s + eps;
            const float inv = 1.f / d;
            const float add = softmax ? eps : 0.f;
MHC_UNROLL_N
            for (int j = 0; j < N; ++j) P[i * N + j] = softmax ? fmaf(P[i * N + j], inv, add) : P[i * N + j] * inv;
        }
MHC_UNROLL_N
        for (int j = 0; j < N; ++j) {
            float s = 0.f;
MHC_UNROLL_N
            for (int i = 0; i < N; ++i) s += P[i * N + j];
            const float d = s + eps;
            const float inv = 1.f / d;
MHC_UNROLL_N
            for (int i = 0; i < N; ++i) P[i * N + j] *= inv;
        }
    }
}

}  // namespace

namespace {

// Sum over the G lanes of this lane's group (fixed butterfly order).
template <int G>
__device__ __forceinline__ float group_sum(float v, unsigned mask) {
#pragma unroll
    for (int off = G / 2; off > 0; off >>= 1) v += __shfl_xor_sync(mask, v, off, G);
    return v;
}

__device__ __forceinline__ float fast_rcp(float d) { return __fdividef(1.f, d); }

// 1 / d for a normal d (>= FLT_MIN): one MUFU.RCP, the bits of fast_rcp there (which first scales
// a subnormal d).
__device__ __forceinline__ float rcp_normal(float d) {
    float r;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(d));
    return r;
}

// The pre op's dh_post_raw_k = gH_post_k * H_post_k * (1 - s_k), s = sigmoid(h_post_raw),
// H_post = post_mult * s (g_post null = zero).  Paper (post_mult = 2): 1 - s = 1 - H_post / 2
// exactly, the bits the formula gH_post H_post (1 - H_post / 2) gives.
__device__ __forceinline__ float post_raw_grad(const float* __restrict__ g_post, const float* __restrict__ h_post_raw,
                                               i64 k, float post_mult) {
    const float s = mhc::sigmoid(h_post_raw[k]);
    const float gp = g_post ? g_post[k] : 0.f;
    return gp * (post_mult * s) * (1.f - s);
}

// Rows per lane R and history slots per lane and iteration: the R row
// denominators of its rows and R column denominators, those of columns j with
// j % G == lane (fetched by a shuffle in the reverse sweep).  Recording every
// column in every lane would need (R + N) slots: at n = 4, G = 2 that is 1.5x
// the shared memory, which cut the H200 to 7 resident blocks per SM and a
// second wave at 32768 tokens.
template <int N, int G> struct Layout {
    static constexpr int R = (N + G - 1) / G;
    static constexpr int SLOTS = 2 * R;
};

// Row-max-shifted exponential of this lane's rows (zeros for rows >= N).
template <int N, int G>
__device__ __forceinline__ void lane_exp(const float* __restrict__ L, int lane, float (&K)[Layout<N, G>::R][N],
                                         int (&amax)[Layout<N, G>::R]) {
#pragma unroll
    for (int r = 0; r < Layout<N, G>::R; ++r) {
        const int i = lane + r * G;
        amax[r] = 0;
        if (i < N) {
            const float* Li = L + i * N;
            float m = Li[0];
#pragma unroll
            for (int j = 1; j < N; ++j)
                if (Li[j] > m) { m = Li[j]; amax[r] = j; }
#pragma unroll
            for (int j = 0; j < N; ++j) K[r][j] = expf(Li[j] - m);
        } else {
#pragma unroll
            for (int j = 0; j < N; ++j) K[r][j] = 0.f;
        }
    }
}

// One row step and one column step on this lane's rows.  The row step is
// p <- p * (1 / (sum + row_eps)) + row_add: (row_eps, row_add) = (eps, 0) the Sinkhorn
// step, (0, eps) the DeepSeek softmax start (one FMA per element either way: fmaf(p,
// inv, 0) is p * inv for p, inv >= 0).  With hist non-null the denominators are recorded
// (row r at slot r; column j at slot R + j / G by lane j % G, see Layout; rows >= N record 1).
template <int N, int G>
__device__ __forceinline__ void lane_iteration(float (&p)[Layout<N, G>::R][N], int lane, float eps, unsigned mask,
                                               float* hist, i64 hs, float row_eps, float row_add) {
    constexpr int R = Layout<N, G>::R;
#pragma unroll
    for (int r = 0; r < R; ++r) {
        float d = 1.f;
        if (lane + r * G < N) {
            float s = 0.f;
#pragma unroll
            for (int j = 0; j < N; ++j) s += p[r][j];
            d = s + row_eps;
            const float inv = fast_rcp(d);
#pragma unroll
            for (int j = 0; j < N; ++j) p[r][j] = fmaf(p[r][j], inv, row_add);
        }
        if (hist) hist[r * hs] = d;
    }
#pragma unroll
    for (int j = 0; j < N; ++j) {
        float c = 0.f;
#pragma unroll
        for (int r = 0; r < R; ++r) c += p[r][j];
        const float d = group_sum<G>(c, mask) + eps;
        if (hist && j % G == lane) hist[(R + j / G) * hs] = d;
        const float inv = fast_rcp(d);
#pragma unroll
        for (int r = 0; r < R; ++r) p[r][j] *= inv;
    }
}

// The forward on this lane's rows: the row-max-shifted exponential of L, then iters row + column
// steps (DS: the first row step is the softmax plus eps).
template <int N, int G, bool DS>
__device__ __forceinline__ void lane_sinkhorn(const float* __restrict__ L, int lane, unsigned mask, int iters,
                                              float eps, float (&p)[Layout<N, G>::R][N]) {
    int amax[Layout<N, G>::R];
    lane_exp<N, G>(L, lane, p, amax);
    int it = 0;
    if (DS && iters > 0) {
        lane_iteration<N, G>(p, lane, eps, mask, nullptr, 0, 0.f, eps);
        it = 1;
    }
    for (; it < iters; ++it) lane_iteration<N, G>(p, lane, eps, mask, nullptr, 0, eps, 0.f);
}

}  // namespace

// P = sinkhorn(logits) for every token; when h_pre_raw is non-null also the
// pre-op activations H_pre = sigmoid(h_pre_raw) + hc_eps, H_post = post_mult sigmoid(h_post_raw)
// (paper: hc_eps = 0, post_mult = 2).  DS: the DeepSeek softmax start (iters >= 1).
// blockDim.x is a multiple of G.
template <int N, int G, bool DS>
__global__ void mhc_sinkhorn_knopp_fwd_kernel(const float* __restrict__ logits, float* __restrict__ P_out,
                                              const float* __restrict__ h_pre_raw,
                                              const float* __restrict__ h_post_raw,
                                              float* __restrict__ H_pre, float* __restrict__ H_post,
                                              i64 tokens, int iters, float eps, float hc_eps, float post_mult) {
    constexpr int R = Layout<N, G>::R;
    const i64 t = (blockIdx.x * (i64)blockDim.x + threadIdx.x) / G;
    const int lane = threadIdx.x % G;
    const unsigned mask = __ballot_sync(0xffffffffu, t < tokens);
    if (t >= tokens) return;
    float p[R][N];
    lane_sinkhorn<N, G, DS>(logits + t * (N * N), lane, mask, iters, eps, p);
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const int i = lane + r * G;
        if (i < N) {
            float* out = P_out + (t * N + i) * N;
#pragma unroll
            for (int j = 0; j < N; ++j) out[j] = p[r][j];
            if (h_pre_raw != nullptr) {
                H_pre[t * N + i] = mhc::sigmoid(h_pre_raw[t * N + i]) + hc_eps;
                H_post[t * N + i] = post_mult * mhc::sigmoid(h_post_raw[t * N + i]);
            }
        }
    }
}

// The layer's pre piece after the coefficient GEMM for a few tokens, in one launch (OPS.md section 9;
// the small-token forward, mhc_cupy.ops.layer): per token (one block, grid-stride over tokens), from
// the GEMM's per-range sums part [splits, T, K+1]:
//   stats and the raw coefficients h (mhc_coeffs_fwd_finish_kernel's sums in its order and formula),
//   Sinkhorn of h_res and the activations H_pre, H_post on the first G lanes
//   (mhc_sinkhorn_knopp_fwd_kernel's lanes and steps),
//   layer_in = sum_i H_pre_i x_i (mhc_stream_aggregate_fwd_kernel's order, E columns a thread access as
//   there: C % E == 0 and x, layer_in aligned to E elements, up to 16 bytes):
// the bits of those three kernels.  blockDim.x a multiple of 32; G as the forward's (fwd_group).
// gridDim.y > 1: a token's columns split over that many blocks (mhc::first_col), each computing the
// token's coefficients (the same), the first of them writing them.  The ranges' sums come through
// shared memory (mhc_coeffs::staged_split_sums: the finish kernel's additions in its order), every
// thread loading: blockDim.x = TAIL_THREADS.
namespace mhc_tail {
constexpr int TAIL_THREADS = 256;
// 32 KiB of the ranges' sums: 327 ranges at n = 4 (the GEMV's 256 at one token in one stage), 7 at n = 32
constexpr int TAIL_STAGE_FLOATS = 8192;
}  // namespace mhc_tail
template <typename T, int N, int G, bool DS, int E>
__global__ void __launch_bounds__(mhc_tail::TAIL_THREADS)
mhc_layer_pre_tail_kernel(const float* __restrict__ part, const float* __restrict__ alpha,
                          const float* __restrict__ bias, const T* __restrict__ x, float* __restrict__ stats,
                          float* __restrict__ H_pre, float* __restrict__ H_post, float* __restrict__ H_res,
                          T* __restrict__ layer_in, i64 tokens, int C, int splits, float rms_eps, int iters,
                          float eps, float hc_eps, float post_mult) {
    constexpr int K = N * N + 2 * N;
    constexpr int R = Layout<N, G>::R;
    constexpr int KPT = (K + mhc_tail::TAIL_THREADS - 1) / mhc_tail::TAIL_THREADS;  // columns a thread
    __shared__ float s_h[K];   // the token's raw coefficients: pre | post | res
    __shared__ float s_pre[N];  // its H_pre
    __shared__ float s_stage[mhc_tail::TAIL_STAGE_FLOATS];  // the ranges' sums (staged_split_sums)
    const int D = N * C;
    for (i64 t = blockIdx.x; t < tokens; t += gridDim.x) {
        const bool writes = blockIdx.y == 0;  // (the blocks of a token's other columns compute the same)
        float H[KPT];
        mhc_coeffs::SumSq q;
        // (its first barrier: the previous token's s_h, s_pre are read)
        mhc_coeffs::staged_split_sums<KPT>(part, tokens, t, K, splits, s_stage, mhc_tail::TAIL_STAGE_FLOATS, H, q);
#pragma unroll
        for (int j = 0; j < KPT; ++j) {
            const int k = threadIdx.x + j * blockDim.x;
            if (k >= K) continue;
            if (writes) {
                stats[t * (K + 1) + k] = H[j];
                if (k == 0) stats[t * (K + 1) + K] = q.saved();
            }
            s_h[k] = fmaf(alpha[mhc_coeffs::group_of(k, N)] * H[j], q.rinv(D, rms_eps), bias[k]);
        }
        __syncthreads();
        if (threadIdx.x < G) {
            const int lane = threadIdx.x;
            const unsigned mask = G == 32 ? 0xffffffffu : (1u << G) - 1u;
            float p[R][N];
            lane_sinkhorn<N, G, DS>(s_h + 2 * N, lane, mask, iters, eps, p);
#pragma unroll
            for (int r = 0; r < R; ++r) {
                const int i = lane + r * G;
                if (i < N) {
                    const float hp = mhc::sigmoid(s_h[i]) + hc_eps;
                    s_pre[i] = hp;
                    if (writes) {
                        float* out = H_res + (t * N + i) * N;
#pragma unroll
                        for (int j = 0; j < N; ++j) out[j] = p[r][j];
                        H_pre[t * N + i] = hp;
                        H_post[t * N + i] = post_mult * mhc::sigmoid(s_h[N + i]);
                    }
                }
            }
        }
        __syncthreads();
        const T* xt = x + t * N * (i64)C;
        for (unsigned c = mhc::first_col(E); c < (unsigned)C; c += mhc::col_step(E)) {
            float o[E];
            mhc::aggregate_cols<T, N, E>(xt, s_pre, C, c, o);
            mhc::store_vec<T, E>(layer_in + t * (i64)C + c, o);
        }
    }
}

// d_logits from grad_P (null = zero), unrolled mode, same layout as the
// forward.  History: SLOTS floats per lane and iteration at
// hist[(it * SLOTS + slot) * hs], in dynamic shared memory (hs = blockDim.x)
// when use_smem, else in hist_global (hs = gridDim.x * blockDim.x).  With
// h_post_raw non-null also the pre op's dh_post_raw = gH_post * H_post (1 - sigmoid)
// with H_post = post_mult * sigmoid(h_post_raw) (g_post null = zero).  DS: the
// DeepSeek softmax start (iters >= 1).
template <int N, int G, bool DS>
__global__ void mhc_sinkhorn_knopp_bwd_kernel(const float* __restrict__ grad_P,
                                              const float* __restrict__ logits, float* __restrict__ d_logits,
                                              float* __restrict__ hist_global, int use_smem,
                                              const float* __restrict__ g_post,
                                              const float* __restrict__ h_post_raw,
                                              float* __restrict__ d_post_raw, i64 tokens, int iters,
                                              float eps, float post_mult) {
    constexpr int R = Layout<N, G>::R;
    constexpr int SLOTS = Layout<N, G>::SLOTS;
    extern __shared__ float hist_smem[];
    const i64 gid = blockIdx.x * (i64)blockDim.x + threadIdx.x;
    const i64 t = gid / G;
    const int lane = threadIdx.x % G;
    const unsigned mask = __ballot_sync(0xffffffffu, t < tokens);
    if (t >= tokens) return;
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const int i = lane + r * G;
        if (i < N && h_post_raw != nullptr)
            d_post_raw[t * N + i] = post_raw_grad(g_post, h_post_raw, t * N + i, post_mult);
    }
    float* dL = d_logits + t * (N * N);
    if (grad_P == nullptr) {
#pragma unroll
        for (int r = 0; r < R; ++r)
            if (lane + r * G < N)
#pragma unroll
                for (int j = 0; j < N; ++j) dL[(lane + r * G) * N + j] = 0.f;
        return;
    }
    float p[R][N], u[R][N];
    int amax[R];
    lane_exp<N, G>(logits + t * (N * N), lane, p, amax);
    float* hist = use_smem ? hist_smem + threadIdx.x : hist_global + gid;
    const i64 hs = use_smem ? (i64)blockDim.x : (i64)gridDim.x * blockDim.x;
    // DS: the softmax start is iteration 0's row step, (row_eps, row_add) = (0, eps) in the first
    // pass of the loop (the compiler may peel it), and peeled off the reverse loop.  (H200, 16384
    // tokens, interleaved micro-benchmark against the paper convention: +10% / +4% at n = 4 / 8
    // with a `DS && it == 0` flag inside the loop and fast_rcp in the softmax start's backward,
    // -0.2% / +0.5% with these loop-carried values and rcp_normal; the same bits.)
    const int it0 = DS ? 1 : 0;
    float row_eps = DS ? 0.f : eps, row_add = DS ? eps : 0.f;
    for (int it = 0; it < iters; ++it) {
        lane_iteration<N, G>(p, lane, eps, mask, hist + (i64)it * SLOTS * hs, hs, row_eps, row_add);
        row_eps = eps;
        row_add = 0.f;
    }
    // Reverse sweep on u = g * y (g: gradient of a step's output y).  For
    // y = p / d (d = row or column sum + eps):  dp = (g - s) / d with
    // s = sum(g * y) = sum(u), and p = y * d, so the input's u is
    // (g - s) * y = u - s * y: no division, and u of the first step's input
    // (the exponential K) is already g_K * K.
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const int i = lane + r * G;
#pragma unroll
        for (int j = 0; j < N; ++j) u[r][j] = i < N ? grad_P[(t * N + i) * N + j] * p[r][j] : 0.f;
    }
    auto column_step = [&](const float* h) {  // reverse of a column step (denominators in h)
#pragma unroll
        for (int j = 0; j < N; ++j) {
            // column j's denominator is in slot R + j / G of lane j % G; a lane whose
            // column lane + (j / G) * G is past N never wrote that slot: it sends 0
            float d;
            if (G == 1) {
                d = h[(R + j) * hs];
            } else {
                const float mine = lane + (j / G) * G < N ? h[(R + j / G) * hs] : 0.f;
                d = __shfl_sync(mask, mine, j % G, G);
            }
            float s = 0.f;
#pragma unroll
            for (int r = 0; r < R; ++r) s += u[r][j];
            s = group_sum<G>(s, mask);
#pragma unroll
            for (int r = 0; r < R; ++r) {
                u[r][j] = fmaf(-s, p[r][j], u[r][j]);
                p[r][j] *= d;
            }
        }
    };
    for (int it = iters - 1; it >= it0; --it) {
        const float* h = hist + (i64)it * SLOTS * hs;
        column_step(h);
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const float d = h[r * hs];
            float s = 0.f;
#pragma unroll
            for (int j = 0; j < N; ++j) s += u[r][j];
#pragma unroll
            for (int j = 0; j < N; ++j) {
                u[r][j] = fmaf(-s, p[r][j], u[r][j]);
                p[r][j] *= d;
            }
        }
    }
    if (DS) {
        column_step(hist);
        // the softmax start: p is y = q + eps, u = g * y (see the file comment); w = u - eps g
        // = u (1 - eps / y).  eps / y enters scaled by eps, so the fast reciprocal (2 ulp) is far
        // below float32 rounding.  y >= eps (max(p, eps): the rebuilt p may round just below); a
        // subnormal eps and y are scaled by 2^64 first (the reciprocal of a subnormal overflows),
        // and eps = 0 leaves w = u (the floor FLT_MIN keeps 0 * (1 / 0) out).
        const float S = eps < 1e-30f ? 0x1p64f : 1.f, eps_s = eps * S;
        const float floor_s = (eps > 0.f ? eps : 1.17549435e-38f) * S;
#pragma unroll
        for (int r = 0; r < R; ++r) {
            float s = 0.f;
#pragma unroll
            for (int j = 0; j < N; ++j) {
                u[r][j] *= 1.f - eps_s * rcp_normal(fmaxf(p[r][j] * S, floor_s));
                s += u[r][j];
            }
#pragma unroll
            for (int j = 0; j < N; ++j) u[r][j] = fmaf(-s, p[r][j] - eps, u[r][j]);
        }
    }
    // through the row-max-shifted exponential (the shift is part of the function)
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const int i = lane + r * G;
        if (i < N) {
            float s = 0.f;
#pragma unroll
            for (int j = 0; j < N; ++j) s += u[r][j];
#pragma unroll
            for (int j = 0; j < N; ++j) dL[i * N + j] = (j == amax[r]) ? u[r][j] - s : u[r][j];
        }
    }
}

// Implicit-mode backward, one thread per matrix (see the file comment); DS: P of
// the DeepSeek forward.
template <int N, bool DS>
__global__ void mhc_sinkhorn_knopp_implicit_bwd_kernel(const float* __restrict__ grad_P,
                                                       const float* __restrict__ logits,
                                                       float* __restrict__ d_logits,
                                                       const float* __restrict__ g_post,
                                                       const float* __restrict__ h_post_raw,
                                                       float* __restrict__ d_post_raw, i64 tokens,
                                                       int iters, float eps, float post_mult) {
    const i64 t = blockIdx.x * (i64)blockDim.x + threadIdx.x;
    if (t >= tokens) return;
    if (h_post_raw != nullptr) {
MHC_UNROLL_N
        for (int i = 0; i < N; ++i) d_post_raw[t * N + i] = post_raw_grad(g_post, h_post_raw, t * N + i, post_mult);
    }
    float* dL = d_logits + t * (N * N);
    if (grad_P == nullptr) {
MHC_UNROLL_N
        for (int k = 0; k < N * N; ++k) dL[k] = 0.f;
        return;
    }
    float P[N * N], G[N * N];
    int amax[N];
    load_exp<N>(logits + t * (N * N), P, amax);
MHC_UNROLL_N
    for (int k = 0; k < N * N; ++k) G[k] = grad_P[t * (N * N) + k];
    sinkhorn_iterate<N, DS>(P, iters, eps);
    float rs[N], cs[N], r[N], c[N];
MHC_UNROLL_N
    for (int i = 0; i < N; ++i) { rs[i] = 0.f; cs[i] = 0.f; r[i] = 0.f; c[i] = 0.f; }
MHC_UNROLL_N
    for (int i = 0; i < N; ++i)
MHC_UNROLL_N
        for (int j = 0; j < N; ++j) {
            const float p = P[i * N + j], pg = p * G[i * N + j];
            rs[i] += p; cs[j] += p; r[i] += pg; c[j] += pg;
        }
    // S + 1 1^T (lower triangle is all Cholesky needs; stored full for clarity) and rhs.
    float S[N * N], b[N];
MHC_UNROLL_N
    for (int j = 0; j < N; ++j) {
        float acc = c[j];
MHC_UNROLL_N
        for (int i = 0; i < N; ++i) acc -= P[i * N + j] * r[i] / rs[i];
        b[j] = acc;
MHC_UNROLL_N
        for (int k = 0; k < N; ++k) {
            float s = (j == k ? cs[j] : 0.f) + 1.f;
MHC_UNROLL_N
            for (int i = 0; i < N; ++i) s -= P[i * N + j] * P[i * N + k] / rs[i];
            S[j * N + k] = s;
        }
    }
    // Cholesky S = L L^T in place (lower), then two triangular solves.  S + 1 1^T
    // is singular when P is (numerically) a permutation: a pivot below 1e-8
    // is treated as zero and its component of b set to 0 (the minimum-norm
    // choice; dL does not depend on it, since those entries of P vanish).
    float pinv[N];
MHC_UNROLL_N
    for (int j = 0; j < N; ++j) {
        float dj = S[j * N + j];
MHC_UNROLL_N
        for (int k = 0; k < j; ++k) dj -= S[j * N + k] * S[j * N + k];
        pinv[j] = dj > 1e-8f ? 1.f / sqrtf(dj) : 0.f;
        S[j * N + j] = dj > 1e-8f ? sqrtf(dj) : 0.f;
MHC_UNROLL_N
        for (int i = j + 1; i < N; ++i) {
            float v = S[i * N + j];
MHC_UNROLL_N
            for (int k = 0; k < j; ++k) v -= S[i * N + k] * S[j * N + k];
            S[i * N + j] = v * pinv[j];
        }
    }
MHC_UNROLL_N
    for (int i = 0; i < N; ++i) {
        float v = b[i];
MHC_UNROLL_N
        for (int k = 0; k < i; ++k) v -= S[i * N + k] * b[k];
        b[i] = v * pinv[i];
    }
MHC_UNROLL_N
    for (int i = N - 1; i >= 0; --i) {
        float v = b[i];
MHC_UNROLL_N
        for (int k = i + 1; k < N; ++k) v -= S[k * N + i] * b[k];
        b[i] = v * pinv[i];
    }
MHC_UNROLL_N
    for (int i = 0; i < N; ++i) {
        float pb = 0.f;
MHC_UNROLL_N
        for (int j = 0; j < N; ++j) pb += P[i * N + j] * b[j];
        const float a = (r[i] - pb) / rs[i];
MHC_UNROLL_N
        for (int j = 0; j < N; ++j) dL[i * N + j] = P[i * N + j] * (G[i * N + j] - a - b[j]);
    }
}

// Implicit-mode backward for larger N (the host uses it for N > 8, where the
// one-thread kernel's three N x N arrays would live in local memory: 12 KB of
// stack per thread at N = 32).  One warp per matrix, IMPLICIT_WARPS matrices
// per block (blockDim.x = 32 * IMPLICIT_WARPS); P and S = L L^T live in shared
// memory, rows padded to N + 1 floats so that walking a row (lane i owns row
// i) and walking a column (lane j owns column j) are both free of bank
// conflicts; lanes >= N only take part in the shuffles.  The arithmetic is
// that of the one-thread kernel, step for step, except the back substitution
// L^T b = y, which subtracts its terms in the opposite order.
namespace {
constexpr int IMPLICIT_WARPS = 4;
}

template <int N, bool DS>
__global__ void __launch_bounds__(32 * IMPLICIT_WARPS)
mhc_sinkhorn_knopp_implicit_bwd_warp_kernel(const float* __restrict__ grad_P, const float* __restrict__ logits,
                                            float* __restrict__ d_logits, const float* __restrict__ g_post,
                                            const float* __restrict__ h_post_raw, float* __restrict__ d_post_raw,
                                            i64 tokens, int iters, float eps, float post_mult) {
    static_assert(N <= 32, "one lane per row");
    constexpr int NP = N + 1;
    constexpr unsigned FULL = 0xffffffffu;
    __shared__ float s_P[IMPLICIT_WARPS][N][NP], s_S[IMPLICIT_WARPS][N][NP];
    __shared__ float s_v[IMPLICIT_WARPS][4][N];  // row sums of P, of P*G; then b, a
    const int warp = threadIdx.x >> 5, l = threadIdx.x & 31;
    const i64 t = blockIdx.x * (i64)IMPLICIT_WARPS + warp;
    if (t >= tokens) return;  // the whole warp (t is warp-uniform)
    const bool own = l < N;
    if (h_post_raw != nullptr && own) d_post_raw[t * N + l] = post_raw_grad(g_post, h_post_raw, t * N + l, post_mult);
    float* dL = d_logits + t * (N * N);
    if (grad_P == nullptr) {
        for (int k = l; k < N * N; k += 32) dL[k] = 0.f;
        return;
    }
    float(*P)[NP] = s_P[warp];
    float(*S)[NP] = s_S[warp];
    float* rs_v = s_v[warp][0];
    float* r_v = s_v[warp][1];
    float* b_v = s_v[warp][2];
    float* a_v = s_v[warp][3];
    const float* Lt = logits + t * (N * N);
    const float* Gt = grad_P + t * (N * N);
    for (int k = l; k < N * N; k += 32) P[k / N][k % N] = Lt[k];  // coalesced
    __syncwarp();
    if (own) {  // K = exp(L - rowmax(L)), row l
        float m = P[l][0];
        for (int j = 1; j < N; ++j)
            if (P[l][j] > m) m = P[l][j];
        for (int j = 0; j < N; ++j) P[l][j] = expf(P[l][j] - m);
    }
    __syncwarp();
    for (int it = 0; it < iters; ++it) {
        if (own) {  // row step, row l (DS: the softmax start first)
            float s = 0.f;
            for (int j = 0; j < N; ++j) s += P[l][j];
            const bool softmax = DS && it == 0;
            const float inv = 1.f / (softmax ? s : s + eps);
            for (int j = 0; j < N; ++j) P[l][j] = softmax ? fmaf(P[l][j], inv, eps) : P[l][j] * inv;
        }
        __syncwarp();
        if (own) {  // column step, column l
            float s = 0.f;
            for (int i = 0; i < N; ++i) s += P[i][l];
            const float inv = 1.f / (s + eps);
            for (int i = 0; i < N; ++i) P[i][l] *= inv;
        }
        __syncwarp();
    }
    // lane l: row sums rs, r of row l (P, P*G) and column sums cs, c of column l
    float cs = 0.f, c = 0.f;
    if (own) {
        float rs = 0.f, r = 0.f;
        for (int j = 0; j < N; ++j) {
            const float p = P[l][j];
            rs += p;
            r += p * Gt[l * N + j];
        }
        for (int i = 0; i < N; ++i) {
            const float p = P[i][l];
            cs += p;
            c += p * Gt[i * N + l];
        }
        rs_v[l] = rs;
        r_v[l] = r;
    }
    __syncwarp();
    // lane j: b_j = c_j - sum_i P_ij r_i / rs_i and row j of S + 1 1^T
    float v = 0.f;
    if (own) {
        float acc = c;
        for (int i = 0; i < N; ++i) acc -= P[i][l] * r_v[i] / rs_v[i];
        v = acc;
        for (int k = 0; k < N; ++k) {
            float s = (l == k ? cs : 0.f) + 1.f;
            for (int i = 0; i < N; ++i) s -= P[i][l] * P[i][k] / rs_v[i];
            S[l][k] = s;
        }
    }
    __syncwarp();
    // Cholesky, column by column (pivots below 1e-8 as in the one-thread kernel);
    // lane i > j finishes S[i][j] of column j.  The diagonal of L is kept only
    // as pinv and never stored: nothing reads it, and lanes i > j read row j
    // (S[j][k], k < j) in the same step, which the compiler may widen to pairs
    // S[j][j-1..j] (NVRTC 12.9 does, LDS.64): a store to S[j][j] here raced with
    // those reads (compute-sanitizer racecheck).  In each step, lane i writes
    // only S[i][j] of its own row, which no other lane reads until the next step.
    float pinv = 0.f;  // lane l: 1 / L_ll
    for (int j = 0; j < N; ++j) {
        float dj = 0.f;
        if (l == j) {
            dj = S[j][j];
            for (int k = 0; k < j; ++k) dj -= S[j][k] * S[j][k];
        }
        dj = __shfl_sync(FULL, dj, j);
        const float pj = dj > 1e-8f ? 1.f / sqrtf(dj) : 0.f;
        if (l == j) {
            pinv = pj;
        } else if (l > j && own) {
            float w = S[l][j];
            for (int k = 0; k < j; ++k) w -= S[l][k] * S[j][k];
            S[l][j] = w * pj;
        }
        __syncwarp();
    }
    // L y = b (lane i holds b_i, then y_i), then L^T b = y (lane i: b_i)
    for (int k = 0; k < N; ++k) {
        if (l == k) v *= pinv;
        const float bk = __shfl_sync(FULL, v, k);
        if (l > k && own) v -= S[l][k] * bk;
    }
    for (int k = N - 1; k >= 0; --k) {
        if (l == k) v *= pinv;
        const float bk = __shfl_sync(FULL, v, k);
        if (l < k) v -= S[k][l] * bk;
    }
    if (own) b_v[l] = v;
    __syncwarp();
    float a = 0.f;  // a_i = (r_i - sum_j P_ij b_j) / rs_i
    if (own) {
        float pb = 0.f;
        for (int j = 0; j < N; ++j) pb += P[l][j] * b_v[j];
        a = (r_v[l] - pb) / rs_v[l];
    }
    // a_v follows b_v in s_v, and the loads of b_v may be widened past b_v[N - 1]
    // (NVRTC 12.9 reads b_v[N-3..N-1] with a_v[0] as one LDS.128 at N = 17):
    // every lane finishes reading b_v before any lane writes a_v.
    __syncwarp();
    if (own) a_v[l] = a;
    __syncwarp();
    if (own)  // dL = P * (G - a 1^T - 1 b^T), row by row (coalesced)
        for (int i = 0; i < N; ++i) dL[i * N + l] = P[i][l] * (Gt[i * N + l] - a_v[i] - v);
}
