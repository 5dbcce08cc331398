"""The Hopper MLA kernel (backend "fa3", kernels_cu/mla_sm90.cu): its compile (sm_90a, no spills, no
serialized wgmma), parameter list and backend choice on the CPU; on an sm_90 GPU (gpu marker) the kernel
against tests/test_mla.py's float64 oracle (decode at 16, 64 and 128 heads, multi-token causal, page sizes
1 / 16 / 64, fp16 / bf16, split-KV, CUDA-graph replay), each asserting that the fa3 kernel ran, under both
schedules (halves and seesaw) where a test's fixture `schedule` forces one."""
import numpy as np
import pytest

import cuattn
from cuattn import UnsupportedError, arrays, cli, jit, mla, mla_sm90

from .conftest import gpu_cc
from .oracle import rel_err
from .test_mla import BF16, CKV, KPE, SCALE, _cp, _dev, _nan, check_gpu, graph_replay_after_replan, mla_case, planned
from .test_params import c_signature

# ============================================================================ CPU (CI)


@pytest.mark.parametrize("spec", mla_sm90.shipped_specs(), ids=lambda s: s.name)
def test_sm90_mla_compiles_without_spills_or_serialized_wgmma(spec):
    res = jit.compile_kernel(spec, "sm_90a").resources[mla_sm90.ENTRY]
    assert res["spill_stores"] == 0 and res["spill_loads"] == 0 and res["stack_frame"] == 0, (spec.name, res)
    # ptxas serializes every wgmma of a kernel (warning C7513) when registers a wgmma reads are written while
    # one is in flight: correct, but several times slower
    status, _, log = jit._nvrtc().compile(jit.source_text(spec), f"{spec.name}.cu", jit.compile_options(spec, "sm_90a"))
    assert status == 0 and "C7513" not in log and "erializ" not in log, log
    assert spec.smem_bytes <= 227 * 1024


def test_sm90_mla_specs_are_shipped_for_sm90a_only():
    names = {s.name for s in mla_sm90.shipped_specs()}
    assert len(names) == 4       # f16 / bf16 x the halves / seesaw schedules
    assert names <= {s.name for s in cli.shipped_specs("sm_90a")}
    assert not names & {s.name for s in cli.shipped_specs("sm_80")}


def test_sm90_mla_spec_name_and_defines():
    spec = mla_sm90.Sm90MLASpec("bf16")
    assert spec.name == "mla_sm90_ckv512_kpe64_qbf16_bm64_bn64_v2"   # the name it had as version 2 (results, logs)
    assert spec.defines() == ("-DDTYPE=cuattn::bf16", "-DSEESAW=0")
    assert spec.smem_bytes == 230992     # 1024 slack + Q + 2 key stages (64 x 576 x 2 B) + P + 2 x 256 + 10 mbarriers
    seesaw = mla_sm90.Sm90MLASpec("f16", True)
    assert seesaw.name == "mla_sm90_ckv512_kpe64_qf16_bm64_bn64_seesaw"
    assert seesaw.defines() == ("-DDTYPE=cuattn::f16", "-DSEESAW=1")
    assert seesaw.smem_bytes == 223568   # P in the stages' kpe blocks: no P buffer; 5 x 256 + 10 mbarriers


def test_mla_fa3_schedule_rule():
    specs = mla_sm90.schedule_specs("bf16")
    assert [s.seesaw for s in specs] == [False, True]
    pick = mla_sm90.pick_schedule
    assert pick(specs, 64, 16384) is specs[1]                    # 128 heads x 16k: full tiles, long items
    assert pick(specs, 64, mla_sm90.SEESAW_MIN_KEYS) is specs[1]
    assert pick(specs, 64, 4096) is specs[0]                     # shorter items: the halves' shorter start
    assert pick(specs, 16, 16384) is specs[0]                    # 16 heads: 16 rows of a 64-row tile


def test_sm90_mla_takes_mla_cu_parameter_list():
    assert c_signature("mla_sm90.cu", mla_sm90.ENTRY, {}) == list(zip(mla.PARAMS.names, mla.PARAMS.kinds))


