// decode.cu — launched by cuattn/decode.py (DecodeSpec).
// Compile-time: HEAD_DIM (64 | 128 | 256), Q_BF16 / KV_BF16 (0: fp16, 1: bf16), STAGES (cp.async depth),
//   NUM_WARPS (4 | 8: warps per CTA, 16 tokens each per stage), TMA (0 | 1, sm_90 only: see below).
//
// cuattn_decode_paged: one CTA = one work item (request, kv range) x one tile of up to 16 query
//   heads of one GQA group. Grid (num_kv_heads * m_tiles, num_work); block 32 * NUM_WARPS.
//   K/V rows stream through a STAGES-deep cp.async pipeline (16-byte copies, zero fill past the
//   end), 16 * NUM_WARPS tokens per stage, 16 per warp.
//   Each warp runs S = Q K^T and O += P V with mma.sync m16n8k16 (query heads are the M dimension, so K/V is read once per group) and keeps
//   its own online-softmax state; the warps merge through shared memory at the end.
//   page_shift = log2(page_size) for power-of-two pages (shift/mask addressing), else -1.
//   Output: the final row (dtype of q) and LSE, or, for a split request, an fp32 partial row and
//   partial LSE in the workspace, merged either by cuattn_decode_merge (counters == null) or by
//   the last CTA of the request to finish (counters != null: one int per (merge row, grid x),
//   zero before the launch; the merging CTA sets it back to zero, so graph replays work).
//   Page ids of WIN_TOK tokens at a time land in one of two shared-memory windows; the
//   next window is copied with the first tile of the current one, so no K/V copy waits on a
//   dependent global load of kv_indices.
// TMA = 1 (sm_90, page_size % 16 == 0, every work item's kv_start % 16 == 0): K/V arrive by TMA
//   instead: each warp owns its 16 rows of every stage and runs its own pipeline (lane 0 loads a
//   box of 16 slots x 64 dims per page, head and 64 columns, onto the warp's mbarrier of that
//   stage), so the loop has no CTA barrier and no per-thread address math. Boxes land with the
//   128-byte swizzle (conflict-free ldmatrix); a box reads whole pages, so V rows past the end
//   are zeroed before P V (P is 0 there, but the slots past last_page_len may hold non-finite
//   bits). The page ids of the warp's next 32 tiles sit one per lane in a register, loaded 32
//   tiles ahead. tmap_k / tmap_v: 4-d tensor maps (dims HEAD_DIM, page_size, num_kv_heads,
//   num_pages; box 64 x 16 x 1 x 1), encoded by decode.py.
// PDL (sm_90): launched with programmatic stream serialization, a CTA reads its work item and,
//   when ids_in_plan (kv_indices copied from the host by plan(), which no kernel writes), its first
//   page ids, sets up its barriers and prefetches the tensor maps while the previous kernel in
//   the stream finishes; q, K/V, out and the workspace are touched only after wait_prior_grids().
// cuattn_decode_merge: grid (num_merge, ceil(num_qo_heads / heads per block)), block 128.
//
// Softmax runs in base 2 (log2(e) folded into the scale); every LSE that leaves a kernel is in
// natural-log units (base e), as everywhere in cuattn.
#include "common/grid_dependency.cuh"
#include "common/mma.cuh"
#ifndef TMA
#define TMA 0
#endif
#if TMA
#include "common/tma.cuh"
#endif

