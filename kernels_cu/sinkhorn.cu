// Sinkhorn-Knopp projection (OPS.md section 1) and the per-token coefficient
// activations of the mHC pre op (section 7), one thread per n x n matrix, all
// tokens in one launch.
//
// Forward per matrix L:  K = exp(L - rowmax(L));  num_iters times
//   row step    P_ij <- P_ij * (1 / (sum_k P_ik + eps))
//   column step P_ij <- P_ij * (1 / (sum_k P_kj + eps))
// (a reciprocal then a multiply: within one rounding of the division).
//
// Unrolled backward: the exact vector-Jacobian product of that forward.  The
// forward is recomputed, keeping only the 2 * num_iters * N step denominators
// d (in shared memory when they fit, else in a global scratch buffer); the
// reverse sweep rebuilds each step's input from its output as p = y * d.
// For y = p / d with d_i = sum_k p_ik + eps:  dp_ij = (gy_ij - sum_k gy_ik y_ik) / d_i.
// The row-max shift is part of the function: dL_ij = gK_ij K_ij - [j = argmax_i] sum_k gK_ik K_ik,
// so every row of dL sums to 0 (P does not change when a row of L is shifted).
//
// Implicit backward: the gradient of the converged projection,
//   dL = P * (G - a 1^T - 1 b^T),  diag(P1) a + P b = rowsum(P*G),  P^T a + diag(P^T 1) b = colsum(P*G),
// solved by the Schur complement (S + 1 1^T) b = rhs with S = diag(P^T 1) - P^T diag(1/P1) P
// (symmetric positive semi-definite, null vector 1) by Cholesky, then a = (r - P b) / P1.
#include "common.cuh"

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

// num_iters row + column steps in place; if hist is non-null, the
// denominator of half step k (k = 2 it for rows, 2 it + 1 for columns) for
// row/column i is stored at hist[(k * N + i) * hstride].
template <int N>
__device__ __forceinline__ void sinkhorn_iterate(float (&P)[N * N], int iters, float eps, float* hist,
                                                 i64 hstride) {
    for (int it = 0; it < iters; ++it) {
MHC_UNROLL_N
        for (int i = 0; i < N; ++i) {
            float s = 0.f;
MHC_UNROLL_N
            for (int j = 0; j < N; ++j) s += P[i * N + j];
            const float d = s + eps;
            if (hist) hist[((i64)(2 * it) * N + i) * hstride] = d;
            const float inv = 1.f / d;
MHC_UNROLL_N
            for (int j = 0; j < N; ++j) P[i * N + j] *= inv;
        }
MHC_UNROLL_N
        for (int j = 0; j < N; ++j) {
            float s = 0.f;
MHC_UNROLL_N
            for (int i = 0; i < N; ++i) s += P[i * N + j];
            const float d = s + eps;
            if (hist) hist[((i64)(2 * it + 1) * N + j) * hstride] = d;
            const float inv = 1.f / d;
MHC_UNROLL_N
            for (int i = 0; i < N; ++i) P[i * N + j] *= inv;
        }
    }
}

// dL from gK (gradient w.r.t. the shifted exponential K).
template <int N>
__device__ __forceinline__ void exp_backward(const float (&K)[N * N], const float (&gK)[N * N],
                                             const int (&amax)[N], float* __restrict__ dL) {
MHC_UNROLL_N
    for (int i = 0; i < N; ++i) {
        float v[N];
        float s = 0.f;
MHC_UNROLL_N
        for (int j = 0; j < N; ++j) {
            v[j] = gK[i * N + j] * K[i * N + j];
            s += v[j];
        }
MHC_UNROLL_N
        for (int j = 0; j < N; ++j) dL[i * N + j] = (j == amax[i]) ? v[j] - s : v[j];
    }
}

}  // namespace

