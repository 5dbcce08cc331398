"""Paged fa3 prefill with the batch's K / V rows gathered (fp8: converted) ahead of the contiguous kernel (issues 21,
22; cuattn/prefill_ahead.py, kernels_cu/page.cu cuattn_kv_rows). CPU: when plan() takes it (query tiles sharing each
key, the buffer's cap), the token offsets it uploads, the gathering kernels compile for sm_80 and sm_90a without
spills. GPU (sm_90): the gathered rows bit for bit (fp8: against ml_dtypes, every byte value, both formats, f16 and
bf16 rows; 16-bit: copied), pages of 1, 5, 16, NHD and HND, an empty request; bitwise the in-kernel path's output (fp8
at an f16 q, 16-bit caches of both types); run()'s replay gathering the cache's current rows; the cases that read the
pages in the kernel; a ragged fp8 batch converted ahead. The fp8 gather's batches gathered ahead against the float64
oracle, and the refusal of a cache off 16 bytes: tests/test_prefill_fp8_gather.py."""
import numpy as np
import pytest

import cuattn
from cuattn import jit, page, prefill_ahead
from tests.conftest import gpu_cc
from tests.prefill_dtype_cases import BF16, FP8, FP8_NAME, _cp, _dev, paged_fp8_case, run_paged_fp8_and_check

# ============================================================================ CPU (CI)

ROW = 2 * 8 * 256            # a token's 16-bit K and V rows at 8 kv heads, head_dim 128


def test_pays_counts_query_tiles_per_key_and_caps_the_buffer(monkeypatch):
    pays = lambda qo, kv, group, causal, cache="fp8": prefill_ahead.pays(  # noqa: E731
        np.array(qo), np.array(kv), group, causal, ROW, cache)
    assert prefill_ahead.MIN_SHARING == {"fp8": 8, "16": 64, "fp8_rows": 0} and prefill_ahead.MIN_READS["fp8"] == 32768
    assert pays([1024], [4096], 1, False)                  # group 1: 8 query tiles read each key (32k reads)
    assert not pays([1024], [4096], 1, True)               # causal: 1024 keys before the queries, 3072 under them
    assert pays([2048], [4096], 1, True)                   # 16 tiles, causal: 12.25 reads a key
    assert pays([897], [4096], 1, False)                   # 8 tiles (the last one row)
    assert not pays([896], [4096], 1, False)               # 7 tiles
    assert not pays([1] * 64, [8192] * 64, 4, False)       # decode rows: one tile a key
    assert not pays([], [], 4, True) and not pays([512], [0], 4, True)
    assert pays([1024], [1024], 4, False) and not pays([1024], [1024], 4, True)   # 32 tiles; 32k reads, causal 16.9k
    assert pays([512], [32768], 4, True) and not pays([512], [32768], 4, True, "16")   # a chunk: 15.9 reads a key
    assert pays([4096], [4096], 4, True, "16") and not pays([2048] * 8, [2048] * 8, 4, True, "16")   # 64.5, 32.5
    assert pays([4096], [4096], 4, True)
    monkeypatch.setattr(prefill_ahead, "MAX_BYTES", 4096 * ROW - 1)
    assert not pays([4096], [4096], 4, True)               # the buffer past its cap: the pages read in the kernel
    assert prefill_ahead.kind("e4m3") == prefill_ahead.kind("e5m2") == "fp8" and prefill_ahead.kind("") == "16"
    assert prefill_ahead.kind("e5m2", paged=False) == "fp8_rows" and pays([1], [10], 4, True, "fp8_rows")   # always


