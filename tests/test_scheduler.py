"""The scheduler and plan buffers shared by every wrapper: split-KV prefill merged exactly, CUDA-graph
capture and replay after re-plans (CuPy and torch), refusal of a capture a wrapper cannot honour,
batch invariance with fixed_split_size, and describe(). Work-list coverage by hypothesis is in
tests/test_plan.py."""
import itertools

import numpy as np
import pytest

import cuattn

from .conftest import gpu_cc
from .oracle import dense_attention, rel_err
from .test_multilevel import CASES, make_cascade, oracle as cascade_oracle
from .test_prefill import _paged_inputs, _ragged_inputs, oracle_batch, rand

TOL, LSE_TOL = 5e-3, 1e-3
HQ, HKV, D = 32, 8, 128


def _cp():
    import cupy
    return cupy


# ============================================================================ CPU (CI)


def test_describe_names_the_numpy_path_without_a_gpu_and_every_wrapper_has_one():
    rng = np.random.default_rng(0)
    cache, indptr, indices, last, _, _ = _paged_inputs(rng, [40, 7], 16, 2, 64, "NHD")
    w = cuattn.BatchPrefillWithPagedKVCacheWrapper()
    assert "not planned" in w.describe()
    w.plan(np.array([0, 3, 4], np.int32), indptr, indices, last, 4, 2, 64, 16, causal=True)
    d = cuattn.BatchDecodeWithPagedKVCacheWrapper()
    d.plan(indptr, indices, last, 4, 2, 64, 16)
    c = cuattn.MultiLevelCascadeAttentionWrapper(1)
    c.plan([np.array([0, 3, 4], np.int32)], [indptr], [indices], [last], 4, 2, 64, 16)
    for wrapper, name in ((w, "BatchPrefillWithPagedKVCacheWrapper"), (d, "BatchDecodeWithPagedKVCacheWrapper"),
                          (c, "MultiLevelCascadeAttentionWrapper")):
        text = wrapper.describe()
        assert text.startswith(name)
        if not cuattn.arrays.gpu_available():
            assert "NumPy reference path" in text


def test_every_wrapper_plans_into_one_typed_plan_structure():
    """decode, ragged and paged prefill, a cascade's levels, block-sparse and BatchAttention all hold a
    plan.Plan after plan(); its fields are declared (a misspelt one raises)."""
    from cuattn.plan import Plan
    rng = np.random.default_rng(1)
    cache, indptr, indices, last, _, _ = _paged_inputs(rng, [40, 7], 16, 2, 64, "NHD")
    qo = np.array([0, 3, 4], np.int32)
    d = cuattn.BatchDecodeWithPagedKVCacheWrapper()
    d.plan(indptr, indices, last, 4, 2, 64, 16)
    p = cuattn.BatchPrefillWithPagedKVCacheWrapper()
    p.plan(qo, indptr, indices, last, 4, 2, 64, 16, causal=True)
    r = cuattn.BatchPrefillWithRaggedKVCacheWrapper()
    r.plan(qo, np.array([0, 40, 47], np.int32), 4, 2, 64, causal=True)
    c = cuattn.MultiLevelCascadeAttentionWrapper(2)
    c.plan([np.array([0, 2], np.int32), np.arange(3, dtype=np.int32)], [np.array([0, 1], np.int32), indptr],
           [np.array([0], np.int32), indices], [np.array([16], np.int32), last], 4, 2, 64, 16)
    s = cuattn.BlockSparseAttentionWrapper()
    s.plan(np.array([0, 1, 2], np.int32), np.array([0, 1], np.int32), 32, 32, 16, 16, 4, 2, 64)
    a = cuattn.BatchAttention()
    a.plan(qo, indptr, indices, np.array([40, 7], np.int32), 4, 2, 64, 64, 16)
    plans = [d._plan, p._plan, r._plan, *(w._plan for w in c._levels), s._inner._plan, a._inner._plan]
    assert all(type(x) is Plan for x in plans)
    assert [x.batch for x in plans] == [2, 2, 2, 1, 2, 2, 2]
    assert d._plan.kv_lens.tolist() == p._plan.kv_lens.tolist() == [40, 7] and p._plan["num_kv_heads"] == 2
    with pytest.raises(AttributeError):
        d._plan.num_kv_head = 3


