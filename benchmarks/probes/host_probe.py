"""Where the host time of a decode step goes: run() and plan() pieces, timed with perf_counter.

Each line is the median over 5 rounds of the mean of N back-to-back calls (no synchronization
inside a round: the GPU queue absorbs the launches). Prints a table; --out writes JSON.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import cupy as cp  # noqa: E402

import cuattn  # noqa: E402
from cuattn import arrays, jit, page, plan as cplan  # noqa: E402


def per_call_us(fn, n=300, rounds=5):
    fn()
    cp.cuda.Device().synchronize()
    means = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        means.append((time.perf_counter() - t0) / n * 1e6)
        cp.cuda.Device().synchronize()
    return statistics.median(means)


def page_table(batch, kv_len, page_size, seed):
    rng = np.random.default_rng(seed)
    per = -(-kv_len // page_size)
    indptr = np.arange(batch + 1, dtype=np.int32) * per
    indices = rng.permutation(batch * per).astype(np.int32)
    lpl = np.full(batch, kv_len - (per - 1) * page_size, np.int32)
    return indptr, indices, lpl


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = {}
    indptr, indices, lpl = page_table(1, 512, 16, 0)
    pages = int(indptr[-1])
    cache = cp.random.standard_normal((pages, 2, 16, 8, 128), dtype=cp.float32).astype(cp.float16)
    q = cp.random.standard_normal((1, 32, 128), dtype=cp.float32).astype(cp.float16)
    out = cp.empty_like(q)
    w = cuattn.BatchDecodeWithPagedKVCacheWrapper()
    w.plan(indptr, indices, lpl, 32, 8, 128, 16)
    fn = "probe"

    # -- floors: a ctypes call into the driver, and the decode kernel's own launch
    lib = ctypes.CDLL("libcuda.so.1")
    dev = ctypes.c_int()
    rows["ctypes cuCtxGetDevice"] = per_call_us(lambda: lib.cuCtxGetDevice(ctypes.byref(dev)))
    stream = cp.cuda.get_current_stream()
    qt = arrays.device_tensor(q, "q", fn)
    _, cache_args = w._kv_view(cache, fn)
    ot = arrays.device_tensor(out, "out", fn)
    rows["decode kernel launch only"] = per_call_us(
        lambda: w._launch(w._plan.launchers[0], qt.ptr, qt.strides, cache_args, ot.ptr, ot.strides, 0, stream, True,
                          w._plan.fixed_vargs))
    for pdl in (False, True):
        def launch_only(pdl=pdl):
            w._plan.launchers[0].configure(w._plan.grid, w._spec.threads, stream.ptr, pdl)
            w._plan.launchers[0].launch()
        rows[f"  cuLaunchKernelEx{', PDL' if pdl else ''} (ctypes, args packed)"] = per_call_us(launch_only)
    rows["run(cupy, out=)"] = per_call_us(lambda: w.run(q, cache, out=out))
    rows["run(cupy)"] = per_call_us(lambda: w.run(q, cache))
    # -- pieces of run()
    rows["  _operand(cupy q), layout checked"] = per_call_us(lambda: w._operand(q, "q", fn))
    rows["  pointer_layout(cupy)"] = per_call_us(lambda: arrays.pointer_layout(q))
    rows["  device_tensor(cupy q)"] = per_call_us(lambda: arrays.device_tensor(q, "q", fn))
    rows["  paged_kv_tensors(cupy)"] = per_call_us(lambda: page.paged_kv_tensors(cache, "NHD", fn))
    rows["  _kv_view(cupy), memoized"] = per_call_us(lambda: w._kv_view(cache, fn))
    rows["  is_device_array(cupy)"] = per_call_us(lambda: arrays.is_device_array(q))
    rows["  resolve_stream(cupy)"] = per_call_us(lambda: arrays.resolve_stream("cupy", 0))
    rows["  pdl_launch"] = per_call_us(lambda: jit.pdl_launch(0, None))
    rows["  cp.empty like q"] = per_call_us(lambda: cp.empty(q.shape, q.dtype))
    try:
        import torch
        tq = torch.from_dlpack(q)
        tc = torch.from_dlpack(cache)
        tout = torch.empty_like(tq)
        rows["run(torch, out=)"] = per_call_us(lambda: w.run(tq, tc, out=tout))
        rows["run(torch)"] = per_call_us(lambda: w.run(tq, tc))
        rows["  _operand(torch q), layout checked"] = per_call_us(lambda: w._operand(tq, "q", fn))
        rows["  pointer_layout(torch)"] = per_call_us(lambda: arrays.pointer_layout(tq))
        rows["  device_tensor(torch q)"] = per_call_us(lambda: arrays.device_tensor(tq, "q", fn))
        rows["  resolve_stream(torch)"] = per_call_us(lambda: arrays.resolve_stream("torch", 0))
        rows["  torch.cuda.current_stream()"] = per_call_us(lambda: torch.cuda.current_stream(0).cuda_stream)
        rows["  torch.empty like q"] = per_call_us(lambda: torch.empty_like(tq))
    except ImportError:
        pass

    # -- plan() for batch 256 x 2048 and its pieces
    pi, px, pl = page_table(256, 2048, 16, 1)
    rows["plan(256x2048, NumPy indices)"] = per_call_us(lambda: w.plan(pi, px, pl, 32, 8, 128, 16), n=30)
    dx = cp.asarray(px)
    rows["plan(256x2048, device indices)"] = per_call_us(lambda: w.plan(pi, dx, pl, 32, 8, 128, 16), n=30)
    host = w._bufs.staging(len(px) + 4096)
    dst = w._bufs.plan
    rows["  cudaMemcpy 128 KB pinned"] = per_call_us(
        lambda: cp.cuda.runtime.memcpy(dst.data.ptr, host.ctypes.data, len(px) * 4, 1), n=30)
    rows["  cudaMemcpy 8 KB pinned"] = per_call_us(
        lambda: cp.cuda.runtime.memcpy(dst.data.ptr, host.ctypes.data, 8192, 1), n=30)
    rows["  cudaMemcpyAsync 128 KB pinned"] = per_call_us(
        lambda: cp.cuda.runtime.memcpyAsync(dst.data.ptr, host.ctypes.data, len(px) * 4, 1, stream.ptr), n=30)
    kl = page.validate_page_table(fn, pi, pl, 16, len(px))
    rows["  validate_page_table"] = per_call_us(lambda: page.validate_page_table(fn, pi, pl, 16, len(px)), n=30)
    rows["  decode_work_list"] = per_call_us(lambda: cplan.decode_work_list(pi, kl, 0, 64), n=30)

    import cProfile
    import io
    import pstats
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(50):
        w.plan(pi, px, pl, 32, 8, 128, 16)
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(14)
    print(buf.getvalue()[-3500:])

    width = max(map(len, rows))
    print(f"\n{'host µs per call':<{width}}  µs")
    for k, v in rows.items():
        print(f"{k:<{width}}  {v:6.1f}")
    if args.out:
        Path(args.out).write_text(json.dumps(dict(device=cp.cuda.runtime.getDeviceProperties(0)["name"].decode(),
                                                  date=time.strftime("%Y-%m-%d"), host_us=rows), indent=1))


if __name__ == "__main__":
    main()
