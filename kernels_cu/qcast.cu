// qcast.cu — launched by cuattn/qcast.py (CastSpec): a float32 q through the 16-bit attention kernels.
// Compile-time: DTYPE (0: f16, 1: bf16), the attention kernels' compute type (elem_t).
// Grid (rows, heads); block a multiple of 32 up to 256 threads, thread t converting columns t, t + blockDim.x, ...
// of row (blockIdx.x, blockIdx.y). Strides in elements; the last dimension is contiguous.
//   cuattn_cast_to_16:  fp32 q -> its elem_t copy, saturating at elem_t's largest finite value (f16: 65504,
//                       bf16: 0x7f7f) so no q becomes inf; NaN stays NaN. Otherwise round to nearest even
//                       (common/dtypes.cuh from_float_sat, as fp32 K/V in decode.cu and prefill.cu).
//   cuattn_cast_to_f32: the kernel's elem_t output -> the caller's fp32 out (exact).
#include "common/dtypes.cuh"
#include "common/elem_dtype.cuh"

using namespace cuattn;

extern "C" __global__ void __launch_bounds__(256) cuattn_cast_to_16(
    const float* __restrict__ src,      // [rows, heads, dim], fp32
    elem_t* __restrict__ dst,           // [rows, heads, dim]
    int dim, int64_t src_s_tok, int64_t src_s_head, int64_t dst_s_tok, int64_t dst_s_head) {
  const float* s = src + int64_t(blockIdx.x) * src_s_tok + int64_t(blockIdx.y) * src_s_head;
  elem_t* d = dst + int64_t(blockIdx.x) * dst_s_tok + int64_t(blockIdx.y) * dst_s_head;
  for (int c = int(threadIdx.x); c < dim; c += int(blockDim.x)) d[c] = from_float_sat<elem_t>(s[c]);
}

extern "C" __global__ void __launch_bounds__(256) cuattn_cast_to_f32(
    const elem_t* __restrict__ src,     // [rows, heads, dim]
    float* __restrict__ dst,            // [rows, heads, dim], fp32
    int dim, int64_t src_s_tok, int64_t src_s_head, int64_t dst_s_tok, int64_t dst_s_head) {
  const elem_t* s = src + int64_t(blockIdx.x) * src_s_tok + int64_t(blockIdx.y) * src_s_head;
  float* d = dst + int64_t(blockIdx.x) * dst_s_tok + int64_t(blockIdx.y) * dst_s_head;
  for (int c = int(threadIdx.x); c < dim; c += int(blockDim.x)) d[c] = to_float(s[c]);
}
