// Tensor-core helpers of the coefficient kernels (sm_80+): bf16 parts of float32 values,
// cp.async copies and their STAGES-deep pipeline, ldmatrix, and 16-byte row pieces.  The MMA itself
// is mhc::mma_m16n8k16 (common.cuh, shared with stream.cu); wgmma is wgmma.cuh's.
//
// Tensor cores multiply bf16 operands exactly and accumulate in float32; a float32 operand is
// written as v = v0 + v1 + v2 + O(2^-24 v) with bf16 parts v0 = bf16(v), v1 = bf16(v - v0),
// v2 = bf16(v - v0 - v1) (split_bits); x is one part (bf16: exact), two (float16: exact) or three
// (float32) (XParts).  The products of part pairs (a, b) with a + b <= 2 are accumulated (the
// others are below 2^-24 of the product), so the result matches a float32 CUDA-core dot product to
// float32 rounding.  (In dx, rounded to a 16-bit dtype, pairs with a + b <= 1 suffice: the dropped
// terms are 2^-16 of the product, far below its ulp.)
//
// The reduction index of an MMA may be permuted freely when both operands agree, and so may the
// rows / columns of the output when the stores know it: each thread reads 8 contiguous positions of
// x with one 16-byte access and the other operands are stored in the matching order by the split
// kernels (per call; they are small: 3 x K x n*C bf16 values for phi).  Tiles reach shared memory
// through cp.async in a STAGES-deep pipeline (pipeline_start / pipeline_next), so the HBM reads of
// the next steps are in flight while the tensor cores work.
#pragma once
#include "common.cuh"
#include "wgmma.cuh"

namespace mhc_mma {

__device__ __forceinline__ unsigned pack2(unsigned lo, unsigned hi) { return lo | (hi << 16); }

// v = sum of P bf16 parts (as bits), each the bf16 rounding of what is left (rounded toward
// zero where rounding to nearest would overflow: |v| above ~3.39e38, still finite in float32).
template <int P>
__device__ __forceinline__ void split_bits(float v, unsigned (&out)[P]) {
    float r = v;
#pragma unroll
    for (int p = 0; p < P; ++p) {
        __nv_bfloat16 h = __float2bfloat16_rn(r);
        if (p == 0 && __hisinf(h) && !isinf(r)) h = __float2bfloat16_rz(r);
        out[p] = (unsigned)__bfloat16_as_ushort(h);
        r -= __bfloat162float(h);
    }
}

// Parts of an activation dtype: bf16 exactly 1, float16 exactly 2, float32 3.
template <typename T> struct XParts { static constexpr int value = 3; };
template <> struct XParts<__nv_bfloat16> { static constexpr int value = 1; };
template <> struct XParts<__half> { static constexpr int value = 2; };

// 16 bytes global -> shared, asynchronously; src_bytes = 0 writes zeros (src is not read).
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(src), "r"(valid ? 16 : 0)
                 : "memory");
}
// ldmatrix .x4: four 8x8 b16 matrices; lane l gives the shared address of row l % 8 of matrix
// l / 8 (16 bytes), and lane t gets elements 2 (t % 4), 2 (t % 4) + 1 of row t / 4 of each, in
// d[0..3] (the mma.m16n8k16 fragment layout).
__device__ __forceinline__ void ldmatrix_x4(unsigned row, unsigned (&d)[4]) {  // row: a shared-space address
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
                 : "r"(row));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// A cp.async ring of STAGES stages over `steps` steps; fill(step, stage) issues one step's copies.
// pipeline_start: the first STAGES - 1 steps, one commit group each (empty past `steps`).
template <int STAGES, typename Fill>
__device__ __forceinline__ void pipeline_start(int steps, Fill&& fill) {
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < steps) fill(s, s);
        cp_async_commit();
    }
}
// pipeline_next, before step `step`: wait for its copies and barrier (every warp is then done
// with step - 1, whose stage is free), then issue step + STAGES - 1 into that stage.  WG: the
// stages are read by wgmma (the async proxy): each thread's copies are fenced before the barrier.
template <int STAGES, bool WG = false, typename Fill>
__device__ __forceinline__ void pipeline_next(int step, int steps, Fill&& fill) {
    cp_async_wait<STAGES - 2>();
    if (WG) mhc_wg::fence_proxy_async();
    __syncthreads();
    if (step + STAGES - 1 < steps) fill(step + STAGES - 1, (step + STAGES - 1) % STAGES);
    cp_async_commit();
}

// One 16-byte chunk of a row of T into shared memory: asynchronously when
// VEC (16-byte aligned, all-or-nothing validity), else element by element
// (elements at positions >= lim, or invalid rows, are zero).
template <typename T, bool VEC>
__device__ __forceinline__ void fill16(void* dst, const T* __restrict__ row, bool row_ok, int pos, int lim) {
    constexpr int E = 16 / (int)sizeof(T);
    if (VEC) {
        const bool ok = row_ok && pos < lim;
        cp_async16(dst, ok ? (const void*)(row + pos) : (const void*)row, ok);
    } else {
        T* d = reinterpret_cast<T*>(dst);
#pragma unroll
        for (int e = 0; e < E; ++e) d[e] = (row_ok && pos + e < lim) ? row[pos + e] : mhc::from_float<T>(0.f);
    }
}

// 8 elements row[pos .. pos + 8) of T from global memory as floats (zeros at positions >= lim).
// VEC: one aligned vector access, all or nothing (lim and pos multiples of 8).
template <typename T, bool VEC>
__device__ __forceinline__ void load8(const T* __restrict__ row, int pos, int lim, float (&v)[8]) {
    if (VEC) {
        if (pos < lim) {
            mhc::load_vec<T, 8>(row + pos, v);
            return;
        }
#pragma unroll
        for (int e = 0; e < 8; ++e) v[e] = 0.f;
    } else {
#pragma unroll
        for (int e = 0; e < 8; ++e) v[e] = pos + e < lim ? mhc::to_float<T>(row[pos + e]) : 0.f;
    }
}

// v as 8 elements row[pos .. pos + 8) of T (none at positions >= lim; VEC as load8).
template <typename T, bool VEC>
__device__ __forceinline__ void store8(T* __restrict__ row, int pos, int lim, const float (&v)[8]) {
    if (VEC) {
        if (pos < lim) mhc::store_vec<T, 8>(row + pos, v);
    } else {
#pragma unroll
        for (int e = 0; e < 8; ++e)
            if (pos + e < lim) row[pos + e] = mhc::from_float<T>(v[e]);
    }
}

}  // namespace mhc_mma
