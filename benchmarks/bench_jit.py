"""Compile cost: import, cold NVRTC compile and warm disk-cache load of every shipped kernel, and of a
user-defined variant, on the machine it runs on (no GPU needed: the arch defaults to this GPU's, or
sm_90a without one).

Method: each measurement in a fresh cache directory (CUATTN_CACHE_DIR in a temporary folder).
"cold, one by one": every shipped spec compiled sequentially in this process, wall seconds summed;
"cold, parallel": ``jit.precompile`` over all cores (what ``cuattn precompile`` runs), wall seconds;
"warm": every spec loaded from the disk cache with the in-process memo cleared, median ms per spec;
"import": ``python -c "import cuattn"`` wall time, median of 5 subprocesses (interpreter start
included, reported separately). ``--flashinfer`` also times FlashInfer's first-use JIT of its decode
module (nvcc + ninja, an empty FlashInfer workspace) when it is importable: 10-100 s.

    python benchmarks/bench_jit.py [--arch sm_90a] [--jobs N] [--flashinfer] [--out results.json]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cuattn import arrays, cli, jit, variants  # noqa: E402
import cuattn  # noqa: E402

SIGMOID = cuattn.Variant("sigmoid", params=(("bias", "float"),), use_softmax=False,
                         logits_transform="return fast_sigmoid(logits + params.bias);")


def subprocess_seconds(code: str, n: int = 5) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], check=True)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def in_fresh_cache(fn):
    old = os.environ.get("CUATTN_CACHE_DIR")
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["CUATTN_CACHE_DIR"] = tmp
        jit._memo.clear()
        try:
            return fn()
        finally:
            jit._memo.clear()
            if old is None:
                os.environ.pop("CUATTN_CACHE_DIR")
            else:
                os.environ["CUATTN_CACHE_DIR"] = old


def flashinfer_decode_jit_seconds():
    """First-use JIT of FlashInfer's batch decode module in a fresh workspace (a subprocess)."""
    code = ("import torch, flashinfer; w = flashinfer.BatchDecodeWithPagedKVCacheWrapper("
            "torch.empty(128 << 20, dtype=torch.uint8, device='cuda')); "
            "w.plan(torch.tensor([0, 1], dtype=torch.int32, device='cuda'), torch.tensor([0], dtype=torch.int32, "
            "device='cuda'), torch.tensor([1], dtype=torch.int32, device='cuda'), 32, 8, 128, 16, "
            "q_data_type=torch.float16); torch.cuda.synchronize()")
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "FLASHINFER_WORKSPACE_BASE": tmp}
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], check=True, env=env)
        return time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arch", default=None)
    ap.add_argument("--jobs", type=int, default=None)
    ap.add_argument("--flashinfer", action="store_true")
    ap.add_argument("--out")
    args = ap.parse_args()
    arch = args.arch or (jit.device_arch(0) if arrays.gpu_available() else "sm_90a")
    specs = cli.shipped_specs(arch)
    cores = os.cpu_count()
    print(f"# cuattn {cuattn.__version__}, NVRTC {jit.nvrtc_version()}, arch {arch}, {cores} cores, "
          f"{len(specs)} shipped specs, {datetime.date.today()}")
    res = dict(date=str(datetime.date.today()), arch=arch, cores=cores, nvrtc=list(jit.nvrtc_version()),
               shipped_specs=len(specs), method=__doc__)
    res["python_start_s"] = subprocess_seconds("pass")
    res["import_s"] = subprocess_seconds("import cuattn")
    print(f"python start {res['python_start_s']:.3f} s; python + import cuattn {res['import_s']:.3f} s "
          f"(import alone ~{res['import_s'] - res['python_start_s']:.3f} s)")

    def one_by_one():
        times = {}
        for s in specs:
            t0 = time.perf_counter()
            jit.compile_kernel(s, arch)
            times[s.name] = time.perf_counter() - t0
        jit._memo.clear()
        warm = []
        for s in specs:
            t0 = time.perf_counter()
            jit.compile_kernel(s, arch)
            warm.append(time.perf_counter() - t0)
        return times, warm
    times, warm = in_fresh_cache(one_by_one)
    res["cold_sequential_s"] = sum(times.values())
    res["cold_per_spec_s"] = {k: round(v, 3) for k, v in times.items()}
    res["warm_median_ms"] = statistics.median(warm) * 1e3
    res["warm_max_ms"] = max(warm) * 1e3
    print(f"cold, one by one: {res['cold_sequential_s']:.1f} s for {len(specs)} specs "
          f"(median {statistics.median(times.values()):.2f} s, max {max(times.values()):.2f} s)")
    print(f"warm load from the disk cache: median {res['warm_median_ms']:.2f} ms, max {res['warm_max_ms']:.2f} ms")

    def parallel():
        t0 = time.perf_counter()
        jit.precompile([(s, arch) for s in specs], args.jobs)
        return time.perf_counter() - t0
    res["cold_parallel_s"] = in_fresh_cache(parallel)
    print(f"cold, parallel over {args.jobs or cores} processes (cuattn precompile): {res['cold_parallel_s']:.1f} s")

    def user_variant():
        comp = variants.Composite((SIGMOID,))
        out = {}
        for spec in (cuattn.decode.DecodeSpec(128, "f16", "f16", variant=comp),
                     cuattn.prefill.make_spec(128, "f16", True, False, True, comp)):
            t0 = time.perf_counter()
            jit.compile_kernel(spec, arch)
            out[spec.name] = round(time.perf_counter() - t0, 3)
        return out
    res["user_variant_cold_s"] = in_fresh_cache(user_variant)
    for k, v in res["user_variant_cold_s"].items():
        print(f"user variant, cold: {k} {v:.2f} s")
    if args.flashinfer:
        try:
            import flashinfer  # noqa: F401
        except ImportError:
            print("FlashInfer is not importable: not timed")
        else:
            res["flashinfer_decode_jit_s"] = flashinfer_decode_jit_seconds()
            print(f"FlashInfer batch decode module, first use (nvcc JIT): {res['flashinfer_decode_jit_s']:.1f} s")
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
