// mla.cu — launched by cuattn/mla.py (MLASpec, PARAMS / MERGE_PARAMS; tests/test_mla.py checks the two agree).
// Compile-time: DTYPE (cuattn::f16 | cuattn::bf16: q and out; the caches too unless KV_FP8), KV_FP8 (0: caches
// of DTYPE, 1: fp8 e4m3 caches, 2: fp8 e5m2), STAGES (cp.async depth of key tiles).
// Fixed: head_dim_ckv 512, head_dim_kpe 64 (DeepSeek V2/V3), BLOCK_M 64 query rows, BLOCK_N 32 keys, 8 warps.
//
// Absorbed MLA: every query head scores against the same 576-wide key [ckv | kpe] of a token,
//   s = (q_nope . ckv + q_pe . kpe) * sm_scale, and reads the same 512-wide ckv as its value.
//
// cuattn_mla_paged: one CTA = one work item of plan.prefill_work_list (request, query tile, kv piece,
//   partial slot): a tile is 64 packed rows (row = token * num_heads + head of the request's queries),
//   so a decode step of 16 heads fills 16 rows and a 4-token speculative step of 16 heads all 64.
//   Grid (num_work); block 256 (8 warps).
//   - Q (64 x 576) sits in shared memory for the whole CTA; key tiles (32 tokens x 576) stream through a
//     STAGES-deep cp.async ring (16-byte copies, zero fill past the piece's end, so V rows there are 0).
//   - Warp w: row group rg = w / 2 (16 rows), half h = w % 2. S = Q K^T: each warp of a pair computes its
//     16 x 32 scores over half of the 576 dims (h = 0: dims 0..287, h = 1: 288..575), the pair sums the
//     two halves through one shared buffer (two named barriers of 64 threads), and both run the same
//     online softmax on the same sum. O += P V: the warp owns V columns h * 256 .. h * 256 + 255 of its 16 rows
//     (128 fp32 accumulators per thread); V is the ckv part of the same key tile.
//   - mma.sync m16n8k16, fp32 accumulation; ldmatrix (plain for Q and K, transposed for V). Shared rows
//     are padded by 16 bytes (pitch 1168 bytes), so the 8 rows of an ldmatrix hit 8 distinct bank groups.
//   - Masks: key j of row (token t) is visible when j < kv_end of the piece and, causal, j <= t + kv_len -
//     qo_len (bottom-right). A row with no visible key in its piece gives 0 and LSE -inf.
//   - KV_FP8: key tiles land as fp8 bytes (plain rows of 576 bytes) in the STAGES-deep ring and are converted
//     by the whole CTA into one DTYPE tile (the layout above) after the tile's barrier, then a second barrier;
//     fp8 -> f16 by common/dtypes.cuh fp8_chunk: the hardware's cvt on sm_89+ (exact values), the byte
//     trick on sm_80 (or FP8_HW_CVT 0: e4m3 exact times 2^-8, FP8_FACTOR's 2^8 joining the scales), then to
//     bf16 through fp32 for a bf16 q (exact: e4m3 / e5m2 values, or 2^-8 times them, are bf16 values). Keys
//     past the piece are zero-filled bytes: 0 either way.
//   Scales (every cache dtype; FlashInfer's meaning, stored value x scale = real value): the key [ckv | kpe]
//   is k_scale (times k_scales[0] when given), folded into the softmax scale; the value ckv is v_scale (times
//   v_scales[0]), multiplied into the normalized rows (final or partial) at the end.
//   Output: the final rows (DTYPE) and LSE, or for a split item fp32 normalized rows and their LSE in
//   workspace rows slot * 64 + r (prefill_tile.cuh's partial-row layout with one kv head), merged by
//   cuattn_mla_merge. LSEs are computed in base 2 and written times lse_scale (1: base 2, FlashInfer's
//   MLA default; ln 2: base e); partial LSEs stay base 2.
// cuattn_mla_merge: grid (num_merge, 64), block 128: one packed row of one merge row (request, tile,
//   first slot, pieces) per CTA, a float4 of the 512 columns per thread.
// Work / merge rows of -1 pad a CUDA-graph plan's fixed grid: those CTAs return at once.
#include "common/mma.cuh"
#include "common/softmax.cuh"

