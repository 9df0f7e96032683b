// The coefficient path of mHC (OPS.md section 8, paper Eqs. 14-18).  Per token
// t, with x~ = vec(x_t) (D = n*C values) and phi [D, K], K = n*n + 2n (columns
// pre | post | res):
//   H~ = x~ phi,  r = sqrt(mean(x~^2) + eps),  h_k = alpha_grp(k) H~_k / r + bias_k.
// Backward, with g'_k = alpha_grp(k) g_k:
//   dH_k = g'_k / r,  c = sum_k g'_k H~_k / (D r^3),
//   dx~ = dH phi^T - c x~,  dphi = sum_t x~^T dH,
//   dalpha_j = sum_t sum_{k in group j} g_k H~_k / r,  dbias = sum_t g.
//
// The GEMMs run on tensor cores (the "tensor-core path" at the end of this
// file: the forward GEMM and the sum of squares for every n; dx and dphi in one
// kernel for K <= 32, i.e. n <= 4, in two above, dx with phi resident in shared memory
// or streamed beside dH; on sm_90a the forward GEMM and the dx of bf16 x also on wgmma for
// some n); the small per-token kernels and the head's CUDA-core GEMMs are here:
//
// * mhc_coeffs_fwd_finish_kernel: h from the raw per-D-range sums part
//   [splits, T, K+1] (column K: the sum of squares), summed in range order.
// * mhc_coeffs_bwd_prep_kernel: one warp per token: sums the D-range
//   partials, writes dH [T, KP] (column K holds c, padded to KP, a multiple of
//   4) and the per-token dalpha terms [T, 3] (summed over tokens by
//   mhc_column_sum_kernel; dbias is the column sum of the incoming gradients).
// * the head (OPS.md section 11): mhc_head_fwd_kernel, mhc_head_bwd_prep_kernel,
//   mhc_head_bwd_dx_kernel (K = n columns of hc_fn = phi^T; section "head" below),
//   and its dhc_fn through mhc_coeffs_bwd_dphi_kernel<T, E, KC> (a thread owns E positions
//   x KC columns of dphi and walks a token range; the column chunk is the fastest block index).
//
// Determinism: every sum has a fixed order (per-lane sequential, fixed
// butterflies, the tensor cores' fixed accumulation, partials summed in index
// order); no atomics.
#include "common.cuh"
#include "wgmma.cuh"

using mhc::i64;

namespace mhc_coeffs {

enum : int {
    NT = 256,      // threads per block of the GEMM kernels
    TS = 32,       // tokens of dH staged per step of the backward
};

// E consecutive floats (16-, 8- or 4-byte aligned for E = 4, 2, 1).
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

// Sums of squares and float32 overflow (|x| above ~1.8e19 / sqrt(range)): the
// forward GEMM writes for each D range the sum of x^2, or, when that overflowed,
// minus the sum of (x mhc::STAT_SCALE)^2 (scaled_sumsq; rows that do not
// overflow never pay for it).  SumSq adds the per-range values of one token and
// gives 1/r: from the plain sum, or from the scaled one when a range overflowed
// or the total did.
template <typename T>
__device__ float scaled_sumsq(const T* __restrict__ xt, int d_begin, int d_end) {
    float s = 0.f;
    for (int d = d_begin; d < d_end; ++d) {
        const float v = mhc::to_float<T>(xt[d]) * mhc::STAT_SCALE;
        s = fmaf(v, v, s);
    }
    return s;
}

struct SumSq {
    float q = 0.f, qs = 0.f;  // plain sum; scaled sum (x STAT_SCALE)^2
    bool scaled = false;

    __device__ __forceinline__ void add(float v) {
        if (v < 0.f) {
            scaled = true;
            qs -= v;
        } else {
            q += v;
            qs = fmaf(v * mhc::STAT_SCALE, mhc::STAT_SCALE, qs);
        }
    }
    __device__ __forceinline__ bool overflowed() const { return scaled || isinf(q); }
    // the per-token value to save: the same convention as one D range
    __device__ __forceinline__ float saved() const { return overflowed() ? -qs : q; }
    __device__ __forceinline__ float rinv(int D, float eps) const {
        return overflowed() ? mhc::rms_inv_scaled(qs, (float)D, eps) : rms_inv(q, D, eps);
    }
};

}  // namespace mhc_coeffs

// ------------------------------------------------------------------ forward
// Forward with several D ranges: h[t, k] from the raw partials, summed in
// range order.  One thread per (t, k), grid-stride.  stats (may be null):
// the summed raw H~ and sum of squares [T, K+1] (the fused layer's saved state;
// the sum of squares as SumSq::saved, negative after a float32 overflow).
__global__ void mhc_coeffs_fwd_finish_kernel(const float* __restrict__ part, const float* __restrict__ alpha,
                                             const float* __restrict__ bias, float* __restrict__ h_pre,
                                             float* __restrict__ h_post, float* __restrict__ h_res,
                                             float* __restrict__ stats, i64 tokens, int D, int n, int K, int splits,
                                             float eps) {
    const i64 total = tokens * K;
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < total; i += (i64)gridDim.x * blockDim.x) {
        const i64 t = i / K;
        const int k = (int)(i - t * K);
        float H = 0.f;
        mhc_coeffs::SumSq q;
        for (int s = 0; s < splits; ++s) {
            const float* row = part + ((i64)s * tokens + t) * (K + 1);
            H += row[k];
            q.add(row[K]);
        }
        if (stats != nullptr) {
            stats[t * (K + 1) + k] = H;
            if (k == 0) stats[t * (K + 1) + K] = q.saved();
        }
        mhc_coeffs::finish_column(alpha, bias, h_pre, h_post, h_res, t, k, n, H, q.rinv(D, eps));
    }
}

