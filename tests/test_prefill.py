"""Prefill attention: the NumPy path (CI) and the CUDA kernel (gpu marker) against tests/oracle.py."""
import itertools
import random
import zlib

import ml_dtypes
import numpy as np
import pytest

import cuattn
from cuattn import jit, prefill, prefill_spec
from cuattn.errors import UnsupportedError

from .conftest import gpu_cc, requires_sm
from .late_writer import late_copy
from .oracle import dense_attention, rel_err

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = {"float16": np.dtype(np.float16), "bfloat16": BF16}
TOL = {"float16": 5e-3, "bfloat16": 2e-2}          # ||out - ref|| / ||ref||
LSE_TOL = 1e-3

QO_LENS = [1, 17, 37, 127, 577, 1024]
KV_LENS = [54, 97, 512, 2048, 4932]
BATCHES = [1, 12, 17]
PAGE_SIZES = [1, 5, 16]
HEADS = [(4, 4), (32, 4), (28, 4), (32, 8)]
HEAD_DIMS = [64, 128, 256]
LAYOUTS = ["NHD", "HND"]


def rand(rng, shape, dtype):
    return rng.standard_normal(shape, dtype=np.float32).astype(dtype)


def oracle_batch(q, ks, vs, qo_indptr, causal, masks=None, sm_scale=None):
    outs, lses = [], []
    for b in range(len(qo_indptr) - 1):
        o, s = dense_attention(q[qo_indptr[b]:qo_indptr[b + 1]], ks[b], vs[b], sm_scale=sm_scale, causal=causal,
                               mask=None if masks is None else masks[b])
        outs.append(o)
        lses.append(s)
    return np.concatenate(outs), np.concatenate(lses)


# ============================================================================ CPU (CI)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("qo_len,kv_len", [(1, 54), (17, 97), (37, 37), (64, 33)], ids=lambda x: str(x))
def test_single_prefill_numpy_matches_oracle(qo_len, kv_len, causal):
    rng = np.random.default_rng(qo_len * 1000 + kv_len)
    q, k, v = rand(rng, (qo_len, 8, 64), np.float16), rand(rng, (kv_len, 2, 64), np.float16), rand(rng, (kv_len, 2, 64), np.float16)
    out, lse = cuattn.single_prefill_with_kv_cache(q, k, v, causal=causal, return_lse=True)
    ref_o, ref_s = dense_attention(q, k, v, causal=causal)
    assert out.dtype == np.float16 and lse.dtype == np.float32
    assert rel_err(out, ref_o) < 2e-3
    assert rel_err(lse, ref_s) < 1e-5


def test_single_prefill_numpy_causal_aligns_bottom_right():
    rng = np.random.default_rng(1)
    q, k, v = rand(rng, (3, 1, 64), np.float16), rand(rng, (10, 1, 64), np.float16), rand(rng, (10, 1, 64), np.float16)
    out = cuattn.single_prefill_with_kv_cache(q, k, v, causal=True)
    # the last query sees all 10 keys; the first sees keys 0..7 only (same float32 arithmetic, same rounding)
    full = cuattn.single_prefill_with_kv_cache(q[2:], k, v)
    first = cuattn.single_prefill_with_kv_cache(q[:1], k[:8], v[:8])
    np.testing.assert_allclose(out[2:].astype(np.float32), full.astype(np.float32), rtol=1e-3, atol=1e-3)
    np.testing.assert_allclose(out[:1].astype(np.float32), first.astype(np.float32), rtol=1e-3, atol=1e-3)


def test_what_no_gpu_kernel_runs_is_refused_at_plan_on_the_numpy_path_too():
    """One contract: the NumPy path refuses what the GPU refuses, at plan(), with the same message."""
    ind, lpl = np.array([0, 1], np.int32), np.array([3], np.int32)
    for kw, match in ((dict(head_dim=96), "head_dim=96 has no kernel; supported: 64, 128, 256"),
                      (dict(q_data_type="float64"), "q dtype float64 has no kernel")):
        # (fp8 and fp32 KV, and an fp32 q, have kernels in both families: tests/test_fp8.py,
        # tests/test_decode_f32.py, tests/test_prefill_fp8.py, tests/test_prefill_f32.py)
        args = dict(head_dim=64, q_data_type="float16") | kw
        d = args.pop("head_dim")
        with pytest.raises(UnsupportedError, match=match):
            cuattn.BatchDecodeWithPagedKVCacheWrapper().plan(ind, np.array([0], np.int32), lpl, 4, 4, d, 16, **args)
        with pytest.raises(UnsupportedError, match=match):
            cuattn.BatchPrefillWithPagedKVCacheWrapper().plan(ind, ind, np.array([0], np.int32), lpl, 4, 4, d, 16, **args)
    x = np.zeros((3, 4, 64), np.float64)
    with pytest.raises(UnsupportedError, match="q dtype float64 has no kernel"):
        cuattn.single_prefill_with_kv_cache(x, x, x)
    with pytest.raises(UnsupportedError, match="q dtype float64 has no kernel"):
        cuattn.single_decode_with_kv_cache(x[0], x, x)


def test_single_prefill_numpy_fully_masked_rows_give_zero_and_neg_inf():
    rng = np.random.default_rng(2)
    q, k, v = rand(rng, (5, 2, 64), np.float16), rand(rng, (3, 2, 64), np.float16), rand(rng, (3, 2, 64), np.float16)
    out, lse = cuattn.single_prefill_with_kv_cache(q, k, v, causal=True, return_lse=True)
    assert np.all(out[:2] == 0) and np.all(np.isneginf(lse[:2]))      # rows 0, 1 see no key
    ref_o, ref_s = dense_attention(q, k, v, causal=True)
    assert rel_err(out, ref_o) < 2e-3 and rel_err(lse, ref_s) < 1e-5


