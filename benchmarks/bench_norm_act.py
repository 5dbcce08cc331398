"""Norms and gated activations (cuattn.norm, cuattn.activation): latency and achieved bandwidth.

Timing: CUDA events around each call, L2 flushed before every timed call (256 MB read, as
bench_decode; --no-flush keeps L2 warm), 10 warm-up + N timed calls (default 50), median reported.
GB/s = 1e9 bytes/s over the bytes each op must move (``op_bytes``: every input read once, every
output written once). The ceiling is a device-to-device copy (1 GiB, bytes read + written) measured
in the same process. FlashInfer (--flashinfer, needs PyTorch and flashinfer importable; its first
call JIT-compiles) is timed the same way on the same arrays through DLPack.
Runs only where CuPy sees a GPU.

    python benchmarks/bench_norm_act.py [--rows 1 16 256 4096 16384] [--hidden 4096 8192 16384 4099]
        [--dtype bfloat16|float16] [--ops rmsnorm fused_add_rmsnorm ...] [--reps 50] [--check]
        [--flashinfer] [--latency-elements N] [--out results.json]

(Session 12's interleaved A/B of launch forms, --ab, went with the rejected forms: see
benchmarks/results/ops_notes_session12.md; the code is in git history.)
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import cupy as cp  # noqa: E402

import cuattn  # noqa: E402
from cuattn import activation, arrays, jit, norm  # noqa: E402
from bench_decode import fill_random, l2_flush, time_events  # noqa: E402

OPS = ("rmsnorm", "gemma_rmsnorm", "fused_add_rmsnorm", "layernorm", "silu_and_mul", "gelu_and_mul",
       "gelu_tanh_and_mul")


def op_bytes(op: str, rows: int, hidden: int, itemsize: int) -> int:
    """Bytes an op must move; for activations ``hidden`` is d (input rows hold 2 * d)."""
    if op in ("rmsnorm", "gemma_rmsnorm"):
        return 2 * rows * hidden * itemsize + hidden * itemsize      # x read, out written; weight read
    if op == "fused_add_rmsnorm":
        return 4 * rows * hidden * itemsize + hidden * itemsize      # input, residual each read and written
    if op == "layernorm":
        return 2 * rows * hidden * itemsize + 2 * hidden * 4          # x read, out written; fp32 gamma, beta
    return 3 * rows * hidden * itemsize                               # gate and up read, out written


def print_env(use_flashinfer: bool) -> dict:
    props = cp.cuda.runtime.getDeviceProperties(0)
    env = {"gpu": props["name"].decode(), "cc": cp.cuda.Device(0).compute_capability,
           "sms": props["multiProcessorCount"], "driver": cp.cuda.runtime.driverGetVersion(),
           "cuda_runtime": cp.cuda.runtime.runtimeGetVersion(), "nvrtc": "%d.%d" % jit.nvrtc_version(),
           "cupy": cp.__version__, "numpy": np.__version__, "cuattn": cuattn.__version__,
           "python": platform.python_version(), "date": datetime.date.today().isoformat()}
    if use_flashinfer:
        import flashinfer
        import torch
        env.update(flashinfer=flashinfer.__version__, torch=torch.__version__)
    for k, v in env.items():
        print(f"{k:<13}{v}")
    return env


def copy_gbps(reps: int) -> float:
    """Device-to-device copy of 1 GiB: bytes read + written per second / 1e9."""
    src = cp.empty(1 << 30, cp.uint8)
    dst = cp.empty_like(src)
    us = time_events(lambda: cp.cuda.runtime.memcpyAsync(dst.data.ptr, src.data.ptr, src.nbytes,
                                                          cp.cuda.runtime.memcpyDeviceToDevice,
                                                          cp.cuda.get_current_stream().ptr), reps)
    return 2 * src.nbytes / (us * 1e-6) / 1e9


def random_array(shape, dtype: str, seed: int):
    x = cp.empty(shape, cp.uint16)
    fill_random(x, dtype, seed)
    return x if dtype == "bfloat16" else x.view(cp.float16)


def setup(op: str, rows: int, hidden: int, dtype: str):
    """(cuattn call, FlashInfer call or None-maker, arrays) for one shape."""
    if op in ("silu_and_mul", "gelu_and_mul", "gelu_tanh_and_mul"):
        x = random_array((rows, 2 * hidden), dtype, 1)
        out = cp.empty((rows, hidden), x.dtype)
        f = getattr(activation, op)
        return (lambda: f(x, out=out)), {"input": x, "out": out}
    x = random_array((rows, hidden), dtype, 1)
    if op == "layernorm":
        g = cp.asarray(np.random.default_rng(2).standard_normal(hidden), cp.float32)
        b = cp.asarray(np.random.default_rng(3).standard_normal(hidden), cp.float32)
        return (lambda: norm.layernorm(x, g, b)), {"input": x, "gemma": g, "beta": b}
    w = random_array((hidden,), dtype, 2)
    if op == "fused_add_rmsnorm":
        r = random_array((rows, hidden), dtype, 3)
        return (lambda: norm.fused_add_rmsnorm(x, r, w)), {"input": x, "residual": r, "weight": w}
    out = cp.empty_like(x)
    f = getattr(norm, op)
    return (lambda: f(x, w, out=out)), {"input": x, "weight": w, "out": out}


def flashinfer_call(op: str, dtype: str, arrs: dict):
    """The same op through FlashInfer on the same memory (torch views over the CuPy arrays)."""
    import flashinfer
    import torch

    def t(a):
        v = torch.from_dlpack(a)
        return v.view(torch.bfloat16) if dtype == "bfloat16" and a.dtype == cp.uint16 else v
    ta = {k: t(v) for k, v in arrs.items()}
    if op in ("silu_and_mul", "gelu_and_mul", "gelu_tanh_and_mul"):
        f = getattr(flashinfer.activation, op)
        return lambda: f(ta["input"], out=ta["out"])
    if op == "layernorm":
        return lambda: flashinfer.norm.layernorm(ta["input"], ta["gemma"], ta["beta"])
    if op == "fused_add_rmsnorm":
        return lambda: flashinfer.norm.fused_add_rmsnorm(ta["input"], ta["residual"], ta["weight"])
    f = getattr(flashinfer.norm, op)
    return lambda: f(ta["input"], ta["weight"], out=ta["out"])


def check(op: str, arrs: dict, dtype: str) -> float:
    """Relative error of the GPU result against cuattn's NumPy path on host copies of the inputs."""
    logical = arrays.as_dtype(dtype, "dtype", "check")
    host = {k: (cp.asnumpy(v).view(logical) if v.dtype in (cp.uint16, cp.float16) else cp.asnumpy(v))
            for k, v in arrs.items()}
    if op in ("silu_and_mul", "gelu_and_mul", "gelu_tanh_and_mul"):
        got, ref = arrs["out"], getattr(activation, op)(host["input"])
        getattr(activation, op)(arrs["input"], out=arrs["out"])
    elif op == "layernorm":
        got, ref = norm.layernorm(arrs["input"], arrs["gemma"], arrs["beta"]), \
            norm.layernorm(host["input"], host["gemma"], host["beta"])
    elif op == "fused_add_rmsnorm":
        norm.fused_add_rmsnorm(host["input"], host["residual"], host["weight"])
        norm.fused_add_rmsnorm(arrs["input"], arrs["residual"], arrs["weight"])
        got, ref = arrs["input"], host["input"]
    else:
        got, ref = getattr(norm, op)(arrs["input"], arrs["weight"]), getattr(norm, op)(host["input"], host["weight"])
    got = cp.asnumpy(got).view(logical).astype(np.float64)
    ref = np.asarray(ref).astype(np.float64)
    return float(np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16, 256, 4096, 16384])
    p.add_argument("--hidden", type=int, nargs="+", default=[4096, 8192, 16384, 4099],
                   help="hidden size of the norms; d of the activations")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--ops", nargs="+", default=list(OPS), choices=OPS)
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--no-flush", action="store_true")
    p.add_argument("--check", action="store_true", help="compare with the NumPy path (rows <= 256)")
    p.add_argument("--flashinfer", action="store_true")
    p.add_argument("--latency-elements", type=int, help="tuning: calls of at most this many elements (rows x "
                   "hidden) run the norms with a thread per 8 elements (cuattn.norm._LATENCY_ELEMENTS; 0: never)")
    p.add_argument("--out")
    args = p.parse_args(argv)
    if not arrays.gpu_available():
        sys.exit("bench_norm_act: no CUDA GPU visible to CuPy; this benchmark runs only on a GPU")
    if args.latency_elements is not None:
        norm._LATENCY_ELEMENTS = args.latency_elements
    env = print_env(args.flashinfer)
    env["latency_elements"] = norm._LATENCY_ELEMENTS
    ceiling = copy_gbps(20)
    print(f"copy ceiling {ceiling:.0f} GB/s (1 GiB device-to-device, read + written)\n")
    flush = None if args.no_flush else l2_flush()
    itemsize = 2
    head = f"{'op':<19}{'rows':>7}{'hidden':>8}{'µs':>9}{'GB/s':>8}{'%copy':>7}"
    head += f"{'fi µs':>9}{'fi/us':>7}" if args.flashinfer else ""
    head += f"{'rel_err':>10}" if args.check else ""
    print(head)
    rows_out = []
    for op in args.ops:
        for hidden in args.hidden:
            for rows in args.rows:
                call, arrs = setup(op, rows, hidden, args.dtype)
                us = time_events(call, args.reps, flush, warmup=10)
                gbps = op_bytes(op, rows, hidden, itemsize) / (us * 1e-6) / 1e9
                row = {"op": op, "rows": rows, "hidden": hidden, "dtype": args.dtype, "us": us, "gbps": gbps,
                       "pct_copy": 100 * gbps / ceiling}
                line = f"{op:<19}{rows:>7}{hidden:>8}{us:>9.2f}{gbps:>8.0f}{row['pct_copy']:>7.1f}"
                if args.flashinfer:
                    try:
                        fi = flashinfer_call(op, args.dtype, arrs)
                        row["flashinfer_us"] = time_events(fi, args.reps, flush, warmup=10)
                        line += f"{row['flashinfer_us']:>9.2f}{row['flashinfer_us'] / us:>7.2f}"
                    # FlashInfer refuses rows that are not 16-byte multiples (ValueError) and its JIT may
                    # fail otherwise: record either and keep timing ours
                    except Exception as e:   # noqa: BLE001
                        row["flashinfer_error"] = f"{type(e).__name__}: {e}"[:200]
                        line += f"{'refused':>9}{'':>7}"
                if args.check and rows <= 256:
                    row["rel_err"] = check(op, arrs, args.dtype)
                    line += f"{row['rel_err']:>10.1e}"
                print(line, flush=True)
                rows_out.append(row)
                del arrs, call
    if args.out:
        Path(args.out).write_text(json.dumps({"env": env, "copy_gbps": ceiling, "flush": not args.no_flush,
                                              "reps": args.reps, "rows": rows_out}, indent=1))


if __name__ == "__main__":
    main()
