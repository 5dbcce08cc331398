// activation.cu — launched by cuattn/activation.py (ActSpec).
// Compile-time: DTYPE (0: f16, 1: bf16), the storage type of input and output.
// Grid (rows, ceil(d / (8 * T))); block T = ActSpec.threads(d): a multiple of 32, at most 256. Each
// thread computes one group of 8 outputs of a row: out[j] = act(input[j]) * input[d + j], in fp32.
// Rows of input (2*d elements) start at r * in_s, rows of out (d) at r * out_s. vec != 0 (the launcher
// checked 16-byte aligned bases, row strides and d multiples of 8 elements): 16-byte loads and stores,
// a scalar tail; vec == 0: coalesced 2-byte accesses. See common/row_io.cuh.
#include "common/dtypes.cuh"
#include "common/elem_dtype.cuh"
#include "common/grid_dependency.cuh"
#include "common/row_io.cuh"

namespace cuattn {

enum Act { SILU, GELU, GELU_TANH };

template <Act ACT>
__device__ __forceinline__ float activate(float x) {
  // x * sigmoid(x) with the approximate division (x times the reciprocal, 2 ulp): -0 as x -> -inf
  if (ACT == SILU) return __fdividef(x, 1.f + __expf(-x));
  if (ACT == GELU) return 0.5f * x * (1.f + erff(x * 0.70710678118654752f));  // exact: erf(x / sqrt(2))
  // 0.5 x (1 + tanh(u)) = x * sigmoid(2u), u = sqrt(2 / pi) * (x + 0.044715 x^3): one exp and one
  // approximate division instead of tanhf, and no cancellation in 1 + tanh(u) for negative x
  const float inner = 1.5957691216057308f * (x + 0.044715f * x * x * x);    // 2u
  return __fdividef(x, 1.f + __expf(-inner));
}

template <Act ACT>
__device__ __forceinline__ void act_and_mul(const elem_t* __restrict__ input, elem_t* __restrict__ out, int d,
                                            int64_t in_s, int64_t out_s, bool vec) {
  const elem_t* gate = input + int64_t(blockIdx.x) * in_s;
  elem_t* o_row = out + int64_t(blockIdx.x) * out_s;
  const int g = blockIdx.y;
  wait_prior_grids();
  float a[GROUP], b[GROUP];
  load_group(gate, d, g, vec, a);
  load_group(gate + d, d, g, vec, b);
  allow_next_grid();
#pragma unroll
  for (int k = 0; k < GROUP; ++k) a[k] = activate<ACT>(a[k]) * b[k];
  store_group(o_row, d, g, vec, a);
}
}  // namespace cuattn

using namespace cuattn;

extern "C" __global__ void __launch_bounds__(256) cuattn_silu_and_mul(
    const elem_t* __restrict__ input, elem_t* __restrict__ out, int d, int64_t in_s, int64_t out_s, int vec) {
  act_and_mul<SILU>(input, out, d, in_s, out_s, vec);
}

extern "C" __global__ void __launch_bounds__(256) cuattn_gelu_and_mul(
    const elem_t* __restrict__ input, elem_t* __restrict__ out, int d, int64_t in_s, int64_t out_s, int vec) {
  act_and_mul<GELU>(input, out, d, in_s, out_s, vec);
}

extern "C" __global__ void __launch_bounds__(256) cuattn_gelu_tanh_and_mul(
    const elem_t* __restrict__ input, elem_t* __restrict__ out, int d, int64_t in_s, int64_t out_s, int vec) {
  act_and_mul<GELU_TANH>(input, out, d, in_s, out_s, vec);
}
