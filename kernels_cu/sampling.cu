// sampling.cu — launched by cuattn/sampling.py (SamplingSpec).
// Compile-time: BLOCK (threads of a CTA), NUM_PIVOTS (thresholds a search pass tests at once).
// Grid (batch) for cuattn_sample and cuattn_chain_speculative, (rows) for cuattn_renorm; one CTA per
// row, block BLOCK. Rows are float32, contiguous in the vocabulary; 16-byte loads when the vocabulary,
// the row stride and the base are multiples of 4 floats, else scalar loads.
//
// No sort. A row's kept set is {x : key(x) >= T}, key() the order-preserving uint32 of a float, and T
// the largest element key that is still "feasible": count(key >= T) >= top_k, or
// sum(value(key >= T)) >= top_p * row sum (value = x for probabilities, exp(x - max) for logits).
// The search keeps [lo, hi): lo a feasible element key, hi an infeasible key. Each pass reads the row
// once and tests NUM_PIVOTS keys between them (counts, value sums, and the nearest element keys on
// either side of each pivot, all block reductions in a fixed order); lo snaps up to the smallest element
// at or above the last feasible pivot, hi down to one past the largest element below the next pivot,
// until [lo, hi) holds one value. Every pass shrinks the interval, so the search ends.
// The token is then drawn by an exponential race over the kept set: argmin_i E_i / value_i with
// E_i = -log(1 - V_i) exponential, V_i uniform from Philox4x32-10 keyed by the seed, with counter
// (i / 4, row of the output, offset) — one Philox call per 4 elements — so the draw is exactly
// proportional to the kept values, needs no normalizing sum, and depends only on (seed, offset, output
// row, element): not on the block size or the order in which threads run. Ties go to the lower index.
// cuattn/sampling.py mirrors the random stream bit for bit on the NumPy path.
// common/dtypes.cuh: the integer typedefs (NVRTC has no system headers here)
#include "common/dtypes.cuh"

#ifndef BLOCK
#define BLOCK 1024
#endif
#ifndef NUM_PIVOTS
#define NUM_PIVOTS 6
#endif
#define NUM_WARPS (BLOCK / 32)
#define CAND_CAP 2048            // top-k candidates held in shared memory (the exact path for k <= BLOCK)