// --------------------------------------------------------------- backward
// One warp per token (grid-stride): from the raw sums part [splits, T, K+1]
// and the incoming gradients (any may be null = zero), write
//   dH[t, k] = alpha_grp g_k / r (k < K), dH[t, K] = c = sum_k alpha_grp g_k H_k / (D r^3),
//   dH[t, K+1 .. KP) = 0 (padding), and qa[t, j] = sum_{k in group j} g_k H_k / r.
__global__ void mhc_coeffs_bwd_prep_kernel(const float* __restrict__ part, const float* __restrict__ g_pre,
                                           const float* __restrict__ g_post, const float* __restrict__ g_res,
                                           const float* __restrict__ alpha, float* __restrict__ dH,
                                           float* __restrict__ qa, i64 tokens, int D, int n, int K, int KP,
                                           int splits, float eps) {
    const int lane = threadIdx.x & 31;
    const i64 warps = (i64)gridDim.x * (blockDim.x >> 5);
    const float a0 = alpha[0], a1 = alpha[1], a2 = alpha[2];
    for (i64 t = blockIdx.x * (i64)(blockDim.x >> 5) + (threadIdx.x >> 5); t < tokens; t += warps) {
        mhc_coeffs::SumSq q;
        for (int s = 0; s < splits; ++s) q.add(part[((i64)s * tokens + t) * (K + 1) + K]);
        const float rinv = q.rinv(D, eps);
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
            // products with the normalised mix H / r (O(1) for any |x|): g H itself overflows
            // float32 once |x| ~ 1e19 makes both g (a sum over x) and H large
            const float Hn = H * rinv;
            sc = fmaf(ag, Hn, sc);
            const float gh = g * Hn;
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
            dH[t * KP + K] = sc * rinv * rinv / (float)D;  // (sc / r) / r: no denormal r^-2
            qa[t * 3 + 0] = q0;
            qa[t * 3 + 1] = q1;
            qa[t * 3 + 2] = q2;
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

// ====================================================================== head
// The mHC head (OPS.md section 11, DeepSeek-V4's hc_head): the coefficient
// path with K = n columns, then one weighted sum of the streams.  Per token,
// with hc_fn [n, D] (phi^T: the forward GEMM runs on phi = hc_fn^T through
// mhc_coeffs_mma_fwd_kernel, giving part [splits, T, n+1]):
//   z_k = H~_k / r * scale + base_k,  w_k = sigmoid(z_k) + hc_eps,  out = sum_k w_k x_k.
// Backward, with gw_k = sum_c g_c x_kc and gz_k = gw_k s_k (1 - s_k), s = sigmoid(z):
//   dH_k = gz_k scale / r,  c = sum_k gz_k scale H~_k / (D r^3),
//   dx_k = w_k g + (dH hc_fn)_k - c x_k,  dhc_fn = sum_t dH^T x~,
//   dscale = sum_t sum_k gz_k H~_k / r,  dbase = sum_t gz.
// One block per token (grid-stride) for the per-token kernels; w and dH are
// computed by the first n threads (n <= 32) and shared.  Fixed-order sums
// (mhc::block_sum), no atomics.
namespace mhc_coeffs {

// z = H~ / r * scale + base and w = sigmoid(z) + hc_eps for column k of token t (from the partials).
__device__ __forceinline__ float head_logit(const float* __restrict__ part, const float* __restrict__ hc_scale,
                                            const float* __restrict__ hc_base, i64 t, i64 tokens, int n, int k,
                                            int splits, int D, float rms_eps, float& H, float& rinv) {
    H = 0.f;
    SumSq q;
    for (int s = 0; s < splits; ++s) {
        const float* row = part + ((i64)s * tokens + t) * (n + 1);
        H += row[k];
        q.add(row[n]);
    }
    rinv = q.rinv(D, rms_eps);
    return fmaf(H * rinv, hc_scale[0], hc_base[k]);
}

// acc[e] += coef[j] * rows[j * stride + e] for j < n (rows of T, E consecutive elements each).
template <typename T, int E>
__device__ __forceinline__ void add_rows(float (&acc)[E], const T* __restrict__ rows, i64 stride, int n,
                                         const float* coef) {
    for (int j = 0; j < n; ++j) {
        float v[E];
        mhc::load_vec<T, E>(rows + j * stride, v);
        const float h = coef[j];
#pragma unroll
        for (int e = 0; e < E; ++e) acc[e] = fmaf(h, v[e], acc[e]);
    }
}

}  // namespace mhc_coeffs

// out[c, r] = in[r, c] for a row-major [rows, cols] float32 matrix with few rows (hc_fn
// [n, D] -> phi [D, n] for the forward GEMM), grid-stride over out.
__global__ void mhc_head_transpose_kernel(const float* __restrict__ in, float* __restrict__ out, int rows, i64 cols) {
    const i64 total = cols * rows;
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < total; i += (i64)gridDim.x * blockDim.x) {
        const i64 c = i / rows;
        const int r = (int)(i - c * rows);
        out[i] = in[r * cols + c];
    }
}

// out[t, c] = sum_k w_k x[t, k, c], w from the forward GEMM's partials.  Block: a
// multiple of 32 threads, E elements of C per access.
template <typename T, int E>
__global__ void __launch_bounds__(256)
mhc_head_fwd_kernel(const T* __restrict__ x, const float* __restrict__ part, const float* __restrict__ hc_scale,
                    const float* __restrict__ hc_base, T* __restrict__ out, i64 tokens, int n, int C, int splits,
                    float rms_eps, float hc_eps) {
    __shared__ float s_w[32];
    const int D = n * C;
    for (i64 t = blockIdx.x; t < tokens; t += gridDim.x) {
        __syncthreads();  // the previous token's readers of s_w are done
        if ((int)threadIdx.x < n) {
            float H, rinv;
            const float z = mhc_coeffs::head_logit(part, hc_scale, hc_base, t, tokens, n, threadIdx.x, splits, D,
                                                   rms_eps, H, rinv);
            s_w[threadIdx.x] = mhc::sigmoid(z) + hc_eps;
        }
        __syncthreads();
        const T* xt = x + t * (i64)D;
        for (int c = threadIdx.x * E; c < C; c += blockDim.x * E) {
            float acc[E];
#pragma unroll
            for (int e = 0; e < E; ++e) acc[e] = 0.f;
            mhc_coeffs::add_rows<T, E>(acc, xt + c, C, n, s_w);
            mhc::store_vec<T, E>(out + t * (i64)C + c, acc);
        }
    }
}

// Backward, per token: gw_k = sum_c g_c x_kc (block_sum over NB >= n slots), then
// dH[t, 0..n) = gz scale / r, dH[t, n] = c, dH[t, n+1 .. KP) = 0, w[t, k], gz[t, k] and
// qs[t] = sum_k gz_k H~_k / r (the per-token dscale term).
template <typename T, typename TG, int E, int NB>
__global__ void __launch_bounds__(256)
mhc_head_bwd_prep_kernel(const TG* __restrict__ g, const T* __restrict__ x, const float* __restrict__ part,
                         const float* __restrict__ hc_scale, const float* __restrict__ hc_base,
                         float* __restrict__ dH, float* __restrict__ w_out, float* __restrict__ gz_out,
                         float* __restrict__ qs_out, i64 tokens, int n, int C, int KP, int splits, float rms_eps,
                         float hc_eps) {
    __shared__ float red[NB * 8];
    const int D = n * C;
    const float scale = hc_scale[0];
    for (i64 t = blockIdx.x; t < tokens; t += gridDim.x) {
        float acc[NB];
#pragma unroll
        for (int k = 0; k < NB; ++k) acc[k] = 0.f;
        const T* xt = x + t * (i64)D;
        for (int c = threadIdx.x * E; c < C; c += blockDim.x * E) {
            float gv[E];
            mhc::load_vec<TG, E>(g + t * (i64)C + c, gv);
#pragma unroll
            for (int k = 0; k < NB; ++k) {
                if (k < n) {
                    float v[E];
                    mhc::load_vec<T, E>(xt + (i64)k * C + c, v);
#pragma unroll
                    for (int e = 0; e < E; ++e) acc[k] = fmaf(gv[e], v[e], acc[k]);
                }
            }
        }
        __syncthreads();  // the previous token's readers of red are done
        mhc::block_sum<NB>(acc, red);
        if (threadIdx.x < 32) {  // warp 0: lane k owns column k
            const int k = threadIdx.x;
            float c_part = 0.f, q_part = 0.f, rinv = 0.f;  // rinv: the same for every column (lane 0's is used)
            if (k < n) {
                float H;
                const float z = mhc_coeffs::head_logit(part, hc_scale, hc_base, t, tokens, n, k, splits, D,
                                                       rms_eps, H, rinv);
                const float s = mhc::sigmoid(z);
                const float gz = red[k] * s * (1.f - s);
                dH[t * KP + k] = gz * scale * rinv;
                w_out[t * n + k] = s + hc_eps;
                gz_out[t * n + k] = gz;
                // products with H / r (O(1) for any |x|): gz H overflows float32 once |x| ~ 1e19
                // makes both gz (a sum over x) and H large (as mhc_coeffs_bwd_prep_kernel)
                const float Hn = H * rinv;
                c_part = gz * scale * Hn;
                q_part = gz * Hn;
            }
            c_part = mhc::warp_sum(c_part);
            q_part = mhc::warp_sum(q_part);
            if (k == 0) {
                dH[t * KP + n] = c_part * rinv * rinv / (float)D;  // (c_part / r) / r
                qs_out[t] = q_part;
            }
            for (int j = n + 1 + k; j < KP; j += 32) dH[t * KP + j] = 0.f;
        }
    }
}

// dx[t, k, c] = w_k g_c + sum_j dH[t, j] hc_fn[j, k C + c] - c_t x[t, k, c], one rounding.
// One block per token (grid-stride); a thread owns E consecutive positions of vec(x).
template <typename T, typename TG, int E>
__global__ void __launch_bounds__(256)
mhc_head_bwd_dx_kernel(const TG* __restrict__ g, const T* __restrict__ x, const float* __restrict__ hc_fn,
                       const float* __restrict__ dH, const float* __restrict__ w, T* __restrict__ dx, i64 tokens,
                       int n, int C, int KP) {
    __shared__ float s_dH[33];
    __shared__ float s_w[32];
    const int D = n * C;
    for (i64 t = blockIdx.x; t < tokens; t += gridDim.x) {
        __syncthreads();
        for (int j = threadIdx.x; j <= n; j += blockDim.x) {  // n + 1 values: a block may have only 32 threads
            s_dH[j] = dH[t * KP + j];
            if (j < n) s_w[j] = w[t * n + j];
        }
        __syncthreads();
        const float cx = s_dH[n];
        for (int d = threadIdx.x * E; d < D; d += blockDim.x * E) {
            const int k = d / C, c = d - k * C;  // C % E == 0: the E positions share stream k
            float xv[E], gv[E], acc[E];
            mhc::load_vec<T, E>(x + t * (i64)D + d, xv);
            mhc::load_vec<TG, E>(g + t * (i64)C + c, gv);
            const float wk = s_w[k];
#pragma unroll
            for (int e = 0; e < E; ++e) acc[e] = fmaf(wk, gv[e], -cx * xv[e]);
            mhc_coeffs::add_rows<float, E>(acc, hc_fn + d, D, n, s_dH);
            mhc::store_vec<T, E>(dx + t * (i64)D + d, acc);
        }
    }
}

// ===================================================================== tensor-core path
// The same coefficient path on tensor cores (sm_80+: mma.sync m16n8k16, bf16
// operands, float32 accumulation), float32-accurate by splitting: every
// float32 operand v is written as v = v0 + v1 + v2 + O(2^-24 v) with bf16
// parts v0 = bf16(v), v1 = bf16(v - v0), v2 = bf16(v - v0 - v1); x is one
// part (bf16: exact), two (float16: exact) or three (float32).  The products
// of part pairs (a, b) with a + b <= 2 are accumulated (the others are below
// 2^-24 of the product); bf16 products are exact and the tensor core sums
// them in float32, so the result matches a float32 CUDA-core dot product to
// float32 rounding.  (In dx, rounded to a 16-bit dtype, pairs with a + b <= 1
// suffice: the dropped terms are 2^-16 of the product, far below its ulp.)
//
// The reduction index of an MMA may be permuted freely when both operands
// agree, and so may the rows / columns of the output when the stores know it:
// each thread reads 8 contiguous positions of x with one 16-byte access and
// the other operands are stored in the matching order by the split kernels
// below (per call; they are small: 3 x K x n*C bf16 values for phi).  Tiles
// reach shared memory through cp.async in a STAGES-deep pipeline, so the HBM
// reads of the next steps are in flight while the tensor cores work.
//
// * mhc_coeffs_mma_fwd_kernel<T, VEC, MT, NTILE, STAGES, SUB>: part[split, t, k]
//   = raw H~ over one D range and part[split, t, K] = the sum of squares (as
//   the CUDA-core forward with part != nullptr; mhc_coeffs_fwd_finish_kernel
//   and mhc_coeffs_bwd_prep_kernel consume it; for bf16 x also on the tensor
//   cores, as the diagonal of X X^T).  4 warps; a warp owns MT x 16 tokens and
//   NTILE x 8 columns and walks the block's D range 32 SUB positions a pipeline
//   stage, 32 a sub-step (8 per lane quad member: two MMA k-steps).
// * mhc_coeffs_mma_bwd_kernel<T, TG, VEC, LAYER, N, KS, NQ, STAGES>: block of N
//   warps, warp i owns columns [cb * 64, cb * 64 + 64) of stream i and walks
//   the block's token range 16 tokens a step: dphi[64 positions, K] += x^T dH
//   (x as the A operand, rows = positions), dx[16 tokens, 64] = dH phi^T - c x
//   (dH as the A operand), and with LAYER the rest of the mHC layer's dx:
//   + H_pre_i g_layer_in + sum_j H_res[j, i] g_j (OPS.md sections 6 and 7),
//   rounded once.
namespace mhc_coeffs {

// Steps ahead that the dx kernels ask L2 for the rows of x and the layer's gradients they read
// straight from global memory (mhc::prefetch_l2).
constexpr int DX_PREFETCH = 1;

__device__ __forceinline__ unsigned pack2(unsigned lo, unsigned hi) { return lo | (hi << 16); }

// v = sum of P bf16 parts (as bits), each the bf16 rounding of what is left (rounded toward
// zero where rounding to nearest would overflow: |v| above ~3.39e38, still finite in float32).
template <int P>
__device__ __forceinline__ void split_bits(float v, unsigned (&out)[P]) {
    float r = v;
#pragma unroll
    for (int p = 0; p < P; ++p) {
        __nv_bfloat16 h = __float2bfloat16_rn(r);
        if (p == 0 && __hisinf(h) && !isinf(r)) h = __float2bfloat16_rz(r);
        out[p] = (unsigned)__bfloat16_as_ushort(h);
        r -= __bfloat162float(h);
    }
}

// Parts of an activation dtype: bf16 exactly 1, float16 exactly 2, float32 3.
template <typename T> struct XParts { static constexpr int value = 3; };
template <> struct XParts<__nv_bfloat16> { static constexpr int value = 1; };
template <> struct XParts<__half> { static constexpr int value = 2; };

// d += a * b (m16n8k16, bf16 in, float32 accumulate).
__device__ __forceinline__ void mma16816(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// 16 bytes global -> shared, asynchronously; src_bytes = 0 writes zeros (src is not read).
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(src), "r"(valid ? 16 : 0)
                 : "memory");
}
// ldmatrix .x4: four 8x8 b16 matrices; lane l gives the shared address of row l % 8 of matrix
// l / 8 (16 bytes), and lane t gets elements 2 (t % 4), 2 (t % 4) + 1 of row t / 4 of each, in
// d[0..3] (the mma.m16n8k16 fragment layout).
__device__ __forceinline__ void ldmatrix_x4(unsigned row, unsigned (&d)[4]) {  // row: a shared-space address
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
                 : "r"(row));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// A cp.async ring of STAGES stages over `steps` steps; fill(step, stage) issues one step's copies.
// pipeline_start: the first STAGES - 1 steps, one commit group each (empty past `steps`).
template <int STAGES, typename Fill>
__device__ __forceinline__ void pipeline_start(int steps, Fill&& fill) {
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < steps) fill(s, s);
        cp_async_commit();
    }
}
// pipeline_next, before step `step`: wait for its copies and barrier (every warp is then done
// with step - 1, whose stage is free), then issue step + STAGES - 1 into that stage.  WG: the
// stages are read by wgmma (the async proxy): each thread's copies are fenced before the barrier.
template <int STAGES, bool WG = false, typename Fill>
__device__ __forceinline__ void pipeline_next(int step, int steps, Fill&& fill) {
    cp_async_wait<STAGES - 2>();
    if (WG) mhc_wg::fence_proxy_async();
    __syncthreads();
    if (step + STAGES - 1 < steps) fill(step + STAGES - 1, (step + STAGES - 1) % STAGES);
    cp_async_commit();
}

// One 16-byte chunk of a row of T into shared memory: asynchronously when
// VEC (16-byte aligned, all-or-nothing validity), else element by element
// (elements at positions >= lim, or invalid rows, are zero).
template <typename T, bool VEC>
__device__ __forceinline__ void fill16(void* dst, const T* __restrict__ row, bool row_ok, int pos, int lim) {
    constexpr int E = 16 / (int)sizeof(T);
    if (VEC) {
        const bool ok = row_ok && pos < lim;
        cp_async16(dst, ok ? (const void*)(row + pos) : (const void*)row, ok);
    } else {
        T* d = reinterpret_cast<T*>(dst);
#pragma unroll
        for (int e = 0; e < E; ++e) d[e] = (row_ok && pos + e < lim) ? row[pos + e] : mhc::from_float<T>(0.f);
    }
}

// 8 elements row[pos .. pos + 8) of T from global memory as floats (zeros at positions >= lim).
// VEC: one aligned vector access, all or nothing (lim and pos multiples of 8).
template <typename T, bool VEC>
__device__ __forceinline__ void load8(const T* __restrict__ row, int pos, int lim, float (&v)[8]) {
    if (VEC) {
        if (pos < lim) {
            mhc::load_vec<T, 8>(row + pos, v);
            return;
        }
#pragma unroll
        for (int e = 0; e < 8; ++e) v[e] = 0.f;
    } else {
#pragma unroll
        for (int e = 0; e < 8; ++e) v[e] = pos + e < lim ? mhc::to_float<T>(row[pos + e]) : 0.f;
    }
}

// v as 8 elements row[pos .. pos + 8) of T (none at positions >= lim; VEC as load8).
template <typename T, bool VEC>
__device__ __forceinline__ void store8(T* __restrict__ row, int pos, int lim, const float (&v)[8]) {
    if (VEC) {
        if (pos < lim) mhc::store_vec<T, 8>(row + pos, v);
    } else {
#pragma unroll
        for (int e = 0; e < 8; ++e)
            if (pos + e < lim) row[pos + e] = mhc::from_float<T>(v[e]);
    }
}

// Position of column k of a row in the "fragment order" of the backward planes, in
// chunks of KC k-steps (16 columns each): within chunk s / KC (16 KC values), lane quad
// member q reads its 4 values (k = 2q, 2q+1, 2q+8, 2q+9) of each of the chunk's k-steps
// as 4 KC consecutive values.  The library uses KC = KS (the whole row one chunk): the order of
// mhc_coeffs_mma_bwd_kernel / mhc_coeffs_mma_dx_kernel (mhc_coeffs_mma_dx_tile_kernel reads its
// planes in natural column order with ldmatrix: split_rows with KC = 0).
__device__ __forceinline__ int frag_slot(int k, int KC) {
    const int s = k >> 4, j = k & 15;
    return (s / KC) * 16 * KC + ((j & 7) >> 1) * 4 * KC + (s % KC) * 4 + 2 * (j >> 3) + (j & 1);
}

// Offset of value c of row r of a plane of 16-row groups whose rows r, r + 8 (r % 16 < 8) are
// interleaved word by word (two bf16 a word): row pair q = (r / 16) 8 + r % 8 starts at value
// 2 K16 q, and word w of its rows sits at its words 2w (row r) and 2w + 1 (row r + 8).  Words w,
// w + 1 (w even) of rows g, g + 8, an MMA's A fragment, are then the 16 bytes at value
// 2 K16 q + 4 w, in the register order of mma m16n8k16 (a0 a1 a2 a3): one shared-memory load
// into the registers the MMA reads.  (Two 8-byte loads of rows g and g + 8 needed four register
// moves per fragment, about 150 instructions a step of mhc_coeffs_mma_dx_kernel at n = 8.  The
// n <= 4 backward keeps the plain order: there the same change made ptxas spill, 16-48 bytes.)
__device__ __forceinline__ i64 pair_slot(i64 r, int c, int K16) {
    const i64 q = (r >> 4) * 8 + (r & 7);
    return q * 2 * K16 + (c >> 1) * 4 + ((r >> 3) & 1) * 2 + (c & 1);
}


