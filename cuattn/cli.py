"""The ``cuattn`` command: info | precompile | cache clear | demo | bench."""
from __future__ import annotations

import argparse
import importlib
import re
import shutil
import sys
import time

import numpy as np

from . import __version__, arrays, jit
from .errors import DeviceUnavailableError

# Modules that ship kernels; each has shipped_specs().
KERNEL_MODULES = ("page", "decode", "cascade", "prefill", "prefill_sm90", "norm", "activation", "rope", "sampling",
                  "mla", "mla_sm90", "qcast", "prefill_ahead")


def shipped_specs(arch: str | None = None) -> list:
    """Every specialization cuattn ships, across all kernel families; with ``arch``, those built for
    it (a spec whose ``archs`` is a tuple, e.g. the sm_90a-only fa3 prefill, is built for those alone)."""
    specs = []
    for name in KERNEL_MODULES:
        specs.extend(importlib.import_module(f"cuattn.{name}").shipped_specs())
    return [s for s in specs if arch is None or getattr(s, "archs", None) is None or arch in s.archs]


def _gpu_line() -> str:
    if not arrays.gpu_available():
        reason = "CuPy not installed" if not _cupy_installed() else "CuPy sees no usable GPU/driver"
        return f"no GPU ({reason})"
    cp = arrays.cupy_module()
    dev = cp.cuda.Device(0)
    name = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    return f"{name} (compute capability {dev.compute_capability}, target {jit.device_arch(0)})"


def _cupy_installed() -> bool:
    try:
        arrays.cupy_module()
        return True
    except DeviceUnavailableError:
        return False


def cmd_info(args) -> int:
    print(f"cuattn     {__version__}")
    print(f"kernels    {jit.KERNELS_DIR}")
    print(f"cupy       {arrays.cupy_module().__version__ if _cupy_installed() else 'not installed'}")
    try:
        print("nvrtc      %d.%d" % jit.nvrtc_version() + f" ({jit._nvrtc().path})")
    except (DeviceUnavailableError, RuntimeError) as e:   # report: info is how users find what is missing
        print(f"nvrtc      not available: {e}")
    print(f"gpu        {_gpu_line()}")
    n, size = jit.cache_usage()
    print(f"cache      {jit.cache_dir()} ({n} kernels, {size / 1e6:.1f} MB)")
    return 0


def _arch(value: str) -> str:
    """An NVRTC target cuattn's kernels build for: sm_80 or newer (sm_90a for Hopper's wgmma / TMA)."""
    m = re.fullmatch(r"sm_(\d+)(a?)", value)
    if m is None or int(m.group(1)) < 80:
        raise argparse.ArgumentTypeError(f"{value!r} is not a supported arch; cuattn builds for sm_80 and newer "
                                         f"(sm_80, sm_86, sm_89, sm_90a, ...)")
    return value


def cmd_precompile(args) -> int:
    archs = args.arch or ([jit.device_arch(0)] if arrays.gpu_available() else list(jit.SHIPPED_ARCHS))
    jobs = [(spec, arch) for arch in archs for spec in shipped_specs(arch)]
    start = time.perf_counter()
    tty = sys.stderr.isatty()

    def progress(i, total, spec, arch):
        if not tty:          # a log gets no carriage returns: the summary line below says it all
            return
        width = shutil.get_terminal_size().columns
        line = f"[{'#' * (20 * i // total):<20}] {i}/{total} {arch} {spec.name}"
        print("\r" + line[:width - 1].ljust(width - 1), end="", file=sys.stderr, flush=True)

    compiled = jit.precompile(jobs, args.jobs, progress)
    if tty:
        print(file=sys.stderr)
    print(f"precompiled {len(jobs)} kernels for {', '.join(archs)} ({compiled} compiled, "
          f"{len(jobs) - compiled} from cache) in {time.perf_counter() - start:.1f} s into {jit.cache_dir()}")
    return 0


def cmd_cache(args) -> int:
    removed = jit.clear_cache()
    print(f"removed {removed} files from {jit.cache_dir()}")
    return 0


