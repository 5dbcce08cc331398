// prefill_sm90_layout.cuh — prefill_sm90.cu's compile-time layout: its tuning defaults, the tile geometry
// (all of it from HEAD_DIM_QK, HEAD_DIM_VO, BLOCK_N, STAGES, KV_FP8), the producer / consumer register split,
// the shared-memory map (tiles and mbarriers: Smem) and the addressing of a swizzled tile in smem.
// Not a common header: it reads the kernel's -D defines; the producers (prefill_sm90_tma_load.cuh,
// prefill_sm90_gather.cuh, prefill_sm90_fp8.cuh) and the kernel build on it.
#pragma once
#include "common/dtypes.cuh"
#include "common/prefill_tile.cuh"
#include "common/variant.cuh"
#ifndef PAGED
#define PAGED 0
#endif
#ifndef NUM_CONSUMERS       // consumer warpgroups, 64 query rows each: 2 (BLOCK_M 128, one CTA per SM) or 1 (BLOCK_M 64,
#define NUM_CONSUMERS 2     // two CTAs per SM whose GEMMs and softmaxes interleave: requests of at most 64 packed rows)
#endif
#ifndef PINGPONG            // the consumer warpgroups take turns issuing their GEMMs (named barriers 4, 5; 0: free-running)
#define PINGPONG (NUM_CONSUMERS == 2)
#endif
#ifndef PERSISTENT          // 1: a grid of at most one CTA per SM, each looping over work items (blockIdx.x, + gridDim.x,
#define PERSISTENT 0        // ..) with its stages and barrier phases running on across them, so the producer loads the
#endif                      // next item's first tiles while the consumers finish one (16-bit K/V)
#ifndef PERSIST_ORDER       // PERSISTENT: the order of the items the CTAs take in turns (prefill_sm90.cu for_each_item_of):
#define PERSIST_ORDER (CAUSAL ? 1 : 2)   // 1 kv head fastest, 2 work item fastest
#endif
#ifndef PERSIST_DYNAMIC     // PERSISTENT, batch mode: the CTAs take items from a global counter as they free up (0: in
#define PERSIST_DYNAMIC 1   // turns, a fixed schedule: prefill_sm90.cu for_each_item_of)
#endif
#ifndef FP8_RING            // PAGED == 2 with fp8 K/V: 0 the rows through registers; n > 0 the rows copied by cp.async into
#define FP8_RING 0          // a ring of n fp8 tiles (K and V) ahead of their conversion (prefill_sm90_gather_fp8.cuh)
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
// fp8 K/V -> f16: common/dtypes.cuh fp8_chunk (FP8_HW_CVT); its factor joins the k / v scales
constexpr float FP8_FACTOR = fp8_factor(KV_FP8);
#define NEG_INF __int_as_float(0xff800000)

