"""fp32 K/V caches with an fp16 q (issues 15, 22): the GPU kernels (decode.cu, prefill.cu fa2) round K/V to
f16 for the tensor cores saturating, as qcast.cu rounds an fp32 q (common/dtypes.cuh pack2_sat): a stored
value past 65504 reads as +-65504, never inf (which made the softmax and the output NaN). The oracle is
float64 attention over K/V clamped to +-65504 (tests/oracle.py). The NumPy path is left exact: float32
arithmetic on the stored values, no clamp (as it does not round K/V to f16 either)."""
import numpy as np
import pytest

import cuattn
from tests.oracle import dense_attention, rel_err
from tests.prefill_dtype_cases import to_pages

F16_MAX = 65504.0
BIG = [1e5, -7e4, 65520.0, -3e38, F16_MAX]   # 65520: the first value that rounds to inf without saturation
TOL = 1e-2
Q_SCALE = 5e-4       # q . k of a clamped entry ~ Q_SCALE * 65504 / sqrt(head_dim): moderate logits


def kv_with_big_values(rng, n, hkv, d, big=BIG):
    """fp32 K and V [n, hkv, d], standard normal, with each ``big`` value at a random (token, dim) of every kv
    head (distinct tokens); returns (k, v, the dims of V that hold one: an output column dominated by it)."""
    k, v = rng.standard_normal((2, n, hkv, d)).astype(np.float32)
    big_dims = set()
    for x in (k, v):
        for h in range(hkv):
            toks = rng.choice(n, len(big), replace=False)
            dims = rng.choice(d, len(big), replace=False)
            x[toks, h, dims] = big
            if x is v:
                big_dims.update(int(c) for c in dims)
    return k, v, sorted(big_dims)


def clamped(x):
    return np.clip(x.astype(np.float64), -F16_MAX, F16_MAX)


def oracle(q, ks, vs, q_rows, causal=False, clamp=True):
    """float64 attention per request: q[q_rows[b]] over ks[b], vs[b], clamped to +-65504 or as stored (an inf
    read as fp32's largest finite value, so that the unclamped result is finite too)."""
    outs, lses = [], []
    for b, rows in enumerate(q_rows):
        f = clamped if clamp else (lambda x: np.nan_to_num(x).astype(np.float64))
        o, s = dense_attention(q[rows], f(ks[b]), f(vs[b]), causal=causal)
        outs.append(o)
        lses.append(s)
    return np.concatenate(outs), np.concatenate(lses)


def q16(rng, shape):
    return (rng.standard_normal(shape) * Q_SCALE).astype(np.float16)


def split(x, indptr):
    """x's rows per request of ``indptr``."""
    return [x[indptr[b]:indptr[b + 1]] for b in range(len(indptr) - 1)]


def decode_case(rng, lens, hq, hkv, d, ps, big=BIG, with_inf=False):
    """A decode batch over an fp32 paged (k, v) pair holding ``big`` values (``with_inf``: a -inf in V too),
    planned on a BatchDecodeWithPagedKVCacheWrapper: (wrapper, q, (k pages, v pages), ks, vs, big dims)."""
    k, v, big_dims = kv_with_big_values(rng, sum(lens), hkv, d, big=big)
    if with_inf:
        v[rng.integers(sum(lens)), 0, big_dims[0]] = -np.inf      # an inf saturates too (qcast's rule for q)
    kv_indptr = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    q = q16(rng, (len(lens), hq, d))
    kp, indptr, indices, last = to_pages(k, kv_indptr, ps)
    vp = to_pages(v, kv_indptr, ps)[0]
    w = cuattn.BatchDecodeWithPagedKVCacheWrapper()
    w.plan(indptr, indices, last, hq, hkv, d, ps, q_data_type="float16", kv_data_type="float32")
    return w, q, (kp, vp), split(k, kv_indptr), split(v, kv_indptr), big_dims


def check(out, lse, ref_o, ref_s, big_dims, unclamped_o):
    """Finite, within TOL of the clamped oracle both over all columns and over the columns no big V value
    dominates, the LSE within 1e-3; and the clamp visibly matters for this data (the test can fail)."""
    o = np.asarray(out, np.float64)
    assert np.all(np.isfinite(o)), "non-finite output: a K/V value past 65504 read as inf"
    assert rel_err(o, ref_o) < TOL
    plain = np.setdiff1d(np.arange(o.shape[-1]), big_dims)
    assert rel_err(o[..., plain], ref_o[..., plain]) < TOL
    assert rel_err(lse, ref_s) < 1e-3
    assert rel_err(unclamped_o, ref_o) > 0.5          # (the data exercises the saturation)


