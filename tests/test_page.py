import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import cuattn
from cuattn import arrays
from cuattn.errors import CacheFullError

# (page_size, lengths of the requests after the append, appended per request)
APPEND_CASES = [(1, [3, 1], [2, 1]), (5, [7, 13, 1], [7, 4, 1]), (16, [40, 17], [1, 17])]
KV_DTYPES = ["float16", "bfloat16", "float8_e4m3fn", "float32"]


def make_case(page_size, seq_lens, append_lens, heads=3, head_dim=32, dtype="float16", layout="NHD",
              seed=0):
    """Random page order, random K/V; returns everything append needs plus an expected cache."""
    rng = np.random.default_rng(seed)
    dtype = arrays.as_dtype(dtype, "dtype", "test")
    pages_per = [-(-n // page_size) for n in seq_lens]
    num_pages = sum(pages_per) + 3
    order = rng.permutation(num_pages)[:sum(pages_per)].astype(np.int32)
    kv_indptr = np.concatenate([[0], np.cumsum(pages_per)]).astype(np.int32)
    last = np.array([(n - 1) % page_size + 1 for n in seq_lens], np.int32)
    append_indptr = np.concatenate([[0], np.cumsum(append_lens)]).astype(np.int32)
    nnz = int(append_indptr[-1])
    k = rng.standard_normal((nnz, heads, head_dim)).astype(dtype)
    v = rng.standard_normal((nnz, heads, head_dim)).astype(dtype)
    inner = (page_size, heads) if layout == "NHD" else (heads, page_size)
    cache = rng.standard_normal((num_pages, 2, *inner, head_dim)).astype(dtype)
    expected = cache.copy()
    for r, (n, a) in enumerate(zip(seq_lens, append_lens)):   # independent loop, token by token
        for j in range(a):
            pos = n - a + j
            page = order[kv_indptr[r] + pos // page_size]
            for h in range(heads):
                idx = (page, 0, pos % page_size, h) if layout == "NHD" else (page, 0, h, pos % page_size)
                expected[idx] = k[append_indptr[r] + j, h]
                expected[idx[:1] + (1,) + idx[2:]] = v[append_indptr[r] + j, h]
    return dict(k=k, v=v, cache=cache, expected=expected, kv_indices=order, kv_indptr=kv_indptr,
                last=last, append_indptr=append_indptr, seq_lens=np.array(seq_lens, np.int32), nnz=nnz)


def test_get_batch_indices_positions_matches_a_loop():
    append_indptr = np.array([0, 3, 3, 7], np.int32)
    seq_lens = np.array([5, 2, 4], np.int32)
    b, p = cuattn.get_batch_indices_positions(append_indptr, seq_lens, 7)
    np.testing.assert_array_equal(b, [0, 0, 0, 2, 2, 2, 2])
    np.testing.assert_array_equal(p, [2, 3, 4, 0, 1, 2, 3])
    assert b.dtype == p.dtype == np.int32


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("dtype", KV_DTYPES)
@pytest.mark.parametrize("page_size,seq_lens,append_lens", APPEND_CASES, ids=["ps1", "ps5", "ps16"])
def test_append_numpy_matches_independent_loop(page_size, seq_lens, append_lens, dtype, layout):
    c = make_case(page_size, seq_lens, append_lens, dtype=dtype, layout=layout)
    b, p = cuattn.get_batch_indices_positions(c["append_indptr"], c["seq_lens"], c["nnz"])
    cuattn.append_paged_kv_cache(c["k"], c["v"], b, p, c["cache"], c["kv_indices"], c["kv_indptr"],
                                 c["last"], layout)
    assert np.array_equal(c["cache"].view(np.uint8), c["expected"].view(np.uint8))


def test_append_numpy_kv_pair_form_writes_both_arrays():
    c = make_case(5, [7, 13], [3, 4])
    kc, vc = c["cache"][:, 0].copy(), c["cache"][:, 1].copy()
    b, p = cuattn.get_batch_indices_positions(c["append_indptr"], c["seq_lens"], c["nnz"])
    cuattn.append_paged_kv_cache(c["k"], c["v"], b, p, (kc, vc), c["kv_indices"], c["kv_indptr"], c["last"])
    np.testing.assert_array_equal(kc, c["expected"][:, 0])
    np.testing.assert_array_equal(vc, c["expected"][:, 1])


def _append_args(c):
    b, p = cuattn.get_batch_indices_positions(c["append_indptr"], c["seq_lens"], c["nnz"])
    return [c["k"], c["v"], b, p, c["cache"], c["kv_indices"], c["kv_indptr"], c["last"]]


@pytest.mark.parametrize("index,bad,match", [
    (0, lambda c: c["k"][:, :2], "append_key must have shape"),
    (1, lambda c: c["v"].astype(np.float32), "append_value must have the cache's dtype"),
    (6, lambda c: c["kv_indptr"][::-1].copy(), "kv_indptr\\[0\\] must be 0|non-decreasing"),
    (7, lambda c: c["last"] + 16, "kv_last_page_len must be in 1..page_size"),
    (5, lambda c: c["kv_indices"] + 100, "kv_indices must be in"),
    (3, lambda c: np.full(c["nnz"], 10**6, np.int32), "positions must lie within"),
    (2, lambda c: np.zeros(1, np.int32), "batch_indices must have length"),
])
def test_append_rejects_bad_inputs_naming_the_argument(index, bad, match):
    c = make_case(16, [40, 17], [1, 17])
    args = _append_args(c)
    args[index] = bad(c)
    with pytest.raises((ValueError, TypeError), match=match):
        cuattn.append_paged_kv_cache(*args)


def test_append_rejects_unknown_layout():
    c = make_case(16, [40, 17], [1, 17])
    with pytest.raises(ValueError, match="kv_layout must be 'NHD' or 'HND'"):
        cuattn.append_paged_kv_cache(*_append_args(c), kv_layout="NDH")


# ---------------------------------------------------------------------------- PagedKVCache

ops = st.lists(st.tuples(st.sampled_from(["add", "remove", "grow"]), st.integers(0, 7), st.integers(0, 40)),
               max_size=40)


@settings(max_examples=150, deadline=None)
@given(ops=ops, page_size=st.integers(1, 9), num_pages=st.integers(1, 30))
def test_paged_cache_never_leaks_or_shares_pages(ops, page_size, num_pages):
    cache = cuattn.PagedKVCache(1, 1, 8, page_size, num_pages)
    model = {}                                          # seq id -> length
    for op, pick, count in ops:
        live = sorted(model)
        if op == "add":
            model[cache.add_sequence()] = 0
        elif op == "remove" and live:
            sid = live[pick % len(live)]
            cache.remove_sequence(sid)
            del model[sid]
        elif op == "grow" and live:
            chosen = live[: pick % len(live) + 1]
            counts = [(count * (i + 1)) % 23 for i in range(len(chosen))]
            before = (cache.num_free_pages, {s: cache.pages_of(s) for s in live})
            try:
                batch = cache.reserve(chosen, counts)
            except CacheFullError:
                assert (cache.num_free_pages, {s: cache.pages_of(s) for s in live}) == before
                continue
            for s, n in zip(chosen, counts):
                model[s] += n
            assert batch.nnz == sum(counts)
            np.testing.assert_array_equal(batch.positions, np.concatenate(
                [np.arange(model[s] - n, model[s]) for s, n in zip(chosen, counts)] + [np.zeros(0)]))
        owned = [p for s in model for p in cache.pages_of(s)]
        assert len(owned) == len(set(owned)), "a page is owned twice"
        assert len(owned) + cache.num_free_pages == num_pages, "a page leaked"
        for s, n in model.items():
            assert cache.seq_len(s) == n and len(cache.pages_of(s)) == -(-n // page_size)
        if model:
            ids = sorted(model)
            indptr, indices, last = cache.page_table(ids)
            np.testing.assert_array_equal(np.diff(indptr), [len(cache.pages_of(s)) for s in ids])
            np.testing.assert_array_equal(indices, [p for s in ids for p in cache.pages_of(s)])
            for s, l in zip(ids, last):
                assert l == (0 if model[s] == 0 else (model[s] - 1) % page_size + 1)


def test_paged_cache_append_then_gather_returns_the_tokens():
    rng = np.random.default_rng(1)
    cache = cuattn.PagedKVCache(2, 2, 16, 4, 32, dtype="bfloat16", kv_layout="HND")
    a, b = cache.add_sequence(), cache.add_sequence()
    ks, vs = {a: [], b: []}, {a: [], b: []}
    for counts in ([5, 9], [1, 1], [3, 0]):
        batch = cache.reserve([a, b], counts)
        k = rng.standard_normal((sum(counts), 2, 16)).astype(arrays.bfloat16)
        v = rng.standard_normal((sum(counts), 2, 16)).astype(arrays.bfloat16)
        cache.append(1, k, v, batch)
        ks[a].append(k[:counts[0]]), ks[b].append(k[counts[0]:])
        vs[a].append(v[:counts[0]]), vs[b].append(v[counts[0]:])
    indptr, indices, last = cache.page_table([a, b])
    from cuattn import reference
    kp, vp = reference.split_paged_kv_cache(cache.layer(1), "HND")
    for i, s in enumerate([a, b]):
        k, v = reference.gather_paged_kv(kp, vp, indices, indptr, last, i)
        np.testing.assert_array_equal(k, np.concatenate(ks[s]))
        np.testing.assert_array_equal(v, np.concatenate(vs[s]))


def test_paged_cache_full_raises_and_stays_unchanged():
    cache = cuattn.PagedKVCache(1, 1, 8, 4, 3)
    s = cache.add_sequence()
    cache.reserve([s], [10])
    with pytest.raises(CacheFullError, match="needs 1 free pages, only 0"):
        cache.reserve([s], [3])
    assert cache.seq_len(s) == 10 and cache.num_free_pages == 0


def test_paged_cache_rejects_bad_arguments():
    with pytest.raises(ValueError, match="page_size must be a positive int"):
        cuattn.PagedKVCache(1, 1, 8, 0, 3)
    with pytest.raises(ValueError, match="dtype must be one of"):
        cuattn.PagedKVCache(1, 1, 8, 4, 3, dtype="int32")
    cache = cuattn.PagedKVCache(1, 1, 8, 4, 3)
    with pytest.raises(KeyError, match="no sequence with id 7"):
        cache.remove_sequence(7)


# ---------------------------------------------------------------------------- GPU


def _to_gpu(framework, x):
    if framework == "cupy":
        cp = arrays.cupy_module()
        return cp.asarray(x.view(arrays.RAW_VIEW.get(x.dtype, x.dtype)))
    import torch
    t = torch.from_numpy(np.ascontiguousarray(x).view(arrays.RAW_VIEW.get(x.dtype, x.dtype))).cuda()
    return t.view({arrays.bfloat16: torch.bfloat16, arrays.float8_e4m3: torch.float8_e4m3fn}.get(x.dtype, t.dtype))


def _to_host(x):
    if type(x).__module__.startswith("cupy"):
        return x.get()
    import torch
    return x.view(torch.uint8).cpu().numpy() if x.dtype.itemsize == 1 else x.cpu().view(
        torch.int16 if x.dtype.itemsize == 2 else x.dtype).numpy()


@pytest.mark.gpu
@pytest.mark.parametrize("framework", ["cupy", "torch"])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float8_e4m3fn"])
@pytest.mark.parametrize("page_size,seq_lens,append_lens", APPEND_CASES, ids=["ps1", "ps5", "ps16"])
def test_append_gpu_matches_numpy(page_size, seq_lens, append_lens, dtype, layout, framework):
    if framework == "torch":
        pytest.importorskip("torch")
    c = make_case(page_size, seq_lens, append_lens, dtype=dtype, layout=layout, head_dim=64, seed=3)
    g = {k: _to_gpu(framework, c[k]) for k in ("k", "v", "cache", "kv_indices", "kv_indptr", "last",
                                                 "append_indptr", "seq_lens")}
    b, p = cuattn.get_batch_indices_positions(g["append_indptr"], g["seq_lens"], c["nnz"])
    cuattn.append_paged_kv_cache(g["k"], g["v"], b, p, g["cache"], g["kv_indices"], g["kv_indptr"],
                                 g["last"], layout)
    got = _to_host(g["cache"])
    assert np.array_equal(got.view(np.uint8), c["expected"].view(np.uint8))


@pytest.mark.gpu
def test_append_gpu_kv_pair_and_out_of_range_tokens_skipped():
    cp = arrays.cupy_module()
    c = make_case(5, [7, 13], [3, 4], head_dim=40)
    kc, vc = cp.asarray(c["cache"][:, 0]), cp.asarray(c["cache"][:, 1])
    b, p = cuattn.get_batch_indices_positions(cp.asarray(c["append_indptr"]), cp.asarray(c["seq_lens"]), c["nnz"])
    p[0] = 10**6        # beyond request 0's pages: must be skipped, not written out of bounds
    cuattn.append_paged_kv_cache(cp.asarray(c["k"]), cp.asarray(c["v"]), b, p, (kc, vc),
                                 cp.asarray(c["kv_indices"]), cp.asarray(c["kv_indptr"]), cp.asarray(c["last"]))
    expected = c["expected"].copy()
    pos0 = 7 - 3
    page0 = c["kv_indices"][pos0 // 5]
    expected[page0, :, pos0 % 5] = c["cache"][page0, :, pos0 % 5]   # the skipped token's slot untouched
    np.testing.assert_array_equal(kc.get(), expected[:, 0])
    np.testing.assert_array_equal(vc.get(), expected[:, 1])


@pytest.mark.gpu
def test_paged_cache_on_gpu_matches_cpu_and_is_zero_copy_for_jax_inputs():
    cp = arrays.cupy_module()
    rng = np.random.default_rng(2)
    gpu = cuattn.PagedKVCache(1, 2, 64, 16, 16, device="cuda")
    cpu = cuattn.PagedKVCache(1, 2, 64, 16, 16)
    for cache in (gpu, cpu):
        s = [cache.add_sequence() for _ in range(3)]
    for counts in ([20, 3, 33], [1, 1, 1]):
        k = rng.standard_normal((sum(counts), 2, 64)).astype(np.float16)
        v = rng.standard_normal((sum(counts), 2, 64)).astype(np.float16)
        gpu.append(0, cp.asarray(k), cp.asarray(v), gpu.reserve(s, counts))
        cpu.append(0, k, v, cpu.reserve(s, counts))
    np.testing.assert_array_equal(gpu.storage.get(), cpu.storage)
    jax = pytest.importorskip("jax")
    kj = jax.device_put(jax.numpy.asarray(k), jax.devices("gpu")[0])
    t = arrays.device_tensor(kj, "k", "test")
    assert t.ptr == kj.unsafe_buffer_pointer()


@pytest.mark.gpu
def test_append_on_a_non_default_torch_stream_is_ordered():
    torch = pytest.importorskip("torch")
    c = make_case(16, [4000], [4000], heads=8, head_dim=128)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        g = {k: _to_gpu("torch", c[k]) for k in ("cache", "kv_indices", "kv_indptr", "last", "append_indptr", "seq_lens")}
        k = torch.from_numpy(c["k"]).cuda()
        torch.cuda._sleep(50_000_000)                 # keep the side stream busy
        k.mul_(2)                                     # ordered before the append only on `side`
        v = torch.from_numpy(c["v"]).cuda()
        b, p = cuattn.get_batch_indices_positions(g["append_indptr"], g["seq_lens"], c["nnz"])
        cuattn.append_paged_kv_cache(k, v, b, p, g["cache"], g["kv_indices"], g["kv_indptr"], g["last"])
    side.synchronize()
    got = g["cache"].cpu().numpy()
    c2 = make_case(16, [4000], [4000], heads=8, head_dim=128)
    c2["k"] *= 2
    b2, p2 = cuattn.get_batch_indices_positions(c2["append_indptr"], c2["seq_lens"], c2["nnz"])
    cuattn.append_paged_kv_cache(c2["k"], c2["v"], b2, p2, c2["cache"], c2["kv_indices"], c2["kv_indptr"], c2["last"])
    np.testing.assert_array_equal(got, c2["cache"])
