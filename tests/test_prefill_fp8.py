"""Prefill over fp8 e4m3 / e5m2 KV caches (issue 22) with k_scale / v_scale (floats, 1-element or per-kv-head
arrays; 16-bit K/V take them too) in single / ragged / paged prefill on fa2 and (sm_90) fa3. The oracle is
tests/oracle.py's float64 attention over the real K/V (fp8 values times their scales: exact once dequantised).
Cases and checks: tests/prefill_dtype_cases.py."""
import numpy as np
import pytest

import cuattn
from cuattn import jit, prefill, prefill_sm90, variants
from cuattn.errors import UnsupportedError
from tests.conftest import gpu_cc
from tests.oracle import dense_attention, rel_err, variant_attention
from tests.prefill_dtype_cases import (BF16, FP8_NAME, TOL, _check, _cp, _dev, _dev_scale, _ids, _oracle, _poisoned,
                                       paged_fp8_case, ragged_fp8_case, run_paged_fp8_and_check)


# ============================================================================ CPU (CI)


@pytest.mark.parametrize("kv", ["e4m3", "e5m2"])
@pytest.mark.parametrize("scale_kind", ["tensor", "one", "head"])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_paged_prefill_numpy_fp8_matches_dequantised_oracle(kv, scale_kind, layout):
    c = paged_fp8_case([5, 1, 12], [21, 7, 12], 5, 8, 2, 64, kv, "float16", scale_kind, layout)
    w = cuattn.BatchPrefillWithPagedKVCacheWrapper(kv_layout=layout)
    w.plan(c["qo_indptr"], c["indptr"], c["indices"], c["last"], 8, 2, 64, 5, causal=True, q_data_type="float16",
           kv_data_type=FP8_NAME[kv])
    out, lse = w.run(c["q"], (c["k"], c["v"]), k_scale=c["scales"][0], v_scale=c["scales"][1], return_lse=True)
    ref_o, ref_s = _oracle(c["q"], c["ks"], c["vs"], c["qo_indptr"], True)
    assert out.dtype == np.float16
    assert rel_err(out, ref_o) < 2e-3 and rel_err(lse, ref_s) < 1e-5


@pytest.mark.parametrize("kv", ["e4m3", "e5m2"])
def test_ragged_and_single_prefill_numpy_fp8_read_uint8_as_kv_data_type(kv):
    c = ragged_fp8_case([3, 17], [9, 40], 8, 4, 128, kv, "bfloat16", "head", seed=1)
    w = cuattn.BatchPrefillWithRaggedKVCacheWrapper()
    w.plan(c["qo_indptr"], c["kv_indptr"], 8, 4, 128, q_data_type="bfloat16", kv_data_type=FP8_NAME[kv])
    out = w.run(c["q"], c["k"].view(np.uint8), c["v"].view(np.uint8), k_scale=c["scales"][0], v_scale=c["scales"][1])
    ref_o, _ = _oracle(c["q"], c["ks"], c["vs"], c["qo_indptr"], False)
    assert out.dtype == BF16 and rel_err(out, ref_o) < 1e-2
    # single request: fp8 arrays as they are, and uint8 with kv_data_type
    q1, k1, v1 = c["q"][:3], c["k"][:9], c["v"][:9]
    o1 = cuattn.single_prefill_with_kv_cache(q1, k1, v1, causal=True, k_scale=c["scales"][0], v_scale=c["scales"][1])
    o2 = cuattn.single_prefill_with_kv_cache(q1, k1.view(np.uint8), v1.view(np.uint8), causal=True,
                                             k_scale=c["scales"][0], v_scale=c["scales"][1],
                                             kv_data_type=FP8_NAME[kv])
    r1, _ = dense_attention(q1, c["ks"][0], c["vs"][0], causal=True)
    np.testing.assert_array_equal(o1.view(np.uint16), o2.view(np.uint16))
    assert rel_err(o1, r1) < 1e-2


