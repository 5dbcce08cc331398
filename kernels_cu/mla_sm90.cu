// mla_sm90.cu — launched by cuattn/mla_sm90.py (Sm90MLASpec, PARAMS: mla.cu's parameter list under another
// entry name; tests/test_mla_sm90.py checks the two agree). The Hopper MLA kernel (backend "fa3"; sm_90a only:
// wgmma, mbarriers, setmaxnreg). Split pieces are merged by mla.cu's cuattn_mla_merge (same partial layout).
// Compile-time: DTYPE (cuattn::f16 | cuattn::bf16: q, caches and out); SEESAW (0: the schedule described below,
// "halves"; 1: FlashMLA's seesaw schedule, described at its consumers: the same producer refilling each stage in
// other groups, P in the stages' kpe blocks; mla_sm90.pick_schedule chooses per plan).
// Fixed: head_dim_ckv 512, head_dim_kpe 64, BLOCK_M 64 packed query rows, BLOCK_N 64 keys, 2 key-tile stages.
// Grid (num_work); block 384 (3 warpgroups); dynamic smem 1024 (alignment) + SMEM_BYTES (mla_sm90.py mirrors it).
//
// One CTA = one work item of plan.prefill_work_list (request, query tile, kv piece, partial slot), as mla.cu:
// 64 packed rows (row = token * num_heads + head of the request's queries), keys [kv_lo, kv_end) of the piece.
// FlashMLA's design (deepseek-ai/FlashMLA, sm90 decode), written from its description:
//   - warpgroup 0, the producer: 128 threads gather Q (64 x 576, once) and key tiles (64 tokens x 576 =
//     [ckv 512 | kpe 64]) with 16-byte cp.async through the page table (any page size: a row's page id and
//     slot come from kv_indices), into the 128-byte-swizzled layout wgmma reads: a tile is 9 column blocks
//     of [64 rows][64 elements], chunk c of row r at (c / 8) * 8192 + r * 128 + ((c % 8) ^ (r % 8)) * 16.
//     Keys past the piece are zero-filled (K and V rows 0: masked in S, and 0 x 0 in P V). A key stage fills
//     and frees as two halves, each with its own "full" and "empty" mbarriers: "high" = ckv 256..511 and kpe
//     (column blocks 4..8: read by S and consumer B's P V) and "low" = ckv 0..255 (blocks 0..3: read by S and
//     consumer A's P V only). The producer copies a tile's high half, then its low half; each thread's copies
//     of a half complete on that half's full mbarrier (cp.async.mbarrier.arrive.noinc, 128 arrivals), and it
//     waits on the half's empty mbarrier (high: 8 consumer warps; low: consumer A's 4) before refilling it.
//   - warpgroup 1 (consumer A): S = Q K^T (wgmma m64n64k16, Q and K from smem, 36 k-steps over 576 dims:
//     the high half's 20 as soon as that half has landed, the low half's 16 once it has), masks, online
//     softmax (base 2, log2 e folded into the scale), P to 16 bits; P and the rows' rescale factors go to
//     shared memory for warpgroup 2 (before A rescales its own accumulator, so B's P V(t) overlaps that
//     rescale); O[:, 0:256] += P V[:, 0:256] (wgmma m64n256k16, P from registers, V = the ckv columns of
//     the same smem tile read N-major). As prefill_sm90.cu: S(t) is issued together with P(t-1) V(t-1), and
//     the softmax of S(t) runs while that product is in flight; P(t) is shared once it has landed
//     (shared-memory stores while a wgmma reading registers is in flight make ptxas serialize every wgmma:
//     warning C7513, which tests/test_mla_sm90.py checks is absent). A frees the high half once S has landed,
//     the low half after its P V.
//   - warpgroup 2 (consumer B): per tile, waits for P(t) (mbarrier "p_full"), rescales its accumulator by
//     the shared factors, O[:, 256:512] += P V[:, 256:512] (wgmma m64n256k16, P and V from smem), then
//     frees P (mbarrier "p_empty") and the stage's high half.
//   Why halves: a stage freed whole only once both P V products of tile t - 1 are done (at the end of
//   iteration t, just before S(t + 1) needs the refill) exposes every tile's whole load (72 KiB gathered) as
//   latency, tensor cores and the read path idle in turn. In halves, the high half of tile t + 1 is requested
//   as soon as consumer B's P V(t - 1) is done (about half way through iteration t) and the low half is
//   needed only after S(t + 1)'s first 20 k-steps: both loads overlap a product instead of following it
//   (H100, 64 x 16k: 128 heads 853 -> 691 us against a whole-stage version, since removed).
//   Why P through shared memory and not S computed twice: S is 576 / 1088 of a tile's tensor work; both
//   warpgroups computing it would cost 53% more tensor time at 128 heads (compute bound), while P is 8 KiB
//   written once per tile. The price is one handshake per tile (consumer A waits p_empty before writing
//   P(t), i.e. for consumer B's P(t-1) V product, which runs beside A's S(t) and softmax).
//   Shared memory (227 KiB max): Q 72 KiB + 2 key stages 144 KiB + P 8 KiB + row factors: two stages only.
//   Registers: producer 56, consumers 224 (setmaxnreg; 128 accumulators of O per thread + S and P in A).
// Masks: key j of row (token t) is visible when j < kv_end of the piece and, causal, j <= t + kv_len -
//   qo_len (bottom-right). A row with no visible key in its piece gives 0 and LSE -inf.
// Output: final rows (DTYPE) and LSE (base 2 times lse_scale), or for a split item fp32 normalized rows in
//   part_o rows slot * 64 + r (512 floats each) and base-2 LSEs in part_lse[slot * 64 + r] (mla.cu's layout).
// Work rows of -1 pad a CUDA-graph plan's fixed grid: those CTAs return at once.
#include "common/dtypes.cuh"
#include "common/mma.cuh"
#include "common/softmax.cuh"
#include "common/tma.cuh"
#include "common/wgmma.cuh"

using namespace cuattn;
using T = DTYPE;

