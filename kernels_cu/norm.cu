// norm.cu — launched by cuattn/norm.py (NormSpec).
// Compile-time: DTYPE (0: f16, 1: bf16), the storage type of input, residual, weight and output;
// MAX_GROUPS, the groups of 8 elements one thread keeps in registers (as raw 16-bit values: 4 registers
// a group); MAX_THREADS (1024), the largest block. A row has at most 8 * MAX_GROUPS * MAX_THREADS
// elements (NormSpec.max_hidden).
// Grid (rows); block T = NormSpec.threads(hidden, rows), a multiple of 32 up to MAX_THREADS with
// 8 * MAX_GROUPS * T >= hidden: for small calls a thread per 8 elements (the shortest dependent chain),
// for large ones the fewest warps (each thread keeps up to MAX_GROUPS 16-byte loads in flight).
// One block per row (except cuattn_fused_add_rmsnorm_regs, at the end: blocks looping over rows): every
// load of the row (and of the weight, for rmsnorm) is issued before the first use, a block reduction
// gives the row's sum of squares in fp32 (layernorm: its mean, then its variance about it), then the row
// is scaled from registers and written.
// vec != 0 (the launcher checked 16-byte aligned bases and row strides that are multiples of 8
// elements): 16-byte loads and stores, a scalar tail when hidden % 8 != 0; vec == 0: coalesced 2-byte
// accesses (rows of odd length or misaligned starts). See common/row_io.cuh.
#include "common/dtypes.cuh"
#include "common/elem_dtype.cuh"
#include "common/grid_dependency.cuh"
#include "common/mma.cuh"
#include "common/row_io.cuh"

namespace cuattn {

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

// -- sum of x over the block, returned to every thread; red holds 33 floats of shared memory
__device__ __forceinline__ float block_sum(float x, float* red) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  x = warp_sum(x);
  if (lane == 0) red[warp] = x;
  __syncthreads();
  if (warp == 0) {
    x = warp_sum(lane < (blockDim.x >> 5) ? red[lane] : 0.f);
    if (lane == 0) red[32] = x;
  }
  __syncthreads();
  return red[32];
}

__device__ __forceinline__ int groups_of(int hidden) {
  return (hidden + GROUP * blockDim.x - 1) / (GROUP * blockDim.x);
}
}  // namespace cuattn

using namespace cuattn;

// RMSNorm of rows of input (batch, heads, hidden) at b*in_s0 + h*in_s1 (heads = 1 for 2-D input):
//   out = input / sqrt(mean(input^2) + eps) * (weight_bias + weight),
// weight_bias 0 for rmsnorm, 1 for gemma_rmsnorm. out may be input (each row is read before it is written).
extern "C" __global__ void __launch_bounds__(MAX_THREADS) cuattn_rmsnorm(
    const elem_t* input, const elem_t* __restrict__ weight, elem_t* out, int hidden, int heads,
    int64_t in_s0, int64_t in_s1, int64_t out_s0, int64_t out_s1, float weight_bias, float eps, int vec) {
  __shared__ float red[33];
  const int64_t b = blockIdx.x / heads, h = blockIdx.x % heads;
  const elem_t* x_row = input + b * in_s0 + h * in_s1;
  elem_t* o_row = out + b * out_s0 + h * out_s1;
  const int groups = groups_of(hidden);
  wait_prior_grids();
  // -- issue the loads of the row and of the weight
  uint32_t xb[MAX_GROUPS][4], wb[MAX_GROUPS][4];
#pragma unroll
  for (int g = 0; g < MAX_GROUPS; ++g)
    if (g < groups) load_bits(x_row, hidden, g, vec, xb[g]);
#pragma unroll
  for (int g = 0; g < MAX_GROUPS; ++g)
    if (g < groups) load_bits(weight, hidden, g, vec, wb[g]);
  // -- sum of squares
  float sum_sq = 0.f;
#pragma unroll
  for (int g = 0; g < MAX_GROUPS; ++g) {
    if (g < groups) {
      float x[GROUP];
      unpack_group<elem_t>(xb[g], x);
#pragma unroll
      for (int k = 0; k < GROUP; ++k) sum_sq += x[k] * x[k];
    }
  }
  const float inv_rms = rsqrtf(block_sum(sum_sq, red) / float(hidden) + eps);
  allow_next_grid();
  // -- scale and write
#pragma unroll
  for (int g = 0; g < MAX_GROUPS; ++g) {
    if (g < groups) {
      float x[GROUP], w[GROUP];
      unpack_group<elem_t>(xb[g], x);
      unpack_group<elem_t>(wb[g], w);
#pragma unroll
      for (int k = 0; k < GROUP; ++k) x[k] = x[k] * inv_rms * (weight_bias + w[k]);
      store_group(o_row, hidden, g, vec, x);
    }
  }
}

