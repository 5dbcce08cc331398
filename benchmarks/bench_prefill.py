"""Prefill attention throughput (cuattn fa2 and, on Hopper, fa3 backends vs fp16 matmul, torch SDPA, FlashInfer).

Timing: CUDA events, warm-up calls, median of --reps timed calls; L2 not flushed (compute bound;
1x16k inputs are far larger than L2 anyway). Three numbers per case: "gpu" (the kernel alone: a
filler matmul keeps the stream busy while the host issues the call, so neither host time nor an
idle GPU's wake-up lands between the events; the paged/contiguous ratio uses these), "b2b" (10
calls back to back) and "us" (one eager call on an idle stream: host time before the launch plus
the kernel, and slower again when the GPU idled ms before it; --diagnose splits it). TFLOP/s = 4 * qo * kv * num_qo_heads * head_dim / time; causal halves the work.
fp8 columns (--fp8 e4m3 / e5m2, default e4m3; "none" skips): the same paged batch over an fp8 cache with
per-kv-head k_scale / v_scale (backend "auto": fa3 on sm_90, else fa2; GPU alone), its ratio to the fp16 paged time (fp16 us / fp8 us: the
issue-22 target is >= 0.95), the same ratio against the fp16 paged call over a cache of the fp8 cache's values ("16=": the
tensor cores see the same numbers; an H100's clock under its power cap depends on the data), and FlashInfer's fp8 paged
prefill (same cache bytes) when importable.
The fp16 matmul ceiling (cuBLAS through CuPy, 8192^3) is measured in the same run. SDPA and
FlashInfer are timed the same way when importable; otherwise the PEERS.md H100 numbers are
printed, labelled as not from this run. JSON goes to benchmarks/results/ (or --out).
Chunked prefill (--chunked 8192 32768 [--chunk 512]; --shapes with no value skips the square grid): one
request's 512 new queries over a cached prefix of 8k / 32k tokens (causal, bottom-right), paged, next to
the contiguous fa3 kernel on the same K/V and FlashInfer's fa2 / fa3 paged wrappers.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import cupy as cp  # noqa: E402

import cuattn  # noqa: E402
from cuattn import jit  # noqa: E402

# PEERS.md, H100, 32:8 heads, hd128, fp16: (batch, len, causal) -> (SDPA cuDNN us, FlashInfer fa2 us)
PEERS_H100 = {(1, 1024, False): (35.1, 60.0), (1, 1024, True): (34.7, 59.7), (1, 4096, False): (420, 780),
              (1, 4096, True): (263, 500), (1, 16384, False): (7380, 12320), (1, 16384, True): (3570, 6630),
              (8, 2048, False): (849, 1655), (8, 2048, True): (511, 913)}


def flops(batch, qo, kv, heads, d, causal):
    f = 4.0 * batch * qo * kv * heads * d        # QK^T and PV, 2 flops per multiply-add each
    return f / 2 if causal else f                 # causal halves the work


def time_cupy(fn, reps, warmup=5, inner=1):
    """Median ms per call; events around ``inner`` back-to-back calls (inner > 1 hides the host
    time of a call behind the previous call's kernel, leaving the GPU time when that is longer)."""
    for _ in range(warmup):
        fn()
    stream = cp.cuda.get_current_stream()
    times = []
    for _ in range(reps):
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record(stream)
        for _ in range(inner):
            fn()
        b.record(stream)
        b.synchronize()
        times.append(cp.cuda.get_elapsed_time(a, b) / inner)
    return float(np.median(times))


def gpu_us(fn, reps, warmup=3):
    """Median GPU time of one call alone: a ~1 ms matmul queued first keeps the stream busy
    while the host issues the events and the call, so neither host time nor launch latency
    lands between the events (the call's kernels start as soon as the matmul ends)."""
    n = 6144     # ~0.6 ms on an H100: longer than a per-call host time (~90 us seen on one)
    a = cp.ones((n, n), cp.float16)
    for _ in range(warmup):
        fn()
    stream = cp.cuda.get_current_stream()
    times = []
    for _ in range(reps):
        a @ a
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        e0.record(stream)
        fn()
        e1.record(stream)
        e1.synchronize()
        times.append(cp.cuda.get_elapsed_time(e0, e1) * 1e3)
    return float(np.median(times))


def host_us(fn, n=50):
    """Host time of one call (no synchronization; the GPU queue absorbs the launches)."""
    cp.cuda.Device().synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    dt = (time.perf_counter() - t) / n * 1e6
    cp.cuda.Device().synchronize()
    return dt


def time_torch(fn, reps, warmup=3):
    import torch
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return float(np.median(times))


def matmul_tflops(reps):
    n = 8192
    a = cp.random.standard_normal((n, n), dtype=cp.float32).astype(cp.float16)
    b = cp.random.standard_normal((n, n), dtype=cp.float32).astype(cp.float16)
    ms = time_cupy(lambda: a @ b, reps)
    return 2 * n ** 3 / (ms * 1e-3) / 1e12


def rand(shape, dtype):
    x = cp.random.standard_normal(shape, dtype=cp.float32)
    if dtype == "bfloat16":
        return (x.view(cp.uint32) >> 16).astype(cp.uint16)     # bf16 bits (truncated), CuPy has no bf16
    return x.astype(cp.float16)


FA3 = cp.cuda.Device().compute_capability == "90"     # cuattn's wgmma + TMA backend runs here


def contiguous_call(q, k, v, indptr, causal, hq, hkv, d, dtype, backend):
    """One prefill call on contiguous K/V: single_prefill for one request, else a planned ragged batch."""
    if len(indptr) == 2:
        return lambda: cuattn.single_prefill_with_kv_cache(q, k, v, causal=causal, backend=backend)
    w = cuattn.BatchPrefillWithRaggedKVCacheWrapper(backend=backend)
    w.plan(indptr, indptr, hq, hkv, d, causal=causal, q_data_type=dtype)
    out = cp.empty_like(q)
    return lambda: w.run(q, k, v, out=out)


def paged_call(q, indptr, length, causal, hq, hkv, d, page_size, dtype, order="random"):
    """(call, cache, page ids, last_page_len, pages per request): the batch of ``indptr`` (qo = kv =
    ``length`` each) over a paged cache; page order "random" (a permutation of the whole cache),
    "sequential" (request b's pages are b * pages_per ...) or "local" (a permutation within each run
    of 2 MiB of pages, so TLB reach matches the contiguous case)."""
    batch = len(indptr) - 1
    pages_per = -(-length // page_size)
    total = batch * pages_per
    if order == "random":
        perm = np.random.default_rng(0).permutation(total).astype(np.int32)
    elif order == "sequential":
        perm = np.arange(total, dtype=np.int32)
    else:   # local: permuted within windows of 2 MiB of cache
        win = max(1, (2 << 20) // (2 * page_size * hkv * d * 2))
        rng = np.random.default_rng(0)
        perm = np.concatenate([i + rng.permutation(min(win, total - i)) for i in range(0, total, win)]).astype(np.int32)
    cache = rand((total, 2, page_size, hkv, d), dtype)
    wp = cuattn.BatchPrefillWithPagedKVCacheWrapper()
    last = np.full(batch, length - (pages_per - 1) * page_size, np.int32)
    wp.plan(indptr, np.arange(batch + 1, dtype=np.int32) * pages_per, perm, last, hq, hkv, d, page_size,
            causal=causal, q_data_type=dtype)
    out = cp.empty_like(q)
    return (lambda: wp.run(q, cache, out=out)), cache, perm, last, pages_per


def paged_fp8_call(q, indptr, perm, last, pages_per, causal, hq, hkv, d, page_size, dtype, kv):
    """(call, cache, scales, backend): the paged batch of paged_call (same page table, backend "auto") over an
    fp8 cache of random finite bytes (uint8, read as plan()'s kv_data_type) with per-kv-head k_scale / v_scale."""
    batch, total = len(indptr) - 1, len(perm)
    # clear an exponent bit: no NaN / inf bit patterns, magnitudes below 1 (e4m3: 0xB7, e5m2: 0xBB)
    cache = cp.random.randint(0, 256, (total, 2, page_size, hkv, d), dtype=cp.int32).astype(cp.uint8) & \
        (0xB7 if kv == "e4m3" else 0xBB)
    scales = (cp.full(hkv, 0.5, cp.float32), cp.full(hkv, 0.25, cp.float32))
    wp = cuattn.BatchPrefillWithPagedKVCacheWrapper()
    wp.plan(indptr, np.arange(batch + 1, dtype=np.int32) * pages_per, perm, last, hq, hkv, d, page_size,
            causal=causal, q_data_type=dtype, kv_data_type="float8_e4m3fn" if kv == "e4m3" else "float8_e5m2")
    out = cp.empty_like(q)
    form = wp.backend + ("+ahead" if "gathered ahead" in wp.describe() else "")   # (prefill_ahead: rows gathered ahead)
    return (lambda: wp.run(q, cache, out=out, k_scale=scales[0], v_scale=scales[1])), cache, scales, form


def paged_same_values_call(q, indptr, perm, last, pages_per, causal, hq, hkv, d, page_size, dtype, kv, cache8, scales):
    """The fp16 / bf16 paged call (q's dtype) over a 16-bit cache holding exactly the fp8 cache's values, with the
    same scales: the tensor cores see the same numbers as in the fp8 run (an H100's clock under its power cap depends
    on the data: the randn cache of the fp16 column draws more power than the fp8 cache's values)."""
    import ml_dtypes
    fp8_t = ml_dtypes.float8_e4m3fn if kv == "e4m3" else ml_dtypes.float8_e5m2
    to = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float16
    lut = cp.asarray(np.arange(256, dtype=np.uint8).view(fp8_t).astype(to).view(np.uint16))
    cache = lut[cache8]
    cache = cache if dtype == "bfloat16" else cache.view(cp.float16)
    batch = len(indptr) - 1
    wp = cuattn.BatchPrefillWithPagedKVCacheWrapper()
    wp.plan(indptr, np.arange(batch + 1, dtype=np.int32) * pages_per, perm, last, hq, hkv, d, page_size,
            causal=causal, q_data_type=dtype)
    out = cp.empty_like(q)
    return lambda: wp.run(q, cache, out=out, k_scale=scales[0], v_scale=scales[1])


def run_case(batch, length, causal, hq, hkv, d, dtype, reps, page_size, sdpa, flashinfer=None, fp8="e4m3",
             flashinfer_fp8=None):
    res = dict(batch=batch, qo_len=length, kv_len=length, causal=causal, num_qo_heads=hq, num_kv_heads=hkv,
               head_dim=d, dtype=dtype)
    f = flops(batch, length, length, hq, d, causal)
    nnz = batch * length
    q, k, v = rand((nnz, hq, d), dtype), rand((nnz, hkv, d), dtype), rand((nnz, hkv, d), dtype)
    indptr = np.arange(batch + 1, dtype=np.int32) * length
    call = contiguous_call(q, k, v, indptr, causal, hq, hkv, d, dtype, "fa2")
    ms = time_cupy(call, reps)
    res.update(us=ms * 1e3, tflops=f / (ms * 1e-3) / 1e12)
    g = gpu_us(call, reps)
    res.update(gpu_us=g, gpu_tflops=f / (g * 1e-6) / 1e12)
    if FA3 and d == 128:     # the Hopper backend (contiguous K/V), GPU alone
        g3 = gpu_us(contiguous_call(q, k, v, indptr, causal, hq, hkv, d, dtype, "fa3"), reps)
        res.update(fa3_gpu_us=g3, fa3_gpu_tflops=f / (g3 * 1e-6) / 1e12)
    if length <= 4096:       # short calls: GPU time with launches back to back, and host time per call
        ms_b = time_cupy(call, reps, inner=10)
        res.update(b2b_us=ms_b * 1e3, b2b_tflops=f / (ms_b * 1e-3) / 1e12, host_us=host_us(call))
    # -- paged K/V, random page order, same lengths
    paged, cache, perm, last, pages_per = paged_call(q, indptr, length, causal, hq, hkv, d, page_size, dtype)
    ms_p = time_cupy(paged, reps)
    gp = gpu_us(paged, reps)
    res.update(paged_us=ms_p * 1e3, paged_tflops=f / (ms_p * 1e-3) / 1e12, paged_ratio=ms_p / ms,
               paged_gpu_us=gp, paged_gpu_ratio=gp / g)
    if flashinfer is not None:
        res.update(flashinfer(q, cache, indptr, pages_per, perm, last, causal, hq, hkv, d, page_size, dtype, reps, f))
    del cache, paged
    if fp8 != "none":        # -- the same batch over an fp8 cache (auto: fa3 on sm_90), next to the fp16 paged time
        paged8, cache8, scales8, backend8 = paged_fp8_call(q, indptr, perm, last, pages_per, causal, hq, hkv, d,
                                                           page_size, dtype, fp8)
        g8 = gpu_us(paged8, reps)
        g16s = gpu_us(paged_same_values_call(q, indptr, perm, last, pages_per, causal, hq, hkv, d, page_size, dtype, fp8,
                                             cache8, scales8), reps)
        res.update(fp8=fp8, paged_fp8_backend=backend8, paged_fp8_gpu_us=g8, paged_fp8_gpu_tflops=f / (g8 * 1e-6) / 1e12,
                   paged_fp8_speed_vs_fp16=gp / g8, paged_fp16_same_values_gpu_us=g16s,
                   paged_fp8_speed_vs_fp16_same_values=g16s / g8)
        if flashinfer_fp8 is not None:
            res.update(flashinfer_fp8(q, cache8, indptr, pages_per, perm, last, causal, hq, hkv, d, page_size,
                                      dtype, reps, f, kv=fp8))
        del cache8, paged8
    if sdpa is not None:
        res.update(sdpa(batch, length, causal, hq, hkv, d, dtype, reps, f))
    return res


def run_chunked(prefix, chunk, hq, hkv, d, dtype, reps, page_size, flashinfer=None):
    """Chunked prefill: one request whose ``chunk`` new queries attend a cached prefix of ``prefix`` tokens plus
    themselves (kv_len = prefix + chunk, causal aligned bottom-right), over a paged cache in random page order:
    cuattn's paged wrapper (backend "auto"), cuattn's contiguous fa3 on the same K/V (sm_90) and FlashInfer's
    fa2 / fa3 paged wrappers, GPU alone."""
    kv_len = prefix + chunk
    f = 4.0 * hq * d * (chunk * prefix + chunk * (chunk + 1) / 2)       # key i of the chunk sees prefix + i + 1
    res = dict(kind="chunked", chunk=chunk, prefix=prefix, kv_len=kv_len, num_qo_heads=hq, num_kv_heads=hkv,
               head_dim=d, dtype=dtype, page_size=page_size)
    q = rand((chunk, hq, d), dtype)
    pages_per = -(-kv_len // page_size)
    perm = np.random.default_rng(0).permutation(pages_per).astype(np.int32)
    cache = rand((pages_per, 2, page_size, hkv, d), dtype)
    qo_indptr = np.array([0, chunk], np.int32)
    last = np.array([kv_len - (pages_per - 1) * page_size], np.int32)
    wp = cuattn.BatchPrefillWithPagedKVCacheWrapper()
    wp.plan(qo_indptr, np.array([0, pages_per], np.int32), perm, last, hq, hkv, d, page_size, causal=True,
            q_data_type=dtype)
    out = cp.empty_like(q)
    g = gpu_us(lambda: wp.run(q, cache, out=out), reps)
    res.update(backend=wp.backend, paged_gpu_us=g, paged_gpu_tflops=f / (g * 1e-6) / 1e12)
    if FA3:                  # the same keys / values contiguous, in token order
        k = cache[perm, 0].reshape(-1, hkv, d)[:kv_len].copy()
        v = cache[perm, 1].reshape(-1, hkv, d)[:kv_len].copy()
        g3 = gpu_us(lambda: cuattn.single_prefill_with_kv_cache(q, k, v, causal=True, backend="fa3"), reps)
        res.update(fa3_gpu_us=g3, fa3_gpu_tflops=f / (g3 * 1e-6) / 1e12)
        del k, v
    if flashinfer is not None:
        res.update(flashinfer(q, cache, qo_indptr, pages_per, perm, last, True, hq, hkv, d, page_size, dtype, reps, f))
    return res


def make_sdpa():
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        return None

    def sdpa(batch, length, causal, hq, hkv, d, dtype, reps, f):
        tdt = torch.float16 if dtype == "float16" else torch.bfloat16
        q = torch.randn(batch, hq, length, d, dtype=tdt, device="cuda")
        k = torch.randn(batch, hkv, length, d, dtype=tdt, device="cuda")
        v = torch.randn(batch, hkv, length, d, dtype=tdt, device="cuda")
        out = {}
        ms = time_torch(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True), reps)
        out.update(sdpa_us=ms * 1e3, sdpa_tflops=f / (ms * 1e-3) / 1e12)
        try:
            from torch.nn.attention import SDPBackend, sdpa_kernel
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                ms = time_torch(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True), reps)
            out.update(sdpa_cudnn_us=ms * 1e3, sdpa_cudnn_tflops=f / (ms * 1e-3) / 1e12)
        except RuntimeError as e:      # cuDNN backend refused this shape
            out.update(sdpa_cudnn_error=str(e)[:200])
        return out
    return sdpa


def make_flashinfer():
    """FlashInfer's paged prefill (fa2 and, on Hopper, fa3) on our paged inputs, timed like ours
    (GPU alone), or None when it is not importable. ``kv`` None: the 16-bit cache; "e4m3" / "e5m2":
    the same cache bytes read as fp8 with k_scale / v_scale as floats (FlashInfer takes per-tensor
    scales), its results under "flashinfer_<backend>_fp8_*"."""
    try:
        import flashinfer
        import torch
    except ImportError:
        return None

    def fi(q, cache, indptr, pages_per, perm, last, causal, hq, hkv, d, page_size, dtype, reps, f, kv=None):
        tdt = torch.float16 if dtype == "float16" else torch.bfloat16
        tq = torch.from_dlpack(q.view(cp.uint16)).view(tdt)
        if kv is None:
            kdt, tag, scales = tdt, "", {}
            tc = torch.from_dlpack(cache.view(cp.uint16)).view(tdt)
        else:
            kdt, tag, scales = (torch.float8_e4m3fn if kv == "e4m3" else torch.float8_e5m2), "_fp8", \
                dict(k_scale=0.5, v_scale=0.25)
            tc = torch.from_dlpack(cache).view(kdt)
        ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
        out = {}
        for backend in ("fa2", "fa3") if cp.cuda.Device().compute_capability == "90" else ("fa2",):
            try:
                w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend=backend)
                w.plan(torch.from_numpy(indptr), torch.from_numpy(np.arange(len(indptr), dtype=np.int32) * pages_per),
                       torch.from_numpy(perm).cuda(), torch.from_numpy(last), hq, hkv, d, page_size,
                       causal=causal, q_data_type=tdt, kv_data_type=kdt)
                g = gpu_us(lambda: w.run(tq, tc, **scales), reps)
                out[f"flashinfer_{backend}{tag}_gpu_us"] = g
                out[f"flashinfer_{backend}{tag}_gpu_tflops"] = f / (g * 1e-6) / 1e12
            except Exception as e:    # a backend FlashInfer cannot build or run here: say so, go on
                out[f"flashinfer_{backend}{tag}_error"] = f"{type(e).__name__}: {str(e)[:200]}"
        return out
    return fi


def check(args):
    """Small correctness check against a float64 reference before timing."""
    from tests.oracle import dense_attention, rel_err
    q = rand((300, 32, args.head_dim[0]), "float16")
    k = rand((700, 8, args.head_dim[0]), "float16")
    v = rand((700, 8, args.head_dim[0]), "float16")
    out = cuattn.single_prefill_with_kv_cache(q, k, v, causal=True, backend="fa2")
    err = rel_err(cp.asnumpy(out), dense_attention(cp.asnumpy(q), cp.asnumpy(k), cp.asnumpy(v), causal=True)[0])
    print(f"check: rel_err {err:.2e}")
    assert err < 5e-3


VARIANTS = [(2, 32, 3), (2, 64, 2), (2, 64, 2, "QK_UNROLL=1"), (2, 64, 2, "QK_UNROLL=4")]
# --variants paged: the paged page-id schemes (PAGE_CPASYNC=0: page id held in a register, QK unroll 1)
VARIANTS_PAGED = [(2, 64, 2, "PAGE_CPASYNC=0"), (2, 64, 2, "PAGE_CPASYNC=1", "QK_UNROLL=1"), (2, 64, 2)]


# --variants issue4: compile-time switches of prefill.cu, each against the shipped defaults in the same run
# (FULL_TILE_FAST, O_SMEM, a persistent grid and LOADS_LATE were tried on 2026-11-22 and dropped;
# PAGE_ADDR32 shipped on sm_90: prefill_notes.md)
VARIANTS_ISSUE4 = [(), ("PAGE_ADDR32=0",), ("L2_PREFETCH=128",)]


def _with_variant(var):
    """Patch prefill_batch.make_spec (plan()'s) so every spec carries the -D defines ``var`` (tile config
    unchanged)."""
    from cuattn import prefill_batch
    orig = prefill_batch._ORIG_MAKE_SPEC = getattr(prefill_batch, "_ORIG_MAKE_SPEC", prefill_batch.make_spec)

    def make(*args, **kw):
        return dataclasses.replace(orig(*args, **kw), tuning=tuple(var))
    prefill_batch.make_spec = make if var else orig


def _ragged_calls(batch, length, causal, hq, hkv, d, page_size, order="random"):
    """(contiguous call, paged call) for batch x length, fa2, fp16 (page orders: paged_call)."""
    nnz = batch * length
    q, k, v = rand((nnz, hq, d), "float16"), rand((nnz, hkv, d), "float16"), rand((nnz, hkv, d), "float16")
    indptr = np.arange(batch + 1, dtype=np.int32) * length
    paged = paged_call(q, indptr, length, causal, hq, hkv, d, page_size, "float16", order)[0]
    return contiguous_call(q, k, v, indptr, causal, hq, hkv, d, "float16", "fa2"), paged


def sweep_issue4(args, hq, hkv):
    """Each variant: oracle check (small ragged + paged batch, both masks), then GPU-alone time (gpu_us)
    of 8x2048 full/causal, 1x4096 and 1x16384 full, contiguous and paged; two
    rounds, variants interleaved, so the spread between rounds shows the noise."""
    from tests.test_prefill import _batch_case, _single_case
    cases = [(8, 2048, False), (8, 2048, True), (1, 4096, False)]
    res = {}
    for rnd in range(2):
        for var in VARIANTS_ISSUE4:
            _with_variant(var)
            # plans choose their spec in plan(): build them after patching make_spec, per variant
            # (until 2026-11-22 round 2 they were built once, so batch and paged rows ran the
            # default spec for every variant; only the single-request rows compared variants)
            calls = {c: _ragged_calls(*c, hq, hkv, 128, args.page_size) for c in cases}
            big = _ragged_calls(1, 16384, False, hq, hkv, 128, args.page_size)
            key = "+".join(var) or "default"
            r = res.setdefault(key, dict(variant=list(var), rounds=[]))
            try:
                if rnd == 0:
                    for causal in (False, True):
                        for paged in (False, True):
                            _batch_case(5, 16, (32, 8), 128, causal, False, "float16", "NHD", paged=paged)
                    for case in ((1000, 1000, (32, 8), 128, False, "float16", "NHD"),
                                 (77, 4097, (32, 8), 128, False, "bfloat16", "HND"),
                                 (3000, 65, (32, 4), 128, False, "float16", "NHD")):
                        _single_case(*case)
                    _batch_case(9, 16, (32, 8), 128, False, False, "bfloat16", "HND", paged=False)
                    r["check"] = "ok"
                row = {}
                for (b, n, c), (fc, fp) in calls.items():
                    tag = f"{b}x{n}{'c' if c else ''}"
                    row[tag] = gpu_us(fc, 15)
                    row[tag + "_paged"] = gpu_us(fp, 15)
                row["1x16384"] = gpu_us(big[0], 7, warmup=2)
                row["1x16384_paged"] = gpu_us(big[1], 7, warmup=2)
                r["rounds"].append(row)
                print(f"round {rnd} {key}: " + " ".join(f"{k}={v:.0f}" for k, v in row.items()), flush=True)
            except Exception as e:   # a variant that fails (check or launch) is reported, not fatal
                r["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                print(f"round {rnd} {key}: failed: {r['error']}", flush=True)
    _with_variant(())
    for key, r in res.items():
        if len(r["rounds"]) == 2:
            r["mean"] = {k: (r["rounds"][0][k] + r["rounds"][1][k]) / 2 for k in r["rounds"][0]}
    return res


def paged_order_diag(args, hq, hkv):
    """Why the paged gather costs 4-23 % depending on the machine: 8x2048 full, GPU-alone time of
    the contiguous kernel and of the paged one with page 16 / 64 in random, sequential and local
    (random within 2 MiB) page order, two rounds interleaved (ratios to the same round's contiguous)."""
    setups = [(16, "random"), (16, "sequential"), (16, "local"), (64, "random"), (64, "sequential")]
    calls = {}
    for ps, order in setups:
        c, p = _ragged_calls(8, 2048, False, hq, hkv, 128, ps, order)
        calls[(ps, order)] = p
        calls["contig"] = c
    out = {}
    for rnd in range(2):
        base = gpu_us(calls["contig"], 15)
        row = {"contig": base}
        for key in setups:
            row[f"p{key[0]}_{key[1]}"] = gpu_us(calls[key], 15)
        out[f"round{rnd}"] = row
        print(f"paged diag round {rnd}: " + " ".join(f"{k}={v:.0f}({v / base:.3f})" for k, v in row.items()),
              flush=True)
    return out


def diagnose_percall(args, hq, hkv):
    """Why per-call time exceeds GPU-alone time (8x2048, contiguous, full): events recorded just
    before and after the kernel launch split a per-call sample into host-before-launch (GPU idle),
    kernel and after; per-call also after 2 ms / 20 ms host sleeps (clock ramp?); nvidia-smi
    samples SM clock and power during each loop; launches per call counted."""
    import subprocess
    from cuattn import prefill
    call, _ = _ragged_calls(8, 2048, False, hq, hkv, 128, args.page_size)
    stream = cp.cuda.get_current_stream()
    orig_launch = prefill._launch
    marks, launches = [], [0]

    def launch(*a, **kw):
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        e0.record(stream)
        orig_launch(*a, **kw)
        e1.record(stream)
        marks.append((e0, e1))
        launches[0] += 1
    out = {}
    for _ in range(5):
        call()
    prefill._launch = launch
    try:
        split, host = [], []
        for _ in range(30):
            marks.clear()
            a, b = cp.cuda.Event(), cp.cuda.Event()
            a.record(stream)
            t = time.perf_counter()
            call()
            host.append((time.perf_counter() - t) * 1e6)
            b.record(stream)
            b.synchronize()
            e0, e1 = marks[0]
            split.append((cp.cuda.get_elapsed_time(a, e0) * 1e3, cp.cuda.get_elapsed_time(e0, e1) * 1e3,
                          cp.cuda.get_elapsed_time(e1, b) * 1e3, cp.cuda.get_elapsed_time(a, b) * 1e3))
        out["launches_per_call"] = launches[0] / 30
        sp = np.median(np.array(split), axis=0)
        out.update(before_launch_us=sp[0], launch_to_end_us=sp[1], after_us=sp[2], total_us=sp[3],
                   host_call_us_percall_mode=float(np.median(host)))
    finally:
        prefill._launch = orig_launch

    def smi_during(fn, seconds=1.0):
        p = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
                              "-lms", "20"], stdout=subprocess.PIPE, text=True)
        t0 = time.perf_counter()
        val = []
        while time.perf_counter() - t0 < seconds:
            val.append(fn())
        p.terminate()
        txt = p.communicate()[0]
        rows = [list(map(float, ln.split(","))) for ln in txt.strip().splitlines() if ln.count(",") == 1]
        clk = np.array(rows) if rows else np.zeros((1, 2))
        return float(np.median(val)), float(np.median(clk[:, 0])), float(np.median(clk[:, 1]))

    def percall_once(sleep_s=0.0):
        if sleep_s:
            time.sleep(sleep_s)
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record(stream)
        call()
        b.record(stream)
        b.synchronize()
        return cp.cuda.get_elapsed_time(a, b) * 1e3

    def b2b_once():
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record(stream)
        for _ in range(10):
            call()
        b.record(stream)
        b.synchronize()
        return cp.cuda.get_elapsed_time(a, b) * 1e3 / 10

    def gpu_once():
        return gpu_us(call, 1, warmup=0)
    for name, fn in (("percall", percall_once), ("percall_sleep2ms", lambda: percall_once(0.002)),
                     ("percall_sleep20ms", lambda: percall_once(0.02)), ("b2b", b2b_once), ("gpu_alone", gpu_once)):
        us, clk, pw = smi_during(fn)
        out[name] = dict(us=us, sm_mhz=clk, power_w=pw)
    print("diagnose 8x2048 full:", json.dumps(out), flush=True)
    return out