namespace cuattn {

#define kInf __int_as_float(0x7f800000)
constexpr uint32_t kTagRace = 0, kTagAccept = 1, kTagRecount = 2;
enum Flags { kFromLogits = 1, kJoint = 2, kTopK = 4, kTopP = 8, kMinP = 16 };

// -- order-preserving key of a float (-0 counted as +0)
__device__ __forceinline__ uint32_t ord_key(float f) {
  uint32_t b = __float_as_uint(f == 0.f ? 0.f : f);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

__device__ __forceinline__ float key_float(uint32_t k) {
  return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

// -- Philox4x32-10 (Salmon et al., Random123's round and key schedule)
__device__ __forceinline__ uint4 philox(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0,
                                        uint32_t k1) {
#pragma unroll
  for (int r = 0; r < 10; ++r) {
    const uint32_t lo0 = 0xD2511F53u * c0, hi0 = __umulhi(0xD2511F53u, c0);
    const uint32_t lo1 = 0xCD9E8D57u * c2, hi1 = __umulhi(0xCD9E8D57u, c2);
    const uint32_t n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
    c0 = n0; c1 = lo1; c2 = n2; c3 = lo0;
    k0 += 0x9E3779B9u; k1 += 0xBB67AE85u;
  }
  return make_uint4(c0, c1, c2, c3);
}

struct Rng {
  uint32_t k0, k1, off_lo, off_hi;
  __device__ uint4 draw(uint32_t group, uint32_t row, uint32_t tag) const {
    return philox(group, row, off_lo, off_hi ^ (tag << 24), k0, k1);
  }
};

// -- uniform in (0, 1) from 32 random bits, then an exponential variate: -log(1 - V) (fine near 0)
__device__ __forceinline__ float uniform01(uint32_t bits) {
  const float v = __fmul_rn(__uint2float_rn(bits), 2.3283064365386963e-10f);   // 2^-32
  return fminf(fmaxf(v, 1.1641532182693481e-10f), 0.99999994f);               // [2^-33, 1 - 2^-24]
}
__device__ __forceinline__ float exponential(uint32_t bits) { return -log1pf(-uniform01(bits)); }
__device__ __forceinline__ uint32_t pick(uint4 r, int e) { return e == 0 ? r.x : e == 1 ? r.y : e == 2 ? r.z : r.w; }

// -- block reductions in a fixed order (deterministic): every thread gets the result
template <typename T, typename Op>
__device__ __forceinline__ T warp_reduce(T x, Op op) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = op(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}
struct Sum { template <typename T> __device__ T operator()(T a, T b) const { return a + b; } };
struct Min { __device__ uint32_t operator()(uint32_t a, uint32_t b) const { return a < b ? a : b; } };
struct Max { __device__ uint32_t operator()(uint32_t a, uint32_t b) const { return a > b ? a : b; } };

// -- NUM_PIVOTS values of each of the four statistics, reduced over the block through shared memory
struct PivotStats {
  uint32_t cnt[NUM_PIVOTS];
  float sum[NUM_PIVOTS];
  uint32_t above[NUM_PIVOTS];  // smallest element key >= pivot
  uint32_t below[NUM_PIVOTS];  // largest element key in [lo, pivot)
};

__device__ __forceinline__ void reduce_pivots(PivotStats& s, uint32_t (*red)[4 * NUM_PIVOTS]) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int j = 0; j < NUM_PIVOTS; ++j) {
    s.cnt[j] = warp_reduce(s.cnt[j], Sum());
    s.sum[j] = warp_reduce(s.sum[j], Sum());
    s.above[j] = warp_reduce(s.above[j], Min());
    s.below[j] = warp_reduce(s.below[j], Max());
  }
  if (lane == 0) {
#pragma unroll
    for (int j = 0; j < NUM_PIVOTS; ++j) {
      red[warp][j] = s.cnt[j];
      red[warp][NUM_PIVOTS + j] = __float_as_uint(s.sum[j]);
      red[warp][2 * NUM_PIVOTS + j] = s.above[j];
      red[warp][3 * NUM_PIVOTS + j] = s.below[j];
    }
  }
  __syncthreads();
  if (threadIdx.x < 4 * NUM_PIVOTS) {   // one thread per statistic, warps in order
    const int t = threadIdx.x, kind = t / NUM_PIVOTS;
    uint32_t acc = red[0][t];
    for (int w = 1; w < NUM_WARPS; ++w) {
      const uint32_t v = red[w][t];
      acc = kind == 0 ? acc + v
          : kind == 1 ? __float_as_uint(__uint_as_float(acc) + __uint_as_float(v))
          : kind == 2 ? min(acc, v) : max(acc, v);
    }
    red[NUM_WARPS][t] = acc;
  }
  __syncthreads();   // the block's statistics are in red[NUM_WARPS]: cnt, sum, above, below
}

struct Shared {
  uint32_t red[NUM_WARPS + 1][4 * NUM_PIVOTS];
  float f[NUM_WARPS];
  float g[NUM_WARPS];
  uint32_t u[NUM_WARPS];
  uint32_t v[NUM_WARPS];
  uint32_t tmax[BLOCK];          // each thread's largest key (pass 0), then sorted
  uint32_t ckey[CAND_CAP];       // top-k candidates: keys and element indices
  int cidx[CAND_CAP];
  int n, m, hit;
};

// -- one row of float32 values, visited element by element (vectorized when aligned)
struct Row {
  const float* x;
  int vocab;
  bool vec;
  __device__ Row(const float* p, int n) : x(p), vocab(n) {
    vec = (n % 4 == 0) && (reinterpret_cast<uint64_t>(p) % 16 == 0);
  }
  // f(index, value) for every element this thread owns; for the race, g(group) first sees each group
  template <typename F>
  __device__ __forceinline__ void for_each(F f) const {
    if (vec) {
      const float4* x4 = reinterpret_cast<const float4*>(x);
      const int n4 = vocab / 4;
      int q = threadIdx.x;
      for (; q + 3 * BLOCK < n4; q += 4 * BLOCK) {   // four 16-byte loads in flight, then use them in order
        float4 v[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) v[u] = x4[q + u * BLOCK];
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          const int i = 4 * (q + u * BLOCK);
          f(i, v[u].x); f(i + 1, v[u].y); f(i + 2, v[u].z); f(i + 3, v[u].w);
        }
      }
      for (; q < n4; q += BLOCK) {
        const float4 v = x4[q];
        f(4 * q, v.x); f(4 * q + 1, v.y); f(4 * q + 2, v.z); f(4 * q + 3, v.w);
      }
    } else {
      for (int i = threadIdx.x; i < vocab; i += BLOCK) f(i, x[i]);
    }
  }
};