def test_decode_plan_checks_again_an_argument_equal_to_a_checked_one_but_of_another_type():
    """plan() memoizes checked configurations; 16.0 == 16 but a float page_size is still refused."""
    rng = np.random.default_rng(2)
    _, indptr, indices, last, _, _ = _paged_inputs(rng, [40, 7], 16, 2, 64, "NHD")
    d = cuattn.BatchDecodeWithPagedKVCacheWrapper()
    d.plan(indptr, indices, last, 4, 2, 64, 16)
    with pytest.raises(ValueError, match="page_size must be a positive int"):
        d.plan(indptr, indices, last, 4, 2, 64, 16.0)
    d.plan(indptr, indices, last, np.int64(4), 2, 64, 16, logits_soft_cap=30.0)
    assert d._plan.bound.composite.has("logits_transform") and d._plan.num_qo_heads == 4


def test_prefill_plan_rejects_a_bad_fixed_split_size_on_every_path():
    rng = np.random.default_rng(1)
    _, _, _, qo_indptr, kv_indptr = _ragged_inputs(rng, [3], [9], 4, 2, 64)
    w = cuattn.BatchPrefillWithRaggedKVCacheWrapper()
    for bad in (0, -5, 2.5, True):
        with pytest.raises(ValueError, match="fixed_split_size must be None or an int >= 1"):
            w.plan(qo_indptr, kv_indptr, 4, 2, 64, fixed_split_size=bad)
    d = cuattn.BatchDecodeWithPagedKVCacheWrapper()
    with pytest.raises(ValueError, match="fixed_split_size must be None or an int >= 1"):
        d.plan(np.array([0, 1], np.int32), np.zeros(1, np.int32), np.array([3], np.int32), 4, 2, 64, 16,
               fixed_split_size=0)
    with pytest.raises(TypeError, match="unexpected keyword"):
        w.plan(qo_indptr, kv_indptr, 4, 2, 64, split_size=64)


def test_prefill_plan_memoizes_its_configuration_and_refuses_a_bad_one_every_time():
    """A checked configuration is reused (the same spec object: the backend memo keys on it); one that
    failed is never stored, so it fails again with the same error; another dtype or a mask is another entry."""
    rng = np.random.default_rng(3)
    _, indptr, indices, last, _, _ = _paged_inputs(rng, [40, 7], 16, 2, 64, "NHD")
    qo = np.array([0, 3, 4], np.int32)
    w = cuattn.BatchPrefillWithPagedKVCacheWrapper()
    w.plan(qo, indptr, indices, last, 4, 2, 64, 16, causal=True)
    spec = w._plan.spec
    w.plan(qo, indptr, indices, last, 4, 2, 64, 16, causal=True)
    assert w._plan.spec is spec and len(w._configs) == 1
    for _ in range(2):
        with pytest.raises(cuattn.UnsupportedError, match="head_dim=96 has no kernel"):
            w.plan(qo, indptr, indices, last, 4, 2, 96, 16, causal=True)
        with pytest.raises(ValueError, match="num_qo_heads must be a multiple of num_kv_heads"):
            w.plan(qo, indptr, indices, last, 5, 2, 64, 16, causal=True)
    assert len(w._configs) == 1
    w.plan(qo, indptr, indices, last, 4, 2, 64, 16, causal=True, q_data_type="bfloat16")
    assert w._plan.spec.dtype == "bf16" and w._plan.q_dtype == np.dtype(cuattn.arrays.bfloat16)
    w.plan(qo, indptr, indices, last, 4, 2, 64, 16, causal=True, custom_mask=np.ones(3 * 40 + 7, bool))
    assert w._plan.spec.custom_mask and w._plan.mask is not None and len(w._configs) == 3
    with pytest.raises(ValueError, match="qo_indptr must start at 0 and be non-decreasing"):
        w.plan(np.array([0, 3, 2], np.int32), indptr, indices, last, 4, 2, 64, 16, causal=True)


