"""The scheduler's and the graph mode's costs, per the cascade/scheduler issue's targets.

1. plan() host time at batch 256 for every wrapper (decode 256 x 2048; paged and ragged prefill of
   256 requests x 64 new tokens over 2048 keys; a 2-level cascade of 256 requests over a 32k prefix):
   median over 40 plans after 10 warm-up plans, time.perf_counter around the call.
2. Host time of a captured step's replay per kernel: one CUDA graph holding 32 layers' run() of a
   decode step at batch 64 x 2048 (and of a paged prefill step of 8 x 512 new tokens), replayed
   after a plan(); host µs per graph.launch() / the run()s it holds (a decode run() is one kernel,
   a prefill run() in graph mode two: attention and the split-KV merge).
3. Skewed decode 1 x 32768 + 63 x 512 (32:8 heads, head_dim 128, fp16, page 16): CUDA events, L2
   read-flushed before each call, median; K/V bytes read / time against the read ceiling measured
   in the run, with what describe() says the scheduler did.

    python benchmarks/bench_scheduler.py [--reps 30] [--out results.json]
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import cupy as cp  # noqa: E402

import cuattn  # noqa: E402
from bench_decode import ceilings, fill_random, l2_flush, page_table, time_events  # noqa: E402

HQ, HKV, D, PS = 32, 8, 128, 16


def rand(shape, seed):
    x = cp.empty(shape, cp.uint16)
    fill_random(x, "float16", seed)
    return x.view(cp.float16)


def plan_host_us(plan, n=40):
    times = []
    for i in range(10 + n):
        t0 = time.perf_counter()
        plan()
        times.append((time.perf_counter() - t0) * 1e6)
    cp.cuda.Device().synchronize()
    return statistics.median(times[10:])


def plan_costs() -> dict:
    batch, kv = 256, 2048
    indptr, indices, lpl = page_table(batch, kv, PS, 1)
    qo = (np.arange(batch + 1) * 64).astype(np.int32)
    kv_indptr = (np.arange(batch + 1) * kv).astype(np.int32)
    d = cuattn.BatchDecodeWithPagedKVCacheWrapper()
    p = cuattn.BatchPrefillWithPagedKVCacheWrapper()
    r = cuattn.BatchPrefillWithRaggedKVCacheWrapper()
    c = cuattn.MultiLevelCascadeAttentionWrapper(2)
    prefix = np.arange(2048, dtype=np.int32)          # 32768 shared tokens in 2048 pages
    c_tables = ([np.array([0, batch], np.int32), np.arange(batch + 1, dtype=np.int32)],
                [np.array([0, 2048], np.int32), indptr], [prefix, indices + 2048],
                [np.array([16], np.int32), lpl])
    return {
        "decode 256 x 2048": plan_host_us(lambda: d.plan(indptr, indices, lpl, HQ, HKV, D, PS)),
        "paged prefill 256 x (64 new / 2048)": plan_host_us(
            lambda: p.plan(qo, indptr, indices, lpl, HQ, HKV, D, PS, causal=True)),
        "ragged prefill 256 x (64 / 2048)": plan_host_us(lambda: r.plan(qo, kv_indptr, HQ, HKV, D, causal=True)),
        "cascade 2-level 32k + 256 x 2048": plan_host_us(lambda: c.plan(*c_tables, HQ, HKV, D, PS)),
    }


def replay_host_us(plan, run, layers=32):
    """Host µs per graph.launch() of ``layers`` run()s captured in one graph."""
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        plan()
        run()
        stream.begin_capture()
        for _ in range(layers):
            run()
        graph = stream.end_capture()
        graph.launch(stream)
        stream.synchronize()
        times = []
        for _ in range(30):
            plan()
            t0 = time.perf_counter()
            graph.launch(stream)
            times.append((time.perf_counter() - t0) * 1e6)
            stream.synchronize()
    return statistics.median(times)


def replay_costs() -> dict:
    rows = {}
    indptr, indices, lpl = page_table(64, 2048, PS, 2)
    cache, q = rand((len(indices), 2, PS, HKV, D), 3), rand((64, HQ, D), 4)
    out = cp.empty_like(q)
    d = cuattn.BatchDecodeWithPagedKVCacheWrapper(use_cuda_graph=True)
    us = replay_host_us(lambda: d.plan(indptr, indices, lpl, HQ, HKV, D, PS), lambda: d.run(q, cache, out=out))
    rows["decode 64 x 2048, 32 layers"] = dict(launch_us=round(us, 1), runs=32, kernels=32)
    pi, px, pl = page_table(8, 2048, PS, 5)
    qo = (np.arange(9) * 512).astype(np.int32)
    cache2, q2 = rand((len(px), 2, PS, HKV, D), 6), rand((8 * 512, HQ, D), 7)
    out2 = cp.empty_like(q2)
    p = cuattn.BatchPrefillWithPagedKVCacheWrapper(use_cuda_graph=True)
    us = replay_host_us(lambda: p.plan(qo, pi, px, pl, HQ, HKV, D, PS, causal=True),
                        lambda: p.run(q2, cache2, out=out2))
    rows["paged prefill 8 x (512 / 2048), 32 layers"] = dict(launch_us=round(us, 1), runs=32, kernels=64,
                                                             plan=p.describe())
    return rows


def skewed(read_tbs, reps) -> dict:
    lens = [32768] + [512] * 63
    pages = [-(-n // PS) for n in lens]
    indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
    indices = np.random.default_rng(8).permutation(int(indptr[-1])).astype(np.int32)
    lpl = np.array([n - (p - 1) * PS for n, p in zip(lens, pages)], np.int32)
    cache, q = rand((len(indices), 2, PS, HKV, D), 9), rand((64, HQ, D), 10)
    out = cp.empty_like(q)
    w = cuattn.BatchDecodeWithPagedKVCacheWrapper()
    w.plan(indptr, indices, lpl, HQ, HKV, D, PS)
    us = time_events(lambda: w.run(q, cache, out=out), reps, l2_flush())
    nbytes = sum(lens) * HKV * D * 2 * 2
    return dict(us=round(us, 1), tbs=round(nbytes / (us * 1e-6) / 1e12, 3),
                of_read_ceiling=round(nbytes / (us * 1e-6) / 1e12 / read_tbs, 3), plan=w.describe())


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out")
    args = ap.parse_args()
    dev = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    read_tbs, _ = ceilings(10)
    print(f"# {dev}, cuattn {cuattn.__version__}, {datetime.date.today()}, read ceiling {read_tbs:.2f} TB/s")
    plans = plan_costs()
    for k, v in plans.items():
        print(f"plan() {k:<40} {v:7.1f} us")
    replays = replay_costs()
    for k, v in replays.items():
        print(f"graph replay {k:<40} {v['launch_us']:7.1f} us per launch ({v['launch_us'] / v['runs']:.2f} us per "
              f"run(), {v['launch_us'] / v['kernels']:.2f} us per kernel)")
    sk = skewed(read_tbs, args.reps)
    print(f"skewed decode 1 x 32768 + 63 x 512: {sk['us']} us, {sk['tbs']} TB/s = {sk['of_read_ceiling']:.0%} of read")
    print(sk["plan"])
    if args.out:
        Path(args.out).write_text(json.dumps(dict(device=dev, date=str(datetime.date.today()), read_tbs=read_tbs,
                                                  method=__doc__, plan_host_us=plans, graph_replay=replays,
                                                  skewed_decode=sk), indent=1))


if __name__ == "__main__":
    main()
