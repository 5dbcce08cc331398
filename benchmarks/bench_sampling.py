"""Sampling (cuattn.sampling): latency per call, next to FlashInfer's sampling and plain PyTorch
implementations (sort-based top-p / top-k + top-p, torch.multinomial) in the same process.

Timing: CUDA events around each call, L2 flushed before every timed call (256 MB read, as bench_decode;
--no-flush keeps L2 warm), 10 warm-up + N timed calls (default 50), median reported in µs. Inputs: float32
logits ``3 * randn`` (fixed seed) and their softmax, vocab 128256 (Llama 3), batch 1 / 64 / 256.
"GB/s" counts one read of the input (the floor every op pays: batch * vocab * 4 bytes); the kernels read a
row several times (stats, 3 radix passes for a top-p threshold, the race), mostly from L2 at small batch
(benchmarks/results/sampling_notes.md).
``--ctas auto 1`` (default) times cuattn twice per row: with the automatic CTAs per row
(``sampling.ctas_per_row``: a group of up to 32 CTAs per row at small batches) and with one CTA per row (the
old launch), in the same run; the first value is the "µs" column, the others follow as "µs@<n>".
FlashInfer (needs PyTorch and flashinfer importable; its first call JIT-compiles) and PyTorch are timed on
the same memory through DLPack. Runs only where CuPy sees a GPU.

    python benchmarks/bench_sampling.py [--batch 1 64 256] [--vocab 128256] [--ops ...] [--reps 50]
        [--ctas auto 1 8] [--no-flashinfer] [--check] [--json out.json]
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

from cuattn import arrays, sampling  # noqa: E402
from bench_decode import l2_flush, time_events  # noqa: E402
from bench_rope import env_info as rope_env_info  # noqa: E402

TOP_K, TOP_P, MIN_P = 50, 0.9, 0.1
OPS = ("top_k_top_p_sampling_from_logits", "top_p_sampling_from_probs", "top_k_sampling_from_probs",
       "sampling_from_probs", "min_p_sampling_from_probs", "top_k_renorm_probs", "top_p_renorm_probs",
       "top_k_mask_logits")


def env_info(torch, flashinfer) -> dict:
    """bench_rope's environment block (GPU, versions, date), plus the sampling spec."""
    env = rope_env_info(torch, flashinfer)
    env["spec"] = sampling.SamplingSpec().name
    print(f"{'spec':<13}{env['spec']}")
    return env


def cuattn_call(op, logits, probs):
    f = getattr(sampling, op)
    x = logits if op.endswith("logits") else probs
    if op == "top_k_top_p_sampling_from_logits":
        return lambda: f(x, TOP_K, TOP_P, seed=1)
    if op in ("top_k_sampling_from_probs", "top_k_renorm_probs", "top_k_mask_logits"):
        return (lambda: f(x, TOP_K, seed=1)) if "sampling" in op else (lambda: f(x, TOP_K))
    if op in ("top_p_sampling_from_probs", "top_p_renorm_probs"):
        return (lambda: f(x, TOP_P, seed=1)) if "sampling" in op else (lambda: f(x, TOP_P))
    if op == "min_p_sampling_from_probs":
        return lambda: f(x, MIN_P, seed=1)
    return lambda: f(x, seed=1)


def flashinfer_call(flashinfer, op, tl, tp):
    f = getattr(flashinfer.sampling, op)
    x = tl if op.endswith("logits") else tp
    if op == "top_k_top_p_sampling_from_logits":
        return lambda: f(x, TOP_K, TOP_P)
    if op in ("top_k_sampling_from_probs", "top_k_renorm_probs", "top_k_mask_logits"):
        return lambda: f(x, TOP_K)
    if op in ("top_p_sampling_from_probs", "top_p_renorm_probs"):
        return lambda: f(x, TOP_P)
    if op == "min_p_sampling_from_probs":
        return lambda: f(x, MIN_P)
    return lambda: f(x)


def torch_call(torch, op, tl, tp):
    """Plain PyTorch: softmax / sort / cumsum / mask / multinomial (None where no plain form is timed)."""
    def top_p_sort(probs, top_p, top_k=None):
        sp, si = torch.sort(probs, dim=-1, descending=True)
        drop = (torch.cumsum(sp, dim=-1) - sp) > top_p           # tokens after the nucleus
        if top_k is not None:
            drop[:, top_k:] = True
        sp = sp.masked_fill(drop, 0.0)
        return si.gather(1, torch.multinomial(sp, 1)).squeeze(1)
    if op == "top_k_top_p_sampling_from_logits":
        return lambda: top_p_sort(torch.softmax(tl, dim=-1), TOP_P, TOP_K)
    if op == "top_p_sampling_from_probs":
        return lambda: top_p_sort(tp, TOP_P)
    if op == "sampling_from_probs":
        return lambda: torch.multinomial(tp, 1).squeeze(1)
    if op == "top_k_sampling_from_probs":
        def top_k(probs):
            v, i = torch.topk(probs, TOP_K, dim=-1)
            return i.gather(1, torch.multinomial(v, 1)).squeeze(1)
        return lambda: top_k(tp)
    return None


