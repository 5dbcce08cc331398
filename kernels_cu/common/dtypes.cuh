// dtypes.cuh — storage types and conversions, without cuda_fp16.h / cuda_bf16.h.
// Kernels only move bits and convert to and from fp32, so a few PTX conversions suffice and
// every translation unit stays self-contained (fast NVRTC compiles, no runtime headers needed).
#pragma once

typedef unsigned char uint8_t;
typedef unsigned short uint16_t;
typedef unsigned int uint32_t;
typedef unsigned long long uint64_t;
typedef long long int64_t;
typedef int int32_t;

namespace cuattn {

struct f16  { uint16_t bits; };
struct bf16 { uint16_t bits; };
struct e4m3 { uint8_t bits; };
struct e5m2 { uint8_t bits; };

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(f16 x) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.bits));
  return f;
}
__device__ __forceinline__ float to_float(bf16 x) { return __uint_as_float(uint32_t(x.bits) << 16); }

template <class T> __device__ __forceinline__ T from_float(float f);
template <> __device__ __forceinline__ float from_float<float>(float f) { return f; }
template <> __device__ __forceinline__ f16 from_float<f16>(float f) {
  f16 r;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r.bits) : "f"(f));
  return r;
}
template <> __device__ __forceinline__ bf16 from_float<bf16>(float f) {
  bf16 r;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r.bits) : "f"(f));
  return r;
}

// -- fp32 -> T saturating (PTX .satfinite, sm_80+): |f| past T's largest finite value (f16: 65504, bf16: 0x7f7f;
//    an inf too) becomes that value with f's sign, so no fp32 value rounds to inf; NaN stays NaN; otherwise round
//    to nearest even, as from_float / pack2. The one saturating conversion of fp32 data into a 16-bit type
//    (an fp32 q in qcast.cu, fp32 K/V in decode.cu and prefill.cu).
template <class T> __device__ __forceinline__ T from_float_sat(float f);
template <> __device__ __forceinline__ f16 from_float_sat<f16>(float f) {
  f16 r;
  asm("cvt.rn.satfinite.f16.f32 %0, %1;" : "=h"(r.bits) : "f"(f));
  return r;
}
template <> __device__ __forceinline__ bf16 from_float_sat<bf16>(float f) {
  bf16 r;
  asm("cvt.rn.satfinite.bf16.f32 %0, %1;" : "=h"(r.bits) : "f"(f));
  return r;
}

// -- two 16-bit values in one 32-bit register: element 0 in the low half
template <class T> __device__ __forceinline__ float2 unpack2(uint32_t w);
template <> __device__ __forceinline__ float2 unpack2<f16>(uint32_t w) {
  return make_float2(to_float(f16{uint16_t(w & 0xffff)}), to_float(f16{uint16_t(w >> 16)}));
}
template <> __device__ __forceinline__ float2 unpack2<bf16>(uint32_t w) {
  return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
}

