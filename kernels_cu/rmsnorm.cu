// RMSNorm (OPS.md section 2): y_c = x_c * r (* w_c), r = 1/sqrt(mean_c x_c^2 + eps).
// Backward with g' = g * w:  dx_c = r (g'_c - x_c r^2 mean_k(g'_k x_k));
//                            dw_c = sum_tokens g_c x_c r.
// One block per row (token); the statistics are recomputed from x.
// The *_cached kernels keep the row (x, and g in the backward) in registers
// as K packed vectors of E elements per thread, so x is read from memory
// once; the others read it twice (the general path: any C, E = 1; and wide
// rows, where their second pass finds the row in L2, see row_sumsq).  The
// weight gradient is accumulated per block over a contiguous range of rows in
// shared memory (each thread owns fixed columns: no races, no atomics) and
// written as one partial row per block; mhc_column_sum_kernel then sums the
// partial rows in a fixed order.
// Sums of x^2 that overflow float32 are redone with x scaled (mhc::STAT_SCALE):
// the row_sum* helpers take SCALED as a template flag, so the common pass does
// not multiply.  Column counters are unsigned: C up to 2^31 - 1 never wraps.
#include "common.cuh"

using mhc::i64;

namespace {

// The weighted backward's per-block dw partial row in shared memory: zeroed
// at the start (each thread only ever touches its own columns afterwards, the
// same set as in the zeroing only when E == 1, hence one synchronisation) and
// written out as row blockIdx.x of dw_part at the end.
template <bool HAS_W>
__device__ __forceinline__ void dw_begin(float* dw_acc, int C) {
    if (HAS_W)
        for (unsigned c = threadIdx.x; c < (unsigned)C; c += blockDim.x) dw_acc[c] = 0.f;
    __syncthreads();
}

template <bool HAS_W>
__device__ __forceinline__ void dw_end(const float* dw_acc, float* __restrict__ dw_part, int C) {
    if (HAS_W) {
        __syncthreads();
        for (unsigned c = threadIdx.x; c < (unsigned)C; c += blockDim.x)
            dw_part[blockIdx.x * (i64)C + c] = dw_acc[c];
    }
}

// x (times mhc::STAT_SCALE when SCALED) of one element.  The sums below also
// serve the register-cached kernels' rare rescaled pass (same columns per
// thread, same order), which reads the row again from memory.
template <bool SCALED>
__device__ __forceinline__ float stat_x(float v) {
    return SCALED ? v * mhc::STAT_SCALE : v;
}

// The two-pass kernels' first pass (TWO_PASS) loads U vectors (of x; the backward U / 2 of x
// and of g) a trip before summing them (more loads in flight), Evict::last: the second pass
// reads the row again, Evict::first, mostly from L2.  The sums run over the same columns in the
// same order as one vector a trip (and as the cached kernels with the same block).  The cached
// kernels' rescan (rare) loads one vector a trip without hints: the unrolled, hinted loop
// would add up to 8 registers to those kernels.
constexpr int U_TWO_PASS = 4;

// Adds the terms of columns c .. c + E - 1 to sum x^2 (xv: E floats, or an mhc::Packed of them).
template <int E, bool SCALED, typename X>
__device__ __forceinline__ void add_sumsq(const X& xv, float& a) {
#pragma unroll
    for (int e = 0; e < E; ++e) {
        const float v = stat_x<SCALED>(xv[e]);
        a = fmaf(v, v, a);
    }
}

// This thread's share of sum x^2 over row xt.
template <typename T, int E, bool SCALED, bool TWO_PASS = true>
__device__ __forceinline__ float row_sumsq(const T* __restrict__ xt, int C) {
    constexpr int U = TWO_PASS ? U_TWO_PASS : 1;
    constexpr mhc::Evict H = TWO_PASS ? mhc::Evict::last : mhc::Evict::normal;
    const unsigned step = blockDim.x * E;
    float a = 0.f;
    unsigned c = threadIdx.x * E;
    for (; c + (U - 1) * step < (unsigned)C; c += U * step) {
        float xv[U][E];
#pragma unroll
        for (int u = 0; u < U; ++u) mhc::load_vec<T, E, H>(xt + c + u * step, xv[u]);
#pragma unroll
        for (int u = 0; u < U; ++u) add_sumsq<E, SCALED>(xv[u], a);
    }
    for (; c < (unsigned)C; c += step) {
        float xv[E];
        mhc::load_vec<T, E, H>(xt + c, xv);
        add_sumsq<E, SCALED>(xv, a);
    }
    return a;
}

// Adds the terms of columns c .. c + E - 1 to sum x^2 and sum g' x.
template <int E, bool HAS_W, bool SCALED>
__device__ __forceinline__ void add_sums(const float (&xv)[E], const float (&gv)[E], const float* __restrict__ w,
                                         unsigned c, float (&acc)[2]) {
#pragma unroll
    for (int e = 0; e < E; ++e) {
        const float gp = HAS_W ? gv[e] * w[c + e] : gv[e];
        const float v = stat_x<SCALED>(xv[e]);
        acc[0] = fmaf(v, v, acc[0]);
        acc[1] = fmaf(gp, v, acc[1]);
    }
}

// This thread's share of sum x^2 and sum g' x over rows xt, gt.
template <typename T, typename TG, int E, bool HAS_W, bool SCALED, bool TWO_PASS = true>
__device__ __forceinline__ void row_sums(const T* __restrict__ xt, const TG* __restrict__ gt,
                                         const float* __restrict__ w, int C, float (&acc)[2]) {
    constexpr int V = TWO_PASS ? U_TWO_PASS / 2 : 1;
    constexpr mhc::Evict H = TWO_PASS ? mhc::Evict::last : mhc::Evict::normal;
    const unsigned step = blockDim.x * E;
    acc[0] = acc[1] = 0.f;
    unsigned c = threadIdx.x * E;
    for (; c + (V - 1) * step < (unsigned)C; c += V * step) {
        float xv[V][E], gv[V][E];
#pragma unroll
        for (int u = 0; u < V; ++u) {
            mhc::load_vec<T, E, H>(xt + c + u * step, xv[u]);
            mhc::load_vec<TG, E, H>(gt + c + u * step, gv[u]);
        }
#pragma unroll
        for (int u = 0; u < V; ++u) add_sums<E, HAS_W, SCALED>(xv[u], gv[u], w, c + u * step, acc);
    }
    for (; c < (unsigned)C; c += step) {
        float xv[E], gv[E];
        mhc::load_vec<T, E, H>(xt + c, xv);
        mhc::load_vec<TG, E, H>(gt + c, gv);
        add_sums<E, HAS_W, SCALED>(xv, gv, w, c, acc);
    }
}

// The backward's per-row factors from the block sums ss = sum (x S)^2 and
// sg = sum g' (x S) (S = 1, or mhc::STAT_SCALE after an overflow):
// r = 1/sqrt(mean x^2 + eps) and k = r^2 mean(g' x), so that
// dx = r (g' - x k).  Written as S q, S q (q mean(g' x S)) with q = r / S:
// no intermediate underflows (r^3 alone does for |x| above ~1e13).
__device__ __forceinline__ void row_factors(float ss, float sg, float S, float C, float eps, float& r, float& k) {
    const float q = 1.f / sqrtf(ss / C + eps * S * S);
    r = S * q;
    k = S * (q * (q * (sg / C)));
}

// Overflow checks below: red[] holds the block totals, the same in every
// thread, so the branches are block-uniform; each waits until every thread
// has read red before summing into it again.

// 1/r of row xt from a, this thread's share of sum x^2: from the block's sum, or after an overflow
// from the sum of (x mhc::STAT_SCALE)^2, read again from memory (TWO_PASS: row_sumsq's).
template <typename T, int E, bool TWO_PASS>
__device__ __forceinline__ float row_rinv(float a, float* red, const T* __restrict__ xt, int C, float eps) {
    float acc[1] = {a};
    mhc::block_sum<1>(acc, red);
    float r = 1.f / sqrtf(red[0] / (float)C + eps);
    if (isinf(red[0])) {
        __syncthreads();
        acc[0] = row_sumsq<T, E, true, TWO_PASS>(xt, C);
        mhc::block_sum<1>(acc, red);
        r = mhc::rms_inv_scaled(red[0], (float)C, eps);
    }
    return r;
}

// The backward kernels' body: block b handles rows [b * rows_per_block, (b + 1) * rows_per_block).
// K = 0: each row is read from memory twice (any C, any E; the first pass hinted Evict::last);
// K > 0: x and g are read once into registers, thread tid holding columns (k * blockDim.x + tid) * E
// + e, k < K (blockDim.x * K * E >= C), and the rare rescan after an overflow reads them again
// without hints (keeps registers as without).  With HAS_W, dynamic shared memory holds C floats and
// dw_part is [gridDim.x, C].
template <typename T, typename TG, int E, int K, bool HAS_W>
__device__ __forceinline__ void bwd_rows(const TG* __restrict__ g, const T* __restrict__ x, const float* __restrict__ w,
                                         T* __restrict__ dx, float* __restrict__ dw_part, i64 rows, int C, float eps,
                                         i64 rows_per_block) {
    extern __shared__ float dw_acc[];
    __shared__ float red[2 * 32];
    dw_begin<HAS_W>(dw_acc, C);
    const i64 r0 = blockIdx.x * rows_per_block;
    const i64 r1 = min(rows, r0 + rows_per_block);
    for (i64 t = r0; t < r1; ++t) {
        const T* xt = x + t * (i64)C;
        const TG* gt = g + t * (i64)C;
        // K > 0: the row in registers (K = 0: one unused vector of whole words)
        mhc::Packed<T, K ? E : 4 / sizeof(T)> xreg[K ? K : 1];
        mhc::Packed<TG, K ? E : 4 / sizeof(TG)> greg[K ? K : 1];
        float acc[2] = {0.f, 0.f};  // sum x^2, sum g' x
        if constexpr (K == 0) {
            row_sums<T, TG, E, HAS_W, false>(xt, gt, w, C, acc);
        } else {
#pragma unroll
            for (int k = 0; k < K; ++k) {
                const int c = (k * blockDim.x + threadIdx.x) * E;
                if (c < C) {
                    xreg[k].load(xt + c);
                    greg[k].load(gt + c);
#pragma unroll
                    for (int e = 0; e < E; ++e) {
                        const float gp = HAS_W ? greg[k][e] * w[c + e] : greg[k][e];
                        acc[0] = fmaf(xreg[k][e], xreg[k][e], acc[0]);
                        acc[1] = fmaf(gp, xreg[k][e], acc[1]);
                    }
                }
            }
        }
        mhc::block_sum<2>(acc, red);
        float S = 1.f;  // scale of x in the sums
        if (isinf(red[0]) || isinf(red[1])) {
            __syncthreads();
            row_sums<T, TG, E, HAS_W, true, K == 0>(xt, gt, w, C, acc);
            mhc::block_sum<2>(acc, red);
            S = mhc::STAT_SCALE;
        }
        float r, kf;
        row_factors(red[0], red[1], S, (float)C, eps, r, kf);
        if constexpr (K == 0) {
            for (unsigned c = threadIdx.x * E; c < (unsigned)C; c += blockDim.x * E) {
                float xv[E], gv[E], o[E];
                mhc::load_vec<T, E, mhc::Evict::first>(xt + c, xv);
                mhc::load_vec<TG, E, mhc::Evict::first>(gt + c, gv);
#pragma unroll
                for (int e = 0; e < E; ++e) {
                    const float gp = HAS_W ? gv[e] * w[c + e] : gv[e];
                    o[e] = r * fmaf(-xv[e], kf, gp);
                    if (HAS_W) dw_acc[c + e] = fmaf(gv[e], xv[e] * r, dw_acc[c + e]);
                }
                mhc::store_vec<T, E>(dx + t * (i64)C + c, o);
            }
        } else {
#pragma unroll
            for (int k = 0; k < K; ++k) {
                const int c = (k * blockDim.x + threadIdx.x) * E;
                if (c < C) {
                    float o[E];
#pragma unroll
                    for (int e = 0; e < E; ++e) {
                        const float gp = HAS_W ? greg[k][e] * w[c + e] : greg[k][e];
                        o[e] = r * fmaf(-xreg[k][e], kf, gp);
                        if (HAS_W) dw_acc[c + e] = fmaf(greg[k][e], xreg[k][e] * r, dw_acc[c + e]);
                    }
                    mhc::store_vec<T, E>(dx + t * (i64)C + c, o);
                }
            }
        }
        __syncthreads();  // red is reused by the next row
    }
    dw_end<HAS_W>(dw_acc, dw_part, C);
}

}  // namespace

