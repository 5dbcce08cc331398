"""DRAM locality: read the same bytes as chunks of different shapes, in random order, 1 CTA per SM.

Each CTA reads its own list of chunks; a chunk is R segments of SEG bytes, STRIDE bytes apart.
    NHD head rows:   16 x 256 B at 2 KB (one page's K rows of one kv head; 8 CTAs share a page)
    HND head block:  1 x 4 KB (one page's K of one head, contiguous)
    whole page:      1 x 32 KB (one page's K of all 8 heads), 1 x 64 KB (K and V)
    contiguous:      each CTA one contiguous region
    PYTHONPATH=. python benchmarks/probes/locality_probe.py
"""
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import cupy as cp  # noqa: E402

import bench_decode as b  # noqa: E402

SRC = r"""
extern "C" __global__ void chunk_read(const uint4* __restrict__ x, const int* __restrict__ chunks,
    int chunks_per_cta, int seg_shift, int segs, int stride_words, unsigned* sink) {
  const int* my = chunks + blockIdx.x * chunks_per_cta;     // chunk bases in 16-byte words
  const int words = segs << seg_shift;                      // words per chunk
  const long long total = (long long)chunks_per_cta * words;
  uint4 acc = make_uint4(0, 0, 0, 0);
  for (long long v0 = threadIdx.x; v0 < total; v0 += U * blockDim.x) {
    uint4 r[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const long long v = v0 + u * blockDim.x;
      r[u] = make_uint4(0, 0, 0, 0);
      if (v < total) {
        const int c = v / words, w = v % words;
        r[u] = x[(long long)__ldg(my + c) + (long long)(w >> seg_shift) * stride_words + (w & ((1 << seg_shift) - 1))];
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) { acc.x ^= r[u].x; acc.y ^= r[u].y; acc.z ^= r[u].z; acc.w ^= r[u].w; }
  }
  if ((acc.x ^ acc.y ^ acc.z ^ acc.w) == 0x12345678u) sink[0] = 1;
}"""
KERNEL = cp.RawKernel(SRC, "chunk_read", options=("-DU=8",))


def chunk_lists(total_bytes, ctas, layout, rng):
    """(bases [ctas, n] in words, seg bytes, segs, stride bytes) for 8 kv heads, pages of 16 tokens x 256 B."""
    page = 16 * 8 * 256                                  # one page's K (or V) of all heads: 32 KB
    pages = total_bytes // page
    order = rng.permutation(pages)                       # random page order
    if layout == "nhd_head_rows":                        # CTA = (request, head): its pages' rows of one head
        reqs = ctas // 8
        per = pages // reqs
        bases = np.stack([order[r * per:(r + 1) * per] * page + h * 256
                          for r in range(reqs) for h in range(8)])
        return bases // 16, 256, 16, 2048
    if layout == "hnd_head_block":                       # HND: one head's 16 rows are 4 KB contiguous
        reqs = ctas // 8
        per = pages // reqs
        bases = np.stack([order[r * per:(r + 1) * per] * page + h * 4096
                          for r in range(reqs) for h in range(8)])
        return bases // 16, 4096, 1, 4096
    if layout.startswith("whole_"):                      # CTA = (request piece): whole chunks of kb KB
        kb = int(layout[6:])
        n = total_bytes // (kb << 10)
        per = n // ctas
        bases = rng.permutation(n)[:per * ctas].reshape(ctas, per) * (kb << 10)
        return bases // 16, kb << 10, 1, kb << 10
    if layout == "contiguous":
        per = total_bytes // ctas // 4096
        bases = (np.arange(ctas * per).reshape(ctas, per)) * 4096
        return bases // 16, 4096, 1, 4096
    raise ValueError(layout)


def main():
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    print(cp.cuda.runtime.getDeviceProperties(0)["name"].decode())
    read_tbs, _ = b.ceilings(20)
    sink = cp.zeros(1, cp.uint32)
    flush = b.l2_flush()
    big = cp.empty(2 << 30, cp.uint8)
    b.fill_random(big.view(cp.uint16), "float16", 3)
    rng = np.random.default_rng(0)
    print(f"read ceiling {read_tbs:.3f} TB/s; 128 CTAs x 1024 threads, 8 x 16 B loads in flight per thread")
    for mb in (134, 537, 2048):
        total = mb * (1 << 20) // (128 * 64 << 10) * (128 * 64 << 10)
        n = total // 16
        plain = min(b.time_events(lambda: k((sms * per_sm,), (t,), (big, np.int64(n), sink)), 30, flush)
                    for k in b._READ.values() for t, per_sm in ((1024, 2), (512, 4), (1024, 1)))
        print(f"{total / 1e6:7.0f} MB  plain read {plain:8.1f} µs {total / plain / 1e6:6.3f} TB/s")
        for layout in ("contiguous", "nhd_head_rows", "hnd_head_block", "whole_32", "whole_64"):
            bases, seg, segs, stride = chunk_lists(total, 128, layout, rng)
            chunks = cp.asarray(bases.astype(np.int32))
            args = (big, chunks, np.int32(bases.shape[1]), np.int32((seg // 16).bit_length() - 1), np.int32(segs),
                    np.int32(stride // 16), sink)
            us = b.time_events(lambda: KERNEL((128,), (1024,), args), 30, flush)
            print(f"{'':7}     {layout:15s} {us:8.1f} µs {total / us / 1e6:6.3f} TB/s  {100 * plain / us:5.1f}% of plain")


if __name__ == "__main__":
    main()
