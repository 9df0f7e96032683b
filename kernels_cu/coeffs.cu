// The coefficient path of mHC (OPS.md section 8, paper Eqs. 14-18).  Per token
// t, with x~ = vec(x_t) (D = n*C values) and phi [D, K], K = n*n + 2n (columns
// pre | post | res):
//   H~ = x~ phi,  r = sqrt(mean(x~^2) + eps),  h_k = alpha_grp(k) H~_k / r + bias_k.
// Backward, with g'_k = alpha_grp(k) g_k:
//   dH_k = g'_k / r,  c = sum_k g'_k H~_k / (D r^3),
//   dx~ = dH phi^T - c x~,  dphi = sum_t x~^T dH,
//   dalpha_j = sum_t sum_{k in group j} g_k H~_k / r,  dbias = sum_t g.
//
// Kernels (all float32 arithmetic; x is read in its own dtype, E contiguous
// elements per access, E > 1 only when D % E == 0 and x / dx are aligned):
//
// * mhc_coeffs_fwd_kernel<T, E, TT, KC>: the skinny GEMM H~ = x~ phi and the
//   sum of squares, from one read of x.  256 threads = 8 warps; a block owns
//   8 * TT tokens (TT per warp), one chunk of KC columns and one range of D.
//   It walks its D range in steps of 32*E positions: each step the block
//   stages phi[d..d+32E, kc0..kc0+KC) in shared memory (transposed, double
//   buffered: one __syncthreads per step; the global loads of the next step
//   are issued before the FMAs of this one), and each lane loads its E
//   positions of x for its warp's TT tokens (prefetched one step ahead) and
//   accumulates TT*KC dot products + TT sums of squares in registers.  Each
//   phi value read from shared memory feeds TT FMAs; phi comes from L2 once per
//   block, i.e. once per 32 tokens.  At the end each warp reduces its lanes
//   (fixed butterfly, mhc::warp_sum) and either finishes the outputs (one D
//   range) or writes raw per-range sums to `part` [splits, T, K+1] (column K:
//   sum of squares), summed in order by mhc_coeffs_fwd_finish_kernel /
//   mhc_coeffs_bwd_prep_kernel.  Columns are chunked (KC <= 24, chosen by the
//   host) so per-thread accumulators stay ~100 at any n; the chunk index is
//   the fastest-varying block index, so blocks re-reading the same tokens of x
//   for other chunks run together and hit L2.  The D split is used only when
//   there are too few token tiles to fill the GPU (small T).
// * mhc_coeffs_bwd_prep_kernel: one warp per token: sums the D-range
//   partials, writes dH [T, KP] (column K holds c, padded to KP, a multiple of
//   4) and the per-token dalpha terms [T, 3] (summed over tokens by
//   mhc_column_sum_kernel; dbias is the column sum of the incoming gradients).
// * mhc_coeffs_bwd_fused_kernel<T, E, K> (K <= 24, i.e. n <= 4): dx and dphi
//   from one more read of x.  A thread owns E positions d and keeps phi[d, :]
//   and its dphi[d, :] accumulators in registers (2*E*K floats); the block
//   walks a range of tokens, staging 32 rows of dH in shared memory at a time
//   (read as broadcasts), writing dx and accumulating dphi.  blockIdx.y splits
//   the tokens; with several splits dphi goes to partials [splits, D, K] that
//   mhc_column_sum_kernel sums in order.
// * n > 4 (K > 24): mhc_coeffs_bwd_dx_kernel<T, E, KC> (a thread owns E
//   positions x TS tokens of dx, loops over K in chunks of KC columns of the
//   transposed phi (mhc_coeffs_transpose_kernel, coalesced) and of dH staged
//   in shared memory) and mhc_coeffs_bwd_dphi_kernel<T, E, KC> (a thread owns
//   E positions x KC columns of dphi and walks a token range, like the fused
//   kernel; the column chunk is the fastest block index).
//
// Determinism: every sum has a fixed order (per-lane sequential, fixed
// butterflies, partials summed in index order); no atomics.
//
// Performance (measured on one H200, bf16 x, n = 4, C = 4096, T = 16384 tokens,
// CUDA-event timing of the public calls): forward 0.89 ms, backward 2.5 ms
// (0.9 ms of it the same GEMM pass, ~1.6 ms the fused dx / dphi kernel).  One
// read of x at 4.3 TB/s takes 0.125 ms; for comparison cuBLAS takes 0.52 ms
// for the FP32 GEMM on an f32 copy of x and 0.14 ms for a bf16 tensor-core
// GEMM (which would round phi).  Both passes are bound by FP32 FMA issue and
// latency, not by memory: the forward does 25 FMAs per element of x (~15
// TFLOP/s, a quarter of the FP32 peak), the backward 48 more.  Measured
// alternatives: TT = 2 (fewer registers, 2 blocks / SM) is 2.3x slower; TT =
// 8 with 12- or 8-column chunks is 1.4-1.7x slower; E = 2 in the fused
// backward is ~8% slower than E = 1.  The forward uses 212 registers (one
// block of 8 warps per SM), no spills at n <= 4.  For n > 4 the backward
// re-reads phi^T from L2 once per 32 tokens (dx) and x once per column chunk
// (n = 8, C = 2048, T = 8192: forward 1.8 ms, backward 4.9 ms): correct, not
// tuned.  A tensor-core version (bf16 x times phi split into bf16 hi + lo,
// float32 accumulation) is the next step if this path shows up in profiles.
#include "common.cuh"

