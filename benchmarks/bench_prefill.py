"""Prefill attention throughput (cuattn fa2 backend vs fp16 matmul, torch SDPA, FlashInfer).

Timing: CUDA events around each call on one stream, 3 warm-up calls, median of --reps timed
calls. Prefill is compute bound, so L2 is not flushed (inputs of 1x16k are far larger than L2
anyway). TFLOP/s = 4 * qo * kv * num_qo_heads * head_dim / time; causal halves the work.
The fp16 matmul ceiling (cuBLAS through CuPy, 8192^3) is measured in the same run. SDPA and
FlashInfer are timed the same way when importable; otherwise the PEERS.md H100 numbers are
printed, labelled as not from this run. JSON goes to benchmarks/results/ (or --out).
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import cupy as cp  # noqa: E402

import cuattn  # noqa: E402
from cuattn import jit  # noqa: E402

# PEERS.md, H100, 32:8 heads, hd128, fp16: (batch, len, causal) -> (SDPA cuDNN us, FlashInfer fa2 us)
PEERS_H100 = {(1, 1024, False): (35.1, 60.0), (1, 1024, True): (34.7, 59.7), (1, 4096, False): (420, 780),
              (1, 4096, True): (263, 500), (1, 16384, False): (7380, 12320), (1, 16384, True): (3570, 6630),
              (8, 2048, False): (849, 1655), (8, 2048, True): (511, 913)}


def flops(batch, qo, kv, heads, d, causal):
    f = 4.0 * batch * qo * kv * heads * d        # QK^T and PV, 2 flops per multiply-add each
    return f / 2 if causal else f                 # causal halves the work


def time_cupy(fn, reps, warmup=5, inner=1):
    """Median ms per call; events around ``inner`` back-to-back calls (inner > 1 hides the host
    time of a call behind the previous call's kernel, leaving the GPU time when that is longer)."""
    for _ in range(warmup):
        fn()
    stream = cp.cuda.get_current_stream()
    times = []
    for _ in range(reps):
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record(stream)
        for _ in range(inner):
            fn()
        b.record(stream)
        b.synchronize()
        times.append(cp.cuda.get_elapsed_time(a, b) / inner)
    return float(np.median(times))


def gpu_us(fn, reps, warmup=3):
    """Median GPU time of one call alone: a ~1 ms matmul queued first keeps the stream busy
    while the host issues the events and the call, so neither host time nor launch latency
    lands between the events (the call's kernels start as soon as the matmul ends)."""
    n = 4096
    a = cp.ones((n, n), cp.float16)
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


def host_us(fn, n=50):
    """Host time of one call (no synchronization; the GPU queue absorbs the launches)."""
    cp.cuda.Device().synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    dt = (time.perf_counter() - t) / n * 1e6
    cp.cuda.Device().synchronize()
    return dt


def time_torch(fn, reps, warmup=3):
    import torch
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return float(np.median(times))


def matmul_tflops(reps):
    n = 8192
    a = cp.random.standard_normal((n, n), dtype=cp.float32).astype(cp.float16)
    b = cp.random.standard_normal((n, n), dtype=cp.float32).astype(cp.float16)
    ms = time_cupy(lambda: a @ b, reps)
    return 2 * n ** 3 / (ms * 1e-3) / 1e12


def rand(shape, dtype):
    x = cp.random.standard_normal(shape, dtype=cp.float32)
    if dtype == "bfloat16":
        return (x.view(cp.uint32) >> 16).astype(cp.uint16)     # bf16 bits (truncated), CuPy has no bf16
    return x.astype(cp.float16)


def run_case(batch, length, causal, hq, hkv, d, dtype, reps, page_size, sdpa):
    res = dict(batch=batch, qo_len=length, kv_len=length, causal=causal, num_qo_heads=hq, num_kv_heads=hkv,
               head_dim=d, dtype=dtype)
    f = flops(batch, length, length, hq, d, causal)
    nnz = batch * length
    q, k, v = rand((nnz, hq, d), dtype), rand((nnz, hkv, d), dtype), rand((nnz, hkv, d), dtype)
    indptr = np.arange(batch + 1, dtype=np.int32) * length
    if batch == 1:
        call = lambda: cuattn.single_prefill_with_kv_cache(q, k, v, causal=causal)  # noqa: E731
    else:
        w = cuattn.BatchPrefillWithRaggedKVCacheWrapper()
        w.plan(indptr, indptr, hq, hkv, d, causal=causal, q_data_type=dtype)
        out = cp.empty_like(q)
        call = lambda: w.run(q, k, v, out=out)  # noqa: E731
    ms = time_cupy(call, reps)
    res.update(us=ms * 1e3, tflops=f / (ms * 1e-3) / 1e12)
    if length <= 4096:       # short calls: GPU time with launches back to back, and host time per call
        ms_b = time_cupy(call, reps, inner=10)
        g = gpu_us(call, reps)
        res.update(b2b_us=ms_b * 1e3, b2b_tflops=f / (ms_b * 1e-3) / 1e12, host_us=host_us(call),
                   gpu_us=g, gpu_tflops=f / (g * 1e-6) / 1e12)
    # -- paged K/V, random page order, same lengths
    pages_per = -(-length // page_size)
    total = batch * pages_per
    perm = np.random.default_rng(0).permutation(total).astype(np.int32)
    cache = rand((total, 2, page_size, hkv, d), dtype)
    wp = cuattn.BatchPrefillWithPagedKVCacheWrapper()
    last = np.full(batch, length - (pages_per - 1) * page_size, np.int32)
    wp.plan(indptr, np.arange(batch + 1, dtype=np.int32) * pages_per, perm, last, hq, hkv, d, page_size,
            causal=causal, q_data_type=dtype)
    out_p = cp.empty_like(q)
    ms_p = time_cupy(lambda: wp.run(q, cache, out=out_p), reps)
    res.update(paged_us=ms_p * 1e3, paged_tflops=f / (ms_p * 1e-3) / 1e12, paged_ratio=ms_p / ms)
    del cache
    if sdpa is not None:
        res.update(sdpa(batch, length, causal, hq, hkv, d, dtype, reps, f))
    return res


def make_sdpa():
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        return None

    def sdpa(batch, length, causal, hq, hkv, d, dtype, reps, f):
        tdt = torch.float16 if dtype == "float16" else torch.bfloat16
        q = torch.randn(batch, hq, length, d, dtype=tdt, device="cuda")
        k = torch.randn(batch, hkv, length, d, dtype=tdt, device="cuda")
        v = torch.randn(batch, hkv, length, d, dtype=tdt, device="cuda")
        out = {}
        ms = time_torch(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True), reps)
        out.update(sdpa_us=ms * 1e3, sdpa_tflops=f / (ms * 1e-3) / 1e12)
        try:
            from torch.nn.attention import SDPBackend, sdpa_kernel
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                ms = time_torch(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True), reps)
            out.update(sdpa_cudnn_us=ms * 1e3, sdpa_cudnn_tflops=f / (ms * 1e-3) / 1e12)
        except RuntimeError as e:      # cuDNN backend refused this shape
            out.update(sdpa_cudnn_error=str(e)[:200])
        return out
    return sdpa


