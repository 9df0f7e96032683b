// The coefficient path's forward (OPS.md section 8): raw H~ = x~ phi and the sum of squares per
// D range into part [splits, T, K+1] (column K: the sum of squares), then h from them.
//
// * mhc_coeffs_split_phi_fwd_kernel, mhc_coeffs_mma_fwd_kernel<T, VEC, MT, NTILE, STAGES, SUB>: the
//   GEMM on mma.sync (every dtype, every n).  part[split, t, k] = raw H~ over one D range and
//   part[split, t, K] = the sum of squares (for bf16 x also on the tensor cores, as the diagonal of
//   X X^T).  4 warps; a warp owns MT x 16 tokens and NTILE x 8 columns and walks the block's D range
//   32 SUB positions a pipeline stage, 32 a sub-step (8 per lane quad member: two MMA k-steps).
// * mhc_coeffs_split_phi_wg_kernel, mhc_coeffs_wg_fwd_kernel<VEC, KC, MT, STAGES>: the same GEMM on
//   wgmma (sm_90a, bf16 x).
// * mhc_coeffs_fwd_finish_kernel: h from part, summed in range order (mhc_coeffs_bwd_prep_kernel,
//   coeffs_bwd.cu, and the head, head.cu, consume part too).
#include "coeffs.cuh"

namespace mhc_coeffs {

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

// Dynamic shared memory of the kernels of this unit that take some, in bytes: what a launch must
// allocate.  Each kernel static_asserts that its layout fills exactly this; the launch computes the
// same number from its KernelSpec (mhc_cupy/ops/coeffs/), and tests/test_launch_layout.py compiles
// these functions against the size of every planned launch.
// mhc_coeffs_mma_fwd_kernel: per stage x [4 MT 16 tokens][32 SUB positions] T and phi [3][8 NTILE][32 SUB] bf16.
template <typename T, bool VEC, int MT, int NTILE, int STAGES, int SUB>
__host__ __device__ constexpr int mma_fwd_smem() {
    return STAGES * SUB * (4 * MT * 16 * 32 * (int)sizeof(T) + 3 * NTILE * 8 * 64);
}
// mhc_coeffs_wg_fwd_kernel: per stage x [64 MT tokens][64 positions] and phi [3][KC][64] bf16.
template <bool VEC, int KC, int MT, int STAGES>
__host__ __device__ constexpr int wg_fwd_smem() {
    return STAGES * (64 * MT * 128 + 3 * KC * 128);
}

}  // namespace mhc_coeffs

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
        mhc_coeffs::SumSq q;
        const float H = mhc_coeffs::split_sum(part, tokens, t, k, K, splits, q);
        if (stats != nullptr) {
            stats[t * (K + 1) + k] = H;
            if (k == 0) stats[t * (K + 1) + K] = q.saved();
        }
        mhc_coeffs::finish_column(alpha, bias, h_pre, h_post, h_res, t, k, n, H, q.rinv(D, eps));
    }
}

// phi [D, K] float32 -> planes [3, Kp, Dp] bf16 (transposed, zero padded):
// plane p holds part p of each value.  Grid-stride over Kp * Dp.
__global__ void mhc_coeffs_split_phi_fwd_kernel(const float* __restrict__ phi, __nv_bfloat16* __restrict__ planes,
                                                int D, int K, int Dp, int Kp) {
    const i64 total = (i64)Kp * Dp;
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < total; i += (i64)gridDim.x * blockDim.x) {
        const int k = (int)(i / Dp), d = (int)(i - (i64)k * Dp);
        const float v = (k < K && d < D) ? phi[(i64)d * K + k] : 0.f;
        unsigned p[3];
        mhc_mma::split_bits<3>(v, p);
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
// Dynamic shared memory: mhc_coeffs::mma_fwd_smem.
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
    static_assert(STAGES * SB == mma_fwd_smem<T, VEC, MT, NTILE, STAGES, SUB>(), "the launch's shared memory");
    extern __shared__ __align__(16) unsigned char smem[];

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, tq = lane & 3;
    const FwdBlock blk = fwd_block(tiles, ncc);
    const int split = blk.split, cc = blk.cc;
    const i64 tile = blk.tile;
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
            fwd_substep(acc, aw, bw);
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
                        mhc::mma_m16n8k16<__nv_bfloat16>(sq[0], a, a[0], a[2]);
                        mhc::mma_m16n8k16<__nv_bfloat16>(sq[1], a, a[1], a[3]);
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
// Dynamic shared memory: mhc_coeffs::wg_fwd_smem.
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
    static_assert(STAGES * SB == wg_fwd_smem<VEC, KC, MT, STAGES>(), "the launch's shared memory");
    extern __shared__ __align__(128) unsigned char smem[];

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, tq = lane & 3;
    const FwdBlock blk = fwd_block(tiles, ncc);
    const int split = blk.split, cc = blk.cc;
    const i64 tile = blk.tile;
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
        mhc_mma::split_bits<3>(v, bits);
        planes[i] = __ushort_as_bfloat16((unsigned short)(p == 0 ? bits[0] : p == 1 ? bits[1] : bits[2]));
    }
}