def test_causal_tile_reads_count_each_tiles_keys():
    """Against a direct count: causal tile t of a request reads kv_len - qo_len + (its last query + 1) keys."""
    rng = np.random.default_rng(0)
    for _ in range(50):
        group = int(rng.choice([1, 4, 7, 8]))
        qo = rng.integers(1, 700, 5)
        kv = qo + rng.integers(0, 3000, 5)
        want = 0
        for q, k in zip(qo, kv):
            rows = q * group
            for t in range(-(-rows // 128)):
                last_row = min((t + 1) * 128, rows) - 1
                want += k - q + last_row // group + 1
        got = prefill_ahead.tile_reads(qo, kv, group, True)
        assert abs(got - want) <= 0.02 * want, (group, got, want)      # (R = 128 / group: fractional at group 7)
    assert prefill_ahead.tile_reads(np.array([300]), np.array([500]), 4, False) == 10 * 500


def test_token_indptr_and_spec_names():
    assert prefill_ahead.token_indptr(np.array([5, 0, 17], np.int64)).tolist() == [0, 5, 5, 22]
    assert prefill_ahead.token_indptr(np.array([5], np.int64)).dtype == np.int32
    names = [s.name for s in prefill_ahead.shipped_specs()]
    assert names == ["page_rows_e4m3_f16", "page_rows_e5m2_f16", "page_rows_e4m3_bf16", "page_rows_e5m2_bf16",
                     "page_rows_b16"]
    assert "-DKV_FP8=2" in prefill_ahead.KvRowsSpec("e5m2", "bf16").defines()
    assert "-DKV_FP8=0" in prefill_ahead.KvRowsSpec("b16").defines()


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_gather_kernels_compile_without_spills(arch):
    for spec in prefill_ahead.shipped_specs():
        res = jit.compile_kernel(spec, arch).resources["cuattn_kv_rows"]
        assert max(res["spill_stores"], res["spill_loads"], res["stack_frame"]) == 0, (spec.name, arch, res)


def test_numpy_plan_never_gathers_ahead():
    c = paged_fp8_case([1024], [1024], 16, 8, 2, 128, "e4m3", "float16", "tensor", seed=1)
    w = cuattn.BatchPrefillWithPagedKVCacheWrapper()
    w.plan(c["qo_indptr"], c["indptr"], c["indices"], c["last"], 8, 2, 128, 16, q_data_type="float16",
           kv_data_type="float8_e4m3fn")
    if w._plan.meta is not None:
        pytest.skip("a GPU plan: the GPU tests below cover it")
    assert prefill_ahead.pays(np.array([1024]), np.array([1024]), 4, False, ROW, "fp8")   # (a GPU plan would take it)
    assert not w._plan.kv_ahead


# ============================================================================ GPU

sm90 = pytest.mark.skipif(gpu_cc() != 90, reason="the fa3 kernel needs an sm_90 GPU")
ALL = {k: 0 for k in prefill_ahead.MIN_SHARING}


@pytest.fixture
def ahead(monkeypatch):
    """Every paged fa3 plan gathers its rows ahead."""
    monkeypatch.setattr(prefill_ahead, "MIN_SHARING", ALL)
    monkeypatch.setattr(prefill_ahead, "MIN_READS", ALL)


def _pages(bits, kv_lens, host_ip, host_idx, which, layout):
    """The rows of K (which 0) or V (1) of the requests, in token order, from a [pages, 2, ...] cache."""
    return np.concatenate([np.concatenate([bits[p, which] if layout == "NHD" else bits[p, which].transpose(1, 0, 2)
                                           for p in host_idx[host_ip[b]:host_ip[b + 1]]])[:n]
                           for b, n in enumerate(kv_lens) if n])


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("page_size,layout", [(1, "NHD"), (5, "HND"), (16, "NHD")])
def test_gathered_rows_bit_for_bit(page_size, layout):
    """fp8: every byte value in K and V (NaN included: NaN out) converted as ml_dtypes does; 16-bit: copied. Pages in
    random order, an empty request between two, outputs poisoned."""
    cp = _cp()
    rng = np.random.default_rng(page_size)
    hkv, d, kv_lens = 2, 128, np.array([300, 0, 77])
    npages = -(-kv_lens // page_size)
    total = int(npages.sum()) + 1
    indices = cp.asarray(rng.permutation(total)[:npages.sum()].astype(np.int32))
    page_indptr = cp.asarray(np.concatenate([[0], np.cumsum(npages)]).astype(np.int32))
    tok = cp.asarray(prefill_ahead.token_indptr(kv_lens))
    meta = (tok.data.ptr, page_indptr.data.ptr, indices.data.ptr)
    host_idx, host_ip, nnz = cp.asnumpy(indices), cp.asnumpy(page_indptr), int(kv_lens.sum())
    ctx = page.arrays.Context("cupy", cp.cuda.runtime.getDevice(), cp.cuda.get_current_stream())
    shape = (total, 2, page_size, hkv, d) if layout == "NHD" else (total, 2, hkv, page_size, d)
    for item in (1, 2):
        bits = rng.integers(0, 256 ** item, shape, dtype=np.uint8 if item == 1 else np.uint16)
        bits.reshape(-1)[:512] = np.tile(np.arange(256), 2)
        kv = page.paged_kv_tensors(cp.asarray(bits), layout, "test")
        specs = ([prefill_ahead.KvRowsSpec(f, o) for f in ("e4m3", "e5m2") for o in ("f16", "bf16")] if item == 1
                 else [prefill_ahead.KvRowsSpec("b16")])
        for spec in specs:
            k_out, v_out = (cp.full((nnz, hkv, d), 0x7E01, np.uint16) for _ in range(2))      # poisoned
            strides = (kv.stride_page, kv.stride_slot, kv.stride_head)
            prefill_ahead.gather_rows(ctx, kv.k, kv.v, strides, strides, page_size, hkv, d, spec, meta, nnz, 3,
                                      k_out.data.ptr, v_out.data.ptr)
            for which, got in ((0, k_out), (1, v_out)):
                want = _pages(bits, kv_lens, host_ip, host_idx, which, layout)
                g = cp.asnumpy(got)
                if item == 2:
                    assert np.array_equal(g, want), (spec.name, which)
                    continue
                np_t = BF16 if spec.dtype_out == "bf16" else np.dtype(np.float16)
                ref = want.view(FP8[spec.dtype_kv]).astype(np_t).view(np.uint16)
                nan = np.isnan(ref.view(np_t).astype(np.float32))
                assert np.array_equal(np.isnan(g.view(np_t).astype(np.float32)), nan), (spec.name, which)
                assert np.array_equal(g[~nan], ref[~nan]), (spec.name, which)


def _cache16(rng, shape, dtype):
    """A 16-bit cache (uint16 bits of ``dtype``), NaN in every slot, the requests' rows written by _fill16."""
    return np.full(shape, 0x7E00 if dtype == "float16" else 0x7FC0, np.uint16)


def _run_both(monkeypatch, c, hq, hkv, ps, kv, causal, split=None, cache=None, kv_layout="NHD"):
    """(out, lse, describe) of the planned batch gathered ahead, then read in the kernel; ``kv`` an fp8 format (the
    case's fp8 cache and scales, f16 q) or a 16-bit q / cache type (``cache``: its uint16 bits, no scales)."""
    cp = _cp()
    got = []
    fp8 = kv in FP8_NAME
    qdt = "float16" if fp8 else kv
    for v in (0, float("inf")):
        monkeypatch.setattr(prefill_ahead, "MIN_SHARING", {k: v for k in ALL})
        monkeypatch.setattr(prefill_ahead, "MIN_READS", {k: v for k in ALL})
        w = cuattn.BatchPrefillWithPagedKVCacheWrapper(kv_layout=kv_layout, backend="fa3")
        w.plan(c["qo_indptr"], c["indptr"], c["indices"], c["last"], hq, hkv, 128, ps, causal=causal,
               q_data_type=qdt, kv_data_type=FP8_NAME[kv] if fp8 else qdt, fixed_split_size=split)
        assert w._plan.kv_ahead is (v == 0)
        rows = int(c["qo_indptr"][-1])
        out = cp.full((rows, hq, 128), 0x7E01, np.uint16)
        lse = cp.full((rows, hq), np.nan, np.float32)
        if fp8:
            s = [x if isinstance(x, float) else cp.asarray(x) for x in c["scales"]]
            w.run(_dev(c["q"]), (_dev(c["k"]), _dev(c["v"])), out=out.view(np.float16), lse=lse, k_scale=s[0],
                  v_scale=s[1])
        else:
            w.run(cp.asarray(c["q"]), cp.asarray(cache), out=out if qdt == "bfloat16" else out.view(np.float16), lse=lse)
        got.append((cp.asnumpy(out), cp.asnumpy(lse), w.describe()))
    return got


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("ps,kv,causal,split,sk", [(16, "e4m3", True, None, "tensor"), (1, "e5m2", False, 512, "head"),
                                                   (16, "e5m2", True, None, "one")])
def test_fp8_gathered_ahead_equals_the_in_kernel_conversion_bitwise(ps, kv, causal, split, sk, monkeypatch):
    """At an f16 q both forms run the same products on the same f16 K / V values (the conversion is exact) in the
    same persistent schedule: outputs and LSEs bit for bit."""
    c = paged_fp8_case([700, 1, 300], [1500, 900, 300], ps, 32, 8, 128, kv, "float16", sk, seed=ps + 3)
    (o1, s1, d1), (o2, s2, d2) = _run_both(monkeypatch, c, 32, 8, ps, kv, causal, split)
    assert "gathered ahead" in d1 and "gathered ahead" not in d2 and "_gather_kv" in d2
    assert np.isfinite(o1.view(np.float16)).all() and np.array_equal(o1, o2) and np.array_equal(s1, s2)


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("ps,dtype,causal,split,layout", [(16, "float16", True, None, "NHD"),
                                                          (1, "bfloat16", False, 512, "HND"),
                                                          (5, "float16", False, None, "NHD")])
def test_16_bit_gathered_ahead_equals_the_paged_kernel_bitwise(ps, dtype, causal, split, layout, monkeypatch):
    """A 16-bit cache: the rows copied ahead and the contiguous kernel against the paged kernel's gather (pages of 16,
    1 and 5: no TMA box), NaN in every slot no request owns: outputs and LSEs bit for bit."""
    rng = np.random.default_rng(ps)
    hq, hkv, qo_lens, kv_lens = 32, 8, [700, 1, 300], [1500, 900, 300]
    npages = [-(-n // ps) for n in kv_lens]
    total = sum(npages) + 3
    perm = rng.permutation(total).astype(np.int32)[:sum(npages)]
    indptr = np.concatenate([[0], np.cumsum(npages)]).astype(np.int32)
    last = np.array([n - (p - 1) * ps for n, p in zip(kv_lens, npages)], np.int32)
    qo_indptr = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
    np_t = BF16 if dtype == "bfloat16" else np.dtype(np.float16)
    cache = _cache16(rng, (total, 2, ps, hkv, 128), dtype)
    for b, n in enumerate(kv_lens):
        for i, p in enumerate(perm[indptr[b]:indptr[b + 1]]):
            m = min(ps, n - i * ps)
            cache[p, :, :m] = rng.standard_normal((2, m, hkv, 128)).astype(np_t).view(np.uint16)
    if layout == "HND":
        cache = cache.transpose(0, 1, 3, 2, 4).copy()
    q = rng.standard_normal((int(qo_indptr[-1]), hq, 128)).astype(np_t).view(np.uint16)
    q = q if dtype == "bfloat16" else q.view(np.float16)
    c = dict(qo_indptr=qo_indptr, indptr=indptr, indices=perm, last=last, q=q)
    cache = cache if dtype == "bfloat16" else cache.view(np.float16)
    (o1, s1, d1), (o2, s2, d2) = _run_both(monkeypatch, c, hq, hkv, ps, dtype, causal, split, cache, layout)
    assert "gathered ahead" in d1 and "converted" not in d1 and "_gather" in d2
    assert np.isfinite(o1.view(np_t).astype(np.float32)).all() and np.array_equal(o1, o2) and np.array_equal(s1, s2)


@pytest.mark.gpu
@sm90
def test_gathered_ahead_replays_with_the_cache_as_it_is_now(ahead):
    """run()'s replay (a plain call: no scales) launches the gathering too: a call after the cache's rows changed
    reads the new rows (a fresh q each call, out allocated by run()), as a fresh wrapper's first call does."""
    cp = _cp()
    c = paged_fp8_case([300, 40], [700, 900], 16, 16, 4, 128, "e4m3", "float16", "tensor", seed=9)
    plan = (_dev(c["qo_indptr"]), _dev(c["indptr"]), _dev(c["indices"]), _dev(c["last"]), 16, 4, 128, 16)
    kw = dict(causal=True, q_data_type="float16", kv_data_type="float8_e4m3fn")
    w = cuattn.BatchPrefillWithPagedKVCacheWrapper()
    w.plan(*plan, **kw)
    assert w._plan.kv_ahead
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
def test_pages_read_in_the_kernel_where_gathering_ahead_does_not_pay(monkeypatch):
    """Decode-like rows, CUDA-graph mode and a batch past the buffer's cap keep the kernel's gather (fp8 and 16-bit)."""
    c = paged_fp8_case([1] * 8, [2000] * 8, 16, 32, 8, 128, "e4m3", "float16", "tensor", seed=2)
    args = (_dev(c["qo_indptr"]), _dev(c["indptr"]), _dev(c["indices"]), _dev(c["last"]), 32, 8, 128, 16)
    kw = dict(q_data_type="float16", kv_data_type="float8_e4m3fn")
    w = cuattn.BatchPrefillWithPagedKVCacheWrapper(backend="fa3")
    w.plan(*args, **kw)
    assert not w._plan.kv_ahead and w._plan["run_spec"].gather and "gathered ahead" not in w.describe()
    run_paged_fp8_and_check(w, c, 32, 128, "float16", False)
    big = paged_fp8_case([2048], [2048], 16, 32, 8, 128, "e4m3", "float16", "tensor", seed=3)   # (64 reads a key)
    bargs = (_dev(big["qo_indptr"]), _dev(big["indptr"]), _dev(big["indices"]), _dev(big["last"]), 32, 8, 128, 16)
    for kvdt in ("float8_e4m3fn", "float16"):
        w.plan(*bargs, q_data_type="float16", kv_data_type=kvdt)
        assert w._plan.kv_ahead and w._ahead._buf is not None     # (the buffer sized at plan())
        g = cuattn.BatchPrefillWithPagedKVCacheWrapper(backend="fa3", use_cuda_graph=True)
        g.plan(*bargs, q_data_type="float16", kv_data_type=kvdt)
        assert not g._plan.kv_ahead and g._plan["run_spec"].gather
    monkeypatch.setattr(prefill_ahead, "MAX_BYTES", 2048 * 2 * 8 * 256 - 1)
    w.plan(*bargs, **kw)
    assert not w._plan.kv_ahead
    run_paged_fp8_and_check(w, big, 32, 128, "float16", False)


# -- a ragged batch of fp8 K / V: converted ahead too (its in-kernel form: the TMA-staged converters)

from tests.prefill_dtype_cases import _check, _oracle, _poisoned, ragged_fp8_case  # noqa: E402


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("kv,qdt,sk,causal,layout", [("e4m3", "float16", "head", True, "NHD"),
                                                     ("e5m2", "bfloat16", "tensor", False, "HND")])
def test_ragged_fp8_converted_ahead_matches_oracle_and_the_in_kernel_form(kv, qdt, sk, causal, layout, monkeypatch):
    """Ragged fp8 K / V (NHD, or HND through transposed views) converted ahead against the float64 oracle, and (f16 q)
    bit for bit against the contiguous fp8 kernel; V a strided view (every other row of a larger array): K's and V's
    strides differ."""
    cp = _cp()
    qo_lens, kv_lens, hq, hkv = [700, 1, 300], [1500, 900, 300], 16, 4
    c = ragged_fp8_case(qo_lens, kv_lens, hq, hkv, 128, kv, qdt, sk, seed=21)
    rows = int(c["qo_indptr"][-1])
    k = _dev(c["k"])
    v2 = cp.zeros((2 * c["v"].shape[0],) + c["v"].shape[1:], cp.uint8)
    v2[::2] = _dev(c["v"])
    v = v2[::2]
    if layout == "HND":                                    # (heads, tokens, head_dim); V's a strided view
        k, v = cp.ascontiguousarray(k.transpose(1, 0, 2)), v.transpose(1, 0, 2)
    scales = [x if isinstance(x, float) else cp.asarray(x) for x in c["scales"]]
    got = []
    for th in (0, float("inf")):
        monkeypatch.setattr(prefill_ahead, "MIN_SHARING", {k: th for k in ALL})
        monkeypatch.setattr(prefill_ahead, "MIN_READS", {k: th for k in ALL})
        w = cuattn.BatchPrefillWithRaggedKVCacheWrapper(kv_layout=layout, backend="fa3")
        w.plan(_dev(c["qo_indptr"]), _dev(c["kv_indptr"]), hq, hkv, 128, causal=causal, q_data_type=qdt,
               kv_data_type=FP8_NAME[kv])
        assert w._plan.kv_ahead is (th == 0) and (("gathered ahead once" in w.describe()) is (th == 0))
        out, lse = _poisoned((rows, hq, 128), qdt), cp.full((rows, hq), np.nan, np.float32)
        w.run(_dev(c["q"]), k, v, out=out, lse=lse, k_scale=scales[0], v_scale=scales[1])
        got.append((cp.asnumpy(out), cp.asnumpy(lse)))
    ref_o, ref_s = _oracle(c["q"], c["ks"], c["vs"], c["qo_indptr"], causal)
    _check(cp.asarray(got[0][0]), cp.asarray(got[0][1]), ref_o, ref_s, qdt)
    if qdt == "float16":
        assert np.array_equal(got[0][0], got[1][0]) and np.array_equal(got[0][1], got[1][1])


@pytest.mark.gpu
@sm90
def test_fp8_graph_mode_replays_the_kernels_gather_after_replans():
    """CUDA-graph mode reads an fp8 cache in the kernel (the ring at head_dim 128, persistent): captured once,
    re-planned with other lengths (the same number of queries; the work padded to the first plan's capacity), each
    replay against the float64 oracle of the dequantised K / V, outputs poisoned."""
    cp = _cp()
    from tests.prefill_dtype_cases import _check, _oracle
    hq, hkv, d, ps = 16, 4, 128, 16
    plans = [([300, 40], [700, 900]), ([170, 170], [3000, 50]), ([340], [340])]
    cases = [paged_fp8_case(qo, kv, ps, hq, hkv, d, "e4m3", "float16", "tensor", seed=40 + i)
             for i, (qo, kv) in enumerate(plans)]
    pages = max(c["k"].shape[0] for c in cases)
    kbuf, vbuf = (cp.zeros((pages,) + cases[0]["k"].shape[1:], cp.uint8) for _ in range(2))
    q = cp.zeros((340, hq, d), cp.float16)
    out, lse = cp.full(q.shape, np.nan, np.float16), cp.full(q.shape[:2], np.nan, np.float32)
    w = cuattn.BatchPrefillWithPagedKVCacheWrapper(backend="fa3", use_cuda_graph=True)
    stream = cp.cuda.Stream(non_blocking=True)

    def load(c):
        w.plan(_dev(c["qo_indptr"]), _dev(c["indptr"]), _dev(c["indices"]), _dev(c["last"]), hq, hkv, d, ps,
               causal=True, q_data_type="float16", kv_data_type="float8_e4m3fn")
        n = c["k"].shape[0]
        kbuf[:n], vbuf[:n], q[...] = _dev(c["k"]), _dev(c["v"]), cp.asarray(c["q"])
    with stream:
        load(cases[0])
        spec = w._plan["run_spec"]
        assert not w._plan.kv_ahead and spec.gather and spec.fp8_ring == 2 and spec.persistent
        w.run(q, (kbuf, vbuf), out=out, lse=lse, k_scale=0.37, v_scale=1.9)      # warm-up: compiles
        stream.begin_capture()
        w.run(q, (kbuf, vbuf), out=out, lse=lse, k_scale=0.37, v_scale=1.9)
        graph = stream.end_capture()
        for c in cases:
            load(c)
            out.fill(np.nan)
            lse.fill(np.nan)
            graph.launch()
            stream.synchronize()
            ref_o, ref_s = _oracle(c["q"], c["ks"], c["vs"], c["qo_indptr"], True)
            _check(out, lse, ref_o, ref_s, "float16")
