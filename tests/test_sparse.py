"""Block-sparse attention (BlockSparseAttentionWrapper, VariableBlockSparseAttentionWrapper) and mixed
prefill + decode batches (BatchAttention) against float64 attention over each row block's gathered
keys (tests/oracle.py), on the NumPy path and (gpu) on the GPU."""
import inspect

import ml_dtypes
import numpy as np
import pytest

import cuattn

from .oracle import dense_attention, rel_err
from .test_prefill import _paged_inputs, rand

TOL = 5e-3


def bsr_case(seed, M, N, R, C, hq, hkv, d, density, with_mask):
    rng = np.random.default_rng(seed)
    mb, nb = -(-M // R), N // C
    dense = rng.random((mb, nb)) < density
    dense[:, 0] |= ~dense.any(1)                                     # every row block attends somewhere
    indptr = np.concatenate([[0], np.cumsum(dense.sum(1))]).astype(np.int32)
    indices = np.nonzero(dense)[1].astype(np.int32)
    mask = rng.random((len(indices), R, C)) < 0.7 if with_mask else None
    q, k, v = rand(rng, (M, hq, d), np.float16), rand(rng, (N, hkv, d), np.float16), rand(rng, (N, hkv, d), np.float16)
    return indptr, indices, mask, q, k, v


def bsr_oracle(indptr, indices, mask, q, k, v, R, C, causal):
    """Each row block attends to its blocks' keys gathered in index order (the paged form)."""
    outs, lses = [], []
    for i in range(len(indptr) - 1):
        rows = slice(i * R, min((i + 1) * R, q.shape[0]))
        keys = np.concatenate([np.arange(b * C, (b + 1) * C) for b in indices[indptr[i]:indptr[i + 1]]])
        m = None
        if mask is not None:
            n = rows.stop - rows.start
            m = mask[indptr[i]:indptr[i + 1], :n].transpose(1, 0, 2).reshape(n, -1)
        o, s = dense_attention(q[rows], k[keys], v[keys], causal=causal, mask=m)
        outs.append(o)
        lses.append(s)
    return np.concatenate(outs), np.concatenate(lses)


BSR_CASES = [  # (M, N, R, C, heads, density, mask, causal)
    (200, 256, 64, 64, (8, 2), 0.5, False, False),
    (130, 192, 16, 32, (4, 4), 0.4, True, False),
    (37, 128, 1, 16, (8, 2), 0.3, False, True),
]


@pytest.mark.parametrize("M,N,R,C,heads,density,with_mask,causal", BSR_CASES)
def test_block_sparse_numpy_matches_gathered_key_attention(M, N, R, C, heads, density, with_mask, causal):
    indptr, indices, mask, q, k, v = bsr_case(1, M, N, R, C, *heads, 64, density, with_mask)
    w = cuattn.BlockSparseAttentionWrapper()
    w.plan(indptr, indices, M, N, R, C, heads[0], heads[1], 64, mask=mask, causal=causal)
    out, lse = w.run(q, k, v, return_lse=True)
    ref_o, ref_s = bsr_oracle(indptr, indices, mask, q, k, v, R, C, causal)
    assert rel_err(out, ref_o) < TOL
    finite = np.isfinite(ref_s)
    assert np.array_equal(np.isfinite(lse), finite) and np.abs(lse[finite] - ref_s[finite]).max() < 1e-3


def test_block_sparse_rejects_bad_plans():
    indptr, indices, mask, q, k, v = bsr_case(2, 64, 128, 32, 32, 4, 2, 64, 0.5, True)
    w = cuattn.BlockSparseAttentionWrapper()
    with pytest.raises(ValueError, match="N must be a multiple of C"):
        w.plan(indptr, indices, 64, 120, 32, 32, 4, 2, 64)
    with pytest.raises(ValueError, match=r"indptr must have ceil\(M / R\) \+ 1"):
        w.plan(indptr, indices, 100, 128, 32, 32, 4, 2, 64)
    with pytest.raises(ValueError, match="indices must be in 0..N / C - 1"):
        w.plan(indptr, indices + 4, 64, 128, 32, 32, 4, 2, 64)
    with pytest.raises(ValueError, match="mask must have shape"):
        w.plan(indptr, indices, 64, 128, 32, 32, 4, 2, 64, mask=mask[:, :3])
    with pytest.raises(cuattn.UnsupportedError, match="o_data_type"):
        w.plan(indptr, indices, 64, 128, 32, 32, 4, 2, 64, o_data_type="float32")
    with pytest.raises(ValueError, match="plan"):
        cuattn.BlockSparseAttentionWrapper().run(q, k, v)
    w.plan(indptr, indices, 64, 128, 32, 32, 4, 2, 64)
    with pytest.raises(ValueError, match="k must have shape"):
        w.run(q, k[:64], v)


def test_block_sparse_output_dtype_defaults_to_q_dtype():
    """o_data_type=None (the default) is q_data_type's, so a bf16 (or fp32) q plans without naming it; an explicit
    o_data_type other than q's is refused (no kernel writes another dtype). FlashInfer 0.6.4 defaults to
    "float16"; the wrapper over variable blocks takes no o_data_type (out has q's dtype, as FlashInfer's)."""
    bf16 = np.dtype(ml_dtypes.bfloat16)
    indptr, indices, mask, q, k, v = bsr_case(5, 64, 128, 32, 32, 4, 2, 64, 0.5, True)
    q, k, v = q.astype(bf16), k.astype(bf16), v.astype(bf16)
    ref_o, _ = bsr_oracle(indptr, indices, mask, q, k, v, 32, 32, False)
    w = cuattn.BlockSparseAttentionWrapper()
    for o_dt in (None, "bfloat16"):
        w.plan(indptr, indices, 64, 128, 32, 32, 4, 2, 64, mask=mask, q_data_type="bfloat16", o_data_type=o_dt)
        out = w.run(q, k, v)
        assert out.dtype == bf16 and rel_err(out.astype(np.float64), ref_o) < 1e-2
    with pytest.raises(cuattn.UnsupportedError, match=r"o_data_type must be q_data_type \(bfloat16\), got float16"):
        w.plan(indptr, indices, 64, 128, 32, 32, 4, 2, 64, q_data_type="bfloat16", o_data_type="float16")
    w.plan(indptr, indices, 64, 128, 32, 32, 4, 2, 64, mask=mask, q_data_type="float32", kv_data_type="bfloat16")
    out32 = w.run(q.astype(np.float32), k, v)
    assert out32.dtype == np.float32 and rel_err(out32, ref_o) < 1e-2
    assert "o_data_type" not in inspect.signature(cuattn.VariableBlockSparseAttentionWrapper.plan).parameters


def variable_case(seed, hq, hkv, d, row_sz, col_sz, density):
    rng = np.random.default_rng(seed)
    row_sz, col_sz = np.array(row_sz, np.int32), np.array(col_sz, np.int32)
    bmap = rng.random((hkv, row_sz.shape[1], col_sz.shape[1])) < density
    bmap[:, :, 0] = True
    lq, lk = int(row_sz[0].sum()), int(col_sz[0].sum())
    q, k, v = rand(rng, (hq, lq, d), np.float16), rand(rng, (hkv, lk, d), np.float16), rand(rng, (hkv, lk, d), np.float16)
    return bmap, row_sz, col_sz, q, k, v


def variable_oracle(bmap, row_sz, col_sz, q, k, v, causal):
    hq, hkv = q.shape[0], k.shape[0]
    g = hq // hkv
    out, lse = np.zeros(q.shape), np.zeros(q.shape[:2])
    for h in range(hkv):
        r0 = np.concatenate([[0], np.cumsum(row_sz[h])])
        c0 = np.concatenate([[0], np.cumsum(col_sz[h])])
        for r in range(bmap.shape[1]):
            keys = np.concatenate([np.arange(c0[c], c0[c + 1]) for c in np.nonzero(bmap[h, r])[0]] + [[]]).astype(int)
            rows = np.arange(r0[r], r0[r + 1])
            qq = q[h * g:(h + 1) * g][:, rows].transpose(1, 0, 2)       # (rows, g, d)
            o, s = dense_attention(qq, k[h:h + 1, keys].transpose(1, 0, 2), v[h:h + 1, keys].transpose(1, 0, 2),
                                   causal=causal)
            out[h * g:(h + 1) * g, rows] = o.transpose(1, 0, 2)
            lse[h * g:(h + 1) * g, rows] = s.T
    return out, lse


@pytest.mark.parametrize("causal", [False, True])
def test_variable_block_sparse_numpy_matches_per_head_attention(causal):
    bmap, rows, cols, q, k, v = variable_case(3, 8, 2, 64, [[5, 11, 16], [20, 2, 10]], [[16, 40, 8], [30, 4, 30]], 0.6)
    w = cuattn.VariableBlockSparseAttentionWrapper()
    w.plan(bmap, rows, cols, 8, 2, 64, causal=causal)
    out, lse = w.run(q, k, v, return_lse=True)
    ref_o, ref_s = variable_oracle(bmap, rows, cols, q, k, v, causal)
    assert out.shape == q.shape and rel_err(out, ref_o) < TOL
    assert np.abs(lse - ref_s).max() < 1e-3


def test_variable_block_sparse_rejects_bad_sizes():
    bmap, rows, cols, *_ = variable_case(4, 4, 2, 64, [[4, 4], [2, 6]], [[8, 8], [8, 8]], 0.5)
    w = cuattn.VariableBlockSparseAttentionWrapper()
    with pytest.raises(ValueError, match="sum to the same qo_len"):
        w.plan(bmap, np.array([[4, 4], [2, 7]], np.int32), cols, 4, 2, 64)
    with pytest.raises(ValueError, match="block_col_sz must be"):
        w.plan(bmap, rows, cols[:, :1], 4, 2, 64)


def mixed_case(seed, page_size=16, hq=8, hkv=2, d=64, dtype=np.float16):
    """Two prefill requests (one a chunk appended to a cached prefix) and four decode requests."""
    rng = np.random.default_rng(seed)
    qo_lens, kv_lens = [40, 17, 1, 1, 1, 1], [40, 300, 700, 5, 129, 2000]
    cache, indptr, indices, last, ks, vs = _paged_inputs(rng, kv_lens, page_size, hkv, d, "NHD", dtype)
    qo_indptr = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
    q = rand(rng, (qo_indptr[-1], hq, d), dtype)
    return qo_lens, kv_lens, cache, indptr, indices, last, ks, vs, qo_indptr, q


def test_batch_attention_numpy_mixed_step_equals_separate_wrappers_and_the_oracle():
    qo_lens, kv_lens, cache, indptr, indices, last, ks, vs, qo_indptr, q = mixed_case(5)
    w = cuattn.BatchAttention()
    w.plan(qo_indptr, indptr, indices, np.array(kv_lens, np.int32), 8, 2, 64, 64, 16, causal=True,
           q_data_type="float16", kv_data_type="float16")
    out, lse = w.run(q, cache)
    for b in range(6):
        o, _ = dense_attention(q[qo_indptr[b]:qo_indptr[b + 1]], ks[b], vs[b], causal=True)
        assert rel_err(out[qo_indptr[b]:qo_indptr[b + 1]], o) < TOL
    d = cuattn.BatchDecodeWithPagedKVCacheWrapper()
    d.plan(np.concatenate([[0], indptr[3:] - indptr[2]]).astype(np.int32), indices[indptr[2]:], last[2:], 8, 2, 64, 16)
    np.testing.assert_allclose(out[57:].astype(np.float32), d.run(q[57:], cache).astype(np.float32), atol=2e-3)
    with pytest.raises(ValueError, match="kv_len_arr must fit"):
        w.plan(qo_indptr, indptr, indices, np.array(kv_lens, np.int32) + 16, 8, 2, 64, 64, 16)
    with pytest.raises(ValueError, match="logits_soft_cap must be the plan's"):
        w.run(q, cache, logits_soft_cap=30.0)


# ============================================================================ GPU


def _cp():
    import cupy
    return cupy


@pytest.mark.gpu
@pytest.mark.parametrize("M,N,R,C,heads,density,with_mask,causal",
                         [(2000, 4096, 64, 64, (32, 8), 0.3, False, False), (300, 1024, 16, 64, (8, 8), 0.5, True, False),
                          (257, 2048, 1, 64, (32, 8), 0.1, False, True)])
def test_block_sparse_gpu_matches_the_oracle(M, N, R, C, heads, density, with_mask, causal):
    cp = _cp()
    indptr, indices, mask, q, k, v = bsr_case(6, M, N, R, C, *heads, 128, density, with_mask)
    w = cuattn.BlockSparseAttentionWrapper()
    w.plan(indptr, indices, M, N, R, C, heads[0], heads[1], 128, mask=mask, causal=causal)
    out = cp.full(q.shape, np.nan, np.float16)
    lse = cp.full(q.shape[:2], np.nan, np.float32)
    w.run(cp.asarray(q), cp.asarray(k), cp.asarray(v), out=out, lse=lse)
    ref_o, ref_s = bsr_oracle(indptr, indices, mask, q, k, v, R, C, causal)
    assert rel_err(cp.asnumpy(out), ref_o) < TOL
    finite = np.isfinite(ref_s)
    assert np.abs(cp.asnumpy(lse)[finite] - ref_s[finite]).max() < 1e-3


@pytest.mark.gpu
def test_variable_block_sparse_gpu_matches_the_oracle():
    cp = _cp()
    bmap, rows, cols, q, k, v = variable_case(7, 32, 8, 128, [[64, 100, 92]] * 4 + [[16, 200, 40]] * 4,
                                              [[128, 256, 128]] * 4 + [[300, 12, 200]] * 4, 0.5)
    w = cuattn.VariableBlockSparseAttentionWrapper()
    w.plan(bmap, rows, cols, 32, 8, 128, causal=True)
    out, lse = w.run(cp.asarray(q), cp.asarray(k), cp.asarray(v), return_lse=True)
    ref_o, ref_s = variable_oracle(bmap, rows, cols, q, k, v, True)
    assert rel_err(cp.asnumpy(out), ref_o) < TOL and np.abs(cp.asnumpy(lse) - ref_s).max() < 1e-3


@pytest.mark.gpu
def test_batch_attention_gpu_mixed_step_in_one_launch_matches_the_oracle():
    cp = _cp()
    qo_lens, kv_lens, cache, indptr, indices, last, ks, vs, qo_indptr, q = mixed_case(8, hq=32, hkv=8, d=128)
    w = cuattn.BatchAttention()
    w.plan(qo_indptr, indptr, indices, np.array(kv_lens, np.int32), 32, 8, 128, 128, 16, causal=True,
           q_data_type="float16", kv_data_type="float16")
    assert "work:" in w.describe()
    out = cp.full(q.shape, np.nan, np.float16)
    o, lse = w.run(cp.asarray(q), cp.asarray(cache), out=out)
    got = cp.asnumpy(o)
    for b in range(6):
        ref, _ = dense_attention(q[qo_indptr[b]:qo_indptr[b + 1]], ks[b], vs[b], causal=True)
        assert rel_err(got[qo_indptr[b]:qo_indptr[b + 1]], ref) < TOL


from hypothesis import given, settings, strategies as st  # noqa: E402


@settings(max_examples=25, deadline=None)
@given(R=st.sampled_from([1, 3, 16, 32]), C=st.sampled_from([8, 16, 48]), mb=st.integers(1, 5), nb=st.integers(1, 6),
       density=st.floats(0.05, 1.0), causal=st.booleans(), masked=st.booleans(), seed=st.integers(0, 2**16))
def test_block_sparse_numpy_equals_dense_attention_with_the_equivalent_mask(R, C, mb, nb, density, causal, masked,
                                                                              seed):
    """Any block size and density: the wrapper equals float64 attention over the row block's gathered
    keys, which (non-causal) is dense attention under the block mask expanded to entries."""
    M, N = mb * R - (R > 1), nb * C                # the last row block one row short when R > 1
    indptr, indices, mask, q, k, v = bsr_case(seed, M, N, R, C, 4, 2, 64, density, masked)
    w = cuattn.BlockSparseAttentionWrapper()
    w.plan(indptr, indices, M, N, R, C, 4, 2, 64, mask=mask, causal=causal)
    out, lse = w.run(q, k, v, return_lse=True)
    ref_o, ref_s = bsr_oracle(indptr, indices, mask, q, k, v, R, C, causal)
    assert rel_err(out, ref_o) < TOL
    if not causal:                                 # the equivalent dense mask over the original key order
        dense = np.zeros((M, N), bool)
        for i in range(len(indptr) - 1):
            rows = slice(i * R, min((i + 1) * R, M))
            for j, b in enumerate(range(indptr[i], indptr[i + 1])):
                blk = np.ones((rows.stop - rows.start, C), bool) if mask is None else mask[b, :rows.stop - rows.start]
                dense[rows, indices[b] * C:(indices[b] + 1) * C] = blk
        o, _ = dense_attention(q, k, v, mask=dense)
        assert rel_err(out, o) < TOL
