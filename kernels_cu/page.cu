// page.cu — launched by cuattn/page.py (PageSpec).
// Compile-time: VEC_BYTES (1, 2, 4, 8 or 16: the width of one copy; row bytes are a multiple).
// cuattn_page_append:    grid ceil(nnz * num_heads * vecs_per_row / 256), block 256.
// cuattn_batch_indices_positions: grid ceil(nnz / 256), block 256.
// Strides are in bytes so one kernel serves every dtype and layout (NHD, HND, (k, v) pairs).
#include "common/dtypes.cuh"

#if VEC_BYTES == 16
typedef uint4 vec_t;
#elif VEC_BYTES == 8
typedef uint2 vec_t;
#elif VEC_BYTES == 4
typedef uint32_t vec_t;
#elif VEC_BYTES == 2
typedef uint16_t vec_t;
#else
typedef uint8_t vec_t;
#endif

// Copy each appended token's K and V rows into its page slot. A token whose page lies outside
// its request's pages, or whose page index is out of range, is skipped (no out-of-bounds write);
// the host validates those cases before launch when the metadata is on the host.
extern "C" __global__ void cuattn_page_append(
    const char* __restrict__ append_key,      // [nnz, num_heads, head_dim]
    const char* __restrict__ append_value,    // [nnz, num_heads, head_dim]
    const int32_t* __restrict__ batch_indices,  // [nnz]
    const int32_t* __restrict__ positions,      // [nnz]
    char* __restrict__ k_cache,               // page p, slot s, head h at p*page + s*slot + h*head
    char* __restrict__ v_cache,
    const int32_t* __restrict__ kv_indices,   // [nnz_pages]
    const int32_t* __restrict__ kv_indptr,    // [batch + 1]
    int64_t nnz, int num_heads, int vecs_per_row, int page_size, int num_pages,
    int64_t ak_tok, int64_t ak_head, int64_t av_tok, int64_t av_head,   // byte strides of inputs
    int64_t c_page, int64_t c_slot, int64_t c_head) {                   // byte strides of cache
  int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  int64_t total = nnz * num_heads * vecs_per_row;
  if (i >= total) return;
  int vec = int(i % vecs_per_row);
  int head = int((i / vecs_per_row) % num_heads);
  int64_t tok = i / (int64_t(vecs_per_row) * num_heads);

  int b = batch_indices[tok];
  int pos = positions[tok];
  int64_t page_iter = int64_t(kv_indptr[b]) + pos / page_size;
  if (pos < 0 || page_iter >= kv_indptr[b + 1]) return;
  int page = kv_indices[page_iter];
  if (page < 0 || page >= num_pages) return;

  int64_t dst = page * c_page + int64_t(pos % page_size) * c_slot + head * c_head + vec * VEC_BYTES;
  const vec_t k = *reinterpret_cast<const vec_t*>(append_key + tok * ak_tok + head * ak_head + vec * VEC_BYTES);
  const vec_t v = *reinterpret_cast<const vec_t*>(append_value + tok * av_tok + head * av_head + vec * VEC_BYTES);
  *reinterpret_cast<vec_t*>(k_cache + dst) = k;
  *reinterpret_cast<vec_t*>(v_cache + dst) = v;
}

// batch_indices[t] = request of appended token t; positions[t] = its position in the request's KV.
extern "C" __global__ void cuattn_batch_indices_positions(
    const int32_t* __restrict__ append_indptr,  // [batch + 1]
    const int32_t* __restrict__ seq_lens,       // [batch], KV length after the append
    int32_t* __restrict__ batch_indices,        // [nnz]
    int32_t* __restrict__ positions,            // [nnz]
    int batch, int nnz) {
  int t = blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= nnz) return;
  // -- binary search: the last request r with append_indptr[r] <= t
  int lo = 0, hi = batch;
  while (hi - lo > 1) {
    int mid = (lo + hi) / 2;
    if (append_indptr[mid] <= t) lo = mid; else hi = mid;
  }
  int append_len = append_indptr[lo + 1] - append_indptr[lo];
  batch_indices[t] = lo;
  positions[t] = seq_lens[lo] - append_len + (t - append_indptr[lo]);
}