using mhc::i64;

namespace mhc_coeffs {

enum : int {
    NT = 256,      // threads per block of the GEMM kernels
    NW = NT / 32,  // warps per block
    TS = 32,       // tokens of dH staged per step of the backward
};

// E consecutive floats from shared memory (16-, 8- or 4-byte aligned for E = 4, 2, 1).
template <int E>
__device__ __forceinline__ void lds(const float* p, float (&v)[E]) {
    if constexpr (E == 4) {
        const float4 r = *reinterpret_cast<const float4*>(p);
        v[0] = r.x; v[1] = r.y; v[2] = r.z; v[3] = r.w;
    } else if constexpr (E == 2) {
        const float2 r = *reinterpret_cast<const float2*>(p);
        v[0] = r.x; v[1] = r.y;
    } else {
#pragma unroll
        for (int e = 0; e < E; ++e) v[e] = p[e];
    }
}

// x at positions d .. d + E of U consecutive tokens from row0 (rows >= valid read as 0).
template <typename T, int E, int U>
__device__ __forceinline__ void load_token_rows(const T* __restrict__ x, i64 row0, int valid, int D, int d,
                                                float (&xv)[U][E]) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
        if (u < valid) {
            mhc::load_vec<T, E>(x + (row0 + u) * (i64)D + d, xv[u]);
        } else {
#pragma unroll
            for (int e = 0; e < E; ++e) xv[u][e] = 0.f;
        }
    }
}

// Group of column k: 0 = pre [0, n), 1 = post [n, 2n), 2 = res [2n, K).
__device__ __forceinline__ int group_of(int k, int n) { return k < n ? 0 : (k < 2 * n ? 1 : 2); }

// h_k = alpha_grp H / r + bias_k, written to its output.
__device__ __forceinline__ void finish_column(const float* __restrict__ alpha, const float* __restrict__ bias,
                                              float* __restrict__ h_pre, float* __restrict__ h_post,
                                              float* __restrict__ h_res, i64 t, int k, int n, float H,
                                              float rinv) {
    const int grp = group_of(k, n);
    const float v = fmaf(alpha[grp] * H, rinv, bias[k]);
    if (grp == 0) h_pre[t * n + k] = v;
    else if (grp == 1) h_post[t * n + (k - n)] = v;
    else h_res[t * (i64)(n * n) + (k - 2 * n)] = v;
}

__device__ __forceinline__ float rms_inv(float sumsq, int D, float eps) {
    return 1.f / sqrtf(sumsq / (float)D + eps);
}