// -- pass 0: smallest and largest key, and the row's sum of values (logits: max, sum of exp(x - max))
struct RowStats { uint32_t min_key, max_key; float max_x, sum; };

__device__ __forceinline__ RowStats row_stats(const Row& row, bool logits, Shared& sm) {
  uint32_t mn = 0xffffffffu, mx = 0u;
  float m = -kInf, s = 0.f;
  row.for_each([&](int, float x) {
    const uint32_t k = ord_key(x);
    mn = min(mn, k); mx = max(mx, k);
    if (logits) {   // online: s is the sum of exp(x - m) for the running max m
      if (x > m) { s = (m == -kInf ? 0.f : s * __expf(m - x)) + 1.f; m = x; }
      else if (x > -kInf) s += __expf(x - m);
    } else {
      s += x;
    }
  });
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  sm.tmax[threadIdx.x] = mx;
  mn = warp_reduce(mn, Min()); mx = warp_reduce(mx, Max());
  if (logits) {
    const float wm = warp_reduce(m, [](float a, float b) { return fmaxf(a, b); });
    s = (m == -kInf) ? 0.f : s * __expf(m - wm);
    m = wm;
  }
  s = warp_reduce(s, Sum());
  if (lane == 0) { sm.u[warp] = mn; sm.v[warp] = mx; sm.f[warp] = m; sm.g[warp] = s; }
  __syncthreads();
  RowStats r{0xffffffffu, 0u, -kInf, 0.f};
  for (int w = 0; w < NUM_WARPS; ++w) { r.min_key = min(r.min_key, sm.u[w]); r.max_key = max(r.max_key, sm.v[w]); }
  if (logits) {
    for (int w = 0; w < NUM_WARPS; ++w) r.max_x = fmaxf(r.max_x, sm.f[w]);
    for (int w = 0; w < NUM_WARPS; ++w)
      if (sm.f[w] > -kInf) r.sum += sm.g[w] * __expf(sm.f[w] - r.max_x);
  } else {
    for (int w = 0; w < NUM_WARPS; ++w) r.sum += sm.g[w];
    r.max_x = __uint_as_float((r.max_key & 0x80000000u) ? (r.max_key & 0x7fffffffu) : ~r.max_key);
  }
  __syncthreads();
  return r;
}

__device__ __forceinline__ float value_of(float x, bool logits, float max_x) {
  return logits ? __expf(x - max_x) : x;
}

// -- one element's contribution to the pivot statistics of a search pass over [lo, hi)
__device__ __forceinline__ void pivot_step(PivotStats& s, const uint32_t (&piv)[NUM_PIVOTS], uint32_t lo, uint32_t hi,
                                           float x, bool logits, float max_x) {
  const uint32_t key = ord_key(x);
  if (key < lo) return;
  const float v = value_of(x, logits, max_x);
  if (key >= hi) {   // above the interval: in every pivot's count and sum, in no interval statistic
#pragma unroll
    for (int j = 0; j < NUM_PIVOTS; ++j) { s.cnt[j] += 1; s.sum[j] += v; }
    return;
  }
#pragma unroll
  for (int j = 0; j < NUM_PIVOTS; ++j) {
    if (key >= piv[j]) { s.cnt[j] += 1; s.sum[j] += v; s.above[j] = min(s.above[j], key); }
    else s.below[j] = max(s.below[j], key);
  }
}

