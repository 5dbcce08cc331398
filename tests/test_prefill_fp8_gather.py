"""The fa3 gather's reworked fp8 loop (issue 22; kernels_cu/prefill_sm90_gather_fp8.cuh), an A/B tuning beside the
shipped loop: FP8_GATHER 1 / 2 (8- / 16-byte loads), FP8_GATHER_DEPTH 0 / 1 / 2 (load order), FP8_GATHER_NOALLOC. CPU:
every variant compiles for sm_90a without spills at its own producer register count, over the specs an fp8 cache
reaches. GPU (sm_90): paged prefill under each variant against tests/oracle.py's float64 attention over the real
(dequantised) K/V, pages of 1 and 16, causal or not, e4m3 and e5m2, the cache's page 0 a free page of NaN bits (the
loop reads row 0 for keys past a request's end: K's must be masked, V's zeroed), outputs poisoned, every element
checked; and compute-sanitizer memcheck over small batches with no spare page."""
import dataclasses

import numpy as np
import pytest

import cuattn
from cuattn import jit, prefill_sm90
from tests.conftest import gpu_cc
from tests.prefill_dtype_cases import FP8_NAME, _check, _cp, _dev, _dev_scale, _ids, _oracle, _poisoned, paged_fp8_case

# the A/B candidates (benchmarks/bench_fa3_tuning.py --tunings takes the same strings)
TUNINGS = ["FP8_GATHER=1,FP8_GATHER_DEPTH=0", "FP8_GATHER=2,FP8_GATHER_DEPTH=0", "FP8_GATHER=1", "FP8_GATHER=2",
           "FP8_GATHER=1,FP8_GATHER_DEPTH=2", "FP8_GATHER=2,FP8_GATHER_DEPTH=2", "FP8_GATHER=2,FP8_GATHER_NOALLOC=1"]


def tuned_spec(tuning: str, *args, **kwargs) -> prefill_sm90.Sm90PrefillSpec:
    """prefill_sm90.make_spec(*args, **kwargs) with the tuning's defines where it is an fp8 gather spec."""
    spec = _MAKE_SPEC(*args, **kwargs)
    return dataclasses.replace(spec, tuning=tuple(tuning.split(","))) if spec.gather and spec.dtype_kv else spec


_MAKE_SPEC = prefill_sm90.make_spec


# ============================================================================ CPU (CI)

# (q dtype, causal, kv, head_dim): where ptxas's allocation differed (prefill_sm90_layout.cuh FP8_GATHER_REGS_OWN)
SPILL_GRID = [(t, c, kv, 128) for t in ("f16", "bf16") for c in (False, True) for kv in ("e4m3", "e5m2")] + \
    [("f16", False, "e4m3", 64), ("f16", True, "e4m3", 64), ("bf16", False, "e5m2", 64), ("bf16", True, "e5m2", 64)]


def test_fp8_gather_variants_compile_without_spills():
    specs = [tuned_spec(tun, t, c, paged=True, dtype_kv=kv, head_dim_qk=d, page_size=1)
             for tun in TUNINGS for t, c, kv, d in SPILL_GRID]
    assert all(s.gather and s.stages == 3 and s.tuning for s in specs)
    assert len({s.name for s in specs}) == len(specs)          # the tuning is in the name: one cache entry each
    jit.precompile([(s, "sm_90a") for s in specs])             # over the cores; checked below
    for spec in specs:
        res = jit.compile_kernel(spec, "sm_90a").resources["cuattn_prefill_sm90"]
        assert res["spill_stores"] == res["spill_loads"] == res["stack_frame"] == 0, (spec.name, res)


def test_fp8_gather_tunings_stay_out_of_shipped_specs():
    """The shipped fp8 specs carry no tuning: their loop is prefill_sm90_layout.cuh's FP8_GATHER default (0, the
    Fp8Rows loop, until an H100 A/B picks a variant)."""
    fp8 = [s for s in prefill_sm90.shipped_specs() if s.dtype_kv]
    assert fp8 and all(s.gather and not s.tuning and "-DFP8_GATHER" not in " ".join(s.defines()) for s in fp8)


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
@pytest.mark.parametrize("case", CASES, ids=_ids(CASES))
@pytest.mark.parametrize("tuning", TUNINGS)
def test_fa3_fp8_gather_variant_matches_dequantised_oracle(tuning, case, monkeypatch):
    qo_lens, kv_lens, ps, hq, hkv, kv, qdt, sk, causal, layout, d, split = case
    c = _page0_free(paged_fp8_case(qo_lens, kv_lens, ps, hq, hkv, d, kv, qdt, sk, layout, seed=len(qo_lens) * 3 + ps))
    monkeypatch.setattr(prefill_sm90, "make_spec", lambda *a, **kw: tuned_spec(tuning, *a, **kw))
    w = cuattn.BatchPrefillWithPagedKVCacheWrapper(kv_layout=layout, backend="fa3")
    w.plan(_dev(c["qo_indptr"]), _dev(c["indptr"]), _dev(c["indices"]), _dev(c["last"]), hq, hkv, d, ps,
           causal=causal, q_data_type=qdt, kv_data_type=FP8_NAME[kv], fixed_split_size=split)
    spec = w._plan["run_spec"]
    assert spec.gather and spec.dtype_kv == kv and ",".join(spec.tuning) == tuning
    assert split is None or w._plan["work_list"].split
    rows = int(c["qo_indptr"][-1])
    out, lse = _poisoned((rows, hq, d), qdt), _cp().full((rows, hq), np.nan, np.float32)
    w.run(_dev(c["q"]), (_dev(c["k"]), _dev(c["v"])), out=out, lse=lse, k_scale=_dev_scale(c["scales"][0]),
          v_scale=_dev_scale(c["scales"][1]))
    ref_o, ref_s = _oracle(c["q"], c["ks"], c["vs"], c["qo_indptr"], causal)
    _check(out, lse, ref_o, ref_s, qdt)


@pytest.mark.gpu
@sm90
def test_fa3_fp8_gather_variants_are_memcheck_clean():
    """compute-sanitizer memcheck over tests/sanitize_paged_fa3.py's fp8 batches (no spare page past the last
    request's: a read past the cache leaves its allocation) under every variant: no invalid access, no error."""
    import os
    import shutil
    import subprocess
    import sys
    tool = shutil.which("compute-sanitizer") or next(
        (p for p in ("/usr/local/cuda/bin/compute-sanitizer",) if os.path.exists(p)), None)
    if tool is None:
        pytest.skip("compute-sanitizer is not installed")
    script = os.path.join(os.path.dirname(__file__), "sanitize_paged_fa3.py")
    r = subprocess.run([tool, "--tool", "memcheck", "--error-exitcode", "3", sys.executable, script, "--fp8-tunings",
                        *TUNINGS], capture_output=True, text=True, timeout=480,
                       env={**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(script))})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "ERROR SUMMARY: 0 errors" in r.stdout + r.stderr
    assert all(f"_gather_kve{kv}_" in r.stdout for kv in ("4m3", "5m2"))
    assert all("_" + t.replace("=", "").replace(",", "_").lower() in r.stdout for t in TUNINGS)
