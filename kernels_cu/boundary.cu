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
// [c_begin, c_end) of every stream (c_split a multiple of 64), walked in 32-channel units u; a pipeline
// step is SUB units of phi's rows (every stream, the three bf16 planes, mhc_coeffs_split_phi_fwd_kernel's
// [3, Kp, Dp] layout) staged in shared memory by cp.async, the only operand the block's warps share.
// x and y go from global memory straight into the registers of the lane that mixes them (each element
// is used by one lane): per unit, a lane loads the 8 channels 8 tq .. of its two rows (g, g + 8) of
// the N streams of x and of y, mixes them, stores out, and feeds the rounded values to the tensor cores
// as the A fragment (x~ positions i C + c) against phi's rows of the same positions; each (unit,
// stream)'s products go into a fresh accumulator added to acc in float32, as
// mhc_coeffs_mma_fwd_kernel does.  bf16 T (one bf16 part: the rounded bits are both out's words and
// the A fragment) mixes all N streams of one channel from one conversion of its inputs, so its sum of
// squares runs over (unit, channel, stream); float16 / float32 (two / three parts) mix one stream at
// a time, (unit, stream, channel).  The sums of squares that overflow float32 (inf) are summed again
// by the lane, scaled by 2^-100 in the same order, from the out values it stored (SumSq).  Needs
// C % 8 == 0 and x, y, out 16-byte aligned (whole 8-element chunks; the host falls back to the
// separate kernels otherwise).
//
// Determinism: fixed sum orders throughout (per-lane sequential, fixed shuffles, the tensor cores'
// fixed accumulation); no atomics.
#include "coeffs.cuh"

namespace mhc_boundary {

// Dynamic shared memory of mhc_boundary_fwd_kernel, in bytes: per stage phi [N streams][3 planes]
// [8 NTILE columns][32 SUB] bf16, then the 64 tokens' H_post and M rows [64][N + N*N] float32.
template <typename T, int N, int NTILE, int STAGES, int SUB>
__host__ __device__ constexpr int fwd_smem() {
    return STAGES * N * 3 * NTILE * 8 * 64 * SUB + 64 * (N + N * N) * 4;
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
    using XV = mhc::Packed<T, 8>;                    // a lane's 8 channels of one row, as raw words
    constexpr int P = XParts<T>::value;
    constexpr int TOK = 64;                          // tokens per block
    constexpr int KC = NTILE * 8;                    // columns
    constexpr int PROW = 64 * SUB;                   // bytes of one phi column's positions of one stream in a stage
    constexpr int SB = N * 3 * KC * PROW;            // stage bytes
    constexpr int CW = N + N * N;                    // coefficient floats per token: H_post, then M row-major
    constexpr int SWZ = PROW == 128 ? 4 : 0;         // chunk c of an odd column sits at c ^ SWZ
    constexpr int PC = PROW / 16;                    // 16-byte chunks per phi row
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
    const int steps = (c_end - c_begin + 32 * SUB - 1) / (32 * SUB);
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

    auto fill = [&](int step, int stage) {  // phi: stream i, plane p, column kk, chunk q
        unsigned char* st = smem + stage * SB;
        const int c0 = c_begin + step * 32 * SUB;
        for (int k = threadIdx.x; k < N * 3 * KC * PC; k += 128) {
            const int q = k % PC, row = k / PC, kk = row % KC, ip = row / KC, p = ip % 3, i = ip / 3;
            const int c = c0 + q * 8;
            const bool ok = c < c_end;
            const __nv_bfloat16* src = planes + p * plane + (i64)kk * Dp + (i64)i * C + c;
            cp_async16(st + row * PROW + (q ^ ((kk & 1) * SWZ)) * 16, ok ? (const void*)src : (const void*)planes, ok);
        }
    };

    float acc[1][NTILE][4];  // (one m tile, as fwd_substep takes it)
    float ss[2] = {0.f, 0.f};
    mhc::zero(acc);
    const int row0 = warp * 16 + g;  // the lane's rows: row0, row0 + 8
    const i64 trow[2] = {t0 + row0, t0 + row0 + 8};

    pipeline_start<STAGES>(steps, fill);  // (its barriers also publish s_coef)
    for (int s = 0; s < steps; ++s) {
        pipeline_next<STAGES>(s, steps, fill);
        const unsigned char* st = smem + (s % STAGES) * SB;
#pragma unroll 1
        for (int sub = 0; sub < SUB; ++sub) {
            const int c = c_begin + (s * SUB + sub) * 32 + tq * 8;  // the lane's 8 channels
            // byte offset of the lane's 8 positions in a phi row (rows of the parity of g)
            const int phi_o = (sub * 64 + tq * 16) ^ ((g & 1) * SWZ * 16);
            XV xv[N + 1][2];  // streams 0 .. N-1 of x, then y (N)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const bool ok = trow[h] < tokens && c < c_end;
#pragma unroll
                for (int j = 0; j <= N; ++j) {
                    if (ok) {
                        xv[j][h].load(j < N ? x + (trow[h] * N + j) * (i64)C + c : y + trow[h] * (i64)C + c);
                    } else {
#pragma unroll
                        for (int w = 0; w < XV::W; ++w) xv[j][h].w[w] = 0u;
                    }
                }
            }
            // phi: the same 8 positions (stream i) of column 8q + g, every plane; then the MMAs
            auto gemm = [&](int i, const unsigned (&aw)[1][P][2][4]) {
                unsigned bw[NTILE][3][4];
#pragma unroll
                for (int q = 0; q < NTILE; ++q)
#pragma unroll
                    for (int p = 0; p < 3; ++p)
                        mhc::load_words<4>(st + ((i * 3 + p) * KC + 8 * q + g) * PROW + phi_o, bw[q][p]);
                fwd_substep(acc, aw, bw);
            };
            if constexpr (P == 1) {
                // every stream's 8 outputs of a row from one conversion of the row's inputs; their
                // bf16 bits are out's words and the A fragments
                unsigned ow[N][2][4];
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const float* cf = s_coef + (row0 + 8 * h) * CW;
#pragma unroll
                    for (int e = 0; e < 8; ++e) {
                        float xf[N + 1];
#pragma unroll
                        for (int j = 0; j <= N; ++j) xf[j] = xv[j][h][e];
#pragma unroll
                        for (int i = 0; i < N; ++i) {
                            float v = cf[i] * xf[N];
#pragma unroll
                            for (int j = 0; j < N; ++j) v = fmaf(cf[N + i * N + j], xf[j], v);
                            const unsigned b = mhc::to_bits<T>(v);
                            const float o = mhc::from_bits<T>(b);  // rounded once, as stored
                            ss[h] = fmaf(o, o, ss[h]);
                            ow[i][h][e >> 1] = (e & 1) ? ow[i][h][e >> 1] | (b << 16) : b;
                        }
                    }
                    if (trow[h] < tokens && c < c_end)
#pragma unroll
                        for (int i = 0; i < N; ++i) mhc::store_words<4>(out + (trow[h] * N + i) * (i64)C + c, ow[i][h]);
                }
#pragma unroll
                for (int i = 0; i < N; ++i) {
                    unsigned aw[1][P][2][4];
#pragma unroll
                    for (int h = 0; h < 2; ++h)
#pragma unroll
                        for (int w = 0; w < 4; ++w) aw[0][0][h][w] = ow[i][h][w];
                    gemm(i, aw);
                }
            } else {
#pragma unroll 1
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
                        }
                        if (trow[h] < tokens && c < c_end) mhc::store_vec<T, 8>(out + (trow[h] * N + i) * (i64)C + c, o);
                        unsigned bits[8][P];
#pragma unroll
                        for (int e = 0; e < 8; ++e) split_bits<P>(o[e], bits[e]);
#pragma unroll
                        for (int p = 0; p < P; ++p)
#pragma unroll
                            for (int w = 0; w < 4; ++w) aw[0][p][h][w] = pack2(bits[2 * w][p], bits[2 * w + 1][p]);
                    }
                    gemm(i, aw);
                }
            }
        }
    }
    cp_async_wait<0>();