# ---------------------------------------------------------------------------- NumPy path (CPU)


def test_f32_kv_numpy_path_keeps_values_past_f16_max_exact():
    """The documented choice: the NumPy path computes with the stored fp32 values (no clamp), so it matches
    the unclamped oracle; the GPU (tests below) matches the clamped one. (Values whose weighted sum stays
    within f16: the output has q's dtype on either path.)"""
    w, q, cache, ks, vs, _ = decode_case(np.random.default_rng(40), [70, 33], 8, 2, 64, 16, big=[2e5, -1e5, 65520.0])
    out = w.run(q, cache).astype(np.float64)
    exact, _ = oracle(q, ks, vs, [[0], [1]], clamp=False)
    sat, _ = oracle(q, ks, vs, [[0], [1]])
    assert rel_err(out, exact) < TOL and rel_err(out, sat) > 10 * TOL


# ---------------------------------------------------------------------------- GPU


@pytest.mark.gpu
def test_f32_kv_batch_decode_gpu_saturates_past_f16_max():
    import cupy
    hq, d = 16, 128
    w, q, (kp, vp), ks, vs, big_dims = decode_case(np.random.default_rng(41), [150, 61, 97], hq, 4, d, 16,
                                                   with_inf=True)
    out, lse = cupy.full((3, hq, d), np.nan, np.float16), cupy.full((3, hq), np.nan, np.float32)
    w.run(cupy.asarray(q), (cupy.asarray(kp), cupy.asarray(vp)), out=out, lse=lse)
    ref_o, ref_s = oracle(q, ks, vs, [[0], [1], [2]])
    unclamped = oracle(q, ks, vs, [[0], [1], [2]], clamp=False)[0]
    check(cupy.asnumpy(out), cupy.asnumpy(lse), ref_o, ref_s, big_dims, unclamped)


@pytest.mark.gpu
@pytest.mark.parametrize("paged", [True, False], ids=["paged", "ragged"])
def test_f32_kv_prefill_gpu_saturates_past_f16_max(paged):
    import cupy
    rng = np.random.default_rng(42 + paged)
    qo_lens, kv_lens, hq, hkv, d, ps = ([37, 5], [150, 90], 8, 2, 128, 16) if paged else ([20], [200], 8, 4, 64, 0)
    k, v, big_dims = kv_with_big_values(rng, sum(kv_lens), hkv, d)
    qo_indptr = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
    kv_indptr = np.concatenate([[0], np.cumsum(kv_lens)]).astype(np.int32)
    rows = int(qo_indptr[-1])
    q = q16(rng, (rows, hq, d))
    out, lse = cupy.full((rows, hq, d), np.nan, np.float16), cupy.full((rows, hq), np.nan, np.float32)
    if paged:
        kp, indptr, indices, last = to_pages(k, kv_indptr, ps)
        vp, _, _, _ = to_pages(v, kv_indptr, ps)
        w = cuattn.BatchPrefillWithPagedKVCacheWrapper()
        w.plan(qo_indptr, indptr, indices, last, hq, hkv, d, ps, causal=True, q_data_type="float16",
               kv_data_type="float32")
        w.run(cupy.asarray(q), (cupy.asarray(kp), cupy.asarray(vp)), out=out, lse=lse)
    else:
        w = cuattn.BatchPrefillWithRaggedKVCacheWrapper()
        w.plan(qo_indptr, kv_indptr, hq, hkv, d, causal=True, q_data_type="float16", kv_data_type="float32")
        w.run(cupy.asarray(q), cupy.asarray(k), cupy.asarray(v), out=out, lse=lse)
    assert w.backend == "fa2"          # fp32 K/V: fa2 only (fa3 reads K/V of q's dtype or fp8)
    ks, vs = split(k, kv_indptr), split(v, kv_indptr)
    q_rows = [np.arange(qo_indptr[b], qo_indptr[b + 1]) for b in range(len(qo_lens))]
    ref_o, ref_s = oracle(q, ks, vs, q_rows, causal=True)
    unclamped = oracle(q, ks, vs, q_rows, causal=True, clamp=False)[0]
    check(cupy.asnumpy(out), cupy.asnumpy(lse), ref_o, ref_s, big_dims, unclamped)
