"""Prefill with head_dim_qk != head_dim_vo (192 / 128, issue 21): the NumPy path, refusals, spill-free specs
and the fa2 kernel on a GPU against tests/oracle.py's float64 attention. Shared helpers:
tests/prefill_dtype_cases.py."""
import numpy as np
import pytest

import cuattn
from cuattn import jit, prefill
from cuattn.errors import UnsupportedError
from tests.oracle import dense_attention, rel_err
from tests.prefill_dtype_cases import QDT, _check, _cp, _dev, _ids, _oracle, _poisoned, to_pages


def split_case(qo_lens, kv_lens, hq, hkv, q_dtype, seed=0, dqk=192, dvo=128):
    rng = np.random.default_rng(seed)
    qo_indptr = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
    kv_indptr = np.concatenate([[0], np.cumsum(kv_lens)]).astype(np.int32)
    dt = QDT[q_dtype]
    q = rng.standard_normal((int(qo_indptr[-1]), hq, dqk)).astype(dt)
    k = rng.standard_normal((int(kv_indptr[-1]), hkv, dqk)).astype(dt)
    v = rng.standard_normal((int(kv_indptr[-1]), hkv, dvo)).astype(dt)
    ks = [k[kv_indptr[b]:kv_indptr[b + 1]] for b in range(len(kv_lens))]
    vs = [v[kv_indptr[b]:kv_indptr[b + 1]] for b in range(len(kv_lens))]
    return q, k, v, qo_indptr, kv_indptr, ks, vs


def test_split_head_dims_numpy_single_ragged_paged_match_oracle():
    q, k, v, qo_indptr, kv_indptr, ks, vs = split_case([5, 17], [21, 40], 8, 2, "float16", seed=4)
    ref_o, ref_s = _oracle(q, ks, vs, qo_indptr, True)
    w = cuattn.BatchPrefillWithRaggedKVCacheWrapper()
    w.plan(qo_indptr, kv_indptr, 8, 2, 192, 128, causal=True)
    out, lse = w.run(q, k, v, return_lse=True)
    assert out.shape == (22, 8, 128) and rel_err(out, ref_o) < 2e-3 and rel_err(lse, ref_s) < 1e-5
    kp, indptr, indices, last = to_pages(k, kv_indptr, 16)
    vp, _, _, _ = to_pages(v, kv_indptr, 16)
    wp = cuattn.BatchPrefillWithPagedKVCacheWrapper()
    wp.plan(qo_indptr, indptr, indices, last, 8, 2, 192, 16, head_dim_vo=128, causal=True)
    np.testing.assert_array_equal(wp.run(q, (kp, vp)), out)
    o1 = cuattn.single_prefill_with_kv_cache(q[:5], ks[0], vs[0], causal=True)
    r1, _ = dense_attention(q[:5], ks[0], vs[0], causal=True)
    assert o1.shape == (5, 8, 128) and rel_err(o1, r1) < 2e-3


def test_split_head_dims_refusals_name_the_argument():
    qo, kv = np.array([0, 4], np.int32), np.array([0, 9], np.int32)
    w = cuattn.BatchPrefillWithRaggedKVCacheWrapper()
    with pytest.raises(UnsupportedError, match="head_dim=192 has no kernel; supported: 64, 128, 256"):
        w.plan(qo, kv, 4, 4, 192, 192)
    for dqk, dvo in ((128, 64), (192, 64), (256, 128)):
        with pytest.raises(UnsupportedError, match=f"head_dim_qk={dqk} with head_dim_vo={dvo} has no kernel; "
                                                   "supported: equal head dims 64, 128, 256, or \\(qk, vo\\) 192/128"):
            w.plan(qo, kv, 4, 4, dqk, dvo)
    with pytest.raises(TypeError, match="head_dim_vo must be an int"):
        w.plan(qo, kv, 4, 4, 192, 128.0)
    with pytest.raises(UnsupportedError, match="need head_dim_vo == head_dim_qk"):
        w.plan(qo, kv, 4, 4, 192, 128, pos_encoding_mode="ROPE_LLAMA", rotary_dim=64)
    # fa3 has a 192 / 128 kernel (tests/test_prefill_sm90.py), custom masks included, but no fp8 one
    cuattn.BatchPrefillWithRaggedKVCacheWrapper(backend="fa3").plan(qo, kv, 4, 4, 192, 128)
    cuattn.BatchPrefillWithRaggedKVCacheWrapper(backend="fa3").plan(qo, kv, 4, 4, 192, 128, custom_mask=np.ones(36, bool))
    with pytest.raises(UnsupportedError, match="backend='fa3': fa3 reads an fp8 KV cache at head_dim 64 and 128 only"):
        cuattn.BatchPrefillWithRaggedKVCacheWrapper(backend="fa3").plan(qo, kv, 4, 4, 192, 128,
                                                                        kv_data_type="float8_e4m3fn")
    w.plan(qo, kv, 4, 4, 192, 128)
    x = np.zeros((9, 4, 192), np.float16)
    with pytest.raises(ValueError, match="v must have the shape of k .* with head_dim_vo=128"):
        w.run(np.zeros((4, 4, 192), np.float16), x, x)
    wp = cuattn.BatchPrefillWithPagedKVCacheWrapper()
    wp.plan(qo, np.array([0, 1], np.int32), np.array([0], np.int32), np.array([9], np.int32), 4, 4, 192, 16,
            head_dim_vo=128)
    with pytest.raises(ValueError, match=r"paged_kv_cache must be a \(k_cache, v_cache\) pair"):
        wp.run(np.zeros((4, 4, 192), np.float16), np.zeros((1, 2, 16, 4, 192), np.float16))
    with pytest.raises(ValueError, match="v_cache must have page_size=16, num_kv_heads=4, head_dim=128"):
        wp.run(np.zeros((4, 4, 192), np.float16), (np.zeros((1, 16, 4, 192), np.float16),
                                                   np.zeros((1, 16, 4, 192), np.float16)))


