"""The Hopper prefill backend "fa3" (kernels_cu/prefill_sm90.cu): compile checks (CI) and the kernel
against tests/oracle.py on an sm_90 GPU (gpu marker)."""
import itertools
import random

import numpy as np
import pytest

import cuattn
from cuattn import jit, plan, prefill, prefill_sm90, variants
from cuattn.errors import UnsupportedError

from .conftest import gpu_cc, memcheck
from .oracle import dense_attention, rel_err
from .test_prefill import (DTYPES, LSE_TOL, TOL, _cp, _from_dev, _nan_like, _poison_pool, _to_dev, oracle_batch,
                           rand)

# ============================================================================ CPU (CI)


NEW_DIMS = [(64, 64), (256, 256), (192, 128)]      # (head_dim_qk, head_dim_vo) beside 128


def test_sm90_specs_compile_without_spills():
    specs = prefill_sm90.shipped_specs()
    # hd128: f16 / bf16 x full / causal x contiguous / paged / paged 64-row tiles, and paged fp8 (e4m3 / e5m2;
    # tests/test_prefill_fp8.py); other dims: f16 / bf16 paged causal
    assert len({s.name for s in specs}) == len(specs) == 12 + 8 + 2 * len(NEW_DIMS)
    assert sum(s.block_m == 64 for s in specs) == 4
    assert {(s.head_dim_qk, s.head_dim_vo) for s in specs} == set(prefill_sm90.HEAD_DIMS)
    # the other head dims' contiguous non-causal kernels (first use) too: both axes the shipped ones fix
    extra = [prefill_sm90.make_spec("bf16", False, head_dim_qk=dk, head_dim_vo=dv) for dk, dv in NEW_DIMS]
    jit.precompile([(spec, "sm_90a") for spec in specs + extra])     # over the cores; checked below
    for spec in specs + extra:
        assert spec.archs == ("sm_90a",) and spec.smem_bytes <= 227 * 1024, spec.name
        compiled = jit.compile_kernel(spec, "sm_90a")
        res = compiled.resources["cuattn_prefill_sm90"]
        assert max(res["spill_stores"], res["spill_loads"], res["stack_frame"]) <= spec.spill_bytes, (spec.name, res)


def test_sm90_spec_geometry_follows_the_head_dims():
    for (dk, dv), bn, st, name in (((64, 64), 128, 3, "prefill_sm90_hd64_qf16_causal_gather_bm128_bn128_s3_persist"),
                                   ((128, 128), 128, 3, "prefill_sm90_hd128_qf16_causal_gather_bm128_bn128_s3_persist"),
                                   ((256, 256), 64, 2, "prefill_sm90_hd256_qf16_causal_gather_bm128_bn64_s2"),
                                   ((192, 128), 128, 2, "prefill_sm90_hd192v128_qf16_causal_gather_bm128_bn128_s2")):
        spec = prefill_sm90.make_spec("f16", True, paged=True, head_dim_qk=dk, head_dim_vo=dv)
        assert (spec.head_dim_qk, spec.head_dim_vo, spec.block_n, spec.stages, spec.name) == (dk, dv, bn, st, name)
        assert f"-DHEAD_DIM_QK={dk}" in spec.defines() and f"-DHEAD_DIM_VO={dv}" in spec.defines()
        slots = (4 * 8 + 2 * 64) * spec.persistent           # the persistent form's item slots
        assert spec.smem_bytes == 1024 + 128 * dk * 2 + st * bn * (dk + dv) * 2 + 32 * st + slots
    assert prefill_sm90.make_spec("f16", False, head_dim_qk=64) == prefill_sm90.make_spec("f16", False, head_dim_qk=64,
                                                                                          head_dim_vo=64)


def test_sm90_smem_mirror_is_checked_at_compile_time():
    """The launch sizes shared memory from spec.smem_bytes: a spec that disagrees with the kernel's
    SMEM_BYTES must not compile."""
    import dataclasses
    from cuattn.errors import CompileError

    @dataclasses.dataclass(frozen=True)
    class Wrong(prefill_sm90.Sm90PrefillSpec):
        @property
        def smem_bytes(self) -> int:
            return super().smem_bytes - 1024
    spec = Wrong("f16", False, 256, 256, 64)
    with pytest.raises(CompileError, match="smem_bytes"):
        jit.compile_kernel(spec, "sm_90a")


def test_sm90_specs_are_shipped_for_sm90a_only():
    from cuattn import cli
    names = {s.name for s in prefill_sm90.shipped_specs()}
    assert names <= {s.name for s in cli.shipped_specs("sm_90a")}
    assert not names & {s.name for s in cli.shipped_specs("sm_80")}


