"""The fa3 gather's fp8 loop (issue 22; kernels_cu/prefill_sm90_gather_fp8.cuh: 16-byte loads at head_dim 128, 8-byte
at 64, each row reloaded with the next tile's as soon as it is stored, tile 0's V rows staged as fp8 by cp.async).
CPU: it compiles for sm_90a without spills over the specs an fp8 cache reaches; the launch refuses an fp8 cache whose
pointers or byte strides are not multiples of 16. GPU (sm_90): paged prefill against tests/oracle.py's float64
attention over the real (dequantised) K/V, pages of 1 and 16, causal or not, e4m3 and e5m2, head_dim 64 and 128,
split-KV, the cache's page 0 a free page of NaN bits (the loop reads row 0 for keys past a request's end: K's must be
masked, V's zeroed), outputs poisoned, every element checked (compute-sanitizer memcheck of the fp8 cases:
tests/test_prefill_sm90.py's sanitize_paged_fa3.py run)."""
import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest

import cuattn
from cuattn import jit, prefill_sm90
from tests.conftest import gpu_cc
from tests.prefill_dtype_cases import FP8_NAME, _cp, _dev, _ids, paged_fp8_case, run_paged_fp8_and_check

# ============================================================================ CPU (CI)

# (q dtype, causal, kv, head_dim): the specs an fp8 cache reaches (ptxas's allocation in the setmaxnreg region moves
# non-monotonically with the producer's register count, prefill_sm90_layout.cuh PRODUCER_REGS: checked here)
SPILL_GRID = [(t, c, kv, d) for t in ("f16", "bf16") for c in (False, True) for kv in ("e4m3", "e5m2") for d in (64, 128)]


def test_fp8_gather_compiles_without_spills():
    specs = [prefill_sm90.make_spec(t, c, paged=True, dtype_kv=kv, head_dim_qk=d, page_size=1)
             for t, c, kv, d in SPILL_GRID]
    assert all(s.gather and not s.tuning and (s.stages, s.fp8_ring) == ((2, 2) if s.head_dim_qk == 128 else (3, 0))
               for s in specs)
    jit.precompile([(s, "sm_90a") for s in specs])             # over the cores; checked below
    for spec in specs:
        res = jit.compile_kernel(spec, "sm_90a").resources["cuattn_prefill_sm90"]
        assert max(res["spill_stores"], res["spill_loads"], res["stack_frame"]) <= spec.spill_bytes, (spec.name, res)
    assert all(s.spill_bytes == 0 for s in specs)
    # the register form at head_dim 128 (before the ring), as an experiment builds it: within its bound
    reg = dataclasses.replace(specs[-1], fp8_ring=0, stages=3)
    assert reg.spill_bytes == (64 if reg.dtype_kv == "e4m3" else 0) and "_ring" not in reg.name


def test_gather_args_give_byte_strides_and_the_page_stride_in_slots():
    """The gather's cache parameters: element strides times the element size (fp8 1, 16-bit 2), the page stride in
    slots. (Alignment is run()'s check before any launch: test_fa3_fp8_gather_refuses_a_cache_off_16_bytes_at_run.)"""
    for kv_bytes in (1, 2):
        a = prefill_sm90.gather_args(SimpleNamespace(ptr=1 << 20), SimpleNamespace(ptr=1 << 21), (1024, 128, 16384),
                                     (1024, 128, 16384), (16, 100, 100), kv_bytes, "run")
        assert a == dict(k_cache=1 << 20, v_cache=1 << 21, k_s_row=1024 * kv_bytes, k_s_head=128 * kv_bytes,
                         v_s_row=1024 * kv_bytes, v_s_head=128 * kv_bytes, page_rows=16)


# ============================================================================ GPU

sm90 = pytest.mark.skipif(gpu_cc() != 90, reason="the fa3 kernel needs an sm_90 GPU")

# (qo_lens, kv_lens, page_size, hq, hkv, kv, q dtype, scales, causal, layout, head_dim, fixed_split_size): one-tile,
# two-tile and long (39 tiles: every stage reused) requests, decode-like rows, kv_len 1, a split request
CASES = [
    ([17, 1, 300], [54, 97, 300], 16, 32, 8, "e4m3", "float16", "tensor", True, "NHD", 128, None),
    ([127, 33], [4932, 40], 16, 28, 4, "e5m2", "bfloat16", "one", False, "HND", 128, None),
    ([64, 7], [512, 7], 1, 32, 8, "e5m2", "bfloat16", "head", False, "NHD", 128, None),
    ([130, 5], [700, 260], 1, 16, 4, "e4m3", "float16", "head", True, "HND", 128, None),
    ([1, 1, 1, 1], [2048, 17, 300, 1], 16, 32, 8, "e4m3", "float16", "head", False, "NHD", 128, None),
    ([40, 300], [3000, 2100], 16, 16, 4, "e5m2", "float16", "head", True, "NHD", 128, 512),
    ([33, 2], [129, 1000], 16, 16, 2, "e4m3", "bfloat16", "head", True, "NHD", 64, None),
]