def test_mla_backend_choice_is_made_in_one_place():
    res = mla_sm90.resolve_backend
    assert res("auto", "f", "sm_90a", "f16", "f16") == "fa3"
    assert res("auto", "f", "sm_90a", "bf16", "bf16") == "fa3"
    assert res("fa3", "f", "sm_90a", "bf16", "bf16") == "fa3"
    for args in (("sm_80", "f16", "f16"), ("sm_90a", "f16", "e4m3"), ("sm_90a", None, None)):
        assert res("auto", "f", *args) == "fa2"
        assert res("fa2", "f", *args) == "fa2"
    with pytest.raises(UnsupportedError, match="f: backend='fa3': .*needs an sm_90 GPU"):
        res("fa3", "f", "sm_80", "f16", "f16")
    with pytest.raises(UnsupportedError, match="kv_data_type e4m3 .no fp8 cache"):
        res("fa3", "f", "sm_90a", "f16", "e4m3")
    with pytest.raises(ValueError, match="backend must be"):
        cuattn.BatchMLAPagedAttentionWrapper(backend="fa4")


def test_mla_fa3_numpy_inputs_run_the_reference():
    c = mla_case(21, [4, 1], [90, 33], 16)
    w = cuattn.BatchMLAPagedAttentionWrapper(backend="fa3")
    w.plan(c["qo_indptr"], c["kv_indptr"], c["kv_indices"], c["kv_len"], 16, CKV, KPE, 16, True, SCALE,
           "float16", "float16")
    a = w.run(c["qn"], c["qp"], c["ckv"], c["kpe"])
    b = planned(c, True, sm_scale=SCALE).run(c["qn"], c["qp"], c["ckv"], c["kpe"])
    np.testing.assert_array_equal(a, b)


def test_mla_fa3_cache_strides_over_4_gib_are_refused_by_name():
    ok = arrays.Tensor(0, (8, 64, CKV), (64 * CKV, CKV, 1), np.dtype(np.float16), 0, "cupy", None)
    mla_sm90.check_cache_strides(ok, ok, "run")
    big = ok._replace(strides=(2 ** 31, CKV, 1))          # 4 GiB of fp16 between pages
    neg = ok._replace(strides=(-64 * CKV, CKV, 1))
    for ckv, kpe, name in ((big, ok, "ckv_cache"), (ok, neg, "kpe_cache")):
        with pytest.raises(UnsupportedError, match=f"{name} page and token strides in"):
            mla_sm90.check_cache_strides(ckv, kpe, "run")


def test_mla_fa3_pieces_are_whole_64_key_tiles():
    ext = np.array([20000, 64, 5000])
    for slots in (None, 40):
        chunk = mla._choose_chunk(ext, 132, slots, mla_sm90.BLOCK_N)
        assert chunk > 0 and chunk % 64 == 0
    assert cuattn.mla._plan.split_choice(False, 1000, mla_sm90.BLOCK_N, None)[0] == 1024


# ============================================================================ GPU (sm_90)

sm90 = pytest.mark.skipif(gpu_cc() != 90, reason="the fa3 MLA kernel needs an sm_90 GPU")


class _Launched(list):
    """The kernel entries launched (so a test knows which kernel ran); ``specs``: their spec names."""
    specs: list


@pytest.fixture
def entries(monkeypatch):
    seen = _Launched()
    seen.specs = []
    orig = jit.get_launcher

    def spy(spec, entry, *a, **kw):
        seen.append(entry)
        seen.specs.append(spec.name)
        return orig(spec, entry, *a, **kw)
    monkeypatch.setattr(jit, "get_launcher", spy)
    return seen


def ran_fa3(entries, dtype=np.float16, seesaw=None):
    """The fa3 kernel of ``dtype`` ran (of the schedule ``seesaw``; None: either) and mla.cu's attention kernel
    did not; returns its spec name."""
    names = [s.name for s in mla_sm90.schedule_specs("bf16" if dtype == BF16 else "f16")
             if seesaw is None or s.seesaw == seesaw]
    assert mla_sm90.ENTRY in entries and mla._ENTRY not in entries
    ran = [n for n in names if n in entries.specs]
    assert ran, (names, entries.specs)
    return ran[0]


