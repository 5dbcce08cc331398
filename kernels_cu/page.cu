// page.cu — launched by cuattn/page.py (PageSpec).
// Compile-time: VEC_BYTES (1, 2, 4, 8 or 16: the width of one copy; row bytes are a multiple).
// cuattn_page_append:    grid ceil(nnz * num_heads * vecs_per_row / 256), block 256.
// cuattn_batch_indices_positions: grid ceil(nnz / 256), block 256.
// cuattn_page_append_fp8 (KV_FP8 without KV_ROWS), cuattn_kv_rows (KV_ROWS): below.
// Strides are in bytes so one kernel serves every dtype and layout (NHD, HND, (k, v) pairs).
#include "common/dtypes.cuh"
#include "common/grid_dependency.cuh"

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

// Thread i's (token, head, vector) of the appended rows and the byte offset of its head row in the
// cache (page * c_page + slot * c_slot + head * c_head; the vector's offset not included), shared by
// both append kernels; false: nothing to write (past the end, or a token whose page lies outside its
// request's pages or the cache).
struct AppendSlot {
  int64_t tok, dst;
  int head, vec;
};
__device__ __forceinline__ bool append_slot(AppendSlot& a, const int32_t* __restrict__ batch_indices,
                                            const int32_t* __restrict__ positions, const int32_t* __restrict__ kv_indices,
                                            const int32_t* __restrict__ kv_indptr, int64_t nnz, int num_heads,
                                            int vecs_per_row, int page_size, int num_pages, int64_t c_page,
                                            int64_t c_slot, int64_t c_head) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= nnz * num_heads * vecs_per_row) return false;
  a.vec = int(i % vecs_per_row);
  a.head = int((i / vecs_per_row) % num_heads);
  a.tok = i / (int64_t(vecs_per_row) * num_heads);
  const int b = batch_indices[a.tok];
  const int pos = positions[a.tok];
  const int64_t page_iter = int64_t(kv_indptr[b]) + pos / page_size;
  if (pos < 0 || page_iter >= kv_indptr[b + 1]) return false;
  const int page = kv_indices[page_iter];
  if (page < 0 || page >= num_pages) return false;
  a.dst = page * c_page + int64_t(pos % page_size) * c_slot + a.head * c_head;
  return true;
}

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
  AppendSlot a;
  if (!append_slot(a, batch_indices, positions, kv_indices, kv_indptr, nnz, num_heads, vecs_per_row, page_size,
                   num_pages, c_page, c_slot, c_head))
    return;
  const int64_t tok = a.tok;
  const int head = a.head, vec = a.vec;

  const int64_t dst = a.dst + vec * VEC_BYTES;
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

#if KV_FP8 && !KV_ROWS
// cuattn_page_append_fp8 (PageFp8Spec; compile-time IN_BF16 (0: fp16 rows in, 1: bf16), KV_FP8
// (1: e4m3, 2: e5m2)): like cuattn_page_append, but each thread converts 8 values of a row
// (16 bytes in, 8 bytes out): stored = round_to_nearest_even(clamp(x / scale, +-max finite)), the
// division in fp32 (IEEE, as NumPy's), so the bits equal cuattn.fp8.quantize's (no NaN or inf from
// overflow); on sm_89+ the quotient by quotient() below and the rounding by the hardware's cvt.rn.satfinite (the
// division and software rounding per value left the H100 at 63% of the copy bandwidth, now 86-88%:
// benchmarks/results/append_notes.md), elsewhere by __fdiv_rn and to_fp8.
// scale = k_scale * (k_scales ? k_scales[head or 0] : 1), likewise v.
// grid ceil(nnz * num_heads * head_dim / 8 / 256), block 256.
namespace cuattn {
#if KV_FP8 == 1
constexpr int MANT = 3, BIAS = 7;
constexpr float MAX_FINITE = 448.f;
#else
constexpr int MANT = 2, BIAS = 15;
constexpr float MAX_FINITE = 57344.f;
#endif
#if IN_BF16
typedef bf16 in_t;
#else
typedef f16 in_t;
#endif

// RN(x / s) as far as the fp8 rounding can tell: x times r = RN(1 / s) is within 3 ulps of RN(x / s) (relative
// errors of 2^-24 in r and in the product), so both round to the same fp8 value unless an fp8 rounding tie lies
// between them: the product is used except where its bits below the fp8 mantissa lie within 4 ulps of a tie,
// in or near fp8's subnormal range (other tie positions), or it is not finite; there the IEEE division decides.
__device__ __forceinline__ float quotient(float x, float s, float r) {
  const float q = x * r;
  constexpr uint32_t LOW = (1u << (23 - MANT)) - 1u, TIE = 1u << (22 - MANT);
  const float a = fabsf(q);
  const bool near_tie = ((__float_as_uint(q) & LOW) - (TIE - 4u)) <= 8u;
  const bool plain = a <= 3.0e38f && a >= __uint_as_float(uint32_t(127 + 2 - BIAS) << 23);   // >= 2 x min normal
  return plain && !near_tie ? q : __fdiv_rn(x, s);
}

// fp32 -> fp8 bits, saturating, round to nearest even (subnormals included; NaN stays NaN)
__device__ __forceinline__ uint32_t to_fp8(float x) {
  const uint32_t u = __float_as_uint(x), sign = (u >> 24) & 0x80u;
  const float a = fminf(fabsf(x), MAX_FINITE);
  if (x != x) return sign | (KV_FP8 == 1 ? 0x7fu : 0x7eu);   // NaN (as ml_dtypes)
  const uint32_t au = __float_as_uint(a);
  constexpr int EMIN = 1 - BIAS;                     // the smallest normal exponent
  if (a < __uint_as_float(uint32_t(127 + EMIN) << 23)) {
    // subnormal (or zero): a multiple of 2^(EMIN - MANT); 2^MANT rounds up to the smallest normal
    const float m = a * __uint_as_float(uint32_t(127 - EMIN + MANT) << 23);   // exact (a power of 2)
    return sign | uint32_t(__float2int_rn(m));
  }
  constexpr int SHIFT = 23 - MANT;
  const uint32_t r = au + ((1u << (SHIFT - 1)) - 1u) + ((au >> SHIFT) & 1u);   // round the mantissa (RNE)
  return sign | ((r >> SHIFT) - (uint32_t(127 - BIAS) << MANT));
}
}  // namespace cuattn

