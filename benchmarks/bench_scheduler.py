"""The scheduler's and the graph mode's costs, per the cascade/scheduler issue's targets.

1. plan() host time at batch 256 for every wrapper (decode 256 x 2048; MLA decode (128 heads, page 64)
   over the same lengths; paged and ragged prefill of 256 requests x 64 new tokens over 2048 keys; a
   2-level cascade of 256 requests over a 32k prefix; each again with request lengths drawn from
   1024-4096 keys; and a 3-level cascade: the 32k prefix, 16 groups of 16 requests x 1024 keys, the requests' own;
   the cascades' shared levels repeat, as a serving loop's prefix does, and keep their plans; the "moving" rows
   take their shared levels' page ids in another order every other plan, which plans them again):
   median over 40 plans after 10 warm-up
   plans, time.perf_counter around the call.
2. Host time of a captured step's replay per kernel: one CUDA graph holding 32 layers' run() of a
   decode step at batch 64 x 2048 (and of a paged prefill step of 8 x 512 new tokens), replayed
   after a plan(); host µs per graph.launch() / the run()s it holds (a decode run() is one kernel,
   a prefill run() in graph mode two: attention and the split-KV merge).
3. Skewed decode 1 x 32768 + 63 x 512 (32:8 heads, head_dim 128, fp16, page 16): CUDA events, L2
   read-flushed before each call, median; K/V bytes read / time against the read ceiling measured
   in the run, with what describe() says the scheduler did.
4. ``--host-only`` (no GPU needed): plan() host time alone, the cases of 1., on a stubbed CuPy (``FakeCupy``: the device
   calls -- pinned allocation, the async copy, events, device arrays -- are no-ops, everything else
   plan() does runs as on a GPU host, with the device taken to be an sm_90a of 132 SMs). Median over
   200 plans after 20 warm-up plans (``--rounds N``: the best of N such medians, the cases taken in turn N
   times: a shared machine's load moves single medians by 1.5x), and the CUDA runtime calls one plan() makes
   (FakeCupy counts them); ``--profile`` adds a cProfile of each case.
5. ``--dump-plans PATH`` (no GPU needed): every upload's bytes and address, every pointer, describe() and
   error of 1200 random plans on the stubbed device, as JSON: the same file from two versions of cuattn
   means the same plans (decode, paged, ragged, 2-level cascade, MLA; eager and graph mode; the
   scheduler's, a fixed or no split; now and then a bad argument or array).

    python benchmarks/bench_scheduler.py [--reps 30] [--out results.json]
    python benchmarks/bench_scheduler.py --host-only [--rounds 5] [--profile] [--out results.json]
    python benchmarks/bench_scheduler.py --dump-plans plans.json [--num-plans 300]
"""
from __future__ import annotations

import argparse
import datetime
import itertools
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


def plan_host_us(plan, n=40, warmup=10, sync=True):
    times = []
    for i in range(warmup + n):
        t0 = time.perf_counter()
        plan()
        times.append((time.perf_counter() - t0) * 1e6)
    if sync:
        cp.cuda.Device().synchronize()
    return statistics.median(times[warmup:])


