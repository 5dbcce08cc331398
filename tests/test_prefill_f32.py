"""Prefill with fp32 K/V (q fp16 / bf16: rounded to q's type on the GPU, fa2) and with an fp32 q (issue 22),
against tests/oracle.py's float64 attention. Shared helpers: tests/prefill_dtype_cases.py."""
import numpy as np
import pytest

import cuattn
from cuattn import jit, prefill
from cuattn.errors import UnsupportedError
from tests.conftest import gpu_cc
from tests.oracle import dense_attention, rel_err, variant_attention
from tests.prefill_dtype_cases import (BF16, FP8, LSE_TOL, QDT, TOL, _check, _cp, _dev, _ids, _oracle, _poisoned,
                                       to_pages)


# ============================================================================ fp32 KV (q fp16 / bf16)


def test_fp32_kv_numpy_ragged_and_paged_match_oracle():
    rng = np.random.default_rng(21)
    qo_indptr, kv_indptr = np.array([0, 5, 22], np.int32), np.array([0, 21, 61], np.int32)
    q = rng.standard_normal((22, 8, 64)).astype(BF16)
    k, v = rng.standard_normal((61, 2, 64)).astype(np.float32), rng.standard_normal((61, 2, 64)).astype(np.float32)
    ks, vs = [k[:21], k[21:]], [v[:21], v[21:]]
    ref_o, ref_s = _oracle(q, ks, vs, qo_indptr, True)
    w = cuattn.BatchPrefillWithRaggedKVCacheWrapper()
    w.plan(qo_indptr, kv_indptr, 8, 2, 64, causal=True, q_data_type="bfloat16", kv_data_type="float32")
    out, lse = w.run(q, k, v, return_lse=True)
    assert out.dtype == BF16 and rel_err(out, ref_o) < 1e-2 and rel_err(lse, ref_s) < 1e-5
    kp, indptr, indices, last = to_pages(k, kv_indptr, 16)
    vp, _, _, _ = to_pages(v, kv_indptr, 16)
    wp = cuattn.BatchPrefillWithPagedKVCacheWrapper()
    wp.plan(qo_indptr, indptr, indices, last, 8, 2, 64, 16, causal=True, q_data_type="bfloat16", kv_data_type="float32")
    np.testing.assert_array_equal(wp.run(q, (kp, vp)).view(np.uint16), out.view(np.uint16))
    with pytest.raises(UnsupportedError, match="q dtype float64 has no kernel"):
        w.plan(qo_indptr, kv_indptr, 8, 2, 64, q_data_type="float64", kv_data_type="float32")
    with pytest.raises(UnsupportedError, match="backend='fa3': fa3 reads K/V of q's dtype or fp8 .* only, got an f32"):
        cuattn.BatchPrefillWithRaggedKVCacheWrapper(backend="fa3").plan(qo_indptr, kv_indptr, 8, 2, 128,
                                                                        kv_data_type="float32")


@pytest.mark.parametrize("arch", jit.SHIPPED_ARCHS)
def test_fp32_kv_specs_compile_without_spills(arch):
    for d, t, c, m, p, dv in ((128, "f16", True, False, True, None), (64, "bf16", False, True, False, None),
                              (256, "f16", False, False, True, None), (192, "bf16", True, False, True, 128)):
        spec = prefill.make_spec(d, t, c, m, p, dtype_kv="f32", head_dim_vo=dv)
        res = jit.compile_kernel(spec, arch).resources["cuattn_prefill"]
        assert res["spill_stores"] == res["spill_loads"] == 0, (spec.name, arch, res)