extern "C" __global__ void cuattn_page_append_fp8(
    const char* __restrict__ append_key,      // [nnz, num_heads, head_dim] of in_t
    const char* __restrict__ append_value,
    const int32_t* __restrict__ batch_indices,  // [nnz]
    const int32_t* __restrict__ positions,      // [nnz]
    char* __restrict__ k_cache,               // page p, slot s, head h at p*page + s*slot + h*head (bytes)
    char* __restrict__ v_cache,
    const int32_t* __restrict__ kv_indices,   // [nnz_pages]
    const int32_t* __restrict__ kv_indptr,    // [batch + 1]
    int64_t nnz, int num_heads, int vecs_per_row, int page_size, int num_pages,
    int64_t ak_tok, int64_t ak_head, int64_t av_tok, int64_t av_head,   // byte strides of inputs
    int64_t c_page, int64_t c_slot, int64_t c_head,                     // byte strides of cache
    float k_scale, float v_scale, const float* __restrict__ k_scales, const float* __restrict__ v_scales,
    int scale_per_head) {   // bit 0: k_scales per head, bit 1: v_scales
  using namespace cuattn;
  AppendSlot a;
  if (!append_slot(a, batch_indices, positions, kv_indices, kv_indptr, nnz, num_heads, vecs_per_row, page_size,
                   num_pages, c_page, c_slot, c_head))
    return;
  const int64_t tok = a.tok;
  const int head = a.head, vec = a.vec;
  float ks = k_scale, vs = v_scale;
  if (k_scales != nullptr) ks *= k_scales[(scale_per_head & 1) ? head : 0];
  if (v_scales != nullptr) vs *= v_scales[(scale_per_head & 2) ? head : 0];

  const int64_t dst = a.dst + vec * 8;
  const uint4 k = *reinterpret_cast<const uint4*>(append_key + tok * ak_tok + head * ak_head + vec * 16);
  const uint4 v = *reinterpret_cast<const uint4*>(append_value + tok * av_tok + head * av_head + vec * 16);
  const float kr = __frcp_rn(ks), vr = __frcp_rn(vs);
  auto pack = [](uint4 x, float s, float r) {    // 8 values -> 8 fp8 bytes
    const uint32_t w[4] = {x.x, x.y, x.z, x.w};
    uint32_t out[2] = {0u, 0u};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 f = unpack2<in_t>(w[j]);
#if __CUDA_ARCH__ >= 890   // the hardware conversion: RNE, +-inf and overflow to +-max finite (satfinite) as to_fp8
      uint16_t pair;
      const float lo = quotient(f.x, s, r), hi = quotient(f.y, s, r);
      if (KV_FP8 == 1)
        asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(pair) : "f"(hi), "f"(lo));
      else
        asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(pair) : "f"(hi), "f"(lo));
      out[j / 2] |= uint32_t(pair) << (16 * (j % 2));
#else
      (void)r;
      const uint32_t lo = to_fp8(__fdiv_rn(f.x, s)), hi = to_fp8(__fdiv_rn(f.y, s));
      out[j / 2] |= (lo | (hi << 8)) << (16 * (j % 2));
#endif
    }
    return make_uint2(out[0], out[1]);
  };
  *reinterpret_cast<uint2*>(k_cache + dst) = pack(k, ks, kr);
  *reinterpret_cast<uint2*>(v_cache + dst) = pack(v, vs, vr);
}
#endif

