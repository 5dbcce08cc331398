"""MLA decode (DeepSeek's absorbed latent attention) on the paged latent cache: latency, achieved
bandwidth and tensor-core rate of BatchMLAPagedAttentionWrapper, and FlashInfer's wrapper of the same
name in the same process when ``import flashinfer`` works (skipped with a note otherwise).

Shapes (issue 14): decode (qo_len 1), batch {1, 16, 64, 128} x kv_len {1k, 4k, 16k, 32k}, heads 16 and
128, head_dim_ckv 512 + head_dim_kpe 64, page 64 in random page order, bf16 (--dtype). --quick: batch
{1, 64} x kv {1k, 16k}. --backend (the wrapper's): "auto" runs the Hopper kernel mla_sm90.cu ("fa3") on
sm_90 and mla.cu ("fa2") elsewhere; every row names the kernel that ran.

--fp8 e4m3|e5m2 (default e4m3; none: off) adds fp8 columns: the same shape over an fp8 latent cache
(random finite bytes, bench_decode's filler; k_scale = v_scale = 1 so the peer, whose MLA wrapper takes
no scale, computes the same thing), its µs, the 16-bit µs / fp8 µs, TB/s and % of the read ceiling
counted on the fp8 bytes, TFLOP/s and % of the matmul rate (the kernel's tensor cores run q's 16-bit
type either way), and FlashInfer's BatchMLAPagedAttentionWrapper planned with kv_data_type fp8 when it
accepts that (its first refusal is printed and the column left empty for the rest of the run).

Timing: CUDA events around each run() (the attention kernel plus the split-KV merge when the plan
splits), 256 MB L2 read-flush before every timed call (bench_decode.l2_flush), 5 warm-up + N timed
calls (default 30), median reported. Ceilings measured in the same run: read-only bandwidth
(bench_decode.ceilings, 2 GiB) and the fp16 tensor-core rate of a cuBLAS 8192^3 matmul
(bench_cascade.matmul_tflops; bf16 runs at the same rate on H100). TB/s = 1e12 bytes/s over the bytes
below; TFLOP/s over the FLOPs below.

    python benchmarks/bench_mla.py [--quick] [--batch 1 16 64 128] [--kv-len 1024 4096 16384 32768]
        [--heads 16 128] [--dtype bfloat16|float16] [--backend auto|fa2|fa3]
        [--fp8 e4m3|e5m2|none] [--reps 30] [--check] [--out results.json]
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import cupy as cp  # noqa: E402

import cuattn  # noqa: E402
from cuattn import jit  # noqa: E402
from bench_cascade import matmul_tflops  # noqa: E402
from bench_decode import _FILL_FP8, ceilings, fill_random, l2_flush, time_events  # noqa: E402

CKV, KPE, PAGE = 512, 64, 64
FP8_DTYPE = {"e4m3": "float8_e4m3fn", "e5m2": "float8_e5m2"}


def mla_bytes(batch, kv_len, heads, itemsize, kv_itemsize=None):
    kv = batch * kv_len * (CKV + KPE) * (kv_itemsize or itemsize)   # each token's ckv and kpe read once (all heads share them)
    qo = batch * heads * (CKV + KPE + CKV) * itemsize               # q_nope + q_pe read, out written (16-bit)
    return kv + qo


def mla_flops(batch, kv_len, heads):
    return 2 * batch * heads * kv_len * (CKV + KPE + CKV)   # QK^T over 576 dims + PV over 512, 2 FLOPs per MAC


def setup(batch, kv_len, heads, dtype, seed):
    pages = -(-kv_len // PAGE)
    rng = np.random.default_rng(seed)
    kv_indices = rng.permutation(batch * pages).astype(np.int32)     # random page order
    kv_indptr = (np.arange(batch + 1) * pages).astype(np.int32)
    kv_lens = np.full(batch, kv_len, np.int32)
    qo_indptr = np.arange(batch + 1, dtype=np.int32)
    arrs = []
    for i, shape in enumerate([(batch * pages, PAGE, CKV), (batch * pages, PAGE, KPE), (batch, heads, CKV),
                               (batch, heads, KPE)]):
        a = cp.empty(shape, cp.uint16)
        fill_random(a, dtype, seed * 10 + i)
        arrs.append(a.view(cp.float16) if dtype == "float16" else a)    # bf16: CuPy holds the raw bits
    return qo_indptr, kv_indptr, kv_indices, kv_lens, arrs


def as_float64(x, dtype):
    """A CuPy fp16 array, or raw bf16 bits (uint16), as float64 on the host."""
    raw = cp.asnumpy(x.view(cp.uint16))
    f = (raw.astype(np.uint32) << 16).view(np.float32) if dtype == "bfloat16" else raw.view(np.float16)
    return f.astype(np.float64)


def host_values(arrs, dtype, fp8=None):
    """(ckv, kpe, q_nope, q_pe) on the host as NumPy arrays of their real type (caches: fp8 ``fp8`` bytes)."""
    import ml_dtypes
    np_dt = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(np.float16)
    f8 = np.dtype(getattr(ml_dtypes, FP8_DTYPE[fp8])) if fp8 else None
    return [cp.asnumpy(a).view(f8) if f8 is not None and i < 2 else cp.asnumpy(a.view(cp.uint16)).view(np_dt)
            for i, a in enumerate(arrs)]


def check(out, arrs, kv_indptr, kv_indices, kv_len, heads, dtype, scale, n_req=2, fp8=None):
    """rel. error of requests 0 .. n_req-1 against float64 on the host (scales 1)."""
    ckv, kpe, qn, qp = host_values(arrs, dtype, fp8)
    o = as_float64(out, dtype)
    errs = []
    for b in range(min(n_req, len(kv_indptr) - 1)):
        ids = kv_indices[kv_indptr[b]:kv_indptr[b + 1]]
        c = ckv[ids].reshape(-1, CKV)[:kv_len].astype(np.float64)
        k = np.concatenate([c, kpe[ids].reshape(-1, KPE)[:kv_len].astype(np.float64)], axis=1)
        q = np.concatenate([qn[b], qp[b]], axis=1).astype(np.float64)
        s = q @ k.T * scale
        w = np.exp(s - s.max(1, keepdims=True))
        ref = (w / w.sum(1, keepdims=True)) @ c
        errs.append(np.linalg.norm(o[b] - ref) / np.linalg.norm(ref))
    return max(errs)


def flashinfer_us(qo_indptr, kv_indptr, kv_indices, kv_lens, heads, dtype, scale, arrs, reps, flush, fp8=None):
    """(µs, output) of FlashInfer's BatchMLAPagedAttentionWrapper (backend "auto"), or None when it is not
    importable; ``fp8``: over the fp8 caches (uint8 CuPy arrays viewed as torch float8)."""
    try:
        import flashinfer
        import torch
    except ImportError:
        return None
    tdt = torch.bfloat16 if dtype == "bfloat16" else torch.float16
    kdt = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}[fp8] if fp8 else tdt
    ckv, kpe = (torch.from_dlpack(a).view(kdt) if fp8 else torch.from_dlpack(a.view(cp.uint16)).view(tdt)
                for a in arrs[:2])
    qn, qp = (torch.from_dlpack(a.view(cp.uint16)).view(tdt) for a in arrs[2:])
    w = flashinfer.mla.BatchMLAPagedAttentionWrapper(torch.empty(128 << 20, dtype=torch.uint8, device="cuda"))
    tt = lambda x: torch.from_numpy(x).cuda()     # noqa: E731
    w.plan(tt(qo_indptr), tt(kv_indptr), tt(kv_indices), tt(kv_lens), heads, CKV, KPE, PAGE, False, scale, tdt, kdt)
    out = torch.empty_like(qn)
    us = time_events(lambda: w.run(qn, qp, ckv, kpe, out=out), reps, flush)
    return us, cp.from_dlpack(out.view(torch.uint16))


_FI_FP8_REFUSED = []     # FlashInfer's first refusal of an fp8 MLA plan / run (then not tried again)


def flashinfer_fp8_us(*args, fp8):
    """flashinfer_us over the fp8 caches, or None (not importable, or the wrapper refuses fp8: printed once)."""
    if _FI_FP8_REFUSED:
        return None
    try:
        return flashinfer_us(*args, fp8=fp8)
    except Exception as e:    # noqa: BLE001 - a peer's refusal is reported, not fatal
        _FI_FP8_REFUSED.append(f"{type(e).__name__}: {e}"[:300])
        print(f"FlashInfer MLA over an fp8 cache failed (column left empty): {_FI_FP8_REFUSED[0]}", flush=True)
        return None


def time_fp8(fp8, batch, kv_len, heads, dtype, scale, qo_indptr, kv_indptr, kv_indices, kv_lens, qn, qp, reps, flush,
             mma, read_tbs, want_check):
    """The fp8 columns of one shape (a dict), and FlashInfer's fp8 output when measured."""
    pages = -(-kv_len // PAGE)
    ckv8, kpe8 = cp.empty((batch * pages, PAGE, CKV), cp.uint8), cp.empty((batch * pages, PAGE, KPE), cp.uint8)
    for i, a in enumerate((ckv8, kpe8)):
        _FILL_FP8(np.uint64(batch * 7 + kv_len + i), np.int32(fp8 == "e5m2"), a)
    w = cuattn.BatchMLAPagedAttentionWrapper()
    w.plan(qo_indptr, kv_indptr, kv_indices, kv_lens, heads, CKV, KPE, PAGE, False, scale, dtype, FP8_DTYPE[fp8])
    out = cp.empty(qn.shape, qn.dtype)
    us = time_events(lambda: w.run(qn, qp, ckv8, kpe8, out=out, k_scale=1.0, v_scale=1.0), reps, flush)
    nbytes = mla_bytes(batch, kv_len, heads, 2, kv_itemsize=1)
    tbs, tflops = nbytes / (us * 1e-6) / 1e12, mla_flops(batch, kv_len, heads) / (us * 1e-6) / 1e12
    row = dict(us=round(us, 2), tbs=round(tbs, 3), pct_read=round(100 * tbs / read_tbs, 1), tflops=round(tflops, 1),
               pct_mma=round(100 * tflops / mma, 1), bytes=nbytes, kernel=w.describe().splitlines()[1])
    arrs = (ckv8, kpe8, qn, qp)
    if want_check:
        row["rel_err_2_requests"] = check(out, arrs, kv_indptr, kv_indices, kv_len, heads, dtype, scale, fp8=fp8)
    fi = flashinfer_fp8_us(qo_indptr, kv_indptr, kv_indices, kv_lens, heads, dtype, scale, arrs, reps, flush, fp8=fp8)
    if fi is not None:
        row["flashinfer_us"] = round(fi[0], 2)
        row["flashinfer_over_ours"] = round(fi[0] / us, 3)
        a, b = (as_float64(x, dtype) for x in (out, fi[1]))
        row["rel_diff_vs_flashinfer"] = float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="batch {1, 64} x kv {1k, 16k}, both head counts")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64, 128])
    ap.add_argument("--kv-len", type=int, nargs="+", default=[1024, 4096, 16384, 32768])
    ap.add_argument("--heads", type=int, nargs="+", default=[16, 128])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--backend", default="auto", choices=["auto", "fa2", "fa3"],
                    help="cuattn's MLA kernel: auto = fa3 (mla_sm90.cu) on sm_90, else fa2 (mla.cu)")
    ap.add_argument("--fp8", default="e4m3", choices=["e4m3", "e5m2", "none"],
                    help="also time each shape over an fp8 latent cache (and FlashInfer's MLA wrapper over it)")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--check", action="store_true", help="check 2 requests per shape against float64")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/mla_<gpu>_<date>.json)")
    args = ap.parse_args()
    if args.quick:
        args.batch, args.kv_len = [1, 64], [1024, 16384]
    reps = max(args.reps, 10)

    dev = cp.cuda.Device()
    gpu = cp.cuda.runtime.getDeviceProperties(dev.id)["name"].decode()
    env = {"gpu": gpu, "sms": dev.attributes["MultiProcessorCount"], "cupy": cp.__version__,
           "cuda_runtime": cp.cuda.runtime.runtimeGetVersion(), "nvrtc": "%d.%d" % jit.nvrtc_version(),
           "cuattn": cuattn.__version__, "python": platform.python_version(),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    try:
        import flashinfer
        env["flashinfer"] = flashinfer.__version__
    except ImportError:
        print("FlashInfer not importable: its columns are left empty (not measured in this run)")
    print(" ".join(f"{k}={v}" for k, v in env.items()), flush=True)
    read_tbs, _ = ceilings(10)
    mma = matmul_tflops(10)
    print(f"ceilings (measured now): read-only {read_tbs:.3f} TB/s, fp16 cuBLAS matmul {mma:.0f} TFLOP/s", flush=True)
    flush = l2_flush("read")
    itemsize = 2
    scale = 1 / math.sqrt(CKV + KPE)
    fp8 = None if args.fp8 == "none" else args.fp8
    hdr = (f"{'heads':>5} {'batch':>5} {'kv_len':>6} {'us':>9} {'TB/s':>6} {'%read':>6} {'TFLOP/s':>8} {'%mma':>5} "
           f"{'FI us':>9} {'FI/ours':>7}"
           + (f" {'fp8 us':>9} {'x16':>5} {'%rd8':>5} {'%mma8':>5} {'FI8 us':>9} {'FI8/us':>6}" if fp8 else "")
           + "  kernel  plan")
    print(hdr, flush=True)
    rows = []
    for heads in args.heads:
        for batch in args.batch:
            for kv_len in args.kv_len:
                qo_indptr, kv_indptr, kv_indices, kv_lens, arrs = setup(batch, kv_len, heads, args.dtype, 1)
                ckv, kpe, qn, qp = arrs
                w = cuattn.BatchMLAPagedAttentionWrapper(backend=args.backend)
                w.plan(qo_indptr, kv_indptr, kv_indices, kv_lens, heads, CKV, KPE, PAGE, False, scale,
                       args.dtype, args.dtype)
                out = cp.empty(qn.shape, qn.dtype)
                us = time_events(lambda: w.run(qn, qp, ckv, kpe, out=out), reps, flush)
                nbytes, flops = mla_bytes(batch, kv_len, heads, itemsize), mla_flops(batch, kv_len, heads)
                tbs, tflops = nbytes / (us * 1e-6) / 1e12, flops / (us * 1e-6) / 1e12
                desc = w.describe().splitlines()
                kernel = next(d for d in desc if d.startswith("kernel: ")).split()[1]    # the spec's name
                row = dict(heads=heads, batch=batch, kv_len=kv_len, us=round(us, 2), tbs=round(tbs, 3),
                           pct_read=round(100 * tbs / read_tbs, 1), tflops=round(tflops, 1),
                           pct_mma=round(100 * tflops / mma, 1), bytes=nbytes, flops=flops, kernel=kernel,
                           plan=desc[1:])
                fi = flashinfer_us(qo_indptr, kv_indptr, kv_indices, kv_lens, heads, args.dtype, scale, arrs,
                                   reps, flush)
                if fi is not None:
                    row["flashinfer_us"] = round(fi[0], 2)
                    row["flashinfer_over_ours"] = round(fi[0] / us, 3)
                    a, b = (as_float64(x, args.dtype) for x in (out, fi[1]))
                    row["rel_diff_vs_flashinfer"] = float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))
                if args.check:
                    row["rel_err_2_requests"] = check(out, arrs, kv_indptr, kv_indices, kv_len, heads,
                                                      args.dtype, scale)
                f8s = ""
                if fp8:                                 # (the fp8 cache runs mla.cu)
                    arrs = ckv = kpe = None             # the 16-bit cache freed before the fp8 one is made
                    cp.get_default_memory_pool().free_all_blocks()
                    r8 = row["fp8"] = time_fp8(fp8, batch, kv_len, heads, args.dtype, scale, qo_indptr, kv_indptr,
                                               kv_indices, kv_lens, qn, qp, reps, flush, mma, read_tbs, args.check)
                    r8["speedup_over_16bit"] = round(us / r8["us"], 3)
                    f8s = (f" {r8['us']:>9.1f} {r8['speedup_over_16bit']:>5.2f} {r8['pct_read']:>5.1f} "
                           f"{r8['pct_mma']:>5.1f} {r8.get('flashinfer_us', '-'):>9} "
                           f"{r8.get('flashinfer_over_ours', '-'):>6}"
                           + (f" err8 {r8['rel_err_2_requests']:.1e}" if args.check else ""))
                rows.append(row)
                split = next((d for d in desc if d.startswith("split-KV")), "")
                print(f"{heads:>5} {batch:>5} {kv_len:>6} {us:>9.1f} {tbs:>6.3f} {row['pct_read']:>6.1f} "
                      f"{tflops:>8.1f} {row['pct_mma']:>5.1f} {row.get('flashinfer_us', '-'):>9} "
                      f"{row.get('flashinfer_over_ours', '-'):>7}{f8s}  {kernel}  {split[:70]}"
                      + (f"  err {row['rel_err_2_requests']:.1e}" if args.check else "")
                      + (f"  |ours-FI|/|FI| {row['rel_diff_vs_flashinfer']:.1e}" if fi is not None else ""),
                      flush=True)
                arrs = ckv = kpe = qn = qp = out = w = fi = None      # free this shape's cache before the next
                cp.get_default_memory_pool().free_all_blocks()
    result = dict(env=env, ceilings=dict(read_only_tbs=read_tbs, matmul_tflops=mma), dtype=args.dtype, fp8=fp8,
                  flashinfer_fp8_refused=_FI_FP8_REFUSED[0] if _FI_FP8_REFUSED else None,
                  page_size=PAGE, backend=args.backend, reps=reps,
                  timing=__doc__.split("\n\n")[3], rows=rows)
    path = Path(args.out) if args.out else (Path(__file__).parent / "results" /
                                            f"mla_{gpu.replace(' ', '_')}_{env['date'][:10]}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
