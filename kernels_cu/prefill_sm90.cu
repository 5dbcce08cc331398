// prefill_sm90.cu — launched by cuattn/prefill_sm90.py (Sm90PrefillSpec); the Hopper "fa3" backend
// Parameters: mirrored by prefill_sm90.py PARAMS (by name; tests/test_params.py checks the two agree).
// (sm_90a only: wgmma, TMA, setmaxnreg).
// Compile-time: HEAD_DIM_QK (q and K columns: 64 | 128 | 256 | 192), HEAD_DIM_VO (V and out columns: 64 |
//   128 | 256; 192 pairs with 128), DTYPE (cuattn::f16 | cuattn::bf16), CAUSAL (0 | 1), BLOCK_N (keys per
//   tile: 128, 64 for head_dim 256), STAGES (K/V tiles in flight, >= 2), PAGED (0 | 1), KV_FP8 (0: K/V of
//   DTYPE, 1: e4m3, 2: e5m2; head dims 64 and 128 only), SPEC_SMEM_BYTES (the launcher's smem).
// Grid (num_work, num_kv_heads), or PERSISTENT (prefill_sm90.py persists: 16-bit K/V or the fp8 gather, head_dim_qk <= 128) at most one
//   CTA per SM taking the num_work x num_kv_heads items in turns (for_each_item_of): its K/V stages and barrier phases
//   run on across items (tile t of an item is the CTA's tile tb + t), so the producer loads the next item's first tiles
//   while the consumers finish one; the producer's thread 0 takes the next item from a global counter as its CTA frees
//   up (PERSIST_DYNAMIC; the plan's `sched`) and hands it to the other producer threads and the consumers through shared
//   memory (publish_item / read_item); the consumers stage the next item's Q before an item's epilogue. H100:
//   0.88-0.95x the one-CTA-an-item grid's time at 8 x 2048, 0.95-0.99x at 1 x 4096 (prefill_sm90_notes.md, session 18).
// Block 384 (3 warpgroups; NUM_CONSUMERS 1, the 64-row tiles: 256, two CTAs per SM); dynamic smem SMEM_BYTES (below): 1024
//   (alignment) + BLOCK_M * HEAD_DIM_QK * 2 + STAGES * BLOCK_N * (HEAD_DIM_QK + HEAD_DIM_VO) * 2 + 32 STAGES
//   (mbarriers) (+ STAGES BLOCK_N (HEAD_DIM_QK + HEAD_DIM_VO) + 32 STAGES with KV_FP8: the fp8 staging
//   tiles and their mbarriers; + 8 STAGES with a key transform: READY_K; PERSISTENT: + 2 item slots of 64 bytes and 4
//   mbarriers), checked against SPEC_SMEM_BYTES.
//
// One CTA computes BLOCK_M = 128 "packed rows" of one request and one kv head, as prefill.cu does:
// packed row r is query position r / group of qo head kv_head * group + r % group.
// Warp specialisation: warpgroup 0 is the producer (one thread issues TMA loads of K and V tiles,
// BLOCK_N x 64 boxes with the 128-byte swizzle, D_QK / 64 per K tile and D_VO / 64 per V tile, into
// STAGES smem buffers each, completing on "full" mbarriers; it waits on "empty" mbarriers before
// reusing a buffer); warpgroups 1 and 2 are consumers, 64 query rows each. A consumer stages its Q
// rows with cp.async (once), then per K/V tile: S = Q K^T by wgmma m64n{BLOCK_N}k16 over D_QK / 16
// k-steps (A and B from smem), mask, online softmax in registers (base 2, log2 e folded into the
// scale), P converted to 16-bit in registers as the A operand of O += P V (wgmma m64n{D_VO}k16, V
// from smem read N-major through the descriptor). setmaxnreg moves registers from the producer (40; 56
// or 88 with an unrolled gather or key transforms: PRODUCER_REGS) to the consumers (232 / 224 / 208): S
// takes BLOCK_N / 2 floats per thread and O D_VO / 2 (hence BLOCK_N 64 at D_VO 256).
// Overlap: a consumer issues S(t) = Q K(t)^T and O += P(t-1) V(t-1) back to back, then runs the
// softmax of S(t) while the P.V product is still in flight (FlashAttention-3's intra-warpgroup
// pipelining); O is rescaled once that product has landed. (+4-16% over the plain loop, which was
// removed after that measurement: benchmarks/results/prefill_sm90_notes.md.) PINGPONG (default): the two
// consumers take turns issuing those products (named barriers 4 / 5, FlashAttention-3's inter-warpgroup
// schedule), so one's softmax runs while the tensor cores work on the other's (H100: 0.95-1.0x the time
// plain, 0.83x with ALiBi, 0.94x with a soft-cap).
//
// Work: `work` == nullptr is the single-request case (lengths from arguments, tiles in reverse so
// the longest causal tiles start first); otherwise work[WORK_COLS * blockIdx.x + {0..3}] = (request,
// tile, kv piece, partial slot) as in prefill.cu (split-KV pieces, cuattn_prefill_sm90_merge)
// and lengths come from qo_indptr / kv_indptr (ragged: token offsets). K / V rows are addressed
// through the tensor maps (dims: K's or V's head dim, tokens, kv heads): keys past a request's kv_len
// are masked in S and their V rows zeroed before the last P.V (they are the next request's in a ragged batch:
// 0 x NaN would be NaN; the TMA zero-fills rows past the tensor's end).
// PAGED = 1: K / V are a paged cache (page CSR kv_indptr / kv_indices / kv_last_page_len) and the
// tensor maps have dims (head dim, page_size, kv heads, pages), box (64, page_box, 1, 1), page_box =
// min(page_size, BLOCK_N) dividing both: a tile is BLOCK_N / page_box boxes, each from its own page,
// landing page_box rows apart (multiples of 1024 bytes, so the 128-byte swizzle is the contiguous
// tile's). Rows past the request's end (the last page's free slots, boxes past the last page) hold
// whatever the cache holds: masked in S, and zeroed in V before the last P.V (0 x NaN would be NaN).
// PAGED = 2 (the gather producer, any page size, 16-bit K/V): the whole producer warpgroup copies K / V rows
// with cp.async, each row from its own page; keys past the request's end are zero-filled
// (prefill_sm90_gather.cuh). Consumers fence the async proxy after each "full" wait (cp.async writes are
// generic-proxy stores, wgmma reads async-proxy).
// Attention variants (common/variant.cuh, generated by cuattn/variants.py): logits transform and
// masks in mask_tile, a sliding window's leading tiles skipped (kv_lo, producer and consumers
// alike), the sink at the store. Query / key transforms (the fused RoPE, a variant's query_transform /
// key_transform) rewrite the swizzled tiles in smem (variant.cuh's helpers, through swz128): a
// consumer warpgroup its own 64 Q rows once, after staging; producer warps 1..3 (XFORM_THREADS) each K
// tile once, after its TMA lands (FULL_K) and before the consumers' S wgmma reads it: they fence their
// generic-proxy stores (fence.proxy.async) and arrive on READY_K, which the consumers wait on instead
// of FULL_K. Off the consumers' critical path (the producer warps are otherwise idle, and run up to
// STAGES tiles ahead); they take issue slots from the consumers' softmax (RoPE, hd128: ~1.3k
// instructions per transform warp a tile, against ~2k cycles of wgmma per tile; not measured). The
// alternative, the consumers splitting the tile at a 256-thread barrier, would put the same work on
// the critical path and lock the two warpgroups together every tile. Such specs move registers
// from the consumers to the producer warpgroup (PRODUCER_REGS).
// Scales (every KV dtype; prefill.cu's meaning: stored value x scale = real value): k = k_scale *
// (k_scales ? k_scales[kv head or 0] : 1), likewise v (a CTA has one kv head: scalars here). The key
// factor joins the softmax scale (or, before a logits transform, the transform's logit_scale with
// sm_scale), the value factor each output row at the store (partial rows too: the merge is linear).
// KV_FP8: paged (PAGED = 2), the gather producer loads fp8 rows into registers, converts them (the hardware's
// cvt) and stores the 16-bit swizzled tiles (prefill_sm90_gather.cuh); contiguous, the TMA loads fp8 K / V tiles
// into fp8 staging buffers and warps 1..3 of the producer warpgroup convert each into the 16-bit tile and arrive
// on its "full" mbarrier (prefill_sm90_fp8.cuh). Either way S and P.V are the 16-bit path's. The tensor cores run f16: a bf16 q is converted to f16 in
// smem once, as prefill.cu does.
#include "common/dtypes.cuh"
#include "common/grid_dependency.cuh"
#include "common/mma.cuh"
#include "common/prefill_tile.cuh"
#include "common/softmax.cuh"
#include "common/variant.cuh"
#include "common/tma.cuh"
#include "common/wgmma.cuh"
// the kernel's own pieces (they read its -D defines): geometry and smem map, the TMA producer, the gather
// producer (PAGED = 2), the fp8 converters (KV_FP8); the consumers and the key transform are below
#include "prefill_sm90_layout.cuh"
#include "prefill_sm90_tma_load.cuh"
#include "prefill_sm90_gather.cuh"
#include "prefill_sm90_fp8.cuh"

