// rope.cu — launched by cuattn/rope.py (RopeSpec).
// Compile-time: DTYPE (0: f16, 1: bf16), the storage type of q, k and their outputs. Everything else
// is a launch argument: head_dim, rotary_dim, the style, where positions come from, the frequencies
// or a cos/sin cache, the lane layout, whether accesses are vectorized, how tails are copied.
// Entries cuattn_rope_p1, _p2, _p4, _p8: a lane owns P pairs of a head row; each entry has its own
// registers. One launch does everything: every byte of q and k is read once and written once.
// cuattn_rope_cache_neox / _gptj (end of the file): the same code for the cos_sin_cache launches of 8 pairs a lane
// in vector accesses with no tail, the style fixed at compile time.
// Grid (blocks, head_splits); block 128 = 4 warps; __launch_bounds__(128, 4) keeps 4 blocks (16 warps)
// an SM at least. Warp w of block b takes the tokens t = 4b + w, t + 4 * gridDim.x, ...; of each token
// the heads blockIdx.y + k * gridDim.y (q's first), in as few steps as its registers allow (ROWS rows a
// lane, lanes_per_row lanes a row: up to 8 KB of rows a warp in flight), spread evenly over the steps.
// Per token: the first step's rows are loaded first, then the position is read and the lanes write
// the cos/sin of the token's pairs (computed with common/rope.cuh, or read from cos_sin_cache), each
// pair once, into the warp's table in shared memory; each lane takes its pairs' values from there.
// So the latency of the position, of the cache row and the trigonometry overlap the rows' loads.
// vector != 0 (the launcher checked the alignment of every base and stride): a row is served by
// lanes_per_row lanes (32 / lanes_per_row rows at once, spare lanes idle); sub-lane s < rotary_dim / 2 / P
// rotates the pairs sP .. sP + P - 1, read interleaved as one run of 2P elements at 2sP, NeoX as two runs
// of P elements at sP and rotary_dim/2 + sP (4- to 16-byte accesses); sub-lanes past those (the returning
// forms, when lanes_per_row covers the whole head) copy the 2P elements at 2sP, in the same accesses.
// vector == 0: the whole warp serves a row, lane l owns pairs l + 32i, coalesced 2-byte accesses.
// A lane writes exactly the elements it read, so out == in (the in-place forms) is safe.
// Elements past rotary_dim not covered by lanes (tail_unit != 0: the returning forms) are copied
// after each row by the row's lanes in accesses of tail_unit = 2 to 16 bytes (the launcher found the
// tails, bases and strides aligned to it); the in-place forms pass tail_unit 0 and leave them.
// Positions: pos_ids[t]; or, with pos_ids == nullptr, ragged: b = the last request with indptr[b] <= t
// (a 32-way search by the warp, in [0, batch) whatever indptr holds), pos = offsets[b] + t - indptr[b].
// int32 or int64 (idx64).
// The launcher checks shapes, not the contents of device metadata (that would need a sync): whatever
// they hold, nothing is read or written out of bounds.
// cos/sin: computed (common/rope.cuh), or, when cos_sin_cache != nullptr, read from row pos of
// cos_sin_cache (float32 [cache_len, rotary_dim], row stride cache_n: cos of pair j at j, its sin at
// rotary_dim/2 + j); a position outside [0, cache_len) gives NaN in that token's rotated elements.
#include "common/dtypes.cuh"
#include "common/elem_dtype.cuh"
#include "common/rope.cuh"

