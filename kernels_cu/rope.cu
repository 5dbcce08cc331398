// rope.cu — launched by cuattn/rope.py (RopeSpec).
// Compile-time: DTYPE (0: f16, 1: bf16), the storage type of q, k and their outputs. Everything else
// is a launch argument: head_dim, rotary_dim, the style, where positions come from, the frequencies
// or a cos/sin cache, whether accesses are vectorized.
// Entries cuattn_rope_p1, _p2, _p4, _p8: a lane owns P pairs of a head row, so the entry with
// 32 * P >= rotary_dim / 2 serves a rotary_dim (up to 2 * 32 * 8 = 512); each has its own registers.
// Grid (blocks, head_splits); block 128 = 4 warps. Warp w of block b takes the tokens t = 4b + w,
// t + 4 * gridDim.x, ...; of each token it rotates the heads blockIdx.y, blockIdx.y + gridDim.y, ... of
// its num_qo_heads + num_kv_heads heads (q's first), ROWS = min(16 / P, 8) rows at a time: all loaded,
// then all rotated and written (2 KB of rows a warp in flight, 1 KB for rotary_dim <= 64).
// A lane computes the cos/sin of its P pairs once per token (the pairs' frequencies come from shared
// memory, computed once per block) and applies them to every head row of the token.
// vector != 0 (the launcher checked alignment and rotary_dim / 2 % P == 0): a row is served by
// lanes_per_row = rotary_dim / 2 / P lanes (32 / lanes_per_row rows at once: the P = 8 entry serves
// rotary_dim 16 to 512 with 16-byte accesses); sub-lane s owns the pairs sP .. sP + P - 1, read
// interleaved as one run of 2P elements at 2sP, NeoX as two runs of P elements at sP and
// rotary_dim/2 + sP, in 4- to 16-byte accesses; vector == 0: the whole warp serves a row, lane l owns
// pairs l + 32i, read in coalesced 2-byte accesses. A lane writes exactly the elements it read, so out == in (the
// in-place forms) is safe. Elements past rotary_dim are not touched: cuattn_rope_tail copies them to
// separate outputs (grid (blocks), block 256: one access of tail_unit = 2 to 16 bytes a thread, as the
// launcher found the tails aligned, over every row's tail).
// Positions: pos_ids[t]; or, with pos_ids == nullptr, ragged: b = the last request with indptr[b] <= t
// (binary search, clamped into [0, batch)), pos = offsets[b] + t - indptr[b]. int32 or int64 (idx64).
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
constexpr int MAX_HALF = 32 * 8;      // pairs of the widest entry (p8): rotary_dim <= 512
constexpr int LANE_WORDS = 16;        // row words a lane keeps in flight: ROWS * P (8 at P = 1)

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
  bool interleave, idx64;
  int64_t q_n, q_h, k_n, k_h, qo_n, qo_h, ko_n, ko_h, cache_n, cache_len;
  RopeFreq freq;
};

__device__ __forceinline__ int64_t load_index(const void* p, int64_t i, bool idx64) {
  return idx64 ? static_cast<const int64_t*>(p)[i] : int64_t(static_cast<const int32_t*>(p)[i]);
}

