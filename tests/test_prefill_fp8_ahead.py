"""fp8 paged prefill with the rows converted ahead of the contiguous fa3 kernel (issue 22; cuattn/prefill_fp8.py,
kernels_cu/page.cu cuattn_kv_dequant). CPU: when plan() takes it (query tiles sharing each key, the buffer's cap),
the token offsets it uploads, the conversion kernels compile for sm_80 and sm_90a without spills. GPU (sm_90): the
conversion bit for bit against ml_dtypes (every byte value, both formats, f16 and bf16 rows, pages of 1, 5, 16, NHD
and HND, an empty request); the paged batches of the fp8 gather's tests converted ahead against the float64 oracle
(outputs poisoned, every element checked, free slots and pages NaN bits); bitwise the in-kernel conversion's output
at an f16 q; run()'s replay converting the cache's current rows; the cases that convert in the kernel."""
import numpy as np
import pytest

import cuattn
from cuattn import jit, page, prefill_fp8
from cuattn.errors import UnsupportedError
from tests.conftest import gpu_cc
from tests.prefill_dtype_cases import BF16, FP8, FP8_NAME, _cp, _dev, _ids, paged_fp8_case, run_paged_fp8_and_check

# ============================================================================ CPU (CI)


def test_pays_counts_query_tiles_per_key_and_caps_the_buffer(monkeypatch):
    row = 2 * 8 * 256                               # a token's 16-bit K and V rows at 8 kv heads, head_dim 128
    one = np.array([1024]), np.array([4096])        # group 1: 8 query tiles read each key (32k reads)
    assert prefill_fp8.pays(*one, 1, False, row)                   # 8 tiles a key: MIN_SHARING
    assert not prefill_fp8.pays(*one, 1, True, row)                # causal: twice that
    assert prefill_fp8.pays(one[0], one[1], 2, True, row)          # group 2: 16 tiles
    assert prefill_fp8.pays(np.array([897]), np.array([4096]), 1, False, row)        # 8 tiles (the last one row)
    assert not prefill_fp8.pays(np.array([896]), np.array([4096]), 1, False, row)    # 7 tiles
    decode = np.ones(64, np.int64), np.full(64, 8192)
    assert not prefill_fp8.pays(*decode, 4, False, row)            # one tile a key
    assert not prefill_fp8.pays(np.zeros(0, np.int64), np.zeros(0, np.int64), 4, True, row)
    assert not prefill_fp8.pays(np.array([512]), np.array([0]), 4, True, row)
    small = np.array([1024]), np.array([1024])      # 32 tiles a key, 32k reads; causal 16k: in the kernel
    assert prefill_fp8.pays(*small, 4, False, row) and not prefill_fp8.pays(*small, 4, True, row)
    big = np.array([4096]), np.array([4096])
    assert prefill_fp8.pays(*big, 4, True, row)
    monkeypatch.setattr(prefill_fp8, "MAX_BYTES", 4096 * row - 1)
    assert not prefill_fp8.pays(*big, 4, True, row)                # the buffer past its cap: in the kernel


def test_token_indptr_and_spec_names():
    assert prefill_fp8.token_indptr(np.array([5, 0, 17], np.int64)).tolist() == [0, 5, 5, 22]
    assert prefill_fp8.token_indptr(np.array([5], np.int64)).dtype == np.int32
    names = [s.name for s in prefill_fp8.shipped_specs()]
    assert names == ["page_dequant_e4m3_f16", "page_dequant_e5m2_f16", "page_dequant_e4m3_bf16",
                     "page_dequant_e5m2_bf16"]
    assert "-DKV_DEQUANT=1" in prefill_fp8.PageDequantSpec("bf16", "e5m2").defines()


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_dequant_kernels_compile_without_spills(arch):
    for spec in prefill_fp8.shipped_specs():
        res = jit.compile_kernel(spec, arch).resources["cuattn_kv_dequant"]
        assert max(res["spill_stores"], res["spill_loads"], res["stack_frame"]) == 0, (spec.name, arch, res)


