// sampling.cu — launched by cuattn/sampling.py (SamplingSpec).
// Compile-time: BLOCK (threads of a CTA), MAX_SPLITS and WS_ROW_BYTES (the workspace layout, checked below).
// Grid (batch * splits) for cuattn_sample, (rows * splits) for the renorm entries: `splits` CTAs (a group)
// share one row, each owning a contiguous chunk of it (a multiple of 4 elements); (batch) for
// cuattn_chain_speculative. Block BLOCK. Rows are float32, contiguous in the vocabulary; 16-byte loads when
// the vocabulary and the row's base are multiples of 4 floats, else scalar loads.
// splits > 1 (small batches: one SM per row is latency-bound): the group exchanges its partial results through
// the per-row workspace `ws` (RowWs): row stats in per-CTA slots combined in CTA order, radix histograms by
// global atomics on integers (order-independent: exact), the race's argmin by a 64-bit atomicMax of a packed
// (score, index) key, with a software barrier between the steps (the launcher keeps batch * splits <= the SM
// count, so a group's CTAs are co-resident). The kernel leaves the workspace as it found it (all zero: the
// histogram ring, the argmin slot and the barrier counters are cleared by the group before it exits), so a
// captured CUDA graph replays. The result does not depend on splits: same kept set, same token.
//
// No sort. A row's kept set is {x : key(x) >= T}, key() the order-preserving uint32 of a float, and T
// the largest element key that is still "feasible": count(key >= T) >= top_k, or
// mass(key >= T) >= target. Mass is fixed point, exact and order-independent: element w (x for
// probabilities, exp(x - max) for logits) weighs q(w) = floor(w * 2^(S - E)) (0 for w <= 0), E the
// exponent of the row's largest w (max w in [2^E, 2^(E+1))), S = 62 - bit_length(vocab) so that a
// row's sum of q stays below 2^63; target = min(ceil(fp64(total) * fp64(top_p)), total) with total the
// q-sum of the set top-p filters (the row, or the top-k set for "top_k_first"). cuattn/sampling.py
// defines the NumPy path's threshold by the same integers, so both paths keep the same tokens.
// T comes from a radix select over the key bits (radix_select: 3 passes of 11 + 11 + 10 bits, each a
// shared-memory histogram of counts and 64-bit masses, then one block scan from the top bin down), or
// for top-k with k <= BLOCK from the top-k candidates sorted in shared memory (top_k_candidates).
// The token is then drawn by an exponential race over the kept set: argmin_i E_i / value_i with
// E_i = -log(1 - V_i) exponential, V_i uniform from Philox4x32-10 keyed by the seed, with counter
// (i / 4, row of the output, offset) — one Philox call per 4 elements — so the draw is exactly
// proportional to the kept values, needs no normalizing sum, and depends only on (seed, offset, output
// row, element): not on the block size or the order in which threads run. Ties go to the lower index.
// cuattn/sampling.py mirrors the random stream bit for bit on the NumPy path.
// common/sampling_math.cuh: keys, Philox, fixed-point masses, warp reductions; common/sampling_group.cuh: the
// group of CTAs of a row (workspace, barrier, ring). common/dtypes.cuh: the integer typedefs (NVRTC has no
// system headers here).
#include "common/dtypes.cuh"

#ifndef BLOCK
#define BLOCK 1024
#endif
#define NUM_WARPS (BLOCK / 32)
#define CAND_CAP 2048            // top-k candidates held in shared memory (the exact path for k <= BLOCK)
#define NBINS 2048               // radix_select histogram bins (11-bit digits)
#define SLOTS (NBINS / BLOCK)    // bins per thread in radix_select's scan
static_assert(NBINS % BLOCK == 0 && BLOCK % 32 == 0, "BLOCK must be a multiple of 32 dividing 2048");
#ifndef MAX_SPLITS
#define MAX_SPLITS 32
#endif
// (sampling_group.cuh uses BLOCK, NBINS, MAX_SPLITS)
#include "common/sampling_math.cuh"
#include "common/sampling_group.cuh"

