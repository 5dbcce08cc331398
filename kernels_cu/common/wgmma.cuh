// wgmma.cuh — Hopper (sm_90a) building blocks as inline PTX: wgmma with shared-memory
// descriptors and setmaxnreg (mbarriers and TMA loads: tma.cuh).
// Generic pieces only (no attention logic); used by prefill_sm90.cu and mla_sm90.cu.
//
// Shared-memory operand layout (the "128-byte swizzle" that TMA's CU_TENSOR_MAP_SWIZZLE_128B
// writes and wgmma descriptors with layout type 1 read): a tile is stored as column blocks of
// 64 16-bit elements (128 bytes per row), each block [rows][64]; inside a block, 16-byte chunk c
// of row r sits at r * 128 + ((c ^ (r % 8)) * 16). Blocks start 1024-byte aligned (the XOR takes
// address bits 7..9).
//   K-major operand (A = Q, B = K for S = Q K^T): SBO = 1024 (next 8 rows), LBO unused; the k-step
//     kk (16 elements) starts at block kk / 4, byte (kk % 4) * 32 of the row.
//   MN-major operand (B = V for O += P V, transposed by the instruction's imm-trans-b = 1):
//     LBO = the stride between 64-wide column blocks, SBO = 1024 (next 8 k rows); k-step kk
//     (16 keys) starts at row 16 kk.
// Accumulator layout of m64nNk16 (per warp w of the warpgroup, g = lane / 4, t = lane % 4):
//   d[4 n + 0, 1] = row 16 w + g, cols 8 n + 2 t, + 1; d[4 n + 2, 3] = row 16 w + g + 8, same cols.
// A from registers (m64nNk16, 16-bit): a0 (row g, k 2t..2t+1), a1 (row g+8, k 2t..), a2 (row g,
//   k 8+2t..), a3 (row g+8, k 8+2t..): the mma.sync m16n8k16 A fragment, per warp.
#pragma once
#include "common/dtypes.cuh"

namespace cuattn {

// -- wgmma shared-memory matrix descriptor, 128-byte swizzle (layout type 1 in bits 62..63)
__device__ __forceinline__ uint64_t wgmma_desc(uint32_t smem_addr, uint32_t lbo, uint32_t sbo) {
  return uint64_t((smem_addr & 0x3FFFF) >> 4) | (uint64_t(lbo >> 4) << 16) | (uint64_t(sbo >> 4) << 32) |
         (uint64_t(1) << 62);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// -- keep the compiler from moving accumulator registers across an asynchronous wgmma
template <int R>
__device__ __forceinline__ void wgmma_fence_regs(float (&d)[R]) {
#pragma unroll
  for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// -- the accumulator operands of an m64nNk16 wgmma (N / 2 floats per thread): the register list of
//    the PTX string and the "+f" constraints, for N = 64, 128, 256
#define CUATTN_WGMMA_REGS_N64 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define CUATTN_WGMMA_ACC_N64 \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
    "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
    "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
    "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define CUATTN_WGMMA_REGS_N128 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
#define CUATTN_WGMMA_ACC_N128 \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
    "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
    "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
    "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
    "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
    "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
    "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
    "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
#define CUATTN_WGMMA_REGS_N256 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}"
#define CUATTN_WGMMA_ACC_N256 \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
    "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
    "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
    "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
    "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
    "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
    "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
    "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), \
    "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), \
    "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), \
    "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), \
    "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), \
    "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), \
    "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), \
    "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), \
    "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])

template <int N, class T>
struct Wgmma;   // ss / rs_tb / ss_tb of m64nNk16 for 16-bit T (specialisations below)

