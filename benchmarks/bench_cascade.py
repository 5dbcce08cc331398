"""Shared-prefix decode: MultiLevelCascadeAttentionWrapper against plain batch decode over the same
tokens, and FlashInfer's cascade wrapper when importable, all in this process.

Shapes (the cascade issue's): a 32768-token shared prefix, 128 requests with 256 unique tokens each
(2 levels), and a 3-level case (a 4096-token system prompt, 8 users x 16 requests with 8192-token
per-user prefixes, 256 unique each). 32:8 heads, head_dim 128, fp16, page 16, random page order.
Timing: CUDA events around each run() (every level's launch and the merges), 256 MB L2 read-flush
before every timed call, 5 warm-up + N timed, median. Floors: the bytes of every level's K and V read
once, at the read bandwidth measured in the run; and the FLOPs (4 x queries x heads x head_dim x keys
per level: QK^T and PV) at the fp16 tensor-core rate of a cuBLAS 8192^3 matmul measured in the run.
The level that attends the shared prefix is a multi-query prefill, so compute bound on that level.
Beside that (timed with the flush, host time included, as a serving step sees it): the call's GPU time
alone (bench_prefill.gpu_us: queued behind a matmul, so host submission is hidden), the same with PDL off,
its host time (bench_prefill.host_us), and the GPU time of each launch of one call queued behind the matmul
(events between the launches: the last level, then each other level and its merge).

    python benchmarks/bench_cascade.py [--reps 30] [--out results.json]
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import cupy as cp  # noqa: E402

import cuattn  # noqa: E402
from bench_decode import ceilings, fill_random, l2_flush, time_events  # noqa: E402
from bench_prefill import gpu_us, host_us  # noqa: E402

HQ, HKV, D, PS = 32, 8, 128, 16


def build(levels, rng):
    """levels: list of (query groups, kv length per group) -> per-level page tables, cache pages."""
    tables, next_page = [], 0
    for groups, lens in levels:
        pages = [-(-n // PS) for n in lens]
        ids = (next_page + rng.permutation(sum(pages))).astype(np.int32)
        indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
        last = np.array([n - (p - 1) * PS for n, p in zip(lens, pages)], np.int32)
        qo = np.concatenate([[0], np.cumsum(groups)]).astype(np.int32)
        tables.append((qo, indptr, ids, last))
        next_page += sum(pages)
    return tables, next_page


def flat_table(tables):
    """Plain decode's page table: each query's pages of every level, concatenated in level order."""
    num_q = int(tables[0][0][-1])
    per_q = [[] for _ in range(num_q)]
    last = np.zeros(num_q, np.int32)
    for qo, indptr, ids, lpl in tables:
        for g in range(len(qo) - 1):
            for i in range(qo[g], qo[g + 1]):
                per_q[i].append(ids[indptr[g]:indptr[g + 1]])
                last[i] = lpl[g]
    # -- every level but the last must fill its pages for the concatenation to be the same tokens
    indices = np.concatenate([np.concatenate(p) for p in per_q]).astype(np.int32)
    indptr = np.concatenate([[0], np.cumsum([sum(len(x) for x in p) for p in per_q])]).astype(np.int32)
    return indptr, indices, last


def matmul_tflops(reps: int) -> float:
    """The fp16 tensor-core ceiling: cuBLAS 8192^3 (2 n^3 FLOPs) through CuPy, median of ``reps``."""
    a = cp.empty((8192, 8192), cp.uint16)
    fill_random(a, "float16", 3)
    a = a.view(cp.float16)
    c = cp.empty_like(a)
    us = time_events(lambda: cp.matmul(a, a, out=c), reps)
    return 2 * 8192 ** 3 / (us * 1e-6) / 1e12


def launch_us(w, q, cache, out, reps: int = 10) -> list:
    """GPU µs of each launch of one cascade call (median over reps), queued behind a matmul: the last level's
    wrapper, then each other level and its merge, in run()'s order (run()'s body, with events between)."""
    from cuattn.multilevel import _merge_into
    from cuattn import arrays
    n = 6144
    a = cp.ones((n, n), cp.float16)
    lse = cp.empty((q.shape[0], q.shape[1]), cp.float32)
    ctx = arrays.context_of("bench", {"q": q}, None)
    rows = []
    for _ in range(reps):
        a @ a
        ev = [cp.cuda.Event()]
        ev[-1].record()
        w._levels[-1].run(q, cache, out=out, lse=lse)
        ev.append(cp.cuda.Event())
        ev[-1].record()
        for i, lv in enumerate(w._levels[:-1]):
            o_i, s_i = w._states[i][0][:w._rows], w._states[i][1][:w._rows]
            lv.run(q, cache, out=o_i, lse=s_i)
            ev.append(cp.cuda.Event())
            ev[-1].record()
            _merge_into(ctx, out, lse, o_i, s_i, "bench")
            ev.append(cp.cuda.Event())
            ev[-1].record()
        ev[-1].synchronize()
        rows.append([cp.cuda.get_elapsed_time(x, y) * 1e3 for x, y in zip(ev, ev[1:])])
    return [round(float(v), 1) for v in np.median(np.array(rows), axis=0)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out")
    args = ap.parse_args()
    dev = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    read_tbs, _ = ceilings(10)
    mma = matmul_tflops(10)
    print(f"# {dev}, cuattn {cuattn.__version__}, {datetime.date.today()}, read ceiling {read_tbs:.2f} TB/s, "
          f"fp16 matmul {mma:.0f} TFLOP/s")
    flush = l2_flush()
    cases = {
        "2-level 32768 + 128 x 256": [([128], [32768]), ([1] * 128, [256] * 128)],
        "3-level 4096 + 8 x 8192 + 128 x 256": [([128], [4096]), ([16] * 8, [8192] * 8), ([1] * 128, [256] * 128)],
    }
    try:
        import flashinfer
        import torch
    except ImportError:
        flashinfer = None
    rows = []
    for name, levels in cases.items():
        rng = np.random.default_rng(0)
        tables, num_pages = build(levels, rng)
        cache = cp.empty((num_pages, 2, PS, HKV, D), cp.uint16)
        fill_random(cache, "float16", 1)
        cache = cache.view(cp.float16)
        q = cp.empty((128, HQ, D), cp.uint16)
        fill_random(q, "float16", 2)
        q = q.view(cp.float16)
        w = cuattn.MultiLevelCascadeAttentionWrapper(len(levels))
        w.plan([t[0] for t in tables], [t[1] for t in tables], [t[2] for t in tables], [t[3] for t in tables],
               HQ, HKV, D, PS)
        out = cp.empty_like(q)
        cascade_us = time_events(lambda: w.run(q, cache, out=out), args.reps, flush)
        gpu_alone = gpu_us(lambda: w.run(q, cache, out=out), args.reps)
        gpu_alone_nopdl = gpu_us(lambda: w.run(q, cache, out=out, enable_pdl=False), args.reps)
        host = host_us(lambda: w.run(q, cache, out=out))
        launches = launch_us(w, q, cache, out)
        lse = cp.empty((128, HQ), cp.float32)
        level_us = [round(time_events(lambda lv=lv: lv.run(q, cache, out=out, lse=lse), args.reps, flush), 1)
                    for lv in w._levels]        # each level alone (the merges are the rest)
        indptr, indices, last = flat_table(tables)
        dw = cuattn.BatchDecodeWithPagedKVCacheWrapper()
        dw.plan(indptr, indices, last, HQ, HKV, D, PS)
        plain_us = time_events(lambda: dw.run(q, cache, out=out), args.reps, flush)
        # check: cascade equals plain decode over the same tokens
        a = cp.asnumpy(w.run(q, cache)).astype(np.float32)
        b = cp.asnumpy(dw.run(q, cache)).astype(np.float32)
        err = float(np.linalg.norm(a - b) / np.linalg.norm(b))
        kv_bytes = sum(sum(lens) for _, lens in levels) * HKV * D * 2 * 2
        flops = sum(4 * g * HQ * D * n for groups, lens in levels for g, n in zip(groups, lens))
        floor_us = max(kv_bytes / (read_tbs * 1e12), flops / (mma * 1e12)) * 1e6
        row = dict(case=name, cascade_us=round(cascade_us, 1), plain_decode_us=round(plain_us, 1),
                   kv_bytes_levels=kv_bytes, flops=flops, floor_us=round(floor_us, 1), rel_diff_vs_plain=err,
                   level_us=level_us, gpu_alone_us=round(gpu_alone, 1), gpu_alone_no_pdl_us=round(gpu_alone_nopdl, 1),
                   host_us=round(host, 1), launch_gpu_us=launches, plan=w.describe())
        if flashinfer is not None:
            fw = flashinfer.MultiLevelCascadeAttentionWrapper(
                len(levels), torch.empty(256 << 20, dtype=torch.uint8, device="cuda"), "NHD")
            tt = lambda x: torch.as_tensor(x, device="cuda")     # noqa: E731
            fw.plan([tt(t[0]) for t in tables], [tt(t[1]) for t in tables], [tt(t[2]) for t in tables],
                    [tt(t[3]) for t in tables], HQ, HKV, D, PS)
            tq, tc = torch.from_dlpack(q), torch.from_dlpack(cache)
            row["flashinfer_cascade_us"] = round(time_events(lambda: fw.run(tq, tc), args.reps, flush), 1)
        rows.append(row)
        print(w.describe())
        print(f"{name:<38} cascade {cascade_us:8.1f} us   plain decode {plain_us:8.1f} us   "
              f"floor {floor_us:6.1f} us   FlashInfer {row.get('flashinfer_cascade_us', '-')}   "
              f"|cascade - plain| / |plain| {err:.1e}   levels {level_us} us", flush=True)
        print(f"{'':<38} GPU alone {gpu_alone:.1f} us (PDL off {gpu_alone_nopdl:.1f}), host {host:.1f} us, "
              f"launches (last level, then level i, merge i) {launches} us", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(dict(device=dev, date=str(datetime.date.today()), read_tbs=read_tbs,
                                                  matmul_tflops=mma,
                                                  method=__doc__, rows=rows), indent=1))


if __name__ == "__main__":
    main()