@pytest.fixture(params=[False, True], ids=["halves", "seesaw"])
def schedule(request, monkeypatch):
    """Every fa3 plan of the test runs this schedule (pick_schedule's rule set aside)."""
    monkeypatch.setattr(mla_sm90, "pick_schedule", lambda specs, *a: specs[int(request.param)])
    return request.param


def run_fa3(c, causal, dtype, backend="fa3", lse_base_e=False, **plan_kw):
    w = cuattn.BatchMLAPagedAttentionWrapper(backend=backend)
    w.plan(c["qo_indptr"], c["kv_indptr"], c["kv_indices"], c["kv_len"], c["heads"], CKV, KPE, c["page_size"],
           causal, SCALE, np.dtype(dtype), np.dtype(dtype), **plan_kw)
    out = _nan(c["qn"].shape, dtype)
    lse = _cp().full(c["qn"].shape[:2], np.nan, np.float32)
    res = w.run(_dev(c["qn"]), _dev(c["qp"]), _dev(c["ckv"]), _dev(c["kpe"]), out=out, lse=lse, return_lse=True,
                return_lse_base_on_e=lse_base_e)
    assert res[0] is out and res[1] is lse
    return w, out, lse


FA3_CASES = [   # (qo_lens, kv_lens, page_size, heads, causal)
    ([1, 1, 1], [1, 63, 1000], 1, 16, False),               # decode, page size 1, partial last tiles
    ([1] * 5, [5, 130, 777, 64, 2049], 16, 128, False),     # decode, 128 heads: two query tiles a request
    ([1, 1], [4097, 77], 64, 128, False),
    ([1], [16384], 64, 16, False),                          # one request: split into pieces by default
    ([4, 4, 1], [100, 33, 4], 16, 16, True),                # 4-token speculative steps, causal bottom-right
    ([4, 4], [300, 1000], 64, 128, True),                   # 512 rows a request: 8 query tiles
    ([1, 2], [500, 129], 16, 64, True),                     # 64 heads: one full tile a token
    ([4, 3], [77, 5], 1, 16, True),
    ([1, 3], [70, 200], 5, 16, True),                       # a page size no shift divides: the division path
]
FA3_IDS = [f"qo{sum(q)}-kv{max(k)}-b{len(k)}-ps{p}-h{h}-{'causal' if c else 'full'}" for q, k, p, h, c in FA3_CASES]


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("qo_lens,kv_lens,page_size,heads,causal", FA3_CASES, ids=FA3_IDS)
@pytest.mark.parametrize("dtype,schedule", [(np.float16, True), (BF16, False)], ids=["f16-seesaw", "bf16-halves"],
                         indirect=["schedule"])     # (each case under both schedules and both dtypes)
def test_mla_fa3_matches_float64_oracle(qo_lens, kv_lens, page_size, heads, causal, dtype, schedule, entries):
    c = mla_case(31, qo_lens, kv_lens, page_size, heads=heads, dtype=dtype)
    w, out, lse = run_fa3(c, causal, dtype, lse_base_e=dtype == BF16)
    name = ran_fa3(entries, dtype, schedule)
    assert f"kernel: {name} (backend fa3)" in w.describe()
    check_gpu(c, causal, dtype, out, lse, lse_base_e=dtype == BF16)


@pytest.mark.gpu
@sm90
def test_mla_auto_runs_fa3_on_sm90_and_fa2_when_asked(entries):
    c = mla_case(32, [1, 2], [700, 90], 16, heads=16)
    _, out3, lse3 = run_fa3(c, False, np.float16, backend="auto")
    ran_fa3(entries)
    entries.clear()
    _, out2, lse2 = run_fa3(c, False, np.float16, backend="fa2")
    assert mla._ENTRY in entries and mla_sm90.ENTRY not in entries
    for out, lse in ((out3, lse3), (out2, lse2)):
        check_gpu(c, False, np.float16, out, lse, lse_base_e=False)
    a, b = (_cp().asnumpy(x).astype(np.float64) for x in (out3, out2))
    assert rel_err(a, b) < 2e-3