template <class T> __device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <> __device__ __forceinline__ uint32_t pack2<f16>(float lo, float hi) {
  uint32_t r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
template <> __device__ __forceinline__ uint32_t pack2<bf16>(float lo, float hi) {
  uint32_t r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

// pack2, saturating as from_float_sat (one instruction, as pack2's)
template <class T> __device__ __forceinline__ uint32_t pack2_sat(float lo, float hi);
template <> __device__ __forceinline__ uint32_t pack2_sat<f16>(float lo, float hi) {
  uint32_t r;
  asm("cvt.rn.satfinite.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
template <> __device__ __forceinline__ uint32_t pack2_sat<bf16>(float lo, float hi) {
  uint32_t r;
  asm("cvt.rn.satfinite.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

// -- 8 consecutive values of type From (16 bytes) -> 8 values of type To (16 bytes)
template <class From, class To>
__device__ __forceinline__ uint4 convert8(uint4 x) {
  uint4 y;
  float2 f;
  f = unpack2<From>(x.x); y.x = pack2<To>(f.x, f.y);
  f = unpack2<From>(x.y); y.y = pack2<To>(f.x, f.y);
  f = unpack2<From>(x.z); y.z = pack2<To>(f.x, f.y);
  f = unpack2<From>(x.w); y.w = pack2<To>(f.x, f.y);
  return y;
}
template <> __device__ __forceinline__ uint4 convert8<f16, f16>(uint4 x) { return x; }
template <> __device__ __forceinline__ uint4 convert8<bf16, bf16>(uint4 x) { return x; }

// -- two fp8 of x -> f16x2 (FMT 1: e4m3, 2: e5m2). SEL is a prmt selector putting each chosen byte
//    at the top of a 16-bit half (0x1404: bytes 0, 1; 0x3424: bytes 2, 3). e5m2 is the top byte of
//    an f16 (exact); e4m3 s.eeee.mmm -> f16 s.0eeee.mmm0.. is exact times 2^-8, subnormals included:
//    callers fold fp8_factor's 2^8 into their scales.
template <int FMT, int SEL>
__device__ __forceinline__ uint32_t fp8x2_to_f16x2(uint32_t x) {
  uint32_t y;
  asm("prmt.b32 %0, %1, 0, %2;" : "=r"(y) : "r"(x), "n"(SEL));   // each byte to the top of its half
  if (FMT == 1) return (y & 0x80008000u) | ((y >> 1) & 0x3fff3fffu);
  return y;
}
// 8 fp8 values (two words, in memory order) -> 8 f16 values (one 16-byte chunk, in memory order)
template <int FMT>
__device__ __forceinline__ uint4 fp8x8_to_f16x8(uint32_t a, uint32_t b) {
  return make_uint4(fp8x2_to_f16x2<FMT, 0x1404>(a), fp8x2_to_f16x2<FMT, 0x3424>(a), fp8x2_to_f16x2<FMT, 0x1404>(b),
                    fp8x2_to_f16x2<FMT, 0x3424>(b));
}
// -- the same with the hardware conversion where there is one (sm_89+: cvt.rn.f16x2.e4m3x2, one instruction a
//    pair after at most one prmt, exact real values: no factor; e5m2 keeps its one prmt; older archs: the trick
//    above). Unlike the trick, e4m3 NaN stays NaN: callers must zero or mask rows
//    that hold no key (the trick turns NaN bits into finite values).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
#define CUATTN_FP8_HW_CVT 1
#else
#define CUATTN_FP8_HW_CVT 0
#endif
template <int FMT, int SEL>
__device__ __forceinline__ uint32_t fp8x2_to_f16x2_hw(uint32_t x) {
#if CUATTN_FP8_HW_CVT
  if (FMT == 1) {
    constexpr int B0 = (SEL >> 4) & 7, B1 = (SEL >> 12) & 7;   // the bytes the trick's selector picks
    uint32_t p = x;
    if (!(B0 == 0 && B1 == 1) && !(B0 == 2 && B1 == 3))        // not a half of x: gather them into the low half
      asm("prmt.b32 %0, %1, 0, %2;" : "=r"(p) : "r"(x), "n"(B0 | (B1 << 4) | 0x4400));
    uint32_t r;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(r) : "h"(static_cast<unsigned short>(B0 == 2 && B1 == 3 ? x >> 16 : p & 0xffffu)));
    return r;
  }
#endif
  return fp8x2_to_f16x2<FMT, SEL>(x);
}
template <int FMT>
__device__ __forceinline__ uint4 fp8x8_to_f16x8_hw(uint32_t a, uint32_t b) {
  return make_uint4(fp8x2_to_f16x2_hw<FMT, 0x1404>(a), fp8x2_to_f16x2_hw<FMT, 0x3424>(a),
                    fp8x2_to_f16x2_hw<FMT, 0x1404>(b), fp8x2_to_f16x2_hw<FMT, 0x3424>(b));
}
// -- the conversion every fp8 K/V kernel runs (decode.cu, prefill.cu, prefill_sm90*, mla.cu), chosen here once:
//    FP8_HW_CVT 1 (the default) the _hw functions, 0 the byte trick everywhere (an A/B define). fp8_factor(FMT):
//    the factor a kernel's k / v scales take for it (2^8 for e4m3 by the trick; 1 otherwise, 16-bit / fp32 K/V too).
#ifndef FP8_HW_CVT
#define FP8_HW_CVT 1
#endif
template <int FMT, int SEL>
__device__ __forceinline__ uint32_t fp8_pair(uint32_t x) {
  return FP8_HW_CVT ? fp8x2_to_f16x2_hw<FMT, SEL>(x) : fp8x2_to_f16x2<FMT, SEL>(x);
}
template <int FMT>
__device__ __forceinline__ uint4 fp8_chunk(uint32_t a, uint32_t b) {
  return FP8_HW_CVT ? fp8x8_to_f16x8_hw<FMT>(a, b) : fp8x8_to_f16x8<FMT>(a, b);
}
// -- fp8_chunk with the hardware cvt reading each word's two fp8 pairs as the register's 16-bit halves (mov.b32
//    {lo, hi}: ptxas selects the high half in the cvt itself, where fp8_chunk's `x >> 16` costs a shift a pair);
//    one cvt a pair, one asm each (one asm block of 4 cvts spilled the fa3 fp8 gather: prefill_sm90_notes.md).
//    Same values as fp8_chunk; e5m2 and the byte trick (FP8_HW_CVT 0, sm_80) are fp8_chunk's.
template <int HI>
__device__ __forceinline__ uint32_t e4m3x2_half_to_f16x2(uint32_t x) {
  uint32_t r;
  if (HI)
    asm("{\n.reg .b16 lo, hi;\nmov.b32 {lo, hi}, %1;\ncvt.rn.f16x2.e4m3x2 %0, hi;\n}\n" : "=r"(r) : "r"(x));
  else
    asm("{\n.reg .b16 lo, hi;\nmov.b32 {lo, hi}, %1;\ncvt.rn.f16x2.e4m3x2 %0, lo;\n}\n" : "=r"(r) : "r"(x));
  return r;
}
template <int FMT>
__device__ __forceinline__ uint4 fp8_chunk_halves(uint32_t a, uint32_t b) {
#if CUATTN_FP8_HW_CVT
  if (FP8_HW_CVT && FMT == 1)
    return make_uint4(e4m3x2_half_to_f16x2<0>(a), e4m3x2_half_to_f16x2<1>(a), e4m3x2_half_to_f16x2<0>(b),
                      e4m3x2_half_to_f16x2<1>(b));
#endif
  return fp8_chunk<FMT>(a, b);
}
__host__ __device__ constexpr float fp8_factor(int fmt) {
  return fmt == 1 && !(FP8_HW_CVT && CUATTN_FP8_HW_CVT) ? 256.f : 1.f;
}

// 2^x with the hardware approximation (softmax runs in base 2 with log2(e) folded into the scale)
__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

}  // namespace cuattn