namespace cuattn {

constexpr int WARPS = 4;
constexpr int MIN_BLOCKS = 4;         // resident blocks an SM: registers capped at 128 a thread
constexpr int MAX_HALF = 32 * 8;      // pairs of the widest entry (p8): rotary_dim <= 512
constexpr int LANE_WORDS = 64;        // row words a lane keeps in flight, vector accesses: ROWS * P (256 bytes)
constexpr int LANE_WORDS_2B = 16;     // the same for 2-byte accesses (their addresses take registers too)

struct RopeArgs {
  const elem_t* q;
  const elem_t* k;
  elem_t* q_out;
  elem_t* k_out;
  const void* pos_ids;
  const void* indptr;
  const void* offsets;
  const float* cache;
  int nnz, batch, num_qo_heads, num_kv_heads, head_dim, rotary_dim;
  int lanes_per_row;   // vector accesses: lanes that serve one head row (32 / it rows at once); else 32
  int tail_unit;       // bytes of a tail copy access; 0: no tail copy
  bool interleave, idx64;
  bool cached;         // cos/sin from cache (else computed from freq)
  int64_t q_n, q_h, k_n, k_h, qo_n, qo_h, ko_n, ko_h, cache_n, cache_len;
  RopeFreq freq;
};

__device__ __forceinline__ int64_t load_index(const void* p, int64_t i, bool idx64) {
  return idx64 ? static_cast<const int64_t*>(p)[i] : int64_t(static_cast<const int32_t*>(p)[i]);
}

// -- the position of token t, by a whole warp (t the same in every lane)
__device__ __forceinline__ int64_t token_position(const RopeArgs& a, int64_t t, int lane) {
  if (a.pos_ids != nullptr) return load_index(a.pos_ids, t, a.idx64);
  // -- the last request b in [0, batch) with indptr[b] <= t (empty requests before it are skipped):
  //    each round the 32 lanes probe the starts of 32 chunks of the candidates [lo, lo + n) and keep the
  //    last chunk whose start is <= t (decode, one token a request: 64 requests take 2 dependent loads)
  int lo = 0, n = a.batch;
  while (n > 1) {
    const int chunk = (n + 31) >> 5, at = lo + lane * chunk;
    const bool before = at < lo + n && load_index(a.indptr, at, a.idx64) <= t;
    const unsigned ballot = __ballot_sync(0xffffffffu, before);
    const int keep = ballot ? 31 - __clz(ballot) : 0;
    lo += keep * chunk;
    n = min(chunk, n - keep * chunk);
  }
  return load_index(a.offsets, lo, a.idx64) + t - load_index(a.indptr, lo, a.idx64);
}

// Head row h of token t: its input and its output.
__device__ __forceinline__ const elem_t* row_in(const RopeArgs& a, int64_t t, int h) {
  return h < a.num_qo_heads ? a.q + t * a.q_n + h * a.q_h : a.k + t * a.k_n + (h - a.num_qo_heads) * a.k_h;
}
__device__ __forceinline__ elem_t* row_out(const RopeArgs& a, int64_t t, int h) {
  return h < a.num_qo_heads ? a.q_out + t * a.qo_n + h * a.qo_h
                            : a.k_out + t * a.ko_n + (h - a.num_qo_heads) * a.ko_h;
}

// -- N consecutive 16-bit elements as N / 2 words (element 2i in the low half of word i), in accesses
//    of up to 16 bytes (the caller guarantees alignment to min(2N, 16) bytes); N == 1: the low half of w[0]
template <int N>
__device__ __forceinline__ void load_bits(const elem_t* p, uint32_t* w) {
  if constexpr (N == 1) {
    w[0] = reinterpret_cast<const uint16_t*>(p)[0];
  } else if constexpr (N == 2) {
    w[0] = *reinterpret_cast<const uint32_t*>(p);
  } else if constexpr (N == 4) {
    const uint2 v = *reinterpret_cast<const uint2*>(p);
    w[0] = v.x, w[1] = v.y;
  } else {
#pragma unroll
    for (int i = 0; i < N / 8; ++i) {
      const uint4 v = reinterpret_cast<const uint4*>(p)[i];
      w[4 * i] = v.x, w[4 * i + 1] = v.y, w[4 * i + 2] = v.z, w[4 * i + 3] = v.w;
    }
  }
}

template <int N>
__device__ __forceinline__ void store_bits(elem_t* p, const uint32_t* w) {
  if constexpr (N == 1) {
    reinterpret_cast<uint16_t*>(p)[0] = uint16_t(w[0]);
  } else if constexpr (N == 2) {
    *reinterpret_cast<uint32_t*>(p) = w[0];
  } else if constexpr (N == 4) {
    *reinterpret_cast<uint2*>(p) = make_uint2(w[0], w[1]);
  } else {
#pragma unroll
    for (int i = 0; i < N / 8; ++i)
      reinterpret_cast<uint4*>(p)[i] = make_uint4(w[4 * i], w[4 * i + 1], w[4 * i + 2], w[4 * i + 3]);
  }
}

// -- where a lane's elements sit in a head row, fixed for the whole kernel
struct LaneSpan {
  int off_a, off_b;    // vector: the two runs (NeoX) or the one run (interleaved: off_a) of the lane
  bool rotates;        // false: a copy lane (vector) or a lane past the rotated pairs
  bool works;          // false: idle (past the rows a warp serves at once, or no pair of its own)
};

template <int P, bool VECTOR>
__device__ __forceinline__ LaneSpan lane_span(const RopeArgs& a, int sub, int slot, int per_warp) {
  const int half = a.rotary_dim >> 1;
  LaneSpan s;
  if constexpr (VECTOR) {
    s.rotates = sub * P < half;
    s.works = slot < per_warp;
    if (a.interleave || !s.rotates) s.off_a = 2 * P * sub, s.off_b = 2 * P * sub + P;
    else s.off_a = P * sub, s.off_b = half + P * sub;
  } else {
    s.rotates = sub < half;
    s.works = true;
    s.off_a = s.off_b = 0;
  }
  return s;
}

// -- one head row's elements of this lane, as raw words: vector NeoX (P >= 2): w[0, P/2) the run at
//    off_a, w[P/2, P) the run at off_b; P == 1 or interleaved or the 2-byte path: pair words
//    (first element | second << 16); copy lanes: the 2P elements in order
template <int P, bool VECTOR>
__device__ __forceinline__ void load_lane(const elem_t* row, const RopeArgs& a, const LaneSpan& s, int lane,
                                          uint32_t (&w)[P]) {
  if constexpr (VECTOR) {
    if (a.interleave) {
      load_bits<2 * P>(row + s.off_a, w);
    } else if constexpr (P == 1) {
      uint32_t x, y;
      load_bits<1>(row + s.off_a, &x);
      load_bits<1>(row + s.off_b, &y);
      w[0] = x | (y << 16);
    } else {
      load_bits<P>(row + s.off_a, w);
      load_bits<P>(row + s.off_b, w + P / 2);
    }
  } else {
    const int half = a.rotary_dim >> 1;
#pragma unroll
    for (int i = 0; i < P; ++i) {
      const int j = lane + 32 * i;
      if (j >= half) break;
      const int ia = a.interleave ? 2 * j : j, ib = a.interleave ? 2 * j + 1 : j + half;
      w[i] = uint32_t(reinterpret_cast<const uint16_t*>(row)[ia]) |
             (uint32_t(reinterpret_cast<const uint16_t*>(row)[ib]) << 16);
    }
  }
}

template <int P, bool VECTOR>
__device__ __forceinline__ void store_lane(elem_t* row, const RopeArgs& a, const LaneSpan& s, int lane,
                                           const uint32_t (&w)[P]) {
  if constexpr (VECTOR) {
    if (a.interleave) {
      store_bits<2 * P>(row + s.off_a, w);
    } else if constexpr (P == 1) {
      const uint32_t x = w[0] & 0xffffu, y = w[0] >> 16;
      store_bits<1>(row + s.off_a, &x);
      store_bits<1>(row + s.off_b, &y);
    } else {
      store_bits<P>(row + s.off_a, w);
      store_bits<P>(row + s.off_b, w + P / 2);
    }
  } else {
    const int half = a.rotary_dim >> 1;
#pragma unroll
    for (int i = 0; i < P; ++i) {
      const int j = lane + 32 * i;
      if (j >= half) break;
      const int ia = a.interleave ? 2 * j : j, ib = a.interleave ? 2 * j + 1 : j + half;
      reinterpret_cast<uint16_t*>(row)[ia] = uint16_t(w[i] & 0xffffu);
      reinterpret_cast<uint16_t*>(row)[ib] = uint16_t(w[i] >> 16);
    }
  }
}

// -- the rotation of a rotating lane's words, in place (the layout of load_lane)
__device__ __forceinline__ uint32_t rotate_word(uint32_t w, float2 cs) {
  const float2 x = unpack2<elem_t>(w);
  const float2 y = rope_rotate(x.x, x.y, cs);
  return pack2<elem_t>(y.x, y.y);
}

template <int P, bool VECTOR>
__device__ __forceinline__ void rotate_lane(const RopeArgs& a, uint32_t (&w)[P], const float2 (&cs)[P]) {
  if (VECTOR && P >= 2 && !a.interleave) {
#pragma unroll
    for (int i = 0; i < P / 2; ++i) {             // runs (a0 a1)(a2 a3).., (b0 b1).. -> pairs (a0 b0)(a1 b1)
      const uint32_t ra = w[i], rb = w[P / 2 + i];
      const uint32_t p0 = rotate_word(__byte_perm(ra, rb, 0x5410), cs[2 * i]);
      const uint32_t p1 = rotate_word(__byte_perm(ra, rb, 0x7632), cs[2 * i + 1]);
      w[i] = __byte_perm(p0, p1, 0x5410), w[P / 2 + i] = __byte_perm(p0, p1, 0x7632);
    }
  } else {
#pragma unroll
    for (int i = 0; i < P; ++i) w[i] = rotate_word(w[i], cs[i]);
  }
}

// -- the elements past rotary_dim of one row, by the row's lanes, in accesses of T
template <class T>
__device__ __forceinline__ void copy_units(const elem_t* in, elem_t* out, int units, int sub, int lanes) {
  const T* s = reinterpret_cast<const T*>(in);
  T* d = reinterpret_cast<T*>(out);
  for (int e = sub; e < units; e += lanes) d[e] = s[e];
}

__device__ __forceinline__ void copy_tail(const RopeArgs& a, const elem_t* in, elem_t* out, int sub, int lanes) {
  const int bytes = (a.head_dim - a.rotary_dim) * int(sizeof(elem_t));
  in += a.rotary_dim, out += a.rotary_dim;
  if (a.tail_unit == 16) copy_units<uint4>(in, out, bytes / 16, sub, lanes);
  else if (a.tail_unit == 8) copy_units<uint2>(in, out, bytes / 8, sub, lanes);
  else if (a.tail_unit == 4) copy_units<uint32_t>(in, out, bytes / 4, sub, lanes);
  else copy_units<uint16_t>(in, out, bytes / 2, sub, lanes);
}

template <int P, bool VECTOR, int WORDS = VECTOR ? LANE_WORDS : LANE_WORDS_2B, bool PIPE = false>
__device__ __forceinline__ void rope_tokens(const RopeArgs& a, float2* table) {
  constexpr int ROWS = WORDS / P < 16 ? WORDS / P : 16;
  const int lane = threadIdx.x & 31;
  const int lpr = VECTOR ? a.lanes_per_row : 32;
  const int per_warp = 32 / lpr;                    // rows served at once
  const int sub = lane % lpr, slot = lane / lpr;
  const LaneSpan span = lane_span<P, VECTOR>(a, sub, slot, per_warp);
  const int half = a.rotary_dim >> 1;
  const bool tail_loop = a.tail_unit != 0 && !(VECTOR && lpr * P > half);   // tails not covered by lanes
  const bool cached = a.cached;
  // -- this block's heads blockIdx.y + k * gridDim.y, k < mine, in steps of per_warp * rows rows
  const int heads = a.num_qo_heads + a.num_kv_heads;
  const int mine = (heads - int(blockIdx.y) + int(gridDim.y) - 1) / int(gridDim.y);
  if (mine <= 0) return;                            // (the launcher splits heads at most heads ways)
  const int steps = (mine + per_warp * ROWS - 1) / (per_warp * ROWS);
  const int rows = (mine + per_warp * steps - 1) / (per_warp * steps);     // a lane's rows a step, <= ROWS

  for (int64_t t = int64_t(blockIdx.x) * WARPS + (threadIdx.x >> 5); t < a.nnz; t += int64_t(gridDim.x) * WARPS) {
    uint32_t w[ROWS][P];
    uint32_t w2[ROWS][P];                           // PIPE: the next step's rows (else unused)
    auto head_of = [&](int step, int u) { return (step * rows + u) * per_warp + slot; };   // k; head below
    auto load_step = [&](int step, uint32_t (&buf)[ROWS][P]) {
      if (!span.works) return;
#pragma unroll
      for (int u = 0; u < ROWS; ++u) {
        const int k = head_of(step, u);
        if (u < rows && k < mine) load_lane<P, VECTOR>(row_in(a, t, blockIdx.y + k * gridDim.y), a, span, lane, buf[u]);
      }
    };
    load_step(0, w);

    // -- the token's cos/sin, each pair once, into the warp's table; then this lane's pairs from it
    const int64_t pos = token_position(a, t, lane);
    const bool in_cache = cached && pos >= 0 && pos < a.cache_len;
    const float* crow = in_cache ? a.cache + pos * a.cache_n : nullptr;
    for (int j = lane; j < half; j += 32) {
      float2 c;
      if (!cached) c = rope_cos_sin(pos, rope_half_turns(j, a.freq));
      else if (in_cache) c = make_float2(crow[j], crow[half + j]);
      else c = make_float2(__int_as_float(0x7fffffff), __int_as_float(0x7fffffff));   // NaN
      table[j] = c;
    }
    __syncwarp();
    float2 cs[P];
    if constexpr (VECTOR && P >= 2) {
      const float4* t4 = reinterpret_cast<const float4*>(table + P * sub);   // 16-byte aligned: P even
#pragma unroll
      for (int i = 0; i < P / 2; ++i) {
        const float4 v = span.rotates ? t4[i] : make_float4(1.f, 0.f, 1.f, 0.f);
        cs[2 * i] = make_float2(v.x, v.y), cs[2 * i + 1] = make_float2(v.z, v.w);
      }
    } else {
#pragma unroll
      for (int i = 0; i < P; ++i) {
        const int j = VECTOR ? P * sub + i : lane + 32 * i;
        cs[i] = j < half ? table[j] : make_float2(1.f, 0.f);
      }
    }
    __syncwarp();     // every lane has its values before the next token's are written

    // -- rotate and write the loaded step, load the next
    auto write_step = [&](int step, uint32_t (&buf)[ROWS][P]) {
#pragma unroll
      for (int u = 0; u < ROWS; ++u) {
        const int k = head_of(step, u);
        if (!span.works || u >= rows || k >= mine) break;
        const int h = blockIdx.y + k * gridDim.y;
        elem_t* out = row_out(a, t, h);
        if (span.rotates) rotate_lane<P, VECTOR>(a, buf[u], cs);
        if (VECTOR || span.rotates) store_lane<P, VECTOR>(out, a, span, lane, buf[u]);
        if (tail_loop) copy_tail(a, row_in(a, t, h), out, sub, lpr);
      }
    };
    if constexpr (PIPE) {
      for (int step = 0; step < steps; step += 2) {
        if (step + 1 < steps) load_step(step + 1, w2);
        write_step(step, w);
        if (step + 1 < steps) {
          if (step + 2 < steps) load_step(step + 2, w);
          write_step(step + 1, w2);
        }
      }
    } else {
      for (int step = 0; step < steps; ++step) {
        if (step) load_step(step, w);
        write_step(step, w);
      }
    }
  }
}

template <int P>
__device__ __forceinline__ void rope_kernel(const RopeArgs& a, int vector) {
  __shared__ __align__(16) float2 tables[WARPS][MAX_HALF];    // per warp: the current token's cos/sin
  float2* table = tables[threadIdx.x >> 5];
  if (vector) rope_tokens<P, true>(a, table);
  else rope_tokens<P, false>(a, table);
}

}  // namespace cuattn

