"""Attention variants: the time each built-in (and a user-defined soft-cap) adds over plain attention,
and what compiling a variant specialization costs.

Timing: decode as bench_decode.py (CUDA events around each run(), 256 MB L2 read-flush before every
timed call, 5 warm-up + N timed, median); prefill as bench_prefill.py's gpu_us (a ~0.6 ms matmul
queued before each timed call so host time does not land between the events; median of N).
Variants of one shape are timed interleaved, in rounds, so drift hits them alike. "window" uses
window_left = kv_len (every key stays: the window's mask and skip logic at full work); "window 1k"
is a real 1024-token window (less work: faster than plain). Ratios are to plain in the same round.
Compile: one cold NVRTC compile (empty cache dir) and one warm load of each variant's decode and
fa2 prefill spec for this device's arch, in seconds.

    python benchmarks/bench_variants.py [--reps 30] [--rounds 3] [--variants rope ...] [--no-compile]
        [--no-decode] [--tuning MASK_SPLIT=0] [--out results.json]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import cupy as cp  # noqa: E402

import cuattn  # noqa: E402
from cuattn import jit, variants  # noqa: E402
from bench_decode import decode_bytes, l2_flush, setup_case, time_events  # noqa: E402
from bench_prefill import flops, gpu_us, rand  # noqa: E402

USER_SOFTCAP = cuattn.Variant("user_softcap", params=(("cap", "float"),),
                              logits_transform="return params.cap * fast_tanh(logits * (1.f / params.cap));")


ONLY: list = []     # --variants: the names to time (plain always), default all


def variant_table(kv_len):
    """name -> (plan options, run() extra args, run() sinks); sinks are made per shape."""
    table = {
        "plain": ({}, ()),
        "softcap": (dict(logits_soft_cap=30.0), ()),
        "window": (dict(window_left=kv_len), ()),
        "window 1k": (dict(window_left=1024), ()),
        "alibi": (dict(pos_encoding_mode="ALIBI"), ()),
        "sinks": ({}, "sinks"),
        "user softcap": (dict(variant=USER_SOFTCAP), (30.0,)),
        "rope": (dict(pos_encoding_mode="ROPE_LLAMA", rope_theta=5e5), ()),
        # prefill only: the fused RoPE rotating every key tile in the kernel (the ragged plan's choice where
        # few query tiles share a key; "rope" above rotates q and the keys once ahead here: prefill_rope.py)
        "rope in-kernel": (dict(pos_encoding_mode="ROPE_LLAMA", rope_theta=5e5), "in-kernel"),
    }
    return {k: v for k, v in table.items() if not ONLY or k == "plain" or k in ONLY}


def decode_rows(args, flush, hq=32, hkv=8, d=128, page=16):
    rows = []
    for batch, kv_len in ((16, 8192), (64, 2048)):
        indptr, indices, lpl, cache, q = setup_case(batch, kv_len, hq, hkv, d, page, "float16", 1)
        sinks = cp.asarray(np.random.default_rng(0).standard_normal(hq).astype(np.float32))
        out = cp.empty_like(q)
        calls = {}
        for name, (opts, extra) in variant_table(kv_len).items():
            if extra == "in-kernel":
                continue
            w = cuattn.BatchDecodeWithPagedKVCacheWrapper()
            w.plan(indptr, indices, lpl, hq, hkv, d, page, q_data_type="float16", **opts)
            kw = dict(sinks=sinks) if extra == "sinks" else {}
            pos = () if extra == "sinks" else extra
            calls[name] = (lambda w=w, pos=pos, kw=kw: w.run(q, cache, *pos, out=out, **kw))
        times = {n: [] for n in calls}
        for _ in range(args.rounds):
            for n, c in calls.items():
                times[n].append(time_events(c, args.reps, flush))
        gb = decode_bytes(batch, kv_len, hq, hkv, d, 2)
        for n, t in times.items():
            us = statistics.median(t)
            ratio = statistics.median([a / b for a, b in zip(t, times["plain"])])
            rows.append(dict(family="decode", shape=f"{batch}x{kv_len}", variant=n, us=round(us, 2),
                             tbs=round(gb / us / 1e6, 3), vs_plain=round(ratio, 3), rounds=[round(x, 2) for x in t]))
            print(f"decode  {batch:>3}x{kv_len:<6} {n:<13} {us:9.1f} us  {gb / us / 1e6:5.2f} TB/s  x{ratio:.3f} of plain",
                  flush=True)
    return rows


def prefill_rows(args, hq=32, hkv=8, d=128):
    rows = []
    length = 16384
    q, k, v = rand((length, hq, d), "float16"), rand((length, hkv, d), "float16"), rand((length, hkv, d), "float16")
    sinks = cp.asarray(np.random.default_rng(0).standard_normal(hq).astype(np.float32))
    sink_v = cuattn.Variant("sinkp", params=(("s", "float*"),), sink="return params.s[qo_head_idx];")
    for backend in ("fa3", "fa2"):
        if backend == "fa3" and jit.device_arch(0) != "sm_90a":
            continue
        calls = {}
        for name, (opts, extra) in variant_table(length).items():
            if extra == "sinks":
                opts, extra = dict(variant=sink_v), (sinks,)
            if extra == "in-kernel":
                calls[name] = _in_kernel_rope(q, k, v, backend, opts)
                continue
            calls[name] = (lambda opts=opts, extra=extra: cuattn.single_prefill_with_kv_cache(
                q, k, v, causal=True, backend=backend, variant_args=extra, **opts))
        times = {n: [] for n in calls}
        for _ in range(args.rounds):
            for n, c in calls.items():
                times[n].append(gpu_us(c, max(5, args.reps // 3)))
        f = flops(1, length, length, hq, d, True)
        for n, t in times.items():
            us = statistics.median(t)
            ratio = statistics.median([a / b for a, b in zip(t, times["plain"])])
            rows.append(dict(family=f"prefill {backend}", shape=f"1x{length} causal", variant=n, us=round(us, 1),
                             tflops=round(f / us / 1e6, 1), vs_plain=round(ratio, 3), rounds=[round(x, 1) for x in t]))
            print(f"prefill {backend} 1x{length} causal {n:<13} {us:9.1f} us  {f / us / 1e6:6.1f} TFLOP/s  "
                  f"x{ratio:.3f} of plain", flush=True)
    return rows


def _in_kernel_rope(q, k, v, backend, opts):
    """A ragged wrapper of the single request planned with the key pre-pass off (prefill_rope.MIN_SHARING
    out of reach while it plans): the kernel rotates every key tile it reads."""
    from cuattn import prefill_rope
    length, hq, d = q.shape
    w = cuattn.BatchPrefillWithRaggedKVCacheWrapper(backend=backend)
    saved, prefill_rope.MIN_SHARING = prefill_rope.MIN_SHARING, 1 << 60
    try:
        ind = np.array([0, length], np.int32)
        w.plan(ind, ind, hq, k.shape[1], d, causal=True, **opts)
    finally:
        prefill_rope.MIN_SHARING = saved
    assert not w._plan.rope_prepass
    return lambda: w.run(q, k, v)


def compile_rows():
    arch = jit.device_arch(0)
    rows = []
    old = os.environ.get("CUATTN_CACHE_DIR")
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["CUATTN_CACHE_DIR"] = tmp
        for name, (opts, _) in variant_table(4096).items():
            if name in ("window 1k", "rope", "rope in-kernel"):
                continue
            comp = variants.resolve("bench", num_qo_heads=32, sinks=name == "sinks", **opts).composite
            for spec in (cuattn.decode.DecodeSpec(128, "f16", "f16", variant=comp),
                         cuattn.prefill.make_spec(128, "f16", True, False, True, comp)):
                t0 = time.perf_counter()
                jit.compile_kernel(spec, arch)
                cold = time.perf_counter() - t0
                jit._memo.clear()
                t0 = time.perf_counter()
                jit.compile_kernel(spec, arch)
                warm = time.perf_counter() - t0
                rows.append(dict(variant=name, spec=spec.name, cold_s=round(cold, 3), warm_s=round(warm, 4)))
                print(f"compile {arch} {spec.name:<72} cold {cold:5.2f} s  warm {warm * 1e3:5.1f} ms", flush=True)
    if old is None:
        os.environ.pop("CUATTN_CACHE_DIR")
    else:
        os.environ["CUATTN_CACHE_DIR"] = old
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--variants", nargs="*", default=[], help="names to time besides plain (default: all)")
    ap.add_argument("--no-compile", action="store_true", help="skip the compile-time rows")
    ap.add_argument("--no-decode", action="store_true", help="skip the decode rows")
    ap.add_argument("--tuning", nargs="*", default=[],
                    help="experiment: -D defines added to every prefill spec (fa2 and fa3) of this process, e.g. "
                         "MASK_SPLIT=0; a second run without them is the A/B (the ratios to plain compare)")
    ap.add_argument("--out")
    args = ap.parse_args()
    ONLY[:] = args.variants
    if args.tuning:
        import dataclasses
        from cuattn import prefill_batch, prefill_sm90
        for mod in (prefill_batch, prefill_sm90):     # where plan() calls make_spec
            def make(*a, _made=mod.make_spec, **kw):
                return dataclasses.replace(_made(*a, **kw), tuning=tuple(args.tuning))
            mod.make_spec = make
    dev = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    print(f"# {dev}, cuattn {cuattn.__version__}, NVRTC {jit.nvrtc_version()}, {datetime.date.today()}")
    compile_res = [] if args.no_compile else compile_rows()
    flush = l2_flush()
    res = dict(device=dev, date=str(datetime.date.today()), method=__doc__, compile=compile_res,
               tuning=args.tuning,
               decode=[] if args.no_decode else decode_rows(args, flush), prefill=prefill_rows(args))
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
