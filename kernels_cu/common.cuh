// Shared device helpers for every mhc_cupy kernel: dtype conversion, vector
// loads/stores of E contiguous elements, and deterministic reductions.
//
// Conventions used by all kernels:
//  * tokens are the flattened leading dims; per token, x is [N, C] row-major;
//  * all arithmetic and accumulation is float32; each output element is
//    rounded to its dtype once, when stored;
//  * reductions use fixed-order warp butterflies and a fixed-order sum over
//    warps: no atomics, so identical inputs give bitwise-identical outputs.
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>

namespace mhc {

typedef long long i64;

template <typename T> __device__ __forceinline__ float to_float(T v);
template <> __device__ __forceinline__ float to_float<float>(float v) { return v; }
template <> __device__ __forceinline__ float to_float<__half>(__half v) { return __half2float(v); }
template <> __device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 v) {
    return __bfloat162float(v);
}

template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ float from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
    return __float2bfloat16_rn(v);
}

// Bits of one element in the low bits of a 32-bit word, and back.
template <typename T> __device__ __forceinline__ unsigned int to_bits(float v);
template <> __device__ __forceinline__ unsigned int to_bits<float>(float v) { return __float_as_uint(v); }
template <> __device__ __forceinline__ unsigned int to_bits<__half>(float v) {
    return __half_as_ushort(__float2half_rn(v));
}
template <> __device__ __forceinline__ unsigned int to_bits<__nv_bfloat16>(float v) {
    return __bfloat16_as_ushort(__float2bfloat16_rn(v));
}
template <typename T> __device__ __forceinline__ float from_bits(unsigned int b);
template <> __device__ __forceinline__ float from_bits<float>(unsigned int b) { return __uint_as_float(b); }
template <> __device__ __forceinline__ float from_bits<__half>(unsigned int b) {
    return __half2float(__ushort_as_half((unsigned short)b));
}
template <> __device__ __forceinline__ float from_bits<__nv_bfloat16>(unsigned int b) {
    return __bfloat162float(__ushort_as_bfloat16((unsigned short)b));
}

// Element k (0: low half, 1: high half) of a 32-bit word of two 16-bit T, or the word itself
// for float, as a float (bf16: one integer instruction, not a shift then a widening).
template <typename T> __device__ __forceinline__ float word_elem(unsigned int w, int k) {
    return from_bits<T>(k ? w >> 16 : w & 0xffffu);
}
template <> __device__ __forceinline__ float word_elem<float>(unsigned int w, int) { return __uint_as_float(w); }
template <> __device__ __forceinline__ float word_elem<__nv_bfloat16>(unsigned int w, int k) {
    return __uint_as_float(k ? w & 0xffff0000u : w << 16);
}

// Ask L2 for the 128-byte line holding p (no register written): a kernel that reads a row in its
// next step issues this a step ahead, so the load then finds the line in L2.
__device__ __forceinline__ void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }

// Elements of T that fit one 16-byte access.
template <typename T> struct Max16 { static constexpr int value = 16 / sizeof(T); };
// load_vec / store_vec move E elements of T in chunks of this many elements (at most 16 bytes).
template <typename T, int E> __host__ __device__ constexpr int chunk_elems() { return (E < Max16<T>::value) ? E : Max16<T>::value; }

// Cache priority of a load.  A row read twice (the two-pass row reductions) is loaded
// Evict::last by its first pass and Evict::first by its second, in L1 and L2, so that it is
// still in L2 when the second pass comes (what Triton's looped reductions do).  sm_80 and
// newer (createpolicy); older GPUs load as usual.
enum class Evict { normal, last, first };

// One hinted load of VEC (".v4.u32", ".v2.u32", ".u32", ".u16") at eviction priority LEVEL
// ("evict_last" / "evict_first"); operand %N is the address, the outputs come first.
#define MHC_LD_EVICT(LEVEL, VEC, OUTS, N)                                                              \
    "{\n\t.reg .b64 pol;\n\tcreatepolicy.fractional.L2::" LEVEL ".b64 pol, 1.0;\n\t"                   \
    "ld.global.L1::" LEVEL ".L2::cache_hint" VEC " " OUTS ", [%" N "], pol;\n\t}"