namespace cuattn {

#define kInf __int_as_float(0x7f800000)
constexpr uint32_t kTagRace = 0, kTagAccept = 1, kTagRecount = 2;
enum Flags { kFromLogits = 1, kJoint = 2, kTopK = 4, kTopP = 8, kMinP = 16 };

// -- a radix_select histogram: per bin a count and a 64-bit mass kept as two 32-bit words (shared-memory
//    atomics are 32-bit; the low word's wraps are carried into the high word, so sums are exact)
struct Hist {
  uint32_t lo[NBINS];
  uint32_t hi[NBINS];
  uint32_t cnt[NBINS];
};

// -- the elements [chunk_beg, chunk_end) of the row that this CTA visits (shared memory, not registers: set by
//    thread 0 with set_chunk before the kernel's first __syncthreads). Chunk `part` of `parts`: ceil(vocab / parts)
//    rounded up to a multiple of 4 elements (the last chunks may be short or empty).
__shared__ int chunk_beg, chunk_end;
__device__ __forceinline__ void set_chunk(int vocab, int part, int parts) {
  if (threadIdx.x == 0) {
    const int64_t chunk = ((int64_t(vocab) + parts - 1) / parts + 3) & ~int64_t(3);
    chunk_beg = int(min(int64_t(vocab), chunk * part));
    chunk_end = int(min(int64_t(vocab), chunk * (part + 1)));
  }
}

// -- one row of float32 values, visited element by element over this CTA's chunk (vectorized when aligned)
struct Row {
  const float* x;
  int vocab;
  bool vec;
  __device__ Row(const float* p, int n) : x(p), vocab(n) {
    vec = (n % 4 == 0) && (reinterpret_cast<uint64_t>(p) % 16 == 0);
  }
  // f(index, value) for every element of the chunk this thread owns (index: the element's place in the row)
  template <typename F>
  __device__ __forceinline__ void for_each(F f) const {
    const int beg = chunk_beg, end = chunk_end;
    if (vec) {
      const float4* x4 = reinterpret_cast<const float4*>(x);
      const int n4 = end / 4;
      int q = beg / 4 + threadIdx.x;
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
      for (int i = beg + threadIdx.x; i < end; i += BLOCK) f(i, x[i]);
    }
  }
};

struct Shared {
  float f[NUM_WARPS];
  float g[NUM_WARPS];
  uint32_t u[NUM_WARPS];
  uint32_t v[NUM_WARPS];
  uint64_t wq[NUM_WARPS];        // per-warp 64-bit partials (block sums, scans)
  uint32_t wc[NUM_WARPS];
  uint32_t tmax[BLOCK];          // each thread's largest key (pass 0), then sorted
  union {
    struct { uint32_t ckey[CAND_CAP]; int cidx[CAND_CAP]; } c;   // top-k candidates: keys, element indices
    Hist h;                                                       // radix_select (after the candidates)
  } w;
  uint32_t sel[3];               // radix_select: the bin chosen by each pass (one slot per pass: no reuse race)
  uint32_t sel_c[3];
  uint64_t sel_q[3], sel_q_ge[3];
  uint64_t total;
  int n, m, hit;
  Group grp;                     // the CTAs sharing this row
};

// -- block sum of a uint64 (exact, so the order does not matter); every thread gets it
__device__ __forceinline__ uint64_t block_sum(uint64_t v, Shared& sm) {
  v = warp_reduce(v, Sum());
  if ((threadIdx.x & 31) == 0) sm.wq[threadIdx.x >> 5] = v;
  __syncthreads();
  uint64_t s = 0;
  for (int w = 0; w < NUM_WARPS; ++w) s += sm.wq[w];
  __syncthreads();
  return s;
}

// -- the sum of a uint64 over the group's CTAs (a global atomic into the ring: exact in any order)
__device__ __forceinline__ uint64_t group_sum(uint64_t v, Group& grp, Shared& sm) {
  v = block_sum(v, sm);
  if (grp.G == 1) return v;
  GBin* gb = grp.next_ring();
  if (threadIdx.x == 0 && v) atomicAdd(&gb[0].mass, (unsigned long long)v);
  grp.sync();
  v = __ldcg(&gb[0].mass);
  grp.done();
  return v;
}

// -- pass 0: smallest and largest key, and the row's sum of values (logits: max, sum of exp(x - max))
struct RowStats { uint32_t min_key, max_key; float max_x, sum; int shift_c; };

__device__ __forceinline__ float value_of(float x, bool logits, float max_x) {
  return logits ? __expf(x - max_x) : x;
}

// -- the group's row stats from each CTA's (r): combined in CTA order, so the float sum is deterministic
__device__ __forceinline__ RowStats group_stats(RowStats r, bool logits, Group& grp) {
  if (threadIdx.x == 0) grp.ws->part[grp.g] = Part{r.min_key, r.max_key, r.max_x, r.sum};
  grp.sync();
  const uint4* parts = reinterpret_cast<const uint4*>(grp.ws->part);
  r = RowStats{0xffffffffu, 0u, -kInf, 0.f, 0};
  for (int c = 0; c < grp.G; ++c) {
    const uint4 w = __ldcg(parts + c);   // min_key, max_key, m, s
    r.min_key = min(r.min_key, w.x);
    r.max_key = max(r.max_key, w.y);
    r.max_x = fmaxf(r.max_x, __uint_as_float(w.z));
  }
  for (int c = 0; c < grp.G; ++c) {
    const uint4 w = __ldcg(parts + c);
    const float m = __uint_as_float(w.z), sc = __uint_as_float(w.w);
    if (!logits) r.sum += sc;
    else if (m > -kInf) r.sum += sc * __expf(m - r.max_x);
  }
  if (!logits) r.max_x = key_float(r.max_key);
  return r;
}

__device__ __forceinline__ RowStats row_stats(const Row& row, bool logits, Group& grp, Shared& sm) {
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
  RowStats r{0xffffffffu, 0u, -kInf, 0.f, 0};
  for (int w = 0; w < NUM_WARPS; ++w) { r.min_key = min(r.min_key, sm.u[w]); r.max_key = max(r.max_key, sm.v[w]); }
  if (logits) {
    for (int w = 0; w < NUM_WARPS; ++w) r.max_x = fmaxf(r.max_x, sm.f[w]);
    for (int w = 0; w < NUM_WARPS; ++w)
      if (sm.f[w] > -kInf) r.sum += sm.g[w] * __expf(sm.f[w] - r.max_x);
  } else {
    for (int w = 0; w < NUM_WARPS; ++w) r.sum += sm.g[w];
    r.max_x = key_float(r.max_key);
  }
  if (grp.G > 1) r = group_stats(r, logits, grp);
  r.shift_c = fixed_shift(value_of(r.max_x, logits, r.max_x), row.vocab);
  __syncthreads();
  return r;
}

// -- the group's histogram: this CTA's nonzero bins added into the ring, the sums read back into h
__device__ __forceinline__ void group_hist(Hist& h, Group& grp) {
  GBin* gb = grp.next_ring();
  for (int j = threadIdx.x; j < NBINS; j += BLOCK) {
    const uint64_t q = (uint64_t(h.hi[j]) << 32) | h.lo[j];
    if (q) atomicAdd(&gb[j].mass, q);
    if (h.cnt[j]) atomicAdd(&gb[j].cnt, h.cnt[j]);
  }
  grp.sync();
  for (int j = threadIdx.x; j < NBINS; j += BLOCK) {
    const uint64_t q = __ldcg(&gb[j].mass);
    h.lo[j] = uint32_t(q); h.hi[j] = uint32_t(q >> 32); h.cnt[j] = __ldcg(&gb[j].cnt);
  }
  grp.done();
  __syncthreads();
}

// -- the largest element key T >= lo with count(lo <= key, key >= T) >= k or mass(lo <= key, key >= T) >=
//    mass_target(mass(key >= lo), p): k = 0xffffffff or p >= 1 turn that test off; with_mass (implied by
//    p < 1) also returns the mass at or above T. Three passes over the row, one per digit of the key
//    (bits 31-21, 20-10, 9-0): a histogram of the elements that share the digits chosen so far, suffix sums
//    from the top bin down (one block scan), and the first bin whose lower edge is feasible. Integer sums:
//    deterministic and exact. No feasible key (no mass at or above lo): T = lo.
struct Select { uint32_t key; uint64_t mass; };

__device__ __forceinline__ Select radix_select(const Row& row, bool logits, float max_x, int shift_c, uint32_t lo,
                                               uint32_t k, float p, bool with_mass, Group& grp, Shared& sm) {
  const bool count = k != 0xffffffffu;
  const bool use_mass = with_mass || p < 1.f;
  Hist& h = sm.w.h;
  uint32_t prefix = 0, c_above = 0;
  uint64_t q_above = 0, target = ~0ull;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int pass = 0; pass < 3; ++pass) {
    const int shift = pass == 0 ? 21 : pass == 1 ? 10 : 0;
    const int top = pass == 0 ? 32 : pass == 1 ? 21 : 10;   // key >> top == prefix: in the chosen bin
    const uint32_t digit_mask = pass == 2 ? 1023u : 2047u;
    for (int j = threadIdx.x; j < NBINS; j += BLOCK) { h.lo[j] = 0; h.hi[j] = 0; h.cnt[j] = 0; }
    if (threadIdx.x == 0) sm.sel[pass] = 0xffffffffu;
    __syncthreads();
    // -- histogram of this digit over the elements that share the chosen higher digits
    row.for_each([&](int, float x) {
      const uint32_t key = ord_key(x);
      if (key < lo || (top < 32 && (key >> top) != prefix)) return;
      const uint32_t bin = (key >> shift) & digit_mask;
      if (count) atomicAdd(&h.cnt[bin], 1u);
      if (use_mass) {
        const uint64_t q = fixed_mass(value_of(x, logits, max_x), shift_c);
        const uint32_t ql = uint32_t(q);
        uint32_t carry = 0;
        if (ql) { const uint32_t old = atomicAdd(&h.lo[bin], ql); carry = old + ql < old; }
        const uint32_t qh = uint32_t(q >> 32) + carry;
        if (qh) atomicAdd(&h.hi[bin], qh);
      }
    });
    __syncthreads();
    if (grp.G > 1) group_hist(h, grp);
    // -- suffix sums from the top: thread t holds slots SLOTS * t + j, slot r being bin NBINS - 1 - r
    uint64_t mq[SLOTS];
    uint32_t mc[SLOTS];
    uint64_t qi = 0;
    uint32_t ci = 0;
#pragma unroll
    for (int j = 0; j < SLOTS; ++j) {
      const int bin = NBINS - 1 - (SLOTS * int(threadIdx.x) + j);
      mq[j] = (uint64_t(h.hi[bin]) << 32) | h.lo[bin];
      mc[j] = h.cnt[bin];
      qi += mq[j]; ci += mc[j];
    }
    const uint64_t own_q = qi;
    const uint32_t own_c = ci;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {   // inclusive warp scan
      const uint64_t yq = __shfl_up_sync(0xffffffffu, qi, o);
      const uint32_t yc = __shfl_up_sync(0xffffffffu, ci, o);
      if (lane >= o) { qi += yq; ci += yc; }
    }
    if (lane == 31) { sm.wq[warp] = qi; sm.wc[warp] = ci; }
    __syncthreads();
    uint64_t q = q_above + qi - own_q, total = q_above;   // q, c: the mass and count above this thread's slots
    uint32_t c = c_above + ci - own_c;
    for (int w = 0; w < NUM_WARPS; ++w) {
      if (w < warp) { q += sm.wq[w]; c += sm.wc[w]; }
      total += sm.wq[w];
    }
    if (pass == 0 && p < 1.f) target = mass_target(total, p);
    // -- the first feasible bin from the top (feasibility only grows downwards): its lower edge is feasible,
    //    the bin above is not
    bool prev = (count && c >= k) || q >= target;
#pragma unroll
    for (int j = 0; j < SLOTS; ++j) {
      const uint64_t q2 = q + mq[j];
      const uint32_t c2 = c + mc[j];
      const bool now = (count && c2 >= k) || q2 >= target;
      if (now && !prev) {
        sm.sel[pass] = uint32_t(NBINS - 1 - (SLOTS * int(threadIdx.x) + j));
        sm.sel_q[pass] = q;
        sm.sel_c[pass] = c;
        sm.sel_q_ge[pass] = q2;
      }
      prev = now; q = q2; c = c2;
    }
    if (pass == 0 && threadIdx.x == 0) sm.total = total;
    __syncthreads();
    const uint32_t sel = sm.sel[pass];
    if (sel == 0xffffffffu) return Select{lo, sm.total};    // uniform: every thread reads the same slot
    prefix = (prefix << (pass == 2 ? 10 : 11)) | sel;
    q_above = sm.sel_q[pass];
    c_above = sm.sel_c[pass];
  }
  return Select{prefix, sm.sel_q_ge[2]};
}

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
  uint32_t* ckey = sm.w.c.ckey;
  int* cidx = sm.w.c.cidx;
  for (int k = 2; k <= P; k <<= 1) {
    for (int j = k >> 1; j > 0; j >>= 1) {
      for (int i = threadIdx.x; i < P; i += BLOCK) {
        const int l = i ^ j;
        if (l > i) {
          const uint32_t ka = ckey[i], kb = ckey[l];
          const int ia = cidx[i], ib = cidx[l];
          if ((i & k) == 0 ? precedes(kb, ib, ka, ia) : precedes(ka, ia, kb, ib)) {
            ckey[i] = kb; ckey[l] = ka; cidx[i] = ib; cidx[l] = ia;
          }
        }
      }
      __syncthreads();
    }
  }
}

