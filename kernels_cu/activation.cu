// activation.cu — launched by cuattn/activation.py (ActSpec).
// Compile-time: DTYPE (0: f16, 1: bf16), the storage type of input and output.
// Grid (rows, ceil(d / (8 * T))); block T = ActSpec.threads(d): a multiple of 32, at most 256. Each
// thread computes one group of 8 outputs of a row: out[j] = act(input[j]) * input[d + j], in fp32.
// Rows of input (2*d elements) start at r * in_s, rows of out (d) at r * out_s. vec != 0 (the launcher
// checked 16-byte aligned bases, row strides and d multiples of 8 elements): 16-byte loads and stores,
// a scalar tail; vec == 0: coalesced 2-byte accesses. See common/row_io.cuh.
// cuattn_*_and_mul_rows (the "rows" form, cuattn/activation.py _FORM): a 1-D grid of rows * chunks blocks
// of T = blockDim.x threads, block b serving chunk b % chunks of row b / chunks, so consecutive blocks
// stream consecutive memory (the old grid (rows, chunks) puts a chunk of 1056 different rows in one wave).
// A block covers GPT (1: entries _rows1, 2: _rows2) groups of 8 * T outputs: group g = chunk * GPT + i, thread t's
// outputs (g * T + t) * 8 .. + 8; every load of the block is issued before the first activation.
// HINTS (entries _rows1cs; vec path only): loads ld.global.nc.L1::no_allocate, stores st.global.cs (streaming: the
// data is touched once).
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

// -- 8 elements at p as raw bits (16 bytes), through the non-coherent path without L1 allocation
__device__ __forceinline__ void load_bits_stream(const elem_t* p, uint32_t (&w)[4]) {
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3]) : "l"(p));
}
__device__ __forceinline__ void store_group_stream(elem_t* p, const float (&v)[GROUP]) {
  asm volatile("st.global.cs.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(pack2<elem_t>(v[0], v[1])),
               "r"(pack2<elem_t>(v[2], v[3])), "r"(pack2<elem_t>(v[4], v[5])), "r"(pack2<elem_t>(v[6], v[7]))
               : "memory");
}

template <Act ACT, int GPT, bool HINTS>
__device__ __forceinline__ void act_and_mul_rows(const elem_t* __restrict__ input, elem_t* __restrict__ out,
                                                 int d, int64_t in_s, int64_t out_s, bool vec, int chunks) {
  const int64_t row = blockIdx.x / chunks;
  const int chunk = blockIdx.x % chunks;
  const elem_t* gate = input + row * in_s;
  elem_t* o_row = out + row * out_s;
  wait_prior_grids();
  // -- issue every load of the block
  uint32_t ab[GPT][4], bb[GPT][4];
#pragma unroll
  for (int i = 0; i < GPT; ++i) {
    {
      const int g = chunk * GPT + i, e0 = group_elem(g, 0, vec);
      if (HINTS && vec && e0 + GROUP <= d) {
        load_bits_stream(gate + e0, ab[i]);
        load_bits_stream(gate + d + e0, bb[i]);
      } else {
        load_bits(gate, d, g, vec, ab[i]);
        load_bits(gate + d, d, g, vec, bb[i]);
      }
    }
  }
  allow_next_grid();
  // -- activate, multiply, write
#pragma unroll
  for (int i = 0; i < GPT; ++i) {
    {
      const int g = chunk * GPT + i, e0 = group_elem(g, 0, vec);
      float a[GROUP], b[GROUP];
      unpack_group<elem_t>(ab[i], a);
      unpack_group<elem_t>(bb[i], b);
#pragma unroll
      for (int k = 0; k < GROUP; ++k) a[k] = activate<ACT>(a[k]) * b[k];
      if (HINTS && vec && e0 + GROUP <= d) store_group_stream(o_row + e0, a);
      else store_group(o_row, d, g, vec, a);
    }
  }
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

// The rows form: grid (rows * chunks); block T <= 1024 (see the header). Entries _rows1 (GPT 1), _rows1cs
// (GPT 1, HINTS), _rows2 (GPT 2). _rows1: at most 32 registers, so that 2048 threads stay resident an SM
// (FlashInfer's occupancy; _rows1cs spills there on sm_90a: 40 registers, 1536 threads).
#define CUATTN_ACT_ROWS_ENTRY(NAME, ACT, SUFFIX, GPT, HINTS)                                                     \
  extern "C" __global__ void __launch_bounds__(1024, HINTS ? 1 : 3 - GPT)                                        \
      cuattn_##NAME##_and_mul_rows##SUFFIX(                                                                      \
      const elem_t* __restrict__ input, elem_t* __restrict__ out, int d, int64_t in_s, int64_t out_s, int vec,  \
      int chunks) {                                                                                              \
    act_and_mul_rows<ACT, GPT, HINTS>(input, out, d, in_s, out_s, vec != 0, chunks);                             \
  }
#define CUATTN_ACT_ROWS_ENTRIES(NAME, ACT)            \
  CUATTN_ACT_ROWS_ENTRY(NAME, ACT, 1, 1, false)       \
  CUATTN_ACT_ROWS_ENTRY(NAME, ACT, 1cs, 1, true)      \
  CUATTN_ACT_ROWS_ENTRY(NAME, ACT, 2, 2, false)
CUATTN_ACT_ROWS_ENTRIES(silu, SILU)
CUATTN_ACT_ROWS_ENTRIES(gelu, GELU)
CUATTN_ACT_ROWS_ENTRIES(gelu_tanh, GELU_TANH)