namespace cuattn {

#if Q_BF16
typedef bf16 q_t;
#else
typedef f16 q_t;
#endif
#if KV_BF16
typedef bf16 kv_t;
#else
typedef f16 kv_t;
#endif

#ifndef NUM_WARPS
#define NUM_WARPS 4
#endif
constexpr int THREADS = NUM_WARPS * 32;
constexpr int WARP_N = 16;                       // tokens per warp per stage
constexpr int BLOCK_N = NUM_WARPS * WARP_N;      // tokens per stage
constexpr int M_TILE = 16;                       // query heads per CTA (mma M)
constexpr int SROW = HEAD_DIM * 2 + 16;          // smem row pitch in bytes: +16 keeps ldmatrix conflict-free
constexpr int CHUNKS = HEAD_DIM / 8;             // 16-byte chunks per row
constexpr int ROWS_PER_PASS = THREADS / CHUNKS;
constexpr int PASSES = BLOCK_N / ROWS_PER_PASS;
constexpr int Q_BYTES = M_TILE * SROW;
// A stage's K/V bytes; a row's 16-byte chunk c (of HEAD_DIM / 8) sits at
//   row * ROW_PITCH + (c / 8) * BLOCK_STRIDE + ((c % 8) ^ swizzle(row)) * 16
// from its warp's K (or V) base, the warps' bases WARP_OFFSET apart and V KV_OFFSET after K.
#if TMA
constexpr int NH = HEAD_DIM / 64;                // 64-column blocks per row: one TMA box each
constexpr int BOX_BYTES = WARP_N * 128;          // 16 rows x 128 bytes
constexpr int ROW_PITCH = 128;
constexpr int BLOCK_STRIDE = BOX_BYTES;
constexpr int KV_OFFSET = NH * BOX_BYTES;        // a warp's K boxes, then its V boxes
constexpr int WARP_OFFSET = 2 * NH * BOX_BYTES;  // bytes of one warp's stage = its TMA transaction
constexpr int STAGE_BYTES = NUM_WARPS * WARP_OFFSET;
#else
constexpr int ROW_PITCH = SROW;
constexpr int BLOCK_STRIDE = 128;                // padded rows: 64 columns = 128 bytes further
constexpr int KV_OFFSET = BLOCK_N * SROW;        // K rows then V rows
constexpr int WARP_OFFSET = WARP_N * SROW;
constexpr int STAGE_BYTES = 2 * BLOCK_N * SROW;
#endif
constexpr int WIN_TILES = 512 / BLOCK_N;         // tiles per page-id window
constexpr int WIN_TOK = WIN_TILES * BLOCK_N;     // 512 tokens
constexpr int WIN_CAP = WIN_TOK;                 // page ids per window: page_size 1 -> 512, >= 2 -> <= 257
static_assert(STAGES <= WIN_TILES + 1, "a window must be copied before its first tile is issued");
constexpr int RED_PITCH = HEAD_DIM + 8;          // floats per row of the warp merge: +8 spreads the 4 rows a
                                                 // half-warp stores over all banks (+0: 4-way conflicts)
static_assert(2 * NUM_WARPS * M_TILE * 4 + NUM_WARPS * M_TILE * RED_PITCH * 4 <= STAGES * STAGE_BYTES,
              "the warp merge reuses the pipeline buffers");
constexpr float LN2 = 0.69314718055994531f;

__device__ __forceinline__ void cp_async_4(uint32_t dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(dst), "l"(src) : "memory");
}

// byte offset of 16-byte chunk c8 (0..7) of a 64-column block's row
__device__ __forceinline__ int chunk_offset(int row, int c8) {
  return row * ROW_PITCH + ((TMA ? c8 ^ (row & 7) : c8) * 16);
}

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }
__device__ __forceinline__ float log2_approx(float x) {
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// 8 consecutive values of type From (16 bytes) -> 8 values of type To (16 bytes)
template <class From, class To>
__device__ __forceinline__ uint4 convert8(uint4 x) {
  uint4 y;
  float2 f;
  f = unpack2<From>(x.x); y.x = pack2<To>(f.x, f.y);
  f = unpack2<From>(x.y); y.y = pack2<To>(f.x, f.y);
  f = unpack2<From>(x.z); y.z = pack2<To>(f.x, f.y);
  f = unpack2<From>(x.w); y.w = pack2<To>(f.x, f.y);
  return y;
}
template <> __device__ __forceinline__ uint4 convert8<f16, f16>(uint4 x) { return x; }
template <> __device__ __forceinline__ uint4 convert8<bf16, bf16>(uint4 x) { return x; }

}  // namespace cuattn

using namespace cuattn;

