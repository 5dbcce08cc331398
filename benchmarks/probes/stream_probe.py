"""Decode load-path probe: per-SM streaming rate of paged K/V loads with the attention math removed.

Separates memory issue from compute for kernels_cu/decode.cu (issue 3). Every CTA streams one
piece of one kv head's K and V rows (fp16, head_dim 128: 256-byte rows) of a paged cache laid out
like the benchmark's [num_pages, 2, 16, 8, 128] (page ids in random order) through a 3-stage
shared-memory pipeline into padded 272-byte rows; the "math" warps only read one 16-byte word
per row (nothing is computed). Modes:

  cpasync   every thread issues 16-byte cp.async copies, wait_group + __syncthreads per stage
            (the shipped decode kernel's load path, page ids read per row with a plain load)
  bulk      one producer warp issues one cp.async.bulk per 256-byte K/V row (NHD), completing
            on a full mbarrier per stage; math warps wait on it and arrive on an empty mbarrier
  bulkpage  as bulk, with one 4 KB copy per page of a head (HND layout: a head's page is
            contiguous), unpadded smem rows
  warpbulk  no producer warp: each math warp bulk-copies its own 16 K + 16 V rows of a stage (one
            per lane) on its own mbarrier, STAGES - 1 tiles ahead (per-warp stages, no CTA barrier)

Geometry: 8 math warps, 128 tokens/stage, 1 CTA per SM (128 CTAs), or 4 math warps, 64
tokens/stage, 2 CTAs per SM (256 CTAs); 134 MB (K+V of 8 heads x 32k tokens) and 2.1 GB.
Timing: CUDA events, 256 MB read flush before each call, 3 warm-up + N timed, median.

    python benchmarks/probes/stream_probe.py [--reps 20] [--out probe.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys

import cupy as cp
import numpy as np

SRC = r"""
typedef unsigned int u32;
typedef long long i64;
__device__ __forceinline__ u32 smem_u32(const void* p) {
  u32 a; asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p)); return a;
}
__device__ __forceinline__ void mbar_init(u32 bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(u32 bar, int bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(u32 bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_wait(u32 bar, int parity) {
  asm volatile("{\n .reg .pred p;\n WAIT:\n mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
               " @!p bra WAIT;\n}\n" ::"r"(bar), "r"(parity) : "memory");
}
__device__ __forceinline__ void bulk_copy(u32 dst, const void* src, int bytes, u32 bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
               ::"r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}

constexpr int STAGES = 3, ROW = 256, SROW = 272;

// MODE 0 cp.async, 1 bulk per row (NHD), 2 bulk per page (HND), 3 per-warp bulk per row (NHD).
// Grid (8 heads, pieces).
template <int NW, int MODE>
__global__ void __launch_bounds__(NW * 32 + (MODE == 1 || MODE == 2 ? 32 : 0)) probe(
    const char* __restrict__ cache, const int* __restrict__ kv_indices, int piece,
    i64 s_page, i64 s_tok, i64 s_head, i64 kv_off, unsigned* sink) {
  extern __shared__ __align__(128) unsigned char smem[];
  constexpr int BLOCK_N = 16 * NW;
  constexpr int PITCH = MODE == 2 ? ROW : SROW;
  constexpr int STAGE_BYTES = 2 * BLOCK_N * PITCH;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int t0 = blockIdx.y * piece;
  const int n_tiles = piece / BLOCK_N;
  const char* kh = cache + blockIdx.x * s_head;
  const char* vh = kh + kv_off;
  unsigned acc = 0;
  if (MODE == 0) {
    constexpr int THREADS = NW * 32, CHUNKS = ROW / 16, RPP = THREADS / CHUNKS, PASSES = BLOCK_N / RPP;
    const int c = tid % CHUNKS;
    auto issue = [&](int tile) {
      if (tile < n_tiles) {
        unsigned char* ks = smem + (tile % STAGES) * STAGE_BYTES;
        unsigned char* vs = ks + BLOCK_N * SROW;
#pragma unroll
        for (int p = 0; p < PASSES; ++p) {
          const int r = p * RPP + tid / CHUNKS;
          const int pos = t0 + tile * BLOCK_N + r;
          const i64 off = i64(kv_indices[pos >> 4]) * s_page + i64(pos & 15) * s_tok + c * 16;
          asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_u32(ks + r * SROW + c * 16)), "l"(kh + off) : "memory");
          asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_u32(vs + r * SROW + c * 16)), "l"(vh + off) : "memory");
        }
      }
      asm volatile("cp.async.commit_group;\n" ::: "memory");
    };
    for (int s = 0; s < STAGES - 1; ++s) issue(s);
    for (int tile = 0; tile < n_tiles; ++tile) {
      asm volatile("cp.async.wait_group %0;\n" ::"n"(STAGES - 2) : "memory");
      __syncthreads();
      issue(tile + STAGES - 1);
      const unsigned char* ks = smem + (tile % STAGES) * STAGE_BYTES + warp * 16 * SROW;
      acc ^= *reinterpret_cast<const unsigned*>(ks + (lane % 16) * SROW + (lane / 16) * BLOCK_N * SROW);
    }
  } else if (MODE == 3) {
    const u32 bars = smem_u32(smem + STAGES * STAGE_BYTES), full = bars + 8 * STAGES * warp;
    if (tid == 0) {
      for (int i = 0; i < NW * STAGES; ++i) mbar_init(bars + 8 * i, 1);
      asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    auto issue = [&](int tile) {
      if (tile >= n_tiles) return;
      const int stage = tile % STAGES, r = warp * 16 + lane % 16, pos = t0 + tile * BLOCK_N + r;
      if (lane == 0) mbar_expect_tx(full + 8 * stage, 32 * ROW);
      const i64 off = i64(kv_indices[pos >> 4]) * s_page + i64(pos & 15) * s_tok;
      bulk_copy(smem_u32(smem + stage * STAGE_BYTES + (lane < 16 ? 0 : BLOCK_N * SROW) + r * SROW),
                (lane < 16 ? kh : vh) + off, ROW, full + 8 * stage);
    };
    for (int s = 0; s < STAGES - 1; ++s) issue(s);
    for (int tile = 0; tile < n_tiles; ++tile) {
      const int stage = tile % STAGES;
      asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
      issue(tile + STAGES - 1);
      mbar_wait(full + 8 * stage, (tile / STAGES) & 1);
      const unsigned char* ks = smem + stage * STAGE_BYTES + warp * 16 * SROW;
      acc ^= *reinterpret_cast<const unsigned*>(ks + (lane % 16) * SROW + (lane / 16) * BLOCK_N * SROW);
    }
  } else {
    const u32 full = smem_u32(smem + STAGES * STAGE_BYTES), empty = full + 8 * STAGES;
    if (tid == 0) {
      for (int s = 0; s < STAGES; ++s) { mbar_init(full + 8 * s, 1); mbar_init(empty + 8 * s, NW); }
      asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    if (warp == NW) {
      for (int tile = 0; tile < n_tiles; ++tile) {
        const int stage = tile % STAGES;
        if (tile >= STAGES) mbar_wait(empty + 8 * stage, (tile / STAGES - 1) & 1);
        if (lane == 0) mbar_expect_tx(full + 8 * stage, 2 * BLOCK_N * ROW);
        const u32 ks = smem_u32(smem + stage * STAGE_BYTES), vs = ks + BLOCK_N * PITCH;
        if (MODE == 1) {
#pragma unroll
          for (int i = 0; i < BLOCK_N / 32; ++i) {
            const int r = i * 32 + lane, pos = t0 + tile * BLOCK_N + r;
            const i64 off = i64(kv_indices[pos >> 4]) * s_page + i64(pos & 15) * s_tok;
            bulk_copy(ks + r * SROW, kh + off, ROW, full + 8 * stage);
            bulk_copy(vs + r * SROW, vh + off, ROW, full + 8 * stage);
          }
        } else if (lane < BLOCK_N / 16) {   // one 4 KB copy per page
          const int pos = t0 + tile * BLOCK_N + lane * 16;
          const i64 off = i64(kv_indices[pos >> 4]) * s_page;
          bulk_copy(ks + lane * 16 * ROW, kh + off, 16 * ROW, full + 8 * stage);
          bulk_copy(vs + lane * 16 * ROW, vh + off, 16 * ROW, full + 8 * stage);
        }
      }
      return;
    }
    for (int tile = 0; tile < n_tiles; ++tile) {
      const int stage = tile % STAGES;
      mbar_wait(full + 8 * stage, (tile / STAGES) & 1);
      const unsigned char* ks = smem + stage * STAGE_BYTES + warp * 16 * PITCH;
      acc ^= *reinterpret_cast<const unsigned*>(ks + (lane % 16) * PITCH + (lane / 16) * BLOCK_N * PITCH);
      __syncwarp();
      if (lane == 0) mbar_arrive(empty + 8 * stage);
    }
  }
  if (acc == 0x9e3779b9u) sink[0] = acc;
}
"""

NAMES = [f"probe<{nw},{m}>" for nw in (4, 8) for m in (0, 1, 2, 3)]
MODES = {0: "cpasync", 1: "bulk", 2: "bulkpage", 3: "warpbulk"}

_READ = cp.RawKernel(r"""
extern "C" __global__ void read_only(const uint4* __restrict__ x, long long n, unsigned* sink) {
  uint4 acc = make_uint4(0, 0, 0, 0);
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
    uint4 v = x[i]; acc.x ^= v.x; acc.y ^= v.y; acc.z ^= v.z; acc.w ^= v.w;
  }
  if ((acc.x ^ acc.y ^ acc.z ^ acc.w) == 0x12345678u) sink[0] = 1;
}""", "read_only")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = cp.cuda.Device()
    gpu = cp.cuda.runtime.getDeviceProperties(dev.id)["name"].decode()
    sms = dev.attributes["MultiProcessorCount"]
    mod = cp.RawModule(code=SRC, options=("--std=c++17",), name_expressions=NAMES)
    flush_buf = cp.empty(256 << 20, cp.uint8)
    flush_buf.fill(1)
    sink = cp.zeros(1, cp.uint32)
    n_flush = flush_buf.nbytes // 16

    def flush():
        _READ((sms * 8,), (512,), (flush_buf, np.int64(n_flush), sink))

    def timed(fn):
        for _ in range(3):
            fn()
        ev0, ev1 = cp.cuda.Event(), cp.cuda.Event()
        ts = []
        for _ in range(args.reps):
            flush()
            ev0.record()
            fn()
            ev1.record()
            ev1.synchronize()
            ts.append(cp.cuda.get_elapsed_time(ev0, ev1) * 1e3)
        return statistics.median(ts)

    # read-only ceiling (2 GiB)
    big = cp.empty(2 << 30, cp.uint8)
    big.view(cp.uint32)[:] = 1
    read_us = timed(lambda: _READ((sms * 8,), (512,), (big, np.int64(big.nbytes // 16), sink)))
    read_tbs = big.nbytes / read_us / 1e6
    big = None
    print(f"{gpu} sms={sms} read-only ceiling {read_tbs:.3f} TB/s", flush=True)
    rows = []
    print(f"{'mode':>9} {'warps':>5} {'CTA/SM':>6} {'MB':>6} {'us':>8} {'TB/s':>6} {'%read':>6}", flush=True)
    for tokens in (32768, 524288):            # per kv head: 134 MB, 2.1 GB of K+V (8 heads)
        pages = tokens // 16
        cache = cp.empty(pages * 65536, cp.uint8)   # [pages, 2, 16, 8, 128] fp16
        cache.view(cp.uint32)[:] = 0x3c003c00
        idx = cp.asarray(np.random.default_rng(0).permutation(pages).astype(np.int32))
        nbytes = 2 * tokens * 8 * 256
        for nw, cps in ((8, 1), (4, 2)):
            pieces = 16 * cps                  # 8 heads x 16 | 32 pieces: 128 | 256 CTAs
            piece = tokens // pieces
            for mode in (0, 1, 2, 3):
                k = mod.get_function(NAMES[(nw == 8) * 4 + mode])
                pitch = 256 if mode == 2 else 272
                smem = 3 * 2 * 16 * nw * pitch + (256 if mode else 0)
                k.max_dynamic_shared_size_bytes = smem
                if mode == 2:   # HND: [page][2][head][slot][d]
                    strides = (65536, 256, 4096)
                else:           # NHD: [page][2][slot][head][d]
                    strides = (65536, 2048, 256)
                block = nw * 32 + (32 if mode in (1, 2) else 0)
                fn = lambda k=k, block=block, smem=smem, strides=strides: k(
                    (8, pieces), (block,), (cache, idx, np.int32(piece), np.int64(strides[0]),
                                            np.int64(strides[1]), np.int64(strides[2]), np.int64(32768), sink),
                    shared_mem=smem)
                us = timed(fn)
                tbs = nbytes / us / 1e6
                row = dict(mode=MODES[mode], warps=nw, ctas_per_sm=cps, mbytes=nbytes / 1e6, us=us, tbs=tbs,
                           of_read=tbs / read_tbs)
                rows.append(row)
                print(f"{MODES[mode]:>9} {nw:>5} {cps:>6} {nbytes / 1e6:6.0f} {us:8.1f} {tbs:6.3f} "
                      f"{100 * tbs / read_tbs:5.1f}%", flush=True)
        cache = idx = None
        cp.get_default_memory_pool().free_all_blocks()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(gpu=gpu, sms=sms, read_only_tbs=read_tbs, flush="read 256 MB", reps=args.reps,
                           rows=rows), f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