// -- a work item of one kv head: its request and query tile, the request's lengths and offsets, the keys its tiles cover
struct Item {
  int w, kvh, req, tile, qo_len, kv_len, kv_base, kv_lo, kv_end, num_tiles;
  int64_t q_base;
  const int32_t* pages;
};
// -- f(item) for each of the CTA's items, in order (load(it, w, kvh) false: a padding item, skipped). PERSISTENT: the
//    CTAs take one item a round in turns that reverse every round (CTA b takes round r's item b, or gridDim.x - 1 - b
//    when r is odd: a long item early goes with a short one late, as in a greedy schedule over a list sorted longest
//    first), the num_work x num_kv_heads items ordered (PERSIST_ORDER) kv head fastest where lengths fall off (causal:
//    the work list is longest first, so kv head fastest keeps the whole list sorted; work item fastest, a round-robin
//    put a single causal request's long tiles on the same CTAs: 1.58x the time at 1x4096), else work item fastest (the
//    CTAs of a round share one kv head's keys in L2: block-sparse rows, whose pages are other rows' too, 0.53-0.70x the
//    time of kv head fastest; uniform lengths 0.97-0.98x). Else `first`, the CTA's own (blockIdx.x, blockIdx.y)
template <class Load, class F>
__device__ __forceinline__ void for_each_item_of(int num_work, int num_kv_heads, const Load& load, Item& first,
                                                 const F& f) {
#if PERSISTENT
  (void)first;
  const int num_items = num_work * num_kv_heads, G = int(gridDim.x), b = int(blockIdx.x);
  for (int r = 0; r * G < num_items; ++r) {
    const int i = r * G + ((r & 1) ? G - 1 - b : b);
    Item it;
    if (i < num_items && (PERSIST_ORDER == 1 ? load(it, i / num_kv_heads, i % num_kv_heads)
                                             : load(it, i % num_work, i / num_work)))
      f(it);
  }
#else
  (void)num_work; (void)num_kv_heads; (void)load;
  f(first);
#endif
}

