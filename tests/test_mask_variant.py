"""The custom mask as the built-in variant ``variants.CUSTOM_MASK`` (issues #17, #21): one mask
mechanism for both prefill backends. CPU: specs, compile checks (no spills), errors naming the
argument, the NumPy path; GPU (marker gpu): fa2 and fa3 against the float64 oracle (tests/oracle.py)
for single, ragged (packed mask), paged and split-KV batches."""
import numpy as np
import pytest

import cuattn
from cuattn import jit, prefill, prefill_sm90, variants

from .conftest import gpu_cc
from .oracle import dense_attention, rel_err
from .test_prefill import (BF16, DTYPES, LSE_TOL, TOL, _cp, _from_dev, _nan_like, _paged_inputs, _poison_pool,
                           _ragged_inputs, _to_dev, oracle_batch, rand)


def _masks(rng, qo_lens, kv_lens, p=0.6):
    """Random boolean masks, one fully masked row in the first request with a row to spare."""
    masks = [rng.random((a, b)) < p for a, b in zip(qo_lens, kv_lens)]
    for m in masks:
        if m.shape[0] > 1:
            m[1] = False
            break
    return masks


def _packed(masks):
    flat = np.concatenate([m.ravel() for m in masks])
    seg = np.concatenate([[0], np.cumsum([m.size for m in masks])])
    return flat, *cuattn.segment_packbits(flat, seg)


# ============================================================================ CPU (CI)


def test_mask_spec_is_the_variant_and_the_plan_uses_the_shipped_spec():
    comp = variants.resolve("f", num_qo_heads=8, custom_mask=True).composite
    assert comp.pieces == (variants.CUSTOM_MASK,) and comp.has_custom_mask
    spec = prefill.make_spec(128, "f16", True, True, False)
    assert spec.variant == comp and spec.custom_mask and "custom_mask" in spec.name
    assert spec.name in {s.name for s in prefill.shipped_specs()}
    plain = prefill.make_spec(128, "f16", True, False, False)
    assert not plain.custom_mask and plain.name != spec.name
    assert "-DCUSTOM_MASK" not in " ".join(spec.defines())      # no mask code of fa2's own
    rng = np.random.default_rng(0)
    q, k, v, qo, kv = _ragged_inputs(rng, [3, 5], [7, 5], 8, 2, 128)
    w = cuattn.BatchPrefillWithRaggedKVCacheWrapper()
    w.plan(qo, kv, 8, 2, 128, custom_mask=np.ones(3 * 7 + 25, bool), causal=True)
    assert w._plan.spec == spec


@pytest.mark.parametrize("paged", [False, True], ids=["ragged", "paged"])
def test_auto_picks_fa3_for_masks_on_sm90(paged):
    kw = dict(paged=paged, page_size=16 if paged else None)
    assert prefill.resolve_backend("auto", "f", arch="sm_90a", head_dim=128, dtype="f16", custom_mask=True, **kw) == "fa3"
    assert prefill.resolve_backend("fa3", "f", arch="sm_90a", head_dim=128, dtype="bf16", custom_mask=True, **kw) == "fa3"
    assert prefill.resolve_backend("auto", "f", arch="sm_80", head_dim=128, dtype="f16", custom_mask=True, **kw) == "fa2"


def test_fa3_mask_specs_compile_without_spills():
    # every (causal, paged) pair, the dtypes alternating (the mask code does not depend on them)
    comp = variants.Composite((variants.CUSTOM_MASK,))
    for t, causal, paged in (("f16", False, False), ("bf16", False, True), ("bf16", True, False), ("f16", True, True)):
        spec = prefill_sm90.make_spec(t, causal, comp, paged)
        res = jit.compile_kernel(spec, "sm_90a").resources["cuattn_prefill_sm90"]
        assert res["spill_stores"] == 0 and res["spill_loads"] == 0 and res["stack_frame"] == 0, (spec.name, res)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_fa2_mask_with_other_variants_compiles_without_spills(arch):
    # (masked specs alone: tests/test_prefill.py test_shipped_specs_compile_without_spills)
    for opts, d, paged in ((dict(logits_soft_cap=30.0), 128, True), (dict(window_left=64, pos_encoding_mode="ALIBI"), 64, False)):
        comp = variants.resolve("f", num_qo_heads=8, custom_mask=True, **opts).composite
        spec = prefill.make_spec(d, "bf16", True, True, paged, comp)
        res = jit.compile_kernel(spec, arch).resources["cuattn_prefill"]
        assert res["spill_stores"] == 0 and res["spill_loads"] == 0 and res["stack_frame"] == 0, (spec.name, res)


