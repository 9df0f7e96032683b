// dphi = sum_t x~^T dH of the coefficient path's backward (OPS.md section 8) where the fused
// kernel (coeffs_bwd.cu) does not run: K > 32 (n > 4) on tensor cores, and the head's (K = n,
// head.cu) on CUDA cores.
#include "coeffs.cuh"

namespace mhc_coeffs {

enum : int {
    NT = 256,      // threads per block of mhc_coeffs_bwd_dphi_kernel
    TS = 32,       // tokens of dH it stages a step
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

// Dynamic shared memory of the kernels of this unit that take some, in bytes: what a launch must
// allocate.  Each kernel static_asserts that its layout fills exactly this; the launch computes the
// same number from its KernelSpec (mhc_cupy/ops/coeffs/), and tests/test_launch_layout.py compiles
// these functions against the size of every planned launch.
// mhc_coeffs_mma_dphi_kernel: per stage x [16][256] T (token rows padded by 16 bytes) and dH_c
// [3][8 NQ][16] bf16.
template <typename T, bool VEC, int NQ, int STAGES>
__host__ __device__ constexpr int mma_dphi_smem() {
    return STAGES * (16 * (256 * (int)sizeof(T) + 16) + 3 * 8 * NQ * 32);
}

}  // namespace mhc_coeffs

// mhc_coeffs_bwd_dphi_kernel<T, E, KC> (CUDA cores): dphi for any K.  Flattened grid:
// blockIdx.x = (split * dblocks + bx) * ncc + cc; a thread owns positions d = (bx * 256 + tid) * E .. + E
// and columns [cc * KC, cc * KC + KC) and walks tokens [split * t_split, ...), with dH rows staged in
// shared memory.  dphi: the output (one split) or partials [splits, D, K].
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
// VEC: D % 8 == 0 and x 16-byte aligned.  Dynamic shared memory: mhc_coeffs::mma_dphi_smem.
template <typename T, bool VEC, int NQ, int STAGES>
__global__ void __launch_bounds__(128)
mhc_coeffs_mma_dphi_kernel(const T* __restrict__ x, const __nv_bfloat16* __restrict__ dH_c, float* __restrict__ dphi,
                           i64 tokens, i64 tokens_p, int D, int K, int Kc, int ncc, i64 t_split) {
    using namespace mhc_coeffs;
    constexpr int P = XParts<T>::value;
    constexpr int XR = 256 * (int)sizeof(T) + 16;  // token row bytes (padded: no bank conflicts between tokens)
    constexpr int XB = 16 * XR, SB = XB + 3 * NQ * 8 * 32;
    static_assert(STAGES * SB == mma_dphi_smem<T, VEC, NQ, STAGES>(), "the launch's shared memory");
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