namespace {
constexpr int D_CKV = 512, D_KPE = 64, D_QK = D_CKV + D_KPE;
constexpr int BLOCK_M = 64, BLOCK_N = 64, STAGES = 2;
constexpr int CHUNKS = D_QK / 8;                      // 16-byte chunks per row: 64 of ckv, 8 of kpe
constexpr uint32_t COL_BLOCK = 64 * 128;              // one [64 rows][64 elements] swizzled column block
constexpr uint32_t TILE_BYTES = (D_QK / 64) * COL_BLOCK;   // Q or a key tile: 9 column blocks
#ifndef SEESAW
#define SEESAW 0
#endif
constexpr uint32_t OFF_K = TILE_BYTES;
#if SEESAW   // P(t) lives in column block 8 of its own key stage (the kpe block, free once S(t) is done)
constexpr uint32_t OFF_SCALE = OFF_K + STAGES * TILE_BYTES;   // 3 x 64 floats: scale0, scale1, the running max
constexpr uint32_t OFF_L = OFF_SCALE + 3 * 256;               // 2 x 64 floats: each warpgroup's row sums
constexpr uint32_t OFF_BAR = OFF_L + 2 * 256;
#else
constexpr uint32_t OFF_P = OFF_K + STAGES * TILE_BYTES;
constexpr uint32_t OFF_SCALE = OFF_P + COL_BLOCK;     // 64 floats: the rows' rescale factors of the current P
constexpr uint32_t OFF_L = OFF_SCALE + 256;           // 64 floats: the rows' final sums (epilogue)
constexpr uint32_t OFF_BAR = OFF_L + 256;   // full_hi[2], empty_hi[2], full_lo[2], empty_lo[2], p_full, p_empty
#endif
constexpr int NUM_BARS = 4 * STAGES + 2;
constexpr uint32_t SMEM_BYTES = OFF_BAR + 8 * NUM_BARS;
constexpr int V_HALF = D_CKV / 2;                     // output columns per consumer warpgroup
constexpr int WORK_COLS = 4;                          // plan.PREFILL_COLS
#ifndef PRODUCER_REGS
#define PRODUCER_REGS 56    // 128 x 56 + 256 x 224 <= 64 Ki registers
#define CONSUMER_REGS 224
#endif
static_assert(CHUNKS == 72 && D_CKV % 64 == 0, "Q / key rows are 9 column blocks: 8 of ckv, 1 of kpe");
static_assert(SMEM_BYTES + 1024 <= 227 * 1024, "shared memory of one CTA");

// -- byte offset of 16-byte chunk c of row r (0..63) in a swizzled 64-row tile
__device__ __forceinline__ uint32_t swz(int r, int c) {
  return uint32_t((c >> 3) * COL_BLOCK + r * 128 + (((c & 7) ^ (r & 7)) << 4));
}
// -- a value the compiler cannot see through: descriptors are built where a tile is issued, from it,
//    instead of all 36 k-steps' being hoisted out of the tile loop into registers
__device__ __forceinline__ uint32_t opaque(uint32_t x) {
  asm volatile("" : "+r"(x));
  return x;
}
}  // namespace