def check(op, logits, probs) -> float:
    """Fraction of tokens equal to the NumPy path's (same seed); max abs error for renorm/mask ops."""
    call = cuattn_call(op, logits, probs)
    got = cp.asnumpy(call())
    host = cuattn_call(op, cp.asnumpy(logits), cp.asnumpy(probs))()
    if "sampling" in op:
        return float(np.mean(got == host))
    fin = np.isfinite(host) & np.isfinite(got)
    return float(np.max(np.abs(got[fin] - host[fin]), initial=0.0)) + float(np.sum(np.isfinite(host) != np.isfinite(got)))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 64, 256])
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--ops", nargs="+", default=list(OPS), choices=OPS)
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--no-flush", action="store_true")
    p.add_argument("--no-flashinfer", action="store_true")
    p.add_argument("--check", action="store_true", help="compare with the NumPy path (batch <= 64)")
    p.add_argument("--sweep", nargs="*", default=[], type=int, metavar="BLOCK",
                   help="tuning: also time top_k_top_p_sampling_from_logits, top_p_sampling_from_probs and "
                        "top_k_renorm_probs with these SamplingSpec block sizes (divisors of 2048, e.g. 512)")
    p.add_argument("--ctas", nargs="+", default=["auto", "1"],
                   help="CTAs per row to time (sampling.set_ctas_per_row): 'auto' or ints; the first is the µs column")
    p.add_argument("--json")
    args = p.parse_args(argv)
    ctas = [None if c == "auto" else int(c) for c in args.ctas]
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    if not arrays.gpu_available():
        sys.exit("bench_sampling: no CUDA GPU visible to CuPy; this benchmark runs only on a GPU")
    try:
        import torch
    except ImportError:
        torch = None
    flashinfer = None
    if torch is not None and not args.no_flashinfer:
        try:
            import flashinfer
            import flashinfer.sampling  # noqa: F401
        except ImportError as e:
            print(f"flashinfer not importable ({e}); timing cuattn and PyTorch only")
            flashinfer = None
    env = env_info(torch, flashinfer)
    flush = None if args.no_flush else l2_flush()
    head = f"{'op':<34}{'batch':>6}{'µs':>9}{'GB/s':>7}{'fi µs':>9}{'fi/us':>7}{'torch µs':>10}{'torch/us':>9}"
    head += "".join(f"{'µs@' + str(c or 'auto'):>10}" for c in ctas[1:])
    head += f"{'check':>9}" if args.check else ""
    print("\n" + head)
    rows_out = []

    def save():
        if args.json:
            Path(args.json).write_text(json.dumps({"env": env, "flush": not args.no_flush, "reps": args.reps,
                                                   "top_k": TOP_K, "top_p": TOP_P, "min_p": MIN_P,
                                                   "rows": rows_out}, indent=1))
    for batch in args.batch:
        rs = cp.random.RandomState(1)
        logits = (3 * rs.standard_normal((batch, args.vocab), dtype=cp.float32)).astype(cp.float32)
        e = cp.exp(logits - logits.max(axis=1, keepdims=True))
        probs = (e / e.sum(axis=1, keepdims=True)).astype(cp.float32)
        tl = tp = None
        if torch is not None:
            tl, tp = torch.from_dlpack(logits), torch.from_dlpack(probs)
        for op in args.ops:
            alt = {}
            for c in ctas:
                if c is not None and c > 1 and batch * c > sms:
                    alt[c] = None                                   # the CTAs of a row would not all be resident
                    continue
                sampling.set_ctas_per_row(c)
                alt[c] = time_events(cuattn_call(op, logits, probs), args.reps, flush, warmup=10)
            sampling.set_ctas_per_row(None)
            us = alt[ctas[0]]
            if us is None:
                print(f"{op:<34}{batch:>6}  skipped: batch * {ctas[0]} CTAs > {sms} SMs", flush=True)
                continue
            row = {"op": op, "batch": batch, "vocab": args.vocab, "us": us,
                   "ctas_per_row": sampling.ctas_per_row(batch, args.vocab, sms) if ctas[0] is None else ctas[0],
                   "us_by_ctas": {str(c or "auto"): v for c, v in alt.items()},
                   "gbps_one_read": batch * args.vocab * 4 / (us * 1e-6) / 1e9}
            line = f"{op:<34}{batch:>6}{us:>9.1f}{row['gbps_one_read']:>7.0f}"
            if flashinfer is not None:
                try:
                    row["flashinfer_us"] = time_events(flashinfer_call(flashinfer, op, tl, tp), args.reps, flush,
                                                       warmup=10)
                    line += f"{row['flashinfer_us']:>9.1f}{row['flashinfer_us'] / us:>7.2f}"
                except Exception as ex:  # noqa: BLE001  (its JIT may fail on the machine: record, go on)
                    row["flashinfer_error"] = f"{type(ex).__name__}: {ex}"[:300]
                    line += f"{'error':>9}{'':>7}"
            else:
                line += f"{'-':>9}{'':>7}"
            tc = torch_call(torch, op, tl, tp) if torch is not None else None
            if tc is not None:
                row["torch_us"] = time_events(tc, args.reps, flush, warmup=10)
                line += f"{row['torch_us']:>10.1f}{row['torch_us'] / us:>9.2f}"
            else:
                line += f"{'-':>10}{'':>9}"
            line += "".join(f"{alt[c]:>10.1f}" if alt[c] is not None else f"{'-':>10}" for c in ctas[1:])
            if args.check and batch <= 64:
                row["check"] = check(op, logits, probs)
                line += f"{row['check']:>9.3g}"
            print(line, flush=True)
            rows_out.append(row)
            save()
        shipped = sampling._SPEC
        for block in args.sweep:
            sampling._SPEC = sampling.SamplingSpec(block)
            for op in ("top_k_top_p_sampling_from_logits", "top_p_sampling_from_probs", "top_k_renorm_probs",
                       "top_p_renorm_probs"):
                us = time_events(cuattn_call(op, logits, probs), args.reps, flush, warmup=10)
                rows_out.append({"op": op, "batch": batch, "vocab": args.vocab, "us": us, "spec": sampling._SPEC.name})
                print(f"{op + ' ' + sampling._SPEC.name:<34}{batch:>6}{us:>9.1f}", flush=True)
            sampling._SPEC = shipped
            save()
        del logits, probs, e, tl, tp


if __name__ == "__main__":
    main()