#ifndef STAGES
#define STAGES 2
#endif
#ifndef KV_FP8
#define KV_FP8 0
#endif

namespace cuattn {
namespace mla {

constexpr int D_CKV = 512, D_KPE = 64, D_QK = D_CKV + D_KPE;
constexpr int BLOCK_M = 64, BLOCK_N = 32, NUM_WARPS = 8, THREADS = 32 * NUM_WARPS;
constexpr int PITCH = D_QK + 8;                 // elements per shared row (1168 bytes: +16 against conflicts)
constexpr int CHUNKS = D_QK / 8;                // 16-byte chunks per DTYPE row (64 ckv + 8 kpe)
constexpr int KV_BYTES = KV_FP8 ? 1 : 2;        // bytes per cache element
constexpr int CKV_CH = D_CKV * KV_BYTES / 16, KPE_CH = D_KPE * KV_BYTES / 16;   // 16-byte chunks of a cache row
constexpr int STG_ROW = KV_FP8 ? D_QK : PITCH * 2;   // bytes per row of the copy ring (fp8: plain rows)
constexpr float FP8_FACTOR = fp8_factor(KV_FP8);   // 256 for e4m3 by the byte trick, else 1 (dtypes.cuh)
constexpr int K_HALF = D_QK / 2;                // 288 dims of the score per warp of a pair
constexpr int V_HALF = D_CKV / 2;               // 256 value columns per warp of a pair
constexpr int S_PITCH = BLOCK_N + 8;            // floats per row of the score exchange (conflict-free float2)
constexpr int WORK_COLS = 4, MERGE_COLS = 4;    // plan.PREFILL_COLS
static_assert(STAGES >= 2, "the key ring needs two stages at least");
static_assert(THREADS % BLOCK_N == 0 && CKV_CH % (THREADS / BLOCK_N) == 0, "key tile copy layout");

constexpr int SMEM_Q = BLOCK_M * PITCH * 2;
constexpr int SMEM_K = STAGES * BLOCK_N * STG_ROW + (KV_FP8 ? BLOCK_N * PITCH * 2 : 0);   // ring (+ fp8: converted)
constexpr int SMEM_S = BLOCK_M * S_PITCH * 4;
constexpr int SMEM_BYTES = SMEM_Q + SMEM_K + SMEM_S;   // mla.py MLASpec.smem_bytes mirrors it

__device__ __forceinline__ void pair_barrier(int rg) {   // the two warps of row group rg
  asm volatile("bar.sync %0, 64;\n" ::"r"(rg + 1) : "memory");
}

}  // namespace mla
}  // namespace cuattn

using namespace cuattn;
using namespace cuattn::mla;
using T = DTYPE;
#if KV_FP8
typedef uint8_t kv_t;     // the caches' element: e4m3 or e5m2 bits
#else
typedef T kv_t;
#endif

#if KV_FP8
// -- two f16 values from fp8 (dtypes.cuh fp8_chunk) -> two T in one register, element 0 low
__device__ __forceinline__ uint32_t f16x2_as(uint32_t h, f16) { return h; }
__device__ __forceinline__ uint32_t f16x2_as(uint32_t h, bf16) {   // exact for fp8-born values
  const float2 f = unpack2<f16>(h);
  return pack2<bf16>(f.x, f.y);
}

