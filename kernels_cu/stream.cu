// Stream kernels of mHC (OPS.md sections 3-7): the residual update
//   out_i = sum_j H_res[i, j] x_j + H_post[i] y          (post op, section 6)
// of which stream mix (section 3, no y) and stream distribute (section 5, no x)
// are special cases, and stream aggregate out = sum_i h_i x_i (section 4; with
// ACT=1 it is the pre op's layer input, h = sigmoid(h_pre_raw), section 7; followed
// by the next GEMM's RMSNorm and / or float8 quantisation of each row, section 13).
//
// Launch layout: one block per token (grid-stride over tokens), blockDim.x a
// multiple of 32; each thread owns E contiguous columns at a time for all N
// streams.  E > 1 needs every pointer aligned to the E-element access and
// C % E == 0; E = 1 is the general path (odd C, offset views).  The forward kernels without
// reductions (post op / mix / distribute, aggregate) take a token's columns split over gridDim.y
// blocks (mhc::first_col) where launched so: the post op at a few tokens under kernel choice small.
// Backward per-token reductions (dH, dh) use mhc::block_sum: deterministic.
//
// res_t (the post op under convention="deepseek", OPS.md "DeepSeek-V4 convention"): the
// matrix is H_res transposed, out_j = sum_i H_res[i, j] x_i + H_post[j] y.  Only the index
// of H_res changes, when a block copies it to shared memory (and when it stores dH_res).
#include "common.cuh"
#include "mma.cuh"

using mhc::i64;

namespace {
// Element k = i * N + j of the matrix M of out = M x: H_res[i, j], or H_res[j, i] when res_t.
template <int N>
__device__ __forceinline__ int res_index(int k, int res_t) { return res_t ? (k % N) * N + k / N : k; }
}  // namespace

// Token t's H_res (as the kernels read it, see res_index) and H_post into shared memory,
// between two barriers (the previous token's are no longer read; this token's are visible).
template <int N, bool HAS_X, bool HAS_Y>
__device__ __forceinline__ void stage_coefficients(float* s_res, float* s_post, const float* __restrict__ h_res,
                                                   const float* __restrict__ h_post, i64 h_post_stride, i64 t,
                                                   int res_t) {
    __syncthreads();
    if (HAS_X)
        for (int k = threadIdx.x; k < N * N; k += blockDim.x) s_res[k] = h_res[t * (N * N) + res_index<N>(k, res_t)];
    if (HAS_Y)
        for (int k = threadIdx.x; k < N; k += blockDim.x) s_post[k] = h_post[t * h_post_stride + k];
    __syncthreads();
}

// ---------------------------------------------------------------- post op fwd
template <typename T, int N, int E, bool HAS_X, bool HAS_Y>
__global__ void mhc_stream_mix_distribute_fwd_kernel(const T* __restrict__ x, const T* __restrict__ y,
                                                     const float* __restrict__ h_post, i64 h_post_stride,
                                                     const float* __restrict__ h_res, T* __restrict__ out,
                                                     i64 tokens, int C, int res_t) {
    __shared__ float s_res[HAS_X ? N * N : 1];
    __shared__ float s_post[HAS_Y ? N : 1];
    for (i64 t = blockIdx.x; t < tokens; t += gridDim.x) {
        stage_coefficients<N, HAS_X, HAS_Y>(s_res, s_post, h_res, h_post, h_post_stride, t, res_t);
        const T* xt = x + t * N * (i64)C;
        const T* yt = y + t * (i64)C;
        T* ot = out + t * N * (i64)C;
        for (unsigned c = mhc::first_col(E); c < (unsigned)C; c += mhc::col_step(E)) {
            float xv[HAS_X ? N : 1][E];
            float yv[E];
            if (HAS_X) {
#pragma unroll
                for (int j = 0; j < N; ++j) mhc::load_vec<T, E>(xt + (i64)j * C + c, xv[j]);
            }
            if (HAS_Y) mhc::load_vec<T, E>(yt + c, yv);
            // Unrolled over the N output rows, the compiler would keep all N x N coefficients in
            // registers: for N > 8 it spills (255 registers at N = 16), so the rows run in a loop
            // (distribute only, without x, has no N x N coefficients and stays unrolled).
#pragma unroll(HAS_X && N > 8 ? 1 : N)
            for (int i = 0; i < N; ++i) {
                float o[E];
#pragma unroll
                for (int e = 0; e < E; ++e) {
                    float s = HAS_Y ? s_post[i] * yv[e] : 0.f;
                    if (HAS_X) {
#pragma unroll
                        for (int j = 0; j < N; ++j) s = fmaf(s_res[i * N + j], xv[j][e], s);
                    }
                    o[e] = s;
                }
                mhc::store_vec<T, E>(ot + (i64)i * C + c, o);
            }
        }
    }
}