def _dense_attention(q, k, v, causal: bool):
    """float64 attention of q [qo, Hq, D] over k, v [kv, Hkv, D], causal aligned bottom-right."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    group = q.shape[1] // k.shape[1]
    s = np.einsum("qhd,khd->hqk", q, np.repeat(k, group, axis=1)) / np.sqrt(q.shape[-1])
    if causal:
        qo, kv = q.shape[0], k.shape[0]
        s = np.where(np.arange(kv)[None, :] <= np.arange(qo)[:, None] + kv - qo, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("hqk,khd->qhd", p / p.sum(-1, keepdims=True), np.repeat(v, group, axis=1))


# The demo's shapes: small on the NumPy path (CI runs it on 2 cores), Llama-8B-like heads on a GPU.
_DEMO_SHAPES = {"cpu": dict(layers=4, q_heads=8, kv_heads=2, head_dim=64, page_size=16, max_pages=512,
                            requests=64, max_batch=24, prompt_median=64, prompt_max=1024, output_median=16),
                "gpu": dict(layers=4, q_heads=32, kv_heads=8, head_dim=128, page_size=16, max_pages=8192,
                            requests=256, max_batch=64, prompt_median=256, prompt_max=4096, output_median=48)}


def _progress_line(text: str) -> None:
    """One progress line on stderr, redrawn in place and clipped to the terminal (nothing into a pipe)."""
    width = shutil.get_terminal_size().columns
    print("\r" + text[:width - 1].ljust(width - 1), end="", file=sys.stderr, flush=True)


def cmd_demo(args) -> int:
    """A small serving loop with continuous batching: a synthetic stream of requests with long-tailed
    prompt and output lengths; each step prefills newly admitted requests (BatchPrefillWithPagedKVCacheWrapper,
    causal), decodes the running ones (BatchDecodeWithPagedKVCacheWrapper) and frees finished ones.
    Queries and new K/V are random (a stand-in for the model); a few requests are checked in float64."""
    from collections import deque

    from .decode import BatchDecodeWithPagedKVCacheWrapper
    from .page import PagedKVCache
    from .prefill import BatchPrefillWithPagedKVCacheWrapper

    on_gpu = arrays.gpu_available() and not args.cpu
    print(f"cuattn demo: running on {'the GPU: ' + _gpu_line() if on_gpu else 'the CPU (NumPy reference path)'}"
          + ("" if on_gpu or args.cpu else f"; {_gpu_line()}"))
    c = dict(_DEMO_SHAPES["gpu" if on_gpu else "cpu"])
    n = args.requests or c["requests"]
    if n < 1:
        print(f"cuattn demo: --requests must be >= 1, got {n}", file=sys.stderr)
        return 2
    xp = arrays.cupy_module() if on_gpu else np
    to_host = xp.asnumpy if on_gpu else np.asarray
    sync = xp.cuda.get_current_stream().synchronize if on_gpu else (lambda: None)
    rng = np.random.default_rng(args.seed)
    # -- the request stream: lognormal (long-tailed) lengths, Poisson arrivals (~1 request per 2 steps)
    prompt_lens = np.clip(rng.lognormal(np.log(c["prompt_median"]), 0.9, n), 4, c["prompt_max"]).astype(int)
    output_lens = np.clip(rng.lognormal(np.log(c["output_median"]), 0.8, n), 1, 16 * c["output_median"]).astype(int)
    arrival = np.floor(np.cumsum(rng.exponential(2.0, n))).astype(int)
    arrival -= arrival[0]
    print(f"{n} requests: prompts {int(prompt_lens.min())}-{int(prompt_lens.max())} tokens (median "
          f"{int(np.median(prompt_lens))}), outputs {int(output_lens.min())}-{int(output_lens.max())} (median "
          f"{int(np.median(output_lens))}); {c['layers']} layers, {c['q_heads']}:{c['kv_heads']} heads, head_dim "
          f"{c['head_dim']}, fp16, {c['max_pages']} pages of {c['page_size']}")
    L, hq, hkv, d, ps = c["layers"], c["q_heads"], c["kv_heads"], c["head_dim"], c["page_size"]
    cache = PagedKVCache(L, hkv, d, ps, max_num_pages=c["max_pages"], dtype="float16",
                         device="cuda" if on_gpu else "cpu")
    prefill = BatchPrefillWithPagedKVCacheWrapper(kv_layout="NHD")
    decode = BatchDecodeWithPagedKVCacheWrapper(kv_layout="NHD")
    # requests whose layer-0 attention is checked in float64 every step: three with short prompts (the
    # check's dense score matrix is prompt x prompt per head)
    short = [r for r in range(n) if prompt_lens[r] <= 256] or [int(np.argmin(prompt_lens))]
    tracked = {short[0], short[len(short) // 2], short[-1]}
    history: dict[int, tuple[list, list]] = {r: ([], []) for r in tracked}
    seq_of: dict[int, int] = {}                   # request -> cache sequence
    generated = np.zeros(n, int)
    waiting, running = deque(), []
    committed = 0                                 # pages promised to admitted requests (prompt + output)
    state = dict(worst=0.0, t_attn=0.0, peak_pages=0, peak_batch=0, prefill_tokens=0, decode_tokens=0)

    def attend(wrapper, reqs, counts, batch):
        """Per layer: new q/k/v (random: the model's stand-in), append K/V, attend; check tracked requests."""
        rows = batch.append_indptr
        for layer in range(L):
            if on_gpu:      # drawn on the device: the host's generator would take longer than the attention
                qd, kd, vd = (xp.random.standard_normal((batch.nnz, h, d), np.float32).astype(np.float16)
                              for h in (hq, hkv, hkv))
            else:
                qd, kd, vd = (rng.standard_normal((batch.nnz, h, d), np.float32).astype(np.float16)
                              for h in (hq, hkv, hkv))
            sync()
            t0 = time.perf_counter()
            cache.append(layer, kd, vd, batch)
            out = wrapper.run(qd, cache.layer(layer))
            sync()
            state["t_attn"] += time.perf_counter() - t0
            if layer:
                continue
            for i, r in enumerate(reqs):
                if r in tracked:
                    ks, vs = history[r]
                    q, k, v = (to_host(x[int(rows[i]):int(rows[i + 1])]) for x in (qd, kd, vd))
                    ks.append(k), vs.append(v)
                    ref = _dense_attention(q, np.concatenate(ks), np.concatenate(vs), True)
                    err = float(np.abs(to_host(out[int(rows[i]):int(rows[i + 1])]) - ref).max())
                    state["worst"] = max(state["worst"], err)

    def timed(fn, *a, **kw):
        t0 = time.perf_counter()
        result = fn(*a, **kw)
        state["t_attn"] += time.perf_counter() - t0
        return result

    tty, drawn = sys.stderr.isatty(), 0.0
    start, step, next_req, done = time.perf_counter(), 0, 0, 0
    while done < n:
        while next_req < n and arrival[next_req] <= step:
            waiting.append(next_req)
            next_req += 1
        # -- admit waiting requests (first come, first served) while the batch and the pages allow
        new = []
        while waiting and len(running) + len(new) < c["max_batch"]:
            r = waiting[0]
            need = -(-(prompt_lens[r] + output_lens[r]) // ps)
            if committed + need > c["max_pages"]:
                break
            committed += need
            new.append(waiting.popleft())
            seq_of[r] = cache.add_sequence()
        # -- decode the running requests: one new token each
        if running:
            counts = [1] * len(running)
            batch = timed(cache.reserve, [seq_of[r] for r in running], counts)
            timed(decode.plan, batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len, hq, hkv, d, ps,
                  q_data_type="float16")
            attend(decode, running, counts, batch)
            generated[running] += 1
            state["decode_tokens"] += len(running)
        # -- prefill the new ones: their whole prompts, causal; prefill yields their first token
        if new:
            counts = [int(prompt_lens[r]) for r in new]
            batch = timed(cache.reserve, [seq_of[r] for r in new], counts)     # admission promised the pages
            timed(prefill.plan, batch.append_indptr, batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len,
                  hq, hkv, d, ps, causal=True, q_data_type="float16")
            attend(prefill, new, counts, batch)
            generated[new] += 1
            state["prefill_tokens"] += sum(counts)
        state["peak_pages"] = max(state["peak_pages"], cache.max_num_pages - cache.num_free_pages)
        state["peak_batch"] = max(state["peak_batch"], len(running) + len(new))
        # -- free finished requests
        running += new
        for r in [r for r in running if generated[r] >= output_lens[r]]:
            running.remove(r)
            cache.remove_sequence(seq_of.pop(r))
            committed -= -(-(prompt_lens[r] + output_lens[r]) // ps)
            done += 1
        step += 1
        if tty and (done == n or time.perf_counter() - drawn > 0.1):      # redrawn at most 10 times a second
            drawn = time.perf_counter()
            bar = "#" * (20 * done // n)
            _progress_line(f"[{bar:<20}] {done}/{n} done | step {step} | running {len(running)} | waiting "
                           f"{len(waiting)} | pages {cache.max_num_pages - cache.num_free_pages}/{cache.max_num_pages}")
    wall = time.perf_counter() - start
    if tty:
        print(file=sys.stderr)
    tokens = state["prefill_tokens"] + state["decode_tokens"]
    print(f"served {n} requests in {step} steps, {wall:.1f} s: {state['prefill_tokens']} prompt tokens prefilled, "
          f"{int(generated.sum())} tokens generated; {tokens / wall:,.0f} tokens/s through attention, "
          f"{int(generated.sum()) / wall:,.0f} generated tokens/s")
    print(f"attention time share: {100 * state['t_attn'] / wall:.0f}% (cuattn: page reservation, plan, append, "
          f"prefill / decode run{', synchronized per call' if on_gpu else ''}); the rest is this demo's stand-in "
          f"for the model (random q/k/v) and its float64 checks")
    print(f"peak pages in use: {state['peak_pages']} of {cache.max_num_pages} (page_size {ps}); peak batch "
          f"{state['peak_batch']} requests; all freed: {cache.num_free_pages}/{cache.max_num_pages} pages free")
    print(f"max |out - float64 reference| over requests {sorted(tracked)}, layer 0, every step: {state['worst']:.2e}")
    if not state["worst"] < 2e-2 or cache.num_free_pages != cache.max_num_pages:
        print("demo FAILED: output differs from the reference or pages leaked", file=sys.stderr)
        return 1
    print("demo OK")
    return 0


# `cuattn bench`: the scripts of benchmarks/ it knows, with the arguments of a quick run (None: full run only)
# and whether they need a GPU. Other benchmarks/bench_*.py scripts run in a full run with --out alone.
_BENCH_SUITE = (
    ("bench_decode.py", ["--batch", "1", "16", "64", "--kv-len", "2048", "8192", "--heads", "32:8", "--reps", "10"], True),
    ("bench_prefill.py", ["--shapes", "1x4096", "8x2048", "--reps", "10", "--no-sdpa"], True),
    ("bench_cascade.py", ["--reps", "10"], True),
    ("bench_norm_act.py", ["--rows", "16", "4096", "--hidden", "4096", "--reps", "20"], True),
    ("bench_variants.py", ["--reps", "10", "--rounds", "1", "--no-compile"], True),
    ("bench_jit.py", None, False),
)


def _bench_plot(out_dir, results: dict) -> str:
    """A PNG of decode TB/s and prefill TFLOP/s against the ceilings measured in the run; returns its
    path, or why there is none."""
    import json
    from pathlib import Path

    try:
        import matplotlib
    except ImportError:
        return "no plot: matplotlib is not installed (pip install matplotlib)"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [name for name in ("bench_decode.py", "bench_prefill.py") if name in results]
    if not panels:
        return "no plot: neither bench_decode.py nor bench_prefill.py wrote results"
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 3.6), squeeze=False)
    for ax, name in zip(axes[0], panels):
        res = json.loads(Path(results[name]).read_text())
        env = res.get("env", {})
        if name == "bench_decode.py":
            rows = [r for r in res["rows"] if r.get("variant", "shipped") == "shipped"]
            kv_bytes = [r["tbs"] * 1e12 * r["us"] * 1e-6 / 1e6 for r in rows]        # MB read: TB/s x time
            ax.plot(kv_bytes, [r["tbs"] for r in rows], "o", label="cuattn decode")
            ceiling = res["ceilings"]["read_only_tbs"]
            ax.axhline(ceiling, color="k", ls="--", lw=1, label=f"read ceiling {ceiling:.2f} TB/s (measured)")
            ax.set_xscale("log"), ax.set_xlabel("K/V MB read per call"), ax.set_ylabel("TB/s")
            ax.set_title(f"decode, {res.get('dtype', '')} hd{res.get('head_dim', '')}", fontsize=9)
        else:
            rows = res["rows"]
            labels = [f"{r['batch']}x{r['qo_len']}" + (" causal" if r["causal"] else "") for r in rows]
            for i, (key, label) in enumerate((("fa3_gpu_tflops", "cuattn fa3"), ("gpu_tflops", "cuattn fa2"))):
                ax.bar([j + 0.4 * i for j in range(len(rows))], [r.get(key) or 0 for r in rows], 0.4, label=label)
            ax.axhline(res["matmul_tflops"], color="k", ls="--", lw=1,
                       label=f"fp16 matmul {res['matmul_tflops']:.0f} TFLOP/s (measured)")
            ax.set_xticks([j + 0.2 for j in range(len(rows))], labels, fontsize=7), ax.set_ylabel("TFLOP/s")
            ax.set_ylim(0, 1.3 * res["matmul_tflops"]), ax.set_title("prefill", fontsize=9)
        ax.legend(fontsize=7)
    fig.suptitle(f"{env.get('gpu', '')}, {str(env.get('date', ''))[:10]}", fontsize=10)
    fig.tight_layout()
    path = Path(out_dir) / "bench.png"
    fig.savefig(path, dpi=110)
    return str(path)


def cmd_bench(args) -> int:
    """Run the benchmark scripts of a checkout's benchmarks/ on this machine; JSON per script, a summary
    JSON and a PNG plot into --out-dir."""
    import datetime
    import json
    import subprocess
    from pathlib import Path

    bench_dir = Path(__file__).resolve().parent.parent / "benchmarks"
    if not bench_dir.is_dir():
        print(f"cuattn bench: no benchmarks/ next to the package ({bench_dir}); the benchmark scripts come with "
              f"a clone of the repository (pip install -e . there)", file=sys.stderr)
        return 2
    on_gpu = arrays.gpu_available()
    date = datetime.date.today().isoformat()
    out_dir = Path(args.out_dir or f"bench-{date}{'-quick' if args.quick else ''}")
    out_dir.mkdir(parents=True, exist_ok=True)
    known = {name for name, _, _ in _BENCH_SUITE}
    suite = [(n, a, g) for n, a, g in _BENCH_SUITE if (bench_dir / n).exists()]
    suite += [(p.name, None, True) for p in sorted(bench_dir.glob("bench_*.py")) if p.name not in known]
    print(f"cuattn bench{' --quick' if args.quick else ''}: {_gpu_line()}; results into {out_dir}/")
    results, summary = {}, []
    for name, quick_args, needs_gpu in suite:
        if needs_gpu and not on_gpu:
            summary.append(dict(script=name, skipped="needs a GPU"))
            print(f"-- {name}: skipped (needs a GPU)")
            continue
        if args.quick and quick_args is None:
            summary.append(dict(script=name, skipped="full run only"))
            print(f"-- {name}: skipped in a quick run")
            continue
        out = out_dir / name.replace(".py", ".json").replace("bench_", "")
        cmd = [sys.executable, str(bench_dir / name), *(quick_args if args.quick else []), "--out", str(out)]
        print(f"-- {name} {' '.join(cmd[2:])}", flush=True)
        start = time.perf_counter()
        rc = subprocess.run(cmd).returncode
        summary.append(dict(script=name, args=cmd[2:], returncode=rc, seconds=round(time.perf_counter() - start, 1),
                            json=str(out) if out.exists() else None))
        if rc == 0 and out.exists():
            results[name] = out
    plot = _bench_plot(out_dir, results)
    (out_dir / "suite.json").write_text(json.dumps(dict(date=date, gpu=_gpu_line(), quick=args.quick, plot=plot,
                                                        scripts=summary), indent=1))
    ran = [s for s in summary if "returncode" in s]
    failed = [s["script"] for s in ran if s["returncode"]]
    print(f"bench: {len(ran)} scripts run, {len(failed)} failed{' (' + ', '.join(failed) + ')' if failed else ''}, "
          f"{len(summary) - len(ran)} skipped; {out_dir / 'suite.json'}; plot: {plot}")
    if not ran:
        print("cuattn bench: nothing could run on this machine", file=sys.stderr)
        return 2
    return 1 if failed else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="cuattn", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="versions, GPU, cache").set_defaults(fn=cmd_info)
    p = sub.add_parser("precompile", help="compile every shipped kernel into the cache")
    p.add_argument("--arch", nargs="+", type=_arch, help="e.g. sm_80 sm_90a (default: this GPU, or sm_80 and sm_90a)")
    p.add_argument("--jobs", type=int, default=None, help="compile processes (default: one per core)")
    p.set_defaults(fn=cmd_precompile)
    p = sub.add_parser("cache", help="manage the kernel cache")
    p.add_argument("action", choices=["clear"])
    p.set_defaults(fn=cmd_cache)
    p = sub.add_parser("demo", help="a small serving loop with continuous batching on the paged cache (GPU if present)")
    p.add_argument("--cpu", action="store_true", help="use the NumPy path even with a GPU")
    p.add_argument("--requests", type=int, default=None, help="requests in the stream (default: 64 on the CPU, 256 on a GPU)")
    p.add_argument("--seed", type=int, default=0, help="seed of the request stream")
    p.set_defaults(fn=cmd_demo)
    p = sub.add_parser("bench", help="run the benchmark scripts of a checkout; JSON and a PNG plot")
    p.add_argument("--quick", action="store_true", help="a few shapes per script, fewer repetitions")
    p.add_argument("--out-dir", default=None, help="where to write (default: ./bench-<date>[-quick])")
    p.set_defaults(fn=cmd_bench)
    args = parser.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
