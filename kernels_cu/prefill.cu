// prefill.cu — launched by cuattn/prefill.py (PrefillSpec); the portable "fa2" backend (sm_80+).
// Compile-time: HEAD_DIM (64 | 128 | 256), DTYPE (cuattn::f16 | cuattn::bf16), CAUSAL (0 | 1),
//   CUSTOM_MASK (0 | 1), PAGED (0 | 1), NUM_MMA_Q (16-row m-tiles per warp), BLOCK_N (keys per tile),
//   STAGES (K/V tiles in flight, >= 2).
// Grid (num_work, num_kv_heads); block 128 (4 warps); dynamic smem (BLOCK_M + 2 STAGES BLOCK_N) * HEAD_DIM * 2
//   (+ (2 STAGES + 1) * BLOCK_N * 4 when PAGED: the tiles' row offsets and page ids).
//
// One CTA computes BLOCK_M = 64 * NUM_MMA_Q "packed rows" of one request and one kv head: packed
// row r is query position r / group of qo head kv_head * group + r % group (GQA: the group's heads
// share every K/V tile). Each warp owns NUM_MMA_Q * 16 consecutive rows. Q is staged in smem once;
// K and V tiles of BLOCK_N keys stream through STAGES smem buffers each with cp.async: tile
// it + STAGES is requested as soon as tile it's buffer is free (K after the barrier before P.V,
// V after the barrier that starts the next iteration), two barriers per tile. Rows of 16 B
// chunks are XOR-swizzled (chunk ^ row % 8) so ldmatrix and cp.async are bank-conflict free.
// Softmax is online in base 2 (log2 e folded into the scale); the LSE written out is natural log.
//
// Work: `work` == nullptr is the single-request case (lengths from arguments, tiles in reverse so
// the longest causal tiles start first); otherwise work[2 * blockIdx.x + {0, 1}] = (request, tile)
// and lengths come from qo_indptr / kv_indptr (ragged: token offsets; paged: page CSR).
#include "common/dtypes.cuh"
#include "common/grid_dependency.cuh"
#include "common/mma.cuh"
#include "common/prefill_tile.cuh"

using namespace cuattn;
typedef DTYPE dtype_t;
#define NEG_INF __int_as_float(0xff800000)

constexpr int NUM_WARPS = 4;
constexpr int NUM_THREADS = 32 * NUM_WARPS;
constexpr int D = HEAD_DIM;
constexpr int CHUNKS = D / 8;                       // 16-byte chunks per row
constexpr int BLOCK_M = NUM_MMA_Q * 16 * NUM_WARPS;
constexpr int WARP_ROWS = NUM_MMA_Q * 16;
constexpr int ROW_STEP = NUM_THREADS / CHUNKS;      // rows covered by one pass of the block
#ifndef PAGE_CPASYNC    // paged: page ids cp.async'd STAGES iterations ahead into smem (no register held)
#define PAGE_CPASYNC 1
#endif
#ifndef QK_UNROLL   // k-steps of S = QK^T unrolled together; 2 was fastest on an H200 (hd128 128x64 tiles)
#if BLOCK_N >= 64 && ((PAGED && !PAGE_CPASYNC) || CUATTN_ARCH < 90)
#define QK_UNROLL 1     // 2 spills there (paged with a page-id register; sm_80: other scheduling)
#else
#define QK_UNROLL 2
#endif
#endif
// paged, hd128 128x64 tiles sit at 255 registers: these two choices were the spill-free ones on
// sm_90a and sm_80, full and causal (other combinations spill 8-60 bytes on one of them)
#ifndef PAGE_BASE_SMEM  // the request's page-table base reread from smem in the loop (2 registers less)
#define PAGE_BASE_SMEM 1
#endif
#ifndef PAGE_PREFETCH   // PAGE_CPASYNC=0 only: the next tile's page ids loaded an iteration ahead into a register
#define PAGE_PREFETCH 1
#endif
#ifndef PAGE_ADDR32     // paged: row address = base + int32 row offset * int32 byte stride (one IMAD.WIDE per row,
                        // no select: rows past kv_len have offset 0) instead of 64-bit multiply, shift, add, select;
                        // H100 same run: paged 8x2048 1929 -> 1777 us, 1x16k 14328 -> 13075 (paged/contiguous
                        // 1.16 -> 1.07). sm_80 keeps the 64-bit form (this one spills 8 bytes there, hd128 full)