__device__ __forceinline__ int64_t token_position(const RopeArgs& a, int64_t t) {
  if (a.pos_ids != nullptr) return load_index(a.pos_ids, t, a.idx64);
  // -- the last request b in [0, batch) with indptr[b] <= t (empty requests before it are skipped)
  int lo = 0, hi = a.batch - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (load_index(a.indptr, mid, a.idx64) <= t) lo = mid;
    else hi = mid - 1;
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

// The pair a lane's slot i holds: lP + i (vector) or l + 32i (coalesced 2-byte accesses).
template <int P, bool VECTOR>
__device__ __forceinline__ int lane_pair(int lane, int i) {
  return VECTOR ? lane * P + i : lane + 32 * i;
}

// -- one head row's pairs of this lane as pair words w[i] = (first element | second element << 16)
template <int P, bool VECTOR>
__device__ __forceinline__ void load_pairs(const elem_t* row, int half, bool interleave, int lane, uint32_t (&w)[P]) {
  if constexpr (VECTOR) {
    const int j0 = lane * P;
    if (j0 >= half) return;
    if (interleave) {
      load_bits<2 * P>(row + 2 * j0, w);                       // (a0 b0)(a1 b1)...: pair words already
    } else if constexpr (P == 1) {
      uint32_t a, b;
      load_bits<1>(row + j0, &a);
      load_bits<1>(row + half + j0, &b);
      w[0] = a | (b << 16);
    } else {
      uint32_t ra[P / 2], rb[P / 2];                           // runs (a0 a1)(a2 a3).., (b0 b1)..
      load_bits<P>(row + j0, ra);
      load_bits<P>(row + half + j0, rb);
#pragma unroll
      for (int i = 0; i < P / 2; ++i)                          // -> (a0 b0)(a1 b1)..: one byte permute each
        w[2 * i] = __byte_perm(ra[i], rb[i], 0x5410), w[2 * i + 1] = __byte_perm(ra[i], rb[i], 0x7632);
    }
  } else {
#pragma unroll
    for (int i = 0; i < P; ++i) {
      const int j = lane_pair<P, false>(lane, i);
      if (j >= half) break;
      const int ia = interleave ? 2 * j : j, ib = interleave ? 2 * j + 1 : j + half;
      w[i] = uint32_t(reinterpret_cast<const uint16_t*>(row)[ia]) |
             (uint32_t(reinterpret_cast<const uint16_t*>(row)[ib]) << 16);
    }
  }
}

template <int P, bool VECTOR>
__device__ __forceinline__ void rotate_store_pairs(elem_t* row, int half, bool interleave, int lane, uint32_t (&w)[P],
                                                   const float2 (&cs)[P]) {
  if (lane_pair<P, VECTOR>(lane, 0) >= half) return;
#pragma unroll
  for (int i = 0; i < P; ++i) {
    const float2 x = unpack2<elem_t>(w[i]);
    const float2 y = rope_rotate(x.x, x.y, cs[i]);
    w[i] = pack2<elem_t>(y.x, y.y);
  }
  if constexpr (VECTOR) {
    const int j0 = lane * P;
    if (interleave) {
      store_bits<2 * P>(row + 2 * j0, w);
    } else if constexpr (P == 1) {
      const uint32_t a = w[0] & 0xffffu, b = w[0] >> 16;
      store_bits<1>(row + j0, &a);
      store_bits<1>(row + half + j0, &b);
    } else {
      uint32_t ra[P / 2], rb[P / 2];
#pragma unroll
      for (int i = 0; i < P / 2; ++i)                          // (a0 b0)(a1 b1) -> (a0 a1), (b0 b1)
        ra[i] = __byte_perm(w[2 * i], w[2 * i + 1], 0x5410), rb[i] = __byte_perm(w[2 * i], w[2 * i + 1], 0x7632);
      store_bits<P>(row + j0, ra);
      store_bits<P>(row + half + j0, rb);
    }
  } else {
#pragma unroll
    for (int i = 0; i < P; ++i) {
      const int j = lane_pair<P, false>(lane, i);
      if (j >= half) break;
      const int ia = interleave ? 2 * j : j, ib = interleave ? 2 * j + 1 : j + half;
      reinterpret_cast<uint16_t*>(row)[ia] = uint16_t(w[i] & 0xffffu);
      reinterpret_cast<uint16_t*>(row)[ib] = uint16_t(w[i] >> 16);
    }
  }
}

template <int P, bool VECTOR>
__device__ __forceinline__ void rope_tokens(const RopeArgs& a, const ff32* half_turns) {
  constexpr int ROWS = LANE_WORDS / P < 8 ? LANE_WORDS / P : 8;     // 8 at P = 1: ptxas spilled 16
  const int lpr = VECTOR ? a.lanes_per_row : 32;
  const int lane = (threadIdx.x & 31) % lpr;        // the sub-lane within its row's lanes
  const int step = 32 / lpr;                        // rows served at once by the warp
  const int row_of_lane = (threadIdx.x & 31) / lpr;
  const int half = a.rotary_dim >> 1;
  const int heads = a.num_qo_heads + a.num_kv_heads;
  const bool cached = a.cache != nullptr;

  for (int64_t t = int64_t(blockIdx.x) * WARPS + (threadIdx.x >> 5); t < a.nnz; t += int64_t(gridDim.x) * WARPS) {
    const int64_t pos = token_position(a, t);

    // -- cos/sin of this lane's pairs at this token, shared by all its heads
    float2 cs[P];
    const bool in_cache = cached && pos >= 0 && pos < a.cache_len;
    const float* crow = in_cache ? a.cache + pos * a.cache_n : nullptr;
#pragma unroll
    for (int i = 0; i < P; ++i) {
      const int j = lane_pair<P, VECTOR>(lane, i);
      if (j >= half) {
        cs[i] = make_float2(1.f, 0.f);              // not used
      } else if (!cached) {
        cs[i] = rope_cos_sin(pos, half_turns[j]);
      } else if (in_cache) {
        cs[i] = make_float2(crow[j], crow[half + j]);
      } else {
        cs[i] = make_float2(__int_as_float(0x7fffffff), __int_as_float(0x7fffffff));   // NaN
      }
    }

    // -- the token's head rows, ROWS * step at a time (row r of a step: ROWS per lane): load all,
    //    then rotate and write all
    for (int h0 = blockIdx.y; h0 < heads; h0 += ROWS * step * gridDim.y) {
      uint32_t w[ROWS][P];
#pragma unroll
      for (int u = 0; u < ROWS; ++u) {
        const int h = h0 + (u * step + row_of_lane) * gridDim.y;
        if (h < heads) load_pairs<P, VECTOR>(row_in(a, t, h), half, a.interleave, lane, w[u]);
      }
#pragma unroll
      for (int u = 0; u < ROWS; ++u) {
        const int h = h0 + (u * step + row_of_lane) * gridDim.y;
        if (h >= heads) break;
        rotate_store_pairs<P, VECTOR>(row_out(a, t, h), half, a.interleave, lane, w[u], cs);
      }
    }
  }
}

// The whole kernel for P pairs a lane: the pairs' frequencies into shared memory once (unless cos and
// sin come from a cache), then the tokens.
template <int P>
__device__ __forceinline__ void rope_kernel(const RopeArgs& a, int vector) {
  __shared__ ff32 half_turns[MAX_HALF];
  if (a.cache == nullptr) {
    for (int j = threadIdx.x; j < a.rotary_dim / 2; j += blockDim.x) half_turns[j] = rope_half_turns(j, a.freq);
    __syncthreads();
  }
  if (vector) rope_tokens<P, true>(a, half_turns);
  else rope_tokens<P, false>(a, half_turns);
}

}  // namespace cuattn

