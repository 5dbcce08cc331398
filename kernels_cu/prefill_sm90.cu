// prefill_sm90.cu — launched by cuattn/prefill_sm90.py (Sm90PrefillSpec); the Hopper "fa3" backend
// (sm_90a only: wgmma, TMA, setmaxnreg).
// Compile-time: HEAD_DIM (128), DTYPE (cuattn::f16 | cuattn::bf16), CAUSAL (0 | 1), BLOCK_N (128),
//   STAGES (K/V tiles in flight, >= 2).
// Grid (num_work, num_kv_heads); block 384 (3 warpgroups); dynamic smem
//   1024 (alignment) + (BLOCK_M + 2 STAGES BLOCK_N) * HEAD_DIM * 2 + 64 (mbarriers).
//
// One CTA computes BLOCK_M = 128 "packed rows" of one request and one kv head, as prefill.cu does:
// packed row r is query position r / group of qo head kv_head * group + r % group.
// Warp specialisation: warpgroup 0 is the producer (one thread issues TMA loads of K and V tiles,
// BLOCK_N x 64 boxes with the 128-byte swizzle, into STAGES smem buffers each, completing on
// "full" mbarriers; it waits on "empty" mbarriers before reusing a buffer); warpgroups 1 and 2 are
// consumers, 64 query rows each. A consumer stages its Q rows with cp.async (once), then per K/V
// tile: S = Q K^T by wgmma m64n128k16 (A and B from smem), mask, online softmax in registers
// (base 2, log2 e folded into the scale), P converted to 16-bit in registers as the A operand of
// O += P V (wgmma, V from smem read N-major through the descriptor). setmaxnreg moves registers
// from the producer (40) to the consumers (232).
// Overlap: a consumer issues S(t) = Q K(t)^T and O += P(t-1) V(t-1) back to back, then runs the
// softmax of S(t) while the P.V product is still in flight (FlashAttention-3's intra-warpgroup
// pipelining); O is rescaled once that product has landed. (+4-16% over the plain loop, which was
// removed after that measurement: benchmarks/results/prefill_sm90_notes.md.)
//
// Work: `work` == nullptr is the single-request case (lengths from arguments, tiles in reverse so
// the longest causal tiles start first); otherwise work[2 * blockIdx.x + {0, 1}] = (request, tile)
// and lengths come from qo_indptr / kv_indptr (ragged: token offsets). K / V rows are addressed
// through the tensor maps (dims: HEAD_DIM, tokens, kv heads): keys past a request's kv_len are
// masked in S (the TMA zero-fills rows past the tensor's end).
#include "common/dtypes.cuh"
#include "common/grid_dependency.cuh"
#include "common/mma.cuh"
#include "common/prefill_tile.cuh"
#include "common/tma.cuh"
#include "common/wgmma.cuh"

using namespace cuattn;
typedef DTYPE dtype_t;
#define NEG_INF __int_as_float(0xff800000)

static_assert(HEAD_DIM == 128, "prefill_sm90: head_dim 128 only");
static_assert(BLOCK_N == 128, "prefill_sm90: wgmma m64n128 for S and O");
static_assert(STAGES >= 2, "the pipeline needs two stages");

constexpr int D = HEAD_DIM;
constexpr int WG_ROWS = 64;                         // rows per consumer warpgroup (wgmma m64)
constexpr int NUM_CONSUMERS = 2;
constexpr int BLOCK_M = WG_ROWS * NUM_CONSUMERS;
constexpr int NUM_THREADS = 128 * (NUM_CONSUMERS + 1);
constexpr uint32_t Q_BYTES = BLOCK_M * D * 2;
constexpr uint32_t TILE_BYTES = BLOCK_N * D * 2;    // one K or V tile: D / 64 column blocks
constexpr uint32_t HALF_BYTES = BLOCK_N * 128;      // one column block of 64 elements
constexpr int PRODUCER_REGS = 40, CONSUMER_REGS = 232;