def sweep_variants(args, hq, hkv, mm):
    """Tile configurations (num_mma_q, block_n, stages) on 1 x 16k, hd128, by patching plan()'s make_spec."""
    from cuattn import prefill_batch
    print("variant sweep, 1x16384 hd128 fp16 (num_mma_q, block_n, stages): TFLOP/s full / causal / paged full")
    sweep = []
    orig_make = prefill_batch.make_spec
    for var in (VARIANTS_PAGED if args.variants == "paged" else VARIANTS):
        prefill_batch.make_spec = lambda *a, var=var, **kw: dataclasses.replace(
            orig_make(*a, **kw), num_mma_q=var[0], block_n=var[1], stages=var[2], tuning=tuple(var[3:]))
        try:
            res = [run_case(1, 16384, c, hq, hkv, 128, "float16", 7, args.page_size, None) for c in (False, True)]
            rg = run_case(8, 2048, False, hq, hkv, 128, "float16", 7, args.page_size, None)
            regs = jit.compile_kernel(prefill_batch.make_spec(128, "f16", False, False, False), "sm_90a").resources
            print(f"  {var}: {res[0]['tflops']:.0f} / {res[1]['tflops']:.0f} / {res[0]['paged_tflops']:.0f}"
                  f" / 8x2048 {rg['tflops']:.0f}  {regs.get('cuattn_prefill', regs)}", flush=True)
            sweep.append(dict(variant=list(map(str, var)), full=res[0], causal=res[1], ragged=rg, resources=regs))
        except Exception as e:  # a variant that fails to launch (smem) is reported, not fatal
            print(f"  {var}: failed: {type(e).__name__}: {str(e)[:120]}")
    prefill_batch.make_spec = orig_make
    return sweep


