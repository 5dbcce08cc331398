// prefill_sm90_gather_fp8.cuh — the fa3 gather producer's fp8 loop (PAGED == 2 with an fp8 cache; prefill_sm90_gather.cuh
// calls fp8_gather_tiles, its page-id machinery shared). A row's address is one 32 x 32 -> 64-bit multiply-add, shared
// addresses a per-thread constant plus immediates, row ids by shuffles with immediate operands, the cvt reads the high
// fp8 pair in place (dtypes.cuh fp8_chunk_halves: no shift a pair), no per-row predicates (rows past the request's end
// read row 0, an address of the cache: K's are masked in S, V's zeroed by the consumers, ZERO_V_TAIL); 16-byte loads at
// head_dim 128 (8-byte at 64: the launch checks the fp8 cache's pointers and byte strides are multiples of 16); each row
// reloaded with the next (K or V) tile's as soon as it is stored, so a tile's load latency overlaps the previous one's
// conversion, and tile 0's V rows copied as fp8 by cp.async beside its K loads (PERSISTENT: no such peel; the stages run
// on across a CTA's items, tile t of an item is the CTA's tile tb + t, as the 16-bit gather's). Chosen by an H100 A/B of 7 variants
// (benchmarks/results/prefill_sm90_notes.md, session 17; the others, 8-byte loads at hd128, other load orders, the shipped
// loop before it, L1::no_allocate, are in git history at 3165f91). Producer registers: prefill_sm90_layout.cuh.
// FP8_RING n > 0 (head_dim 128, prefill_sm90.py ring): the rows are not held in registers between a load and its
// conversion but copied as fp8 by cp.async (the tile-0 staging below, for every tile) into a ring of n K + V tiles, n
// tiles ahead; a thread reads back only its own copies (after its cp.async.wait_group), so no barrier. Up to n tiles a
// CTA in flight against the register form's half tile: on an H100 0.81-0.98x its time at every shape, most where few
// query tiles share the keys (prefill_sm90_notes.md, session 22).
#pragma once
#include "common/dtypes.cuh"
#include "common/mma.cuh"
#include "common/tma.cuh"
#include "prefill_sm90_layout.cuh"