F32_GPU = [   # (qo_lens, kv_lens, hq, hkv, head_dim, q dtype, causal, paged page size (0: ragged))
    ([37, 200], [97, 200], 32, 8, 128, "float16", True, 16),
    ([64, 1], [700, 33], 16, 2, 64, "bfloat16", False, 1),
    ([100], [1500], 8, 2, 128, "bfloat16", True, 0),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", F32_GPU, ids=_ids(F32_GPU))
def test_fp32_kv_gpu_matches_oracle(case):
    qo_lens, kv_lens, hq, hkv, d, qdt, causal, ps = case
    rng = np.random.default_rng(hq + d)
    qo_indptr = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
    kv_indptr = np.concatenate([[0], np.cumsum(kv_lens)]).astype(np.int32)
    rows = int(qo_indptr[-1])
    q = rng.standard_normal((rows, hq, d)).astype(QDT[qdt])
    k, v = (rng.standard_normal((int(kv_indptr[-1]), hkv, d)).astype(np.float32) for _ in range(2))
    out, lse = _poisoned((rows, hq, d), qdt), _cp().full((rows, hq), np.nan, np.float32)
    if ps:
        kp, indptr, indices, last = to_pages(k, kv_indptr, ps)
        vp, _, _, _ = to_pages(v, kv_indptr, ps)
        w = cuattn.BatchPrefillWithPagedKVCacheWrapper()
        w.plan(_dev(qo_indptr), _dev(indptr), _dev(indices), _dev(last), hq, hkv, d, ps, causal=causal,
               q_data_type=qdt, kv_data_type="float32")
        w.run(_dev(q), (_dev(kp), _dev(vp)), out=out, lse=lse)
    else:
        w = cuattn.BatchPrefillWithRaggedKVCacheWrapper()
        w.plan(qo_indptr, kv_indptr, hq, hkv, d, causal=causal, q_data_type=qdt, kv_data_type="float32")
        w.run(_dev(q), _dev(k), _dev(v), out=out, lse=lse)
    assert w.backend == "fa2"
    ks = [k[kv_indptr[b]:kv_indptr[b + 1]] for b in range(len(kv_lens))]
    vs = [v[kv_indptr[b]:kv_indptr[b + 1]] for b in range(len(kv_lens))]
    ref_o, ref_s = _oracle(q, ks, vs, qo_indptr, causal)
    _check(out, lse, ref_o, ref_s, qdt)


# ============================================================================ fp32 q (issue 22)
# An fp32 q runs the 16-bit kernels (cuattn/qcast.py): converted on the GPU to bf16 for a bf16 cache, else
# to f16 saturating at +-65504, the output converted back into an fp32 out. The NumPy path computes with it.

F32Q_KV = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16), "bfloat16": BF16, "e4m3": FP8["e4m3"]}
F32Q_KV_NAME = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16", "e4m3": "float8_e4m3fn"}


def f32q_case(qo_lens, kv_lens, hq, hkv, d, kv, seed):
    """An fp32 q (scaled past 1), contiguous K/V of ``kv`` (e4m3: stored values, read with k_scale 0.5 and
    v_scale 2), the indptrs, the scales to pass and the float64 oracle's per-request real K/V."""
    rng = np.random.default_rng(seed)
    qo_indptr = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
    kv_indptr = np.concatenate([[0], np.cumsum(kv_lens)]).astype(np.int32)
    q = (rng.standard_normal((int(qo_indptr[-1]), hq, d)) * 3).astype(np.float32)
    k, v = (rng.standard_normal((int(kv_indptr[-1]), hkv, d)).astype(F32Q_KV[kv]) for _ in range(2))
    scales = (0.5, 2.0) if kv == "e4m3" else (None, None)
    kr, vr = (x.astype(np.float64) * (s or 1.0) for x, s in ((k, scales[0]), (v, scales[1])))
    ks = [kr[kv_indptr[b]:kv_indptr[b + 1]] for b in range(len(kv_lens))]
    vs = [vr[kv_indptr[b]:kv_indptr[b + 1]] for b in range(len(kv_lens))]
    return q, k, v, qo_indptr, kv_indptr, scales, ks, vs


@pytest.mark.parametrize("kv", list(F32Q_KV))
def test_f32_q_prefill_numpy_ragged_paged_and_single_match_oracle(kv):
    q, k, v, qo_indptr, kv_indptr, (ksc, vsc), ks, vs = f32q_case([5, 17], [21, 40], 8, 2, 64, kv, seed=31)
    ref_o, ref_s = _oracle(q, ks, vs, qo_indptr, True)
    w = cuattn.BatchPrefillWithRaggedKVCacheWrapper()
    w.plan(qo_indptr, kv_indptr, 8, 2, 64, causal=True, q_data_type="float32", kv_data_type=F32Q_KV_NAME[kv])
    out, lse = np.full(q.shape, np.nan, np.float32), np.full(q.shape[:2], np.nan, np.float32)
    res = w.run(q, k, v, out=out, lse=lse, return_lse=True, k_scale=ksc, v_scale=vsc)
    assert res[0] is out and res[1] is lse and out.dtype == np.float32
    assert rel_err(out, ref_o) < 1e-5 and rel_err(lse, ref_s) < 1e-6      # float32 arithmetic on the exact q
    kp, indptr, indices, last = to_pages(k, kv_indptr, 16)
    vp, _, _, _ = to_pages(v, kv_indptr, 16)
    wp = cuattn.BatchPrefillWithPagedKVCacheWrapper()
    wp.plan(qo_indptr, indptr, indices, last, 8, 2, 64, 16, causal=True, q_data_type="float32",
            kv_data_type=F32Q_KV_NAME[kv])
    paged = wp.run(q, (kp, vp), k_scale=ksc, v_scale=vsc)
    assert paged.dtype == np.float32 and rel_err(paged, ref_o) < 1e-5
    single = cuattn.single_prefill_with_kv_cache(q[5:], k[21:], v[21:], causal=True, k_scale=ksc, v_scale=vsc)
    assert single.dtype == np.float32 and rel_err(single, ref_o[5:]) < 1e-5


