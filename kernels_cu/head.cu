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
#include "coeffs.cuh"

namespace mhc_coeffs {

// z = H~ / r * scale + base and w = sigmoid(z) + hc_eps for column k of token t (from the partials).
__device__ __forceinline__ float head_logit(const float* __restrict__ part, const float* __restrict__ hc_scale,
                                            const float* __restrict__ hc_base, i64 t, i64 tokens, int n, int k,
                                            int splits, int D, float rms_eps, float& H, float& rinv) {
    SumSq q;
    H = split_sum(part, tokens, t, k, n, splits, q);
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

// dst[c, r] = src[r, c] for a row-major [rows, cols] float32 matrix with few rows (hc_fn
// [n, D] -> phi [D, n] for the forward GEMM), grid-stride over dst.
__global__ void mhc_head_transpose_kernel(const float* __restrict__ src, float* __restrict__ dst, int rows, i64 cols) {
    const i64 total = cols * rows;
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < total; i += (i64)gridDim.x * blockDim.x) {
        const i64 c = i / rows;
        const int r = (int)(i - c * rows);
        dst[i] = src[r * cols + c];
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