// ---------------------------------------------------------------- post op bwd
// dy = sum_i H_post_i g_i ; dx_j = sum_i H_res_ij g_i ;
// dH_post_i = sum_c g_ic y_c ; dH_res_ij = sum_c g_ic x_jc  (per token).
// dH_res rows are reduced RB at a time (RB*N accumulators per thread); the
// first pass also writes dx (unless null), dy and dH_post.  d_post is [tokens, N] per token
// (the host sums it over tokens for a shared H_post).
// LI (mhc_layer_post_pre_bwd_kernel; HAS_X and HAS_Y): no dx and no dy; the first pass also sums
// dh_j = sum_c g_li_c x_jc, reduced on its own as mhc_stream_aggregate_bwd_kernel reduces it
// (mhc::block_sum<N>, the same per-thread order: its bits), and writes the pre op's
// d_pre_j = dh_j s_j (1 - s_j), s = sigmoid(h_pre_raw) (that kernel's ACT = 1 without gh);
// g_post / g_res (may be null): other gradients of H_post / H_res, added to d_post / d_res.
// STAGES > 0 (mhc_stream_mix_distribute_bwd_kernel's post_pipe form: one pass, 16-byte vectors of 16-bit g, x,
// y, not LI): a
// thread's next chunks of g, x and y (STAGES - 1 ahead, across tokens) come through cp.async into its
// own slots of dynamic shared memory, [STAGES][2N + 1][blockDim.x] 16-byte slots, while it works on
// the current one: the loads of the next token are in flight during this token's block reduction.
// Each thread reads only what it copied (no barrier for the slots); the arithmetic, and so the bits,
// are the direct loads'.
namespace mhc_stream {
// The 8 16-bit values of 16 bytes (a pipelined slot) as floats.
template <typename U>
__device__ __forceinline__ void unpack16(uint4 w, float (&v)[8]) {
    const unsigned ww[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int e = 0; e < 8; ++e) v[e] = mhc::word_elem<U>(ww[e / 2], e & 1);
}

template <typename T, typename TG, int N, int E, int RB, bool HAS_X, bool HAS_Y, bool LI, int STAGES = 0>
__device__ __forceinline__ void mix_distribute_bwd(const TG* __restrict__ g, const T* __restrict__ x,
                                                   const T* __restrict__ y, const float* __restrict__ h_post,
                                                   i64 h_post_stride, const float* __restrict__ h_res,
                                                   T* __restrict__ dx, T* __restrict__ dy,
                                                   float* __restrict__ d_post, float* __restrict__ d_res,
                                                   i64 tokens, int C, int res_t, const TG* __restrict__ g_li,
                                                   const float* __restrict__ h_pre_raw,
                                                   const float* __restrict__ g_post,
                                                   const float* __restrict__ g_res, float* __restrict__ d_pre) {
    static_assert(!LI || (HAS_X && HAS_Y), "the layer's backward has x and y");
    constexpr int KR = HAS_X ? RB * N : 0;
    constexpr int KP = HAS_Y ? N : 0;
    constexpr int K = KR + KP;
    __shared__ float s_res[HAS_X ? N * N : 1];
    __shared__ float s_post[HAS_Y ? N : 1];
    __shared__ float red[K * 32];  // K values x up to 32 warps
    // STAGES: the cp.async ring (see above); (pt, pc) the next chunk to fetch, in the order of the loops below
    constexpr int PR = 2 * N + 1;  // slot rows: g_0..g_{N-1}, x_0..x_{N-1}, y
    static_assert(STAGES == 0 || (!LI && HAS_X && HAS_Y && RB >= N && E * sizeof(T) == 16 &&
                                  sizeof(TG) == sizeof(T)), "the pipelined loads: one pass of 16-byte vectors");
    extern __shared__ __align__(16) unsigned char pipe_smem[];
    i64 pt = blockIdx.x;
    unsigned pc = threadIdx.x * E;
    int stage = 0;
    auto fetch = [&](int st) {  // one commit group per call (empty when this thread has nothing left)
        if (pt < tokens && pc < (unsigned)C) {
            uint4* slot = reinterpret_cast<uint4*>(pipe_smem) + (i64)st * PR * blockDim.x + threadIdx.x;
#pragma unroll
            for (int i = 0; i < N; ++i) {
                mhc_mma::cp_async16(slot + i * blockDim.x, g + (pt * N + i) * (i64)C + pc, true);
                mhc_mma::cp_async16(slot + (N + i) * blockDim.x, x + (pt * N + i) * (i64)C + pc, true);
            }
            mhc_mma::cp_async16(slot + 2 * N * blockDim.x, y + pt * (i64)C + pc, true);
            pc += blockDim.x * E;
            if (pc >= (unsigned)C) {
                pt += gridDim.x;
                pc = threadIdx.x * E;
            }
        }
        mhc_mma::cp_async_commit();
    };
    if constexpr (STAGES > 0) {
#pragma unroll
        for (int st = 0; st < STAGES - 1; ++st) fetch(st);
    }
    for (i64 t = blockIdx.x; t < tokens; t += gridDim.x) {
        stage_coefficients<N, HAS_X && !LI, HAS_Y && !LI>(s_res, s_post, h_res, h_post, h_post_stride, t, res_t);
        const TG* gt = g + t * N * (i64)C;
        const T* xt = x + t * N * (i64)C;
        const T* yt = y + t * (i64)C;
        for (int ib = 0; ib < (HAS_X ? N : 1); ib += RB) {
            const bool first = (ib == 0);
            float acc[K > 0 ? K : 1];
#pragma unroll
            for (int k = 0; k < K; ++k) acc[k] = 0.f;
            float acc_li[LI ? N : 1];  // LI: dh of the pre op (first pass)
#pragma unroll
            for (int j = 0; j < (LI ? N : 0); ++j) acc_li[j] = 0.f;
            for (unsigned c = threadIdx.x * E; c < (unsigned)C; c += blockDim.x * E) {
                float gv[N][E];
                float xv[HAS_X ? N : 1][E];
                float yv[E];
                if constexpr (STAGES > 0) {  // this chunk's slots, then the chunk STAGES - 1 ahead into the freed stage
                    mhc_mma::cp_async_wait<STAGES - 2>();
                    const uint4* slot = reinterpret_cast<const uint4*>(pipe_smem) + (i64)stage * PR * blockDim.x +
                                        threadIdx.x;
#pragma unroll
                    for (int i = 0; i < N; ++i) {
                        unpack16<TG>(slot[i * blockDim.x], gv[i]);
                        unpack16<T>(slot[(N + i) * blockDim.x], xv[i]);
                    }
                    unpack16<T>(slot[2 * N * blockDim.x], yv);
                    fetch(stage == 0 ? STAGES - 1 : stage - 1);
                    stage = stage == STAGES - 1 ? 0 : stage + 1;
                } else {
#pragma unroll
                    for (int i = 0; i < N; ++i) mhc::load_vec<TG, E>(gt + (i64)i * C + c, gv[i]);
                    if (HAS_X) {
#pragma unroll
                        for (int j = 0; j < N; ++j) mhc::load_vec<T, E>(xt + (i64)j * C + c, xv[j]);
                    }
                    if (HAS_Y) mhc::load_vec<T, E>(yt + c, yv);
                }
                if (LI && first) {  // in mhc_stream_aggregate_bwd_kernel's order (g_li null: zeros)
                    float lv[E];
                    if (g_li != nullptr) {
                        mhc::load_vec<TG, E>(g_li + t * (i64)C + c, lv);
                    } else {
#pragma unroll
                        for (int e = 0; e < E; ++e) lv[e] = 0.f;
                    }
#pragma unroll
                    for (int j = 0; j < (LI ? N : 0); ++j)
#pragma unroll
                        for (int e = 0; e < E; ++e) acc_li[j] = fmaf(lv[e], xv[j][e], acc_li[j]);
                }
                if (first) {
                    if (HAS_X && !LI && dx != nullptr) {  // null dx: the fused layer adds H_res^T g itself
#pragma unroll(N > 8 ? 1 : N)  // (as in the forward: all N x N coefficients in registers spill)
                        for (int j = 0; j < N; ++j) {
                            float o[E];
#pragma unroll
                            for (int e = 0; e < E; ++e) {
                                float s = 0.f;
#pragma unroll
                                for (int i = 0; i < N; ++i) s = fmaf(s_res[i * N + j], gv[i][e], s);
                                o[e] = s;
                            }
                            mhc::store_vec<T, E>(dx + (t * N + j) * (i64)C + c, o);
                        }
                    }
                    if (HAS_Y && !LI) {
                        float o[E];
#pragma unroll
                        for (int e = 0; e < E; ++e) {
                            float s = 0.f;
#pragma unroll
                            for (int i = 0; i < N; ++i) s = fmaf(s_post[i], gv[i][e], s);
                            o[e] = s;
                        }
                        mhc::store_vec<T, E>(dy + t * (i64)C + c, o);
                    }
                    if (HAS_Y) {
#pragma unroll
                        for (int i = 0; i < N; ++i)
#pragma unroll
                            for (int e = 0; e < E; ++e) acc[KR + i] = fmaf(gv[i][e], yv[e], acc[KR + i]);
                    }
                }
                if (HAS_X) {
#pragma unroll
                    for (int ii = 0; ii < RB; ++ii) {
                        if (ib + ii < N) {
#pragma unroll
                            for (int j = 0; j < N; ++j) {
                                float s = acc[ii * N + j];
#pragma unroll
                                for (int e = 0; e < E; ++e) {
                                    // gv row ib+ii; with several passes, select it with a
                                    // compile-time loop to keep register arrays statically indexed.
                                    float gie = 0.f;
                                    if (RB >= N) {
                                        gie = gv[ii < N ? ii : 0][e];
                                    } else {
#pragma unroll
                                        for (int i = 0; i < N; ++i)
                                            if (i == ib + ii) gie = gv[i][e];
                                    }
                                    s = fmaf(gie, xv[j][e], s);
                                }
                                acc[ii * N + j] = s;
                            }
                        }
                    }
                }
            }
            if (K > 0) {
                mhc::block_sum<K>(acc, red);
                if (HAS_X)
                    for (int k = threadIdx.x; k < KR; k += blockDim.x)
                        if (ib + k / N < N) {
                            if constexpr (LI) {
                                const i64 o = t * (N * N) + res_index<N>(ib * N + k, res_t);
                                d_res[o] = g_res != nullptr ? red[k] + g_res[o] : red[k];
                            } else {
                                d_res[t * (N * N) + res_index<N>(ib * N + k, res_t)] = red[k];
                            }
                        }
                if (HAS_Y && first)
                    for (int k = threadIdx.x; k < KP; k += blockDim.x)
                        d_post[t * N + k] = LI && g_post != nullptr ? red[KR + k] + g_post[t * N + k] : red[KR + k];
                __syncthreads();
            }
            if (LI && first) {
                mhc::block_sum<LI ? N : 1>(acc_li, red);
                for (int k = threadIdx.x; k < N; k += blockDim.x) {
                    const float s = mhc::sigmoid(h_pre_raw[t * N + k]);
                    d_pre[t * N + k] = red[k] * (s * (1.f - s));
                }
                __syncthreads();
            }
        }
    }
}
}  // namespace mhc_stream