def test_row_state_feeds_a_mask_of_any_type():
    # an int row state read by a mask (the custom mask's is a long long): compiles in decode and fa2
    v = cuattn.Variant("lastn", params=(("n", "int"),), row_state="return qo_pos - params.n;",
                       logits_mask="return kv_idx > row;")
    comp = variants.Composite((v,))
    for spec in (cuattn.decode.DecodeSpec(64, "f16", "f16", variant=comp), prefill.make_spec(64, "f16", False, False, False, comp)):
        assert jit.compile_kernel(spec, "sm_80").cubin
    with pytest.raises(ValueError, match="row_state is read by the logits_transform and logits_mask"):
        cuattn.Variant("v", row_state="return 0.f;", kv_begin="return 0;")


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_numpy_paged_mask_matches_oracle_and_variant_form_is_the_same(causal):
    rng = np.random.default_rng(1)
    qo_lens, kv_lens = [4, 19, 1], [11, 19, 40]
    cache, indptr, indices, last, ks, vs = _paged_inputs(rng, kv_lens, 16, 2, 128, "NHD")
    qo = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
    q = rand(rng, (qo[-1], 8, 128), np.float16)
    masks = _masks(rng, qo_lens, kv_lens)
    flat, packed, mask_indptr = _packed(masks)
    w = cuattn.BatchPrefillWithPagedKVCacheWrapper(backend="fa3")       # a mask is no reason to refuse fa3
    w.plan(qo, indptr, indices, last, 8, 2, 128, 16, custom_mask=flat, causal=causal)
    out, lse = w.run(q, cache, return_lse=True)
    ref_o, ref_s = oracle_batch(q, ks, vs, qo, causal, masks)
    assert rel_err(out, ref_o) < 2e-3 and rel_err(lse, ref_s) < 1e-5
    assert np.all(np.isneginf(lse[1]))                              # the fully masked row
    # -- the same variant passed by the user, its arrays to run(): bit for bit the option's result
    w2 = cuattn.BatchPrefillWithPagedKVCacheWrapper()
    w2.plan(qo, indptr, indices, last, 8, 2, 128, 16, causal=causal, variant=variants.CUSTOM_MASK)
    np.testing.assert_array_equal(w2.run(q, cache, packed, mask_indptr), out)


def test_mask_errors_name_the_argument():
    rng = np.random.default_rng(2)
    qo_lens, kv_lens = [2, 3, 1], [4, 6, 5]
    q, k, v, qo, kv = _ragged_inputs(rng, qo_lens, kv_lens, 4, 4, 64)
    masks = _masks(rng, qo_lens, kv_lens)
    flat, packed, mask_indptr = _packed(masks)
    w = cuattn.BatchPrefillWithRaggedKVCacheWrapper()
    # -- the plan's options
    with pytest.raises(TypeError, match="custom_mask must be a boolean array"):
        w.plan(qo, kv, 4, 4, 64, custom_mask=flat.astype(np.float32))
    with pytest.raises(ValueError, match="custom_mask must have 31 entries"):
        w.plan(qo, kv, 4, 4, 64, custom_mask=flat[:-1])
    with pytest.raises(TypeError, match="packed_custom_mask must be uint8"):
        w.plan(qo, kv, 4, 4, 64, packed_custom_mask=packed.astype(np.int32))
    with pytest.raises(ValueError, match="custom_mask or packed_custom_mask, not both"):
        w.plan(qo, kv, 4, 4, 64, custom_mask=flat, packed_custom_mask=packed)
    with pytest.raises(ValueError, match="distinct names"):
        w.plan(qo, kv, 4, 4, 64, custom_mask=flat, variant=variants.CUSTOM_MASK)
    pw = cuattn.BatchPrefillWithPagedKVCacheWrapper()
    with pytest.raises(ValueError, match="custom_mask must have 31 entries"):
        pw.plan(qo, np.array([0, 1, 2, 3], np.int32), np.arange(3, dtype=np.int32), np.array([4, 6, 5], np.int32),
                4, 4, 64, 8, custom_mask=np.ones(30, bool))
    q1 = q[:2]
    with pytest.raises(ValueError, match="custom_mask must have 8 entries"):
        cuattn.single_prefill_with_kv_cache(q1, k[:4], v[:4], custom_mask=np.ones((2, 3), bool))
    # -- the variant passed by the user: its arrays at run()
    w.plan(qo, kv, 4, 4, 64, variant=variants.CUSTOM_MASK)
    np.testing.assert_array_equal(w.run(q, k, v, packed, mask_indptr).shape, q.shape)
    for bits, ind, match in ((packed.astype(np.int32), mask_indptr, "custom_mask must be a 1-D uint8 array"),
                             (packed, mask_indptr.astype(np.int64), "mask_indptr must be a 1-D int32 array"),
                             (packed, mask_indptr[:-1], "mask_indptr must have batch \\+ 1 = 4 entries"),
                             (packed[:-1], mask_indptr, "fit in custom_mask"),
                             (packed, mask_indptr - 1, "byte offsets >= 0")):
        with pytest.raises(ValueError, match=match):
            w.run(q, k, v, bits, ind)
    with pytest.raises(TypeError, match="mask_indptr"):
        w.run(q, k, v, packed)


