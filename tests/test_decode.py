import zlib

import ml_dtypes
import numpy as np
import pytest

import cuattn
from cuattn import decode, jit
from cuattn.errors import UnsupportedError
from tests.conftest import requires_sm
from tests.late_writer import late_copy
from tests.oracle import dense_attention, rel_err

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = {"float16": np.dtype(np.float16), "bfloat16": BF16}
TOL = 1e-2          # ||out - ref|| / ||ref|| (fp16 lands near 1e-3, bf16 near 4e-3)
LSE_TOL = 1e-3


# ---------------------------------------------------------------------------- helpers


def make_case(batch, kv_len, page_size, num_qo_heads, num_kv_heads, head_dim, layout, dtype, seed=0,
              kv_lens=None, extra_pages=3):
    """Random q, paged cache (random page order), page table and per-request contiguous K/V."""
    rng = np.random.default_rng(seed)
    dt = DTYPES[dtype]
    lens = list(kv_lens) if kv_lens is not None else [kv_len] * batch
    pages = [-(-n // page_size) for n in lens]
    num_pages = sum(pages) + extra_pages
    perm = rng.permutation(num_pages).astype(np.int32)
    indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
    indices = perm[:indptr[-1]]
    lpl = np.array([n - (p - 1) * page_size if p else 0 for n, p in zip(lens, pages)], np.int32)
    k_nhd = rng.standard_normal((num_pages, page_size, num_kv_heads, head_dim)).astype(dt)
    v_nhd = rng.standard_normal((num_pages, page_size, num_kv_heads, head_dim)).astype(dt)
    q = rng.standard_normal((len(lens), num_qo_heads, head_dim)).astype(dt)
    if layout == "HND":
        k_store, v_store = k_nhd.transpose(0, 2, 1, 3).copy(), v_nhd.transpose(0, 2, 1, 3).copy()
    else:
        k_store, v_store = k_nhd, v_nhd
    per_req = []
    for b, n in enumerate(lens):
        idx = indices[indptr[b]:indptr[b + 1]]
        per_req.append((k_nhd[idx].reshape(-1, num_kv_heads, head_dim)[:n],
                        v_nhd[idx].reshape(-1, num_kv_heads, head_dim)[:n]))
    return dict(q=q, k=k_store, v=v_store, indptr=indptr, indices=indices, lpl=lpl, per_req=per_req,
                lens=lens)


def oracle(case, sm_scale=None):
    outs, lses = [], []
    for b, (k, v) in enumerate(case["per_req"]):
        o, s = dense_attention(case["q"][b:b + 1], k, v, sm_scale=sm_scale)
        outs.append(o[0])
        lses.append(s[0])
    return np.stack(outs), np.stack(lses)


def cache_arg(case, form, xp=np.asarray):
    """The cache as one [P, 2, ...] array ("one") or a (k, v) pair ("pair")."""
    if form == "pair":
        return (xp(case["k"]), xp(case["v"]))
    return xp(np.stack([case["k"], case["v"]], axis=1))


def planned(case, num_qo_heads, num_kv_heads, head_dim, page_size, dtype, layout="NHD", **kw):
    w = cuattn.BatchDecodeWithPagedKVCacheWrapper(kv_layout=layout)
    w.plan(case["indptr"], case["indices"], case["lpl"], num_qo_heads, num_kv_heads, head_dim, page_size,
           q_data_type=dtype, **kw)
    return w


# ---------------------------------------------------------------------------- CPU path

CPU_CASES = [  # (batch, kv_len, page_size, qo_heads, kv_heads, head_dim, layout, form, dtype)
    (1, 1, 1, 4, 4, 64, "NHD", "one", "float16"),
    (3, 37, 5, 8, 2, 64, "HND", "pair", "bfloat16"),
    (2, 300, 16, 12, 2, 128, "NHD", "pair", "float16"),
    (4, 97, 64, 7, 1, 64, "HND", "one", "float16"),
]


@pytest.mark.parametrize("case_args", CPU_CASES, ids=[f"b{c[0]}-kv{c[1]}-ps{c[2]}-{c[3]}:{c[4]}-hd{c[5]}-{c[6]}-{c[7]}-{c[8]}"
                                                      for c in CPU_CASES])
def test_batch_decode_numpy_path_matches_float64_oracle(case_args):
    batch, kv_len, ps, hq, hkv, d, layout, form, dtype = case_args
    case = make_case(batch, kv_len, ps, hq, hkv, d, layout, dtype, seed=batch * 7 + kv_len)
    w = planned(case, hq, hkv, d, ps, dtype, layout)
    out, lse = w.run(case["q"], cache_arg(case, form), return_lse=True)
    ref_o, ref_lse = oracle(case)
    assert isinstance(out, np.ndarray) and out.dtype == DTYPES[dtype] and out.shape == (batch, hq, d)
    assert rel_err(out, ref_o) < TOL
    assert rel_err(lse, ref_lse) < LSE_TOL


def test_batch_decode_numpy_path_writes_out_and_lse_in_place():
    case = make_case(2, 40, 16, 4, 2, 64, "NHD", "float16", seed=3)
    w = planned(case, 4, 2, 64, 16, "float16")
    out = np.full((2, 4, 64), np.nan, np.float16)
    lse = np.full((2, 4), np.nan, np.float32)
    res = w.run(case["q"], cache_arg(case, "one"), out=out, lse=lse)
    assert res is out
    ref_o, ref_lse = oracle(case)
    assert rel_err(out, ref_o) < TOL and rel_err(lse, ref_lse) < LSE_TOL


def test_single_decode_numpy_path_matches_float64_oracle():
    rng = np.random.default_rng(5)
    q = rng.standard_normal((8, 64)).astype(np.float16)
    k = rng.standard_normal((2, 50, 64)).astype(np.float16)   # HND
    v = rng.standard_normal((2, 50, 64)).astype(np.float16)
    out, lse = cuattn.single_decode_with_kv_cache(q, k, v, "HND", sm_scale=0.1, return_lse=True)
    ref_o, ref_lse = dense_attention(q[None], k.transpose(1, 0, 2), v.transpose(1, 0, 2), sm_scale=0.1)
    assert rel_err(out, ref_o[0]) < TOL and rel_err(lse, ref_lse[0]) < LSE_TOL


def test_plan_accepts_torch_style_dtypes_and_strings():
    case = make_case(1, 10, 4, 4, 4, 64, "NHD", "bfloat16")
    for dt in ("bf16", "bfloat16", BF16):
        w = planned(case, 4, 4, 64, 4, dt)
        assert w.run(case["q"], cache_arg(case, "one")).dtype == BF16


# ---------------------------------------------------------------------------- errors


@pytest.fixture
def small():
    case = make_case(2, 20, 8, 8, 2, 64, "NHD", "float16", seed=11)
    return case, planned(case, 8, 2, 64, 8, "float16")


def test_plan_rejects_heads_not_a_multiple():
    case = make_case(1, 8, 8, 6, 4, 64, "NHD", "float16")
    with pytest.raises(ValueError, match="num_qo_heads must be a multiple of num_kv_heads"):
        planned(case, 6, 4, 64, 8, "float16")


@pytest.mark.parametrize("field,value,match", [
    ("lpl", [0, 4], "last_page_len must be in 1..page_size"),
    ("lpl", [9, 4], "last_page_len must be in 1..page_size"),
    ("indptr", [0, 3, 2], "non-decreasing"),
    ("indptr", [0, 2, 5], "must equal len\\(indices\\)"),
])
def test_plan_rejects_bad_page_table(small, field, value, match):
    case, _ = small
    case = dict(case, **{field: np.array(value, np.int32)})
    with pytest.raises(ValueError, match=match):
        planned(case, 8, 2, 64, 8, "float16")


def test_run_rejects_page_index_out_of_range(small):
    case, _ = small
    case = dict(case, indices=case["indices"].copy())
    case["indices"][-1] = 1000
    w = planned(case, 8, 2, 64, 8, "float16")
    with pytest.raises(ValueError, match="indices must be in 0.."):
        w.run(case["q"], cache_arg(case, "one"))


def test_run_rejects_q_shape_and_dtype_mismatch(small):
    case, w = small
    with pytest.raises(ValueError, match="q must have shape"):
        w.run(case["q"][:1], cache_arg(case, "one"))
    with pytest.raises(ValueError, match="q must have dtype"):
        w.run(case["q"].astype(BF16), cache_arg(case, "one"))


def test_run_rejects_cache_dtype_and_shape_mismatch(small):
    case, w = small
    with pytest.raises(ValueError, match="paged_kv_cache must have dtype"):
        w.run(case["q"], (case["k"].astype(BF16), case["v"].astype(BF16)))
    with pytest.raises(ValueError, match="paged_kv_cache must have page_size"):
        w.run(case["q"], (case["k"][:, :4], case["v"][:, :4]))
    with pytest.raises(ValueError, match="same shape and dtype|one shape and dtype"):
        w.run(case["q"], (case["k"], case["v"].astype(BF16)))


def test_run_before_plan_is_an_error():
    with pytest.raises(ValueError, match="plan\\(\\) must be called"):
        cuattn.BatchDecodeWithPagedKVCacheWrapper().run(np.zeros((1, 1, 64), np.float16), None)


def test_unsupported_features_raise_unsupported_error(small):
    case, _ = small
    with pytest.raises(UnsupportedError, match="rotary_dim=48 has no fused-RoPE kernel"):
        planned(case, 8, 2, 64, 8, "float16", pos_encoding_mode="ROPE_LLAMA", rotary_dim=48)
    with pytest.raises(TypeError, match="unexpected keyword argument 'rope_offset'"):
        planned(case, 8, 2, 64, 8, "float16").run(case["q"], cache_arg(case, "one"), rope_offset=3)


def test_unknown_tuning_override_is_rejected():
    """_tuning (benchmark/test overrides) takes num_stages / num_warps / fuse_merge only; the
    removed experiments (prefetch, idx_smem, lazy_rescale) are not silently ignored."""
    case = make_case(1, 10, 4, 4, 4, 64, "NHD", "float16")
    w = cuattn.BatchDecodeWithPagedKVCacheWrapper(kv_layout="NHD")
    w._tuning = {"lazy_rescale": 1}
    with pytest.raises(KeyError, match="lazy_rescale"):
        w.plan(case["indptr"], case["indices"], case["lpl"], 4, 4, 64, 4, q_data_type="float16")


def test_bad_kv_layout_is_rejected():
    with pytest.raises(ValueError, match="kv_layout must be"):
        cuattn.BatchDecodeWithPagedKVCacheWrapper(kv_layout="NDH")


# ---------------------------------------------------------------------------- compilation


@pytest.mark.parametrize("arch", jit.SHIPPED_ARCHS)
def test_shipped_decode_kernels_compile_without_spills(arch):
    specs = [s for s in decode.shipped_specs() if s.archs is None or arch in s.archs]
    assert any(s.tma for s in specs) == (arch == "sm_90a")
    for spec in specs:
        res = jit.compile_kernel(spec, arch).resources
        for entry in (decode._ENTRY, decode._MERGE_ENTRY):
            r = res[entry]
            assert r["spill_stores"] == 0 and r["spill_loads"] == 0 and r["stack_frame"] == 0, (spec.name, entry, r)
            assert r["registers"] <= 255
        # 2 CTAs of 128 threads per SM for head_dim <= 128 need <= 255 regs; check the smem budget
        assert spec.smem_bytes <= 227 * 1024


# ---------------------------------------------------------------------------- GPU

# (batch, kv_len, page_size, qo_heads, kv_heads, head_dim, layout, form, dtype): a sample of the
# cross product in which every value of every axis appears.
GPU_SMOKE = [
    (1, 1, 1, 4, 4, 128, "NHD", "one", "float16"),
    (7, 15, 5, 32, 8, 128, "HND", "pair", "bfloat16"),
    (17, 54, 16, 20, 4, 64, "NHD", "pair", "float16"),
    (1, 97, 64, 16, 2, 256, "HND", "one", "float16"),
    (16, 512, 16, 32, 8, 128, "NHD", "one", "float16"),
    (7, 2048, 1, 16, 1, 128, "NHD", "pair", "bfloat16"),
    (1, 16384, 16, 32, 8, 128, "NHD", "one", "float16"),
    (1, 2048, 16, 32, 32, 128, "HND", "one", "bfloat16"),
    (17, 97, 5, 8, 1, 256, "NHD", "one", "bfloat16"),
    (1, 512, 64, 40, 8, 64, "HND", "pair", "bfloat16"),
    (3, 777, 16, 64, 2, 128, "NHD", "one", "float16"),     # group 32: two head tiles
    (5, 300, 32, 128, 8, 128, "NHD", "pair", "bfloat16"),  # group 16: one whole head tile
]
GPU_FULL = [(b, n, ps, hq, hkv, d, lay, form, dt)
            for b in (1, 7, 17) for n in (1, 15, 54, 97, 512, 2048, 16384) for ps in (1, 5, 16, 64)
            for hq, hkv in ((8, 8), (32, 8), (20, 4), (64, 8), (16, 1)) for d in (64, 128, 256)
            for lay, form in (("NHD", "one"), ("HND", "pair")) for dt in ("float16", "bfloat16")
            if b * n <= 20000 and zlib.crc32(repr((b, n, ps, hq, d, lay, dt)).encode()) % 23 == 0]


def _ids(cases):
    return [f"b{c[0]}-kv{c[1]}-ps{c[2]}-{c[3]}:{c[4]}-hd{c[5]}-{c[6]}-{c[7]}-{c[8]}" for c in cases]


def to_cupy(x):
    import cupy
    if x.dtype == BF16:
        return cupy.asarray(x.view(np.uint16))
    return cupy.asarray(x)


def from_cupy(x, dtype):
    import cupy
    a = cupy.asnumpy(x)
    return a.view(dtype) if dtype == BF16 else a


def _check_gpu(case_args, **plan_kw):
    import cupy
    batch, kv_len, ps, hq, hkv, d, layout, form, dtype = case_args
    case = make_case(batch, kv_len, ps, hq, hkv, d, layout, dtype, seed=batch * 131 + kv_len + d)
    w = planned(case, hq, hkv, d, ps, dtype, layout, **plan_kw)
    out = cupy.full((batch, hq, d), np.nan, np.float16 if dtype == "float16" else np.float32)
    out = out.astype(np.float16).view(np.uint16) if dtype == "bfloat16" else out
    if dtype == "bfloat16":
        out[...] = 0x7fc0   # bf16 NaN
    lse = cupy.full((batch, hq), np.nan, np.float32)
    res = w.run(to_cupy(case["q"]), cache_arg(case, form, to_cupy), out=out, lse=lse)
    assert res is out
    ref_o, ref_lse = oracle(case)
    o = from_cupy(out, DTYPES[dtype])
    assert rel_err(o, ref_o) < TOL
    assert rel_err(cupy.asnumpy(lse), ref_lse) < LSE_TOL
    return o


@pytest.mark.gpu
@pytest.mark.parametrize("case_args", GPU_SMOKE, ids=_ids(GPU_SMOKE))
def test_batch_decode_gpu_matches_float64_oracle(case_args):
    _check_gpu(case_args)


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("case_args", GPU_FULL, ids=_ids(GPU_FULL))
def test_batch_decode_gpu_full_grid(case_args):
    _check_gpu(case_args)


@pytest.mark.gpu
@pytest.mark.parametrize("case_args", [(3, 3000, 16, 32, 8, 128, "NHD", "one", "float16"),
                                       (2, 999, 5, 8, 8, 64, "HND", "pair", "bfloat16")])
def test_batch_decode_gpu_split_and_unsplit_plans_agree(case_args):
    a = _check_gpu(case_args, disable_split_kv=True)
    b = _check_gpu(case_args, fixed_split_size=200)
    c = _check_gpu(case_args, fixed_split_size=37)
    ref = a.astype(np.float64)
    tol = 2e-3 if case_args[-1] == "float16" else 6e-3     # one output rounding apart (bf16 ulp 2^-8)
    assert rel_err(b, ref) < tol and rel_err(c, ref) < tol


@pytest.mark.gpu
@pytest.mark.parametrize("variant", [dict(fuse_merge=False), dict(num_warps=4), dict(num_warps=8),
                                     dict(num_warps=8, fuse_merge=False)])
def test_batch_decode_gpu_merge_and_warp_variants_agree(variant):
    """Fused merge (last piece merges, counters reset) vs the merge kernel; 4 vs 8 warps per CTA;
    each run several times on one plan (a counter left non-zero would break the 2nd run)."""
    import cupy
    case = make_case(0, 0, 5, 32, 8, 128, "NHD", "float16", kv_lens=[3000, 1, 0, 700, 2049], seed=4)
    ref_o, ref_lse = oracle(case)
    outs = []
    for kw in ({}, variant):
        w = cuattn.BatchDecodeWithPagedKVCacheWrapper(kv_layout="NHD")
        w._tuning = dict(kw)     # test overrides, not API
        w.plan(case["indptr"], case["indices"], case["lpl"], 32, 8, 128, 5, q_data_type="float16",
               fixed_split_size=300)
        assert w._work.split
        for _rep in range(3):
            out, lse = w.run(to_cupy(case["q"]), cache_arg(case, "one", to_cupy), return_lse=True)
            assert rel_err(cupy.asnumpy(out), ref_o) < TOL
            assert rel_err(cupy.asnumpy(lse), ref_lse) < LSE_TOL
        outs.append(cupy.asnumpy(out).astype(np.float64))
    assert rel_err(outs[1], outs[0]) < 2e-3


@pytest.mark.gpu
def test_batch_decode_gpu_short_requests_take_two_stages_where_chosen():
    """A large batch of short requests (<= 512 keys each, >= 3 CTAs per SM of them) runs the 2-stage TMA kernel on an
    sm_90 (3 CTAs per SM): against the oracle, with NaN / inf in every slot no request owns, bf16 and fp16."""
    import cupy
    rng = np.random.default_rng(19)
    for dtype, layout in (("float16", "NHD"), ("bfloat16", "HND")):
        lens = rng.integers(1, 513, 64).tolist()
        case = make_case(0, 0, 16, 32, 8, 128, layout, dtype, kv_lens=lens, seed=len(dtype))
        _poison_past_the_end(case, 16, layout)
        w = planned(case, 32, 8, 128, 16, dtype, layout)
        assert (w._spec.num_stages == 2) == (jit.device_arch(0) == decode._TMA_ARCH), w.describe()
        out, lse = w.run(to_cupy(case["q"]), cache_arg(case, "one", to_cupy), return_lse=True)
        ref_o, ref_lse = oracle(case)
        got = from_cupy(out, DTYPES[dtype])
        assert np.isfinite(got.astype(np.float32)).all()
        assert rel_err(got, ref_o) < TOL
        assert rel_err(cupy.asnumpy(lse), ref_lse) < LSE_TOL


def _poison_past_the_end(case, page_size, layout):
    """NaN / inf in every cache slot no request owns (past last_page_len, and the spare pages):
    the TMA kernel reads whole pages, so it must not let them reach the output."""
    owned = np.zeros((case["k"].shape[0], page_size), bool)
    for b, n in enumerate(case["lens"]):
        for j, page in enumerate(case["indices"][case["indptr"][b]:case["indptr"][b + 1]]):
            owned[page, :min(page_size, n - j * page_size)] = True
    for name, bad in (("k", np.nan), ("v", np.inf)):
        arr = case[name] if layout == "NHD" else case[name].transpose(0, 2, 1, 3)   # view: [P, slot, H, D]
        arr[~owned] = bad


@pytest.mark.gpu
@pytest.mark.parametrize("layout,form,page_size,split,warps", [("NHD", "one", 16, 300, 4), ("HND", "pair", 32, 0, 4),
                                                               ("NHD", "pair", 64, 37, 8), ("HND", "one", 16, 0, 8)])
def test_batch_decode_gpu_tma_and_cp_async_kernels_agree(layout, form, page_size, split, warps):
    """The TMA kernel (sm_90, page_size % 16 == 0) against the oracle and the cp.async kernel, with
    NaN / inf in the slots past each request's end, split (pieces cut to 16-token multiples) or not."""
    import cupy
    if jit.device_arch(0) != decode._TMA_ARCH:
        pytest.skip("the TMA decode kernel is built for sm_90 alone")
    case = make_case(0, 0, page_size, 32, 8, 128, layout, "float16", kv_lens=[3000, 1, 0, 700, 2049, 33, 16], seed=11)
    _poison_past_the_end(case, page_size, layout)
    ref_o, ref_lse = oracle(case)
    outs = []
    for tma in (True, False):
        w = cuattn.BatchDecodeWithPagedKVCacheWrapper(kv_layout=layout)
        w._tuning = dict(tma=tma, num_warps=warps)     # test overrides, not API
        w.plan(case["indptr"], case["indices"], case["lpl"], 32, 8, 128, page_size, q_data_type="float16",
               fixed_split_size=split or None, disable_split_kv=not split)
        assert w._spec.tma == tma and w._work.split == bool(split)
        assert not tma or (w._work.work[:, 2] % 16 == 0).all()
        for _rep in range(2):
            out, lse = w.run(to_cupy(case["q"]), cache_arg(case, form, to_cupy), return_lse=True)
            assert rel_err(cupy.asnumpy(out), ref_o) < TOL
            assert rel_err(cupy.asnumpy(lse), ref_lse) < LSE_TOL
        outs.append(cupy.asnumpy(out).astype(np.float64))
    assert rel_err(outs[0], outs[1]) < 2e-3


@pytest.mark.gpu
def test_batch_decode_gpu_run_memo_follows_the_cache_and_keeps_none_alive():
    """run() memoizes cache descriptions on pointer/shape/strides/dtype: another cache of the same
    shape, or the same cache in (k, v) form, must be read afresh; a dropped cache must be freed."""
    import cupy
    case = make_case(3, 300, 16, 32, 8, 128, "NHD", "float16", seed=21)
    w = planned(case, 32, 8, 128, 16, "float16")
    q = to_cupy(case["q"])
    pool = cupy.get_default_memory_pool()
    for c, form in ((case, "one"), (case, "pair"), (case, "one")):
        cache = cache_arg(c, form, to_cupy)
        out = w.run(q, cache)
        assert rel_err(cupy.asnumpy(out), oracle(c)[0]) < TOL
    # a second cache with other contents at another address: not the memoized one
    k2 = case["k"][::-1].copy()                      # pages reversed: other K/V for the same table
    v2 = case["v"][::-1].copy()
    swapped = dict(case, k=k2, v=v2, per_req=[])
    for b, n in enumerate(case["lens"]):
        idx = case["indices"][case["indptr"][b]:case["indptr"][b + 1]]
        swapped["per_req"].append((k2[idx].reshape(-1, 8, 128)[:n], v2[idx].reshape(-1, 8, 128)[:n]))
    out = w.run(q, cache_arg(swapped, "one", to_cupy))
    assert rel_err(cupy.asnumpy(out), oracle(swapped)[0]) < TOL
    # the memo holds no array: dropping the cache frees its memory
    cache = cache_arg(case, "one", to_cupy)
    w.run(q, cache)
    cupy.cuda.Device().synchronize()
    before = pool.used_bytes()
    del cache, out
    assert pool.used_bytes() <= before - 2 * case["k"].nbytes


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [16, 5])     # TMA (on sm_90) and cp.async kernels
def test_batch_decode_gpu_rejects_misaligned_arrays_and_keeps_working(page_size):
    """q, out and the cache shifted by one element: a clear error naming the argument (the kernels'
    16-byte loads would fault), and the next well-formed run() still works. A good run() comes
    first, so the shifted arrays have layouts run() has already checked (only pointers differ)."""
    import cupy
    case = make_case(2, 40, page_size, 8, 8, 64, "NHD", "float16", seed=5)
    w = planned(case, 8, 8, 64, page_size, "float16")
    q, cache = to_cupy(case["q"]), cache_arg(case, "one", to_cupy)
    assert rel_err(cupy.asnumpy(w.run(q, cache, out=cupy.empty_like(q))), oracle(case)[0]) < TOL

    def shifted(x):     # the same values one element further into a larger buffer
        buf = cupy.empty(x.size + 1, x.dtype)
        view = buf[1:].reshape(x.shape)
        view[...] = x
        return view

    for kw, name in ((dict(q=shifted(q)), "q"), (dict(paged_kv_cache=shifted(cache)), "paged_kv_cache"),
                     (dict(out=shifted(cupy.empty_like(q))), "out")):
        args = dict(q=q, paged_kv_cache=cache) | kw
        with pytest.raises(ValueError, match=f"{name} must start at a"):
            w.run(args.pop("q"), args.pop("paged_kv_cache"), **args)
    out = w.run(q, cache)
    assert rel_err(cupy.asnumpy(out), oracle(case)[0]) < TOL


@pytest.mark.gpu
def test_batch_decode_gpu_checked_layouts_are_forgotten_by_the_next_plan():
    """run() skips re-checking q/out/lse layouts it has checked in this plan; a new plan with
    another q dtype or batch must check them again."""
    import cupy
    case = make_case(2, 40, 16, 8, 8, 64, "NHD", "float16", seed=6)
    w = planned(case, 8, 8, 64, 16, "float16")
    q, cache = to_cupy(case["q"]), cache_arg(case, "one", to_cupy)
    out, lse = cupy.empty_like(q), cupy.empty((2, 8), cupy.float32)
    for _ in range(2):
        w.run(q, cache, out=out, lse=lse)
        assert rel_err(cupy.asnumpy(out), oracle(case)[0]) < TOL
    w.plan(case["indptr"], case["indices"], case["lpl"], 8, 8, 64, 16, q_data_type="bfloat16")
    with pytest.raises(ValueError, match="q must have dtype"):
        w.run(q, cache, out=out)
    with pytest.raises(ValueError, match="out must have dtype"):
        w.run(q.view(cupy.uint16), cache.view(cupy.uint16), out=out)     # bf16 q and cache, fp16 out
    one = make_case(1, 40, 16, 8, 8, 64, "NHD", "float16", seed=6)
    w.plan(one["indptr"], one["indices"], one["lpl"], 8, 8, 64, 16, q_data_type="float16")
    with pytest.raises(ValueError, match=r"q must have shape"):
        w.run(q, cache, out=out)
    with pytest.raises(ValueError, match="lse must be a contiguous float32 array of shape"):
        w.run(q[:1], cache, out=out[:1], lse=lse)


@pytest.mark.gpu
def test_batch_decode_gpu_tma_override_needs_whole_boxes():
    if jit.device_arch(0) != decode._TMA_ARCH:
        pytest.skip("the TMA decode kernel is built for sm_90 alone")
    case = make_case(2, 40, 5, 8, 8, 64, "NHD", "float16")
    w = cuattn.BatchDecodeWithPagedKVCacheWrapper()
    w._tuning = dict(tma=True)
    with pytest.raises(UnsupportedError, match="page_size % 16"):
        w.plan(case["indptr"], case["indices"], case["lpl"], 8, 8, 64, 5, q_data_type="float16")


@pytest.mark.gpu
def test_batch_decode_gpu_skewed_batch_and_empty_request():
    import cupy
    case = make_case(0, 0, 16, 32, 8, 128, "NHD", "float16", kv_lens=[5000, 3, 0, 700, 1], seed=9)
    w = planned(case, 32, 8, 128, 16, "float16")
    out, lse = w.run(to_cupy(case["q"]), cache_arg(case, "one", to_cupy), return_lse=True)
    ref_o, ref_lse = oracle(case)
    assert rel_err(cupy.asnumpy(out), ref_o) < TOL
    assert rel_err(cupy.asnumpy(lse), ref_lse) < LSE_TOL


@pytest.mark.gpu
def test_batch_decode_gpu_plan_reused_across_layers_and_replans():
    for step, lens in enumerate(([100, 2000], [101, 2001, 5])):
        case = make_case(0, 0, 16, 32, 8, 128, "HND", "bfloat16", kv_lens=lens, seed=step)
        if step == 0:
            w = planned(case, 32, 8, 128, 16, "bfloat16", "HND")
        else:
            w.plan(case["indptr"], case["indices"], case["lpl"], 32, 8, 128, 16, q_data_type="bfloat16")
        ref_o, _ = oracle(case)
        for _layer in range(2):
            o = from_cupy(w.run(to_cupy(case["q"]), cache_arg(case, "pair", to_cupy)), BF16)
            assert rel_err(o, ref_o) < TOL


@pytest.mark.gpu
def test_batch_decode_gpu_replan_while_previous_run_is_in_flight():
    # plan() uploads asynchronously on the current stream: a re-plan issued while the previous
    # plan's run() is still executing must neither change that run's answer nor its own
    import cupy
    big = make_case(4, 16384, 16, 32, 8, 128, "NHD", "float16", seed=31)      # ~0.1 ms of kernel
    small = make_case(3, 777, 16, 32, 8, 128, "NHD", "float16", seed=32)
    w = planned(big, 32, 8, 128, 16, "float16")
    q_big, kv_big = to_cupy(big["q"]), cache_arg(big, "one", to_cupy)
    q_small, kv_small = to_cupy(small["q"]), cache_arg(small, "one", to_cupy)
    cupy.cuda.Device().synchronize()
    o_big = w.run(q_big, kv_big)                  # no sync: still running during the next plan
    w.plan(small["indptr"], small["indices"], small["lpl"], 32, 8, 128, 16, q_data_type="float16")
    o_small = w.run(q_small, kv_small)
    w.plan(big["indptr"], big["indices"], big["lpl"], 32, 8, 128, 16, q_data_type="float16")
    o_big2 = w.run(q_big, kv_big)
    ref_big = oracle(big)[0]                      # one float64 oracle of the 4 x 16384 case for both its runs
    for o, ref in ((o_big, ref_big), (o_small, oracle(small)[0]), (o_big2, ref_big)):
        assert rel_err(cupy.asnumpy(o), ref) < TOL


@pytest.mark.gpu
def test_batch_decode_gpu_torch_tensors_and_workspace():
    torch = pytest.importorskip("torch")
    case = make_case(5, 1234, 16, 32, 8, 128, "NHD", "bfloat16", seed=21)
    ws = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
    w = cuattn.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
    indptr = torch.from_numpy(case["indptr"]).cuda()
    indices = torch.from_numpy(case["indices"]).cuda()
    lpl = torch.from_numpy(case["lpl"]).cuda()
    w.plan(indptr, indices, lpl, 32, 8, 128, 16, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
    to_t = lambda x: torch.from_numpy(x.view(np.int16)).view(torch.bfloat16).cuda()  # noqa: E731
    cache = torch.stack([to_t(case["k"]), to_t(case["v"])], dim=1)
    out, lse = w.run(to_t(case["q"]), cache, return_lse=True)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16 and out.is_cuda
    o = out.float().cpu().numpy()
    ref_o, ref_lse = oracle(case)
    assert rel_err(o, ref_o) < TOL and rel_err(lse.cpu().numpy(), ref_lse) < LSE_TOL
    # again with new tensors of the layouts run() has checked (its layout memo): NaN-poisoned
    # outputs written in place, then a misaligned q of the same layout is still refused
    out2 = torch.full_like(out, float("nan"))
    lse2 = torch.full_like(lse, float("nan"))
    assert w.run(to_t(case["q"]), cache, out=out2, lse=lse2) is out2
    assert rel_err(out2.float().cpu().numpy(), ref_o) < TOL and rel_err(lse2.cpu().numpy(), ref_lse) < LSE_TOL
    shifted = torch.empty(out.numel() + 1, dtype=torch.bfloat16, device="cuda")[1:].view(out.shape)
    with pytest.raises(ValueError, match="q must start at a"):
        w.run(shifted, cache, out=out2)


@pytest.mark.gpu
def test_batch_decode_gpu_jax_arrays():
    jax = pytest.importorskip("jax")
    if not any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("jax sees no GPU")
    case = make_case(3, 300, 16, 16, 4, 64, "NHD", "float16", seed=4)
    w = planned(case, 16, 4, 64, 16, "float16")
    out = w.run(jax.numpy.asarray(case["q"]), jax.numpy.asarray(np.stack([case["k"], case["v"]], 1)))
    ref_o, _ = oracle(case)
    assert rel_err(np.asarray(out), ref_o) < TOL


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("kv_len,hq,hkv,d,dtype", [(1, 8, 8, 128, "float16"), (4097, 32, 8, 128, "bfloat16"),
                                                   (333, 20, 4, 256, "float16"), (31000, 8, 1, 64, "float16")])
def test_single_decode_gpu_matches_float64_oracle(layout, kv_len, hq, hkv, d, dtype):
    import cupy
    rng = np.random.default_rng(kv_len)
    dt = DTYPES[dtype]
    q = rng.standard_normal((hq, d)).astype(dt)
    k = rng.standard_normal((kv_len, hkv, d)).astype(dt)
    v = rng.standard_normal((kv_len, hkv, d)).astype(dt)
    kk, vv = (k, v) if layout == "NHD" else (k.transpose(1, 0, 2).copy(), v.transpose(1, 0, 2).copy())
    out, lse = cuattn.single_decode_with_kv_cache(to_cupy(q), to_cupy(kk), to_cupy(vv), layout, return_lse=True)
    ref_o, ref_lse = dense_attention(q[None], k, v)
    assert rel_err(from_cupy(out, dt), ref_o[0]) < TOL
    assert rel_err(cupy.asnumpy(lse), ref_lse[0]) < LSE_TOL


@pytest.mark.gpu
@pytest.mark.parametrize("device_indices", [False, True])    # device ones are copied into the plan buffer
def test_batch_decode_gpu_cuda_graph_replays_after_replan(device_indices):
    import cupy
    lens0, lens1 = [300, 40], [301, 41]
    idx = (lambda c: cupy.asarray(c["indices"])) if device_indices else (lambda c: c["indices"])
    case0 = make_case(0, 0, 16, 32, 8, 128, "NHD", "float16", kv_lens=lens0, seed=1, extra_pages=8)
    w = cuattn.BatchDecodeWithPagedKVCacheWrapper(kv_layout="NHD", use_cuda_graph=True)
    q = to_cupy(case0["q"])
    cache = cache_arg(case0, "one", to_cupy)
    out = cupy.empty((2, 32, 128), np.float16)
    stream = cupy.cuda.Stream(non_blocking=True)
    cupy.cuda.Device().synchronize()
    with stream:
        w.plan(case0["indptr"], idx(case0), case0["lpl"], 32, 8, 128, 16, q_data_type="float16")
        w.run(q, cache, out=out)          # warm-up (compiles, sets smem attributes)
        stream.begin_capture()
        w.run(q, cache, out=out)
        graph = stream.end_capture()
        graph.launch()
    stream.synchronize()
    assert rel_err(cupy.asnumpy(out), oracle(case0)[0]) < TOL
    # one more token per request, same pages: replan, replay the graph, all on the graph's stream
    # (plan() uploads on the caller's current stream)
    case1 = make_case(0, 0, 16, 32, 8, 128, "NHD", "float16", kv_lens=lens1, seed=1, extra_pages=8)
    with stream:
        w.plan(case1["indptr"], idx(case1), case1["lpl"], 32, 8, 128, 16, q_data_type="float16")
        q[...] = to_cupy(case1["q"])
        cache[...] = cache_arg(case1, "one", to_cupy)
        graph.launch()
    stream.synchronize()
    assert rel_err(cupy.asnumpy(out), oracle(case1)[0]) < TOL


@pytest.mark.gpu
@requires_sm(90)
@pytest.mark.parametrize("page_size,split,device_indices", [(16, 300, False), (16, 0, True), (5, 200, True),
                                                            (5, 0, False)])
def test_batch_decode_gpu_pdl_waits_for_the_previous_kernel(page_size, split, device_indices):
    """enable_pdl=True right after a kernel that writes q, the cache and (device) page ids late
    (tests/late_writer.py)."""
    import cupy
    case = make_case(0, 0, page_size, 32, 8, 128, "NHD", "float16", kv_lens=[2500, 17, 700, 1], seed=13)
    q_true, cache_true = to_cupy(case["q"]), cache_arg(case, "one", to_cupy)
    idx_true = cupy.asarray(case["indices"])
    q, cache = cupy.full_like(q_true, np.nan), cupy.full_like(cache_true, np.nan)
    idx = cupy.zeros_like(idx_true)
    w = cuattn.BatchDecodeWithPagedKVCacheWrapper(kv_layout="NHD")
    w.plan(case["indptr"], idx if device_indices else case["indices"], case["lpl"], 32, 8, 128, page_size,
           q_data_type="float16", fixed_split_size=split or None, disable_split_kv=not split)
    assert w._work.split == bool(split) and jit.pdl_launch(0, None)
    ref_o, ref_lse = oracle(case)
    for _rep in range(2):
        q.fill(np.nan)
        cache.fill(np.nan)
        idx.fill(0)
        late_copy([(q_true, q), (cache_true, cache)] + [(idx_true, idx)] * device_indices)
        out, lse = w.run(q, cache, return_lse=True, enable_pdl=True)
        assert rel_err(cupy.asnumpy(out), ref_o) < TOL
        assert rel_err(cupy.asnumpy(lse), ref_lse) < LSE_TOL