// 1/r of token row xt when its float32 sum of squares overflowed (sumsq inf):
// summed again with x scaled by mhc::STAT_SCALE, by the 32 lanes of the calling
// warp (a warp-uniform call) or by one thread.  Never runs for other rows.
template <typename T>
__device__ float rms_inv_rescaled_warp(const T* __restrict__ xt, int D, float eps, int lane) {
    float s = 0.f;
    for (int d = lane; d < D; d += 32) {
        const float v = mhc::to_float<T>(xt[d]) * mhc::STAT_SCALE;
        s = fmaf(v, v, s);
    }
    return mhc::rms_inv_scaled(mhc::warp_sum(s), (float)D, eps);
}

template <typename T>
__device__ float rms_inv_rescaled_thread(const T* __restrict__ xt, int D, float eps) {
    float s = 0.f;
    for (int d = 0; d < D; ++d) {
        const float v = mhc::to_float<T>(xt[d]) * mhc::STAT_SCALE;
        s = fmaf(v, v, s);
    }
    return mhc::rms_inv_scaled(s, (float)D, eps);
}

}  // namespace mhc_coeffs

// ------------------------------------------------------------------ forward
// Grid: one block per (column chunk cc, token tile, D range), flattened with
// cc fastest: blockIdx.x = (split * tiles + tile) * ncc + cc.  D range
// `split` is [split * d_split, min(D, (split + 1) * d_split)), d_split a
// multiple of 32 * E.  part == nullptr: finish the outputs here (one D
// range); else write raw sums part[split, t, k] (k < K) and part[split, t, K]
// (sum of squares, written by the cc == 0 blocks).
template <typename T, int E, int TT, int KC>
__global__ void __launch_bounds__(256)
mhc_coeffs_fwd_kernel(const T* __restrict__ x, const float* __restrict__ phi, const float* __restrict__ alpha,
                      const float* __restrict__ bias, float* __restrict__ h_pre, float* __restrict__ h_post,
                      float* __restrict__ h_res, float* __restrict__ part, i64 tokens, int D, int n, int K,
                      int ncc, i64 tiles, int d_split, float eps) {
    using namespace mhc_coeffs;
    constexpr int DC = 32 * E;                  // positions of D per step (E per lane)
    constexpr int DP = DC + E;                  // padded row: keeps E-vector alignment, spreads staging stores
    constexpr int STG = (KC * DC + NT - 1) / NT;  // phi values staged per thread per step
    __shared__ __align__(16) float s_phi[2][KC][DP];
    __shared__ float s_tot[NW][TT][KC + 1];

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    // 32-bit index arithmetic (the host keeps the grid below 2^31 blocks)
    const unsigned b = blockIdx.x, rest = b / (unsigned)ncc;
    const int cc = (int)(b - rest * (unsigned)ncc);
    const unsigned split_u = rest / (unsigned)tiles;
    const i64 tile = rest - split_u * (unsigned)tiles;
    const int split = (int)split_u;
    const int kc0 = cc * KC;
    const int kn = min(KC, K - kc0);            // columns in this chunk
    const int d_begin = split * d_split;
    const int d_end = min(D, d_begin + d_split);
    const int steps = (d_end - d_begin + DC - 1) / DC;
    const i64 tok0 = (tile * NW + warp) * TT;

    float acc[TT][KC], ss[TT];
#pragma unroll
    for (int tt = 0; tt < TT; ++tt) {
        ss[tt] = 0.f;
#pragma unroll
        for (int k = 0; k < KC; ++k) acc[tt][k] = 0.f;
    }

    // staged element j of a step: position p = j / KC, column k = j % KC
    // (consecutive threads read consecutive columns of one row of phi).
    float stg[STG];
    auto stage_load = [&](int db) {
#pragma unroll
        for (int s = 0; s < STG; ++s) {
            const int j = threadIdx.x + s * NT;
            const int p = j / KC, k = j - p * KC;
            const int d = db + p;
            stg[s] = (j < KC * DC && k < kn && d < d_end) ? phi[(i64)d * K + kc0 + k] : 0.f;
        }
    };
    auto stage_store = [&](int buf) {
#pragma unroll
        for (int s = 0; s < STG; ++s) {
            const int j = threadIdx.x + s * NT;
            const int p = j / KC, k = j - p * KC;
            if (j < KC * DC) s_phi[buf][k][p] = stg[s];
        }
    };
    auto x_load = [&](int db, float (&xv)[TT][E]) {
        const int d = db + lane * E;
#pragma unroll
        for (int tt = 0; tt < TT; ++tt) {
            const i64 t = tok0 + tt;
            if (t < tokens && d < d_end) {
                mhc::load_vec<T, E>(x + t * (i64)D + d, xv[tt]);
            } else {
#pragma unroll
                for (int e = 0; e < E; ++e) xv[tt][e] = 0.f;
            }
        }
    };

    float xv[TT][E];
    if (steps > 0) {
        stage_load(d_begin);
        stage_store(0);
        x_load(d_begin, xv);
    }
    for (int i = 0; i < steps; ++i) {
        const int db = d_begin + i * DC;
        const bool more = i + 1 < steps;
        __syncthreads();  // s_phi[i & 1] staged; every warp is done with s_phi[(i + 1) & 1]
        float xn[TT][E];
        if (more) {
            stage_load(db + DC);
            x_load(db + DC, xn);
        }
        const float* sp = &s_phi[i & 1][0][lane * E];
#pragma unroll
        for (int k = 0; k < KC; ++k) {
            float pv[E];
            mhc_coeffs::lds<E>(sp + k * DP, pv);
#pragma unroll
            for (int tt = 0; tt < TT; ++tt)
#pragma unroll
                for (int e = 0; e < E; ++e) acc[tt][k] = fmaf(xv[tt][e], pv[e], acc[tt][k]);
        }
#pragma unroll
        for (int tt = 0; tt < TT; ++tt)
#pragma unroll
            for (int e = 0; e < E; ++e) ss[tt] = fmaf(xv[tt][e], xv[tt][e], ss[tt]);
        if (more) {
            stage_store((i + 1) & 1);
#pragma unroll
            for (int tt = 0; tt < TT; ++tt)
#pragma unroll
                for (int e = 0; e < E; ++e) xv[tt][e] = xn[tt][e];
        }
    }

    // Warp totals (fixed butterfly), spread over the lanes through shared memory.
#pragma unroll
    for (int tt = 0; tt < TT; ++tt) {
#pragma unroll
        for (int k = 0; k < KC; ++k) {
            const float v = mhc::warp_sum(acc[tt][k]);
            if (lane == (tt * (KC + 1) + k) % 32) s_tot[warp][tt][k] = v;
        }
        const float v = mhc::warp_sum(ss[tt]);
        if (lane == (tt * (KC + 1) + KC) % 32) s_tot[warp][tt][KC] = v;
    }
    __syncwarp();
    if (part == nullptr) {  // one D range: s_tot[warp][tt][KC] becomes 1/r of token tt (warp-uniform)
        float rinv[TT];
#pragma unroll
        for (int tt = 0; tt < TT; ++tt) {
            const float q = s_tot[warp][tt][KC];
            rinv[tt] = mhc_coeffs::rms_inv(q, D, eps);
            if (isinf(q) && tok0 + tt < tokens)
                rinv[tt] = mhc_coeffs::rms_inv_rescaled_warp<T>(x + (tok0 + tt) * (i64)D, D, eps, lane);
        }
        __syncwarp();  // every lane has read the sums
        if (lane == 0)
#pragma unroll
            for (int tt = 0; tt < TT; ++tt) s_tot[warp][tt][KC] = rinv[tt];
        __syncwarp();
    }
    for (int idx = lane; idx < TT * kn; idx += 32) {
        const int tt = idx / kn, k = idx - tt * kn;
        const i64 t = tok0 + tt;
        if (t >= tokens) continue;
        const float H = s_tot[warp][tt][k], q = s_tot[warp][tt][KC];
        if (part != nullptr) {
            float* row = part + ((i64)split * tokens + t) * (K + 1);
            row[kc0 + k] = H;
            if (cc == 0 && k == 0) row[K] = q;
        } else {
            mhc_coeffs::finish_column(alpha, bias, h_pre, h_post, h_res, t, kc0 + k, n, H, q);
        }
    }
}

