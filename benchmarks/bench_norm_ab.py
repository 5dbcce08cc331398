"""A/B of the launch forms of the serving norms in one process (issue #13): every form of an op, a device copy of
the same bytes and FlashInfer (when importable) timed in the same rounds on the same arrays.

Ops and their forms (the shipped form first):
- layernorm: cuattn.norm.LAYERNORM_FORMS (NormSpec.ln), for large calls with 16-byte accesses, hidden <= 8192.

Timing: per case, --rounds rounds (default 5); in each round every candidate (forms, copy, FlashInfer) in turn:
10 warm-up calls, then --reps timed calls (default 30), each after an L2 flush (--flush read: bench_decode's
256 MB read, which leaves L2 clean, as bench_ops; write: 256 MB rewritten, dirty lines the timed call must write
back, as session 16's probe), CUDA events around the one call; a round keeps the median of its reps, the report
the median of the rounds'. Columns:
- % copy: copy µs / form µs; the copy (cudaMemcpyAsync, device to device) moves the bytes the op reads and writes
  (rows x hidden x itemsize, each way; layernorm's gamma and beta, 2 x hidden x 4 bytes, left out);
- % 1GiB: the op's bytes per second over the 1 GiB copy ceiling (bench_norm_act.copy_gbps: what bench_ops'
  "% of copy" and the issue's 85% target are measured against);
- x FI: FlashInfer µs / form µs (> 1: the form is faster).
Before timing, every form's output is checked against a float64 reference over the whole array (the GPU
tests' tolerance, tests/test_norm.py); a form that fails is reported and not timed. Each form's geometry
(entry, threads a row, rows a block, block, grid, blocks an SM, registers, local memory bytes) is printed.
Runs only where CuPy sees a GPU.

    python benchmarks/bench_norm_ab.py [--ops layernorm] [--forms pipe rows ...] [--dtypes bfloat16 float16]
        [--rows 4096] [--hidden 4096 8192] [--rounds 5] [--reps 30] [--flush read|write] [--no-flashinfer]
        [--out ab.json]
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import cupy as cp  # noqa: E402

from bench_decode import l2_flush  # noqa: E402
from bench_norm_act import copy_gbps, print_env, random_array  # noqa: E402
from cuattn import arrays, jit, norm  # noqa: E402

TOL = {"bfloat16": 1e-2, "float16": 2e-3}      # tests/test_norm.py's TOL
WARMUP = 10


@dataclass
class Case:
    """One op at one shape: its candidates (name -> call), the bytes it moves, and how to check a form."""
    op: str
    dtype: str
    rows: int
    hidden: int
    op_bytes: int                                 # every input read once, every output written once
    copy_bytes: int                               # what the same-bytes copy moves each way
    forms: dict[str, Callable] = field(default_factory=dict)
    geometry: dict[str, dict] = field(default_factory=dict)
    check: Callable[[str], float] | None = None   # form -> worst error over its tolerance (<= 1: passes)
    flashinfer: Callable | None = None
    flashinfer_error: str | None = None


# ---------------------------------------------------------------------------- float64 reference and check


def worst_over_tolerance(got: np.ndarray, ref: np.ndarray, dtype: str) -> float:
    """max |got - ref| / (tol * (|ref| + rms(ref))) over every element (tests/test_norm.assert_close's bound);
    inf where got is not finite (an unwritten or poisoned element)."""
    got, ref = got.astype(np.float64), ref.astype(np.float64)
    if not np.all(np.isfinite(got)):
        return math.inf
    scale = math.sqrt(np.mean(ref * ref))
    return float(np.max(np.abs(got - ref) / (TOL[dtype] * (np.abs(ref) + scale))))


def host_values(x, dtype: str) -> np.ndarray:
    logical = arrays.as_dtype(dtype, "dtype", "bench_norm_ab")
    h = cp.asnumpy(x)
    return h.view(logical) if h.dtype == np.uint16 else h


def layernorm64(x: np.ndarray, gamma: np.ndarray, beta: np.ndarray, eps: float) -> np.ndarray:
    x = x.astype(np.float64)
    mean = x.mean(axis=-1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * gamma.astype(np.float64) + beta.astype(np.float64)


# ---------------------------------------------------------------------------- geometry


def function_resources(spec, entry: str, device: int) -> dict:
    """Registers and local (spill) bytes a compiled entry uses, from the driver (NVRTC 13 on the GPU hosts
    prints no ptxas log)."""
    f = jit.get_function(spec, entry, device)
    drv = cp.cuda.driver
    return {"registers": drv.funcGetAttribute(drv.CU_FUNC_ATTRIBUTE_NUM_REGS, f.ptr),
            "local_bytes": drv.funcGetAttribute(drv.CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES, f.ptr)}


def layernorm_geometry(dtype: str, rows: int, hidden: int, form: str, device: int) -> dict:
    """The launch norm.layernorm makes for an aligned call in ``form`` (after one call: the launcher's
    attributes, such as the raised shared-memory limit, are set)."""
    spec = norm.NormSpec(arrays.SHORT_NAME[arrays.as_dtype(dtype, "dtype", "bench_norm_ab")], ln=form)
    entry, threads, per_block, block, smem = spec.layernorm_geometry(hidden, rows, True)
    resident = norm._resident_blocks(spec, entry, device, block, smem)
    tiles = -(-rows // per_block)
    grid = min(tiles, resident) if smem else tiles
    sms = cp.cuda.Device(device).attributes["MultiProcessorCount"]
    return {"spec": spec.name, "entry": entry, "threads_per_row": threads, "rows_per_block": per_block,
            "block": block, "smem": smem, "grid": grid, "blocks_per_sm": resident // sms,
            **function_resources(spec, entry, device)}


# ---------------------------------------------------------------------------- cases


def layernorm_case(dtype: str, rows: int, hidden: int, forms: list[str], use_fi: bool) -> Case:
    itemsize = 2
    x = random_array((rows, hidden), dtype, 1)
    g = cp.asarray(np.random.default_rng(2).standard_normal(hidden), cp.float32)
    b = cp.asarray(np.random.default_rng(3).standard_normal(hidden), cp.float32)
    eps = 1e-6
    case = Case("layernorm", dtype, rows, hidden, op_bytes=2 * rows * hidden * itemsize + 2 * hidden * 4,
                copy_bytes=rows * hidden * itemsize)
    for form in forms:
        case.forms[form] = (lambda f=form: norm._layernorm(x, g, b, eps, None, f))
    ref = layernorm64(host_values(x, dtype), cp.asnumpy(g), cp.asnumpy(b), eps)

    def check(form: str) -> float:
        return worst_over_tolerance(host_values(case.forms[form](), dtype), ref, dtype)
    case.check = check
    if use_fi:
        try:
            import flashinfer
            import torch
            tx = torch.from_dlpack(x)
            tx = tx.view(torch.bfloat16) if dtype == "bfloat16" else tx
            tg, tb = torch.from_dlpack(g), torch.from_dlpack(b)
            case.flashinfer = lambda: flashinfer.norm.layernorm(tx, tg, tb, eps)
            case.flashinfer()
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001  (FlashInfer takes bf16 only; its JIT may fail: record, go on)
            case.flashinfer, case.flashinfer_error = None, f"{type(e).__name__}: {e}"[:160]
    return case


CASES = {"layernorm": layernorm_case}
FORMS = {"layernorm": list(norm.LAYERNORM_FORMS)}
SPEC_OF_FORM = {"layernorm": lambda dtype, form: norm.NormSpec(dtype, ln=form)}


# ---------------------------------------------------------------------------- timing


def time_round(fn, reps: int, flush) -> float:
    """Median µs of ``reps`` calls of ``fn``, each after ``flush``, CUDA events around the call."""
    for _ in range(WARMUP):
        fn()
    start, end = cp.cuda.Event(), cp.cuda.Event()
    times = []
    for _ in range(reps):
        flush()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, end) * 1e3)
    return statistics.median(times)


def run_case(case: Case, rounds: int, reps: int, flush, ceiling_gbps: float, device: int) -> dict:
    src = cp.empty(case.copy_bytes, cp.uint8)
    dst = cp.empty_like(src)
    stream = cp.cuda.get_current_stream()
    candidates = {}
    result = {"op": case.op, "dtype": case.dtype, "rows": case.rows, "hidden": case.hidden,
              "op_bytes": case.op_bytes, "copy_bytes": case.copy_bytes, "forms": {}}
    for form, call in case.forms.items():
        entry = result["forms"].setdefault(form, {})
        try:
            entry["worst_over_tol"] = case.check(form)
            entry["geometry"] = layernorm_geometry(case.dtype, case.rows, case.hidden, form, device)
        except Exception as e:  # noqa: BLE001  (a compile or launch failure of one form: report, time the others)
            entry["error"] = f"{type(e).__name__}: {e}"[:300]
            traceback.print_exc()
            continue
        if entry["worst_over_tol"] <= 1:
            candidates[form] = call
        else:
            entry["error"] = f"wrong result: worst error {entry['worst_over_tol']:.3g} x the tolerance; not timed"
    candidates["copy"] = lambda: cp.cuda.runtime.memcpyAsync(dst.data.ptr, src.data.ptr, case.copy_bytes,
                                                             cp.cuda.runtime.memcpyDeviceToDevice, stream.ptr)
    if case.flashinfer is not None:
        candidates["flashinfer"] = case.flashinfer
    medians = {k: [] for k in candidates}
    for _ in range(rounds):
        for name, fn in candidates.items():
            medians[name].append(time_round(fn, reps, flush))
    us = {k: statistics.median(v) for k, v in medians.items()}
    result["round_medians"], result["us"] = medians, us
    for form, entry in result["forms"].items():
        if form in us:
            entry["us"] = us[form]
            entry["pct_copy"] = 100 * us["copy"] / us[form]
            entry["pct_1gib"] = 100 * case.op_bytes / (us[form] * 1e-6) / 1e9 / ceiling_gbps
            entry["x_flashinfer"] = us["flashinfer"] / us[form] if "flashinfer" in us else None
    if case.flashinfer_error:
        result["flashinfer_error"] = case.flashinfer_error
    return result


def print_case(r: dict, shipped: str) -> None:
    us = r["us"]
    fi = f"FlashInfer {us['flashinfer']:.2f} µs" if "flashinfer" in us else f"FlashInfer: {r.get('flashinfer_error')}"
    print(f"{r['op']} {r['dtype']} {r['rows']}x{r['hidden']}: copy {us['copy']:.2f} µs "
          f"({2 * r['copy_bytes'] / (us['copy'] * 1e-6) / 1e9:.0f} GB/s), {fi}")
    for form, e in r["forms"].items():
        if "us" not in e:
            print(f"  {form:<12} {e.get('error', '?')}")
            continue
        g = e["geometry"]
        xfi = f"{e['x_flashinfer']:5.2f}" if e["x_flashinfer"] else "  -  "
        vs = f"{us[shipped] / e['us']:6.3f}" if shipped in us else "   -  "
        print(f"  {form:<12}{e['us']:8.2f} µs {e['pct_copy']:6.1f}% copy {e['pct_1gib']:6.1f}% 1GiB  x FI {xfi}"
              f"  x {shipped} {vs}  err/tol {e['worst_over_tol']:.2f}   {g['entry']} {g['threads_per_row']} thr/row x "
              f"{g['rows_per_block']} rows, block {g['block']}, grid {g['grid']}, {g['blocks_per_sm']}/SM, "
              f"{g['registers']} regs, {g['local_bytes']} B local, smem {g['smem'] // 1024} KB")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ops", nargs="+", default=list(CASES), choices=list(CASES))
    p.add_argument("--forms", nargs="+", help="forms to time (default: every form of each op)")
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float16"], choices=["bfloat16", "float16"])
    p.add_argument("--rows", type=int, nargs="+", default=[4096])
    p.add_argument("--hidden", type=int, nargs="+", default=[4096, 8192])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--flush", choices=["read", "write"], default="read")
    p.add_argument("--no-flashinfer", action="store_true")
    p.add_argument("--out")
    args = p.parse_args(argv)
    if not arrays.gpu_available():
        sys.exit("bench_norm_ab: no CUDA GPU visible to CuPy; this benchmark runs only on a GPU")
    use_fi = not args.no_flashinfer
    if use_fi:
        try:
            import flashinfer  # noqa: F401
            import torch  # noqa: F401
        except ImportError as e:
            print(f"FlashInfer not timed: {e}")
            use_fi = False
    env = print_env(use_fi)
    device = cp.cuda.Device().id
    arch = jit.device_arch(device)
    forms = {op: [f for f in FORMS[op] if not args.forms or f in args.forms] for op in args.ops}
    jobs = [(SPEC_OF_FORM[op](arrays.SHORT_NAME[arrays.as_dtype(d, "dtype", "bench")], f), arch)
            for op in args.ops for d in args.dtypes for f in forms[op]]
    print(f"compiled {jit.precompile(jobs)} of {len(jobs)} specs (the rest from the disk cache)")
    ceiling = copy_gbps(20)
    print(f"copy ceiling {ceiling:.0f} GB/s (1 GiB device-to-device, read + written); L2 flush: {args.flush}; "
          f"{args.rounds} rounds x {args.reps} reps, median of round medians\n")
    flush = l2_flush(args.flush)
    results = []
    for op in args.ops:
        for dtype in args.dtypes:
            for hidden in args.hidden:
                for rows in args.rows:
                    case = CASES[op](dtype, rows, hidden, forms[op], use_fi)
                    r = run_case(case, args.rounds, args.reps, flush, ceiling, device)
                    print_case(r, FORMS[op][0])
                    results.append(r)
                    del case
    print("\nsummary (µs; % of a same-bytes copy / of the 1 GiB copy ceiling; x FlashInfer)")
    for r in results:
        best = min((f for f in r["forms"] if "us" in r["forms"][f]), key=lambda f: r["forms"][f]["us"], default=None)
        cells = "  ".join(f"{f} {e['us']:.2f} ({e['pct_copy']:.1f}/{e['pct_1gib']:.1f}"
                          + (f", {e['x_flashinfer']:.2f}x" if e["x_flashinfer"] else "") + ")"
                          for f, e in r["forms"].items() if "us" in e)
        print(f"{r['op']} {r['dtype']} {r['rows']}x{r['hidden']}: best {best}; {cells}")
    if args.out:
        Path(args.out).write_text(json.dumps({"env": env, "copy_ceiling_gbps": ceiling, "flush": args.flush,
                                              "rounds": args.rounds, "reps": args.reps, "cases": results}, indent=1))


if __name__ == "__main__":
    main()
