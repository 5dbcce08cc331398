// mma.cuh — tensor-core and async-copy building blocks as inline PTX (sm_80+).
// Generic pieces only (no attention logic): shared-memory addresses, cp.async with zero fill,
// ldmatrix (plain and transposed) and mma.sync m16n8k16 with fp32 accumulation.
//
// Fragment layouts of mma.m16n8k16.row.col (g = lane / 4, t = lane % 4):
//   A 16x16 (4 regs): a0 (row g, k 2t..2t+1), a1 (row g+8, k 2t..), a2 (row g, k 8+2t..), a3 (row g+8, k 8+2t..)
//   B 16x8  (2 regs): b0 (k 2t..2t+1, col g), b1 (k 8+2t.., col g)
//   C 16x8  (4 f32):  c0 c1 (row g, cols 2t, 2t+1), c2 c3 (row g+8, cols 2t, 2t+1)
#pragma once
#include "common/dtypes.cuh"

namespace cuattn {

// -- generic pointer -> 32-bit shared-state-space address (for cp.async / ldmatrix operands)
__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  uint32_t a;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
  return a;
}

// -- 16-byte global -> shared copy; src_bytes < 16 zero-fills the rest (0: all zeros, src unread).
//    L2_PREFETCH (0 | 128 | 256): the L2 fetches that many bytes around the copy's line at once
#ifndef L2_PREFETCH
#define L2_PREFETCH 0
#endif
#if L2_PREFETCH == 256
#define CP_ASYNC_16_OP "cp.async.cg.shared.global.L2::256B [%0], [%1], 16, "
#elif L2_PREFETCH == 128
#define CP_ASYNC_16_OP "cp.async.cg.shared.global.L2::128B [%0], [%1], 16, "
#else
#define CP_ASYNC_16_OP "cp.async.cg.shared.global [%0], [%1], 16, "
#endif
#define CP_ASYNC_16_PTX CP_ASYNC_16_OP "%2;\n"
#define CP_ASYNC_16_PRED_PTX CP_ASYNC_16_OP "z;\n"

__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, int src_bytes) {
  asm volatile(CP_ASYNC_16_PTX ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
// -- the same with a predicate: zero = true writes 16 zero bytes and leaves src unread (src must still be an
//    address of the tensor); one LDGSTS with its zero-fill predicate, no byte count to compute
__device__ __forceinline__ void cp_async_16_zfill(uint32_t dst, const void* src, bool zero) {
  asm volatile("{\n.reg .pred z;\nsetp.ne.b32 z, %2, 0;\n" CP_ASYNC_16_PRED_PTX "}\n"
               ::"r"(dst), "l"(src), "r"(int(zero)) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// -- wait until at most N of this thread's committed groups are still in flight
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// -- arrive on mbarrier `bar` (a shared::cta address) once every cp.async this thread issued so far has
//    landed; .noinc: that arrival is one of the barrier's expected count (init it with the arriving threads)
__device__ __forceinline__ void cp_async_mbar_arrive_noinc(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}

// -- four 8x8 b16 matrices; lanes 8i..8i+7 give the row addresses of matrix i, reg i holds it
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

// -- c += a * b on tensor cores, 16x8x16, fp32 accumulation; T is f16 or bf16
template <class T>
__device__ __forceinline__ void mma_m16n8k16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);

template <>
__device__ __forceinline__ void mma_m16n8k16<f16>(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <>
__device__ __forceinline__ void mma_m16n8k16<bf16>(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

}  // namespace cuattn