def test_f32_q_prefill_plans_the_16bit_kernel_of_the_compute_type():
    qo_indptr, kv_indptr = np.array([0, 3], np.int32), np.array([0, 9], np.int32)
    want = {"float16": ("f16", ""), "bfloat16": ("bf16", ""), "float32": ("f16", "f32"),
            "float8_e4m3fn": ("f16", "e4m3")}
    for kv, (dt, dkv) in want.items():
        w = cuattn.BatchPrefillWithRaggedKVCacheWrapper()
        w.plan(qo_indptr, kv_indptr, 8, 2, 128, q_data_type="float32", kv_data_type=kv)
        assert (w._plan.spec.dtype, w._plan.spec.dtype_kv) == (dt, dkv), kv
        assert w._plan.q_dtype == np.float32             # what run() checks q and out against
    # fa3 takes the 16-bit copy where it takes that q: an f16 / bf16 cache, not an fp32 one
    cuattn.BatchPrefillWithRaggedKVCacheWrapper(backend="fa3").plan(qo_indptr, kv_indptr, 8, 2, 128,
                                                                    q_data_type="float32", kv_data_type="bfloat16")
    with pytest.raises(UnsupportedError, match="backend='fa3'"):
        cuattn.BatchPrefillWithRaggedKVCacheWrapper(backend="fa3").plan(qo_indptr, kv_indptr, 8, 2, 128,
                                                                        q_data_type="float32",
                                                                        kv_data_type="float32")


def test_f32_q_prefill_variants_numpy_path_match_float64_oracle():
    q, k, v, qo_indptr, kv_indptr, _, ks, vs = f32q_case([4, 11], [30, 19], 8, 2, 64, "bfloat16", seed=32)
    sinks = np.random.default_rng(4).standard_normal(8).astype(np.float32)
    cases = [(dict(logits_soft_cap=6.0, window_left=7), dict(soft_cap=6.0, window_left=7)),
             (dict(pos_encoding_mode="ALIBI"), dict(alibi=True))]
    for opts, ref_opts in cases:
        w = cuattn.BatchPrefillWithRaggedKVCacheWrapper()
        w.plan(qo_indptr, kv_indptr, 8, 2, 64, causal=True, q_data_type="float32", kv_data_type="bfloat16", **opts)
        out = w.run(q, k, v)
        for b in range(2):
            ro, _ = variant_attention(q[qo_indptr[b]:qo_indptr[b + 1]], ks[b], vs[b], causal=True, **ref_opts)
            assert rel_err(out[qo_indptr[b]:qo_indptr[b + 1]], ro) < 1e-5, opts
    # sinks: BatchAttentionWithAttentionSinkWrapper over pages
    kp, indptr, indices, last = to_pages(k, kv_indptr, 8)
    vp, _, _, _ = to_pages(v, kv_indptr, 8)
    w = cuattn.BatchAttentionWithAttentionSinkWrapper(q_data_type="float32", kv_data_type="bfloat16", head_dim_qk=64,
                                                      head_dim_vo=64)
    w.plan(qo_indptr, indptr, indices, last, 8, 2, 64, 8, causal=True)
    out = w.run(q, (kp, vp), sinks)
    for b in range(2):
        ro, _ = variant_attention(q[qo_indptr[b]:qo_indptr[b + 1]], ks[b], vs[b], causal=True, sinks=sinks)
        assert out.dtype == np.float32 and rel_err(out[qo_indptr[b]:qo_indptr[b + 1]], ro) < 1e-5