// -- the staged fp8 tile (BLOCK_N plain rows of D_QK bytes) -> the DTYPE tile (rows of PITCH): each step
//    converts 8 values (8 bytes in, 16 bytes out), so a warp's loads and stores cover contiguous bytes
__device__ __forceinline__ void convert_tile(const uint8_t* stg, T* dst) {
#pragma unroll 3
  for (int i = int(threadIdx.x); i < BLOCK_N * CHUNKS; i += THREADS) {
    const int r = i / CHUNKS, c = i % CHUNKS;
    const uint2 x = *reinterpret_cast<const uint2*>(stg + r * D_QK + c * 8);
    const uint4 h = fp8_chunk<KV_FP8>(x.x, x.y);
    *reinterpret_cast<uint4*>(dst + r * PITCH + c * 8) =
        make_uint4(f16x2_as(h.x, T{}), f16x2_as(h.y, T{}), f16x2_as(h.z, T{}), f16x2_as(h.w, T{}));
  }
}
#endif

extern "C" __global__ void __launch_bounds__(THREADS, 1) cuattn_mla_paged(
    const int32_t* __restrict__ work,        // [num_work, 4] (request, query tile, kv piece, partial slot)
    const int32_t* __restrict__ kv_chunk,    // [1]: keys per piece (0: nothing split)
    const int32_t* __restrict__ qo_indptr,   // [batch + 1]
    const int32_t* __restrict__ kv_indptr,   // [batch + 1]: first page slot of each request
    const int32_t* __restrict__ kv_indices,  // page ids
    const int32_t* __restrict__ kv_len_arr,  // [batch]
    const T* __restrict__ q_nope,            // [nnz_qo, num_heads, 512]
    const T* __restrict__ q_pe,              // [nnz_qo, num_heads, 64]
    const kv_t* __restrict__ ckv_cache,      // [num_pages, page_size, 512]
    const kv_t* __restrict__ kpe_cache,      // [num_pages, page_size, 64]
    T* __restrict__ out,                     // [nnz_qo, num_heads, 512]
    float* __restrict__ lse,                 // [nnz_qo, num_heads] contiguous, or null
    float* __restrict__ part_o,              // [slots * 64, 512]
    float* __restrict__ part_lse,            // [slots * 64]
    int num_heads, int page_size, int causal,
    int64_t qn_s_tok, int64_t qn_s_head, int64_t qp_s_tok, int64_t qp_s_head,
    int64_t ckv_s_page, int64_t ckv_s_tok, int64_t kpe_s_page, int64_t kpe_s_tok,
    int64_t o_s_tok, int64_t o_s_head, float scale_log2, float lse_scale,
    float k_scale, float v_scale,            // times k_scales[0] / v_scales[0] when given (device scalars)
    const float* __restrict__ k_scales, const float* __restrict__ v_scales) {
  extern __shared__ __align__(128) unsigned char smem[];
  T* s_q = reinterpret_cast<T*>(smem);
  uint8_t* s_stg = smem + SMEM_Q;              // the copy ring: STAGES tiles of BLOCK_N rows of STG_ROW bytes
#if KV_FP8
  T* s_k = reinterpret_cast<T*>(smem + SMEM_Q + STAGES * BLOCK_N * STG_ROW);   // the converted tile
#else
  T* s_k = reinterpret_cast<T*>(s_stg);        // the ring is the tiles
#endif
  float* s_x = reinterpret_cast<float*>(smem + SMEM_Q + SMEM_K);   // [BLOCK_M][S_PITCH] score exchange

  const int32_t* item = work + WORK_COLS * blockIdx.x;
  const int req = item[0];
  if (req < 0) return;                 // padding of a CUDA-graph plan
  const int tile = item[1], piece = item[2];
  const int tid = int(threadIdx.x), lane = tid & 31, warp = tid >> 5;
  const int rg = warp >> 1, half = warp & 1;
  const int g = lane >> 2, t4 = lane & 3;

  const int64_t q_base = qo_indptr[req];
  const int qo_len = qo_indptr[req + 1] - int(q_base);
  const int kv_len = kv_len_arr[req];
  const int rows = qo_len * num_heads;           // packed rows of the request
  const int row0 = tile * BLOCK_M;
  const int page_base = kv_indptr[req];
  const int shift = kv_len - qo_len;             // causal: token t sees keys <= t + shift

  // -- the piece's keys [kv_lo, kv_end): causal-trimmed to the tile's last row, cut to the piece
  int kv_end = kv_len;
  if (causal) kv_end = min(kv_len, max(0, (min(rows, row0 + BLOCK_M) - 1) / num_heads + shift + 1));
  int kv_lo = 0;
  const int chunk = *kv_chunk;
  if (chunk > 0) {
    kv_lo = piece * chunk;
    kv_end = min(kv_end, kv_lo + chunk);
  }
  const int num_tiles = kv_end > kv_lo ? (kv_end - kv_lo + BLOCK_N - 1) / BLOCK_N : 0;

  // -- Q: 64 rows x 72 chunks, rows past the request zero-filled
  for (int c = tid; c < BLOCK_M * CHUNKS; c += THREADS) {
    const int r = c / CHUNKS, ch = c % CHUNKS;
    const int pr = row0 + r;
    const bool ok = pr < rows;
    const int64_t tok = q_base + (ok ? pr / num_heads : 0);
    const int head = ok ? pr % num_heads : 0;
    const T* src = ch < D_CKV / 8 ? q_nope + tok * qn_s_tok + head * qn_s_head + ch * 8
                                  : q_pe + tok * qp_s_tok + head * qp_s_head + (ch - D_CKV / 8) * 8;
    cp_async_16(smem_u32(s_q + r * PITCH + ch * 8), src, ok ? 16 : 0);
  }
  cp_async_commit();

  // -- one key tile into stage `st`: thread copies row tid / 8, ckv chunks tid % 8 + 8 i and kpe chunks
  //    tid % 8 (+ 8) below KPE_CH (16 bytes each: 8 values, fp8 16). A tile's page id is
  //    read one tile ahead (page_of), so no copy waits on a dependent load of kv_indices
  const int ld_row = tid / (THREADS / BLOCK_N), ld_sub = tid % (THREADS / BLOCK_N);
  auto page_of = [&](int kt) -> int {
    const int key = kv_lo + kt * BLOCK_N + ld_row;
    return key < kv_end ? kv_indices[page_base + key / page_size] : 0;
  };
  auto load_tile = [&](int kt, int st, int page) {
    const int key = kv_lo + kt * BLOCK_N + ld_row;
    const bool ok = key < kv_end;
    const int slot = ok ? key % page_size : 0;
    const uint8_t* ckv_row = reinterpret_cast<const uint8_t*>(ckv_cache + int64_t(page) * ckv_s_page + slot * ckv_s_tok);
    const uint8_t* kpe_row = reinterpret_cast<const uint8_t*>(kpe_cache + int64_t(page) * kpe_s_page + slot * kpe_s_tok);
    uint8_t* dst = s_stg + (st * BLOCK_N + ld_row) * STG_ROW;
#pragma unroll
    for (int i = 0; i < CKV_CH / (THREADS / BLOCK_N); ++i) {
      const int ch = ld_sub + i * (THREADS / BLOCK_N);
      cp_async_16(smem_u32(dst + ch * 16), ckv_row + ch * 16, ok ? 16 : 0);
    }
#pragma unroll
    for (int ch = ld_sub; ch < KPE_CH; ch += THREADS / BLOCK_N)
      cp_async_16(smem_u32(dst + CKV_CH * 16 + ch * 16), kpe_row + ch * 16, ok ? 16 : 0);
  };
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < num_tiles) load_tile(s, s, page_of(s));
    cp_async_commit();
  }
  int page_next = STAGES - 1 < num_tiles ? page_of(STAGES - 1) : 0;   // page id of the next tile to copy

  // -- the key scale (and the byte trick's 2^8) folded into the softmax scale
  float k_fac = k_scale * FP8_FACTOR;
  if (k_scales != nullptr) k_fac *= k_scales[0];
  const float sl2 = scale_log2 * k_fac;

  // -- per-thread row state: rows g and g + 8 of the warp's row group
  const float neg_inf = __int_as_float(0xff800000);
  float m_i[2] = {neg_inf, neg_inf}, l_i[2] = {0.f, 0.f};
  int lim[2];                                  // first key a row may not see
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int pr = row0 + rg * 16 + g + 8 * i;
    lim[i] = causal ? min(kv_end, pr / num_heads + shift + 1) : kv_end;
  }
  float acc[V_HALF / 8][4];