// -- PERSISTENT: the producer's thread 0 hands item n (nullptr: the end of its list) to the consumers
//    through slot n % ITEM_SLOTS, the Item itself in shared memory (claim_slot waits until the slot's previous item
//    has been read, post_slot publishes it); the readers copy it (read_item: then lane 0 of each warp marks it read) or
//    look at the next one before that (peek_item)
static_assert(sizeof(Item) <= ITEM_SLOT_BYTES, "prefill_sm90: Item outgrew its shared-memory slot");
__device__ __forceinline__ Item* claim_slot(const Smem& sm, int n) {
  mbar_wait(sm.item_read(n % ITEM_SLOTS), ((n / ITEM_SLOTS) & 1) ^ 1);
  return reinterpret_cast<Item*>(__cvta_shared_to_generic(sm.item_slot(n % ITEM_SLOTS)));
}
__device__ __forceinline__ void post_slot(const Smem& sm, int n) {
  mbar_arrive(sm.item_full(n % ITEM_SLOTS));   // (release: the readers' wait acquires the slot's stores)
}
__device__ __forceinline__ void publish_item(const Smem& sm, int n, const Item* it) {   // (nullptr: the end mark)
  Item* d = claim_slot(sm, n);
  if (it == nullptr)
    d->num_tiles = -1;
  else
    *d = *it;
  post_slot(sm, n);
}
__device__ __forceinline__ bool peek_item(const Smem& sm, int n, Item& it) {
  mbar_wait(sm.item_full(n % ITEM_SLOTS), (n / ITEM_SLOTS) & 1);
  it = *reinterpret_cast<const Item*>(__cvta_shared_to_generic(sm.item_slot(n % ITEM_SLOTS)));
  return it.num_tiles >= 0;
}
__device__ __forceinline__ bool read_item(const Smem& sm, int n, Item& it, int lane) {
  const bool more = peek_item(sm, n, it);
  __syncwarp();
  if (lane == 0) mbar_arrive(sm.item_read(n % ITEM_SLOTS));
  return more;
}