def test_prefill_scales_apply_to_16_bit_kv_too():
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal(s).astype(np.float16) for s in ((7, 4, 64), (20, 2, 64), (20, 2, 64)))
    out = cuattn.single_prefill_with_kv_cache(q, k, v, k_scale=0.5, v_scale=np.array([2.0, 3.0], np.float32))
    ref, _ = dense_attention(q, k.astype(np.float64) * 0.5, v.astype(np.float64) * np.array([2.0, 3.0])[None, :, None])
    assert rel_err(out, ref) < 2e-3


def test_prefill_rejects_bad_scales_naming_the_argument():
    c = paged_fp8_case([4], [9], 4, 4, 2, 64, "e4m3", "float16", "tensor")
    w = cuattn.BatchPrefillWithPagedKVCacheWrapper()
    w.plan(c["qo_indptr"], c["indptr"], c["indices"], c["last"], 4, 2, 64, 4, kv_data_type="float8_e4m3fn")
    for kw, match in ((dict(k_scale=np.ones(3, np.float32)), r"k_scale must be .*shape \(1,\) or \(num_kv_heads,\)"),
                      (dict(v_scale=-1.0), "v_scale must be a positive finite number"),
                      (dict(k_scale=0.0), "k_scale must be a positive finite number"),
                      (dict(v_scale=float("nan")), "v_scale must be a positive finite number"),
                      (dict(k_scale=np.ones((2, 1), np.float32)), "k_scale must be"),
                      (dict(v_scale=np.array([1.0, np.inf], np.float32)), "v_scale must be positive and finite")):
        with pytest.raises(ValueError, match=match):
            w.run(c["q"], (c["k"], c["v"]), **kw)
    with pytest.raises(ValueError, match="paged_kv_cache must have dtype float8_e4m3fn"):
        w.run(c["q"], (c["k"].astype(np.float16), c["v"].astype(np.float16)))


def test_prefill_fp8_refusals_name_the_limit():
    ind, lpl = np.array([0, 4], np.int32), np.array([3], np.int32)
    w = cuattn.BatchPrefillWithPagedKVCacheWrapper(backend="fa3")
    w.plan(ind, np.array([0, 1], np.int32), np.array([0], np.int32), lpl, 4, 4, 128, 16,
           kv_data_type="float8_e4m3fn")          # fa3 has fp8 kernels (NumPy plan here)
    w.plan(ind, np.array([0, 1], np.int32), np.array([0], np.int32), lpl, 4, 4, 128, 5,
           kv_data_type="float8_e5m2")            # any page size: the gather converts fp8 rows
    assert prefill_sm90.make_spec("f16", True, paged=True, dtype_kv="e5m2", page_size=5).gather
    with pytest.raises(UnsupportedError, match="q dtype float8_e4m3fn has no kernel"):
        cuattn.BatchPrefillWithPagedKVCacheWrapper().plan(ind, np.array([0, 1], np.int32), np.array([0], np.int32),
                                                          lpl, 4, 4, 128, 16, q_data_type="float8_e4m3fn",
                                                          kv_data_type="float8_e4m3fn")
    with pytest.raises(UnsupportedError, match="16-bit KV cache"):
        cuattn.BatchPrefillWithRaggedKVCacheWrapper().plan(ind, np.array([0, 4], np.int32), 4, 4, 128,
                                                           kv_data_type="float8_e5m2", pos_encoding_mode="ROPE_LLAMA")
    # auto plans fa3 for an fp8 cache wherever it runs the 16-bit case (paged or not), fa2 elsewhere;
    # fp32 K/V: fa2 only
    for kv in ("e4m3", "e5m2"):
        for kw in (dict(paged=True, page_size=16), dict(paged=False)):
            assert prefill.resolve_backend("auto", "f", arch="sm_90a", head_dim=128, dtype="bf16", custom_mask=False,
                                           dtype_kv=kv, **kw) == "fa3"
        for arch, ps, want in (("sm_80", 16, "fa2"), ("sm_90a", 5, "fa3"), ("sm_90a", 1, "fa3")):
            assert prefill.resolve_backend("auto", "f", arch=arch, head_dim=128, dtype="f16", custom_mask=False,
                                           paged=True, page_size=ps, dtype_kv=kv) == want
    assert prefill.resolve_backend("auto", "f", arch="sm_90a", head_dim=128, dtype="f16", custom_mask=False,
                                   paged=False, dtype_kv="f32") == "fa2"


