// norm.cu — launched by cuattn/norm.py (NormSpec).
// Compile-time: DTYPE (0: f16, 1: bf16), the storage type of input, residual, weight and output;
// MAX_GROUPS, the groups of 8 elements one thread keeps in registers (as raw 16-bit values: 4 registers
// a group); MAX_THREADS (1024), the largest block. A row has at most 8 * MAX_GROUPS * MAX_THREADS
// elements (NormSpec.max_hidden).
// Grid (rows); block T = NormSpec.threads(hidden, rows), a multiple of 32 up to MAX_THREADS with
// 8 * MAX_GROUPS * T >= hidden: for small calls a thread per 8 elements (the shortest dependent chain),
// for large ones the fewest warps (each thread keeps up to MAX_GROUPS 16-byte loads in flight).
// One block per row (except cuattn_layernorm_rows: sub-blocks of its own block size serve two rows each; and
// cuattn_fused_add_rmsnorm_regs, at the end: blocks looping over rows): every load of the row (and of the
// weight, for rmsnorm) is issued before the first use, a block reduction gives the row's sum of squares in
// fp32 (layernorm: its mean, then its variance about it), then the row is scaled from registers and written.
// vec != 0 (the launcher checked 16-byte aligned bases and row strides that are multiples of 8
// elements): 16-byte loads and stores, a scalar tail when hidden % 8 != 0; vec == 0: coalesced 2-byte
// accesses (rows of odd length or misaligned starts). See common/row_io.cuh.
#include "common/dtypes.cuh"
#include "common/elem_dtype.cuh"
#include "common/grid_dependency.cuh"
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

// LayerNorm of rows (batch, hidden), gamma and beta float32 (FlashInfer's layernorm):
//   out = (x - mean) / sqrt(var + eps) * gamma + beta,  var = mean((x - mean)^2) (two passes over registers).
// norm.py (NormSpec.layernorm_geometry) runs cuattn_layernorm_rows (below) for large calls (rows * hidden > 2^20)
// with 16-byte accesses and hidden <= 8192, cuattn_layernorm for the others.
// cuattn_layernorm: one row a block, as rmsnorm. gamma and beta (8 floats a group each) are loaded after the
// reductions; an L2 prefetch issued with the row's loads takes their DRAM latency off that path. (Read from L2 for
// every row, they are 4x a 16-bit row's bytes: in large calls L2 bandwidth bounds this form, H100: 63% of the copy
// ceiling at hidden 4096; hence cuattn_layernorm_rows.)
extern "C" __global__ void __launch_bounds__(MAX_THREADS) cuattn_layernorm(
    const elem_t* input, const float* __restrict__ gamma, const float* __restrict__ beta, elem_t* out,
    int hidden, int64_t in_s, int64_t out_s, float eps, int vec) {
  __shared__ float red[33];
  const elem_t* x_row = input + int64_t(blockIdx.x) * in_s;
  elem_t* o_row = out + int64_t(blockIdx.x) * out_s;
  const int groups = groups_of(hidden);
  wait_prior_grids();
  // -- issue the loads of the row; gamma and beta towards L2
  uint32_t xb[MAX_GROUPS][4];
#pragma unroll
  for (int g = 0; g < MAX_GROUPS; ++g) {
    if (g < groups) {
      load_bits(x_row, hidden, g, vec, xb[g]);
      prefetch_l2(gamma, hidden, g);
      prefetch_l2(beta, hidden, g);
    }
  }
  // -- mean (elements past the row's end read as 0)
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
  const float mean = block_sum(sum, red) / float(hidden);
  // -- variance about the mean (elements past the row's end count nothing)
  float sum_sq = 0.f;
#pragma unroll
  for (int g = 0; g < MAX_GROUPS; ++g) {
    if (g < groups) {
      float x[GROUP];
      unpack_group<elem_t>(xb[g], x);
#pragma unroll
      for (int k = 0; k < GROUP; ++k) {
        const float d = group_elem(g, k, vec) < hidden ? x[k] - mean : 0.f;
        sum_sq += d * d;
      }
    }
  }
  const float inv_std = rsqrtf(block_sum(sum_sq, red) / float(hidden) + eps);
  allow_next_grid();
  // -- normalize, scale, shift, write
#pragma unroll
  for (int g = 0; g < MAX_GROUPS; ++g) {
    if (g < groups) {
      float x[GROUP], gm[GROUP], bt[GROUP];
      unpack_group<elem_t>(xb[g], x);
      load_group(gamma, hidden, g, vec, gm);
      load_group(beta, hidden, g, vec, bt);
#pragma unroll
      for (int k = 0; k < GROUP; ++k) x[k] = (x[k] - mean) * inv_std * gm[k] + bt[k];
      store_group(o_row, hidden, g, vec, x);
    }
  }
}

