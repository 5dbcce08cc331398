"""Serving-op launch forms A/B (issue #13): layernorm, fused_add_rmsnorm, in-place cos_sin_cache RoPE.

In one process, every form of an op, a device copy of the same bytes and FlashInfer (when importable) are timed
in the same rounds on the same arrays.

Ops and their forms (the shipped form first):
- layernorm: the shipped form only (large calls with 16-byte accesses and hidden <= 8192: cuattn_layernorm_rows;
  session 17's A/B of its candidates: benchmarks/results/ops_notes_session17.md);
- fused_add_rmsnorm: the shipped form only (its ratio to FlashInfer in the same run);
- rope_cache_inplace: apply_rope_with_cos_sin_cache_inplace, q (rows, 32 x 128) and k (rows, 8 x 128), NeoX,
  rotary_dim 128, positions as bench_rope's (512-token chunks): the shipped form only (session 17's launch-grid
  candidates tok1 / split2 lost to it: ops_notes_session17.md; session 21's cos_sin_cache entry forms:
  ops_notes_session21.md); --hidden does not apply.

Timing: per case, --rounds rounds (default 5); in each round every candidate (forms, copy, FlashInfer) in turn:
10 warm-up calls, then --reps timed calls (default 30), each after an L2 flush (--flush read: bench_decode's
256 MB read, which leaves L2 clean, as bench_ops; write: 256 MB rewritten, dirty lines the timed call must write
back, as session 16's probe), CUDA events around the one call; a round keeps the median of its reps, the report
the median of the rounds'. Columns:
- % copy: copy µs / form µs; the copy (cudaMemcpyAsync, device to device) moves the bytes the op reads and writes
  (rows x hidden x itemsize each way, twice that for fused_add_rmsnorm, q and k for RoPE; weights, gamma and beta,
  positions and cos/sin rows left out);
- % 1GiB: the op's bytes per second over the 1 GiB copy ceiling (bench_norm_act.copy_gbps: what bench_ops'
  "% of copy" and the issue's 85% target are measured against);
- x FI: FlashInfer µs / form µs (> 1: the form is faster).
Before timing, every form's output is checked against a float64 reference over the whole array (the GPU
tests' tolerance, tests/test_norm.py); a form that fails is reported and not timed. The in-place ops
(fused_add_rmsnorm, the RoPE) are checked on fresh copies of their inputs as they were before any call, against a
reference computed from those, and timed on live buffers that drift from call to call (values, not bytes or
work); the live buffers are restored before each candidate's round, so that every candidate starts from the
same values. Each form's geometry (entry, threads a row, rows a block, block, grid, blocks an SM, registers,
local memory bytes) is printed. Runs only where CuPy sees a GPU.

    python benchmarks/bench_norm_ab.py [--ops layernorm fused_add_rmsnorm rope_cache_inplace] [--forms wave tok1 ...]
        [--dtypes bfloat16 float16]
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

import bench_rope  # noqa: E402
from bench_decode import l2_flush  # noqa: E402
from bench_norm_act import copy_gbps, print_env, random_array  # noqa: E402
from cuattn import arrays, jit, norm, rope  # noqa: E402

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
    check: Callable[[str], float] | None = None   # form -> worst error over its tolerance (<= 1: passes)
    geometry: Callable[[str], dict] | None = None   # form -> its launch (after a call)
    reset: Callable[[], None] | None = None       # in-place ops: the live buffers back to their first values
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


def short(dtype: str) -> str:
    return arrays.SHORT_NAME[arrays.as_dtype(dtype, "dtype", "bench_norm_ab")]


def launch_info(spec, entry: str, device: int, grid, block: int, resident: int, **more) -> dict:
    sms = cp.cuda.Device(device).attributes["MultiProcessorCount"]
    return {"spec": spec.name, "entry": entry, "grid": grid, "block": block, "blocks_per_sm": resident // sms,
            **more, **function_resources(spec, entry, device)}


def layernorm_geometry(dtype: str, rows: int, hidden: int, device: int) -> dict:
    """The launch norm.layernorm makes for a call on fresh contiguous arrays (16-byte accesses where hidden % 8
    == 0)."""
    spec = norm.NormSpec(short(dtype))
    entry, threads, per_block, block = spec.layernorm_geometry(hidden, rows, hidden % 8 == 0)
    resident = norm._resident_blocks(spec, entry, device, block)
    return launch_info(spec, entry, device, -(-rows // per_block), block, resident, threads_per_row=threads,
                       rows_per_block=per_block)


def fused_add_geometry(dtype: str, rows: int, hidden: int, device: int) -> dict:
    spec = norm.fused_add_spec(short(dtype), hidden, rows)
    entry, threads = norm.fused_add_entry(spec.dtype, hidden, rows, 1), spec.threads(hidden, rows)
    resident = norm._resident_blocks(spec, entry, device, threads)
    grid = min(rows, resident) if entry == "cuattn_fused_add_rmsnorm_regs" else rows
    return launch_info(spec, entry, device, grid, threads, resident, threads_per_row=threads, rows_per_block=1)


def rope_geometry(dtype: str, nnz: int, form: str, device: int) -> dict:
    spec = rope.RopeSpec(short(dtype))     # (one form: the shipped grid)
    strides = [2 * bench_rope.HQ * bench_rope.HEAD_DIM, 2 * bench_rope.HEAD_DIM,
               2 * bench_rope.HK * bench_rope.HEAD_DIM, 2 * bench_rope.HEAD_DIM] * 2      # in place: out = in
    layout = rope._vector_layout(ROPE_DIM, bench_rope.HEAD_DIM, False, False, strides)
    entry = "cuattn_rope_cache_neox"              # (the cos_sin_cache entry: 8 pairs a lane, no tail)
    resident = rope._resident_blocks(spec, entry, device)
    grid = spec.grid(nnz, bench_rope.HQ + bench_rope.HK, resident)
    return launch_info(spec, entry, device, grid, 128, resident, lanes_per_row=layout.lanes_per_row)


# ---------------------------------------------------------------------------- cases


def layernorm_case(dtype: str, rows: int, hidden: int, forms: list[str], use_fi: bool) -> Case:
    itemsize = 2
    x = random_array((rows, hidden), dtype, 1)
    g = cp.asarray(np.random.default_rng(2).standard_normal(hidden), cp.float32)
    b = cp.asarray(np.random.default_rng(3).standard_normal(hidden), cp.float32)
    eps = 1e-6
    case = Case("layernorm", dtype, rows, hidden, op_bytes=2 * rows * hidden * itemsize + 2 * hidden * 4,
                copy_bytes=rows * hidden * itemsize)
    case.forms["shipped"] = lambda: norm.layernorm(x, g, b, eps)
    ref = layernorm64(host_values(x, dtype), cp.asnumpy(g), cp.asnumpy(b), eps)

    def check(form: str) -> float:
        return worst_over_tolerance(host_values(case.forms[form](), dtype), ref, dtype)
    case.check = check
    case.geometry = lambda form: layernorm_geometry(dtype, rows, hidden, cp.cuda.Device().id)
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


def fused_add_case(dtype: str, rows: int, hidden: int, forms: list[str], use_fi: bool) -> Case:
    """fused_add_rmsnorm in place on the same live arrays every call (values drift, bytes and work do not); checked
    on fresh copies of the first values (x0, r0), against float64 from those."""
    itemsize, eps = 2, 1e-6
    x, r, w = random_array((rows, hidden), dtype, 1), random_array((rows, hidden), dtype, 3), \
        random_array((hidden,), dtype, 2)
    x0, r0 = x.copy(), r.copy()                  # before any call (FlashInfer's first one below included)
    case = Case("fused_add_rmsnorm", dtype, rows, hidden, op_bytes=4 * rows * hidden * itemsize + hidden * itemsize,
                copy_bytes=2 * rows * hidden * itemsize)
    case.forms["shipped"] = lambda: norm.fused_add_rmsnorm(x, r, w, eps)
    total = host_values(x0, dtype).astype(np.float64) + host_values(r0, dtype).astype(np.float64)
    w64 = host_values(w, dtype).astype(np.float64)
    ref_x = total / np.sqrt(np.mean(total * total, axis=-1, keepdims=True) + eps) * w64

    def check(form: str) -> float:
        xs, rs = x0.copy(), r0.copy()
        norm.fused_add_rmsnorm(xs, rs, w, eps)     # the one form, "shipped"
        return max(worst_over_tolerance(host_values(rs, dtype), total, dtype),
                   worst_over_tolerance(host_values(xs, dtype), ref_x, dtype))

    def reset() -> None:
        cp.copyto(x, x0)
        cp.copyto(r, r0)
    case.check, case.reset = check, reset
    case.geometry = lambda form: fused_add_geometry(dtype, rows, hidden, cp.cuda.Device().id)
    if use_fi:
        try:
            import flashinfer
            import torch

            def t(a):
                v = torch.from_dlpack(a)
                return v.view(torch.bfloat16) if dtype == "bfloat16" else v
            tx, tr, tw = t(x), t(r), t(w)
            case.flashinfer = lambda: flashinfer.norm.fused_add_rmsnorm(tx, tr, tw, eps)
            case.flashinfer()
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001  (record, go on)
            case.flashinfer, case.flashinfer_error = None, f"{type(e).__name__}: {e}"[:160]
    return case


ROPE_OP, ROPE_DIM = "apply_rope_with_cos_sin_cache_inplace", 128


def rope_case(dtype: str, rows: int, hidden: int, forms: list[str], use_fi: bool) -> Case:
    """The in-place cos_sin_cache RoPE on the same live q / k every call; checked on fresh copies of their first
    values (q0, k0), against float64 from those."""
    torch = None
    if use_fi:
        try:
            import torch
        except ImportError:
            torch = None
    c = bench_rope.Case(rows, ROPE_DIM, dtype, ROPE_OP, torch)
    q0, k0 = c.q.copy(), c.k.copy()               # before any call (FlashInfer's first one below included)
    qk_bytes = rows * (bench_rope.HQ + bench_rope.HK) * bench_rope.HEAD_DIM * 2
    case = Case("rope_cache_inplace", dtype, rows, bench_rope.HEAD_DIM,
                op_bytes=bench_rope.rope_bytes(ROPE_OP, rows, ROPE_DIM, 2, c.batch), copy_bytes=qk_bytes)

    def in_form(form: str, arrs: dict):
        return bench_rope.call(rope, ROPE_OP, c, arrs)
    live = {"q": c.q, "k": c.k, "pos64": c.pos64, "cache": c.cache}
    for form in forms:
        case.forms[form] = in_form(form, live)
    pos = cp.asnumpy(c.pos64)
    cache = cp.asnumpy(c.cache).astype(np.float64)
    cos, sin, h = cache[pos, None, :ROPE_DIM // 2], cache[pos, None, ROPE_DIM // 2:], ROPE_DIM // 2

    def rotated(x):                  # NeoX pairs (j, j + 64) of every head row, float64
        x = x.astype(np.float64)
        return np.concatenate([x[..., :h] * cos - x[..., h:] * sin, x[..., h:] * cos + x[..., :h] * sin], axis=-1)
    ref_q, ref_k = rotated(host_values(q0, dtype)), rotated(host_values(k0, dtype))

    def check(form: str) -> float:
        qs, ks = q0.copy(), k0.copy()
        in_form(form, {"q": qs, "k": ks, "pos64": c.pos64, "cache": c.cache})()
        return max(worst_over_tolerance(host_values(qs, dtype), ref_q, dtype),
                   worst_over_tolerance(host_values(ks, dtype), ref_k, dtype))

    def reset() -> None:                          # in place: FlashInfer's torch views of c.q / c.k stay valid
        cp.copyto(c.q, q0)
        cp.copyto(c.k, k0)
    case.check, case.reset = check, reset
    case.geometry = lambda form: rope_geometry(dtype, rows, form, cp.cuda.Device().id)
    if torch is not None:
        try:
            import flashinfer
            case.flashinfer = bench_rope.call(flashinfer.rope, ROPE_OP, c, c.t)
            case.flashinfer()
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001  (record, go on)
            case.flashinfer, case.flashinfer_error = None, f"{type(e).__name__}: {e}"[:160]
    return case


CASES = {"layernorm": layernorm_case, "fused_add_rmsnorm": fused_add_case, "rope_cache_inplace": rope_case}
FORMS = {"layernorm": ["shipped"], "fused_add_rmsnorm": ["shipped"], "rope_cache_inplace": ["shipped"]}


def specs_of(op: str, dtype: str, form: str) -> list:
    """The specs a form of an op launches (compiled before the timing starts)."""
    if op == "rope_cache_inplace":
        return [rope.RopeSpec(dtype)]
    return [s for s in norm.shipped_specs() if s.dtype == dtype]


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


def run_case(case: Case, rounds: int, reps: int, flush, ceiling_gbps: float) -> dict:
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
            entry["geometry"] = case.geometry(form)
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
            if case.reset is not None:
                case.reset()                  # in-place ops: each candidate's round from the same values
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
        shape = (f"{g['threads_per_row']} thr/row x {g['rows_per_block']} rows, " if "threads_per_row" in g
                 else f"{g['lanes_per_row']} lanes/row, ")
        print(f"  {form:<12}{e['us']:8.2f} µs {e['pct_copy']:6.1f}% copy {e['pct_1gib']:6.1f}% 1GiB  x FI {xfi}"
              f"  x {shipped} {vs}  err/tol {e['worst_over_tol']:.2f}   {g['entry']} {shape}block {g['block']}, "
              f"grid {g['grid']}, {g['blocks_per_sm']}/SM, {g['registers']} regs, {g['local_bytes']} B local")


def prebuild_flashinfer(ops: list[str]) -> list:
    """FlashInfer's JIT builds of the modules the cases call (norm, rope), one thread each, while cuattn's
    kernels compile and the ceiling is measured (bench_ops.prebuild_flashinfer's way; a failure is printed and
    the case's FlashInfer call records its own error)."""
    import threading
    from flashinfer.jit.norm import gen_norm_module
    from flashinfer.jit.rope import gen_rope_module
    gens = {"norm": gen_norm_module} if {"layernorm", "fused_add_rmsnorm"} & set(ops) else {}
    if "rope_cache_inplace" in ops:
        gens["rope"] = gen_rope_module

    def build(name, gen):
        try:
            gen().build(verbose=False)
        except Exception as e:  # noqa: BLE001
            print(f"[flashinfer JIT] {name} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
    threads = [threading.Thread(target=build, args=item, daemon=True) for item in gens.items()]
    for t in threads:
        t.start()
    return threads


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
    builds = prebuild_flashinfer(args.ops) if use_fi else []
    device = cp.cuda.Device().id
    arch = jit.device_arch(device)
    forms = {op: [f for i, f in enumerate(FORMS[op]) if i == 0 or not args.forms or f in args.forms]
             for op in args.ops}                      # the shipped form (first) always: the ratios' base
    jobs = list({s.name: (s, arch) for op in args.ops for d in args.dtypes for f in forms[op]
                 for s in specs_of(op, short(d), f)}.values())
    print(f"compiled {jit.precompile(jobs)} of {len(jobs)} specs (the rest from the disk cache)")
    ceiling = copy_gbps(20)
    print(f"copy ceiling {ceiling:.0f} GB/s (1 GiB device-to-device, read + written); L2 flush: {args.flush}; "
          f"{args.rounds} rounds x {args.reps} reps, median of round medians\n")
    flush = l2_flush(args.flush)
    for t in builds:
        t.join()
    results = []
    for op in args.ops:
        for dtype in args.dtypes:
            for hidden in ([bench_rope.HEAD_DIM] if op == "rope_cache_inplace" else args.hidden):
                for rows in args.rows:
                    case = CASES[op](dtype, rows, hidden, forms[op], use_fi)
                    r = run_case(case, args.rounds, args.reps, flush, ceiling)
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