// -- the largest feasible element key in [lo, hi): count(key >= t) >= k or sum(value(key >= t)) >= p_mass.
//    lo must be a feasible element key (lo_sum: the sum at lo), hi an infeasible key; *keep_sum gets the
//    sum of the values at or above the result.
__device__ __forceinline__ uint32_t search(const Row& row, bool logits, float max_x, uint32_t lo, uint32_t hi, float lo_sum,
                           uint32_t k, float p_mass, float* keep_sum, Shared& sm) {
  while (hi - lo > 1) {
    uint32_t piv[NUM_PIVOTS];
    const uint64_t span = hi - lo - 1;
#pragma unroll
    for (int j = 0; j < NUM_PIVOTS; ++j) piv[j] = lo + 1 + uint32_t(span * (j + 1) / (NUM_PIVOTS + 1));
    PivotStats s;
#pragma unroll
    for (int j = 0; j < NUM_PIVOTS; ++j) { s.cnt[j] = 0; s.sum[j] = 0.f; s.above[j] = 0xffffffffu; s.below[j] = 0; }
    // explicit loops (a lambda capturing s kept it in local memory)
    if (row.vec) {
      const float4* x4 = reinterpret_cast<const float4*>(row.x);
      const int n4 = row.vocab / 4;
      int q = threadIdx.x;
      for (; q + BLOCK < n4; q += 2 * BLOCK) {   // two 16-byte loads in flight
        const float4 v = x4[q], w = x4[q + BLOCK];
        pivot_step(s, piv, lo, hi, v.x, logits, max_x);
        pivot_step(s, piv, lo, hi, v.y, logits, max_x);
        pivot_step(s, piv, lo, hi, v.z, logits, max_x);
        pivot_step(s, piv, lo, hi, v.w, logits, max_x);
        pivot_step(s, piv, lo, hi, w.x, logits, max_x);
        pivot_step(s, piv, lo, hi, w.y, logits, max_x);
        pivot_step(s, piv, lo, hi, w.z, logits, max_x);
        pivot_step(s, piv, lo, hi, w.w, logits, max_x);
      }
      for (; q < n4; q += BLOCK) {
        const float4 v = x4[q];
        pivot_step(s, piv, lo, hi, v.x, logits, max_x);
        pivot_step(s, piv, lo, hi, v.y, logits, max_x);
        pivot_step(s, piv, lo, hi, v.z, logits, max_x);
        pivot_step(s, piv, lo, hi, v.w, logits, max_x);
      }
    } else {
      for (int i = threadIdx.x; i < row.vocab; i += BLOCK) pivot_step(s, piv, lo, hi, row.x[i], logits, max_x);
    }
    reduce_pivots(s, sm.red);
    // -- the last feasible pivot (-1: none) moves lo up; the next one moves hi down. Read from shared
    //    memory: indexing the register copies by `best` would put them in local memory
    const uint32_t* r = sm.red[NUM_WARPS];
    int best = -1;
    for (int j = 0; j < NUM_PIVOTS; ++j)
      if (r[j] >= k || __uint_as_float(r[NUM_PIVOTS + j]) >= p_mass) best = j;
    const uint32_t new_hi = best + 1 < NUM_PIVOTS ? r[3 * NUM_PIVOTS + best + 1] + 1 : hi;
    if (best >= 0) { lo = r[2 * NUM_PIVOTS + best]; lo_sum = __uint_as_float(r[NUM_PIVOTS + best]); }
    hi = new_hi;
    __syncthreads();   // red is reused by the next pass
  }
  *keep_sum = lo_sum;
  return lo;
}

// -- the threshold key of one request's filters (every thread gets it)
struct Filter { uint32_t top_k; float top_p; float min_p; int flags; };

// -- a before b: larger key first, then lower element index
__device__ __forceinline__ bool precedes(uint32_t ka, int ia, uint32_t kb, int ib) {
  return ka > kb || (ka == kb && ia < ib);
}

// -- bitonic sort of sm.tmax[0, BLOCK) into decreasing order
__device__ __forceinline__ void sort_thread_maxima(Shared& sm) {
  for (int k = 2; k <= BLOCK; k <<= 1) {
    for (int j = k >> 1; j > 0; j >>= 1) {
      const int i = threadIdx.x, l = i ^ j;
      if (l > i) {
        const uint32_t a = sm.tmax[i], b = sm.tmax[l];
        if ((i & k) == 0 ? b > a : a > b) { sm.tmax[i] = b; sm.tmax[l] = a; }
      }
      __syncthreads();
    }
  }
}

