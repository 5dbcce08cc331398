"""The ``cuattn`` command: info | precompile | cache clear | demo."""
from __future__ import annotations

import argparse
import importlib
import sys
import time

import numpy as np

from . import __version__, arrays, jit

# Modules that ship kernels; each has shipped_specs().
KERNEL_MODULES = ("page", "decode", "cascade", "prefill")


def shipped_specs() -> list:
    """Every specialization cuattn ships, across all kernel families."""
    specs = []
    for name in KERNEL_MODULES:
        specs.extend(importlib.import_module(f"cuattn.{name}").shipped_specs())
    return specs


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
    except Exception:
        return False


def cmd_info(args) -> int:
    print(f"cuattn     {__version__}")
    print(f"kernels    {jit.KERNELS_DIR}")
    print(f"cupy       {arrays.cupy_module().__version__ if _cupy_installed() else 'not installed'}")
    try:
        print("nvrtc      %d.%d" % jit.nvrtc_version() + f" ({jit._nvrtc().path})")
    except Exception as e:   # report, don't fail: info is how users find what is missing
        print(f"nvrtc      not available: {e}")
    print(f"gpu        {_gpu_line()}")
    n, size = jit.cache_usage()
    print(f"cache      {jit.cache_dir()} ({n} kernels, {size / 1e6:.1f} MB)")
    return 0


def cmd_precompile(args) -> int:
    archs = args.arch or ([jit.device_arch(0)] if arrays.gpu_available() else list(jit.SHIPPED_ARCHS))
    jobs = [(spec, arch) for arch in archs for spec in shipped_specs()]
    start, compiled = time.perf_counter(), 0
    for i, (spec, arch) in enumerate(jobs, 1):
        result = jit.compile_kernel(spec, arch)
        compiled += not result.from_cache
        bar = "#" * (30 * i // len(jobs))
        print(f"\r[{bar:<30}] {i}/{len(jobs)} {arch} {spec.name:<48}", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    print(f"precompiled {len(jobs)} kernels for {', '.join(archs)} ({compiled} compiled, "
          f"{len(jobs) - compiled} from cache) in {time.perf_counter() - start:.1f} s into {jit.cache_dir()}")
    return 0


def cmd_cache(args) -> int:
    removed = jit.clear_cache()
    print(f"removed {removed} files from {jit.cache_dir()}")
    return 0


def cmd_demo(args) -> int:
    """A tiny serving loop: prompts appended to a paged cache, then decode steps, then free."""
    from .decode import BatchDecodeWithPagedKVCacheWrapper
    from .page import PagedKVCache

    on_gpu = arrays.gpu_available() and not args.cpu
    device = "cuda" if on_gpu else "cpu"
    print(f"cuattn demo: running on {'the GPU: ' + _gpu_line() if on_gpu else 'the CPU (NumPy reference path)'}"
          + ("" if on_gpu or args.cpu else f"; {_gpu_line()}"))
    xp = arrays.cupy_module() if on_gpu else np
    rng = np.random.default_rng(0)
    layers, q_heads, kv_heads, head_dim, page_size = 2, 8, 2, 64, 16
    cache = PagedKVCache(layers, kv_heads, head_dim, page_size, max_num_pages=64, dtype="float16", device=device)
    prompts = [37, 5, 20]
    seqs = [cache.add_sequence() for _ in prompts]
    history = {s: [[] for _ in range(layers)] for s in seqs}   # host copy of K/V for the check

    def append(batch, counts):
        for layer in range(layers):
            k = rng.standard_normal((batch.nnz, kv_heads, head_dim)).astype(np.float16)
            v = rng.standard_normal((batch.nnz, kv_heads, head_dim)).astype(np.float16)
            cache.append(layer, xp.asarray(k), xp.asarray(v), batch)
            rows = np.cumsum([0] + counts)
            for i, s in enumerate(batch.seq_ids):
                history[s][layer].append((k[rows[i]:rows[i + 1]], v[rows[i]:rows[i + 1]]))

    append(cache.reserve(seqs, prompts), prompts)
    print(f"prefilled {len(seqs)} sequences of {prompts} tokens: {cache.max_num_pages - cache.num_free_pages} "
          f"pages of {page_size} in use")
    wrapper = BatchDecodeWithPagedKVCacheWrapper(kv_layout="NHD")
    worst = 0.0
    for step in range(4):
        batch = cache.reserve(seqs, [1] * len(seqs))
        append(batch, [1] * len(seqs))
        wrapper.plan(batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len, q_heads, kv_heads,
                     head_dim, page_size, q_data_type="float16", kv_data_type="float16")
        for layer in range(layers):
            q = rng.standard_normal((len(seqs), q_heads, head_dim)).astype(np.float16)
            out = wrapper.run(xp.asarray(q), cache.layer(layer))
            out = arrays.cupy_module().asnumpy(out) if on_gpu else out
            for i, s in enumerate(seqs):     # check against plain float64 attention
                k = np.concatenate([a for a, _ in history[s][layer]]).astype(np.float64)
                v = np.concatenate([b for _, b in history[s][layer]]).astype(np.float64)
                for h in range(q_heads):
                    kh = h // (q_heads // kv_heads)
                    w = k[:, kh] @ q[i, h].astype(np.float64) / np.sqrt(head_dim)
                    p = np.exp(w - w.max())
                    ref = p @ v[:, kh] / p.sum()
                    worst = max(worst, float(np.abs(out[i, h].astype(np.float64) - ref).max()))
        print(f"decode step {step}: lengths {[cache.seq_len(s) for s in seqs]}, "
              f"max |out - float64 reference| so far {worst:.2e}")
    for s in seqs:
        cache.remove_sequence(s)
    print(f"freed all sequences: {cache.num_free_pages}/{cache.max_num_pages} pages free")
    if worst > 2e-2:
        print("demo FAILED: output differs from the reference", file=sys.stderr)
        return 1
    print("demo OK")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="cuattn", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="versions, GPU, cache").set_defaults(fn=cmd_info)
    p = sub.add_parser("precompile", help="compile every shipped kernel into the cache")
    p.add_argument("--arch", nargs="+", help="e.g. sm_80 sm_90a (default: this GPU, or sm_80 and sm_90a)")
    p.set_defaults(fn=cmd_precompile)
    p = sub.add_parser("cache", help="manage the kernel cache")
    p.add_argument("action", choices=["clear"])
    p.set_defaults(fn=cmd_cache)
    p = sub.add_parser("demo", help="a small serving loop on the paged cache (GPU if present)")
    p.add_argument("--cpu", action="store_true", help="use the NumPy path even with a GPU")
    p.set_defaults(fn=cmd_demo)
    args = parser.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