extern "C" __global__ void __launch_bounds__(384, 1) cuattn_mla_sm90(
    const int32_t* __restrict__ work,        // [num_work, 4] (request, query tile, kv piece, partial slot)
    const int32_t* __restrict__ kv_chunk,    // [1]: keys per piece (0: nothing split)
    const int32_t* __restrict__ qo_indptr,   // [batch + 1]
    const int32_t* __restrict__ kv_indptr,   // [batch + 1]: first page slot of each request
    const int32_t* __restrict__ kv_indices,  // page ids
    const int32_t* __restrict__ kv_len_arr,  // [batch]
    const T* __restrict__ q_nope,            // [nnz_qo, num_heads, 512]
    const T* __restrict__ q_pe,              // [nnz_qo, num_heads, 64]
    const T* __restrict__ ckv_cache,         // [num_pages, page_size, 512]
    const T* __restrict__ kpe_cache,         // [num_pages, page_size, 64]
    T* __restrict__ out,                     // [nnz_qo, num_heads, 512]
    float* __restrict__ lse,                 // [nnz_qo, num_heads] contiguous, or null
    float* __restrict__ part_o,              // [slots * 64, 512]
    float* __restrict__ part_lse,            // [slots * 64]
    int num_heads, int page_size, int causal,
    int64_t qn_s_tok, int64_t qn_s_head, int64_t qp_s_tok, int64_t qp_s_head,
    int64_t ckv_s_page, int64_t ckv_s_tok, int64_t kpe_s_page, int64_t kpe_s_tok,
    int64_t o_s_tok, int64_t o_s_head, float scale_log2, float lse_scale,
    float k_scale, float v_scale,            // times k_scales[0] / v_scales[0] when given (mla.cu's meaning)
    const float* __restrict__ k_scales, const float* __restrict__ v_scales) {
  extern __shared__ uint8_t smem_raw[];
  const int32_t* item = work + WORK_COLS * blockIdx.x;
  const int req = item[0];
  if (req < 0) return;                 // padding of a CUDA-graph plan
  const int tile = item[1], piece = item[2], slot_out = item[3];
  const uint32_t base = (smem_u32(smem_raw) + 1023) & ~1023u;
  uint8_t* smem = smem_raw + (base - smem_u32(smem_raw));        // the same bytes, generic address
  const uint32_t sQ = base, sK = base + OFF_K;
  float* s_scale = reinterpret_cast<float*>(smem + OFF_SCALE);
  float* s_l = reinterpret_cast<float*>(smem + OFF_L);
  const uint32_t bars = base + OFF_BAR;
#define FULL_HI(s) (bars + 8 * (s))                    // key stage s, high half (ckv 256..511, kpe)
#define EMPTY_HI(s) (bars + 8 * (STAGES + (s)))
#define FULL_LO(s) (bars + 8 * (2 * STAGES + (s)))     // key stage s, low half (ckv 0..255)
#define EMPTY_LO(s) (bars + 8 * (3 * STAGES + (s)))
#define P_FULL (bars + 8 * (NUM_BARS - 2))
#define P_EMPTY (bars + 8 * (NUM_BARS - 1))
  const int tid = int(threadIdx.x);

  const int64_t q_base = qo_indptr[req];
  const int qo_len = qo_indptr[req + 1] - int(q_base);
  const int kv_len = kv_len_arr[req];
  const int rows = qo_len * num_heads;           // packed rows of the request
  const int row0 = tile * BLOCK_M;
  const int shift = kv_len - qo_len;             // causal: token t sees keys <= t + shift
  // -- the piece's keys [kv_lo, kv_end): causal-trimmed to the tile's last row, cut to the piece (mla.cu's)
  int kv_end = kv_len;
  if (causal) kv_end = min(kv_len, max(0, (min(rows, row0 + BLOCK_M) - 1) / num_heads + shift + 1));
  int kv_lo = 0;
  const int chunk = *kv_chunk;
  if (chunk > 0) {
    kv_lo = piece * chunk;
    kv_end = min(kv_end, kv_lo + chunk);
  }
  const int num_tiles = kv_end > kv_lo ? (kv_end - kv_lo + BLOCK_N - 1) / BLOCK_N : 0;

  if (tid == 0) {
#pragma unroll
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(FULL_HI(s), 128);       // every producer thread's cp.async arrival
      mbar_init(EMPTY_HI(s), SEESAW ? 4 : 8);   // lane 0 of every consumer warp (seesaw: of one warpgroup)
      mbar_init(FULL_LO(s), 128);
      mbar_init(EMPTY_LO(s), 4);        // lane 0 of every consumer-A warp (the low half's only reader)
    }
    mbar_init(P_FULL, 128);             // every thread of consumer A
    mbar_init(P_EMPTY, 128);            // every thread of consumer B
    mbar_init_fence();
  }
  __syncthreads();

  if (tid < 128) {
    // ------------------------------------------------------------------ producer
    setmaxnreg_dec<PRODUCER_REGS>();
    // thread: rows r16 + 16 j (j < 4), chunk sub of column block i (i < 9: 8 of ckv, then kpe); a warp's
    // instruction covers 4 rows x 128 contiguous bytes
    const int sub = tid & 7, r16 = tid >> 3;
    if (num_tiles > 0) {
#pragma unroll 1
      for (int j = 0; j < 4; ++j) {     // -- Q rows past the request: zeros
        const int r = r16 + 16 * j, pr = row0 + r;
        const bool ok = pr < rows;
        const int64_t tok = q_base + (ok ? pr / num_heads : 0);
        const int head = ok ? pr % num_heads : 0;
        const T* qn = q_nope + tok * qn_s_tok + head * qn_s_head + sub * 8;
#pragma unroll
        for (int i = 0; i < 8; ++i) cp_async_16(sQ + swz(r, sub + 8 * i), qn + i * 64, ok ? 16 : 0);
        cp_async_16(sQ + swz(r, 64 + sub), q_pe + tok * qp_s_tok + head * qp_s_head + sub * 8, ok ? 16 : 0);
      }
    }
    const int page_base = kv_indptr[req];
    // a power-of-two page size (1, 16, 64: what serving uses) by shift and mask, any other by division
    const int page_shift = (page_size & (page_size - 1)) == 0 ? __ffs(page_size) - 1 : -1;
    int page[4];                        // the page ids of this thread's rows of the next tile
    auto page_ids = [&](int (&pg)[4], int t) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int key = kv_lo + t * BLOCK_N + r16 + 16 * j;
        pg[j] = key < kv_end ? kv_indices[page_base + (page_shift >= 0 ? key >> page_shift : key / page_size)] : 0;
      }
    };
    if (num_tiles > 0) page_ids(page, 0);
    // a row's source: two 32 x 32 -> 64-bit multiply-adds (page, slot) on byte strides under 4 GiB (mla.py
    // checks them: mla_sm90.check_cache_strides); chunk sub + 8 i of row r16 + 16 j sits at dst0 + j 16 rows +
    // i column blocks (the row's swizzle, r16 % 8, is the thread's own)
    const uint8_t* ckv_b = reinterpret_cast<const uint8_t*>(ckv_cache) + sub * 16;
    const uint8_t* kpe_b = reinterpret_cast<const uint8_t*>(kpe_cache) + sub * 16;
    const uint32_t ckv_sp = uint32_t(ckv_s_page * int64_t(sizeof(T))), ckv_st = uint32_t(ckv_s_tok * int64_t(sizeof(T)));
    const uint32_t kpe_sp = uint32_t(kpe_s_page * int64_t(sizeof(T))), kpe_st = uint32_t(kpe_s_tok * int64_t(sizeof(T)));
    const uint32_t dst0 = swz(r16, sub);
    // -- this thread's rows of tile t: the sources of their ckv and kpe rows, and how many are inside the piece
    //    (row j while 16 j < rem; the others are zero-filled from page 0's slot, an address of the cache)
    struct Rows {
      const uint8_t* ckv[4];
      const uint8_t* kpe[4];
      int rem;
    };
    auto rows_of = [&](const int (&pg)[4], int t) {
      Rows w;
      const int key0 = kv_lo + t * BLOCK_N + r16;
      w.rem = kv_end - key0;
#pragma unroll
      for (int j = 0; j < 4; ++j) {        // (unrolled: page[] stays in registers)
        const int key = key0 + 16 * j;
        const uint32_t slot = uint32_t(page_shift >= 0 ? key & (page_size - 1) : key % page_size);
        w.ckv[j] = ckv_b + uint64_t(uint32_t(pg[j])) * ckv_sp + uint64_t(slot) * ckv_st;
        w.kpe[j] = kpe_b + uint64_t(uint32_t(pg[j])) * kpe_sp + uint64_t(slot) * kpe_st;
      }
      return w;
    };
    // -- ckv column blocks [i0, i1) (and kpe) of rows w into dst
    auto copy_rows = [&](uint32_t dst, const Rows& w, int i0, int i1, bool with_kpe) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
#pragma unroll
        for (int i = i0; i < i1; ++i)
          cp_async_16_zfill(dst + dst0 + j * 2048 + i * COL_BLOCK, w.ckv[j] + i * 128, 16 * j >= w.rem);
        if (with_kpe) cp_async_16_zfill(dst + dst0 + j * 2048 + 8 * COL_BLOCK, w.kpe[j], 16 * j >= w.rem);
      }
    };
