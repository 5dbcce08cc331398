// cascade.cu — launched by cuattn/cascade.py (MergeSpec).
// Compile-time: DTYPE_V (0: f16, 1: bf16, 2: f32), the storage type of the partial outputs.
// Grid (seq_len, num_heads); block 128; each thread walks head_dim with stride 128.
// Merges partial attention states over disjoint key sets: with LSEs s_i (natural log, base e),
//   s = log(sum_i exp(s_i)),  v = sum_i exp(s_i - s) * v_i.
// A state with s_i = -inf (no keys) contributes nothing; if all are -inf the result is v = 0, s = -inf.
#include "common/dtypes.cuh"

namespace cuattn {
#if DTYPE_V == 0
typedef f16 v_t;
#elif DTYPE_V == 1
typedef bf16 v_t;
#else
typedef float v_t;
#endif

__device__ __forceinline__ float merge_neg_inf() { return __int_as_float(0xff800000); }
__device__ __forceinline__ float merge_log2(float x) {
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
constexpr float MERGE_LOG2E = 1.4426950408889634f;
constexpr float MERGE_LN2 = 0.69314718055994531f;
}  // namespace cuattn

using namespace cuattn;

// v: element (t, i, h, d) at t*v_t_ + i*v_i + h*v_h + d; s: (t, i, h) at t*s_t_ + i*s_i + h*s_h.
// out: (t, h, d) at t*o_t + h*o_h + d; s_out: (t, h) at t*num_heads + h (contiguous float32).
extern "C" __global__ void __launch_bounds__(128) cuattn_merge_states(
    const v_t* __restrict__ v, const float* __restrict__ s, v_t* __restrict__ out,
    float* __restrict__ s_out, int num_states, int num_heads, int head_dim,
    int64_t v_t_, int64_t v_i, int64_t v_h, int64_t s_t_, int64_t s_i, int64_t s_h,
    int64_t o_t, int64_t o_h) {
  const int64_t t = blockIdx.x;
  const int h = blockIdx.y;
  float m = merge_neg_inf();
  for (int i = 0; i < num_states; ++i) m = fmaxf(m, s[t * s_t_ + i * s_i + h * s_h]);
  const float m_use = m == merge_neg_inf() ? 0.f : m;
  float l = 0.f;
  for (int i = 0; i < num_states; ++i) l += exp2_approx((s[t * s_t_ + i * s_i + h * s_h] - m_use) * MERGE_LOG2E);
  const float inv = l > 0.f ? 1.f / l : 0.f;
  for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
    float acc = 0.f;
    for (int i = 0; i < num_states; ++i) {
      const float w = exp2_approx((s[t * s_t_ + i * s_i + h * s_h] - m_use) * MERGE_LOG2E);
      acc += w * to_float(v[t * v_t_ + i * v_i + h * v_h + d]);
    }
    out[t * o_t + h * o_h + d] = from_float<v_t>(acc * inv);
  }
  if (s_out != nullptr && threadIdx.x == 0)
    s_out[t * num_heads + h] = l > 0.f ? m_use + merge_log2(l) * MERGE_LN2 : merge_neg_inf();
}

// Two states given as separate arrays (merge_state): v_a/v_b (t, h, d), s_a/s_b (t, h); out / s_out
// may be v_a / s_a (merge_state_in_place: each thread reads an element before writing it).
extern "C" __global__ void __launch_bounds__(128) cuattn_merge_state(
    const v_t* __restrict__ v_a, const float* __restrict__ s_a, const v_t* __restrict__ v_b,
    const float* __restrict__ s_b, v_t* __restrict__ out, float* __restrict__ s_out,
    int num_heads, int head_dim, int64_t a_t, int64_t a_h, int64_t b_t, int64_t b_h,
    int64_t sa_t, int64_t sa_h, int64_t sb_t, int64_t sb_h, int64_t o_t, int64_t o_h) {
  const int64_t t = blockIdx.x;
  const int h = blockIdx.y;
  const float sa = s_a[t * sa_t + h * sa_h], sb = s_b[t * sb_t + h * sb_h];
  const float m = fmaxf(sa, sb);
  const float m_use = m == merge_neg_inf() ? 0.f : m;
  const float wa = exp2_approx((sa - m_use) * MERGE_LOG2E), wb = exp2_approx((sb - m_use) * MERGE_LOG2E);
  const float l = wa + wb;
  const float inv = l > 0.f ? 1.f / l : 0.f;
  for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
    const float x = wa * to_float(v_a[t * a_t + h * a_h + d]) + wb * to_float(v_b[t * b_t + h * b_h + d]);
    out[t * o_t + h * o_h + d] = from_float<v_t>(x * inv);
  }
  __syncthreads();     // every thread has read s_a / s_b: out and s_out may be v_a and s_a (in place)
  if (threadIdx.x == 0)
    s_out[t * num_heads + h] = l > 0.f ? m_use + merge_log2(l) * MERGE_LN2 : merge_neg_inf();
}
