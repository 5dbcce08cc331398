// prefill_sm90_fp8.cuh — prefill_sm90.cu's fp8 K/V converters (KV_FP8): the TMA loads fp8 K / V tiles (half
// the bytes; boxes of min(D_QK or D_VO, 128) byte-columns, a swizzle of as many bytes: LoadTile) into
// LOAD_STAGES fp8 staging buffers each ("loaded" mbarriers; "free" ones when the converters are done reading).
// Warps 1..3 of the producer warpgroup convert each staged tile into the 16-bit swizzled tile the wgmma path
// reads (common/dtypes.cuh fp8_chunk, FP8_FACTOR joining the scales), V rows past the
// request's end as zeros, then arrive on the "full" mbarrier the consumers wait on (after their release of
// that 16-bit buffer on "empty"), so S and P.V are the 16-bit path's.
#pragma once
#include "common/dtypes.cuh"
#include "common/tma.cuh"
#include "prefill_sm90_layout.cuh"

#if KV_FP8 && PAGED != 2   // (FP8_STAGED; the gather converts fp8 rows in registers: prefill_sm90_gather.cuh)
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
    sts128(dst + swz128(BLOCK_N, r, 2 * c), fp8_chunk<KV_FP8>(x.x, x.y));
    sts128(dst + swz128(BLOCK_N, r, 2 * c + 1), fp8_chunk<KV_FP8>(x.z, x.w));
  }
}

// -- the converter warps (warps 1..3 of the producer warpgroup, tid 32..127): staged fp8 tile t -> 16-bit
//    buffer t % STAGES once the consumers have released it; K then V, each published on its "full" barrier
//    (generic stores -> wgmma reads). Tiles start at key kv_lo + t BLOCK_N; keys >= kv_len: V rows of zeros
__device__ __forceinline__ void fp8_converters(const Smem& sm, int tid, int kv_lo, int kv_len, int num_tiles) {
  const int ct = tid - 32, lane = tid % 32;
  for (int t = 0; t < num_tiles; ++t) {
    const int s8 = t % LOAD_STAGES, s = t % STAGES;
    const uint32_t ph8 = (t / LOAD_STAGES) & 1, ph = (t / STAGES) & 1;
    mbar_wait(sm.loaded_k(s8), ph8);
    mbar_wait(sm.empty_k(s), ph ^ 1);
    convert_fp8_tile<D_QK>(sm.k8 + s8 * LoadK::BYTES, sm.k + s * K_TILE_BYTES, ct, BLOCK_N);   // keys past the end: masked in S
    fence_proxy_async();
    __syncwarp();
    if (lane == 0) {
      mbar_arrive(sm.full_k(s));
      mbar_arrive(sm.free_k(s8));
    }
    mbar_wait(sm.loaded_v(s8), ph8);
    mbar_wait(sm.empty_v(s), ph ^ 1);
    convert_fp8_tile<D_VO>(sm.v8 + s8 * LoadV::BYTES, sm.v + s * V_TILE_BYTES, ct,
                           kv_len - (kv_lo + t * BLOCK_N));   // V rows past the end: zeros
    fence_proxy_async();
    __syncwarp();
    if (lane == 0) {
      mbar_arrive(sm.full_v(s));
      mbar_arrive(sm.free_v(s8));
    }
  }
}
#endif