// -- tile geometry, all of it from HEAD_DIM_QK, HEAD_DIM_VO, BLOCK_N and STAGES (prefill_sm90.py
//    Sm90PrefillSpec.smem_bytes mirrors SMEM_BYTES)
constexpr int D_QK = HEAD_DIM_QK;                   // q / K columns: S = Q K^T over D_QK / 16 k-steps
constexpr int D_VO = HEAD_DIM_VO;                   // V / out columns: O is m64n{D_VO}, D_VO / 2 floats per thread
constexpr int WG_ROWS = 64;                         // rows per consumer warpgroup (wgmma m64)
static_assert(NUM_CONSUMERS == 1 || NUM_CONSUMERS == 2, "prefill_sm90: one or two consumer warpgroups");
static_assert(!(PINGPONG && NUM_CONSUMERS == 1), "prefill_sm90: ping-pong needs two consumer warpgroups");
constexpr int BLOCK_M = WG_ROWS * NUM_CONSUMERS;
constexpr int NUM_THREADS = 128 * (NUM_CONSUMERS + 1);
constexpr int CTAS_PER_SM = NUM_CONSUMERS == 2 ? 1 : 2;   // (shared memory: 227 KiB, or 113 KiB each)
constexpr int ENTRY_REGS = 65536 / (NUM_THREADS * CTAS_PER_SM) / 8 * 8;   // a thread's registers at launch: 168 | 128
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
// what is left of 3 x 168 (the entry count at 384 threads): 232 plain, 224, 208, 200 (one consumer, two CTAs per SM: what is
// left of 2 x 128)
constexpr int GATHER_ROWS = GATHER_UNROLL > 0 ? GATHER_UNROLL : D_QK <= 128 && !K_XFORM ? 8 : 1;
// (the fp8 gather's ring (FP8_RING) holds nothing in registers between a copy and its conversion: 56, consumers 224;
// its register form, prefill_sm90_gather_fp8.cuh, holds a tile's rows in flight: 104, consumers 200; a count where no spec
// spilled (f16 / bf16 q, causal or not, e4m3 / e5m2, head_dim 64 / 128): ptxas's allocation in the setmaxnreg region
// moves non-monotonically with the count, tests/test_prefill_fp8_gather.py checks. PERSISTENT: the e4m3 producer at
// head_dim 128 spills 36 bytes at 104; at 112 the causal consumers (192) spill 4 and ran slower on an H100, as did the
// spill-free byte-trick conversion: prefill_sm90.py Sm90PrefillSpec.spill_bytes)
// (PERSISTENT: the item loop's state too, thread 0's item fetch (PERSIST_DYNAMIC): the RoPE gather 112 and boxes 104, TMA
// boxes 56, where 104 / 88 / 40 spilled; a mask variant's
// gather 48: the causal custom mask's spilled 76 bytes at 56 since the item loop, none at 40 or 48)
static_assert(FP8_RING == 0 || (PAGED == 2 && KV_FP8), "FP8_RING: the fp8 gather's cp.async ring");
constexpr int PRODUCER_REGS = PAGED == 2 && KV_FP8 ? (FP8_RING ? 56 : 104)
                            : CUATTN_VARIANT_ROPE ? (PERSISTENT && PAGED == 2 ? 112 : PERSISTENT && PAGED ? 104 : 88)
                            : PERSISTENT && PAGED == 1 ? 56
                            : PAGED == 2 && GATHER_ROWS > 1 && variant::HAS_MASK && !K_XFORM ? 48
                            : (K_XFORM || (PAGED == 2 && GATHER_ROWS > 1)) ? 56 : 40;