using namespace cuattn;

// q: (t, h, d) at t*q_n + h*q_h + d, k likewise with k_n / k_h; q_out / k_out with qo_* / ko_* (equal
// to q / k for the in-place forms). The float pairs are RopeFreq's (hi, lo) values.
// The entries' parameters (rope.py's _ARG_KINDS) and the RopeArgs they describe, shared by both kinds of entry.
#define CUATTN_ROPE_PARAMS                                                                                        \
      const elem_t *q, const elem_t *k, elem_t *q_out, elem_t *k_out, const void *pos_ids, const void *indptr,    \
      const void *offsets, const float *cos_sin_cache, int nnz, int batch, int num_qo_heads, int num_kv_heads,    \
      int head_dim, int rotary_dim, int interleave, int idx64, int vector, int lanes_per_row, int tail_unit,      \
      int64_t q_n, int64_t q_h, int64_t k_n, int64_t k_h, int64_t qo_n, int64_t qo_h, int64_t ko_n, int64_t ko_h, \
      int64_t cache_n, int64_t cache_len, float step_hi, float step_lo, float smooth_a_hi, float smooth_a_lo,     \
      float smooth_b_hi, float smooth_b_lo, float scaled_pi_hi, float scaled_pi_lo, float unscaled_pi_hi,         \
      float unscaled_pi_lo