def check(args):
    """Small correctness check against a float64 reference before timing."""
    from tests.oracle import dense_attention, rel_err
    q = rand((300, 32, args.head_dim[0]), "float16")
    k = rand((700, 8, args.head_dim[0]), "float16")
    v = rand((700, 8, args.head_dim[0]), "float16")
    out = cuattn.single_prefill_with_kv_cache(q, k, v, causal=True)
    err = rel_err(cp.asnumpy(out), dense_attention(cp.asnumpy(q), cp.asnumpy(k), cp.asnumpy(v), causal=True)[0])
    print(f"check: rel_err {err:.2e}")
    assert err < 5e-3


VARIANTS = [(2, 32, 3), (2, 64, 2), (2, 64, 2, "QK_UNROLL=1"), (2, 64, 2, "QK_UNROLL=4")]
# --variants paged: the paged page-id schemes (PAGE_CPASYNC=0: page id held in a register, QK unroll 1)
VARIANTS_PAGED = [(2, 64, 2, "PAGE_CPASYNC=0"), (2, 64, 2, "PAGE_CPASYNC=1", "QK_UNROLL=1"), (2, 64, 2)]


def sweep_variants(args, hq, hkv, mm):
    """Tile configurations (num_mma_q, block_n, stages) on 1 x 16k, hd128, by patching tile_config."""
    from cuattn import prefill
    orig = prefill.tile_config
    print("variant sweep, 1x16384 hd128 fp16 (num_mma_q, block_n, stages): TFLOP/s full / causal / paged full")
    sweep = []
    orig_make = prefill.make_spec
    for var in (VARIANTS_PAGED if args.variants == "paged" else VARIANTS):
        prefill.make_spec = lambda d, t, c, m, p, var=var: prefill.PrefillSpec(d, t, bool(c), bool(m), bool(p), *var[:3],
                                                                              variant=tuple(var[3:]))
        try:
            res = [run_case(1, 16384, c, hq, hkv, 128, "float16", 7, args.page_size, None) for c in (False, True)]
            rg = run_case(8, 2048, False, hq, hkv, 128, "float16", 7, args.page_size, None)
            regs = jit.compile_kernel(prefill.make_spec(128, "f16", False, False, False), "sm_90a").resources
            print(f"  {var}: {res[0]['tflops']:.0f} / {res[1]['tflops']:.0f} / {res[0]['paged_tflops']:.0f}"
                  f" / 8x2048 {rg['tflops']:.0f}  {regs.get('cuattn_prefill', regs)}", flush=True)
            sweep.append(dict(variant=list(map(str, var)), full=res[0], causal=res[1], ragged=rg, resources=regs))
        except Exception as e:  # a variant that fails to launch (smem) is reported, not fatal
            print(f"  {var}: failed: {type(e).__name__}: {str(e)[:120]}")
    prefill.tile_config = orig
    prefill.make_spec = orig_make
    return sweep


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shapes", nargs="*", default=["1x1024", "1x4096", "1x16384", "8x2048"])
    ap.add_argument("--head-dim", type=int, nargs="*", default=[128])
    ap.add_argument("--dtype", nargs="*", default=["float16"])
    ap.add_argument("--heads", default="32:8")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--no-sdpa", action="store_true")
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--variants", nargs="?", const="tiles", default=None, choices=("tiles", "paged"),
                    help="sweep tile configurations (or the paged variants: --variants paged) first (hd128)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--profile-host", action="store_true", help="cProfile 200 eager 1x1024 calls")
    args = ap.parse_args()
    hq, hkv = map(int, args.heads.split(":"))
    dev = cp.cuda.Device(0)
    name = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    env = dict(gpu=name, sm=dev.compute_capability, cupy=cp.__version__, nvrtc="%d.%d" % jit.nvrtc_version(),
               cuattn=cuattn.__version__, python=platform.python_version(), backend="fa2",
               date=time.strftime("%Y-%m-%d %H:%M:%S %Z"))
    print("env:", env)
    if args.check:
        check(args)
    mm = matmul_tflops(args.reps)
    print(f"fp16 matmul 8192^3 (cuBLAS via CuPy): {mm:.0f} TFLOP/s")
    sdpa = None if args.no_sdpa else make_sdpa()
    try:
        import flashinfer  # noqa: F401
        print("flashinfer importable: not yet wired into this script (TODO)")
    except ImportError:
        print("flashinfer: not importable here; PEERS.md H100 numbers shown (not from this run)")
    sweep = sweep_variants(args, hq, hkv, mm) if args.variants else None
    if args.profile_host:
        import cProfile
        import pstats
        q, k, v = rand((1024, hq, 128), "float16"), rand((1024, hkv, 128), "float16"), rand((1024, hkv, 128), "float16")
        for _ in range(5):
            cuattn.single_prefill_with_kv_cache(q, k, v)
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(200):
            cuattn.single_prefill_with_kv_cache(q, k, v)
        pr.disable()
        cp.cuda.Device().synchronize()
        pstats.Stats(pr).sort_stats("tottime").print_stats(12)
    rows = []
    for dtype in args.dtype:
        for d in args.head_dim:
            for shp in args.shapes:
                b, n = map(int, shp.split("x"))
                for causal in (False, True):
                    r = run_case(b, n, causal, hq, hkv, d, dtype, args.reps, args.page_size, sdpa)
                    r["matmul_tflops"] = mm
                    peer = PEERS_H100.get((b, n, causal)) if (d == 128 and (hq, hkv) == (32, 8)) else None
                    if peer:
                        r["peers_h100_not_this_run"] = dict(sdpa_cudnn_us=peer[0], flashinfer_fa2_us=peer[1])
                    rows.append(r)
                    print(json.dumps(r), flush=True)
    out = Path(args.out) if args.out else (Path(__file__).parent / "results" /
                                           f"prefill_{name.replace(' ', '_')}_{int(time.time())}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(env=env, matmul_tflops=mm, rows=rows, variants=sweep), indent=1))
    print(f"\n{'case':<22}{'us':>9}{'TF/s':>7}{'/mm':>6}{'b2b us':>8}{'host':>6}{'paged us':>10}{'pg/ct':>7}"
          f"{'sdpa us':>9}{'sdpa/us':>8}{'FI-fa2*':>8}")
    for r in rows:
        case = f"{r['dtype'][:4]} hd{r['head_dim']} {r['batch']}x{r['qo_len']}{' c' if r['causal'] else ''}"
        sd = r.get("sdpa_cudnn_us", r.get("sdpa_us"))
        peer = r.get("peers_h100_not_this_run", {}).get("flashinfer_fa2_us")
        us = r["us"]
        sd_s = "-" if sd is None else f"{sd:.1f}"
        sd_r = "-" if sd is None else f"{sd / us:.2f}"
        pr = "-" if peer is None else f"{peer / us:.2f}"
        b2b = f"{r['b2b_us']:.1f}" if "b2b_us" in r else "-"
        hu = f"{r['host_us']:.0f}" if "host_us" in r else "-"
        print(f"{case:<22}{us:9.1f}{r['tflops']:7.0f}{r['tflops'] / mm:6.2f}{b2b:>8}{hu:>6}{r['paged_us']:10.1f}"
              f"{r['paged_us'] / us:7.2f}{sd_s:>9}{sd_r:>8}{pr:>8}")
    print("sdpa = torch SDPA (cuDNN backend where it accepts the shape), same run; sdpa/us > 1: cuattn faster. "
          "FI-fa2* = PEERS.md FlashInfer fa2 H100 time / ours (not this run).")


if __name__ == "__main__":
    main()
