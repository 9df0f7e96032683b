// The coefficient path's forward GEMM for a few tokens (OPS.md section 8), on CUDA cores: raw
// H~ = x~ phi and the sum of squares per D range into part [splits, T, K+1], as the tensor-core
// kernels of coeffs_fwd.cu give them, but reading phi [D, K] float32 as it is (no bf16 planes to make
// first: at a few tokens that split pass costs more than the GEMM) and split over enough D ranges
// to read phi at the memory's speed.  At T = 1 it is a GEMV over phi.
//
// mhc_coeffs_gemv_fwd_kernel<T, POST>: grid (splits, token groups of tt tokens), 256 threads.  A block
// stages `rows` rows of phi [rows][K] and the group's x [tt][rows] (as float) in its 48 KiB of static
// shared memory at a time (its whole D range where that fits: the host's gemv_layout); thread r owns
// the outputs o = r + 256 j (j < outs <= GEMV_MAX_OUTS) of the group's
// tt x (K + 1) (token o / (K + 1), column o % (K + 1); column K: the sum of squares, with its
// 2^-100-scaled twin for a float32 overflow, as SumSq expects) and sums over its D range in
// position order, one fmaf each: float32 throughout, a fixed order (bitwise repeatable, no atomics).
#include "coeffs.cuh"

namespace mhc_coeffs {
constexpr int GEMV_THREADS = 256;
constexpr int GEMV_MAX_OUTS = 8;  // outputs per thread: tt (K + 1) <= 2048
constexpr int GEMV_SMEM_FLOATS = 12288;  // static shared memory (48 KiB): rows (K + tt) <= this
constexpr int GEMV_LOADS = 16;  // phi loads a thread has in flight while staging
constexpr int GEMV_X_LOADS = 8;  // x (POST: out) elements a thread stages at a time
}  // namespace mhc_coeffs