// -- bitonic sort of the candidates [0, P) (P a power of two) into `precedes` order
__device__ __forceinline__ void sort_candidates(Shared& sm, int P) {
  for (int k = 2; k <= P; k <<= 1) {
    for (int j = k >> 1; j > 0; j >>= 1) {
      for (int i = threadIdx.x; i < P; i += BLOCK) {
        const int l = i ^ j;
        if (l > i) {
          const uint32_t ka = sm.ckey[i], kb = sm.ckey[l];
          const int ia = sm.cidx[i], ib = sm.cidx[l];
          if ((i & k) == 0 ? precedes(kb, ib, ka, ia) : precedes(ka, ia, kb, ib)) {
            sm.ckey[i] = kb; sm.ckey[l] = ka; sm.cidx[i] = ib; sm.cidx[l] = ia;
          }
        }
      }
      __syncthreads();
    }
  }
}

// -- the exact path for top-k with k <= BLOCK, in one more pass over the row: the k-th largest of the
//    threads' maxima (pass 0) is a feasible lower bound (k distinct elements reach it); every element at
//    or above it goes to shared memory (usually a few k), where a bitonic sort orders them and one warp's
//    prefix sums (fixed order) place the top-p threshold. False (the caller searches instead) when more
//    than CAND_CAP elements reach the bound. On true, sm.n candidates are sorted in sm.ckey / sm.cidx.
__device__ __forceinline__ bool top_k_candidates(const Row& row, const Filter& f, const RowStats& st, bool use_p,
                                                 uint32_t* t, float* keep_sum, Shared& sm) {
  const bool logits = f.flags & kFromLogits;
  sort_thread_maxima(sm);
  const uint32_t lo = sm.tmax[f.top_k - 1];
  if (threadIdx.x == 0) sm.n = 0;
  __syncthreads();
  row.for_each([&](int i, float x) {
    const uint32_t key = ord_key(x);
    if (key >= lo) {
      const int slot = atomicAdd(&sm.n, 1);
      if (slot < CAND_CAP) { sm.ckey[slot] = key; sm.cidx[slot] = i; }
    }
  });
  __syncthreads();
  const int n = sm.n;
  if (n > CAND_CAP) return false;
  int P = 1;
  while (P < n) P <<= 1;
  for (int i = n + threadIdx.x; i < P; i += BLOCK) { sm.ckey[i] = 0u; sm.cidx[i] = 0x7fffffff; }
  __syncthreads();
  sort_candidates(sm, P);
  // -- the k-th key, and m: the candidates at or above it (ties of the k-th are kept)
  const uint32_t tk = sm.ckey[f.top_k - 1];
  if (threadIdx.x == 0) sm.m = n;
  __syncthreads();
  for (int i = int(f.top_k) + threadIdx.x; i < n; i += BLOCK)
    if (sm.ckey[i] < tk && sm.ckey[i - 1] >= tk) sm.m = i;
  __syncthreads();
  const int m = sm.m;
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x, chunk = (m + 31) / 32;
    const int beg = min(lane * chunk, m), end = min(beg + chunk, m);
    float part = 0.f;
    for (int i = beg; i < end; ++i) part += value_of(key_float(sm.ckey[i]), logits, st.max_x);
    float incl = part;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const float y = __shfl_up_sync(0xffffffffu, incl, o);
      if (lane >= o) incl += y;
    }
    float run = __shfl_up_sync(0xffffffffu, incl, 1);
    if (lane == 0) run = 0.f;
    const float total = __shfl_sync(0xffffffffu, incl, 31);
    uint32_t hit = 0x7fffffffu;
    if (use_p) {
      const float p_mass = f.top_p * ((f.flags & kJoint) ? st.sum : total);
      for (int i = beg; i < end; ++i) {
        run += value_of(key_float(sm.ckey[i]), logits, st.max_x);
        if (run >= p_mass) { hit = uint32_t(i); break; }
      }
    }
    hit = warp_reduce(hit, Min());
    if (lane == 0) { sm.hit = int(hit); sm.g[0] = total; }
  }
  __syncthreads();
  *t = sm.hit < m ? sm.ckey[sm.hit] : tk;
  *keep_sum = sm.g[0];
  __syncthreads();
  return true;
}

