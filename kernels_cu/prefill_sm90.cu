// prefill_sm90.cu — launched by cuattn/prefill_sm90.py (Sm90PrefillSpec); the Hopper "fa3" backend
// Parameters: mirrored by prefill_sm90.py PARAMS (by name; tests/test_params.py checks the two agree).
// (sm_90a only: wgmma, TMA, setmaxnreg).
// Compile-time: HEAD_DIM_QK (q and K columns: 64 | 128 | 256 | 192), HEAD_DIM_VO (V and out columns: 64 |
//   128 | 256; 192 pairs with 128), DTYPE (cuattn::f16 | cuattn::bf16), CAUSAL (0 | 1), BLOCK_N (keys per
//   tile: 128, 64 for head_dim 256), STAGES (K/V tiles in flight, >= 2), PAGED (0 | 1), KV_FP8 (0: K/V of
//   DTYPE, 1: e4m3, 2: e5m2; head dims 64 and 128 only), SPEC_SMEM_BYTES (the launcher's smem).
// Grid (num_work, num_kv_heads); block 384 (3 warpgroups); dynamic smem SMEM_BYTES (below): 1024
//   (alignment) + BLOCK_M * HEAD_DIM_QK * 2 + STAGES * BLOCK_N * (HEAD_DIM_QK + HEAD_DIM_VO) * 2 + 32 STAGES
//   (mbarriers) (+ STAGES BLOCK_N (HEAD_DIM_QK + HEAD_DIM_VO) + 32 STAGES with KV_FP8: the fp8 staging
//   tiles and their mbarriers; + 8 STAGES with a key transform: READY_K), checked against SPEC_SMEM_BYTES.
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
// or 88 with an unrolled gather or key transforms: PRODUCER_REGS) to the consumers (232 / 224 / 208): S takes BLOCK_N / 2 floats per thread and O D_VO / 2 (hence BLOCK_N 64 at
// D_VO 256).
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
// are masked in S (the TMA zero-fills rows past the tensor's end).
// PAGED = 1: K / V are a paged cache (page CSR kv_indptr / kv_indices / kv_last_page_len) and the
// tensor maps have dims (head dim, page_size, kv heads, pages), box (64, page_box, 1, 1), page_box =
// min(page_size, BLOCK_N) dividing both: a tile is BLOCK_N / page_box boxes, each from its own page,
// landing page_box rows apart (multiples of 1024 bytes, so the 128-byte swizzle is the contiguous
// tile's). Rows past the request's end (the last page's free slots, boxes past the last page) hold
// whatever the cache holds: masked in S, and zeroed in V before the last P.V (0 x NaN would be NaN).
// PAGED = 2 (the gather producer, any page size, 16-bit K/V): the whole producer warpgroup copies K / V rows
// with cp.async, 8 threads a row (16-byte chunks q, q + 8, ..: a warp moves 4 rows of 128 contiguous bytes
// per instruction), BLOCK_N / 16 rows a thread, each row from its own page (row = page * page_rows + slot,
// page_rows = the page stride over the slot stride; byte strides k_s_row / k_s_head, v_*); keys past the
// request's end are zero-filled. Each thread's arrival on the "full" barrier (count 128) is
// cp.async.mbarrier.arrive.noinc: it lands with the thread's copies, so no producer thread waits on its
// own loads; consumers fence the async proxy after the wait (cp.async writes are generic-proxy stores,
// wgmma reads async-proxy). The page ids of tile t + 1 are loaded while the thread waits for tile t + 1's buffer.
// A thread's rows are unrolled (GATHER_ROWS; 56 producer registers) where the consumers keep enough registers.
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
// factor joins the softmax scale (or, before a logits transform / without softmax, multiplies the raw
// dot products), the value factor each output row at the store (partial rows too: the merge is linear).
// KV_FP8: the TMA loads fp8 K / V tiles (half the bytes; boxes of min(D_QK or D_VO, 128) byte-columns, a
// swizzle of as many bytes: LoadTile) into STAGES fp8 staging buffers each ("loaded" mbarriers; "free" ones when the
// converters are done reading). Warps 1..3 of the producer warpgroup convert each staged tile into the
// 16-bit swizzled tile the wgmma path reads (common/dtypes.cuh fp8x2_to_f16x2: f16, e4m3 times 2^-8,
// which joins the scales), V rows past the request's end as zeros, then arrive on the "full" mbarrier
// the consumers wait on (after their release of that 16-bit buffer on "empty"), so S and P.V are the
// 16-bit path's. The tensor cores run f16: a bf16 q is converted to f16 in smem once, as prefill.cu does.
#include "common/dtypes.cuh"
#include "common/grid_dependency.cuh"
#include "common/mma.cuh"
#include "common/prefill_tile.cuh"
#include "common/softmax.cuh"
#include "common/variant.cuh"
#include "common/tma.cuh"
#include "common/wgmma.cuh"
#ifndef PAGED
#define PAGED 0
#endif
#ifndef PINGPONG
#define PINGPONG 1          // the consumer warpgroups take turns issuing their GEMMs (named barriers 4, 5; 0: free-running)
#endif
#ifndef MASK_SPLIT
#define MASK_SPLIT 1        // tiles no mask reaches run a variant's logits transform without bound checks (0: the A/B)
#endif
#ifndef KV_FP8
#define KV_FP8 0
#endif
#ifndef GATHER_UNROLL       // PAGED == 2: rows a gather thread copies per loop iteration (> 1: 56 producer registers);
#define GATHER_UNROLL 0     // 0: all 8 at head_dim_qk <= 128 (H100 A/B, prefill_sm90_notes.md: 0.84-0.99x the time of
#endif                      // a rolled loop), else 1 (spills: consumers at 192 / 256, key-transform producers)