// -- the threshold key of one request's filters (every thread gets it)
struct Filter { uint32_t top_k; float top_p; float min_p; int flags; };

// -- the exact path for top-k with k <= BLOCK, in one more pass over the row: the k-th largest of the
//    threads' maxima (pass 0) is a feasible lower bound (k distinct elements reach it); every element at
//    or above it goes to shared memory (usually a few k), where a bitonic sort orders them and one warp's
//    prefix sums of the fixed-point masses place the top-p threshold. False (the caller runs radix_select
//    instead) when more than CAND_CAP elements reach the bound. On true, sm.n candidates are sorted in
//    sm.w.c, *t is the threshold and *keep_q the mass of the candidates at or above it.
__device__ __forceinline__ bool top_k_candidates(const Row& row, const Filter& f, const RowStats& st, bool use_p,
                                                 uint32_t* t, uint64_t* keep_q, Shared& sm) {
  const bool logits = f.flags & kFromLogits;
  const bool joint_p = use_p && (f.flags & kJoint);   // top-p over the whole row: its total mass is needed
  uint32_t* ckey = sm.w.c.ckey;
  int* cidx = sm.w.c.cidx;
  sort_thread_maxima(sm);
  const uint32_t lo = sm.tmax[f.top_k - 1];
  if (threadIdx.x == 0) sm.n = 0;
  __syncthreads();
  uint64_t row_q = 0;
  row.for_each([&](int i, float x) {
    const uint32_t key = ord_key(x);
    if (joint_p) row_q += fixed_mass(value_of(x, logits, st.max_x), st.shift_c);
    if (key >= lo) {
      const int slot = atomicAdd(&sm.n, 1);
      if (slot < CAND_CAP) { ckey[slot] = key; cidx[slot] = i; }
    }
  });
  if (joint_p) row_q = block_sum(row_q, sm); else __syncthreads();
  const int n = sm.n;
  if (n > CAND_CAP) return false;
  int P = 1;
  while (P < n) P <<= 1;
  for (int i = n + threadIdx.x; i < P; i += BLOCK) { ckey[i] = 0u; cidx[i] = 0x7fffffff; }
  __syncthreads();
  sort_candidates(sm, P);
  // -- the k-th key, and m: the candidates at or above it (ties of the k-th are kept)
  const uint32_t tk = ckey[f.top_k - 1];
  if (threadIdx.x == 0) sm.m = n;
  __syncthreads();
  for (int i = int(f.top_k) + threadIdx.x; i < n; i += BLOCK)
    if (ckey[i] < tk && ckey[i - 1] >= tk) sm.m = i;
  __syncthreads();
  const int m = sm.m;
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x, chunk = (m + 31) / 32;
    const int beg = min(lane * chunk, m), end = min(beg + chunk, m);
    auto q_of = [&](int i) { return fixed_mass(value_of(key_float(ckey[i]), logits, st.max_x), st.shift_c); };
    uint64_t part = 0;
    for (int i = beg; i < end; ++i) part += q_of(i);
    uint64_t incl = part;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const uint64_t y = __shfl_up_sync(0xffffffffu, incl, o);
      if (lane >= o) incl += y;
    }
    const uint64_t total = __shfl_sync(0xffffffffu, incl, 31);
    uint32_t hit = 0x7fffffffu;
    if (use_p) {
      const uint64_t target = mass_target(joint_p ? row_q : total, f.top_p);
      uint64_t run = incl - part;
      for (int i = beg; i < end; ++i) {
        run += q_of(i);
        if (run >= target) { hit = uint32_t(i); break; }
      }
    }
    hit = warp_reduce(hit, Min());
    const uint32_t thr = hit < uint32_t(m) ? ckey[hit] : tk;
    uint64_t kept = 0;   // the mass at or above thr (ties of thr after `hit` included)
    for (int i = beg; i < end; ++i)
      if (ckey[i] >= thr) kept += q_of(i);
    kept = warp_reduce(kept, Sum());
    if (lane == 0) { sm.hit = int(hit); sm.wq[0] = kept; }
  }
  __syncthreads();
  *t = sm.hit < m ? ckey[sm.hit] : tk;
  *keep_q = sm.wq[0];
  __syncthreads();
  return true;
}

