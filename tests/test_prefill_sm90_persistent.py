"""The fa3 kernel's persistent form (``Sm90PrefillSpec.persistent``, PERSISTENT=1: at most one CTA per SM, each
taking work items in turns, the producer handing each to the consumers through shared memory). ``make_spec``
picks it where its registers allow (``prefill_sm90.persists``); the fa3 GPU tests of test_prefill_sm90 run it
there and the one-CTA-an-item grid elsewhere. Here: which specs persist, and on an sm_90 GPU the two forms
give bitwise the same output and LSE (the same arithmetic per item), graph-padded plans included."""
import dataclasses

import numpy as np
import pytest

import cuattn
from cuattn import prefill_sm90, variants

from .conftest import gpu_cc
from .test_prefill import _paged_inputs, rand

sm90 = pytest.mark.skipif(gpu_cc() != 90, reason="the fa3 kernel needs an sm_90 GPU")


def test_specs_persist_where_registers_allow():
    mask = variants.Composite((variants.CUSTOM_MASK,))
    for dk, dv in prefill_sm90.HEAD_DIMS:
        for paged in (False, True):
            spec = prefill_sm90.make_spec("bf16", True, paged=paged, head_dim_qk=dk, head_dim_vo=dv)
            assert spec.persistent == (dk <= 128), spec.name
            assert ("_persist" in spec.name) == spec.persistent
    assert prefill_sm90.make_spec("f16", False, paged=True, dtype_kv="e4m3").persistent            # (the fp8 gather)
    assert not prefill_sm90.make_spec("f16", False, dtype_kv="e4m3").persistent                    # (TMA-staged fp8)
    cap = variants.resolve("t", num_qo_heads=8, head_dim=128, logits_soft_cap=30.0).composite
    assert not prefill_sm90.make_spec("f16", True, cap, paged=True, dtype_kv="e4m3").persistent    # (fp8 + a variant)
    assert not prefill_sm90.make_spec("f16", False, mask, paged=True, page_size=1).persistent     # (the gather)
    assert prefill_sm90.make_spec("f16", False, mask).persistent                                    # (contiguous)
    spec = prefill_sm90.make_spec("f16", True, paged=True)
    assert spec.smem_bytes == dataclasses.replace(spec, persistent=False).smem_bytes + 4 * 8 + 2 * 64   # item slots


def test_persistent_needs_16_bit_kv_or_the_fp8_gather():
    from cuattn import jit
    spec = dataclasses.replace(prefill_sm90.make_spec("f16", False, dtype_kv="e4m3"), persistent=True)
    with pytest.raises(jit.CompileError, match="PERSISTENT with 16-bit K/V or the fp8 gather"):
        jit.compile_kernel(spec, prefill_sm90.ARCH)


def _both_forms(monkeypatch, run):
    """run() under the shipped specs and with every fa3 spec made one-CTA-an-item: (output, LSE, describe()) of each."""
    import cupy as cp
    got = [run()]
    made = prefill_sm90.make_spec
    monkeypatch.setattr(prefill_sm90, "make_spec", lambda *a, **kw: dataclasses.replace(made(*a, **kw), persistent=False))
    got.append(run())
    return [(cp.asnumpy(o), cp.asnumpy(s), d) for o, s, d in got]


CASES = [   # (page size or None: ragged, causal, fixed_split_size, GQA (qo heads, kv heads))
    (16, True, None, (32, 8)), (1, False, 256, (28, 4)), (None, True, None, (32, 8)), (None, False, 512, (7, 1)),
    (64, True, None, (32, 8))]


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("page_size,causal,split,heads", CASES)
def test_persistent_equals_one_cta_an_item_bitwise(page_size, causal, split, heads, monkeypatch):
    _check_both_forms(page_size, causal, split, heads, [300, 1, 77, 129, 2048], [300, 3000, 1037, 200, 2048], monkeypatch)


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("page_size", [16, None])
def test_persistent_items_with_no_keys_last(page_size, monkeypatch):
    """Causal with more queries than keys: the query tiles before the first key have no key tiles, and as the causal
    work list runs longest first they are the CTAs' last items (no GEMM turn, no stage, but Q staged and an epilogue).
    Bitwise the one-CTA-an-item form, rows that see no key give 0 and the others do not."""
    o1 = _check_both_forms(page_size, True, None, (32, 8), [1000, 600, 40, 3], [100, 64, 2000, 3], monkeypatch)
    assert not o1[:900].any() and not o1[1000:1536].any()
    assert (np.abs(o1[900:1000].astype(np.float32)).sum(axis=(1, 2)) > 0).all()