def test_fp8_shipped_prefill_specs_cover_serving_and_stay_few():
    fp8_specs = [s for s in prefill.shipped_specs() if s.dtype_kv]
    have = {(s.head_dim, s.dtype, s.dtype_kv, s.causal, s.paged, s.custom_mask) for s in fp8_specs}
    assert {(128, t, kv, c, True, False) for t in ("f16", "bf16") for kv in ("e4m3", "e5m2") for c in (False, True)} <= have
    assert len(fp8_specs) <= 16
    assert len({s.name for s in prefill.shipped_specs()}) == len(prefill.shipped_specs())
    # spill-free on sm_80 and sm_90a: tests/test_prefill.py::test_shipped_specs_compile_without_spills


def test_fa3_fp8_specs_compile_without_spills():
    """fa3 over fp8 (sm_90a): the shipped paged specs (tests/test_prefill_sm90.py compiles them) and the
    ones compiled on first use: contiguous K/V, a logits transform (the key scale on raw dot products)."""
    shipped = [s for s in prefill_sm90.shipped_specs() if s.dtype_kv]
    assert {(s.dtype, s.causal, s.dtype_kv) for s in shipped if s.paged} == \
        {(t, c, kv) for t in ("f16", "bf16") for c in (False, True) for kv in ("e4m3", "e5m2")}
    assert all(s.smem_bytes <= 232448 for s in shipped)                # sm_90's 227 KiB
    cap = variants.resolve("t", num_qo_heads=8, head_dim=128, logits_soft_cap=30.0).composite
    for spec in (prefill_sm90.make_spec("f16", True, dtype_kv="e4m3"), prefill_sm90.make_spec("bf16", False, dtype_kv="e5m2"),
                 prefill_sm90.make_spec("bf16", True, cap, paged=True, dtype_kv="e4m3"),
                 prefill_sm90.make_spec("f16", False, dtype_kv="f16")):   # q's dtype: the 16-bit spec
        assert spec.dtype_kv in ("", "e4m3", "e5m2")
        res = jit.compile_kernel(spec, "sm_90a").resources["cuattn_prefill_sm90"]
        assert res["spill_stores"] == res["spill_loads"] == res["stack_frame"] == 0, (spec.name, res)


@pytest.mark.parametrize("arch", jit.SHIPPED_ARCHS)
def test_fp8_prefill_specs_not_shipped_compile_without_spills(arch):
    """Compiled on first use (ragged, custom mask, head_dim 256): spill-free too."""
    specs = [prefill.make_spec(d, t, c, m, p, dtype_kv="e5m2" if d == 256 else "e4m3")
             for d, t, c, m, p in ((128, "f16", True, False, False), (128, "bf16", False, True, False),
                                   (256, "f16", True, False, True), (64, "bf16", False, True, True))]
    for spec in specs:
        res = jit.compile_kernel(spec, arch).resources["cuattn_prefill"]
        assert res["spill_stores"] == res["spill_loads"] == 0, (spec.name, arch, res)


# ============================================================================ GPU