// A work item: 8 int32 (32 bytes)
//   [0] request  [1] first page slot in kv_indices  [2] kv_start  [3] kv_end
//   [4] partial slot (-1: write the final output)
//   split pieces only: [5] merge row of the request  [6] its first slot  [7] its number of pieces
// A negative request marks padding (CUDA-graph grids are sized for capacity).
// out[req, head, d..d+3] = sum_s exp(lse_s - lse) * part_o[s, head, d..d+3] over the partial
// slots s0..s1 of a split request, lse = log(sum_s exp(lse_s)) (base e); lse written by d == 0.
// One pass with a running max, unrolled so several slots' loads are in flight at once (the
// merge runs after every piece, so its load latency adds straight to the kernel's time).
// Loads bypass L1 (__ldcg): the partials were written by other CTAs of the same launch.
__device__ __forceinline__ void merge_partials(const float* part_o, const float* part_lse, int s0, int s1,
                                               int req, int head, int d, int num_qo_heads, q_t* out,
                                               int64_t o_s_b, int64_t o_s_h, float* lse) {
  constexpr float LOG2E = 1.4426950408889634f;
  float m = neg_inf(), l = 0.f, o0 = 0.f, o1 = 0.f, o2 = 0.f, o3 = 0.f;   // m, l in base 2
#pragma unroll 4
  for (int s = s0; s < s1; ++s) {
    const int64_t row = int64_t(s) * num_qo_heads + head;
    const float lse_s = __ldcg(part_lse + row) * LOG2E;
    const float4 v = __ldcg(reinterpret_cast<const float4*>(part_o + row * HEAD_DIM + d));
    if (lse_s == neg_inf()) continue;            // an empty piece adds nothing
    const float m_new = fmaxf(m, lse_s);
    const float a = exp2_approx(m - m_new), c = exp2_approx(lse_s - m_new);   // a = 0 at the first
    l = l * a + c;
    o0 = o0 * a + v.x * c; o1 = o1 * a + v.y * c; o2 = o2 * a + v.z * c; o3 = o3 * a + v.w * c;
    m = m_new;
  }
  const float inv = l > 0.f ? 1.f / l : 0.f;
  uint2 packed;
  packed.x = pack2<q_t>(o0 * inv, o1 * inv);
  packed.y = pack2<q_t>(o2 * inv, o3 * inv);
  *reinterpret_cast<uint2*>(out + req * o_s_b + int64_t(head) * o_s_h + d) = packed;
  if (lse != nullptr && d == 0)
    lse[int64_t(req) * num_qo_heads + head] = l > 0.f ? (m + log2_approx(l)) * LN2 : neg_inf();
}