// cuattn_layernorm_rows (large calls with 16-byte accesses, hidden <= 8192): rmsnorm's structure, two rows a
// thread. The block is S = blockDim.x / T sub-blocks of T = threads_per_row threads; sub-block s serves the
// LN_ROWS rows (blockIdx.x * S + s) * LN_ROWS + j (the grid covers every row), each thread the same columns of each:
// the quads (groups of 4 elements) q * T + t, q < QUADS, of every row. All the row loads are issued first; two block
// reductions give the rows' mean, then their variance about it; then the quads are normalized with gamma and beta
// read once for the LN_ROWS rows. gamma and beta are read through L1 with evict_last, the rows with
// L1::no_allocate (loads and stores that do not evict them): an SM's blocks find them in L1 (32 / 64 KB at hidden
// 4096 / 8192) rather than in L2, whose bandwidth bound the one-row-a-block form when they came from there (63% of
// the copy ceiling). Quads rather than groups of 8: a warp's 16-byte reads of gamma and beta cover 512 contiguous
// bytes (4 wavefronts) instead of 1 KB with half of each line read (8).
// H100 (session 17, benchmarks/results/ops_notes_session17.md): 92-94% of a same-bytes copy at 4096 x 4096 / 8192,
// against 72-81% for the persistent, cp.async-pipelined form it replaced (gamma / beta staged in shared memory),
// 91-92% for one row a thread, 4-7% more time with one-pass (Chan-merged) statistics; their code: git history,
// d07b337.
namespace cuattn {
constexpr int QUADS = 2 * MAX_GROUPS;
constexpr int LN_ROWS = 2;      // rows a thread

// Helpers for the quad from element e0 of a row of n (CHECK false: the caller knows it lies within the row).
// -- the row's 4 elements as raw bits (past n: 0); streaming, L1 left to gamma and beta
template <bool CHECK>
__device__ __forceinline__ void load_quad_bits(const elem_t* row, int n, int e0, uint32_t (&w)[2]) {
  if (!CHECK || e0 + 4 <= n) {
    asm("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];" : "=r"(w[0]), "=r"(w[1]) : "l"(row + e0));
    return;
  }
  w[0] = w[1] = 0;
#pragma unroll
  for (int k = 0; k < 4; ++k)
    if (e0 + k < n) w[k >> 1] |= uint32_t(row[e0 + k].bits) << (16 * (k & 1));
}
// -- gamma / beta (past n: 0), kept in L1 for the SM's next rows. volatile: issued where the code says (a quad
//    ahead of its use), not hoisted all together (64 registers) over the reductions
template <bool CHECK>
__device__ __forceinline__ void load_quad_param(const float* p, int n, int e0, float (&v)[4]) {
  if (!CHECK || e0 + 4 <= n) {
    asm volatile("ld.global.nc.L1::evict_last.v4.f32 {%0, %1, %2, %3}, [%4];"
        : "=f"(v[0]), "=f"(v[1]), "=f"(v[2]), "=f"(v[3]) : "l"(p + e0));
    return;
  }
#pragma unroll
  for (int k = 0; k < 4; ++k) v[k] = e0 + k < n ? p[e0 + k] : 0.f;
}
// -- the compiler forgets what w holds: each pass over a row unpacks its bits again instead of keeping the
//    floats of an earlier pass (2x the registers) live across the reductions
__device__ __forceinline__ void forget(uint32_t (&w)[2]) { asm volatile("" : "+r"(w[0]), "+r"(w[1])); }
template <bool CHECK>
__device__ __forceinline__ void store_quad(elem_t* row, int n, int e0, const float (&v)[4]) {
  if (!CHECK || e0 + 4 <= n) {
    asm volatile("st.global.L1::no_allocate.v2.b32 [%0], {%1, %2};"
                 ::"l"(row + e0), "r"(pack2<elem_t>(v[0], v[1])), "r"(pack2<elem_t>(v[2], v[3])));
    return;
  }
#pragma unroll
  for (int k = 0; k < 4; ++k)
    if (e0 + k < n) row[e0 + k] = from_float<elem_t>(v[k]);
}

// FULL: every quad of the block's threads lies within the row (hidden == 4 * QUADS * T) and every row of the
// block exists: no checks, no branches between a thread's accesses (the serving sizes 4096 and 8192).
template <bool FULL>
__device__ __forceinline__ void layernorm_quads(const elem_t* input, const float* __restrict__ gamma,
                                                const float* __restrict__ beta, elem_t* out, int rows, int hidden,
                                                int threads_per_row, int64_t in_s, int64_t out_s, float eps) {
  constexpr int RR = LN_ROWS;
  const int T = threads_per_row, t = threadIdx.x % T, sub = threadIdx.x / T, S = blockDim.x / T;
  const int lane = threadIdx.x & 31, warps = T >> 5, first = sub * warps;
  const int quads = FULL ? QUADS : (hidden + 4 * T - 1) / (4 * T);
  const int64_t row0 = (int64_t(blockIdx.x) * S + sub) * RR;
  wait_prior_grids();
  // -- issue the loads of the rows
  uint32_t xb[RR][QUADS][2];
#pragma unroll
  for (int j = 0; j < RR; ++j) {
#pragma unroll
    for (int q = 0; q < QUADS; ++q) {
      xb[j][q][0] = xb[j][q][1] = 0;
      const int e0 = (q * T + t) * 4;
      if (FULL || (q < quads && row0 + j < rows))
        load_quad_bits<!FULL>(input + (row0 + j) * in_s, hidden, e0, xb[j][q]);
    }
  }
  // -- statistics of each row
  float sum[RR], mean[RR], inv_std[RR];
#pragma unroll
  for (int j = 0; j < RR; ++j) {
    sum[j] = 0.f;
#pragma unroll
    for (int q = 0; q < QUADS; ++q) {
      if (q < quads) {
        const float2 a = unpack2<elem_t>(xb[j][q][0]), b = unpack2<elem_t>(xb[j][q][1]);
        sum[j] += (a.x + a.y) + (b.x + b.y);
      }
    }
  }
  auto dev2 = [&](int j, float center) {    // sum of squared deviations of row j (past the end: nothing)
    float s = 0.f;
#pragma unroll
    for (int q = 0; q < QUADS; ++q) {
      if (q < quads) {
        forget(xb[j][q]);
        const float2 a = unpack2<elem_t>(xb[j][q][0]), b = unpack2<elem_t>(xb[j][q][1]);
        const float x[4] = {a.x, a.y, b.x, b.y};
        const int e0 = (q * T + t) * 4;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const float d = FULL || e0 + k < hidden ? x[k] - center : 0.f;
          s += d * d;
        }
      }
    }
    return s;
  };
  __shared__ float red[2][RR][32];
#pragma unroll
  for (int j = 0; j < RR; ++j) {
    sum[j] = warp_sum(sum[j]);
    if (lane == 0) red[0][j][threadIdx.x >> 5] = sum[j];
  }
  __syncthreads();
#pragma unroll
  for (int j = 0; j < RR; ++j) {
    float s = 0.f;
    for (int w = 0; w < warps; ++w) s += red[0][j][first + w];
    mean[j] = s / float(hidden);
    s = warp_sum(dev2(j, mean[j]));
    if (lane == 0) red[1][j][threadIdx.x >> 5] = s;
  }
  __syncthreads();
#pragma unroll
  for (int j = 0; j < RR; ++j) {
    float s = 0.f;
    for (int w = 0; w < warps; ++w) s += red[1][j][first + w];
    inv_std[j] = rsqrtf(s / float(hidden) + eps);
  }
  allow_next_grid();
  // -- normalize, scale, shift, write; gamma and beta of quad q + 1 loaded before quad q is computed
  float gm[2][4], bt[2][4];
  load_quad_param<!FULL>(gamma, hidden, t * 4, gm[0]);
  load_quad_param<!FULL>(beta, hidden, t * 4, bt[0]);
#pragma unroll
  for (int q = 0; q < QUADS; ++q) {
    if (q < quads) {
      if (q + 1 < QUADS && q + 1 < quads) {
        load_quad_param<!FULL>(gamma, hidden, ((q + 1) * T + t) * 4, gm[(q + 1) & 1]);
        load_quad_param<!FULL>(beta, hidden, ((q + 1) * T + t) * 4, bt[(q + 1) & 1]);
      }
#pragma unroll
      for (int j = 0; j < RR; ++j) {
        if (FULL || row0 + j < rows) {
          forget(xb[j][q]);
          const float2 a = unpack2<elem_t>(xb[j][q][0]), b = unpack2<elem_t>(xb[j][q][1]);
          float y[4] = {a.x, a.y, b.x, b.y};
#pragma unroll
          for (int k = 0; k < 4; ++k) y[k] = (y[k] - mean[j]) * inv_std[j] * gm[q & 1][k] + bt[q & 1][k];
          store_quad<!FULL>(out + (row0 + j) * out_s, hidden, (q * T + t) * 4, y);
        }
      }
    }
  }
}
}  // namespace cuattn

// vec is 1 by the launcher's routing (8-byte row accesses and 16-byte ones of gamma / beta need it). Blocks of at
// most 256 threads (hidden <= 8192: T <= 256). Registers capped at 80 (3 such blocks an SM; 64 spill): 768 threads
// an SM keep 96 KB of row loads in flight (12 rows of 4096, 6 of 8192; one row a thread, 64 registers, 1024
// threads: 64 KB).
extern "C" __global__ void __launch_bounds__(256, 3) cuattn_layernorm_rows(
    const elem_t* input, const float* __restrict__ gamma, const float* __restrict__ beta, elem_t* out,
    int rows, int hidden, int threads_per_row, int64_t in_s, int64_t out_s, float eps, int vec) {
  const int64_t block_rows = blockDim.x / threads_per_row * LN_ROWS;    // the same in every thread of the block
  if (hidden == 4 * QUADS * threads_per_row && (int64_t(blockIdx.x) + 1) * block_rows <= rows)
    layernorm_quads<true>(input, gamma, beta, out, rows, hidden, threads_per_row, in_s, out_s, eps);
  else
    layernorm_quads<false>(input, gamma, beta, out, rows, hidden, threads_per_row, in_s, out_s, eps);
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