// STAGES > 0 (kernel choice post_pipe, off until measured): with x and y, one pass (N <= 4) of 16-byte vectors
// of 16-bit g, x, y (E = 8), the loads pipelined through cp.async STAGES deep (mix_distribute_bwd above), the
// same bits; dynamic shared memory STAGES (2N + 1) blockDim.x 16 bytes.
template <typename T, typename TG, int N, int E, int RB, bool HAS_X, bool HAS_Y, int STAGES = 0>
__global__ void mhc_stream_mix_distribute_bwd_kernel(const TG* __restrict__ g, const T* __restrict__ x,
                                                     const T* __restrict__ y, const float* __restrict__ h_post,
                                                     i64 h_post_stride, const float* __restrict__ h_res,
                                                     T* __restrict__ dx, T* __restrict__ dy,
                                                     float* __restrict__ d_post, float* __restrict__ d_res,
                                                     i64 tokens, int C, int res_t) {
    mhc_stream::mix_distribute_bwd<T, TG, N, E, RB, HAS_X, HAS_Y, false, STAGES>(
        g, x, y, h_post, h_post_stride, h_res, dx, dy, d_post, d_res, tokens, C, res_t, nullptr, nullptr, nullptr,
        nullptr, nullptr);
}

// The post op's coefficient gradients (dH_post, dH_res, plus g_post / g_res where given) and the pre
// op's d_pre (dh_pre_raw) in one pass over g, x, y and g_li (OPS.md section 12, "Fused boundary
// backward"): the reductions of mhc_stream_mix_distribute_bwd_kernel and of
// mhc_stream_aggregate_bwd_kernel (ACT = 1, no dx), with their bits where the launch has theirs (E,
// threads): those of the post op's backward and of mhc_layer_pre_bwd's aggregate step.
template <typename T, typename TG, int N, int E, int RB>
__global__ void mhc_layer_post_pre_bwd_kernel(const TG* __restrict__ g, const T* __restrict__ x,
                                              const T* __restrict__ y, const TG* __restrict__ g_li,
                                              const float* __restrict__ h_pre_raw, const float* __restrict__ g_post,
                                              const float* __restrict__ g_res, float* __restrict__ d_pre,
                                              float* __restrict__ d_post, float* __restrict__ d_res, i64 tokens,
                                              int C, int res_t) {
    mhc_stream::mix_distribute_bwd<T, TG, N, E, RB, true, true, true>(
        g, x, y, nullptr, 0, nullptr, nullptr, nullptr, d_post, d_res, tokens, C, res_t, g_li, h_pre_raw, g_post,
        g_res, d_pre);
}

