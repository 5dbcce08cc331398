"""MultiLevelCascadeAttentionWrapper and merge_state_in_place against float64 attention over the
concatenated KV of every level (tests/oracle.py)."""
import ml_dtypes
import numpy as np
import pytest

import cuattn
from tests.oracle import dense_attention, rel_err

TOL = 1e-2


def _level_tables(rng, groups, lens, page_size, next_page):
    """Page table of one level: request g holds lens[g] tokens in fresh pages (random order)."""
    pages = [-(-n // page_size) for n in lens]
    ids = next_page + rng.permutation(sum(pages)).astype(np.int32)
    indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
    last = np.array([n - (p - 1) * page_size for n, p in zip(lens, pages)], np.int32)
    qo = np.concatenate([[0], np.cumsum(groups)]).astype(np.int32)
    return qo, indptr, ids, last, next_page + sum(pages)


def make_cascade(seed, levels, hq, hkv, d, page_size, dtype=np.float16):
    """levels: list of (query-group sizes, kv lengths) per level; every level covers the same queries.
    Returns the wrapper's plan arrays, the cache, q and each query's concatenated K/V."""
    rng = np.random.default_rng(seed)
    num_q = sum(levels[0][0])
    tables, next_page = [], 0
    for groups, lens in levels:
        assert sum(groups) == num_q
        *t, next_page = _level_tables(rng, groups, lens, page_size, next_page)
        tables.append(t)
    cache = rng.standard_normal((next_page, 2, page_size, hkv, d)).astype(dtype)
    q = rng.standard_normal((num_q, hq, d)).astype(dtype)
    per_query_kv = [[] for _ in range(num_q)]
    for (qo, indptr, ids, last) in tables:
        for g in range(len(qo) - 1):
            rows = cache[ids[indptr[g]:indptr[g + 1]]]                 # [pages, 2, ps, hkv, d]
            n = (indptr[g + 1] - indptr[g] - 1) * page_size + last[g]
            kv = rows.transpose(1, 0, 2, 3, 4).reshape(2, -1, hkv, d)[:, :n]
            for i in range(qo[g], qo[g + 1]):
                per_query_kv[i].append(kv)
    return tables, cache, q, per_query_kv


def oracle(q, per_query_kv, causal_last_groups=None):
    outs, lses = [], []
    for i in range(q.shape[0]):
        k = np.concatenate([kv[0] for kv in per_query_kv[i]])
        v = np.concatenate([kv[1] for kv in per_query_kv[i]])
        o, s = dense_attention(q[i:i + 1], k, v)
        outs.append(o[0])
        lses.append(s[0])
    return np.stack(outs), np.stack(lses)


CASES = {   # name: levels (query groups, kv lengths per group)
    "2-level decode": [([5], [300]), ([1] * 5, [17, 40, 1, 64, 33])],
    "3-level decode": [([6], [100]), ([2, 4], [50, 77]), ([1] * 6, [3, 16, 9, 1, 30, 12])],
    "2-level append": [([9], [129]), ([4, 5], [20, 35])],
}


def _planned(tables, levels_n, hq, hkv, d, ps, dtype="float16", causal=False):
    w = cuattn.MultiLevelCascadeAttentionWrapper(levels_n)
    w.plan([t[0] for t in tables], [t[1] for t in tables], [t[2] for t in tables], [t[3] for t in tables],
           hq, hkv, d, ps, causal=causal, q_data_type=dtype)
    return w


@pytest.mark.parametrize("name", list(CASES))
def test_cascade_equals_attention_over_the_concatenated_kv_on_cpu(name):
    tables, cache, q, per_q = make_cascade(1, CASES[name], 8, 2, 64, 16)
    w = _planned(tables, len(CASES[name]), 8, 2, 64, 16)
    out, lse = w.run(q, cache, return_lse=True)
    want, want_lse = oracle(q, per_q)
    assert rel_err(out, want) < TOL
    assert np.abs(lse - want_lse).max() < 2e-3 * np.abs(want_lse).max()


def test_cascade_causal_applies_to_the_last_level_on_cpu():
    levels = [([4], [50]), ([4], [10])]          # 4 queries appended after a 10-token unique part
    tables, cache, q, per_q = make_cascade(2, levels, 4, 4, 64, 8)
    w = _planned(tables, 2, 4, 4, 64, 8, causal=True)
    out = w.run(q, cache)
    for i in range(4):   # query i sees the whole prefix and unique keys 0 .. 6 + i (bottom-right)
        k = np.concatenate([per_q[i][0][0], per_q[i][1][0][:7 + i]])
        v = np.concatenate([per_q[i][0][1], per_q[i][1][1][:7 + i]])
        assert rel_err(out[i:i + 1], dense_attention(q[i:i + 1], k, v)[0]) < TOL


def test_cascade_levels_are_planned_with_the_cascades_arguments():
    """Every level's plan carries the cascade's sm_scale, dtypes and split arguments (the levels' plan() takes them
    positionally); causal only the last level's; a level a direct plan() of the same kind, same arguments."""
    tables, _, _, _ = make_cascade(5, CASES["3-level decode"], 8, 2, 64, 16)
    w = cuattn.MultiLevelCascadeAttentionWrapper(3)
    w.plan(*([t[i] for t in tables] for i in range(4)), 8, 2, 64, 16, causal=True, sm_scale=0.3,
           q_data_type="bfloat16", kv_data_type="bfloat16", fixed_split_size=100)
    for i, lv in enumerate(w._levels):
        p = lv._plan
        assert (p.sm_scale, str(p.q_dtype), str(p.kv_dtype)) == (0.3, "bfloat16", "bfloat16")
        if i < 2:
            assert isinstance(lv, cuattn.BatchPrefillWithPagedKVCacheWrapper) and p.causal == (i == 2)
            direct = cuattn.BatchPrefillWithPagedKVCacheWrapper()
            direct.plan(*tables[i], 8, 2, 64, 16, causal=False, sm_scale=0.3, q_data_type="bfloat16",
                        kv_data_type="bfloat16", fixed_split_size=100)
        else:
            assert isinstance(lv, cuattn.BatchDecodeWithPagedKVCacheWrapper)
            direct = cuattn.BatchDecodeWithPagedKVCacheWrapper()
            direct.plan(*tables[i][1:], 8, 2, 64, 16, sm_scale=0.3, q_data_type="bfloat16", kv_data_type="bfloat16",
                        fixed_split_size=100)
        assert lv.describe() == direct.describe()


def test_cascade_keeps_a_shared_level_planned_with_the_same_values():
    """A shared level whose arguments have the values of its last plan keeps that plan (no plan() of the level); any
    other value (a page id, a dtype, a split argument) plans it again. Either way every level equals a fresh
    cascade's, and the output is the oracle's."""
    tables, cache, q, per_q = make_cascade(6, CASES["3-level decode"], 8, 2, 64, 16)
    w = cuattn.MultiLevelCascadeAttentionWrapper(3)
    moved = [t[:2] + [t[2][::-1].copy()] + t[3:] for t in tables[:2]] + [tables[2]]
    steps = [(tables, {}, 0), ([[a.copy() for a in t] for t in tables], {}, 2),
             ([[a.astype(np.int64) for a in t] for t in tables], {}, 0), (tables, {}, 0), (tables, {}, 2),
             (tables, dict(causal=True), 2), (tables, dict(fixed_split_size=64), 0), (moved, {}, 0),
             (moved, {}, 2)]   # (causal: the last level's only; the shared levels' arguments are the same)
    for t, kw, kept in steps:
        before = [lv and lv._plan for lv in w._levels]
        w.plan(*([x[i] for x in t] for i in range(4)), 8, 2, 64, 16, **kw)
        assert sum(lv._plan is p for lv, p in zip(w._levels[:2], before)) == kept
        fresh = cuattn.MultiLevelCascadeAttentionWrapper(3)
        fresh.plan(*([x[i] for x in t] for i in range(4)), 8, 2, 64, 16, **kw)
        assert w.describe() == fresh.describe()
        for lv, ref in zip(w._levels, fresh._levels):
            for f in ("kv_lens", "qo_indptr", "kv_indptr", "kv_indices", "last_page_len"):
                assert np.array_equal(getattr(lv._plan, f), getattr(ref._plan, f))
        if t is tables and not kw:
            assert rel_err(w.run(q, cache), oracle(q, per_q)[0]) < TOL


def test_merge_state_in_place_with_mask_on_cpu():
    rng = np.random.default_rng(3)
    v, vo = (rng.standard_normal((6, 4, 64)).astype(np.float16) for _ in range(2))
    s, so = (rng.standard_normal((6, 4)).astype(np.float32) for _ in range(2))
    want_v, want_s = cuattn.merge_state(v, s, vo, so)
    mask = np.array([1, 0, 1, 1, 0, 1], bool)
    v0, s0 = v.copy(), s.copy()
    cuattn.merge_state_in_place(v, s, vo, so, mask=mask)
    assert np.array_equal(v[mask], want_v[mask]) and np.array_equal(s[mask], want_s[mask])
    assert np.array_equal(v[~mask], v0[~mask]) and np.array_equal(s[~mask], s0[~mask])
    with pytest.raises(ValueError, match="mask must have shape"):
        cuattn.merge_state_in_place(v, s, vo, so, mask=mask[:3])


def test_cascade_rejects_bad_plans():
    with pytest.raises(ValueError, match="num_levels"):
        cuattn.MultiLevelCascadeAttentionWrapper(0)
    tables, cache, q, _ = make_cascade(1, CASES["2-level decode"], 8, 2, 64, 16)
    w = cuattn.MultiLevelCascadeAttentionWrapper(2)
    with pytest.raises(ValueError, match="list of num_levels=2"):
        w.plan([tables[0][0]], [t[1] for t in tables], [t[2] for t in tables], [t[3] for t in tables], 8, 2, 64, 16)
    bad = [tables[0][0], np.array([0, 1, 2, 3], np.int32)]
    with pytest.raises(ValueError):
        w.plan(bad, [t[1] for t in tables], [t[2] for t in tables], [t[3] for t in tables], 8, 2, 64, 16)
    with pytest.raises(ValueError, match="plan\\(\\) must be called"):
        cuattn.MultiLevelCascadeAttentionWrapper(2).run(q, cache)


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_cascade_equals_attention_over_the_concatenated_kv_on_gpu(name, dtype):
    import cupy as cp
    dt = np.float16 if dtype == "float16" else ml_dtypes.bfloat16
    tables, cache, q, per_q = make_cascade(4, CASES[name], 32, 8, 128, 16, dt)
    w = _planned(tables, len(CASES[name]), 32, 8, 128, 16, dtype)
    raw = np.uint16
    qd = cp.asarray(q.view(raw)) if dtype == "bfloat16" else cp.asarray(q)
    cd = cp.asarray(cache.view(raw)) if dtype == "bfloat16" else cp.asarray(cache)
    out = cp.full(q.shape, np.nan, np.float16).view(raw) if dtype == "bfloat16" else cp.full(q.shape, np.nan, np.float16)
    lse = cp.full(q.shape[:2], np.nan, np.float32)
    w.run(qd, cd, out=out, lse=lse, return_lse=True)
    o = cp.asnumpy(out)
    o = o.view(ml_dtypes.bfloat16) if dtype == "bfloat16" else o
    want, want_lse = oracle(q, per_q)
    assert rel_err(o.astype(np.float32), want) < TOL
    assert np.abs(cp.asnumpy(lse) - want_lse).max() < 2e-3 * np.abs(want_lse).max()
