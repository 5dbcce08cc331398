"""The ``cuattn`` command: info | precompile | cache clear | demo."""
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
KERNEL_MODULES = ("page", "decode", "cascade", "prefill", "prefill_sm90", "norm", "activation", "rope")


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


def cmd_demo(args) -> int:
    """A small serving loop: prompts appended and prefilled on a paged cache, decode steps, free."""
    from .decode import BatchDecodeWithPagedKVCacheWrapper
    from .page import PagedKVCache
    from .prefill import BatchPrefillWithPagedKVCacheWrapper

    on_gpu = arrays.gpu_available() and not args.cpu
    print(f"cuattn demo: running on {'the GPU: ' + _gpu_line() if on_gpu else 'the CPU (NumPy reference path)'}"
          + ("" if on_gpu or args.cpu else f"; {_gpu_line()}"))
    xp = arrays.cupy_module() if on_gpu else np
    to_host = arrays.cupy_module().asnumpy if on_gpu else np.asarray
    rng = np.random.default_rng(0)
    layers, q_heads, kv_heads, head_dim, page_size = 2, 8, 2, 64, 16
    cache = PagedKVCache(layers, kv_heads, head_dim, page_size, max_num_pages=64, dtype="float16",
                         device="cuda" if on_gpu else "cpu")
    prompts = [37, 5, 20]
    seqs = [cache.add_sequence() for _ in prompts]
    history = {(s, layer): ([], []) for s in seqs for layer in range(layers)}   # host K/V for the check
    worst = 0.0

    def step(counts, wrapper, causal):
        """Reserve pages, then per layer: append new K/V, attend with new queries, check."""
        nonlocal worst
        batch = cache.reserve(seqs, counts)
        plan_args = (batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len, q_heads, kv_heads,
                     head_dim, page_size)
        if causal:
            wrapper.plan(batch.append_indptr, *plan_args, causal=True, q_data_type="float16")
        else:
            wrapper.plan(*plan_args, q_data_type="float16", kv_data_type="float16")
        rows = batch.append_indptr
        for layer in range(layers):
            k, v, q = (rng.standard_normal((batch.nnz, h, head_dim)).astype(np.float16)
                       for h in (kv_heads, kv_heads, q_heads))
            cache.append(layer, xp.asarray(k), xp.asarray(v), batch)
            out = to_host(wrapper.run(xp.asarray(q), cache.layer(layer)))
            for i, s in enumerate(seqs):
                ks, vs = history[(s, layer)]
                ks.append(k[rows[i]:rows[i + 1]]), vs.append(v[rows[i]:rows[i + 1]])
                ref = _dense_attention(q[rows[i]:rows[i + 1]], np.concatenate(ks), np.concatenate(vs), causal)
                worst = max(worst, float(np.abs(out[rows[i]:rows[i + 1]] - ref).max()))

    step(prompts, BatchPrefillWithPagedKVCacheWrapper(kv_layout="NHD"), causal=True)
    print(f"prefill: {len(seqs)} prompts of {prompts} tokens appended and attended (causal) on "
          f"{cache.max_num_pages - cache.num_free_pages} pages of {page_size}; "
          f"max |out - float64 reference| {worst:.2e}")
    decode = BatchDecodeWithPagedKVCacheWrapper(kv_layout="NHD")
    for i in range(4):
        step([1] * len(seqs), decode, causal=False)
        print(f"decode step {i}: lengths {[cache.seq_len(s) for s in seqs]}, "
              f"max |out - float64 reference| so far {worst:.2e}")
    for s in seqs:
        cache.remove_sequence(s)
    print(f"freed all sequences: {cache.num_free_pages}/{cache.max_num_pages} pages free")
    if not worst < 2e-2:
        print("demo FAILED: output differs from the reference", file=sys.stderr)
        return 1
    print("demo OK")
    return 0


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
    p = sub.add_parser("demo", help="a small serving loop on the paged cache (GPU if present)")
    p.add_argument("--cpu", action="store_true", help="use the NumPy path even with a GPU")
    p.set_defaults(fn=cmd_demo)
    args = parser.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
