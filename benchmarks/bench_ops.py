"""The serving ops around attention (RoPE, norms, gated activations, sampling): one driver that runs
bench_rope, bench_norm_act and bench_sampling at serving sizes in one process, next to FlashInfer and
plain PyTorch, and prints one table of ratios to the copy ceiling and to FlashInfer.

Timing: each section's own method (CUDA events, L2 flushed by a 256 MB read before every timed call,
10 warm-up + N timed calls, median; see each script's docstring). The read and copy ceilings are measured
once here (bench_decode.ceilings: 2 GiB read, 1 GiB device-to-device copy counting bytes read + written)
and every "%copy" below is against that copy ceiling. Sizes:

- rope (bench_rope): q/k of 1 / 64 / 4096 tokens x 32:8 heads x 128, rotary_dim 128 and 64, bf16 and fp16;
- norm_act (bench_norm_act): 1 / 64 / 4096 rows x hidden 4096 and 8192, bf16; bench_norm_act times no
  PyTorch, so the plain PyTorch versions (HF / vLLM forward_native style, fp32 statistics) are timed here
  on arrays of the same shapes;
- sampling (bench_sampling): vocab 128256, batch 1 / 64 / 256, top_k 50, top_p 0.9, min_p 0.1.

FlashInfer's modules JIT-compile on first use; they are built in background threads at the start (one
ninja each), while the ceilings and cuattn's kernels run. A FlashInfer function that fails prints the
reason in its row and the run goes on. Each section also writes its own JSON next to --out
(``<out>_rope.json`` ...), so a run cut short keeps what it measured. Runs only where CuPy sees a GPU.

    python benchmarks/bench_ops.py [--sections rope norm_act sampling] [--reps 30] [--no-flashinfer]
        [--out ops.json] [--md ops.md]
"""
from __future__ import annotations

import argparse
import json
import sys
import threading
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import cupy as cp  # noqa: E402

import bench_norm_act  # noqa: E402
import bench_rope  # noqa: E402
import bench_sampling  # noqa: E402
from bench_decode import ceilings, l2_flush, time_events  # noqa: E402
from cuattn import arrays  # noqa: E402

SECTIONS = ("rope", "norm_act", "sampling")
NORM_ROWS, NORM_HIDDEN = (1, 64, 4096), (4096, 8192)
SUMMARY_ROPE_NNZ, SUMMARY_NORM_ROWS = 4096, 4096
SHORT = bench_rope.SHORT


def prebuild_flashinfer() -> list:
    """Start FlashInfer's JIT builds of the modules the sections call, one thread each (nvcc via ninja;
    a later call of the same module waits on its file lock). Returns the threads."""
    from flashinfer.jit import gen_act_and_mul_module
    from flashinfer.jit.norm import gen_norm_module
    from flashinfer.jit.rope import gen_rope_module
    from flashinfer.jit.sampling import gen_sampling_module
    gens = {"rope": gen_rope_module, "norm": gen_norm_module, "sampling": gen_sampling_module,
            **{f"act_{a}": (lambda a=a: gen_act_and_mul_module(a)) for a in ("silu", "gelu", "gelu_tanh")}}

    def build(name, gen):
        t0 = time.perf_counter()
        try:
            gen().build(verbose=False)
            print(f"[flashinfer JIT] {name} built in {time.perf_counter() - t0:.0f} s", flush=True)
        except Exception as e:  # noqa: BLE001  (reported; the timed call will record its own error)
            print(f"[flashinfer JIT] {name} failed after {time.perf_counter() - t0:.0f} s: "
                  f"{type(e).__name__}: {str(e)[:300]}", flush=True)
    threads = [threading.Thread(target=build, args=item, daemon=True) for item in gens.items()]
    for t in threads:
        t.start()
    return threads


