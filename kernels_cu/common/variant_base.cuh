// variant_base.cuh — math helpers in scope of every variant hook (cuattn/variants.py puts this file,
// then the generated Params struct and hooks, before each kernel). Self-contained: no includes.
#ifndef CUATTN_VARIANT_BASE
#define CUATTN_VARIANT_BASE
namespace cuattn { namespace variant {

// tanh by the sm_75+ approximation instruction (max relative error ~2^-11, below bf16's precision)
__device__ __forceinline__ float fast_tanh(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
// 1 / (1 + exp(-x)) = 0.5 * tanh(x / 2) + 0.5
__device__ __forceinline__ float fast_sigmoid(float x) { return fmaf(0.5f, fast_tanh(0.5f * x), 0.5f); }
// float(x) for |x| < 2^22 on the FMA pipe (an integer add and a float subtract) instead of the
// quarter-rate conversion unit that exp2 already keeps busy once per logit
__device__ __forceinline__ float small_int_to_float(int x) {
  return __int_as_float(0x4B400000 + x) - 12582912.f;   // 1.5 * 2^23
}
// ALiBi slope of head h (Press et al.: heads past the largest power of two p <= the head count take
// the odd powers of 2^(-4/p)), as FlashInfer and the models that use ALiBi compute it, from
// a = -8 / p and b = -4 / p: one exp2 per head, no division
__device__ __forceinline__ float alibi_slope(int h, int p, float a, float b) {
  // __expf (a pure intrinsic: ex2.approx of x * log2 e), not inline asm: the compiler hoists a pure
  // per-head value out of the per-logit loop (with asm it recomputed it per logit: H100 fa3 6.9x)
  const float e = h < p ? a * float(h + 1) : b * float(2 * (h - p) + 1);
  return __expf(e * 0.69314718055994531f);
}

}}  // namespace cuattn::variant
#endif