// The same backward with x and y, without dx (the host adds dx_j = sum_i M_ij g_i as the mix
// forward of g by M transposed; the fused layer needs none, OPS.md section 9), on tensor cores,
// for 16-bit g, x and y: per token, [dH_res | dH_post] = G [X; y]^T (G, X the token's [N, C]
// rows, bf16 / float16 products exact, float32 accumulation) with mma m16n8k16, and
// dy = sum_i H_post_i g_i.  The RB passes of the kernel above re-read g and x N / RB times
// and sum RB N + N values across the block per pass; here each value is read once.
// One token per block at a time (grid-stride), WARPS warps; warp w takes columns
// [32 (w + WARPS s), +32), each thread 8 consecutive columns (one 16-byte access with VEC:
// C % 8 == 0 and 16-byte aligned rows) of g rows g8 + 8 r and of x / y rows 8 q + g8 (row N
// is y).  The 16 columns of a k-step are a permutation of the reduction index, the same for
// both operands.  dy: per thread sum over its g rows, then a reduce-scatter over the 8 lanes
// of a column group (lane g8 ends with column 8 tq + g8).  dH: per-warp accumulators summed
// over warps 0, 1, ... in shared memory.  Fixed order throughout (deterministic).
template <typename T, bool VEC>
__device__ __forceinline__ void load8_words(const T* __restrict__ row, int col, int C, unsigned (&w)[4]) {
#pragma unroll
    for (int k = 0; k < 4; ++k) w[k] = 0u;
    if (row == nullptr) return;
    if (VEC) {
        if (col < C) mhc::load_words<4>(row + col, w);
    } else {
        const unsigned short* r = reinterpret_cast<const unsigned short*>(row);
#pragma unroll
        for (int e = 0; e < 8; ++e)
            if (col + e < C) w[e >> 1] |= (unsigned)r[col + e] << (16 * (e & 1));
    }
}

