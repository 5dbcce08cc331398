"""Where the time of an isolated decode call goes: per-CTA timestamps from a traced copy of decode.cu.

Thread 0 of every CTA records %globaltimer at its start and end, and clock64 at: start, work item
in hand, first page ids in hand, first K/V tile landed (warp 0), main loop done, epilogue done,
end. A plain read kernel of the same bytes records its CTAs' start/end the same way.
The trace lines are inserted at anchors of decode.cu's text (PATCHES; each must occur once), so a
change to those lines of the kernel needs the anchors updated. Timing and correctness are the
benchmark's and the tests' business; this only says where an isolated call's time goes.
    PYTHONPATH=. python benchmarks/probes/decode_trace.py
"""
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import cupy as cp  # noqa: E402

from cuattn import jit  # noqa: E402

HELPERS = r"""
__device__ long long cuattn_trace[16384][12];
__device__ __forceinline__ long long gtime() { long long t; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); return t; }
// clock64 once v is in hand: the branch on v cannot be passed before v's load completes
__device__ __forceinline__ long long clk_after(int v) {
  if (v == 0x7fffabcd) asm volatile("trap;");
  return clock64();
}
#define TR(i, v) if (threadIdx.x == 0) cuattn_trace[blockIdx.y * gridDim.x + blockIdx.x][i] = (v)
"""

PATCHES = [
    ("  __syncthreads();\n  float* red_m = reinterpret_cast<float*>(kv_s);",
     "  __syncthreads();\n  TR(10, clock64());\n  float* red_m = reinterpret_cast<float*>(kv_s);"),
    ("  __syncthreads();\n  if (!is_last) return;", "  __syncthreads();\n  TR(11, clock64());\n  if (!is_last) return;"),
    ("using namespace cuattn;\n", "using namespace cuattn;\n" + HELPERS),
    ("  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;\n",
     "  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;\n"
     "  TR(0, gtime()); TR(2, clock64());\n"
     "  { unsigned sm; asm(\"mov.u32 %0, %%smid;\" : \"=r\"(sm)); TR(9, sm); }\n"),
    ("  const int page_base = w[1], kv_end = w[3], slot = w[4];\n",
     "  const int page_base = w[1], kv_end = w[3], slot = w[4];\n"
     "  TR(3, clk_after(kv_end));\n"),
    ("  int ids_t0 = 0, ids_cur = load_ids(0), ids_next = load_ids(32);\n",
     "  int ids_t0 = 0, ids_cur = load_ids(0), ids_next = load_ids(32);\n"
     "  TR(4, clk_after(ids_cur));\n"),
    ("    mbar_wait(bar_of(tile % STAGES), (tile / STAGES) & 1);\n",
     "    mbar_wait(bar_of(tile % STAGES), (tile / STAGES) & 1);\n"
     "    if (tile == 0) TR(5, clock64());\n"),
    ("  allow_next_grid();    // only the epilogue is left",
     "  TR(6, clock64());\n  allow_next_grid();    // only the epilogue is left"),
    ("  // -- fused merge: the last piece of a split request to finish (per head tile) merges them all\n",
     "  TR(7, clock64()); TR(1, gtime()); TR(8, -1);\n"
     "  // -- fused merge: the last piece of a split request to finish (per head tile) merges them all\n"),
    ("                   (i % (HEAD_DIM / 4)) * 4, num_qo_heads, out, o_s_b, o_s_h, lse);\n}",
     "                   (i % (HEAD_DIM / 4)) * 4, num_qo_heads, out, o_s_b, o_s_h, lse);\n"
     "  __syncthreads(); TR(8, gtime());\n}"),
]

_original = jit.assemble_source


def _traced(source):
    text = _original(source)
    if source != "decode.cu":
        return text
    for old, new in PATCHES:
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    return text


jit.assemble_source = _traced

import bench_decode as b  # noqa: E402
import cuattn  # noqa: E402

READ_TRACED = cp.RawKernel(r"""
extern "C" __global__ void read_traced(const uint4* __restrict__ x, long long n, unsigned* sink,
                                       long long* trace) {
  long long t0; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  const long long stride = (long long)gridDim.x * blockDim.x;
  long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
  uint4 acc = make_uint4(0, 0, 0, 0);
  for (; i + 3 * stride < n; i += 4 * stride) {
    uint4 v[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) v[u] = x[i + u * stride];
#pragma unroll
    for (int u = 0; u < 4; ++u) { acc.x ^= v[u].x; acc.y ^= v[u].y; acc.z ^= v[u].z; acc.w ^= v[u].w; }
  }
  for (; i < n; i += stride) { uint4 v = x[i]; acc.x ^= v.x; acc.y ^= v.y; acc.z ^= v.z; acc.w ^= v.w; }
  if ((acc.x ^ acc.y ^ acc.z ^ acc.w) == 0x12345678u) sink[0] = 1;
  __syncthreads();
  long long t1; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t1));
  if (threadIdx.x == 0) { trace[2 * blockIdx.x] = t0; trace[2 * blockIdx.x + 1] = t1; }
}""", "read_traced")