def test_fa3_where_it_has_no_kernel_raises_naming_the_case():
    reason = prefill_sm90.unsupported_reason
    assert reason("sm_90a", 96, "f16", False, False) == (
        "fa3 has kernels for head_dim 64, 128, 256 and head_dim_qk / head_dim_vo 192 / 128, got head_dim=96")
    assert reason("sm_90a", 128, "f16", False, False, head_dim_vo=64).endswith(
        "got head_dim_qk=128, head_dim_vo=64")
    for dk, dv in prefill_sm90.HEAD_DIMS:
        assert reason("sm_90a", dk, "bf16", False, True, page_size=16, head_dim_vo=dv) is None
    # 16-bit pages a TMA box cannot hold (1, 5, 96 at head_dim 256): the cp.async gather producer (no query /
    # key transform at head_dim 256 there); fp8 pages likewise (converted in registers)
    for dk, dv in prefill_sm90.HEAD_DIMS:
        for ps in (1, 5, 24):
            assert reason("sm_90a", dk, "f16", False, True, page_size=ps, head_dim_vo=dv) is None
            r = reason("sm_90a", dk, "f16", False, True, True, page_size=ps, head_dim_vo=dv)
            assert r is None if dk != 256 else "no query / key transform" in r
    for kv in ("e4m3", "e5m2"):
        for dk in (64, 128):
            for ps in (1, 5, 96, 192):
                assert reason("sm_90a", dk, "f16", False, True, page_size=ps, dtype_kv=kv) is None
    # head_dim 256 tiles are 64 keys: pages of 192 box (3 tiles of 64), pages of 96 do not (gathered)
    assert reason("sm_90a", 256, "f16", False, True, page_size=192) is None
    assert reason("sm_90a", 256, "f16", False, True, page_size=96) is None

    # the producer: the gather for every cache (3 stages where they fit), TMA boxes for the RoPE at head_dim 256
    # (pages no box fits: fa2 there, above)
    rope = variants.resolve("f", num_qo_heads=8, head_dim=256, pos_encoding_mode="ROPE_LLAMA").composite
    for ps in (1, 5, 16, 24, 64, 256):
        for dk, dv in prefill_sm90.HEAD_DIMS:
            spec = prefill_sm90.make_spec("f16", True, paged=True, page_size=ps, head_dim_qk=dk, head_dim_vo=dv)
            assert spec.gather and "_gather" in spec.name and "-DPAGED=2" in spec.defines()
            assert spec.stages == (3 if dk <= 128 else 2) and spec.smem_bytes <= prefill_sm90.SMEM_LIMIT
            if (dk, dv) in prefill_sm90.FP8_HEAD_DIMS:   # fp8: 3 stages at 64; at 128 the ring of 2 fp8 tiles, 2 stages
                f8 = prefill_sm90.make_spec("f16", True, paged=True, page_size=ps, dtype_kv="e4m3", head_dim_qk=dk)
                assert f8.gather and (f8.stages, f8.fp8_ring) == ((2, 2) if dk == 128 else (3, 0))
                assert f8.smem_bytes <= prefill_sm90.SMEM_LIMIT and ("_ring2" in f8.name) is (dk == 128)
        r256 = prefill_sm90.make_spec("f16", True, rope, paged=True, page_size=ps, head_dim_qk=256)
        assert r256.gather is (prefill_sm90.page_box(ps, 64) is None) and ("-DPAGED=1" in r256.defines()) is not r256.gather
    with pytest.raises(UnsupportedError, match="sm_90"):
        prefill.resolve_backend("fa3", "f", arch="sm_80", head_dim=128, dtype="f16", custom_mask=False, paged=False)
    # auto never picks fa3 off sm_90 or where it has no kernel (a custom mask is a variant: tests/test_mask_variant.py)
    for kw in (dict(arch="sm_80"), dict(arch="sm_90a", paged=True, page_size=1, rope=True, head_dim=256)):
        args = dict(dict(head_dim=128, dtype="f16", custom_mask=False, paged=False), **kw)
        assert prefill.resolve_backend("auto", "f", **args) == "fa2"
    for kw in (dict(paged=False), dict(paged=True, page_size=16), dict(paged=True, page_size=256),
               dict(paged=True, page_size=1), dict(paged=True, page_size=5)):
        for dk, dv in prefill_sm90.HEAD_DIMS:
            assert prefill.resolve_backend("auto", "f", arch="sm_90a", head_dim=dk, head_dim_vo=dv, dtype="bf16",
                                           custom_mask=False, **kw) == "fa3", (dk, dv, kw)


# -- fp8 K/V and query / key transforms at every head dim (the merged features)

def _query_only():
    return variants.Composite((cuattn.Variant("q_half", query_transform="return make_float2(x.x * 0.5f, x.y * 0.5f);"),))


def _feature_grid():
    """(spec, what): every head-dim pair x 16-bit / e4m3 (where fa3 takes fp8; bf16 q: converted to f16,
    and f16 q) x contiguous / paged x plain / fused RoPE / a user key transform / a query-only transform
    (where the API allows transforms: a 16-bit cache, head_dim_vo == head_dim_qk), causal."""
    from .test_qk_transform import KEY_SCALE
    out = []
    rope = variants.resolve("f", num_qo_heads=8, head_dim=64, pos_encoding_mode="ROPE_LLAMA").composite
    for dk, dv in prefill_sm90.HEAD_DIMS:      # (the RoPE's rotary_dim is a run-time parameter)
        xforms = [variants.DEFAULT] + ([rope, variants.Composite((KEY_SCALE,)), _query_only()] if dk == dv else [])
        for paged in (False, True):
            out += [prefill_sm90.make_spec("bf16", True, v, paged, "", dk, dv, gather=False) for v in xforms]   # boxes
            if (dk, dv) in prefill_sm90.FP8_HEAD_DIMS:
                out += [prefill_sm90.make_spec(t, True, paged=paged, dtype_kv="e4m3", head_dim_qk=dk, head_dim_vo=dv)
                        for t in ("bf16", "f16")]
        # the gather producer (pages of 1): plain, a custom mask, the transforms (no RoPE at head_dim 256)
        out += [prefill_sm90.make_spec("bf16", c, v, True, "", dk, dv, page_size=1)
                for c, v in ((True, variants.DEFAULT), (False, variants.Composite((variants.CUSTOM_MASK,))))
                + tuple((True, v) for v in xforms[1:] if not (v is rope and dk == 256))]
    return out


def test_sm90_feature_grid_compiles_without_spills():
    """Each spec compiles for sm_90a (the kernel checks spec.smem_bytes, fp8 staging tiles and READY_K
    mbarriers included, against its SMEM_BYTES at compile time) without spills."""
    specs = _feature_grid()
    assert len({s.name for s in specs}) == len(specs) == 3 * 2 * 4 + 2 + 2 * 2 * 2 + 4 * 2 + 3 * 3 - 1   # (+ gather)
    jit.precompile([(spec, "sm_90a") for spec in specs])     # over the cores; checked below
    for spec in specs:
        assert spec.smem_bytes <= 227 * 1024, spec.name
        res = jit.compile_kernel(spec, "sm_90a").resources["cuattn_prefill_sm90"]
        assert max(res["spill_stores"], res["spill_loads"], res["stack_frame"]) <= spec.spill_bytes, (spec.name, res)