// ---- the dphi MMAs (x^T dH over 16 tokens), shared by mhc_coeffs_mma_bwd_kernel and
// mhc_coeffs_mma_dphi_kernel.  A operand: 4 m tiles of 16 positions; row g of m tile m is
// position 8 g8 + 2m (row g8 + 8: + 1) of the warp's 64; the reduction index is the token
// (2tq, 2tq+1 | 2tq+8, 2tq+9).  xrow(u): the warp's 64 positions of token u, staged.
template <typename T, typename XRow>
__device__ __forceinline__ void xT_fragments(XRow xrow, int g8, int tq, unsigned (&afr)[4][XParts<T>::value][4]) {
    constexpr int P = XParts<T>::value;
    if constexpr (P == 1) {
        // bf16: word m of a row holds columns 2m (low half) and 2m + 1; pair the halves of two tokens
        unsigned xw[4][4];
#pragma unroll
        for (int u = 0; u < 4; ++u) mhc::load_words<4>(xrow(2 * tq + (u & 1) + 8 * (u >> 1)) + 8 * g8, xw[u]);
#pragma unroll
        for (int m = 0; m < 4; ++m) {
            afr[m][0][0] = __byte_perm(xw[0][m], xw[1][m], 0x5410);
            afr[m][0][1] = __byte_perm(xw[0][m], xw[1][m], 0x7632);
            afr[m][0][2] = __byte_perm(xw[2][m], xw[3][m], 0x5410);
            afr[m][0][3] = __byte_perm(xw[2][m], xw[3][m], 0x7632);
        }
    } else {
        float xv[4][8];
#pragma unroll
        for (int u = 0; u < 4; ++u) mhc::load_vec<T, 8>(xrow(2 * tq + (u & 1) + 8 * (u >> 1)) + 8 * g8, xv[u]);
#pragma unroll
        for (int m = 0; m < 4; ++m) {
            unsigned bits[4][2][P];  // [token u][h][part]
#pragma unroll
            for (int u = 0; u < 4; ++u)
#pragma unroll
                for (int h = 0; h < 2; ++h) split_bits<P>(xv[u][2 * m + h], bits[u][h]);
#pragma unroll
            for (int pa = 0; pa < P; ++pa) {
                afr[m][pa][0] = pack2(bits[0][0][pa], bits[1][0][pa]);
                afr[m][pa][1] = pack2(bits[0][1][pa], bits[1][1][pa]);
                afr[m][pa][2] = pack2(bits[2][0][pa], bits[3][0][pa]);
                afr[m][pa][3] = pack2(bits[2][1][pa], bits[3][1][pa]);
            }
        }
    }
}

// acc[m][q] += x^T dH for NQ column tiles; dhc: the staged dH_c [3][rows][16] (rows per plane).
template <typename T, int NQ>
__device__ __forceinline__ void dphi_mma(float (&acc)[4][NQ][4], const unsigned (&afr)[4][XParts<T>::value][4],
                                         const __nv_bfloat16* dhc, int rows, int g8, int tq) {
    constexpr int P = XParts<T>::value;
    unsigned bp[NQ][3][2];
#pragma unroll
    for (int q = 0; q < NQ; ++q)
#pragma unroll
        for (int p = 0; p < 3; ++p) {
            const __nv_bfloat16* col = dhc + (p * rows + 8 * q + g8) * 16 + 2 * tq;
            bp[q][p][0] = *reinterpret_cast<const unsigned*>(col);
            bp[q][p][1] = *reinterpret_cast<const unsigned*>(col + 8);
        }
#pragma unroll
    for (int pa = 0; pa < P; ++pa)
#pragma unroll
        for (int pb = 0; pb + pa < 3; ++pb)
#pragma unroll
            for (int q = 0; q < NQ; ++q)
#pragma unroll
                for (int m = 0; m < 4; ++m) mma16816(acc[m][q], afr[m][pa], bp[q][pb][0], bp[q][pb][1]);
}

// out[(base + pos) * K + k] = acc for the warp's rows pos = pos0 + 8 g8 + 2m + h below lim and
// columns k = k0 + 8q + 2tq + e below K.
template <int NQ>
__device__ __forceinline__ void store_dphi(float* __restrict__ out, const float (&acc)[4][NQ][4], i64 base, int pos0,
                                           int lim, int K, int k0, int g8, int tq) {
#pragma unroll
    for (int m = 0; m < 4; ++m)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int pos = pos0 + 8 * g8 + 2 * m + h;
            if (pos >= lim) continue;
            const i64 d = base + pos;
#pragma unroll
            for (int q = 0; q < NQ; ++q)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int k = k0 + 8 * q + 2 * tq + e;
                    if (k < K) out[d * K + k] = acc[m][q][2 * h + e];
                }
        }
}

}  // namespace mhc_coeffs

// phi [D, K] float32 -> planes [3, Kp, Dp] bf16 (transposed, zero padded):
// plane p holds part p of each value.  Grid-stride over Kp * Dp.
__global__ void mhc_coeffs_split_phi_fwd_kernel(const float* __restrict__ phi, __nv_bfloat16* __restrict__ planes,
                                                int D, int K, int Dp, int Kp) {
    const i64 total = (i64)Kp * Dp;
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < total; i += (i64)gridDim.x * blockDim.x) {
        const int k = (int)(i / Dp), d = (int)(i - (i64)k * Dp);
        const float v = (k < K && d < D) ? phi[(i64)d * K + k] : 0.f;
        unsigned p[3];
        mhc_coeffs::split_bits<3>(v, p);
#pragma unroll
        for (int j = 0; j < 3; ++j) planes[j * total + i] = __ushort_as_bfloat16((unsigned short)p[j]);
    }
}

// src [rows, K] float32 (row stride ld) -> planes [3, rows_p, K16] bf16, columns in
// fragment order of KC k-steps a chunk (mhc_coeffs::frag_slot; KC divides K16 / 16), or in
// their own order for KC = 0 (read with ldmatrix), zero padded.  For phi (rows = D) and dH
// (rows = tokens) in the backward.  pairs (rows_p a multiple of 16): rows r and r + 8 of each 16
// rows interleaved word by word (mhc_coeffs::pair_slot; dH of mhc_coeffs_mma_dx_kernel).
__global__ void mhc_coeffs_split_rows_kernel(const float* __restrict__ src, __nv_bfloat16* __restrict__ planes,
                                             i64 rows, int K, int ld, i64 rows_p, int K16, int KC, int pairs) {
    const i64 total = rows_p * K16;
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < total; i += (i64)gridDim.x * blockDim.x) {
        const i64 r = i / K16;
        const int k = (int)(i - r * K16);
        const float v = (r < rows && k < K) ? src[r * ld + k] : 0.f;
        unsigned p[3];
        mhc_coeffs::split_bits<3>(v, p);
        const int c = KC ? mhc_coeffs::frag_slot(k, KC) : k;
        const i64 o = pairs ? mhc_coeffs::pair_slot(r, c, K16) : r * K16 + c;
#pragma unroll
        for (int j = 0; j < 3; ++j) planes[j * total + o] = __ushort_as_bfloat16((unsigned short)p[j]);
    }
}

// dH [tokens, ld] float32 (first K columns) -> planes [3, Kp8, tokens_p] bf16
// (transposed, zero padded).  Grid-stride over Kp8 * tokens_p.
__global__ void mhc_coeffs_split_cols_kernel(const float* __restrict__ src, __nv_bfloat16* __restrict__ planes,
                                             i64 tokens, int K, int ld, i64 tokens_p, int Kp8) {
    const i64 total = (i64)Kp8 * tokens_p;
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < total; i += (i64)gridDim.x * blockDim.x) {
        const int k = (int)(i / tokens_p);
        const i64 t = i - (i64)k * tokens_p;
        const float v = (t < tokens && k < K) ? src[t * ld + k] : 0.f;
        unsigned p[3];
        mhc_coeffs::split_bits<3>(v, p);
#pragma unroll
        for (int j = 0; j < 3; ++j) planes[j * total + i] = __ushort_as_bfloat16((unsigned short)p[j]);
    }
}

// Grid: blockIdx.x = (split * tiles + tile) * ncc + cc, as the CUDA-core forward; 128 threads.
// planes: [3, Kp, Dp] (mhc_coeffs_split_phi_fwd_kernel), Kp = ncc * NTILE * 8, Dp a
// multiple of 32 SUB >= D; d_split a multiple of 32 SUB.  VEC: D % 8 == 0 and x 16-byte aligned.
// A stage holds SUB sub-steps of 32 positions, 128 bytes of each token row (SUB = 2 for 16-bit x,
// 1 for float32): HBM serves 64-byte pieces of 128 rows at about 57 % of a copy's bandwidth and
// 128-byte pieces at full speed (H200, scripts/hbm_row_pieces.py "rows": 2.4 against 4.2 TB/s).
// Rows of x and phi are then 128 bytes (16-bit x): the 16-byte chunks of odd rows are stored
// swapped by halves (chunk c at c ^ 4), so that the 8 lanes of a quarter warp (rows g and g + 1,
// 4 chunks each) read distinct banks.
// Dynamic shared memory: STAGES * SUB * (4 * MT * 16 * 32 * sizeof(T) + 3 * NTILE * 8 * 64) bytes.
template <typename T, bool VEC, int MT, int NTILE, int STAGES, int SUB>
__global__ void __launch_bounds__(128)
mhc_coeffs_mma_fwd_kernel(const T* __restrict__ x, const __nv_bfloat16* __restrict__ planes,
                          float* __restrict__ part, i64 tokens, int D, int Dp, int K, int Kp, int ncc, i64 tiles,
                          int d_split) {
    using namespace mhc_coeffs;
    constexpr int P = XParts<T>::value;
    constexpr int TOK = 4 * MT * 16;                 // tokens per block
    constexpr int STEP = 32 * SUB;                   // positions per stage
    constexpr int XROW = STEP * (int)sizeof(T);      // bytes of one token's positions in a stage
    constexpr int PROW = STEP * 2;                   // bytes of one phi column's positions (bf16)
    constexpr int XB = TOK * XROW;                   // x bytes per stage
    constexpr int KC = NTILE * 8;                    // columns per block
    constexpr int SB = XB + 3 * KC * PROW;           // stage bytes
    constexpr int SWZ = (XROW == 128 && PROW == 128) ? 4 : 0;  // chunk c of an odd row sits at c ^ SWZ
    extern __shared__ __align__(16) unsigned char smem[];

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, tq = lane & 3;
    const unsigned b = blockIdx.x, rest = b / (unsigned)ncc;
    const int cc = (int)(b - rest * (unsigned)ncc);
    const unsigned split_u = rest / (unsigned)tiles;
    const i64 tile = rest - split_u * (unsigned)tiles;
    const int split = (int)split_u;
    const int kc0 = cc * KC;
    const int d_begin = split * d_split;
    const int d_end = min(D, d_begin + d_split);
    const int steps = (d_end - d_begin + STEP - 1) / STEP;
    const i64 plane = (i64)Kp * Dp;

    // The copies of a step: every thread copies chunk xq of XN token rows and PN (or PN - 1)
    // 16-byte pieces of the phi planes; their sources are fixed but for the step's offset d0.
    constexpr int XC = XROW / 16;                 // 16-byte chunks per token row
    constexpr int XN = TOK * XC / 128;            // x chunks per thread
    constexpr int PCR = PROW / 16;                // 16-byte chunks per phi row
    constexpr int PC = 3 * KC * PCR;              // phi chunks per step
    constexpr int PN = (PC + 127) / 128;          // phi chunks per thread (at most)
    static_assert(128 % XC == 0, "a thread copies one chunk position of its rows");
    constexpr int XRS = 128 / XC;                 // rows between a thread's chunks (even)
    const int xq = threadIdx.x % XC, xr0 = threadIdx.x / XC;
    const i64 xt0 = tile * TOK + xr0;             // the thread's first row; then every XRS rows
    const T* const xrow0 = x + min(xt0, tokens - 1) * (i64)D;
    const int xdst0 = xr0 * XROW + (xq ^ ((xr0 & 1) * SWZ)) * 16;
    const __nv_bfloat16* prow[PN];
    int pdst[PN];
#pragma unroll
    for (int j = 0; j < PN; ++j) {
        const int c = min(threadIdx.x + 128 * j, PC - 1), r = c / PCR, q = c % PCR, p = r / KC, k = r - p * KC;
        prow[j] = planes + p * plane + (i64)(kc0 + k) * Dp + q * 8;
        pdst[j] = XB + r * PROW + (q ^ ((r & 1) * SWZ)) * 16;
    }
    auto fill = [&](int step, int stage) {
        unsigned char* st = smem + stage * SB;
        const int d0 = d_begin + step * STEP;
#pragma unroll
        for (int j = 0; j < XN; ++j) {
            const bool ok = xt0 + j * XRS < tokens;
            fill16<T, VEC>(st + xdst0 + j * XRS * XROW, ok ? xrow0 + (i64)j * XRS * D : x, ok,
                           d0 + xq * (16 / (int)sizeof(T)), d_end);
        }
#pragma unroll
        for (int j = 0; j < PN; ++j)
            if (PC % 128 == 0 || threadIdx.x + 128 * j < PC) cp_async16(st + pdst[j], prow[j] + d0, true);
    };

    float acc[MT][NTILE][4], ss[MT][2];
#pragma unroll
    for (int m = 0; m < MT; ++m) {
        ss[m][0] = ss[m][1] = 0.f;
#pragma unroll
        for (int q = 0; q < NTILE; ++q)
#pragma unroll
            for (int r = 0; r < 4; ++r) acc[m][q][r] = 0.f;
    }

    pipeline_start<STAGES>(steps, fill);
    for (int i = 0; i < steps; ++i) {
        pipeline_next<STAGES>(i, steps, fill);  // step i in shared memory, every warp done with i - 1
        const unsigned char* st = smem + (i % STAGES) * SB;
#pragma unroll (NTILE > 5 ? 1 : SUB)  // NTILE 6 unrolled: 140 bytes of spills on sm_80
        for (int sub = 0; sub < SUB; ++sub) {
            // byte offsets of this lane's 8 positions (8 tq ..) of sub-step sub: in a phi row (the
            // rows this lane reads have the parity of g), and in an x row (g, g + 8 of an m tile)
            const int phi_o = (sub * 64 + tq * 16) ^ ((g & 1) * SWZ * 16);
            const int x_o = SWZ ? phi_o : (sub * 32 + tq * 8) * (int)sizeof(T);
            // phi: 8 consecutive positions of column kc0 + 8q + g, every plane
            unsigned bw[NTILE][3][4];
#pragma unroll
            for (int q = 0; q < NTILE; ++q)
#pragma unroll
                for (int p = 0; p < 3; ++p) mhc::load_words<4>(st + XB + (p * KC + 8 * q + g) * PROW + phi_o, bw[q][p]);
            // x: the same 8 positions of rows g and g + 8 of each m tile, split into P parts
            // (bf16: the fragments are the stored words themselves)
            unsigned aw[MT][P][2][4];  // [m][part][row half][word]
#pragma unroll
            for (int m = 0; m < MT; ++m)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const unsigned char* src = st + (warp * MT * 16 + m * 16 + g + 8 * h) * XROW + x_o;
                    if constexpr (P == 1) {
                        mhc::load_words<4>(src, aw[m][0][h]);  // the sum of squares: below, on the tensor cores
                    } else {
                        float v[8];
                        mhc::load_vec<T, 8>(reinterpret_cast<const T*>(src), v);
                        unsigned bits[8][P];
#pragma unroll
                        for (int e = 0; e < 8; ++e) {
                            ss[m][h] = fmaf(v[e], v[e], ss[m][h]);
                            split_bits<P>(v[e], bits[e]);
                        }
#pragma unroll
                        for (int p = 0; p < P; ++p)
#pragma unroll
                            for (int w = 0; w < 4; ++w) aw[m][p][h][w] = pack2(bits[2 * w][p], bits[2 * w + 1][p]);
                    }
                }
            // k-step j uses positions 8 tq + 4j .. + 3 (logical k 2tq, 2tq+1 | 2tq+8, 2tq+9); the
            // accumulator of consecutive MMAs differs (m innermost) so they do not wait on each other.
            // The sub-step's products go into a fresh accumulator, added to acc in float32 (round to
            // nearest): the tensor cores' own accumulation truncates, which over the thousands of
            // MMAs of a long D range left up to 2e-5 of max |H~| (H200, D = 131072; 8e-7 with this,
            // at no measured cost: tests/test_coeffs.py::test_coeffs_float32_accurate_over_long_rows).
            float stp[MT][NTILE][4];
            mhc::zero(stp);
#pragma unroll
            for (int j = 0; j < 2; ++j)
#pragma unroll
                for (int pa = 0; pa < P; ++pa)
#pragma unroll
                    for (int pb = 0; pb + pa < 3; ++pb)
#pragma unroll
                        for (int q = 0; q < NTILE; ++q)
#pragma unroll
                            for (int m = 0; m < MT; ++m) {
                                const unsigned a[4] = {aw[m][pa][0][2 * j], aw[m][pa][1][2 * j],
                                                       aw[m][pa][0][2 * j + 1], aw[m][pa][1][2 * j + 1]};
                                mma16816(stp[m][q], a, bw[q][pb][2 * j], bw[q][pb][2 * j + 1]);
                            }
            mhc::add(acc, stp);
            if (P == 1 && cc == 0) {  // (only column chunk 0 writes the sums of squares)
                // bf16: the sub-step's sums of squares as the diagonal of X X^T (products exact,
                // summed in float32 as H~): B = X^T of the same 16 positions is A's own words, rows g
                // (a0, a2) for the tokens 0-7 of the m tile, rows g + 8 (a1, a3) for 8-15.  Diagonal
                // entry g of each half sits in lane quad member tq = g / 2, element g % 2 (+ 2 for
                // rows g + 8).
#pragma unroll
                for (int m = 0; m < MT; ++m) {
                    float sq[2][4];
                    mhc::zero(sq);
#pragma unroll
                    for (int j = 0; j < 2; ++j) {
                        const unsigned a[4] = {aw[m][0][0][2 * j], aw[m][0][1][2 * j], aw[m][0][0][2 * j + 1],
                                               aw[m][0][1][2 * j + 1]};
                        mma16816(sq[0], a, a[0], a[2]);
                        mma16816(sq[1], a, a[1], a[3]);
                    }
                    if (tq == (g >> 1)) {
                        ss[m][0] += (g & 1) ? sq[0][1] : sq[0][0];
                        ss[m][1] += (g & 1) ? sq[1][3] : sq[1][2];
                    }
                }
            }
        }
    }
    cp_async_wait<0>();

    const i64 tok0 = tile * TOK + warp * MT * 16;
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float s = ss[m][h];
            s += __shfl_xor_sync(0xffffffffu, s, 1);
            s += __shfl_xor_sync(0xffffffffu, s, 2);
            const i64 t = tok0 + m * 16 + g + 8 * h;
            if (t >= tokens) continue;
            float* row = part + ((i64)split * tokens + t) * (K + 1);
            if (cc == 0 && tq == 0)  // after an overflow: minus the scaled sum (see SumSq)
                row[K] = isinf(s) ? -mhc_coeffs::scaled_sumsq<T>(x + t * (i64)D, d_begin, d_end) : s;