// Forward with several D ranges: h[t, k] from the raw partials, summed in
// range order.  One thread per (t, k), grid-stride; x only for a token whose
// sum of squares overflowed.
template <typename T>
__global__ void mhc_coeffs_fwd_finish_kernel(const T* __restrict__ x, const float* __restrict__ part,
                                             const float* __restrict__ alpha,
                                             const float* __restrict__ bias, float* __restrict__ h_pre,
                                             float* __restrict__ h_post, float* __restrict__ h_res, i64 tokens,
                                             int D, int n, int K, int splits, float eps) {
    const i64 total = tokens * K;
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < total; i += (i64)gridDim.x * blockDim.x) {
        const i64 t = i / K;
        const int k = (int)(i - t * K);
        float H = 0.f, q = 0.f;
        for (int s = 0; s < splits; ++s) {
            const float* row = part + ((i64)s * tokens + t) * (K + 1);
            H += row[k];
            q += row[K];
        }
        const float rinv = isinf(q) ? mhc_coeffs::rms_inv_rescaled_thread<T>(x + t * (i64)D, D, eps)
                                    : mhc_coeffs::rms_inv(q, D, eps);
        mhc_coeffs::finish_column(alpha, bias, h_pre, h_post, h_res, t, k, n, H, rinv);
    }
}

