// The fused layer boundary's forward (OPS.md section 12, "Fused boundary"): the residual update of
// layer l and the coefficient GEMM of layer l + 1 in one pass over the tile being written.
//
//   out_i = sum_j M_ij x_j + H_post_i y         (layer l's post op, OPS.md section 6; M = H_res, or
//                                                H_res transposed under convention="deepseek")
//   part[split, t, k] = sum over the split's positions d of out~_d phi[d, k]   (layer l + 1's H~)
//   part[split, t, K] = sum over them of out~_d^2                             (its sum of squares)
//
// out is rounded once to T (the post op's kernel's sum order: H_post_i y, then + M_ij x_j for
// j = 0 .. N-1, each an fmaf: the same bits as mhc_post_op_fwd), written, and the rounded values
// are what the GEMM and the sum of squares see: the numbers layer l + 1's coefficient forward would
// read back.  mhc_coeffs_fwd_finish_kernel (coeffs_fwd.cu) then sums the splits in order.
//
// mhc_boundary_fwd_kernel<T, N, NTILE, STAGES, SUB>: 128 threads (4 warps), 64 tokens a block (16 a
// warp), every column of phi (K = N*N + 2N <= 8 NTILE: N <= 6).  A split is a channel range
// [c_begin, c_end) of every stream (c_split a multiple of 64); a pipeline step is STEP = 32 SUB
// channels of the N streams of x and of y, with the phi rows of those positions (every stream, the
// three bf16 planes, mhc_coeffs_split_phi_fwd_kernel's [3, Kp, Dp] layout).  Per 32-channel unit u of
// the split and stream i = 0 .. N-1 (in that order, whatever SUB: the bits do not depend on the
// layout), a lane mixes the 8 channels 8 tq .. of its two rows (g, g + 8) from shared memory, stores
// them, and feeds them to the tensor cores as the A fragment (x~ positions i C + c); B is phi's rows of
// the same positions; each unit's products go into a fresh accumulator added to acc in float32, as
// mhc_coeffs_mma_fwd_kernel does.  Needs C % 8 == 0 and x, y, out 16-byte aligned (whole 8-element
// chunks; the host falls back to the separate kernels otherwise).
//
// Determinism: fixed sum orders throughout (per-lane sequential, fixed shuffles, the tensor cores'
// fixed accumulation); no atomics.
#include "coeffs.cuh"

namespace mhc_boundary {

// Dynamic shared memory of mhc_boundary_fwd_kernel, in bytes: per stage x and y [N + 1][64 tokens]
// [STEP] T and phi [N streams][3 planes][8 NTILE columns][STEP] bf16, then the 64 tokens' H_post and
// M rows [64][N + N*N] float32.
template <typename T, int N, int NTILE, int STAGES, int SUB>
__host__ __device__ constexpr int fwd_smem() {
    return STAGES * ((N + 1) * 64 * 32 * SUB * (int)sizeof(T) + N * 3 * NTILE * 8 * 64 * SUB) +
           64 * (N + N * N) * 4;
}

}  // namespace mhc_boundary