class _CountingCupy:
    """CuPy's device calls as counted no-ops (plan() on a machine without a GPU): ``calls`` by name."""

    def __init__(self):
        import collections
        import types
        calls = self.calls = collections.Counter()

        class Ptr:
            ptr = 1 << 32

        class Array:
            def __init__(self, n, dtype):
                calls["alloc"] += 1
                self.shape = tuple(n) if isinstance(n, tuple) else (int(n),)
                self.size, self.data = int(np.prod(n)), Ptr()

        class Event:
            def __init__(self, *a, **k):
                calls["event_create"] += 1

            @property
            def done(self):
                calls["event_query"] += 1
                return True

            def record(self, stream=None):
                calls["event_record"] += 1

        class Device:
            compute_capability, attributes = "90", {"MultiProcessorCount": 132}

            def __init__(self, device=0):
                pass

            def __enter__(self):
                calls["device_context"] += 1

            def __exit__(self, *a):
                return False

        class Stream:
            ptr = 0

        def memcpy(dst, src, nbytes, kind, stream):
            calls["memcpyAsync"] += 1

        runtime = types.SimpleNamespace(memcpyAsync=memcpy, getDevice=lambda: 0, memcpyDeviceToDevice=3)
        self.cuda = types.SimpleNamespace(runtime=runtime, Device=Device, Event=Event, Stream=Stream,
                                          ExternalStream=Stream, get_current_stream=lambda device=None: Stream(),
                                          alloc_pinned_memory=lambda nbytes: bytearray(nbytes))
        self.empty = Array


