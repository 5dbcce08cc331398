// sampling_math.cuh — the bit-exact arithmetic of sampling.cu (launched by cuattn/sampling.py), which
// cuattn/sampling.py mirrors on the NumPy path: the order-preserving uint32 key of a float, Philox4x32-10 and
// the uniform / exponential variates drawn from it, the fixed-point masses top-p compares; plus the warp
// reductions (fixed order: deterministic). Needs only dtypes.cuh.
#pragma once
#include "common/dtypes.cuh"

namespace cuattn {

// -- order-preserving key of a float (-0 counted as +0)
__device__ __forceinline__ uint32_t ord_key(float f) {
  uint32_t b = __float_as_uint(f == 0.f ? 0.f : f);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

__device__ __forceinline__ float key_float(uint32_t k) {
  return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

// -- Philox4x32-10 (Salmon et al., Random123's round and key schedule)
__device__ __forceinline__ uint4 philox(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0,
                                        uint32_t k1) {
#pragma unroll
  for (int r = 0; r < 10; ++r) {
    const uint32_t lo0 = 0xD2511F53u * c0, hi0 = __umulhi(0xD2511F53u, c0);
    const uint32_t lo1 = 0xCD9E8D57u * c2, hi1 = __umulhi(0xCD9E8D57u, c2);
    const uint32_t n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
    c0 = n0; c1 = lo1; c2 = n2; c3 = lo0;
    k0 += 0x9E3779B9u; k1 += 0xBB67AE85u;
  }
  return make_uint4(c0, c1, c2, c3);
}

struct Rng {
  uint32_t k0, k1, off_lo, off_hi;
  __device__ uint4 draw(uint32_t group, uint32_t row, uint32_t tag) const {
    return philox(group, row, off_lo, off_hi ^ (tag << 24), k0, k1);
  }
};

// -- uniform in (0, 1) from 32 random bits, then an exponential variate: -log(1 - V) (fine near 0)
__device__ __forceinline__ float uniform01(uint32_t bits) {
  const float v = __fmul_rn(__uint2float_rn(bits), 2.3283064365386963e-10f);   // 2^-32
  return fminf(fmaxf(v, 1.1641532182693481e-10f), 0.99999994f);               // [2^-33, 1 - 2^-24]
}
__device__ __forceinline__ float exponential(uint32_t bits) { return -log1pf(-uniform01(bits)); }
__device__ __forceinline__ uint32_t pick(uint4 r, int e) { return e == 0 ? r.x : e == 1 ? r.y : e == 2 ? r.z : r.w; }

// -- block reductions in a fixed order (deterministic): every thread gets the result
template <typename T, typename Op>
__device__ __forceinline__ T warp_reduce(T x, Op op) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = op(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}
struct Sum { template <typename T> __device__ T operator()(T a, T b) const { return a + b; } };
struct Min { __device__ uint32_t operator()(uint32_t a, uint32_t b) const { return a < b ? a : b; } };
struct Max { __device__ uint32_t operator()(uint32_t a, uint32_t b) const { return a > b ? a : b; } };

// -- the fixed-point mass of a value: q(w) = floor(w * 2^(S - E)) = floor(sig * 2^(e + shift_c)), with
//    shift_c = S - E - 150 (fixed_shift), w = sig * 2^(e - 150) (e the biased exponent, 1 for subnormals)
__device__ __forceinline__ uint64_t fixed_mass(float w, int shift_c) {
  if (!(w > 0.f)) return 0ull;
  const uint32_t b = __float_as_uint(w);
  const int e = int(b >> 23);
  const uint32_t sig = e ? (b & 0x7fffffu) | 0x800000u : b;
  const int sh = max(e, 1) + shift_c;
  return sh >= 0 ? uint64_t(sig) << min(sh, 40) : sh > -24 ? uint64_t(sig >> -sh) : 0ull;
}

// -- shift_c of a row whose largest value is w_max > 0 (S = 62 - bit_length(vocab))
__device__ __forceinline__ int fixed_shift(float w_max, int vocab) {
  const uint32_t b = __float_as_uint(w_max);
  const int e = int(b >> 23);
  const int E = e ? e - 127 : (31 - __clz(int(b & 0x7fffffu))) - 149;
  return (62 - (32 - __clz(vocab))) - E - 150;
}

// -- value of a fixed-point mass: q * 2^(E - S)
__device__ __forceinline__ double fixed_value(uint64_t q, int shift_c) {
  return ldexp(__ull2double_rn(q), -(shift_c + 150));
}

// -- the mass top-p needs: min(ceil(fp64(total) * fp64(p)), total), at least 1 (the NumPy path's formula)
__device__ __forceinline__ uint64_t mass_target(uint64_t total, float p) {
  const double t = ceil(__dmul_rn(__ull2double_rn(total), double(p)));
  const uint64_t q = __double2ull_rz(t);
  return max(min(q, total), 1ull);
}

}  // namespace cuattn