template <typename T, int N, bool VEC, int WARPS>
__global__ void __launch_bounds__(32 * WARPS)
mhc_stream_post_bwd_mma_kernel(const T* __restrict__ g, const T* __restrict__ x, const T* __restrict__ y,
                               const float* __restrict__ h_post, i64 h_post_stride, T* __restrict__ dy,
                               float* __restrict__ d_post, float* __restrict__ d_res, i64 tokens, int C,
                               int res_t) {
    constexpr int MT = (N + 15) / 16;      // m tiles: rows i of g
    constexpr int QT = (N + 1 + 7) / 8;    // n tiles: rows j of x, then y (j = N)
    constexpr int R = MT * QT * 4;         // accumulators per thread
    __shared__ float red[WARPS * R * 32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g8 = lane >> 2, tq = lane & 3;
    for (i64 t = blockIdx.x; t < tokens; t += gridDim.x) {
        float hp[2 * MT];
#pragma unroll
        for (int r = 0; r < 2 * MT; ++r) hp[r] = g8 + 8 * r < N ? h_post[t * h_post_stride + g8 + 8 * r] : 0.f;
        float acc[MT][QT][4];
        mhc::zero(acc);
        const T* gt = g + t * N * (i64)C;
        const T* xt = x + t * N * (i64)C;
#pragma unroll 2
        for (unsigned c0 = 32 * warp; c0 < (unsigned)C; c0 += 32 * WARPS) {  // unsigned: C up to 2^31 - 1
            const int col = (int)c0 + 8 * tq;
            unsigned ga[2 * MT][4], xb[QT][4];
#pragma unroll
            for (int r = 0; r < 2 * MT; ++r) {
                const int i = g8 + 8 * r;
                load8_words<T, VEC>(i < N ? gt + (i64)i * C : nullptr, col, C, ga[r]);
            }
#pragma unroll
            for (int q = 0; q < QT; ++q) {
                const int j = 8 * q + g8;
                load8_words<T, VEC>(j < N ? xt + (i64)j * C : (j == N ? y + t * (i64)C : nullptr), col, C, xb[q]);
            }
            // the chunk's products into a fresh accumulator, added to acc in float32 (round to
            // nearest): the tensor cores' own accumulation truncates (as the coefficient GEMM, OPS.md
            // section 8), which over a long row would bias dH by up to ~1e-4 of it at C ~ 1e5
            float stp[MT][QT][4];
            mhc::zero(stp);
#pragma unroll
            for (int ks = 0; ks < 2; ++ks)
#pragma unroll
                for (int m = 0; m < MT; ++m) {
                    const unsigned a[4] = {ga[2 * m][2 * ks], ga[2 * m + 1][2 * ks], ga[2 * m][2 * ks + 1],
                                           ga[2 * m + 1][2 * ks + 1]};
#pragma unroll
                    for (int q = 0; q < QT; ++q) mhc::mma_m16n8k16<T>(stp[m][q], a, xb[q][2 * ks], xb[q][2 * ks + 1]);
                }
            mhc::add(acc, stp);
            if (dy != nullptr) {
                float v[8];
#pragma unroll
                for (int e = 0; e < 8; ++e) {
                    float s = 0.f;
#pragma unroll
                    for (int r = 0; r < 2 * MT; ++r)
                        s = fmaf(hp[r], mhc::word_elem<T>(ga[r][e >> 1], e & 1), s);
                    v[e] = s;
                }
                mhc::reduce_scatter_step<8, 16>(v, lane);
                if (col + g8 < C) dy[t * (i64)C + col + g8] = mhc::from_float<T>(v[0]);
            }
        }
#pragma unroll
        for (int m = 0; m < MT; ++m)
#pragma unroll
            for (int q = 0; q < QT; ++q)
#pragma unroll
                for (int k = 0; k < 4; ++k) red[((warp * MT + m) * QT + q) * 128 + k * 32 + lane] = acc[m][q][k];
        __syncthreads();
        for (int o = threadIdx.x; o < N * (N + 1); o += 32 * WARPS) {
            const int i = o / (N + 1), j = o - i * (N + 1);
            // accumulator of (i, j): tile (i / 16, j / 8), register 2 ((i % 16) / 8) + j % 2, lane 4 (i % 8) + (j % 8) / 2
            const int m = i >> 4, q = j >> 3, k = 2 * ((i >> 3) & 1) + (j & 1), l = 4 * (i & 7) + ((j & 7) >> 1);
            float s = 0.f;
            for (int w = 0; w < WARPS; ++w) s += red[((w * MT + m) * QT + q) * 128 + k * 32 + l];
            if (j < N) {
                if (d_res != nullptr) d_res[t * (N * N) + res_index<N>(i * N + j, res_t)] = s;
            } else if (d_post != nullptr) {
                d_post[t * N + i] = s;
            }
        }
        __syncthreads();
    }
}

// ------------------------------------------------------- stream aggregate fwd
// out = sum_i h_i x_i; h is per token (h_stride = N) or shared (h_stride = 0).
template <typename T, int N, int E>
__global__ void mhc_stream_aggregate_fwd_kernel(const T* __restrict__ x, const float* __restrict__ h,
                                                i64 h_stride, T* __restrict__ out, i64 tokens, int C) {
    __shared__ float s_h[N];
    for (i64 t = blockIdx.x; t < tokens; t += gridDim.x) {
        __syncthreads();
        for (int k = threadIdx.x; k < N; k += blockDim.x) s_h[k] = h[t * h_stride + k];
        __syncthreads();
        const T* xt = x + t * N * (i64)C;
        for (unsigned c = mhc::first_col(E); c < (unsigned)C; c += mhc::col_step(E)) {
            float o[E];
            mhc::aggregate_cols<T, N, E>(xt, s_h, C, c, o);
            mhc::store_vec<T, E>(out + t * (i64)C + c, o);
        }
    }
}

// ------------------------------------------ stream aggregate for the next GEMM (OPS.md section 13)
namespace {
// layer_in at columns c .. c + E - 1 of token row xt (its N rows; s_h its H_pre), rounded to T as
// mhc_stream_aggregate_fwd_kernel stores it (the same fmaf chain); x loaded at cache priority H.
template <typename T, int N, int E, mhc::Evict H>
__device__ __forceinline__ void aggregate_vec(const T* __restrict__ xt, const float* s_h, int C, unsigned c,
                                              float (&v)[E]) {
    mhc::aggregate_cols<T, N, E, H>(xt, s_h, C, c, v);
#pragma unroll
    for (int e = 0; e < E; ++e) v[e] = mhc::to_float<T>(mhc::from_float<T>(v[e]));
}

// The kept row: element e of vector vi (of V) in cell e V + vi, so a warp's cells are consecutive
// (no bank conflicts); a thread reads back only the cells it wrote (no barrier).
template <typename T, int E>
__device__ __forceinline__ void keep_store(T* s_row, unsigned V, unsigned vi, const float (&v)[E]) {
#pragma unroll
    for (int e = 0; e < E; ++e) s_row[e * V + vi] = mhc::from_float<T>(v[e]);
}
template <typename T, int E>
__device__ __forceinline__ void keep_load(const T* s_row, unsigned V, unsigned vi, float (&v)[E]) {
#pragma unroll
    for (int e = 0; e < E; ++e) v[e] = mhc::to_float<T>(s_row[e * V + vi]);
}

// u = T((v rstd) w) of E columns (two float32 products, then one rounding to T).
template <typename T, int E>
__device__ __forceinline__ void normalise_vec(float (&v)[E], float rstd, const float* __restrict__ w) {
    float wv[E];
    mhc::load_vec<float, E>(w, wv);
#pragma unroll
    for (int e = 0; e < E; ++e) v[e] = mhc::to_float<T>(mhc::from_float<T>(__fmul_rn(__fmul_rn(v[e], rstd), wv[e])));
}

// max(a, b) of |values|, NaN once either is NaN (so the result does not depend on the order).
__device__ __forceinline__ float amax_of(float a, float b) { return (b > a || b != b) ? b : a; }

// The block's total of a (mhc::block_sum's fixed order) / its amax_of, in every thread; red: 32 floats,
// free again on return.
__device__ __forceinline__ float block_total(float a, float* red) {
    float acc[1] = {a};
    mhc::block_sum<1>(acc, red);
    const float s = red[0];
    __syncthreads();
    return s;
}
__device__ __forceinline__ float block_amax(float a, float* red) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) a = amax_of(a, __shfl_xor_sync(0xffffffffu, a, off));
    if (lane == 0) red[warp] = a;
    __syncthreads();
    float m = 0.f;
    for (int k = 0; k < nwarps; ++k) m = amax_of(m, red[k]);
    __syncthreads();
    return m;
}