// Fused residual add and RMSNorm, in place on rows (batch, hidden) of input and residual:
//   x = input + residual (fp32);  residual = x (rounded to DTYPE);
//   input = x / sqrt(mean(x^2) + eps) * (weight_bias + weight)   (the fp32 x, as FlashInfer's kernel).
// input and residual stay in registers as raw bits, so the fp32 x is recomputed exactly for the second use.
// MAX_GROUPS 1 (norm.py's large calls of hidden <= 8192, a thread per 8 elements), bf16: at most 32 registers,
// 2048 threads an SM (FlashInfer's occupancy). f16 spills under that cap (NVRTC 12, sm_80 and sm_90a) and keeps 41.
extern "C" __global__ void __launch_bounds__(MAX_THREADS, MAX_GROUPS == 1 && DTYPE == 1 ? 2 : 1)
    cuattn_fused_add_rmsnorm(
    elem_t* __restrict__ input, elem_t* __restrict__ residual, const elem_t* __restrict__ weight, int hidden,
    int64_t in_s, int64_t res_s, float weight_bias, float eps, int vec) {
  __shared__ float red[33];
  elem_t* x_row = input + int64_t(blockIdx.x) * in_s;
  elem_t* r_row = residual + int64_t(blockIdx.x) * res_s;
  const int groups = groups_of(hidden);
  wait_prior_grids();
  // -- issue the loads of both rows; the weight towards L2 (in registers too it would spill)
  uint32_t ib[MAX_GROUPS][4], rb[MAX_GROUPS][4];
#pragma unroll
  for (int g = 0; g < MAX_GROUPS; ++g) {
    if (g < groups) {
      load_bits(x_row, hidden, g, vec, ib[g]);
      load_bits(r_row, hidden, g, vec, rb[g]);
    }
  }
#pragma unroll
  for (int g = 0; g < MAX_GROUPS; ++g)
    if (g < groups) prefetch_l2(weight, hidden, g);
  // -- x = input + residual, written back to residual; sum of squares
  float sum_sq = 0.f;
#pragma unroll
  for (int g = 0; g < MAX_GROUPS; ++g) {
    if (g < groups) {
      float x[GROUP], r[GROUP];
      unpack_group<elem_t>(ib[g], x);
      unpack_group<elem_t>(rb[g], r);
#pragma unroll
      for (int k = 0; k < GROUP; ++k) {
        x[k] += r[k];
        sum_sq += x[k] * x[k];
      }
      store_group(r_row, hidden, g, vec, x);
    }
  }
  const float inv_rms = rsqrtf(block_sum(sum_sq, red) / float(hidden) + eps);
  allow_next_grid();
  // -- normalized x into input
#pragma unroll
  for (int g = 0; g < MAX_GROUPS; ++g) {
    if (g < groups) {
      float x[GROUP], r[GROUP], w[GROUP];
      unpack_group<elem_t>(ib[g], x);
      unpack_group<elem_t>(rb[g], r);
      load_group(weight, hidden, g, vec, w);
#pragma unroll
      for (int k = 0; k < GROUP; ++k) x[k] = (x[k] + r[k]) * inv_rms * (weight_bias + w[k]);
      store_group(x_row, hidden, g, vec, x);
    }
  }
}

constexpr int STAGED_THREADS = 512;