#define PAGE_ADDR32 (CUATTN_ARCH >= 90)
#endif

static_assert(STAGES >= 2, "the pipeline needs two stages");
static_assert(NUM_THREADS % CHUNKS == 0, "a pass of the block must cover whole rows");
static_assert(BLOCK_N % 16 == 0 && BLOCK_N % ROW_STEP == 0 && BLOCK_M % ROW_STEP == 0, "tile shape");

// -- byte offset of 16-byte chunk c of row r in a swizzled [rows][D] tile
__device__ __forceinline__ uint32_t swz(int r, int c) { return uint32_t((r * CHUNKS + (c ^ (r & 7))) * 16); }

// -- per-thread source pointer of the K or V rows this thread copies: row (tid / CHUNKS), chunk
//    tid % CHUNKS, kv head kvh (and request base, contiguous case) folded in once, so a tile's
//    copy is one 64-bit multiply-add per row instead of a full index computation
struct KvRows {
  const dtype_t* base;   // contiguous: row kv_base + tid / CHUNKS of head kvh, chunk; paged: head + chunk
  int64_t s_tok;
  int s_tok_bytes;       // paged, PAGE_ADDR32: token stride in bytes (the host checks it fits in int32)
};

// -- paged K/V: the row offset of every key of a tile (in units of s_tok: page * (s_page / s_tok)
//    + slot; the host checks that s_page is a multiple of s_tok and that this fits in int32) is
//    staged in smem, STAGES int arrays of BLOCK_N, so the cp.async issue reads it from smem instead
//    of holding ROWS_PT offsets in registers across the loop. Thread tid < BLOCK_N owns key tid of
//    a tile: its page id is cp.async'd into smem STAGES iterations ahead (PAGE_CPASYNC; else loaded
//    one iteration ahead into a register, page_id), turned into an
//    offset and stored to the slot of tile t (t % STAGES) after the first barrier of iteration
//    t - STAGES (both loads of tile t - STAGES, which used that slot, were issued before it); the
//    second barrier of that iteration makes it visible to the K load, the V load follows later.
constexpr int ROWS_PT = BLOCK_N / ROW_STEP;
static_assert(!PAGED || BLOCK_N <= NUM_THREADS, "one thread per key of a tile");
// slot of key k in a tile's offset array: PAGE_ADDR32 stores the ROWS_PT keys one thread copies
// (k = row + j * ROW_STEP) next to each other, so it reads them with ROWS_PT / 4 16-byte loads
__device__ __forceinline__ int off_slot(int k) {
#if PAGE_ADDR32
  return (k % ROW_STEP) * ROWS_PT + k / ROW_STEP;
#else
  return k;
#endif
}
static_assert(!(PAGED && PAGE_ADDR32) || ROWS_PT % 4 == 0, "offsets are read 4 at a time");