def _page0_free(c):
    """The case with page 0 of its cache a free page (NaN bits), swapped with a free one if a request owns it:
    the loop's row 0, which it reads for keys past a request's end."""
    used = set(c["indices"].tolist())
    if 0 in used:
        u = next(p for p in range(c["k"].shape[0]) if p not in used)
        c["indices"] = np.where(c["indices"] == 0, u, c["indices"]).astype(np.int32)
        for a in (c["k"], c["v"]):
            a[[0, u]] = a[[u, 0]]
    assert np.isnan(c["k"][0].astype(np.float32)).all() and np.isnan(c["v"][0].astype(np.float32)).all()
    return c


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("ahead", [False, True], ids=["in-kernel", "ahead"])
@pytest.mark.parametrize("case", CASES, ids=_ids(CASES))
def test_fa3_fp8_gather_matches_dequantised_oracle(case, ahead, monkeypatch):
    """The fp8 gather (rows converted in the kernel), and the same batches with the rows converted once ahead of the
    contiguous kernel (cuattn/prefill_ahead.py, forced here at every size)."""
    from cuattn import prefill_ahead
    for name in ("MIN_SHARING", "MIN_READS"):
        monkeypatch.setattr(prefill_ahead, name, {k: 0 if ahead else float("inf") for k in prefill_ahead.MIN_SHARING})
    qo_lens, kv_lens, ps, hq, hkv, kv, qdt, sk, causal, layout, d, split = case
    c = _page0_free(paged_fp8_case(qo_lens, kv_lens, ps, hq, hkv, d, kv, qdt, sk, layout, seed=len(qo_lens) * 3 + ps))
    w = cuattn.BatchPrefillWithPagedKVCacheWrapper(kv_layout=layout, backend="fa3")
    w.plan(_dev(c["qo_indptr"]), _dev(c["indptr"]), _dev(c["indices"]), _dev(c["last"]), hq, hkv, d, ps,
           causal=causal, q_data_type=qdt, kv_data_type=FP8_NAME[kv], fixed_split_size=split)
    spec = w._plan["run_spec"]
    if ahead:
        assert w._plan.kv_ahead and not spec.paged and not spec.dtype_kv and spec.persistent
        assert spec.dtype == {"float16": "f16", "bfloat16": "bf16"}[qdt] and "converted to 16 bits" in w.describe()
    else:
        assert spec.gather and spec.dtype_kv == kv and not spec.tuning and not w._plan.kv_ahead
    assert split is None or w._plan["work_list"].split
    run_paged_fp8_and_check(w, c, hq, d, qdt, causal)


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("ahead", [False, True], ids=["in-kernel", "ahead"])
def test_fa3_fp8_gather_refuses_a_cache_off_16_bytes_at_run(ahead, monkeypatch):
    """The gather's 16-byte loads, and the rows gathered ahead (prefill_ahead: its loads are 16 bytes too): run()'s
    alignment check (arrays.check_aligned, every prefill kernel's) refuses the cache before either is reached."""
    from cuattn import prefill_ahead
    for name in ("MIN_SHARING", "MIN_READS"):
        monkeypatch.setattr(prefill_ahead, name, {k: 0 if ahead else float("inf") for k in prefill_ahead.MIN_SHARING})
    c = paged_fp8_case([5], [40], 16, 8, 2, 128, "e4m3", "float16", "one", seed=3)
    w = cuattn.BatchPrefillWithPagedKVCacheWrapper(backend="fa3")
    w.plan(_dev(c["qo_indptr"]), _dev(c["indptr"]), _dev(c["indices"]), _dev(c["last"]), 8, 2, 128, 16,
           q_data_type="float16", kv_data_type="float8_e4m3fn")
    assert w._plan.kv_ahead is ahead
    k, v = _dev(c["k"]), _dev(c["v"])
    buf = _cp().empty(k.size + 16, _cp().uint8)
    off = buf[8:8 + k.size].reshape(k.shape)                   # K's pointer 8 bytes off 16
    off[...] = k
    with pytest.raises(ValueError, match="run: paged_kv_cache must start at a 16-byte aligned address"):
        w.run(_dev(c["q"]), (off, v))
    assert w.run(_dev(c["q"]), (k, v)).shape == (5, 8, 128)