using namespace cuattn;
typedef DTYPE dtype_t;                              // q and out
#if KV_FP8
typedef f16 mma_t;                                  // the tensor cores' type: fp8 K/V (and a bf16 q) converted to it
#else
typedef DTYPE mma_t;
#endif
template <class A, class B> struct SameType { static constexpr bool value = false; };
template <class A> struct SameType<A, A> { static constexpr bool value = true; };
constexpr bool Q_CONVERT = !SameType<dtype_t, mma_t>::value;   // bf16 q with fp8 K/V
constexpr float FP8_FACTOR = Fp8F16Factor<KV_FP8>::value;
#define NEG_INF __int_as_float(0xff800000)

// -- tile geometry, all of it from HEAD_DIM_QK, HEAD_DIM_VO, BLOCK_N and STAGES (prefill_sm90.py
//    Sm90PrefillSpec.smem_bytes mirrors SMEM_BYTES)
constexpr int D_QK = HEAD_DIM_QK;                   // q / K columns: S = Q K^T over D_QK / 16 k-steps
constexpr int D_VO = HEAD_DIM_VO;                   // V / out columns: O is m64n{D_VO}, D_VO / 2 floats per thread
constexpr int WG_ROWS = 64;                         // rows per consumer warpgroup (wgmma m64)
constexpr int NUM_CONSUMERS = 2;
constexpr int BLOCK_M = WG_ROWS * NUM_CONSUMERS;
constexpr int NUM_THREADS = 128 * (NUM_CONSUMERS + 1);
constexpr int S_REGS = BLOCK_N / 2, O_REGS = D_VO / 2;   // accumulator floats per thread: S tile, O
constexpr uint32_t HALF_BYTES = BLOCK_N * 128;      // one column block of 64 elements of a K or V tile
constexpr uint32_t Q_BYTES = BLOCK_M * D_QK * 2;    // D_QK / 64 column blocks of BLOCK_M * 128 bytes
constexpr uint32_t K_TILE_BYTES = (D_QK / 64) * HALF_BYTES;
constexpr uint32_t V_TILE_BYTES = (D_VO / 64) * HALF_BYTES;
// -- query / key transforms (see the header); plain attention: both false, today's code
constexpr bool Q_XFORM = CUATTN_VARIANT_ROPE || variant::HAS_QUERY_TRANSFORM;
constexpr bool K_XFORM = CUATTN_VARIANT_ROPE || variant::HAS_KEY_TRANSFORM;
constexpr int XFORM_THREADS = 96;                   // producer warps 1..3
// RoPE: rotary_dim is a power of two <= D_QK, so its rotary_dim / 16 chunks divide this largest one
constexpr int ROPE_MAX_CHUNKS = D_QK >= 256 ? 16 : D_QK >= 128 ? 8 : D_QK >= 64 ? 4 : D_QK >= 32 ? 2 : 1;
static_assert(XFORM_THREADS % ROPE_MAX_CHUNKS == 0 && 128 % ROPE_MAX_CHUNKS == 0, "RoPE: a fixed chunk pair per thread");
static_assert(!((Q_XFORM || K_XFORM) && KV_FP8),
              "query / key transforms need a 16-bit KV cache (READY_K shares fp8's barrier slots; a bf16 q is f16 in smem)");