#pragma unroll
            for (int q = 0; q < NTILE; ++q)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int k = kc0 + 8 * q + 2 * tq + e;
                    if (k < K) row[k] = acc[m][q][2 * h + e];
                }
        }
}

// The forward GEMM on Hopper's warpgroup MMA (wgmma, sm_90a; kernels_cu/wgmma.cuh), bf16 x:
// part[split, t, k] = raw H~ over one D range and part[split, t, K] = its sum of squares, as
// mhc_coeffs_mma_fwd_kernel (same grid, same D ranges, the three bf16 planes of phi: products
// float32-accurate; each 64-position stage into fresh accumulators, added to acc in float32).
// One warpgroup (128 threads) a block: MT m64 tiles of tokens (64 MT tokens) x KC columns (N of
// the wgmma).  VEC: D % 8 == 0 and x 16-byte aligned (cp.async of 16 bytes), else element-wise
// fills (mhc_coeffs::fill16): the same sums either way.  Shared memory per stage: x [64 MT / 8 row
// groups][8 chunks][8 rows][16 B], then phi [3][KC / 8][8 chunks][8 columns][16 B] (wgmma.cuh's
// K-major layout, LBO 128, SBO 1024); planes (global, mhc_coeffs_split_phi_wg_kernel):
// [ncc][Dp / 64][3][KC / 8][8][8][8], one stage of a column chunk contiguous (a linear copy).
// The sums of squares (stored by column chunk 0): thread r of 128 (of 64 with MT = 1: two threads a row,
// added in order) sums its row's bf16 values in float32 from shared memory while the tensor cores work.
// Dynamic shared memory: STAGES * (64 MT * 128 + 3 * KC * 128) bytes.
template <bool VEC, int KC, int MT, int STAGES>
__global__ void __launch_bounds__(128)
mhc_coeffs_wg_fwd_kernel(const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ planes,
                         float* __restrict__ part, i64 tokens, int D, int Dp, int K, int ncc, i64 tiles,
                         int d_split) {
    using namespace mhc_coeffs;
    constexpr int TOK = 64 * MT;
    constexpr int XB = TOK * 128;          // x bytes per stage
    constexpr int SB = XB + 3 * KC * 128;  // stage bytes
    constexpr int R = KC / 2;              // accumulators per thread and m tile
    constexpr int RS = 128 / TOK;          // threads per row in the sums of squares
    static_assert(KC % 8 == 0 && KC <= 256 && (MT == 1 || MT == 2), "m64nNk16 tiles");
    extern __shared__ __align__(128) unsigned char smem[];

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, tq = lane & 3;
    const unsigned b = blockIdx.x, rest = b / (unsigned)ncc;
    const int cc = (int)(b - rest * (unsigned)ncc);
    const unsigned split_u = rest / (unsigned)tiles;
    const i64 tile = rest - split_u * (unsigned)tiles;
    const int split = (int)split_u;
    const int d_begin = split * d_split;
    const int d_end = min(D, d_begin + d_split);
    const int steps = (d_end - d_begin + 63) / 64;
    const __nv_bfloat16* const psrc = planes + ((i64)cc * (Dp / 64) + d_begin / 64) * (3 * KC * 64);

    auto fill = [&](int step, int stage) {
        unsigned char* st = smem + stage * SB;
        const int d0 = d_begin + step * 64;
#pragma unroll
        for (int j = 0; j < MT * 4; ++j) {  // chunk c: row (c / 64) 8 + c % 8, positions d0 + 8 ((c / 8) % 8) ..
            const int c = tid + 128 * j;
            const i64 t = tile * TOK + (c >> 6) * 8 + (c & 7);
            const int pos = d0 + ((c >> 3) & 7) * 8;
            const bool ok = t < tokens;
            fill16<__nv_bfloat16, VEC>(st + c * 16, ok ? x + t * D : x, ok, pos, d_end);
        }
        const __nv_bfloat16* src = psrc + (i64)step * (3 * KC * 64);
        constexpr int PC = 3 * KC * 8;
#pragma unroll
        for (int j = 0; j < (PC + 127) / 128; ++j) {
            const int c = tid + 128 * j;
            if (PC % 128 == 0 || c < PC) cp_async16(st + XB + c * 16, src + c * 8, true);
        }
    };

    float acc[MT][R], stp[MT][R];
    mhc::zero(acc);
    mhc::zero(stp);
    float ss = 0.f;
    const int srow = tid % TOK, spart = tid / TOK;

    pipeline_start<STAGES>(steps, fill);
    for (int i = 0; i < steps; ++i) {
        pipeline_next<STAGES, true>(i, steps, fill);
        const unsigned char* st = smem + (i % STAGES) * SB;
#pragma unroll
        for (int m = 0; m < MT; ++m) mhc_wg::reg_fence(stp[m]);
        mhc_wg::fence();
#pragma unroll
        for (int s = 0; s < 4; ++s)
#pragma unroll
            for (int p = 0; p < 3; ++p)
#pragma unroll
                for (int m = 0; m < MT; ++m)
                    mhc_wg::Mma<KC, 0>::run(stp[m], mhc_wg::desc(st + m * 8192 + s * 256, 128, 1024),
                                            mhc_wg::desc(st + XB + p * KC * 128 + s * 256, 128, 1024), (s | p) != 0);
        mhc_wg::commit();
        // the sums of squares while the tensor cores work (every column chunk: a branch on cc here made
        // ptxas keep far more registers, 72 -> 166 at KC = 24; chunk 0 stores them)
#pragma unroll
        for (int k = 0; k < 8 / RS; ++k) {
            const int kc = spart * (8 / RS) + k;
            unsigned w[4];
            mhc::load_words<4>(st + (srow >> 3) * 1024 + kc * 128 + (srow & 7) * 16, w);
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float lo = __uint_as_float(w[e] << 16), hi = __uint_as_float(w[e] & 0xffff0000u);
                ss = fmaf(lo, lo, ss);
                ss = fmaf(hi, hi, ss);
            }
        }
        mhc_wg::wait<0>();
#pragma unroll
        for (int m = 0; m < MT; ++m) {
            mhc_wg::reg_fence(stp[m]);
#pragma unroll
            for (int r = 0; r < R; ++r) acc[m][r] += stp[m][r];
        }
    }
    cp_async_wait<0>();
    __syncthreads();
    float* red = reinterpret_cast<float*>(smem);
    if (RS > 1) red[tid] = ss;
    __syncthreads();
    if (cc == 0 && spart == 0) {
        float s = ss;
#pragma unroll
        for (int q = 1; q < RS; ++q) s += red[srow + q * TOK];
        const i64 t = tile * TOK + srow;
        if (t < tokens)  // after an overflow: minus the scaled sum (see SumSq)
            part[((i64)split * tokens + t) * (K + 1) + K] =
                isinf(s) ? -scaled_sumsq<__nv_bfloat16>(x + t * (i64)D, d_begin, d_end) : s;
    }
    const int kc0 = cc * KC;
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const i64 t = tile * TOK + m * 64 + warp * 16 + g + 8 * h;
            if (t >= tokens) continue;
            float* row = part + ((i64)split * tokens + t) * (K + 1);
#pragma unroll
            for (int j = 0; j < KC / 8; ++j)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int k = kc0 + 8 * j + 2 * tq + e;
                    if (k < K) row[k] = acc[m][4 * j + 2 * h + e];
                }
        }
}

// phi [D, K] float32 -> the planes of mhc_coeffs_wg_fwd_kernel: [ncc][Dp / 64][3][KC / 8][8 chunks][8
// columns][8 positions] bf16 (column kc0 + k of chunk cc, position d; zero past K and D).  Grid-stride.
__global__ void mhc_coeffs_split_phi_wg_kernel(const float* __restrict__ phi, __nv_bfloat16* __restrict__ planes,
                                               int D, int K, int Dp, int KC, int ncc) {
    const i64 per_p = (i64)KC * 64;  // values of one plane of one stage
    const i64 total = (i64)ncc * (Dp / 64) * 3 * per_p;
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < total; i += (i64)gridDim.x * blockDim.x) {
        const i64 blk = i / (3 * per_p);  // cc * (Dp / 64) + step
        const int rem = (int)(i - blk * 3 * per_p);
        const int p = rem / (int)per_p, w = rem - p * (int)per_p;
        const int cg = w >> 9, chunk = (w >> 6) & 7, col = (w >> 3) & 7, e = w & 7;
        const int cc = (int)(blk / (Dp / 64)), step = (int)(blk - (i64)cc * (Dp / 64));
        const int k = cc * KC + cg * 8 + col, d = step * 64 + chunk * 8 + e;
        const float v = (k < K && d < D) ? phi[(i64)d * K + k] : 0.f;
        unsigned bits[3];
        mhc_coeffs::split_bits<3>(v, bits);
        planes[i] = __ushort_as_bfloat16((unsigned short)(p == 0 ? bits[0] : p == 1 ? bits[1] : bits[2]));
    }
}