template <Evict H, int W>
__device__ __forceinline__ void load_words_evict(const void* p, unsigned int (&w)[W]) {
    constexpr bool last = H == Evict::last;
    if constexpr (W == 4) {
        if constexpr (last)
            asm(MHC_LD_EVICT("evict_last", ".v4.u32", "{%0,%1,%2,%3}", "4")
                : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3]) : "l"(p));
        else
            asm(MHC_LD_EVICT("evict_first", ".v4.u32", "{%0,%1,%2,%3}", "4")
                : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3]) : "l"(p));
    } else if constexpr (W == 2) {
        if constexpr (last)
            asm(MHC_LD_EVICT("evict_last", ".v2.u32", "{%0,%1}", "2") : "=r"(w[0]), "=r"(w[1]) : "l"(p));
        else
            asm(MHC_LD_EVICT("evict_first", ".v2.u32", "{%0,%1}", "2") : "=r"(w[0]), "=r"(w[1]) : "l"(p));
    } else {
        if constexpr (last)
            asm(MHC_LD_EVICT("evict_last", ".u32", "%0", "1") : "=r"(w[0]) : "l"(p));
        else
            asm(MHC_LD_EVICT("evict_first", ".u32", "%0", "1") : "=r"(w[0]) : "l"(p));
    }
}

// 2 bytes at p, at cache priority H (sm_80+; a plain load elsewhere or for Evict::normal).
template <Evict H>
__device__ __forceinline__ unsigned short load_u16(const void* p) {
    unsigned short v;
#if __CUDA_ARCH__ >= 800
    if constexpr (H == Evict::last) {
        asm(MHC_LD_EVICT("evict_last", ".u16", "%0", "1") : "=h"(v) : "l"(p));
        return v;
    } else if constexpr (H == Evict::first) {
        asm(MHC_LD_EVICT("evict_first", ".u16", "%0", "1") : "=h"(v) : "l"(p));
        return v;
    }
#endif
    v = *reinterpret_cast<const unsigned short*>(p);
    return v;
}

// W consecutive 32-bit words in one load / store instruction (W = 1, 2, 4); H: cache
// priority (above; sm_80+, elsewhere a plain load).
template <int W, Evict H = Evict::normal>
__device__ __forceinline__ void load_words(const void* p, unsigned int (&w)[W]) {
#if __CUDA_ARCH__ >= 800
    if constexpr (H != Evict::normal) {
        load_words_evict<H, W>(p, w);
        return;
    }
#endif
    if constexpr (W == 4) {
        const uint4 r = *reinterpret_cast<const uint4*>(p);
        w[0] = r.x; w[1] = r.y; w[2] = r.z; w[3] = r.w;
    } else if constexpr (W == 2) {
        const uint2 r = *reinterpret_cast<const uint2*>(p);
        w[0] = r.x; w[1] = r.y;
    } else {
        w[0] = *reinterpret_cast<const unsigned int*>(p);
    }
}
template <int W> __device__ __forceinline__ void store_words(void* p, const unsigned int (&w)[W]) {
    if constexpr (W == 4) {
        // the intrinsic keeps the store one 16-byte instruction (a plain uint4
        // assignment was split into four 4-byte stores by NVVM)
        __stwb(reinterpret_cast<uint4*>(p), make_uint4(w[0], w[1], w[2], w[3]));
    } else if constexpr (W == 2) {
        __stwb(reinterpret_cast<uint2*>(p), make_uint2(w[0], w[1]));
    } else {
        *reinterpret_cast<unsigned int*>(p) = w[0];
    }
}

// Load E contiguous elements starting at p into floats, with accesses of up
// to 16 bytes built from integer words (a struct of bf16 members would be
// split by the compiler into 2-byte accesses).  p must be aligned to
// min(E * sizeof(T), 16) bytes.  H: cache priority (Evict).
template <typename T, int E, Evict H = Evict::normal>
__device__ __forceinline__ void load_vec(const T* __restrict__ p, float (&out)[E]) {
    constexpr int K = chunk_elems<T, E>(), B = K * (int)sizeof(T);
#pragma unroll
    for (int k0 = 0; k0 < E; k0 += K) {
        if constexpr (B >= 4) {
            unsigned int w[B / 4];
            load_words<B / 4, H>(p + k0, w);
#pragma unroll
            for (int k = 0; k < K; ++k)
                out[k0 + k] = word_elem<T>(w[sizeof(T) == 4 ? k : k / 2], k & 1);
        } else {
            out[k0] = from_bits<T>(load_u16<H>(p + k0));
        }
    }
}

