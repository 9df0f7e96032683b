// The coefficient path's backward (OPS.md section 8): dH and c from the forward's sums, the bf16
// planes of dH and phi that the tensor-core backward kernels read, and for K <= 32 (n <= 4) dx and
// dphi in one kernel (K > 32: coeffs_dphi.cu and coeffs_dx.cu).
//
// * mhc_coeffs_bwd_prep_kernel: one warp per token: sums the D-range partials, writes dH [T, KP]
//   (column K holds c, padded to KP, a multiple of 4) and the per-token dalpha terms [T, 3] (summed
//   over tokens by mhc_column_sum_kernel; dbias is the column sum of the incoming gradients).
// * mhc_coeffs_split_rows_kernel, mhc_coeffs_split_cols_kernel: dH and phi into bf16 planes.
// * mhc_coeffs_mma_bwd_kernel<T, TG, VEC, LAYER, N, KS, NQ, STAGES>: block of N warps, warp i owns
//   columns [cb * 64, cb * 64 + 64) of stream i and walks the block's token range 16 tokens a step:
//   dphi[64 positions, K] += x^T dH (x as the A operand, rows = positions), dx[16 tokens, 64] =
//   dH phi^T - c x (dH as the A operand), and with LAYER the rest of the mHC layer's dx:
//   + H_pre_i g_layer_in + sum_j H_res[j, i] g_j (OPS.md sections 6 and 7), rounded once.
// * mhc_coeffs_zero_kernel: zero parameter gradients.
#include "coeffs.cuh"

namespace mhc_coeffs {

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

// Dynamic shared memory of the kernels of this unit that take some, in bytes: what a launch must
// allocate.  Each kernel static_asserts that its layout fills exactly this; the launch computes the
// same number from its KernelSpec (mhc_cupy/ops/coeffs/), and tests/test_launch_layout.py compiles
// these functions against the size of every planned launch.
// mhc_coeffs_mma_bwd_kernel: the block's phi rows [PO][64 N][16 KS] bf16, then per stage x [16][64 N]
// T (token rows padded by 16 bytes), dH_r [PO][16][16 KS] and dH_c [3][8 NQ][16] bf16, and where the
// layer's g is staged (LAYER, VEC, 16-bit TG) g [N][16][64] TG; PO = 2 planes for 16-bit T, 3 for float32.
template <typename T, typename TG, bool VEC, bool LAYER, int N, int KS, int NQ, int STAGES>
__host__ __device__ constexpr int mma_bwd_smem() {
    constexpr int PO = sizeof(T) == 4 ? 3 : 2, K16 = 16 * KS;
    constexpr bool GS = LAYER && VEC && sizeof(TG) == 2;
    return PO * 64 * N * K16 * 2 + STAGES * (16 * (64 * N * (int)sizeof(T) + 16) + PO * 16 * K16 * 2 + 3 * 8 * NQ * 32 +
                                             (GS ? N * 16 * 64 * (int)sizeof(TG) : 0));
}

}  // namespace mhc_coeffs

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

// out[i] = 0 for i < count (zero parameter gradients: no tokens, missing incoming gradients).
__global__ void mhc_coeffs_zero_kernel(float* __restrict__ out, i64 count) {
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < count; i += (i64)gridDim.x * blockDim.x)
        out[i] = 0.f;
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
        mhc_mma::split_bits<3>(v, p);
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
        mhc_mma::split_bits<3>(v, p);