template <typename T, int E, bool HAS_W>
__global__ void mhc_rmsnorm_fwd_kernel(const T* __restrict__ x, const float* __restrict__ w,
                                       T* __restrict__ y, i64 rows, int C, float eps) {
    __shared__ float red[32];
    for (i64 t = blockIdx.x; t < rows; t += gridDim.x) {
        const T* xt = x + t * (i64)C;
        const float r = row_rinv<T, E, true>(row_sumsq<T, E, false>(xt, C), red, xt, C, eps);
        for (unsigned c = threadIdx.x * E; c < (unsigned)C; c += blockDim.x * E) {
            float xv[E], o[E];
            mhc::load_vec<T, E, mhc::Evict::first>(xt + c, xv);
#pragma unroll
            for (int e = 0; e < E; ++e) o[e] = HAS_W ? xv[e] * r * w[c + e] : xv[e] * r;
            mhc::store_vec<T, E>(y + t * (i64)C + c, o);
        }
        __syncthreads();  // red is reused by the next row
    }
}

// The backward (bwd_rows) reading each row twice.
template <typename T, typename TG, int E, bool HAS_W>
__global__ void mhc_rmsnorm_bwd_kernel(const TG* __restrict__ g, const T* __restrict__ x,
                                       const float* __restrict__ w, T* __restrict__ dx,
                                       float* __restrict__ dw_part, i64 rows, int C, float eps,
                                       i64 rows_per_block) {
    bwd_rows<T, TG, E, 0, HAS_W>(g, x, w, dx, dw_part, rows, C, eps, rows_per_block);
}

