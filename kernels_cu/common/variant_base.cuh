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
// ALiBi slope of head h of n (Press et al.; heads past the largest power of two p <= n take the odd
// powers of 2^(-4/p)), as FlashInfer and the models that use ALiBi compute it
__device__ __forceinline__ float alibi_slope(int h, int n) {
  const int p = 1 << (31 - __clz(n));
  return h < p ? exp2f(-8.f * float(h + 1) / float(p)) : exp2f(-4.f * float(2 * (h - p) + 1) / float(p));
}

}}  // namespace cuattn::variant
#endif