def test_sm90_smem_mirror_counts_fp8_staging_and_transform_barriers():
    from .test_qk_transform import KEY_SCALE
    for dk, dv in prefill_sm90.HEAD_DIMS:
        plain = prefill_sm90.make_spec("f16", True, paged=True, head_dim_qk=dk, head_dim_vo=dv, gather=False)
        bn = plain.block_n
        slots = (4 * 8 + 2 * 64) * plain.persistent           # the persistent form's item slots
        assert plain.smem_bytes == 1024 + 128 * dk * 2 + 2 * bn * (dk + dv) * 2 + 8 * 4 * 2 + slots
        if dk == dv:     # READY_K: STAGES more mbarriers where producer warps transform K; none for q alone
            for v, extra in ((variants.Composite((KEY_SCALE,)), 16), (_query_only(), 0)):
                assert prefill_sm90.make_spec("f16", True, v, head_dim_qk=dk).smem_bytes == plain.smem_bytes + extra
        if (dk, dv) in prefill_sm90.FP8_HEAD_DIMS:
            # TMA-staged (contiguous K/V): + STAGES fp8 K and V staging tiles, 4 STAGES mbarriers
            f8 = prefill_sm90.make_spec("f16", True, dtype_kv="e5m2", head_dim_qk=dk, head_dim_vo=dv)
            contig = prefill_sm90.make_spec("f16", True, head_dim_qk=dk, head_dim_vo=dv)
            assert f8.smem_bytes == contig.smem_bytes - slots + 2 * bn * (dk + dv) + 8 * 4 * 2 <= 227 * 1024
            assert "-DKV_FP8=2" in f8.defines() and f"-DSPEC_SMEM_BYTES={f8.smem_bytes}" in f8.defines()
            # gathered (paged): head_dim 64 converted in registers (the 16-bit gather's smem, 3 stages); 128 through the
            # ring (FP8_RING 2: 2 stages, + 2 fp8 K and V tiles)
            g8 = prefill_sm90.make_spec("f16", True, paged=True, dtype_kv="e4m3", head_dim_qk=dk, head_dim_vo=dv)
            g16 = prefill_sm90.make_spec("f16", True, paged=True, head_dim_qk=dk, head_dim_vo=dv)
            assert g8.gather and g8.persistent and g16.stages == 3
            # (the ring's 2 fp8 tiles take the third stage's bytes; its 4 mbarriers go)
            assert g8.smem_bytes == g16.smem_bytes - (bn * (dk + dv) * 2 - 2 * bn * (dk + dv) + 8 * 4 if dk == 128 else 0)
            assert g8.smem_bytes <= 227 * 1024
            assert f"-DFP8_RING={g8.fp8_ring}" in g8.defines() and g8.stages == (2 if dk == 128 else 3)


def test_fa3_refuses_fp8_at_head_dims_its_staging_cannot_hold():
    """fp8 K/V on fa3: head_dim 64 and 128. head_dim 256 (the fp8 staging tiles do not fit shared memory
    beside the 16-bit ones) and 192 / 128 (the converter reads rows of 64 or a multiple of 128 bytes):
    refused by name (auto runs fa2), and the kernel refuses those specs at compile time too."""
    from cuattn.errors import CompileError
    reason = prefill_sm90.unsupported_reason
    ind, last = np.array([0, 1], np.int32), np.array([3], np.int32)
    qo = np.array([0, 4], np.int32)
    for dk, dv in prefill_sm90.FP8_HEAD_DIMS:
        for paged in (False, True):
            assert prefill.resolve_backend("auto", "f", arch="sm_90a", head_dim=dk, head_dim_vo=dv, dtype="bf16",
                                           custom_mask=False, paged=paged, page_size=16, dtype_kv="e4m3") == "fa3"
        cuattn.BatchPrefillWithPagedKVCacheWrapper(backend="fa3").plan(
            qo, ind, np.array([0], np.int32), last, 4, 4, dk, 16, head_dim_vo=dv, kv_data_type="float8_e4m3fn")
    for (dk, dv), why, kernel_says in (((256, 256), "do not fit 227 KiB of shared memory", "exceed 227 KiB"),
                                       ((192, 128), "rows of 64 or a multiple of 128 bytes",
                                        "fp8 K/V: head_dim 64 or a multiple of 128")):
        r = reason("sm_90a", dk, "f16", False, True, page_size=16, dtype_kv="e5m2", head_dim_vo=dv)
        assert r.startswith("fa3 reads an fp8 KV cache at head_dim 64 and 128 only, got ") and why in r, r
        assert reason("sm_90a", dk, "f16", False, True, page_size=16, dtype_kv="f16", head_dim_vo=dv) is None
        for paged in (False, True):
            assert prefill.resolve_backend("auto", "f", arch="sm_90a", head_dim=dk, head_dim_vo=dv, dtype="f16",
                                           custom_mask=False, paged=paged, page_size=16, dtype_kv="e4m3") == "fa2"
        with pytest.raises(UnsupportedError, match="backend='fa3': fa3 reads an fp8 KV cache at head_dim 64 and 128"):
            cuattn.BatchPrefillWithPagedKVCacheWrapper(backend="fa3").plan(
                qo, ind, np.array([0], np.int32), last, 4, 4, dk, 16, head_dim_vo=dv, kv_data_type="float8_e4m3fn")
        with pytest.raises(UnsupportedError, match="fa3 reads an fp8 KV cache"):
            cuattn.BatchPrefillWithRaggedKVCacheWrapper(backend="fa3").plan(
                qo, qo, 4, 4, dk, dv, kv_data_type="float8_e5m2")
        cuattn.BatchPrefillWithRaggedKVCacheWrapper().plan(qo, qo, 4, 4, dk, dv, kv_data_type="float8_e5m2")  # auto
        spec = prefill_sm90.Sm90PrefillSpec("f16", True, dk, dv, prefill_sm90.tile_n(dv), paged=True, dtype_kv="e4m3")
        with pytest.raises(CompileError, match=kernel_says):
            jit.compile_kernel(spec, "sm_90a")


def test_fa3_plans_the_new_head_dims_and_runs_numpy_inputs_on_the_reference():
    rng = np.random.default_rng(3)
    qo_indptr, kv_indptr = np.array([0, 5, 12], np.int32), np.array([0, 9, 40], np.int32)
    for dk, dv in NEW_DIMS:
        q = rand(rng, (12, 4, dk), np.float16)
        k, v = rand(rng, (40, 2, dk), np.float16), rand(rng, (40, 2, dv), np.float16)
        w = cuattn.BatchPrefillWithRaggedKVCacheWrapper(backend="fa3")
        w.plan(qo_indptr, kv_indptr, 4, 2, dk, dv, causal=True)
        ref_o, _ = oracle_batch(q, [k[:9], k[9:]], [v[:9], v[9:]], qo_indptr, True)
        assert rel_err(w.run(q, k, v), ref_o) < 5e-3