#define CUATTN_ROPE_ARGS(TAIL_UNIT, INTERLEAVE, CACHED)                                                           \
  RopeArgs {                                                                                                      \
    q, k, q_out, k_out, pos_ids, indptr, offsets, cos_sin_cache, nnz, batch, num_qo_heads, num_kv_heads,          \
        head_dim, rotary_dim, lanes_per_row, TAIL_UNIT, INTERLEAVE, idx64 != 0, CACHED, q_n, q_h, k_n, k_h, qo_n, \
        qo_h, ko_n, ko_h, cache_n, cache_len,                                                                     \
        RopeFreq{{step_hi, step_lo}, {smooth_a_hi, smooth_a_lo}, {smooth_b_hi, smooth_b_lo},                      \
                 {scaled_pi_hi, scaled_pi_lo}, {unscaled_pi_hi, unscaled_pi_lo}}                                  \
  }

#define CUATTN_ROPE_ENTRY(P)                                                                                      \
  extern "C" __global__ void __launch_bounds__(WARPS * 32, MIN_BLOCKS) cuattn_rope_p##P(CUATTN_ROPE_PARAMS) {   \
    const RopeArgs a = CUATTN_ROPE_ARGS(tail_unit, interleave != 0, cos_sin_cache != nullptr);                   \
    rope_kernel<P>(a, vector);                                                                                    \
  }