// setmaxnreg: the producer warpgroup's count (the RoPE transform keeps its chunk's frequencies, 32
// registers: 88; a variant's key transform: 56, headroom for the user's code), the consumers share
// what is left of 3 x 168 (the entry count at 384 threads): 232 plain, 224, 208
constexpr int GATHER_ROWS = GATHER_UNROLL > 0 ? GATHER_UNROLL : D_QK <= 128 && !K_XFORM ? 8 : 1;
constexpr int PRODUCER_REGS = CUATTN_VARIANT_ROPE ? 88 : (K_XFORM || (PAGED == 2 && GATHER_ROWS > 1)) ? 56 : 40;
constexpr int CONSUMER_REGS = ((NUM_CONSUMERS + 1) * 168 - PRODUCER_REGS) / NUM_CONSUMERS / 8 * 8;
constexpr int MAX_BOXES = BLOCK_N / 16;             // PAGED: TMA boxes per tile at the smallest page (16)
constexpr int CONVERT_WARPS = 3;                    // KV_FP8: producer warps 1..3
constexpr int LOAD_STAGES = STAGES;                 // fp8 staging buffers per K and per V (KV_FP8)
// -- how the TMA lands a K tile (DIM = D_QK) or a V tile (DIM = D_VO): KV_FP8, an fp8 staging tile that
//    CONVERT_WARPS warps of the producer warpgroup convert (boxes of min(DIM, 128) byte-columns, a swizzle
//    of as many bytes); otherwise the 16-bit tile itself (64 columns, 128-byte swizzle)
template <int DIM>
struct LoadTile {
  static constexpr int COLS = KV_FP8 ? (DIM < 128 ? DIM : 128) : 64;   // elements per box row
  static constexpr int ROW_BYTES = KV_FP8 ? COLS : 128;
  static constexpr int BLOCKS = DIM / COLS;                             // column blocks (boxes per row)
  static constexpr uint32_t BLOCK_BYTES = BLOCK_N * ROW_BYTES;
  static constexpr uint32_t BYTES = BLOCKS * BLOCK_BYTES;
  static_assert(DIM % COLS == 0 && (COLS == 64 || COLS == 128),
                "fp8 K/V: head_dim 64 or a multiple of 128 (one fp8 box is 64 or 128 bytes wide)");
};
typedef LoadTile<D_QK> LoadK;
typedef LoadTile<D_VO> LoadV;
static_assert(KV_FP8 || (LoadK::BYTES == K_TILE_BYTES && LoadV::BYTES == V_TILE_BYTES), "16-bit: the TMA fills the tiles");
// -- shared memory: Q, STAGES 16-bit K and V tiles, (KV_FP8) STAGES fp8 K and V staging tiles, the mbarriers
constexpr int NUM_BARS = 4 * STAGES + (KV_FP8 ? 4 * LOAD_STAGES : K_XFORM ? STAGES : 0);
constexpr uint32_t SMEM_BYTES = 1024 + Q_BYTES + STAGES * (K_TILE_BYTES + V_TILE_BYTES) +
                                (KV_FP8 ? LOAD_STAGES * (LoadK::BYTES + LoadV::BYTES) : 0) + 8 * NUM_BARS;

static_assert(D_QK % 64 == 0 && D_QK <= 256 && D_VO % 64 == 0 && D_VO <= D_QK,
              "prefill_sm90: head dims of whole 64-column blocks, V's at most K's (split-KV rows: head_dim_qk floats)");
static_assert(BLOCK_N == 64 || BLOCK_N == 128, "prefill_sm90: S is wgmma m64n64 or m64n128");
static_assert(S_REGS + O_REGS <= 160, "prefill_sm90: S and O accumulators must leave registers for P and the rest");
static_assert(STAGES >= 2, "the pipeline needs two stages");
static_assert(!(PAGED == 2 && KV_FP8), "the gather producer copies 16-bit K/V (fp8 pages: TMA boxes)");
static_assert(!(PAGED == 2 && CUATTN_VARIANT_ROPE && D_QK == 256),
              "the gather producer with the RoPE transform at head_dim 256 spills in the producer's 88 registers");
static_assert(SMEM_BYTES <= 227 * 1024, "prefill_sm90: Q and STAGES K / V tiles (fp8: and their staging) exceed 227 KiB "
              "of shared memory");
static_assert(SMEM_BYTES == SPEC_SMEM_BYTES, "prefill_sm90.py Sm90PrefillSpec.smem_bytes (the launch's) must be SMEM_BYTES");

// -- smem byte offset of 16-byte chunk c (0..D/8) of row r in a swizzled [rows][D] tile of `rows` rows (any D)
__device__ __forceinline__ uint32_t swz128(int rows, int r, int c) {
  return uint32_t((c / 8) * rows * 128 + r * 128 + (((c % 8) ^ (r % 8)) * 16));
}

__device__ __forceinline__ uint4 lds128(uint32_t a) {
  uint4 x;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n" : "=r"(x.x), "=r"(x.y), "=r"(x.z), "=r"(x.w) : "r"(a) : "memory");
  return x;
}
__device__ __forceinline__ void sts128(uint32_t a, uint4 x) {
  asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(a), "r"(x.x), "r"(x.y), "r"(x.z), "r"(x.w) : "memory");
}

#if KV_FP8
// -- one staged fp8 tile of DIM columns (column blocks of BLOCK_N rows x F8 = LoadTile<DIM>::COLS bytes, the
//    TMA's F8-byte swizzle: 16-byte chunk c of row r at c ^ (address bits 7.. of the row)) -> the 16-bit tile
//    (swz128), rows >= `valid` as zeros. Thread ct (0 .. 32 CONVERT_WARPS) takes 16-byte fp8 chunks u = ct +
//    k 32 CONVERT_WARPS: row (u / 8 CH) * 8 + u % 8, chunk (u / 8) % CH, so the 8 lanes of each quarter warp
//    read 8 rows of one chunk (8 distinct bank groups) and write two 16-bit chunks each likewise.
template <int DIM>
__device__ __forceinline__ void convert_fp8_tile(uint32_t src, uint32_t dst, int ct, int valid) {
  constexpr int F8 = LoadTile<DIM>::COLS;
  constexpr int CH = DIM / 16, BCH = F8 / 16;        // 16-byte fp8 chunks per row, per column block
#pragma unroll 2
  for (int u = ct; u < BLOCK_N * CH; u += 32 * CONVERT_WARPS) {
    const int j = u % 8, c = (u / 8) % CH, r = (u / (8 * CH)) * 8 + j;
    const int cc = c % BCH;
    uint4 x = lds128(src + (c / BCH) * (BLOCK_N * F8) + r * F8 + ((cc ^ ((r * F8 / 128) % BCH)) * 16));
    if (r >= valid) x = make_uint4(0u, 0u, 0u, 0u);  // zero bits are 0 in both formats
    sts128(dst + swz128(BLOCK_N, r, 2 * c), fp8x8_to_f16x8<KV_FP8>(x.x, x.y));
    sts128(dst + swz128(BLOCK_N, r, 2 * c + 1), fp8x8_to_f16x8<KV_FP8>(x.z, x.w));
  }
}
#endif

