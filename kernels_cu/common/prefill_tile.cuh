// prefill_tile.cuh — what both prefill kernels (prefill.cu, prefill_sm90.cu) share around their
// main loops: which request and query tile a CTA works on, the first key tile a variant lets it
// see, and the store of a finished row.
#pragma once
#include "common/dtypes.cuh"
#include "common/variant.cuh"

// -- the defines both prefill kernels read, with their defaults
#ifndef MASK_SPLIT
#define MASK_SPLIT 1        // tiles no mask reaches run a variant's logits transform without bound checks (0: the A/B)
#endif
#ifndef KV_FP8
#define KV_FP8 0            // K/V of the kernel's 16-bit type; 1: e4m3, 2: e5m2
#endif

namespace cuattn {

// -- work items: WORK_COLS int32 each, (request, query tile, kv piece, partial slot). A piece p of a
//    split item covers keys [p * kv_chunk, (p + 1) * kv_chunk) (kv_chunk 0: unsplit, piece 0) and
//    writes an fp32 partial row and LSE into workspace slot `slot` (-1: the final output).
//    Request -1 pads a CUDA-graph plan's fixed grid: that CTA has nothing to do.
constexpr int WORK_COLS = 4;
constexpr int MERGE_COLS = 4;   // merge rows: (request, query tile, first slot, pieces)

// -- which work item a CTA is on, w() of count(): its launch's blockIdx.x of gridDim.x (CtaItem: read where
//    used; fa2's registers spilled with the index read up front), or a persistent CTA's current item (ListItem)
struct CtaItem {
  __device__ __forceinline__ unsigned w() const { return blockIdx.x; }
  __device__ __forceinline__ unsigned count() const { return gridDim.x; }
};
struct ListItem {
  unsigned i, n;
  __device__ __forceinline__ unsigned w() const { return i; }
  __device__ __forceinline__ unsigned count() const { return n; }
};

// -- a CTA's request and query tile, and the request's first query token and query length, for work item
//    `at`: work == nullptr is the single-request case (req, q_base and qo_len keep their values; tiles in
//    reverse so the longest causal tiles start first). False: a padding item.
template <class At>
__device__ __forceinline__ bool query_tile(const int32_t* work, const At& at, const int32_t* qo_indptr, int& req,
                                           int& tile, int64_t& q_base, int& qo_len) {
  if (work == nullptr) {
    tile = int(at.count()) - 1 - int(at.w());
    return true;
  }
  const int32_t* item = work + WORK_COLS * at.w();
  req = item[0];
  if (req < 0) return false;
  tile = item[1];
  q_base = qo_indptr[req];
  qo_len = qo_indptr[req + 1] - qo_indptr[req];
  return true;
}

// -- the key range [kv_lo, kv_end) narrowed to this CTA's piece of a split item (*kv_chunk > 0, a
//    multiple of the kernel's BLOCK_N, so kv_lo stays tile-aligned)
template <class At>
__device__ __forceinline__ void clamp_to_piece(const int32_t* work, const At& at, const int32_t* kv_chunk, int& kv_lo,
                                               int& kv_end) {
  const int chunk = kv_chunk == nullptr ? 0 : *kv_chunk;
  if (work != nullptr && chunk > 0) {
    const int piece = work[WORK_COLS * at.w() + 2];
    kv_lo = max(kv_lo, piece * chunk);
    kv_end = min(kv_end, (piece + 1) * chunk);
  }
}

// -- at the epilogue (read again, so no register holds them through the main loop): the partial
//    slot of this CTA's item (-1: it writes the final output) and whether it counts the sink (the
//    first piece of an item alone)
struct ItemEnd {
  int slot;
  bool with_sink;
};
template <class At>
__device__ __forceinline__ ItemEnd item_end(const int32_t* work, const At& at) {
  if (work == nullptr) return {-1, true};
  const int slot = work[WORK_COLS * at.w() + 3];
  return {slot, slot < 0 || work[WORK_COLS * at.w() + 2] == 0};
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

// -- a split item's finished row: fp32 values times end.o_scale and the LSE into workspace row
//    `row` ((slot * num_kv_heads + kv head) * BLOCK_M + row within the tile)
template <int D, class Pair>
__device__ __forceinline__ void store_partial_row(float* part_o, float* part_lse, int64_t row, int t4, RowEnd end,
                                                  Pair pair) {
  float* orow = part_o + row * D;
#pragma unroll
  for (int n = 0; n < D / 8; ++n) {
    const float2 v = pair(n);
    *reinterpret_cast<float2*>(orow + n * 8 + 2 * t4) = make_float2(v.x * end.o_scale, v.y * end.o_scale);
  }
  if (t4 == 0) part_lse[row] = end.lse;
}

// -- merge the pieces of split items (CTAs of 128 threads; grid (merge rows, num_kv_heads, row
//    chunks): the z CTAs of a (merge row, kv head) take its BLOCK_M rows in turn, D / 4 threads a row,
//    so the merge has as many rows in flight as the grid has CTAs; launched with BLOCK_M * D / 512
//    chunks, one row per thread group, any count is correct): with piece LSEs s_i (natural log),
//    lse = log(sum_i exp(s_i)) and o = sum_i exp(s_i - lse) o_i; pieces with s_i = -inf add nothing, all
//    -inf give 0 and -inf
template <int D, int BLOCK_M, class T>
__device__ __forceinline__ void merge_pieces(const int32_t* __restrict__ merge, const int32_t* __restrict__ qo_indptr,
                                             const float* __restrict__ part_o, const float* __restrict__ part_lse,
                                             T* __restrict__ o, float* __restrict__ lse, int group, int64_t o_s_tok,
                                             int64_t o_s_head) {
  const int32_t* row_desc = merge + MERGE_COLS * blockIdx.x;
  const int req = row_desc[0];
  if (req < 0) return;     // a padding row of a CUDA-graph plan
  const int tile = row_desc[1], first = row_desc[2], pieces = row_desc[3];
  const int kvh = int(blockIdx.y), num_kv_heads = int(gridDim.y), num_qo_heads = num_kv_heads * group;
  const int64_t q_base = qo_indptr[req];
  const int packed_rows = (qo_indptr[req + 1] - qo_indptr[req]) * group;
  constexpr int TPR = D / 4;                    // threads per row, 4 columns each
  constexpr int ROWS_PER_PASS = 128 / TPR;
  const int c = int(threadIdx.x) % TPR;
  const float neg_inf = __int_as_float(0xff800000);
  for (int r = int(blockIdx.z) * ROWS_PER_PASS + int(threadIdx.x) / TPR; r < BLOCK_M;
       r += ROWS_PER_PASS * int(gridDim.z)) {
    const int pr = tile * BLOCK_M + r;
    if (pr >= packed_rows) break;
    float m = neg_inf;
    for (int i = 0; i < pieces; ++i) m = fmaxf(m, part_lse[(int64_t(first + i) * num_kv_heads + kvh) * BLOCK_M + r]);
    const float m_use = m == neg_inf ? 0.f : m;
    float l = 0.f;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 4
    for (int i = 0; i < pieces; ++i) {
      const int64_t row = (int64_t(first + i) * num_kv_heads + kvh) * BLOCK_M + r;
      const float w = __expf(part_lse[row] - m_use);
      const float4 x = *reinterpret_cast<const float4*>(part_o + row * D + 4 * c);
      acc.x += w * x.x; acc.y += w * x.y; acc.z += w * x.z; acc.w += w * x.w;
      l += w;
    }
    const float inv = l > 0.f ? 1.f / l : 0.f;
    const int head = kvh * group + pr % group;
    const int64_t tok = q_base + pr / group;
    T* orow = o + tok * o_s_tok + head * o_s_head + 4 * c;
    reinterpret_cast<uint32_t*>(orow)[0] = pack2<T>(acc.x * inv, acc.y * inv);
    reinterpret_cast<uint32_t*>(orow)[1] = pack2<T>(acc.z * inv, acc.w * inv);
    if (lse != nullptr && c == 0) lse[tok * num_qo_heads + head] = l > 0.f ? m_use + __logf(l) : neg_inf;
  }
}

}  // namespace cuattn
