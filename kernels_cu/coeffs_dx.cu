// dx = dH phi^T - c x~ of the coefficient path's backward (OPS.md section 8) for K > 32 (n > 4),
// with the mHC layer's other dx terms (OPS.md section 9) when LAYER, rounded once; the K <= 32 dx is
// part of mhc_coeffs_mma_bwd_kernel (coeffs_bwd.cu), whose fragments these kernels share.
// * mhc_coeffs_mma_dx_kernel: phi's rows of the block resident in shared memory;
// * mhc_coeffs_mma_dx_tile_kernel: phi streamed beside dH (any n; the same bits);
// * mhc_coeffs_wg_dx_kernel: on wgmma (sm_90a, bf16).
#include "coeffs.cuh"

namespace mhc_coeffs {

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
                mhc_mma::load8<TG, VEC>(g + t * (i64)D + j * C, col, C, gv);
#pragma unroll
                for (int e8 = 0; e8 < 8; ++e8) o[e8] = fmaf(w, gv[e8], o[e8]);
            }
        }
        if (gx != nullptr) {
#pragma unroll
            for (int e8 = 0; e8 < 8; ++e8) o[e8] += gxv[e8];
        }
    }
    mhc_mma::store8<T, VEC>(dx + t * (i64)D + (i64)i * C, col, C, o);
}

// Asks L2 for the lines at column pc of what the dx kernels' epilogue reads of token t: stream i of x (xi),
// and with LAYER g_li and gx where not null.
template <bool LAYER, typename T, typename TG>
__device__ __forceinline__ void prefetch_row(const T* xi, const TG* g_li, const TG* gx, i64 t, i64 D, int C, int i,
                                             int pc) {
    mhc::prefetch_l2(xi + t * D + pc);
    if (LAYER && g_li != nullptr) mhc::prefetch_l2(g_li + t * (i64)C + pc);
    if (LAYER && gx != nullptr) mhc::prefetch_l2(gx + t * D + (i64)i * C + pc);
}

// 16 bytes of global memory (16-byte aligned), as raw words; value e8 of 8 bf16 in them as float.
__device__ __forceinline__ uint4 ldg16(const __nv_bfloat16* p) { return *reinterpret_cast<const uint4*>(p); }
__device__ __forceinline__ float bf16_of(const uint4& w, int e8) {
    const unsigned v = e8 < 2 ? w.x : e8 < 4 ? w.y : e8 < 6 ? w.z : w.w;
    return mhc::word_elem<__nv_bfloat16>(v, e8 & 1);
}

// Dynamic shared memory of the kernels of this unit that take some, in bytes: what a launch must
// allocate.  Each kernel static_asserts that its layout fills exactly this; the launch computes the
// same number from its KernelSpec (mhc_cupy/ops/coeffs/), and tests/test_launch_layout.py compiles
// these functions against the size of every planned launch.
// mhc_coeffs_mma_dx_kernel: the phi rows of its W streams' 8 NT columns [PO][8 NT W][16 KS], then per
// stage dH_r [PO][16][16 KS], bf16; PO = 2 planes for 16-bit T, 3 for float32.
template <typename T, typename TG, bool VEC, bool LAYER, int KS, int W, int NT, int STAGES>
__host__ __device__ constexpr int mma_dx_smem() {
    return (8 * NT * W + STAGES * 16) * 16 * KS * 2 * (sizeof(T) == 4 ? 3 : 2);
}
// mhc_coeffs_mma_dx_tile_kernel: per stage dH_r [PO][BT][32] and phi_r [PO][32 W][32] bf16,
// BT = 16 (4 / W) MT tokens.
template <typename T, typename TG, bool VEC, bool LAYER, int KS, int W, int MT, int STAGES>
__host__ __device__ constexpr int mma_dx_tile_smem() {
    return STAGES * (sizeof(T) == 4 ? 3 : 2) * (16 * (4 / W) * MT + 32 * W) * 64;
}
// mhc_coeffs_wg_dx_kernel: phi's two planes [2][NB][16 KS], then per stage dH [2][64][16 KS], bf16.
template <bool LAYER, int KS, int NB, int STAGES>
__host__ __device__ constexpr int wg_dx_smem() {
    return 4 * NB * 16 * KS + STAGES * 256 * 16 * KS;
}

}  // namespace mhc_coeffs

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
// NT = 4 (ops/coeffs/split_bwd.py _DX_NT: half the phi rows, more blocks per SM, measured faster).
// VEC: C % 8 == 0 and x, dx (and g, g_li, gx) 16-byte aligned.  Dynamic shared memory: mhc_coeffs::mma_dx_smem.
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
    static_assert(PO * NW * K16 * 2 + STAGES * SB == mma_dx_smem<T, TG, VEC, LAYER, KS, W, NT, STAGES>(),
                  "the launch's shared memory");

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
                if (t < t_end) prefetch_row<LAYER>(xi, g_li, gx, t, D, C, i, pc);
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
                    for (int pb = 0; pb + pa < PO; ++pb)
                        mhc::mma_m16n8k16<__nv_bfloat16>(acc[j], a[pa], b[pb][0], b[pb][1]);
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
// mhc_coeffs::mma_dx_tile_smem.
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
    static_assert(STAGES * SB == mma_dx_tile_smem<T, TG, VEC, LAYER, KS, W, MT, STAGES>(),
                  "the launch's shared memory");
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
                        if (t < t_end) prefetch_row<LAYER>(xi, g_li, gx, t, D, C, i, pc);
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
                            mhc::mma_m16n8k16<__nv_bfloat16>(acc[m][j], a[m][pa][sl], b[j][pb][2 * sl],
                                                             b[j][pb][2 * sl + 1]);
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
// Dynamic shared memory: mhc_coeffs::wg_dx_smem (phi's two planes, then per stage dH's).
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
    static_assert(2 * PB + STAGES * SB == wg_dx_smem<LAYER, KS, NB, STAGES>(), "the launch's shared memory");
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