// Backward on tensor cores.  Grid (cblocks = ceil(C / 64), splits), n warps per
// block: warp i owns positions i * C + [cb * 64, cb * 64 + 64) (stream i) and the
// block walks tokens [s * t_split, min(tokens, (s + 1) * t_split)) (t_split a
// multiple of 16), 16 a step.
//   phi_r: [3, D, K16] bf16 (split_rows of phi);  dH_r: [3, tokens_p, K16]
//   (split_rows of dH);  dH_c: [3, Kp8, tokens_p] (split_cols of dH), tokens_p a
//   multiple of 16 >= tokens;  dH: [tokens, KP] float32, column K = c.
//   LAYER: g [tokens, n, C] and g_li [tokens, C] (dtype TG), H_pre [tokens, n],
//   H_res [tokens, n, n] add the pre and post ops' parts of the layer's dx: the post op's
//   sum_j H_res[j, i] g_j, or with res_t (convention="deepseek", H_res transposed in the
//   post op) sum_j H_res[i, j] g_j; then gx [tokens, n, C] (dtype TG, may be null: another
//   gradient of x, e.g. the post op's dx).
//   dphi: partials [splits, D, K] (the output with one split).
// VEC: C % 8 == 0 and x, dx (and g, g_li, gx) 16-byte aligned.  KS = K16 / 16, NQ = Kp8 / 8.
// Dynamic shared memory: MmaBwd.pipeline (ops/coeffs.py; phi and dH_r in PO planes: 2 for 16-bit x, 3 for float32).
// 3 blocks of 4 warps per SM need at most 168 registers a thread; the launch bound asks ptxas for
// them with 16-bit x (NVRTC 12.9, sm_90, n = 4: bf16 164 with the layer's g staged, 151 without,
// no spills; fp16 168 with 12 bytes spilled, where unbounded it took 171 / 178 and 2 blocks fit:
// 2-5 % slower layer fwd+bwd on the H200).  float32 x (over 200 registers) has no bound.
// Per step a thread's addresses are the block's first token row plus int token offsets (u below),
// no 64-bit token arithmetic (before: 1,490 instructions a warp per 16-token step, ncu, bf16 n = 4
// layer, most of them address and predicate work of the copies and the per-token loads).
template <typename T, typename TG, bool VEC, bool LAYER, int N, int KS, int NQ, int STAGES>
__global__ void __launch_bounds__(128, sizeof(T) == 2 ? 3 : 1)
mhc_coeffs_mma_bwd_kernel(const T* __restrict__ x, const __nv_bfloat16* __restrict__ phi_r,
                          const __nv_bfloat16* __restrict__ dH_r, const __nv_bfloat16* __restrict__ dH_c,
                          const float* __restrict__ dH, const TG* __restrict__ g, const TG* __restrict__ g_li,
                          const float* __restrict__ H_pre, const float* __restrict__ H_res,
                          const TG* __restrict__ gx, T* __restrict__ dx, float* __restrict__ dphi, i64 tokens,
                          i64 tokens_p, int C, int K, int KP, i64 t_split, int res_t) {
    using namespace mhc_coeffs;
    constexpr int P = XParts<T>::value;
    constexpr int PO = sizeof(T) == 4 ? 3 : 2;
    constexpr int K16 = KS * 16, Kp8 = NQ * 8;
    extern __shared__ __align__(16) unsigned char smem[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g8 = lane >> 2, tq = lane & 3;
    constexpr int n = N, nw = N * 64;  // streams, positions of the block
    const int cb0 = blockIdx.x * 64;
    const int D = n * C;
    const i64 t_begin = (i64)blockIdx.y * t_split;
    const int rows = (int)max(min(tokens, t_begin + t_split) - t_begin, (i64)0);  // tokens of the block
    const int steps = (rows + 15) / 16;
    const i64 plane_r = tokens_p * K16, plane_c = (i64)Kp8 * tokens_p, plane_phi = (i64)D * K16;
    const int res_j = res_t ? 1 : n, res_i = res_t ? n : 1;  // H_res element (j, i) of this warp's row i
    // Token u of the block's range (u < rows) is token t_begin + u; addresses of a token row are
    // the block's first row plus u rows (int u: only the row's stride is 64-bit).  Rows at or past
    // `rows` are clamped to the last valid one (an address never read: cp.async of 0 bytes).
    const T* const x0 = x + t_begin * D + warp * C;  // this warp's stream
    auto row_of = [&](int u) { return (i64)min(u, rows - 1); };
    const TG* const gli0 = LAYER && g_li != nullptr ? g_li + t_begin * C : nullptr;
    const float* const dH0 = dH + t_begin * KP + K;  // c of the block's first token
    const float* const hp0 = LAYER ? H_pre + t_begin * n + warp : nullptr;
    const float* const hr0 = LAYER ? H_res + t_begin * (n * n) + warp * res_i : nullptr;

    // shared memory: phi rows of the block (PO planes), then STAGES stages of
    // x [16][n][64] T | dH_r [PO][16][K16] | dH_c [3][Kp8][16] (| GS: g [n][16][64] TG), the
    // token rows of x padded by 16 bytes (no bank conflicts between tokens); g's 128-byte rows
    // unpadded, 16-byte chunk q of token row u at slot q ^ (u & 7) (conflict-free reads below).
    // GS (LAYER, vector path, 16-bit gradients): the layer's g comes with the step's copies, zero
    // where absent, and every warp reads all n streams from there; g_li (and without GS, g too)
    // the epilogue reads from global memory, its lines asked of L2 a step ahead.  At n = 4 bf16
    // with 2 stages a block takes 74,752 bytes: 3 blocks per SM where an SM has 228 KiB.
    constexpr bool GS = LAYER && VEC && sizeof(TG) == 2;
    constexpr int GR = 64 * (int)sizeof(TG);  // g row bytes (GS)
    __nv_bfloat16* s_phi = reinterpret_cast<__nv_bfloat16*>(smem);
    constexpr int XR = nw * (int)sizeof(T) + 16;  // token row bytes
    constexpr int XB = 16 * XR, RB = PO * 16 * K16 * 2, CB = 3 * Kp8 * 16 * 2;
    constexpr int SB = XB + RB + CB + (GS ? n * 16 * GR : 0);
    unsigned char* stages = smem + PO * nw * K16 * 2;

    // phi rows of the block's positions (zero where the column is past C)
    for (int c = threadIdx.x; c < PO * nw * (K16 / 8); c += blockDim.x) {
        const int r = c / (K16 / 8), q = c - r * (K16 / 8);  // r = p * nw + i * 64 + cl
        const int p = r / nw, pos = r - p * nw, i = pos >> 6, cl = pos & 63;
        const bool ok = cb0 + cl < C;
        cp_async16(s_phi + (i64)r * K16 + q * 8, phi_r + p * plane_phi + (i64)(i * C + (ok ? cb0 + cl : 0)) * K16 + q * 8,
                   ok);
    }
    // The copies of a step: a lane's chunks of x and g are chunk q of token rows u0 + j (32 / XC)
    // of the step; dH_r / dH_c pieces c = threadIdx.x + 32 N j at fixed offsets past the step's token.
    constexpr int XC = 64 * (int)sizeof(T) / 16, GC = 64 * (int)sizeof(TG) / 16;  // 16-byte chunks per row
    // dH_r, dH_c chunks per step; threads of the block (launch_mma_bwd launches 32 n)
    constexpr int RC = PO * 16 * K16 / 8, CC = 3 * Kp8 * 2, NT = 32 * N;
    const int xq = lane % XC, xu0 = lane / XC;
    // the vector path's chunk column (all or nothing; 0 where past C: a valid address, not read)
    const bool xcol = cb0 + xq * (16 / (int)sizeof(T)) < C;
    const int xpos = xcol ? cb0 + xq * (16 / (int)sizeof(T)) : 0;
    const int gq = lane % GC;  // g's (GS)
    const bool gcol = g != nullptr && cb0 + gq * 8 < C;
    const int gpos = gcol ? cb0 + gq * 8 : 0;
    auto fill = [&](int step, int stage) {
        unsigned char* st = stages + stage * SB;
        const int u0 = step * 16;
        // x: warp i copies the rows of stream i (the only ones it reads), 16 XC / 32 chunks a lane
#pragma unroll
        for (int j = 0; j < 16 * XC / 32; ++j) {
            const int u = xu0 + j * (32 / XC), lu = u0 + u;
            unsigned char* dst = st + u * XR + warp * 64 * (int)sizeof(T) + xq * 16;
            const T* row = x0 + row_of(lu) * D;
            if constexpr (VEC) cp_async16(dst, row + xpos, lu < rows && xcol);
            else fill16<T, false>(dst, row, lu < rows, cb0 + xq * (16 / (int)sizeof(T)), C);
        }
        const i64 t0 = t_begin + u0;
#pragma unroll
        for (int j = 0; j < (RC + NT - 1) / NT; ++j) {
            const int c = threadIdx.x + NT * j;
            if (RC % NT != 0 && c >= RC) break;
            const int p = c / (16 * K16 / 8), o = c - p * (16 * K16 / 8);
            cp_async16(st + XB + c * 16, dH_r + p * plane_r + t0 * K16 + o * 8, true);
        }
#pragma unroll
        for (int j = 0; j < (CC + NT - 1) / NT; ++j) {
            const int c = threadIdx.x + NT * j;
            if (CC % NT != 0 && c >= CC) break;
            const int r = c >> 1, q = c & 1, p = r / Kp8, k = r - p * Kp8;
            cp_async16(st + XB + RB + c * 16, dH_c + p * plane_c + (i64)k * tokens_p + t0 + q * 8, true);
        }
        if constexpr (GS) {
            // g: warp i copies the rows of stream i (as x), chunk q of row u to slot q ^ (u & 7)
            // (zeros where g is absent: the epilogue adds them unconditionally)
            unsigned char* sg = st + XB + RB + CB;
            const TG* g0 = g != nullptr ? g + t_begin * D + warp * C : reinterpret_cast<const TG*>(x0);
#pragma unroll
            for (int j = 0; j < 16 * GC / 32; ++j) {
                const int u = lane / GC + j * (32 / GC), lu = u0 + u;
                cp_async16(sg + (warp * 16 + u) * GR + (gq ^ (u & 7)) * 16, g0 + row_of(lu) * D + gpos,
                           lu < rows && gcol);
            }
        }
    };

    float accp[4][NQ][4];  // dphi: [m tile of 16 positions][column tile][fragment]
    mhc::zero(accp);

    pipeline_start<STAGES>(steps, fill);  // the first group also holds the phi rows
    const __nv_bfloat16* ph = s_phi + (warp * 64) * K16;  // this warp's rows, plane 0
    for (int step = 0; step < steps; ++step) {
        pipeline_next<STAGES>(step, steps, fill);
        const unsigned char* st = stages + (step % STAGES) * SB;
        // row of stream i of token u of this step's x tile
        auto xrow = [&](int u, int i) { return reinterpret_cast<const T*>(st + u * XR) + i * 64; };
        const __nv_bfloat16* dhr = reinterpret_cast<const __nv_bfloat16*>(st + XB);
        const __nv_bfloat16* dhc = reinterpret_cast<const __nv_bfloat16*>(st + XB + RB);
        const int u0 = step * 16;  // the step's first token (of the block's)
        // LAYER, vector path: the g_li rows (warp 0) and, not staged (!GS: float32), the g rows
        // (warp i: stream i) of step + DX_PREFETCH into L2: lanes tq = 0 and 3 ask for the lines
        // of the first and the last 8 of a row's 64 columns
        if (LAYER && VEC && (tq == 0 || tq == 3) && step + DX_PREFETCH < steps) {
            const int pc = tq == 0 ? cb0 : min(cb0 + 56, C - 8);
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int u = u0 + 16 * DX_PREFETCH + g8 + 8 * h;
                if (u >= rows) continue;
                if (g_li != nullptr && (!GS || warp == 0)) mhc::prefetch_l2(gli0 + (i64)u * C + pc);
                if (!GS && g != nullptr) mhc::prefetch_l2(g + (t_begin + u) * D + warp * C + pc);
            }
        }
        // Per-token scalars of this thread's two dx rows (tokens g8, g8 + 8), loaded now so their
        // latency hides behind the MMAs: c, and with LAYER H_pre[t, i] and H_res[t, :, i].
        float cs[2], hp[2], hr[2][n];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int u = u0 + g8 + 8 * h;
            const bool ok = u < rows;
            cs[h] = ok ? dH0[(i64)u * KP] : 0.f;
            hp[h] = (LAYER && ok) ? hp0[u * n] : 0.f;
#pragma unroll
            for (int j = 0; j < n; ++j) hr[h][j] = (LAYER && ok) ? hr0[(i64)u * (n * n) + j * res_j] : 0.f;
        }

        // ---- dphi += x^T dH (mhc_coeffs::xT_fragments)
        {
            unsigned afr[4][P][4];
            xT_fragments<T>([&](int u) { return xrow(u, warp); }, g8, tq, afr);
            dphi_mma<T, NQ>(accp, afr, dhc, Kp8, g8, tq);
        }
        // ---- dx = dH phi^T - c x (+ layer terms).  A rows: tokens g8, g8 + 8; B column g8 of
        // n tile j: column 16 (g8 >> 1) + 2j + (g8 & 1); accumulator (tq, e) of tile j: column 16 tq + 2j + e.
        {
            float acc[8][4];
            mhc::zero(acc);
            unsigned aw[PO][2][2 * KS];  // [part][row half][word]: words 2s, 2s + 1 of k-step s
#pragma unroll
            for (int p = 0; p < PO; ++p)
#pragma unroll
                for (int h = 0; h < 2; ++h)
                    mhc::load_words<2 * KS>(dhr + (p * 16 + g8 + 8 * h) * K16 + tq * 4 * KS, aw[p][h]);
#pragma unroll
            for (int j0 = 0; j0 < 8; j0 += 4) {
                unsigned bw[4][PO][2 * KS];  // [tile][part][word]
#pragma unroll
                for (int jj = 0; jj < 4; ++jj) {
                    const int pos = 16 * (g8 >> 1) + 2 * (j0 + jj) + (g8 & 1);
#pragma unroll
                    for (int p = 0; p < PO; ++p)
                        mhc::load_words<2 * KS>(ph + (p * nw + pos) * K16 + tq * 4 * KS, bw[jj][p]);
                }
#pragma unroll
                for (int s = 0; s < KS; ++s)
#pragma unroll
                    for (int pa = 0; pa < PO; ++pa)
#pragma unroll
                        for (int pb = 0; pb + pa < PO; ++pb) {
                            const unsigned a[4] = {aw[pa][0][2 * s], aw[pa][1][2 * s], aw[pa][0][2 * s + 1],
                                                   aw[pa][1][2 * s + 1]};
#pragma unroll
                            for (int jj = 0; jj < 4; ++jj)
                                mma16816(acc[j0 + jj], a, bw[jj][pb][2 * s], bw[jj][pb][2 * s + 1]);
                        }
            }
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int u = g8 + 8 * h;
                if (u0 + u >= rows) continue;
                const i64 t = t_begin + u0 + u;
#pragma unroll
                for (int half = 0; half < 2; ++half) {
                    const int cl = 16 * tq + 8 * half;
                    const int col = cb0 + cl;
                    float xv[8], o[8];
                    mhc::load_vec<T, 8>(xrow(u, warp) + cl, xv);
#pragma unroll
                    for (int e8 = 0; e8 < 8; ++e8)
                        o[e8] = fmaf(-cs[h], xv[e8], acc[4 * half + (e8 >> 1)][2 * h + (e8 & 1)]);
                    if constexpr (GS) {
                        // g_li (zeros where absent, added all the same: the bits of a staged zero
                        // row), then the streams in order (the order of the path below), from the stage
                        float gv[8];
                        if (g_li != nullptr) {
                            load8<TG, VEC>(gli0 + (i64)(u0 + u) * C, col, C, gv);
                        } else {
#pragma unroll
                            for (int e8 = 0; e8 < 8; ++e8) gv[e8] = 0.f;
                        }
#pragma unroll
                        for (int e8 = 0; e8 < 8; ++e8) o[e8] = fmaf(hp[h], gv[e8], o[e8]);
                        const unsigned char* sg = st + XB + RB + CB + u * GR + (((cl >> 3) ^ (u & 7)) << 4);
#pragma unroll
                        for (int j = 0; j < n; ++j) {
                            unsigned ww[4];
                            mhc::load_words<4>(sg + j * 16 * GR, ww);
#pragma unroll
                            for (int e8 = 0; e8 < 8; ++e8)
                                o[e8] = fmaf(hr[h][j], mhc::word_elem<TG>(ww[e8 >> 1], e8 & 1), o[e8]);
                        }
                    } else if (LAYER) {
                        float gv[8];
                        if (g_li != nullptr) {
                            load8<TG, VEC>(gli0 + (i64)(u0 + u) * C, col, C, gv);
#pragma unroll
                            for (int e8 = 0; e8 < 8; ++e8) o[e8] = fmaf(hp[h], gv[e8], o[e8]);
                        }
                        if (g != nullptr) {
#pragma unroll
                            for (int j = 0; j < n; ++j) {
                                load8<TG, VEC>(g + t * (i64)D + j * C, col, C, gv);
#pragma unroll
                                for (int e8 = 0; e8 < 8; ++e8) o[e8] = fmaf(hr[h][j], gv[e8], o[e8]);
                            }
                        }
                    }
                    if constexpr (LAYER) {
                        if (gx != nullptr) {
                            float gv[8];
                            load8<TG, VEC>(gx + t * (i64)D + warp * C, col, C, gv);
#pragma unroll
                            for (int e8 = 0; e8 < 8; ++e8) o[e8] += gv[e8];
                        }
                    }
                    store8<T, VEC>(dx + t * (i64)D + warp * C, col, C, o);
                }
            }
        }
    }
    cp_async_wait<0>();
    store_dphi<NQ>(dphi + (i64)blockIdx.y * D * (i64)K, accp, (i64)warp * C, cb0, C, K, 0, g8, tq);
}