// -- one (N, T): the operands after the N / 2 accumulators are numbered from N / 2 on, so the PTX
//    strings name them by the literal indices I0.. (I0 = N / 2)
#define CUATTN_WGMMA_DEFS(N, T, PT, I0, I1, I2, I3, I4, I5)                                                        \
  template <>                                                                                                     \
  struct Wgmma<N, T> {                                                                                            \
    static __device__ __forceinline__ void ss(float (&d)[N / 2], uint64_t desc_a, uint64_t desc_b, int scale_d) {  \
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" I2 ", 0;\n"                                               \
                   "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." PT "." PT " " CUATTN_WGMMA_REGS_N##N         \
                   ", %" I0 ", %" I1 ", p, 1, 1, 0, 0;\n}\n"                                                      \
                   : CUATTN_WGMMA_ACC_N##N                                                                        \
                   : "l"(desc_a), "l"(desc_b), "r"(scale_d));                                                     \
    }                                                                                                             \
    static __device__ __forceinline__ void rs_tb(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t desc_b) {     \
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" I5 ", 0;\n"                                               \
                   "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." PT "." PT " " CUATTN_WGMMA_REGS_N##N         \
                   ", {%" I0 ", %" I1 ", %" I2 ", %" I3 "}, %" I4 ", p, 1, 1, 1;\n}\n"                            \
                   : CUATTN_WGMMA_ACC_N##N                                                                        \
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1));                            \
    }                                                                                                             \
    static __device__ __forceinline__ void ss_tb(float (&d)[N / 2], uint64_t desc_a, uint64_t desc_b) {            \
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" I2 ", 0;\n"                                               \
                   "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." PT "." PT " " CUATTN_WGMMA_REGS_N##N         \
                   ", %" I0 ", %" I1 ", p, 1, 1, 0, 1;\n}\n"                                                      \
                   : CUATTN_WGMMA_ACC_N##N                                                                        \
                   : "l"(desc_a), "l"(desc_b), "r"(1));                                                           \
    }                                                                                                             \
  };

CUATTN_WGMMA_DEFS(64, f16, "f16", "32", "33", "34", "35", "36", "37")
CUATTN_WGMMA_DEFS(64, bf16, "bf16", "32", "33", "34", "35", "36", "37")
CUATTN_WGMMA_DEFS(128, f16, "f16", "64", "65", "66", "67", "68", "69")
CUATTN_WGMMA_DEFS(128, bf16, "bf16", "64", "65", "66", "67", "68", "69")
CUATTN_WGMMA_DEFS(256, f16, "f16", "128", "129", "130", "131", "132", "133")
CUATTN_WGMMA_DEFS(256, bf16, "bf16", "128", "129", "130", "131", "132", "133")
#undef CUATTN_WGMMA_DEFS

// -- d (64 x N, fp32) (+)= A (64 x 16, smem, K-major) * B (16 x N, smem, K-major); scale_d = 0 overwrites d
template <int N, class T>
__device__ __forceinline__ void wgmma_m64k16_ss(float (&d)[N / 2], uint64_t desc_a, uint64_t desc_b, int scale_d) {
  Wgmma<N, T>::ss(d, desc_a, desc_b, scale_d);
}
// -- d (64 x N, fp32) += A (64 x 16, registers) * B (16 x N, smem, N-major: imm-trans-b = 1)
template <int N, class T>
__device__ __forceinline__ void wgmma_m64k16_rs_tb(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t desc_b) {
  Wgmma<N, T>::rs_tb(d, a, desc_b);
}
// -- d (64 x N, fp32) += A (64 x 16, smem, K-major) * B (16 x N, smem, N-major: imm-trans-b = 1)
template <int N, class T>
__device__ __forceinline__ void wgmma_m64k16_ss_tb(float (&d)[N / 2], uint64_t desc_a, uint64_t desc_b) {
  Wgmma<N, T>::ss_tb(d, desc_a, desc_b);
}
// -- the fixed-N names mla_sm90.cu calls
template <class T>
__device__ __forceinline__ void wgmma_m64n64k16_ss(float (&d)[32], uint64_t desc_a, uint64_t desc_b, int scale_d) {
  Wgmma<64, T>::ss(d, desc_a, desc_b, scale_d);
}
template <class T>
__device__ __forceinline__ void wgmma_m64n256k16_rs_tb(float (&d)[128], const uint32_t (&a)[4], uint64_t desc_b) {
  Wgmma<256, T>::rs_tb(d, a, desc_b);
}
template <class T>
__device__ __forceinline__ void wgmma_m64n256k16_ss_tb(float (&d)[128], uint64_t desc_a, uint64_t desc_b) {
  Wgmma<256, T>::ss_tb(d, desc_a, desc_b);
}

// ---------------------------------------------------------------------------- misc
template <int R> __device__ __forceinline__ void setmaxnreg_inc() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(R)); }
template <int R> __device__ __forceinline__ void setmaxnreg_dec() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(R)); }

}  // namespace cuattn