extern "C" __global__ void __launch_bounds__(NUM_THREADS, CTAS_PER_SM) cuattn_prefill_sm90(
    const __grid_constant__ TmaDesc tmap_k,  // K: dims (D_QK, tokens, kv heads), box (64, BLOCK_N, 1), swizzle 128B
    const __grid_constant__ TmaDesc tmap_v,  // V: the same with D_VO
    const dtype_t* __restrict__ q,           // [nnz_qo, num_qo_heads, D_QK] (strides q_s_tok, q_s_head)
    dtype_t* __restrict__ o,                 // [nnz_qo, num_qo_heads, D_VO] (strides o_s_tok, o_s_head)
    float* __restrict__ lse,                 // [nnz_qo, num_qo_heads] or nullptr
    const int32_t* __restrict__ qo_indptr,   // [batch + 1] (batch mode)
    const int32_t* __restrict__ kv_indptr,   // [batch + 1] token offsets (batch mode), page offsets (PAGED)
    const int32_t* __restrict__ kv_indices,  // [nnz_pages] (PAGED)
    const int32_t* __restrict__ kv_last_page_len,  // [batch] (PAGED)
    int page_size, int page_shift, int page_box,   // PAGED: page_shift = log2(page_size) or -1
    const uint8_t* __restrict__ k_cache,     // PAGED 2: the K / V caches (TMA maps unused), byte strides of a slot
    const uint8_t* __restrict__ v_cache,     //   (token row) and a head; page p, slot s: row p * page_rows + s
    int64_t k_s_row, int64_t k_s_head, int64_t v_s_row, int64_t v_s_head, int page_rows,
    const int32_t* __restrict__ work,        // [num_work, WORK_COLS], or nullptr: single
    float* __restrict__ part_o,              // [slots, num_kv_heads, BLOCK_M, D_VO] split items' partial rows
    float* __restrict__ part_lse,            // [slots, num_kv_heads, BLOCK_M]
    const int32_t* __restrict__ kv_chunk,    // [1] keys per piece of a split item (0: none split), or nullptr
    int* __restrict__ sched,                 // [2] zeros (PERSIST_DYNAMIC: the next item, CTAs done; left zero), or nullptr
    int num_work,                            // work items (graph mode: the padded count); the single case: query tiles
    int single_qo_len, int single_kv_len, int group, int num_qo_heads,
    int64_t q_s_tok, int64_t q_s_head, int64_t o_s_tok, int64_t o_s_head,
    float k_scale, float v_scale,            // times k_scales / v_scales[kv head or 0] when given
    const float* __restrict__ k_scales, const float* __restrict__ v_scales,
    int scale_per_head,                      // bit 0: k_scales has one scale per kv head, bit 1: v_scales
    float scale_log2 CUATTN_VARIANT_ARGS) {
  extern __shared__ uint8_t smem_raw[];
  const variant::Params vp = CUATTN_VARIANT_PARAMS;
  const uint32_t base = (smem_u32(smem_raw) + 1023) & ~1023u;
  const Smem sm(base);                     // tiles and mbarriers (prefill_sm90_layout.cuh)
  const uint32_t sQ = sm.q, sK = sm.k, sV = sm.v;
  const int tid = int(threadIdx.x);
  if (tid == 0 && PAGED != 2) {   // before the PDL wait: the maps are kernel parameters
    tma_prefetch_desc(&tmap_k);
    tma_prefetch_desc(&tmap_v);
  }
  wait_prior_grids();   // PDL: every other input may come from the previous kernel in the stream

  const int num_kv_heads = num_qo_heads / group;
  // -- item w (of num_work) of kv head kvh: which request and tile, the request's lengths and offsets, the keys its
  //    tiles cover; false: a padding item. Producer and consumers derive the same items (for_each_item)
  const auto load_item = [&](Item& it, int w, int kvh) {
    it.w = w;
    it.kvh = kvh;
    it.req = 0;
    it.qo_len = single_qo_len;
    it.kv_len = single_kv_len;
    it.kv_base = 0;   // (contiguous K/V in batch mode: the request's first row)
    it.q_base = 0;
    if (!query_tile(work, ListItem{unsigned(w), unsigned(num_work)}, qo_indptr, it.req, it.tile, it.q_base, it.qo_len))
      return false;
    it.pages = kv_indices;
    if (work != nullptr) {
#if PAGED
      const int p0 = kv_indptr[it.req], np = kv_indptr[it.req + 1] - p0;
      it.pages = kv_indices + p0;
      it.kv_len = np > 0 ? (np - 1) * page_size + kv_last_page_len[it.req] : 0;
#else
      it.kv_base = kv_indptr[it.req];
      it.kv_len = kv_indptr[it.req + 1] - it.kv_base;
#endif
    }
    const int row0 = it.tile * BLOCK_M;
    const int causal_shift = it.kv_len - it.qo_len;   // bottom-right alignment: key j <= i + shift
    it.kv_end = it.kv_len;
    if (CAUSAL)
      it.kv_end = min(it.kv_len, min(it.qo_len - 1, (row0 + BLOCK_M - 1) / group) + causal_shift + 1);
    // -- the variant's first key for the CTA's first row (sliding window): tiles before it are skipped;
    //    a split item's piece: its keys alone
    it.kv_lo = first_kv_tile_key(vp, it.req, row0 / group + causal_shift, it.qo_len, it.kv_len, BLOCK_N);
    clamp_to_piece(work, ListItem{unsigned(w), 0u}, kv_chunk, it.kv_lo, it.kv_end);
    it.num_tiles = it.kv_end > it.kv_lo ? (it.kv_end - it.kv_lo + BLOCK_N - 1) / BLOCK_N : 0;
    return true;
  };
  (void)page_shift; (void)page_box;
  Item first;                              // (one item a CTA: a padding CTA leaves before the barriers' setup)
  if (!PERSISTENT && !load_item(first, int(blockIdx.x), int(blockIdx.y))) return;
#define for_each_item(...) for_each_item_of(num_work, num_kv_heads, load_item, first, __VA_ARGS__)
  // -- a running count of the K/V tiles the CTA has passed through its stages (PERSISTENT: across items, so the
  //    producer fills the next item's stages while the consumers finish this one); tile t of an item is tb + t
  int tb = 0;
  // -- PERSIST_DYNAMIC (batch mode): the producer's thread 0 takes the CTAs' next item from a global counter
  //    (sched[0]; the last CTA to run out, counted in sched[1], zeroes both for the next launch) and publishes it;
  //    every producer thread reads it back, as the consumers do. Else each CTA's items in turns (for_each_item)
  const bool DYNAMIC = PERSISTENT && PERSIST_DYNAMIC && !variant::HAS_MASK && sched != nullptr && work != nullptr;
  (void)DYNAMIC;

  if (tid == 0) {
#pragma unroll
    for (int s = 0; s < STAGES; ++s) {
      // staged fp8: lane 0 of every converter warp; gather: every producer thread's copies; else the TMA
      mbar_init(sm.full_k(s), FP8_STAGED ? CONVERT_WARPS : PAGED == 2 ? 128 : 1);
      mbar_init(sm.full_v(s), FP8_STAGED ? CONVERT_WARPS : PAGED == 2 ? 128 : 1);
      mbar_init(sm.empty_k(s), 4 * NUM_CONSUMERS);   // lane 0 of every consumer warp
      mbar_init(sm.empty_v(s), 4 * NUM_CONSUMERS);
      if (K_XFORM) mbar_init(sm.ready_k(s), XFORM_THREADS);
    }
#if KV_FP8 && PAGED != 2   // (FP8_STAGED)
#pragma unroll
    for (int s = 0; s < LOAD_STAGES; ++s) {
      mbar_init(sm.loaded_k(s), 1);
      mbar_init(sm.loaded_v(s), 1);
      mbar_init(sm.free_k(s), CONVERT_WARPS);
      mbar_init(sm.free_v(s), CONVERT_WARPS);
    }
#endif
#pragma unroll
    for (int n = 0; n < ITEM_SLOTS; ++n) {   // (PERSISTENT) the producer's thread 0 publishes, consumer warps read
      mbar_init(sm.item_full(n), 1);
      mbar_init(sm.item_read(n), 4 * NUM_CONSUMERS + (DYNAMIC ? 4 : 0));   // (DYNAMIC: producer warps read too)
    }
    mbar_init_fence();
  }
  __syncthreads();

  if (tid < 128) {
    // ------------------------------------------------------------------ producer
    setmaxnreg_dec<PRODUCER_REGS>();
#if CUATTN_VARIANT_ROPE || CUATTN_VARIANT_QK
    // -- K tile t transformed in place once it has landed (FULL_K), then handed to both consumers (READY_K)
    const int xt = tid - (128 - XFORM_THREADS);   // (producer warps 1..3)
#if CUATTN_VARIANT_ROPE
    const RopeCols rc = rope_cols(vp, max(xt, 0) % (vp.rotary_dim / 16), XFORM_THREADS / (vp.rotary_dim / 16));
#endif
    // -- tile t of item it (stage tb + t)
    const auto xform_k_tile = [&](const Item& it, int t) {
      const int st = (tb + t) % STAGES;
      const uint32_t sKs = sK + st * K_TILE_BYTES;
      const int kv0 = it.kv_lo + t * BLOCK_N;   // the tile's first key in the request (split pieces: absolute)
      const auto addr = [&](int r, int c) { return sKs + swz128(BLOCK_N, r, c); };
      mbar_wait(sm.full_k(st), ((tb + t) / STAGES) & 1);
#if CUATTN_VARIANT_ROPE
      rope_rotate_rows_linear<dtype_t>(addr, kv0, BLOCK_N, xt, XFORM_THREADS, vp, rc);
      if (variant::HAS_KEY_TRANSFORM) named_barrier(3, XFORM_THREADS);   // other chunks of the same rows next
#endif
#if CUATTN_VARIANT_QK
      if (variant::HAS_KEY_TRANSFORM)   // (rows past the request, masked in S, as its last key: kv_idx < kv_len)
        transform_rows<dtype_t, D_QK>(addr, BLOCK_N, xt, XFORM_THREADS, [&](int r, int j, float2 x) {
          return variant::key_transform(vp, x, j, it.req, min(kv0 + r, it.kv_len - 1), it.kvh);
        });
#endif
      fence_proxy_async();                 // generic stores -> the consumers' wgmma reads
      mbar_arrive(sm.ready_k(st));
    };
#define XFORM_K_TILE(it, t) if (K_XFORM && tid >= 128 - XFORM_THREADS) xform_k_tile(it, t)
#else
#define XFORM_K_TILE(it, t)
#endif
    // -- the gather: all 128 threads (prefill_sm90_gather.cuh); else thread 0 issues the TMA loads
    //    (prefill_sm90_tma_load.cuh) and warps 1..3 convert fp8 tiles (prefill_sm90_fp8.cuh) or transform K tiles
    const auto produce = [&](const Item& it) {
#if PAGED == 2
      gather_producer(sm, tid, it.kvh, k_cache, v_cache, k_s_row, k_s_head, v_s_row, v_s_head, page_rows, it.pages,
                      page_size, page_shift, it.kv_lo, it.kv_len, it.num_tiles, tb, [&](int t) { XFORM_K_TILE(it, t); });
#else
      if (tid == 0) {
        int page[MAX_BOXES];               // (PAGED) a tile's page ids: here, not in tma_producer (see there)
        tma_producer(sm, tmap_k, tmap_v, it.kvh, it.kv_base, it.kv_lo, it.kv_len, it.num_tiles, tb, it.pages,
                     page_size, page_shift, page_box, page);
      }
#if KV_FP8
      else if (tid >= 32)
        fp8_converters(sm, tid, it.kv_lo, it.kv_len, it.num_tiles);
#endif
#if CUATTN_VARIANT_ROPE || CUATTN_VARIANT_QK
      else if (K_XFORM && tid >= 128 - XFORM_THREADS) {
        for (int t = 0; t < it.num_tiles; ++t) xform_k_tile(it, t);
      }
#endif
#endif   // PAGED == 2
      tb += it.num_tiles;
    };
#if PERSISTENT && PERSIST_DYNAMIC
    if (DYNAMIC) {
      const int num_items = num_work * num_kv_heads;
      for (int n = 0;; ++n) {
        if (tid == 0) {                    // -- the next item that is not padding, or the end, loaded into the slot
          Item* d = claim_slot(sm, n);
          int i;
          bool more;
          do {
            i = atomicAdd(sched, 1);
            more = i < num_items;
          } while (more && !(PERSIST_ORDER == 1 ? load_item(*d, i / num_kv_heads, i % num_kv_heads)
                                                : load_item(*d, i % num_work, i / num_work)));
          if (!more) {
            d->num_tiles = -1;
            if (atomicAdd(sched + 1, 1) == int(gridDim.x) - 1) {   // every CTA has run out: zeros again
              sched[0] = 0;
              sched[1] = 0;
            }
          }
          post_slot(sm, n);
        }
        Item it;
        if (!read_item(sm, n, it, tid % 32)) break;
        produce(it);
      }
    } else
#endif
    {
      int published = 0;                   // (PERSISTENT) items handed to the consumers
      for_each_item([&](const Item& it) {
        if (PERSISTENT && tid == 0) publish_item(sm, published, &it);
        ++published;
        produce(it);
      });
      if (PERSISTENT && tid == 0) publish_item(sm, published, nullptr);   // the end of the CTA's list
    }
#undef XFORM_K_TILE
    return;
  }

  // -------------------------------------------------------------------- consumers
  setmaxnreg_inc<CONSUMER_REGS>();
  const int wg = tid / 128 - 1;            // consumer 0 | 1: rows wg * 64 ..
  const int wt = tid % 128;
  const int warp = wt / 32, lane = tid % 32;
  const int g = lane / 4, t4 = lane % 4;

  // -- this warpgroup's 64 Q rows of item it (rows past the request are zeros): the copies issued, then (after the
  //    wait) converted and transformed in place, fenced for the wgmma reads
  constexpr int CHUNKS = D_QK / 8;         // 16-byte chunks per row
  const auto q_issue = [&](const Item& it) {
    const int row0 = it.tile * BLOCK_M, packed_rows = it.qo_len * group;
#pragma unroll
    for (int j = 0; j < WG_ROWS * CHUNKS / 128; ++j) {
      const int r = wg * WG_ROWS + (wt + 128 * j) / CHUNKS, c = (wt + 128 * j) % CHUNKS;
      const int pr = row0 + r;
      const bool ok = pr < packed_rows;
      const dtype_t* src =
          ok ? q + (it.q_base + pr / group) * q_s_tok + (it.kvh * group + pr % group) * q_s_head + c * 8 : q;
      cp_async_16(sQ + swz128(BLOCK_M, r, c), src, ok ? 16 : 0);
    }
    cp_async_commit();
  };
  const auto q_finish = [&](const Item& it) {
    cp_async_wait<0>();
    if (Q_CONVERT) {                       // -- bf16 q -> f16 in place (fp8 K/V): the chunks this thread copied
#pragma unroll
      for (int j = 0; j < WG_ROWS * CHUNKS / 128; ++j) {
        const uint32_t a = sQ + swz128(BLOCK_M, wg * WG_ROWS + (wt + 128 * j) / CHUNKS, (wt + 128 * j) % CHUNKS);
        sts128(a, convert8<dtype_t, mma_t>(lds128(a)));
      }
    }
#if CUATTN_VARIANT_ROPE || CUATTN_VARIANT_QK
    if (Q_XFORM) {   // -- the query transforms, once, on the rows every thread of the warpgroup staged
      const int row0 = it.tile * BLOCK_M, packed_rows = it.qo_len * group, causal_shift = it.kv_len - it.qo_len;
      named_barrier(1 + wg, 128);
      const auto addr = [&](int r, int c) { return sQ + swz128(BLOCK_M, wg * WG_ROWS + r, c); };
      // packed row of local row r (rows past the request: its last, so they see a valid position)
      const auto packed = [&](int r) { return min(row0 + wg * WG_ROWS + r, max(packed_rows, 1) - 1); };
#if CUATTN_VARIANT_ROPE
      const RopeCols rc = rope_cols(vp, wt % (vp.rotary_dim / 16), 128 / (vp.rotary_dim / 16));
      rope_rotate_rows<dtype_t>(addr, [&](int r) { return int64_t(packed(r) / group + causal_shift); }, WG_ROWS, wt,
                                128, vp, rc);
      if (variant::HAS_QUERY_TRANSFORM) named_barrier(1 + wg, 128);   // other chunks of the same rows next
#endif
#if CUATTN_VARIANT_QK
      if (variant::HAS_QUERY_TRANSFORM)
        transform_rows<dtype_t, D_QK>(addr, WG_ROWS, wt, 128, [&](int r, int j, float2 x) {
          const int pr = packed(r);
          return variant::query_transform(vp, x, j, it.req, pr / group + causal_shift, it.kvh * group + pr % group);
        });
#endif
    }
#endif
    fence_proxy_async();                   // cp.async (and transform) writes -> wgmma reads
    named_barrier(1 + wg, 128);
  };
  // -- item it (PERSISTENT: the producer's n-th), its Q staged already (staged: by the previous item) or not; once its Q
  //    rows are read no more (after its last S), before the epilogue, PERSISTENT stages the next item's Q
  bool staged = false;
  const auto consume = [&](const Item& it, int n) {
    const int req = it.req, qo_len = it.qo_len, kv_len = it.kv_len, kv_lo = it.kv_lo, num_tiles = it.num_tiles;
    const int kvh = it.kvh;
    const int64_t q_base = it.q_base;
    const int row0 = it.tile * BLOCK_M;
    const int packed_rows = qo_len * group;
    const int causal_shift = kv_len - qo_len;   // bottom-right alignment: key j <= i + shift
    if (!staged) q_issue(it);
    q_finish(it);

    // -- the call's key scale (read after the PDL wait: a previous kernel may write it): folded into the
    //    softmax scale, or (a logits transform: variants.py allows no softmax without one) into the
    //    transform's logit_scale (the raw dot products times sm_scale and the key scale: one multiply)
    constexpr bool K_FIRST = variant::HAS_TRANSFORM;
    static_assert(variant::USE_SOFTMAX || K_FIRST, "use_softmax=False needs a logits transform");
    float k_fac = k_scale * FP8_FACTOR;
    if (k_scales != nullptr) k_fac *= k_scales[(scale_per_head & 1) ? kvh : 0];
    const float qk_scale_log2 = K_FIRST ? scale_log2 : scale_log2 * k_fac;
    const float logit_scale = k_fac * vp.sm_scale;

    // -- per-thread rows: local row wg * 64 + warp * 16 + g + 8 h
    const int my_row0 = row0 + wg * WG_ROWS + warp * 16 + g;
    int mask_from = kv_len;                  // tiles reaching past this key need element masks
    if (CAUSAL) mask_from = min(kv_len, (row0 + wg * WG_ROWS) / group + causal_shift + 1);
    int kv_full = 0;                         // sliding window: tiles below this key need element masks
    if (variant::HAS_KV_BEGIN)
      kv_full = variant::kv_begin(vp, req, min(qo_len - 1, (row0 + (wg + 1) * WG_ROWS - 1) / group) + causal_shift,
                                  qo_len, kv_len);
    float acc[O_REGS];
    float m_i[2] = {NEG_INF, NEG_INF}, l_i[2] = {0.f, 0.f};
    variant::RowState rs[2];                 // the variant's per-row state, once per row
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int pr = my_row0 + 8 * h;
      rs[h] = variant::row_state(vp, req, pr / group, pr / group + causal_shift, 0, kvh * group + pr % group, kvh,
                                 qo_len, kv_len);
    }
#pragma unroll
    for (int i = 0; i < O_REGS; ++i) acc[i] = 0.f;
    uint32_t p[BLOCK_N / 16][4];

    // -- S = Q K(t)^T issued (not waited for)
    const auto stage = [&](int t) { return (tb + t) % STAGES; };          // tile t's buffers and barriers' phase
    const auto phase = [&](int t) { return uint32_t((tb + t) / STAGES) & 1; };
    auto issue_qk = [&](float (&s)[S_REGS], int t) {
      const uint32_t sKs = sK + stage(t) * K_TILE_BYTES;
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < D_QK / 16; ++kk) {
        const uint64_t da = wgmma_desc(sQ + (kk / 4) * (BLOCK_M * 128) + wg * (WG_ROWS * 128) + (kk % 4) * 32, 16, 1024);
        const uint64_t db = wgmma_desc(sKs + (kk / 4) * HALF_BYTES + (kk % 4) * 32, 16, 1024);
        wgmma_m64k16_ss<BLOCK_N, mma_t>(s, da, db, kk > 0);
      }
      wgmma_commit();
    };
    // -- O += P V(t) issued (not waited for)
    auto issue_pv = [&](int t) {
      const uint32_t sVs = sV + stage(t) * V_TILE_BYTES;
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < BLOCK_N / 16; ++kk)
        wgmma_m64k16_rs_tb<D_VO, mma_t>(acc, p[kk], wgmma_desc(sVs + kk * 16 * 128, HALF_BYTES, 1024));
      wgmma_commit();
    };
    // -- tile t of S: the variant's logits transform (every tile) and the masks (causal on diagonal
    //    tiles, the window below kv_full, a variant mask on every tile)
    auto mask_tile = [&](float (&s)[S_REGS], int t) {
      const int kv0 = kv_lo + t * BLOCK_N;
      const bool edge = variant::HAS_MASK || kv0 + BLOCK_N > mask_from || (variant::HAS_KV_BEGIN && kv0 < kv_full);
      if (!variant::HAS_TRANSFORM && !edge) return;
      if (MASK_SPLIT && variant::HAS_TRANSFORM && !edge) {   // -- a tile no mask reaches: the transform alone
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int pr = my_row0 + 8 * h;
          const int qpos = pr / group;
#pragma unroll
          for (int n = 0; n < BLOCK_N / 8; ++n)
#pragma unroll
            for (int e = 0; e < 2; ++e)
              s[4 * n + 2 * h + e] = variant_transform(vp, rs[h], s[4 * n + 2 * h + e], logit_scale, req, qpos,
                                                       qpos + causal_shift, kv0 + n * 8 + 2 * t4 + e, kv0 + 2 * t4,
                                                       kvh * group + pr % group, kvh, qo_len, kv_len);
        }
        return;
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int pr = my_row0 + 8 * h;
        const int qpos = pr / group;
        const int row_lo = variant::HAS_KV_BEGIN ? variant::kv_begin(vp, req, qpos + causal_shift, qo_len, kv_len) : 0;
#pragma unroll
        for (int n = 0; n < BLOCK_N / 8; ++n)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int kpos = kv0 + n * 8 + 2 * t4 + e;
            bool keep = kpos < kv_len;
            if (CAUSAL) keep = keep && kpos <= qpos + causal_shift;
            if (!keep)
              s[4 * n + 2 * h + e] = NEG_INF;
            else if (variant::NEEDS_POSITION)
              s[4 * n + 2 * h + e] = variant_score(vp, rs[h], s[4 * n + 2 * h + e], logit_scale, req, qpos,
                                                   qpos + causal_shift, kpos, kv0 + 2 * t4, kvh * group + pr % group,
                                                   kvh, qo_len, kv_len, row_lo);
          }
      }
    };
    // -- online softmax (base 2): m, l updated, S becomes P (fp32), corr = rescale factor of O
    //    (without softmax: the transformed logits are the weights, dropped keys 0)
    auto softmax = [&](float (&s)[S_REGS], float (&corr)[2]) {
      if (!variant::USE_SOFTMAX) {
#pragma unroll
        for (int i = 0; i < S_REGS; ++i) s[i] = s[i] == NEG_INF ? 0.f : s[i];
        corr[0] = corr[1] = 1.f;
        return;
      }
#pragma unroll
      for (int h = 0; h < 2; ++h)            // row h: s[4 n + 2 h + e]
        corr[h] = online_softmax_row<BLOCK_N / 4>(
            [&](int k) { return s[4 * (k >> 1) + 2 * h + (k & 1)]; },
            [&](int k, float p) { s[4 * (k >> 1) + 2 * h + (k & 1)] = p; }, m_i[h], l_i[h], qk_scale_log2);
    };
    auto rescale_o = [&](const float (&corr)[2]) {
#pragma unroll
      for (int n = 0; n < D_VO / 8; ++n) {
        acc[4 * n + 0] *= corr[0];
        acc[4 * n + 1] *= corr[0];
        acc[4 * n + 2] *= corr[1];
        acc[4 * n + 3] *= corr[1];
      }
    };
    // -- P (fp32 accumulator layout) -> 16-bit A fragments, one per 16 keys
    auto pack_p = [&](const float (&s)[S_REGS]) {
#pragma unroll
      for (int kk = 0; kk < BLOCK_N / 16; ++kk) {
        p[kk][0] = pack2<mma_t>(s[8 * kk + 0], s[8 * kk + 1]);
        p[kk][1] = pack2<mma_t>(s[8 * kk + 2], s[8 * kk + 3]);
        p[kk][2] = pack2<mma_t>(s[8 * kk + 4], s[8 * kk + 5]);
        p[kk][3] = pack2<mma_t>(s[8 * kk + 6], s[8 * kk + 7]);
      }
    };
    auto release = [&](uint32_t bar) {       // this warp is done reading a K or V buffer
      __syncwarp();
      if (lane == 0) mbar_arrive(bar);
    };
    // -- PINGPONG: the two consumer warpgroups take turns issuing their GEMMs (named barrier 4 + wg:
    //    warpgroup wg's turn), so one's softmax runs while the tensor cores work on the other's products.
    //    Consumer 1 opens consumer 0's first turn; its last turn passes nothing (the counts balance).
    auto turn_wait = [&]() {
      if (PINGPONG) named_barrier(4 + wg, 256);
    };
    auto turn_pass = [&](bool last) {
      if (PINGPONG && !(last && wg == 1)) named_barrier_arrive(4 + (wg ^ 1), 256);
    };

    if (num_tiles > 0) {
      if (PINGPONG && wg == 1) named_barrier_arrive(4, 256);
      {  // -- tile 0: S, softmax, P (O is still zero: nothing to rescale)
        float s[S_REGS], corr[2];
        mbar_wait(sm.k_landed(stage(0)), phase(0));
        if (PAGED == 2) fence_proxy_async();   // cp.async stores -> wgmma reads
        turn_wait();
        issue_qk(s, 0);
        turn_pass(false);
        wgmma_wait<0>();
        wgmma_fence_regs(s);
        release(sm.empty_k(stage(0)));
        mask_tile(s, 0);
        softmax(s, corr);
        pack_p(s);
      }
      for (int t = 1; t < num_tiles; ++t) {
        float s[S_REGS], corr[2];
        const int ps = stage(t - 1);
        mbar_wait(sm.k_landed(stage(t)), phase(t));
        if (PAGED == 2) fence_proxy_async();
        turn_wait();
        issue_qk(s, t);
        mbar_wait(sm.full_v(ps), phase(t - 1));
        if (PAGED == 2) fence_proxy_async();
        issue_pv(t - 1);
        turn_pass(false);
        wgmma_wait<1>();                     // S(t) has landed; P(t-1) V(t-1) may still run
        wgmma_fence_regs(s);
        release(sm.empty_k(stage(t)));
        mask_tile(s, t);
        softmax(s, corr);
        wgmma_wait<0>();
        wgmma_fence_regs(acc);
        release(sm.empty_v(ps));
        rescale_o(corr);
        pack_p(s);
      }
      const int lt = num_tiles - 1;
      mbar_wait(sm.full_v(stage(lt)), phase(lt));
      if (PAGED == 2) fence_proxy_async();
#if ZERO_V_TAIL   // (TMA tiles and boxes, the fp8 gather; TMA-staged fp8: the converters zero them; 16-bit gather: its copies)
      {   // -- V rows past the request's end hold whatever the cache holds: zeros before P.V (both
          //    consumer warpgroups write the same zeros; each reads after its own writes and barrier)
        const int valid = kv_len - (kv_lo + lt * BLOCK_N);
        if (valid < BLOCK_N) {
          // thread wt: 16-byte chunk c = wt % CH of rows valid + wt / CH, + 128 / CH, .. (any chunk order within a row:
          // the rows are zeroed whole); one running address, so the loop adds no registers beside P and O
          constexpr int CH = D_VO / 8, ROW_STEP = 128 / CH;
          static_assert(128 % CH == 0, "ZERO_V_TAIL: a whole number of rows a pass");
          const uint32_t end = sV + stage(lt) * V_TILE_BYTES + (wt % CH / 8) * HALF_BYTES + (wt % CH % 8) * 16 + BLOCK_N * 128;
          for (uint32_t a = end - (BLOCK_N - valid - wt / CH) * 128; a < end; a += ROW_STEP * 128)
            asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(a), "r"(0) : "memory");
          fence_proxy_async();               // generic stores -> wgmma reads
          named_barrier(1 + wg, 128);
        }
      }