# (qo_lens, kv_lens, page_size, hq, hkv, head_dim, kv, q dtype, scales, causal, layout)
PAGED_GPU = [
    ([17, 1, 300], [54, 97, 300], 16, 32, 8, 128, "e4m3", "float16", "tensor", True, "NHD"),
    ([64, 7], [512, 7], 1, 32, 8, 128, "e5m2", "bfloat16", "head", False, "NHD"),
    ([127, 33], [4932, 40], 16, 28, 4, 128, "e4m3", "bfloat16", "one", False, "HND"),
    ([577], [577], 16, 8, 8, 64, "e5m2", "float16", "head", True, "NHD"),
    ([33, 2], [129, 1000], 1, 16, 2, 64, "e4m3", "float16", "head", True, "HND"),
    ([1, 1, 1, 1], [2048, 17, 300, 1], 16, 32, 8, 128, "e4m3", "float16", "head", False, "NHD"),   # decode-like rows
]
RAGGED_GPU = [
    ([37, 200], [97, 200], 32, 8, 128, "e4m3", "float16", "head", True),
    ([100], [1500], 8, 2, 128, "e5m2", "bfloat16", "tensor", False),
    ([16, 3], [4000, 3], 4, 4, 256, "e4m3", "bfloat16", "one", True),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", PAGED_GPU, ids=_ids(PAGED_GPU))
def test_paged_prefill_gpu_fp8_matches_dequantised_oracle(case):
    qo_lens, kv_lens, ps, hq, hkv, d, kv, qdt, sk, causal, layout = case
    c = paged_fp8_case(qo_lens, kv_lens, ps, hq, hkv, d, kv, qdt, sk, layout, seed=len(qo_lens) * 7 + d)
    w = cuattn.BatchPrefillWithPagedKVCacheWrapper(kv_layout=layout, backend="fa2")
    w.plan(_dev(c["qo_indptr"]), _dev(c["indptr"]), _dev(c["indices"]), _dev(c["last"]), hq, hkv, d, ps,
           causal=causal, q_data_type=qdt, kv_data_type=FP8_NAME[kv])
    assert w.backend == "fa2"
    run_paged_fp8_and_check(w, c, hq, d, qdt, causal)


@pytest.mark.gpu
@pytest.mark.parametrize("case", RAGGED_GPU, ids=_ids(RAGGED_GPU))
def test_ragged_prefill_gpu_fp8_matches_dequantised_oracle(case):
    qo_lens, kv_lens, hq, hkv, d, kv, qdt, sk, causal = case
    c = ragged_fp8_case(qo_lens, kv_lens, hq, hkv, d, kv, qdt, sk, seed=d + hq)
    w = cuattn.BatchPrefillWithRaggedKVCacheWrapper(backend="fa2")
    w.plan(c["qo_indptr"], c["kv_indptr"], hq, hkv, d, causal=causal, q_data_type=qdt, kv_data_type=FP8_NAME[kv])
    rows = int(c["qo_indptr"][-1])
    out, lse = _poisoned((rows, hq, d), qdt), _cp().full((rows, hq), np.nan, np.float32)
    w.run(_dev(c["q"]), _dev(c["k"]), _dev(c["v"]), out=out, lse=lse, k_scale=_dev_scale(c["scales"][0]),
          v_scale=_dev_scale(c["scales"][1]))
    ref_o, ref_s = _oracle(c["q"], c["ks"], c["vs"], c["qo_indptr"], causal)
    _check(out, lse, ref_o, ref_s, qdt)


@pytest.mark.gpu
def test_single_prefill_gpu_fp8_and_split_kv():
    # one long request (split-KV pieces merged: the value scale must reach every partial row)
    c = ragged_fp8_case([16], [6000], 8, 2, 128, "e4m3", "float16", "head", seed=11)    # 2 CTAs unsplit
    out, lse = cuattn.single_prefill_with_kv_cache(_dev(c["q"]), _dev(c["k"]), _dev(c["v"]), causal=True,
                                                   k_scale=_dev_scale(c["scales"][0]),
                                                   v_scale=_dev_scale(c["scales"][1]), kv_data_type="float8_e4m3fn",
                                                   return_lse=True, backend="fa2")
    ref_o, ref_s = _oracle(c["q"], c["ks"], c["vs"], c["qo_indptr"], True)
    _check(out, lse, ref_o, ref_s, "float16")


# ---------------------------------------------------------------------------- fa3 (sm_90)

sm90 = pytest.mark.skipif(gpu_cc() != 90, reason="the fa3 kernel needs an sm_90 GPU")

# (qo_lens, kv_lens, page_size, hq, hkv, kv, q dtype, scales, causal, layout[, head_dim: 128]). Free slots
# and pages hold NaN bits (paged_fp8_case): rows past a request's end must be masked / zeroed. The gather
# converts fp8 rows of any page size (1, 5 and 3 below: pages no TMA box fits).
FA3_PAGED_GPU = [
    ([17, 1, 300], [54, 97, 300], 16, 32, 8, "e4m3", "float16", "tensor", True, "NHD"),
    ([127, 33], [4932, 40], 16, 28, 4, "e5m2", "bfloat16", "one", False, "HND"),
    ([1, 1, 1, 1], [2048, 17, 300, 1], 16, 32, 8, "e4m3", "bfloat16", "head", False, "NHD"),  # decode-like rows
    ([577, 64], [577, 1000], 64, 8, 8, "e5m2", "float16", "head", True, "NHD"),
    ([64, 7], [512, 7], 1, 32, 8, "e5m2", "bfloat16", "head", False, "NHD"),
    ([130, 5], [700, 260], 5, 16, 4, "e4m3", "float16", "tensor", True, "HND"),
    ([33, 2], [129, 1000], 3, 16, 2, "e4m3", "bfloat16", "head", True, "NHD", 64),
]
FA3_RAGGED_GPU = [   # (qo_lens, kv_lens, hq, hkv, kv, q dtype, scales, causal)
    ([37, 200], [97, 200], 32, 8, "e4m3", "float16", "head", True),
    ([100], [1500], 8, 2, "e5m2", "bfloat16", "tensor", False),
    ([16, 3], [4000, 3], 4, 4, "e4m3", "bfloat16", "one", True),
]


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("case", FA3_PAGED_GPU, ids=_ids(FA3_PAGED_GPU))
def test_paged_prefill_gpu_fp8_fa3_matches_dequantised_oracle(case):
    qo_lens, kv_lens, ps, hq, hkv, kv, qdt, sk, causal, layout, *dim = case
    d = dim[0] if dim else 128
    c = paged_fp8_case(qo_lens, kv_lens, ps, hq, hkv, d, kv, qdt, sk, layout, seed=len(qo_lens) * 5 + ps)
    w = cuattn.BatchPrefillWithPagedKVCacheWrapper(kv_layout=layout)      # auto
    w.plan(_dev(c["qo_indptr"]), _dev(c["indptr"]), _dev(c["indices"]), _dev(c["last"]), hq, hkv, d, ps,
           causal=causal, q_data_type=qdt, kv_data_type=FP8_NAME[kv])
    spec = w._plan["run_spec"]      # the fp8 gather, or the rows converted ahead of the contiguous kernel (prefill_ahead)
    assert w.backend == "fa3" and ((spec.dtype_kv == kv and spec.gather) or
                                   (w._plan.kv_ahead and not spec.paged and not spec.dtype_kv))
    run_paged_fp8_and_check(w, c, hq, d, qdt, causal)
    assert w.backend == "fa3"


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("case", FA3_RAGGED_GPU, ids=_ids(FA3_RAGGED_GPU))
def test_ragged_prefill_gpu_fp8_fa3_matches_dequantised_oracle(case):
    qo_lens, kv_lens, hq, hkv, kv, qdt, sk, causal = case
    c = ragged_fp8_case(qo_lens, kv_lens, hq, hkv, 128, kv, qdt, sk, seed=hq + 3)
    w = cuattn.BatchPrefillWithRaggedKVCacheWrapper()                     # auto
    w.plan(_dev(c["qo_indptr"]), _dev(c["kv_indptr"]), hq, hkv, 128, causal=causal, q_data_type=qdt,
           kv_data_type=FP8_NAME[kv])
    assert w.backend == "fa3"
    rows = int(c["qo_indptr"][-1])
    out, lse = _poisoned((rows, hq, 128), qdt), _cp().full((rows, hq), np.nan, np.float32)
    w.run(_dev(c["q"]), _dev(c["k"]), _dev(c["v"]), out=out, lse=lse, k_scale=_dev_scale(c["scales"][0]),
          v_scale=_dev_scale(c["scales"][1]))
    ref_o, ref_s = _oracle(c["q"], c["ks"], c["vs"], c["qo_indptr"], causal)
    _check(out, lse, ref_o, ref_s, qdt)


@pytest.mark.gpu
@sm90
def test_paged_prefill_gpu_fp8_fa3_split_kv_and_single():
    # pieces of 512 keys merged: the value scale (per head, device array) must reach every partial row
    c = paged_fp8_case([40, 300], [3000, 2100], 16, 16, 4, 128, "e5m2", "float16", "head", seed=17)
    w = cuattn.BatchPrefillWithPagedKVCacheWrapper()
    w.plan(_dev(c["qo_indptr"]), _dev(c["indptr"]), _dev(c["indices"]), _dev(c["last"]), 16, 4, 128, 16,
           causal=True, kv_data_type="float8_e5m2", fixed_split_size=512)
    assert w.backend == "fa3" and w._plan["work_list"].split
    rows = int(c["qo_indptr"][-1])
    out, lse = _poisoned((rows, 16, 128), "float16"), _cp().full((rows, 16), np.nan, np.float32)
    w.run(_dev(c["q"]), (_dev(c["k"]), _dev(c["v"])), out=out, lse=lse, k_scale=_dev_scale(c["scales"][0]),
          v_scale=_dev_scale(c["scales"][1]))
    ref_o, ref_s = _oracle(c["q"], c["ks"], c["vs"], c["qo_indptr"], True)
    _check(out, lse, ref_o, ref_s, "float16")
    # single request, fp8 read from uint8 with kv_data_type, scalar scales
    r = ragged_fp8_case([16], [6000], 8, 2, 128, "e4m3", "bfloat16", "tensor", seed=11)
    o1, s1 = cuattn.single_prefill_with_kv_cache(_dev(r["q"]), _dev(r["k"]), _dev(r["v"]), causal=True,
                                                 k_scale=r["scales"][0], v_scale=r["scales"][1],
                                                 kv_data_type="float8_e4m3fn", return_lse=True, backend="fa3")
    ref_o, ref_s = _oracle(r["q"], r["ks"], r["vs"], r["qo_indptr"], True)
    _check(o1, s1, ref_o, ref_s, "bfloat16")


@pytest.mark.gpu
@sm90
def test_prefill_gpu_fp8_fa3_soft_cap_scales_raw_logits():
    """A logits transform sees the real q.k: the key scale multiplies the dot products before it."""
    c = ragged_fp8_case([40], [300], 8, 2, 128, "e4m3", "float16", "head", seed=5)
    w = cuattn.BatchPrefillWithRaggedKVCacheWrapper()
    w.plan(c["qo_indptr"], c["kv_indptr"], 8, 2, 128, causal=True, kv_data_type="float8_e4m3fn",
           logits_soft_cap=2.0)
    out = _poisoned((40, 8, 128), "float16")
    w.run(_dev(c["q"]), _dev(c["k"]), _dev(c["v"]), out=out, k_scale=_dev_scale(c["scales"][0]),
          v_scale=_dev_scale(c["scales"][1]))
    assert w.backend == "fa3"
    ref, _ = variant_attention(c["q"], c["ks"][0], c["vs"][0], causal=True, soft_cap=2.0)
    o = _cp().asnumpy(out)
    assert np.all(np.isfinite(o)) and rel_err(o, ref) < TOL


@pytest.mark.gpu
@pytest.mark.parametrize("backend,seed", [pytest.param("fa3", 13, marks=sm90), ("fa2", 12)], ids=["fa3", "fa2"])
def test_prefill_gpu_scales_with_16_bit_kv(backend, seed):
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal(s).astype(np.float16) for s in ((77, 8, 128), (300, 2, 128), (300, 2, 128)))
    vs = np.array([2.0, 0.5], np.float32)
    out = cuattn.single_prefill_with_kv_cache(_dev(q), _dev(k), _dev(v), causal=True, backend=backend, k_scale=0.3,
                                              v_scale=_cp().asarray(vs))
    ref, _ = dense_attention(q, k.astype(np.float64) * 0.3, v.astype(np.float64) * vs[None, :, None], causal=True)
    assert rel_err(_cp().asnumpy(out), ref) < 5e-3