def test_fa3_numpy_inputs_run_the_reference():
    rng = np.random.default_rng(0)
    q, k = rand(rng, (5, 4, 128), np.float16), rand(rng, (9, 2, 128), np.float16)
    out = cuattn.single_prefill_with_kv_cache(q, k, k, backend="fa3")
    assert rel_err(out, dense_attention(q, k, k)[0]) < 5e-3


def test_sm90_work_list_puts_longest_causal_tiles_first():
    spec = prefill_sm90.make_spec("f16", True)
    w = plan.prefill_work_list(np.array([300, 5]), np.array([300, 100]), 4, spec.block_m, spec.block_n, True).work
    assert w.shape == (-(-1200 // 128) + 1, 4)
    assert w[0][0] == 0 and w[0][1] >= 8 and tuple(w[-1, :2]) == (1, 0)   # 3 key tiles first, request 1's 1 last


# ============================================================================ GPU (sm_90)

sm90 = pytest.mark.skipif(gpu_cc() != 90, reason="the fa3 kernel needs an sm_90 GPU")

QO_LENS = [1, 17, 127, 577, 1024]
KV_LENS = [54, 97, 2048, 4932]
HEADS = [(8, 8), (32, 8), (28, 4)]          # GQA groups 1, 4, 7
GRID = (QO_LENS, KV_LENS, HEADS, [False, True], list(DTYPES))
SINGLE = sorted(random.Random(11).sample(list(itertools.product(*GRID)), 24), key=str) + [
    (1024, 4932, (32, 8), True, "float16"), (577, 54, (28, 4), True, "bfloat16"),   # fully masked rows
    (1024, 1024, (32, 8), False, "bfloat16"), (127, 2048, (8, 8), True, "float16")]


@pytest.fixture
def launches(monkeypatch):
    """Counts fa3 kernel launches (so a test knows which backend ran)."""
    calls = []
    orig = prefill_sm90.launch

    def spy(*a, **kw):
        calls.append(kw["num_work"])
        return orig(*a, **kw)
    monkeypatch.setattr(prefill_sm90, "launch", spy)
    return calls


def _single(qo_len, kv_len, heads, causal, dtype, layout="NHD", backend="fa3"):
    rng = np.random.default_rng()
    hq, hkv = heads
    dt = DTYPES[dtype]
    q, k, v = rand(rng, (qo_len, hq, 128), dt), rand(rng, (kv_len, hkv, 128), dt), rand(rng, (kv_len, hkv, 128), dt)
    kd, vd = (k, v) if layout == "NHD" else (k.transpose(1, 0, 2).copy(), v.transpose(1, 0, 2).copy())
    _poison_pool(q.size * 4)
    out, lse = cuattn.single_prefill_with_kv_cache(_to_dev(q), _to_dev(kd), _to_dev(vd), causal=causal,
                                                   kv_layout=layout, return_lse=True, backend=backend)
    ref_o, ref_s = dense_attention(q, k, v, causal=causal)
    o = _from_dev(out, dt)
    assert np.isfinite(o.astype(np.float32)).all()
    assert rel_err(o, ref_o) < TOL[dtype]
    assert rel_err(_cp().asnumpy(lse), ref_s) < LSE_TOL


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("case", SINGLE, ids=["-".join(str(x).replace(" ", "") for x in c) for c in SINGLE])
def test_fa3_single_matches_oracle(case, launches):
    _single(*case)
    assert launches, "fa3 did not run"


@pytest.mark.gpu
@sm90
def test_fa3_single_hnd_layout(launches):
    _single(577, 2048, (32, 8), True, "bfloat16", layout="HND")
    assert launches


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_fa3_ragged_batch_matches_oracle(causal, dtype, launches):
    rng = np.random.default_rng()
    hq, hkv = 28, 4
    dt = DTYPES[dtype]
    qo_lens = [1, 17, 577, 127, 0, 1024]
    kv_lens = [54, 97, 4932, 127, 33, 2048]
    qo_indptr = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
    kv_indptr = np.concatenate([[0], np.cumsum(kv_lens)]).astype(np.int32)
    q = rand(rng, (qo_indptr[-1], hq, 128), dt)
    k, v = rand(rng, (kv_indptr[-1], hkv, 128), dt), rand(rng, (kv_indptr[-1], hkv, 128), dt)
    out = _nan_like((qo_indptr[-1], hq, 128), dt)
    lse = _cp().full((qo_indptr[-1], hq), np.nan, np.float32)
    w = cuattn.BatchPrefillWithRaggedKVCacheWrapper(backend="fa3")
    w.plan(qo_indptr, kv_indptr, hq, hkv, 128, causal=causal, q_data_type=dtype)
    w.run(_to_dev(q), _to_dev(k), _to_dev(v), out=out, lse=lse)
    assert w.backend == "fa3" and launches
    ks = [k[kv_indptr[b]:kv_indptr[b + 1]] for b in range(len(qo_lens))]
    vs = [v[kv_indptr[b]:kv_indptr[b + 1]] for b in range(len(qo_lens))]
    ref_o, ref_s = oracle_batch(q, ks, vs, qo_indptr, causal)
    assert rel_err(_from_dev(out, dt), ref_o) < TOL[dtype]
    assert rel_err(_cp().asnumpy(lse), ref_s) < LSE_TOL


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("backend,causal,masked", [("fa3", False, False), ("fa3", True, False), ("fa3", False, True),
                                                   ("fa2", True, False)])
def test_ragged_nan_in_one_request_or_past_the_last_stays_there(backend, causal, masked):
    """A request's last tile reads keys past its end (the next request's, or what follows the last one in the
    buffer): masked in S, and their V rows zeroed before P.V, so a NaN there reaches no other request's output
    (0 x NaN). Request 1's own K and V hold a NaN (its output is not checked), the buffer's rows past the last
    request are NaN; requests 0 and 2 (lengths no multiple of a tile) must match the oracle, every element finite."""
    rng = np.random.default_rng()
    hq, hkv, dt = 16, 4, np.float16
    qo_lens, kv_lens = [33, 70, 5], [100, 157, 61]
    qo_indptr = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
    kv_indptr = np.concatenate([[0], np.cumsum(kv_lens)]).astype(np.int32)
    q = rand(rng, (qo_indptr[-1], hq, 128), dt)
    k, v = rand(rng, (kv_indptr[-1] + 64, hkv, 128), dt), rand(rng, (kv_indptr[-1] + 64, hkv, 128), dt)
    k[kv_indptr[-1]:], v[kv_indptr[-1]:] = np.nan, np.nan
    k[kv_indptr[1] + 5, 1], v[kv_indptr[1] + 3] = np.nan, np.nan
    masks = [rng.random((n, m)) < 0.7 for n, m in zip(qo_lens, kv_lens)] if masked else None
    if masked:
        for m in masks:
            m[:, 0] = True                     # no fully masked row
    out = _nan_like((qo_indptr[-1], hq, 128), dt)
    w = cuattn.BatchPrefillWithRaggedKVCacheWrapper(backend=backend)
    w.plan(qo_indptr, kv_indptr, hq, hkv, 128, causal=causal, q_data_type="float16",
           custom_mask=None if masks is None else np.concatenate([m.ravel() for m in masks]))
    w.run(_to_dev(q), _to_dev(k), _to_dev(v), out=out)
    assert w.backend == backend
    ks = [k[kv_indptr[b]:kv_indptr[b + 1]] for b in range(3)]
    vs = [v[kv_indptr[b]:kv_indptr[b + 1]] for b in range(3)]
    got = _from_dev(out, dt)
    for b in (0, 2):
        rows = slice(qo_indptr[b], qo_indptr[b + 1])
        ref_o, _ = oracle_batch(q[rows], ks[b:b + 1], vs[b:b + 1], np.array([0, qo_lens[b]]), causal,
                                masks=None if masks is None else masks[b:b + 1])
        assert np.isfinite(got[rows].astype(np.float32)).all(), f"request {b}: NaN from another request's rows"
        assert rel_err(got[rows], ref_o) < TOL["float16"]


@pytest.mark.gpu
@sm90
def test_fa3_close_to_fa2_and_auto_reports_its_choice():
    rng = np.random.default_rng()
    q, k, v = (_to_dev(rand(rng, s, np.float16)) for s in ((300, 32, 128), (700, 8, 128), (700, 8, 128)))
    a = _cp().asnumpy(cuattn.single_prefill_with_kv_cache(q, k, v, causal=True, backend="fa2")).astype(np.float32)
    b = _cp().asnumpy(cuattn.single_prefill_with_kv_cache(q, k, v, causal=True, backend="fa3")).astype(np.float32)
    assert rel_err(b, a) < 2e-3
    w = cuattn.BatchPrefillWithRaggedKVCacheWrapper()
    w.plan(np.array([0, 300], np.int32), np.array([0, 700], np.int32), 32, 8, 128, causal=True)
    w.run(q, k, v)
    assert w.backend == "fa3"


PAGED_CASES = [   # (page_size, layout, one array or a (k, v) pair, causal, fixed_split_size)
    (16, "NHD", "one", True, None), (32, "HND", "pair", False, None), (64, "NHD", "pair", True, 256),
    (128, "HND", "one", True, None), (256, "NHD", "one", False, 128),
    # pages no TMA box fits (the gather takes every 16-bit cache), and TMA boxes forced ("16t": fp8's producer)
    (1, "NHD", "one", True, None), (5, "HND", "pair", False, 256), (3, "NHD", "pair", True, None),
    ("16t", "HND", "one", True, 512), ("64t", "NHD", "pair", False, None),
]


@sm90
@pytest.mark.gpu
@pytest.mark.parametrize("page_size,layout,form,causal,split", PAGED_CASES,
                         ids=[f"ps{p}-{lay}-{f}-{'causal' if c else 'full'}-{s}" for p, lay, f, c, s in PAGED_CASES])
def test_fa3_paged_prefill_reads_pages_by_tma_boxes_or_gathers(page_size, layout, form, causal, split, monkeypatch):
    """The Hopper kernel over a paged cache in random page order: the gather producer, or ("16t": forced)
    a TMA box per page; the slots past each request's last key hold NaN (a serving cache's free slots hold
    anything) and must not leak."""
    import cupy as cp
    from .test_prefill import _paged_inputs, oracle_batch, rand
    if isinstance(page_size, str):
        page_size = int(page_size[:-1])
        monkeypatch.setattr(prefill_sm90, "use_gather", lambda *a: False)
    rng = np.random.default_rng(page_size)
    qo_lens, kv_lens = [200, 1, 77, 129], [200, 3000, 1037, 129 + page_size // 2]
    cache, indptr, indices, last, ks, vs = _paged_inputs(rng, kv_lens, page_size, 8, 128, layout)
    nhd = cache if layout == "NHD" else cache.transpose(0, 1, 3, 2, 4)
    for b, n in enumerate(kv_lens):            # NaN in every free slot of each request's last page
        nhd[indices[indptr[b + 1] - 1], :, last[b]:] = np.nan
    qo_indptr = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
    q = rand(rng, (qo_indptr[-1], 32, 128), np.float16)
    w = cuattn.BatchPrefillWithPagedKVCacheWrapper(kv_layout=layout, backend="fa3")
    w.plan(qo_indptr, indptr, indices, last, 32, 8, 128, page_size, causal=causal, fixed_split_size=split)
    assert w.backend == "fa3" and ("_gather" if prefill_sm90.use_gather(page_size, 128) else "_paged") in w.describe()
    cd = cp.asarray(cache)
    kv = cd if form == "one" else (cp.ascontiguousarray(cd[:, 0]), cp.ascontiguousarray(cd[:, 1]))
    out = cp.full(q.shape, np.nan, np.float16)
    lse = cp.full(q.shape[:2], np.nan, np.float32)
    w.run(cp.asarray(q), kv, out=out, lse=lse)
    ref_o, ref_s = oracle_batch(q, ks, vs, qo_indptr, causal)
    got = cp.asnumpy(out)
    assert np.isfinite(got).all() and rel_err(got, ref_o) < 5e-3
    assert np.abs(cp.asnumpy(lse) - ref_s).max() < 1e-3


# ---------------------------------------------------------------------------- head_dim 64, 256, 192 / 128 (sm_90)
# One q dtype per head-dim pair, causal: the single and ragged cases share one contiguous kernel, the
# paged ones run the shipped paged kernels (3 first-use compiles in all).
DIM_DTYPE = {(64, 64): "float16", (256, 256): "bfloat16", (192, 128): "bfloat16"}
DIM_IDS = [f"hd{dk}" + (f"v{dv}" if dv != dk else "") for dk, dv in DIM_DTYPE]


def _dims_inputs(rng, qo_lens, kv_lens, hq, hkv, dk, dv, dtype):
    dt = DTYPES[dtype]
    qo_indptr = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
    kv_indptr = np.concatenate([[0], np.cumsum(kv_lens)]).astype(np.int32)
    q = rand(rng, (qo_indptr[-1], hq, dk), dt)
    k, v = rand(rng, (kv_indptr[-1], hkv, dk), dt), rand(rng, (kv_indptr[-1], hkv, dv), dt)
    ks = [k[kv_indptr[b]:kv_indptr[b + 1]] for b in range(len(kv_lens))]
    vs = [v[kv_indptr[b]:kv_indptr[b + 1]] for b in range(len(kv_lens))]
    return q, k, v, qo_indptr, kv_indptr, ks, vs


def _check_dims(out, lse, ref_o, ref_s, dtype):
    """Every element finite and within the dtype's tolerance of the largest reference magnitude, the
    norm-relative error, and the LSE."""
    o = _from_dev(out, DTYPES[dtype]).astype(np.float64)
    assert o.shape == ref_o.shape and np.isfinite(o).all(), "unwritten or non-finite output"
    assert rel_err(o, ref_o) < TOL[dtype]
    assert np.abs(o - ref_o).max() < 4 * TOL[dtype] * np.abs(ref_o).max()
    assert rel_err(_cp().asnumpy(lse), ref_s) < LSE_TOL


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("dims", list(DIM_DTYPE), ids=DIM_IDS)
def test_fa3_head_dims_single_chunked_prefill_matches_oracle(dims, launches):
    """Causal, qo_len < kv_len (a chunk after a cached prefix, bottom-right aligned), GQA group 4, auto."""
    dk, dv = dims
    dtype = DIM_DTYPE[dims]
    q, k, v, _, _, _, _ = _dims_inputs(np.random.default_rng(dk), [300], [1100], 32, 8, dk, dv, dtype)
    _poison_pool(q.size * 8)
    out, lse = cuattn.single_prefill_with_kv_cache(_to_dev(q), _to_dev(k), _to_dev(v), causal=True, return_lse=True)
    assert launches, "auto did not pick fa3"
    ref_o, ref_s = dense_attention(q, k, v, causal=True)
    _check_dims(out, lse, ref_o, ref_s, dtype)


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("dims", list(DIM_DTYPE), ids=DIM_IDS)
def test_fa3_head_dims_ragged_batch_matches_oracle(dims, launches):
    """Requests shorter and longer than a tile, an empty one, and one with qo_len > kv_len (fully
    masked rows: 0 and LSE -inf); auto reports fa3."""
    dk, dv = dims
    dtype = DIM_DTYPE[dims]
    q, k, v, qo_indptr, kv_indptr, ks, vs = _dims_inputs(np.random.default_rng(dk + 1), [1, 17, 300, 0, 129],
                                                         [54, 97, 1037, 33, 100], 16, 4, dk, dv, dtype)
    out = _nan_like((qo_indptr[-1], 16, dv), DTYPES[dtype])
    lse = _cp().full((qo_indptr[-1], 16), np.nan, np.float32)
    w = cuattn.BatchPrefillWithRaggedKVCacheWrapper()
    w.plan(qo_indptr, kv_indptr, 16, 4, dk, dv, causal=True, q_data_type=dtype)
    w.run(_to_dev(q), _to_dev(k), _to_dev(v), out=out, lse=lse)
    assert w.backend == "fa3" and launches
    ref_o, ref_s = oracle_batch(q, ks, vs, qo_indptr, True)
    _check_dims(out, lse, ref_o, ref_s, dtype)


DIM_PAGED = [   # (head dims, q dtype, page_size, layout, one cache array or a (k, v) pair, fixed_split_size)
    ((64, 64), "float16", 16, "NHD", "one", None), ((64, 64), "bfloat16", 64, "HND", "pair", None),
    ((256, 256), "bfloat16", 16, "NHD", "one", None), ((256, 256), "float16", 64, "HND", "pair", 128),
    ((192, 128), "bfloat16", 16, "NHD", "pair", None), ((192, 128), "float16", 64, "HND", "pair", 256),
    ((64, 64), "bfloat16", 1, "NHD", "one", None), ((256, 256), "float16", 5, "HND", "pair", 256),
    ((192, 128), "float16", 1, "HND", "pair", None),     # the gather producer (pages no TMA box fits)
]


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("dims,dtype,page_size,layout,form,split", DIM_PAGED,
                         ids=[f"hd{d[0]}{f'v{d[1]}' if d[1] != d[0] else ''}-{t}-ps{p}-{lay}-{f}-{s}"
                              for d, t, p, lay, f, s in DIM_PAGED])
def test_fa3_head_dims_paged_batch_matches_oracle(dims, dtype, page_size, layout, form, split, launches):
    """Paged K/V in random page order, free slots and spare pages NaN (they must not leak), causal with
    qo_len < kv_len and one request with qo_len > kv_len; split-KV (fixed_split_size) where given."""
    from .prefill_dtype_cases import to_pages
    dk, dv = dims
    hq, hkv = 32, 8
    q, k, v, qo_indptr, kv_indptr, ks, vs = _dims_inputs(np.random.default_rng(page_size + dk), [300, 1, 77, 129],
                                                         [300, 1500, 1037, 100], hq, hkv, dk, dv, dtype)
    kp, indptr, indices, last = to_pages(k, kv_indptr, page_size, perm_seed=dk, layout=layout)
    vp, _, v_indices, _ = to_pages(v, kv_indptr, page_size, perm_seed=dk, layout=layout)
    assert np.array_equal(indices, v_indices)
    w = cuattn.BatchPrefillWithPagedKVCacheWrapper(kv_layout=layout)
    w.plan(qo_indptr, indptr, indices, last, hq, hkv, dk, page_size, head_dim_vo=dv, causal=True,
           q_data_type=dtype, fixed_split_size=split)
    assert w.backend == "fa3" and "_gather" in w.describe()
    if split:
        assert f"pieces of {split} keys" in w.describe()
    cache = _to_dev(np.stack((kp, vp), axis=1)) if form == "one" else (_to_dev(kp), _to_dev(vp))
    out = _nan_like((qo_indptr[-1], hq, dv), DTYPES[dtype])
    lse = _cp().full((qo_indptr[-1], hq), np.nan, np.float32)
    w.run(_to_dev(q), cache, out=out, lse=lse)
    assert launches
    ref_o, ref_s = oracle_batch(q, ks, vs, qo_indptr, True)
    _check_dims(out, lse, ref_o, ref_s, dtype)


# -- fp8 K/V at head_dim 64, query / key transforms at head_dim 64 and 256 (auto picks fa3 for both)

@pytest.mark.gpu
@sm90
def test_fa3_fp8_head_dim_64_paged_split_and_ragged_match_oracle(launches, pages_in_kernel):
    """fp8 at head_dim 64 (64-byte fp8 boxes and swizzle): paged e4m3 with a bf16 q (converted to f16),
    page 16 in random order with NaN bits in free slots and spare pages, per-head scales; paged e5m2, f16
    q, split-KV pieces of 256 keys, 1-element device scales; ragged e5m2 non-causal, scalar scales."""
    from .prefill_dtype_cases import (FP8_NAME, _check, _dev, _oracle, _poisoned, paged_fp8_case,
                                      ragged_fp8_case, run_paged_fp8_and_check)
    hq, hkv, d = 16, 4, 64
    for qo_lens, kv_lens, kv, qdt, sk, split in (([17, 1, 300], [54, 97, 1300], "e4m3", "bfloat16", "head", None),
                                                 ([40, 300], [3000, 700], "e5m2", "float16", "one", 256)):
        c = paged_fp8_case(qo_lens, kv_lens, 16, hq, hkv, d, kv, qdt, sk, seed=len(qo_lens) + 64)
        w = cuattn.BatchPrefillWithPagedKVCacheWrapper()                  # auto
        w.plan(c["qo_indptr"], c["indptr"], c["indices"], c["last"], hq, hkv, d, 16, causal=True, q_data_type=qdt,
               kv_data_type=FP8_NAME[kv], fixed_split_size=split)
        assert w.backend == "fa3" and (split is None or f"pieces of {split} keys" in w.describe())
        run_paged_fp8_and_check(w, c, hq, d, qdt, True)
        spec = w._plan["run_spec"]
        assert (spec.head_dim_qk, spec.head_dim_vo, spec.dtype_kv) == (d, d, kv)
    c = ragged_fp8_case([37, 200], [97, 200], hq, hkv, d, "e5m2", "float16", "tensor", seed=65)
    w = cuattn.BatchPrefillWithRaggedKVCacheWrapper()                     # auto
    w.plan(c["qo_indptr"], c["kv_indptr"], hq, hkv, d, causal=False, kv_data_type="float8_e5m2")
    out, lse = _poisoned((237, hq, d), "float16"), _cp().full((237, hq), np.nan, np.float32)
    w.run(_dev(c["q"]), _dev(c["k"]), _dev(c["v"]), out=out, lse=lse, k_scale=c["scales"][0], v_scale=c["scales"][1])
    assert w.backend == "fa3" and launches
    ref_o, ref_s = _oracle(c["q"], c["ks"], c["vs"], c["qo_indptr"], False)
    _check(out, lse, ref_o, ref_s, "float16")


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("d", [64, 256])
def test_fa3_transforms_at_head_dims_64_256_match_oracle(d, launches):
    """The fused RoPE (rotary_dim = head_dim, rope_scale 2) over a ragged fp16 batch in split-KV pieces;
    over pages of 16 and 1 (random order, NaN in free slots and spare pages) the per-head key scale (key hook
    alone) and the fused RoPE with rotary_dim = head_dim / 2; GQA group 4, causal, qo_len < kv_len."""
    from .test_qk_transform import KEY_SCALE, THETA, _batch_oracle
    from .test_variants import _paged_case
    cp = _cp()
    rng = np.random.default_rng(60 + d)
    qlens, lens, hq, hkv = [1, 37, 300, 5], [54, 500, 1333, 5], 16, 4
    qo_indptr = np.concatenate([[0], np.cumsum(qlens)]).astype(np.int32)
    kv_indptr = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    q = rand(rng, (qo_indptr[-1], hq, d), np.float16)
    k, v = rand(rng, (kv_indptr[-1], hkv, d), np.float16), rand(rng, (kv_indptr[-1], hkv, d), np.float16)
    w = cuattn.BatchPrefillWithRaggedKVCacheWrapper()                     # auto
    w.plan(qo_indptr, kv_indptr, hq, hkv, d, causal=True, pos_encoding_mode="ROPE_LLAMA", rope_scale=2.0,
           rope_theta=THETA, fixed_split_size=256)
    out, lse = _nan_like(q.shape, np.float16), cp.full(q.shape[:2], np.nan, np.float32)
    w.run(cp.asarray(q), cp.asarray(k), cp.asarray(v), out=out, lse=lse)
    assert w.backend == "fa3" and launches
    ks = [k[kv_indptr[b]:kv_indptr[b + 1]] for b in range(len(lens))]
    vs = [v[kv_indptr[b]:kv_indptr[b + 1]] for b in range(len(lens))]
    want, want_lse = _batch_oracle(q, ks, vs, qo_indptr, d, 2.0)
    _check_dims(out, lse, want, want_lse, "float16")
    # -- paged, pages of 16 and (head_dim 64) 1: the gather producer, whose warps 1..3 transform K tiles
    #    (the RoPE at head_dim 256: TMA boxes)
    for ps in ((16, 1) if d == 64 else (16,)):
        indptr, indices, last, kc, vc, per_req = _paged_case(rng, lens, ps, hkv, d)
        spare = np.setdiff1d(np.arange(kc.shape[0]), indices)
        kc[spare], vc[spare] = np.nan, np.nan
        for b in range(len(lens)):
            kc[indices[indptr[b + 1] - 1], last[b]:] = np.nan
            vc[indices[indptr[b + 1] - 1], last[b]:] = np.nan
        ks, vs = [k for k, _ in per_req], [v for _, v in per_req]
        scale = np.array([0.5, 2.0, 1.0, 0.25], np.float32)
        runs = [(dict(variant=KEY_SCALE), (cp.asarray(scale),),
                 _batch_oracle(q, [k.astype(np.float64) * scale[None, :, None] for k in ks], vs, qo_indptr)),
                (dict(pos_encoding_mode="ROPE_LLAMA", rope_theta=THETA, rotary_dim=d // 2), (),
                 _batch_oracle(q, ks, vs, qo_indptr, d // 2))]
        for opts, args, (want, want_lse) in runs:
            wp = cuattn.BatchPrefillWithPagedKVCacheWrapper()                 # auto
            wp.plan(qo_indptr, indptr, indices, last, hq, hkv, d, ps, causal=True, **opts)
            out, lse = _nan_like(q.shape, np.float16), cp.full(q.shape[:2], np.nan, np.float32)
            wp.run(cp.asarray(q), (cp.asarray(kc), cp.asarray(vc)), *args, out=out, lse=lse)
            assert wp.backend == "fa3" and wp._plan["run_spec"].head_dim_qk == d, opts
            assert ("_gather" in wp.describe()) == (d != 256 or "variant" in opts)
            _check_dims(out, lse, want, want_lse, "float16")


@pytest.mark.gpu
@sm90
def test_fa3_paged_gather_and_boxes_are_memcheck_clean():
    """compute-sanitizer memcheck over small paged fa3 batches (the gather: pages of 1, 5 and 16, fp8 pages of
    16 and 5, each batch also with its rows gathered ahead (prefill_ahead); TMA boxes: the fused RoPE at head_dim
    256), CuPy's pool off, no spare page past the last request's: no invalid access, no error."""
    out = memcheck("sanitize_paged_fa3.py")
    assert "_gather_kve4m3" in out and "_gather_kve5m2" in out and "_paged" in out
    assert out.count("gathered ahead") == 7


# -- requests of at most 64 packed rows (block-sparse row blocks, decode and speculative steps): 64-row tiles
#    (NUM_CONSUMERS 1, two CTAs per SM) where prefill_sm90.small_tile allows

def test_fa3_small_requests_take_64_row_tiles_where_they_compile():
    rope = variants.resolve("f", num_qo_heads=8, head_dim=64, pos_encoding_mode="ROPE_LLAMA").composite
    for d in (64, 128):
        spec = prefill_sm90.make_spec("f16", True, paged=True, head_dim_qk=d, small=True)
        assert (spec.block_m, spec.block_n, spec.num_threads, spec.ctas_per_sm) == (64, 64, 256, 2)
        assert "-DNUM_CONSUMERS=1" in spec.defines() and spec.smem_bytes <= prefill_sm90.SMEM_LIMIT_2
    for kw in (dict(head_dim_qk=256), dict(head_dim_qk=192, head_dim_vo=128), dict(dtype_kv="e4m3")):
        assert prefill_sm90.make_spec("f16", True, paged=True, small=True, **kw).block_m == 128
    assert prefill_sm90.make_spec("f16", True, rope, paged=True, small=True).block_m == 128   # (hd128 RoPE spilled)
    assert prefill_sm90.make_spec("f16", True, rope, paged=True, head_dim_qk=64, small=True).block_m == 64


SMALL_CASES = [   # (page size, causal, custom mask, qo heads : kv heads)
    (16, True, False, (32, 8)), (1, False, False, (32, 8)), (16, False, True, (16, 16)), (5, True, False, (28, 4))]


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("page_size,causal,mask,heads", SMALL_CASES)
def test_fa3_small_requests_match_oracle(page_size, causal, mask, heads):
    """Every request within 64 packed rows: the 64-row fa3 kernel (describe() names it), random page order, NaN in the
    free slots, against the float64 oracle (a custom mask: against fa2, which the mask tests check)."""
    import cupy as cp
    from .test_prefill import _paged_inputs, oracle_batch, rand
    hq, hkv = heads
    rng = np.random.default_rng(page_size)
    qo_lens = [64 * hkv // hq, 1, 5, 2]                  # (the first request: 63 or 64 packed rows)
    kv_lens = [300, 3000, 17, 1100]
    cache, indptr, indices, last, ks, vs = _paged_inputs(rng, kv_lens, page_size, hkv, 128, "NHD")
    nhd = cache
    for b in range(len(kv_lens)):
        nhd[indices[indptr[b + 1] - 1], :, last[b]:] = np.nan
    qo_indptr = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
    q = rand(rng, (qo_indptr[-1], hq, 128), np.float16)
    kw = {}
    if mask:
        kw["custom_mask"] = np.concatenate([rng.random(qo * kv) < 0.7 for qo, kv in zip(qo_lens, kv_lens)])
    outs = []
    for backend in ("fa3", "fa2"):
        w = cuattn.BatchPrefillWithPagedKVCacheWrapper(backend=backend)
        w.plan(qo_indptr, indptr, indices, last, hq, hkv, 128, page_size, causal=causal, **kw)
        out = cp.full(q.shape, np.nan, np.float16)
        lse = cp.full(q.shape[:2], np.nan, np.float32)
        w.run(cp.asarray(q), cp.asarray(cache), out=out, lse=lse)
        outs.append((cp.asnumpy(out), cp.asnumpy(lse), w.describe()))
        if not mask:
            break
    got, got_lse, desc = outs[0]
    assert "_bm64_bn64_" in desc and (("2 per SM" in desc) == ("_persist" in desc)), desc   # (custom mask gather: not)
    assert np.isfinite(got).all()
    if mask:
        assert rel_err(got, outs[1][0]) < 2e-3 and np.abs(got_lse - outs[1][1]).max() < 1e-3
    else:
        ref_o, ref_s = oracle_batch(q, ks, vs, qo_indptr, causal)
        assert rel_err(got, ref_o) < 5e-3 and np.abs(got_lse - ref_s).max() < 1e-3