#pragma unroll
    for (int h = 0; h < 2; ++h) {
        float s = ss[h];
        s += __shfl_xor_sync(0xffffffffu, s, 1);
        s += __shfl_xor_sync(0xffffffffu, s, 2);
        const i64 t = trow[h];
        // after an overflow (the quad's row sum is inf, rare): the sum of (out 2^-100)^2 in the order
        // above, from the values this lane stored, for part's minus the scaled sum (see SumSq)
        float sq = 0.f;
        if (isinf(s) && t < tokens) {
            for (int c = c_begin + tq * 8; c < c_end; c += 32) {
                const T* o = out + t * N * (i64)C + c;
                auto add = [&](int i, int e) {
                    const float v = mhc::to_float<T>(o[i * (i64)C + e]) * mhc::STAT_SCALE;
                    sq = fmaf(v, v, sq);
                };
#pragma unroll
                for (int a = 0; a < (P == 1 ? 8 : N); ++a)
#pragma unroll
                    for (int b = 0; b < (P == 1 ? N : 8); ++b) P == 1 ? add(b, a) : add(a, b);
            }
        }
        sq += __shfl_xor_sync(0xffffffffu, sq, 1);
        sq += __shfl_xor_sync(0xffffffffu, sq, 2);
        if (t >= tokens) continue;
        float* row = part + ((i64)split * tokens + t) * (K + 1);
        if (tq == 0) row[K] = isinf(s) ? -sq : s;
#pragma unroll
        for (int q = 0; q < NTILE; ++q)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int k = 8 * q + 2 * tq + e;
                if (k < K) row[k] = acc[0][q][2 * h + e];
            }
    }
}