def torch_norm_act_call(torch, op: str, rows: int, hidden: int, dtype: str):
    """Plain PyTorch: fp32 statistics as HF's LlamaRMSNorm / GemmaRMSNorm, F.layer_norm, and vLLM's
    forward_native activations (act(x[:, :d]) * x[:, d:] in the input dtype)."""
    F = torch.nn.functional
    dt = torch.bfloat16 if dtype == "bfloat16" else torch.float16
    gen = torch.Generator(device="cuda").manual_seed(1)

    def randn(*shape, dtype=dt):
        return torch.randn(*shape, device="cuda", dtype=dtype, generator=gen)
    if op.endswith("_and_mul"):
        x, d = randn(rows, 2 * hidden), hidden
        act = {"silu_and_mul": F.silu, "gelu_and_mul": F.gelu,
               "gelu_tanh_and_mul": lambda v: F.gelu(v, approximate="tanh")}[op]
        return lambda: act(x[:, :d]) * x[:, d:]
    x, w, eps = randn(rows, hidden), randn(hidden), 1e-6
    if op == "layernorm":
        g, b = randn(hidden, dtype=torch.float32), randn(hidden, dtype=torch.float32)
        return lambda: F.layer_norm(x.float(), (hidden,), g, b, eps).to(dt)

    def rms(v, gemma=False):
        vf = v.float()
        vf = vf * torch.rsqrt(vf.pow(2).mean(-1, keepdim=True) + eps)
        return (vf * (1.0 + w.float())).to(dt) if gemma else vf.to(dt) * w
    if op == "fused_add_rmsnorm":
        r = randn(rows, hidden)

        def fused():        # residual += input; input = rmsnorm(residual), both in place
            r.add_(x)
            x.copy_(rms(r))
        return fused
    return lambda: rms(x, gemma=(op == "gemma_rmsnorm"))


def time_torch_norm_act(torch, rows_out: list, reps: int) -> None:
    flush = l2_flush()
    for row in rows_out:
        try:
            row["torch_us"] = time_events(torch_norm_act_call(torch, row["op"], row["rows"], row["hidden"],
                                                              row["dtype"]), reps, flush, warmup=10)
        except Exception as e:  # noqa: BLE001  (an out-of-memory or a missing op: record, go on)
            row["torch_error"] = f"{type(e).__name__}: {e}"[:200]
    torch.cuda.empty_cache()


def summary(result: dict) -> list[dict]:
    """One line per op at the serving size: µs, GB/s, % of the copy ceiling, FlashInfer µs / ours
    (> 1: cuattn faster), PyTorch µs / ours."""
    copy = result["copy_gbps"]
    out = []

    def line(section, op, shape, r, gbps):
        d = {"section": section, "op": op, "shape": shape, "us": r["us"], "gbps": gbps,
             "pct_copy": None if gbps is None or section == "sampling" else 100 * gbps / copy}
        d["x_flashinfer"] = r["flashinfer_us"] / r["us"] if "flashinfer_us" in r else None
        d["x_torch"] = r["torch_us"] / r["us"] if "torch_us" in r else None
        if "flashinfer_error" in r:
            d["flashinfer_error"] = r["flashinfer_error"]
        out.append(d)
    sec = result["sections"]
    for r in sec.get("rope", {}).get("rows", []):
        if r["nnz"] == SUMMARY_ROPE_NNZ and r["rotary_dim"] == 128 and r["dtype"] == "bfloat16":
            line("rope", r["op"], f"{r['nnz']}x32:8x128 rd{r['rotary_dim']} {SHORT[r['dtype']]}", r, r["gbps"])
    for r in sec.get("norm_act", {}).get("rows", []):
        if r["rows"] == SUMMARY_NORM_ROWS:
            line("norm_act", r["op"], f"{r['rows']}x{r['hidden']} {SHORT[r['dtype']]}", r, r["gbps"])
    for r in sec.get("sampling", {}).get("rows", []):
        if "spec" in r:
            continue
        if r["op"] == "top_k_top_p_sampling_from_logits" or r["batch"] == 64:
            line("sampling", r["op"], f"batch {r['batch']} vocab {r['vocab']}", r, r.get("gbps_one_read"))
    return out


def fmt(v, spec):
    return format(v, spec) if v is not None else "-"