// --------------------------------------------------------------- backward
// One warp per token (grid-stride): from the raw sums part [splits, T, K+1]
// and the incoming gradients (any may be null = zero), write
//   dH[t, k] = alpha_grp g_k / r (k < K), dH[t, K] = c = sum_k alpha_grp g_k H_k / (D r^3),
//   dH[t, K+1 .. KP) = 0 (padding), and qa[t, j] = sum_{k in group j} g_k H_k / r.
// x only for a token whose sum of squares overflowed.  blockDim.x: a multiple of 32.
template <typename T>
__global__ void mhc_coeffs_bwd_prep_kernel(const T* __restrict__ x, const float* __restrict__ part,
                                           const float* __restrict__ g_pre,
                                           const float* __restrict__ g_post, const float* __restrict__ g_res,
                                           const float* __restrict__ alpha, float* __restrict__ dH,
                                           float* __restrict__ qa, i64 tokens, int D, int n, int K, int KP,
                                           int splits, float eps) {
    const int lane = threadIdx.x & 31;
    const i64 warps = (i64)gridDim.x * (blockDim.x >> 5);
    const float a0 = alpha[0], a1 = alpha[1], a2 = alpha[2];
    for (i64 t = blockIdx.x * (i64)(blockDim.x >> 5) + (threadIdx.x >> 5); t < tokens; t += warps) {
        float q = 0.f;
        for (int s = 0; s < splits; ++s) q += part[((i64)s * tokens + t) * (K + 1) + K];
        float rinv = mhc_coeffs::rms_inv(q, D, eps);
        if (isinf(q)) rinv = mhc_coeffs::rms_inv_rescaled_warp<T>(x + t * (i64)D, D, eps, lane);  // warp-uniform
        float sc = 0.f, q0 = 0.f, q1 = 0.f, q2 = 0.f;
        for (int k = lane; k < K; k += 32) {
            float H = 0.f;
            for (int s = 0; s < splits; ++s) H += part[((i64)s * tokens + t) * (K + 1) + k];
            const int grp = mhc_coeffs::group_of(k, n);
            float g, a;
            if (grp == 0) {
                g = g_pre != nullptr ? g_pre[t * n + k] : 0.f;
                a = a0;
            } else if (grp == 1) {
                g = g_post != nullptr ? g_post[t * n + (k - n)] : 0.f;
                a = a1;
            } else {
                g = g_res != nullptr ? g_res[t * (i64)(n * n) + (k - 2 * n)] : 0.f;
                a = a2;
            }
            const float ag = a * g;
            dH[t * KP + k] = ag * rinv;
            sc = fmaf(ag, H, sc);
            const float gh = g * H * rinv;
            if (grp == 0) q0 += gh;
            else if (grp == 1) q1 += gh;
            else q2 += gh;
        }
        sc = mhc::warp_sum(sc);
        q0 = mhc::warp_sum(q0);
        q1 = mhc::warp_sum(q1);
        q2 = mhc::warp_sum(q2);
        for (int k = K + 1 + lane; k < KP; k += 32) dH[t * KP + k] = 0.f;
        if (lane == 0) {
            dH[t * KP + K] = sc * rinv * rinv * rinv / (float)D;
            qa[t * 3 + 0] = q0;
            qa[t * 3 + 1] = q1;
            qa[t * 3 + 2] = q2;
        }
    }
}

