// softmax.cuh — the online-softmax update of one query row, shared by decode.cu, prefill.cu and
// prefill_sm90.cu: each kernel holds a row's scores of a key tile spread over the 4 threads of an mma
// quad (the C fragment layout), N per thread, and names them through get(k) / set(k, v).
#pragma once
#include "common/dtypes.cuh"

namespace cuattn {

// Scores s (already transformed and masked: -inf where dropped) become p = exp2(s * scale_log2 - m)
// in place, with m the row's running base-2 max over every tile so far (m: -inf before any key);
// l is this thread's partial row sum (quad-reduced once at the end). Returns the factor the row's
// accumulated output must be multiplied by (exp2(m_old - m_new); 1 when the max did not move).
// scale_log2 = 1 for scores a kernel scaled already.
template <int N, class Get, class Set>
__device__ __forceinline__ float online_softmax_row(Get get, Set set, float& m, float& l, float scale_log2) {
  const float neg_inf = __int_as_float(0xff800000);
  float mx = neg_inf;
#pragma unroll
  for (int k = 0; k < N; ++k) mx = fmaxf(mx, get(k));
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
  const float m_new = fmaxf(m, mx * scale_log2);
  const float m_use = m_new == neg_inf ? 0.f : m_new;   // fully masked so far: no NaN
  const float corr = exp2_approx(m - m_use);
  m = m_new;
  float sum = 0.f;
#pragma unroll
  for (int k = 0; k < N; ++k) {
    const float p = exp2_approx(fmaf(get(k), scale_log2, -m_use));
    set(k, p);
    sum += p;
  }
  l = l * corr + sum;
  return corr;
}

}  // namespace cuattn