// -- the kept set's threshold key; *keep (when want_keep) the value sum of the kept set, for renorm
__device__ __forceinline__ uint32_t threshold(const Row& row, const Filter& f, const RowStats& st, bool want_keep,
                                              double* keep, bool* from_candidates, Group& grp, Shared& sm) {
  *from_candidates = false;
  const bool logits = f.flags & kFromLogits;
  const uint32_t lo = st.min_key;
  *keep = st.sum;
  if (!(st.sum > 0.f) || st.max_key == 0xffffffffu) return lo;   // degenerate row: keep every token
  const bool use_k = (f.flags & kTopK) && f.top_k < uint32_t(row.vocab);
  const bool use_p = (f.flags & kTopP) && f.top_p < 1.f;
  if (f.flags & kMinP) {   // p >= min_p * max(p), exactly: the smallest float at or above the fp64 product
    const double cut = double(logits ? 1.f : st.max_x) * double(f.min_p);
    return max(lo, ord_key(__double2float_ru(cut)));
  }
  Select s{lo, 0};
  if (use_k && f.top_k <= BLOCK && grp.G == 1) {   // (a group of CTAs takes the radix select)
    uint32_t t;
    uint64_t q;
    if (top_k_candidates(row, f, st, use_p, &t, &q, sm)) {
      *from_candidates = true;
      *keep = fixed_value(q, st.shift_c);
      return t;
    }
  }
  const uint32_t never_k = 0xffffffffu;
  if (use_k && use_p && (f.flags & kJoint)) {
    s = radix_select(row, logits, st.max_x, st.shift_c, lo, f.top_k, f.top_p, false, grp, sm);
  } else {
    if (use_k) s = radix_select(row, logits, st.max_x, st.shift_c, lo, f.top_k, 1.f, want_keep && !use_p, grp, sm);
    if (use_p) s = radix_select(row, logits, st.max_x, st.shift_c, s.key, never_k, f.top_p, true, grp, sm);
  }
  if (want_keep) {
    if (!use_k && !use_p) {   // every token kept: the row's exact mass
      uint64_t q = 0;
      row.for_each([&](int, float x) { q += fixed_mass(value_of(x, logits, st.max_x), st.shift_c); });
      s.mass = group_sum(q, grp, sm);
    }
    *keep = fixed_value(s.mass, st.shift_c);
  }
  return s.key;
}