#pragma unroll
        for (int j = 0; j < 3; ++j) planes[j * total + i] = __ushort_as_bfloat16((unsigned short)p[j]);
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
// Dynamic shared memory: mhc_coeffs::mma_bwd_smem (phi and dH_r in PO planes: 2 for 16-bit x, 3 for float32).
// 3 blocks of 4 warps per SM need at most 168 registers a thread; the launch bound asks ptxas for
// them with 16-bit x (NVRTC 12.9, sm_90, n = 4: bf16 164 with the layer's g staged, 151 without,
// no spills; fp16 168 with 12 bytes spilled, where unbounded it took 171 / 178 and 2 blocks fit:
// 2-5 % slower layer fwd+bwd on the H200).  float32 x (over 200 registers) has no bound.
// Per step a thread's addresses are the block's first token row plus int token offsets (u below),
// no 64-bit token arithmetic (before: 1,490 instructions a warp per 16-token step, ncu, bf16 n = 4
// layer, most of them address and predicate work of the copies and the per-token loads).
// DY (mhc_coeffs_mma_bwd_dy_kernel, OPS.md section 12 "Fused boundary backward"): after each step's dx
// stores, the previous layer's post-op dy_prev = sum_i H_post_prev[t, i] dx_i (the rounded dx, read
// back from global memory after a barrier: the block wrote all N streams of its 16 tokens x 64
// columns; L2 hits) in the post op's backward order (mhc_stream_mix_distribute_bwd_kernel: its bits).
namespace mhc_coeffs {
template <typename T, typename TG, bool VEC, bool LAYER, int N, int KS, int NQ, int STAGES, bool DY>
__device__ __forceinline__ void mma_bwd(const T* __restrict__ x, const __nv_bfloat16* __restrict__ phi_r,
                                        const __nv_bfloat16* __restrict__ dH_r, const __nv_bfloat16* __restrict__ dH_c,
                                        const float* __restrict__ dH, const TG* __restrict__ g,
                                        const TG* __restrict__ g_li, const float* __restrict__ H_pre,
                                        const float* __restrict__ H_res, const TG* __restrict__ gx, T* __restrict__ dx,
                                        float* __restrict__ dphi, i64 tokens, i64 tokens_p, int C, int K, int KP,
                                        i64 t_split, int res_t, const float* __restrict__ H_post_prev,
                                        T* __restrict__ dy_prev) {
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
    static_assert(PO * nw * K16 * 2 + STAGES * SB == mma_bwd_smem<T, TG, VEC, LAYER, N, KS, NQ, STAGES>(),
                  "the launch's shared memory");

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
                                mhc::mma_m16n8k16<__nv_bfloat16>(acc[j0 + jj], a, bw[jj][pb][2 * s],
                                                                 bw[jj][pb][2 * s + 1]);
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
        if constexpr (DY) {
            __syncthreads();  // the step's dx (all N streams) written and visible to the block
            for (int q = threadIdx.x; q < 16 * 64; q += 32 * N) {
                const int u = q >> 6, col = cb0 + (q & 63);
                if (u0 + u >= rows || col >= C) continue;
                const i64 t = t_begin + u0 + u;
                float s = 0.f;
#pragma unroll
                for (int i = 0; i < N; ++i)
                    s = fmaf(H_post_prev[t * N + i], mhc::to_float(dx[t * (i64)D + i * C + col]), s);
                dy_prev[t * (i64)C + col] = mhc::from_float<T>(s);
            }
        }
    }
    cp_async_wait<0>();
    store_dphi<NQ>(dphi + (i64)blockIdx.y * D * (i64)K, accp, (i64)warp * C, cb0, C, K, 0, g8, tq);
}
}  // namespace mhc_coeffs

template <typename T, typename TG, bool VEC, bool LAYER, int N, int KS, int NQ, int STAGES>
__global__ void __launch_bounds__(128, sizeof(T) == 2 ? 3 : 1)
mhc_coeffs_mma_bwd_kernel(const T* __restrict__ x, const __nv_bfloat16* __restrict__ phi_r,
                          const __nv_bfloat16* __restrict__ dH_r, const __nv_bfloat16* __restrict__ dH_c,
                          const float* __restrict__ dH, const TG* __restrict__ g, const TG* __restrict__ g_li,
                          const float* __restrict__ H_pre, const float* __restrict__ H_res,
                          const TG* __restrict__ gx, T* __restrict__ dx, float* __restrict__ dphi, i64 tokens,
                          i64 tokens_p, int C, int K, int KP, i64 t_split, int res_t) {
    mhc_coeffs::mma_bwd<T, TG, VEC, LAYER, N, KS, NQ, STAGES, false>(
        x, phi_r, dH_r, dH_c, dH, g, g_li, H_pre, H_res, gx, dx, dphi, tokens, tokens_p, C, K, KP, t_split, res_t,
        nullptr, nullptr);
}

// mhc_coeffs_mma_bwd_kernel (LAYER only) that also writes the previous layer's dy_prev [tokens, C]
// from H_post_prev [tokens, N] (DY above).  The same template parameters and shared memory.
template <typename T, typename TG, bool VEC, bool LAYER, int N, int KS, int NQ, int STAGES>
__global__ void __launch_bounds__(128, sizeof(T) == 2 ? 3 : 1)
mhc_coeffs_mma_bwd_dy_kernel(const T* __restrict__ x, const __nv_bfloat16* __restrict__ phi_r,
                             const __nv_bfloat16* __restrict__ dH_r, const __nv_bfloat16* __restrict__ dH_c,
                             const float* __restrict__ dH, const TG* __restrict__ g, const TG* __restrict__ g_li,
                             const float* __restrict__ H_pre, const float* __restrict__ H_res,
                             const TG* __restrict__ gx, T* __restrict__ dx, float* __restrict__ dphi, i64 tokens,
                             i64 tokens_p, int C, int K, int KP, i64 t_split, int res_t,
                             const float* __restrict__ H_post_prev, T* __restrict__ dy_prev) {
    static_assert(LAYER, "dy_prev is a layer backward's");
    mhc_coeffs::mma_bwd<T, TG, VEC, LAYER, N, KS, NQ, STAGES, true>(
        x, phi_r, dH_r, dH_c, dH, g, g_li, H_pre, H_res, gx, dx, dphi, tokens, tokens_p, C, K, KP, t_split, res_t,
        H_post_prev, dy_prev);
}