def q(v):
    v = sorted(v)
    return f"{v[0]:7.2f} {v[len(v) // 2]:7.2f} {v[-1]:7.2f}"


def main():
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    sink = cp.zeros(1, cp.uint32)
    flush = b.l2_flush()
    print(f"{cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}")
    print("columns: min median max over CTAs, µs (clock deltas scaled by each CTA's clock/globaltimer ratio)")

    big = cp.empty(2 << 30, cp.uint8)
    b.fill_random(big.view(cp.uint16), "float16", 3)
    for mb, (per_sm, threads) in ((mb, g) for mb in (134, 537) for g in ((2, 1024), (4, 512), (1, 1024))):
        n = mb * 1000 * 1000 // 16
        rtr = cp.zeros((sms * per_sm, 2), cp.int64)
        call = lambda: READ_TRACED((sms * per_sm,), (threads,), (big, np.int64(n), sink, rtr))  # noqa: E731
        us = b.time_events(call, 30, flush)
        flush(); call(); cp.cuda.Device().synchronize()
        t = cp.asnumpy(rtr)
        t0 = t[:, 0].min()
        print(f"plain read {mb} MB {per_sm}x{threads}/SM: event {us:.1f} µs; CTA start {q((t[:, 0] - t0) / 1e3)}; "
              f"end {q((t[:, 1] - t0) / 1e3)}")
    big = None  # noqa: F841 (frees 2 GB)
    cp.get_default_memory_pool().free_all_blocks()

    for heads, batch, kv_len in (("32:8", 1, 512), ("32:8", 1, 32768), ("32:8", 16, 2048), ("32:8", 16, 8192),
                                 ("32:8", 64, 2048), ("32:8", 16, 32768)):
        hq, hkv = map(int, heads.split(":"))
        indptr, indices, lpl, cache, qq = b.setup_case(batch, kv_len, hq, hkv, 128, 16, "float16", batch + kv_len)
        w = cuattn.BatchDecodeWithPagedKVCacheWrapper(kv_layout="NHD")
        w.plan(indptr, indices, lpl, hq, hkv, 128, 16, q_data_type="float16")
        out = cp.empty_like(qq)
        run = lambda: w.run(qq, cache, out=out)  # noqa: E731
        us = b.time_events(run, 30, flush)
        mod = jit._module(w._spec, 0)
        gptr = mod.get_global_var("cuattn_trace")
        ctas = w._plan.grid[0] * w._plan.grid[1]
        rows = []
        for _ in range(5):
            if isinstance(gptr, int):
                gptr = cp.cuda.MemoryPointer(cp.cuda.UnownedMemory(gptr, 16384 * 96, mod), 0)
            trace = cp.ndarray((16384, 12), cp.int64, gptr)
            trace[:ctas].fill(0)
            flush()
            run()
            cp.cuda.Device().synchronize()
            rows.append(cp.asnumpy(trace[:ctas]))
        t = rows[2]
        g0 = t[:, 0].min()
        ghz = (t[:, 7] - t[:, 2]) / np.maximum(t[:, 1] - t[:, 0], 1)   # clock cycles per ns
        cyc = lambda a, c: (t[:, c] - t[:, a]) / ghz / 1e3  # noqa: E731
        merged = t[:, 8] > 0
        print(f"\n{heads} bs{batch}x{kv_len}: event {us:.1f} µs, {ctas} CTAs {w._spec.name} grid {w._plan.grid}, "
              f"split {bool(w._work.split)}, clock {np.median(ghz):.2f} GHz; "
              f"SMs used {len(set(t[:, 9]))}")
        print(f"  CTA start after the first       {q((t[:, 0] - g0) / 1e3)}")
        print(f"  start -> work item              {q(cyc(2, 3))}")
        print(f"  work item -> first page ids     {q(cyc(3, 4))}")
        print(f"  page ids -> first tile landed   {q(cyc(4, 5))}")
        print(f"  first tile -> loop done         {q(cyc(5, 6))}")
        print(f"  loop done -> all warps done     {q(cyc(6, 10))}")
        print(f"  all warps done -> epilogue done {q(cyc(10, 7))}")
        print(f"  CTA end (epilogue) after first  {q((t[:, 1] - g0) / 1e3)}")
        if merged.any():
            print(f"  epilogue done -> counter known  {q(cyc(7, 11)[merged])}")
            print(f"  merge done after first start    {q((t[merged, 8] - g0) / 1e3)}  ({merged.sum()} merging CTAs)")
        last = max(t[:, 1].max(), t[:, 8].max()) - g0
        print(f"  first start -> last end: {last / 1e3:.2f} µs (other reps: "
              + " ".join(f"{(max(r[:, 1].max(), r[:, 8].max()) - r[:, 0].min()) / 1e3:.2f}" for r in rows) + ")")
        cp.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main()