__device__ __forceinline__ int block_argmin(float best, int best_i, Group& grp, Shared& sm);

// -- exponential race over {key >= t}: the index of the smallest E_i / value_i (ties: lower index).
//    E_i = -log1p(-u_i) >= u_i, so an element with u_i > best * value_i (with a 2^-16 margin for the
//    roundings of log1pf, the division and the product) scores above this thread's best and cannot win:
//    it skips log1pf and the division. Exact: the winner and its score are unchanged.
template <typename V>
__device__ __forceinline__ int race(const Row& row, V value, uint32_t t, const Rng& rng, uint32_t rng_row, Group& grp,
                                    Shared& sm) {
  float best = kInf;
  int best_i = 0x7fffffff;
  uint4 r = make_uint4(0, 0, 0, 0);
  int group = -1;
  row.for_each([&](int i, float x) {
    if (ord_key(x) < t) return;
    if ((i >> 2) != group) { group = i >> 2; r = rng.draw(uint32_t(group), rng_row, kTagRace); }
    const float u = uniform01(pick(r, i & 3));
    const float v = value(i, x);
    if (v > 0.f && u > best * v * 1.0000153f) return;            // 1 + 2^-16
    const float score = -log1pf(-u) / v;
    if (score < best || (score == best && i < best_i)) { best = score; best_i = i; }
  });
  return block_argmin(best, best_i, grp, sm);
}