// rows (K + tt) <= GEMV_SMEM_FLOATS, tt (K + 1) <= 256 outs, outs <= GEMV_MAX_OUTS (the host's layout).
// POST (the fused layer boundary at a few tokens, OPS.md section 12): the GEMM's input is layer l's
// residual update out_i = sum_j M_ij x_j + H_post_i y (x: layer l's streams, M = H_res, transposed
// when res_t), each element computed in the post op kernel's order (H_post_i y, then fmaf over j =
// 0 .. n-1: its bits), rounded once to T, stored to out and staged; else (y, h_post, h_res, out
// null; n = 1) x itself.
template <typename T, bool POST>
__global__ void __launch_bounds__(256)
mhc_coeffs_gemv_fwd_kernel(const T* __restrict__ x, const float* __restrict__ phi, float* __restrict__ part,
                           i64 tokens, int D, int K, int tt, int outs, int rows, int d_split, const T* __restrict__ y,
                           const float* __restrict__ h_post, const float* __restrict__ h_res, T* __restrict__ out,
                           int C, int n, int res_t) {
    using namespace mhc_coeffs;
    __shared__ float s_gemv[GEMV_SMEM_FLOATS];
    float* const s_phi = s_gemv;            // [rows][K]
    float* const s_x = s_gemv + rows * K;   // [tt][rows]
    const int split = blockIdx.x;
    const i64 t0 = (i64)blockIdx.y * tt;
    const int d_begin = split * d_split;
    const int d_end = min(D, d_begin + d_split);
    const int KW = K + 1;

    // the thread's j-th output: token t of the group, column k (false past the last)
    auto output = [&](int j, int& t, int& k) {
        const int o = threadIdx.x + GEMV_THREADS * j;
        if (j >= outs || o >= tt * KW) return false;
        t = o / KW;
        k = o - t * KW;
        return true;
    };
    float acc[GEMV_MAX_OUTS], qs[GEMV_MAX_OUTS];
#pragma unroll
    for (int j = 0; j < GEMV_MAX_OUTS; ++j) acc[j] = qs[j] = 0.f;

    for (int d0 = d_begin; d0 < d_end; d0 += rows) {
        const int nr = min(rows, d_end - d0);
        __syncthreads();  // every thread done with the previous rows
        // phi's rows: GEMV_LOADS loads a thread in flight before their stores (at one token a block's
        // 112 rows x 24 columns are ~11 loads a thread, from HBM: one round trip instead of three)
        for (int i0 = threadIdx.x; i0 < nr * K; i0 += GEMV_LOADS * GEMV_THREADS) {
            float v[GEMV_LOADS];
#pragma unroll
            for (int b = 0; b < GEMV_LOADS; ++b) {
                const int i = i0 + b * GEMV_THREADS;
                v[b] = i < nr * K ? phi[(i64)d0 * K + i] : 0.f;
            }
#pragma unroll
            for (int b = 0; b < GEMV_LOADS; ++b)
                if (i0 + b * GEMV_THREADS < nr * K) s_phi[i0 + b * GEMV_THREADS] = v[b];
        }
        // the group's x (POST: out) rows, GEMV_X_LOADS elements a thread in flight before their stores (a
        // thread's elements one at a time made a round trip each: 20 at 64 tokens, 307 rows a chunk)
        for (int i0 = threadIdx.x; i0 < tt * rows; i0 += GEMV_X_LOADS * GEMV_THREADS) {
            float v[GEMV_X_LOADS];
#pragma unroll
            for (int b = 0; b < GEMV_X_LOADS; ++b) {
                const int i = i0 + b * GEMV_THREADS;
                const int t = i / rows, r = i - t * rows;
                const i64 tok = t0 + t;
                const int d = d0 + r;
                v[b] = 0.f;
                if (i < tt * rows && r < nr && tok < tokens) {
                    if constexpr (POST) {
                        const int si = d / C, c = d - si * C;  // stream si of out, channel c
                        const float* m = h_res + tok * n * n;
                        float o = h_post[tok * n + si] * mhc::to_float<T>(y[tok * C + c]);
                        for (int j = 0; j < n; ++j)
                            o = fmaf(m[res_t ? j * n + si : si * n + j], mhc::to_float<T>(x[(tok * n + j) * C + c]), o);
                        const T q = mhc::from_float<T>(o);
                        out[tok * (i64)D + d] = q;
                        v[b] = mhc::to_float<T>(q);
                    } else {
                        v[b] = mhc::to_float<T>(x[tok * (i64)D + d]);
                    }
                }
            }
#pragma unroll
            for (int b = 0; b < GEMV_X_LOADS; ++b)
                if (i0 + b * GEMV_THREADS < tt * rows) s_x[i0 + b * GEMV_THREADS] = v[b];
        }
        __syncthreads();
#pragma unroll
        for (int j = 0; j < GEMV_MAX_OUTS; ++j) {
            int t, k;
            if (!output(j, t, k)) break;
            const float* xr = s_x + t * rows;
            float a = acc[j], q = qs[j];
            if (k < K) {
                for (int r = 0; r < nr; ++r) a = fmaf(xr[r], s_phi[r * K + k], a);
            } else {
                for (int r = 0; r < nr; ++r) {
                    const float v = xr[r], s = v * mhc::STAT_SCALE;
                    a = fmaf(v, v, a);
                    q = fmaf(s, s, q);
                }
            }
            acc[j] = a;
            qs[j] = q;
        }
    }
#pragma unroll
    for (int j = 0; j < GEMV_MAX_OUTS; ++j) {
        int t, k;
        if (!output(j, t, k)) break;
        if (t0 + t >= tokens) continue;
        // after an overflow of the sum of squares: minus the scaled sum (see SumSq)
        part[((i64)split * tokens + t0 + t) * KW + k] = (k == K && isinf(acc[j])) ? -qs[j] : acc[j];
    }
}