#pragma unroll
  for (int n = 0; n < V_HALF / 8; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;

  const uint32_t q_addr = smem_u32(s_q + (rg * 16 + (lane & 15)) * PITCH + half * K_HALF + (lane >> 4) * 8);
  // K as the mma's B (rows = keys): lanes 0-7 keys 0-7 dims +0, 8-15 keys 0-7 +8, 16-23 keys 8-15 +0, ...
  const int kb_key = (lane & 7) + ((lane >> 4) << 3), kb_col = ((lane >> 3) & 1) * 8;
  // V as the mma's B, transposed: lanes 0-7 keys 0-7 cols +0, 8-15 keys 8-15 +0, 16-23 keys 0-7 +8, ...
  const int vb_key = (lane & 7) + (((lane >> 3) & 1) << 3), vb_col = (lane >> 4) * 8;
  float* s_pair = s_x + rg * 16 * S_PITCH;     // the pair's 16 score rows
  const bool active = row0 + rg * 16 < rows;     // the same for both warps of a pair (their barriers)

  for (int kt = 0; kt < num_tiles; ++kt) {
    // -- keep STAGES - 1 tiles in flight: issue tile kt + STAGES - 1 into the stage read at kt - 1
    if (kt + STAGES - 1 < num_tiles) load_tile(kt + STAGES - 1, (kt + STAGES - 1) % STAGES, page_next);
    cp_async_commit();
    if (kt + STAGES < num_tiles) page_next = page_of(kt + STAGES);     // used one iteration later
    cp_async_wait<STAGES - 1>();
    __syncthreads();
#if KV_FP8
    convert_tile(s_stg + (kt % STAGES) * BLOCK_N * STG_ROW, s_k);   // -- fp8 bytes -> the DTYPE tile
    __syncthreads();
    const T* kst = s_k;
#else
    const T* kst = s_k + (kt % STAGES) * BLOCK_N * PITCH;
#endif

    // -- a pair whose 16 rows are all padding (decode with 16 heads: 3 of 4 pairs) only copies
    if (active) {
      // -- S half = Q[rows, half dims] K[tile, half dims]^T
      float s[BLOCK_N / 8][4];
#pragma unroll
      for (int n = 0; n < BLOCK_N / 8; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
      const uint32_t k_addr = smem_u32(kst + kb_key * PITCH + half * K_HALF + kb_col);
#pragma unroll 6
      for (int kk = 0; kk < K_HALF / 16; ++kk) {
        uint32_t a[4];
        ldmatrix_x4(a, q_addr + kk * 32);
#pragma unroll
        for (int np = 0; np < BLOCK_N / 16; ++np) {
          uint32_t b[4];
          ldmatrix_x4(b, k_addr + (np * 16 * PITCH) * 2 + kk * 32);
          mma_m16n8k16<T>(s[2 * np], a, b[0], b[1]);
          mma_m16n8k16<T>(s[2 * np + 1], a, b[2], b[3]);
        }
      }
      // -- the pair sums its halves through one shared buffer: half 0 stores its scores, half 1 adds
      //    them to its own and stores the sum, half 0 reads the sum back (both hold the same bits)
      if (half == 0) {
#pragma unroll
        for (int n = 0; n < BLOCK_N / 8; ++n) {
          *reinterpret_cast<float2*>(s_pair + g * S_PITCH + n * 8 + 2 * t4) = make_float2(s[n][0], s[n][1]);
          *reinterpret_cast<float2*>(s_pair + (g + 8) * S_PITCH + n * 8 + 2 * t4) = make_float2(s[n][2], s[n][3]);
        }
      }
      pair_barrier(rg);
      if (half == 1) {
#pragma unroll
        for (int n = 0; n < BLOCK_N / 8; ++n) {
          float2* lo = reinterpret_cast<float2*>(s_pair + g * S_PITCH + n * 8 + 2 * t4);
          float2* hi = reinterpret_cast<float2*>(s_pair + (g + 8) * S_PITCH + n * 8 + 2 * t4);
          const float2 x = *lo, y = *hi;
          s[n][0] += x.x; s[n][1] += x.y; s[n][2] += y.x; s[n][3] += y.y;
          *lo = make_float2(s[n][0], s[n][1]);
          *hi = make_float2(s[n][2], s[n][3]);
        }
      }
      pair_barrier(rg);
      const int key0 = kv_lo + kt * BLOCK_N;
#pragma unroll
      for (int n = 0; n < BLOCK_N / 8; ++n) {
        if (half == 0) {
          const float2 x = *reinterpret_cast<const float2*>(s_pair + g * S_PITCH + n * 8 + 2 * t4);
          const float2 y = *reinterpret_cast<const float2*>(s_pair + (g + 8) * S_PITCH + n * 8 + 2 * t4);
          s[n][0] = x.x; s[n][1] = x.y; s[n][2] = y.x; s[n][3] = y.y;
        }
        const int j = key0 + n * 8 + 2 * t4;      // -- masks: past the piece, and causal
        if (j >= lim[0]) s[n][0] = neg_inf;
        if (j + 1 >= lim[0]) s[n][1] = neg_inf;
        if (j >= lim[1]) s[n][2] = neg_inf;
        if (j + 1 >= lim[1]) s[n][3] = neg_inf;
      }

      // -- online softmax of rows g and g + 8; rescale the accumulator
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const float corr = online_softmax_row<BLOCK_N / 4>(
            [&](int k) { return s[k >> 1][2 * i + (k & 1)]; },
            [&](int k, float v) { s[k >> 1][2 * i + (k & 1)] = v; }, m_i[i], l_i[i], sl2);
#pragma unroll
        for (int n = 0; n < V_HALF / 8; ++n) {
          acc[n][2 * i] *= corr;
          acc[n][2 * i + 1] *= corr;
        }
      }

      // -- O[rows, half cols] += P V[tile, half cols]
      const uint32_t v_addr = smem_u32(kst + vb_key * PITCH + half * V_HALF + vb_col);
#pragma unroll
      for (int kk = 0; kk < BLOCK_N / 16; ++kk) {
        uint32_t a[4];
        a[0] = pack2<T>(s[2 * kk][0], s[2 * kk][1]);
        a[1] = pack2<T>(s[2 * kk][2], s[2 * kk][3]);
        a[2] = pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]);
        a[3] = pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
        for (int np = 0; np < V_HALF / 16; ++np) {
          uint32_t b[4];
          ldmatrix_x4_trans(b, v_addr + (kk * 16 * PITCH + np * 16) * 2);
          mma_m16n8k16<T>(acc[2 * np], a, b[0], b[1]);
          mma_m16n8k16<T>(acc[2 * np + 1], a, b[2], b[3]);
        }
      }
    }
    __syncthreads();      // the stage and the score exchange are free for the next tile
  }
  cp_async_wait<0>();     // no copy may land after the CTA exits

  // -- finish: quad-reduce l, normalize (times the value scale), store rows (or partial rows) and the LSE
  const int slot = item[3];
  float v_fac = v_scale * FP8_FACTOR;
  if (v_scales != nullptr) v_fac *= v_scales[0];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    float l = l_i[i];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    const int r = rg * 16 + g + 8 * i;
    const int pr = row0 + r;
    if (pr >= rows) continue;
    const float inv = l > 0.f ? v_fac / l : 0.f;
    const float lse2 = l > 0.f ? m_i[i] + __log2f(l) : neg_inf;
    if (slot < 0) {
      const int64_t tok = q_base + pr / num_heads;
      const int head = pr % num_heads;
      T* orow = out + tok * o_s_tok + head * o_s_head + half * V_HALF + 2 * t4;
#pragma unroll
      for (int n = 0; n < V_HALF / 8; ++n)
        *reinterpret_cast<uint32_t*>(orow + n * 8) = pack2<T>(acc[n][2 * i] * inv, acc[n][2 * i + 1] * inv);
      if (lse != nullptr && half == 0 && t4 == 0) lse[tok * num_heads + head] = lse2 * lse_scale;
    } else {
      const int64_t prow = int64_t(slot) * BLOCK_M + r;
      float* orow = part_o + prow * D_CKV + half * V_HALF + 2 * t4;
#pragma unroll
      for (int n = 0; n < V_HALF / 8; ++n)
        *reinterpret_cast<float2*>(orow + n * 8) = make_float2(acc[n][2 * i] * inv, acc[n][2 * i + 1] * inv);
      if (half == 0 && t4 == 0) part_lse[prow] = lse2;
    }
  }
}