CUATTN_ROPE_ENTRY(1)
CUATTN_ROPE_ENTRY(2)
CUATTN_ROPE_ENTRY(4)
CUATTN_ROPE_ENTRY(8)

// The cos_sin_cache forms vLLM and SGLang call, in their common launch (cuattn_rope_cache_neox / _gptj): vector
// accesses of P = 8 pairs a lane, no tail copy (in place, or rotary_dim == head_dim), the style and the cache fixed,
// so the general entries' run-time state folds away: 64 registers, 8 blocks (32 warps) an SM, a lane's row of the
// next step loaded before the current one is rotated and stored (PIPE). H100, 4096 tokens x 32:8 heads x 128 in
// place: 0.95x the time of the general p8 entry (4 blocks an SM, up to 8 rows a lane a step; session 21's A/B).
constexpr int CACHE_MIN_BLOCKS = 8;
constexpr int CACHE_WORDS = 8;          // row words a lane a step: one row of 8 pairs
#define CUATTN_ROPE_CACHE_ENTRY(STYLE, INTERLEAVE)                                                                \
  extern "C" __global__ void __launch_bounds__(WARPS * 32, CACHE_MIN_BLOCKS) cuattn_rope_cache_##STYLE(           \
      CUATTN_ROPE_PARAMS) {                                                                                       \
    __shared__ __align__(16) float2 tables[WARPS][MAX_HALF];                                                     \
    const RopeArgs a = CUATTN_ROPE_ARGS(0, INTERLEAVE, true);                /* (the frequencies go unread) */    \
    rope_tokens<8, true, CACHE_WORDS, true>(a, tables[threadIdx.x >> 5]);                                         \
  }

CUATTN_ROPE_CACHE_ENTRY(neox, false)
CUATTN_ROPE_CACHE_ENTRY(gptj, true)