def _peer_cols(r, tag, ours):
    """FlashInfer fa2 / fa3 columns of a table row: its GPU µs and its time over ``ours`` ('-' where absent)."""
    cols = ""
    for b in ("fa2", "fa3"):
        fi = r.get(f"flashinfer_{b}{tag}_gpu_us")
        cols += f"{fi:9.1f}{fi / ours:7.2f}" if fi else f"{'-':>9}{'-':>7}"
    return cols


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shapes", nargs="*", default=["1x1024", "1x4096", "1x16384", "8x2048"])
    ap.add_argument("--head-dim", type=int, nargs="*", default=[128])
    ap.add_argument("--dtype", nargs="*", default=["float16"])
    ap.add_argument("--heads", default="32:8")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--no-sdpa", action="store_true")
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--diagnose", action="store_true", help="split 8x2048 per-call time (host, kernel, clocks)")
    ap.add_argument("--variants", nargs="?", const="tiles", default=None, choices=("tiles", "paged", "issue4"),
                    help="sweep tile configurations (or the paged variants: --variants paged) first (hd128)")
    ap.add_argument("--paged-diag", action="store_true", help="8x2048 paged: page size and page order")
    ap.add_argument("--fp8", default="e4m3", choices=("e4m3", "e5m2", "none"),
                    help="paged fp8 columns: the KV format (none: skip)")
    ap.add_argument("--fa3-producer", default="auto", choices=("auto", "tma"),
                    help="fa3 paged producer: auto (the cp.async gather for 16-bit caches) or tma (a TMA box per "
                         "page, as fp8 caches take: the A/B of the two)")
    ap.add_argument("--fa3-stages", type=int, default=0, help="experiment: K/V stages of every fa3 spec (0: the spec's)")
    ap.add_argument("--fa3-tuning", nargs="*", default=[], help="experiment: -D defines for every fa3 spec")
    ap.add_argument("--chunked", type=int, nargs="*", default=[],
                    help="chunked-prefill rows: cached prefix lengths (e.g. 8192 32768), --chunk queries each")
    ap.add_argument("--chunk", type=int, default=512, help="queries of a chunked-prefill row")
    ap.add_argument("--out", default=None)
    ap.add_argument("--profile-host", action="store_true", help="cProfile 200 eager 1x1024 calls")
    args = ap.parse_args()
    hq, hkv = map(int, args.heads.split(":"))
    if args.fa3_producer == "tma":
        from cuattn import prefill_sm90
        prefill_sm90.use_gather = lambda *a, **kw: False
    if args.fa3_stages or args.fa3_tuning:      # experiments: every fa3 spec with these stages / defines
        from cuattn import prefill_sm90
        made = prefill_sm90.make_spec

        def make_spec(*a, **kw):
            spec = made(*a, **kw)
            return dataclasses.replace(spec, stages=args.fa3_stages or spec.stages, tuning=tuple(args.fa3_tuning))
        prefill_sm90.make_spec = make_spec
    dev = cp.cuda.Device(0)
    name = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    env = dict(gpu=name, sm=dev.compute_capability, cupy=cp.__version__, nvrtc="%d.%d" % jit.nvrtc_version(),
               cuattn=cuattn.__version__, python=platform.python_version(), backend="fa2",
               date=time.strftime("%Y-%m-%d %H:%M:%S %Z"), page_size=args.page_size, fa3_paged_producer=args.fa3_producer)
    print("env:", env)
    if args.check:
        check(args)
    mm = matmul_tflops(args.reps)
    print(f"fp16 matmul 8192^3 (cuBLAS via CuPy): {mm:.0f} TFLOP/s")
    sdpa = None if args.no_sdpa else make_sdpa()
    flashinfer = make_flashinfer()
    flashinfer_fp8 = flashinfer if args.fp8 != "none" else None
    if flashinfer is None:
        print("flashinfer: not importable here; PEERS.md H100 numbers shown (not from this run)")
    diag = diagnose_percall(args, hq, hkv) if args.diagnose else None
    pdiag = paged_order_diag(args, hq, hkv) if args.paged_diag else None
    if args.variants == "issue4":
        sweep = sweep_issue4(args, hq, hkv)
    else:
        sweep = sweep_variants(args, hq, hkv, mm) if args.variants else None
    if args.profile_host:
        import cProfile
        import pstats
        q, k, v = rand((1024, hq, 128), "float16"), rand((1024, hkv, 128), "float16"), rand((1024, hkv, 128), "float16")
        for _ in range(5):
            cuattn.single_prefill_with_kv_cache(q, k, v, backend="fa2")
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(200):
            cuattn.single_prefill_with_kv_cache(q, k, v, backend="fa2")
        pr.disable()
        cp.cuda.Device().synchronize()
        pstats.Stats(pr).sort_stats("tottime").print_stats(12)
    rows = []
    for dtype in args.dtype:
        for d in args.head_dim:
            for shp in args.shapes:
                b, n = map(int, shp.split("x"))
                for causal in (False, True):
                    r = run_case(b, n, causal, hq, hkv, d, dtype, args.reps, args.page_size, sdpa, flashinfer,
                                 args.fp8, flashinfer_fp8)
                    r["matmul_tflops"] = mm
                    peer = PEERS_H100.get((b, n, causal)) if (d == 128 and (hq, hkv) == (32, 8)) else None
                    if peer:
                        r["peers_h100_not_this_run"] = dict(sdpa_cudnn_us=peer[0], flashinfer_fa2_us=peer[1])
                    rows.append(r)
                    print(json.dumps(r), flush=True)
    chunked = []
    for dtype in args.dtype:
        for d in args.head_dim:
            for prefix in args.chunked:
                r = run_chunked(prefix, args.chunk, hq, hkv, d, dtype, args.reps, args.page_size, flashinfer)
                chunked.append(r)
                print(json.dumps(r), flush=True)
    out = Path(args.out) if args.out else (Path(__file__).parent / "results" /
                                           f"prefill_{name.replace(' ', '_')}_{int(time.time())}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(env=env, matmul_tflops=mm, rows=rows, chunked=chunked, variants=sweep, diagnose=diag,
                                   paged_diag=pdiag), indent=1))
    if chunked:
        print(f"\n{'chunked prefill (causal)':<30}{'backend':>8}{'paged us':>10}{'TF/s':>6}{'fa3 ct us':>10}{'pg/ct':>7}"
              f"{'FI2 us':>9}{'FI2/pg':>7}{'FI3 us':>9}{'FI3/pg':>7}")
        for r in chunked:
            g, g3 = r["paged_gpu_us"], r.get("fa3_gpu_us")
            ct = f"{g3:10.1f}{g3 / g:7.2f}" if g3 else f"{'-':>10}{'-':>7}"
            peers = _peer_cols(r, "", g)
            print(f"{r['dtype'][:4] + ' hd' + str(r['head_dim']) + ' ' + str(r['chunk']) + ' x ' + str(r['prefix']):<30}"
                  f"{r['backend']:>8}{g:10.1f}{r['paged_gpu_tflops']:6.0f}{ct}{peers}")
        print("chunked = one request, --chunk new queries over a cached prefix (kv_len = prefix + chunk, causal "
              "bottom-right), paged (random page order), GPU alone; pg/ct = contiguous fa3 time over paged; "
              "FI2/pg, FI3/pg = FlashInfer fa2 / fa3 paged over ours (> 1: cuattn faster), same run.")
    print(f"\n{'case':<22}{'gpu us':>9}{'TF/s':>7}{'/mm':>6}{'call us':>9}{'b2b us':>8}{'host':>6}{'pg gpu us':>10}"
          f"{'pg/ct':>7}{'sdpa us':>9}{'sdpa/us':>8}{'FI2/pg':>8}{'FI3/pg':>8}{'fa3 us':>9}{'TF/s':>6}{'FI3/fa3':>8}")
    for r in rows:
        case = f"{r['dtype'][:4]} hd{r['head_dim']} {r['batch']}x{r['qo_len']}{' c' if r['causal'] else ''}"
        sd = r.get("sdpa_cudnn_us", r.get("sdpa_us"))
        peer = r.get("peers_h100_not_this_run", {}).get("flashinfer_fa2_us")
        us = r["us"]
        sd_s = "-" if sd is None else f"{sd:.1f}"
        sd_r = "-" if sd is None else f"{sd / us:.2f}"
        fi2, fi3 = r.get("flashinfer_fa2_gpu_us"), r.get("flashinfer_fa3_gpu_us")
        pr = (f"{fi2 / r['paged_gpu_us']:.2f}" if fi2 else "-" if peer is None else f"{peer / r['paged_gpu_us']:.2f}*")
        pr3 = f"{fi3 / r['paged_gpu_us']:.2f}" if fi3 else "-"
        g3 = r.get("fa3_gpu_us")
        fa3_s = (f"{g3:9.1f}{r['fa3_gpu_tflops']:6.0f}" + (f"{fi3 / g3:8.2f}" if fi3 else f"{'-':>8}")
                 if g3 else f"{'-':>9}{'-':>6}{'-':>8}")
        b2b = f"{r['b2b_us']:.1f}" if "b2b_us" in r else "-"
        hu = f"{r['host_us']:.0f}" if "host_us" in r else "-"
        g = r["gpu_us"]
        print(f"{case:<22}{g:9.1f}{r['gpu_tflops']:7.0f}{r['gpu_tflops'] / mm:6.2f}{us:9.1f}{b2b:>8}{hu:>6}"
              f"{r['paged_gpu_us']:10.1f}{r['paged_gpu_ratio']:7.2f}{sd_s:>9}{sd_r:>8}{pr:>8}{pr3:>8}{fa3_s}")
    print("gpu = kernel alone (TF/s, /mm and pg/ct from it); call = one eager call on an idle stream. "
          "sdpa = torch SDPA (cuDNN backend where it accepts the shape), same run, per call; sdpa/us > 1: cuattn "
          "faster. FI2/pg, FI3/pg = FlashInfer fa2 / fa3 paged prefill (page 16, same random page order) GPU time "
          "over ours, paged, same run (> 1: cuattn faster); * = PEERS.md H100 time, not this run. The columns "
          "before fa3 are cuattn's fa2 backend (mma.sync); fa3 = cuattn's Hopper backend (wgmma + TMA, "
          "contiguous K/V, what backend='auto' runs there), GPU alone; FI3/fa3 = FlashInfer fa3 (paged) over it.")
    fp8_rows = [r for r in rows if "paged_fp8_gpu_us" in r]
    if fp8_rows:
        print(f"\n{'case (paged, fp8 KV)':<26}{'fp16 us':>9}{'fp8 us':>9}{'TF/s':>7}{'16/8':>7}{'16= us':>9}{'16=/8':>7}"
              f"{'FI2 fp8':>9}{'FI2/8':>7}{'FI3 fp8':>9}{'FI3/8':>7}")
        for r in fp8_rows:
            case = (f"{r['fp8']} {r.get('paged_fp8_backend', '')} hd{r['head_dim']} {r['batch']}x{r['qo_len']}"
                    f"{' c' if r['causal'] else ''}")
            g8 = r["paged_fp8_gpu_us"]
            peers = _peer_cols(r, "_fp8", g8)
            print(f"{case:<26}{r['paged_gpu_us']:9.1f}{g8:9.1f}{r['paged_fp8_gpu_tflops']:7.0f}"
                  f"{r['paged_fp8_speed_vs_fp16']:7.2f}{r['paged_fp16_same_values_gpu_us']:9.1f}"
                  f"{r['paged_fp8_speed_vs_fp16_same_values']:7.2f}{peers}")
        print("fp8 = cuattn paged prefill over an fp8 cache (per-kv-head scales; backend named in the case: 'auto' "
              "picks it, as for the fp16 paged column; '+ahead': the batch's rows gathered and converted to 16 bits once, "
              "ahead of the contiguous kernel, prefill_ahead.py), GPU alone; 16/8 = fp16 paged GPU "
              "time over it (target >= 0.95); 16= = the fp16 paged call over a cache holding the fp8 cache's values "
              "(same scales: the same numbers in the tensor cores, whose clock under the power cap depends on the data), "
              "16=/8 its time over fp8's; FI2/8, FI3/8 = FlashInfer fp8 paged (fa2 / fa3) over ours (> 1: cuattn "
              "faster), same run.")


if __name__ == "__main__":
    main()
