// sampling_group.cuh — a group of CTAs sharing one row in sampling.cu (launched by cuattn/sampling.py; splits > 1):
// the per-row workspace (RowWs, whose size sampling.py's _WS_ROW_BYTES mirrors), the group's software barrier
// and ring of histograms (Group), and the group's argmin of the race. The launcher keeps batch * splits <= the
// SM count, so a group's CTAs are co-resident and the spinning barrier cannot deadlock.
// The includer defines BLOCK (threads of a CTA), NBINS (histogram bins) and MAX_SPLITS (CTAs of a group at most).
#pragma once
#include "common/dtypes.cuh"
#include "common/sampling_math.cuh"

namespace cuattn {

// -- the per-row workspace of a group of CTAs (splits > 1); all zero between launches
struct GBin { unsigned long long mass; uint32_t cnt; uint32_t pad; };
struct Part { uint32_t min_key, max_key; float m, s; };   // one CTA's row stats
struct RowWs {
  GBin ring[3][NBINS];          // histograms of the group's reductions, used in turn (cleared two steps later)
  Part part[MAX_SPLITS];        // row stats of each CTA
  unsigned long long best;      // ~ the packed (score, index) of the race's winner so far (atomicMax of ~key)
  uint32_t arrive, depart;      // barrier counters
};
#ifdef WS_ROW_BYTES
static_assert(sizeof(RowWs) == WS_ROW_BYTES, "RowWs layout must match sampling.py's _WS_ROW_BYTES");
#endif

// -- the CTAs that share one row: g of G, and the group's barrier. Kept in shared memory (Shared::grp, written by
//    thread 0 before the first __syncthreads; nbar and step change only in thread 0, between barriers), which
//    keeps it out of the registers. Every CTA of a group takes the same branches (they decide on the same reduced
//    data), so they call sync() and use the ring equally often.
struct Group {
  RowWs* ws;
  int G, g;
  uint32_t nbar;     // barriers passed (the arrival counter reaches G * nbar)
  uint32_t step;     // reductions through ws->ring done (reduction s uses ring[s % 3])
  __device__ __forceinline__ void init(int G_, int g_, void* base, int64_t slot) {
    if (threadIdx.x == 0) {
      ws = G_ > 1 ? static_cast<RowWs*>(base) + slot : nullptr;
      G = G_; g = g_; nbar = 0; step = 0;
    }
  }
  // -- every CTA of the group has reached this point, and sees the global writes made before it
  __device__ __forceinline__ void sync() {
    if (G == 1) { __syncthreads(); return; }
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
      const uint32_t target = ++nbar * uint32_t(G);
      atomicAdd(&ws->arrive, 1u);
      while (*reinterpret_cast<volatile uint32_t*>(&ws->arrive) < target) __nanosleep(32);
      __threadfence();
    }
    __syncthreads();
  }
  // -- the ring histogram of this reduction; clears this CTA's share of the next one (last read two reductions
  //    ago: every CTA has passed a barrier since). The caller calls done() after its group sync.
  __device__ __forceinline__ GBin* next_ring() {
    GBin* nxt = ws->ring[(step + 1) % 3];
    for (int j = g * BLOCK + threadIdx.x; j < NBINS; j += G * BLOCK) { nxt[j].mass = 0; nxt[j].cnt = 0; }
    return ws->ring[step % 3];
  }
  __device__ __forceinline__ void done() {   // (every thread has taken its ring pointer; a __syncthreads follows)
    if (threadIdx.x == 0) ++step;
  }
  // -- before the kernel exits: clear what is still set, then the barrier counters (the last CTA to leave)
  __device__ __forceinline__ void finish() {
    if (G == 1) return;
    sync();
    for (int j = g * BLOCK + threadIdx.x; j < 3 * NBINS; j += G * BLOCK) {
      ws->ring[j / NBINS][j % NBINS].mass = 0;
      ws->ring[j / NBINS][j % NBINS].cnt = 0;
    }
    if (g == 0 && threadIdx.x == 0) ws->best = 0;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0 && atomicAdd(&ws->depart, 1u) == uint32_t(G) - 1) { ws->arrive = 0; ws->depart = 0; }
  }
};

// -- the group's smallest (score, index) from each CTA's: ord_key(score) << 32 | index orders them as the
//    block does, and an atomicMax of its complement finds it (the slot is zero between launches: finish()
//    clears it).
__device__ __forceinline__ int group_argmin(float best, int best_i, Group& grp) {
  const uint64_t key = (uint64_t(ord_key(best)) << 32) | uint32_t(best_i);
  if (threadIdx.x == 0) atomicMax(&grp.ws->best, ~key);
  grp.sync();
  return int(uint32_t(~__ldcg(&grp.ws->best)));
}

}  // namespace cuattn