#if SEESAW
    // -- pairs of tiles (2 j in stage 0, 2 j + 1 in stage 1; past the piece: zero rows), each stage in two
    //    groups refilled in the order the consumers free them: stage 0's blocks 0..3 (consumer 0's P V), stage
    //    1's 4..7 (consumer 1's P V), stage 0's 4..8 (consumer 1's P0 V), stage 1's 0..3 and 8 (consumer 0's P1 V)
    int page1[4];
    if (num_tiles > 0) page_ids(page1, 1);
#pragma unroll 1
    for (int j = 0; j < (num_tiles + 1) / 2; ++j) {
      const uint32_t ph = (j & 1) ^ 1, dst1 = sK + TILE_BYTES;
      const Rows w0 = rows_of(page, 2 * j), w1 = rows_of(page1, 2 * j + 1);
      mbar_wait(EMPTY_HI(0), ph);
      copy_rows(sK, w0, 0, 4, false);
      cp_async_mbar_arrive_noinc(FULL_HI(0));        // (pair 0's arrivals cover the Q copies too)
      mbar_wait(EMPTY_HI(1), ph);
      copy_rows(dst1, w1, 4, 8, false);
      cp_async_mbar_arrive_noinc(FULL_HI(1));
      mbar_wait(EMPTY_LO(0), ph);
      copy_rows(sK, w0, 4, 8, true);
      cp_async_mbar_arrive_noinc(FULL_LO(0));
      mbar_wait(EMPTY_LO(1), ph);
      copy_rows(dst1, w1, 0, 4, true);
      cp_async_mbar_arrive_noinc(FULL_LO(1));
      page_ids(page, 2 * j + 2);
      page_ids(page1, 2 * j + 3);
    }
#else
#pragma unroll 1
    for (int t = 0; t < num_tiles; ++t) {
      const int s = t % STAGES;
      const uint32_t ph = ((t / STAGES) & 1) ^ 1, dst = sK + s * TILE_BYTES;
      const Rows w = rows_of(page, t);
      mbar_wait(EMPTY_HI(s), ph);          // the consumers are done with the high half of tile t - STAGES
      // -- the high half (ckv 256..511, kpe) first: it frees first (consumer B's P V and the S product are its
      //    readers) and S(t) reads it first; then the low half once consumer A's P V of tile t - STAGES is done
      copy_rows(dst, w, 4, 8, true);
      cp_async_mbar_arrive_noinc(FULL_HI(s));         // (tile 0's arrival covers the Q copies too)
      mbar_wait(EMPTY_LO(s), ph);
      copy_rows(dst, w, 0, 4, false);
      cp_async_mbar_arrive_noinc(FULL_LO(s));
      if (t + 1 < num_tiles) page_ids(page, t + 1);
    }
#endif
    cp_async_wait<0>();                 // no copy lands after this thread has left
    return;
  }

  // -------------------------------------------------------------------- consumers
  setmaxnreg_inc<CONSUMER_REGS>();
  const int wg = tid / 128 - 1;            // 0: consumer A (S, softmax, O columns 0..255); 1: consumer B (256..511)
  const int wt = tid % 128;
  const int warp = wt / 32, lane = tid % 32;
  const int g = lane / 4, t4 = lane % 4;
  const int r_lo = warp * 16 + g;          // this thread's rows r_lo and r_lo + 8 (wgmma accumulator layout)
  const float neg_inf = __int_as_float(0xff800000);
  float k_fac = k_scale;                   // the key's scale joins the softmax scale (mla.cu's meaning)
  if (k_scales != nullptr) k_fac *= k_scales[0];
  const float sl2 = scale_log2 * k_fac;
  float acc[128];                          // O[rows, wg * 256 + 8 n + 2 t4 + e]: acc[4 n + 2 h + e], row r_lo + 8 h
#pragma unroll
  for (int i = 0; i < 128; ++i) acc[i] = 0.f;
  float m_i[2] = {neg_inf, neg_inf}, l_i[2] = {0.f, 0.f};
  auto arrive_warp = [&](uint32_t bar) {   // this warp is done with what `bar` guards
    __syncwarp();
    if (lane == 0) mbar_arrive(bar);
  };
  auto rescale = [&](float c0, float c1) {
#pragma unroll
    for (int n = 0; n < V_HALF / 8; ++n) {
      acc[4 * n + 0] *= c0;
      acc[4 * n + 1] *= c0;
      acc[4 * n + 2] *= c1;
      acc[4 * n + 3] *= c1;
    }
  };