template <typename T, int E>
__device__ __forceinline__ void store_vec(T* __restrict__ p, const float (&in)[E]) {
    constexpr int K = chunk_elems<T, E>(), B = K * (int)sizeof(T);
#pragma unroll
    for (int k0 = 0; k0 < E; k0 += K) {
        if constexpr (B >= 4) {
            unsigned int w[B / 4];
#pragma unroll
            for (int i = 0; i < B / 4; ++i)
                w[i] = sizeof(T) == 4 ? to_bits<T>(in[k0 + i])
                                      : to_bits<T>(in[k0 + 2 * i]) | (to_bits<T>(in[k0 + 2 * i + 1]) << 16);
            store_words<B / 4>(p + k0, w);
        } else {
            *reinterpret_cast<unsigned short*>(p + k0) = (unsigned short)to_bits<T>(in[k0]);
        }
    }
}

// The stream aggregate of E columns: o[e] = sum_i h[i] x_i[c + e] (fmaf in i order, from 0; float32),
// x_i = xt + i C (load_vec's alignment; H: its cache priority).  mhc_stream_aggregate_fwd_kernel's sum,
// and the kernels that stand for it (the pre piece's tail, layer_in for the next GEMM).
template <typename T, int N, int E, Evict H = Evict::normal>
__device__ __forceinline__ void aggregate_cols(const T* __restrict__ xt, const float* h, int C, unsigned c,
                                               float (&o)[E]) {
    float xv[N][E];
#pragma unroll
    for (int i = 0; i < N; ++i) load_vec<T, E, H>(xt + (i64)i * C + c, xv[i]);
#pragma unroll
    for (int e = 0; e < E; ++e) {
        float s = 0.f;
#pragma unroll
        for (int i = 0; i < N; ++i) s = fmaf(h[i], xv[i][e], s);
        o[e] = s;
    }
}

// The columns of a token row that this thread owns, E at a time: c = first_col(E), then + col_step(E).
// A row's columns may be split over gridDim.y blocks (a few tokens: more blocks than tokens); with
// gridDim.y = 1 a block owns the whole row.  What a thread computes at a column does not depend on
// the split (no reductions over columns where it is used).
__device__ __forceinline__ unsigned first_col(int E) { return (blockIdx.y * blockDim.x + threadIdx.x) * E; }
__device__ __forceinline__ unsigned col_step(int E) { return gridDim.y * blockDim.x * E; }

// E contiguous elements of T kept as raw 32-bit words (E * sizeof(T) a
// multiple of 4): half the registers of floats for 16-bit types, so a whole
// row can stay on chip between the two passes of a row reduction.
template <typename T, int E> struct Packed {
    static constexpr int W = E * (int)sizeof(T) / 4;
    static_assert(W >= 1 && E * sizeof(T) % 4 == 0, "Packed needs whole 32-bit words");
    unsigned int w[W];

    __device__ __forceinline__ void load(const T* __restrict__ p) {
#pragma unroll
        for (int i = 0; i < W; i += 4) {
            constexpr int L = W < 4 ? W : 4;
            unsigned int part[L];
            load_words<L>(reinterpret_cast<const unsigned int*>(p) + i, part);
#pragma unroll
            for (int k = 0; k < L; ++k) w[i + k] = part[k];
        }
    }

    __device__ __forceinline__ float operator[](int e) const {
        return word_elem<T>(w[sizeof(T) == 4 ? e : e / 2], e & 1);
    }
};