extern "C" __global__ void __launch_bounds__(THREADS) cuattn_decode_paged(
    // the plan's (fixed until the next plan())
    const int32_t* __restrict__ work,      // [num_work, 8]
    const int32_t* __restrict__ kv_indices,
    float* __restrict__ part_o,            // [num_slots, num_qo_heads, HEAD_DIM]
    float* __restrict__ part_lse,          // [num_slots, num_qo_heads]
    int page_size, int page_shift, int num_qo_heads, int group, int m_tiles, float scale_log2,
    int* __restrict__ counters,             // null: cuattn_decode_merge merges split requests
    int ids_in_plan,                        // 1: kv_indices may be read before wait_prior_grids()
    // the cache's
    const kv_t* __restrict__ k_cache,      // page p, slot s, head h at p*s_page + s*s_tok + h*s_head
    const kv_t* __restrict__ v_cache,
    int64_t s_page, int64_t s_tok, int64_t s_head,
#if TMA
    const __grid_constant__ TmaDesc tmap_k, const __grid_constant__ TmaDesc tmap_v,
#endif
    // the call's
    const q_t* __restrict__ q,             // [batch, num_qo_heads, HEAD_DIM] via strides
    q_t* __restrict__ out,                 // [batch, num_qo_heads, HEAD_DIM] via strides
    float* __restrict__ lse,               // [batch, num_qo_heads] or null
    int64_t q_s_b, int64_t q_s_h, int64_t o_s_b, int64_t o_s_h
    ) {
  extern __shared__ __align__(128) unsigned char smem[];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
#if TMA
  if (threadIdx.x == 0) {
    tma_prefetch_desc(&tmap_k);
    tma_prefetch_desc(&tmap_v);
  }
#endif
  const int32_t* w = work + int64_t(blockIdx.y) * 8;
  const int req = w[0];
  if (req < 0) return;
  const int page_base = w[1], kv_start = w[2], kv_end = w[3], slot = w[4];
  const int kv_head = blockIdx.x / m_tiles;
  const int head0 = kv_head * group + (blockIdx.x % m_tiles) * M_TILE;
  const int rows = min(M_TILE, group - (blockIdx.x % m_tiles) * M_TILE);

  // stages (1024-byte aligned for the TMA swizzle), query rows, then page-id windows or mbarriers
  unsigned char* kv_s = smem + (TMA ? (1024 - (smem_u32(smem) & 1023)) & 1023 : 0);
  unsigned char* q_s = kv_s + STAGES * STAGE_BYTES;
  const int n_tiles = (kv_end - kv_start + BLOCK_N - 1) / BLOCK_N;

  auto page_of = [&](int pos) { return page_shift >= 0 ? pos >> page_shift : pos / page_size; };
#if TMA
  // -- page ids: lane l holds that of the warp's tile ids_t0 + l; the next 32 load 32 tiles ahead
  auto load_ids = [&](int t0) {
    const int pos = kv_start + (t0 + lane) * BLOCK_N + warp * WARP_N;
    return pos < kv_end ? __ldg(kv_indices + page_base + page_of(pos)) : 0;
  };
  if (!ids_in_plan) wait_prior_grids();
  int ids_t0 = 0, ids_cur = load_ids(0), ids_next = load_ids(32);
  auto page_id = [&](int t) {            // every lane, t increasing
    if (t >= ids_t0 + 32) {
      ids_t0 += 32;
      ids_cur = ids_next;
      ids_next = load_ids(ids_t0 + 32);
    }
    return __shfl_sync(0xffffffffu, ids_cur, t - ids_t0);
  };
  const uint32_t bars = smem_u32(q_s + Q_BYTES);          // [NUM_WARPS][STAGES] mbarriers
  auto bar_of = [&](int stage) { return bars + (warp * STAGES + stage) * 8; };
  // -- lane 0 loads the warp's 16 K and V rows of tile `tile` into stage `stage`
  auto issue_tile = [&](int tile, int stage) {
    const int tok0 = kv_start + tile * BLOCK_N + warp * WARP_N;
    if (tile >= n_tiles || tok0 >= kv_end) return;       // warp-uniform
    const int id = page_id(tile);
    if (lane == 0) {
      const int slot_in_page = tok0 - page_of(tok0) * page_size;
      const uint32_t dst = smem_u32(kv_s + stage * STAGE_BYTES + warp * WARP_OFFSET), bar = bar_of(stage);
      mbar_arrive_expect_tx(bar, WARP_OFFSET);
#pragma unroll
      for (int h = 0; h < NH; ++h) {
        tma_load_4d(dst + h * BOX_BYTES, &tmap_k, h * 64, slot_in_page, kv_head, id, bar);
        tma_load_4d(dst + KV_OFFSET + h * BOX_BYTES, &tmap_v, h * 64, slot_in_page, kv_head, id, bar);
      }
    }
  };
  if (tid == 0) {
    for (int i = 0; i < NUM_WARPS * STAGES; ++i) mbar_init(bars + i * 8, 1);
    mbar_init_fence();
  }
  __syncthreads();
  if (ids_in_plan) wait_prior_grids();
#else
  const kv_t* k_head = k_cache + kv_head * s_head;
  const kv_t* v_head = v_cache + kv_head * s_head;
  const int c = tid % CHUNKS;
  // -- page-id windows: window wi holds the pages of tokens [kv_start + wi*WIN_TOK, +WIN_TOK)
  int* idx_s = reinterpret_cast<int*>(q_s + Q_BYTES);     // [2][WIN_CAP]
  auto copy_window = [&](int wi) {      // cp.async of window wi's page ids (no commit)
    const int t0 = kv_start + wi * WIN_TOK;
    if (t0 >= kv_end) return;
    const int p0 = page_of(t0), n = page_of(min(t0 + WIN_TOK, kv_end) - 1) - p0 + 1;
    int* dst = idx_s + (wi & 1) * WIN_CAP;
    for (int i = tid; i < n; i += THREADS) cp_async_4(smem_u32(dst + i), kv_indices + page_base + p0 + i);
  };
  // -- issue the copies of tile `tile` into stage `stage` (always commits a group); the first
  //    tile of window wi also copies window wi + 1 (read from WIN_TILES - STAGES + 1 iterations on)
  auto issue_tile = [&](int tile, int stage) {
    if (tile < n_tiles) {
      const int wi = tile / WIN_TILES;
      if (tile % WIN_TILES == 0) copy_window(wi + 1);
      const int* win = idx_s + (wi & 1) * WIN_CAP;
      const int p_base = page_of(kv_start + wi * WIN_TOK);
      unsigned char* ks = kv_s + stage * STAGE_BYTES;
      unsigned char* vs = ks + BLOCK_N * SROW;
#pragma unroll
      for (int p = 0; p < PASSES; ++p) {
        const int r = p * ROWS_PER_PASS + tid / CHUNKS;
        const int pos = kv_start + tile * BLOCK_N + r;
        const bool valid = pos < kv_end;
        int64_t off = 0;
        if (valid) {
          const int pg = page_of(pos);
          const int slot_in_page = page_shift >= 0 ? pos & (page_size - 1) : pos - pg * page_size;
          off = int64_t(win[pg - p_base]) * s_page + int64_t(slot_in_page) * s_tok + c * 8;
        }
        cp_async_16(smem_u32(ks + r * SROW + c * 16), k_head + off, valid ? 16 : 0);
        cp_async_16(smem_u32(vs + r * SROW + c * 16), v_head + off, valid ? 16 : 0);
      }
    }
    cp_async_commit();
  };

  if (!ids_in_plan) wait_prior_grids();
  copy_window(0);
  cp_async_commit();
  if (ids_in_plan) wait_prior_grids();
  cp_async_wait<0>();
  __syncthreads();
#endif
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) issue_tile(s, s);

  // -- query rows of this head tile -> smem (converted to the K/V type; rows >= `rows` zero)
  for (int i = tid; i < M_TILE * CHUNKS; i += THREADS) {
    const int r = i / CHUNKS, c = i % CHUNKS;
    uint4 val = make_uint4(0, 0, 0, 0);
    if (r < rows) {
      val = *reinterpret_cast<const uint4*>(q + req * q_s_b + int64_t(head0 + r) * q_s_h + c * 8);
      val = convert8<q_t, kv_t>(val);
    }
    *reinterpret_cast<uint4*>(q_s + r * SROW + c * 16) = val;
  }
  if (TMA) __syncthreads();   // the cp.async loop's first barrier publishes q_s otherwise

  float acc[HEAD_DIM / 8][4];