// float32 -> float8 e4m3fn bits (OPS.md section 13): to nearest even, saturating (+-inf too) to +-448,
// NaN -> NaN (0x7f with the sign).  Integer arithmetic, one path on every GPU (sm_89+ has
// cvt.rn.satfinite.e4m3x2.f32, with these bits); the kernel around it is memory bound.
__device__ __forceinline__ unsigned int to_e4m3(float f) {
    const unsigned int u = __float_as_uint(f), a = u & 0x7fffffffu, sign = (u >> 24) & 0x80u;
    if (a > 0x7f800000u) return sign | 0x7fu;  // NaN
    if (a >= 0x43e00000u) return sign | 0x7eu;  // |f| >= 448: 448
    if (a >= 0x3c800000u)                       // |f| >= 2^-6: a normal e4m3 (a carry may round 2^k up)
        return sign | (((a + 0x7ffffu + ((a >> 20) & 1u)) >> 20) - (120u << 3));
    return sign | __float2uint_rn(__uint_as_float(a) * 512.f);  // multiples of 2^-9 (8: the least normal)
}

// E bytes (low 8 bits of b) to p in accesses of up to 16 bytes (p aligned to them).
template <int E>
__device__ __forceinline__ void store_bytes(unsigned char* __restrict__ p, const unsigned int (&b)[E]) {
    if constexpr (E >= 4) {
        constexpr int W = E / 4, L = W < 4 ? W : 4;
#pragma unroll
        for (int k0 = 0; k0 < W; k0 += L) {
            unsigned int w[L];
#pragma unroll
            for (int k = 0; k < L; ++k) {
                const int e = 4 * (k0 + k);
                w[k] = b[e] | (b[e + 1] << 8) | (b[e + 2] << 16) | (b[e + 3] << 24);
            }
            mhc::store_words<L>(p + 4 * k0, w);
        }
    } else if constexpr (E == 2) {
        *reinterpret_cast<unsigned short*>(p) = (unsigned short)(b[0] | (b[1] << 8));
    } else {
        *p = (unsigned char)b[0];
    }
}
}  // namespace

