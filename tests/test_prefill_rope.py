"""Ragged prefill's fused RoPE with q and the keys rotated once per run ahead of the kernel
(cuattn/prefill_rope.py): when plan() picks it, the kernel and arguments it runs, and on the GPU the result
against the float64 oracle for both backends, both layouts, rotary_dim < head_dim, fp16 and bf16."""
import numpy as np
import pytest

import cuattn
from cuattn import prefill_rope, variants
from tests.conftest import gpu_cc
from tests.test_qk_transform import THETA, _batch_oracle, _dev, _host, _poisoned
from tests.test_variants import BF16, _check, _cp, _rand

ROPE = dict(pos_encoding_mode="ROPE_LLAMA", rope_theta=THETA)


def _indptr(lens):
    return np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)


def _ragged_plan(qlens, kvlens, causal=True, hq=16, hkv=4, d=128, **kw):
    w = cuattn.BatchPrefillWithRaggedKVCacheWrapper(**kw)
    w.plan(_indptr(qlens), _indptr(kvlens), hq, hkv, d, causal=causal, **ROPE)
    return w._plan


def test_plan_rotates_keys_ahead_only_where_query_tiles_share_them():
    # 1000 queries x group 4 = 32 tiles of 128 rows over each key: ahead, the plain kernel
    p = _ragged_plan([1000], [1500])
    assert p.rope_prepass and p.spec.variant.is_default and p.bound.composite.has_rope   # NumPy path: the RoPE
    w = cuattn.BatchPrefillWithRaggedKVCacheWrapper()
    w.plan(_indptr([1000]), _indptr([1500]), 16, 4, 128, causal=True, logits_soft_cap=30.0, **ROPE)
    assert w._plan.rope_prepass and w._plan.spec.variant.pieces == (variants.SOFT_CAP,)   # other pieces stay
    # one or two tiles a key (decode-like and short appends): the kernel rotates key tiles itself
    for qlens, kvlens in (([1, 7], [4000, 300]), ([30], [2000])):
        p = _ragged_plan(qlens, kvlens)
        assert not p.rope_prepass and p.spec.variant.has_rope
    # causal halves the sharing: 6 tiles a key are enough without a mask, not with it
    assert _ragged_plan([192], [1000], causal=False).rope_prepass
    assert not _ragged_plan([192], [1000], causal=True).rope_prepass
    # CUDA-graph mode fixes one kernel for every batch: in-kernel
    assert not _ragged_plan([1000], [1500], use_cuda_graph=True).rope_prepass
    # the paged wrapper rotates in the kernel (its keys are not contiguous)
    wp = cuattn.BatchPrefillWithPagedKVCacheWrapper()
    wp.plan(_indptr([1000]), np.array([0, 94], np.int32), np.arange(94, dtype=np.int32), np.array([12], np.int32),
            16, 4, 128, 16, causal=True, **ROPE)
    assert not wp._plan.rope_prepass and wp._plan.spec.variant.has_rope
    # no RoPE: nothing to do
    assert not prefill_rope.pays(variants.DEFAULT, np.array([1000]), np.array([1500]), 4, True)


def test_kernel_arguments_without_the_rope_are_the_other_pieces():
    w = cuattn.BatchPrefillWithRaggedKVCacheWrapper()
    w.plan(_indptr([1000]), _indptr([1500]), 16, 4, 128, causal=True, logits_soft_cap=30.0, **ROPE)
    full, kb = w._plan.bound, prefill_rope.kernel_bound(w._plan)
    assert kb.composite.pieces == (variants.SOFT_CAP,) and kb.runtime == full.runtime
    assert kb.kernel_args(0.1, full.fixed, "f") == (0.1, 30.0, 1 / 30.0)
    w.plan(_indptr([8]), _indptr([1500]), 16, 4, 128, causal=True, logits_soft_cap=30.0, **ROPE)   # in-kernel
    assert prefill_rope.kernel_bound(w._plan) is w._plan.bound
    # q at kv_len - qo_len (bottom-right), then the keys at 0, per request
    assert prefill_rope.offsets(np.array([3, 0, 5]), np.array([10, 4, 5])).tolist() == [7, 4, 0, 0, 0, 0]