// page id of key pos (>= 0), or -1 past kv_len (page_shift >= 0: page_size = 1 << shift)
__device__ __forceinline__ int page_of(int pos, int kv_len, const int32_t* __restrict__ pages, int page_size,
                                       int page_shift) {
  if (pos >= kv_len) return -1;
  return __ldg(pages + (page_shift >= 0 ? pos >> page_shift : pos / page_size));
}
// 4-byte cp.async (zero-filled when src_bytes == 0): page ids into smem
__device__ __forceinline__ void cp_async_4(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
// cp.async the page id of key pos (of this thread) into dst; nothing useful past kv_len
__device__ __forceinline__ void page_id_async(uint32_t dst, int pos, int kv_len, const int32_t* __restrict__ pages,
                                              int page_size, int page_shift) {
  const bool ok = pos < kv_len;
  const int32_t* src = pages + (ok ? (page_shift >= 0 ? pos >> page_shift : pos / page_size) : 0);
  cp_async_4(dst, src, ok ? 4 : 0);
}
__device__ __forceinline__ int row_offset(int page_id, int pos, int page_size, int page_shift, int page_rows) {
  if (page_id < 0) return 0;
  const int slot = page_shift >= 0 ? pos & (page_size - 1) : pos % page_size;
  return page_id * page_rows + slot;
}

// -- cp.async a BLOCK_N x D tile of keys [kv0, kv0 + BLOCK_N) into smem (dst = this thread's first
//    chunk in the stage buffer); rows past kv_len are zeros. rows_left = kv_len - kv0 - tid / CHUNKS.
//    offs: the tile's smem row offsets (PAGED).
__device__ __forceinline__ void load_kv_tile(uint32_t dst, const KvRows& t, int kv0, int rows_left,
                                             const int* offs) {
#if !PAGED
  const dtype_t* tile_src = t.base + int64_t(kv0) * t.s_tok;
#endif
#if PAGED && PAGE_ADDR32
  // this thread's ROWS_PT row offsets, 4 per 16-byte load, each load just before its 4 copies
  int off[4];
#define LOAD_OFFS(j)                                                                                  \
  if ((j) % 4 == 0) {                                                                                 \
    const int4 o4 = *reinterpret_cast<const int4*>(offs + (int(threadIdx.x) / CHUNKS) * ROWS_PT + (j)); \
    off[0] = o4.x; off[1] = o4.y; off[2] = o4.z; off[3] = o4.w;                                        \
  }
#else
#define LOAD_OFFS(j)
#endif
#pragma unroll
  for (int j = 0; j < ROWS_PT; ++j) {
    LOAD_OFFS(j)
    const bool ok = j * ROW_STEP < rows_left;
    // row r = tid / CHUNKS + j * ROW_STEP: the swizzle depends on r % 8 alone
    const int r = int(threadIdx.x) / CHUNKS + j * ROW_STEP;
#if PAGED && PAGE_ADDR32
    // rows past kv_len have offset 0 (row_offset), so src is always a valid address
    const void* src = reinterpret_cast<const char*>(t.base) + int64_t(off[j % 4]) * t.s_tok_bytes;
    cp_async_16(dst + swz(r, int(threadIdx.x) % CHUNKS), src, ok ? 16 : 0);
#else
#if PAGED
    const dtype_t* src = t.base + int64_t(offs[r]) * t.s_tok;
#else
    const dtype_t* src = tile_src + int64_t(j * ROW_STEP) * t.s_tok;
#endif
    cp_async_16(dst + swz(r, int(threadIdx.x) % CHUNKS), ok ? src : t.base, ok ? 16 : 0);
#endif
  }
#undef LOAD_OFFS
}

extern "C" __global__ void __launch_bounds__(NUM_THREADS, 2) cuattn_prefill(
    const dtype_t* __restrict__ q,           // [nnz_qo, num_qo_heads, D] (strides q_s_tok, q_s_head)
    const dtype_t* __restrict__ k,           // contiguous: token t at t * s_tok; paged: page, slot, head
    const dtype_t* __restrict__ v,
    dtype_t* __restrict__ o,                 // [nnz_qo, num_qo_heads, D] (strides o_s_tok, o_s_head)
    float* __restrict__ lse,                 // [nnz_qo, num_qo_heads] or nullptr
    const int32_t* __restrict__ qo_indptr,   // [batch + 1] (batch mode)
    const int32_t* __restrict__ kv_indptr,   // [batch + 1]: token offsets, or page offsets when PAGED
    const int32_t* __restrict__ kv_indices,  // [nnz_pages] (PAGED)
    const int32_t* __restrict__ kv_last_page_len,  // [batch] (PAGED)
    const uint8_t* __restrict__ mask,        // bit-packed, little bit order (CUSTOM_MASK)
    const int32_t* __restrict__ mask_indptr, // [batch + 1] byte offsets into mask (batch mode)
    const int32_t* __restrict__ work,        // [num_work, 2] (request, tile), or nullptr: single
    int single_qo_len, int single_kv_len, int group, int page_size, int page_shift, int page_rows,
    int64_t q_s_tok, int64_t q_s_head, int64_t k_s_tok, int64_t k_s_head, int64_t k_s_page,
    int64_t v_s_tok, int64_t v_s_head, int64_t v_s_page, int64_t o_s_tok, int64_t o_s_head,
    float scale_log2) {
  extern __shared__ __align__(128) uint8_t smem[];
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int kvh = blockIdx.y;
  const int num_qo_heads = gridDim.y * group;
  wait_prior_grids();   // PDL: every input may come from the previous kernel in the stream

  // -- which request and tile; lengths and offsets of the request
  int req = 0, tile;
  int64_t q_base = 0, kv_base = 0;
  int qo_len = single_qo_len, kv_len = single_kv_len;
  const int32_t* pages = kv_indices;
  query_tile(work, qo_indptr, req, tile, q_base, qo_len);
  if (work != nullptr) {
#if PAGED
    const int p0 = kv_indptr[req], np = kv_indptr[req + 1] - p0;
    pages = kv_indices + p0;
    kv_len = np > 0 ? (np - 1) * page_size + kv_last_page_len[req] : 0;
#else
    kv_base = kv_indptr[req];
    kv_len = kv_indptr[req + 1] - kv_indptr[req];
#endif
  }
#if CUSTOM_MASK
  const int64_t mask_bit0 = work == nullptr ? 0 : int64_t(mask_indptr[req]) * 8;
#endif
  const int row0 = tile * BLOCK_M;
  const int packed_rows = qo_len * group;
  const int causal_shift = kv_len - qo_len;   // bottom-right alignment: key j <= i + shift

  const uint32_t sQ = smem_u32(smem);
  constexpr uint32_t TILE_BYTES = BLOCK_N * D * 2;
  const uint32_t sK = sQ + BLOCK_M * D * 2;           // STAGES K tiles, then STAGES V tiles
  const uint32_t sV = sK + STAGES * TILE_BYTES;
  const int thr_row = tid / CHUNKS, thr_chunk = tid % CHUNKS;
  const int row_lim = kv_len - thr_row;               // rows_left of a tile = row_lim - kv0
#if PAGED
  const KvRows kt{k + kvh * k_s_head + thr_chunk * 8, k_s_tok, int(k_s_tok) * int(sizeof(dtype_t))},
      vt{v + kvh * v_s_head + thr_chunk * 8, v_s_tok, int(v_s_tok) * int(sizeof(dtype_t))};
  (void)k_s_page; (void)v_s_page;
#else
  const KvRows kt{k + (kv_base + thr_row) * k_s_tok + kvh * k_s_head + thr_chunk * 8, k_s_tok, 0},
      vt{v + (kv_base + thr_row) * v_s_tok + kvh * v_s_head + thr_chunk * 8, v_s_tok, 0};
#endif

  // -- stage the Q tile (rows past the request are zeros)
  {
    const int c = tid % CHUNKS;
#pragma unroll
    for (int r = tid / CHUNKS; r < BLOCK_M; r += ROW_STEP) {
      const int pr = row0 + r;
      const bool ok = pr < packed_rows;
      const dtype_t* src = ok ? q + (q_base + pr / group) * q_s_tok + (kvh * group + pr % group) * q_s_head + c * 8 : q;
      cp_async_16(sQ + swz(r, c), src, ok ? 16 : 0);
    }
  }

  // -- key range this tile needs; tiles from mask_from on need element masks
  int kv_end = kv_len;
  int mask_from = kv_len;
  if (CAUSAL) {
    const int max_q = min(qo_len - 1, (row0 + BLOCK_M - 1) / group);
    kv_end = min(kv_len, max_q + causal_shift + 1);
    mask_from = min(kv_len, row0 / group + causal_shift + 1);
  }
  const int num_tiles = kv_end > 0 ? (kv_end + BLOCK_N - 1) / BLOCK_N : 0;

  // -- paged: row offsets of tiles 0 .. STAGES-1 into their smem slots, the page id of tile STAGES
  //    into page_id (one lookup serves K and V)
#if PAGED
  int* const s_off = reinterpret_cast<int*>(smem + BLOCK_M * D * 2 + 2 * STAGES * TILE_BYTES);
  int page_id = -1;
  (void)page_id;
#if PAGE_CPASYNC
  // page ids: STAGES + 1 int arrays of BLOCK_N after the offsets; thread tid < BLOCK_N reads and
  // writes only its own entries, so its cp.async.wait_group alone orders them (no barrier)
  const uint32_t s_pid = smem_u32(s_off + STAGES * BLOCK_N);
#endif
  __shared__ int s_page0;     // the request's first page-table entry, reread after each barrier
  if (tid == 0) s_page0 = int(pages - kv_indices);
  if (tid < BLOCK_N) {
#pragma unroll
    for (int st = 0; st < STAGES; ++st) {
      const int pos = st * BLOCK_N + tid;
      s_off[st * BLOCK_N + off_slot(tid)] = row_offset(page_of(pos, kv_len, pages, page_size, page_shift), pos, page_size,
                                             page_shift, page_rows);
    }
#if PAGE_CPASYNC   // page ids of tiles STAGES .. 2 STAGES - 1 (group 0: complete before iteration 0)
#pragma unroll
    for (int st = STAGES; st < 2 * STAGES; ++st)
      page_id_async(s_pid + ((st % (STAGES + 1)) * BLOCK_N + tid) * 4, st * BLOCK_N + tid, kv_len, pages,
                    page_size, page_shift);
#elif PAGE_PREFETCH
    page_id = page_of(STAGES * BLOCK_N + tid, kv_len, pages, page_size, page_shift);
#endif
  }
  __syncthreads();
#define TILE_OFFS(t) (s_off + ((t) % STAGES) * BLOCK_N)
#else
#define TILE_OFFS(t) nullptr
#endif

  // -- prologue: groups (Q + K0), V0, K1, V1, ..., V[STAGES-1]; every later group is one tile
#pragma unroll
  for (int st = 0; st < STAGES; ++st) {
    if (st < num_tiles) load_kv_tile(sK + st * TILE_BYTES, kt, st * BLOCK_N, row_lim - st * BLOCK_N, TILE_OFFS(st));
    cp_async_commit();
    if (st < num_tiles) load_kv_tile(sV + st * TILE_BYTES, vt, st * BLOCK_N, row_lim - st * BLOCK_N, TILE_OFFS(st));
    cp_async_commit();
  }

  // -- per-thread rows: m-tile i, half h -> local row warp * WARP_ROWS + 16 i + lane / 4 + 8 h
  const int g = lane / 4, t4 = lane % 4;
  float acc[NUM_MMA_Q][D / 8][4];
  float m_i[NUM_MMA_Q][2], l_i[NUM_MMA_Q][2];
#pragma unroll
  for (int i = 0; i < NUM_MMA_Q; ++i) {
#pragma unroll
    for (int h = 0; h < 2; ++h) { m_i[i][h] = NEG_INF; l_i[i][h] = 0.f; }
#pragma unroll
    for (int n = 0; n < D / 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][n][e] = 0.f;
  }

  for (int it = 0; it < num_tiles; ++it) {
    const int kv0 = it * BLOCK_N;
    const int stage = it % STAGES;
    const uint32_t sKs = sK + stage * TILE_BYTES, sVs = sV + stage * TILE_BYTES;
    cp_async_wait<2 * STAGES - 2>();
    __syncthreads();                            // K[it] (and Q) visible; every warp done with P.V of it-1
    if (it > 0) {                               // -- V[it-1+STAGES] into the V buffer P.V of it-1 used
      const int nt = it - 1 + STAGES, ps = (it - 1) % STAGES;
      if (nt < num_tiles) load_kv_tile(sV + ps * TILE_BYTES, vt, nt * BLOCK_N, row_lim - nt * BLOCK_N, TILE_OFFS(nt));
      cp_async_commit();
    }
#if PAGED
    if (tid < BLOCK_N && it + STAGES < num_tiles) {   // -- offsets of tile it + STAGES into slot it % STAGES
      const int pos = (it + STAGES) * BLOCK_N + tid;
#if PAGE_BASE_SMEM
      const int32_t* pages = kv_indices + s_page0;
#endif
#if PAGE_CPASYNC
      // ids of tile it + STAGES were issued in the K group of iteration it - STAGES (or group 0),
      // which the wait above has completed; then those of tile it + 2 STAGES, into the slot of
      // tile it + STAGES - 1 (read by this thread last iteration)
      const int pid = s_off[(STAGES + (it + STAGES) % (STAGES + 1)) * BLOCK_N + tid];
      s_off[stage * BLOCK_N + off_slot(tid)] = row_offset(pos < kv_len ? pid : -1, pos, page_size, page_shift, page_rows);
      if (it + 2 * STAGES < num_tiles)
        page_id_async(s_pid + (((it + 2 * STAGES) % (STAGES + 1)) * BLOCK_N + tid) * 4, pos + STAGES * BLOCK_N,
                      kv_len, pages, page_size, page_shift);
#elif PAGE_PREFETCH
      s_off[stage * BLOCK_N + off_slot(tid)] = row_offset(page_id, pos, page_size, page_shift, page_rows);
      page_id = page_of(pos + BLOCK_N, kv_len, pages, page_size, page_shift);
#else
      s_off[stage * BLOCK_N + off_slot(tid)] = row_offset(page_of(pos, kv_len, pages, page_size, page_shift), pos, page_size,
                                                page_shift, page_rows);
#endif
    }
#endif

    // -- S = Q K^T
    float s[NUM_MMA_Q][BLOCK_N / 8][4];
#pragma unroll
    for (int i = 0; i < NUM_MMA_Q; ++i)
#pragma unroll
      for (int n = 0; n < BLOCK_N / 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[i][n][e] = 0.f;
#pragma unroll QK_UNROLL
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t a[NUM_MMA_Q][4];
#pragma unroll
      for (int i = 0; i < NUM_MMA_Q; ++i)
        ldmatrix_x4(a[i], sQ + swz(warp * WARP_ROWS + i * 16 + lane % 16, kk * 2 + lane / 16));
#pragma unroll
      for (int nn = 0; nn < BLOCK_N / 16; ++nn) {
        uint32_t b[4];
        ldmatrix_x4(b, sKs + swz(nn * 16 + lane % 8 + (lane / 16) * 8, kk * 2 + (lane / 8) % 2));
#pragma unroll
        for (int i = 0; i < NUM_MMA_Q; ++i) {
          mma_m16n8k16<dtype_t>(s[i][2 * nn], a[i], b[0], b[1]);
          mma_m16n8k16<dtype_t>(s[i][2 * nn + 1], a[i], b[2], b[3]);
        }
      }
    }

    // -- masks: only on boundary / diagonal tiles (every tile with a custom mask)
    if (CUSTOM_MASK || kv0 + BLOCK_N > mask_from) {
#pragma unroll
      for (int i = 0; i < NUM_MMA_Q; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int pr = row0 + warp * WARP_ROWS + i * 16 + g + 8 * h;
          const int qpos = pr / group;
          const bool row_ok = qpos < qo_len;
#pragma unroll
          for (int n = 0; n < BLOCK_N / 8; ++n)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const int kpos = kv0 + n * 8 + 2 * t4 + e;
              bool keep = kpos < kv_len;
              if (CAUSAL) keep = keep && kpos <= qpos + causal_shift;
#if CUSTOM_MASK
              if (keep && row_ok) {
                const int64_t bit = mask_bit0 + int64_t(qpos) * kv_len + kpos;
                keep = (__ldg(mask + (bit >> 3)) >> (bit & 7)) & 1;
              }
#endif
              (void)row_ok;
              if (!keep) s[i][n][2 * h + e] = NEG_INF;
            }
        }
    }

    // -- online softmax (base 2): m_new = max(m, rowmax * scale); rescale acc and l
    float corr[NUM_MMA_Q][2];
    bool changed = false;
#pragma unroll
    for (int i = 0; i < NUM_MMA_Q; ++i)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float mx = NEG_INF;
#pragma unroll
        for (int n = 0; n < BLOCK_N / 8; ++n) mx = fmaxf(mx, fmaxf(s[i][n][2 * h], s[i][n][2 * h + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float m_new = fmaxf(m_i[i][h], mx * scale_log2);
        const float m_use = m_new == NEG_INF ? 0.f : m_new;   // fully masked so far: no NaN
        corr[i][h] = exp2_approx(m_i[i][h] - m_use);
        changed |= corr[i][h] != 1.f;
        m_i[i][h] = m_new;
        float sum = 0.f;
#pragma unroll
        for (int n = 0; n < BLOCK_N / 8; ++n)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float p = exp2_approx(fmaf(s[i][n][2 * h + e], scale_log2, -m_use));
            s[i][n][2 * h + e] = p;
            sum += p;
          }
        l_i[i][h] = l_i[i][h] * corr[i][h] + sum;   // per-thread partial; quad-reduced at the end
      }
    if (__any_sync(0xffffffffu, changed)) {     // -- rescale only when some row max moved (warp-uniform)
#pragma unroll
      for (int i = 0; i < NUM_MMA_Q; ++i)
#pragma unroll
        for (int n = 0; n < D / 8; ++n) {
          acc[i][n][0] *= corr[i][0];
          acc[i][n][1] *= corr[i][0];
          acc[i][n][2] *= corr[i][1];
          acc[i][n][3] *= corr[i][1];
        }
    }

    cp_async_wait<2 * STAGES - 2>();
    __syncthreads();                            // V[it] visible; every warp done reading K[it]
    if (it + STAGES < num_tiles)                // -- K[it+STAGES] into the K buffer just used
      load_kv_tile(sKs, kt, (it + STAGES) * BLOCK_N, row_lim - (it + STAGES) * BLOCK_N, TILE_OFFS(it + STAGES));
    cp_async_commit();

    // -- O += P V (P from the S accumulators, repacked as A fragments)
#pragma unroll
    for (int kk = 0; kk < BLOCK_N / 16; ++kk) {
      uint32_t a[NUM_MMA_Q][4];
#pragma unroll
      for (int i = 0; i < NUM_MMA_Q; ++i) {
        a[i][0] = pack2<dtype_t>(s[i][2 * kk][0], s[i][2 * kk][1]);
        a[i][1] = pack2<dtype_t>(s[i][2 * kk][2], s[i][2 * kk][3]);
        a[i][2] = pack2<dtype_t>(s[i][2 * kk + 1][0], s[i][2 * kk + 1][1]);
        a[i][3] = pack2<dtype_t>(s[i][2 * kk + 1][2], s[i][2 * kk + 1][3]);
      }
#pragma unroll
      for (int dd = 0; dd < D / 16; ++dd) {
        uint32_t b[4];
        ldmatrix_x4_trans(b, sVs + swz(kk * 16 + lane % 8 + ((lane / 8) % 2) * 8, dd * 2 + lane / 16));
#pragma unroll
        for (int i = 0; i < NUM_MMA_Q; ++i) {
          mma_m16n8k16<dtype_t>(acc[i][2 * dd], a[i], b[0], b[1]);
          mma_m16n8k16<dtype_t>(acc[i][2 * dd + 1], a[i], b[2], b[3]);
        }
      }
    }
  }
  cp_async_wait<0>();
  allow_next_grid();    // only the epilogue is left: the next kernel may start its prologue

  // -- epilogue: O / l, natural-log LSE; fully masked rows give 0 and -inf
#pragma unroll
  for (int i = 0; i < NUM_MMA_Q; ++i)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float l = l_i[i][h];
      l += __shfl_xor_sync(0xffffffffu, l, 1);
      l += __shfl_xor_sync(0xffffffffu, l, 2);
      const int pr = row0 + warp * WARP_ROWS + i * 16 + g + 8 * h;
      if (pr >= packed_rows) continue;
      store_output_row<D>(o, o_s_tok, o_s_head, lse, num_qo_heads, q_base + pr / group, kvh * group + pr % group,
                          t4, l, m_i[i][h],
                          [&](int n) { return make_float2(acc[i][n][2 * h], acc[i][n][2 * h + 1]); });
    }
}