// v = layer_in = sum_i h_i x_i, each element as mhc_stream_aggregate_fwd_kernel computes and rounds it
// (h = H_pre per token [tokens, N]), then per token row (one block, grid-stride over tokens):
//   NORM: rstd = 1 / sqrt(sum_c v_c^2 / C + eps) in float32 (block_sum's fixed order; a sum that
//         overflows is summed again with v scaled by 2^-100, as RMSNorm), u_c = T((v_c rstd) w_c),
//         written to out unless FP8; stat[t] = rstd.
//   FP8:  amax = max_c |u_c| (u = v without NORM; NaN if some u_c is), scale = amax / 448, 1 where
//         that is 0; q_c = to_e4m3(u_c / scale) (float32 division); stat[t] = scale.
// Each reduction needs the whole row before the next pass.  keep: the row stays in dynamic shared
// memory between passes, as T (the rounded values are all a later pass reads: nothing is lost), at
// C sizeof(T) bytes (the host keeps rows of at most 32 KiB: 8 KiB at C = 4096 in bf16).  Registers
// would need the columns per thread at compile time (a specialisation per row size class); reading x
// again costs n rows a pass.  keep = 0 (longer rows): each pass recomputes the row from x (the same
// fmaf chain, the same bits), the first loading it evict_last so that the others find it in L2.
// Needs C % E == 0 and every pointer aligned to its E-element access.
template <typename T, int N, int E, bool NORM, bool FP8>
__global__ void mhc_stream_aggregate_out_kernel(const T* __restrict__ x, const float* __restrict__ h,
                                                const float* __restrict__ w, T* __restrict__ out,
                                                unsigned char* __restrict__ q, float* __restrict__ stat,
                                                i64 tokens, int C, float eps, int keep) {
    static_assert(NORM || FP8, "the plain aggregate is mhc_stream_aggregate_fwd_kernel");
    extern __shared__ __align__(16) unsigned char s_dyn[];
    T* s_row = reinterpret_cast<T*>(s_dyn);
    __shared__ float s_h[N];
    __shared__ float red[32];
    const unsigned V = (unsigned)C / E, step = blockDim.x * E;
    for (i64 t = blockIdx.x; t < tokens; t += gridDim.x) {
        __syncthreads();
        for (int k = threadIdx.x; k < N; k += blockDim.x) s_h[k] = h[t * N + k];
        __syncthreads();
        const T* xt = x + t * N * (i64)C;
        // the row as a pass after the first reads it: kept, or recomputed (from L2 mostly)
        auto again = [&](unsigned c, float (&v)[E]) {
            if (keep) keep_load<T, E>(s_row, V, c / E, v);
            else aggregate_vec<T, N, E, mhc::Evict::normal>(xt, s_h, C, c, v);
        };
        // first pass: v; the sum of squares (NORM) or the amax (FP8 alone)
        float acc = 0.f;
        for (unsigned c = threadIdx.x * E; c < (unsigned)C; c += step) {
            float v[E];
            if (keep) {
                aggregate_vec<T, N, E, mhc::Evict::normal>(xt, s_h, C, c, v);
                keep_store<T, E>(s_row, V, c / E, v);
            } else {
                aggregate_vec<T, N, E, mhc::Evict::last>(xt, s_h, C, c, v);
            }
#pragma unroll
            for (int e = 0; e < E; ++e) acc = NORM ? fmaf(v[e], v[e], acc) : amax_of(acc, fabsf(v[e]));
        }
        float rstd = 1.f;
        if (NORM) {
            const float ss = block_total(acc, red);
            if (isinf(ss)) {  // rare: v scaled by 2^-100 (a NaN sum stays NaN: rstd NaN)
                acc = 0.f;
                for (unsigned c = threadIdx.x * E; c < (unsigned)C; c += step) {
                    float v[E];
                    again(c, v);
#pragma unroll
                    for (int e = 0; e < E; ++e) {
                        const float s = v[e] * mhc::STAT_SCALE;
                        acc = fmaf(s, s, acc);
                    }
                }
                rstd = mhc::rms_inv_scaled(block_total(acc, red), (float)C, eps);
            } else {
                rstd = 1.f / sqrtf(ss / (float)C + eps);
            }
            // second pass: u; written out (NORM alone) or kept for the quantisation and its amax
            acc = 0.f;
            for (unsigned c = threadIdx.x * E; c < (unsigned)C; c += step) {
                float v[E];
                again(c, v);
                normalise_vec<T, E>(v, rstd, w + c);
                if (FP8) {
                    if (keep) keep_store<T, E>(s_row, V, c / E, v);
#pragma unroll
                    for (int e = 0; e < E; ++e) acc = amax_of(acc, fabsf(v[e]));
                } else {
                    mhc::store_vec<T, E>(out + t * (i64)C + c, v);
                }
            }
        }
        if (FP8) {
            float scale = __fdiv_rn(block_amax(acc, red), 448.f);
            if (scale == 0.f) scale = 1.f;
            for (unsigned c = threadIdx.x * E; c < (unsigned)C; c += step) {
                float u[E];
                if (keep) {
                    keep_load<T, E>(s_row, V, c / E, u);
                } else {
                    aggregate_vec<T, N, E, mhc::Evict::first>(xt, s_h, C, c, u);
                    if (NORM) normalise_vec<T, E>(u, rstd, w + c);
                }
                unsigned int b[E];
#pragma unroll
                for (int e = 0; e < E; ++e) b[e] = to_e4m3(__fdiv_rn(u[e], scale));
                store_bytes<E>(q + t * (i64)C + c, b);
            }
            if (threadIdx.x == 0) stat[t] = scale;
        } else if (threadIdx.x == 0) {
            stat[t] = rstd;
        }
    }
}