#endif
      turn_wait();
      issue_pv(lt);
      turn_pass(true);
      wgmma_wait<0>();
      wgmma_fence_regs(acc);
      release(sm.empty_v(stage(lt)));
    }

#if PERSISTENT
    {   // (Q is read no more)
      Item next;
      staged = peek_item(sm, n + 1, next);
      if (staged) q_issue(next);
    }
#else
    (void)n;
#endif
    if (!PERSISTENT) allow_next_grid();    // only the epilogue is left: the next kernel may start its prologue

    // -- epilogue: O / l, natural-log LSE; fully masked rows give 0 and -inf. A piece of a split item
    //    writes its fp32 partial row instead (the sink joins piece 0 alone)
#if PERSISTENT
    const ItemEnd item = item_end(work, ListItem{unsigned(it.w), 0u});
#else
    const ItemEnd item = item_end(work, CtaItem());   // (read here: no register holds the item index through the loop)
#endif
    float v_fac = v_scale * FP8_FACTOR;         // the call's value scale (read here: no register across the loop)
    if (v_scales != nullptr) v_fac *= v_scales[(scale_per_head & 2) ? kvh : 0];
    const auto scaled = [&](RowEnd e) { e.o_scale *= v_fac; return e; };
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float l = l_i[h];
      l += __shfl_xor_sync(0xffffffffu, l, 1);
      l += __shfl_xor_sync(0xffffffffu, l, 2);
      const int pr = my_row0 + 8 * h;
      if (pr >= packed_rows) continue;
      const int head = kvh * group + pr % group;
      const auto pair = [&](int n) { return make_float2(acc[4 * n + 2 * h], acc[4 * n + 2 * h + 1]); };
      if (item.slot >= 0)
        store_partial_row<D_VO>(part_o, part_lse, (int64_t(item.slot) * num_kv_heads + kvh) * BLOCK_M + (pr - row0), t4,
                                scaled(finish_row(vp, m_i[h], l, req, pr / group, head, item.with_sink)), pair);
      else
        store_output_row<D_VO>(o, o_s_tok, o_s_head, lse, num_qo_heads, q_base + pr / group, head, t4,
                               scaled(finish_row(vp, m_i[h], l, req, pr / group, head, true)), pair);
    }
    tb += num_tiles;
  };
#if PERSISTENT
  // -- the producer's items, in order, until its end mark
  for (int n = 0;; ++n) {
    Item it;
    if (!read_item(sm, n, it, lane)) break;
    consume(it, n);
  }
#else
  for_each_item([&](const Item& it) { consume(it, 0); });
#endif
  if (PERSISTENT) allow_next_grid();
#undef for_each_item
}

extern "C" __global__ void __launch_bounds__(128) cuattn_prefill_sm90_merge(
    const int32_t* __restrict__ merge,       // [num_merge, MERGE_COLS] (request, tile, first slot, pieces)
    const int32_t* __restrict__ qo_indptr, const float* __restrict__ part_o, const float* __restrict__ part_lse,
    dtype_t* __restrict__ o, float* __restrict__ lse, int group, int64_t o_s_tok, int64_t o_s_head) {
  merge_pieces<D_VO, BLOCK_M>(merge, qo_indptr, part_o, part_lse, o, lse, group, o_s_tok, o_s_head);
}
