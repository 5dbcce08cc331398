"""A/B of cuattn's Hopper prefill kernel (prefill_sm90.cu) under compile-time tunings (-D defines such as
PINGPONG=0, GATHER_UNROLL=1, MASK_SPLIT=0), every tuning's kernel timed interleaved in one process.

Each case is planned once per tuning on its own wrapper (backend "fa3"; the tuning goes into the spec, so
each gets its own specialization) and timed GPU-alone (bench_prefill.gpu_us: a matmul queued before each
timed call keeps host time out of the events), median of 8 calls, in --rounds rounds (each round starts a case's
tunings at another one); the report gives the median over rounds, TFLOP/s, the time over the first tuning's, and the
same ratio paired within rounds (median and range). Run a tuning twice (e.g. "" and "GATHER_UNROLL=0", the same code
under another name) to see the harness's spread on the machine. 32:8 heads, head_dim 128 (--head-dim: another), fp16, page 16
in random order. Cases: KIND:BxN[:c] with KIND contig (ragged), paged, pagedseq (pages in order), fp8 (e4m3 pages, scales 0.5 / 0.25),
fp8e5 (e5m2 pages), softcap / alibi (contiguous, with the variant); ":c" = causal. sm_90 only. Where the cases hold a
paged case of an fp8 case's shape, a last table gives the fp8 case's speed over it (fp16 paged time / fp8 time, both
under the first tuning for the fp16 one: issue 22's target is >= 0.95).

    python benchmarks/bench_fa3_tuning.py --tunings "" --cases paged:1x16384 fp8:1x16384 fp8:1x4096:c

    python benchmarks/bench_fa3_tuning.py --tunings "" PINGPONG=0 --cases contig:1x16384 paged:8x2048:c [--rounds 3]

A tuning item "@field=N" sets a field of the spec instead of a define (an int), e.g. "@gather=0,@stages=2": the
fp8 cache through the TMA-staged converters instead of the gather.

(session 12's A/B logs, benchmarks/results/prefill_fa3_ab_H100_2026-11-25_session12_*.log, came from this
script before it had a command line: its first tuning was the default "" and the second the named one.)
"""
import argparse
import dataclasses
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import cupy as cp  # noqa: E402

import cuattn  # noqa: E402
from bench_prefill import flops, gpu_us, rand  # noqa: E402
from cuattn import prefill_sm90  # noqa: E402

HQ, HKV, D, PS = 32, 8, 128, 16