// dx and dphi for K <= 24 (n <= 4).  Grid (ceil(D / (256 E)), splits): block
// (bx, s) owns positions [bx * 256 E, ...) and tokens [s * t_split, ...).
// dphi: the output (one split) or partials [splits, D, K].  KP = K + 1
// rounded up to a multiple of 4 (the row stride of dH).
template <typename T, int E, int K>
__global__ void __launch_bounds__(256)
mhc_coeffs_bwd_fused_kernel(const T* __restrict__ x, const float* __restrict__ phi, const float* __restrict__ dH,
                            T* __restrict__ dx, float* __restrict__ dphi, i64 tokens, int D, i64 t_split) {
    using namespace mhc_coeffs;
    constexpr int KP = (K + 1 + 3) / 4 * 4;
    constexpr int U = 4;  // tokens whose x loads are issued together
    __shared__ __align__(16) float s_dH[TS][KP];

    const int d = (blockIdx.x * NT + threadIdx.x) * E;
    const bool active = d < D;
    const i64 t_begin = blockIdx.y * t_split;
    const i64 t_end = min(tokens, t_begin + t_split);

    float ph[E][K], dp[E][K];
#pragma unroll
    for (int e = 0; e < E; ++e)
#pragma unroll
        for (int k = 0; k < K; ++k) {
            ph[e][k] = active ? phi[(i64)(d + e) * K + k] : 0.f;
            dp[e][k] = 0.f;
        }

    for (i64 t0 = t_begin; t0 < t_end; t0 += TS) {
        const int nt = (int)min((i64)TS, t_end - t0);
        __syncthreads();  // everyone is done with the previous rows
        for (int j = threadIdx.x; j < nt * KP; j += NT) (&s_dH[0][0])[j] = dH[t0 * KP + j];
        __syncthreads();
        if (!active) continue;
        // x of U tokens at a time; the next U are loaded while these are used
        auto x_load = [&](int tt0, float (&xv)[U][E]) { load_token_rows<T, E, U>(x, t0 + tt0, nt - tt0, D, d, xv); };
        float xv[U][E];
        x_load(0, xv);
        for (int tt0 = 0; tt0 < nt; tt0 += U) {
            const bool more = tt0 + U < nt;
            float xn[U][E];
            if (more) x_load(tt0 + U, xn);
#pragma unroll
            for (int u = 0; u < U; ++u) {
                if (tt0 + u >= nt) break;
                float q[KP];
#pragma unroll
                for (int k = 0; k < KP; k += 4) {
                    const float4 r = *reinterpret_cast<const float4*>(&s_dH[tt0 + u][k]);
                    q[k] = r.x; q[k + 1] = r.y; q[k + 2] = r.z; q[k + 3] = r.w;
                }
                float o[E];
#pragma unroll
                for (int e = 0; e < E; ++e) {
                    float s = -xv[u][e] * q[K];
#pragma unroll
                    for (int k = 0; k < K; ++k) {
                        s = fmaf(ph[e][k], q[k], s);
                        dp[e][k] = fmaf(xv[u][e], q[k], dp[e][k]);
                    }
                    o[e] = s;
                }
                mhc::store_vec<T, E>(dx + (t0 + tt0 + u) * (i64)D + d, o);
            }
            if (more) {
#pragma unroll
                for (int u = 0; u < U; ++u)
#pragma unroll
                    for (int e = 0; e < E; ++e) xv[u][e] = xn[u][e];
            }
        }
    }
    if (active) {
        float* out = dphi + (i64)blockIdx.y * D * K + (i64)d * K;
#pragma unroll
        for (int e = 0; e < E; ++e)
#pragma unroll
            for (int k = 0; k < K; ++k) out[e * K + k] = dp[e][k];
    }
}

