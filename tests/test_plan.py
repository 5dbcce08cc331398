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