// -- smem byte offset of 16-byte chunk c (0..D/8) of row r in a swizzled [rows][D] tile of `rows` rows
__device__ __forceinline__ uint32_t swz128(int rows, int r, int c) {
  return uint32_t((c / 8) * rows * 128 + r * 128 + (((c % 8) ^ (r % 8)) * 16));
}

extern "C" __global__ void __launch_bounds__(NUM_THREADS, 1) cuattn_prefill_sm90(
    const __grid_constant__ TmaDesc tmap_k,  // K: dims (D, tokens, kv heads), box (64, BLOCK_N, 1), swizzle 128B
    const __grid_constant__ TmaDesc tmap_v,  // V: the same
    const dtype_t* __restrict__ q,           // [nnz_qo, num_qo_heads, D] (strides q_s_tok, q_s_head)
    dtype_t* __restrict__ o,                 // [nnz_qo, num_qo_heads, D] (strides o_s_tok, o_s_head)
    float* __restrict__ lse,                 // [nnz_qo, num_qo_heads] or nullptr
    const int32_t* __restrict__ qo_indptr,   // [batch + 1] (batch mode)
    const int32_t* __restrict__ kv_indptr,   // [batch + 1] token offsets (batch mode)
    const int32_t* __restrict__ work,        // [num_work, 2] (request, tile), or nullptr: single
    int single_qo_len, int single_kv_len, int group, int num_qo_heads,
    int64_t q_s_tok, int64_t q_s_head, int64_t o_s_tok, int64_t o_s_head, float scale_log2) {
  extern __shared__ uint8_t smem_raw[];
  const uint32_t base = (smem_u32(smem_raw) + 1023) & ~1023u;
  const uint32_t sQ = base, sK = sQ + Q_BYTES, sV = sK + STAGES * TILE_BYTES;
  const uint32_t bars = sV + STAGES * TILE_BYTES;   // fullK, fullV, emptyK, emptyV: STAGES each
#define FULL_K(s) (bars + 8 * (s))
#define FULL_V(s) (bars + 8 * (STAGES + (s)))
#define EMPTY_K(s) (bars + 8 * (2 * STAGES + (s)))
#define EMPTY_V(s) (bars + 8 * (3 * STAGES + (s)))
  const int tid = int(threadIdx.x);
  const int kvh = int(blockIdx.y);
  if (tid == 0) {       // before the PDL wait: the maps are kernel parameters
    tma_prefetch_desc(&tmap_k);
    tma_prefetch_desc(&tmap_v);
  }
  wait_prior_grids();   // PDL: every other input may come from the previous kernel in the stream

  // -- which request and tile; lengths and offsets of the request
  int req = 0, tile, qo_len = single_qo_len, kv_base = 0, kv_len = single_kv_len;
  int64_t q_base = 0;
  query_tile(work, qo_indptr, req, tile, q_base, qo_len);
  if (work != nullptr) {
    kv_base = kv_indptr[req];
    kv_len = kv_indptr[req + 1] - kv_base;
  }
  const int row0 = tile * BLOCK_M;
  const int packed_rows = qo_len * group;
  const int causal_shift = kv_len - qo_len;   // bottom-right alignment: key j <= i + shift
  int kv_end = kv_len;
  if (CAUSAL) kv_end = min(kv_len, min(qo_len - 1, (row0 + BLOCK_M - 1) / group) + causal_shift + 1);
  const int num_tiles = kv_end > 0 ? (kv_end + BLOCK_N - 1) / BLOCK_N : 0;

  if (tid == 0) {
#pragma unroll
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(FULL_K(s), 1);
      mbar_init(FULL_V(s), 1);
      mbar_init(EMPTY_K(s), 4 * NUM_CONSUMERS);   // lane 0 of every consumer warp
      mbar_init(EMPTY_V(s), 4 * NUM_CONSUMERS);
    }
    mbar_init_fence();
  }
  __syncthreads();

  if (tid < 128) {
    // ------------------------------------------------------------------ producer
    setmaxnreg_dec<PRODUCER_REGS>();
    if (tid == 0) {
      for (int t = 0; t < num_tiles; ++t) {
        const int s = t % STAGES;
        const uint32_t ph = (t / STAGES) & 1;
        const int tok = kv_base + t * BLOCK_N;
        mbar_wait(EMPTY_K(s), ph ^ 1);
        mbar_arrive_expect_tx(FULL_K(s), TILE_BYTES);
#pragma unroll
        for (int h = 0; h < D / 64; ++h) tma_load_3d(sK + s * TILE_BYTES + h * HALF_BYTES, &tmap_k, h * 64, tok, kvh, FULL_K(s));
        mbar_wait(EMPTY_V(s), ph ^ 1);
        mbar_arrive_expect_tx(FULL_V(s), TILE_BYTES);
#pragma unroll
        for (int h = 0; h < D / 64; ++h) tma_load_3d(sV + s * TILE_BYTES + h * HALF_BYTES, &tmap_v, h * 64, tok, kvh, FULL_V(s));
      }
    }
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
    const int c = wt % 16;
#pragma unroll
    for (int j = 0; j < WG_ROWS / 8; ++j) {
      const int r = wg * WG_ROWS + wt / 16 + 8 * j;
      const int pr = row0 + r;
      const bool ok = pr < packed_rows;
      const dtype_t* src = ok ? q + (q_base + pr / group) * q_s_tok + (kvh * group + pr % group) * q_s_head + c * 8 : q;
      cp_async_16(sQ + swz128(BLOCK_M, r, c), src, ok ? 16 : 0);
    }
    cp_async_commit();
    cp_async_wait<0>();
    fence_proxy_async();                   // cp.async writes -> wgmma reads
    named_barrier(1 + wg, 128);
  }

  // -- per-thread rows: local row wg * 64 + warp * 16 + g + 8 h
  const int my_row0 = row0 + wg * WG_ROWS + warp * 16 + g;
  int mask_from = kv_len;                  // tiles reaching past this key need element masks
  if (CAUSAL) mask_from = min(kv_len, (row0 + wg * WG_ROWS) / group + causal_shift + 1);
  float acc[64];
  float m_i[2] = {NEG_INF, NEG_INF}, l_i[2] = {0.f, 0.f};