// out[c, r] = in[r, c] for a row-major [rows, cols] float32 matrix (phi -> phi^T).
// blockDim (32, 8); grid (ceil(rows / 32), ceil(cols / 32)).
__global__ void mhc_coeffs_transpose_kernel(const float* __restrict__ in, float* __restrict__ out, int rows,
                                            int cols) {
    __shared__ float tile[32][33];
    const int r0 = blockIdx.x * 32, c0 = blockIdx.y * 32;
    for (int i = threadIdx.y; i < 32; i += 8) {
        const int r = r0 + i, c = c0 + threadIdx.x;
        if (r < rows && c < cols) tile[i][threadIdx.x] = in[(i64)r * cols + c];
    }
    __syncthreads();
    for (int i = threadIdx.y; i < 32; i += 8) {
        const int c = c0 + i, r = r0 + threadIdx.x;
        if (r < rows && c < cols) out[(i64)c * rows + r] = tile[threadIdx.x][i];
    }
}

// dx for any K.  Flattened grid: blockIdx.x = tile * dblocks + bx; a thread
// owns positions d = (bx * 256 + tid) * E .. + E of the TS tokens of `tile`;
// it walks K in chunks of KC columns: phi_t [K, D] (coalesced) in registers,
// dH[tile tokens, chunk] staged in shared memory.
template <typename T, int E, int KC>
__global__ void __launch_bounds__(256)
mhc_coeffs_bwd_dx_kernel(const T* __restrict__ x, const float* __restrict__ phi_t, const float* __restrict__ dH,
                         T* __restrict__ dx, i64 tokens, int D, int K, int KP, int dblocks) {
    using namespace mhc_coeffs;
    constexpr int KCP = (KC + 3) / 4 * 4;
    __shared__ __align__(16) float s_dH[TS][KCP];

    const unsigned tile = blockIdx.x / (unsigned)dblocks;
    const int bx = (int)(blockIdx.x - tile * (unsigned)dblocks);
    const i64 t0 = (i64)tile * TS;
    const int nt = (int)min((i64)TS, tokens - t0);
    const int d = (bx * NT + threadIdx.x) * E;
    const bool active = d < D;

    float acc[TS][E];
#pragma unroll
    for (int tt = 0; tt < TS; ++tt)
#pragma unroll
        for (int e = 0; e < E; ++e) acc[tt][e] = 0.f;

    for (int kc0 = 0; kc0 < K; kc0 += KC) {
        const int kn = min(KC, K - kc0);
        __syncthreads();
        for (int j = threadIdx.x; j < TS * KCP; j += NT) {
            const int tt = j / KCP, k = j - tt * KCP;
            (&s_dH[0][0])[j] = (tt < nt && k < kn) ? dH[(t0 + tt) * KP + kc0 + k] : 0.f;
        }
        __syncthreads();
        if (!active) continue;
        float ph[KC][E];
#pragma unroll
        for (int k = 0; k < KC; ++k) {
            if (k < kn) {
                mhc_coeffs::lds<E>(phi_t + (i64)(kc0 + k) * D + d, ph[k]);  // global, E-aligned
            } else {
#pragma unroll
                for (int e = 0; e < E; ++e) ph[k][e] = 0.f;
            }
        }
#pragma unroll
        for (int tt = 0; tt < TS; ++tt) {
#pragma unroll
            for (int k = 0; k < KCP; k += 4) {
                float q[4];
                mhc_coeffs::lds<4>(&s_dH[tt][k], q);
#pragma unroll
                for (int j = 0; j < 4; ++j)
                    if (k + j < KC)
#pragma unroll
                        for (int e = 0; e < E; ++e) acc[tt][e] = fmaf(ph[k + j < KC ? k + j : 0][e], q[j], acc[tt][e]);
            }
        }
    }
    if (!active) return;
#pragma unroll
    for (int tt = 0; tt < TS; ++tt) {
        if (tt < nt) {
            const i64 t = t0 + tt;
            const float c = dH[t * KP + K];
            float xv[E], o[E];
            mhc::load_vec<T, E>(x + t * (i64)D + d, xv);
#pragma unroll
            for (int e = 0; e < E; ++e) o[e] = fmaf(-xv[e], c, acc[tt][e]);
            mhc::store_vec<T, E>(dx + t * (i64)D + d, o);
        }
    }
}

