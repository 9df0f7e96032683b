// The coefficient path of mHC (OPS.md section 8, paper Eqs. 14-18): what its kernel units share.
// Per token t, with x~ = vec(x_t) (D = n*C values) and phi [D, K], K = n*n + 2n (columns
// pre | post | res):
//   H~ = x~ phi,  r = sqrt(mean(x~^2) + eps),  h_k = alpha_grp(k) H~_k / r + bias_k.
// Backward, with g'_k = alpha_grp(k) g_k:
//   dH_k = g'_k / r,  c = sum_k g'_k H~_k / (D r^3),
//   dx~ = dH phi^T - c x~,  dphi = sum_t x~^T dH,
//   dalpha_j = sum_t sum_{k in group j} g_k H~_k / r,  dbias = sum_t g.
//
// The GEMMs run on tensor cores (mma.cuh); the units, each launched from its module of
// mhc_cupy/ops/coeffs/:
// * coeffs_fwd.cu: the forward GEMM and the sum of squares (mma.sync; on sm_90a for bf16 x from
//   n = 7 on wgmma) into per-D-range sums part [splits, T, K+1], and h from them;
// * coeffs_bwd.cu: dH and c from those sums, the bf16 planes of dH and phi, and dx and dphi in one
//   kernel for K <= 32 (n <= 4);
// * coeffs_dphi.cu: dphi for K > 32 on tensor cores, and the head's dphi on CUDA cores;
// * coeffs_dx.cu: dx for K > 32, phi resident in shared memory or streamed beside dH, or on wgmma;
// * head.cu: the head (OPS.md section 11) on the same forward GEMM.
//
// Determinism: every sum has a fixed order (per-lane sequential, fixed butterflies, the tensor
// cores' fixed accumulation, partials summed in index order); no atomics.
#pragma once
#include "mma.cuh"

using mhc::i64;