def test_f32_q_wrappers_built_on_prefill_run_it_on_the_numpy_path():
    """Cascade, block-sparse and BatchAttention plan and run their inner wrappers: an fp32 q passes through."""
    from tests.test_multilevel import make_cascade, oracle as cascade_oracle
    levels = [([9], [129]), ([4, 5], [20, 35])]
    tables, cache, q16, per_q = make_cascade(3, levels, 8, 2, 64, 16)
    q = (np.random.default_rng(5).standard_normal(q16.shape) * 3).astype(np.float32)
    w = cuattn.MultiLevelCascadeAttentionWrapper(2)
    w.plan([t[0] for t in tables], [t[1] for t in tables], [t[2] for t in tables], [t[3] for t in tables],
           8, 2, 64, 16, q_data_type="float32", kv_data_type="float16")
    out, lse = w.run(q, cache, return_lse=True)
    want, want_lse = cascade_oracle(q, per_q)
    assert out.dtype == np.float32 and rel_err(out, want) < 1e-5 and rel_err(lse, want_lse) < 1e-5
    # block-sparse: 2 row blocks of 16 queries over column blocks of 32 keys
    rng = np.random.default_rng(6)
    qb = (rng.standard_normal((32, 4, 64)) * 3).astype(np.float32)
    kb, vb = (rng.standard_normal((96, 2, 64)).astype(np.float16) for _ in range(2))
    bs = cuattn.BlockSparseAttentionWrapper()
    bs.plan(np.array([0, 2, 3], np.int32), np.array([0, 2, 1], np.int32), 32, 96, 16, 32, 4, 2, 64,
            q_data_type="float32", kv_data_type="float16", o_data_type="float32")
    ob = bs.run(qb, kb, vb)
    for rows, keys in ((slice(0, 16), np.r_[0:32, 64:96]), (slice(16, 32), np.r_[32:64])):
        ro, _ = dense_attention(qb[rows], kb[keys], vb[keys])
        assert ob.dtype == np.float32 and rel_err(ob[rows], ro) < 1e-5
    # BatchAttention: a prefill chunk and a decode step over one paged cache
    q2, k2, v2, qo2, kv2, _, ks2, vs2 = f32q_case([6, 1], [20, 13], 8, 2, 64, "float16", seed=33)
    kp, indptr, indices, last = to_pages(k2, kv2, 16)
    vp, _, _, _ = to_pages(v2, kv2, 16)
    ba = cuattn.BatchAttention()
    ba.plan(qo2, indptr, indices, np.diff(kv2).astype(np.int32), 8, 2, 64, 64, 16, causal=True,
            q_data_type="float32", kv_data_type="float16")
    o2, _ = ba.run(q2, (kp, vp))
    ref2, _ = _oracle(q2, ks2, vs2, qo2, True)
    assert o2.dtype == np.float32 and rel_err(o2, ref2) < 1e-5


def test_f32_q_prefill_run_refuses_a_q_or_out_of_another_dtype():
    q, k, v, qo_indptr, kv_indptr, _, _, _ = f32q_case([3], [9], 4, 2, 64, "float16", seed=34)
    w = cuattn.BatchPrefillWithRaggedKVCacheWrapper()
    w.plan(qo_indptr, kv_indptr, 4, 2, 64, q_data_type="float32", kv_data_type="float16")
    with pytest.raises(ValueError, match=r"q must have the q_data_type given to plan \(float32\)"):
        w.run(q.astype(np.float16), k, v)
    with pytest.raises(ValueError, match="out must have shape .* and dtype float32"):
        w.run(q, k, v, out=np.empty(q.shape, np.float16))
    w.plan(qo_indptr, kv_indptr, 4, 2, 64, q_data_type="float16", kv_data_type="float16")
    with pytest.raises(ValueError, match=r"q must have the q_data_type given to plan \(float16\)"):
        w.run(q, k, v)
    with pytest.raises(UnsupportedError, match="q dtype float64 has no kernel"):
        cuattn.single_prefill_with_kv_cache(q.astype(np.float64), k, v)


