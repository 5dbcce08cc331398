// prefill_tile.cuh — what both prefill kernels (prefill.cu, prefill_sm90.cu) share around their
// main loops: which request and query tile a CTA works on, and the store of a finished row.
#pragma once
#include "common/dtypes.cuh"

namespace cuattn {

// -- a CTA's request and query tile, and the request's first query token and query length:
//    work == nullptr is the single-request case (req, q_base and qo_len keep their values; tiles
//    in reverse so the longest causal tiles start first), else work[2 * blockIdx.x + {0, 1}] =
//    (request, tile) of a ragged batch
__device__ __forceinline__ void query_tile(const int32_t* work, const int32_t* qo_indptr, int& req, int& tile,
                                           int64_t& q_base, int& qo_len) {
  if (work == nullptr) {
    tile = int(gridDim.x) - 1 - int(blockIdx.x);
    return;
  }
  req = work[2 * blockIdx.x];
  tile = work[2 * blockIdx.x + 1];
  q_base = qo_indptr[req];
  qo_len = qo_indptr[req + 1] - qo_indptr[req];
}

// -- O / l of one query row (token tok, qo head `head`) from the mma accumulator layout, where
//    this thread holds columns n * 8 + 2 t4 and + 1 as pair(n), and its natural-log LSE from the
//    base-2 row max m and the full row sum l; a fully masked row (l = 0) gives 0 and -inf
template <int D, class T, class Pair>
__device__ __forceinline__ void store_output_row(T* o, int64_t o_s_tok, int64_t o_s_head, float* lse,
                                                 int num_qo_heads, int64_t tok, int head, int t4, float l,
                                                 float m, Pair pair) {
  const float inv = l > 0.f ? 1.f / l : 0.f;
  T* orow = o + tok * o_s_tok + head * o_s_head;
#pragma unroll
  for (int n = 0; n < D / 8; ++n) {
    const float2 v = pair(n);
    *reinterpret_cast<uint32_t*>(orow + n * 8 + 2 * t4) = pack2<T>(v.x * inv, v.y * inv);
  }
  if (lse != nullptr && t4 == 0)
    lse[tok * num_qo_heads + head] = l > 0.f ? (m + __log2f(l)) * 0.69314718055994531f : __int_as_float(0xff800000);
}

}  // namespace cuattn
