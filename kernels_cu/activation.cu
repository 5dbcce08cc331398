// activation.cu — launched by cuattn/activation.py (ActSpec).
// Compile-time: DTYPE (0: f16, 1: bf16), the storage type of input and output.
// Grid (rows * chunks), 1-D; block T = activation.geometry(d)[0]: a thread per group of 8 outputs, a multiple
// of 32 up to 1024 (FlashInfer's geometry: one block a row for d <= 8192). Block b serves chunk b % chunks of
// row b / chunks, so consecutive blocks stream consecutive memory; thread t computes outputs
// (chunk * T + t) * 8 .. + 8 of its row: out[j] = act(input[j]) * input[d + j], in fp32, both loads issued
// before the activation. Rows of input (2*d elements) start at r * in_s, rows of out (d) at r * out_s.
// vec != 0 (the launcher checked 16-byte aligned bases, row strides and d multiples of 8 elements):
// 16-byte loads and stores, a scalar tail; vec == 0: coalesced 2-byte accesses. See common/row_io.cuh.
// (Session 12 A/B, benchmarks/results/ops_notes_session12.md: a grid (rows, chunks) of 256-thread blocks, two
// groups a thread and streaming cache hints were slower or no faster; they are in git history.)
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
                                            int64_t in_s, int64_t out_s, bool vec, int chunks) {
  const int64_t row = blockIdx.x / chunks;
  const int g = blockIdx.x % chunks;
  const elem_t* gate = input + row * in_s;
  elem_t* o_row = out + row * out_s;
  wait_prior_grids();
  // -- issue both loads
  uint32_t ab[4], bb[4];
  load_bits(gate, d, g, vec, ab);
  load_bits(gate + d, d, g, vec, bb);
  allow_next_grid();
  // -- activate, multiply, write
  float a[GROUP], b[GROUP];
  unpack_group<elem_t>(ab, a);
  unpack_group<elem_t>(bb, b);
#pragma unroll
  for (int k = 0; k < GROUP; ++k) a[k] = activate<ACT>(a[k]) * b[k];
  store_group(o_row, d, g, vec, a);
}
}  // namespace cuattn

using namespace cuattn;

// At most 32 registers (__launch_bounds__(1024, 2)), so that 2048 threads stay resident an SM (FlashInfer's
// occupancy).
#define CUATTN_ACT_ENTRY(NAME, ACT)                                                                              \
  extern "C" __global__ void __launch_bounds__(1024, 2) cuattn_##NAME##_and_mul(                                 \
      const elem_t* __restrict__ input, elem_t* __restrict__ out, int d, int64_t in_s, int64_t out_s, int vec,  \
      int chunks) {                                                                                              \
    act_and_mul<ACT>(input, out, d, in_s, out_s, vec != 0, chunks);                                              \
  }
CUATTN_ACT_ENTRY(silu, SILU)
CUATTN_ACT_ENTRY(gelu, GELU)
CUATTN_ACT_ENTRY(gelu_tanh, GELU_TANH)