# ============================================================================ GPU (marker gpu)

BACKENDS = ["fa2", "fa3"]


def _skip_unless(backend):
    if backend == "fa3" and gpu_cc() != 90:
        pytest.skip("the fa3 kernel needs an sm_90 GPU")


def _check(out, lse, ref_o, ref_s, dtype):
    assert rel_err(_from_dev(out, DTYPES[dtype]), ref_o) < TOL[dtype]
    assert rel_err(_cp().asnumpy(lse), ref_s) < LSE_TOL


def _batch_plan_kwargs(backend):
    # fa3 through "auto" (what serving engines run): .backend must then say fa3 on sm_90
    return dict(backend="auto" if backend == "fa3" else "fa2")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("qo_len,kv_len,causal,dtype", [(300, 1000, False, "float16"), (77, 509, True, "bfloat16")],
                         ids=["300x1000-full-f16", "77x509-causal-bf16"])
def test_single_prefill_gpu_mask_matches_oracle(backend, qo_len, kv_len, causal, dtype):
    _skip_unless(backend)
    rng = np.random.default_rng(qo_len + kv_len)
    dt = DTYPES[dtype]
    q, k, v = (rand(rng, (n, h, 128), dt) for n, h in ((qo_len, 32), (kv_len, 8), (kv_len, 8)))   # GQA group 4
    m = _masks(rng, [qo_len], [kv_len])[0]
    _poison_pool(q.size * 4)
    out, lse = cuattn.single_prefill_with_kv_cache(_to_dev(q), _to_dev(k), _to_dev(v), custom_mask=_cp().asarray(m),
                                                   causal=causal, backend=backend, return_lse=True)
    ref_o, ref_s = dense_attention(q, k, v, causal=causal, mask=m)
    _check(out, lse, ref_o, ref_s, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("split", [None, 128], ids=["scheduler", "split128"])
def test_ragged_gpu_packed_mask_matches_oracle(backend, split):
    # several query tiles per request (100 queries x group 4 = 400 packed rows), a 1-query request,
    # qo_len < kv_len; fixed_split_size=128 cuts the 700- and 2100-key requests into merged pieces
    _skip_unless(backend)
    rng = np.random.default_rng(11)
    qo_lens, kv_lens = [1, 100, 37, 64], [54, 700, 37, 2100]
    q, k, v, qo, kv = _ragged_inputs(rng, qo_lens, kv_lens, 32, 8, 128)
    masks = _masks(rng, qo_lens, kv_lens)
    _, packed, _ = _packed(masks)
    w = cuattn.BatchPrefillWithRaggedKVCacheWrapper(**_batch_plan_kwargs(backend))
    w.plan(_to_dev(qo), _to_dev(kv), 32, 8, 128, packed_custom_mask=_cp().asarray(packed), causal=True,
           fixed_split_size=split)
    assert w.backend == backend
    if split:
        assert w._plan.work_list.split
    out, lse = _nan_like(q.shape, q.dtype), _cp().full(q.shape[:2], np.nan, np.float32)
    w.run(_to_dev(q), _to_dev(k), _to_dev(v), out=out, lse=lse)
    ks = [k[kv[b]:kv[b + 1]] for b in range(len(kv_lens))]
    vs = [v[kv[b]:kv[b + 1]] for b in range(len(kv_lens))]
    ref_o, ref_s = oracle_batch(q, ks, vs, qo, True, masks)
    _check(out, lse, ref_o, ref_s, "float16")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS)
def test_paged_gpu_mask_matches_oracle(backend):
    # random page order, HND, bf16, a request whose queries fill less than a tile (the 64-row tiles of
    # fa2's small_q path when every request does) and one longer than its page run
    _skip_unless(backend)
    rng = np.random.default_rng(12)
    qo_lens, kv_lens = [17, 130, 3], [600, 130, 77]
    cache, indptr, indices, last, ks, vs = _paged_inputs(rng, kv_lens, 16, 4, 128, "HND", BF16)
    qo = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
    q = rand(rng, (qo[-1], 16, 128), BF16)
    masks = _masks(rng, qo_lens, kv_lens)
    flat, _, _ = _packed(masks)
    w = cuattn.BatchPrefillWithPagedKVCacheWrapper(kv_layout="HND", **_batch_plan_kwargs(backend))
    w.plan(_to_dev(qo), _to_dev(indptr), _to_dev(indices), _to_dev(last), 16, 4, 128, 16,
           custom_mask=_cp().asarray(flat), causal=False, q_data_type="bfloat16", fixed_split_size=256)
    assert w.backend == backend
    out, lse = _nan_like(q.shape, BF16), _cp().full(q.shape[:2], np.nan, np.float32)
    w.run(_to_dev(q), _to_dev(cache), out=out, lse=lse)
    ref_o, ref_s = oracle_batch(q, ks, vs, qo, False, masks)
    _check(out, lse, ref_o, ref_s, "bfloat16")