extern "C" __global__ void __launch_bounds__(NUM_THREADS, 1) cuattn_prefill_sm90(
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
    int single_qo_len, int single_kv_len, int group, int num_qo_heads,
    int64_t q_s_tok, int64_t q_s_head, int64_t o_s_tok, int64_t o_s_head,
    float k_scale, float v_scale,            // times k_scales / v_scales[kv head or 0] when given
    const float* __restrict__ k_scales, const float* __restrict__ v_scales,
    int scale_per_head,                      // bit 0: k_scales has one scale per kv head, bit 1: v_scales
    float scale_log2 CUATTN_VARIANT_ARGS) {
  extern __shared__ uint8_t smem_raw[];
  const variant::Params vp = CUATTN_VARIANT_PARAMS;
  const uint32_t base = (smem_u32(smem_raw) + 1023) & ~1023u;
  const uint32_t sQ = base, sK = sQ + Q_BYTES, sV = sK + STAGES * K_TILE_BYTES;
#if KV_FP8
  const uint32_t sK8 = sV + STAGES * V_TILE_BYTES, sV8 = sK8 + LOAD_STAGES * LoadK::BYTES;   // fp8 staging
  const uint32_t bars = sV8 + LOAD_STAGES * LoadV::BYTES;
#else
  const uint32_t bars = sV + STAGES * V_TILE_BYTES;
#endif
  // fullK, fullV, emptyK, emptyV: STAGES each; readyK (K_XFORM): STAGES (the 16-bit tiles: written, released by the consumers);
  // KV_FP8: loadedK, loadedV, freeK, freeV: LOAD_STAGES each (the staging tiles: landed, read by the converters)
#define FULL_K(s) (bars + 8 * (s))
#define FULL_V(s) (bars + 8 * (STAGES + (s)))
#define EMPTY_K(s) (bars + 8 * (2 * STAGES + (s)))
#define EMPTY_V(s) (bars + 8 * (3 * STAGES + (s)))
#define LOADED_K(s) (bars + 8 * (4 * STAGES + (s)))
#define LOADED_V(s) (bars + 8 * (4 * STAGES + LOAD_STAGES + (s)))
#define FREE_K(s) (bars + 8 * (4 * STAGES + 2 * LOAD_STAGES + (s)))
#define FREE_V(s) (bars + 8 * (4 * STAGES + 3 * LOAD_STAGES + (s)))
#if KV_FP8   // where the TMA lands, the barrier it completes, the one that frees its buffer
#define LOAD_DST_K(s) (sK8 + (s) * LoadK::BYTES)
#define LOAD_DST_V(s) (sV8 + (s) * LoadV::BYTES)
#define LOAD_BAR_K(s) LOADED_K(s)
#define LOAD_BAR_V(s) LOADED_V(s)
#define LOAD_FREE_K(s) FREE_K(s)
#define LOAD_FREE_V(s) FREE_V(s)
#else
#define LOAD_DST_K(s) (sK + (s) * K_TILE_BYTES)
#define LOAD_DST_V(s) (sV + (s) * V_TILE_BYTES)
#define LOAD_BAR_K(s) FULL_K(s)
#define LOAD_BAR_V(s) FULL_V(s)
#define LOAD_FREE_K(s) EMPTY_K(s)
#define LOAD_FREE_V(s) EMPTY_V(s)
#endif
#define READY_K(s) (bars + 8 * (4 * STAGES + (s)))       // K_XFORM (never with KV_FP8): the K tile transformed
#define K_LANDED(s) (K_XFORM ? READY_K(s) : FULL_K(s))   // what the consumers' S wgmma waits on
  const int tid = int(threadIdx.x);
  const int kvh = int(blockIdx.y);
  if (tid == 0 && PAGED != 2) {   // before the PDL wait: the maps are kernel parameters
    tma_prefetch_desc(&tmap_k);
    tma_prefetch_desc(&tmap_v);
  }
  wait_prior_grids();   // PDL: every other input may come from the previous kernel in the stream

  // -- which request and tile; lengths and offsets of the request
  int req = 0, tile, qo_len = single_qo_len, kv_len = single_kv_len;
  int kv_base = 0;   // (contiguous K/V in batch mode: the request's first row)
  int64_t q_base = 0;
  if (!query_tile(work, qo_indptr, req, tile, q_base, qo_len)) return;
  const int32_t* pages = kv_indices;
  if (work != nullptr) {
#if PAGED
    const int p0 = kv_indptr[req], np = kv_indptr[req + 1] - p0;
    pages = kv_indices + p0;
    kv_len = np > 0 ? (np - 1) * page_size + kv_last_page_len[req] : 0;
#else
    kv_base = kv_indptr[req];
    kv_len = kv_indptr[req + 1] - kv_base;
#endif
  }
  (void)pages; (void)page_shift; (void)page_box; (void)kv_base;
  const int row0 = tile * BLOCK_M;
  const int packed_rows = qo_len * group;
  const int causal_shift = kv_len - qo_len;   // bottom-right alignment: key j <= i + shift
  int kv_end = kv_len;
  if (CAUSAL) kv_end = min(kv_len, min(qo_len - 1, (row0 + BLOCK_M - 1) / group) + causal_shift + 1);
  // -- the variant's first key for the CTA's first row (sliding window): tiles before it are skipped;
  //    a split item's piece: its keys alone
  int kv_lo = first_kv_tile_key(vp, req, row0 / group + causal_shift, qo_len, kv_len, BLOCK_N);
  clamp_to_piece(work, kv_chunk, kv_lo, kv_end);
  const int num_tiles = kv_end > kv_lo ? (kv_end - kv_lo + BLOCK_N - 1) / BLOCK_N : 0;

  if (tid == 0) {
#pragma unroll
    for (int s = 0; s < STAGES; ++s) {
      // fp8: lane 0 of every converter warp; gather: every producer thread's copies; else the TMA
      mbar_init(FULL_K(s), KV_FP8 ? CONVERT_WARPS : PAGED == 2 ? 128 : 1);
      mbar_init(FULL_V(s), KV_FP8 ? CONVERT_WARPS : PAGED == 2 ? 128 : 1);
      mbar_init(EMPTY_K(s), 4 * NUM_CONSUMERS);   // lane 0 of every consumer warp
      mbar_init(EMPTY_V(s), 4 * NUM_CONSUMERS);
      if (K_XFORM) mbar_init(READY_K(s), XFORM_THREADS);
    }
#if KV_FP8
#pragma unroll
    for (int s = 0; s < LOAD_STAGES; ++s) {
      mbar_init(LOADED_K(s), 1);
      mbar_init(LOADED_V(s), 1);
      mbar_init(FREE_K(s), CONVERT_WARPS);
      mbar_init(FREE_V(s), CONVERT_WARPS);
    }
#endif
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
    const auto xform_k_tile = [&](int t) {
      const uint32_t sKs = sK + (t % STAGES) * K_TILE_BYTES;
      const int kv0 = kv_lo + t * BLOCK_N;   // the tile's first key in the request (split pieces: absolute)
      const auto addr = [&](int r, int c) { return sKs + swz128(BLOCK_N, r, c); };
      mbar_wait(FULL_K(t % STAGES), (t / STAGES) & 1);
#if CUATTN_VARIANT_ROPE
      rope_rotate_rows_linear<dtype_t>(addr, kv0, BLOCK_N, xt, XFORM_THREADS, vp, rc);
      if (variant::HAS_KEY_TRANSFORM) named_barrier(3, XFORM_THREADS);   // other chunks of the same rows next
#endif
#if CUATTN_VARIANT_QK
      if (variant::HAS_KEY_TRANSFORM)   // (rows past the request, masked in S, as its last key: kv_idx < kv_len)
        transform_rows<dtype_t, D_QK>(addr, BLOCK_N, xt, XFORM_THREADS, [&](int r, int j, float2 x) {
          return variant::key_transform(vp, x, j, req, min(kv0 + r, kv_len - 1), kvh);
        });
#endif
      fence_proxy_async();                 // generic stores -> the consumers' wgmma reads
      mbar_arrive(READY_K(t % STAGES));
    };
#define XFORM_K_TILE(t) if (K_XFORM && tid >= 128 - XFORM_THREADS) xform_k_tile(t)
#else
#define XFORM_K_TILE(t)
#endif
#if PAGED == 2
    {   // -- the gather producer (see the header). Thread tid copies chunks q8, q8 + 8, .. of rows r0 + 16 i
        //    (r0 = tid / 8) of every tile; warp w's 4 x ROWS rows are 4 w + a + 16 i (a < 4): lane a + 4 i
        //    looks row 4 w + a + 16 i up (its page id, loaded a tile ahead) and the copying threads take its
        //    row id by shuffle, so a thread keeps one page id in registers, not ROWS
      constexpr int TPR = 8, ROW_STEP = 128 / TPR, ROWS = BLOCK_N / ROW_STEP;
      static_assert(4 * ROWS <= 32, "a warp's rows: one per lane");
      const int lane = tid % 32, q8 = tid % TPR, r0 = tid / TPR, a = lane / TPR;
      const int my_r = (tid / 32) * 4 + lane % 4 + ROW_STEP * ((lane / 4) % ROWS);   // the row this lane looks up
      const uint8_t* kb = k_cache + kvh * k_s_head;
      const uint8_t* vb = v_cache + kvh * v_s_head;
      int pg = 0;                            // the page of row my_r of the next tile (its load in flight)
      const auto load_page = [&](int t) {
        const int key = kv_lo + t * BLOCK_N + my_r;
        pg = key < kv_len ? __ldg(pages + (page_shift >= 0 ? key >> page_shift : key / page_size)) : 0;
      };
      // -- this thread's rows (row ids by shuffle, -1 past the end: zero-filled) of a tile into buffer sb,
      //    ch 16-byte chunks a row (D_QK or D_VO / 8)
      const auto copy_rows = [&](uint32_t sb, const uint8_t* base, int64_t s_row, int row_id, const int ch) {
#pragma unroll GATHER_ROWS                   // (1: a rolled loop in the producer's 40 registers; > 1: 56)
        for (int i = 0; i < ROWS; ++i) {
          const int r = r0 + ROW_STEP * i, rid = __shfl_sync(0xffffffffu, row_id, a + 4 * i);
          const uint8_t* src = rid >= 0 ? base + int64_t(rid) * s_row : base;
#pragma unroll
          for (int j = 0; j < ch / TPR; ++j)
            cp_async_16(sb + swz128(BLOCK_N, r, q8 + TPR * j), src + 16 * (q8 + TPR * j), rid >= 0 ? 16 : 0);
        }
      };
      if (num_tiles > 0) load_page(0);
      for (int t = 0; t < num_tiles; ++t) {
        const int s = t % STAGES;
        const uint32_t ph = (t / STAGES) & 1;
        const int key = kv_lo + t * BLOCK_N + my_r;
        const int row_id = key < kv_len ? pg * page_rows + (page_shift >= 0 ? key & (page_size - 1) : key % page_size)
                                        : -1;
        if (t + 1 < num_tiles) load_page(t + 1);
        mbar_wait(EMPTY_K(s), ph ^ 1);
        copy_rows(sK + s * K_TILE_BYTES, kb, k_s_row, row_id, D_QK / 8);
        cp_async_mbar_arrive_noinc(FULL_K(s));
        mbar_wait(EMPTY_V(s), ph ^ 1);
        copy_rows(sV + s * V_TILE_BYTES, vb, v_s_row, row_id, D_VO / 8);
        cp_async_mbar_arrive_noinc(FULL_V(s));
        XFORM_K_TILE(t);                     // (warps 1..3 with a key transform: after their copies of tile t)
      }
    }
#else
    if (tid == 0) {
      for (int t = 0; t < num_tiles; ++t) {
        const int s = t % LOAD_STAGES;
        const uint32_t ph = (t / LOAD_STAGES) & 1;
        const int tok = kv_base + kv_lo + t * BLOCK_N;
#if PAGED
        // -- the tile's boxes: page_box keys each, from their pages (past the end: the last page, slot 0).
        //    Every page id is loaded before the first box is issued (the loads overlap; each TMA issue
        //    is ordered after them), and K and V share them.
        int page[MAX_BOXES];                 // the producer runs in 40 registers: slots are recomputed
#pragma unroll
        for (int j = 0; j < MAX_BOXES; ++j) {
          const int k_in = min(tok + j * page_box, kv_len - 1);
          page[j] = j * page_box < BLOCK_N ? pages[page_shift >= 0 ? k_in >> page_shift : k_in / page_size] : 0;
        }
#define PAGED_BOXES(buf, map, bar, L)                                                             \
  _Pragma("unroll") for (int j = 0; j < MAX_BOXES; ++j)                                           \
    if (j * page_box < BLOCK_N) {                                                                 \
      const int key = tok + j * page_box;                                                         \
      const int slot = key < kv_len ? (page_shift >= 0 ? key & (page_size - 1) : key % page_size) : 0; \
      _Pragma("unroll") for (int h = 0; h < L::BLOCKS; ++h)                                          \
          tma_load_4d((buf) + h * L::BLOCK_BYTES + j * page_box * L::ROW_BYTES, &(map), h * L::COLS, slot, kvh, \
                      page[j], (bar));                                                                     \
    }
        mbar_wait(LOAD_FREE_K(s), ph ^ 1);
        mbar_arrive_expect_tx(LOAD_BAR_K(s), LoadK::BYTES);
        PAGED_BOXES(LOAD_DST_K(s), tmap_k, LOAD_BAR_K(s), LoadK)
        mbar_wait(LOAD_FREE_V(s), ph ^ 1);
        mbar_arrive_expect_tx(LOAD_BAR_V(s), LoadV::BYTES);
        PAGED_BOXES(LOAD_DST_V(s), tmap_v, LOAD_BAR_V(s), LoadV)
#undef PAGED_BOXES
#else
        mbar_wait(LOAD_FREE_K(s), ph ^ 1);
        mbar_arrive_expect_tx(LOAD_BAR_K(s), LoadK::BYTES);
#pragma unroll
        for (int h = 0; h < LoadK::BLOCKS; ++h)
          tma_load_3d(LOAD_DST_K(s) + h * LoadK::BLOCK_BYTES, &tmap_k, h * LoadK::COLS, tok, kvh, LOAD_BAR_K(s));
        mbar_wait(LOAD_FREE_V(s), ph ^ 1);
        mbar_arrive_expect_tx(LOAD_BAR_V(s), LoadV::BYTES);
#pragma unroll
        for (int h = 0; h < LoadV::BLOCKS; ++h)
          tma_load_3d(LOAD_DST_V(s) + h * LoadV::BLOCK_BYTES, &tmap_v, h * LoadV::COLS, tok, kvh, LOAD_BAR_V(s));
#endif
      }
    }
#if KV_FP8
    else if (tid >= 32) {
      // -- converters (warps 1..3): staged fp8 tile t -> 16-bit buffer t % STAGES once the consumers have
      //    released it; K then V, each published on its "full" barrier (generic stores -> wgmma reads)
      const int ct = tid - 32, lane = tid % 32;
      for (int t = 0; t < num_tiles; ++t) {
        const int s8 = t % LOAD_STAGES, s = t % STAGES;
        const uint32_t ph8 = (t / LOAD_STAGES) & 1, ph = (t / STAGES) & 1;
        mbar_wait(LOADED_K(s8), ph8);
        mbar_wait(EMPTY_K(s), ph ^ 1);
        convert_fp8_tile<D_QK>(sK8 + s8 * LoadK::BYTES, sK + s * K_TILE_BYTES, ct, BLOCK_N);   // keys past the end: masked in S
        fence_proxy_async();
        __syncwarp();
        if (lane == 0) {
          mbar_arrive(FULL_K(s));
          mbar_arrive(FREE_K(s8));
        }
        mbar_wait(LOADED_V(s8), ph8);
        mbar_wait(EMPTY_V(s), ph ^ 1);
        convert_fp8_tile<D_VO>(sV8 + s8 * LoadV::BYTES, sV + s * V_TILE_BYTES, ct,
                               kv_len - (kv_lo + t * BLOCK_N));   // V rows past the end: zeros
        fence_proxy_async();
        __syncwarp();
        if (lane == 0) {
          mbar_arrive(FULL_V(s));
          mbar_arrive(FREE_V(s8));
        }
      }
    }
#endif
#if CUATTN_VARIANT_ROPE || CUATTN_VARIANT_QK
    else if (K_XFORM && tid >= 128 - XFORM_THREADS) {
      for (int t = 0; t < num_tiles; ++t) xform_k_tile(t);
    }
#endif
#endif   // PAGED == 2
#undef XFORM_K_TILE
    return;
  }

  // -------------------------------------------------------------------- consumers
  setmaxnreg_inc<CONSUMER_REGS>();
  const int wg = tid / 128 - 1;            // consumer 0 | 1: rows wg * 64 ..
  const int wt = tid % 128;
  const int warp = wt / 32, lane = tid % 32;
  const int g = lane / 4, t4 = lane % 4;

  // -- stage this warpgroup's 64 Q rows (rows past the request are zeros)
  {
    constexpr int CHUNKS = D_QK / 8;       // 16-byte chunks per row
#pragma unroll
    for (int j = 0; j < WG_ROWS * CHUNKS / 128; ++j) {
      const int r = wg * WG_ROWS + (wt + 128 * j) / CHUNKS, c = (wt + 128 * j) % CHUNKS;
      const int pr = row0 + r;
      const bool ok = pr < packed_rows;
      const dtype_t* src = ok ? q + (q_base + pr / group) * q_s_tok + (kvh * group + pr % group) * q_s_head + c * 8 : q;
      cp_async_16(sQ + swz128(BLOCK_M, r, c), src, ok ? 16 : 0);
    }
    cp_async_commit();
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
          return variant::query_transform(vp, x, j, req, pr / group + causal_shift, kvh * group + pr % group);
        });