// -- the race over the sorted top-k candidates at or above t: the same scores as race() over the row
__device__ __forceinline__ int race_candidates(uint32_t t, bool logits, float max_x, const Rng& rng, uint32_t rng_row,
                                               Shared& sm) {
  float best = kInf;
  int best_i = 0x7fffffff;
  for (int c = threadIdx.x; c < sm.n; c += BLOCK) {
    const uint32_t key = sm.w.c.ckey[c];
    if (key < t) continue;
    const int i = sm.w.c.cidx[c];
    const float score = exponential(pick(rng.draw(uint32_t(i >> 2), rng_row, kTagRace), i & 3)) /
                        value_of(key_float(key), logits, max_x);
    if (score < best || (score == best && i < best_i)) { best = score; best_i = i; }
  }
  return block_argmin(best, best_i, sm.grp, sm);
}

// -- the smallest (score, index) of the block, then of the group (ties: lower index); 0 when none is finite
__device__ __forceinline__ int block_argmin(float best, int best_i, Group& grp, Shared& sm) {
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
  if (grp.G > 1) best_i = group_argmin(best, best_i, grp);
  return best_i == 0x7fffffff ? 0 : best_i;
}

}  // namespace cuattn

using namespace cuattn;

// Filtered sampling: out[b] drawn from row indices[b] (b when indices is null) of x [num_rows, vocab]
// (row stride row_stride), kept set by flags (top-k / top-p / min-p, top-k-first or joint), parameters
// per request from the arrays when non-null, else the scalars. out[b] = -1 for an index outside the rows.
// CTA blockIdx.x is part (blockIdx.x % splits) of output b = blockIdx.x / splits; ws: splits > 1 only,
// batch RowWs (zeroed once by the launcher).
extern "C" __global__ void __launch_bounds__(BLOCK) cuattn_sample(
    const float* __restrict__ x, int64_t row_stride, int vocab, int num_rows, const void* indices,
    int indices_is64, const int* __restrict__ top_k_arr, int top_k_val, const float* __restrict__ top_p_arr,
    float top_p_val, const float* __restrict__ min_p_arr, float min_p_val, int flags, int64_t seed,
    int64_t offset, int* __restrict__ out, int splits, void* ws) {
  __shared__ Shared sm;
  const int b = blockIdx.x / splits, part = blockIdx.x % splits;
  int64_t r = b;
  if (indices) r = indices_is64 ? static_cast<const int64_t*>(indices)[b] : static_cast<const int*>(indices)[b];
  if (r < 0 || r >= num_rows) { if (threadIdx.x == 0 && part == 0) out[b] = -1; return; }
  const Row row(x + r * row_stride, vocab);
  set_chunk(vocab, part, splits);
  Group& grp = sm.grp;
  grp.init(splits, part, ws, b);
  __syncthreads();
  Filter f;
  f.flags = flags;
  const int k = top_k_arr ? top_k_arr[b] : top_k_val;
  f.top_k = uint32_t(max(k, 1));
  f.top_p = top_p_arr ? top_p_arr[b] : top_p_val;
  f.min_p = min_p_arr ? min_p_arr[b] : min_p_val;
  // -- plain sampling from probabilities races over every element (key >= 0) and needs no row stats
  RowStats st{0u, 0xffffffffu, 0.f, 0.f, 0};
  if (flags != 0) st = row_stats(row, flags & kFromLogits, grp, sm);
  double keep_sum;
  bool from_candidates = false;
  const uint32_t t = (flags & (kTopK | kTopP | kMinP))
      ? threshold(row, f, st, false, &keep_sum, &from_candidates, grp, sm) : st.min_key;
  const Rng rng{uint32_t(uint64_t(seed)), uint32_t(uint64_t(seed) >> 32), uint32_t(uint64_t(offset)),
                uint32_t(uint64_t(offset) >> 32)};
  const bool logits = flags & kFromLogits;
  const float max_x = st.max_x;
  const int tok = from_candidates
      ? race_candidates(t, logits, max_x, rng, uint32_t(b), sm)
      : race(row, [&](int, float v) { return value_of(v, logits, max_x); }, t, rng, uint32_t(b), grp, sm);
  if (threadIdx.x == 0 && part == 0) out[b] = tok;
  grp.finish();
}