def _check_both_forms(page_size, causal, split, heads, qo_lens, kv_lens, monkeypatch):
    import cupy as cp
    rng = np.random.default_rng(7)
    hq, hkv = heads
    qo_indptr = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
    q = cp.asarray(rand(rng, (qo_indptr[-1], hq, 128), np.float16))
    if page_size is None:
        kv_indptr = np.concatenate([[0], np.cumsum(kv_lens)]).astype(np.int32)
        k, v = (cp.asarray(rand(rng, (kv_indptr[-1], hkv, 128), np.float16)) for _ in range(2))
    else:
        cache, indptr, indices, last, _, _ = _paged_inputs(rng, kv_lens, page_size, hkv, 128, "NHD")
        cache = cp.asarray(cache)

    def run():
        if page_size is None:
            w = cuattn.BatchPrefillWithRaggedKVCacheWrapper(backend="fa3")
            w.plan(qo_indptr, kv_indptr, hq, hkv, 128, causal=causal, fixed_split_size=split)
        else:
            w = cuattn.BatchPrefillWithPagedKVCacheWrapper(backend="fa3")
            w.plan(qo_indptr, indptr, indices, last, hq, hkv, 128, page_size, causal=causal, fixed_split_size=split)
        out = cp.full(q.shape, np.nan, np.float16)
        lse = cp.full(q.shape[:2], np.nan, np.float32)
        w.run(q, k, v, out=out, lse=lse) if page_size is None else w.run(q, cache, out=out, lse=lse)
        return out, lse, w.describe()
    (o1, s1, d1), (o2, s2, d2) = _both_forms(monkeypatch, run)
    assert "_persist" in d1 and "persistent CTAs" in d1 and "_persist" not in d2 and "CTAs on" in d2
    assert np.isfinite(o1).all() and np.array_equal(o1, o2) and np.array_equal(s1, s2)
    return o1


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("page_size,causal,kv,split", [(16, True, "e4m3", None), (1, False, "e5m2", 256),
                                                       (16, False, "e4m3", None)])
def test_persistent_fp8_gather_equals_one_cta_an_item_bitwise(page_size, causal, kv, split, monkeypatch, pages_in_kernel):
    """The fp8 gather persistent (no tile-0 peel, tiles counted across items, the next item's first K rows loaded
    while the consumers finish the last) against its one-CTA-an-item form (the peel): bitwise equal."""
    import cupy as cp
    rng = np.random.default_rng(11)
    hq, hkv = 32, 8
    qo_lens, kv_lens = [300, 1, 77, 129, 1024], [300, 3000, 1037, 200, 1024]
    qo_indptr = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
    q = cp.asarray(rand(rng, (qo_indptr[-1], hq, 128), np.float16))
    cache, indptr, indices, last, _, _ = _paged_inputs(rng, kv_lens, page_size, hkv, 128, "NHD")
    # fp8 bits with no NaN (e4m3 exponents below 15, e5m2 below 31: the & 0xB7), random signs and mantissas
    bits = cp.asarray(rng.integers(0, 256, cache.shape, dtype=np.uint8) & 0xB7)
    kv_dtype = {"e4m3": "float8_e4m3fn", "e5m2": "float8_e5m2"}[kv]

    def run():
        w = cuattn.BatchPrefillWithPagedKVCacheWrapper(backend="fa3")
        w.plan(qo_indptr, indptr, indices, last, hq, hkv, 128, page_size, causal=causal, fixed_split_size=split,
               q_data_type="float16", kv_data_type=kv_dtype)
        out = cp.full(q.shape, np.nan, np.float16)
        lse = cp.full(q.shape[:2], np.nan, np.float32)
        w.run(q, bits, out=out, lse=lse, k_scale=0.5, v_scale=0.25)
        return out, lse, w.describe()
    (o1, s1, d1), (o2, s2, d2) = _both_forms(monkeypatch, run)
    assert "_persist" in d1 and "kve" in d1 and "_persist" not in d2
    assert np.isfinite(o1).all() and np.array_equal(o1, o2) and np.array_equal(s1, s2)


@pytest.mark.gpu
@sm90
def test_persistent_graph_replays_padded_plans():
    """Graph mode pads the work list with empty items: the persistent CTAs skip them (the scheduler's replay test,
    its fa3 ragged case, with the shipped persistent spec)."""
    from .test_scheduler import test_prefill_cuda_graph_replays_after_replans_with_new_lengths as replay
    assert prefill_sm90.make_spec("f16", True).persistent
    replay("ragged", "fa3")