def test_numpy_plan_never_converts_ahead():
    c = paged_fp8_case([512], [600], 16, 8, 2, 128, "e4m3", "float16", "tensor", seed=1)
    w = cuattn.BatchPrefillWithPagedKVCacheWrapper()
    w.plan(c["qo_indptr"], c["indptr"], c["indices"], c["last"], 8, 2, 128, 16, q_data_type="float16",
           kv_data_type="float8_e4m3fn")
    if w._plan.meta is None:        # (a machine without a GPU: the NumPy plan)
        assert not w._plan.fp8_ahead and not w._fp8.active


# ============================================================================ GPU

sm90 = pytest.mark.skipif(gpu_cc() != 90, reason="the fa3 kernel needs an sm_90 GPU")


@pytest.fixture
def ahead(monkeypatch):
    """Every fp8 paged fa3 plan converts its rows ahead."""
    monkeypatch.setattr(prefill_fp8, "MIN_SHARING", 0)
    monkeypatch.setattr(prefill_fp8, "MIN_READS", 0)


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("page_size,layout", [(1, "NHD"), (5, "HND"), (16, "NHD")])
def test_dequant_rows_are_ml_dtypes_conversions_bit_for_bit(page_size, layout):
    """Every byte value in K and V (NaN included: NaN out), pages in random order, an empty request between two."""
    cp = _cp()
    rng = np.random.default_rng(page_size)
    hkv, d, kv_lens = 2, 128, np.array([300, 0, 77])
    npages = -(-kv_lens // page_size)
    total = int(npages.sum()) + 1
    indices = cp.asarray(rng.permutation(total)[:npages.sum()].astype(np.int32))
    page_indptr = cp.asarray(np.concatenate([[0], np.cumsum(npages)]).astype(np.int32))
    tok = cp.asarray(prefill_fp8.token_indptr(kv_lens))
    shape = (total, 2, page_size, hkv, d) if layout == "NHD" else (total, 2, hkv, page_size, d)
    bits = rng.integers(0, 256, shape, dtype=np.uint8)
    bits.reshape(-1)[:512] = np.tile(np.arange(256, dtype=np.uint8), 2)
    kv = page.paged_kv_tensors(cp.asarray(bits), layout, "test")
    nnz = int(kv_lens.sum())
    host_idx, host_ip = cp.asnumpy(indices), cp.asnumpy(page_indptr)
    for fmt in ("e4m3", "e5m2"):
        for out_t, np_t in (("f16", np.dtype(np.float16)), ("bf16", BF16)):
            k_out = cp.full((nnz, hkv, d), 0x7E01, np.uint16)          # poisoned
            v_out = cp.full((nnz, hkv, d), 0x7E01, np.uint16)
            meta = dict(kv_indptr=tok.data.ptr, page_indptr=page_indptr.data.ptr, kv_indices=indices.data.ptr)
            prefill_fp8.dequant_rows(page.arrays.Context("cupy", kv.k.device, cp.cuda.get_current_stream()), kv,
                                     out_t, fmt, meta, nnz, 3, k_out.data.ptr, v_out.data.ptr)
            for which, got in ((0, k_out), (1, v_out)):
                want = np.concatenate([np.concatenate([bits[p, which] if layout == "NHD" else
                                                       bits[p, which].transpose(1, 0, 2)
                                                       for p in host_idx[host_ip[b]:host_ip[b + 1]]])[:n]
                                       for b, n in enumerate(kv_lens) if n])
                ref = want.view(FP8[fmt]).astype(np_t)
                g = cp.asnumpy(got).view(np_t)
                nan = np.isnan(ref.astype(np.float32))
                assert np.array_equal(np.isnan(g.astype(np.float32)), nan), (fmt, out_t, which)
                assert np.array_equal(g.view(np.uint16)[~nan], ref.view(np.uint16)[~nan]), (fmt, out_t, which)


# the fp8 gather's cases (tests/test_prefill_fp8_gather.py), converted ahead: one-tile, two-tile and long requests,
# decode-like rows, kv_len 1, split requests, pages of 1 and 16, head_dim 64 and 128
from tests.test_prefill_fp8_gather import CASES, _page0_free  # noqa: E402


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("case", CASES, ids=_ids(CASES))
def test_fp8_converted_ahead_matches_dequantised_oracle(case, ahead):
    qo_lens, kv_lens, ps, hq, hkv, kv, qdt, sk, causal, layout, d, split = case
    c = _page0_free(paged_fp8_case(qo_lens, kv_lens, ps, hq, hkv, d, kv, qdt, sk, layout, seed=len(qo_lens) * 7 + ps))
    w = cuattn.BatchPrefillWithPagedKVCacheWrapper(kv_layout=layout, backend="fa3")
    w.plan(_dev(c["qo_indptr"]), _dev(c["indptr"]), _dev(c["indices"]), _dev(c["last"]), hq, hkv, d, ps,
           causal=causal, q_data_type=qdt, kv_data_type=FP8_NAME[kv], fixed_split_size=split)
    spec = w._plan["run_spec"]
    assert w._plan.fp8_ahead and not spec.paged and not spec.dtype_kv and "converted to 16 bits" in w.describe()
    assert spec.dtype == {"float16": "f16", "bfloat16": "bf16"}[qdt] and spec.persistent
    assert split is None or w._plan["work_list"].split
    run_paged_fp8_and_check(w, c, hq, d, qdt, causal)


def _run_both(monkeypatch, c, hq, hkv, ps, kv, causal, split=None):
    """(out, lse) of the planned batch converted ahead, then in the kernel, f16 q, the case's scales."""
    cp = _cp()
    got = []
    monkeypatch.setattr(prefill_fp8, "MIN_READS", 0)
    for sharing in (0, float("inf")):
        monkeypatch.setattr(prefill_fp8, "MIN_SHARING", sharing)
        w = cuattn.BatchPrefillWithPagedKVCacheWrapper(backend="fa3")
        w.plan(c["qo_indptr"], c["indptr"], c["indices"], c["last"], hq, hkv, 128, ps, causal=causal,
               q_data_type="float16", kv_data_type=FP8_NAME[kv], fixed_split_size=split)
        assert w._plan.fp8_ahead is (sharing == 0)
        out, lse = cp.full((int(c["qo_indptr"][-1]), hq, 128), np.nan, np.float16), cp.full(
            (int(c["qo_indptr"][-1]), hq), np.nan, np.float32)
        s = [x if isinstance(x, float) else cp.asarray(x) for x in c["scales"]]
        w.run(_dev(c["q"]), (_dev(c["k"]), _dev(c["v"])), out=out, lse=lse, k_scale=s[0], v_scale=s[1])
        got.append((cp.asnumpy(out), cp.asnumpy(lse)))
    return got


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("ps,kv,causal,split,sk", [(16, "e4m3", True, None, "tensor"), (1, "e5m2", False, 512, "head"),
                                                   (16, "e5m2", True, None, "one")])
def test_fp8_converted_ahead_equals_the_in_kernel_conversion_bitwise(ps, kv, causal, split, sk, monkeypatch):
    """At an f16 q both forms run the same products on the same f16 K / V values (the conversion is exact) in the
    same persistent schedule: outputs and LSEs bit for bit."""
    c = paged_fp8_case([700, 1, 300], [1500, 900, 300], ps, 32, 8, 128, kv, "float16", sk, seed=ps + 3)
    (o1, s1), (o2, s2) = _run_both(monkeypatch, c, 32, 8, ps, kv, causal, split)
    assert np.isfinite(o1).all() and np.array_equal(o1, o2) and np.array_equal(s1, s2)


@pytest.mark.gpu
@sm90
def test_fp8_converted_ahead_replays_with_the_cache_as_it_is_now(ahead):
    """run()'s replay (a plain call: no scales) launches the conversion too: a call after the cache's rows changed
    reads the new rows (a fresh q each call, out allocated by run()), as a fresh wrapper's first call does."""
    cp = _cp()
    c = paged_fp8_case([300, 40], [700, 900], 16, 16, 4, 128, "e4m3", "float16", "tensor", seed=9)
    plan = (_dev(c["qo_indptr"]), _dev(c["indptr"]), _dev(c["indices"]), _dev(c["last"]), 16, 4, 128, 16)
    kw = dict(causal=True, q_data_type="float16", kv_data_type="float8_e4m3fn")
    w = cuattn.BatchPrefillWithPagedKVCacheWrapper()
    w.plan(*plan, **kw)
    assert w._plan.fp8_ahead
    k, v = _dev(c["k"]), _dev(c["v"])
    o1 = cp.asnumpy(w.run(_dev(c["q"]), (k, v)))
    assert len(w._runs) == 1, "the plain call was recorded"
    assert np.array_equal(cp.asnumpy(w.run(_dev(c["q"]), (k, v))), o1)       # replayed
    k[...] = cp.random.randint(0, 256, k.shape, dtype=cp.int32).astype(cp.uint8) & 0xB7   # new rows, no NaN bits
    o2 = cp.asnumpy(w.run(_dev(c["q"]), (k, v)))
    assert len(w._runs) == 1 and np.isfinite(o2).all() and not np.array_equal(o1, o2)
    w2 = cuattn.BatchPrefillWithPagedKVCacheWrapper()         # a fresh wrapper: no record
    w2.plan(*plan, **kw)
    assert np.array_equal(cp.asnumpy(w2.run(_dev(c["q"]), (k, v))), o2)


@pytest.mark.gpu
@sm90
def test_fp8_converts_in_the_kernel_where_ahead_does_not_pay(monkeypatch):
    """Decode-like rows, CUDA-graph mode and a batch past the buffer's cap keep the fp8 gather."""
    c = paged_fp8_case([1] * 8, [2000] * 8, 16, 32, 8, 128, "e4m3", "float16", "tensor", seed=2)
    args = (_dev(c["qo_indptr"]), _dev(c["indptr"]), _dev(c["indices"]), _dev(c["last"]), 32, 8, 128, 16)
    kw = dict(q_data_type="float16", kv_data_type="float8_e4m3fn")
    w = cuattn.BatchPrefillWithPagedKVCacheWrapper(backend="fa3")
    w.plan(*args, **kw)
    assert not w._plan.fp8_ahead and w._plan["run_spec"].gather and "converted to 16 bits" not in w.describe()
    run_paged_fp8_and_check(w, c, 32, 128, "float16", False)
    big = paged_fp8_case([2048], [2048], 16, 32, 8, 128, "e4m3", "float16", "tensor", seed=3)
    bargs = (_dev(big["qo_indptr"]), _dev(big["indptr"]), _dev(big["indices"]), _dev(big["last"]), 32, 8, 128, 16)
    w.plan(*bargs, causal=True, **kw)
    assert w._plan.fp8_ahead and w._fp8.active
    g = cuattn.BatchPrefillWithPagedKVCacheWrapper(backend="fa3", use_cuda_graph=True)
    g.plan(*bargs, causal=True, **kw)
    assert not g._plan.fp8_ahead and g._plan["run_spec"].gather
    monkeypatch.setattr(prefill_fp8, "MAX_BYTES", 2048 * 2 * 8 * 256 - 1)
    w.plan(*bargs, causal=True, **kw)
    assert not w._plan.fp8_ahead and not w._fp8.active
    run_paged_fp8_and_check(w, big, 32, 128, "float16", True)


@pytest.mark.gpu
@sm90
def test_fp8_converted_ahead_refuses_a_cache_off_16_bytes(ahead):
    c = paged_fp8_case([40], [300], 16, 8, 2, 128, "e4m3", "float16", "one", seed=3)
    w = cuattn.BatchPrefillWithPagedKVCacheWrapper(backend="fa3")
    w.plan(_dev(c["qo_indptr"]), _dev(c["indptr"]), _dev(c["indices"]), _dev(c["last"]), 8, 2, 128, 16,
           q_data_type="float16", kv_data_type="float8_e4m3fn")
    assert w._plan.fp8_ahead
    k, v = _dev(c["k"]), _dev(c["v"])
    buf = _cp().empty(k.size + 16, _cp().uint8)
    off = buf[8:8 + k.size].reshape(k.shape)
    off[...] = k
    with pytest.raises(UnsupportedError, match="fp8 paged_kv_cache in 16-byte loads.*K pointer"):
        w.run(_dev(c["q"]), (off, v))
    assert w.run(_dev(c["q"]), (k, v)).shape == (40, 8, 128)