// ------------------------------------------------------- backward on tensor cores, K > 32
// With more than 32 columns (n > 4) one warp cannot hold dphi's accumulators for all of
// them and dx's reduction at once, so dphi and dx are two kernels (same bf16 planes).
//
// mhc_coeffs_mma_dphi_kernel<T, VEC, NQ, STAGES>: dphi[d, k] += sum_t x[t, d] dH[t, k].
// Grid (pblocks * ncc, splits), 4 warps: the block owns positions [pb * 256, pb * 256 + 256)
// of D (warp w: the 64 from pb * 256 + 64 w) and columns [cc * 8 NQ, cc * 8 NQ + 8 NQ), and
// walks tokens [split * t_split, min(tokens, (split + 1) * t_split)) (t_split a multiple of
// 16) 16 a step, x [16][256] T and dH_c [3][8 NQ][16] per stage.  A operand x^T and
// fragments as the dphi part of mhc_coeffs_mma_bwd_kernel.
//   dH_c: [3, Kc, tokens_p] (split_cols of dH, Kc = ncc * 8 NQ columns, zero past K).
//   dphi: partials [splits, D, K] (the output with one split).
// VEC: D % 8 == 0 and x 16-byte aligned.  Dynamic shared memory: STAGES * (16 * (256 *
// sizeof(T) + 16) + 3 * 8 NQ * 32) bytes.
template <typename T, bool VEC, int NQ, int STAGES>
__global__ void __launch_bounds__(128)
mhc_coeffs_mma_dphi_kernel(const T* __restrict__ x, const __nv_bfloat16* __restrict__ dH_c, float* __restrict__ dphi,
                           i64 tokens, i64 tokens_p, int D, int K, int Kc, int ncc, i64 t_split) {
    using namespace mhc_coeffs;
    constexpr int P = XParts<T>::value;
    constexpr int XR = 256 * (int)sizeof(T) + 16;  // token row bytes (padded: no bank conflicts between tokens)
    constexpr int XB = 16 * XR, SB = XB + 3 * NQ * 8 * 32;
    extern __shared__ __align__(16) unsigned char smem[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g8 = lane >> 2, tq = lane & 3;
    const int pb = (int)(blockIdx.x / (unsigned)ncc), cc = (int)(blockIdx.x - (unsigned)pb * ncc);
    const int d0 = pb * 256, k0 = cc * NQ * 8;
    const i64 t_begin = (i64)blockIdx.y * t_split;
    const i64 t_end = min(tokens, t_begin + t_split);
    const int steps = (int)((max(t_end - t_begin, (i64)0) + 15) / 16);
    const i64 plane_c = (i64)Kc * tokens_p;

    // The copies of a step: chunk xq of XN token rows (u = xu0 + j 128 / XC) and HN (or HN - 1)
    // 16-byte halves of dH_c rows p * 8 NQ + k, whose sources differ from step to step by t0 only.
    constexpr int XC = 256 * (int)sizeof(T) / 16;  // 16-byte chunks per token row (32 or 64)
    constexpr int XN = 16 * XC / 128;
    constexpr int HC = 3 * NQ * 8 * 2, HN = (HC + 127) / 128;
    const int xq = threadIdx.x % XC, xu0 = threadIdx.x / XC;
    const __nv_bfloat16* hsrc[HN];
#pragma unroll
    for (int j = 0; j < HN; ++j) {
        const int c = min((int)threadIdx.x + 128 * j, HC - 1), r = c >> 1, p = r / (NQ * 8), k = r - p * (NQ * 8);
        hsrc[j] = dH_c + p * plane_c + (i64)(k0 + k) * tokens_p + (c & 1) * 8;
    }
    auto fill = [&](int step, int stage) {
        unsigned char* st = smem + stage * SB;
        const i64 t0 = t_begin + step * 16;
#pragma unroll
        for (int j = 0; j < XN; ++j) {
            const int u = xu0 + j * (128 / XC);
            const i64 t = t0 + u;
            const bool ok = t < t_end;
            fill16<T, VEC>(st + u * XR + xq * 16, x + (ok ? t : 0) * (i64)D, ok, d0 + xq * (16 / (int)sizeof(T)), D);
        }
#pragma unroll
        for (int j = 0; j < HN; ++j)
            if (HC % 128 == 0 || (int)threadIdx.x + 128 * j < HC)
                cp_async16(st + XB + (threadIdx.x + 128 * j) * 16, hsrc[j] + t0, true);
    };

    float acc[4][NQ][4];  // [m tile of 16 positions][column tile][fragment]
    mhc::zero(acc);
    pipeline_start<STAGES>(steps, fill);
    for (int step = 0; step < steps; ++step) {
        pipeline_next<STAGES>(step, steps, fill);
        const unsigned char* st = smem + (step % STAGES) * SB;
        unsigned afr[4][P][4];
        xT_fragments<T>([&](int u) { return reinterpret_cast<const T*>(st + u * XR) + warp * 64; }, g8, tq, afr);
        dphi_mma<T, NQ>(acc, afr, reinterpret_cast<const __nv_bfloat16*>(st + XB), NQ * 8, g8, tq);
    }
    cp_async_wait<0>();
    store_dphi<NQ>(dphi + (i64)blockIdx.y * D * (i64)K, acc, 0, d0 + warp * 64, D, K, k0, g8, tq);
}

// The end of 8 columns [col, col + 8) of dx row (token t, stream i) of the tensor-core dx kernels,
// o = (dH phi^T - c x) there: with LAYER + H_pre_i g_li (lv: g_li's 8 values, hp = H_pre[t, i])
// + sum_j H_res[j, i] g_j (res_t: H_res[i, j]) + gx_i (gxv), the terms whose pointer is not null,
// in that order; then o is rounded to T and stored (columns below C).
template <typename T, typename TG, bool VEC, bool LAYER>
__device__ __forceinline__ void dx_finish(float (&o)[8], float hp, const float (&lv)[8], const float (&gxv)[8],
                                          const TG* __restrict__ g, const TG* __restrict__ g_li,
                                          const TG* __restrict__ gx, const float* __restrict__ H_res,
                                          T* __restrict__ dx, i64 t, int n, int i, int C, int D, int col,
                                          int res_t) {
    if constexpr (LAYER) {
        if (g_li != nullptr) {
#pragma unroll
            for (int e8 = 0; e8 < 8; ++e8) o[e8] = fmaf(hp, lv[e8], o[e8]);
        }
        if (g != nullptr) {
            float gv[8];
            for (int j = 0; j < n; ++j) {
                const float w = H_res[t * n * n + (res_t ? i * n + j : j * n + i)];
                mhc_coeffs::load8<TG, VEC>(g + t * (i64)D + j * C, col, C, gv);
#pragma unroll
                for (int e8 = 0; e8 < 8; ++e8) o[e8] = fmaf(w, gv[e8], o[e8]);
            }
        }
        if (gx != nullptr) {
#pragma unroll
            for (int e8 = 0; e8 < 8; ++e8) o[e8] += gxv[e8];
        }
    }
    mhc_coeffs::store8<T, VEC>(dx + t * (i64)D + (i64)i * C, col, C, o);
}

// mhc_coeffs_mma_dx_kernel<T, TG, VEC, LAYER, KS, W, NT, STAGES>: dx = dH phi^T - c x (+ with
// LAYER the rest of the layer's dx, as mhc_coeffs_mma_bwd_kernel), rounded once.  Grid
// (cblocks * groups, splits), groups = n / W, W warps of NT 8-column MMA tiles (NT = 8 or 4,
// CW = 8 NT columns): warp w owns positions i * C + [cb * CW, cb * CW + CW) of stream
// i = group * W + w; the block keeps those positions' phi rows (PO planes, bf16) in shared
// memory and walks tokens [split * t_split, ...) 16 a step, dH_r [PO][16][K16] per stage
// (split_rows with pairs: rows g, g + 8 interleaved, mhc_coeffs::pair_slot).
// A operand dH, B operand phi, fragments as the dx part of mhc_coeffs_mma_bwd_kernel (PO = 2
// planes of each for 16-bit T: the dropped products are 2^-16 of the result, below its ulp; 3
// for float32).  Each dx value is the same sum in the same order for either NT; the library runs
// NT = 4 (ops/coeffs.py _DX_NT: half the phi rows, more blocks per SM, measured faster).
// VEC: C % 8 == 0 and x, dx (and g, g_li, gx) 16-byte aligned.  Dynamic shared memory:
// (W * CW * K16 + STAGES * 16 * K16) * PO * 2 bytes.
template <typename T, typename TG, bool VEC, bool LAYER, int KS, int W, int NT, int STAGES>
__global__ void __launch_bounds__(32 * W)
mhc_coeffs_mma_dx_kernel(const T* __restrict__ x, const __nv_bfloat16* __restrict__ phi_r,
                         const __nv_bfloat16* __restrict__ dH_r, const float* __restrict__ dH,
                         const TG* __restrict__ g, const TG* __restrict__ g_li, const float* __restrict__ H_pre,
                         const float* __restrict__ H_res, const TG* __restrict__ gx, T* __restrict__ dx, i64 tokens,
                         i64 tokens_p, int n, int C, int K, int KP, int groups, i64 t_split, int res_t) {
    using namespace mhc_coeffs;
    constexpr int PO = sizeof(T) == 4 ? 3 : 2;
    static_assert(NT == 8 || NT == 4, "8 or 4 column tiles per warp");
    constexpr int K16 = KS * 16, CW = 8 * NT, NW = CW * W;
    constexpr int SB = PO * 16 * K16 * 2;  // stage bytes
    extern __shared__ __align__(16) unsigned char smem[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g8 = lane >> 2, tq = lane & 3;
    const int cb = (int)(blockIdx.x / (unsigned)groups), grp = (int)(blockIdx.x - (unsigned)cb * groups);
    const int cb0 = cb * CW, i = grp * W + warp;
    const int D = n * C;
    const i64 t_begin = (i64)blockIdx.y * t_split;
    const i64 t_end = min(tokens, t_begin + t_split);
    const int steps = (int)((max(t_end - t_begin, (i64)0) + 15) / 16);
    const i64 plane_r = tokens_p * K16, plane_phi = (i64)D * K16;
    __nv_bfloat16* s_phi = reinterpret_cast<__nv_bfloat16*>(smem);  // [PO][NW][K16]
    unsigned char* stages = smem + PO * NW * K16 * 2;

    // phi rows of the block's positions (zero where the column is past C)
    for (int c = threadIdx.x; c < PO * NW * (K16 / 8); c += 32 * W) {
        const int r = c / (K16 / 8), q = c - r * (K16 / 8);  // r = p * NW + w * CW + cl
        const int p = r / NW, pos = r - p * NW, w = pos / CW, cl = pos - w * CW;
        const bool ok = cb0 + cl < C;
        cp_async16(s_phi + (i64)r * K16 + q * 8,
                   phi_r + p * plane_phi + (i64)((grp * W + w) * C + (ok ? cb0 + cl : 0)) * K16 + q * 8, ok);
    }
    constexpr int RC = 16 * K16 / 8;  // 16-byte pieces of a plane's 16 rows (contiguous in dH_r)
    auto fill = [&](int step, int stage) {
        unsigned char* st = stages + stage * SB;
        const __nv_bfloat16* src = dH_r + (t_begin + step * 16) * K16;
#pragma unroll
        for (int p = 0; p < PO; ++p)
#pragma unroll
            for (int c0 = 0; c0 < RC; c0 += 32 * W) {
                const int c = c0 + (int)threadIdx.x;
                if (RC % (32 * W) == 0 || c < RC) cp_async16(st + (p * RC + c) * 16, src + p * plane_r + c * 8, true);
            }
    };
    pipeline_start<STAGES>(steps, fill);  // the first group also holds the phi rows
    const __nv_bfloat16* ph = s_phi + (warp * CW) * K16;  // this warp's rows, plane 0
    const T* xi = x + (i64)i * C;
    for (int step = 0; step < steps; ++step) {
        pipeline_next<STAGES>(step, steps, fill);
        const __nv_bfloat16* dhr = reinterpret_cast<const __nv_bfloat16*>(stages + (step % STAGES) * SB);
        const i64 t0 = t_begin + step * 16;
        // the rows of step + DX_PREFETCH into L2: lanes tq = 0 and 3 ask for the lines of the
        // first and the last 8 of the warp's CW columns of a row
        if (VEC && (tq == 0 || tq == 3) && step + DX_PREFETCH < steps) {
            const int pc = tq == 0 ? cb0 : min(cb0 + CW - 8, C - 8);
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const i64 t = t0 + 16 * DX_PREFETCH + g8 + 8 * h;
                if (t >= t_end) continue;
                mhc::prefetch_l2(xi + t * (i64)D + pc);
                if (LAYER && g_li != nullptr) mhc::prefetch_l2(g_li + t * (i64)C + pc);
                if (LAYER && gx != nullptr) mhc::prefetch_l2(gx + t * (i64)D + (i64)i * C + pc);
            }
        }
        // this thread's rows (tokens g8, g8 + 8) x 2 NT columns of x and c, and with LAYER of
        // g_li (with H_pre) and gx, loaded before the MMAs so that their latency hides behind them
        constexpr int LR = LAYER ? 2 : 1;
        float xv[2][NT / 4][8], cs[2], lv[LR][NT / 4][8], gxv[LR][NT / 4][8], hp[LR];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const i64 t = t0 + g8 + 8 * h;
            const bool ok = t < t_end;
            const int lim = ok ? C : 0;
            cs[h] = ok ? dH[t * KP + K] : 0.f;
#pragma unroll
            for (int half = 0; half < NT / 4; ++half) {
                const int col = cb0 + 2 * NT * tq + 8 * half;
                load8<T, VEC>(xi + (ok ? t : 0) * (i64)D, col, lim, xv[h][half]);
                if constexpr (LAYER) {
                    if (g_li != nullptr) load8<TG, VEC>(g_li + (ok ? t : 0) * (i64)C, col, lim, lv[h][half]);
                    if (gx != nullptr) load8<TG, VEC>(gx + (ok ? t : 0) * (i64)D + (i64)i * C, col, lim, gxv[h][half]);
                }
            }
            if constexpr (LAYER) hp[h] = (ok && g_li != nullptr) ? H_pre[t * n + i] : 0.f;
        }
        // A rows: tokens g8, g8 + 8; B column g8 of n tile j: position 2 NT (g8 >> 1) + 2j + (g8 & 1);
        // accumulator (tq, e) of tile j: column 2 NT tq + 2j + e.
        float acc[NT][4];
        mhc::zero(acc);
#pragma unroll
        for (int s = 0; s < KS; ++s) {
            unsigned a[PO][4];  // the A fragments: rows g8, g8 + 8 of dH_r interleaved (mhc_coeffs::pair_slot)
#pragma unroll
            for (int p = 0; p < PO; ++p) mhc::load_words<4>(dhr + p * 16 * K16 + 2 * g8 * K16 + 8 * (tq * KS + s), a[p]);
#pragma unroll
            for (int j = 0; j < NT; ++j) {
                const int pos = 2 * NT * (g8 >> 1) + 2 * j + (g8 & 1);
                unsigned b[PO][2];
#pragma unroll
                for (int p = 0; p < PO; ++p) mhc::load_words<2>(ph + (p * NW + pos) * K16 + tq * 4 * KS + 4 * s, b[p]);
#pragma unroll
                for (int pa = 0; pa < PO; ++pa)
#pragma unroll
                    for (int pb = 0; pb + pa < PO; ++pb) mma16816(acc[j], a[pa], b[pb][0], b[pb][1]);
            }
        }
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const i64 t = t0 + g8 + 8 * h;
            if (t >= t_end) continue;
#pragma unroll
            for (int half = 0; half < NT / 4; ++half) {
                const int col = cb0 + 2 * NT * tq + 8 * half;
                float o[8];
#pragma unroll
                for (int e8 = 0; e8 < 8; ++e8)
                    o[e8] = fmaf(-cs[h], xv[h][half][e8], acc[4 * half + (e8 >> 1)][2 * h + (e8 & 1)]);
                dx_finish<T, TG, VEC, LAYER>(o, hp[LAYER ? h : 0], lv[LAYER ? h : 0][half], gxv[LAYER ? h : 0][half], g,
                                             g_li, gx, H_res, dx, t, n, i, C, D, col, res_t);
            }
        }
    }
    cp_async_wait<0>();
}

