// row_io.cuh — a thread's group of 8 elements of one row, read as floats and written back, for the
// row-wise kernels (norm.cu, activation.cu; launched by cuattn/norm.py and cuattn/activation.py).
// A block of T threads covers 8*T elements of a row per group index g:
//   vec:     thread t owns the 8 consecutive elements (g*T + t)*8 + k: one 16-byte access of 16-bit
//            values (two of float). The launcher passes vec only when every base pointer is 16-byte
//            aligned and every row stride is a multiple of 8 elements. A group that crosses the row's
//            end n (the tail when n % 8 != 0) falls back to the scalar accesses below.
//   scalar:  thread t owns the elements g*8*T + k*T + t, so each of the 8 accesses of a warp reads
//            32 consecutive elements (coalesced 2-byte accesses for rows of any alignment).
// Elements at or past n read as 0 and are never written. t and threads default to threadIdx.x and
// blockDim.x; a kernel that serves several rows a block passes a thread's place among its row's threads.
#pragma once
#include "common/dtypes.cuh"

namespace cuattn {

constexpr int GROUP = 8;

__device__ __forceinline__ int group_elem(int g, int k, bool vec, int t = threadIdx.x, int threads = blockDim.x) {
  return vec ? (g * threads + t) * GROUP + k : g * threads * GROUP + k * threads + t;
}

// -- 16-bit storage (f16 / bf16) as raw bits: element k in half k & 1 of word k >> 1 (0 bits: +0.0),
//    so a row can stay in registers at half the cost of floats and be unpacked again losslessly
template <class T>
__device__ __forceinline__ void load_bits(const T* __restrict__ row, int n, int g, bool vec, uint32_t (&w)[4],
                                          int t = threadIdx.x, int threads = blockDim.x) {
  const int e0 = group_elem(g, 0, vec, t, threads);
  if (vec && e0 + GROUP <= n) {
    const uint4 q = *reinterpret_cast<const uint4*>(row + e0);
    w[0] = q.x; w[1] = q.y; w[2] = q.z; w[3] = q.w;
    return;
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) w[i] = 0;
#pragma unroll
  for (int k = 0; k < GROUP; ++k) {
    const int e = group_elem(g, k, vec, t, threads);
    if (e < n) w[k >> 1] |= uint32_t(row[e].bits) << (16 * (k & 1));
  }
}

template <class T>
__device__ __forceinline__ void unpack_group(const uint32_t (&w)[4], float (&v)[GROUP]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = unpack2<T>(w[i]);
    v[2 * i] = f.x;
    v[2 * i + 1] = f.y;
  }
}
// f16: convert the two halves of each word in place (mov.b32 {lo, hi}), no shifted or masked copies
template <>
__device__ __forceinline__ void unpack_group<f16>(const uint32_t (&w)[4], float (&v)[GROUP]) {
#pragma unroll
  for (int i = 0; i < 4; ++i)
    asm("{.reg .f16 lo, hi;\n mov.b32 {lo, hi}, %2;\n cvt.f32.f16 %0, lo;\n cvt.f32.f16 %1, hi;}"
        : "=f"(v[2 * i]), "=f"(v[2 * i + 1]) : "r"(w[i]));
}

template <class T>
__device__ __forceinline__ void load_group(const T* __restrict__ row, int n, int g, bool vec, float (&v)[GROUP]) {
  uint32_t w[4];
  load_bits(row, n, g, vec, w);
  unpack_group<T>(w, v);
}

// -- float storage (layernorm's gamma and beta)
__device__ __forceinline__ void load_group(const float* __restrict__ row, int n, int g, bool vec,
                                           float (&v)[GROUP], int t = threadIdx.x, int threads = blockDim.x) {
  const int e0 = group_elem(g, 0, vec, t, threads);
  if (vec && e0 + GROUP <= n) {
    const float4 a = *reinterpret_cast<const float4*>(row + e0);
    const float4 b = *reinterpret_cast<const float4*>(row + e0 + 4);
    v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
    v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
    return;
  }
#pragma unroll
  for (int k = 0; k < GROUP; ++k) {
    const int e = group_elem(g, k, vec, t, threads);
    v[k] = e < n ? row[e] : 0.f;
  }
}

// -- ask L2 for the elements [8 * T * g, 8 * T * (g + 1)) of a row, 8 a thread: those group g of the
//    block reads in either mapping (a hint: it holds no registers and never faults)
template <class T>
__device__ __forceinline__ void prefetch_l2(const T* row, int n, int g) {
  const int e = group_elem(g, 0, true);
  if (e < n) asm volatile("prefetch.global.L2 [%0];" ::"l"(row + e));
}

template <class T>
__device__ __forceinline__ void store_group(T* __restrict__ row, int n, int g, bool vec, const float (&v)[GROUP],
                                            int t = threadIdx.x, int threads = blockDim.x) {
  const int e0 = group_elem(g, 0, vec, t, threads);
  if (vec && e0 + GROUP <= n) {
    uint4 w;
    w.x = pack2<T>(v[0], v[1]);
    w.y = pack2<T>(v[2], v[3]);
    w.z = pack2<T>(v[4], v[5]);
    w.w = pack2<T>(v[6], v[7]);
    *reinterpret_cast<uint4*>(row + e0) = w;
    return;
  }
#pragma unroll
  for (int k = 0; k < GROUP; ++k) {
    const int e = group_elem(g, k, vec, t, threads);
    if (e < n) row[e] = from_float<T>(v[k]);
  }
}

}  // namespace cuattn
