"""RoPE (cuattn.rope): latency and achieved bandwidth, next to FlashInfer's same function and a plain
PyTorch rotation in the same process, against the copy ceiling measured in the run.

Timing: CUDA events around each call, L2 flushed before every timed call (256 MB read, as bench_decode;
--no-flush keeps L2 warm), 10 warm-up + N timed calls (default 30), median reported in µs.
Shapes: q (nnz, 32, 128) and k (nnz, 8, 128) (Llama 3 8B's heads), nnz 1 / 64 / 4096, rotary_dim 128 and
64, float16 and bfloat16, NeoX style. Positions: nnz <= 256 is a decode batch (one token per request at
a random position below 8192); larger nnz is chunked prefill (requests of 512 tokens at random offsets).
GB/s = 1e9 bytes/s over the bytes each op must move (``rope_bytes``); the ceiling is a device-to-device
copy of 1 GiB (bytes read + written, bench_decode.ceilings), measured in the same process.
FlashInfer (needs PyTorch and flashinfer importable; its first call JIT-compiles its rope module) and
PyTorch are timed on the same memory through DLPack (bf16 as uint16 views). "torch" is the plain
rotation vLLM's ``forward_native`` does: cos/sin per token in float32 (``positions x inv_freq``, or a
gather of cos_sin_cache rows), q/k rotated in float32 and stored in their dtype; it is given the
position ids of every form (the ragged forms' positions are not derived from indptr/offsets there).
``check``: relative L2 error of FlashInfer's and torch's results against cuattn's (returning forms).
Runs only where CuPy sees a GPU.

    python benchmarks/bench_rope.py [--nnz 1 64 4096] [--rotary-dim 128 64] [--dtype bfloat16 float16]
        [--ops apply_rope ...] [--reps 30] [--no-flush] [--no-flashinfer] [--no-torch] [--out rope.json]
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
from cuattn import arrays, jit, rope  # noqa: E402
from bench_decode import ceilings, fill_random, l2_flush, time_events  # noqa: E402

OPS = ("apply_rope", "apply_rope_inplace", "apply_rope_pos_ids", "apply_rope_pos_ids_inplace",
       "apply_llama31_rope", "apply_llama31_rope_inplace", "apply_llama31_rope_pos_ids",
       "apply_llama31_rope_pos_ids_inplace", "apply_rope_with_cos_sin_cache",
       "apply_rope_with_cos_sin_cache_inplace")
HQ, HK, HEAD_DIM = 32, 8, 128
THETA, LLAMA31 = 1e4, dict(rope_scale=8.0, rope_theta=5e5, low_freq_factor=1.0, high_freq_factor=4.0,
                           old_context_len=8192)
SHORT = {"bfloat16": "bf16", "float16": "fp16"}
MAX_POS = 8192 + 512              # positions stay below this (the cos_sin_cache's rows)


def rope_bytes(op: str, nnz: int, rotary_dim: int, itemsize: int, batch: int) -> int:
    """Bytes an op must move: q and k read once and written once (returning forms: whole heads, the
    elements past rotary_dim are copied; in-place forms: the rotary part only), plus position metadata."""
    dims = rotary_dim if op.endswith("_inplace") else HEAD_DIM
    qk = 2 * nnz * (HQ + HK) * dims * itemsize                        # read + written
    if "cos_sin_cache" in op:
        return qk + nnz * 8 + nnz * rotary_dim * 4                    # int64 positions; a float32 cache row each
    if "pos_ids" in op:
        return qk + nnz * 4                                           # int32 pos_ids
    return qk + (2 * batch + 1) * 4                                   # int32 indptr and offsets


def inv_freq(op: str, rotary_dim: int) -> np.ndarray:
    """float64 (rotary_dim // 2,) angle per position: theta^(-2j/rotary_dim); Llama 3.1 smooths between the
    wavelengths old_context_len / factor (its published formula) and divides the low frequencies by scale."""
    theta = LLAMA31["rope_theta"] if "llama31" in op else THETA
    freq = theta ** (-2.0 * np.arange(rotary_dim // 2) / rotary_dim)
    if "llama31" not in op:
        return freq
    s, lo, hi, old = (LLAMA31[k] for k in ("rope_scale", "low_freq_factor", "high_freq_factor", "old_context_len"))
    wavelen = 2 * math.pi / freq
    smooth = np.clip((old / wavelen - lo) / (hi - lo), 0.0, 1.0)
    return (1 - smooth) * freq / s + smooth * freq


def positions(nnz: int, seed: int = 1):
    """(indptr, offsets, pos_ids) as int64 NumPy arrays: decode batch for nnz <= 256, else 512-token chunks."""
    rng = np.random.default_rng(seed)
    chunk = 1 if nnz <= 256 else 512
    lens = [min(chunk, nnz - i) for i in range(0, nnz, chunk)]
    indptr = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    offsets = rng.integers(0, MAX_POS - chunk, len(lens)).astype(np.int64)
    pos = np.concatenate([offsets[b] + np.arange(n) for b, n in enumerate(lens)]).astype(np.int64)
    return indptr, offsets, pos


def random_array(shape, dtype: str, seed: int):
    x = cp.empty(shape, cp.uint16)
    fill_random(x, dtype, seed)
    return x if dtype == "bfloat16" else x.view(cp.float16)


class Case:
    """The arrays of one (nnz, rotary_dim, dtype, op family): CuPy for cuattn, torch views of the same memory."""

    def __init__(self, nnz, rotary_dim, dtype, op, torch=None):
        self.nnz, self.rotary_dim, self.dtype, self.op = nnz, rotary_dim, dtype, op
        indptr, offsets, pos = positions(nnz)
        self.batch = len(offsets)
        self.q = random_array((nnz, HQ, HEAD_DIM), dtype, 1)
        self.k = random_array((nnz, HK, HEAD_DIM), dtype, 2)
        self.indptr, self.offsets = cp.asarray(indptr, cp.int32), cp.asarray(offsets, cp.int32)
        self.pos32, self.pos64 = cp.asarray(pos, cp.int32), cp.asarray(pos, cp.int64)
        ang = np.arange(MAX_POS, dtype=np.float64)[:, None] * inv_freq(op, rotary_dim)[None, :]
        self.cache = cp.asarray(np.concatenate([np.cos(ang), np.sin(ang)], axis=1), cp.float32)
        self.t = None
        if torch is not None:
            def tv(a):
                v = torch.from_dlpack(a)
                return v.view(torch.bfloat16) if a.dtype == cp.uint16 else v
            self.t = {name: tv(getattr(self, name)) for name in
                      ("q", "k", "indptr", "offsets", "pos32", "pos64", "cache")}
            self.t["inv_freq"] = torch.tensor(inv_freq(op, rotary_dim), dtype=torch.float32, device="cuda")

    def q2(self, a):     # (nnz, heads * head_dim): the form vLLM passes to the cos_sin_cache functions
        return a.reshape(a.shape[0], -1)


def kwargs(op: str, rotary_dim: int) -> dict:
    if "cos_sin_cache" in op:
        return {}
    kw = {"rotary_dim": rotary_dim, "interleave": False}
    if "llama31" in op:
        kw.update(LLAMA31)
    else:
        kw.update(rope_scale=1.0, rope_theta=THETA)
    return kw


def call(mod, op: str, c: Case, arrs: dict):
    """``mod.op`` (cuattn.rope or flashinfer) with FlashInfer's argument order on ``arrs``."""
    f = getattr(mod, op)
    kw = kwargs(op, c.rotary_dim)
    q, k = arrs["q"], arrs["k"]
    if "cos_sin_cache" in op:
        q2, k2, pos, cache = c.q2(q), c.q2(k), arrs["pos64"], arrs["cache"]
        return lambda: f(pos, q2, k2, HEAD_DIM, cache, True)
    if "pos_ids" in op:
        pos = arrs["pos32"]
        return lambda: f(q, k, pos, **kw)
    indptr, offsets = arrs["indptr"], arrs["offsets"]
    return lambda: f(q, k, indptr, offsets, **kw)


def torch_call(torch, op: str, c: Case):
    """Plain PyTorch rotation (NeoX pairs (j, j + r/2)), vLLM forward_native style."""
    t, r, h = c.t, c.rotary_dim, c.rotary_dim // 2
    inplace = op.endswith("_inplace")
    cache_form = "cos_sin_cache" in op

    def run():
        if cache_form:
            cos, sin = t["cache"][t["pos64"]].chunk(2, dim=-1)             # (nnz, r/2) each
        else:
            ang = t["pos32"].float()[:, None] * t["inv_freq"][None, :]
            cos, sin = ang.cos(), ang.sin()
        cos, sin = cos[:, None, :], sin[:, None, :]
        outs = []
        for x in (t["q"], t["k"]):
            x1, x2 = x[..., :h].float(), x[..., h:r].float()
            rot = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
            if inplace:
                x[..., :r] = rot
            else:
                outs.append(torch.cat((rot, x[..., r:]), dim=-1) if r < x.shape[-1] else rot)
        return None if inplace else tuple(outs)
    return run


def rel_err(got, ref) -> float:
    got = np.asarray(got, np.float64)
    ref = np.asarray(ref, np.float64)
    return float(np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30))