def varied_table(batch, lo, hi, page_size, seed):
    """A page table of ``batch`` requests of lo..hi keys (uniform), pages in random order."""
    rng = np.random.default_rng(seed)
    lens = rng.integers(lo, hi + 1, batch)
    pages = -(-lens // page_size)
    indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
    indices = rng.permutation(int(indptr[-1])).astype(np.int32)
    lpl = (lens - (pages - 1) * page_size).astype(np.int32)
    return indptr, indices, lpl, lens


def plan_cases(batch=256, kv=2048, varied=False) -> dict:
    """name -> a plan() call of each wrapper at ``batch`` (uniform ``kv`` keys, or 1024-4096 when ``varied``)."""
    if varied:
        indptr, indices, lpl, lens = varied_table(batch, 1024, 4096, PS, 1)
        kv_indptr = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        tag = "1-4k"
    else:
        indptr, indices, lpl = page_table(batch, kv, PS, 1)
        kv_indptr = (np.arange(batch + 1) * kv).astype(np.int32)
        tag = str(kv)
    qo = (np.arange(batch + 1) * 64).astype(np.int32)
    d = cuattn.BatchDecodeWithPagedKVCacheWrapper()
    p = cuattn.BatchPrefillWithPagedKVCacheWrapper()
    r = cuattn.BatchPrefillWithRaggedKVCacheWrapper()
    c = cuattn.MultiLevelCascadeAttentionWrapper(2)
    prefix = np.arange(2048, dtype=np.int32)          # 32768 shared tokens in 2048 pages
    c_tables = ([np.array([0, batch], np.int32), np.arange(batch + 1, dtype=np.int32)],
                [np.array([0, 2048], np.int32), indptr], [prefix, indices + 2048],
                [np.array([16], np.int32), lpl])
    c3 = cuattn.MultiLevelCascadeAttentionWrapper(3)   # + a middle level: 16 groups of batch / 16 requests x 1024 keys
    g = np.arange(0, batch + 1, batch // 16, dtype=np.int32)
    c3_tables = ([c_tables[0][0], g, c_tables[0][1]], [c_tables[1][0], np.arange(17, dtype=np.int32) * 64, indptr],
                 [prefix, np.arange(1024, dtype=np.int32) + 2048 + len(indices), indices + 2048],
                 [c_tables[3][0], np.full(16, 16, np.int32), lpl])
    # -- the same cascades with their shared levels' page ids in another order every other plan (a shared level
    #    whose values change is planned again; one whose values repeat, as above, keeps its plan)
    c_moved, c3_moved = cuattn.MultiLevelCascadeAttentionWrapper(2), cuattn.MultiLevelCascadeAttentionWrapper(3)
    moved = itertools.cycle([c_tables, (c_tables[0], c_tables[1], [prefix[::-1].copy(), c_tables[2][1]], c_tables[3])])
    moved3 = itertools.cycle([c3_tables, (c3_tables[0], c3_tables[1], [prefix[::-1].copy(), c3_tables[2][1][::-1].copy(),
                                                                       c3_tables[2][2]], c3_tables[3])])
    m = cuattn.BatchMLAPagedAttentionWrapper()
    m_lens = np.diff(kv_indptr)           # MLA (DeepSeek: 128 heads, page 64), one query per request (decode)
    m_indptr = np.concatenate([[0], np.cumsum(-(-m_lens // 64))]).astype(np.int32)
    m_ids = np.random.default_rng(2).permutation(int(m_indptr[-1])).astype(np.int32)
    m_args = (np.arange(batch + 1, dtype=np.int32), m_indptr, m_ids, m_lens.astype(np.int32), 128, 512, 64, 64, False,
              0.1, "float16", "float16")
    return {
        f"decode {batch} x {tag}": lambda: d.plan(indptr, indices, lpl, HQ, HKV, D, PS),
        f"mla decode {batch} x {tag}": lambda: m.plan(*m_args),
        f"paged prefill {batch} x (64 new / {tag})": lambda: p.plan(qo, indptr, indices, lpl, HQ, HKV, D, PS,
                                                                    causal=True),
        f"ragged prefill {batch} x (64 / {tag})": lambda: r.plan(qo, kv_indptr, HQ, HKV, D, causal=True),
        f"cascade 2-level 32k + {batch} x {tag}": lambda: c.plan(*c_tables, HQ, HKV, D, PS),
        f"cascade 3-level 32k + 16 x 1k + {batch} x {tag}": lambda: c3.plan(*c3_tables, HQ, HKV, D, PS),
        **({} if varied else {
            f"cascade 2-level 32k moving + {batch} x {tag}": lambda: c_moved.plan(*next(moved), HQ, HKV, D, PS),
            f"cascade 3-level, shared moving, {batch} x {tag}": lambda: c3_moved.plan(*next(moved3), HQ, HKV, D, PS)}),
    }


def plan_costs() -> dict:
    return {k: plan_host_us(f) for k, f in {**plan_cases(), **plan_cases(varied=True)}.items()}


class FakeCupy:
    """Just enough of CuPy for plan() on a machine without a GPU (``--host-only``): device calls are no-ops,
    each counted in ``calls`` by the CUDA runtime call it stands for (a Device context's enter and exit:
    getDevice / setDevice; an Event: create, record, query (``done``), synchronize; the async copy; a pinned or
    device allocation). The current-stream lookup (no CUDA call in CuPy) is counted as ``stream``. Device
    arrays get distinct fake addresses, in allocation order; ``uploads`` (when a list) receives every
    host-to-device copy as (dst, nbytes, bytes)."""

    def __init__(self):
        import collections
        import types
        calls = self.calls = collections.Counter()
        self.uploads = None
        fake = self
        self._next = [1 << 32]

        class Ptr:
            def __init__(self, ptr):
                self.ptr = ptr

        class DevArray:
            def __init__(self, n, dtype):
                calls["alloc"] += 1
                self.shape = tuple(n) if isinstance(n, tuple) else (int(n),)
                self.size = int(np.prod(self.shape))
                nbytes = self.size * np.dtype(dtype).itemsize
                self.data = Ptr(fake._next[0])
                fake._next[0] += -(-max(nbytes, 1) // 4096) * 4096 + 4096

        class Stream:
            ptr = 0

        class Event:
            def __init__(self, *a, **k):
                calls["event_create"] += 1

            @property
            def done(self):
                calls["event_query"] += 1
                return True

            def record(self, stream=None):
                calls["event_record"] += 1

            def synchronize(self):
                calls["event_sync"] += 1

        class Device:
            compute_capability = "90"
            attributes = {"MultiProcessorCount": 132}

            def __init__(self, device=0):
                pass

            def __enter__(self):
                calls["device_enter"] += 1
                return self

            def __exit__(self, *a):
                calls["device_exit"] += 1
                return False

        class Runtime:
            memcpyDeviceToDevice = 3

            @staticmethod
            def getDevice():
                calls["getDevice"] += 1
                return 0

            @staticmethod
            def getDeviceCount():
                calls["getDeviceCount"] += 1
                return 1

            @staticmethod
            def streamIsCapturing(ptr):
                calls["streamIsCapturing"] += 1
                return 0

            @staticmethod
            def memcpyAsync(dst, src, nbytes, kind, stream):
                calls["memcpyAsync"] += 1
                if fake.uploads is not None and kind == 1:
                    import ctypes
                    fake.uploads.append((dst, nbytes, ctypes.string_at(src, nbytes)))

        def current_stream(device=None):
            calls["stream"] += 1
            return Stream()

        def pinned(nbytes):
            calls["alloc_pinned"] += 1
            return bytearray(nbytes)

        self._DevArray = DevArray
        self.cuda = types.SimpleNamespace(
            runtime=Runtime, Device=Device, Event=Event, Stream=Stream, ExternalStream=Stream,
            get_current_stream=current_stream, alloc_pinned_memory=pinned)

    def empty(self, n, dtype):
        return self._DevArray(n, dtype)

    def device_calls(self) -> int:
        """CUDA runtime calls counted so far (the stream lookup is none)."""
        return sum(v for k, v in self.calls.items() if k != "stream")


def stub_device() -> FakeCupy:
    """Route cuattn's device calls to FakeCupy (this process only): ``--host-only``."""
    from cuattn import arrays, decode, jit, plan
    fake = FakeCupy()
    arrays.cupy_module = lambda: fake
    arrays.gpu_available = lambda: True
    plan.num_sms = lambda device: 132
    if hasattr(decode, "_num_sms"):
        decode._num_sms = lambda device: 132
    jit.get_launcher = lambda *a, **k: None
    return fake


def host_only(args) -> dict:
    fake = stub_device()
    rows = {}
    cases = {**plan_cases(), **plan_cases(varied=True)}
    best = {name: float("inf") for name in cases}
    for _ in range(max(args.rounds, 1)):          # the cases in turn, each round: the best median of each
        for name, f in cases.items():
            best[name] = min(best[name], plan_host_us(f, n=200, warmup=20, sync=False))
    for name, f in cases.items():
        fake.calls.clear()
        f()
        calls = dict(sorted(fake.calls.items()))
        rows[name] = dict(us=round(best[name], 1), device_calls=fake.device_calls(), calls=calls)
        print(f"plan() host {name:<45} {best[name]:7.1f} us  {fake.device_calls():3d} device calls  "
              + " ".join(f"{k}={v}" for k, v in calls.items()))
        if args.profile:
            import cProfile
            import pstats
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(200):
                f()
            pr.disable()
            pstats.Stats(pr).sort_stats("tottime").print_stats(18)
    return rows


def _random_table(rng, batch, page_size, lo, hi):
    lens = rng.integers(lo, hi + 1, batch)
    pages = -(-lens // page_size)
    indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
    indices = rng.permutation(int(indptr[-1]) + int(rng.integers(0, 50))).astype(np.int32)[:int(indptr[-1])]
    lpl = np.where(pages > 0, lens - (pages - 1) * page_size, 0).astype(np.int32)
    return indptr, indices, lpl, lens


def random_plans(n: int, seed: int = 0):
    """(name, wrapper, [plan() calls]) of ``n`` random wrappers (decode, paged, ragged, 2-level cascade, MLA;
    eager or graph mode; the scheduler's, a fixed or no split), each planned 4 times with mostly the same
    configuration (the memos' hits) and now and then another one or a bad argument (their misses and errors)."""
    rng = np.random.default_rng(seed)
    for i in range(n):
        kind = ["decode", "paged", "ragged", "cascade", "mla"][i % 5]
        graph = bool(rng.integers(0, 2))
        split = rng.choice(["auto", "auto", "fixed", "disable"])
        hq, hkv = [(32, 8), (8, 8), (16, 2), (4, 1)][int(rng.integers(0, 4))]
        d = [64, 128][int(rng.integers(0, 2))] if kind != "mla" else 576
        ps = [16, 1, 32][int(rng.integers(0, 3))] if kind != "mla" else [1, 64][int(rng.integers(0, 2))]
        dtype = ["float16", "bfloat16"][int(rng.integers(0, 2))]
        causal = bool(rng.integers(0, 2))
        sk = dict(fixed_split_size=int(rng.integers(1, 5000))) if split == "fixed" else \
            dict(disable_split_kv=True) if split == "disable" else {}
        w = {"decode": lambda: cuattn.BatchDecodeWithPagedKVCacheWrapper(use_cuda_graph=graph),
             "paged": lambda: cuattn.BatchPrefillWithPagedKVCacheWrapper(use_cuda_graph=graph),
             "ragged": lambda: cuattn.BatchPrefillWithRaggedKVCacheWrapper(use_cuda_graph=graph),
             "cascade": lambda: cuattn.MultiLevelCascadeAttentionWrapper(2, use_cuda_graph=graph),
             "mla": lambda: cuattn.BatchMLAPagedAttentionWrapper(use_cuda_graph=graph)}[kind]()
        calls = []
        for j in range(4):
            b = int(rng.integers(1, 300)) if j == 0 or not graph else int(rng.integers(1, 150))
            hi = int(rng.choice([64, 2048, 40000]))
            lo = int(rng.integers(0 if kind == "ragged" else 1, hi))
            cfg_dtype = dtype if rng.random() > 0.15 else ("bfloat16" if dtype == "float16" else "float16")
            cfg_causal = causal if rng.random() > 0.15 else not causal
            bad = rng.random() < 0.06
            indptr, indices, lpl, lens = _random_table(rng, b, ps, max(lo, 1) if kind != "ragged" else lo, hi)
            qo_lens = rng.integers(1 if kind != "ragged" else 0, int(rng.choice([2, 17, 200])), b)
            if cfg_causal:
                qo_lens = np.minimum(qo_lens, np.maximum(lens, 1))
            corrupt = rng.random() < 0.08 and not bad      # a bad array: a negative page id, qo_indptr or
            if corrupt:                                     # lengths that decrease, a batch mismatch
                what = int(rng.integers(0, 4))
                if what == 0 and len(indices):
                    indices = indices.copy()
                    indices[int(rng.integers(0, len(indices)))] = -3
                elif what == 1 and b > 1:
                    qo_lens = qo_lens.copy()
                    qo_lens[0] = -1
                elif what == 2:
                    lens = lens.copy()
                    lens[-1] += ps
                else:
                    lpl = lpl[:-1]
            qo = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
            mask = None
            if kind in ("paged", "ragged") and rng.random() < 0.1 and int((qo_lens * lens).sum()) < 200000:
                mask = rng.random(int((qo_lens * lens).sum())) < 0.5
            if kind == "decode":
                f = (lambda a=(indptr, indices, lpl), h=(hq, hkv, d, ps), k=dict(q_data_type=cfg_dtype, **sk):
                     w.plan(*a, *h, **k))
                if bad:
                    f = (lambda a=(indptr, indices, lpl): w.plan(*a, hq, 3, d, ps))
            elif kind == "paged":
                f = (lambda a=(qo, indptr, indices, lpl), h=(hq, hkv, d, ps),
                     k=dict(q_data_type=cfg_dtype, causal=cfg_causal, custom_mask=mask, **sk): w.plan(*a, *h, **k))
                if bad:
                    f = (lambda a=(qo, indptr, indices, lpl): w.plan(*a, hq, hkv, d, ps, q_data_type="float32"))
            elif kind == "ragged":
                kv_indptr = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
                f = (lambda a=(qo, kv_indptr), h=(hq, hkv, d),
                     k=dict(q_data_type=cfg_dtype, causal=cfg_causal, custom_mask=mask, **sk): w.plan(*a, *h, **k))
                if bad:
                    f = (lambda a=(qo, kv_indptr): w.plan(*a, hq, hkv, 96))
            elif kind == "cascade":
                prefix = int(rng.choice([1, 100, 2048]))
                shared = [np.array([0, int(qo[-1])], np.int32), np.array([0, prefix], np.int32),
                          rng.permutation(prefix).astype(np.int32) + int(indices.max(initial=0)) + 1,
                          np.array([int(rng.integers(1, ps + 1))], np.int32)]
                uq = qo if rng.random() < 0.5 else None
                if uq is None:      # a decode step: one query per request
                    uq = np.arange(b + 1, dtype=np.int32)
                    shared[0] = np.array([0, b], np.int32)
                tables = ([shared[0], uq], [shared[1], indptr], [shared[2], indices], [shared[3], lpl])
                f = (lambda t=tables, h=(hq, hkv, d, ps), k=dict(q_data_type=cfg_dtype, causal=cfg_causal, **sk):
                     w.plan(*t, *h, **k))
                if bad:
                    f = (lambda t=tables: w.plan(*t, hq, hkv, d, ps, window_left=5))
            else:
                kvi = np.concatenate([[0], np.cumsum(-(-lens // ps))]).astype(np.int32)
                ids = rng.permutation(int(kvi[-1])).astype(np.int32)
                f = (lambda a=(qo, kvi, ids, lens.astype(np.int32)), k=dict(causal=cfg_causal, **sk), dt=cfg_dtype:
                     w.plan(*a, hq, 512, 64, ps, sm_scale=0.1, q_data_type=dt, kv_data_type=dt, **k))
                if bad:
                    f = (lambda a=(qo, kvi, ids, lens.astype(np.int32)): w.plan(*a, 0, 512, 64, ps, False, 0.1,
                                                                               dtype, dtype))
            calls.append(f)
        yield f"{i} {kind} graph={graph} split={split}", w, calls


def dump_plans(path: str, n: int) -> None:
    """Every upload's bytes and address, every describe() and error of ``random_plans`` (device stubbed),
    as JSON: the same file from two versions of cuattn means the same plans (``--dump-plans``)."""
    import hashlib
    fake = stub_device()
    out = []
    for name, w, calls in random_plans(n):
        for j, f in enumerate(calls):
            fake.uploads = []
            try:
                f()
                err = None
            except Exception as e:        # noqa: BLE001 (recorded: the same errors on both sides)
                err = f"{type(e).__name__}: {e}"
            p = getattr(w, "_plan", None)
            levels = [lv._plan for lv in w._levels if lv is not None] if hasattr(w, "_levels") else [p]
            rec = dict(name=f"{name} #{j}", error=err, describe=w.describe(),
                       uploads=[(dst, nb, hashlib.sha1(data).hexdigest()) for dst, nb, data in fake.uploads],
                       plans=[None if q is None else dict(
                           meta=q.meta, grid=[q.grid_work, q.grid_merge], backend=q.backend,
                           spec=getattr(q.run_spec, "name", None), why=q.split_why, device=q.device,
                           kernel_args=repr(q.kernel_args), grids=[q.grid, q.merge_grid]) for q in levels])
            out.append(rec)
    Path(path).write_text(json.dumps(out, indent=0, default=str))
    print(f"{len(out)} plans ({sum(r['error'] is not None for r in out)} errors) -> {path}")


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
    ap.add_argument("--host-only", action="store_true", help="plan() host time on a stubbed device (no GPU)")
    ap.add_argument("--profile", action="store_true", help="with --host-only: cProfile each case")
    ap.add_argument("--rounds", type=int, default=1, help="with --host-only: the best of this many medians per case")
    ap.add_argument("--dump-plans", metavar="PATH", help="random plans' uploads and describe() on a stubbed device, "
                                                         "as JSON (compare two versions' files)")
    ap.add_argument("--num-plans", type=int, default=300, help="with --dump-plans: random wrappers (4 plans each)")
    args = ap.parse_args()
    if args.dump_plans:
        dump_plans(args.dump_plans, args.num_plans)
        return
    if args.host_only:
        import platform
        print(f"# plan() host time, device stubbed; {platform.processor() or platform.machine()}, "
              f"cuattn {cuattn.__version__}, numpy {np.__version__}, {datetime.date.today()}")
        rows = host_only(args)
        if args.out:
            Path(args.out).write_text(json.dumps(dict(date=str(datetime.date.today()), method=__doc__,
                                                      plan_host_us_stubbed=rows), indent=1))
        return
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