#pragma unroll
  for (int i = 0; i < 64; ++i) acc[i] = 0.f;
  uint32_t p[BLOCK_N / 16][4];

  // -- S = Q K(t)^T issued (not waited for)
  auto issue_qk = [&](float (&s)[64], int t) {
    const uint32_t sKs = sK + (t % STAGES) * TILE_BYTES;
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      const uint64_t da = wgmma_desc(sQ + (kk / 4) * (BLOCK_M * 128) + wg * (WG_ROWS * 128) + (kk % 4) * 32, 16, 1024);
      const uint64_t db = wgmma_desc(sKs + (kk / 4) * HALF_BYTES + (kk % 4) * 32, 16, 1024);
      wgmma_m64n128k16_ss<dtype_t>(s, da, db, kk > 0);
    }
    wgmma_commit();
  };
  // -- O += P V(t) issued (not waited for)
  auto issue_pv = [&](int t) {
    const uint32_t sVs = sV + (t % STAGES) * TILE_BYTES;
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < BLOCK_N / 16; ++kk)
      wgmma_m64n128k16_rs_tb<dtype_t>(acc, p[kk], wgmma_desc(sVs + kk * 16 * 128, HALF_BYTES, 1024));
    wgmma_commit();
  };
  // -- mask tile t of S (boundary / diagonal tiles only)
  auto mask_tile = [&](float (&s)[64], int t) {
    const int kv0 = t * BLOCK_N;
    if (kv0 + BLOCK_N <= mask_from) return;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int qpos = (my_row0 + 8 * h) / group;
#pragma unroll
      for (int n = 0; n < BLOCK_N / 8; ++n)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int kpos = kv0 + n * 8 + 2 * t4 + e;
          bool keep = kpos < kv_len;
          if (CAUSAL) keep = keep && kpos <= qpos + causal_shift;
          if (!keep) s[4 * n + 2 * h + e] = NEG_INF;
        }
    }
  };
  // -- online softmax (base 2): m, l updated, S becomes P (fp32), corr = rescale factor of O
  auto softmax = [&](float (&s)[64], float (&corr)[2]) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float mx = NEG_INF;