__device__ __forceinline__ uint32_t threshold(const Row& row, const Filter& f, const RowStats& st, float* keep_sum,
                                              bool* from_candidates, Shared& sm) {
  *from_candidates = false;
  const bool logits = f.flags & kFromLogits;
  const uint32_t hi = st.max_key + 1;
  uint32_t lo = st.min_key;
  float lo_sum = st.sum;
  if (!(st.sum > 0.f) || st.max_key == 0xffffffffu) { *keep_sum = st.sum; return lo; }   // degenerate row
  const bool use_k = (f.flags & kTopK) && f.top_k < uint32_t(row.vocab);
  const bool use_p = (f.flags & kTopP) && f.top_p < 1.f;
  if (f.flags & kMinP) {
    const float cut = (logits ? 1.f : st.max_x) * f.min_p;   // min_p sampling is from probabilities
    *keep_sum = st.sum;
    return max(lo, ord_key(cut));
  }
  if (use_k && f.top_k <= BLOCK) {
    uint32_t t;
    if (top_k_candidates(row, f, st, use_p, &t, keep_sum, sm)) { *from_candidates = true; return t; }
  }
  const uint32_t never_k = 0xffffffffu;
  if (use_k && use_p && (f.flags & kJoint))
    return search(row, logits, st.max_x, lo, hi, lo_sum, f.top_k, f.top_p * st.sum, keep_sum, sm);
  if (use_k) {
    lo = search(row, logits, st.max_x, lo, hi, lo_sum, f.top_k, kInf, &lo_sum, sm);
  }
  if (use_p) return search(row, logits, st.max_x, lo, hi, lo_sum, never_k, f.top_p * lo_sum, keep_sum, sm);
  *keep_sum = lo_sum;
  return lo;
}

__device__ __forceinline__ int block_argmin(float best, int best_i, Shared& sm);

// -- exponential race over {key >= t}: the index of the smallest E_i / value_i (ties: lower index)
template <typename V>
__device__ __forceinline__ int race(const Row& row, V value, uint32_t t, const Rng& rng, uint32_t rng_row, Shared& sm) {
  float best = kInf;
  int best_i = 0x7fffffff;
  uint4 r = make_uint4(0, 0, 0, 0);
  int group = -1;
  row.for_each([&](int i, float x) {
    if (ord_key(x) < t) return;
    if ((i >> 2) != group) { group = i >> 2; r = rng.draw(uint32_t(group), rng_row, kTagRace); }
    const float score = exponential(pick(r, i & 3)) / value(i, x);
    if (score < best || (score == best && i < best_i)) { best = score; best_i = i; }
  });
  return block_argmin(best, best_i, sm);
}

// -- the race over the sorted top-k candidates at or above t: the same scores as race() over the row
__device__ __forceinline__ int race_candidates(uint32_t t, bool logits, float max_x, const Rng& rng, uint32_t rng_row,
                                               Shared& sm) {
  float best = kInf;
  int best_i = 0x7fffffff;
  for (int c = threadIdx.x; c < sm.n; c += BLOCK) {
    const uint32_t key = sm.ckey[c];
    if (key < t) continue;
    const int i = sm.cidx[c];
    const float score = exponential(pick(rng.draw(uint32_t(i >> 2), rng_row, kTagRace), i & 3)) /
                        value_of(key_float(key), logits, max_x);
    if (score < best || (score == best && i < best_i)) { best = score; best_i = i; }
  }
  return block_argmin(best, best_i, sm);
}