using namespace cuattn;

// q: (t, h, d) at t*q_n + h*q_h + d, k likewise with k_n / k_h; q_out / k_out with qo_* / ko_* (equal
// to q / k for the in-place forms). The float pairs are RopeFreq's (hi, lo) values.
#define CUATTN_ROPE_ENTRY(P)                                                                                      \
  extern "C" __global__ void __launch_bounds__(WARPS * 32) cuattn_rope_p##P(                                    \
      const elem_t* q, const elem_t* k, elem_t* q_out, elem_t* k_out, const void* pos_ids, const void* indptr,    \
      const void* offsets, const float* cos_sin_cache, int nnz, int batch, int num_qo_heads, int num_kv_heads,    \
      int head_dim, int rotary_dim, int interleave, int idx64, int vector, int lanes_per_row, int64_t q_n,      \
      int64_t q_h,                                                                                                \
      int64_t k_n, int64_t k_h, int64_t qo_n, int64_t qo_h, int64_t ko_n, int64_t ko_h,                           \
      int64_t cache_n, int64_t cache_len, float step_hi, float step_lo, float smooth_a_hi, float smooth_a_lo,     \
      float smooth_b_hi, float smooth_b_lo, float scaled_pi_hi, float scaled_pi_lo, float unscaled_pi_hi,         \
      float unscaled_pi_lo) {                                                                                     \
    const RopeArgs a{q, k, q_out, k_out, pos_ids, indptr, offsets, cos_sin_cache, nnz, batch, num_qo_heads,      \
                     num_kv_heads, head_dim, rotary_dim, lanes_per_row, interleave != 0, idx64 != 0, q_n, q_h,    \
                     k_n, k_h, qo_n, qo_h, ko_n, ko_h, cache_n, cache_len,                                        \
                     RopeFreq{{step_hi, step_lo}, {smooth_a_hi, smooth_a_lo}, {smooth_b_hi, smooth_b_lo},         \
                              {scaled_pi_hi, scaled_pi_lo}, {unscaled_pi_hi, unscaled_pi_lo}}};                   \
    rope_kernel<P>(a, vector);                                                                                    \
  }