#pragma unroll
      for (int n = 0; n < BLOCK_N / 8; ++n) mx = fmaxf(mx, fmaxf(s[4 * n + 2 * h], s[4 * n + 2 * h + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float m_new = fmaxf(m_i[h], mx * scale_log2);
      const float m_use = m_new == NEG_INF ? 0.f : m_new;   // fully masked so far: no NaN
      corr[h] = exp2_approx(m_i[h] - m_use);
      m_i[h] = m_new;
      float sum = 0.f;
#pragma unroll
      for (int n = 0; n < BLOCK_N / 8; ++n)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float pv = exp2_approx(fmaf(s[4 * n + 2 * h + e], scale_log2, -m_use));
          s[4 * n + 2 * h + e] = pv;
          sum += pv;
        }
      l_i[h] = l_i[h] * corr[h] + sum;     // per-thread partial; quad-reduced at the end
    }
  };
  auto rescale_o = [&](const float (&corr)[2]) {
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      acc[4 * n + 0] *= corr[0];
      acc[4 * n + 1] *= corr[0];
      acc[4 * n + 2] *= corr[1];
      acc[4 * n + 3] *= corr[1];
    }
  };
  // -- P (fp32 accumulator layout) -> 16-bit A fragments, one per 16 keys
  auto pack_p = [&](const float (&s)[64]) {
#pragma unroll
    for (int kk = 0; kk < BLOCK_N / 16; ++kk) {
      p[kk][0] = pack2<dtype_t>(s[8 * kk + 0], s[8 * kk + 1]);
      p[kk][1] = pack2<dtype_t>(s[8 * kk + 2], s[8 * kk + 3]);
      p[kk][2] = pack2<dtype_t>(s[8 * kk + 4], s[8 * kk + 5]);
      p[kk][3] = pack2<dtype_t>(s[8 * kk + 6], s[8 * kk + 7]);
    }
  };
  auto release = [&](uint32_t bar) {       // this warp is done reading a K or V buffer
    __syncwarp();
    if (lane == 0) mbar_arrive(bar);
  };

  if (num_tiles > 0) {
    {  // -- tile 0: S, softmax, P (O is still zero: nothing to rescale)
      float s[64], corr[2];
      mbar_wait(FULL_K(0), 0);
      issue_qk(s, 0);
      wgmma_wait<0>();
      wgmma_fence_regs(s);
      release(EMPTY_K(0));
      mask_tile(s, 0);
      softmax(s, corr);
      pack_p(s);
    }
    for (int t = 1; t < num_tiles; ++t) {
      float s[64], corr[2];
      const int ps = (t - 1) % STAGES;
      mbar_wait(FULL_K(t % STAGES), (t / STAGES) & 1);
      issue_qk(s, t);
      mbar_wait(FULL_V(ps), ((t - 1) / STAGES) & 1);
      issue_pv(t - 1);
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
    issue_pv(lt);
    wgmma_wait<0>();
    wgmma_fence_regs(acc);
    release(EMPTY_V(lt % STAGES));
  }

  allow_next_grid();    // only the epilogue is left: the next kernel may start its prologue

  // -- epilogue: O / l, natural-log LSE; fully masked rows give 0 and -inf
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float l = l_i[h];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    const int pr = my_row0 + 8 * h;
    if (pr >= packed_rows) continue;
    store_output_row<D>(o, o_s_tok, o_s_head, lse, num_qo_heads, q_base + pr / group, kvh * group + pr % group, t4,
                        l, m_i[h], [&](int n) { return make_float2(acc[4 * n + 2 * h], acc[4 * n + 2 * h + 1]); });
  }
#undef FULL_K
#undef FULL_V
#undef EMPTY_K
#undef EMPTY_V
}