BACKENDS = ["fa2", pytest.param("fa3", marks=pytest.mark.skipif(gpu_cc() != 90, reason="fa3 needs sm_90"))]


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("d,rot,dtype,layout", [(128, None, np.float16, "NHD"), (128, 64, BF16, "HND"),
                                                (64, None, BF16, "NHD"), (256, 128, np.float16, "NHD")])
def test_ragged_rope_with_keys_rotated_ahead_matches_oracle_on_gpu(backend, d, rot, dtype, layout):
    """A ragged causal batch whose longest request makes the plan rotate the keys ahead (qo_len < kv_len,
    an empty request, one of a single query); q and k of the caller unchanged; rope_scale 2."""
    cp = _cp()
    rng = np.random.default_rng(71 + d)
    qlens, kvlens, hq, hkv = [700, 0, 1, 90], [900, 5, 333, 90], 16, 4
    qo_indptr, kv_indptr = _indptr(qlens), _indptr(kvlens)
    q = _rand(rng, (qo_indptr[-1], hq, d), dtype)
    k, v = _rand(rng, (kv_indptr[-1], hkv, d), dtype), _rand(rng, (kv_indptr[-1], hkv, d), dtype)
    w = cuattn.BatchPrefillWithRaggedKVCacheWrapper(kv_layout=layout, backend=backend)
    w.plan(qo_indptr, kv_indptr, hq, hkv, d, causal=True, rope_scale=2.0, rotary_dim=rot, q_data_type=dtype, **ROPE)
    assert w._plan.rope_prepass
    kd, vd = _dev(cp, k), _dev(cp, v)
    if layout == "HND":
        kd, vd = cp.ascontiguousarray(kd.transpose(1, 0, 2)), cp.ascontiguousarray(vd.transpose(1, 0, 2))
    qd = _dev(cp, q)
    q_before, k_before = qd.copy(), kd.copy()
    out, lse = _poisoned(cp, q.shape, dtype), cp.full(q.shape[:2], np.nan, np.float32)
    w.run(qd, kd, vd, out=out, lse=lse)
    assert w.backend == backend and bool((kd == k_before).all()) and bool((qd == q_before).all())
    ks = [k[kv_indptr[b]:kv_indptr[b + 1]].astype(np.float64) for b in range(len(qlens))]
    vs = [v[kv_indptr[b]:kv_indptr[b + 1]].astype(np.float64) for b in range(len(qlens))]
    want, want_lse = _batch_oracle(q.astype(np.float64), ks, vs, qo_indptr, rot or d, 2.0)
    _check(_host(cp, out, dtype), want, cp.asnumpy(lse), want_lse)


@pytest.mark.gpu
def test_single_prefill_rope_ahead_equals_in_kernel_on_gpu():
    """single_prefill_with_kv_cache (a ragged batch of one) takes the pre-pass; the same call through a
    CUDA-graph wrapper rotates in the kernel: both within fp16 rounding of each other and the oracle."""
    cp = _cp()
    rng = np.random.default_rng(77)
    qo, kv, hq, hkv, d = 600, 800, 8, 2, 128
    q, k, v = _rand(rng, (qo, hq, d)), _rand(rng, (kv, hkv, d)), _rand(rng, (kv, hkv, d))
    ahead = cp.asnumpy(cuattn.single_prefill_with_kv_cache(cp.asarray(q), cp.asarray(k), cp.asarray(v), causal=True,
                                                           **ROPE))
    w = cuattn.BatchPrefillWithRaggedKVCacheWrapper(use_cuda_graph=True)
    w.plan(_indptr([qo]), _indptr([kv]), hq, hkv, d, causal=True, **ROPE)
    assert not w._plan.rope_prepass
    inside = cp.asnumpy(w.run(cp.asarray(q), cp.asarray(k), cp.asarray(v)))
    want, _ = _batch_oracle(q.astype(np.float64), [k.astype(np.float64)], [v.astype(np.float64)], _indptr([qo]), d)
    _check(ahead, want)
    _check(inside, want)