def make_call(kind, b, n, causal):
    """A call of case (kind, b x n, causal) on a fresh wrapper, planned now (with the current tuning)."""
    if kind == "mixed":      # bench_sparse's mixed step (b x n ignored), BatchAttention; ~18 GB of cache a tuning
        from bench_sparse import MIXED_SHAPE, mixed_step
        hq, hkv, d, ps = MIXED_SHAPE
        qo_indptr, indptr, indices, kv_lens, _, q, cache = mixed_step()
        out = cp.empty_like(q)
        w = cuattn.BatchAttention()
        w.plan(qo_indptr, indptr, indices, kv_lens, hq, hkv, d, d, ps, causal=True, q_data_type="float16",
               kv_data_type="float16")
        return lambda: w.run(q, cache, out=out)
    nnz = b * n
    q = rand((nnz, HQ, D), "float16")
    indptr = np.arange(b + 1, dtype=np.int32) * n
    out = cp.empty_like(q)
    if kind in ("contig", "softcap", "alibi"):
        k, v = rand((nnz, HKV, D), "float16"), rand((nnz, HKV, D), "float16")
        opts = dict(softcap=dict(logits_soft_cap=30.0), alibi=dict(pos_encoding_mode="ALIBI")).get(kind, {})
        w = cuattn.BatchPrefillWithRaggedKVCacheWrapper(backend="fa3")
        w.plan(indptr, indptr, HQ, HKV, D, causal=causal, q_data_type="float16", **opts)
        return lambda: w.run(q, k, v, out=out)
    pages = -(-n // PS)
    perm = np.random.default_rng(0).permutation(b * pages).astype(np.int32)
    if kind == "pagedseq":                         # pages in order: the gather's locality alone
        kind, perm = "paged", np.arange(b * pages, dtype=np.int32)
    last = np.full(b, n - (pages - 1) * PS, np.int32)
    w = cuattn.BatchPrefillWithPagedKVCacheWrapper(backend="fa3")
    if kind in ("fp8", "fp8e5"):   # (no NaN bits: e4m3 exponents below 15, e5m2 below 31)
        cache = cp.random.randint(0, 256, (b * pages, 2, PS, HKV, D), dtype=cp.int32).astype(cp.uint8) & 0xB7
        w.plan(indptr, np.arange(b + 1, dtype=np.int32) * pages, perm, last, HQ, HKV, D, PS, causal=causal,
               q_data_type="float16", kv_data_type="float8_e4m3fn" if kind == "fp8" else "float8_e5m2")
        return lambda: w.run(q, cache, out=out, k_scale=0.5, v_scale=0.25)
    if kind != "paged":
        raise SystemExit(f"unknown case kind {kind!r} (contig, paged, pagedseq, fp8, fp8e5, softcap, alibi, mixed)")
    cache = rand((b * pages, 2, PS, HKV, D), "float16")
    w.plan(indptr, np.arange(b + 1, dtype=np.int32) * pages, perm, last, HQ, HKV, D, PS, causal=causal,
           q_data_type="float16")
    return lambda: w.run(q, cache, out=out)


def main():
    global D
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tunings", nargs="+", default=["", "PINGPONG=0"],
                    help='each a comma-separated list of defines ("" = the shipped kernel); ratios are to the first')
    ap.add_argument("--cases", nargs="+", default=["contig:1x16384:c", "paged:1x16384:c", "paged:8x2048"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=D, help="head_dim of every case (qk = vo)")
    args = ap.parse_args()
    D = args.head_dim
    tunings = [tuple(t.split(",")) if t else () for t in args.tunings]
    current = []
    made = prefill_sm90.make_spec
    def tuned(*a, **kw):
        spec = made(*a, **kw)
        fields = dict(t[1:].split("=") for t in current if t.startswith("@"))      # "@gather=0" -> gather: False
        fields = {k: type(getattr(spec, k))(int(v)) for k, v in fields.items()}
        return dataclasses.replace(spec, tuning=tuple(t for t in current if not t.startswith("@")), **fields)
    prefill_sm90.make_spec = tuned
    calls = {}
    for case in args.cases:
        kind, shape, *c = case.split(":")
        b, n = map(int, shape.split("x"))
        for tun in tunings:
            current[:] = tun
            fn = make_call(kind, b, n, bool(c))
            out = fn()                             # the wrapper's first run fixes its kernel (this tuning)
            out = out[0] if isinstance(out, tuple) else out          # (BatchAttention returns out, lse)
            cp.cuda.Device().synchronize()
            calls[(case, tun)] = (fn, flops(b, n, n, HQ, D, bool(c)))
            if tun == tunings[0]:
                first = out.copy()
            elif kind == "mixed":                  # (the other kinds draw new inputs per tuning)
                print(f"{case} {','.join(tun)}: output bitwise equal to the first tuning's: "
                      f"{bool(cp.array_equal(out.view(cp.uint16), first.view(cp.uint16)))}", flush=True)
    # -- round r times each case's tunings starting from tuning r (mod their number): the first call of a case in a
    #    round ran up to 7% faster than the next on a loaded H100 host (session 24, an A / B / A' run), so each tuning
    #    takes every place in turn; 'paired' is the median over rounds of the time over the first tuning's in the same
    #    round, with its range (an A/A pair's range is the harness's spread on that machine)
    times = {key: [] for key in calls}
    for r in range(args.rounds):
        for case in args.cases:
            for tun in tunings[r % len(tunings):] + tunings[:r % len(tunings)]:
                times[(case, tun)].append(gpu_us(calls[(case, tun)][0], 8))
    print(f"# {cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}, 32:8, hd{D}, fp16, page {PS}, GPU alone")
    for case in args.cases:
        t0 = times[(case, tunings[0])]
        base = statistics.median(t0)
        for tun in tunings:
            t = times[(case, tun)]
            m = statistics.median(t)
            paired = [a / b for a, b in zip(t, t0)]
            print(f"{case:<22} {','.join(tun) or 'default':<30} {m:9.1f} us {calls[(case, tun)][1] / m / 1e6:6.0f} TF/s"
                  f"  x{m / base:.3f}  paired x{statistics.median(paired):.3f} [{min(paired):.3f}, {max(paired):.3f}]"
                  f"  rounds {[round(x) for x in t]}", flush=True)
    # -- fp8 speed over the fp16 paged kernel of the same shape (its first tuning's time)
    for case in args.cases:
        kind, rest = case.split(":", 1)
        ref = "paged:" + rest
        if kind in ("fp8", "fp8e5") and ref in args.cases:
            t16 = statistics.median(times[(ref, tunings[0])])
            print(f"{case:<22} over {ref:<18} " + "  ".join(
                f"{','.join(tun) or 'default'} {t16 / statistics.median(times[(case, tun)]):.3f}" for tun in tunings))


if __name__ == "__main__":
    main()
