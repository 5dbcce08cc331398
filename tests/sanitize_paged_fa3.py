"""Run by tests/test_prefill_sm90.py under compute-sanitizer memcheck (not a test itself): small paged
fa3 prefill batches through the gather (16-bit caches with cp.async, fp8 caches converted in registers) and
through TMA boxes (the fused RoPE at head_dim 256, the one case the gather does not take), with CuPy's memory pool off so every array is its
own allocation (the pool would hide out-of-bounds accesses inside its blocks). Exits 0 when each output is
finite; memcheck's own report decides the test. fp8 batches: pages of 1, 5, 16; head_dim 64 and 128 (the fp8 gather
reads row 0 of the cache for keys past a request's end: with no spare page, still inside the allocation), each run
twice: converted in the kernel, and converted ahead into the wrapper's buffer; the 16-bit batches whose kernel has no
query / key transform, likewise gathered ahead (prefill_ahead: page.cu cuattn_kv_rows)."""

import numpy as np

import cupy as cp

import cuattn
from cuattn import prefill_ahead

cp.cuda.set_allocator(None)
rng = np.random.default_rng(5)
hq, hkv = 8, 2
CASES = ((1, True, None, 128, False), (5, False, None, 128, False), (16, True, None, 128, False),
         (16, True, "float8_e4m3fn", 128, False), (5, False, "float8_e5m2", 128, False), (16, True, None, 256, True),
         (1, False, "float8_e4m3fn", 64, False), (16, False, "float8_e5m2", 64, False))


def run_case(page_size, causal, kv, d, rope, ahead=False):
    kv_lens, qo_lens = [37, 130, 3], [5, 130, 1]
    pages = [-(-n // page_size) for n in kv_lens]
    num_pages = sum(pages)                       # no spare page: a read past a request's pages leaves the array
    indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
    indices = rng.permutation(num_pages).astype(np.int32)
    last = np.array([n - (p - 1) * page_size for n, p in zip(kv_lens, pages)], np.int32)
    qo_indptr = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
    shape = (num_pages, 2, page_size, hkv, d)
    if kv is None:
        cache = cp.asarray(rng.standard_normal(shape).astype(np.float16))
    else:                                        # e4m3 bytes of magnitude < 2 (no NaN), random sign
        cache = cp.asarray((rng.integers(0, 0x40, shape) | (rng.integers(0, 2, shape) << 7)).astype(np.uint8))
    q = cp.asarray(rng.standard_normal((int(qo_indptr[-1]), hq, d)).astype(np.float16))
    v = 0 if ahead else float("inf")
    prefill_ahead.MIN_SHARING = prefill_ahead.MIN_READS = {k: v for k in ("fp8", "16", "fp8_rows")}
    w = cuattn.BatchPrefillWithPagedKVCacheWrapper(backend="fa3")
    w.plan(qo_indptr, indptr, indices, last, hq, hkv, d, page_size, causal=causal, kv_data_type=kv,
           pos_encoding_mode="ROPE_LLAMA" if rope else "NONE")
    out = w.run(q, cache)
    cp.cuda.Device().synchronize()
    assert bool(cp.isfinite(out).all()), page_size
    assert w._plan.kv_ahead is ahead
    print(page_size, w.describe().splitlines()[1], "gathered ahead" if ahead else "")


for case in CASES:
    run_case(*case)
    if not case[4]:
        run_case(*case, ahead=True)
