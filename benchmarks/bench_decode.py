"""Batch decode on the paged KV cache: latency and achieved bandwidth.

Timing: CUDA events around each run() (the decode kernel plus the split-KV merge when the plan
splits), L2 flushed before every timed call (default: 256 MB read, leaving L2 clean; --flush
write rewrites it, PEERS.md's method, whose dirty lines the timed kernel then writes back:
~9 µs of a 134 MB shape), 5 warm-up + N timed calls (default 30), median reported. FlashInfer,
when importable, is timed the same way in the same process: its CUDA-core (default) and
tensor-core decode kernels, the faster one compared. Ceilings are measured in the same process: read-only
bandwidth (16-byte loads, 2 GiB) and device-to-device copy (1 GiB, bytes read + written).
TB/s = 1e12 bytes/s over the K, V, q and o bytes.
--fp8 e4m3|e5m2 (default e4m3; none: off) adds fp8 columns to every variant: the same shape over
an fp8 cache (random finite bytes, k_scale = v_scale = 0.5), its µs, fp16 µs / fp8 µs, % of the read
ceiling counted on the fp8 bytes, and FlashInfer's fp8 decode (when importable) timed the same way. Host µs = wall time of eager run() calls with
out= given, averaged over 200 back-to-back calls of the bs 1 x 512 shape (not synced per call).
--stream also times run() back to back over R copies of the cache (>= 256 MB in all, so L2
holds none of the next one), as a serving loop runs one layer after another: a spinning kernel
holds the GPU while the host queues 16+ calls, events bracket the calls, µs per call = elapsed /
calls (launch gaps and, with PDL, each kernel's start-up overlap the previous kernel's tail).

    python benchmarks/bench_decode.py [--batch 1 16 64 256] [--kv-len 512 2048 8192 32768]
        [--heads 32:8 32:32] [--dtype float16|bfloat16] [--fp8 e4m3|e5m2|none] [--reps 30] [--check]
        [--out results.json]
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import cupy as cp  # noqa: E402

import cuattn  # noqa: E402
from cuattn import jit  # noqa: E402

# FlashInfer 0.6.4 from shared/PEERS.md (not measured in this run): µs, best of its cc/tc kernels
PEERS_H200 = {("32:8", 1, 512): 12.4, ("32:8", 1, 32768): 44.3, ("32:8", 16, 2048): 45.2,
              ("32:8", 16, 32768): 493, ("32:8", 64, 8192): 495, ("32:8", 256, 512): 149,
              ("32:8", 256, 32768): 7727, ("32:32", 1, 512): 11.3, ("32:32", 1, 32768): 132,
              ("32:32", 16, 2048): 128, ("32:32", 64, 32768): 7678, ("32:32", 256, 8192): 7653}
PEERS_H100 = {("32:8", 1, 512): 13.2, ("32:8", 1, 32768): 58.6, ("32:8", 16, 2048): 57.6,
              ("32:8", 16, 32768): 722, ("32:8", 64, 8192): 720, ("32:8", 256, 512): 195,
              ("32:8", 256, 32768): 11240, ("32:32", 1, 512): 12.3, ("32:32", 1, 32768): 188,
              ("32:32", 16, 2048): 183, ("32:32", 64, 32768): 11250, ("32:32", 256, 8192): 11200}

_READ_SOURCE = r"""
// Read n 16-byte words, U independent loads in flight per thread per step (a one-wave grid).
// LOAD: * (a plain load) or __ldcs (evict-first in L2: never for the L2 flush, whose lines must
// push the timed kernel's lines out of L2).
extern "C" __global__ void read_only(const uint4* __restrict__ x, long long n, unsigned* sink) {
  const long long stride = (long long)gridDim.x * blockDim.x;
  long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
  uint4 acc = make_uint4(0, 0, 0, 0);
  for (; i + (U - 1) * stride < n; i += U * stride) {
    uint4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) v[u] = LOAD(x + i + u * stride);
#pragma unroll
    for (int u = 0; u < U; ++u) { acc.x ^= v[u].x; acc.y ^= v[u].y; acc.z ^= v[u].z; acc.w ^= v[u].w; }
  }
  for (; i < n; i += stride) { uint4 v = x[i]; acc.x ^= v.x; acc.y ^= v.y; acc.z ^= v.z; acc.w ^= v.w; }
  if ((acc.x ^ acc.y ^ acc.z ^ acc.w) == 0x12345678u) sink[0] = 1;
}"""
_READ = {(u, load): cp.RawKernel(_READ_SOURCE, "read_only", options=(f"-DU={u}", f"-DLOAD={load}"))
         for u in (4, 8) for load in ("*", "__ldcs")}

_FILL = cp.ElementwiseKernel("uint64 seed", "uint16 y", """
  unsigned long long z = (i + seed) * 0x9E3779B97F4A7C15ull;
  z ^= z >> 31; z *= 0xBF58476D1CE4E5B9ull; z ^= z >> 29;
  float u = (float)(z & 0xffffff) / 16777216.0f * 2.0f - 1.0f;   // uniform [-1, 1)
  unsigned short h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(u));
  y = h;
