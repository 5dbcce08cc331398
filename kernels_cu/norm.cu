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

// -- layernorm's one-pass statistics (LN_ONEPASS): count, mean and sum of squared deviations of a part of a
//    row; two parts merge exactly in real arithmetic (Chan et al.), and in fp32 without the cancellation of
//    sum(x^2) - sum(x)^2 / n, so one block reduction gives mean and variance with two-pass accuracy
struct Moments {
  float n, mean, m2;
};
__device__ __forceinline__ Moments merge(Moments a, Moments b) {
  const float n = a.n + b.n;
  const float f = n > 0.f ? __fdividef(b.n, n) : 0.f;     // b's share; 0 when both are empty
  const float d = b.mean - a.mean;
  return {n, fmaf(d, f, a.mean), a.m2 + b.m2 + d * d * a.n * f};
}
__device__ __forceinline__ Moments warp_merge(Moments a) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    const Moments b = {__shfl_xor_sync(0xffffffffu, a.n, offset), __shfl_xor_sync(0xffffffffu, a.mean, offset),
                       __shfl_xor_sync(0xffffffffu, a.m2, offset)};
    a = merge(a, b);
  }
  return a;
}
// -- a thread's own part: n values of sum `sum`, m2 about their mean from `dev2(mean)`
template <class Dev2>
__device__ __forceinline__ Moments local_moments(float n, float sum, Dev2 dev2) {
  const float mean = n > 0.f ? __fdividef(sum, n) : 0.f;
  return {n, mean, dev2(mean)};
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

// Layernorm forms (NormSpec.ln, norm.LAYERNORM_FORMS; the shipped "pipe" compiles with none of these defined):
//   LN_ONEPASS 1: mean and variance from one block reduction (Moments merged across threads and warps, one
//                 barrier a tile, the partials in two buffers alternating by tile) instead of two;
//   LN_SPLIT 1:   the staged gamma / beta in shared memory as two float4 arrays each (elements 0-3 and 4-7 of
//                 every group of 8), so a warp's 16-byte reads of them are conflict-free (the plain layout, 32
//                 bytes a thread, is 2-way conflicted: 8 wavefronts a read where 4 carry the data);
//   LN_ROWS N:    compiles cuattn_layernorm_rows (below), N rows a thread.
#ifndef LN_ONEPASS
#define LN_ONEPASS 0
#endif
#ifndef LN_SPLIT
#define LN_SPLIT 0
#endif
#ifndef LN_ROWS
#define LN_ROWS 0
#endif

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
// -- index of element e of a staged parameter array of ng groups of 8 (LN_SPLIT: lo halves, then hi halves)
__device__ __forceinline__ int param_index(int e, int ng) {
  return LN_SPLIT ? ((e & 4) ? 4 * ng : 0) + (e >> 3) * 4 + (e & 3) : e;
}
// -- group g of a staged parameter array, as load_group reads the plain one
__device__ __forceinline__ void load_staged(const float* s, int n, int g, bool vec, float (&v)[GROUP], int t, int T) {
  if (!LN_SPLIT) {
    load_group(s, n, g, vec, v, t, T);
    return;
  }
  const int ng = (n + GROUP - 1) / GROUP, e0 = group_elem(g, 0, vec, t, T);
  if (vec && e0 + GROUP <= n) {
    const float4 a = reinterpret_cast<const float4*>(s)[e0 >> 3];
    const float4 b = reinterpret_cast<const float4*>(s)[ng + (e0 >> 3)];
    v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
    v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
    return;
  }
#pragma unroll
  for (int k = 0; k < GROUP; ++k) {
    const int e = group_elem(g, k, vec, t, T);
    v[k] = e < n ? s[param_index(e, ng)] : 0.f;
  }
}

template <bool STAGED>
__device__ __forceinline__ void layernorm_rows(const elem_t* input, const float* __restrict__ gamma,
                                               const float* __restrict__ beta, elem_t* out, int rows, int hidden,
                                               int threads_per_row, int64_t in_s, int64_t out_s, float eps, bool vec) {
  constexpr bool staged = STAGED;
  extern __shared__ float4 staged_params[];      // staged: gamma[hidden], then beta[hidden]
#if LN_ONEPASS
  __shared__ float4 red4[2][32];                 // the warps' Moments (n, mean, m2), by tile parity
  int parity = 0;
#else
  __shared__ float red[2][32];                   // the warps' partial sums: the mean's, the variance's
#endif
  const int T = threads_per_row, t = threadIdx.x % T, sub = threadIdx.x / T, R = blockDim.x / T;
  const int lane = threadIdx.x & 31, warps = T >> 5, first = sub * warps;
  const int groups = (hidden + GROUP * T - 1) / (GROUP * T);
  const int ng = (hidden + 7) >> 3;
  float* const s_gamma = reinterpret_cast<float*>(staged_params);
  float* const s_beta = s_gamma + 8 * ng;        // 32-byte aligned for the groups' float4 reads
  const bool pipe = STAGED && vec;
  uint4* const slots = reinterpret_cast<uint4*>(s_beta + 8 * ng);   // [MAX_GROUPS][blockDim.x]
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
          const int j = param_index(4 * i, ng) >> 2;
          reinterpret_cast<float4*>(s_gamma)[j] = reinterpret_cast<const float4*>(gamma)[i];
          reinterpret_cast<float4*>(s_beta)[j] = reinterpret_cast<const float4*>(beta)[i];
        } else {
          const int j = param_index(i, ng);
          s_gamma[j] = gamma[i], s_beta[j] = beta[i];
        }
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
    if (pipe) {
      asm volatile("" ::"f"(sum) : "memory");   // sum consumed every slot's value: their reads are complete
      prefetch_row(row + int64_t(gridDim.x) * R);  // the next tile's row into the slots
    }
    // -- sum of squared deviations about `center` (elements past the row's end count nothing)
    auto dev2 = [&](float center) {
      float sum_sq = 0.f;
#pragma unroll
      for (int g = 0; g < MAX_GROUPS; ++g) {
        if (g < groups) {
          float x[GROUP];
          unpack_group<elem_t>(xb[g], x);
#pragma unroll
          for (int k = 0; k < GROUP; ++k) {
            const float d = group_elem(g, k, vec, t, T) < hidden ? x[k] - center : 0.f;
            sum_sq += d * d;
          }
        }
      }
      return sum_sq;
    };
#if LN_ONEPASS
    // -- this thread's Moments, merged over the warp, then over the row's warps (one barrier)
    int n_own = 0;        // this thread's elements (vec: group g's 8 from group_elem(g, 0) on)
#pragma unroll
    for (int g = 0; g < MAX_GROUPS; ++g) {
      if (g < groups && vec) n_own += min(max(hidden - group_elem(g, 0, true, t, T), 0), GROUP);
#pragma unroll
      for (int k = 0; k < GROUP; ++k) n_own += (g < groups && !vec && group_elem(g, k, false, t, T) < hidden);
    }
    Moments mo = warp_merge(local_moments(float(n_own), sum, dev2));
    if (lane == 0) red4[parity][threadIdx.x >> 5] = make_float4(mo.n, mo.mean, mo.m2, 0.f);
    __syncthreads();      // (red4[parity] is next written two tiles on, after every thread passed the next barrier)
    float4 p = red4[parity][first];
    mo = {p.x, p.y, p.z};
    for (int w = 1; w < warps; ++w) {
      p = red4[parity][first + w];
      mo = merge(mo, {p.x, p.y, p.z});
    }
    parity ^= 1;
    const float mean = mo.mean;
    const float inv_std = rsqrtf(mo.m2 / float(hidden) + eps);
#else
    sum = warp_sum(sum);
    if (lane == 0) red[0][threadIdx.x >> 5] = sum;
    __syncthreads();
    sum = 0.f;
    for (int w = 0; w < warps; ++w) sum += red[0][first + w];
    const float mean = sum / float(hidden);
    // -- variance about the mean
    float sum_sq = warp_sum(dev2(mean));
    if (lane == 0) red[1][threadIdx.x >> 5] = sum_sq;
    __syncthreads();      // (also: red[0] read by every thread before the next tile writes it)
    sum_sq = 0.f;
    for (int w = 0; w < warps; ++w) sum_sq += red[1][first + w];
    const float inv_std = rsqrtf(sum_sq / float(hidden) + eps);
#endif
    if (row0 + int64_t(gridDim.x) * R >= rows) allow_next_grid();
    // -- normalize, scale, shift, write
    if (live) {
      elem_t* o_row = out + row * out_s;
#pragma unroll
      for (int g = 0; g < MAX_GROUPS; ++g) {
        if (g < groups) {
          float x[GROUP], gm[GROUP], bt[GROUP];
          unpack_group<elem_t>(xb[g], x);
          if (staged) {
            load_staged(s_gamma, hidden, g, vec, gm, t, T);
            load_staged(s_beta, hidden, g, vec, bt, t, T);
          } else {
            load_group(gamma, hidden, g, vec, gm, t, T);
            load_group(beta, hidden, g, vec, bt, t, T);
          }
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

#if LN_ROWS
// cuattn_layernorm_rows (NormSpec.ln "rows*": large calls with 16-byte accesses, hidden <= 8192): rmsnorm's
// structure instead of persistent blocks. The block is S = blockDim.x / T sub-blocks of T = threads_per_row
// threads; sub-block s serves the LN_ROWS rows (blockIdx.x * S + s) * LN_ROWS + j (the grid covers every row),
// each thread the same columns of each: the quads (groups of 4 elements) q * T + t, q < QUADS, of every row. All the
// row loads are issued first; one block reduction (LN_ONEPASS) or two give the rows' statistics; then the quads
// are normalized with gamma and beta read once for the LN_ROWS rows. gamma and beta are read through L1 with
// evict_last, the rows with L1::no_allocate (loads and stores that do not evict them): an SM's blocks find them in
// L1 (32 / 64 KB at hidden 4096 / 8192) rather than in L2, whose bandwidth bound the one-row-a-block form when
// they came from there (63% of the copy ceiling). Quads rather than groups of 8: a warp's 16-byte reads of gamma
// and beta cover 512 contiguous bytes (4 wavefronts) instead of 1 KB with half of each line read (8).
namespace cuattn {
constexpr int QUADS = 2 * MAX_GROUPS;

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
#if LN_ONEPASS
  __shared__ float4 red4[RR][32];
  float n_own = 0.f;
#pragma unroll
  for (int q = 0; q < QUADS; ++q)
    if (q < quads) n_own += FULL ? 4.f : float(min(max(hidden - (q * T + t) * 4, 0), 4));
  Moments mo[RR];
#pragma unroll
  for (int j = 0; j < RR; ++j) {
    mo[j] = warp_merge(local_moments(n_own, sum[j], [&](float c) { return dev2(j, c); }));
    if (lane == 0) red4[j][threadIdx.x >> 5] = make_float4(mo[j].n, mo[j].mean, mo[j].m2, 0.f);
  }
  __syncthreads();
#pragma unroll
  for (int j = 0; j < RR; ++j) {
    float4 p = red4[j][first];
    mo[j] = {p.x, p.y, p.z};
    for (int w = 1; w < warps; ++w) {
      p = red4[j][first + w];
      mo[j] = merge(mo[j], {p.x, p.y, p.z});
    }
    mean[j] = mo[j].mean;
    inv_std[j] = rsqrtf(mo[j].m2 / float(hidden) + eps);
  }
#else
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
#endif
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
// most 256 threads (hidden <= 8192: T <= 256). Registers: LN_ROWS 1 capped at 64 (4 such blocks an SM; 48 spill),
// so 1024 threads an SM keep 64 KB of row loads in flight (8 rows of 4096, 4 of 8192); LN_ROWS 2 at 80 (3 blocks;
// 64 spill), 96 KB from 768 threads.
extern "C" __global__ void __launch_bounds__(256, LN_ROWS == 1 ? 4 : 3) cuattn_layernorm_rows(
    const elem_t* input, const float* __restrict__ gamma, const float* __restrict__ beta, elem_t* out,
    int rows, int hidden, int threads_per_row, int64_t in_s, int64_t out_s, float eps, int vec) {
  const int64_t block_rows = blockDim.x / threads_per_row * LN_ROWS;    // the same in every thread of the block
  if (hidden == 4 * QUADS * threads_per_row && (int64_t(blockIdx.x) + 1) * block_rows <= rows)
    layernorm_quads<true>(input, gamma, beta, out, rows, hidden, threads_per_row, in_s, out_s, eps);
  else
    layernorm_quads<false>(input, gamma, beta, out, rows, hidden, threads_per_row, in_s, out_s, eps);
}
#endif  // LN_ROWS

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
