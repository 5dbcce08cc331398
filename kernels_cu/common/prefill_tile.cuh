// prefill_tile.cuh — what both prefill kernels (prefill.cu, prefill_sm90.cu) share around their
// main loops: which request and query tile a CTA works on, the first key tile a variant lets it
// see, and the store of a finished row.
#pragma once
#include "common/dtypes.cuh"
#include "common/variant.cuh"

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

// -- the first key of the tiles a CTA reads, a multiple of block_n: 0, or with a variant's kv_begin
//    (sliding window) the first key its first query row (position qo_pos0) may see
__device__ __forceinline__ int first_kv_tile_key(const variant::Params& vp, int batch, int qo_pos0, int qo_len,
                                                 int kv_len, int block_n) {
  if (!variant::HAS_KV_BEGIN) return 0;
  const int lo = max(0, min(variant::kv_begin(vp, batch, qo_pos0, qo_len, kv_len), kv_len));
  return lo / block_n * block_n;
}

// -- one finished query row (token tok, qo head `head`) from the mma accumulator layout, where
//    this thread holds columns n * 8 + 2 t4 and + 1 as pair(n), times end.o_scale, and its LSE
//    (variant.cuh finish_row: 1 / l and the natural-log LSE, a sink included; 0 and -inf for a
//    fully masked row)
template <int D, class T, class Pair>
__device__ __forceinline__ void store_output_row(T* o, int64_t o_s_tok, int64_t o_s_head, float* lse,
                                                 int num_qo_heads, int64_t tok, int head, int t4, RowEnd end,
                                                 Pair pair) {
  T* orow = o + tok * o_s_tok + head * o_s_head;
#pragma unroll
  for (int n = 0; n < D / 8; ++n) {
    const float2 v = pair(n);
    *reinterpret_cast<uint32_t*>(orow + n * 8 + 2 * t4) = pack2<T>(v.x * end.o_scale, v.y * end.o_scale);
  }
  if (lse != nullptr && t4 == 0) lse[tok * num_qo_heads + head] = end.lse;
}

}  // namespace cuattn
