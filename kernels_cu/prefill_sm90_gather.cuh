// prefill_sm90_gather.cuh — prefill_sm90.cu's gather producer (PAGED = 2: any page size; fp8: prefill_sm90_gather_fp8.cuh).
// The whole producer warpgroup copies K / V rows with cp.async, 8 threads a row (16-byte chunks q, q + 8, ..:
// a warp moves 4 rows of 128 contiguous bytes per instruction), BLOCK_N / 16 rows a thread, each row from its
// own page (row = page * page_rows + slot, page_rows = the page stride over the slot stride; byte strides
// k_s_row / k_s_head, v_*; a 16-bit row's offset is one 32 x 32 -> 64-bit multiply-add); keys past the request's
// end are zero-filled (cp.async's zero-fill predicate; their row id is 0, an address of the cache). Each thread's arrival on the "full"
// barrier (count 128) is cp.async.mbarrier.arrive.noinc: it lands with the thread's copies, so no producer
// thread waits on its own loads; consumers fence the async proxy after the wait (cp.async writes are
// generic-proxy stores, wgmma reads async-proxy). The page ids of tile t + 1 are loaded while the thread waits
// for tile t + 1's buffer. A thread's rows are unrolled (GATHER_ROWS; 56 producer registers) where the
// consumers keep enough registers.
// fp8 K/V (KV_FP8): the same page-id machinery; head_dim 128 copies the rows by cp.async into a ring of FP8_RING fp8
// tiles ahead of their conversion (2 stages), head_dim 64 through registers (loaded, converted, stored; 3 stages); the
// conversion is the hardware's cvt to f16 either way (keys past the request's end read row 0, zeroed by the
// consumers): prefill_sm90_gather_fp8.cuh.
#pragma once
#include "common/mma.cuh"
#include "common/tma.cuh"
#include "prefill_sm90_layout.cuh"
#include "prefill_sm90_gather_fp8.cuh"