constexpr int CONSUMER_REGS = ((NUM_CONSUMERS + 1) * ENTRY_REGS - PRODUCER_REGS) / NUM_CONSUMERS / 8 * 8;
// V rows past the request's end hold what the cache holds (the TMA box producer; the fp8 gather's row 0; contiguous K/V:
// the next request's rows in a ragged batch, or whatever follows the last one in the buffer): the consumers zero them
// before the last P.V, so a NaN or inf there cannot reach another request's output as 0 x NaN (the TMA-staged fp8
// converters and the 16-bit gather write zeros there themselves)
#define ZERO_V_TAIL ((PAGED != 2 && !KV_FP8) || (PAGED == 2 && KV_FP8))
constexpr int MAX_BOXES = BLOCK_N / 16;             // PAGED: TMA boxes per tile at the smallest page (16)
constexpr int CONVERT_WARPS = 3;                    // FP8_STAGED: producer warps 1..3
// fp8 K/V staged by the TMA and converted smem -> smem (prefill_sm90_fp8.cuh); the gather (PAGED 2) converts
// fp8 rows in registers on their way from global memory into the 16-bit tiles instead (no staging tiles)
constexpr bool FP8_STAGED = KV_FP8 && PAGED != 2;
constexpr int LOAD_STAGES = STAGES;                 // fp8 staging buffers per K and per V (FP8_STAGED)
// -- how the TMA lands a K tile (DIM = D_QK) or a V tile (DIM = D_VO): FP8_STAGED, an fp8 staging tile that
//    CONVERT_WARPS warps of the producer warpgroup convert (boxes of min(DIM, 128) byte-columns, a swizzle
//    of as many bytes); otherwise the 16-bit tile itself (64 columns, 128-byte swizzle)
template <int DIM>
struct LoadTile {
  static constexpr int COLS = FP8_STAGED ? (DIM < 128 ? DIM : 128) : 64;   // elements per box row
  static constexpr int ROW_BYTES = FP8_STAGED ? COLS : 128;
  static constexpr int BLOCKS = DIM / COLS;                             // column blocks (boxes per row)
  static constexpr uint32_t BLOCK_BYTES = BLOCK_N * ROW_BYTES;
  static constexpr uint32_t BYTES = BLOCKS * BLOCK_BYTES;
  static_assert(DIM % COLS == 0 && (COLS == 64 || COLS == 128),
                "fp8 K/V: head_dim 64 or a multiple of 128 (one fp8 box is 64 or 128 bytes wide)");
};
typedef LoadTile<D_QK> LoadK;
typedef LoadTile<D_VO> LoadV;
static_assert(FP8_STAGED || (LoadK::BYTES == K_TILE_BYTES && LoadV::BYTES == V_TILE_BYTES), "16-bit: the TMA fills the tiles");
// -- shared memory (Smem below): Q, STAGES 16-bit K and V tiles, (FP8_STAGED) LOAD_STAGES fp8 K and V staging
//    tiles, the mbarriers
// PERSISTENT: ITEM_SLOTS items handed from the producer to the consumers (Item, 64 bytes each, after the mbarriers),
// each with a "published" and a "read" mbarrier
constexpr int ITEM_SLOTS = PERSISTENT ? 2 : 0;
constexpr uint32_t ITEM_SLOT_BYTES = 64;
constexpr int NUM_BARS = 4 * STAGES + (FP8_STAGED ? 4 * LOAD_STAGES : K_XFORM ? STAGES : 0) + 2 * ITEM_SLOTS;
constexpr uint32_t RING_K_BYTES = BLOCK_N * D_QK, RING_V_BYTES = BLOCK_N * D_VO;   // FP8_RING: an fp8 tile each
constexpr uint32_t SMEM_BYTES = 1024 + Q_BYTES + STAGES * (K_TILE_BYTES + V_TILE_BYTES) +
                                (FP8_STAGED ? LOAD_STAGES * (LoadK::BYTES + LoadV::BYTES) : 0) +
                                FP8_RING * (RING_K_BYTES + RING_V_BYTES) + 8 * NUM_BARS + ITEM_SLOTS * ITEM_SLOT_BYTES;

static_assert(D_QK % 64 == 0 && D_QK <= 256 && D_VO % 64 == 0 && D_VO <= D_QK,
              "prefill_sm90: head dims of whole 64-column blocks, V's at most K's (split-KV rows: head_dim_qk floats)");
static_assert(BLOCK_N == 64 || BLOCK_N == 128, "prefill_sm90: S is wgmma m64n64 or m64n128");
static_assert(S_REGS + O_REGS <= 160, "prefill_sm90: S and O accumulators must leave registers for P and the rest");
static_assert(STAGES >= 2, "the pipeline needs two stages");
static_assert(!(PERSISTENT && FP8_STAGED), "prefill_sm90: PERSISTENT with 16-bit K/V or the fp8 gather (the TMA-staged converters count tiles from 0)");
static_assert(!(PAGED == 2 && CUATTN_VARIANT_ROPE && D_QK == 256),
              "the gather producer with the RoPE transform at head_dim 256 spills in the producer's 88 registers");
static_assert(CTAS_PER_SM == 1 || SMEM_BYTES <= 113 * 1024, "prefill_sm90: two CTAs per SM take 113 KiB each at most");
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