// d += a b on tensor cores (m16n8k16, row.col): 16-bit T (bf16 or float16) in, float32
// accumulate.  Fragments (g8 = lane / 4, tq = lane % 4): a[0] row g8, k 2tq..2tq+1; a[1] row
// g8 + 8, same k; a[2], a[3] the same rows at k + 8; b0 k 2tq..2tq+1 of column g8, b1 k + 8;
// d[0..1] row g8, columns 2tq..2tq+1, d[2..3] row g8 + 8.  Products of 16-bit values are exact.
template <typename T>
__device__ __forceinline__ void mma_m16n8k16(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1);
template <>
__device__ __forceinline__ void mma_m16n8k16<__nv_bfloat16>(float (&d)[4], const unsigned (&a)[4], unsigned b0,
                                                             unsigned b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <>
__device__ __forceinline__ void mma_m16n8k16<__half>(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Row statistics (RMSNorm, the coefficient path's r) sum x^2 in float32, which
// overflows for |x| above ~1.8e19 / sqrt(length).  A row whose sum comes out
// inf is summed again with x scaled by STAT_SCALE = 2^-100 (then every finite
// row fits: x^2 * 2^-200 * 2^31 < FLT_MAX, and the largest element, at least
// ~4e14 in such a row, stays a normal float), and
//   1 / sqrt(mean x^2 + eps) = STAT_SCALE / sqrt(mean (x STAT_SCALE)^2 + eps STAT_SCALE^2).
// Rows that do not overflow never pay for it.
constexpr float STAT_SCALE = 7.8886090522101181e-31f;  // 2^-100, exact

// 1 / sqrt(sumsq / n + eps) from sumsq = sum (x STAT_SCALE)^2.
__device__ __forceinline__ float rms_inv_scaled(float sumsq, float n, float eps) {
    return STAT_SCALE / sqrtf(sumsq / n + eps * STAT_SCALE * STAT_SCALE);
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    return v;
}

// Warp reduce-scatter of K values per lane (K padded to KP = 32 Q): after it, lane l holds
// in v[m] (m < Q) the warp total of value l * Q + m.  Five halving steps; at the step of
// offset s each lane keeps the half of its live values selected by bit s of its lane id and
// sends the other half: KP (1 - 1/32) shuffles in all instead of 5 K for K separate
// butterflies.  Fixed order (deterministic).
template <int M, int S>
__device__ __forceinline__ void reduce_scatter_step(float* v, int lane) {
    if constexpr (S > 0) {
        const bool upper = (lane & S) != 0;
#pragma unroll
        for (int k = 0; k < M / 2; ++k) {
            const float lo = v[k], hi = v[k + M / 2];  // selects of values, not of indices
            const float recv = __shfl_xor_sync(0xffffffffu, upper ? lo : hi, S);
            v[k] = (upper ? hi : lo) + recv;
        }
        reduce_scatter_step<M / 2, S / 2>(v, lane);
    }
}

template <int KP>
__device__ __forceinline__ void warp_reduce_scatter(float (&v)[KP]) {
    static_assert(KP % 32 == 0, "pad to a multiple of 32");
    reduce_scatter_step<KP, 16>(v, threadIdx.x & 31);
}

// Deterministic block-wide sum of K per-thread values.  `red` is shared
// memory of at least K * (blockDim.x / 32) floats; blockDim.x is a multiple
// of 32.  On return red[k] holds the block total of acc[k] for every k < K
// (visible to all threads).  Fixed summation order: within each warp a
// butterfly per value (K <= 6) or one reduce-scatter (larger K, fewer shuffles),
// then warps 0, 1, 2, ... in sequence.
template <int K>
__device__ __forceinline__ void block_sum(float (&acc)[K], float* red) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int nwarps = blockDim.x >> 5;
    constexpr int KP = (K + 31) / 32 * 32;
    if constexpr (5 * K > KP) {
        constexpr int Q = KP / 32;
        float v[KP];
#pragma unroll
        for (int k = 0; k < KP; ++k) v[k] = k < K ? acc[k] : 0.f;
        warp_reduce_scatter<KP>(v);
#pragma unroll
        for (int m = 0; m < Q; ++m) {
            const int k = lane * Q + m;
            if (k < K) red[k * nwarps + warp] = v[m];
        }
    } else {
#pragma unroll
        for (int k = 0; k < K; ++k) {
            float v = warp_sum(acc[k]);
            if (lane == 0) red[k * nwarps + warp] = v;
        }
    }
    __syncthreads();
    float tot[(K + 31) / 32 > 0 ? (K + 31) / 32 : 1];
    for (int k = threadIdx.x, r = 0; k < K; k += blockDim.x, ++r) {
        float s = 0.f;
        for (int w = 0; w < nwarps; ++w) s += red[k * nwarps + w];
        if (r < (int)(sizeof(tot) / sizeof(float))) tot[r] = s;
    }
    __syncthreads();
    for (int k = threadIdx.x, r = 0; k < K; k += blockDim.x, ++r) red[k] = tot[r];
    __syncthreads();
}

__device__ __forceinline__ float sigmoid(float z) {
    // Stable for large |z|: never evaluates exp of a large positive number.
    if (z >= 0.f) {
        return 1.f / (1.f + expf(-z));
    }
    const float e = expf(z);
    return e / (1.f + e);
}

// Register arrays of any shape (float, float[a], float[a][b], ...), every loop unrolled so
// they stay in registers: zero(a) sets every element to 0; add(a, b) does a += b elementwise.
__device__ __forceinline__ void zero(float& v) { v = 0.f; }
template <typename A, int N>
__device__ __forceinline__ void zero(A (&a)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) zero(a[i]);
}
__device__ __forceinline__ void add(float& a, float b) { a += b; }
template <typename A, int N>
__device__ __forceinline__ void add(A (&a)[N], const A (&b)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) add(a[i], b[i]);
}

}  // namespace mhc