#if PAGED == 2 && KV_FP8
// -- the rows: a thread's row i of a tile (row r0 + 16 i, r0 = 4 w + a) is LOADS loads of VEC bytes from one
//    row address (row id x the 32-bit slot stride + the thread's first byte: one IMAD.WIDE.U32), each 8-byte fp8 piece
//    converted into one 16-byte chunk store at a per-thread shared offset plus immediates (r0 + 16 i keeps r0's
//    swizzle). VEC 8: lane = 8 a + c, chunks c + 8 j (head_dim 64); VEC 16 (head_dim 128): 16-bit chunks 2 p and
//    2 p + 1 a load, and each quarter warp takes 4 pieces of each of two rows of opposite swizzle parity, so its 16-byte
//    stores hit 8 distinct bank groups (8 lanes of one row would take only the even, then the odd ones: 2-way conflicts)
// -- p as a value the compiler cannot take apart (it re-associates base + piece + row offset into three adds)
__device__ __forceinline__ const uint8_t* opaque(const uint8_t* p) {
  asm("" : "+l"(p));
  return p;
}
struct Fp8Gather {
  static constexpr int VEC = D_QK == 128 ? 16 : 8;   // bytes a load
  static constexpr int LOADS = D_QK / (8 * VEC);   // loads a row (8 threads a row)
  static constexpr int HALVES = VEC / 8;           // 8-byte pieces a load: one 16-byte chunk of the 16-bit tile each
  static constexpr int WORDS = LOADS * VEC / 4;    // registers a row
  static constexpr int ROWS = BLOCK_N / 16;        // rows a thread (16 at a time)
  static constexpr int STAGE_BAR = 6;              // tile 0's staging: a named barrier of the producer warps (1, 2:
                                                   // consumers' own; 3: key transforms; 4, 5: ping-pong)
  static_assert(D_QK == D_VO && LOADS * 8 * VEC == D_QK, "fp8 gather: K and V rows of 64 or 128 bytes");
  // a thread's row in its warp's 4 (rows 4 w + a + 16 i) is a function of the lane bits in SEGMASK (VEC 8: a = lane / 8;
  // 16: a = 2 (lane / 16) + lane / 4 % 2); the other 3 lane bits number the rows i, so lane (lane & SEGMASK) | lane_of(i)
  // looks up row i of every lane with the same a: shfl.idx with that segment mask takes it with immediate operands
  static constexpr uint32_t SEGMASK = VEC == 8 ? 0x18 : 0x14;
  static_assert(ROWS == 8, "fp8 gather: 8 rows a thread (BLOCK_N 128), numbered by the 3 lane bits outside SEGMASK");
  static __device__ __forceinline__ int row_in_warp(int lane) {
    return VEC == 8 ? lane / 8 : 2 * (lane / 16) + (lane / 4) % 2;
  }
  static __host__ __device__ constexpr uint32_t lane_of(int i) { return VEC == 8 ? uint32_t(i) : uint32_t((i & 3) | (i >> 2) << 3); }
  // the row lane `lane` of warp w looks the page up for: 4 w + a + 16 i(lane)
  static __device__ __forceinline__ int lookup_row(int tid) {
    const int lane = tid % 32;
    const int i = VEC == 8 ? lane % 8 : (lane & 3) | ((lane >> 3) & 1) << 2;
    return (tid / 32) * 4 + row_in_warp(lane) + 16 * i;
  }
  // row i's id: from lane (lane & SEGMASK) | lane_of(i) (shfl.sync.idx, c = SEGMASK << 8 | 31: no clamping)
  static __device__ __forceinline__ int row_id(int row, int i) {   // (i: a constant once unrolled)
    int r;
    asm volatile("shfl.sync.idx.b32 %0, %1, %2, %3, -1;\n" : "=r"(r) : "r"(row), "r"(lane_of(i)), "n"(SEGMASK << 8 | 31));
    return r;
  }
  uint32_t piece;                         // the thread's first byte in a row
  uint32_t dst[HALVES];                   // shared offset of the thread's chunk h of load 0 of row 4 w + a
  __device__ __forceinline__ explicit Fp8Gather(int tid) {
    const int lane = tid % 32;
    const int c0 = VEC == 8 ? lane % 8 : 2 * (4 * ((lane / 8) % 2) + lane % 4);   // the 16-bit chunk of its first piece
    piece = 8 * c0;
#pragma unroll
    for (int h = 0; h < HALVES; ++h) dst[h] = swz128(BLOCK_N, (tid / 32) * 4 + row_in_warp(lane), c0 + h);
  }
  // -- the thread's part of row id `rid` (the row of the head at base + piece), slot stride s_row, into x
  __device__ __forceinline__ void load(uint32_t (&x)[WORDS], const uint8_t* base, uint32_t s_row, int rid) const {
    const uint8_t* src = base + uint64_t(uint32_t(rid)) * s_row;
#pragma unroll
    for (int j = 0; j < LOADS; ++j) {
      uint32_t* w = x + j * (VEC / 4);
      if (VEC == 8)
        asm volatile("ld.global.nc.v2.u32 {%0, %1}, [%2];\n" : "=r"(w[0]), "=r"(w[1]) : "l"(src + 8 * VEC * j));
      else
        asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(w[0]), "=r"(w[1]), "=r"(w[VEC / 4 > 2 ? 2 : 0]), "=r"(w[VEC / 4 > 3 ? 3 : 0])
                     : "l"(src + 8 * VEC * j));
    }
  }
  // -- tile 0's V: the thread's part of row id `rid` copied as it is (fp8, cp.async) to staging area st, row i's slot of
  //    the thread (row-major by i, then by thread: a quarter warp reads 8 consecutive pieces back, conflict-free)
  __device__ __forceinline__ void stage(uint32_t st, int tid, int i, const uint8_t* base, uint32_t s_row, int rid) const {
    const uint8_t* src = base + uint64_t(uint32_t(rid)) * s_row;
#pragma unroll
    for (int j = 0; j < LOADS; ++j) {
      const uint32_t dst = st + ((i * LOADS + j) * 128 + tid) * VEC;
      if (VEC == 8)
        asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(dst), "l"(src + 8 * VEC * j) : "memory");
      else
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src + 8 * VEC * j) : "memory");
    }
  }
  // -- ... and read back (after the thread's cp.async.wait_all: its own copies alone, no barrier)
  __device__ __forceinline__ void unstage(uint32_t (&x)[WORDS], uint32_t st, int tid, int i) const {
#pragma unroll
    for (int j = 0; j < LOADS; ++j) {
      const uint32_t a = st + ((i * LOADS + j) * 128 + tid) * VEC;
      uint32_t* w = x + j * (VEC / 4);
      if (VEC == 8)
        asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];\n" : "=r"(w[0]), "=r"(w[1]) : "r"(a) : "memory");
      else
        asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(w[0]), "=r"(w[1]), "=r"(w[VEC / 4 > 2 ? 2 : 0]), "=r"(w[VEC / 4 > 3 ? 3 : 0]) : "r"(a) : "memory");
    }
  }
  // -- x (row i of the thread) converted into the 16-bit tile at sb
  __device__ __forceinline__ void store(const uint32_t (&x)[WORDS], uint32_t sb, int i) const {
#pragma unroll
    for (int j = 0; j < LOADS; ++j)
#pragma unroll
      for (int h = 0; h < HALVES; ++h)
        sts128(sb + dst[h] + i * 16 * 128 + j * HALF_BYTES,
               fp8_chunk_halves<KV_FP8>(x[2 * (j * HALVES + h)], x[2 * (j * HALVES + h) + 1]));
  }
};