def test_single_prefill_numpy_hnd_equals_nhd():
    rng = np.random.default_rng(3)
    q, k, v = rand(rng, (9, 4, 64), np.float16), rand(rng, (20, 2, 64), np.float16), rand(rng, (20, 2, 64), np.float16)
    a = cuattn.single_prefill_with_kv_cache(q, k, v)
    b = cuattn.single_prefill_with_kv_cache(q, k.transpose(1, 0, 2).copy(), v.transpose(1, 0, 2).copy(), kv_layout="HND")
    np.testing.assert_array_equal(a, b)


def test_single_prefill_numpy_packed_mask_equals_unpacked():
    rng = np.random.default_rng(4)
    q, k, v = rand(rng, (13, 4, 64), np.float16), rand(rng, (29, 4, 64), np.float16), rand(rng, (29, 4, 64), np.float16)
    mask = rng.random((13, 29)) < 0.5
    mask[3] = False                                                      # one fully masked row
    a, la = cuattn.single_prefill_with_kv_cache(q, k, v, custom_mask=mask, return_lse=True)
    b, lb = cuattn.single_prefill_with_kv_cache(q, k, v, packed_custom_mask=cuattn.packbits(mask), return_lse=True)
    np.testing.assert_array_equal(a, b)
    ref_o, ref_s = dense_attention(q, k, v, mask=mask)
    assert rel_err(a, ref_o) < 2e-3 and rel_err(la, ref_s) < 1e-5
    assert np.all(a[3] == 0) and np.all(np.isneginf(la[3]))


def _ragged_inputs(rng, qo_lens, kv_lens, hq, hkv, d, dtype=np.float16):
    qo_indptr = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
    kv_indptr = np.concatenate([[0], np.cumsum(kv_lens)]).astype(np.int32)
    q = rand(rng, (qo_indptr[-1], hq, d), dtype)
    k = rand(rng, (kv_indptr[-1], hkv, d), dtype)
    v = rand(rng, (kv_indptr[-1], hkv, d), dtype)
    return q, k, v, qo_indptr, kv_indptr


@pytest.mark.parametrize("causal", [False, True])
def test_batch_ragged_numpy_matches_oracle_with_mask(causal):
    rng = np.random.default_rng(5)
    qo_lens, kv_lens = [3, 17, 1], [9, 17, 40]
    q, k, v, qo_indptr, kv_indptr = _ragged_inputs(rng, qo_lens, kv_lens, 8, 4, 64)
    masks = [rng.random((a, b)) < 0.7 for a, b in zip(qo_lens, kv_lens)]
    flat = np.concatenate([m.ravel() for m in masks])
    w = cuattn.BatchPrefillWithRaggedKVCacheWrapper()
    w.plan(qo_indptr, kv_indptr, 8, 4, 64, custom_mask=flat, causal=causal)
    out, lse = w.run(q, k, v, return_lse=True)
    ref_o, ref_s = oracle_batch(q, [k[kv_indptr[b]:kv_indptr[b + 1]] for b in range(3)],
                                [v[kv_indptr[b]:kv_indptr[b + 1]] for b in range(3)], qo_indptr, causal, masks)
    assert rel_err(out, ref_o) < 2e-3 and rel_err(lse, ref_s) < 1e-5
    packed, mask_indptr = cuattn.segment_packbits(flat, np.concatenate([[0], np.cumsum([m.size for m in masks])]))
    w.plan(qo_indptr, kv_indptr, 8, 4, 64, packed_custom_mask=packed, causal=causal)
    out2 = w.run(q, k, v)
    np.testing.assert_array_equal(out, out2)


