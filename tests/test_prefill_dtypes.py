"""Prefill beyond 16-bit K/V of q's dtype (issues 22 and 21): fp8 e4m3 / e5m2 KV caches with
k_scale / v_scale (floats, 1-element or per-kv-head arrays) in single / ragged / paged prefill on fa2 and
(sm_90) fa3, and head_dim_qk != head_dim_vo. The oracle is tests/oracle.py's float64 attention over the real K/V (fp8
values times their scales: exact once dequantised)."""
import ml_dtypes
import numpy as np
import pytest

import cuattn
from cuattn import jit, prefill, prefill_sm90, variants
from cuattn.errors import UnsupportedError
from tests.conftest import gpu_cc
from tests.oracle import dense_attention, rel_err, variant_attention

BF16 = np.dtype(ml_dtypes.bfloat16)
FP8 = {"e4m3": np.dtype(ml_dtypes.float8_e4m3fn), "e5m2": np.dtype(ml_dtypes.float8_e5m2)}
FP8_NAME = {"e4m3": "float8_e4m3fn", "e5m2": "float8_e5m2"}
QDT = {"float16": np.dtype(np.float16), "bfloat16": BF16}
TOL = 1e-2          # ||out - ref|| / ||ref||: K/V exact once dequantised; q (as f16), P and out round
LSE_TOL = 1e-3


def _scales(rng, kind, hkv):
    """(k_scale, v_scale) as passed (host values; the GPU tests move arrays to the device) and their
    per-head float64 factors."""
    if kind == "tensor":
        return (0.37, 1.9), (np.full(hkv, 0.37), np.full(hkv, 1.9))
    if kind == "one":
        return (np.array([0.61], np.float32), np.array([0.23], np.float32)), (np.full(hkv, 0.61, np.float32),
                                                                              np.full(hkv, 0.23, np.float32))
    ks, vs = rng.uniform(0.1, 2.0, hkv).astype(np.float32), rng.uniform(0.1, 2.0, hkv).astype(np.float32)
    return (ks, vs), (ks, vs)


def _q(rng, rows, hq, d, q_dtype):
    return rng.standard_normal((rows, hq, d)).astype(QDT[q_dtype])


def _fp8(rng, shape, kv):
    return (rng.standard_normal(shape) * 3).astype(FP8[kv])


def _real(x, factors, head_axis=1):
    shape = [1] * x.ndim
    shape[head_axis] = -1
    return x.astype(np.float64) * np.asarray(factors, np.float64).reshape(shape)


def _oracle(q, ks, vs, qo_indptr, causal):
    outs, lses = [], []
    for b in range(len(ks)):
        o, s = dense_attention(q[qo_indptr[b]:qo_indptr[b + 1]], ks[b], vs[b], causal=causal)
        outs.append(o)
        lses.append(s)
    return np.concatenate(outs), np.concatenate(lses)