// -- merge: with piece LSEs s_i (base 2), lse = log2(sum_i 2^s_i) and o = sum_i 2^(s_i - lse) o_i; pieces
//    with s_i = -inf add nothing, all -inf give 0 and -inf
extern "C" __global__ void __launch_bounds__(128) cuattn_mla_merge(
    const int32_t* __restrict__ merge,       // [num_merge, 4] (request, query tile, first slot, pieces)
    const int32_t* __restrict__ qo_indptr,
    const float* __restrict__ part_o, const float* __restrict__ part_lse,
    T* __restrict__ out, float* __restrict__ lse, int num_heads, int64_t o_s_tok, int64_t o_s_head,
    float lse_scale) {
  const int32_t* row_desc = merge + MERGE_COLS * blockIdx.x;
  const int req = row_desc[0];
  if (req < 0) return;     // padding of a CUDA-graph plan
  const int tile = row_desc[1], first = row_desc[2], pieces = row_desc[3];
  const int r = int(blockIdx.y);
  const int pr = tile * BLOCK_M + r;
  const int64_t q_base = qo_indptr[req];
  if (pr >= (qo_indptr[req + 1] - int(q_base)) * num_heads) return;
  const float neg_inf = __int_as_float(0xff800000);
  float m = neg_inf;
  for (int i = 0; i < pieces; ++i) m = fmaxf(m, part_lse[int64_t(first + i) * BLOCK_M + r]);
  const float m_use = m == neg_inf ? 0.f : m;
  float l = 0.f;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  const int c = int(threadIdx.x);
  for (int i = 0; i < pieces; ++i) {
    const int64_t row = int64_t(first + i) * BLOCK_M + r;
    const float w = exp2_approx(part_lse[row] - m_use);
    const float4 x = *reinterpret_cast<const float4*>(part_o + row * D_CKV + 4 * c);
    acc.x += w * x.x; acc.y += w * x.y; acc.z += w * x.z; acc.w += w * x.w;
    l += w;
  }
  const float inv = l > 0.f ? 1.f / l : 0.f;
  const int64_t tok = q_base + pr / num_heads;
  const int head = pr % num_heads;
  T* orow = out + tok * o_s_tok + head * o_s_head + 4 * c;
  reinterpret_cast<uint32_t*>(orow)[0] = pack2<T>(acc.x * inv, acc.y * inv);
  reinterpret_cast<uint32_t*>(orow)[1] = pack2<T>(acc.z * inv, acc.w * inv);
  if (lse != nullptr && c == 0) lse[tok * num_heads + head] = l > 0.f ? (m_use + __log2f(l)) * lse_scale : neg_inf;
}
