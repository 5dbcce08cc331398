// tma.cuh — Hopper (sm_90) asynchronous-copy building blocks as inline PTX: mbarriers, TMA tile
// loads (cp.async.bulk.tensor) from a CUtensorMap kernel parameter, proxy fences, named barriers.
// Generic pieces only (no attention logic); used by prefill_sm90.cu and decode.cu (TMA=1).
#pragma once
#include "common/dtypes.cuh"

namespace cuattn {

// ---------------------------------------------------------------------------- mbarrier
__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
// -- make the initialised barriers visible to the async proxy (TMA) and the other threads
__device__ __forceinline__ void mbar_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
// -- wait until the phase with parity `parity` has completed (a fresh barrier: parity 1 passes)
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  uint32_t done;
  do {
    asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(done) : "r"(bar), "r"(parity) : "memory");
  } while (!done);
}

// ---------------------------------------------------------------------------- TMA
// A CUtensorMap (cuTensorMapEncodeTiled) passed by value as a __grid_constant__ kernel parameter.
struct __align__(64) TmaDesc { uint64_t bits[16]; };

// -- fetch a tensor map into the TMA unit's descriptor cache ahead of its first load
__device__ __forceinline__ void tma_prefetch_desc(const TmaDesc* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

// -- 3-d / 4-d tile load: box at coordinates (c0, c1, c2[, c3]) of the tensor map into smem dst, completing
//    `bytes` of transaction count on mbarrier bar
__device__ __forceinline__ void tma_load_3d(uint32_t dst, const TmaDesc* map, int c0, int c1, int c2, uint32_t bar) {
  asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];\n"
               ::"r"(dst), "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(bar) : "memory");
}
__device__ __forceinline__ void tma_load_4d(uint32_t dst, const TmaDesc* map, int c0, int c1, int c2, int c3,
                                            uint32_t bar) {
  asm volatile("cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], [%6];\n"
               ::"r"(dst), "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar)
               : "memory");
}

// -- ordinary (generic-proxy) smem writes, e.g. cp.async, made visible to wgmma / TMA (async proxy)
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// -- barrier among `count` threads (a multiple of 32) under id (1..15; 0 is __syncthreads)
__device__ __forceinline__ void named_barrier(int id, int count) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
// -- arrive on such a barrier without waiting (the waiters' bar.sync counts these threads too)
__device__ __forceinline__ void named_barrier_arrive(int id, int count) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}

}  // namespace cuattn