def print_summary(lines: list, copy: float) -> str:
    """Prints the table; returns it as Markdown."""
    print(f"\nsummary (copy ceiling {copy:.0f} GB/s; x fi / x torch = their µs / ours, > 1: cuattn faster)")
    print(f"{'op':<38}{'shape':<28}{'µs':>9}{'GB/s':>7}{'%copy':>7}{'x fi':>7}{'x torch':>8}")
    md = ["| op | shape | µs | GB/s | % of copy | × FlashInfer | × PyTorch |",
          "|---|---|---:|---:|---:|---:|---:|"]
    for d in lines:
        cells = (fmt(d["us"], ".2f"), fmt(d["gbps"], ".0f"), fmt(d["pct_copy"], ".1f"),
                 fmt(d["x_flashinfer"], ".2f"), fmt(d["x_torch"], ".2f"))
        print(f"{d['op']:<38}{d['shape']:<28}{cells[0]:>9}{cells[1]:>7}{cells[2]:>7}{cells[3]:>7}{cells[4]:>8}")
        md.append(f"| {d['op']} | {d['shape']} | " + " | ".join(cells) + " |")
    return "\n".join(md) + "\n"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sections", nargs="+", default=list(SECTIONS), choices=SECTIONS)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--no-flashinfer", action="store_true")
    p.add_argument("--out", help="combined JSON; each section also writes <out stem>_<section>.json beside it")
    p.add_argument("--jit-wait", type=float, default=240, help="seconds to wait for FlashInfer's background "
                   "JIT builds before timing starts (a build still running then finishes on first use)")
    p.add_argument("--md", help="write the summary table as Markdown")
    args = p.parse_args(argv)
    if not arrays.gpu_available():
        sys.exit("bench_ops: no CUDA GPU visible to CuPy; this benchmark runs only on a GPU")
    torch = flashinfer = None
    try:
        import torch
    except ImportError as e:
        print(f"torch not importable ({e}): no FlashInfer or PyTorch columns")
    if torch is not None and not args.no_flashinfer:
        try:
            import flashinfer
        except Exception as e:  # noqa: BLE001  (an ImportError, or its import-time probes failing)
            print(f"flashinfer not importable ({type(e).__name__}: {e}); timing cuattn and PyTorch only")
            flashinfer = None
    builds = []
    if flashinfer is not None:
        try:
            builds = prebuild_flashinfer()
        except Exception as e:  # noqa: BLE001  (its JIT helpers moved: each first call builds instead)
            print(f"flashinfer prebuild not started ({type(e).__name__}: {e})")
    use_fi = flashinfer is not None
    env = bench_rope.env_info(torch, flashinfer)
    read_tbs, copy_tbs = ceilings(20)
    copy = copy_tbs * 1e3
    print(f"read ceiling {read_tbs * 1e3:.0f} GB/s (2 GiB), copy ceiling {copy:.0f} GB/s (1 GiB, read + written)")
    t0 = time.perf_counter()
    for t in builds:        # no timing while nvcc runs on the host's cores (small calls are host-bound)
        t.join(timeout=max(0.0, args.jit_wait - (time.perf_counter() - t0)))
    result = {"env": env, "read_gbps": read_tbs * 1e3, "copy_gbps": copy, "reps": args.reps, "sections": {},
              "errors": {}}
    stem = Path(args.out).with_suffix("") if args.out else Path("/tmp/bench_ops")
    reps = ["--reps", str(args.reps)]

    def save():
        if args.out:
            result["summary"] = summary(result)
            Path(args.out).write_text(json.dumps(result, indent=1))
    for name in args.sections:
        part = f"{stem}_{name}.json"
        print(f"\n===== {name} =====", flush=True)
        t0 = time.perf_counter()
        try:
            if name == "rope":
                sec = bench_rope.main(reps + ["--copy-gbps", str(copy), "--out", part]
                                      + ([] if use_fi else ["--no-flashinfer"])
                                      + (["--no-torch"] if torch is None else []))
            elif name == "norm_act":
                bench_norm_act.main(reps + ["--rows", *map(str, NORM_ROWS), "--hidden", *map(str, NORM_HIDDEN),
                                            "--out", part] + (["--flashinfer"] if use_fi else []))
                sec = json.loads(Path(part).read_text())
                if torch is not None:
                    time_torch_norm_act(torch, sec["rows"], args.reps)
                    Path(part).write_text(json.dumps(sec, indent=1))
            else:
                bench_sampling.main(reps + ["--json", part] + ([] if use_fi else ["--no-flashinfer"]))
                sec = json.loads(Path(part).read_text())
            sec["seconds"] = time.perf_counter() - t0
            result["sections"][name] = sec
        except (Exception, SystemExit) as e:  # noqa: BLE001  (one section failing keeps the others)
            traceback.print_exc()
            result["errors"][name] = f"{type(e).__name__}: {e}"[:500]
        cp.get_default_memory_pool().free_all_blocks()
        save()
    md = print_summary(summary(result), copy)
    if args.md:
        Path(args.md).write_text(md)
    save()
    return result


if __name__ == "__main__":
    main()
