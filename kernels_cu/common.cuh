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

// A pack of K elements of T, aligned to its own size (at most 16 bytes), so
// that one load or store instruction moves it.
template <typename T, int K> struct alignas(sizeof(T) * K) Pack { T v[K]; };

// Elements of T that fit one 16-byte access.
template <typename T> struct Max16 { static constexpr int value = 16 / sizeof(T); };

// Load E contiguous elements starting at p (p aligned to E*sizeof(T) bytes,
// or to 16 bytes when the run is longer than 16 bytes) into floats.
template <typename T, int E>
__device__ __forceinline__ void load_vec(const T* __restrict__ p, float (&out)[E]) {
    constexpr int K = (E < Max16<T>::value) ? E : Max16<T>::value;
#pragma unroll
    for (int k0 = 0; k0 < E; k0 += K) {
        Pack<T, K> pk = *reinterpret_cast<const Pack<T, K>*>(p + k0);
#pragma unroll
        for (int k = 0; k < K; ++k) out[k0 + k] = to_float<T>(pk.v[k]);
    }
}

template <typename T, int E>
__device__ __forceinline__ void store_vec(T* __restrict__ p, const float (&in)[E]) {
    constexpr int K = (E < Max16<T>::value) ? E : Max16<T>::value;
#pragma unroll
    for (int k0 = 0; k0 < E; k0 += K) {
        Pack<T, K> pk;
#pragma unroll
        for (int k = 0; k < K; ++k) pk.v[k] = from_float<T>(in[k0 + k]);
        *reinterpret_cast<Pack<T, K>*>(p + k0) = pk;
    }
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    return v;
}

// Deterministic block-wide sum of K per-thread values.  `red` is shared
// memory of at least K * (blockDim.x / 32) floats; blockDim.x is a multiple
// of 32.  On return red[k] holds the block total of acc[k] for every k < K
// (visible to all threads).  Fixed summation order: butterfly within each
// warp, then warps 0, 1, 2, ... in sequence.
template <int K>
__device__ __forceinline__ void block_sum(float (&acc)[K], float* red) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int nwarps = blockDim.x >> 5;
#pragma unroll
    for (int k = 0; k < K; ++k) {
        float v = warp_sum(acc[k]);
        if (lane == 0) red[k * nwarps + warp] = v;
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

}  // namespace mhc