#pragma unroll
  for (int i = 0; i < HEAD_DIM / 8; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
  float m_i[2] = {neg_inf(), neg_inf()};   // rows lane/4 and lane/4 + 8, base-2 scaled units
  float l_i[2] = {0.f, 0.f};               // this thread's partial row sums

  const uint32_t q_addr = smem_u32(q_s + (lane % 16) * SROW + (lane / 16) * 16);
  // ldmatrix row offsets of k-step kk % 4 in a 64-column block (lane j = lane / 8 picks the matrix):
  // K (S = Q K^T) rows (lane % 8) + (j >> 1) * 8, chunk 2 kk + (j & 1); V (P V, transposed)
  // rows (lane % 8) + (j & 1) * 8, chunk 2 kk + (j >> 1)
  int k_off[4], v_off[4];
#pragma unroll
  for (int k4 = 0; k4 < 4; ++k4) {
    const int j = lane / 8;
    k_off[k4] = chunk_offset((lane % 8) + (j >> 1) * 8, 2 * k4 + (j & 1));
    v_off[k4] = chunk_offset((lane % 8) + (j & 1) * 8, 2 * k4 + (j >> 1));
  }

  for (int tile = 0; tile < n_tiles; ++tile) {
#if !TMA
    cp_async_wait<STAGES - 2>();
    __syncthreads();
#endif
    issue_tile(tile + STAGES - 1, (tile + STAGES - 1) % STAGES);

    unsigned char* ks = kv_s + (tile % STAGES) * STAGE_BYTES + warp * WARP_OFFSET;
    unsigned char* vs = ks + KV_OFFSET;
    const int tok0 = kv_start + tile * BLOCK_N + warp * WARP_N;
    if (tok0 >= kv_end) continue;   // this warp's rows are all past the end
#if TMA
    mbar_wait(bar_of(tile % STAGES), (tile / STAGES) & 1);
    if (kv_end - tok0 < WARP_N) {   // V rows past the end -> 0 (whole rows: the swizzle does not matter)
      const int r0 = kv_end - tok0;
      for (int i = lane; i < (WARP_N - r0) * NH * 8; i += 32) {
        const int r = r0 + i / (NH * 8), h = (i / 8) % NH;
        *reinterpret_cast<uint4*>(vs + h * BOX_BYTES + r * 128 + (i % 8) * 16) = make_uint4(0, 0, 0, 0);
      }
      __syncwarp();
    }
#endif

    // -- S = Q K^T for 16 heads x 16 tokens (two n8 tiles)
    float s[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
    {
      const uint32_t k_base = smem_u32(ks);
#pragma unroll
      for (int kk = 0; kk < HEAD_DIM / 16; ++kk) {
        uint32_t a[4], b[4];
        ldmatrix_x4(a, q_addr + kk * 32);
        ldmatrix_x4(b, k_base + (kk / 4) * BLOCK_STRIDE + k_off[kk % 4]);
        mma_m16n8k16<kv_t>(s[0], a, b[0], b[1]);
        mma_m16n8k16<kv_t>(s[1], a, b[2], b[3]);
      }
    }

    // -- scale to base 2, mask tokens past the end, online softmax update
    float mx[2] = {neg_inf(), neg_inf()};
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int tok = tok0 + nt * 8 + (lane % 4) * 2 + (i & 1);
        s[nt][i] = tok < kv_end ? s[nt][i] * scale_log2 : neg_inf();
        mx[i >> 1] = fmaxf(mx[i >> 1], s[nt][i]);
      }
    float alpha[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
      mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
      const float m_new = fmaxf(m_i[h], mx[h]);
      const float m_use = m_new == neg_inf() ? 0.f : m_new;
      alpha[h] = exp2_approx(m_i[h] - m_use);
      m_i[h] = m_new;
      mx[h] = m_use;
    }
    float rs[2] = {0.f, 0.f};
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        s[nt][i] = exp2_approx(s[nt][i] - mx[i >> 1]);
        rs[i >> 1] += s[nt][i];
      }
    l_i[0] = l_i[0] * alpha[0] + rs[0];
    l_i[1] = l_i[1] * alpha[1] + rs[1];
#pragma unroll
    for (int d = 0; d < HEAD_DIM / 8; ++d) {
      acc[d][0] *= alpha[0]; acc[d][1] *= alpha[0];
      acc[d][2] *= alpha[1]; acc[d][3] *= alpha[1];
    }

    // -- O += P V: P (C layout of two n8 tiles) is the A operand of one k16 step
    uint32_t pa[4];
    pa[0] = pack2<kv_t>(s[0][0], s[0][1]);
    pa[1] = pack2<kv_t>(s[0][2], s[0][3]);
    pa[2] = pack2<kv_t>(s[1][0], s[1][1]);
    pa[3] = pack2<kv_t>(s[1][2], s[1][3]);
    {
      const uint32_t v_base = smem_u32(vs);
#pragma unroll
      for (int dn = 0; dn < HEAD_DIM / 16; ++dn) {
        uint32_t b[4];
        ldmatrix_x4_trans(b, v_base + (dn / 4) * BLOCK_STRIDE + v_off[dn % 4]);
        mma_m16n8k16<kv_t>(acc[2 * dn], pa, b[0], b[1]);
        mma_m16n8k16<kv_t>(acc[2 * dn + 1], pa, b[2], b[3]);
      }
    }
#if TMA
    __syncwarp();   // every lane's ldmatrix of this stage is done before lane 0 refills it
#endif
  }