// Grid: blockIdx.x = split * tiles + tile; 128 threads.  planes: [3, Kp, Dp] bf16 (Kp = 8 NTILE,
// Dp >= N C, a multiple of 8).  h_post [T, N], h_res [T, N, N] float32 (res_t: transposed).
// Dynamic shared memory: mhc_boundary::fwd_smem.
template <typename T, int N, int NTILE, int STAGES, int SUB>
__global__ void __launch_bounds__(128)
mhc_boundary_fwd_kernel(const T* __restrict__ x, const T* __restrict__ y, const float* __restrict__ h_post,
                        const float* __restrict__ h_res, T* __restrict__ out, const __nv_bfloat16* __restrict__ planes,
                        float* __restrict__ part, i64 tokens, int C, int Dp, int K, i64 tiles, int c_split,
                        int res_t) {
    using namespace mhc_coeffs;
    constexpr int P = XParts<T>::value;
    constexpr int TOK = 64;                          // tokens per block
    constexpr int KC = NTILE * 8;                    // columns
    constexpr int STEP = 32 * SUB;                   // channels per stage
    constexpr int XROW = STEP * (int)sizeof(T);      // bytes of one token's channels of one stream in a stage
    constexpr int PROW = STEP * 2;                   // bytes of one phi column's positions of one stream
    constexpr int XB = (N + 1) * TOK * XROW;         // x and y bytes per stage
    constexpr int SB = XB + N * 3 * KC * PROW;       // stage bytes
    constexpr int CW = N + N * N;                    // coefficient floats per token: H_post, then M row-major
    constexpr int SWZ = (XROW == 128 && PROW == 128) ? 4 : 0;  // chunk c of an odd row sits at c ^ SWZ
    constexpr int E16 = 16 / (int)sizeof(T);         // elements per 16-byte chunk
    constexpr int XC = XROW / 16, PC = PROW / 16;    // 16-byte chunks per row
    static_assert(N >= 1 && KC >= N * N + 2 * N && NTILE <= 6, "every column in one block");
    static_assert(STAGES * SB + TOK * CW * 4 == mhc_boundary::fwd_smem<T, N, NTILE, STAGES, SUB>(),
                  "the launch's shared memory");
    extern __shared__ __align__(16) unsigned char smem[];
    float* const s_coef = reinterpret_cast<float*>(smem + STAGES * SB);

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, tq = lane & 3;
    const FwdBlock blk = fwd_block(tiles, 1);
    const int split = blk.split;
    const i64 tile = blk.tile;
    const int c_begin = split * c_split;
    const int c_end = min(C, c_begin + c_split);
    const int steps = (c_end - c_begin + STEP - 1) / STEP;
    const i64 t0 = tile * TOK;
    const i64 plane = (i64)KC * Dp;

    // the block's coefficients (zero past the last token: those rows mix zeros and store nothing)
    for (int k = threadIdx.x; k < TOK * CW; k += 128) {
        const int r = k / CW, c = k - r * CW;
        const i64 t = t0 + r;
        float v = 0.f;
        if (t < tokens) {
            if (c < N) {
                v = h_post[t * N + c];
            } else {
                const int m = c - N, i = m / N, j = m - i * N;
                v = h_res[t * (N * N) + (res_t ? j * N + i : m)];
            }
        }
        s_coef[k] = v;
    }

    auto fill = [&](int step, int stage) {
        unsigned char* st = smem + stage * SB;
        const int c0 = c_begin + step * STEP;
        for (int k = threadIdx.x; k < (N + 1) * TOK * XC; k += 128) {  // stream j (N: y), row r, chunk q
            const int q = k % XC, jr = k / XC, r = jr % TOK, j = jr / TOK;
            const int c = c0 + q * E16;
            const i64 t = t0 + r;
            const bool ok = t < tokens && c < c_end;
            const T* src = j < N ? x + (t * N + j) * (i64)C + c : y + t * (i64)C + c;
            cp_async16(st + jr * XROW + (q ^ ((r & 1) * SWZ)) * 16, ok ? (const void*)src : (const void*)x, ok);
        }
        for (int k = threadIdx.x; k < N * 3 * KC * PC; k += 128) {  // stream i, plane p, column kk, chunk q
            const int q = k % PC, row = k / PC, kk = row % KC, ip = row / KC, p = ip % 3, i = ip / 3;
            const int c = c0 + q * 8;
            const bool ok = c < c_end;
            const __nv_bfloat16* src = planes + p * plane + (i64)kk * Dp + (i64)i * C + c;
            cp_async16(st + XB + row * PROW + (q ^ ((kk & 1) * SWZ)) * 16, ok ? (const void*)src : (const void*)planes,
                       ok);
        }
    };

    float acc[1][NTILE][4];  // (one m tile, as fwd_substep takes it)
    float ss[2] = {0.f, 0.f}, qs[2] = {0.f, 0.f};  // qs: (x 2^-100)^2, for an overflow
    mhc::zero(acc);
    const int row0 = warp * 16 + g;  // the lane's rows: row0, row0 + 8

    pipeline_start<STAGES>(steps, fill);  // (its barriers also publish s_coef)
    for (int s = 0; s < steps; ++s) {
        pipeline_next<STAGES>(s, steps, fill);
        const unsigned char* st = smem + (s % STAGES) * SB;
#pragma unroll 1
        for (int sub = 0; sub < SUB; ++sub) {
            const int c = c_begin + s * STEP + sub * 32 + tq * 8;  // the lane's 8 channels
            // byte offset of the lane's 8 positions in a row of x / y and of phi (rows of the parity of g)
            const int phi_o = (sub * 64 + tq * 16) ^ ((g & 1) * SWZ * 16);
            const int x_o = SWZ ? phi_o : (sub * 32 + tq * 8) * (int)sizeof(T);
            float xv[N + 1][2][8];
#pragma unroll
            for (int j = 0; j <= N; ++j)
#pragma unroll
                for (int h = 0; h < 2; ++h)
                    mhc::load_vec<T, 8>(reinterpret_cast<const T*>(st + (j * TOK + row0 + 8 * h) * XROW + x_o), xv[j][h]);
#pragma unroll
            for (int i = 0; i < N; ++i) {
                unsigned aw[1][P][2][4];  // [m tile][part][row half][word]
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const float* cf = s_coef + (row0 + 8 * h) * CW;
                    float o[8];
#pragma unroll
                    for (int e = 0; e < 8; ++e) {
                        float v = cf[i] * xv[N][h][e];
#pragma unroll
                        for (int j = 0; j < N; ++j) v = fmaf(cf[N + i * N + j], xv[j][h][e], v);
                        o[e] = mhc::to_float<T>(mhc::from_float<T>(v));  // rounded once, as stored
                        ss[h] = fmaf(o[e], o[e], ss[h]);
                        const float sc = o[e] * mhc::STAT_SCALE;
                        qs[h] = fmaf(sc, sc, qs[h]);
                    }
                    const i64 t = t0 + row0 + 8 * h;
                    if (t < tokens && c < c_end) mhc::store_vec<T, 8>(out + (t * N + i) * (i64)C + c, o);
                    unsigned bits[8][P];
#pragma unroll
                    for (int e = 0; e < 8; ++e) split_bits<P>(o[e], bits[e]);
#pragma unroll
                    for (int p = 0; p < P; ++p)
#pragma unroll
                        for (int w = 0; w < 4; ++w) aw[0][p][h][w] = pack2(bits[2 * w][p], bits[2 * w + 1][p]);
                }
                // phi: the same 8 positions (stream i) of column 8q + g, every plane
                unsigned bw[NTILE][3][4];
#pragma unroll
                for (int q = 0; q < NTILE; ++q)
#pragma unroll
                    for (int p = 0; p < 3; ++p)
                        mhc::load_words<4>(st + XB + ((i * 3 + p) * KC + 8 * q + g) * PROW + phi_o, bw[q][p]);
                fwd_substep(acc, aw, bw);
            }
        }
    }
    cp_async_wait<0>();

#pragma unroll
    for (int h = 0; h < 2; ++h) {
        float s = ss[h], sq = qs[h];
        s += __shfl_xor_sync(0xffffffffu, s, 1);
        s += __shfl_xor_sync(0xffffffffu, s, 2);
        sq += __shfl_xor_sync(0xffffffffu, sq, 1);
        sq += __shfl_xor_sync(0xffffffffu, sq, 2);
        const i64 t = t0 + row0 + 8 * h;
        if (t >= tokens) continue;
        float* row = part + ((i64)split * tokens + t) * (K + 1);
        if (tq == 0) row[K] = isinf(s) ? -sq : s;  // after an overflow: minus the scaled sum (see SumSq)
#pragma unroll
        for (int q = 0; q < NTILE; ++q)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int k = 8 * q + 2 * tq + e;
                if (k < K) row[k] = acc[0][q][2 * h + e];
            }
    }
}