def test_a_steady_state_plan_makes_three_cuda_calls_per_upload(monkeypatch):
    """After the first plan (allocations, the event), a paged / ragged prefill, decode or MLA plan() makes one
    event query, one async copy and one event record: no Device context, no allocation; a 2-level cascade
    (a prefill level and a decode level) as many when its shared level is the last plan's (kept, not uploaded
    again), twice that when it is another."""
    from cuattn import arrays, jit, plan
    fake = _CountingCupy()
    monkeypatch.setattr(arrays, "cupy_module", lambda: fake)
    monkeypatch.setattr(arrays, "gpu_available", lambda: True)
    monkeypatch.setattr(plan, "num_sms", lambda device: 132)
    monkeypatch.setattr(jit, "device_arch", lambda device: "sm_90a")
    monkeypatch.setattr(jit, "get_launcher", lambda *a, **k: None)      # (decode's launch state: no compile)
    rng = np.random.default_rng(4)
    _, indptr, indices, last, _, _ = _paged_inputs(rng, [40, 7, 300], 16, 2, 64, "NHD")
    qo = np.array([0, 3, 4, 40], np.int32)
    p, r = cuattn.BatchPrefillWithPagedKVCacheWrapper(), cuattn.BatchPrefillWithRaggedKVCacheWrapper()
    d, m, c = (cuattn.BatchDecodeWithPagedKVCacheWrapper(), cuattn.BatchMLAPagedAttentionWrapper(),
               cuattn.MultiLevelCascadeAttentionWrapper(2))
    mla_lens = np.array([40, 7, 300], np.int32)
    mla_indptr = np.concatenate([[0], np.cumsum(-(-mla_lens // 64))]).astype(np.int32)
    shared = [np.array([0, 3], np.int32), np.array([0, 4], np.int32), np.arange(100, 104, dtype=np.int32),
              np.array([16], np.int32)]
    tables = ([shared[0], np.arange(4, dtype=np.int32)], [shared[1], indptr], [shared[2], indices], [shared[3], last])
    plans = {"paged": (lambda: p.plan(qo, indptr, indices, last, 4, 2, 64, 16, causal=True), 1),
             "ragged": (lambda: r.plan(qo, np.array([0, 40, 47, 347], np.int32), 4, 2, 64, causal=True), 1),
             "decode": (lambda: d.plan(indptr, indices, last, 4, 2, 64, 16), 1),
             "mla": (lambda: m.plan(qo, mla_indptr, np.arange(int(mla_indptr[-1]), dtype=np.int32), mla_lens, 16,
                                    512, 64, 64, True, 0.1, "float16", "float16"), 1),
             "cascade": (lambda: c.plan(*tables, 4, 2, 64, 16), 1),
             "cascade, another prefix": (lambda: c.plan(*next(moving), 4, 2, 64, 16), 2)}
    moving = itertools.cycle([tables, (tables[0], tables[1], [shared[2][::-1].copy(), indices], tables[3])])
    for name, (f, uploads) in plans.items():
        f()
        fake.calls.clear()
        f()
        assert dict(fake.calls) == {"event_query": uploads, "memcpyAsync": uploads, "event_record": uploads}, name
    assert c._kinds == ["prefill", "decode"]


def test_decode_takes_two_stages_for_large_batches_of_short_requests(monkeypatch):
    """The decode plan's stage rule (decode.SHORT_STAGES_MAX): 2 stages (3 CTAs per SM) on the sm_90 TMA kernel at hd128
    with a 16-bit cache when every request is short and they fill 3 CTAs per SM; else the default; not with a fixed
    split (one kernel whatever the batch); graph mode keeps the first plan's choice."""
    from cuattn import arrays, decode, jit, plan
    fake = _CountingCupy()
    monkeypatch.setattr(arrays, "cupy_module", lambda: fake)
    monkeypatch.setattr(arrays, "gpu_available", lambda: True)
    monkeypatch.setattr(plan, "num_sms", lambda device: 132)
    monkeypatch.setattr(decode, "_num_sms", lambda device: 132)
    monkeypatch.setattr(jit, "device_arch", lambda device: "sm_90a")
    monkeypatch.setattr(jit, "get_launcher", lambda *a, **k: None)

    def stages(batch, kv, w=None, kv_type="float16", head_dim=128, **kw):
        w = w or cuattn.BatchDecodeWithPagedKVCacheWrapper()
        pages = -(-kv // 16)
        w.plan((np.arange(batch + 1) * pages).astype(np.int32), np.arange(batch * pages, dtype=np.int32),
               np.full(batch, kv - (pages - 1) * 16, np.int32), 32, 8, head_dim, 16, kv_data_type=kv_type, **kw)
        return w._spec.num_stages, w
    assert stages(128, 256)[0] == 2 and stages(64, decode.SHORT_STAGES_MAX)[0] == 2
    assert stages(128, decode.SHORT_STAGES_MAX + 1)[0] == 0        # a longer request
    assert stages(32, 256)[0] == 0                                 # 256 CTAs: fewer than 3 per SM
    assert stages(128, 256, fixed_split_size=1024)[0] == 0 and stages(128, 256, disable_split_kv=True)[0] == 0
    assert stages(128, 256, kv_type="float8_e4m3fn")[0] == 0 and stages(128, 256, head_dim=64)[0] == 0
    _, g = stages(128, 256, w=cuattn.BatchDecodeWithPagedKVCacheWrapper(use_cuda_graph=True))
    assert stages(8, 4096, w=g)[0] == 2                            # graph mode: the first plan's kernel
    _, g = stages(16, 4096, w=cuattn.BatchDecodeWithPagedKVCacheWrapper(use_cuda_graph=True))
    assert stages(128, 256, w=g)[0] == 0


# ============================================================================ GPU


def _poisoned(shape, dtype=np.float16):
    return _cp().full(shape, np.nan, dtype)


SPLIT_CASES = [   # (kind, backend, causal, fixed_split_size): None = the scheduler's choice
    ("paged", "fa2", False, None), ("paged", "fa2", True, 64), ("paged", "fa2", True, 512),
    ("ragged", "fa2", True, None), ("ragged", "fa3", False, None), ("ragged", "fa3", True, 128),
    ("paged", "fa3", True, None), ("paged", "fa3", False, 256),
]


@pytest.mark.gpu
@pytest.mark.parametrize("kind,backend,causal,split", SPLIT_CASES,
                         ids=[f"{k}-{b}-{'causal' if c else 'full'}-{s}" for k, b, c, s in SPLIT_CASES])
def test_split_kv_prefill_matches_the_oracle(kind, backend, causal, split):
    """Short query runs over long keys (append, shared prefix): the scheduler splits the keys across
    the SMs and merges the pieces exactly; out and LSE poisoned with NaN before the run."""
    if backend == "fa3" and gpu_cc() < 90:
        pytest.skip("the fa3 backend needs compute capability 9.0")
    cp = _cp()
    rng = np.random.default_rng(7)
    qo_lens, kv_lens = [1, 17, 64, 200], [5000, 700, 3000, 3001]
    q, k, v, qo_indptr, kv_indptr = _ragged_inputs(rng, qo_lens, kv_lens, HQ, HKV, D)
    if kind == "paged":
        cache, indptr, indices, last, ks, vs = _paged_inputs(rng, kv_lens, 16, HKV, D, "NHD")
        w = cuattn.BatchPrefillWithPagedKVCacheWrapper(backend=backend)
        w.plan(qo_indptr, indptr, indices, last, HQ, HKV, D, 16, causal=causal, fixed_split_size=split)
        kv_args = (cp.asarray(cache),)
    else:
        ks = [k[kv_indptr[b]:kv_indptr[b + 1]] for b in range(4)]
        vs = [v[kv_indptr[b]:kv_indptr[b + 1]] for b in range(4)]
        w = cuattn.BatchPrefillWithRaggedKVCacheWrapper(backend=backend)
        w.plan(qo_indptr, kv_indptr, HQ, HKV, D, causal=causal, fixed_split_size=split)
        kv_args = (cp.asarray(k), cp.asarray(v))
    assert w._plan["work_list"].split, w.describe()
    assert "split-KV: " in w.describe() and w._plan["run_spec"].name in w.describe()
    out, lse = _poisoned(q.shape), _poisoned(q.shape[:2], np.float32)
    w.run(cp.asarray(q), *kv_args, out=out, lse=lse)
    ref_o, ref_s = oracle_batch(q, ks, vs, qo_indptr, causal)
    assert rel_err(cp.asnumpy(out), ref_o) < TOL
    assert rel_err(cp.asnumpy(lse), ref_s) < LSE_TOL


@pytest.mark.gpu
def test_split_kv_prefill_counts_the_sink_once_and_keeps_the_window():
    """A sink joins the first piece of a split item alone; a sliding window skips whole pieces."""
    cp = _cp()
    rng = np.random.default_rng(8)
    qo_lens, kv_lens = [3, 40], [4000, 2500]
    cache, indptr, indices, last, ks, vs = _paged_inputs(rng, kv_lens, 16, HKV, D, "NHD")
    qo_indptr = np.array([0, 3, 43], np.int32)
    q = rand(rng, (43, HQ, D), np.float16)
    sink = rng.standard_normal(HQ).astype(np.float32) + 3
    w = cuattn.BatchAttentionWithAttentionSinkWrapper(q_data_type="float16", kv_data_type="float16",
                                                      head_dim_qk=D, head_dim_vo=D, window_left=1500)
    w.plan(qo_indptr, indptr, indices, last, HQ, HKV, D, 16, causal=True, fixed_split_size=512)
    assert w._plan["work_list"].split
    out = w.run(cp.asarray(q), cp.asarray(cache), cp.asarray(sink), 1 / np.sqrt(D))
    w.plan(qo_indptr, indptr, indices, last, HQ, HKV, D, 16, causal=True, disable_split_kv=True)
    whole = w.run(cp.asarray(q), cp.asarray(cache), cp.asarray(sink), 1 / np.sqrt(D))
    assert rel_err(cp.asnumpy(out), cp.asnumpy(whole).astype(np.float64)) < 2e-3
    # the float64 answer: keys j in (i + shift - 1500 - 1, i + shift], plus exp(sink) in the denominator
    got = cp.asnumpy(out).astype(np.float64)
    for b, (qo, kv) in enumerate(zip(qo_lens, kv_lens)):
        qb = q[qo_indptr[b]:qo_indptr[b + 1]].astype(np.float64)
        kb, vb = ks[b].astype(np.float64), vs[b].astype(np.float64)
        for i in (0, qo - 1):
            pos = i + kv - qo
            keys = np.arange(max(0, pos - 1500), pos + 1)
            for h in (0, HQ - 1):
                s = kb[keys, h // (HQ // HKV)] @ qb[i, h] / np.sqrt(D)
                m = max(s.max(), sink[h])
                p = np.exp(s - m)
                want = p @ vb[keys, h // (HQ // HKV)] / (p.sum() + np.exp(sink[h] - m))
                assert rel_err(got[qo_indptr[b] + i, h], want) < 1e-2


def _graph_prefill_case(seed, kv_lens, qo_lens, kind, kv_tokens):
    rng = np.random.default_rng(seed)
    if kind == "paged":
        pages = sum(-(-n // 16) for n in kv_lens)        # every case's cache has 512 pages (the graph holds it)
        cache, indptr, indices, last, ks, vs = _paged_inputs(rng, kv_lens, 16, HKV, D, "NHD",
                                                             extra_pages=max(512 - pages, 0))
        return dict(cache=cache, indptr=indptr, indices=indices, last=last, ks=ks, vs=vs,
                    q=rand(rng, (sum(qo_lens), HQ, D), np.float16),
                    qo_indptr=np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32))
    q, k, v, qo_indptr, kv_indptr = _ragged_inputs(rng, qo_lens, kv_lens, HQ, HKV, D)
    kk, vv = rand(rng, (kv_tokens, HKV, D), np.float16), rand(rng, (kv_tokens, HKV, D), np.float16)
    kk[:len(k)], vv[:len(v)] = k, v                        # fixed arrays (the graph holds their address)
    return dict(q=q, k=kk, v=vv, qo_indptr=qo_indptr, kv_indptr=kv_indptr,
                ks=[k[kv_indptr[b]:kv_indptr[b + 1]] for b in range(len(qo_lens))],
                vs=[v[kv_indptr[b]:kv_indptr[b + 1]] for b in range(len(qo_lens))])


def _plan_graph_case(w, c, kind, causal):
    if kind == "paged":
        w.plan(c["qo_indptr"], c["indptr"], c["indices"], c["last"], HQ, HKV, D, 16, causal=causal)
    else:
        w.plan(c["qo_indptr"], c["kv_indptr"], HQ, HKV, D, causal=causal)


@pytest.mark.gpu
@pytest.mark.parametrize("kind,backend", [("paged", "fa2"), ("ragged", "auto")])
def test_prefill_cuda_graph_replays_after_replans_with_new_lengths(kind, backend):
    """Captured once; re-planned with other lengths (a split and an unsplit plan; the same number of
    queries, the graph holds q's address), the replay equals the oracle each time."""
    cp = _cp()
    wrapper = cuattn.BatchPrefillWithPagedKVCacheWrapper if kind == "paged" else cuattn.BatchPrefillWithRaggedKVCacheWrapper
    w = wrapper(backend=backend, use_cuda_graph=True)
    plans = [([300, 40, 900], [3, 1, 60]), ([4000, 41, 20], [30, 33, 1]), ([17, 17, 300], [17, 17, 30])]
    cases = [_graph_prefill_case(11 + i, kv, qo, kind, 6000) for i, (kv, qo) in enumerate(plans)]
    stream = cp.cuda.Stream(non_blocking=True)
    q = cp.asarray(cases[0]["q"])
    kv = [cp.asarray(cases[0]["cache"])] if kind == "paged" else [cp.asarray(cases[0]["k"]), cp.asarray(cases[0]["v"])]
    out, lse = _poisoned(q.shape), _poisoned(q.shape[:2], np.float32)
    splits = []
    with stream:
        _plan_graph_case(w, cases[0], kind, True)
        w.run(q, *kv, out=out, lse=lse)                          # warm-up: compiles, sets smem sizes
        stream.begin_capture()
        w.run(q, *kv, out=out, lse=lse)
        graph = stream.end_capture()
        for c in cases:
            _plan_graph_case(w, c, kind, True)
            splits.append(w._plan["work_list"].split)
            q[...] = cp.asarray(c["q"])
            if kind == "paged":
                kv[0][...] = cp.asarray(c["cache"])
            else:
                kv[0][...], kv[1][...] = cp.asarray(c["k"]), cp.asarray(c["v"])
            out.fill(np.nan)
            graph.launch()
            stream.synchronize()
            ref_o, ref_s = oracle_batch(c["q"], c["ks"], c["vs"], c["qo_indptr"], True)
            assert rel_err(cp.asnumpy(out), ref_o) < TOL and rel_err(cp.asnumpy(lse), ref_s) < LSE_TOL
    assert any(splits) and not all(splits), splits                # the graph replays split and unsplit plans
    with pytest.raises(ValueError, match="use_cuda_graph=True"):   # past the first plan's capacity
        many = _graph_prefill_case(20, [1] * 4000, [1] * 4000, kind, 6000)
        _plan_graph_case(w, many, kind, True)


@pytest.mark.gpu
def test_prefill_cuda_graph_through_torch_replays_after_a_replan():
    torch = pytest.importorskip("torch")
    w = cuattn.BatchPrefillWithPagedKVCacheWrapper(use_cuda_graph=True)
    cases = [_graph_prefill_case(30 + i, kv, [5, 2], "paged", 0) for i, kv in enumerate(([700, 30], [60, 3000]))]
    q = torch.tensor(cases[0]["q"], device="cuda")
    cache = torch.tensor(cases[0]["cache"], device="cuda")
    out = torch.full_like(q, float("nan"))
    _plan_graph_case(w, cases[0], "paged", False)
    _cp().cuda.Device().synchronize()          # plan() of NumPy arrays uploads on CuPy's current stream
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        w.run(q, cache, out=out)                                   # warm-up on a side stream
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        w.run(q, cache, out=out)
    for c in cases:
        _plan_graph_case(w, c, "paged", False)
        _cp().cuda.Device().synchronize()
        q.copy_(torch.tensor(c["q"]))
        cache.copy_(torch.tensor(c["cache"]))
        graph.replay()
        torch.cuda.synchronize()
        ref_o, _ = oracle_batch(c["q"], c["ks"], c["vs"], c["qo_indptr"], False)
        assert rel_err(out.cpu().numpy(), ref_o) < TOL


@pytest.mark.gpu
def test_cascade_cuda_graph_replays_after_a_replan():
    cp = _cp()
    levels = CASES["3-level decode"]
    tables, cache, q, per_q = make_cascade(3, levels, HQ, HKV, D, 16)
    w = cuattn.MultiLevelCascadeAttentionWrapper(3, use_cuda_graph=True)
    args = lambda t: ([x[0] for x in t], [x[1] for x in t], [x[2] for x in t], [x[3] for x in t])
    w.plan(*args(tables), HQ, HKV, D, 16)
    assert "level 2: BatchDecodeWithPagedKVCacheWrapper" in w.describe()     # one query per group: decode
    qd, cd = cp.asarray(q), cp.asarray(cache)
    out, lse = _poisoned(q.shape), _poisoned(q.shape[:2], np.float32)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        w.run(qd, cd, out=out, lse=lse)
        stream.begin_capture()
        w.run(qd, cd, out=out, lse=lse)
        graph = stream.end_capture()
        # the same queries over other suffix lengths (the same pages in all: the graph holds the cache)
        levels2 = levels[:2] + [([1] * 6, [30, 12, 3, 16, 9, 1])]
        tables2, cache2, q2, per_q2 = make_cascade(4, levels2, HQ, HKV, D, 16)
        assert cache2.shape == cache.shape
        w.plan(*args(tables2), HQ, HKV, D, 16)
        cd[...], qd[...] = cp.asarray(cache2), cp.asarray(q2)
        graph.launch()
        stream.synchronize()
    want, want_lse = cascade_oracle(q2, per_q2)
    assert rel_err(cp.asnumpy(out), want) < 1e-2 and np.abs(cp.asnumpy(lse) - want_lse).max() < 2e-3 * np.abs(want_lse).max()


@pytest.mark.gpu
def test_run_refuses_a_capture_the_wrapper_was_not_built_for():
    cp = _cp()
    rng = np.random.default_rng(5)
    cache, indptr, indices, last, _, _ = _paged_inputs(rng, [300, 20], 16, HKV, D, "NHD")
    cd = cp.asarray(cache)
    d = cuattn.BatchDecodeWithPagedKVCacheWrapper()
    d.plan(indptr, indices, last, HQ, HKV, D, 16)
    p = cuattn.BatchPrefillWithPagedKVCacheWrapper()
    p.plan(np.array([0, 2, 3], np.int32), indptr, indices, last, HQ, HKV, D, 16)
    c = cuattn.MultiLevelCascadeAttentionWrapper(1)
    c.plan([np.array([0, 1, 2], np.int32)], [indptr], [indices], [last], HQ, HKV, D, 16)
    q2, q3 = cp.asarray(rand(rng, (2, HQ, D), np.float16)), cp.asarray(rand(rng, (3, HQ, D), np.float16))
    out2, out3 = cp.empty_like(q2), cp.empty_like(q3)
    runs = [lambda: d.run(q2, cd, out=out2), lambda: p.run(q3, cd, out=out3), lambda: c.run(q2, cd, out=out2)]
    stream = cp.cuda.Stream(non_blocking=True)
    for run in runs:
        with stream:
            run()                                        # eager: fine (and allocates outside the capture)
            stream.begin_capture()
            try:
                with pytest.raises(RuntimeError, match="use_cuda_graph=True"):
                    run()
            finally:
                stream.end_capture()


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["decode", "paged", "ragged"])
def test_fixed_split_size_makes_a_request_bitwise_the_same_alone_or_in_any_batch(kind):
    cp = _cp()
    rng = np.random.default_rng(21)
    n = 32
    # request 0 long enough to split; the others short (their random K/V are most of the test's host time)
    kv_lens = [3000] + list(rng.integers(1, 600, n - 1))
    qo_lens = [1] * n if kind == "decode" else [37] + list(rng.integers(1, 100, n - 1))
    q, k, v, qo_indptr, kv_indptr = _ragged_inputs(rng, qo_lens, kv_lens, HQ, HKV, D)
    cache, indptr, indices, last, ks, vs = _paged_inputs(rng, kv_lens, 16, HKV, D, "NHD")
    cd, kd, vd = cp.asarray(cache), cp.asarray(k), cp.asarray(v)
    answers = []
    for batch in (1, 4, 12, 32):
        sub = lambda a, b=batch: a[:b + 1]
        rows = int(qo_indptr[batch])
        if kind == "decode":
            w = cuattn.BatchDecodeWithPagedKVCacheWrapper()
            w.plan(sub(indptr), indices[:indptr[batch]], last[:batch], HQ, HKV, D, 16, fixed_split_size=1024)
            o = w.run(cp.asarray(q[:rows]), cd)
        elif kind == "paged":
            w = cuattn.BatchPrefillWithPagedKVCacheWrapper()
            w.plan(sub(qo_indptr), sub(indptr), indices[:indptr[batch]], last[:batch], HQ, HKV, D, 16, causal=True,
                   fixed_split_size=1024)
            o = w.run(cp.asarray(q[:rows]), cd)
        else:
            w = cuattn.BatchPrefillWithRaggedKVCacheWrapper()
            w.plan(sub(qo_indptr), sub(kv_indptr), HQ, HKV, D, causal=True, fixed_split_size=1024)
            o = w.run(cp.asarray(q[:rows]), kd, vd)
        answers.append(cp.asnumpy(o[:qo_lens[0]]))
    for a in answers[1:]:
        assert np.array_equal(a.view(np.uint16), answers[0].view(np.uint16))
    k0, v0 = (k[:kv_lens[0]], v[:kv_lens[0]]) if kind == "ragged" else (ks[0], vs[0])
    assert rel_err(answers[0], dense_attention(q[:qo_lens[0]], k0, v0, causal=kind != "decode")[0]) < TOL