// Renormalization / masking of row r of x into row r of out (stride out_stride); CTA blockIdx.x is part
// (blockIdx.x % splits) of row blockIdx.x / splits, as cuattn_sample:
// MODE 0: top_k_renorm_probs, 1: top_p_renorm_probs (out = x / kept sum, 0 elsewhere);
// MODE 2: top_k_mask_logits (out = x, -inf elsewhere).
template <int MODE>
__device__ __forceinline__ void renorm_row(const float* __restrict__ x, int64_t row_stride, int vocab,
                                           const int* __restrict__ top_k_arr, int top_k_val,
                                           const float* __restrict__ top_p_arr, float top_p_val,
                                           float* __restrict__ out, int64_t out_stride, int splits, void* ws,
                                           Shared& sm) {
  const int r = blockIdx.x / splits, part = blockIdx.x % splits;
  const Row row(x + int64_t(r) * row_stride, vocab);
  set_chunk(vocab, part, splits);
  Group& grp = sm.grp;
  grp.init(splits, part, ws, r);
  __syncthreads();
  Filter f;
  const int k = top_k_arr ? top_k_arr[r] : top_k_val;
  f.top_k = uint32_t(max(k, 1));
  f.top_p = top_p_arr ? top_p_arr[r] : top_p_val;
  f.min_p = 0.f;
  f.flags = MODE == 1 ? kTopP : MODE == 2 ? (kTopK | kFromLogits) : kTopK;
  const RowStats st = row_stats(row, MODE == 2, grp, sm);
  double keep_sum;
  bool from_candidates;
  const uint32_t t = threshold(row, f, st, MODE != 2, &keep_sum, &from_candidates, grp, sm);
  float* o = out + int64_t(r) * out_stride;
  const float scale = float(1.0 / keep_sum);
  row.for_each([&](int i, float v) {
    const bool keep = ord_key(v) >= t;
    o[i] = MODE == 2 ? (keep ? v : -kInf) : (keep ? v * scale : 0.f);
  });
  grp.finish();
}