def to_f64(a, torch=None):
    """A result (CuPy array or torch tensor, possibly (nnz, H*D)) as float64 NumPy."""
    if torch is not None and isinstance(a, torch.Tensor):
        a = a.float().cpu().numpy()
        return a.astype(np.float64)
    host = cp.asnumpy(a)
    if host.dtype == np.uint16:
        host = host.view(arrays.bfloat16)
    return host.astype(np.float64)


def env_info(torch, flashinfer) -> dict:
    props = cp.cuda.runtime.getDeviceProperties(0)
    env = {"gpu": props["name"].decode(), "cc": cp.cuda.Device(0).compute_capability,
           "sms": props["multiProcessorCount"], "driver": cp.cuda.runtime.driverGetVersion(),
           "cuda_runtime": cp.cuda.runtime.runtimeGetVersion(), "nvrtc": "%d.%d" % jit.nvrtc_version(),
           "cupy": cp.__version__, "numpy": np.__version__, "cuattn": cuattn.__version__,
           "python": platform.python_version(), "date": datetime.date.today().isoformat(),
           "torch": getattr(torch, "__version__", None), "flashinfer": getattr(flashinfer, "__version__", None)}
    for k, v in env.items():
        print(f"{k:<13}{v}")
    return env


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nnz", type=int, nargs="+", default=[1, 64, 4096])
    p.add_argument("--rotary-dim", type=int, nargs="+", default=[128, 64])
    p.add_argument("--dtype", nargs="+", default=["bfloat16", "float16"], choices=["bfloat16", "float16"])
    p.add_argument("--ops", nargs="+", default=list(OPS), choices=OPS)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--no-flush", action="store_true")
    p.add_argument("--no-flashinfer", action="store_true")
    p.add_argument("--no-torch", action="store_true")
    p.add_argument("--copy-gbps", type=float, help="use this copy ceiling (GB/s) instead of measuring it")
    p.add_argument("--out")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    """Run the benchmark; returns (and with --out writes) {"env", "copy_gbps", "read_gbps", "rows", ...}."""
    args = parse_args(argv)
    if not arrays.gpu_available():
        sys.exit("bench_rope: no CUDA GPU visible to CuPy; this benchmark runs only on a GPU")
    torch = flashinfer = None
    if not (args.no_torch and args.no_flashinfer):
        try:
            import torch
        except ImportError as e:
            print(f"torch not importable ({e}); timing cuattn only")
    if torch is not None and not args.no_flashinfer:
        try:
            import flashinfer
            import flashinfer.rope  # noqa: F401
        except Exception as e:  # noqa: BLE001  (an ImportError, or its import-time probes failing)
            print(f"flashinfer not importable ({type(e).__name__}: {e}); timing cuattn and PyTorch only")
            flashinfer = None
    env = env_info(torch, flashinfer)
    read_gbps = None
    if args.copy_gbps:
        copy = args.copy_gbps
    else:
        read_tbs, copy_tbs = ceilings(20)
        read_gbps, copy = read_tbs * 1e3, copy_tbs * 1e3
    print(f"copy ceiling {copy:.0f} GB/s (1 GiB device-to-device, read + written)\n")
    flush = None if args.no_flush else l2_flush()
    out = {"env": env, "copy_gbps": copy, "read_gbps": read_gbps, "flush": not args.no_flush, "reps": args.reps,
           "heads": [HQ, HK, HEAD_DIM], "rows": []}

    def save():
        if args.out:
            Path(args.out).write_text(json.dumps(out, indent=1))
    head = (f"{'op':<38}{'dtype':>6}{'nnz':>6}{'rd':>5}{'µs':>9}{'GB/s':>7}{'%copy':>7}{'fi µs':>9}{'fi/us':>7}"
            f"{'torch µs':>10}{'t/us':>7}{'err fi':>9}{'err t':>9}")
    print(head)
    for dtype in args.dtype:
        for nnz in args.nnz:
            for rd in args.rotary_dim:
                for op in args.ops:
                    c = Case(nnz, rd, dtype, op, torch)
                    nbytes = rope_bytes(op, nnz, rd, 2, c.batch)
                    row = {"op": op, "dtype": dtype, "nnz": nnz, "rotary_dim": rd, "batch": c.batch, "bytes": nbytes}
                    cu_arrs = {"q": c.q, "k": c.k, "indptr": c.indptr, "offsets": c.offsets, "pos32": c.pos32,
                               "pos64": c.pos64, "cache": c.cache}
                    cu = call(rope, op, c, cu_arrs)
                    inplace = op.endswith("_inplace")
                    ref = None if inplace else [to_f64(a) for a in cu()]     # before any in-place call
                    us = time_events(cu, args.reps, flush, warmup=10)
                    row.update(us=us, gbps=nbytes / (us * 1e-6) / 1e9)
                    row["pct_copy"] = 100 * row["gbps"] / copy
                    line = (f"{op:<38}{SHORT[dtype]:>6}{nnz:>6}{rd:>5}{us:>9.2f}{row['gbps']:>7.0f}"
                            f"{row['pct_copy']:>7.1f}")
                    if flashinfer is not None:
                        try:
                            fi = call(flashinfer, op, c, c.t)
                            if ref is not None:
                                res = fi()
                                row["err_flashinfer"] = max(rel_err(to_f64(a, torch).reshape(r.shape), r)
                                                            for a, r in zip(res, ref))
                            row["flashinfer_us"] = time_events(fi, args.reps, flush, warmup=10)
                            line += f"{row['flashinfer_us']:>9.2f}{row['flashinfer_us'] / us:>7.2f}"
                        # its JIT may fail on the machine, or it may refuse a shape: record it, keep timing ours
                        except Exception as e:  # noqa: BLE001
                            row["flashinfer_error"] = f"{type(e).__name__}: {e}"[:300]
                            print(f"  flashinfer {op}: {row['flashinfer_error']}")
                            line += f"{'error':>9}{'':>7}"
                    else:
                        line += f"{'-':>9}{'':>7}"
                    if torch is not None and not args.no_torch:
                        tc = torch_call(torch, op, c)
                        if ref is not None:
                            res = tc()
                            row["err_torch"] = max(rel_err(to_f64(a, torch).reshape(r.shape), r)
                                                   for a, r in zip(res, ref))
                        row["torch_us"] = time_events(tc, args.reps, flush, warmup=10)
                        line += f"{row['torch_us']:>10.2f}{row['torch_us'] / us:>7.2f}"
                    else:
                        line += f"{'-':>10}{'':>7}"
                    for key in ("err_flashinfer", "err_torch"):
                        line += f"{row[key]:>9.1e}" if key in row else f"{'':>9}"
                    print(line, flush=True)
                    out["rows"].append(row)
                    save()
                    del c, cu, cu_arrs
    save()
    return out


if __name__ == "__main__":
    main()