__device__ __forceinline__ int block_argmin(float best, int best_i, Shared& sm) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float ob = __shfl_xor_sync(0xffffffffu, best, o);
    const int oi = __shfl_xor_sync(0xffffffffu, best_i, o);
    if (ob < best || (ob == best && oi < best_i)) { best = ob; best_i = oi; }
  }
  if (lane == 0) { sm.f[warp] = best; sm.u[warp] = uint32_t(best_i); }
  __syncthreads();
  best = kInf; best_i = 0x7fffffff;
  for (int w = 0; w < NUM_WARPS; ++w) {
    if (sm.f[w] < best || (sm.f[w] == best && int(sm.u[w]) < best_i)) { best = sm.f[w]; best_i = int(sm.u[w]); }
  }
  __syncthreads();
  return best_i == 0x7fffffff ? 0 : best_i;
}

}  // namespace cuattn

using namespace cuattn;

// Filtered sampling: out[b] drawn from row indices[b] (b when indices is null) of x [num_rows, vocab]
// (row stride row_stride), kept set by flags (top-k / top-p / min-p, top-k-first or joint), parameters
// per request from the arrays when non-null, else the scalars. out[b] = -1 for an index outside the rows.
extern "C" __global__ void __launch_bounds__(BLOCK) cuattn_sample(
    const float* __restrict__ x, int64_t row_stride, int vocab, int num_rows, const void* indices,
    int indices_is64, const int* __restrict__ top_k_arr, int top_k_val, const float* __restrict__ top_p_arr,
    float top_p_val, const float* __restrict__ min_p_arr, float min_p_val, int flags, int64_t seed,
    int64_t offset, int* __restrict__ out) {
  __shared__ Shared sm;
  const int b = blockIdx.x;
  int64_t r = b;
  if (indices) r = indices_is64 ? static_cast<const int64_t*>(indices)[b] : static_cast<const int*>(indices)[b];
  if (r < 0 || r >= num_rows) { if (threadIdx.x == 0) out[b] = -1; return; }
  const Row row(x + r * row_stride, vocab);
  Filter f;
  f.flags = flags;
  const int k = top_k_arr ? top_k_arr[b] : top_k_val;
  f.top_k = uint32_t(max(k, 1));
  f.top_p = top_p_arr ? top_p_arr[b] : top_p_val;
  f.min_p = min_p_arr ? min_p_arr[b] : min_p_val;
  const RowStats st = row_stats(row, flags & kFromLogits, sm);
  float keep_sum;
  bool from_candidates = false;
  const uint32_t t =
      (flags & (kTopK | kTopP | kMinP)) ? threshold(row, f, st, &keep_sum, &from_candidates, sm) : st.min_key;
  const Rng rng{uint32_t(uint64_t(seed)), uint32_t(uint64_t(seed) >> 32), uint32_t(uint64_t(offset)),
                uint32_t(uint64_t(offset) >> 32)};
  const bool logits = flags & kFromLogits;
  const float max_x = st.max_x;
  const int tok = from_candidates
      ? race_candidates(t, logits, max_x, rng, uint32_t(b), sm)
      : race(row, [&](int, float v) { return value_of(v, logits, max_x); }, t, rng, uint32_t(b), sm);
  if (threadIdx.x == 0) out[b] = tok;
}

// Renormalization / masking of row r of x into row r of out (stride out_stride):
// MODE 0: top_k_renorm_probs, 1: top_p_renorm_probs (out = x / kept sum, 0 elsewhere);
// MODE 2: top_k_mask_logits (out = x, -inf elsewhere).
template <int MODE>
__device__ __forceinline__ void renorm_row(const float* __restrict__ x, int64_t row_stride, int vocab,
                                           const int* __restrict__ top_k_arr, int top_k_val,
                                           const float* __restrict__ top_p_arr, float top_p_val,
                                           float* __restrict__ out, int64_t out_stride, Shared& sm) {
  const int r = blockIdx.x;
  const Row row(x + int64_t(r) * row_stride, vocab);
  Filter f;
  const int k = top_k_arr ? top_k_arr[r] : top_k_val;
  f.top_k = uint32_t(max(k, 1));
  f.top_p = top_p_arr ? top_p_arr[r] : top_p_val;
  f.min_p = 0.f;
  f.flags = MODE == 1 ? kTopP : MODE == 2 ? (kTopK | kFromLogits) : kTopK;
  const RowStats st = row_stats(row, MODE == 2, sm);
  float keep_sum;
  bool from_candidates;
  const uint32_t t = threshold(row, f, st, &keep_sum, &from_candidates, sm);
  float* o = out + int64_t(r) * out_stride;
  const float scale = 1.f / keep_sum;
  row.for_each([&](int i, float v) {
    const bool keep = ord_key(v) >= t;
    o[i] = MODE == 2 ? (keep ? v : -kInf) : (keep ? v * scale : 0.f);
  });
}

