// prefill_sm90_tma_load.cuh — prefill_sm90.cu's TMA producer (PAGED 0 and 1): one thread issues the
// TMA loads of every K and V tile into the stage buffers (Smem::load_dst_*: the 16-bit tiles, or with
// KV_FP8 the fp8 staging tiles the converters read), waiting on each buffer's "free" barrier first.
// PAGED = 0: a tile is LoadTile::BLOCKS boxes at token kv_base + key; PAGED = 1: BLOCK_N / page_box boxes
// per column block, each from its own page (see the kernel's header).
#pragma once
#include "common/tma.cuh"
#include "prefill_sm90_layout.cuh"

#if PAGED != 2
#if PAGED
// -- one paged tile (keys tok ..) into buf (L: LoadK or LoadV), completing on bar: page_box keys a box, from
//    page[j] (past the end: slot 0)
template <class L>
__device__ __forceinline__ void tma_paged_boxes(uint32_t buf, const TmaDesc& map, uint32_t bar, int kvh, int tok,
                                                int kv_len, const int (&page)[MAX_BOXES], int page_size,
                                                int page_shift, int page_box) {
#pragma unroll
  for (int j = 0; j < MAX_BOXES; ++j)
    if (j * page_box < BLOCK_N) {
      const int key = tok + j * page_box;
      const int slot = key < kv_len ? (page_shift >= 0 ? key & (page_size - 1) : key % page_size) : 0;
#pragma unroll
      for (int h = 0; h < L::BLOCKS; ++h)
        tma_load_4d(buf + h * L::BLOCK_BYTES + j * page_box * L::ROW_BYTES, &map, h * L::COLS, slot, kvh, page[j],
                    bar);
    }
}
#endif

// -- tiles 0 .. num_tiles - 1 (keys kv_lo + t BLOCK_N ..) of kv head kvh; kv_base: contiguous K/V's first
//    row of the request; pages (PAGED): the request's page ids; tb: the CTA's tiles before these (tile t takes
//    stage buffer (tb + t) % LOAD_STAGES). `page` is the caller's scratch for a tile's
//    page ids: an array local to this function changed the kernel's machine code (the consumers' loop entry;
//    checked when it was split out of prefill_sm90.cu), one in the kernel leaves it as it was
__device__ __forceinline__ void tma_producer(const Smem& sm, const TmaDesc& tmap_k, const TmaDesc& tmap_v, int kvh,
                                             int kv_base, int kv_lo, int kv_len, int num_tiles, int tb,
                                             const int32_t* pages,
                                             int page_size, int page_shift, int page_box, int (&page)[MAX_BOXES]) {
  for (int t = 0; t < num_tiles; ++t) {
    const int s = (tb + t) % LOAD_STAGES;
    const uint32_t ph = ((tb + t) / LOAD_STAGES) & 1;
    const int tok = kv_base + kv_lo + t * BLOCK_N;
#if PAGED
    // -- the tile's boxes: page_box keys each, from their pages (past the end: the last page, slot 0).
    //    Every page id is loaded before the first box is issued (the loads overlap; each TMA issue
    //    is ordered after them), and K and V share them.
#pragma unroll
    for (int j = 0; j < MAX_BOXES; ++j) {
      const int k_in = min(tok + j * page_box, kv_len - 1);
      page[j] = j * page_box < BLOCK_N ? pages[page_shift >= 0 ? k_in >> page_shift : k_in / page_size] : 0;
    }
    mbar_wait(sm.load_free_k(s), ph ^ 1);
    mbar_arrive_expect_tx(sm.load_bar_k(s), LoadK::BYTES);
    tma_paged_boxes<LoadK>(sm.load_dst_k(s), tmap_k, sm.load_bar_k(s), kvh, tok, kv_len, page, page_size,
                           page_shift, page_box);
    mbar_wait(sm.load_free_v(s), ph ^ 1);
    mbar_arrive_expect_tx(sm.load_bar_v(s), LoadV::BYTES);
    tma_paged_boxes<LoadV>(sm.load_dst_v(s), tmap_v, sm.load_bar_v(s), kvh, tok, kv_len, page, page_size,
                           page_shift, page_box);
#else
    (void)pages; (void)page_size; (void)page_shift; (void)page_box;
    mbar_wait(sm.load_free_k(s), ph ^ 1);
    mbar_arrive_expect_tx(sm.load_bar_k(s), LoadK::BYTES);
#pragma unroll
    for (int h = 0; h < LoadK::BLOCKS; ++h)
      tma_load_3d(sm.load_dst_k(s) + h * LoadK::BLOCK_BYTES, &tmap_k, h * LoadK::COLS, tok, kvh, sm.load_bar_k(s));
    mbar_wait(sm.load_free_v(s), ph ^ 1);
    mbar_arrive_expect_tx(sm.load_bar_v(s), LoadV::BYTES);
#pragma unroll
    for (int h = 0; h < LoadV::BLOCKS; ++h)
      tma_load_3d(sm.load_dst_v(s) + h * LoadV::BLOCK_BYTES, &tmap_v, h * LoadV::COLS, tok, kvh, sm.load_bar_v(s));
#endif
  }
}
#endif