// -- shared memory from the 1024-aligned base: Q, STAGES 16-bit K and V tiles, (FP8_STAGED) LOAD_STAGES fp8 K and V
//    staging tiles, then the mbarriers (8 bytes each): fullK, fullV, emptyK, emptyV: STAGES each; readyK
//    (K_XFORM): STAGES (the 16-bit tiles: written, released by the consumers); FP8_STAGED: loadedK, loadedV, freeK,
//    freeV: LOAD_STAGES each (the staging tiles: landed, read by the converters)
struct Smem {
  uint32_t q, k, v;                        // Q, the 16-bit K and V tiles
  uint32_t k8, v8;                         // FP8_STAGED: the fp8 staging tiles; FP8_RING: the ring's fp8 tiles
  uint32_t bars;
  __device__ __forceinline__ explicit Smem(uint32_t base)
      : q(base), k(q + Q_BYTES), v(k + STAGES * K_TILE_BYTES), k8(v + STAGES * V_TILE_BYTES),
        v8(k8 + (FP8_STAGED ? LOAD_STAGES * LoadK::BYTES : FP8_RING * RING_K_BYTES)),
        bars(v8 + (FP8_STAGED ? LOAD_STAGES * LoadV::BYTES : FP8_RING * RING_V_BYTES)) {}
  __device__ __forceinline__ uint32_t full_k(int s) const { return bars + 8 * s; }
  __device__ __forceinline__ uint32_t full_v(int s) const { return bars + 8 * (STAGES + s); }
  __device__ __forceinline__ uint32_t empty_k(int s) const { return bars + 8 * (2 * STAGES + s); }
  __device__ __forceinline__ uint32_t empty_v(int s) const { return bars + 8 * (3 * STAGES + s); }
  __device__ __forceinline__ uint32_t loaded_k(int s) const { return bars + 8 * (4 * STAGES + s); }
  __device__ __forceinline__ uint32_t loaded_v(int s) const { return bars + 8 * (4 * STAGES + LOAD_STAGES + s); }
  __device__ __forceinline__ uint32_t free_k(int s) const { return bars + 8 * (4 * STAGES + 2 * LOAD_STAGES + s); }
  __device__ __forceinline__ uint32_t free_v(int s) const { return bars + 8 * (4 * STAGES + 3 * LOAD_STAGES + s); }
  // K_XFORM (never with KV_FP8: it takes loadedK's slots): the K tile transformed; k_landed: what the
  // consumers' S wgmma waits on
  __device__ __forceinline__ uint32_t ready_k(int s) const { return bars + 8 * (4 * STAGES + s); }
  __device__ __forceinline__ uint32_t k_landed(int s) const { return K_XFORM ? ready_k(s) : full_k(s); }
  // PERSISTENT: item slot n's barriers (the last 2 ITEM_SLOTS) and its bytes (after every barrier)
  __device__ __forceinline__ uint32_t item_full(int n) const { return bars + 8 * (NUM_BARS - 2 * ITEM_SLOTS + n); }
  __device__ __forceinline__ uint32_t item_read(int n) const { return bars + 8 * (NUM_BARS - ITEM_SLOTS + n); }
  __device__ __forceinline__ uint32_t item_slot(int n) const { return bars + 8 * NUM_BARS + n * ITEM_SLOT_BYTES; }
  // -- where the TMA lands stage s, the barrier it completes, the one that frees its buffer (KV_FP8: the
  //    staging tiles and their loaded / free barriers when FP8_STAGED; otherwise the 16-bit tiles and full / empty)
  __device__ __forceinline__ uint32_t load_dst_k(int s) const {
    return FP8_STAGED ? k8 + s * LoadK::BYTES : k + s * K_TILE_BYTES;
  }
  __device__ __forceinline__ uint32_t load_dst_v(int s) const {
    return FP8_STAGED ? v8 + s * LoadV::BYTES : v + s * V_TILE_BYTES;
  }
  __device__ __forceinline__ uint32_t load_bar_k(int s) const { return FP8_STAGED ? loaded_k(s) : full_k(s); }
  __device__ __forceinline__ uint32_t load_bar_v(int s) const { return FP8_STAGED ? loaded_v(s) : full_v(s); }
  __device__ __forceinline__ uint32_t load_free_k(int s) const { return FP8_STAGED ? free_k(s) : empty_k(s); }
  __device__ __forceinline__ uint32_t load_free_v(int s) const { return FP8_STAGED ? free_v(s) : empty_v(s); }
};