// P = sinkhorn(logits) for every token; when h_pre_raw is non-null also the
// pre-op activations H_pre = sigmoid(h_pre_raw), H_post = 2 sigmoid(h_post_raw).
template <int N>
__global__ void mhc_sinkhorn_knopp_fwd_kernel(const float* __restrict__ logits, float* __restrict__ P_out,
                                              const float* __restrict__ h_pre_raw,
                                              const float* __restrict__ h_post_raw,
                                              float* __restrict__ H_pre, float* __restrict__ H_post,
                                              i64 tokens, int iters, float eps) {
    const i64 t = blockIdx.x * (i64)blockDim.x + threadIdx.x;
    if (t >= tokens) return;
    float P[N * N];
    int amax[N];
    load_exp<N>(logits + t * (N * N), P, amax);
    sinkhorn_iterate<N>(P, iters, eps, nullptr, 0);
MHC_UNROLL_N
    for (int k = 0; k < N * N; ++k) P_out[t * (N * N) + k] = P[k];
    if (h_pre_raw != nullptr) {
MHC_UNROLL_N
        for (int i = 0; i < N; ++i) {
            H_pre[t * N + i] = mhc::sigmoid(h_pre_raw[t * N + i]);
            H_post[t * N + i] = 2.f * mhc::sigmoid(h_post_raw[t * N + i]);
        }
    }
}

// d_logits from grad_P (null = zero).  IMPLICIT selects the gradient mode.
// With h_post_raw non-null also the pre op's dh_post_raw = gH_post * H_post (1 - H_post / 2)
// (g_post null = zero).  History of the unrolled mode: dynamic shared memory of
// 2 * iters * N * blockDim.x floats when use_smem, else hist_global of
// 2 * iters * N * tokens floats.
template <int N, bool IMPLICIT>
__global__ void mhc_sinkhorn_knopp_bwd_kernel(const float* __restrict__ grad_P,
                                              const float* __restrict__ logits, float* __restrict__ d_logits,
                                              float* __restrict__ hist_global, int use_smem,
                                              const float* __restrict__ g_post,
                                              const float* __restrict__ h_post_raw,
                                              float* __restrict__ d_post_raw, i64 tokens, int iters,
                                              float eps) {
    extern __shared__ float hist_smem[];
    const i64 t = blockIdx.x * (i64)blockDim.x + threadIdx.x;
    if (t >= tokens) return;
    if (h_post_raw != nullptr) {
MHC_UNROLL_N
        for (int i = 0; i < N; ++i) {
            const float hp = 2.f * mhc::sigmoid(h_post_raw[t * N + i]);
            const float gp = g_post ? g_post[t * N + i] : 0.f;
            d_post_raw[t * N + i] = gp * hp * (1.f - 0.5f * hp);
        }
    }
    float* dL = d_logits + t * (N * N);
    if (grad_P == nullptr) {
MHC_UNROLL_N
        for (int k = 0; k < N * N; ++k) dL[k] = 0.f;
        return;
    }
    float K[N * N], P[N * N], G[N * N];
    int amax[N];
    load_exp<N>(logits + t * (N * N), K, amax);
MHC_UNROLL_N
    for (int k = 0; k < N * N; ++k) {
        P[k] = K[k];
        G[k] = grad_P[t * (N * N) + k];
    }
    if (!IMPLICIT) {
        float* hist = use_smem ? hist_smem + threadIdx.x : hist_global + t;
        const i64 hs = use_smem ? (i64)blockDim.x : tokens;
        sinkhorn_iterate<N>(P, iters, eps, hist, hs);
        for (int it = iters - 1; it >= 0; --it) {
            // column step: y = P (its output), d_j stored at half step 2 it + 1
MHC_UNROLL_N
            for (int j = 0; j < N; ++j) {
                const float d = hist[((i64)(2 * it + 1) * N + j) * hs];
                const float inv = 1.f / d;
                float s = 0.f;
MHC_UNROLL_N
                for (int i = 0; i < N; ++i) s = fmaf(G[i * N + j], P[i * N + j], s);
MHC_UNROLL_N
                for (int i = 0; i < N; ++i) {
                    G[i * N + j] = (G[i * N + j] - s) * inv;
                    P[i * N + j] *= d;
                }
            }
            // row step, half step 2 it
MHC_UNROLL_N
            for (int i = 0; i < N; ++i) {
                const float d = hist[((i64)(2 * it) * N + i) * hs];
                const float inv = 1.f / d;
                float s = 0.f;
MHC_UNROLL_N
                for (int j = 0; j < N; ++j) s = fmaf(G[i * N + j], P[i * N + j], s);
MHC_UNROLL_N
                for (int j = 0; j < N; ++j) {
                    G[i * N + j] = (G[i * N + j] - s) * inv;
                    P[i * N + j] *= d;
                }
            }
        }
        exp_backward<N>(K, G, amax, dL);
        return;
    }
    // implicit mode
    sinkhorn_iterate<N>(P, iters, eps, nullptr, 0);
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
