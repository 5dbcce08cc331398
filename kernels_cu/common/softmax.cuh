// softmax.cuh — the online-softmax update of one query row, shared by decode.cu, prefill.cu and
// prefill_sm90.cu: each kernel holds a row's scores of a key tile spread over the 4 threads of an mma
// quad (the C fragment layout), N per thread, and names them through get(k) / set(k, v).
#pragma once
#include "common/dtypes.cuh"

#ifndef EXP2_POLY_DEGREE
#define EXP2_POLY_DEGREE 3   // exp2_poly's polynomial: 3 (relative error 2^-13.3), 4 (2^-18.4) or 5 (2^-22.5)
#endif

namespace cuattn {

// 2^x on the FMA pipe, for x <= 127 (the softmax's x <= 0): 2^x = 2^j 2^f with j = rint(x) (the 1.5 * 2^23
// rounding trick: t's low mantissa bits hold j) and f = x - j in [-0.5, 0.5] (exact), 2^f by a minimax
// polynomial with p(0) = 1 (coefficients fitted for relative error, checked in float32 emulation by
// tests/test_exp2_poly.py over [-126, 0]), 2^j added to its exponent field. x <= -127 (-inf: a masked
// logit) gives exactly +0 (clamped to -127: p(0) = 1 = 2^127 2^-127, the exponent field 0), as
// exp2_approx's flush does; on (-127, -126) it gives a value below 2^-126 where exp2_approx gives 0; NaN
// gives 0. What it saves: the special-function unit (16 ops / clk / SM on sm_90) also takes a soft-cap's
// tanh per logit; this is ~8 FMA-pipe / ALU instructions (degree 3), at 128 / clk / SM.
__device__ __forceinline__ float exp2_poly(float x) {
  x = fmaxf(x, -127.f);
  const float t = x + 12582912.f;
  const float f = x - (t - 12582912.f);
#if EXP2_POLY_DEGREE == 3
  float p = fmaf(fmaf(0.05500893294811249f, f, 0.2422109991312027f), f, 0.6932829022407532f);
#elif EXP2_POLY_DEGREE == 4
  float p = fmaf(fmaf(0.009582854807376862f, f, 0.05590642988681793f), f, 0.24024099111557007f);
  p = fmaf(p, f, 0.6931241750717163f);
#elif EXP2_POLY_DEGREE == 5
  float p = fmaf(fmaf(0.0013264728477224708f, f, 0.009671512991189957f), f, 0.05550733581185341f);
  p = fmaf(fmaf(p, f, 0.24022242426872253f), f, 0.6931470036506653f);
#else
#error "EXP2_POLY_DEGREE must be 3, 4 or 5"
#endif
  p = fmaf(p, f, 1.f);
  return __int_as_float(__float_as_int(p) + (__float_as_int(t) << 23));
}

// Scores s (already transformed and masked: -inf where dropped) become p = exp2(s * scale_log2 - m)
// in place, with m the row's running base-2 max over every tile so far (m: -inf before any key);
// l is this thread's partial row sum (quad-reduced once at the end). Returns the factor the row's
// accumulated output must be multiplied by (exp2(m_old - m_new); 1 when the max did not move).
// scale_log2 = 1 for scores a kernel scaled already. POLY (0..8): how many of every 8 scores take exp2_poly
// instead of exp2_approx (spread out: score k when (k POLY) % 8 < POLY; N a multiple of 8 when POLY > 0).
template <int N, int POLY = 0, class Get, class Set>
__device__ __forceinline__ float online_softmax_row(Get get, Set set, float& m, float& l, float scale_log2) {
  static_assert(POLY >= 0 && POLY <= 8 && (POLY == 0 || N % 8 == 0), "POLY: 0..8 of every 8 scores");
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
    const float x = fmaf(get(k), scale_log2, -m_use);
    const float p = (k * POLY) % 8 < POLY ? exp2_poly(x) : exp2_approx(x);
    set(k, p);
    sum += p;
  }
  l = l * corr + sum;
  return corr;
}

}  // namespace cuattn