#if PAGED == 2
// -- tiles 0 .. num_tiles - 1 (keys kv_lo + t BLOCK_N ..) of kv head kvh into the 16-bit K / V buffers, by
//    producer thread tid (0..127), tile t into stage (tb + t) % STAGES; on_k_tile(t) after the thread's copies of
//    tile t (a key transform's warps)
template <class OnKTile>
__device__ __forceinline__ void gather_producer(const Smem& sm, int tid, int kvh, const uint8_t* k_cache,
                                                const uint8_t* v_cache, int64_t k_s_row, int64_t k_s_head,
                                                int64_t v_s_row, int64_t v_s_head, int page_rows,
                                                const int32_t* pages, int page_size, int page_shift, int kv_lo,
                                                int kv_len, int num_tiles, int tb, OnKTile on_k_tile) {
  // Thread tid copies chunks q8, q8 + 8, .. of rows r0 + 16 i (r0 = tid / 8) of every tile; warp w's 4 x ROWS
  // rows are 4 w + a + 16 i (a < 4): lane a + 4 i looks row 4 w + a + 16 i up (its page id, loaded a tile
  // ahead) and the copying threads take its row id by shuffle, so a thread keeps one page id in registers, not ROWS
  constexpr int TPR = 8, ROW_STEP = 128 / TPR, ROWS = BLOCK_N / ROW_STEP;
  static_assert(4 * ROWS <= 32, "a warp's rows: one per lane");
  const int lane = tid % 32, q8 = tid % TPR, r0 = tid / TPR, a = lane / TPR;
#if KV_FP8
  const int my_r = Fp8Gather::lookup_row(tid);                                      // the row this lane looks up
#else
  const int my_r = (tid / 32) * 4 + lane % 4 + ROW_STEP * ((lane / 4) % ROWS);   // the row this lane looks up
#endif
  const uint8_t* kb = k_cache + kvh * k_s_head;
  const uint8_t* vb = v_cache + kvh * v_s_head;
  // row offsets as one 32 x 32 -> 64-bit multiply-add (a row stride is < 4 GiB: prefill_sm90.py checks it)
  const uint32_t ks_row = uint32_t(k_s_row), vs_row = uint32_t(v_s_row);
  int pg = 0;                            // the page of row my_r of the next tile (its load in flight)
  const auto load_page = [&](int t) {
    const int key = kv_lo + t * BLOCK_N + my_r;
    pg = key < kv_len ? __ldg(pages + (page_shift >= 0 ? key >> page_shift : key / page_size)) : 0;
  };
  // -- this thread's rows (row ids by shuffle; row i is past the end where 16 i >= rem: zero-filled, its row
  //    id 0) of a tile into buffer sb, ch 16-byte chunks a row (D_QK or D_VO / 8): chunk q8 + 8 j of row
  //    r0 + 16 i sits at dst0 + i 16 rows + j column blocks (the row's swizzle, r0 % 8, is the thread's own)
  const uint32_t dst0 = swz128(BLOCK_N, r0, q8);
  const uint8_t* kq = kb + 16 * q8;        // the thread's first byte of row 0 of K / V
  const uint8_t* vq = vb + 16 * q8;
  const auto copy_rows = [&](uint32_t sb, const uint8_t* base, uint32_t s_row, int row_id, int rem, const int ch) {
#pragma unroll GATHER_ROWS                   // (1: a rolled loop in the producer's 40 registers; > 1: 56)
    for (int i = 0; i < ROWS; ++i) {
      const uint8_t* src = base + uint64_t(uint32_t(__shfl_sync(0xffffffffu, row_id, a + 4 * i))) * s_row;
#pragma unroll
      for (int j = 0; j < ch / TPR; ++j)
        cp_async_16_zfill(sb + dst0 + i * ROW_STEP * 128 + j * HALF_BYTES, src + 128 * j, 16 * i >= rem);
    }
  };
  if (num_tiles > 0) load_page(0);
#if KV_FP8
  // -- fp8 (prefill_sm90_gather_fp8.cuh): tile t's row ids from pg (the page of row my_r, loaded half a tile or
  //    a tile ahead; rows past the end: row 0)
  const auto row_of = [&](int t) {
    const int key = kv_lo + t * BLOCK_N + my_r;
    return key < kv_len ? pg * page_rows + (page_shift >= 0 ? key & (page_size - 1) : key % page_size) : 0;
  };
  fp8_gather_tiles(sm, tid, kb, vb, ks_row, vs_row, num_tiles, tb, load_page, row_of, on_k_tile);
  (void)copy_rows;
#else
  for (int t = 0; t < num_tiles; ++t) {
    const int s = (tb + t) % STAGES;
    const uint32_t ph = ((tb + t) / STAGES) & 1;
    const int key = kv_lo + t * BLOCK_N + my_r;
    const int row_id = key < kv_len ? pg * page_rows + (page_shift >= 0 ? key & (page_size - 1) : key % page_size)
                                    : 0;   // (past the end: row 0, zero-filled)
    const int rem = kv_len - (kv_lo + t * BLOCK_N + r0);   // this thread's row i: valid while 16 i < rem
    if (t + 1 < num_tiles) load_page(t + 1);
    mbar_wait(sm.empty_k(s), ph ^ 1);
    copy_rows(sm.k + s * K_TILE_BYTES, kq, ks_row, row_id, rem, D_QK / 8);
    cp_async_mbar_arrive_noinc(sm.full_k(s));
    mbar_wait(sm.empty_v(s), ph ^ 1);
    copy_rows(sm.v + s * V_TILE_BYTES, vq, vs_row, row_id, rem, D_VO / 8);
    cp_async_mbar_arrive_noinc(sm.full_v(s));
    on_k_tile(t);                        // (warps 1..3 with a key transform: after their copies of tile t)
  }
#endif
}
#endif
