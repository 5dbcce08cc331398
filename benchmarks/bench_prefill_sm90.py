"""Prefill on Hopper: cuattn's "fa3" backend (kernels_cu/prefill_sm90.cu, wgmma + TMA) against "fa2"
(kernels_cu/prefill.cu, mma.sync), same run, GPU-alone time (see bench_prefill.gpu_us).

Shapes: 1x1024, 1x4096, 1x16384 (single_prefill_with_kv_cache) and 8x2048 (BatchPrefillWithRaggedKVCacheWrapper),
qo_len = kv_len, 32:8 heads, head_dim 128, causal and not; fp16 (and bf16 for 1x16384).
Variants: fa3 = the shipped spec; fa3_noov = OVERLAP=0 (no softmax / P.V overlap).

    PYTHONPATH=. python benchmarks/bench_prefill_sm90.py --out results.json
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import platform

import cupy as cp
import numpy as np

import cuattn
from cuattn import prefill_sm90

HQ, HKV, D = 32, 8, 128
SHAPES = [(1, 1024), (1, 4096), (1, 16384), (8, 2048)]


def flops(batch, length, causal):
    f = 4.0 * batch * length * length * HQ * D
    return f / 2 if causal else f


def gpu_us(fn, reps, warmup=3):
    """Median GPU time of one call alone: a ~0.6 ms matmul queued first keeps the stream busy while
    the host issues the events and the call, so host time stays out of the measurement."""
    a = cp.ones((6144, 6144), cp.float16)
    for _ in range(warmup):
        fn()
    stream = cp.cuda.get_current_stream()
    times = []
    for _ in range(reps):
        a @ a
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        e0.record(stream)
        fn()
        e1.record(stream)
        e1.synchronize()
        times.append(cp.cuda.get_elapsed_time(e0, e1) * 1e3)
    return float(np.median(times))


def rand(shape, dtype):
    x = cp.random.standard_normal(shape, dtype=cp.float32)
    if dtype == "bfloat16":
        return (x.view(cp.uint32) >> 16).astype(cp.uint16)
    return x.astype(cp.float16)


def _as_float(x, dtype):
    return (x.astype(cp.uint32) << 16).view(cp.float32) if dtype == "bfloat16" else x.astype(cp.float32)


class _Fa3Variant:
    """Within the block, backend "fa3" launches ``overlap`` = False specs."""

    def __init__(self, overlap: bool):
        self.overlap, self.orig = overlap, prefill_sm90.make_spec

    def __enter__(self):
        prefill_sm90.make_spec = lambda t, c: dataclasses.replace(self.orig(t, c), overlap=self.overlap)

    def __exit__(self, *exc):
        prefill_sm90.make_spec = self.orig


def run_case(batch, length, causal, dtype, reps):
    q = rand((batch * length, HQ, D), dtype)
    k, v = rand((batch * length, HKV, D), dtype), rand((batch * length, HKV, D), dtype)
    row = dict(batch=batch, length=length, causal=causal, dtype=dtype)
    outs = {}
    for name, backend, overlap in (("fa2", "fa2", True), ("fa3", "fa3", True), ("fa3_noov", "fa3", False)):
        with _Fa3Variant(overlap):
            if batch == 1:
                fn = lambda: cuattn.single_prefill_with_kv_cache(q, k, v, causal=causal, backend=backend)  # noqa: E731
            else:
                w = cuattn.BatchPrefillWithRaggedKVCacheWrapper(backend=backend)
                indptr = np.arange(batch + 1, dtype=np.int32) * length
                w.plan(indptr, indptr, HQ, HKV, D, causal=causal, q_data_type=dtype)
                fn = lambda: w.run(q, k, v)  # noqa: E731
            try:
                outs[name] = _as_float(fn(), dtype)
                us = gpu_us(fn, reps)
            except Exception as e:      # report and go on: the other backend's number still counts
                row[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
                continue
        row[f"{name}_us"] = us
        row[f"{name}_tflops"] = flops(batch, length, causal) / (us * 1e-6) / 1e12
    for name in ("fa3", "fa3_noov"):
        if name in outs and "fa2" in outs:
            ref = outs["fa2"]
            row[f"{name}_vs_fa2_relerr"] = float(cp.linalg.norm(outs[name] - ref) / cp.linalg.norm(ref))
    return row


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", help="write the rows as JSON here")
    args = p.parse_args()
    dev = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    rows = []
    for batch, length in SHAPES:
        for causal in (False, True):
            rows.append(run_case(batch, length, causal, "float16", args.reps))
    for causal in (False, True):
        rows.append(run_case(1, 16384, causal, "bfloat16", args.reps))
    meta = dict(device=dev, date=datetime.date.today().isoformat(), cuattn=cuattn.__version__,
                python=platform.python_version(), heads=f"{HQ}:{HKV}", head_dim=D,
                timing="GPU-alone median (bench_prefill.gpu_us), qo_len = kv_len")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)
    print(f"{dev}: TFLOP/s (GPU-alone), 32:8 heads, hd128")
    print(f"{'shape':>10} {'causal':>6} {'dtype':>9} {'fa2':>7} {'fa3':>7} {'fa3_noov':>8} {'fa3/fa2':>7} {'err':>8}")
    for r in rows:
        t = {n: r.get(f"{n}_tflops", float("nan")) for n in ("fa2", "fa3", "fa3_noov")}
        print(f"{r['batch']}x{r['length']:>7} {str(r['causal']):>6} {r['dtype']:>9} {t['fa2']:7.1f} {t['fa3']:7.1f} "
              f"{t['fa3_noov']:8.1f} {t['fa3'] / t['fa2']:7.2f} {r.get('fa3_vs_fa2_relerr', float('nan')):8.1e}")
        for key in r:
            if key.endswith("_error"):
                print(f"   {key}: {r[key]}")


if __name__ == "__main__":
    main()
