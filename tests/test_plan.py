import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from cuattn import plan
from cuattn.page import validate_page_table


def _page_table(lens, page_size, rng):
    pages = [-(-n // page_size) for n in lens]
    indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
    indices = rng.permutation(int(indptr[-1])).astype(np.int32)
    lpl = np.array([n - (p - 1) * page_size if p else 0 for n, p in zip(lens, pages)], np.int32)
    return indptr, indices, lpl


def _covered(wl, indptr, indices, page_size, num_heads_work):
    """Multiset of (request, head tile, page, slot) the grid touches."""
    seen = []
    for req, base, start, end, slot, *_ in wl.work:
        for h in range(num_heads_work):
            for pos in range(start, end):
                page = indices[base + pos // page_size]
                seen.append((req, h, page, pos % page_size))
    return seen


@settings(max_examples=60, deadline=None)
@given(lens=st.lists(st.integers(1, 5000), min_size=1, max_size=6), page_size=st.integers(1, 64),
       heads=st.integers(1, 4), sms=st.integers(1, 200), fixed=st.one_of(st.none(), st.integers(1, 3000)),
       align=st.sampled_from([1, 16]), seed=st.integers(0, 2**31))
def test_decode_work_list_covers_every_request_head_token_exactly_once(lens, page_size, heads, sms, fixed, align,
                                                                       seed):
    rng = np.random.default_rng(seed)
    indptr, indices, lpl = _page_table(lens, page_size, rng)
    kv_lens = validate_page_table("t", indptr, lpl, page_size, len(indices))
    assert kv_lens.tolist() == lens
    chunk = fixed if fixed is not None else plan.choose_chunk(kv_lens, heads, sms, 2)
    wl = plan.decode_work_list(indptr, kv_lens, chunk, align=align)
    # every piece lies inside its request, starts at a multiple of align (the TMA kernel's
    # 16-slot boxes) and respects the chunk size
    for req, base, start, end, slot, *_ in wl.work:
        assert base == indptr[req] and 0 <= start <= end <= kv_lens[req] and start % align == 0
        if chunk:
            assert end - start <= max(chunk + plan.BLOCK_N, chunk * 2)
    seen = _covered(wl, indptr, indices, page_size, heads)
    expect = [(r, h, indices[indptr[r] + p // page_size], p % page_size)
              for r, n in enumerate(lens) for h in range(heads) for p in range(n)]
    assert len(seen) == len(expect) == len(set(seen))
    assert set(seen) == set(expect)
    # slots: split requests own a contiguous slot range that the merge rows name
    for req, s0, s1, _ in wl.merge:
        slots = sorted(int(w[4]) for w in wl.work if w[0] == req)
        assert slots == list(range(s0, s1))
    unsplit = {int(w[0]) for w in wl.work if w[4] < 0}
    assert unsplit.isdisjoint({int(m[0]) for m in wl.merge})
    assert wl.num_slots == sum(int(m[2] - m[1]) for m in wl.merge)
    # fused merge: every piece of a split request names its merge row, first slot and piece count
    for w in wl.work:
        if w[4] >= 0:
            req, s0, s1, _ = wl.merge[w[5]]
            assert (req, s0, s1 - s0) == (w[0], w[6], w[7])
            assert sum(1 for x in wl.work if x[0] == w[0]) == w[7]


def test_choose_chunk_splits_batch1_long_context_to_fill_the_gpu():
    chunk = plan.choose_chunk(np.array([32768]), 8, 132, 2)
    wl = plan.decode_work_list(np.array([0, 2048]), np.array([32768]), chunk)
    assert 0.9 * 264 <= len(wl.work) * 8 <= 264


def test_choose_chunk_does_not_split_a_uniform_batch_that_fills_the_gpu():
    assert plan.choose_chunk(np.full(64, 32768), 8, 132, 2) == 0
    assert plan.choose_chunk(np.full(256, 512), 8, 132, 2) == 0


def test_choose_chunk_splits_until_every_sm_holds_ctas_per_sm_ctas():
    lens = np.full(16, 32768)
    chunk = plan.choose_chunk(lens, 8, 132, 2)
    wl = plan.decode_work_list(np.arange(17) * 2048, lens, chunk)
    assert 0.9 * 264 <= len(wl.work) * 8 <= 264      # one full wave, no mostly empty second one


def test_choose_chunk_keeps_short_requests_whole_once_every_sm_has_a_cta():
    assert plan.choose_chunk(np.full(16, 512), 8, 132, 2) == 0        # 128 CTAs: no split
    assert plan.choose_chunk(np.full(16, 2048), 8, 132, 2) == 1024    # long enough pieces: split
    assert plan.choose_chunk(np.array([512]), 8, 132, 2) == 128       # idle GPU: split short too


def test_choose_chunk_splits_the_long_request_of_a_skewed_batch():
    lens = np.array([32768] + [512] * 63)
    chunk = plan.choose_chunk(lens, 8, 132, 2)
    assert 0 < chunk <= 4096


def test_empty_request_gets_one_empty_piece():
    wl = plan.decode_work_list(np.array([0, 0, 1]), np.array([0, 5]), 0)
    assert sorted((int(w[0]), int(w[2]), int(w[3])) for w in wl.work) == [(0, 0, 0), (1, 0, 5)]


@pytest.mark.parametrize("indptr,lpl,match", [
    ([0, 2, 1], [1, 1], "non-decreasing"),
    ([0, 1, 2], [0, 1], "last_page_len must be in 1..page_size"),
    ([0, 1, 2], [1, 17], "last_page_len must be in 1..page_size"),
    ([0, 1, 3], [1, 1], "indptr\\[-1\\] must equal len\\(indices\\)"),
    ([0, 1, 2], [1], "last_page_len must have shape"),
])
def test_validate_page_table_rejects_bad_metadata(indptr, lpl, match):
    with pytest.raises(ValueError, match=match):
        validate_page_table("f", np.array(indptr), np.array(lpl), 16, 2)


@pytest.mark.parametrize("dtype", ["int32", "int64", "uint32", "uint64", "int16"])
def test_validate_page_table_lengths_of_any_int_dtype_and_of_requests_without_pages(dtype):
    # a request without pages may hold any last_page_len (0, or past page_size): its kv_len is 0
    indptr = np.array([0, 3, 3, 4, 4, 6], dtype)
    lpl = np.array([16, 0, 1, 17, 5], dtype)
    assert validate_page_table("f", indptr, lpl, 16, 6).tolist() == [48, 0, 1, 0, 21]
    assert validate_page_table("f", np.array([0], dtype), np.zeros(0, dtype), 16, 0).tolist() == []
    bad = lpl.copy()
    bad[3], bad[4] = 3, 0
    with pytest.raises(ValueError, match=r"last_page_len\[4\]=0"):
        validate_page_table("f", indptr, bad, 16, 6)


def test_validate_page_table_raises_the_first_failing_check():
    # non-decreasing is checked before indptr[-1] == len(indices), the shape before the dtype
    with pytest.raises(ValueError, match="non-decreasing"):
        validate_page_table("f", np.array([0, 2, 1]), np.array([1, 1]), 16, 5)
    with pytest.raises(ValueError, match="must have shape"):
        validate_page_table("f", np.array([0.0, 2.0]), np.array([1, 1]), 16, 2)
    with pytest.raises(TypeError, match="integer arrays"):
        validate_page_table("f", np.array([0.0, 2.0]), np.array([1]), 16, 2)
    with pytest.raises(ValueError, match="1-D"):
        validate_page_table("f", np.array(0), np.array([1]), 16, 2)
    with pytest.raises(ValueError, match=r"kv_indptr\[0\] must be 0"):
        validate_page_table("f", np.array([1, 2]), np.array([1]), 16, 2, prefix="kv_")


# ---------------------------------------------------------------------------- prefill


def test_prefill_work_list_puts_longest_causal_tiles_first():
    wl = plan.prefill_work_list(np.array([300, 40]), np.array([300, 1000]), 1, 128, 64, True)
    assert sorted(map(tuple, wl.work[:, :2].tolist())) == [(0, 0), (0, 1), (0, 2), (1, 0)]
    assert tuple(wl.work[0, :2]) == (1, 0) and tuple(wl.work[-1, :2]) == (0, 0)
    assert (wl.work[:, 3] == -1).all() and not wl.split


def _prefill_keys(wl, qo_lens, kv_lens, group, block_m, causal):
    """Multiset of (request, packed query row, key) the work rows attend, from the kernel's rule:
    piece p of an item reads keys [p * chunk, (p + 1) * chunk) below its tile's causal end."""
    seen = []
    for req, tile, piece, slot in wl.work.tolist():
        qo, kv = int(qo_lens[req]), int(kv_lens[req])
        rows = range(tile * block_m, min((tile + 1) * block_m, qo * group))
        end = kv
        if causal:
            end = min(kv, min(qo - 1, ((tile + 1) * block_m - 1) // group) + kv - qo + 1)
        lo, hi = (piece * wl.chunk, min(end, (piece + 1) * wl.chunk)) if wl.chunk else (0, end)
        for r in rows:
            for key in range(lo, hi):
                if not causal or key <= r // group + kv - qo:
                    seen.append((req, r, key))
    return seen


@settings(max_examples=40, deadline=None)
@given(qo=st.lists(st.integers(0, 300), min_size=1, max_size=5), extra=st.lists(st.integers(0, 3000), min_size=5,
       max_size=5), group=st.sampled_from([1, 4, 7]), causal=st.booleans(), heads=st.integers(1, 8),
       sms=st.integers(1, 132), fixed=st.one_of(st.none(), st.sampled_from([64, 512, 1024])))
def test_prefill_work_list_covers_every_request_row_key_exactly_once(qo, extra, group, causal, heads, sms, fixed):
    qo_lens = np.array(qo, np.int64)
    kv_lens = qo_lens + np.array(extra[:len(qo)], np.int64)          # kv_len >= qo_len (append / prefill)
    block_m, block_n = 128, 64
    ext = plan.prefill_items(qo_lens, kv_lens, group, block_m, causal)[2]
    chunk = fixed if fixed is not None else plan.choose_prefill_chunk(ext, heads, sms, 2, block_n)
    assert chunk % block_n == 0
    wl = plan.prefill_work_list(qo_lens, kv_lens, group, block_m, block_n, causal, chunk)
    seen = _prefill_keys(wl, qo_lens, kv_lens, group, block_m, causal)
    expect = [(r, row, key) for r in range(len(qo)) for row in range(int(qo_lens[r]) * group)
              for key in range(int(kv_lens[r])) if not causal or key <= row // group + kv_lens[r] - qo_lens[r]]
    assert len(seen) == len(expect) == len(set(seen)) and set(seen) == set(expect)
    # pieces of split items own distinct slots, and every split item has one merge row naming them
    slots = wl.work[wl.work[:, 3] >= 0]
    assert len(set(slots[:, 3].tolist())) == len(slots) == wl.num_slots
    for req, tile, first, n in wl.merge.tolist():
        mine = slots[(slots[:, 0] == req) & (slots[:, 1] == tile)]
        assert sorted(mine[:, 3].tolist()) == list(range(first, first + n)) and n > 1
    assert 0 < wl.balance(block_n) <= 1


def test_choose_prefill_chunk_splits_a_shared_prefix_over_the_gpu():
    """128 decode queries of a 4:1 GQA group over a 32k prefix: 4 query tiles x 8 kv heads fill 32 of
    264 CTA slots unsplit; split, ~one wave of pieces."""
    ext = plan.prefill_items(np.array([128]), np.array([32768]), 4, 128, False)[2]
    chunk = plan.choose_prefill_chunk(ext, 8, 132, 2, 64)
    wl = plan.prefill_work_list(np.array([128]), np.array([32768]), 4, 128, 64, False, chunk)
    assert 200 <= len(wl.work) * 8 <= 264 and wl.balance(64) > 0.95


def test_choose_prefill_chunk_keeps_a_batch_that_fills_the_gpu_whole():
    ext = plan.prefill_items(np.full(64, 2048), np.full(64, 2048), 4, 128, True)[2]
    assert plan.choose_prefill_chunk(ext, 8, 132, 2, 64) == 0


def test_choose_prefill_chunk_grows_pieces_to_fit_a_fixed_workspace():
    ext = plan.prefill_items(np.array([128]), np.array([32768]), 4, 128, False)[2]
    free = plan.choose_prefill_chunk(ext, 8, 132, 2, 64)
    fixed = plan.choose_prefill_chunk(ext, 8, 132, 2, 64, max_slots=10)
    assert fixed > free and int(np.where(ext > fixed, -(-ext // fixed), 0).sum()) <= 10
    assert plan.choose_prefill_chunk(ext, 8, 132, 2, 64, max_slots=1) == 0


# ---------------------------------------------------------------------------- vectorised = loop reference
# plan()'s work lists are built with NumPy (a few dozen array calls per plan, whatever the batch);
# these loops state what they build, one request / item / piece at a time.


def _decode_work_list_loop(indptr, kv_lens, chunk, block_n, align):
    lens = [int(n) for n in kv_lens]
    if chunk <= 0 or (lens and max(lens) <= chunk):
        rows = [(r, int(indptr[r]), 0, n, -1, 0, 0, 0) for r, n in enumerate(lens)]
        return sorted(rows, key=lambda w: -(w[3] - w[2])), [], 0
    rows, merge, slot = [], [], 0
    for r, n in enumerate(lens):
        pieces = max(1, -(-n // chunk))
        piece = -(-n // pieces)
        piece = max(-(-piece // block_n) * block_n if piece > block_n else -(-piece // align) * align, 1)
        pieces = max(1, -(-n // piece))
        for k in range(pieces):
            split = pieces > 1
            rows.append((r, int(indptr[r]), k * piece, min(k * piece + piece, n), slot + k if split else -1,
                         len(merge) if split else 0, slot if split else 0, pieces if split else 0))
        if pieces > 1:
            merge.append((r, slot, slot + pieces, 0))
            slot += pieces
    return sorted(rows, key=lambda w: -(w[3] - w[2])), merge, slot       # sorted(): stable, longest first


def _prefill_items_loop(qo_lens, kv_lens, group, block_m, causal):
    items = []
    for r, (q, k) in enumerate(zip(qo_lens.tolist(), kv_lens.tolist())):
        for t in range(-(-q * group // block_m)):
            last_row = min(q - 1, ((t + 1) * block_m - 1) // group)        # the tile's last query
            items.append((r, t, min(max(last_row + k - q + 1, 0), k) if causal else k))
    return items


def _prefill_work_list_loop(items, block_n, chunk):
    if chunk <= 0 or (items and max(e for *_, e in items) <= chunk):
        rows = sorted([((r, t, 0, -1), e) for r, t, e in items], key=lambda x: -(-(-x[1] // block_n)))
        return [w for w, _ in rows], [e for _, e in rows], [], 0
    rows, merge, slot = [], [], 0
    for r, t, e in items:
        pieces = max(1, -(-e // chunk))
        for k in range(pieces):
            rows.append(((r, t, k, slot + k if pieces > 1 else -1), min(max(e - k * chunk, 0), chunk)))
        if pieces > 1:
            merge.append((r, t, slot, pieces))
            slot += pieces
    rows.sort(key=lambda x: -(-(-x[1] // block_n)))
    return [w for w, _ in rows], [e for _, e in rows], merge, slot


@settings(max_examples=150, deadline=None)
@given(lens=st.lists(st.integers(0, 6000), min_size=1, max_size=40), chunk=st.sampled_from([0, 1, 50, 128, 700, 4096]),
       block_n=st.sampled_from([32, 64, 128]), align=st.sampled_from([1, 16]))
def test_decode_work_list_equals_the_loop_reference(lens, chunk, block_n, align):
    kv_lens = np.array(lens, np.int64)
    indptr = np.concatenate([[0], np.cumsum(-(-kv_lens // 16))])
    wl = plan.decode_work_list(indptr, kv_lens, chunk, block_n, align)
    rows, merge, slots = _decode_work_list_loop(indptr, kv_lens, chunk, block_n, align)
    assert wl.work.dtype == np.int32 and wl.work.tolist() == [list(w) for w in rows]
    assert wl.merge.tolist() == [list(m) for m in merge] and wl.num_slots == slots
    # the lengths' range handed in (decode.plan reads it once): the same list
    given_bounds = plan.decode_work_list(indptr, kv_lens, chunk, block_n, align, (min(lens), max(lens)))
    assert given_bounds.work.tolist() == wl.work.tolist() and given_bounds.merge.tolist() == wl.merge.tolist()
    assert wl.chunk == (chunk if merge or (chunk > 0 and max(lens) > chunk) else 0)


@settings(max_examples=150, deadline=None)
@given(qo=st.lists(st.integers(0, 400), min_size=0, max_size=30), extra=st.lists(st.integers(0, 5000), min_size=30,
       max_size=30), group=st.sampled_from([1, 2, 4, 7, 8]), block_m=st.sampled_from([64, 128]),
       block_n=st.sampled_from([32, 64, 128]), causal=st.booleans(), chunk=st.sampled_from([0, 64, 512, 1024, 4096]))
def test_prefill_work_list_equals_the_loop_reference(qo, extra, group, block_m, block_n, causal, chunk):
    qo_lens = np.array(qo, np.int64)
    kv_lens = qo_lens + np.array(extra[:len(qo)], np.int64)
    req, tile, ext = plan.prefill_items(qo_lens, kv_lens, group, block_m, causal)
    items = _prefill_items_loop(qo_lens, kv_lens, group, block_m, causal)
    assert list(zip(req.tolist(), tile.tolist(), ext.tolist())) == items
    if qo:          # qo_lens' range handed in (prefill / MLA plan() read it once): the same items
        r2, t2, e2 = plan.prefill_items(qo_lens, kv_lens, group, block_m, causal, (min(qo), max(qo)))
        assert list(zip(r2.tolist(), t2.tolist(), e2.tolist())) == items
    wl = plan.prefill_work_list(qo_lens, kv_lens, group, block_m, block_n, causal, chunk)
    rows, extents, merge, slots = _prefill_work_list_loop(items, block_n, chunk)
    assert wl.work.dtype == np.int32 and wl.work.tolist() == [list(w) for w in rows]
    assert wl.extents.tolist() == extents and wl.merge.tolist() == [list(m) for m in merge]
    assert wl.num_slots == slots and wl.chunk == (chunk if merge else 0)


UNIFORM = [   # (qo_lens, group, block_m): every request the same number of query tiles (prefill_items' grid path)
    ([64] * 5, 4, 128), ([60, 64, 33], 4, 128), ([1, 16, 9], 4, 64), ([300, 290, 257], 1, 128), ([100, 92], 7, 128),
    ([5], 8, 64)]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("qo,group,block_m", UNIFORM, ids=[f"q{len(q)}x{q[0]}-g{g}-bm{m}" for q, g, m in UNIFORM])
def test_prefill_items_of_a_uniform_batch_equal_the_loop_reference(qo, group, block_m, causal):
    qo_lens = np.array(qo, np.int64)
    tiles = -(-qo_lens * group // block_m)
    assert tiles.min() == tiles.max()
    kv_lens = qo_lens + np.array([0, 7, 3000, 65, 1][:len(qo)], np.int64)
    expect = _prefill_items_loop(qo_lens, kv_lens, group, block_m, causal)
    for qo_range in (None, (min(qo), max(qo))):
        r, t, e = plan.prefill_items(qo_lens, kv_lens, group, block_m, causal, qo_range)
        assert list(zip(r.tolist(), t.tolist(), e.tolist())) == expect
    req, tile, ext = plan.prefill_items(qo_lens, kv_lens, group, block_m, causal, (min(qo), max(qo)))
    ext[:] = -7                   # the extents are the caller's to keep: not a view of kv_lens
    assert kv_lens.min() >= 0


@settings(max_examples=100, deadline=None)
@given(values=st.lists(st.integers(-2**31, 2**31 - 1), max_size=12),
       dtype=st.sampled_from(["int32", "int64", "uint32"]), step=st.integers(1, 2))
def test_max_index_is_the_max_or_none_when_a_value_is_negative(values, dtype, step):
    ids = np.array([v % 2**32 if dtype == "uint32" else v for v in values], dtype)[::step]
    want = -1 if not len(ids) else None if ids.min() < 0 else int(ids.max())
    assert plan.max_index(ids) == want


@pytest.mark.parametrize("hi", [1, 40, 32767, 32768, 10 ** 6])
def test_descending_is_the_stable_argsort_of_the_negated_keys(hi):
    """The work lists' order (longest first, ties in input order) whether the keys fit the 16-bit radix sort
    (hi <= 32767) or not: every tie kept in input order."""
    rng = np.random.default_rng(hi)
    for n in (1, 2, 7, 512, 3000):
        keys = rng.integers(0, hi + 1, n)
        keys[rng.integers(0, n)] = hi
        got = plan.descending(keys, int(keys.min()), int(keys.max()))
        assert got.tolist() == np.argsort(-keys, kind="stable").tolist()
        assert got.tolist() == sorted(range(n), key=lambda i: (-int(keys[i]), i))


@settings(max_examples=100, deadline=None)
@given(values=st.lists(st.integers(-2**40, 2**40), min_size=1, max_size=80),
       dtype=st.sampled_from(["int32", "int64", "float64"]))
def test_int_reductions_equal_numpys_on_short_and_long_arrays(values, dtype):
    """plan.int_bounds / int_top / int_min: Python ints equal to NumPy's reductions, through a list (<= 32
    values) or the ufuncs (longer), for int32 / int64 lengths and the float64 extents of a float page size."""
    a = np.array(values, np.int64).astype(dtype) if dtype != "int32" else np.array(values, np.int64).astype(np.int32)
    lo, hi, total = int(a.min()), int(a.max()), int(a.sum())
    assert plan.int_bounds(a) == (lo, hi) and plan.int_bounds(a, True) == (lo, hi, total)
    assert plan.int_top(a) == (hi, total) and plan.int_min(a) == lo
    assert all(type(v) is int for v in plan.int_bounds(a, True) + plan.int_top(a) + (plan.int_min(a),))


@settings(max_examples=300, deadline=None)
@given(pages=st.lists(st.integers(-2, 4), min_size=1, max_size=40), lpl=st.lists(st.integers(-1, 6), min_size=1,
       max_size=40), page_size=st.integers(1, 5), dtype=st.sampled_from([np.int32, np.int64, np.uint32]))
def test_validate_page_table_of_a_short_table_equals_the_numpy_path(pages, lpl, page_size, dtype):
    """A table of <= plan.SHORT requests is checked as Python ints: the NumPy path's kv_lens, or its first error."""
    from cuattn import page
    n = min(len(pages), len(lpl))
    ip = np.concatenate([[0], np.cumsum(pages[:n])])
    last = np.array(lpl[:n])
    if dtype == np.uint32:
        ip, last = np.maximum.accumulate(ip), np.abs(last)
    indptr, last = ip.astype(dtype), last.astype(dtype)

    def outcome(f):
        try:
            return f().tolist()
        except ValueError as e:
            return str(e)
    got = outcome(lambda: validate_page_table("f", indptr, last, page_size, int(indptr[-1]), prefix="kv_"))
    assert got == outcome(lambda: page._kv_lens("f", indptr, last, page_size, int(indptr[-1]), "kv_"))


@settings(max_examples=150, deadline=None)
@given(qo=st.lists(st.integers(0, 300), min_size=1, max_size=40), kv=st.lists(st.integers(0, 40000), min_size=40,
       max_size=40), group=st.sampled_from([1, 4, 8]), block=st.sampled_from([(64, 64), (128, 128), (128, 64)]),
       causal=st.booleans(), heads=st.sampled_from([1, 8]), sms=st.sampled_from([8, 132]),
       max_slots=st.sampled_from([None, 40]), split=st.sampled_from([(None, False), (700, False), (None, True)]),
       softmax=st.booleans())
def test_prefill_schedule_of_a_short_batch_is_kept_and_equals_the_computed_one(qo, kv, group, block, causal, heads,
                                                                               sms, max_slots, split, softmax):
    """A short batch's schedule (<= plan.SHORT requests) is kept per its arguments' values, read-only, and is what
    the schedule computes for them (a longer batch's is computed every time)."""
    qo_lens, kv_lens = np.array(qo, np.int64), np.array(kv[:len(qo)], np.int64)
    if causal:
        kv_lens = np.maximum(kv_lens, qo_lens)
    qo_range = (int(qo_lens.min()), int(qo_lens.max()))
    args = (group, *block, causal, heads, sms, 2 * sms, max_slots, *split, softmax)
    plan._SCHEDULES.clear()
    why, wl = plan.prefill_schedule(qo_lens, kv_lens, qo_range, *args)
    want_why, want = plan._prefill_schedule(qo_lens.copy(), kv_lens.copy(), qo_range, *args)
    assert why == want_why and (wl.num_slots, wl.chunk) == (want.num_slots, want.chunk)
    for a, b in ((wl.work, want.work), (wl.merge, want.merge), (wl.extents, want.extents)):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    again = plan.prefill_schedule(qo_lens.copy(), kv_lens.copy(), qo_range, *args)
    short = len(qo) <= plan.SHORT
    assert (again[1] is wl) == short and wl.work.flags.writeable != short