#if SEESAW
  // ------------------------------------------------------------------ seesaw consumers (FlashMLA's schedule)
  // Tiles come in pairs: 2 j (stage 0, "tile 0") and 2 j + 1 (stage 1, "tile 1"; past the piece: zero rows, all
  // masked). Warpgroup 0 holds O[:, 0:256] and computes S0 = Q K0^T, warpgroup 1 holds O[:, 256:512] and S1; the
  // running row max passes from one to the other through shared memory (s_m), so
  //   wg 0: m0 = max(m, rowmax S0), P0 = exp2(S0 - m0), O_L = O_L c0 + P0 V0_L               (c0 = exp2(m - m0))
  //   wg 1: m1 = max(m0, rowmax S1), P1 = exp2(S1 - m1), O_R = O_R c0 c1 + P1 V1_R + (P0 c1) V0_R   (c1 = exp2(m0 - m1))
  //   wg 0: O_L = O_L c1 + P1 V1_L
  // with P0 c1 and P1 through shared memory (column block 8 of their own stage: its kpe part, read by S only).
  // Each warpgroup does one S and two P V products a pair (the tensor work split evenly) and its softmax
  // overlaps the other's products. Hand-offs are named barriers (an arrive by one warpgroup, a sync by the other).
  // Shared-memory stores are made with no wgmma of the storing warpgroup in flight (ptxas C7513).
  constexpr int BAR_SC0 = 2, BAR_SC1 = 3, BAR_P0 = 4, BAR_PV0R = 5;
  float* s_sc0 = s_scale;                  // s_l: [2][64], each warpgroup's row sums
  float* s_sc1 = s_sc0 + 64;
  float* s_m = s_sc0 + 128;
  int lim[2];                              // first key a row may not see
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int pr = row0 + r_lo + 8 * h;
    lim[h] = causal ? min(kv_end, pr / num_heads + shift + 1) : kv_end;
  }
  const int lim_min = min(lim[0], lim[1]);
  const int num_pairs = (num_tiles + 1) / 2;
  const uint32_t stage0 = sK, stage1 = sK + TILE_BYTES;
  // -- S = Q K(stage)^T over column blocks [b0, b1) (k-steps of 16), the first one starting the sum
  auto qk_blocks = [&](float (&s)[32], uint32_t stage, int b0, int b1, bool first) {
    const uint64_t dq = wgmma_desc(opaque(sQ), 16, 1024);
    const uint64_t dk = wgmma_desc(opaque(stage), 16, 1024);
#pragma unroll
    for (int kk = 4 * b0; kk < 4 * b1; ++kk) {
      const uint32_t off = ((kk / 4) * COL_BLOCK + (kk % 4) * 32) >> 4;
      wgmma_m64n64k16_ss<T>(s, dq + off, dk + off, !first || kk > 4 * b0);
    }
  };
  // -- a stage's group once it has landed (full barrier `bar`, parity ph)
  auto landed = [&](uint32_t bar, uint32_t ph) {
    mbar_wait(bar, ph);
    fence_proxy_async();                   // cp.async writes (seen through the mbarrier) -> wgmma reads
    wgmma_fence();
  };
  // -- S of tile 0 reads blocks 0..3 (freed first) then 4..8; S of tile 1 blocks 4..7, then 8 and 0..3 (each
  //    warpgroup calls its own: no wgmma on a path that depends on the warpgroup, ptxas C7520)
  auto s0_first = [&](float (&s)[32], uint32_t ph) {
    landed(FULL_HI(0), ph);
    qk_blocks(s, stage0, 0, 4, true);
    wgmma_commit();
  };
  auto s0_second = [&](float (&s)[32], uint32_t ph) {
    landed(FULL_LO(0), ph);
    qk_blocks(s, stage0, 4, 9, false);
    wgmma_commit();
  };
  auto s1_all = [&](float (&s)[32], uint32_t ph) {
    landed(FULL_HI(1), ph);
    qk_blocks(s, stage1, 4, 8, true);
    wgmma_commit();
    landed(FULL_LO(1), ph);
    qk_blocks(s, stage1, 8, 9, false);
    qk_blocks(s, stage1, 0, 4, false);
    wgmma_commit();
  };
  auto mask = [&](float (&s)[32], int t) {
    const int key0 = kv_lo + t * BLOCK_N;
    if (key0 + BLOCK_N <= lim_min) return;
#pragma unroll
    for (int n = 0; n < BLOCK_N / 8; ++n)
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int e = 0; e < 2; ++e)
          if (key0 + 8 * n + 2 * t4 + e >= lim[h]) s[4 * n + 2 * h + e] = neg_inf;
  };
  auto softmax = [&](float (&s)[32], float (&corr)[2]) {
#pragma unroll
    for (int h = 0; h < 2; ++h)
      corr[h] = online_softmax_row<BLOCK_N / 4>([&](int k) { return s[4 * (k >> 1) + 2 * h + (k & 1)]; },
                                                [&](int k, float v) { s[4 * (k >> 1) + 2 * h + (k & 1)] = v; },
                                                m_i[h], l_i[h], sl2);
  };
  // -- P (fp32, scaled by c) as the 16-bit A fragments of 4 k-steps of 16 keys
  uint32_t p[BLOCK_N / 16][4];
  auto pack_p = [&](const float (&s)[32], const float (&c)[2]) {
#pragma unroll
    for (int kk = 0; kk < BLOCK_N / 16; ++kk) {
      p[kk][0] = pack2<T>(s[8 * kk + 0] * c[0], s[8 * kk + 1] * c[0]);
      p[kk][1] = pack2<T>(s[8 * kk + 2] * c[1], s[8 * kk + 3] * c[1]);
      p[kk][2] = pack2<T>(s[8 * kk + 4] * c[0], s[8 * kk + 5] * c[0]);
      p[kk][3] = pack2<T>(s[8 * kk + 6] * c[1], s[8 * kk + 7] * c[1]);
    }
  };
  // -- p into column block 8 of `stage` in the swizzled K-major layout of a [64 rows][64 keys] A operand
  auto store_p = [&](uint32_t stage) {
    uint8_t* sp = smem + (stage - base) + 8 * COL_BLOCK;
#pragma unroll
    for (int kk = 0; kk < BLOCK_N / 16; ++kk)
#pragma unroll
      for (int i = 0; i < 2; ++i) {        // keys 16 kk + 8 i + 2 t4, + 1: 16-byte chunk 2 kk + i of the row
        const int col = (((2 * kk + i) ^ g) << 4) + 4 * t4;   // (r_lo + 8) % 8 == r_lo % 8 == g
        *reinterpret_cast<uint32_t*>(sp + r_lo * 128 + col) = p[kk][2 * i];
        *reinterpret_cast<uint32_t*>(sp + (r_lo + 8) * 128 + col) = p[kk][2 * i + 1];
      }
    fence_proxy_async();                   // generic stores -> the wgmma reads of either warpgroup
  };
  // -- O[:, wg half] += P V over the stage's value columns of this warpgroup: P from registers or from block 8
  const uint32_t v_off = uint32_t(wg) * 4 * COL_BLOCK;
  auto pv_regs = [&](uint32_t stage) {
    const uint64_t dv = wgmma_desc(opaque(stage + v_off), COL_BLOCK, 1024);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < BLOCK_N / 16; ++kk) wgmma_m64n256k16_rs_tb<T>(acc, p[kk], dv + ((kk * 16 * 128) >> 4));
    wgmma_commit();
  };
  auto pv_smem = [&](uint32_t stage) {
    const uint64_t dv = wgmma_desc(opaque(stage + v_off), COL_BLOCK, 1024);
    const uint64_t dp = wgmma_desc(opaque(stage + 8 * COL_BLOCK), 16, 1024);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < BLOCK_N / 16; ++kk)
      wgmma_m64n256k16_ss_tb<T>(acc, dp + ((kk * 32) >> 4), dv + ((kk * 16 * 128) >> 4));
    wgmma_commit();
  };
  // -- the running max's hand-off: publish this warpgroup's factors c and its max m_i (to sc and s_m); take the
  //    other's (c its factors, m_i its max, l_i rescaled by c)
  auto publish = [&](float* sc, const float (&c)[2]) {
    if (t4 == 0) {
      sc[r_lo] = c[0], sc[r_lo + 8] = c[1];
      s_m[r_lo] = m_i[0], s_m[r_lo + 8] = m_i[1];
    }
  };
  auto take = [&](const float* sc, float (&c)[2]) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      c[h] = sc[r_lo + 8 * h];
      m_i[h] = s_m[r_lo + 8 * h];
      l_i[h] *= c[h];
    }
  };
  const float one[2] = {1.f, 1.f};
  float s[32];
  if (num_pairs > 0 && wg == 0) {
    // ------------------------------------------------------------------ warpgroup 0: O[:, 0:256], tiles 2 j
    s0_first(s, 0);
    s0_second(s, 0);
    wgmma_wait<0>();
    wgmma_fence_regs(s);
    // -- one pair; `more`: S of the next pair's tile 0 is issued at its end (a constant at each call: the last
    //    pair is peeled, so no wgmma or wgmma wait sits under a run-time condition, ptxas C7520)
    auto pair = [&](int j, bool more) {   // (inlined at two sites with a constant `more`)
      float c0[2], c1[2];
      mask(s, 2 * j);
      softmax(s, c0);                      // m_i: m0; l_i: tile 0's rows summed in
      publish(s_sc0, c0);
      named_barrier_arrive(BAR_SC0, 256);
      rescale(c0[0], c0[1]);
      pack_p(s, one);
      pv_regs(stage0);                     // O_L += P0 V0_L
      wgmma_wait<0>();
      wgmma_fence_regs(acc);
      arrive_warp(EMPTY_HI(0));            // stage 0's blocks 0..3 are read
      named_barrier(BAR_SC1, 256);         // warpgroup 1's m1 and c1
      take(s_sc1, c1);
      pack_p(s, c1);                       // P0 c1 to warpgroup 1
      store_p(stage0);
      named_barrier_arrive(BAR_P0, 256);
      named_barrier(BAR_PV0R, 256);        // P1 is in stage 1's block 8
      rescale(c1[0], c1[1]);
      pv_smem(stage1);                     // O_L += P1 V1_L
      if (more) {
        s0_first(s, (j + 1) & 1);
        wgmma_wait<1>();
      } else {
        wgmma_wait<0>();
      }
      wgmma_fence_regs(acc);
      arrive_warp(EMPTY_LO(1));            // stage 1's blocks 0..3 and P1 are read
      if (more) {
        s0_second(s, (j + 1) & 1);
        wgmma_wait<0>();
        wgmma_fence_regs(s);
      }
    };
#pragma unroll 1
    for (int j = 0; j + 1 < num_pairs; ++j) pair(j, true);
    pair(num_pairs - 1, false);
  } else if (num_pairs > 0) {
    // ------------------------------------------------------------------ warpgroup 1: O[:, 256:512], tiles 2 j + 1
    s1_all(s, 0);
    wgmma_wait<0>();
    wgmma_fence_regs(s);
    auto pair = [&](int j, bool more) {   // (inlined at two sites with a constant `more`)
      float c0[2], c1[2];
      mask(s, 2 * j + 1);
      named_barrier(BAR_SC0, 256);         // warpgroup 0's m0 and c0
      take(s_sc0, c0);
      softmax(s, c1);                      // m_i: m1
      publish(s_sc1, c1);
      named_barrier_arrive(BAR_SC1, 256);
      rescale(c0[0] * c1[0], c0[1] * c1[1]);
      pack_p(s, one);
      store_p(stage1);                     // P1 to warpgroup 0
      pv_regs(stage1);                     // O_R += P1 V1_R
      named_barrier(BAR_P0, 256);
      pv_smem(stage0);                     // O_R += (P0 c1) V0_R
      named_barrier_arrive(BAR_PV0R, 256);
      wgmma_wait<1>();
      arrive_warp(EMPTY_HI(1));            // stage 1's blocks 4..7 are read
      wgmma_wait<0>();
      wgmma_fence_regs(acc);
      arrive_warp(EMPTY_LO(0));            // stage 0's blocks 4..8 and P0 are read
      if (more) {
        s1_all(s, (j + 1) & 1);
        wgmma_wait<0>();
        wgmma_fence_regs(s);
      }
    };
#pragma unroll 1
    for (int j = 0; j + 1 < num_pairs; ++j) pair(j, true);
    pair(num_pairs - 1, false);
  }
  // -- each warpgroup's row sums (quad-reduced) for the epilogue; m_i is m1 of the last pair in both
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l_i[h] += __shfl_xor_sync(0xffffffffu, l_i[h], 1);
    l_i[h] += __shfl_xor_sync(0xffffffffu, l_i[h], 2);
  }
  if (t4 == 0) {
    s_l[wg * 64 + r_lo] = l_i[0];
    s_l[wg * 64 + r_lo + 8] = l_i[1];
  }
  named_barrier(1, 256);
  auto row_sum = [&](int r) { return s_l[r] + s_l[64 + r]; };