def paged_fp8_case(qo_lens, kv_lens, page_size, hq, hkv, d, kv, q_dtype, scale_kind, layout="NHD", seed=0):
    """q, a random-order fp8 (k, v) page pair (free slots and pages hold NaN bits), the page table,
    the scales as passed and the float64 oracle's out / lse."""
    rng = np.random.default_rng(seed)
    npages = [-(-n // page_size) for n in kv_lens]
    total = sum(npages) + 2
    perm = rng.permutation(total).astype(np.int32)[:sum(npages)]
    indptr = np.concatenate([[0], np.cumsum(npages)]).astype(np.int32)
    last = np.array([n - (p - 1) * page_size if p else 0 for n, p in zip(kv_lens, npages)], np.int32)
    k = np.full((total, page_size, hkv, d), 0x7F, np.uint8).view(FP8[kv])     # NaN bits in both formats
    v = k.copy()
    for b, n in enumerate(kv_lens):   # the owned slots: real values
        flat_k, flat_v = _fp8(rng, (n, hkv, d), kv), _fp8(rng, (n, hkv, d), kv)
        for i, p in enumerate(perm[indptr[b]:indptr[b + 1]]):
            m = min(page_size, n - i * page_size)
            k[p, :m], v[p, :m] = flat_k[i * page_size:i * page_size + m], flat_v[i * page_size:i * page_size + m]
    passed, factors = _scales(rng, scale_kind, hkv)
    qo_indptr = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
    q = _q(rng, int(qo_indptr[-1]), hq, d, q_dtype)
    ks = [_real(k[perm[indptr[b]:indptr[b + 1]]].reshape(-1, hkv, d)[:n], factors[0]) for b, n in enumerate(kv_lens)]
    vs = [_real(v[perm[indptr[b]:indptr[b + 1]]].reshape(-1, hkv, d)[:n], factors[1]) for b, n in enumerate(kv_lens)]
    if layout == "HND":
        k, v = k.transpose(0, 2, 1, 3).copy(), v.transpose(0, 2, 1, 3).copy()
    return dict(q=q, k=k, v=v, qo_indptr=qo_indptr, indptr=indptr, indices=perm, last=last, scales=passed, ks=ks,
                vs=vs)


def ragged_fp8_case(qo_lens, kv_lens, hq, hkv, d, kv, q_dtype, scale_kind, seed=0):
    rng = np.random.default_rng(seed)
    qo_indptr = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
    kv_indptr = np.concatenate([[0], np.cumsum(kv_lens)]).astype(np.int32)
    k, v = _fp8(rng, (int(kv_indptr[-1]), hkv, d), kv), _fp8(rng, (int(kv_indptr[-1]), hkv, d), kv)
    passed, factors = _scales(rng, scale_kind, hkv)
    q = _q(rng, int(qo_indptr[-1]), hq, d, q_dtype)
    ks = [_real(k[kv_indptr[b]:kv_indptr[b + 1]], factors[0]) for b in range(len(kv_lens))]
    vs = [_real(v[kv_indptr[b]:kv_indptr[b + 1]], factors[1]) for b in range(len(kv_lens))]
    return dict(q=q, k=k, v=v, qo_indptr=qo_indptr, kv_indptr=kv_indptr, scales=passed, ks=ks, vs=vs)


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


def _cp():
    import cupy
    return cupy


def _dev(x):
    cp = _cp()
    if x.dtype == BF16:
        return cp.asarray(x.view(np.uint16))
    if x.dtype in FP8.values():
        return cp.asarray(x.view(np.uint8))
    return cp.asarray(x)


def _dev_scale(s):
    return s if isinstance(s, float) else _cp().asarray(s)


def _poisoned(shape, q_dtype):
    cp = _cp()
    return cp.full(shape, 0x7FC0, np.uint16) if q_dtype == "bfloat16" else cp.full(shape, np.nan, np.float16)


def _check(out, lse, ref_o, ref_s, q_dtype):
    o = _cp().asnumpy(out)
    o = o.view(BF16) if q_dtype == "bfloat16" else o
    assert np.all(np.isfinite(o.astype(np.float32))), "unwritten or non-finite output"
    assert rel_err(o, ref_o) < TOL
    # every element: within TOL of the reference's largest magnitude
    assert np.max(np.abs(o.astype(np.float64) - ref_o)) < TOL * 4 * np.max(np.abs(ref_o)) + 1e-6
    assert rel_err(_cp().asnumpy(lse), ref_s) < LSE_TOL


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


def _ids(cases):
    return ["-".join(str(x).replace(" ", "") for x in c) for c in cases]


@pytest.mark.gpu
@pytest.mark.parametrize("case", PAGED_GPU, ids=_ids(PAGED_GPU))
def test_paged_prefill_gpu_fp8_matches_dequantised_oracle(case):
    qo_lens, kv_lens, ps, hq, hkv, d, kv, qdt, sk, causal, layout = case
    c = paged_fp8_case(qo_lens, kv_lens, ps, hq, hkv, d, kv, qdt, sk, layout, seed=len(qo_lens) * 7 + d)
    w = cuattn.BatchPrefillWithPagedKVCacheWrapper(kv_layout=layout, backend="fa2")
    w.plan(_dev(c["qo_indptr"]), _dev(c["indptr"]), _dev(c["indices"]), _dev(c["last"]), hq, hkv, d, ps,
           causal=causal, q_data_type=qdt, kv_data_type=FP8_NAME[kv])
    assert w.backend == "fa2"
    rows = int(c["qo_indptr"][-1])
    out, lse = _poisoned((rows, hq, d), qdt), _cp().full((rows, hq), np.nan, np.float32)
    w.run(_dev(c["q"]), (_dev(c["k"]), _dev(c["v"])), out=out, lse=lse, k_scale=_dev_scale(c["scales"][0]),
          v_scale=_dev_scale(c["scales"][1]))
    ref_o, ref_s = _oracle(c["q"], c["ks"], c["vs"], c["qo_indptr"], causal)
    _check(out, lse, ref_o, ref_s, qdt)


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
    assert w.backend == "fa3" and w._plan["run_spec"].dtype_kv == kv and w._plan["run_spec"].gather
    rows = int(c["qo_indptr"][-1])
    out, lse = _poisoned((rows, hq, d), qdt), _cp().full((rows, hq), np.nan, np.float32)
    w.run(_dev(c["q"]), (_dev(c["k"]), _dev(c["v"])), out=out, lse=lse, k_scale=_dev_scale(c["scales"][0]),
          v_scale=_dev_scale(c["scales"][1]))
    assert w.backend == "fa3"
    ref_o, ref_s = _oracle(c["q"], c["ks"], c["vs"], c["qo_indptr"], causal)
    _check(out, lse, ref_o, ref_s, qdt)


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
@sm90
def test_prefill_gpu_scales_with_16_bit_kv_on_fa3():
    rng = np.random.default_rng(13)
    q, k, v = (rng.standard_normal(s).astype(np.float16) for s in ((77, 8, 128), (300, 2, 128), (300, 2, 128)))
    vs = np.array([2.0, 0.5], np.float32)
    out = cuattn.single_prefill_with_kv_cache(_dev(q), _dev(k), _dev(v), causal=True, backend="fa3", k_scale=0.3,
                                              v_scale=_cp().asarray(vs))
    ref, _ = dense_attention(q, k.astype(np.float64) * 0.3, v.astype(np.float64) * vs[None, :, None], causal=True)
    assert rel_err(_cp().asnumpy(out), ref) < 5e-3


# ============================================================================ head_dim_qk != head_dim_vo


def split_case(qo_lens, kv_lens, hq, hkv, q_dtype, seed=0, dqk=192, dvo=128):
    rng = np.random.default_rng(seed)
    qo_indptr = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
    kv_indptr = np.concatenate([[0], np.cumsum(kv_lens)]).astype(np.int32)
    dt = QDT[q_dtype]
    q = rng.standard_normal((int(qo_indptr[-1]), hq, dqk)).astype(dt)
    k = rng.standard_normal((int(kv_indptr[-1]), hkv, dqk)).astype(dt)
    v = rng.standard_normal((int(kv_indptr[-1]), hkv, dvo)).astype(dt)
    ks = [k[kv_indptr[b]:kv_indptr[b + 1]] for b in range(len(kv_lens))]
    vs = [v[kv_indptr[b]:kv_indptr[b + 1]] for b in range(len(kv_lens))]
    return q, k, v, qo_indptr, kv_indptr, ks, vs


def to_pages(x, kv_indptr, page_size, perm_seed=0, layout="NHD"):
    """A contiguous [nnz, heads, d] K or V as a random-order page array (pages past the requests hold
    NaN) and its page table."""
    lens = np.diff(kv_indptr)
    npages = [-(-int(n) // page_size) for n in lens]
    total = sum(npages) + 2
    perm = np.random.default_rng(perm_seed).permutation(total).astype(np.int32)[:sum(npages)]
    indptr = np.concatenate([[0], np.cumsum(npages)]).astype(np.int32)
    last = np.array([int(n) - (p - 1) * page_size for n, p in zip(lens, npages)], np.int32)
    pages = np.full((total, page_size) + x.shape[1:], np.nan, np.float32).astype(x.dtype)
    for b, n in enumerate(lens):
        for i, p in enumerate(perm[indptr[b]:indptr[b + 1]]):
            m = min(page_size, int(n) - i * page_size)
            pages[p, :m] = x[kv_indptr[b] + i * page_size:kv_indptr[b] + i * page_size + m]
    if layout == "HND":
        pages = pages.transpose(0, 2, 1, 3).copy()
    return pages, indptr, perm, last


def test_split_head_dims_numpy_single_ragged_paged_match_oracle():
    q, k, v, qo_indptr, kv_indptr, ks, vs = split_case([5, 17], [21, 40], 8, 2, "float16", seed=4)
    ref_o, ref_s = _oracle(q, ks, vs, qo_indptr, True)
    w = cuattn.BatchPrefillWithRaggedKVCacheWrapper()
    w.plan(qo_indptr, kv_indptr, 8, 2, 192, 128, causal=True)
    out, lse = w.run(q, k, v, return_lse=True)
    assert out.shape == (22, 8, 128) and rel_err(out, ref_o) < 2e-3 and rel_err(lse, ref_s) < 1e-5
    kp, indptr, indices, last = to_pages(k, kv_indptr, 16)
    vp, _, _, _ = to_pages(v, kv_indptr, 16)
    wp = cuattn.BatchPrefillWithPagedKVCacheWrapper()
    wp.plan(qo_indptr, indptr, indices, last, 8, 2, 192, 16, head_dim_vo=128, causal=True)
    np.testing.assert_array_equal(wp.run(q, (kp, vp)), out)
    o1 = cuattn.single_prefill_with_kv_cache(q[:5], ks[0], vs[0], causal=True)
    r1, _ = dense_attention(q[:5], ks[0], vs[0], causal=True)
    assert o1.shape == (5, 8, 128) and rel_err(o1, r1) < 2e-3


def test_split_head_dims_refusals_name_the_argument():
    qo, kv = np.array([0, 4], np.int32), np.array([0, 9], np.int32)
    w = cuattn.BatchPrefillWithRaggedKVCacheWrapper()
    with pytest.raises(UnsupportedError, match="head_dim=192 has no kernel; supported: 64, 128, 256"):
        w.plan(qo, kv, 4, 4, 192, 192)
    for dqk, dvo in ((128, 64), (192, 64), (256, 128)):
        with pytest.raises(UnsupportedError, match=f"head_dim_qk={dqk} with head_dim_vo={dvo} has no kernel; "
                                                   "supported: equal head dims 64, 128, 256, or \\(qk, vo\\) 192/128"):
            w.plan(qo, kv, 4, 4, dqk, dvo)
    with pytest.raises(TypeError, match="head_dim_vo must be an int"):
        w.plan(qo, kv, 4, 4, 192, 128.0)
    with pytest.raises(UnsupportedError, match="need head_dim_vo == head_dim_qk"):
        w.plan(qo, kv, 4, 4, 192, 128, pos_encoding_mode="ROPE_LLAMA", rotary_dim=64)
    # fa3 has a 192 / 128 kernel (tests/test_prefill_sm90.py), custom masks included, but no fp8 one
    cuattn.BatchPrefillWithRaggedKVCacheWrapper(backend="fa3").plan(qo, kv, 4, 4, 192, 128)
    cuattn.BatchPrefillWithRaggedKVCacheWrapper(backend="fa3").plan(qo, kv, 4, 4, 192, 128, custom_mask=np.ones(36, bool))
    with pytest.raises(UnsupportedError, match="backend='fa3': fa3 reads an fp8 KV cache at head_dim 64 and 128 only"):
        cuattn.BatchPrefillWithRaggedKVCacheWrapper(backend="fa3").plan(qo, kv, 4, 4, 192, 128,
                                                                        kv_data_type="float8_e4m3fn")
    w.plan(qo, kv, 4, 4, 192, 128)
    x = np.zeros((9, 4, 192), np.float16)
    with pytest.raises(ValueError, match="v must have the shape of k .* with head_dim_vo=128"):
        w.run(np.zeros((4, 4, 192), np.float16), x, x)
    wp = cuattn.BatchPrefillWithPagedKVCacheWrapper()
    wp.plan(qo, np.array([0, 1], np.int32), np.array([0], np.int32), np.array([9], np.int32), 4, 4, 192, 16,
            head_dim_vo=128)
    with pytest.raises(ValueError, match=r"paged_kv_cache must be a \(k_cache, v_cache\) pair"):
        wp.run(np.zeros((4, 4, 192), np.float16), np.zeros((1, 2, 16, 4, 192), np.float16))
    with pytest.raises(ValueError, match="v_cache must have page_size=16, num_kv_heads=4, head_dim=128"):
        wp.run(np.zeros((4, 4, 192), np.float16), (np.zeros((1, 16, 4, 192), np.float16),
                                                   np.zeros((1, 16, 4, 192), np.float16)))


@pytest.mark.parametrize("arch", jit.SHIPPED_ARCHS)
def test_split_head_dim_specs_compile_without_spills(arch):
    for t, c, m, p, kv in (("f16", False, False, False, ""), ("bf16", True, False, True, ""),
                           ("f16", True, True, True, ""), ("bf16", False, False, True, "e4m3")):
        spec = prefill.make_spec(192, t, c, m, p, dtype_kv=kv, head_dim_vo=128)
        res = jit.compile_kernel(spec, arch).resources["cuattn_prefill"]
        assert res["spill_stores"] == res["spill_loads"] == 0, (spec.name, arch, res)


SPLIT_GPU = [   # (qo_lens, kv_lens, hq, hkv, q dtype, causal, kind, page_size, layout)
    ([37, 200], [97, 200], 32, 8, "float16", True, "ragged", 0, "NHD"),
    ([64, 1], [1000, 33], 16, 2, "bfloat16", False, "paged", 16, "NHD"),
    ([127], [600], 8, 8, "float16", True, "paged", 1, "HND"),
    ([300], [300], 16, 4, "bfloat16", True, "single", 0, "NHD"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", SPLIT_GPU, ids=_ids(SPLIT_GPU))
def test_split_head_dims_gpu_match_oracle(case):
    qo_lens, kv_lens, hq, hkv, qdt, causal, kind, ps, layout = case
    q, k, v, qo_indptr, kv_indptr, ks, vs = split_case(qo_lens, kv_lens, hq, hkv, qdt, seed=hq + len(kind))
    rows = int(qo_indptr[-1])
    out, lse = _poisoned((rows, hq, 128), qdt), _cp().full((rows, hq), np.nan, np.float32)
    if kind == "single":
        out, lse = cuattn.single_prefill_with_kv_cache(_dev(q), _dev(k), _dev(v), causal=causal, return_lse=True)
    elif kind == "ragged":
        w = cuattn.BatchPrefillWithRaggedKVCacheWrapper()
        w.plan(qo_indptr, kv_indptr, hq, hkv, 192, 128, causal=causal, q_data_type=qdt)
        w.run(_dev(q), _dev(k), _dev(v), out=out, lse=lse)
    else:
        kp, indptr, indices, last = to_pages(k, kv_indptr, ps, layout=layout)
        vp, _, _, _ = to_pages(v, kv_indptr, ps, layout=layout)
        w = cuattn.BatchPrefillWithPagedKVCacheWrapper(kv_layout=layout)
        w.plan(_dev(qo_indptr), _dev(indptr), _dev(indices), _dev(last), hq, hkv, 192, ps, head_dim_vo=128,
               causal=causal, q_data_type=qdt)
        w.run(_dev(q), (_dev(kp), _dev(vp)), out=out, lse=lse)
    ref_o, ref_s = _oracle(q, ks, vs, qo_indptr, causal)
    _check(out, lse, ref_o, ref_s, qdt)


@pytest.mark.gpu
def test_prefill_gpu_scales_with_16_bit_kv_on_fa2():
    rng = np.random.default_rng(12)
    q, k, v = (rng.standard_normal(s).astype(np.float16) for s in ((77, 8, 128), (300, 2, 128), (300, 2, 128)))
    vs = np.array([2.0, 0.5], np.float32)
    out = cuattn.single_prefill_with_kv_cache(_dev(q), _dev(k), _dev(v), causal=True, backend="fa2", k_scale=0.3,
                                              v_scale=_cp().asarray(vs))
    ref, _ = dense_attention(q, k.astype(np.float64) * 0.3, v.astype(np.float64) * vs[None, :, None], causal=True)
    assert rel_err(_cp().asnumpy(out), ref) < 5e-3


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