// mhc_coeffs_mma_dx_tile_kernel<T, TG, VEC, LAYER, KS, W, MT, STAGES>: the dx of
// mhc_coeffs_mma_dx_kernel (the same sums in the same order: bit for bit) for any K: phi's rows
// are not kept in shared memory but streamed with dH's in chunks of two k-steps (32 columns of
// K), so a block covers more tokens a step and any n fits.  Grid (cblocks * groups, splits),
// cblocks = ceil(C / 32), groups = n / W; 4 warps, warp (wm, w) (wm < WM = 4 / W, w < W) owns
// stream i = group * W + w, columns [cb * 32, cb * 32 + 32) and the MT 16-token m tiles
// wm * MT .. of each step of BT = 16 WM MT tokens; the block walks tokens [split * t_split,
// ...) (t_split a multiple of BT) a step at a time and each step's K in KS / 2 chunks.  A stage
// holds one chunk: dH_r [PO][BT][32] and phi_r [PO][32 W][32] (bf16; 64-byte rows of four
// 16-byte pieces, XOR-swizzled: ldmatrix reads the MMA fragments without bank conflicts and
// without register moves).  The epilogue reads x, g_li, gx from global memory; their lines are
// asked of L2 at the step's first chunk.
//   phi_r: [3, D, K16], dH_r: [3, tokens_p, K16] (split_rows with KC = 0: columns in their own
//   order), K16 = 16 KS, KS even.
// VEC: C % 8 == 0 and x, dx (and g, g_li, gx) 16-byte aligned.  Dynamic shared memory:
// STAGES * PO * (BT + 32 W) * 64 bytes.
template <typename T, typename TG, bool VEC, bool LAYER, int KS, int W, int MT, int STAGES>
__global__ void __launch_bounds__(128)
mhc_coeffs_mma_dx_tile_kernel(const T* __restrict__ x, const __nv_bfloat16* __restrict__ phi_r,
                              const __nv_bfloat16* __restrict__ dH_r, const float* __restrict__ dH,
                              const TG* __restrict__ g, const TG* __restrict__ g_li, const float* __restrict__ H_pre,
                              const float* __restrict__ H_res, const TG* __restrict__ gx, T* __restrict__ dx,
                              i64 tokens, i64 tokens_p, int n, int C, int K, int KP, int groups, i64 t_split,
                              int res_t) {
    using namespace mhc_coeffs;
    constexpr int PO = sizeof(T) == 4 ? 3 : 2;
    static_assert(KS % 2 == 0 && (W == 1 || W == 2 || W == 4), "even k-steps, 1, 2 or 4 streams a block");
    constexpr int WM = 4 / W, BT = 16 * WM * MT, NW = 32 * W, KCN = KS / 2, K16 = 16 * KS;
    constexpr int ROW = 64;                       // bytes of a row's chunk (32 bf16)
    constexpr int AB = PO * BT * ROW, SB = AB + PO * NW * ROW;
    extern __shared__ __align__(16) unsigned char smem[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g8 = lane >> 2, tq = lane & 3, wm = warp / W, w = warp - wm * W;
    const int cb = (int)(blockIdx.x / (unsigned)groups), grp = (int)(blockIdx.x - (unsigned)cb * groups);
    const int cb0 = cb * 32, i = grp * W + w;
    const i64 D = (i64)n * C;
    const i64 t_begin = (i64)blockIdx.y * t_split;
    const i64 t_end = min(tokens, t_begin + t_split);
    const int steps = (int)((max(t_end - t_begin, (i64)0) + BT - 1) / BT);
    const int iters = steps * KCN;
    const i64 plane_r = tokens_p * K16, plane_phi = D * K16;
    const int ks_real = (K + 15) / 16;  // k-steps of K (KS may be one more)

    // The copies of an iteration: 16-byte pieces c = threadIdx.x + 128 j, piece (c & 3) of row c >> 2 =
    // u0 + 32 j (u0 = threadIdx.x >> 2).  dH_r rows p * BT + u: plane j / JB, token u0 + 32 (j % JB)
    // of the step (JB = BT / 32); phi_r rows p * NW + 32 w' + cl: plane j / W, stream group * W + j % W,
    // column cb0 + u0.  So the sources are one pointer each plus offsets that are constants or
    // loop-invariant (written so that they stay cheap: precomputed per-copy pointers were recomputed
    // in the loop by ptxas, about 28 instructions a copy).
    static_assert(BT % 32 == 0, "BT a multiple of 32 (whole 128-piece rounds)");
    constexpr int JB = BT / 32, HN = PO * JB, FN = PO * W;
    const int u0 = threadIdx.x >> 2, q8 = (threadIdx.x & 3) * 8;
    const __nv_bfloat16* hbase = dH_r + (i64)u0 * K16 + q8;
    const bool fok = cb0 + u0 < C;
    const __nv_bfloat16* fbase = phi_r + ((i64)grp * W * C + (fok ? cb0 + u0 : 0)) * K16 + q8;
    const i64 stream_stride = (i64)C * K16;
    // Stage rows are 64 bytes (4 pieces of 16); piece c of row r sits at slot c ^ swz(r),
    // swz(r) = ((r >> 1) ^ (r >> 3)) & 3, so that the 8 rows of each ldmatrix below (8 consecutive
    // dH_r rows; phi_r rows 8 q + 2 j + b, q < 4) cover all 32 banks.  This thread's rows u0 + 32 j
    // share swz(u0).
    const int slot = (threadIdx.x & 3) ^ (((u0 >> 1) ^ (u0 >> 3)) & 3);
    auto fill = [&](int it, int stage) {
        unsigned char* st = smem + stage * SB + u0 * ROW + slot * 16;
        const int step = it / KCN, k0 = (it - step * KCN) * 32;
        const i64 t0 = t_begin + (i64)step * BT;
        const __nv_bfloat16* h = hbase + t0 * K16 + k0;
#pragma unroll
        for (int j = 0; j < HN; ++j) {
            const bool ok = t0 + u0 + 32 * (j % JB) < tokens_p;
            cp_async16(st + j * 2048, ok ? h + (j / JB) * plane_r + (j % JB) * 32 * K16 : dH_r, ok);
        }
        const __nv_bfloat16* f = fbase + k0;
#pragma unroll
        for (int j = 0; j < FN; ++j) cp_async16(st + AB + j * 2048, f + (j / W) * plane_phi + (j % W) * stream_stride, fok);
    };

    // The fragments by ldmatrix (lane l gives row l % 8 of matrix l / 8).  A (m tile wm MT + m,
    // plane p, k-step sl): matrices rows 0-7 / 8-15, pieces 2 sl (k 0-7) / 2 sl + 1 (k 8-15) ->
    // a0..a3.  B (n tile j, plane p): rows 8 (r >> 1) + 2j + (r & 1) of the warp's 32 (column r
    // of tile j), pieces 0..3 -> b0, b1 of k-step 0, then of k-step 1.  With swz as above, this
    // lane's A slot is s0 ^ 2 ((m + sl) & 1) and its B slot t0s ^ j; planes are 32-row multiples.
    const int lr = lane & 7, lm = lane >> 3;
    const int ra = wm * MT * 16 + lr + 8 * (lm & 1), s0 = ((lm >> 1) ^ (ra >> 1) ^ (ra >> 3)) & 3;
    const unsigned a_off[2] = {(unsigned)(ra * ROW + s0 * 16), (unsigned)(ra * ROW + (s0 ^ 2) * 16)};
    const int rb = 32 * w + 8 * (lr >> 1) + (lr & 1), t0s = (lm ^ (lr >> 1)) & 3;
    const unsigned b_off = (unsigned)(AB + rb * ROW + t0s * 16);  // tile j: (b_off ^ 16 j) + 128 j
    const unsigned s_smem = (unsigned)__cvta_generic_to_shared(smem);

    const T* xi = x + (i64)i * C;
    const int col = cb0 + 8 * tq;  // this thread's 8 columns of each of its rows
    float acc[MT][4][4];           // [m tile][n tile j][fragment]: column 8 tq + 2j + e of row g8 (+ 8)
    pipeline_start<STAGES>(iters, fill);
    for (int it = 0; it < iters; ++it) {
        pipeline_next<STAGES>(it, iters, fill);
        const int step = it / KCN, kc = it - step * KCN;
        const i64 t0 = t_begin + (i64)step * BT + (wm * MT) * 16;  // this warp's first token
        if (kc == 0) {
            mhc::zero(acc);
            // the epilogue's rows into L2: lanes tq = 0 and 3 ask for the lines of the first
            // and the last 8 of the warp's 32 columns
            if (VEC && (tq == 0 || tq == 3)) {
                const int pc = tq == 0 ? cb0 : min(cb0 + 24, C - 8);
#pragma unroll
                for (int m = 0; m < MT; ++m)
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const i64 t = t0 + 16 * m + g8 + 8 * h;
                        if (t >= t_end) continue;
                        mhc::prefetch_l2(xi + t * D + pc);
                        if (LAYER && g_li != nullptr) mhc::prefetch_l2(g_li + t * (i64)C + pc);
                        if (LAYER && gx != nullptr) mhc::prefetch_l2(gx + t * D + (i64)i * C + pc);
                    }
            }
        }
        // A: rows 16 (wm MT + m) + g8 (+ 8) of dH_r; B: column g8 of n tile j = position
        // 8 (g8 >> 1) + 2j + (g8 & 1) of the warp's 32 (accumulator (tq, e): column 8 tq + 2j + e).
        // Words 0, 1: the chunk's first k-step, 2, 3: its second.
        const unsigned sst = s_smem + (unsigned)((it % STAGES) * SB);
        unsigned a[MT][PO][2][4], b[4][PO][4];
#pragma unroll
        for (int m = 0; m < MT; ++m)
#pragma unroll
            for (int p = 0; p < PO; ++p)
#pragma unroll
                for (int sl = 0; sl < 2; ++sl)
                    ldmatrix_x4(sst + a_off[(m + sl) & 1] + (p * BT + m * 16) * ROW, a[m][p][sl]);
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int p = 0; p < PO; ++p) ldmatrix_x4(sst + ((b_off ^ (16 * j)) + 128 * j) + p * NW * ROW, b[j][p]);
        // per accumulator: k-step, then part pairs (pa, pb) in mhc_coeffs_mma_dx_kernel's order;
        // the k-step that only pads K16 to an even count is skipped (its operands are zero)
#pragma unroll
        for (int sl = 0; sl < 2; ++sl) {
            if (2 * kc + sl >= ks_real) break;
#pragma unroll
            for (int m = 0; m < MT; ++m)
#pragma unroll
                for (int j = 0; j < 4; ++j)
#pragma unroll
                    for (int pa = 0; pa < PO; ++pa)
#pragma unroll
                        for (int pb = 0; pb + pa < PO; ++pb) {
                            mma16816(acc[m][j], a[m][pa][sl], b[j][pb][2 * sl], b[j][pb][2 * sl + 1]);
                        }
        }
        if (kc != KCN - 1) continue;
#pragma unroll
        for (int m = 0; m < MT; ++m)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const i64 t = t0 + 16 * m + g8 + 8 * h;
                if (t >= t_end) continue;
                float xv[8], lv[8], gxv[8], o[8];
                load8<T, VEC>(xi + t * D, col, C, xv);
                float hp = 0.f;
                if constexpr (LAYER) {
                    if (g_li != nullptr) {
                        hp = H_pre[t * n + i];
                        load8<TG, VEC>(g_li + t * (i64)C, col, C, lv);
                    }
                    if (gx != nullptr) load8<TG, VEC>(gx + t * D + (i64)i * C, col, C, gxv);
                }
                const float c = dH[t * KP + K];
#pragma unroll
                for (int e8 = 0; e8 < 8; ++e8) o[e8] = fmaf(-c, xv[e8], acc[m][e8 >> 1][2 * h + (e8 & 1)]);
                dx_finish<T, TG, VEC, LAYER>(o, hp, lv, gxv, g, g_li, gx, H_res, dx, t, n, i, C, (int)D, col, res_t);
            }
    }
    cp_async_wait<0>();
}

