"""Block-sparse attention and a mixed prefill + decode step, next to FlashInfer in the same process.

1. BlockSparseAttentionWrapper: 32:32 heads, head_dim 128, fp16, 16384 queries x 16384 keys, 64 x 64
   blocks at 10% and 50% density (random blocks, every row block non-empty). TFLOP/s counts
   4 x nnz x R x C x heads x head_dim (QK^T and PV) against the fp16 matmul rate measured in the run.
2. A mixed step (BatchAttention): 4 prefill chunks of 1024 new tokens over 1024-8192 cached + 256
   decodes over 2k-32k keys (32:8 heads, head_dim 128, fp16, page 16, random page order), in one
   plan/run, against cuattn's separate paged prefill + decode launches (and each alone) and FlashInfer's
   BatchAttention. The step reads 18.3 GB of K/V (96% of it the decodes'): its floor is those bytes (plus q and
   out) at the read-only ceiling measured in the run (bench_decode's), and each time is also given as a
   fraction of that ceiling.
Timing: CUDA events, L2 read-flushed before each call, 5 warm-up + N timed, median.

    python benchmarks/bench_sparse.py [--reps 20] [--out results.json]
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
from bench_cascade import matmul_tflops  # noqa: E402
from bench_decode import ceilings, fill_random, l2_flush, time_events  # noqa: E402


def rand(shape, seed):
    x = cp.empty(shape, cp.uint16)
    fill_random(x, "float16", seed)
    return x.view(cp.float16)


def flashinfer_or_none():
    try:
        import flashinfer
        import torch
        return flashinfer, torch
    except ImportError as e:
        print(f"# FlashInfer not importable ({e}): cuattn only")
        return None, None


def block_sparse(args, mma, fi, torch, flush) -> list:
    rows = []
    seq, bs, h, d = 16384, 64, 32, 128
    q, k, v = rand((seq, h, d), 1), rand((seq, h, d), 2), rand((seq, h, d), 3)
    for density in (0.1, 0.5):
        rng = np.random.default_rng(4)
        mask = rng.random((seq // bs, seq // bs)) < density
        mask[:, 0] = True
        indptr = np.concatenate([[0], np.cumsum(mask.sum(1))]).astype(np.int32)
        indices = np.nonzero(mask)[1].astype(np.int32)
        flops = 4 * len(indices) * bs * bs * h * d
        w = cuattn.BlockSparseAttentionWrapper()
        w.plan(indptr, indices, seq, seq, bs, bs, h, h, d)
        out = cp.empty_like(q)
        us = time_events(lambda: w.run(q, k, v, out=out), args.reps, flush)
        row = dict(case=f"block-sparse 16k, 64x64, density {density}", nnz=len(indices), us=round(us, 1),
                   tflops=round(flops / us / 1e6, 1), of_matmul=round(flops / us / 1e6 / mma, 3), plan=w.describe())
        if cp.cuda.Device().compute_capability == "90":     # the Hopper kernel's 128-row tiles, for the record
            w3 = cuattn.BlockSparseAttentionWrapper(backend="fa3")
            w3.plan(indptr, indices, seq, seq, bs, bs, h, h, d)
            row["fa3_us"] = round(time_events(lambda: w3.run(q, k, v, out=out), args.reps, flush), 1)
        if fi is not None:
            try:
                fw = fi.BlockSparseAttentionWrapper(torch.empty(128 << 20, dtype=torch.uint8, device="cuda"))
                tt = lambda x: torch.as_tensor(x, device="cuda")      # noqa: E731
                fw.plan(tt(indptr), tt(indices), seq, seq, bs, bs, h, h, d, q_data_type=torch.float16)
                tq, tk, tv = (torch.from_dlpack(x) for x in (q, k, v))
                row["flashinfer_us"] = round(time_events(lambda: fw.run(tq, tk, tv), args.reps, flush), 1)
                ref = fw.run(tq, tk, tv)
                row["rel_diff_vs_flashinfer"] = float((torch.from_dlpack(out).float() - ref.float()).norm()
                                                      / ref.float().norm())
            except Exception as e:       # noqa: BLE001 - report and go on
                row["flashinfer_error"] = f"{type(e).__name__}: {e}"[:200]
        rows.append(row)
        print(f"{row['case']:<40} {us:9.1f} us {row['tflops']:6.1f} TFLOP/s ({row['of_matmul']:.0%} of matmul), "
              f"fa3 {row.get('fa3_us', '-')} us   "
              f"FlashInfer {row.get('flashinfer_us', row.get('flashinfer_error', '-'))}", flush=True)
    return rows


MIXED_SHAPE = (32, 8, 128, 16)      # heads, kv heads, head_dim, page size of the mixed step


def mixed_step():
    """The mixed step's batch (4 prefill chunks of 1024 new tokens over 1024-8192 cached + 256 decodes over
    2k-32k keys, random page order): (qo_indptr, kv page indptr, page ids, kv lengths, last page lengths, q, cache)."""
    hq, hkv, d, ps = MIXED_SHAPE
    rng = np.random.default_rng(5)
    prefix = [1024, 2048, 4096, 8192]
    dec_kv = rng.integers(2048, 32769, 256)
    qo_lens = [1024] * 4 + [1] * 256
    kv_lens = [p + 1024 for p in prefix] + dec_kv.tolist()
    pages = [-(-n // ps) for n in kv_lens]
    indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
    indices = rng.permutation(int(indptr[-1])).astype(np.int32)
    last = np.array([n - (p - 1) * ps for n, p in zip(kv_lens, pages)], np.int32)
    qo_indptr = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
    cache, q = rand((len(indices), 2, ps, hkv, d), 6), rand((int(qo_indptr[-1]), hq, d), 7)
    return qo_indptr, indptr, indices, np.array(kv_lens, np.int32), last, q, cache


def mixed(args, fi, torch, flush, read_tbs: float) -> dict:
    hq, hkv, d, ps = MIXED_SHAPE
    qo_indptr, indptr, indices, kv_lens, last, q, cache = mixed_step()
    out = cp.empty_like(q)
    w = cuattn.BatchAttention()
    w.plan(qo_indptr, indptr, indices, kv_lens, hq, hkv, d, d, ps, causal=True,
           q_data_type="float16", kv_data_type="float16")
    one_us = time_events(lambda: w.run(q, cache, out=out), args.reps, flush)
    # -- the separate launches: paged prefill over the 4 chunks, decode over the 256
    p = cuattn.BatchPrefillWithPagedKVCacheWrapper()
    p.plan(qo_indptr[:5], indptr[:5], indices[:indptr[4]], last[:4], hq, hkv, d, ps, causal=True)
    dw = cuattn.BatchDecodeWithPagedKVCacheWrapper()
    dw.plan(indptr[4:] - indptr[4], indices[indptr[4]:], last[4:], hq, hkv, d, ps)
    qp, qd = q[:4096], q[4096:]
    sep_us = time_events(lambda: (p.run(qp, cache, out=out[:4096]), dw.run(qd, cache, out=out[4096:])), args.reps,
                         flush)
    prefill_us = time_events(lambda: p.run(qp, cache, out=out[:4096]), args.reps, flush)
    decode_us = time_events(lambda: dw.run(qd, cache, out=out[4096:]), args.reps, flush)
    step_bytes = int(kv_lens.sum()) * hkv * d * 2 * cache.itemsize + 2 * q.nbytes     # K and V once, q in, out
    floor_us = step_bytes / (read_tbs * 1e12) * 1e6
    row = dict(case="4 x 1024-token chunks + 256 decodes (2k-32k)", batch_attention_us=round(one_us, 1),
               separate_us=round(sep_us, 1), prefill_alone_us=round(prefill_us, 1), decode_alone_us=round(decode_us, 1),
               step_gb=round(step_bytes / 1e9, 3), read_ceiling_tbs=round(read_tbs, 3), floor_us=round(floor_us, 1),
               batch_attention_of_read=round(floor_us / one_us, 3), separate_of_read=round(floor_us / sep_us, 3),
               plan=w.describe())
    if fi is not None:
        try:
            fw = fi.BatchAttention(kv_layout="NHD")
            tt = lambda x: torch.as_tensor(x, device="cuda")      # noqa: E731
            fw.plan(tt(qo_indptr), tt(indptr), tt(indices), tt(kv_lens), hq, hkv, d, d, ps,
                    causal=True, q_data_type=torch.float16, kv_data_type=torch.float16)
            tq, tc = torch.from_dlpack(q), torch.from_dlpack(cache)
            row["flashinfer_us"] = round(time_events(lambda: fw.run(tq, tc), args.reps, flush), 1)
        except Exception as e:           # noqa: BLE001 - report and go on
            row["flashinfer_error"] = f"{type(e).__name__}: {e}"[:200]
    fi_us = row.get("flashinfer_us")
    print(f"{row['case']}: {row['step_gb']} GB of K/V, q and out; floor {floor_us:.1f} us at the read ceiling "
          f"({read_tbs:.3f} TB/s, measured now)", flush=True)
    for name, us in (("BatchAttention (one launch)", one_us), ("separate prefill + decode", sep_us),
                     ("  prefill alone", prefill_us), ("  decode alone", decode_us), ("FlashInfer BatchAttention", fi_us)):
        if us is not None:
            share = f"{100 * floor_us / us:5.1f}% of read" if "alone" not in name else ""
            vs_fi = f"FlashInfer / this {fi_us / us:5.3f}" if fi_us and "alone" not in name else ""
            print(f"  {name:<28} {us:8.1f} us  {share:>14}  {vs_fi}", flush=True)
    if "flashinfer_error" in row:
        print(f"  FlashInfer: {row['flashinfer_error']}", flush=True)
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out")
    args = ap.parse_args()
    dev = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    mma = matmul_tflops(10)
    print(f"# {dev}, cuattn {cuattn.__version__}, {datetime.date.today()}, fp16 matmul {mma:.0f} TFLOP/s")
    fi, torch = flashinfer_or_none()
    read_tbs, _ = ceilings(10)
    print(f"# read-only ceiling {read_tbs:.3f} TB/s (measured now)", flush=True)
    flush = l2_flush()
    rows = block_sparse(args, mma, fi, torch, flush)
    mix = mixed(args, fi, torch, flush, read_tbs)
    if args.out:
        Path(args.out).write_text(json.dumps(dict(device=dev, date=str(datetime.date.today()), matmul_tflops=mma,
                                                  read_tbs=read_tbs, method=__doc__, block_sparse=rows, mixed=mix),
                                             indent=1))


if __name__ == "__main__":
    main()