CUATTN_ROPE_ENTRY(1)
CUATTN_ROPE_ENTRY(2)
CUATTN_ROPE_ENTRY(4)
CUATTN_ROPE_ENTRY(8)

// The elements past rotary_dim of every head row, copied to the separate outputs of the returning forms
// in accesses of T: thread g copies unit g % units of row g / units (rows: token-major, q's heads first).
template <class T, class I>     // I: the index type, 32-bit unless there are 2^32 units or more
__device__ __forceinline__ void copy_tails(const RopeArgs& a, I units, I total) {
  const I heads = I(a.num_qo_heads + a.num_kv_heads);
  for (I g = I(blockIdx.x) * blockDim.x + threadIdx.x; g < total; g += I(gridDim.x) * blockDim.x) {
    const I row = g / units, e = g - row * units;
    const I t = row / heads;
    const int h = int(row - t * heads);
    const T v = reinterpret_cast<const T*>(row_in(a, t, h) + a.rotary_dim)[e];
    reinterpret_cast<T*>(row_out(a, t, h) + a.rotary_dim)[e] = v;
  }
}

template <class T>
__device__ __forceinline__ void copy_tails(const RopeArgs& a) {
  const int64_t units = (a.head_dim - a.rotary_dim) * int64_t(sizeof(elem_t)) / int64_t(sizeof(T));
  const int64_t total = units * (a.num_qo_heads + a.num_kv_heads) * a.nnz;
  if (total < (int64_t(1) << 32)) copy_tails<T, uint32_t>(a, uint32_t(units), uint32_t(total));
  else copy_tails<T, int64_t>(a, units, total);
}

extern "C" __global__ void __launch_bounds__(256) cuattn_rope_tail(
    const elem_t* q, const elem_t* k, elem_t* q_out, elem_t* k_out, int nnz, int num_qo_heads, int num_kv_heads,
    int head_dim, int rotary_dim, int tail_unit, int64_t q_n, int64_t q_h, int64_t k_n, int64_t k_h, int64_t qo_n,
    int64_t qo_h, int64_t ko_n, int64_t ko_h) {
  RopeArgs a{};
  a.q = q, a.k = k, a.q_out = q_out, a.k_out = k_out, a.nnz = nnz, a.num_qo_heads = num_qo_heads;
  a.num_kv_heads = num_kv_heads, a.head_dim = head_dim, a.rotary_dim = rotary_dim;
  a.q_n = q_n, a.q_h = q_h, a.k_n = k_n, a.k_h = k_h, a.qo_n = qo_n, a.qo_h = qo_h, a.ko_n = ko_n, a.ko_h = ko_h;
  if (tail_unit == 16) copy_tails<uint4>(a);
  else if (tail_unit == 8) copy_tails<uint2>(a);
  else if (tail_unit == 4) copy_tails<uint32_t>(a);
  else copy_tails<uint16_t>(a);
}
