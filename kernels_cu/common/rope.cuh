// rope.cuh — the rotary position embedding (RoPE) formula, once: rope.cu (launched by
// cuattn/rope.py) uses it, and so can a kernel that fuses RoPE into attention. Needs only dtypes.cuh.
//
// Pair j (0 <= j < rotary_dim / 2) of a head vector x turns by the angle pos * freq_j:
//   (x_a, x_b) -> (x_a cos - x_b sin, x_b cos + x_a sin)
// with (a, b) = (2j, 2j + 1) interleaved (GPT-J, FlashInfer's interleave=True, vLLM's is_neox=False)
// or (j, j + rotary_dim / 2) (NeoX / Llama, the default); elements at or past rotary_dim stay as
// they are. The frequencies are FlashInfer's:
//   freq_j = rope_rcp_theta^(2j / rotary_dim),   smooth = clamp(freq_j * smooth_a + smooth_b, 0, 1),
//   freq_j <- (1 - smooth) * freq_j * rope_rcp_scale + smooth * freq_j
// smooth_a = smooth_b = 0 is plain RoPE (positions divided by rope_scale); Llama 3.1 has
// smooth_a = old_context_len / (2 pi (high_freq_factor - low_freq_factor)) and
// smooth_b = -low_freq_factor / (high_freq_factor - low_freq_factor).
//
// Accuracy. fp32 alone cannot do it: rounding freq_j to fp32 (2^-24 relative) moves the angle at
// position 1e6 by up to 0.06 rad, whatever sin/cos does afterwards. So the frequency and its product
// with the position are float-float pairs (hi + lo, ~48 significant bits, made of fp32 instructions:
// fast where fp64 runs at 1/64 rate), the angle is counted in half-turns (freq_j / pi per position),
// whole turns are removed exactly, and sincospif evaluates the remainder (|r| <= 1 half-turn, where
// it is accurate to 1 ulp). Emulated in NumPy against float64: angle error < 2e-7 rad up to
// position 2^24, < 1e-5 rad up to 2^31 - 1.
#pragma once
#include "common/dtypes.cuh"

namespace cuattn {

// -- float-float arithmetic: the unevaluated sum hi + lo with |lo| <= ulp(hi) / 2. The _rn
//    intrinsics keep the compiler from fusing the error terms into FMAs, which would break them.
struct ff32 {
  float hi, lo;
};

__device__ __forceinline__ ff32 ff_quick_two_sum(float a, float b) {   // needs |a| >= |b|
  const float s = __fadd_rn(a, b);
  return {s, __fsub_rn(b, __fsub_rn(s, a))};
}

__device__ __forceinline__ ff32 ff_add(ff32 a, ff32 b) {
  const float s = __fadd_rn(a.hi, b.hi);
  const float bb = __fsub_rn(s, a.hi);
  const float e = __fadd_rn(__fsub_rn(a.hi, __fsub_rn(s, bb)), __fsub_rn(b.hi, bb));   // a.hi + b.hi - s, exactly
  return ff_quick_two_sum(s, __fadd_rn(e, __fadd_rn(a.lo, b.lo)));
}

__device__ __forceinline__ ff32 ff_mul(ff32 a, ff32 b) {
  const float p = __fmul_rn(a.hi, b.hi);
  float e = __fmaf_rn(a.hi, b.hi, -p);                       // the rounding error of p, exactly
  e = __fmaf_rn(a.hi, b.lo, e);
  e = __fmaf_rn(a.lo, b.hi, e);
  return ff_quick_two_sum(p, e);
}

__device__ __forceinline__ ff32 ff_from_int64(int64_t v) {
  const float hi = __ll2float_rn(v);
  return {hi, __ll2float_rn(v - __float2ll_rn(hi))};        // the remainder is exact below 2^48
}

// -- frequencies: the launcher's float64 values, each split into a float-float pair
struct RopeFreq {
  ff32 step;           // rope_rcp_theta^(2 / rotary_dim): freq_j = step^j before smoothing
  ff32 smooth_a;       // Llama 3.1 smoothing (0, 0: none)
  ff32 smooth_b;
  ff32 scaled_pi;      // rope_rcp_scale / pi
  ff32 unscaled_pi;    // (1 - rope_rcp_scale) / pi
};

// freq_j / pi, the half-turns pair j turns by per position. Compute it once per pair and keep it:
// step^j by repeated squaring costs up to 16 float-float products (j < 256).
__device__ __forceinline__ ff32 rope_half_turns(int j, const RopeFreq& f) {
  ff32 freq = {1.f, 0.f}, base = f.step;
  for (int e = j; e != 0; e >>= 1) {
    if (e & 1) freq = ff_mul(freq, base);
    base = ff_mul(base, base);
  }
  ff32 smooth = ff_add(ff_mul(f.smooth_a, freq), f.smooth_b);
  if (smooth.hi <= 0.f) smooth = {0.f, 0.f};
  if (smooth.hi >= 1.f) smooth = {1.f, 0.f};
  // (1 - s) * freq * rcp_scale + s * freq = freq * (rcp_scale + s * (1 - rcp_scale)), over pi
  return ff_mul(freq, ff_add(f.scaled_pi, ff_mul(smooth, f.unscaled_pi)));
}

// (cos, sin) of the angle pos * freq_j, from rope_half_turns(j).
__device__ __forceinline__ float2 rope_cos_sin(int64_t pos, ff32 half_turns) {
  const ff32 x = ff_mul(ff_from_int64(pos), half_turns);
  const float whole = 2.f * rintf(0.5f * x.hi);              // even: a whole number of turns
  const float r = __fadd_rn(__fsub_rn(x.hi, whole), x.lo);  // x.hi - whole is exact (Sterbenz)
  float s, c;
  sincospif(r, &s, &c);
  return make_float2(c, s);
}

// The rotation itself: (x_a, x_b) turned by the angle whose (cos, sin) is cs.
__device__ __forceinline__ float2 rope_rotate(float xa, float xb, float2 cs) {
  return make_float2(xa * cs.x - xb * cs.y, xb * cs.x + xa * cs.y);
}

// The elements pair j rotates: (2j, 2j + 1) interleaved, (j, j + rotary_dim / 2) NeoX.
__device__ __forceinline__ int2 rope_pair(int j, int rotary_dim, bool interleave) {
  return interleave ? make_int2(2 * j, 2 * j + 1) : make_int2(j, j + rotary_dim / 2);
}

// One pair of a head vector, rotated in place as position pos places it (the whole formula: a fused
// kernel that needs only a few pairs per position can call this; rope.cu keeps half_turns per lane).
__device__ __forceinline__ void rope_apply_pair(float& xa, float& xb, int64_t pos, int j, const RopeFreq& f) {
  const float2 r = rope_rotate(xa, xb, rope_cos_sin(pos, rope_half_turns(j, f)));
  xa = r.x;
  xb = r.y;
}

}  // namespace cuattn