#if !TMA
  cp_async_wait<0>();
#endif
  allow_next_grid();    // only the epilogue is left: the next kernel may start its prologue

  // -- merge the warps' states through smem (pipeline buffers are free now)
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l_i[h] += __shfl_xor_sync(0xffffffffu, l_i[h], 1);
    l_i[h] += __shfl_xor_sync(0xffffffffu, l_i[h], 2);
  }
  __syncthreads();
  float* red_m = reinterpret_cast<float*>(kv_s);             // [NUM_WARPS][16]
  float* red_l = red_m + NUM_WARPS * M_TILE;                 // [NUM_WARPS][16]
  float* red_o = red_l + NUM_WARPS * M_TILE;                 // [NUM_WARPS][16][RED_PITCH]
  {                                                          // rows >= `rows` (past the group) are not read
    const int g = lane / 4, t = lane % 4;
    if (t == 0) {
      red_m[warp * M_TILE + g] = m_i[0];
      red_m[warp * M_TILE + g + 8] = m_i[1];
      red_l[warp * M_TILE + g] = l_i[0];
      red_l[warp * M_TILE + g + 8] = l_i[1];
    }
    float* o = red_o + (warp * M_TILE + g) * RED_PITCH + 2 * t;
    if (g < rows) {
#pragma unroll
      for (int d = 0; d < HEAD_DIM / 8; ++d) *reinterpret_cast<float2*>(o + d * 8) = make_float2(acc[d][0], acc[d][1]);
    }
    if (g + 8 < rows) {
#pragma unroll
      for (int d = 0; d < HEAD_DIM / 8; ++d)
        *reinterpret_cast<float2*>(o + 8 * RED_PITCH + d * 8) = make_float2(acc[d][2], acc[d][3]);
    }
  }
  __syncthreads();

  for (int i = tid; i < rows * (HEAD_DIM / 4); i += THREADS) {
    const int r = i / (HEAD_DIM / 4), d = (i % (HEAD_DIM / 4)) * 4;
    float m = neg_inf();
#pragma unroll
    for (int wi = 0; wi < NUM_WARPS; ++wi) m = fmaxf(m, red_m[wi * M_TILE + r]);
    const float m_use = m == neg_inf() ? 0.f : m;
    float l = 0.f, o0 = 0.f, o1 = 0.f, o2 = 0.f, o3 = 0.f;
#pragma unroll
    for (int wi = 0; wi < NUM_WARPS; ++wi) {
      const float c = exp2_approx(red_m[wi * M_TILE + r] - m_use);
      l += red_l[wi * M_TILE + r] * c;
      const float4 v = *reinterpret_cast<const float4*>(red_o + (wi * M_TILE + r) * RED_PITCH + d);
      o0 += v.x * c; o1 += v.y * c; o2 += v.z * c; o3 += v.w * c;
    }
    const float inv = l > 0.f ? 1.f / l : 0.f;
    const float row_lse = l > 0.f ? (m_use + log2_approx(l)) * LN2 : neg_inf();
    const int head = head0 + r;
    if (slot < 0) {
      uint2 packed;
      packed.x = pack2<q_t>(o0 * inv, o1 * inv);
      packed.y = pack2<q_t>(o2 * inv, o3 * inv);
      *reinterpret_cast<uint2*>(out + req * o_s_b + int64_t(head) * o_s_h + d) = packed;
      if (lse != nullptr && d == 0) lse[int64_t(req) * num_qo_heads + head] = row_lse;
    } else {
      const int64_t row = int64_t(slot) * num_qo_heads + head;
      *reinterpret_cast<float4*>(part_o + row * HEAD_DIM + d) = make_float4(o0 * inv, o1 * inv, o2 * inv, o3 * inv);
      if (d == 0) part_lse[row] = row_lse;
    }
  }

  // -- fused merge: the last piece of a split request to finish (per head tile) merges them all
  if (slot < 0 || counters == nullptr) return;
  __shared__ int is_last;
  __threadfence();                 // this thread's partial stores, visible device-wide
  __syncthreads();
  if (tid == 0) {
    int* ctr = counters + int64_t(w[5]) * gridDim.x + blockIdx.x;
    const int done = atomicAdd(ctr, 1) + 1;
    is_last = done == w[7];
    if (done == w[7]) *ctr = 0;    // every piece has counted: reset for the next launch
  }
  __syncthreads();
  if (!is_last) return;
  __threadfence();
  for (int i = tid; i < rows * (HEAD_DIM / 4); i += THREADS)
    merge_partials(part_o, part_lse, w[6], w[6] + w[7], req, head0 + i / (HEAD_DIM / 4),
                   (i % (HEAD_DIM / 4)) * 4, num_qo_heads, out, o_s_b, o_s_h, lse);
}

// Merge item: 4 int32: [0] request (-1: padding) [1] first slot [2] end slot [3] unused.
// out[req, h] = sum_s exp(lse_s - lse) * part_o[s, h], lse = log(sum_s exp(lse_s)) (base e).
extern "C" __global__ void __launch_bounds__(128) cuattn_decode_merge(
    const int32_t* __restrict__ merge, const float* __restrict__ part_o,
    const float* __restrict__ part_lse, q_t* __restrict__ out, float* __restrict__ lse,
    int64_t o_s_b, int64_t o_s_h, int num_qo_heads) {
  constexpr int TPH = HEAD_DIM / 4;          // threads per head, 4 values each
  constexpr int HPB = 128 / TPH;             // heads per block
  const int32_t* mi = merge + int64_t(blockIdx.x) * 4;
  const int req = mi[0];
  if (req < 0) return;
  const int s0 = mi[1], s1 = mi[2];
  const int head = blockIdx.y * HPB + threadIdx.x / TPH;
  const int d = (threadIdx.x % TPH) * 4;
  if (head >= num_qo_heads) return;
  merge_partials(part_o, part_lse, s0, s1, req, head, d, num_qo_heads, out, o_s_b, o_s_h, lse);
}