#else
  const uint32_t sP = base + OFF_P;
  auto release_hi = [&](int s) { arrive_warp(EMPTY_HI(s)); };   // done reading key stage s's high half
  if (wg == 0) {
    // ---------------------------------------------------------------- consumer A
    int lim[2];                            // first key a row may not see
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int pr = row0 + r_lo + 8 * h;
      lim[h] = causal ? min(kv_end, pr / num_heads + shift + 1) : kv_end;
    }
    uint32_t p[BLOCK_N / 16][4];           // P(t) as the A fragments of 4 k-steps of 16 keys
    // -- S(t) = Q K(t)^T: the high half's 20 k-steps (ckv 256..511, kpe) as soon as it has landed, then the low
    //    half's 16 (its copies may still run meanwhile): two commit groups
    auto issue_qk = [&](float (&s)[32], int t) {
      const int st = t % STAGES;
      const uint32_t ph = (t / STAGES) & 1;
      const uint64_t dq = wgmma_desc(opaque(sQ), 16, 1024);
      const uint64_t dk = wgmma_desc(opaque(sK + st * TILE_BYTES), 16, 1024);
      auto ksteps = [&](int k0, int k1, bool first) {
#pragma unroll
        for (int kk = k0; kk < k1; ++kk) {
          const uint32_t off = ((kk / 4) * COL_BLOCK + (kk % 4) * 32) >> 4;
          wgmma_m64n64k16_ss<T>(s, dq + off, dk + off, !first || kk > k0);
        }
      };
      mbar_wait(FULL_HI(st), ph);
      fence_proxy_async();                 // cp.async writes (seen through the mbarrier) -> wgmma reads
      wgmma_fence();
      ksteps(D_CKV / 2 / 16, D_QK / 16, true);
      wgmma_commit();
      mbar_wait(FULL_LO(st), ph);
      fence_proxy_async();
      wgmma_fence();
      ksteps(0, D_CKV / 2 / 16, false);
      wgmma_commit();
    };
    auto issue_pv = [&](int t) {           // V columns 0..255: column blocks 0..3, LBO = one block
      const uint64_t dv = wgmma_desc(opaque(sK + (t % STAGES) * TILE_BYTES), COL_BLOCK, 1024);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < BLOCK_N / 16; ++kk) wgmma_m64n256k16_rs_tb<T>(acc, p[kk], dv + ((kk * 16 * 128) >> 4));
      wgmma_commit();
    };
    // -- masks, then online softmax: s becomes P (fp32), corr the rows' rescale factors
    auto softmax = [&](float (&s)[32], int t, float (&corr)[2]) {
      const int key0 = kv_lo + t * BLOCK_N;
#pragma unroll
      for (int n = 0; n < BLOCK_N / 8; ++n)
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
          for (int e = 0; e < 2; ++e)
            if (key0 + 8 * n + 2 * t4 + e >= lim[h]) s[4 * n + 2 * h + e] = neg_inf;
#pragma unroll
      for (int h = 0; h < 2; ++h)
        corr[h] = online_softmax_row<BLOCK_N / 4>([&](int k) { return s[4 * (k >> 1) + 2 * h + (k & 1)]; },
                                                  [&](int k, float v) { s[4 * (k >> 1) + 2 * h + (k & 1)] = v; },
                                                  m_i[h], l_i[h], sl2);
    };
    // -- P(t) (the packed fragments p: 16-bit, stored in the swizzled K-major layout of a [64 rows][64 keys]
    //    A operand) and the factors to consumer B. Called with no wgmma in flight: stores while a product
    //    reading p is in flight make ptxas serialize every wgmma of the kernel (warning C7513)
    auto share_p = [&](const float (&corr)[2], int t) {
      mbar_wait(P_EMPTY, (t & 1) ^ 1);     // consumer B is done with P(t - 1)
      uint8_t* sp = smem + OFF_P;
#pragma unroll
      for (int kk = 0; kk < BLOCK_N / 16; ++kk)
#pragma unroll
        for (int i = 0; i < 2; ++i) {      // keys 16 kk + 8 i + 2 t4, + 1: 16-byte chunk 2 kk + i of the row
          const int col = (((2 * kk + i) ^ g) << 4) + 4 * t4;   // (r_lo + 8) % 8 == r_lo % 8 == g
          *reinterpret_cast<uint32_t*>(sp + r_lo * 128 + col) = p[kk][2 * i];
          *reinterpret_cast<uint32_t*>(sp + (r_lo + 8) * 128 + col) = p[kk][2 * i + 1];
        }
      if (t4 == 0) {
        s_scale[r_lo] = corr[0];
        s_scale[r_lo + 8] = corr[1];
      }
      fence_proxy_async();                 // generic stores -> consumer B's wgmma reads
      mbar_arrive(P_FULL);
    };
    auto pack_p = [&](const float (&s)[32]) {
#pragma unroll
      for (int kk = 0; kk < BLOCK_N / 16; ++kk) {
        p[kk][0] = pack2<T>(s[8 * kk + 0], s[8 * kk + 1]);
        p[kk][1] = pack2<T>(s[8 * kk + 2], s[8 * kk + 3]);
        p[kk][2] = pack2<T>(s[8 * kk + 4], s[8 * kk + 5]);
        p[kk][3] = pack2<T>(s[8 * kk + 6], s[8 * kk + 7]);
      }
    };

    if (num_tiles > 0) {
      // -- consumer A frees a stage's high half once S is done, the low half after its P V
      auto release_s = [&](int t) { release_hi(t % STAGES); };
      auto release_pv = [&](int t) { arrive_warp(EMPTY_LO(t % STAGES)); };
      {  // -- tile 0: S, softmax, P (O is still zero: nothing to rescale)
        float s[32], corr[2];
        issue_qk(s, 0);
        wgmma_wait<0>();
        wgmma_fence_regs(s);
        release_s(0);
        softmax(s, 0, corr);
        pack_p(s);
        share_p(corr, 0);
      }
#pragma unroll 1
      for (int t = 1; t < num_tiles; ++t) {
        float s[32], corr[2];
        issue_qk(s, t);
        issue_pv(t - 1);
        wgmma_wait<1>();                   // S(t) has landed; P(t-1) V(t-1) may still run
        wgmma_fence_regs(s);
        release_s(t);
        softmax(s, t, corr);
        wgmma_wait<0>();
        wgmma_fence_regs(acc);
        release_pv(t - 1);
        pack_p(s);                         // P(t) to consumer B first, so its P V(t) overlaps this rescale
        share_p(corr, t);
        rescale(corr[0], corr[1]);
      }
      issue_pv(num_tiles - 1);
      wgmma_wait<0>();
      wgmma_fence_regs(acc);
      release_pv(num_tiles - 1);
    }
    // -- the rows' sums for consumer B (quad-reduced: every thread of a quad holds a quarter)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      l_i[h] += __shfl_xor_sync(0xffffffffu, l_i[h], 1);
      l_i[h] += __shfl_xor_sync(0xffffffffu, l_i[h], 2);
    }
    if (t4 == 0) {
      s_l[r_lo] = l_i[0];
      s_l[r_lo + 8] = l_i[1];
    }
  } else {
    // ---------------------------------------------------------------- consumer B
#pragma unroll 1
    for (int t = 0; t < num_tiles; ++t) {
      const int s = t % STAGES;
      mbar_wait(P_FULL, t & 1);
      const float c0 = s_scale[r_lo], c1 = s_scale[r_lo + 8];
      mbar_wait(FULL_HI(s), (t / STAGES) & 1);  // complete already (consumer A saw it): the high half, the one
                                                // this warpgroup reads, visible to this thread
      fence_proxy_async();
      rescale(c0, c1);
      // V columns 256..511: column blocks 4..7 of the stage
      const uint64_t dv = wgmma_desc(opaque(sK + s * TILE_BYTES + 4 * COL_BLOCK), COL_BLOCK, 1024);
      const uint64_t dp = wgmma_desc(opaque(sP), 16, 1024);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < BLOCK_N / 16; ++kk)
        wgmma_m64n256k16_ss_tb<T>(acc, dp + ((kk * 32) >> 4), dv + ((kk * 16 * 128) >> 4));
      wgmma_commit();
      wgmma_wait<0>();
      wgmma_fence_regs(acc);
      mbar_arrive(P_EMPTY);                // P(t) and its factors are read
      release_hi(s);
    }
  }
  named_barrier(1, 256);                   // consumer A's row sums are in s_l
  auto row_sum = [&](int r) { return s_l[r]; };