// -- tiles 0 .. num_tiles - 1 of a kv head (K rows at kb, V rows at vb: a head's row 0; slot strides ks_row, vs_row)
//    into the 16-bit K / V buffers by producer thread tid; load_page(t) loads tile t's page ids (pg), row_of(t) gives
//    lane's looked-up row id of tile t from them; on_k_tile(t) after tile t's K rows are published
template <class LoadPage, class RowOf, class OnKTile>
__device__ __forceinline__ void fp8_gather_tiles(const Smem& sm, int tid, const uint8_t* kb, const uint8_t* vb,
                                                 uint32_t ks_row, uint32_t vs_row, int num_tiles, int tb,
                                                 LoadPage load_page, RowOf row_of, OnKTile on_k_tile) {
  constexpr int R = Fp8Gather::ROWS, W = Fp8Gather::WORDS;
  const Fp8Gather g(tid);
  const uint8_t* kp = opaque(kb + g.piece);   // (one 64-bit addend: a row address is one IMAD.WIDE.U32)
  const uint8_t* vp = opaque(vb + g.piece);
  const auto publish = [&](uint32_t full) {
    fence_proxy_async();                  // generic stores -> the consumers' wgmma reads
    mbar_arrive(full);
  };
#if FP8_RING
  // -- the ring: tile u's K and V rows copied as fp8 by cp.async (no registers: a thread's own rows, read back by it
  //    alone) into ring slot (tb + u) % FP8_RING, FP8_RING tiles ahead of their conversion, one commit group a tile;
  //    the thread's page id of tile u + 1 loaded when tile u's copies are issued
  const auto issue = [&](int u) {
    if (u < num_tiles) {
      const int row = row_of(u);
      if (u + 1 < num_tiles) load_page(u + 1);
      const int slot = (tb + u) % FP8_RING;
#pragma unroll
      for (int i = 0; i < R; ++i) {
        const int rid = g.row_id(row, i);
        g.stage(sm.k8 + slot * RING_K_BYTES, tid, i, kp, ks_row, rid);
        g.stage(sm.v8 + slot * RING_V_BYTES, tid, i, vp, vs_row, rid);
      }
    }
    cp_async_commit();                    // (past the last tile: an empty group, so the wait below counts alike)
  };
  const auto convert = [&](uint32_t ring_tile, uint32_t tile) {   // the thread's rows of a ring tile -> the 16-bit tile
#pragma unroll
    for (int i = 0; i < R; ++i) {
      uint32_t y[W];
      g.unstage(y, ring_tile, tid, i);
      g.store(y, tile, i);
    }
  };
#pragma unroll
  for (int u = 0; u < FP8_RING; ++u) issue(u);
  for (int t = 0; t < num_tiles; ++t) {
    const int s = (tb + t) % STAGES, slot = (tb + t) % FP8_RING;
    const uint32_t ph = ((tb + t) / STAGES) & 1;
    cp_async_wait<FP8_RING - 1>();        // the thread's copies of tile t
    mbar_wait(sm.empty_k(s), ph ^ 1);
    convert(sm.k8 + slot * RING_K_BYTES, sm.k + s * K_TILE_BYTES);
    publish(sm.full_k(s));
    on_k_tile(t);
    mbar_wait(sm.empty_v(s), ph ^ 1);
    convert(sm.v8 + slot * RING_V_BYTES, sm.v + s * V_TILE_BYTES);
    publish(sm.full_v(s));
    issue(t + FP8_RING);                  // the slot just read, refilled
  }
#else
  int rid[R];                             // the row ids of the thread's rows of the tile being loaded
  int cur = 0;                            // PERSISTENT: the lane's looked-up row id of that tile; V's row ids shuffled
                                          // from it again (8 fewer live registers: rid's spilled the producer)
  uint32_t x[R][W];                       // its rows in flight
  // -- each row reloaded as soon as it is stored: K(t) -> V(t) -> K(t + 1)
  int t0 = 0;                             // (tile 0 peeled; PERSISTENT: not, its K rows loaded before the loop while the
                                          // consumers still work through the previous item's tiles in the stages; the
                                          // peel's staging buffer, the last stage's K, may hold the previous item's)
#if PERSISTENT
  if (num_tiles > 0) {
    const int row = row_of(0);
    cur = row;
    if (num_tiles > 1) load_page(1);
#pragma unroll
    for (int i = 0; i < R; ++i) {
      rid[i] = g.row_id(row, i);
      g.load(x[i], kp, ks_row, rid[i]);
    }
  }
#else
  (void)tb;                               // (one item a CTA: its tiles from stage 0)
  if (num_tiles > 0) {
    const int row = row_of(0);
    if (num_tiles > 1) load_page(1);
#pragma unroll
    for (int i = 0; i < R; ++i) {
      rid[i] = g.row_id(row, i);
      g.load(x[i], kp, ks_row, rid[i]);
    }
    // tile 0's V rows copied with its K rows (fp8, cp.async: no registers) into the
    const uint32_t stg = sm.k + (STAGES - 1) * K_TILE_BYTES;   // last stage's K buffer (first written by tile STAGES - 1)
#pragma unroll
    for (int i = 0; i < R; ++i) g.stage(stg, tid, i, vp, vs_row, rid[i]);
    cp_async_commit();
    const int next = num_tiles > 1 ? row_of(1) : 0;   // (page ids of tile 1: loaded before tile 0's rows)
    if (num_tiles > 2) load_page(2);
    mbar_wait(sm.empty_k(0), 1);
#pragma unroll
    for (int i = 0; i < R; ++i) {         // K(0) stored, K(1) loaded behind it (past the last tile: row 0, unused)
      g.store(x[i], sm.k, i);
      rid[i] = g.row_id(next, i);
      g.load(x[i], kp, ks_row, rid[i]);
    }
    publish(sm.full_k(0));
    on_k_tile(0);
    cp_async_wait<0>();                   // (the thread's own copies: it reads back only those)
    mbar_wait(sm.empty_v(0), 1);
#pragma unroll
    for (int i = 0; i < R; ++i) {
      uint32_t y[W];
      g.unstage(y, stg, tid, i);
      g.store(y, sm.v, i);
    }
    publish(sm.full_v(0));
    named_barrier(Fp8Gather::STAGE_BAR, 128);   // each producer thread has read its staged rows: K(STAGES - 1) may land
    t0 = 1;
  }
#endif
  for (int t = t0; t < num_tiles; ++t) {   // x: K(t)'s rows in flight (row ids rid), stage tb + t
    const int s = (tb + t) % STAGES;
    const uint32_t ph = ((tb + t) / STAGES) & 1;
    mbar_wait(sm.empty_k(s), ph ^ 1);
#pragma unroll
    for (int i = 0; i < R; ++i) {
      g.store(x[i], sm.k + s * K_TILE_BYTES, i);
      g.load(x[i], vp, vs_row, PERSISTENT ? g.row_id(cur, i) : rid[i]);
    }
    publish(sm.full_k(s));
    on_k_tile(t);
    const int next = t + 1 < num_tiles ? row_of(t + 1) : 0;
    if (t + 2 < num_tiles) load_page(t + 2);
    mbar_wait(sm.empty_v(s), ph ^ 1);
#pragma unroll
    for (int i = 0; i < R; ++i) {         // (past the last tile: loads of row 0, unused; a conditional load here
      g.store(x[i], sm.v + s * V_TILE_BYTES, i);   // spilled the producer)
      rid[i] = g.row_id(next, i);
      g.load(x[i], kp, ks_row, rid[i]);
    }
    cur = next;
    publish(sm.full_v(s));
  }
#endif
}
#endif