@pytest.mark.parametrize("arch", jit.SHIPPED_ARCHS)
def test_split_head_dim_specs_compile_without_spills(arch):
    for t, c, m, p, kv in (("f16", False, False, False, ""), ("bf16", True, False, True, ""),
                           ("f16", True, True, True, ""), ("bf16", False, False, True, "e4m3")):
        spec = prefill.make_spec(192, t, c, m, p, dtype_kv=kv, head_dim_vo=128)
        res = jit.compile_kernel(spec, arch).resources["cuattn_prefill"]
        assert res["spill_stores"] == res["spill_loads"] == 0, (spec.name, arch, res)


SPLIT_GPU = [   # (qo_lens, kv_lens, hq, hkv, q dtype, causal, kind, page_size, layout)
    ([37, 200], [97, 200], 32, 8, "float16", True, "ragged", 0, "NHD"),
    ([64, 1], [1000, 33], 16, 2, "bfloat16", False, "paged", 16, "NHD"),
    ([127], [600], 8, 8, "float16", True, "paged", 1, "HND"),
    ([300], [300], 16, 4, "bfloat16", True, "single", 0, "NHD"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", SPLIT_GPU, ids=_ids(SPLIT_GPU))
def test_split_head_dims_gpu_match_oracle(case):
    qo_lens, kv_lens, hq, hkv, qdt, causal, kind, ps, layout = case
    q, k, v, qo_indptr, kv_indptr, ks, vs = split_case(qo_lens, kv_lens, hq, hkv, qdt, seed=hq + len(kind))
    rows = int(qo_indptr[-1])
    out, lse = _poisoned((rows, hq, 128), qdt), _cp().full((rows, hq), np.nan, np.float32)
    if kind == "single":
        out, lse = cuattn.single_prefill_with_kv_cache(_dev(q), _dev(k), _dev(v), causal=causal, return_lse=True)
    elif kind == "ragged":
        w = cuattn.BatchPrefillWithRaggedKVCacheWrapper()
        w.plan(qo_indptr, kv_indptr, hq, hkv, 192, 128, causal=causal, q_data_type=qdt)
        w.run(_dev(q), _dev(k), _dev(v), out=out, lse=lse)
    else:
        kp, indptr, indices, last = to_pages(k, kv_indptr, ps, layout=layout)
        vp, _, _, _ = to_pages(v, kv_indptr, ps, layout=layout)
        w = cuattn.BatchPrefillWithPagedKVCacheWrapper(kv_layout=layout)
        w.plan(_dev(qo_indptr), _dev(indptr), _dev(indices), _dev(last), hq, hkv, 192, ps, head_dim_vo=128,
               causal=causal, q_data_type=qdt)
        w.run(_dev(q), (_dev(kp), _dev(vp)), out=out, lse=lse)
    ref_o, ref_s = _oracle(q, ks, vs, qo_indptr, causal)
    _check(out, lse, ref_o, ref_s, qdt)