#endif

  float v_fac = v_scale;                   // the value's scale multiplies the normalized rows (final or partial)
  if (v_scales != nullptr) v_fac *= v_scales[0];
  // -- epilogue: O / l; consumer A also writes the LSE. Final rows (DTYPE) or, for a split item, fp32 partials.
  //    Final rows go through shared memory (Q's bytes: both consumers are past their last product, barrier 1
  //    above) when out's rows and strides allow 16-byte stores: each warpgroup stages its [64 rows][256 columns]
  //    (16-byte chunk c of row r at r * 512 + (c ^ (r % 8)) * 16: the accumulator layout's writes conflict-free),
  //    then stores whole 512-byte row halves, a warp a row. (The accumulators' own layout stores 16 bytes a row per
  //    instruction: H100, 128 heads x 64 requests, one key tile 20.7 -> 16.2 us staged, 4k keys 1.09x / 1.01x
  //    faster halves / seesaw; benchmarks/results/mla_notes.md, session 26.)
  const int col0 = wg * V_HALF + 2 * t4;
  constexpr int HALF_ROW = V_HALF * int(sizeof(T));     // bytes of a staged row half
  const bool staged = slot_out < 0 &&
      ((reinterpret_cast<unsigned long long>(out) | uint64_t(o_s_tok | o_s_head) * sizeof(T)) & 15) == 0;
  uint8_t* const stage = smem + wg * (BLOCK_M * HALF_ROW);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = r_lo + 8 * h, pr = row0 + r;
    if (pr >= rows) continue;
    const float l = row_sum(r);
    const float inv = l > 0.f ? v_fac / l : 0.f;
    const float lse2 = l > 0.f ? m_i[h] + __log2f(l) : neg_inf;     // (m_i: consumer A's alone)
    if (slot_out < 0) {
      const int64_t tok = q_base + pr / num_heads;
      const int head = pr % num_heads;
      if (staged) {
        uint8_t* srow = stage + r * HALF_ROW + 4 * t4;
#pragma unroll
        for (int n = 0; n < V_HALF / 8; ++n)
          *reinterpret_cast<uint32_t*>(srow + ((n ^ (r & 7)) << 4)) =
              pack2<T>(acc[4 * n + 2 * h] * inv, acc[4 * n + 2 * h + 1] * inv);
      } else {
        T* orow = out + tok * o_s_tok + head * o_s_head + col0;
#pragma unroll
        for (int n = 0; n < V_HALF / 8; ++n)
          *reinterpret_cast<uint32_t*>(orow + n * 8) = pack2<T>(acc[4 * n + 2 * h] * inv, acc[4 * n + 2 * h + 1] * inv);
      }
      if (lse != nullptr && wg == 0 && t4 == 0) lse[tok * num_heads + head] = lse2 * lse_scale;
    } else {
      const int64_t prow = int64_t(slot_out) * BLOCK_M + r;
      float* orow = part_o + prow * D_CKV + col0;
#pragma unroll
      for (int n = 0; n < V_HALF / 8; ++n)
        *reinterpret_cast<float2*>(orow + n * 8) = make_float2(acc[4 * n + 2 * h] * inv, acc[4 * n + 2 * h + 1] * inv);
      if (wg == 0 && t4 == 0) part_lse[prow] = lse2;
    }
  }
  if (staged) {
    named_barrier(6 + wg, 128);            // this warpgroup's staged rows are complete
    const int n_rows = min(BLOCK_M, rows - row0);
#pragma unroll 4
    for (int i = wt; i < n_rows * (HALF_ROW / 16); i += 128) {
      const int r = i / (HALF_ROW / 16), c = i % (HALF_ROW / 16), pr = row0 + r;
      const int4 v = *reinterpret_cast<const int4*>(stage + r * HALF_ROW + ((c ^ (r & 7)) << 4));
      const int64_t tok = q_base + pr / num_heads;
      *reinterpret_cast<int4*>(out + tok * o_s_tok + (pr % num_heads) * o_s_head + wg * V_HALF + c * 8) = v;
    }
  }
#undef FULL_HI
#undef EMPTY_HI
#undef FULL_LO
#undef EMPTY_LO
#undef P_FULL
#undef P_EMPTY
}