#define RENORM_ENTRY(NAME, MODE)                                                                          \
  extern "C" __global__ void __launch_bounds__(BLOCK) NAME(                                              \
      const float* __restrict__ x, int64_t row_stride, int vocab, const int* __restrict__ top_k_arr,       \
      int top_k_val, const float* __restrict__ top_p_arr, float top_p_val, float* __restrict__ out,        \
      int64_t out_stride, int splits, void* ws) {                                                         \
    __shared__ Shared sm;                                                                                 \
    renorm_row<MODE>(x, row_stride, vocab, top_k_arr, top_k_val, top_p_arr, top_p_val, out, out_stride, splits, \
                     ws, sm);                                                                             \
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
  set_chunk(vocab, 0, 1);
  sm.grp.init(1, 0, nullptr, 0);
  __syncthreads();
  if (pos < n)
    tok = race(row, [&](int i, float t) { return fmaxf(t - dp[i], 0.f); }, 0u, rng, race_row, sm.grp, sm);
  else
    tok = race(row, [&](int, float t) { return t; }, 0u, rng, race_row, sm.grp, sm);
  int* o = out_ids + int64_t(b) * (n + 1);
  for (int i = threadIdx.x; i <= n; i += BLOCK) o[i] = i < pos ? ids[i] : i == pos ? tok : -1;
  if (threadIdx.x == 0) { accepted[b] += acc; emitted[b] += pos; }
}