#if KV_ROWS
// cuattn_kv_rows (KvRowsSpec; compile-time KV_FP8 (0: 16-bit rows copied as they are, 1: e4m3, 2: e5m2 converted),
// OUT_BF16 (fp8: 0 f16 rows out, 1 bf16)): a batch's K and V rows of a paged cache gathered into contiguous rows in
// token order, an fp8 cache's converted exactly (every e4m3 and e5m2 value is an f16 and a bf16 value; no scale
// applied: the attention kernel applies k_scale / v_scale as it does to the cache's rows), read once per run by the
// fa3 kernel's contiguous form (cuattn/prefill_ahead.py: paged prefill gathering each row once, not once per query
// tile that reads it). Token t of request b (tok_indptr[b] <= t < tok_indptr[b + 1]) sits at position
// p = t - tok_indptr[b]: page kv_indices[page_indptr[b] + p / page_size], slot p % page_size (contiguous rows, a ragged
// batch's: one page a request, its first row's index as its id, page stride = slot stride). One thread a piece of a
// K row and the same piece of its V row, 16 bytes out each (16-bit: 16 bytes in; fp8: 8 bytes in: every store
// instruction of a warp writes 512 contiguous bytes; with 16 bytes in and 32 out a thread, the pass ran at 1.27-1.39x
// the time of a copy of its bytes, 1.05x for the 16-bit copy); a warp covers one token's heads, so its request search
// reads the same few indptr words. Launched with PDL (sm_90) behind the previous
// kernel and before the attention kernel: it lets the attention kernel start its prologue at once (that kernel
// waits for this grid before reading K / V) and waits for the previous one before reading the cache.
// grid ceil(nnz * num_heads * chunks_per_row / 256), block 256.
namespace cuattn {
#if OUT_BF16
typedef bf16 out_t;
#else
typedef f16 out_t;
#endif

#if KV_FP8
__device__ __forceinline__ uint4 dequant8(uint32_t a, uint32_t b) {    // 8 fp8 values -> 8 out_t values, exact
  const uint4 h = fp8_chunk<KV_FP8>(a, b);
  constexpr float F = fp8_factor(KV_FP8);       // (256: the byte trick's e4m3 values, without the hardware cvt)
  if (F == 1.f) return convert8<f16, out_t>(h);
  uint32_t w[4] = {h.x, h.y, h.z, h.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float2 f = unpack2<f16>(w[j]);
    w[j] = pack2<out_t>(f.x * F, f.y * F);
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}
#endif
}  // namespace cuattn

extern "C" __global__ void cuattn_kv_rows(
    const char* __restrict__ k_cache,           // page p, slot s, head h at p*c_page + s*c_slot + h*c_head (bytes)
    const char* __restrict__ v_cache,           // ... at p*v_page + s*v_slot + h*v_head
    const int32_t* __restrict__ tok_indptr,     // [batch + 1]: the rows' token offsets
    const int32_t* __restrict__ page_indptr,    // [batch + 1]: the requests' page ids in kv_indices
    const int32_t* __restrict__ kv_indices,
    uint4* __restrict__ k_out,                  // [nnz, num_heads, head_dim] of 16-bit values, contiguous
    uint4* __restrict__ v_out,
    int nnz, int batch, int num_heads, int chunk_shift, int page_size, int page_shift,
    int64_t c_page, int64_t c_slot, int64_t c_head, int64_t v_page, int64_t v_slot, int64_t v_head) {
  // (32-bit index math: the launch keeps nnz x num_heads x chunks under 2^31; chunks a row and, where page_shift >= 0,
  //  the page size are powers of two: shifts)
  cuattn::allow_next_grid();
  cuattn::wait_prior_grids();
  const int i = int(blockIdx.x) * int(blockDim.x) + int(threadIdx.x);
  const int r = i >> chunk_shift;                  // (token, head) row
  if (r >= nnz * num_heads) return;
  const int c = i & ((1 << chunk_shift) - 1);
  const int t = r / num_heads;
  const int head = r - t * num_heads;
  int lo = 0, hi = batch;          // the last request b with tok_indptr[b] <= t (an empty one before it: skipped)
  while (hi - lo > 1) {
    const int mid = (lo + hi) >> 1;
    if (tok_indptr[mid] <= t) lo = mid; else hi = mid;
  }
  const int p = t - tok_indptr[lo];
  const int pi = page_shift >= 0 ? p >> page_shift : p / page_size;
  const int64_t page = kv_indices[page_indptr[lo] + pi];
  const int64_t slot = p - pi * page_size;
#if KV_FP8
  const uint2 k = *reinterpret_cast<const uint2*>(k_cache + page * c_page + slot * c_slot + head * c_head + c * 8);
  const uint2 v = *reinterpret_cast<const uint2*>(v_cache + page * v_page + slot * v_slot + head * v_head + c * 8);
  k_out[i] = cuattn::dequant8(k.x, k.y);
  v_out[i] = cuattn::dequant8(v.x, v.y);
#else
  k_out[i] = *reinterpret_cast<const uint4*>(k_cache + page * c_page + slot * c_slot + head * c_head + c * 16);
  v_out[i] = *reinterpret_cast<const uint4*>(v_cache + page * v_page + slot * v_slot + head * v_head + c * 16);
#endif
}
#endif