""", "fill_rand_f16")
_FILL_BF16 = cp.ElementwiseKernel("uint64 seed", "uint16 y", """
  unsigned long long z = (i + seed) * 0x9E3779B97F4A7C15ull;
  z ^= z >> 31; z *= 0xBF58476D1CE4E5B9ull; z ^= z >> 29;
  float u = (float)(z & 0xffffff) / 16777216.0f * 2.0f - 1.0f;
  y = (unsigned short)(__float_as_uint(u) >> 16);
""", "fill_rand_bf16")


_FILL_FP8 = cp.ElementwiseKernel("uint64 seed, int32 e5m2", "uint8 y", """
  unsigned long long z = (i + seed) * 0x9E3779B97F4A7C15ull;
  z ^= z >> 31; z *= 0xBF58476D1CE4E5B9ull; z ^= z >> 29;
  unsigned b = (unsigned)(z >> 24) & 0xff;
  // finite values only: e4m3 0x7f / 0xff are NaN; e5m2 exponent 11111 is inf / NaN; smaller magnitudes
  if (e5m2) { if ((b & 0x7c) == 0x7c) b &= 0xbf; } else { if ((b & 0x7f) == 0x7f) b ^= 1; }
  y = (unsigned char)b;
""", "fill_rand_fp8")


def fill_random(x, dtype, seed):
    (_FILL_BF16 if dtype == "bfloat16" else _FILL)(np.uint64(seed * 0x1000003), x.view(cp.uint16))


_SPIN = cp.RawKernel(r"""
extern "C" __global__ void spin(long long cycles) {
  const long long t0 = clock64();
  while (clock64() - t0 < cycles) {}
}""", "spin")


def time_back_to_back(calls, reps, spin_cycles=6_000_000):
    """Median over reps of µs per call when ``calls`` run back to back on the null stream
    (~3.5 ms of spin lets the host queue them all first, so host launch cost does not gap them)."""
    for c in calls:
        c()
    start, end = cp.cuda.Event(), cp.cuda.Event()
    times = []
    for _ in range(reps):
        _SPIN((1,), (1,), (np.int64(spin_cycles),))
        start.record()
        for c in calls:
            c()
        end.record()
        end.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, end) * 1e3 / len(calls))
    return statistics.median(times)


def rotated_copies(cache, min_bytes=256 << 20, max_bytes=4 << 30, min_calls=16):
    """(copies of cache, order of calls over them) for time_back_to_back, or None if too big."""
    if cache.nbytes * 2 > max_bytes:
        return None
    n = max(2, -(-min_bytes // cache.nbytes))
    copies = [cache] + [cache.copy() for _ in range(n - 1)]
    return copies, [copies[i % n] for i in range(n * -(-min_calls // n))]


def time_events(fn, reps, flush=None, warmup=5):
    for _ in range(warmup):
        fn()
    start, end = cp.cuda.Event(), cp.cuda.Event()
    times = []
    for _ in range(reps):
        if flush is not None:
            flush()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, end) * 1e3)   # µs
    return statistics.median(times)


def l2_flush(kind="read"):
    """A call that empties L2 of what a timed call would find there: read 256 MB with plain loads
    (leaves L2 clean), or rewrite them ("write": dirty lines the timed call must write back)."""
    buf = cp.empty(256 << 20, cp.uint8)
    buf.fill(1)
    if kind == "write":
        return lambda: buf.fill(1)
    sink = cp.zeros(1, cp.uint32)
    grid, n = cp.cuda.Device().attributes["MultiProcessorCount"] * 4, np.int64(buf.nbytes // 16)
    return lambda: _READ[4, "*"]((grid,), (512,), (buf, n, sink))


def ceilings(reps):
    n = (2 << 30) // 16
    x = cp.empty(n * 16, cp.uint8)
    fill_random(x.view(cp.uint16), "float16", 1)
    sink = cp.zeros(1, cp.uint32)
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    # the best of a few shapes of the read kernel: a ceiling the decode kernel beats is no ceiling.
    # H100, 2026-11-22: 2 x 1024 threads per SM with __ldcs read 3.08-3.11 TB/s (PEERS.md: 3.11),
    # 4 x 512 3.04-3.07, and the single grid used until then (8 x 512 plain loads, 2 waves)
    # 3.04-3.06, below the decode kernel's own 3.09 at batch 256
    read_us = min(time_events(lambda: kernel((sms * per_sm,), (threads,), (x, np.int64(n), sink)), reps)
                  for kernel in _READ.values() for threads, per_sm in ((1024, 2), (512, 4)))
    read_tbs = x.nbytes / (read_us * 1e-6) / 1e12
    src, dst = x[:1 << 30], x[1 << 30:]
    copy_us = time_events(lambda: cp.cuda.runtime.memcpyAsync(
        dst.data.ptr, src.data.ptr, src.nbytes, cp.cuda.runtime.memcpyDeviceToDevice,
        cp.cuda.get_current_stream().ptr), reps)
    copy_tbs = 2 * src.nbytes / (copy_us * 1e-6) / 1e12
    x = src = dst = None
    return read_tbs, copy_tbs


def decode_bytes(batch, kv_len, hq, hkv, d, itemsize):
    kv = 2 * batch * kv_len * hkv * d * itemsize     # K and V, each read once
    qo = 2 * batch * hq * d * itemsize               # q read, o written
    return kv + qo


def page_table(batch, kv_len, page_size, seed):
    pages_per_req = -(-kv_len // page_size)
    rng = np.random.default_rng(seed)
    indices = rng.permutation(batch * pages_per_req).astype(np.int32)       # random page order
    indptr = (np.arange(batch + 1) * pages_per_req).astype(np.int32)
    lpl = np.full(batch, kv_len - (pages_per_req - 1) * page_size, np.int32)
    return indptr, indices, lpl


def setup_case(batch, kv_len, hq, hkv, d, page_size, dtype, seed):
    indptr, indices, lpl = page_table(batch, kv_len, page_size, seed)
    num_pages = len(indices)
    cache = cp.empty((num_pages, 2, page_size, hkv, d), cp.uint16)
    fill_random(cache, dtype, seed)
    q = cp.empty((batch, hq, d), cp.uint16)
    fill_random(q, dtype, seed + 7)
    if dtype == "float16":
        cache, q = cache.view(cp.float16), q.view(cp.float16)
    return indptr, indices, lpl, cache, q


def check_case(w, q, cache, indptr, indices, lpl, dtype, n_req=2):
    """Compare the first requests against a float64 dense attention on the host."""
    from tests.oracle import dense_attention, rel_err
    import ml_dtypes
    dt = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(np.float16)
    out = cp.asnumpy(w.run(q, cache)).view(dt)
    qh = cp.asnumpy(q).view(dt)
    errs = []
    for b in range(min(n_req, len(lpl))):
        idx = cp.asarray(indices[indptr[b]:indptr[b + 1]])
        kv = cp.asnumpy(cache[idx]).view(dt)          # [pages, 2, ps, hkv, d]
        n = (len(idx) - 1) * kv.shape[2] + int(lpl[b])
        k = kv[:, 0].reshape(-1, *kv.shape[3:])[:n]
        v = kv[:, 1].reshape(-1, *kv.shape[3:])[:n]
        ref, _ = dense_attention(qh[b:b + 1], k, v)
        errs.append(rel_err(out[b:b + 1], ref))
    return max(errs)


FP8_DTYPE = {"e4m3": "float8_e4m3fn", "e5m2": "float8_e5m2"}


def check_case_fp8(w, q, cache8, indptr, indices, lpl, args, n_req=2):
    """The fp8 run (scales 0.5) of the first requests against a float64 dense attention over the
    fp8 values times the scales."""
    from tests.oracle import dense_attention, rel_err
    import ml_dtypes
    dt = np.dtype(ml_dtypes.bfloat16) if args.dtype == "bfloat16" else np.dtype(np.float16)
    f8 = np.dtype(getattr(ml_dtypes, FP8_DTYPE[args.fp8]))
    out = cp.asnumpy(w.run(q, cache8, k_scale=0.5, v_scale=0.5)).view(dt)
    qh = cp.asnumpy(q).view(dt)
    errs = []
    for b in range(min(n_req, len(lpl))):
        idx = cp.asarray(indices[indptr[b]:indptr[b + 1]])
        kv = cp.asnumpy(cache8[idx]).view(f8).astype(np.float64) * 0.5     # [pages, 2, ps, hkv, d]
        n = (len(idx) - 1) * kv.shape[2] + int(lpl[b])
        k = kv[:, 0].reshape(-1, *kv.shape[3:])[:n]
        v = kv[:, 1].reshape(-1, *kv.shape[3:])[:n]
        ref, _ = dense_attention(qh[b:b + 1].astype(np.float64), k, v)
        errs.append(rel_err(out[b:b + 1].astype(np.float64), ref))
    return max(errs)


def flashinfer_fp8_us(args, batch, kv_len, hq, hkv, indptr, indices, lpl, cache8, q, reps, flush):
    """µs of FlashInfer's faster fp8 decode (CUDA-core or tensor-core) over the same fp8 cache, or None
    when it refuses the configuration."""
    import flashinfer
    import torch
    tdt = torch.float16 if args.dtype == "float16" else torch.bfloat16
    t8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}[args.fp8]
    ws = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
    tq = torch.from_dlpack(q.view(cp.uint16)).view(tdt)
    tc = torch.from_dlpack(cache8).view(t8)
    times = []
    for tensor_cores in (False, True):
        try:
            w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=tensor_cores)
            w.plan(torch.from_numpy(indptr), torch.from_numpy(indices).cuda(), torch.from_numpy(lpl),
                   hq, hkv, args.head_dim, args.page_size, q_data_type=tdt, kv_data_type=t8)
            times.append(time_events(lambda: w.run(tq, tc, k_scale=0.5, v_scale=0.5), reps, flush))
        except Exception as e:    # noqa: BLE001 - a peer's refusal is reported, not fatal
            print(f"FlashInfer fp8 (tensor_cores={tensor_cores}) failed: {type(e).__name__}: {e}"[:300], flush=True)
    return min(times) if times else None


def flashinfer_us(batch, kv_len, hq, hkv, d, page_size, dtype, indptr, indices, lpl, cache, q, reps, flush,
                  rotation=None):
    """(isolated µs, back-to-back µs or None) of FlashInfer's faster kernel (CUDA-core or tensor-core,
    each picked separately), its default PDL launch, or None if it is not importable."""
    try:
        import flashinfer
        import torch
    except ImportError:
        return None
    tdt = torch.float16 if dtype == "float16" else torch.bfloat16
    ws = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
    tq = torch.from_dlpack(q.view(cp.uint16)).view(tdt)
    as_torch = lambda c: torch.from_dlpack(c.view(cp.uint16)).view(tdt)  # noqa: E731
    tc = as_torch(cache)
    tout = torch.empty_like(tq)
    iso, stream = [], []
    for tensor_cores in (False, True):
        w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=tensor_cores)
        w.plan(torch.from_numpy(indptr), torch.from_numpy(indices).cuda(), torch.from_numpy(lpl),
               hq, hkv, d, page_size, q_data_type=tdt, kv_data_type=tdt)
        iso.append(time_events(lambda: w.run(tq, tc), reps, flush))
        if rotation is not None:
            calls = [lambda c=as_torch(c): w.run(tq, c, out=tout) for c in rotation[1]]
            stream.append(time_back_to_back(calls, reps))
    return min(iso), (min(stream) if stream else None)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--kv-len", type=int, nargs="+", default=[512, 2048, 8192, 32768])
    ap.add_argument("--heads", nargs="+", default=["32:8", "32:32"])
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    ap.add_argument("--fp8", default="e4m3", choices=["e4m3", "e5m2", "none"],
                    help="also time the shipped kernel over an fp8 cache of each shape (and FlashInfer's fp8)")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--max-gb", type=float, default=36.0, help="skip shapes whose cache exceeds this")
    ap.add_argument("--check", action="store_true", help="check 2 requests per shape against float64")
    ap.add_argument("--stages", type=int, default=0, help="cp.async depth experiment (0: shipped default)")
    ap.add_argument("--variants", nargs="+", default=["shipped"],
                    help="kernel variants to time on every shape: 'shipped', or '+'-joined tweaks of it: "
                         "sepmerge (split-KV merged by the separate merge kernel), nosplit, chunkN (plan pieces "
                         "of N tokens), sN (N cp.async stages), wN (N warps per CTA), pfN (cp.async L2 prefetch hint of "
                         "N bytes), tma / notma (force the TMA kernel on or off), nopdl (run(enable_pdl=False)); "
                         "e.g. w8+s3+sepmerge. "
                         "(regidx, lazy, --prefetch and the bulk / warpbulk / qreg load-path variants were "
                         "removed on 2026-11-22: decode_notes.md)")
    ap.add_argument("--flush", default="read", choices=["write", "read"],
                    help="L2 flush before each timed call: rewrite 256 MB (leaves L2 full of dirty lines "
                         "that the kernel's reads must write back; PEERS.md method) or read 256 MB (clean L2)")
    ap.add_argument("--stream", action="store_true",
                    help="also time back-to-back runs over rotated cache copies (shapes whose cache is <= 2 GB)")
    ap.add_argument("--profile-host", default=None, help="write a cProfile of run()/plan() host time here")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/decode_<gpu>_<date>.json)")
    args = ap.parse_args()
    reps = max(args.reps, 20)

    dev = cp.cuda.Device()
    props = cp.cuda.runtime.getDeviceProperties(dev.id)
    gpu = props["name"].decode()
    env = {"gpu": gpu, "sms": dev.attributes["MultiProcessorCount"], "cupy": cp.__version__,
           "cuda_runtime": cp.cuda.runtime.runtimeGetVersion(), "nvrtc": "%d.%d" % jit.nvrtc_version(),
           "cuattn": cuattn.__version__, "python": platform.python_version(),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    print(" ".join(f"{k}={v}" for k, v in env.items()), flush=True)
    read_tbs, copy_tbs = ceilings(reps)
    print(f"ceilings: read-only {read_tbs:.3f} TB/s, copy {copy_tbs:.3f} TB/s (measured now)", flush=True)
    flush = l2_flush(args.flush)
    print(f"L2 flush before each timed call: {args.flush} 256 MB", flush=True)
    # what the method itself costs: an empty kernel (one thread) timed the same way
    empty_us = time_events(lambda: _SPIN((1,), (1,), (np.int64(0),)), reps, flush)
    print(f"an empty kernel timed the same way (flush, events around it): {empty_us:.1f} us", flush=True)
    peers = {}
    try:
        import flashinfer  # noqa: F401
        have_fi = True
    except ImportError:
        have_fi = False
        peers = PEERS_H200 if "H200" in gpu else PEERS_H100 if "H100" in gpu else {}
        print(f"FlashInfer not importable: 'FI us' is FlashInfer 0.6.4 on "
              f"{'H200' if 'H200' in gpu else 'H100'} from PEERS.md, NOT measured in this run")

    rows = []
    vw = max(len(v) for v in args.variants)
    hdr = (f"{'variant':>{vw}} {'heads':>6} {'batch':>5} {'kv_len':>6} {'us':>9} {'TB/s':>6} {'%read':>6} {'%copy':>6} "
           f"{'split':>5} {'FI us':>8} {'FI/us':>6}"
           + (f" {'b2b us':>8} {'%read':>6} {'FI b2b':>8}" if args.stream else "")
           + (f" {'fp8 us':>8} {'x16':>5} {'%rd8':>6} {'FI fp8':>8} {'FI8/us':>6}" if args.fp8 != "none" else "")
           + f"{'  err' if args.check else ''}")
    print(hdr, flush=True)
    itemsize = 2
    for heads in args.heads:
        hq, hkv = map(int, heads.split(":"))
        for batch in args.batch:
            for kv_len in args.kv_len:
                gb = 2 * batch * kv_len * hkv * args.head_dim * itemsize / 1e9
                if gb > args.max_gb:
                    print(f"{heads:>6} {batch:>5} {kv_len:>6}  skipped: cache {gb:.0f} GB > --max-gb", flush=True)
                    continue
                indptr, indices, lpl, cache, q = setup_case(batch, kv_len, hq, hkv, args.head_dim,
                                                            args.page_size, args.dtype, seed=batch + kv_len)
                rotation = rotated_copies(cache) if args.stream else None
                fi = (flashinfer_us(batch, kv_len, hq, hkv, args.head_dim, args.page_size, args.dtype, indptr,
                                    indices, lpl, cache, q, reps, flush, rotation) if have_fi else
                      (peers.get((heads, batch, kv_len)), None))
                cache8 = None
                if args.fp8 != "none":
                    cache8 = cp.empty(cache.shape, cp.uint8)
                    _FILL_FP8(np.uint64(batch + kv_len), np.int32(args.fp8 == "e5m2"), cache8)
                    fi8 = flashinfer_fp8_us(args, batch, kv_len, hq, hkv, indptr, indices, lpl, cache8, q, reps,
                                            flush) if have_fi else None
                for variant in args.variants:
                    fp8_case = (cache8, fi8) if cache8 is not None else None
                    rows.append(time_case(args, variant, vw, heads, batch, kv_len, hq, hkv, indptr, indices,
                                          lpl, cache, q, reps, flush, read_tbs, copy_tbs, fi, have_fi, rotation,
                                          fp8_case))
                cache = q = rotation = cache8 = None
                cp.get_default_memory_pool().free_all_blocks()
    return finish(args, env, read_tbs, copy_tbs, rows, reps, empty_us)


def time_case(args, variant, vw, heads, batch, kv_len, hq, hkv, indptr, indices, lpl, cache, q, reps, flush,
              read_tbs, copy_tbs, fi, have_fi, rotation, fp8_case=None):
    fi, fi_stream = fi if fi is not None else (None, None)
    tweaks = set(variant.split("+")) - {"shipped"}
    plan_kw, spec_kw = {}, {}
    for t in list(tweaks):
        if t == "nosplit":
            plan_kw["disable_split_kv"] = True
        elif t.startswith("chunk") and t[5:].isdigit():
            plan_kw["fixed_split_size"] = int(t[5:])
        elif t.startswith("pf") and t[2:].isdigit():
            spec_kw["pf"] = int(t[2:])
        elif t[:1] in "sw" and t[1:].isdigit():
            spec_kw[t[0]] = int(t[1:])
        else:
            continue
        tweaks.discard(t)
    unknown = tweaks - {"sepmerge", "tma", "notma", "nopdl"}
    if unknown:
        raise SystemExit(f"unknown variant tweak(s) {sorted(unknown)}")
    w = cuattn.BatchDecodeWithPagedKVCacheWrapper(kv_layout="NHD")
    w._tuning = dict(num_stages=spec_kw.get("s", args.stages), num_warps=spec_kw.get("w", 0),   # 0: plan's
                     fuse_merge="sepmerge" not in tweaks,   # choice; benchmark overrides, not API
                     l2_prefetch=spec_kw.get("pf", 128),
                     tma=True if "tma" in tweaks else False if "notma" in tweaks else None)
    t0 = time.perf_counter()
    w.plan(indptr, indices, lpl, hq, hkv, args.head_dim, args.page_size, q_data_type=args.dtype, **plan_kw)
    plan_us = (time.perf_counter() - t0) * 1e6
    out = cp.empty_like(q)
    pdl = False if "nopdl" in tweaks else None
    run = lambda: w.run(q, cache, out=out, enable_pdl=pdl)  # noqa: E731
    us = time_events(run, reps, flush)
    nbytes = decode_bytes(batch, kv_len, hq, hkv, args.head_dim, 2)
    tbs = nbytes / (us * 1e-6) / 1e12
    stream_us = None
    if rotation is not None:
        stream_us = time_back_to_back([lambda c=c: w.run(q, c, out=out, enable_pdl=pdl) for c in rotation[1]], reps)
    err = check_case(w, q, cache, indptr, indices, lpl, args.dtype) if args.check else None
    fp8_row, fp8_s = {}, ""
    if fp8_case is not None:
        cache8, fi8 = fp8_case
        w8 = cuattn.BatchDecodeWithPagedKVCacheWrapper(kv_layout="NHD")
        w8._tuning = dict(w._tuning)
        w8.plan(indptr, indices, lpl, hq, hkv, args.head_dim, args.page_size, q_data_type=args.dtype,
                kv_data_type=FP8_DTYPE[args.fp8], **plan_kw)
        us8 = time_events(lambda: w8.run(q, cache8, out=out, k_scale=0.5, v_scale=0.5, enable_pdl=pdl), reps, flush)
        bytes8 = 2 * batch * kv_len * hkv * args.head_dim * 1 + 2 * batch * hq * args.head_dim * 2   # fp8 K/V, 16-bit q/o
        err8 = check_case_fp8(w8, q, cache8, indptr, indices, lpl, args) if args.check else None
        fp8_row = dict(fp8=args.fp8, fp8_us=us8, fp8_speedup=us / us8, fp8_of_read=bytes8 / (us8 * 1e-6) / 1e12 / read_tbs,
                       fp8_spec=w8._spec.name, flashinfer_fp8_us=fi8, fp8_rel_err=err8)
        fp8_s = (f" {us8:8.1f} {us / us8:5.2f} {100 * fp8_row['fp8_of_read']:5.1f}%"
                 + (f" {fi8:8.1f} {fi8 / us8:6.2f}" if fi8 else f" {'-':>8} {'-':>6}")
                 + (f"  err8 {err8:.1e}" if err8 is not None else ""))
        w8 = None
    row = dict(variant=variant, spec=w._spec.name, flush=args.flush, heads=heads, batch=batch, kv_len=kv_len, us=us,
               tbs=tbs, of_read=tbs / read_tbs,
               of_copy=tbs / copy_tbs, split=bool(w._work.split), n_work=len(w._work.work),
               plan_us=plan_us, flashinfer_us=fi, flashinfer_measured=have_fi, rel_err=err,
               b2b_us=stream_us, b2b_of_read=nbytes / (stream_us * 1e-6) / 1e12 / read_tbs if stream_us else None,
               flashinfer_b2b_us=fi_stream, **fp8_row)
    fi_s = f"{fi:8.1f} {fi / us:6.2f}" if fi else f"{'-':>8} {'-':>6}"
    if args.stream:
        fi_s += (f" {stream_us:8.1f} {100 * row['b2b_of_read']:5.1f}%" if stream_us else f" {'-':>8} {'-':>6}")
        fi_s += f" {fi_stream:8.1f}" if fi_stream else f" {'-':>8}"
    print(f"{variant:>{vw}} {heads:>6} {batch:>5} {kv_len:>6} {us:9.1f} {tbs:6.3f} "
          f"{100 * tbs / read_tbs:5.1f}% "
          f"{100 * tbs / copy_tbs:5.1f}% {str(row['split'])[0]:>5} {fi_s}{fp8_s}"
          f"{f'  {err:.1e}' if err is not None else ''}  {w._spec.name}", flush=True)
    out = w = None
    return row


def host_us_per_call(call, synchronize, n_calls=200):
    """Host µs per call over n_calls back-to-back calls (not synced per call; the GPU queue absorbs them)."""
    call()
    synchronize()
    t0 = time.perf_counter()
    for _ in range(n_calls):
        call()
    us = (time.perf_counter() - t0) / n_calls * 1e6
    synchronize()
    return us


def plan_us_each(args, n=40):
    """Host µs of each of n plan() calls for batch 256 x 2048 on a fresh wrapper, after 10 warm-up
    plans (the first plans run 2-5x slower: H100 VM 488, 220, 154 µs, ...)."""
    w = cuattn.BatchDecodeWithPagedKVCacheWrapper(kv_layout="NHD")
    pi, px, pl = page_table(256, 2048, args.page_size, 2)
    times = []
    for i in range(10 + n):
        t0 = time.perf_counter()
        w.plan(pi, px, pl, 32, 8, args.head_dim, args.page_size, q_data_type=args.dtype)
        times.append((time.perf_counter() - t0) * 1e6)
    return times[10:]


def finish(args, env, read_tbs, copy_tbs, rows, reps, empty_us):
    # -- host cost: eager run() with out= given (bs 1 x 512, 32:8), plan() for batch 256
    indptr, indices, lpl, cache, q = setup_case(1, 512, 32, 8, args.head_dim, args.page_size, args.dtype, 1)
    w = cuattn.BatchDecodeWithPagedKVCacheWrapper(kv_layout="NHD")
    w.plan(indptr, indices, lpl, 32, 8, args.head_dim, args.page_size, q_data_type=args.dtype)
    out = cp.empty_like(q)
    host = {}
    plan_before = plan_us_each(args)      # again after the run() timings (FlashInfer's among them)
    host["cupy"] = host_us_per_call(lambda: w.run(q, cache, out=out), cp.cuda.Device().synchronize)
    try:
        import torch
        tdt = torch.float16 if args.dtype == "float16" else torch.bfloat16
        tq = torch.from_dlpack(q.view(cp.uint16)).view(tdt)
        tc = torch.from_dlpack(cache.view(cp.uint16)).view(tdt)
        tout = torch.empty_like(tq)
        host["torch"] = host_us_per_call(lambda: w.run(tq, tc, out=tout), torch.cuda.synchronize)
        try:
            import flashinfer
            fw = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                torch.empty(128 << 20, dtype=torch.uint8, device="cuda"), "NHD")
            fw.plan(torch.from_numpy(indptr), torch.from_numpy(indices).cuda(), torch.from_numpy(lpl),
                    32, 8, args.head_dim, args.page_size, q_data_type=tdt, kv_data_type=tdt)
            host["flashinfer"] = host_us_per_call(lambda: fw.run(tq, tc, out=tout), torch.cuda.synchronize)
        except ImportError:
            pass
    except ImportError:
        pass
    plan_times = plan_us_each(args)
    host["plan_batch256_us"] = statistics.median(plan_times)
    host["plan_batch256_each_us"] = [round(t, 1) for t in plan_times]
    host["plan_batch256_before_peers_us"] = statistics.median(plan_before)
    if args.profile_host:
        import cProfile
        import io
        import pstats
        pi, px, pl = page_table(256, 2048, args.page_size, 2)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(20):
            w.plan(pi, px, pl, 32, 8, args.head_dim, args.page_size, q_data_type=args.dtype)
        w.plan(indptr, indices, lpl, 32, 8, args.head_dim, args.page_size, q_data_type=args.dtype)
        for _ in range(300):
            w.run(q, cache, out=out)
        prof.disable()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
        Path(args.profile_host).write_text(buf.getvalue())
    cp.cuda.Device().synchronize()
    print("host µs per eager run() (bs1x512, out= given): " + ", ".join(
        f"{k} {v:.1f}" for k, v in host.items() if not k.startswith("plan_"))
          + f"; plan() batch 256 x 2048: median {host['plan_batch256_before_peers_us']:.0f} µs before the run() "
          f"timings, {host['plan_batch256_us']:.0f} µs after, each "
          + " ".join(f"{t:.0f}" for t in plan_times))

    result = dict(env=env, ceilings=dict(read_only_tbs=read_tbs, copy_tbs=copy_tbs, empty_kernel_us=empty_us),
                  dtype=args.dtype, head_dim=args.head_dim, page_size=args.page_size, reps=reps, timing=__doc__.split("\n\n")[1],
                  rows=rows, host_us=host)
    path = Path(args.out) if args.out else (Path(__file__).parent / "results" /
                                            f"decode_{env['gpu'].replace(' ', '_')}_{env['date'][:10]}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