F32Q_PREFILL_GPU = [   # (qo_lens, kv_lens, hq, hkv, head_dim, kv dtype, causal, page size (0: ragged))
    ([37, 200], [97, 200], 32, 8, 128, "float32", True, 0),
    ([64, 1], [700, 33], 16, 2, 64, "bfloat16", False, 0),      # fa3 on sm_90
    ([37, 200], [97, 200], 32, 8, 128, "float16", True, 16),     # fa3 on sm_90
    ([100, 3], [1500, 40], 8, 2, 128, "float32", True, 1),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", F32Q_PREFILL_GPU, ids=_ids(F32Q_PREFILL_GPU))
def test_f32_q_prefill_gpu_matches_oracle(case):
    cp = _cp()
    qo_lens, kv_lens, hq, hkv, d, kv, causal, ps = case
    q, k, v, qo_indptr, kv_indptr, _, ks, vs = f32q_case(qo_lens, kv_lens, hq, hkv, d, kv, seed=hq + d + ps)
    rows = int(qo_indptr[-1])
    out, lse = cp.full((rows, hq, d), np.nan, np.float32), cp.full((rows, hq), np.nan, np.float32)
    if ps:
        kp, indptr, indices, last = to_pages(k, kv_indptr, ps)
        vp, _, _, _ = to_pages(v, kv_indptr, ps)
        w = cuattn.BatchPrefillWithPagedKVCacheWrapper()
        w.plan(_dev(qo_indptr), _dev(indptr), _dev(indices), _dev(last), hq, hkv, d, ps, causal=causal,
               q_data_type="float32", kv_data_type=kv)
        run = lambda q_, out_=None, lse_=None: w.run(q_, (_dev(kp), _dev(vp)), out=out_, lse=lse_)   # noqa: E731
    else:
        w = cuattn.BatchPrefillWithRaggedKVCacheWrapper()
        w.plan(qo_indptr, kv_indptr, hq, hkv, d, causal=causal, q_data_type="float32", kv_data_type=kv)
        run = lambda q_, out_=None, lse_=None: w.run(q_, _dev(k), _dev(v), out=out_, lse=lse_)       # noqa: E731
    res = run(_dev(q), out, lse)
    assert res is out
    # "auto": fa3 on sm_90 runs the 16-bit copy of q over a 16-bit cache (not over an fp32 one)
    assert w.backend == ("fa3" if kv != "float32" and gpu_cc() >= 90 else "fa2")
    ref_o, ref_s = _oracle(q, ks, vs, qo_indptr, causal)
    o = cp.asnumpy(out)
    assert np.all(np.isfinite(o)), "unwritten or non-finite output"
    assert rel_err(o, ref_o) < TOL
    assert np.max(np.abs(o - ref_o)) < TOL * 4 * np.max(np.abs(ref_o))        # every element
    assert rel_err(cp.asnumpy(lse), ref_s) < LSE_TOL
    if ps == 0 and kv == "float32":      # errors name the argument; a returned out is fp32
        with pytest.raises(ValueError, match=r"q must have the q_data_type given to plan \(float32\)"):
            run(_dev(q.astype(np.float16)))
        with pytest.raises(ValueError, match="out must be a .* float32 array"):
            run(_dev(q), cp.empty((rows, hq, d), np.float16))
        fresh = run(_dev(q))
        assert fresh.dtype == np.float32 and rel_err(cp.asnumpy(fresh), ref_o) < TOL


@pytest.mark.gpu
def test_f32_q_single_prefill_gpu_returns_fp32():
    cp = _cp()
    q, k, v, qo_indptr, _, _, ks, vs = f32q_case([77], [300], 16, 4, 128, "bfloat16", seed=35)
    out, lse = cuattn.single_prefill_with_kv_cache(_dev(q), _dev(k), _dev(v), causal=True, return_lse=True)
    ref_o, ref_s = _oracle(q, ks, vs, qo_indptr, True)
    assert out.dtype == np.float32 and rel_err(cp.asnumpy(out), ref_o) < TOL
    assert rel_err(cp.asnumpy(lse), ref_s) < LSE_TOL


@pytest.mark.gpu
def test_f32_q_cascade_gpu_matches_oracle():
    """The cascade's levels (a decode level and a prefill level here) each convert the fp32 q; their fp32
    states merge (cascade.py's merge takes fp32)."""
    cp = _cp()
    from tests.test_multilevel import make_cascade, oracle as cascade_oracle
    levels = [([9], [300]), ([1] * 9, [17, 40, 1, 64, 33, 5, 9, 70, 2])]
    tables, cache, q16, per_q = make_cascade(7, levels, 16, 4, 128, 16)
    q = (np.random.default_rng(8).standard_normal(q16.shape) * 3).astype(np.float32)
    w = cuattn.MultiLevelCascadeAttentionWrapper(2)
    w.plan([t[0] for t in tables], [t[1] for t in tables], [t[2] for t in tables], [t[3] for t in tables],
           16, 4, 128, 16, q_data_type="float32", kv_data_type="float16")
    out, lse = cp.full(q.shape, np.nan, np.float32), cp.full(q.shape[:2], np.nan, np.float32)
    w.run(cp.asarray(q), cp.asarray(cache), out=out, lse=lse)
    want, want_lse = cascade_oracle(q, per_q)
    o = cp.asnumpy(out)
    assert np.all(np.isfinite(o)) and rel_err(o, want) < TOL
    assert rel_err(cp.asnumpy(lse), want_lse) < LSE_TOL
