"""MLA (BatchMLAPagedAttentionWrapper, append_paged_mla_kv_cache) on the NumPy path against an
independent float64 formula; the GPU refusal of MLA attention and the GPU append (gpu marker)."""
import math

import ml_dtypes
import numpy as np
import pytest

import cuattn
from cuattn import UnsupportedError

from .oracle import rel_err

BF16 = np.dtype(ml_dtypes.bfloat16)
CKV, KPE = 512, 64


def mla_case(seed, qo_lens, kv_lens, page_size, heads=16, dtype=np.float16):
    rng = np.random.default_rng(seed)
    pages = [-(-n // page_size) for n in kv_lens]
    total = sum(pages) + 2
    perm = rng.permutation(total)[:sum(pages)].astype(np.int32)
    kv_indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
    ckv = rng.standard_normal((total, page_size, CKV)).astype(dtype)
    kpe = rng.standard_normal((total, page_size, KPE)).astype(dtype)
    qo_indptr = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
    qn = rng.standard_normal((qo_indptr[-1], heads, CKV)).astype(dtype)
    qp = rng.standard_normal((qo_indptr[-1], heads, KPE)).astype(dtype)
    return dict(qo_indptr=qo_indptr, kv_indptr=kv_indptr, kv_indices=perm, kv_len=np.array(kv_lens, np.int32),
                ckv=ckv, kpe=kpe, qn=qn, qp=qp, page_size=page_size, heads=heads)


def mla_oracle(c, causal, sm_scale):
    """float64, one (request, head, query) at a time."""
    out = np.zeros(c["qn"].shape, np.float64)
    lse = np.full(c["qn"].shape[:2], -np.inf)
    for b in range(len(c["kv_len"])):
        ids = c["kv_indices"][c["kv_indptr"][b]:c["kv_indptr"][b + 1]]
        n = int(c["kv_len"][b])
        ckv = c["ckv"][ids].reshape(-1, CKV)[:n].astype(np.float64)
        kpe = c["kpe"][ids].reshape(-1, KPE)[:n].astype(np.float64)
        q0, q1 = c["qo_indptr"][b], c["qo_indptr"][b + 1]
        for i in range(q0, q1):
            visible = n - (q1 - i) + 1 if causal else n
            for h in range(c["heads"]):
                s = (ckv[:visible] @ c["qn"][i, h].astype(np.float64) + kpe[:visible] @ c["qp"][i, h].astype(np.float64)) * sm_scale
                if visible <= 0:
                    continue
                m = s.max()
                w = np.exp(s - m)
                out[i, h] = w @ ckv[:visible] / w.sum()
                lse[i, h] = m + math.log(w.sum())
    return out, lse


def planned(c, causal, dtype="float16", sm_scale=0.07):
    w = cuattn.BatchMLAPagedAttentionWrapper()
    w.plan(c["qo_indptr"], c["kv_indptr"], c["kv_indices"], c["kv_len"], c["heads"], CKV, KPE, c["page_size"],
           causal, sm_scale, dtype, dtype)
    return w


CASES = [   # (qo_lens, kv_lens, page_size, causal): decode, speculative / chunked prefill, any page size
    ([1, 1, 1], [300, 17, 1], 1, False),
    ([1, 1], [1000, 65], 64, False),
    ([4, 1, 7], [100, 33, 7], 16, True),
]


@pytest.mark.parametrize("qo_lens,kv_lens,page_size,causal", CASES)
@pytest.mark.parametrize("dtype", [np.float16, BF16], ids=["f16", "bf16"])
def test_mla_numpy_matches_float64_absorbed_attention(qo_lens, kv_lens, page_size, causal, dtype):
    c = mla_case(1, qo_lens, kv_lens, page_size, dtype=dtype)
    w = planned(c, causal, np.dtype(dtype))
    out, lse = w.run(c["qn"], c["qp"], c["ckv"], c["kpe"], return_lse=True, return_lse_base_on_e=True)
    ref_o, ref_s = mla_oracle(c, causal, 0.07)
    assert out.shape == c["qn"].shape and out.dtype == np.dtype(dtype)
    assert rel_err(out.astype(np.float64), ref_o) < (1e-2 if dtype == BF16 else 2e-3)
    assert np.abs(lse - ref_s).max() < 1e-3 * np.abs(ref_s).max()
    _, lse2 = w.run(c["qn"], c["qp"], c["ckv"], c["kpe"], return_lse=True)      # FlashInfer's default: base 2
    np.testing.assert_allclose(lse2 * math.log(2), lse, rtol=1e-6)


def test_append_paged_mla_kv_cache_writes_each_row_to_its_slot_numpy():
    page_size, lens = 16, [20, 3]
    c = mla_case(2, [1, 1], lens, page_size)
    ckv, kpe = np.zeros_like(c["ckv"]), np.zeros_like(c["kpe"])
    last = np.array([n - (-(-n // page_size) - 1) * page_size for n in lens], np.int32)
    append_indptr = np.array([0, 20, 23], np.int32)
    bi, pos = cuattn.get_batch_indices_positions(append_indptr, np.array(lens, np.int32), 23)
    rows_c = np.concatenate([c["ckv"][c["kv_indices"][c["kv_indptr"][b]:c["kv_indptr"][b + 1]]].reshape(-1, CKV)[:n]
                             for b, n in enumerate(lens)])
    rows_k = np.concatenate([c["kpe"][c["kv_indices"][c["kv_indptr"][b]:c["kv_indptr"][b + 1]]].reshape(-1, KPE)[:n]
                             for b, n in enumerate(lens)])
    cuattn.append_paged_mla_kv_cache(rows_c, rows_k, bi, pos, ckv, kpe, c["kv_indices"], c["kv_indptr"], last)
    w = planned(c, False)
    a = w.run(c["qn"], c["qp"], ckv, kpe)
    b = w.run(c["qn"], c["qp"], c["ckv"], c["kpe"])
    np.testing.assert_array_equal(a, b)               # attention over the appended cache = over the original


def test_mla_rejects_what_it_cannot_run():
    c = mla_case(3, [1], [10], 16)
    w = cuattn.BatchMLAPagedAttentionWrapper()
    with pytest.raises(UnsupportedError, match="head_dim_ckv, head_dim_kpe must be"):
        w.plan(c["qo_indptr"], c["kv_indptr"], c["kv_indices"], c["kv_len"], 16, 128, 64, 16, False, 0.1,
               "float16", "float16")
    with pytest.raises(ValueError, match="kv_len_arr must fit"):
        w.plan(c["qo_indptr"], c["kv_indptr"], c["kv_indices"], c["kv_len"] + 16, 16, CKV, KPE, 16, False, 0.1,
               "float16", "float16")
    with pytest.raises(ValueError, match="plan"):
        w.run(c["qn"], c["qp"], c["ckv"], c["kpe"])
    w.plan(c["qo_indptr"], c["kv_indptr"], c["kv_indices"], c["kv_len"], 16, CKV, KPE, 16, False, 0.1,
           "float16", "float16")
    with pytest.raises(ValueError, match="q_pe must have shape"):
        w.run(c["qn"], c["qp"][:, :8], c["ckv"], c["kpe"])
    with pytest.raises(ValueError, match="ckv_cache must have dtype"):
        w.run(c["qn"], c["qp"], c["ckv"].astype(np.float32), c["kpe"])


@pytest.mark.gpu
def test_mla_gpu_attention_is_refused_and_the_gpu_append_equals_numpy():
    import cupy as cp
    c = mla_case(4, [1, 1], [40, 9], 16)
    w = planned(c, False)
    with pytest.raises(UnsupportedError, match="no GPU kernel yet"):
        w.run(*(cp.asarray(c[k]) for k in ("qn", "qp", "ckv", "kpe")))
    rng = np.random.default_rng(5)
    rows_c = rng.standard_normal((49, CKV)).astype(np.float16)
    rows_k = rng.standard_normal((49, KPE)).astype(np.float16)
    bi, pos = cuattn.get_batch_indices_positions(np.array([0, 40, 49], np.int32), c["kv_len"], 49)
    last = np.array([8, 9], np.int32)
    host = [np.zeros_like(c["ckv"]), np.zeros_like(c["kpe"])]
    dev = [cp.zeros(x.shape, x.dtype) for x in host]
    cuattn.append_paged_mla_kv_cache(rows_c, rows_k, bi, pos, *host, c["kv_indices"], c["kv_indptr"], last)
    cuattn.append_paged_mla_kv_cache(cp.asarray(rows_c), cp.asarray(rows_k), cp.asarray(bi), cp.asarray(pos), *dev,
                                     cp.asarray(c["kv_indices"]), cp.asarray(c["kv_indptr"]), cp.asarray(last))
    for h, d in zip(host, dev):
        np.testing.assert_array_equal(h, cp.asnumpy(d))