// LayerNorm of rows (batch, hidden), gamma and beta float32 (FlashInfer's layernorm):
//   out = (x - mean) / sqrt(var + eps) * gamma + beta,  var = mean((x - mean)^2) (two passes over registers).
// The block is R = blockDim.x / threads_per_row sub-blocks of T = threads_per_row threads (a multiple of
// 32); sub-block r serves row tile * R + r for tile = blockIdx.x, blockIdx.x + gridDim.x, ... (the
// launcher sizes the grid to one wave). cuattn_layernorm (small calls, hidden > 8192: one row a block): gamma
// and beta are read from global memory after the reductions, an L2 prefetch issued with the row's loads taking
// their latency off that path. cuattn_layernorm_pipe (large calls, hidden <= 8192; STAGED): gamma and beta are
// copied into dynamic shared memory (2 * round_up(hidden, 8) floats) once per block, while the first rows load:
// read from L2 once per row instead, they are 4x the row's own bytes and bound the kernel by L2 bandwidth (H100:
// 63% of the copy ceiling at hidden 4096). The rows are software-pipelined: each thread copies its own 16-byte
// groups of the next tile's row with cp.async into its own slots of shared memory (MAX_GROUPS * blockDim.x
// slots after gamma and beta) as soon as it has read the current tile's out of them (after the mean's partial
// sum consumed them: a data dependence, so the slots' reads are done), and waits for them at the top of the
// next tile: one tile's loads are in flight through the reductions, normalization and stores (a staged form
// without the pipeline, loads issued only after the previous tile's rows are written, reached 77-79% of the
// copy ceiling; session 12 A/B in benchmarks/results/ops_notes_session12.md, code in git history).
// Only the vec path pipelines (cp.async moves 16 bytes); groups crossing the row's end load directly.
namespace cuattn {
template <bool STAGED>
__device__ __forceinline__ void layernorm_rows(const elem_t* input, const float* __restrict__ gamma,
                                               const float* __restrict__ beta, elem_t* out, int rows, int hidden,
                                               int threads_per_row, int64_t in_s, int64_t out_s, float eps, bool vec) {
  constexpr bool staged = STAGED;
  extern __shared__ float4 staged_params[];      // staged: gamma[hidden], then beta[hidden]
  __shared__ float red[2][32];                   // the warps' partial sums: the mean's, the variance's
  const int T = threads_per_row, t = threadIdx.x % T, sub = threadIdx.x / T, R = blockDim.x / T;
  const int lane = threadIdx.x & 31, warps = T >> 5, first = sub * warps;
  const int groups = (hidden + GROUP * T - 1) / (GROUP * T);
  float* const s_gamma = reinterpret_cast<float*>(staged_params);
  float* const s_beta = s_gamma + ((hidden + 7) & ~7);     // 32-byte aligned for the groups' float4 reads
  const float* const gm_src = staged ? s_gamma : gamma;
  const float* const bt_src = staged ? s_beta : beta;
  const bool pipe = STAGED && vec;
  uint4* const slots = reinterpret_cast<uint4*>(s_beta + ((hidden + 7) & ~7));   // [MAX_GROUPS][blockDim.x]
  // -- STAGED: cp.async of row r's whole 16-byte groups into this thread's slots
  auto prefetch_row = [&](int64_t r) {
    if (r < rows) {
      const elem_t* src = input + r * in_s;
#pragma unroll
      for (int g = 0; g < MAX_GROUPS; ++g) {
        const int e0 = group_elem(g, 0, true, t, T);
        if (g < groups && e0 + GROUP <= hidden)
          cp_async_16(smem_u32(slots + g * blockDim.x + threadIdx.x), src + e0, 16);
      }
    }
    cp_async_commit();
  };
  wait_prior_grids();
  if (pipe) prefetch_row(int64_t(blockIdx.x) * R + sub);
  for (int64_t row0 = int64_t(blockIdx.x) * R; row0 < rows; row0 += int64_t(gridDim.x) * R) {
    const int64_t row = row0 + sub;
    const bool live = row < rows;
    const elem_t* x_row = input + row * in_s;
    // -- issue the loads of the row (STAGED: take the prefetched groups from the slots)
    uint32_t xb[MAX_GROUPS][4];
    if (pipe) cp_async_wait<0>();
#pragma unroll
    for (int g = 0; g < MAX_GROUPS; ++g) {
      if (g < groups) {
        if (pipe && live && group_elem(g, 0, true, t, T) + GROUP <= hidden) {
          const uint4 v = slots[g * blockDim.x + threadIdx.x];
          xb[g][0] = v.x, xb[g][1] = v.y, xb[g][2] = v.z, xb[g][3] = v.w;
        } else if (live) {
          load_bits(x_row, hidden, g, vec, xb[g], t, T);
        } else {
          xb[g][0] = xb[g][1] = xb[g][2] = xb[g][3] = 0;
        }
        if (!staged) {
          prefetch_l2(gamma, hidden, g);
          prefetch_l2(beta, hidden, g);
        }
      }
    }
    // -- first tile: gamma and beta into shared memory (visible after the first barrier below)
    if (staged && row0 == int64_t(blockIdx.x) * R) {
      const bool v4 = vec && hidden % 4 == 0;
      for (int i = threadIdx.x; i < (v4 ? hidden / 4 : hidden); i += blockDim.x) {
        if (v4) {
          reinterpret_cast<float4*>(s_gamma)[i] = reinterpret_cast<const float4*>(gamma)[i];
          reinterpret_cast<float4*>(s_beta)[i] = reinterpret_cast<const float4*>(beta)[i];
        } else {
          s_gamma[i] = gamma[i], s_beta[i] = beta[i];
        }
      }
    }
    // -- mean
    float sum = 0.f;
#pragma unroll
    for (int g = 0; g < MAX_GROUPS; ++g) {
      if (g < groups) {
        float x[GROUP];
        unpack_group<elem_t>(xb[g], x);
#pragma unroll
        for (int k = 0; k < GROUP; ++k) sum += x[k];
      }
    }
    if (pipe) {
      asm volatile("" ::"f"(sum) : "memory");   // sum consumed every slot's value: their reads are complete
      prefetch_row(row + int64_t(gridDim.x) * R);  // the next tile's row into the slots
    }
    sum = warp_sum(sum);
    if (lane == 0) red[0][threadIdx.x >> 5] = sum;
    __syncthreads();
    sum = 0.f;
    for (int w = 0; w < warps; ++w) sum += red[0][first + w];
    const float mean = sum / float(hidden);
    // -- variance about the mean (elements past the row's end count nothing)
    float sum_sq = 0.f;
#pragma unroll
    for (int g = 0; g < MAX_GROUPS; ++g) {
      if (g < groups) {
        float x[GROUP];
        unpack_group<elem_t>(xb[g], x);
#pragma unroll
        for (int k = 0; k < GROUP; ++k) {
          const float d = group_elem(g, k, vec, t, T) < hidden ? x[k] - mean : 0.f;
          sum_sq += d * d;
        }
      }
    }
    sum_sq = warp_sum(sum_sq);
    if (lane == 0) red[1][threadIdx.x >> 5] = sum_sq;
    __syncthreads();      // (also: red[0] read by every thread before the next tile writes it)
    sum_sq = 0.f;
    for (int w = 0; w < warps; ++w) sum_sq += red[1][first + w];
    const float inv_std = rsqrtf(sum_sq / float(hidden) + eps);
    if (row0 + int64_t(gridDim.x) * R >= rows) allow_next_grid();
    // -- normalize, scale, shift, write
    if (live) {
      elem_t* o_row = out + row * out_s;
#pragma unroll
      for (int g = 0; g < MAX_GROUPS; ++g) {
        if (g < groups) {
          float x[GROUP], gm[GROUP], bt[GROUP];
          unpack_group<elem_t>(xb[g], x);
          load_group(gm_src, hidden, g, vec, gm, t, T);
          load_group(bt_src, hidden, g, vec, bt, t, T);
#pragma unroll
          for (int k = 0; k < GROUP; ++k) x[k] = (x[k] - mean) * inv_std * gm[k] + bt[k];
          store_group(o_row, hidden, g, vec, x, t, T);
        }
      }
    }
  }
}
}  // namespace cuattn