// dphi for any K.  Flattened grid: blockIdx.x = (split * dblocks + bx) * ncc + cc;
// a thread owns positions d = (bx * 256 + tid) * E .. + E and columns
// [cc * KC, cc * KC + KC) and walks tokens [split * t_split, ...), with dH
// rows staged in shared memory.  dphi: the output (one split) or partials
// [splits, D, K].
template <typename T, int E, int KC>
__global__ void __launch_bounds__(256)
mhc_coeffs_bwd_dphi_kernel(const T* __restrict__ x, const float* __restrict__ dH, float* __restrict__ dphi,
                           i64 tokens, int D, int K, int KP, int ncc, int dblocks, i64 t_split) {
    using namespace mhc_coeffs;
    constexpr int KCP = (KC + 3) / 4 * 4;
    constexpr int U = 4;
    __shared__ __align__(16) float s_dH[TS][KCP];

    const unsigned rest = blockIdx.x / (unsigned)ncc;
    const int cc = (int)(blockIdx.x - rest * (unsigned)ncc);
    const unsigned split_u = rest / (unsigned)dblocks;
    const int bx = (int)(rest - split_u * (unsigned)dblocks);
    const i64 split = split_u;
    const int kc0 = cc * KC;
    const int kn = min(KC, K - kc0);
    const int d = (bx * NT + threadIdx.x) * E;
    const bool active = d < D;
    const i64 t_begin = split * t_split;
    const i64 t_end = min(tokens, t_begin + t_split);

    float acc[E][KC];
#pragma unroll
    for (int e = 0; e < E; ++e)
#pragma unroll
        for (int k = 0; k < KC; ++k) acc[e][k] = 0.f;

    for (i64 t0 = t_begin; t0 < t_end; t0 += TS) {
        const int nt = (int)min((i64)TS, t_end - t0);
        __syncthreads();
        for (int j = threadIdx.x; j < nt * KCP; j += NT) {
            const int tt = j / KCP, k = j - tt * KCP;
            (&s_dH[0][0])[j] = k < kn ? dH[(t0 + tt) * KP + kc0 + k] : 0.f;
        }
        __syncthreads();
        if (!active) continue;
        for (int tt0 = 0; tt0 < nt; tt0 += U) {
            float xv[U][E];
            load_token_rows<T, E, U>(x, t0 + tt0, nt - tt0, D, d, xv);
#pragma unroll
            for (int u = 0; u < U; ++u) {
                if (tt0 + u >= nt) break;
#pragma unroll
                for (int k = 0; k < KCP; k += 4) {
                    float q[4];
                    mhc_coeffs::lds<4>(&s_dH[tt0 + u][k], q);
#pragma unroll
                    for (int j = 0; j < 4; ++j)
                        if (k + j < KC)
#pragma unroll
                            for (int e = 0; e < E; ++e) {
                                const int kk = k + j < KC ? k + j : 0;
                                acc[e][kk] = fmaf(xv[u][e], q[j], acc[e][kk]);
                            }
                }
            }
        }
    }
    if (!active) return;
    float* out = dphi + split * D * (i64)K;
#pragma unroll
    for (int e = 0; e < E; ++e)
#pragma unroll
        for (int k = 0; k < KC; ++k)
            if (k < kn) out[(i64)(d + e) * K + kc0 + k] = acc[e][k];
}

// out[i] = 0 for i < count (zero parameter gradients: no tokens, missing incoming gradients).
__global__ void mhc_coeffs_zero_kernel(float* __restrict__ out, i64 count) {
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < count; i += (i64)gridDim.x * blockDim.x)
        out[i] = 0.f;
}