#endif
    }
#endif
    fence_proxy_async();                   // cp.async (and transform) writes -> wgmma reads
    named_barrier(1 + wg, 128);
  }

  // -- the call's key scale (read after the PDL wait: a previous kernel may write it): folded into the
  //    softmax scale, or (a logits transform, no softmax) multiplied into the raw dot products
  constexpr bool K_FIRST = variant::HAS_TRANSFORM || !variant::USE_SOFTMAX;
  float k_fac = k_scale * FP8_FACTOR;
  if (k_scales != nullptr) k_fac *= k_scales[(scale_per_head & 1) ? kvh : 0];
  const float qk_scale_log2 = K_FIRST ? scale_log2 : scale_log2 * k_fac;

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
  auto issue_qk = [&](float (&s)[S_REGS], int t) {
    const uint32_t sKs = sK + (t % STAGES) * K_TILE_BYTES;
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
    const uint32_t sVs = sV + (t % STAGES) * V_TILE_BYTES;
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < BLOCK_N / 16; ++kk)
      wgmma_m64k16_rs_tb<D_VO, mma_t>(acc, p[kk], wgmma_desc(sVs + kk * 16 * 128, HALF_BYTES, 1024));
    wgmma_commit();
  };
  // -- tile t of S: the variant's logits transform (every tile) and the masks (causal on diagonal
  //    tiles, the window below kv_full, a variant mask on every tile)
  auto mask_tile = [&](float (&s)[S_REGS], int t) {
    if (K_FIRST) {                         // -- the key scale before a transform (raw dot products)
#pragma unroll
      for (int i = 0; i < S_REGS; ++i) s[i] *= k_fac;
    }
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
            s[4 * n + 2 * h + e] = variant_transform(vp, rs[h], s[4 * n + 2 * h + e], req, qpos, qpos + causal_shift,
                                                     kv0 + n * 8 + 2 * t4 + e, kvh * group + pr % group, kvh, qo_len,
                                                     kv_len);
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
            s[4 * n + 2 * h + e] = variant_score(vp, rs[h], s[4 * n + 2 * h + e], req, qpos, qpos + causal_shift, kpos,
                                                 kvh * group + pr % group, kvh, qo_len, kv_len, row_lo);
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
      corr[h] = online_softmax_row<BLOCK_N / 4>([&](int k) { return s[4 * (k >> 1) + 2 * h + (k & 1)]; },
                                                [&](int k, float p) { s[4 * (k >> 1) + 2 * h + (k & 1)] = p; },
                                                m_i[h], l_i[h], qk_scale_log2);
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
      mbar_wait(K_LANDED(0), 0);
      if (PAGED == 2) fence_proxy_async();   // cp.async stores -> wgmma reads
      turn_wait();
      issue_qk(s, 0);
      turn_pass(false);
      wgmma_wait<0>();
      wgmma_fence_regs(s);
      release(EMPTY_K(0));
      mask_tile(s, 0);
      softmax(s, corr);
      pack_p(s);
    }
    for (int t = 1; t < num_tiles; ++t) {
      float s[S_REGS], corr[2];
      const int ps = (t - 1) % STAGES;
      mbar_wait(K_LANDED(t % STAGES), (t / STAGES) & 1);
      if (PAGED == 2) fence_proxy_async();
      turn_wait();
      issue_qk(s, t);
      mbar_wait(FULL_V(ps), ((t - 1) / STAGES) & 1);
      if (PAGED == 2) fence_proxy_async();
      issue_pv(t - 1);
      turn_pass(false);
      wgmma_wait<1>();                     // S(t) has landed; P(t-1) V(t-1) may still run
      wgmma_fence_regs(s);
      release(EMPTY_K(t % STAGES));
      mask_tile(s, t);
      softmax(s, corr);
      wgmma_wait<0>();
      wgmma_fence_regs(acc);
      release(EMPTY_V(ps));
      rescale_o(corr);
      pack_p(s);
    }
    const int lt = num_tiles - 1;
    mbar_wait(FULL_V(lt % STAGES), (lt / STAGES) & 1);
    if (PAGED == 2) fence_proxy_async();