extern "C" __global__ void __launch_bounds__(MAX_THREADS) cuattn_layernorm(
    const elem_t* input, const float* __restrict__ gamma, const float* __restrict__ beta, elem_t* out,
    int rows, int hidden, int threads_per_row, int64_t in_s, int64_t out_s, float eps, int vec) {
  layernorm_rows<false>(input, gamma, beta, out, rows, hidden, threads_per_row, in_s, out_s, eps, vec != 0);
}

// The staged, pipelined form (see layernorm_rows): blocks of up to STAGED_THREADS, 2 resident an SM at least
// (registers capped at 64); dynamic shared memory gamma, beta, then the slots.
extern "C" __global__ void __launch_bounds__(STAGED_THREADS, 2) cuattn_layernorm_pipe(
    const elem_t* input, const float* __restrict__ gamma, const float* __restrict__ beta, elem_t* out,
    int rows, int hidden, int threads_per_row, int64_t in_s, int64_t out_s, float eps, int vec) {
  layernorm_rows<true>(input, gamma, beta, out, rows, hidden, threads_per_row, in_s, out_s, eps, vec != 0);
}

// Compiled in the MAX_GROUPS 1 spec only (more groups spill under the 64-register cap).
#if MAX_GROUPS == 1
// Fused residual add and RMSNorm, the register-pipelined form (large calls, hidden <= 8 * MAX_THREADS,
// 16-byte accesses; norm.py runs it with MAX_GROUPS 1, a thread per 8 elements): a block of T threads serves
// rows blockIdx.x, blockIdx.x + gridDim.x, ... (a grid of one wave) with the weight (plus weight_bias) in
// registers and FA_DEPTH rows of input and residual in flight: a row's slot is refilled with the row FA_DEPTH
// steps ahead as soon as its values are unpacked (the loop over d is unrolled: static slot indices, the slots
// stay registers). One block reduction a row: the warps' partials alternate between two buffers, so one
// barrier a row suffices. Without the 32-register cap of the one-row-a-block form (fp16 keeps 41 there).
#ifndef FA_DEPTH
#define FA_DEPTH 2
#endif
extern "C" __global__ void __launch_bounds__(MAX_THREADS, 1) cuattn_fused_add_rmsnorm_regs(
    elem_t* __restrict__ input, elem_t* __restrict__ residual, const elem_t* __restrict__ weight, int rows,
    int hidden, int64_t in_s, int64_t res_s, float weight_bias, float eps) {
  static_assert(FA_DEPTH % 2 == 0, "the reduction buffer alternates with the row");
  __shared__ float red[2][32];
  const int lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  const int64_t stride = gridDim.x;
  uint32_t ib[FA_DEPTH][4], rb[FA_DEPTH][4];
  wait_prior_grids();
#pragma unroll
  for (int d = 0; d < FA_DEPTH; ++d) {
    const int64_t r = blockIdx.x + d * stride;
    if (r < rows) {
      load_bits(input + r * in_s, hidden, 0, true, ib[d]);
      load_bits(residual + r * res_s, hidden, 0, true, rb[d]);
    }
  }
  float w[GROUP];
  load_group(weight, hidden, 0, true, w);
#pragma unroll
  for (int k = 0; k < GROUP; ++k) w[k] += weight_bias;
  for (int64_t row0 = blockIdx.x; row0 < rows; row0 += FA_DEPTH * stride) {
#pragma unroll
    for (int d = 0; d < FA_DEPTH; ++d) {
      const int64_t row = row0 + d * stride;
      if (row >= rows) break;                    // the same in every thread of the block
      float x[GROUP], r[GROUP];
      unpack_group<elem_t>(ib[d], x);
      unpack_group<elem_t>(rb[d], r);
      float sum_sq = 0.f;
#pragma unroll
      for (int k = 0; k < GROUP; ++k) {
        x[k] += r[k];
        sum_sq += x[k] * x[k];
      }
      const int64_t ahead = row + FA_DEPTH * stride;
      if (ahead < rows) {
        load_bits(input + ahead * in_s, hidden, 0, true, ib[d]);
        load_bits(residual + ahead * res_s, hidden, 0, true, rb[d]);
      }
      store_group(residual + row * res_s, hidden, 0, true, x);
      sum_sq = warp_sum(sum_sq);
      if (lane == 0) red[d & 1][threadIdx.x >> 5] = sum_sq;
      __syncthreads();
      sum_sq = 0.f;
      for (int i = 0; i < warps; ++i) sum_sq += red[d & 1][i];
      const float inv_rms = rsqrtf(sum_sq / float(hidden) + eps);
      if (row + stride >= rows) allow_next_grid();
#pragma unroll
      for (int k = 0; k < GROUP; ++k) x[k] *= inv_rms * w[k];
      store_group(input + row * in_s, hidden, 0, true, x);
    }
  }
}
#endif  // MAX_GROUPS == 1