def _paged_inputs(rng, kv_lens, page_size, hkv, d, layout, dtype=np.float16, extra_pages=3):
    npages = [-(-n // page_size) for n in kv_lens]
    total = sum(npages) + extra_pages
    perm = rng.permutation(total)[:sum(npages)].astype(np.int32)         # random page order
    indptr = np.concatenate([[0], np.cumsum(npages)]).astype(np.int32)
    last = np.array([n - (p - 1) * page_size for n, p in zip(kv_lens, npages)], np.int32)
    shape = (total, 2, page_size, hkv, d) if layout == "NHD" else (total, 2, hkv, page_size, d)
    cache = rand(rng, shape, dtype)
    nhd = cache if layout == "NHD" else cache.transpose(0, 1, 3, 2, 4)
    ks = [nhd[perm[indptr[b]:indptr[b + 1]], 0].reshape(-1, hkv, d)[:kv_lens[b]] for b in range(len(kv_lens))]
    vs = [nhd[perm[indptr[b]:indptr[b + 1]], 1].reshape(-1, hkv, d)[:kv_lens[b]] for b in range(len(kv_lens))]
    return cache, indptr, perm, last, ks, vs


@pytest.mark.parametrize("layout", LAYOUTS)
def test_batch_paged_numpy_matches_oracle(layout):
    rng = np.random.default_rng(6)
    qo_lens, kv_lens = [5, 1, 12], [21, 7, 12]
    cache, indptr, indices, last, ks, vs = _paged_inputs(rng, kv_lens, 5, 2, 64, layout)
    qo_indptr = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
    q = rand(rng, (qo_indptr[-1], 6, 64), np.float16)
    w = cuattn.BatchPrefillWithPagedKVCacheWrapper(kv_layout=layout)
    w.plan(qo_indptr, indptr, indices, last, 6, 2, 64, 5, causal=True)
    out, lse = w.run(q, cache, return_lse=True)
    ref_o, ref_s = oracle_batch(q, ks, vs, qo_indptr, True)
    assert rel_err(out, ref_o) < 2e-3 and rel_err(lse, ref_s) < 1e-5
    k_half, v_half = cache[:, 0].copy(), cache[:, 1].copy()
    np.testing.assert_array_equal(out, w.run(q, (k_half, v_half)))
    # the NumPy plan snapshots the page ids (a GPU plan uploads them inside plan()): the caller's array is theirs
    ids = indices.astype(np.int64)
    w.plan(qo_indptr, indptr, ids, last, 6, 2, 64, 5, causal=True)
    ids[:] = ids[::-1].copy()
    np.testing.assert_array_equal(out, w.run(q, cache))


# ---------------------------------------------------------------------------- errors (CI)


def test_batch_ragged_rejects_mismatched_batch_sizes():
    w = cuattn.BatchPrefillWithRaggedKVCacheWrapper()
    with pytest.raises(ValueError, match="same batch"):
        w.plan(np.array([0, 3, 5], np.int32), np.array([0, 4], np.int32), 4, 4, 64)


def test_batch_paged_rejects_mismatched_batch_sizes():
    w = cuattn.BatchPrefillWithPagedKVCacheWrapper()
    with pytest.raises(ValueError, match="same batch"):
        w.plan(np.array([0, 3], np.int32), np.array([0, 1, 2], np.int32), np.array([0, 1], np.int32),
               np.array([1, 1], np.int32), 4, 4, 64, 16)


def test_batch_rejects_mask_of_wrong_length():
    w = cuattn.BatchPrefillWithRaggedKVCacheWrapper()
    with pytest.raises(ValueError, match="custom_mask must have 12 entries"):
        w.plan(np.array([0, 2, 3], np.int32), np.array([0, 4, 8], np.int32), 4, 4, 64, custom_mask=np.ones(11, bool))
    with pytest.raises(ValueError, match="packed_custom_mask must have 2 bytes"):
        w.plan(np.array([0, 2, 3], np.int32), np.array([0, 4, 8], np.int32), 4, 4, 64,
               packed_custom_mask=np.ones(3, np.uint8))


def test_single_prefill_rejects_bad_shapes_and_groups():
    q, k = np.zeros((4, 6, 64), np.float16), np.zeros((8, 4, 64), np.float16)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        cuattn.single_prefill_with_kv_cache(q, k, k)
    with pytest.raises(ValueError, match="v must have the shape of k"):
        cuattn.single_prefill_with_kv_cache(q[:, :4], k, k[:7])
    with pytest.raises(ValueError, match="q must have shape"):
        cuattn.single_prefill_with_kv_cache(q[0], k, k)
    with pytest.raises(ValueError, match="kv_layout must be"):
        cuattn.single_prefill_with_kv_cache(q[:, :4], k, k, kv_layout="NDH")
    with pytest.raises(ValueError, match="custom_mask must have 32 entries"):
        cuattn.single_prefill_with_kv_cache(q[:, :4], k, k, custom_mask=np.ones((4, 7), bool))


def test_run_rejects_wrong_q_shape_and_unplanned_run():
    w = cuattn.BatchPrefillWithRaggedKVCacheWrapper()
    with pytest.raises(ValueError, match="plan"):
        w.run(np.zeros((3, 4, 64), np.float16), np.zeros((4, 4, 64), np.float16), np.zeros((4, 4, 64), np.float16))
    w.plan(np.array([0, 3], np.int32), np.array([0, 4], np.int32), 4, 4, 64)
    with pytest.raises(ValueError, match=r"q.shape\[1\] \(num_qo_heads\) must be 4"):
        w.run(np.zeros((3, 8, 64), np.float16), np.zeros((4, 4, 64), np.float16), np.zeros((4, 4, 64), np.float16))


def test_unsupported_options_raise():
    q = np.zeros((4, 4, 64), np.float16)
    k32 = np.zeros((4, 4, 64), np.float32)
    with pytest.raises(UnsupportedError, match="fa3 reads K/V of q's dtype or fp8"):     # fp32 K/V: fa2 only
        cuattn.single_prefill_with_kv_cache(q, k32, k32, backend="fa3")
    with pytest.raises(UnsupportedError, match="use_fp16_qk_reduction"):
        cuattn.single_prefill_with_kv_cache(q, q, q, use_fp16_qk_reduction=True)
    with pytest.raises(ValueError, match="backend must be"):
        cuattn.BatchPrefillWithRaggedKVCacheWrapper(backend="triton")
    assert cuattn.BatchPrefillWithPagedKVCacheWrapper().backend == "fa2"


def test_paged_rejects_bad_last_page_len():
    w = cuattn.BatchPrefillWithPagedKVCacheWrapper()
    with pytest.raises(ValueError, match="kv_last_page_len must be in 1..page_size"):
        w.plan(np.array([0, 3], np.int32), np.array([0, 1], np.int32), np.array([0], np.int32),
               np.array([17], np.int32), 4, 4, 64, 16)


# ---------------------------------------------------------------------------- compile (CI)


@pytest.mark.parametrize("arch", jit.SHIPPED_ARCHS)
def test_shipped_specs_compile_without_spills(arch, announce):
    specs = prefill.shipped_specs()
    announce(f"checking {len(specs)} prefill kernels for {arch} (compiled now unless cached)")
    assert len({s.name for s in specs}) == len(specs)
    for spec in specs:
        res = jit.compile_kernel(spec, arch).resources["cuattn_prefill"]
        assert res["spill_stores"] == 0 and res["spill_loads"] == 0, (spec.name, arch, res)




# ============================================================================ GPU


def _cp():
    import cupy
    return cupy


def _to_dev(x):
    cp = _cp()
    return cp.asarray(x.view(np.uint16)) if x.dtype == BF16 else cp.asarray(x)


def _from_dev(x, dtype):
    a = _cp().asnumpy(x) if not isinstance(x, np.ndarray) else x
    return a.view(BF16) if dtype == BF16 else a


def _nan_like(shape, dtype):
    cp = _cp()
    if dtype == BF16:
        return cp.full(shape, 0x7FC0, np.uint16)
    return cp.full(shape, np.nan, dtype)


def _poison_pool(nbytes):
    """Fill freed pool memory with NaN so an unwritten output cannot pass."""
    cp = _cp()
    junk = cp.full(max(nbytes // 4, 1) + 1024, np.nan, np.float32)
    del junk


def _sample(grid, n, seed):
    return sorted(random.Random(seed).sample(list(itertools.product(*grid)), n), key=str)


SINGLE_GRID = (QO_LENS, KV_LENS, HEADS, HEAD_DIMS, [False, True], list(DTYPES), LAYOUTS)
SINGLE_SMOKE = _sample(SINGLE_GRID, 14, 0) + [(1024, 4932, (32, 8), 128, True, "float16", "NHD"),
                                              (577, 97, (28, 4), 64, True, "bfloat16", "HND")]
SINGLE_FULL = _sample(SINGLE_GRID, 120, 1)


def _single_case(qo_len, kv_len, heads, d, causal, dtype, layout, mask=False):
    rng = np.random.default_rng(zlib.crc32(repr((qo_len, kv_len, heads, d, causal, dtype, layout, mask)).encode()))
    hq, hkv = heads
    dt = DTYPES[dtype]
    q, k, v = rand(rng, (qo_len, hq, d), dt), rand(rng, (kv_len, hkv, d), dt), rand(rng, (kv_len, hkv, d), dt)
    m = rng.random((qo_len, kv_len)) < 0.6 if mask else None
    if mask:
        m[0] = False
    kd, vd = (k, v) if layout == "NHD" else (k.transpose(1, 0, 2).copy(), v.transpose(1, 0, 2).copy())
    _poison_pool(q.size * 2)
    out, lse = cuattn.single_prefill_with_kv_cache(
        _to_dev(q), _to_dev(kd), _to_dev(vd), custom_mask=None if m is None else _cp().asarray(m),
        causal=causal, kv_layout=layout, return_lse=True)
    ref_o, ref_s = dense_attention(q, k, v, causal=causal, mask=m)
    assert rel_err(_from_dev(out, dt), ref_o) < TOL[dtype]
    assert rel_err(_cp().asnumpy(lse), ref_s) < LSE_TOL


def _ids(cases):
    return ["-".join(str(x).replace(" ", "") for x in c) for c in cases]


@pytest.mark.gpu
@pytest.mark.parametrize("case", SINGLE_SMOKE, ids=_ids(SINGLE_SMOKE))
def test_single_prefill_gpu_matches_oracle(case):
    _single_case(*case)


@pytest.mark.gpu
@pytest.mark.parametrize("case", [(37, 97, (32, 4), 128, True, "float16", "NHD"),
                                  (127, 54, (4, 4), 64, False, "bfloat16", "HND"),
                                  (17, 512, (28, 4), 256, False, "float16", "NHD")], ids=lambda c: str(c[:4]))
def test_single_prefill_gpu_custom_mask_matches_oracle(case):
    _single_case(*case, mask=True)


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("case", SINGLE_FULL, ids=_ids(SINGLE_FULL))
def test_single_prefill_gpu_full_grid(case):
    _single_case(*case)


def _batch_lengths(rng, batch):
    qo = rng.choice(QO_LENS, batch)
    kv = rng.choice(KV_LENS, batch)
    kv = np.where(rng.random(batch) < 0.5, np.maximum(kv, qo), kv)      # append: kv >= qo mostly
    return [int(x) for x in qo], [int(x) for x in kv]


BATCH_GRID = (BATCHES, PAGE_SIZES, HEADS, HEAD_DIMS, [False, True], [False, True], list(DTYPES), LAYOUTS)
BATCH_SMOKE = _sample(BATCH_GRID, 8, 2)
BATCH_FULL = _sample(BATCH_GRID, 80, 3)


def _batch_case(batch, page_size, heads, d, causal, mask, dtype, layout, paged):
    rng = np.random.default_rng(zlib.crc32(repr((batch, page_size, heads, d, causal, mask, dtype, layout, paged)).encode()))
    if batch > 4 and d == 256:
        batch = 4                      # keep the float64 oracle's time bounded
    hq, hkv = heads
    dt = DTYPES[dtype]
    qo_lens, kv_lens = _batch_lengths(rng, batch)
    qo_indptr = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
    q = rand(rng, (qo_indptr[-1], hq, d), dt)
    masks = [rng.random((a, b)) < 0.6 for a, b in zip(qo_lens, kv_lens)] if mask else None
    flat = np.concatenate([m.ravel() for m in masks]) if mask else None
    out = _nan_like((qo_indptr[-1], hq, d), dt)
    lse = _cp().full((qo_indptr[-1], hq), np.nan, np.float32)
    if paged:
        cache, indptr, indices, last, ks, vs = _paged_inputs(rng, kv_lens, page_size, hkv, d, layout, dt)
        w = cuattn.BatchPrefillWithPagedKVCacheWrapper(kv_layout=layout)
        w.plan(_to_dev(qo_indptr), _to_dev(indptr), _to_dev(indices), _to_dev(last), hq, hkv, d, page_size,
               custom_mask=None if flat is None else _cp().asarray(flat), causal=causal, q_data_type=dtype)
        w.run(_to_dev(q), _to_dev(cache), out=out, lse=lse)
    else:
        kv_indptr = np.concatenate([[0], np.cumsum(kv_lens)]).astype(np.int32)
        k, v = rand(rng, (kv_indptr[-1], hkv, d), dt), rand(rng, (kv_indptr[-1], hkv, d), dt)
        ks = [k[kv_indptr[b]:kv_indptr[b + 1]] for b in range(batch)]
        vs = [v[kv_indptr[b]:kv_indptr[b + 1]] for b in range(batch)]
        kd, vd = (k, v) if layout == "NHD" else (k.transpose(1, 0, 2).copy(), v.transpose(1, 0, 2).copy())
        w = cuattn.BatchPrefillWithRaggedKVCacheWrapper(kv_layout=layout)
        w.plan(qo_indptr, kv_indptr, hq, hkv, d, custom_mask=flat, causal=causal, q_data_type=dtype)
        w.run(_to_dev(q), _to_dev(kd), _to_dev(vd), out=out, lse=lse)
    ref_o, ref_s = oracle_batch(q, ks, vs, qo_indptr, causal, masks)
    assert rel_err(_from_dev(out, dt), ref_o) < TOL[dtype]
    assert rel_err(_cp().asnumpy(lse), ref_s) < LSE_TOL


@pytest.mark.gpu
@pytest.mark.parametrize("case", BATCH_SMOKE, ids=_ids(BATCH_SMOKE))
def test_batch_paged_gpu_matches_oracle(case):
    _batch_case(*case, paged=True)


@pytest.mark.gpu
@pytest.mark.parametrize("case", BATCH_SMOKE[:5], ids=_ids(BATCH_SMOKE[:5]))
def test_batch_ragged_gpu_matches_oracle(case):
    _batch_case(*case, paged=False)


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("case", BATCH_FULL, ids=_ids(BATCH_FULL))
def test_batch_gpu_full_grid(case):
    _batch_case(*case, paged=case[0] % 2 == 1)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["fa2", "fa3"])
def test_batch_paged_gpu_equals_ragged_bitwise(monkeypatch, backend):
    # give the ragged run the paged tile shape (the same 128x64 for hd128 now; kept so a future
    # split stays covered): the two differ only in how K/V rows are addressed, so bit for bit
    if backend == "fa3" and gpu_cc() < 90:
        pytest.skip("the fa3 backend needs compute capability 9.0")
    orig = prefill_spec.tile_config
    monkeypatch.setattr(prefill_spec, "tile_config", lambda d, m, paged=False, small_q=False: orig(d, m, True, small_q))
    rng = np.random.default_rng(7)
    kv_lens, qo_lens = [300, 77, 1000], [300, 5, 64]
    cache, indptr, indices, last, ks, vs = _paged_inputs(rng, kv_lens, 16, 8, 128, "NHD")
    qo_indptr = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
    q = _to_dev(rand(rng, (qo_indptr[-1], 32, 128), np.float16))
    wp = cuattn.BatchPrefillWithPagedKVCacheWrapper(backend=backend)
    wp.plan(qo_indptr, indptr, indices, last, 32, 8, 128, 16, causal=True)
    a = wp.run(q, _to_dev(cache))
    wr = cuattn.BatchPrefillWithRaggedKVCacheWrapper(backend=backend)
    wr.plan(qo_indptr, np.concatenate([[0], np.cumsum(kv_lens)]).astype(np.int32), 32, 8, 128, causal=True)
    b = wr.run(q, _to_dev(np.concatenate(ks)), _to_dev(np.concatenate(vs)))
    assert bool((a == b).all())


def _shifted(x, elems):
    """A device copy of ``x`` starting ``elems`` elements past an aligned allocation (same shape and values)."""
    cp = _cp()
    buf = cp.empty(x.size + elems, x.dtype)
    out = buf[elems:].reshape(x.shape)
    out[...] = x
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["fa2", "fa3"])
def test_misaligned_q_kv_and_out_are_refused_by_name(backend):
    """The kernels copy q / K / V 16 bytes at a time and store out 4 bytes at a time: an array off those
    alignments is a ValueError naming it (a misaligned access would fault and poison the CUDA context), and
    the same call on aligned arrays still runs and matches the oracle."""
    if backend == "fa3" and gpu_cc() < 90:
        pytest.skip("the fa3 backend needs compute capability 9.0")
    rng = np.random.default_rng(11)
    kv_lens, qo_lens = [200, 70], [33, 9]
    cache, indptr, indices, last, ks, vs = _paged_inputs(rng, kv_lens, 16, 8, 128, "NHD")
    qo_indptr = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
    qh = rand(rng, (qo_indptr[-1], 32, 128), np.float16)
    q, dcache = _to_dev(qh), _to_dev(cache)
    wp = cuattn.BatchPrefillWithPagedKVCacheWrapper(backend=backend)
    wp.plan(qo_indptr, indptr, indices, last, 32, 8, 128, 16, causal=True)
    wr = cuattn.BatchPrefillWithRaggedKVCacheWrapper(backend=backend)
    wr.plan(qo_indptr, np.concatenate([[0], np.cumsum(kv_lens)]).astype(np.int32), 32, 8, 128, causal=True)
    k, v = _to_dev(np.concatenate(ks)), _to_dev(np.concatenate(vs))
    with pytest.raises(ValueError, match=r"run: q must start at a 16-byte aligned address"):
        wp.run(_shifted(q, 2), dcache)
    with pytest.raises(ValueError, match=r"run: paged_kv_cache must start at a 16-byte aligned address"):
        wp.run(q, _shifted(dcache, 4))
    with pytest.raises(ValueError, match=r"run: out must start at a 4-byte aligned address"):
        wp.run(q, dcache, out=_shifted(_nan_like(q.shape, np.float16), 1))
    with pytest.raises(ValueError, match=r"run: k must start at a 16-byte aligned address"):
        wr.run(q, _shifted(k, 4), v)
    with pytest.raises(ValueError, match=r"run: v must start at a 16-byte aligned address"):
        wr.run(q, k, _shifted(v, 2))
    out = _shifted(_nan_like(q.shape, np.float16), 2)           # 4-byte aligned: accepted
    ref, _ = oracle_batch(qh, ks, vs, qo_indptr, True)
    for o in (wp.run(q, dcache, out=out), wr.run(q, k, v)):
        got = _from_dev(o, np.float16).astype(np.float64)
        assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 1e-2


@pytest.mark.gpu
def test_single_prefill_gpu_torch_inputs():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(8)
    q, k, v = rand(rng, (77, 32, 128), np.float32), rand(rng, (200, 8, 128), np.float32), rand(rng, (200, 8, 128), np.float32)
    tq, tk, tv = (torch.from_numpy(x).to("cuda", torch.bfloat16) for x in (q, k, v))
    out, lse = cuattn.single_prefill_with_kv_cache(tq, tk, tv, causal=True, return_lse=True)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16 and out.is_cuda
    ref_o, ref_s = dense_attention(tq.float().cpu().numpy(), tk.float().cpu().numpy(), tv.float().cpu().numpy(), causal=True)
    assert rel_err(out.float().cpu().numpy(), ref_o) < TOL["bfloat16"]
    assert rel_err(lse.cpu().numpy(), ref_s) < LSE_TOL
    w = cuattn.BatchPrefillWithPagedKVCacheWrapper(torch.empty(1, dtype=torch.uint8, device="cuda"), "NHD")
    cache = torch.randn(30, 2, 16, 8, 128, dtype=torch.float16, device="cuda")
    qo_indptr = torch.tensor([0, 10, 21], dtype=torch.int32, device="cuda")
    w.plan(qo_indptr, torch.tensor([0, 2, 5], dtype=torch.int32, device="cuda"),
           torch.tensor([4, 9, 0, 29, 13], dtype=torch.int32, device="cuda"),
           torch.tensor([7, 16], dtype=torch.int32, device="cuda"), 32, 8, 128, 16, causal=True,
           q_data_type=torch.float16)
    o = w.run(torch.randn(21, 32, 128, dtype=torch.float16, device="cuda"), cache)
    assert isinstance(o, torch.Tensor) and o.shape == (21, 32, 128) and bool(torch.isfinite(o).all())


@pytest.mark.gpu
def test_single_prefill_gpu_jax_inputs():
    jax = pytest.importorskip("jax")
    if not any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("jax has no GPU backend here")
    rng = np.random.default_rng(9)
    q, k, v = rand(rng, (50, 8, 64), np.float16), rand(rng, (90, 8, 64), np.float16), rand(rng, (90, 8, 64), np.float16)
    out = cuattn.single_prefill_with_kv_cache(jax.numpy.asarray(q), jax.numpy.asarray(k), jax.numpy.asarray(v),
                                              causal=True)
    assert isinstance(out, jax.Array)
    assert rel_err(np.asarray(out), dense_attention(q, k, v, causal=True)[0]) < TOL["float16"]


@pytest.mark.gpu
@requires_sm(90)
@pytest.mark.parametrize("kind,backend", [("ragged", "fa2"), ("ragged", "fa3"), ("paged", "fa2")])
def test_batch_prefill_gpu_pdl_waits_for_the_previous_kernel(kind, backend):
    """enable_pdl=True right after a kernel that writes q and K/V late (tests/late_writer.py); the
    first run also uploads the plan's metadata in between, the second follows the writer directly."""
    cp = _cp()
    rng = np.random.default_rng(17)
    hq, hkv, d = 32, 8, 128
    qo_lens, kv_lens = [300, 17, 64], [300, 700, 64]
    q, k, v, qo_indptr, kv_indptr = _ragged_inputs(rng, qo_lens, kv_lens, hq, hkv, d)
    if kind == "paged":
        cache, indptr, indices, last, ks, vs = _paged_inputs(rng, kv_lens, 16, hkv, d, "NHD")
        w = cuattn.BatchPrefillWithPagedKVCacheWrapper(kv_layout="NHD", backend=backend)
        w.plan(qo_indptr, indptr, indices, last, hq, hkv, d, 16, causal=True, q_data_type="float16")
        kv_true = [_to_dev(cache)]
    else:
        ks = [k[kv_indptr[b]:kv_indptr[b + 1]] for b in range(3)]
        vs = [v[kv_indptr[b]:kv_indptr[b + 1]] for b in range(3)]
        w = cuattn.BatchPrefillWithRaggedKVCacheWrapper(kv_layout="NHD", backend=backend)
        w.plan(qo_indptr, kv_indptr, hq, hkv, d, causal=True, q_data_type="float16")
        kv_true = [_to_dev(k), _to_dev(v)]
    q_true = _to_dev(q)
    q_dev, kv_dev = cp.empty_like(q_true), [cp.empty_like(x) for x in kv_true]
    ref_o, ref_s = oracle_batch(q, ks, vs, qo_indptr, True)
    for _rep in range(2):
        for x in (q_dev, *kv_dev):
            x.fill(np.nan)
        late_copy([(q_true, q_dev)] + list(zip(kv_true, kv_dev)))
        out, lse = w.run(q_dev, *kv_dev, return_lse=True, enable_pdl=True)
        assert rel_err(cp.asnumpy(out), ref_o) < TOL["float16"]
        assert rel_err(cp.asnumpy(lse), ref_s) < LSE_TOL


def test_replay_records_patch_q_out_lse_pointers_and_refuse_ambiguous_ones(monkeypatch):
    """prefill_batch's replay bookkeeping without a GPU (pointer layouts, stream and capture check stubbed): a record
    finds where q / out / lse sit in each launch's arguments, a hit with other arrays of the same layouts launches the
    recorded arguments with those pointers patched in (the same arrays: the recorded arguments as they are), another
    alignment misses, and a call whose pointers coincide (with each other or a cache's) or do not appear as
    themselves is not recorded."""
    import types
    from cuattn import arrays, plan_buffers, prefill_batch

    class Arr:
        def __init__(self, ptr, shape):
            self.ptr, self.shape = ptr, shape
    monkeypatch.setattr(arrays, "pointer_layout", lambda x: (x.ptr, ("cupy", x.shape, (1,), np.dtype(np.float16), 0)))
    monkeypatch.setattr(arrays, "resolve_stream", lambda fw, device, stream: "stream")
    monkeypatch.setattr(plan_buffers, "refuse_capture", lambda fn, graph, stream: None)
    w = prefill_batch._BatchPrefillBase.__new__(prefill_batch._BatchPrefillBase)
    w._runs, w._runs_plan, w._bufs = {}, None, types.SimpleNamespace(graph=False)
    w._f32q = w._rope = types.SimpleNamespace(active=False)
    plan = types.SimpleNamespace(bound=types.SimpleNamespace(runtime=False))
    launched = []

    def launcher(grid, threads, stream, *args, pdl):
        launched.append(args)
    G = 1 << 40
    q, k, v, out, lse = (Arr(i * G, (64, 8, 128)) for i in (1, 2, 3, 4, 5))
    record = [(launcher, (1,), 128, (q.ptr, k.ptr, v.ptr, out.ptr, lse.ptr, 7, 1.5), False),
              (launcher, (2,), 128, (9, out.ptr, lse.ptr, 64), False)]          # (the merge)
    key, ptrs = w._replay_key(plan, (q, k, v), out, lse, True, True, None)
    w._keep_record(plan, key, record, ptrs, (k.ptr, v.ptr))
    assert w._runs[key][1] == (((0, "q"), (3, "out"), (4, "lse")), ((1, "out"), (2, "lse")))
    q2, out2, lse2 = Arr(11 * G, q.shape), Arr(14 * G, out.shape), Arr(15 * G, lse.shape)
    key2, ptrs2 = w._replay_key(plan, (q2, k, v), out2, lse2, True, True, None)
    assert key2 == key and w._replay(plan, key2, ptrs2, out2, lse2, True, None, "f") == (out2, lse2)
    assert launched == [(q2.ptr, k.ptr, v.ptr, out2.ptr, lse2.ptr, 7, 1.5), (9, out2.ptr, lse2.ptr, 64)]
    launched.clear()
    assert w._replay(plan, key, ptrs, out, lse, True, None, "f") == (out, lse)      # the recorded arrays
    assert launched == [record[0][3], record[1][3]]
    q3 = Arr(21 * G + 16, q.shape)                                                # another alignment: a miss
    assert w._replay_key(plan, (q3, k, v), out, lse, True, True, None)[0] not in w._runs
    k2 = Arr(31 * G, k.shape)                                                     # another cache: a miss
    assert w._replay_key(plan, (q, k2, v), out, lse, True, True, None)[0] not in w._runs
    # -- not recorded: out at a cache's pointer, q and out the same, or lse in no argument as itself
    for rec, p, caches in ((record, dict(ptrs, out=k.ptr), (k.ptr, v.ptr)), (record, dict(ptrs, out=q.ptr), ()),
                           ([(launcher, (1,), 128, (q.ptr, k.ptr, v.ptr, out.ptr, 0, 7, 1.5), False)], ptrs, ())):
        w._runs.clear()
        w._keep_record(plan, key, rec, p, caches)
        assert not w._runs


@pytest.mark.gpu
@pytest.mark.parametrize("kind,backend", [("ragged", "auto"), ("paged", "auto"), ("paged", "fa2")])
def test_run_replays_a_call_with_the_same_layouts(kind, backend, monkeypatch):
    """run()'s replay of a plain call's recorded launches (prefill_batch._replay): the same arrays again replay (and
    read their new contents); another q or out of the same layout and alignment replays with its pointer patched in,
    and so does a call whose out (and lse) run() allocates; calls alternating between recorded caches (layers) replay
    each; another cache, lse added, q at another alignment, or a new plan take the checked path.
    Every output against the oracle; out poisoned before each call, and memory poisoned where run() allocates."""
    import cupy as cp
    from cuattn import prefill_batch
    rng = np.random.default_rng()
    hq, hkv, d = 16, 4, 128
    checked = []
    real = prefill_batch._BatchPrefillBase._keep_record
    monkeypatch.setattr(prefill_batch._BatchPrefillBase, "_keep_record",
                        lambda self, *a: (checked.append(1), real(self, *a))[1])

    def batch(qo_lens, kv_lens):
        qo_indptr = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
        q = rand(rng, (qo_indptr[-1], hq, d), np.float16)
        if kind == "paged":
            cache, indptr, indices, last, ks, vs = _paged_inputs(rng, kv_lens, 16, hkv, d, "NHD")
            w = cuattn.BatchPrefillWithPagedKVCacheWrapper(backend=backend)
            replan = lambda: w.plan(qo_indptr, indptr, indices, last, hq, hkv, d, 16, causal=True,   # noqa: E731
                                    q_data_type="float16")
            replan()
            return w, replan, qo_indptr, q, [cache], ks, vs
        kv_indptr = np.concatenate([[0], np.cumsum(kv_lens)]).astype(np.int32)
        k, v = rand(rng, (kv_indptr[-1], hkv, d), np.float16), rand(rng, (kv_indptr[-1], hkv, d), np.float16)
        w = cuattn.BatchPrefillWithRaggedKVCacheWrapper(backend=backend)
        replan = lambda: w.plan(qo_indptr, kv_indptr, hq, hkv, d, causal=True, q_data_type="float16")  # noqa: E731
        replan()
        return (w, replan, qo_indptr, q, [k, v], [k[kv_indptr[b]:kv_indptr[b + 1]] for b in range(len(kv_lens))],
                [v[kv_indptr[b]:kv_indptr[b + 1]] for b in range(len(kv_lens))])

    def check(w, qo_indptr, q, kv, ks, vs, q_dev, kv_dev, out, lse=None, replayed=False, return_lse=None):
        return_lse = lse is not None if return_lse is None else return_lse
        if out is not None:
            out.fill(np.nan)
        else:            # run() allocates: the pool's next blocks of those sizes hold NaN
            junk = [cp.full(q.shape, np.nan, np.float16), cp.full((q.shape[0], hq), np.nan, np.float32)]
            del junk
        n = len(checked)
        res = w.run(q_dev, *kv_dev, out=out, lse=lse, return_lse=return_lse)
        assert (len(checked) == n) == replayed
        got_o, got_s = res if return_lse else (res, None)
        ref_o, ref_s = oracle_batch(q, ks, vs, qo_indptr, True)
        assert got_o.shape == q.shape and rel_err(cp.asnumpy(got_o), ref_o) < TOL["float16"]
        if return_lse:
            assert lse is None or got_s is lse
            assert rel_err(cp.asnumpy(got_s), ref_s) < LSE_TOL
        return res

    w, replan, qo_indptr, q, kv, ks, vs = batch([70, 1, 300], [70, 900, 2100])
    q_dev, kv_dev = cp.asarray(q), [cp.asarray(x) for x in kv]
    out = cp.empty(q.shape, np.float16)
    assert check(w, qo_indptr, q, kv, ks, vs, q_dev, kv_dev, out) is out            # recorded
    check(w, qo_indptr, q, kv, ks, vs, q_dev, kv_dev, out, replayed=True)            # replayed
    q2 = rand(rng, q.shape, np.float16)
    q_dev[...] = cp.asarray(q2)                                                      # new contents, same array
    check(w, qo_indptr, q2, kv, ks, vs, q_dev, kv_dev, out, replayed=True)
    q3_dev = cp.asarray(q)                                                           # another q array: patched
    check(w, qo_indptr, q, kv, ks, vs, q3_dev, kv_dev, out, replayed=True)
    out2 = cp.empty_like(out)                                                        # another out: patched
    assert check(w, qo_indptr, q, kv, ks, vs, q3_dev, kv_dev, out2, replayed=True) is out2
    wide = cp.empty((q.size + 8,), np.float16)                                       # q 16 bytes further on
    q4_dev = wide[8:].reshape(q.shape)
    q4_dev[...] = q3_dev
    check(w, qo_indptr, q, kv, ks, vs, q4_dev, kv_dev, out2)                        # another alignment: checked
    check(w, qo_indptr, q, kv, ks, vs, q4_dev, kv_dev, out2, replayed=True)
    kv2_dev = [cp.asarray(x) for x in kv]                                            # another cache
    check(w, qo_indptr, q, kv, ks, vs, q3_dev, kv2_dev, out2)
    for layer_kv in (kv_dev, kv2_dev, kv_dev):            # layers alternating caches: one record each
        check(w, qo_indptr, q, kv, ks, vs, q3_dev, layer_kv, out2, replayed=True)
    lse = cp.empty((q.shape[0], hq), np.float32)                                     # lse wanted
    check(w, qo_indptr, q, kv, ks, vs, q3_dev, kv2_dev, out2, lse)
    check(w, qo_indptr, q, kv, ks, vs, q3_dev, kv2_dev, out2, lse, replayed=True)
    # -- out (and lse) allocated by run(): recorded once, then every call a fresh array, its pointer patched in
    first = check(w, qo_indptr, q, kv, ks, vs, q3_dev, kv2_dev, None)
    fresh = check(w, qo_indptr, q, kv, ks, vs, cp.asarray(q), kv2_dev, None, replayed=True)   # a fresh q too
    assert fresh.data.ptr != first.data.ptr                                          # (first still alive)
    o1, s1 = check(w, qo_indptr, q, kv, ks, vs, q3_dev, kv2_dev, None, return_lse=True)
    o2, s2 = check(w, qo_indptr, q, kv, ks, vs, q3_dev, kv2_dev, None, return_lse=True, replayed=True)
    assert o2.data.ptr != o1.data.ptr and s2.data.ptr != s1.data.ptr
    # -- plan() again (the same arguments: a new plan object): the checked path, then that plan's replay
    replan()
    check(w, qo_indptr, q, kv, ks, vs, q3_dev, kv2_dev, out2, lse)
    check(w, qo_indptr, q, kv, ks, vs, q3_dev, kv2_dev, out2, lse, replayed=True)