#if PAGED == 1 && !KV_FP8   // (fp8: the converters zero them; gather: its copies)
    {   // -- V rows past the request's end hold whatever the cache holds: zeros before P.V (both
        //    consumer warpgroups write the same zeros; each reads after its own writes and barrier)
      const int valid = kv_len - (kv_lo + lt * BLOCK_N);
      if (valid < BLOCK_N) {
        const uint32_t sVs = sV + (lt % STAGES) * V_TILE_BYTES;
        for (int i = wt; i < (BLOCK_N - valid) * (D_VO / 8); i += 128) {
          const int r = valid + i / (D_VO / 8), c = i % (D_VO / 8);      // row, 16-byte chunk (any order within a row)
          asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(sVs + (c / 8) * HALF_BYTES + r * 128 + (c % 8) * 16),
                       "r"(0) : "memory");
        }
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
    release(EMPTY_V(lt % STAGES));
  }

  allow_next_grid();    // only the epilogue is left: the next kernel may start its prologue

  // -- epilogue: O / l, natural-log LSE; fully masked rows give 0 and -inf. A piece of a split item
  //    writes its fp32 partial row instead (the sink joins piece 0 alone)
  const ItemEnd item = item_end(work);
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
      store_partial_row<D_VO>(part_o, part_lse, (int64_t(item.slot) * gridDim.y + kvh) * BLOCK_M + (pr - row0), t4,
                              scaled(finish_row(vp, m_i[h], l, req, pr / group, head, item.with_sink)), pair);
    else
      store_output_row<D_VO>(o, o_s_tok, o_s_head, lse, num_qo_heads, q_base + pr / group, head, t4,
                             scaled(finish_row(vp, m_i[h], l, req, pr / group, head, true)), pair);
  }
#undef FULL_K
#undef FULL_V
#undef EMPTY_K
#undef EMPTY_V
#undef LOADED_K
#undef LOADED_V
#undef FREE_K
#undef FREE_V
#undef LOAD_DST_K
#undef LOAD_DST_V
#undef LOAD_BAR_K
#undef LOAD_BAR_V
#undef LOAD_FREE_K
#undef LOAD_FREE_V
#undef READY_K
#undef K_LANDED
}

extern "C" __global__ void __launch_bounds__(128) cuattn_prefill_sm90_merge(
    const int32_t* __restrict__ merge,       // [num_merge, MERGE_COLS] (request, tile, first slot, pieces)
    const int32_t* __restrict__ qo_indptr, const float* __restrict__ part_o, const float* __restrict__ part_lse,
    dtype_t* __restrict__ o, float* __restrict__ lse, int group, int64_t o_s_tok, int64_t o_s_head) {
  merge_pieces<D_VO, BLOCK_M>(merge, qo_indptr, part_o, part_lse, o, lse, group, o_s_tok, o_s_head);
}