namespace mhc_coeffs {

using namespace mhc_mma;  // the tensor-core helpers, for the kernels' `using namespace mhc_coeffs`

// Group of column k: 0 = pre [0, n), 1 = post [n, 2n), 2 = res [2n, K).
__device__ __forceinline__ int group_of(int k, int n) { return k < n ? 0 : (k < 2 * n ? 1 : 2); }

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

// A forward GEMM block's place in its grid: blockIdx.x = (split * tiles + tile) * ncc + cc (column
// chunk cc; mhc_boundary_fwd_kernel: ncc = 1), in 32-bit unsigned arithmetic.  (Computed in this order:
// returning the fields as one brace list changed the forward kernels' SASS and registers.)
struct FwdBlock {
    int split, cc;
    i64 tile;
};
__device__ __forceinline__ FwdBlock fwd_block(i64 tiles, int ncc) {
    FwdBlock r;
    const unsigned b = blockIdx.x, rest = b / (unsigned)ncc;
    r.cc = (int)(b - rest * (unsigned)ncc);
    const unsigned split_u = rest / (unsigned)tiles;
    r.tile = rest - split_u * (unsigned)tiles;
    r.split = (int)split_u;
    return r;
}

// Token t's raw H~_k summed over the forward GEMM's D ranges part [splits, T, K+1] in range order,
// and its sums of squares added to q (mhc_coeffs_fwd_finish_kernel, the small-token tail kernel).
// The loads go SPLIT_BATCH ranges at a time before their sums (the same additions in the same order):
// one at a time, SumSq::add's branch on each loaded value held the next load back, a round trip to L2
// per range (at one token the small path's tail sums 256 ranges, the tensor-core path's finish 64).
constexpr int SPLIT_BATCH = 16;
__device__ __forceinline__ float split_sum(const float* __restrict__ part, i64 tokens, i64 t, int k, int K,
                                           int splits, SumSq& q) {
    float H = 0.f;
    const i64 stride = tokens * (K + 1);
    const float* row = part + t * (K + 1);
    int s = 0;
    for (; s + SPLIT_BATCH <= splits; s += SPLIT_BATCH, row += SPLIT_BATCH * stride) {
        float h[SPLIT_BATCH], v[SPLIT_BATCH];
#pragma unroll
        for (int b = 0; b < SPLIT_BATCH; ++b) {
            h[b] = row[b * stride + k];
            v[b] = row[b * stride + K];
        }
#pragma unroll
        for (int b = 0; b < SPLIT_BATCH; ++b) {
            H += h[b];
            q.add(v[b]);
        }
    }
    for (; s < splits; ++s, row += stride) {
        H += row[k];
        q.add(row[K]);
    }
    return H;
}

// split_sum for the columns k = threadIdx.x + j blockDim.x (j < KPT) of token t, every thread of the
// block taking part (a barrier inside: all of them call it): the ranges come into shared memory
// `stage` (stage_floats floats, at least K + 1) as many at a time as fit, STAGE_LOADS loads a thread in
// flight, then each thread sums its columns' ranges in range order, split_sum's additions in its
// order (its bits); q gets the ranges' sums of squares (column K, the same for every k).  One L2 round
// trip a stage, where split_sum makes one every SPLIT_BATCH ranges with only K threads loading (the
// small path's tail kernel at one token: 256 ranges, 16 round trips).
constexpr int STAGE_LOADS = 8;
template <int KPT>
__device__ __forceinline__ void staged_split_sums(const float* __restrict__ part, i64 tokens, i64 t, int K,
                                                  int splits, float* __restrict__ stage, int stage_floats,
                                                  float (&H)[KPT], SumSq& q) {
    const int KW = K + 1, chunk = stage_floats / KW;
    const i64 stride = tokens * KW;
#pragma unroll
    for (int j = 0; j < KPT; ++j) H[j] = 0.f;
    for (int s0 = 0; s0 < splits; s0 += chunk) {
        const int count = min(chunk, splits - s0) * KW;  // floats of this stage: ranges s0 .. , columns 0 .. K
        const float* src = part + (i64)s0 * stride + t * KW;
        __syncthreads();  // the previous stage read
        for (int i0 = threadIdx.x; i0 < count; i0 += STAGE_LOADS * blockDim.x) {
            float v[STAGE_LOADS];
#pragma unroll
            for (int b = 0; b < STAGE_LOADS; ++b) {
                const int i = i0 + b * blockDim.x, s = i / KW;
                v[b] = i < count ? src[s * stride + (i - s * KW)] : 0.f;
            }
#pragma unroll
            for (int b = 0; b < STAGE_LOADS; ++b)
                if (i0 + b * blockDim.x < count) stage[i0 + b * blockDim.x] = v[b];
        }
        __syncthreads();
        if ((int)threadIdx.x < K) {
            for (const float* row = stage; row < stage + count; row += KW) {
#pragma unroll
                for (int j = 0; j < KPT; ++j) {
                    const int k = threadIdx.x + j * blockDim.x;
                    if (k < K) H[j] += row[k];
                }
                q.add(row[K]);
            }
        }
    }
}

// Steps ahead that the dx kernels ask L2 for the rows of x and the layer's gradients they read
// straight from global memory (mhc::prefetch_l2).
constexpr int DX_PREFETCH = 1;

// acc[m][q] += A[m] B[q] for the part pairs (pa, pb) with pa < P and pa + pb < 3 (mma.cuh: float32-accurate
// products); a: the A fragments [m][part], b: the B fragments [q][part] (b0, b1).  m innermost: consecutive
// MMAs accumulate into different registers, so they do not wait on each other.
template <int P, int MT, int NQ>
__device__ __forceinline__ void mma_parts(float (&acc)[MT][NQ][4], const unsigned (&a)[MT][P][4],
                                          const unsigned (&b)[NQ][3][2]) {
#pragma unroll
    for (int pa = 0; pa < P; ++pa)
#pragma unroll
        for (int pb = 0; pb + pa < 3; ++pb)
#pragma unroll
            for (int q = 0; q < NQ; ++q)
#pragma unroll
                for (int m = 0; m < MT; ++m)
                    mhc::mma_m16n8k16<__nv_bfloat16>(acc[m][q], a[m][pa], b[q][pb][0], b[q][pb][1]);
}

// One 32-position sub-step of the forward GEMM (mhc_coeffs_mma_fwd_kernel, mhc_boundary_fwd_kernel): acc +=
// x~ phi over the lane's positions 8 tq .. 8 tq + 7.  aw [m tile][part][row half: g, g + 8][word]: x's words
// there; bw [n tile q][plane][word]: phi's of column 8 q + g.  k-step j takes words 2j, 2j + 1 (positions
// 8 tq + 4j .. + 3: logical k 2tq, 2tq+1 | 2tq+8, 2tq+9).  The products go into a fresh accumulator, added
// to acc in float32 (round to nearest): the tensor cores' own accumulation truncates, which over the
// thousands of MMAs of a long D range left up to 2e-5 of max |H~| (H200, D = 131072; 8e-7 with this, at no
// measured cost: tests/test_coeffs.py::test_coeffs_float32_accurate_over_long_rows).
template <int P, int MT, int NTILE>
__device__ __forceinline__ void fwd_substep(float (&acc)[MT][NTILE][4], const unsigned (&aw)[MT][P][2][4],
                                            const unsigned (&bw)[NTILE][3][4]) {
    float stp[MT][NTILE][4];
    mhc::zero(stp);
#pragma unroll
    for (int j = 0; j < 2; ++j) {
        unsigned a[MT][P][4], b[NTILE][3][2];
#pragma unroll
        for (int m = 0; m < MT; ++m)
#pragma unroll
            for (int p = 0; p < P; ++p) {
                a[m][p][0] = aw[m][p][0][2 * j];
                a[m][p][1] = aw[m][p][1][2 * j];
                a[m][p][2] = aw[m][p][0][2 * j + 1];
                a[m][p][3] = aw[m][p][1][2 * j + 1];
            }
#pragma unroll
        for (int q = 0; q < NTILE; ++q)
#pragma unroll
            for (int p = 0; p < 3; ++p) {
                b[q][p][0] = bw[q][p][2 * j];
                b[q][p][1] = bw[q][p][2 * j + 1];
            }
        mma_parts<P>(stp, a, b);
    }
    mhc::add(acc, stp);
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
    mma_parts<P>(acc, afr, bp);
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
