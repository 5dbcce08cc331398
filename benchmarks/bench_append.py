"""Appending K/V into the paged cache (issue #22's last target: append into fp8 at >= 80% of the copy bandwidth at
64k tokens), next to FlashInfer's append_paged_kv_cache in the same process.

Cases: 65536 appended tokens as 16 requests x 4096 and as 64 x 1024 new tokens into empty requests (positions
from 0), 8 kv heads x head_dim 128, page 16, pages in random order, NHD; fp16 K/V into an fp16 cache, and into an
fp8 e4m3 cache (uint8 storage) with scalar scales and with per-kv-head scales. Bytes counted: the appended K and V
read (2 B an element) plus the cache rows written (the cache's element size); batch_indices / positions and the
page table are left out. "% copy": those bytes per second over a 1 GiB device-to-device copy (read + written)
measured in the run. Timing: CUDA events around one call, L2 read-flushed (256 MB) before each, 5 warm-up + --reps
timed calls, median. Every case's written cache is checked bit for bit against cuattn's NumPy path on the same
inputs first (the fp8 rounding: nearest even, saturating). Runs only where CuPy sees a GPU.

    python benchmarks/bench_append.py [--reps 30] [--no-flashinfer] [--out append.json]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import cupy as cp  # noqa: E402

import cuattn  # noqa: E402
from cuattn import arrays  # noqa: E402
from bench_decode import l2_flush, time_events  # noqa: E402
from bench_norm_act import copy_gbps, print_env  # noqa: E402

HKV, D, PS = 8, 128, 16


def case(batch: int, new: int, kv: str, per_head: bool, rng) -> dict:
    """The arrays of one append (device) and a function that runs it on given cache / scales."""
    nnz = batch * new
    pages = -(-new // PS)
    indptr = np.arange(batch + 1, dtype=np.int32) * pages
    indices = rng.permutation(batch * pages).astype(np.int32)
    last = np.full(batch, new - (pages - 1) * PS, np.int32)
    append_indptr = np.arange(batch + 1, dtype=np.int32) * new
    k = (rng.standard_normal((nnz, HKV, D)) * 3).astype(np.float16)
    v = (rng.standard_normal((nnz, HKV, D)) * 3).astype(np.float16)
    bi, pos = cuattn.get_batch_indices_positions(append_indptr, np.full(batch, new, np.int32), nnz)
    shape = (batch * pages, 2, PS, HKV, D)
    ks = vs = None
    if kv == "e4m3":
        ks, vs = (np.linspace(0.01, 0.02, HKV).astype(np.float32), np.linspace(0.02, 0.03, HKV).astype(np.float32)
                  ) if per_head else (0.015, 0.025)
    return dict(nnz=nnz, host=(k, v, bi, pos, indices, indptr, last), shape=shape, kv=kv, scales=(ks, vs),
                cache_dtype=np.uint8 if kv == "e4m3" else np.float16)


def run(c: dict, operands: tuple, cache, scales):
    k, v, bi, pos, indices, indptr, last = operands
    extra = {} if c["kv"] != "e4m3" else dict(k_scale=scales[0], v_scale=scales[1], kv_data_type="float8_e4m3fn")
    cuattn.append_paged_kv_cache(k, v, bi, pos, cache, indices, indptr, last, **extra)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--no-flashinfer", action="store_true")
    p.add_argument("--out")
    args = p.parse_args(argv)
    if not arrays.gpu_available():
        sys.exit("bench_append: no CUDA GPU visible to CuPy; this benchmark runs only on a GPU")
    fi = torch = None
    if not args.no_flashinfer:
        try:
            import flashinfer as fi
            import torch
        except ImportError as e:
            print(f"FlashInfer not timed: {e}")
    env = print_env(fi is not None)
    copy = copy_gbps(10)
    flush = l2_flush("read")
    print(f"copy ceiling {copy:.0f} GB/s (1 GiB device-to-device, read + written); L2 read-flushed before each call")
    rng = np.random.default_rng(22)
    rows = []
    for batch, new in ((16, 4096), (64, 1024)):
        for kv, per_head in (("f16", False), ("e4m3", False), ("e4m3", True)):
            c = case(batch, new, kv, per_head, rng)
            host = c["host"]
            dev = tuple(cp.asarray(x) for x in host)
            ks, vs = c["scales"]
            dscales = tuple(cp.asarray(s) if isinstance(s, np.ndarray) else s for s in (ks, vs))
            cache = cp.zeros(c["shape"], c["cache_dtype"])
            ref = np.zeros(c["shape"], c["cache_dtype"])
            run(c, host, ref, (ks, vs))                                # the NumPy path
            run(c, dev, cache, dscales)
            exact = bool(np.array_equal(cp.asnumpy(cache), ref))
            us = time_events(lambda: run(c, dev, cache, dscales), args.reps, flush)
            nbytes = c["nnz"] * HKV * D * 2 * (2 + np.dtype(c["cache_dtype"]).itemsize)
            row = dict(case=f"{batch}x{new}", kv=kv + (" per-head scales" if per_head else ""), tokens=c["nnz"],
                       us=round(us, 2), gbps=round(nbytes / us / 1e3, 1), of_copy=round(nbytes / us / 1e3 / copy, 3),
                       bitwise_vs_numpy=exact)
            if fi is not None and kv == "f16":
                tt = lambda x: torch.as_tensor(x, device="cuda")       # noqa: E731
                tk, tv, tbi, tpos, tind, tptr, tlast = (tt(x) for x in dev)
                tcache = torch.as_tensor(cp.zeros(c["shape"], np.float16), device="cuda")
                try:
                    fcall = lambda: fi.append_paged_kv_cache(tk, tv, tbi, tpos, tcache, tind, tptr, tlast, "NHD")  # noqa: E731
                    fcall()
                    row["flashinfer_us"] = round(time_events(fcall, args.reps, flush), 2)
                except Exception as e:  # noqa: BLE001 - report and go on
                    row["flashinfer_error"] = f"{type(e).__name__}: {e}"[:200]
            rows.append(row)
            fi_col = (f"FlashInfer {row['flashinfer_us']:8.2f} us (x{row['flashinfer_us'] / us:.2f})"
                      if "flashinfer_us" in row else row.get("flashinfer_error", ""))
            print(f"{row['case']:>9} {row['kv']:<22} {us:8.2f} us {row['gbps']:7.1f} GB/s {100 * row['of_copy']:5.1f}% copy"
                  f"  bitwise vs NumPy: {exact}  {fi_col}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(dict(env=env, copy_gbps=copy, rows=rows), indent=1))


if __name__ == "__main__":
    main()