// Row in registers: thread tid holds columns (k * blockDim.x + tid) * E + e,
// k < K; blockDim.x * K * E >= C.
template <typename T, int E, int K, bool HAS_W>
__global__ void mhc_rmsnorm_fwd_cached_kernel(const T* __restrict__ x, const float* __restrict__ w,
                                              T* __restrict__ y, i64 rows, int C, float eps) {
    __shared__ float red[32];
    for (i64 t = blockIdx.x; t < rows; t += gridDim.x) {
        const T* xt = x + t * (i64)C;
        mhc::Packed<T, E> xv[K];
        float a = 0.f;
#pragma unroll
        for (int k = 0; k < K; ++k) {
            const int c = (k * blockDim.x + threadIdx.x) * E;
            if (c < C) {
                xv[k].load(xt + c);
                add_sumsq<E, false>(xv[k], a);
            }
        }
        const float r = row_rinv<T, E, false>(a, red, xt, C, eps);  // (rescan: keeps registers as without)
#pragma unroll
        for (int k = 0; k < K; ++k) {
            const int c = (k * blockDim.x + threadIdx.x) * E;
            if (c < C) {
                float o[E];
#pragma unroll
                for (int e = 0; e < E; ++e) o[e] = HAS_W ? xv[k][e] * r * w[c + e] : xv[k][e] * r;
                mhc::store_vec<T, E>(y + t * (i64)C + c, o);
            }
        }
        __syncthreads();  // red is reused by the next row
    }
}

// The backward (bwd_rows) with x and g in registers, as mhc_rmsnorm_fwd_cached_kernel.
template <typename T, typename TG, int E, int K, bool HAS_W>
__global__ void mhc_rmsnorm_bwd_cached_kernel(const TG* __restrict__ g, const T* __restrict__ x,
                                              const float* __restrict__ w, T* __restrict__ dx,
                                              float* __restrict__ dw_part, i64 rows, int C, float eps,
                                              i64 rows_per_block) {
    bwd_rows<T, TG, E, K, HAS_W>(g, x, w, dx, dw_part, rows, C, eps, rows_per_block);
}