// ------------------------------------------------------- stream aggregate bwd
// dx_i = h_i g ; dh_i = sum_c g_c x_ic (per token, [tokens, N]).
// ACT = 1 (pre op): h = sigmoid(h_raw) + shift (shift = hc_eps: 0 under the paper convention)
// and the kernel writes dh_raw_i = (sum_c g_c x_ic + gh_i) * s_i (1 - s_i), s = sigmoid(h_raw),
// gh (grad of H_pre) may be null.
// g null means a zero incoming gradient (the pre op's unused layer input); dx null: dh only
// (the fused layer adds H_pre_i g to its dx itself).
template <typename T, typename TG, int N, int E, int ACT>
__global__ void mhc_stream_aggregate_bwd_kernel(const TG* __restrict__ g, const T* __restrict__ x,
                                                const float* __restrict__ h, i64 h_stride,
                                                const float* __restrict__ gh, T* __restrict__ dx,
                                                float* __restrict__ dh, i64 tokens, int C, float shift) {
    __shared__ float s_h[N];
    __shared__ float red[N * 32];
    for (i64 t = blockIdx.x; t < tokens; t += gridDim.x) {
        __syncthreads();
        for (int k = threadIdx.x; k < N; k += blockDim.x) {
            const float v = h[t * h_stride + k];
            s_h[k] = ACT ? mhc::sigmoid(v) + shift : v;
        }
        __syncthreads();
        const TG* gt = g + t * (i64)C;
        const T* xt = x + t * N * (i64)C;
        float acc[N];
#pragma unroll
        for (int i = 0; i < N; ++i) acc[i] = 0.f;
        for (unsigned c = threadIdx.x * E; c < (unsigned)C; c += blockDim.x * E) {
            float gv[E];
            float xv[N][E];
            if (g != nullptr) {
                mhc::load_vec<TG, E>(gt + c, gv);
            } else {
#pragma unroll
                for (int e = 0; e < E; ++e) gv[e] = 0.f;
            }
#pragma unroll
            for (int i = 0; i < N; ++i) mhc::load_vec<T, E>(xt + (i64)i * C + c, xv[i]);
#pragma unroll
            for (int i = 0; i < N; ++i) {
                float o[E];
#pragma unroll
                for (int e = 0; e < E; ++e) {
                    o[e] = s_h[i] * gv[e];
                    acc[i] = fmaf(gv[e], xv[i][e], acc[i]);
                }
                if (dx != nullptr) mhc::store_vec<T, E>(dx + (t * N + i) * (i64)C + c, o);
            }
        }
        mhc::block_sum<N>(acc, red);
        for (int k = threadIdx.x; k < N; k += blockDim.x) {
            float v = red[k];
            if (ACT) {
                if (gh != nullptr) v += gh[t * N + k];
                const float s = mhc::sigmoid(h[t * h_stride + k]);
                v *= s * (1.f - s);
            }
            dh[t * N + k] = v;
        }
    }
}

// ------------------------------------------------------------- column sum
// sum_{r = r0, r0 + S, r0 + 2S, ... < rows} part[r, c] into 8 interleaved accumulators
// (index (r - r0) / S mod 8) added in order: a fixed order that depends on the shape only.
__device__ __forceinline__ float strided_column_sum(const float* __restrict__ part, i64 rows, int cols, int c,
                                                   i64 r0, i64 S) {
    float acc[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) acc[k] = 0.f;
    i64 r = r0;
    for (; r + 7 * S < rows; r += 8 * S) {
#pragma unroll
        for (int k = 0; k < 8; ++k) acc[k] += part[(r + k * S) * cols + c];
    }
#pragma unroll
    for (int k = 0; k < 8; ++k)
        if (r + k * S < rows) acc[k] += part[(r + k * S) * cols + c];
    float v = 0.f;
#pragma unroll
    for (int k = 0; k < 8; ++k) v += acc[k];
    return v;
}

// out[c] = sum_r part[r, c] for a row-major [rows, cols] float32 matrix, in a fixed
// order: thread row y sums rows y, y + Y, ... (Y = blockDim.y, strided_column_sum),
// then the Y thread rows are added in sequence: the deterministic sum over tokens of
// shared-coefficient and RMSNorm-weight gradients.  blockDim = (32, Y), Y <= 32.
__global__ void mhc_column_sum_kernel(const float* __restrict__ part, float* __restrict__ out,
                                                 i64 rows, int cols) {
    __shared__ float s[32][33];
    const int c = blockIdx.x * 32 + threadIdx.x;
    s[threadIdx.y][threadIdx.x] = c < cols ? strided_column_sum(part, rows, cols, c, threadIdx.y, blockDim.y) : 0.f;
    __syncthreads();
    if (threadIdx.y == 0 && c < cols) {
        float tot = 0.f;
        for (int k = 0; k < (int)blockDim.y; ++k) tot += s[k][threadIdx.x];
        out[c] = tot;
    }
}

// The same sum for few rows (the per-split partials of a parameter gradient): one thread per
// column, rows 0, 1, ... into strided_column_sum's 8 accumulators, no shared memory or barrier.
// For rows <= 64 its bits are mhc_column_sum_kernel's with Y = 8 (accumulator k holds what
// thread row k held there, added in the same order).  1-D grid-stride launch.
__global__ void mhc_column_sum_few_kernel(const float* __restrict__ part, float* __restrict__ out, i64 rows,
                                          int cols) {
    for (i64 c = blockIdx.x * (i64)blockDim.x + threadIdx.x; c < cols; c += (i64)gridDim.x * blockDim.x)
        out[c] = strided_column_sum(part, rows, cols, (int)c, 0, 1);
}

// The same sum for narrow matrices (cols <= 32, many rows: per-token terms summed over
// tokens): one block, thread l on column c = l % cols, rows j, j + J, ... (j = l / cols,
// J = blockDim.x / cols, strided_column_sum); then warp c adds column c's J partials
// (lane-strided, fixed butterfly).  blockDim = (1024, 1, 1), one block.
__global__ void mhc_column_sum_narrow_kernel(const float* __restrict__ part, float* __restrict__ out, i64 rows,
                                             int cols) {
    __shared__ float s[1024];
    const int l = threadIdx.x, J = blockDim.x / cols, c = l % cols, j = l / cols;
    s[l] = j < J ? strided_column_sum(part, rows, cols, c, j, J) : 0.f;
    __syncthreads();
    const int warp = l >> 5, lane = l & 31;
    if (warp < cols) {
        float t = 0.f;
        for (int jj = lane; jj < J; jj += 32) t += s[jj * cols + warp];
        t = mhc::warp_sum(t);
        if (lane == 0) out[warp] = t;
    }
}