namespace mhc_coeffs {
// 16 bytes of global memory (16-byte aligned), as raw words; value e8 of 8 bf16 in them as float.
__device__ __forceinline__ uint4 ldg16(const __nv_bfloat16* p) { return *reinterpret_cast<const uint4*>(p); }
__device__ __forceinline__ float bf16_of(const uint4& w, int e8) {
    const unsigned v = e8 < 2 ? w.x : e8 < 4 ? w.y : e8 < 6 ? w.z : w.w;
    return mhc::word_elem<__nv_bfloat16>(v, e8 & 1);
}
}  // namespace mhc_coeffs

// mhc_coeffs_wg_dx_kernel<LAYER, KS, NB, STAGES>: the dx of mhc_coeffs_mma_dx_kernel (dH phi^T - c x,
// with LAYER the rest of the layer's dx, rounded once) for bf16 x and bf16 layer gradients on
// Hopper's wgmma (sm_90a; the library launches it only there, for C % 8 == 0 and 16-byte aligned x,
// dx, g, g_li, gx).  The products are those of the mma.sync kernel (2 bf16 parts of dH and of phi,
// part pairs a + b <= 1, float32 accumulation, k-step by k-step).  Grid (ceil(D / NB), splits), one
// warpgroup (128 threads): the block owns positions [pb NB, pb NB + NB) of vec(x) (D = n C; an
// 8-position group never straddles two streams since C % 8 == 0), keeps their phi rows resident in
// shared memory and walks tokens [split t_split, ...) (t_split a multiple of 64) 64 a step: one
// m64nNBk16 wgmma per k-step and part pair, A = dH_r [64 tokens][K16], B = phi_r [NB positions][K16],
// both K-major in the no-swizzle canonical layout (kernels_cu/wgmma.cuh): [rows / 8][K16 / 8][8
// rows][8 values], LBO 128 bytes, SBO 16 K16 bytes.  B row nn holds position 32 (j / 4) + 8 tq +
// 2 (j % 4) + e of the block for nn = 8 j + 2 tq + e: accumulator (j, e) of lane quad member tq is
// that position, so a thread holds 8 consecutive positions 32 k + 8 tq .. of each of its rows for
// k < NB / 32 (one 16-byte load and store each; a lane quad's are 64 contiguous bytes).  What the
// epilogue reads (x, c, g_li, H_pre, gx) is loaded into registers while the tensor cores work; a
// thread's streams and columns are computed once (integer divisions in the step loop cost 7-16 % of
// the kernel's time on the H200).
// (Issuing the next step's wgmmas into a second accumulator set before this step's epilogue made
// ptxas serialise them: C7514, accumulators read while another wgmma group is in flight.)
//   phi_r: [2+, D, K16] bf16, dH_r: [2+, tokens_p, K16] (split_rows with KC = 0, pairs = 0).
// Dynamic shared memory: 4 NB K16 + STAGES 256 K16 bytes (phi's two planes, then per stage dH's).
template <bool LAYER, int KS, int NB, int STAGES>
__global__ void __launch_bounds__(128)
mhc_coeffs_wg_dx_kernel(const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ phi_r,
                        const __nv_bfloat16* __restrict__ dH_r, const float* __restrict__ dH,
                        const __nv_bfloat16* __restrict__ g, const __nv_bfloat16* __restrict__ g_li,
                        const float* __restrict__ H_pre, const float* __restrict__ H_res,
                        const __nv_bfloat16* __restrict__ gx, __nv_bfloat16* __restrict__ dx,
                        i64 tokens, i64 tokens_p, int n, int C, int K, int KP, i64 t_split, int res_t) {
    using namespace mhc_coeffs;
    static_assert(NB == 64 || NB == 128, "64 or 128 positions a block");
    constexpr int K16 = 16 * KS, KQ = 2 * KS;  // 16-byte chunks of a row
    constexpr int PB = NB * K16 * 2;           // bytes of a phi plane
    constexpr int AB = 64 * K16 * 2;           // bytes of a dH plane of a stage
    constexpr int SB = 2 * AB;                 // stage bytes
    constexpr int R = NB / 2;                  // accumulators a thread
    constexpr int QC = NB / 32;                // 8-position groups of a thread's row
    extern __shared__ __align__(128) unsigned char smem[];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g8 = lane >> 2, tq = lane & 3;
    const int D = n * C;
    const int d0 = (int)blockIdx.x * NB;
    const i64 t_begin = (i64)blockIdx.y * t_split;
    const i64 t_end = min(tokens, t_begin + t_split);
    const int steps = (int)((max(t_end - t_begin, (i64)0) + 63) / 64);
    const i64 plane_r = tokens_p * K16, plane_phi = (i64)D * K16;
    unsigned char* const stages = smem + 2 * PB;

    // phi rows (two planes), zero past D: chunk c = (p, rg, q, r8) -> row nn = 8 rg + r8 of plane p
    for (int c = tid; c < 2 * NB * KQ; c += 128) {
        const int p = c / (NB * KQ), rem = c - p * (NB * KQ);
        const int nn = (rem / (8 * KQ)) * 8 + (rem & 7), q = (rem >> 3) % KQ;
        const int d = d0 + 32 * (nn >> 5) + 8 * ((nn >> 1) & 3) + 2 * ((nn >> 3) & 3) + (nn & 1);
        const bool ok = d < D;
        cp_async16(smem + c * 16, phi_r + p * plane_phi + (i64)(ok ? d : 0) * K16 + q * 8, ok);
    }
    // a step's copies: thread (p, u) = (tid / 64, tid % 64) copies the KQ chunks of row t0 + u of
    // plane p of dH_r (zero past tokens_p); the 8 threads of a core matrix write 128 contiguous bytes
    const int cu = tid & 63, cp = tid >> 6;
    const __nv_bfloat16* const hsrc = dH_r + cp * plane_r + (t_begin + cu) * K16;
    const int hdst = cp * AB + (cu >> 3) * (KQ * 128) + (cu & 7) * 16;
    auto fill = [&](int step, int stage) {
        unsigned char* st = stages + stage * SB + hdst;
        const bool ok = t_begin + (i64)step * 64 + cu < tokens_p;
        const __nv_bfloat16* src = ok ? hsrc + (i64)step * 64 * K16 : dH_r;
#pragma unroll
        for (int q = 0; q < KQ; ++q) cp_async16(st + q * 128, ok ? src + q * 8 : src, ok);
    };

    const int pq = d0 + 8 * tq;  // this thread's first position
    int si[QC], sc[QC];          // stream and column of its 8-position group k (position pq + 32 k)
#pragma unroll
    for (int k = 0; k < QC; ++k) {
        si[k] = (pq + 32 * k) / C;
        sc[k] = pq + 32 * k - si[k] * C;
    }
    float acc[R];
    mhc::zero(acc);
    pipeline_start<STAGES>(steps, fill);  // the first group also holds the phi rows
    for (int step = 0; step < steps; ++step) {
        pipeline_next<STAGES, true>(step, steps, fill);
        const unsigned char* st = stages + (step % STAGES) * SB;
        mhc_wg::reg_fence(acc);
        mhc_wg::fence();
#pragma unroll
        for (int s = 0; s < KS; ++s)
#pragma unroll
            for (int pa = 0; pa < 2; ++pa)
#pragma unroll
                for (int pb = 0; pb + pa < 2; ++pb)
                    mhc_wg::Mma<NB, 0>::run(acc, mhc_wg::desc(st + pa * AB + s * 256, 128, 16 * K16),
                                            mhc_wg::desc(smem + pb * PB + s * 256, 128, 16 * K16), (s | pa | pb) != 0);
        mhc_wg::commit();
        // while the tensor cores work: what the epilogue reads of this thread's rows (x, c and with
        // LAYER g_li, H_pre, gx) into registers
        const i64 t0 = t_begin + (i64)step * 64 + warp * 16 + g8;  // rows t0, t0 + 8
        uint4 xw[2][QC], lw[2][QC] = {}, gw[2][QC] = {};  // (zero without LAYER)
        float cs[2], hq[2][QC] = {};
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const i64 t = t0 + 8 * h;
            const bool ok = t < t_end;
            cs[h] = ok ? dH[t * KP + K] : 0.f;
#pragma unroll
            for (int k = 0; k < QC; ++k) {
                const int d = pq + 32 * k;
                const bool okk = ok && d < D;
                const i64 o = okk ? t * D + d : 0;
                xw[h][k] = okk ? ldg16(x + o) : make_uint4(0, 0, 0, 0);
                if constexpr (LAYER) {
                    gw[h][k] = okk && gx != nullptr ? ldg16(gx + o) : make_uint4(0, 0, 0, 0);
                    lw[h][k] = okk && g_li != nullptr ? ldg16(g_li + t * C + sc[k]) : make_uint4(0, 0, 0, 0);
                    hq[h][k] = okk && g_li != nullptr ? H_pre[t * n + si[k]] : 0.f;
                }
            }
        }
        mhc_wg::wait<0>();
        mhc_wg::reg_fence(acc);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const i64 t = t0 + 8 * h;
            if (t >= t_end) continue;
#pragma unroll
            for (int k = 0; k < QC; ++k) {
                if (pq + 32 * k >= D) continue;
                float o[8], lv[8], gxv[8];
#pragma unroll
                for (int e8 = 0; e8 < 8; ++e8) {  // position 32 k + 8 tq + e8: j = 4 k + e8 / 2, e = e8 % 2
                    o[e8] = fmaf(-cs[h], bf16_of(xw[h][k], e8), acc[16 * k + 4 * (e8 >> 1) + 2 * h + (e8 & 1)]);
                    lv[e8] = bf16_of(lw[h][k], e8);
                    gxv[e8] = bf16_of(gw[h][k], e8);
                }
                dx_finish<__nv_bfloat16, __nv_bfloat16, true, LAYER>(o, hq[h][k], lv, gxv, g, g_li, gx, H_res, dx, t,
                                                                    n, si[k], C, D, sc[k], res_t);
            }
        }
    }
    cp_async_wait<0>();
}