#define RENORM_ENTRY(NAME, MODE)                                                                          \
  extern "C" __global__ void __launch_bounds__(BLOCK) NAME(                                              \
      const float* __restrict__ x, int64_t row_stride, int vocab, const int* __restrict__ top_k_arr,       \
      int top_k_val, const float* __restrict__ top_p_arr, float top_p_val, float* __restrict__ out,        \
      int64_t out_stride) {                                                                               \
    __shared__ Shared sm;                                                                                 \
    renorm_row<MODE>(x, row_stride, vocab, top_k_arr, top_k_val, top_p_arr, top_p_val, out, out_stride, sm); \
  }
RENORM_ENTRY(cuattn_top_k_renorm, 0)
RENORM_ENTRY(cuattn_top_p_renorm, 1)
RENORM_ENTRY(cuattn_top_k_mask_logits, 2)

// Chain speculative sampling of request b (FlashInfer's semantics): draft token i is accepted while
// u_i * draft[b, i, d_i] < target[b, i, d_i]; at the first rejection a token is drawn from
// relu(target - draft) at that position, else a bonus token from target[b, n]; later slots get -1.
// accepted[b] += emitted + the later positions that a fresh uniform would accept; emitted[b] += emitted.
// draft [batch, n, vocab], target [batch, n + 1, vocab], draft_ids [batch, n] (int32), all contiguous.
extern "C" __global__ void __launch_bounds__(BLOCK) cuattn_chain_speculative(
    const float* __restrict__ draft, const float* __restrict__ target, const int* __restrict__ draft_ids, int n,
    int vocab, int64_t seed, int64_t offset, int* __restrict__ out_ids, int* __restrict__ accepted,
    int* __restrict__ emitted) {
  __shared__ Shared sm;
  const int b = blockIdx.x;
  const Rng rng{uint32_t(uint64_t(seed)), uint32_t(uint64_t(seed) >> 32), uint32_t(uint64_t(offset)),
                uint32_t(uint64_t(offset) >> 32)};
  const int* ids = draft_ids + int64_t(b) * n;
  const float* dr = draft + int64_t(b) * n * vocab;
  const float* tg = target + int64_t(b) * (n + 1) * vocab;
  int pos = n;
  for (int i = 0; i < n; ++i) {   // every thread walks the chain (a few loads each)
    const int d = ids[i];
    const float u = uniform01(pick(rng.draw(uint32_t(i >> 2), uint32_t(b), kTagAccept), i & 3));
    if (!(u * dr[int64_t(i) * vocab + d] < tg[int64_t(i) * vocab + d])) { pos = i; break; }
  }
  int acc = pos;
  for (int i = pos; i < n; ++i) {
    const int d = ids[i];
    const float u = uniform01(pick(rng.draw(uint32_t(i >> 2), uint32_t(b), kTagRecount), i & 3));
    if (u * dr[int64_t(i) * vocab + d] < tg[int64_t(i) * vocab + d]) ++acc;
  }
  const Row row(tg + int64_t(pos) * vocab, vocab);
  const float* dp = dr + int64_t(pos) * vocab;
  const uint32_t race_row = uint32_t(b) * uint32_t(n + 1) + uint32_t(pos);
  int tok;
  if (pos < n)
    tok = race(row, [&](int i, float t) { return fmaxf(t - dp[i], 0.f); }, 0u, rng, race_row, sm);
  else
    tok = race(row, [&](int, float t) { return t; }, 0u, rng, race_row, sm);
  int* o = out_ids + int64_t(b) * (n + 1);
  for (int i = threadIdx.x; i <= n; i += BLOCK) o[i] = i < pos ? ids[i] : i == pos ? tok : -1;
  if (threadIdx.x == 0) { accepted[b] += acc; emitted[b] += pos; }
}