@pytest.mark.gpu
@sm90
def test_mla_fa3_split_and_unsplit_agree_and_match_the_oracle(schedule, entries):
    c = mla_case(33, [1, 1, 4], [9000, 3000, 2000], 16, heads=128)
    w, out_split, lse_split = run_fa3(c, True, np.float16, fixed_split_size=1000)
    assert "pieces of 1024 keys" in w.describe() and mla._MERGE_ENTRY in entries
    w2, out_one, lse_one = run_fa3(c, True, np.float16, disable_split_kv=True)
    assert "split-KV: none" in w2.describe()
    for out, lse in ((out_split, lse_split), (out_one, lse_one)):
        check_gpu(c, True, np.float16, out, lse, lse_base_e=False)
    a, b = (_cp().asnumpy(x).astype(np.float64) for x in (out_split, out_one))
    assert rel_err(a, b) < 2e-3
    assert entries.count(mla_sm90.ENTRY) == 2
    ran_fa3(entries, seesaw=schedule)


@pytest.mark.gpu
@sm90
def test_mla_fa3_plan_picks_the_schedule(entries):
    c = mla_case(36, [1] * 3, [9000, 8500, 10000], 64, heads=128, dtype=BF16)     # full tiles, long items: seesaw
    w, out, lse = run_fa3(c, False, BF16, lse_base_e=True, disable_split_kv=True)
    assert ran_fa3(entries, BF16, True) in w.describe()
    check_gpu(c, False, BF16, out, lse, lse_base_e=True)
    entries.clear()
    c = mla_case(37, [1] * 3, [3000, 2500, 4000], 64, heads=16, dtype=BF16)       # 16 rows a tile: halves
    w, out, lse = run_fa3(c, False, BF16, lse_base_e=True, disable_split_kv=True)
    assert ran_fa3(entries, BF16, False) in w.describe()
    check_gpu(c, False, BF16, out, lse, lse_base_e=True)
    entries.clear()
    c = mla_case(38, [1] * 3, [9000, 8500, 10000], 64, heads=128, dtype=BF16)     # split into short pieces: halves
    w, out, lse = run_fa3(c, False, BF16, lse_base_e=True)
    assert "split-KV: 6 query tiles" in w.describe()
    assert ran_fa3(entries, BF16, False) in w.describe()
    check_gpu(c, False, BF16, out, lse, lse_base_e=True)


@pytest.mark.gpu
@sm90
def test_mla_fa3_out_8_byte_aligned_takes_the_direct_stores(schedule, entries):
    """The epilogue stages final rows in shared memory and stores 16-byte chunks where out allows it; an out at an
    8-byte (not 16-byte) aligned address takes the accumulators' 4-byte stores: the same values, bit for bit."""
    c = mla_case(39, [1, 2, 1], [700, 90, 2100], 64, heads=128)
    w, out, lse = run_fa3(c, False, np.float16)
    buf = _nan((out.size + 4,), np.float16)
    shifted = buf[4:].reshape(out.shape)
    assert shifted.data.ptr % 16 == 8
    w.run(_dev(c["qn"]), _dev(c["qp"]), _dev(c["ckv"]), _dev(c["kpe"]), out=shifted)
    assert bool((shifted.view(np.uint16) == out.view(np.uint16)).all())
    assert bool(_cp().isnan(buf[:4]).all())          # the 4 elements before out untouched
    check_gpu(c, False, np.float16, out, lse, lse_base_e=False)
    ran_fa3(entries, seesaw=schedule)


@pytest.mark.gpu
@sm90
def test_mla_fa3_zero_length_kv_gives_zeros_and_minus_inf(schedule, entries):
    c = mla_case(34, [1, 1, 2], [0, 50, 0], 16)
    _, out, lse = run_fa3(c, False, np.float16)
    o, s = _cp().asnumpy(out), _cp().asnumpy(lse)
    assert np.all(o[0] == 0) and np.all(o[2:] == 0) and np.all(s[0] == -np.inf) and np.all(s[2:] == -np.inf)
    check_gpu(c, False, np.float16, out, lse, lse_base_e=False)
    ran_fa3(entries, seesaw=schedule)


@pytest.mark.gpu
@sm90
def test_mla_fa3_cuda_graph_replays_after_replan(entries):
    graph_replay_after_replan(128, "fa3", 35)
    ran_fa3(entries, seesaw=True)          # 128 heads: full tiles; graph mode keeps the first plan's schedule
