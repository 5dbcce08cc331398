"""MLA (BatchMLAPagedAttentionWrapper, append_paged_mla_kv_cache) on the NumPy path against an
independent float64 formula; the kernels' compile (sm_80, sm_90a, no spills) and parameter lists on
the CPU; on a GPU (gpu marker) the kernel against a vectorised float64 oracle (decode and multi-token
causal, heads 16 / 128, page sizes 1 / 16 / 64, fp16 / bf16, split-KV, CUDA-graph replay after a
re-plan, LSE in both bases) and the GPU append. fp8 latent caches (e4m3, e5m2, with k_scale / v_scale):
the oracle runs on the dequantized cache (stored value x scale), on both paths; the fp8 append against
an independent saturating quantization (NumPy) and bit for bit against the NumPy append (GPU)."""
import math

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import cuattn
from cuattn import UnsupportedError, jit, mla

from .oracle import rel_err
from .test_params import c_signature

BF16 = np.dtype(ml_dtypes.bfloat16)
FP8 = {"e4m3": np.dtype(ml_dtypes.float8_e4m3fn), "e5m2": np.dtype(ml_dtypes.float8_e5m2)}
FP8_MAX = {"e4m3": 448.0, "e5m2": 57344.0}
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


# ============================================================================ fp8 latent cache (NumPy path)


def fp8_case(c, kv, k_scale, v_scale=None):
    """c's caches stored as fp8 ``kv`` at scale k_scale (value = stored x scale), with an oracle view
    holding the stored values (float64) for oracle_fast(..., k_scale, v_scale)."""
    st = {n: (c[n].astype(np.float64) / k_scale).astype(FP8[kv]) for n in ("ckv", "kpe")}
    ref = dict(c, ckv=st["ckv"].astype(np.float64), kpe=st["kpe"].astype(np.float64))
    return st["ckv"], st["kpe"], ref


FP8_NUMPY = [   # (kv, q dtype, k_scale, v_scale, case index of CASES)
    ("e4m3", np.float16, 0.5, 0.5, 2),
    ("e5m2", BF16, 2.0, 2.0, 0),
    ("e4m3", BF16, 0.25, 0.125, 1),       # the value scale apart from the key's: v_scale scales the output alone
]


@pytest.mark.parametrize("kv,qdt,ks,vs,case", FP8_NUMPY, ids=[f"{k}-{'bf16' if q == BF16 else 'f16'}-ks{a}-vs{b}"
                                                             for k, q, a, b, _ in FP8_NUMPY])
def test_mla_numpy_fp8_cache_matches_float64_on_the_dequantized_cache(kv, qdt, ks, vs, case):
    qo_lens, kv_lens, page_size, causal = CASES[case]
    c = mla_case(21, qo_lens, kv_lens, page_size, dtype=qdt)
    ckv8, kpe8, ref = fp8_case(c, kv, ks)
    w = cuattn.BatchMLAPagedAttentionWrapper()
    w.plan(c["qo_indptr"], c["kv_indptr"], c["kv_indices"], c["kv_len"], c["heads"], CKV, KPE, page_size, causal,
           0.07, np.dtype(qdt), f"float8_{kv}fn" if kv == "e4m3" else "float8_e5m2")
    out, lse = w.run(c["qn"], c["qp"], ckv8, kpe8, return_lse=True, return_lse_base_on_e=True, k_scale=ks, v_scale=vs)
    ref_o, ref_s = oracle_fast(ref, causal, 0.07, ks, vs)
    assert out.dtype == np.dtype(qdt) and rel_err(out.astype(np.float64), ref_o) < (1e-2 if qdt == BF16 else 2e-3)
    fin = np.isfinite(ref_s)
    assert np.array_equal(np.isfinite(lse), fin) and np.abs(lse[fin] - ref_s[fin]).max() < 1e-3 * np.abs(ref_s).max()
    # -- a uint8 cache is read as kv_data_type; a 1-element array scale is the float
    out2 = w.run(c["qn"], c["qp"], ckv8.view(np.uint8), kpe8.view(np.uint8), k_scale=np.array([ks], np.float32),
                 v_scale=vs)
    np.testing.assert_array_equal(out2, out)


def test_mla_numpy_scales_apply_to_16_bit_caches_too():
    c = mla_case(22, [1, 2], [50, 9], 16)
    w = planned(c, True)
    out = w.run(c["qn"], c["qp"], c["ckv"], c["kpe"], k_scale=0.5, v_scale=3.0)
    ref_o, _ = oracle_fast(c, True, 0.07, 0.5, 3.0)
    assert rel_err(out.astype(np.float64), ref_o) < 2e-3


def test_mla_fp8_rejects_bad_dtypes_and_scales_naming_them():
    c = mla_case(23, [1], [10], 16)
    ckv8, kpe8, _ = fp8_case(c, "e4m3", 1.0)
    w = cuattn.BatchMLAPagedAttentionWrapper()
    with pytest.raises(UnsupportedError, match="q_data_type must be float16, bfloat16 or float32"):
        w.plan(c["qo_indptr"], c["kv_indptr"], c["kv_indices"], c["kv_len"], 16, CKV, KPE, 16, False, 0.1,
               "float8_e4m3fn", "float8_e4m3fn")
    w.plan(c["qo_indptr"], c["kv_indptr"], c["kv_indices"], c["kv_len"], 16, CKV, KPE, 16, False, 0.1,
           "float16", "float8_e4m3fn")
    with pytest.raises(ValueError, match="ckv_cache must have dtype float8_e4m3fn .*or uint8"):
        w.run(c["qn"], c["qp"], ckv8.astype(FP8["e5m2"]), kpe8)
    with pytest.raises(ValueError, match="kpe_cache must have dtype float8_e4m3fn"):
        w.run(c["qn"], c["qp"], ckv8, c["kpe"])
    for bad in (-1.0, 0.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="k_scale must be a positive finite number"):
            w.run(c["qn"], c["qp"], ckv8, kpe8, k_scale=bad)
    with pytest.raises(ValueError, match="v_scale must be positive and finite"):
        w.run(c["qn"], c["qp"], ckv8, kpe8, v_scale=np.array([-2.0], np.float32))
    with pytest.raises(ValueError, match=r"v_scale must be a float or an array of shape \(1,\)"):
        w.run(c["qn"], c["qp"], ckv8, kpe8, v_scale=np.ones(2, np.float32))
    with pytest.raises(ValueError, match="k_scale must be a float"):
        w.run(c["qn"], c["qp"], ckv8, kpe8, k_scale=np.ones((1, 1), np.float32))
    w16 = planned(c, False)
    with pytest.raises(ValueError, match="ckv_cache must have dtype float16 .*got uint8"):
        w16.run(c["qn"], c["qp"], ckv8.view(np.uint8), c["kpe"])


def test_mla_run_kv_len_and_page_table_must_restate_the_plan():
    c = mla_case(24, [1, 2], [40, 17], 16)
    w = planned(c, False)
    base = w.run(c["qn"], c["qp"], c["ckv"], c["kpe"])
    pages = np.diff(c["kv_indptr"])
    table = np.full((2, 5), 999, np.int32)            # padded past each request's pages (never read)
    for b in range(2):
        table[b, :pages[b]] = c["kv_indices"][c["kv_indptr"][b]:c["kv_indptr"][b + 1]]
    out = w.run(c["qn"], c["qp"], c["ckv"], c["kpe"], kv_len=c["kv_len"], page_table=table)
    np.testing.assert_array_equal(out, base)
    with pytest.raises(ValueError, match="kv_len must be an integer array equal to plan"):
        w.run(c["qn"], c["qp"], c["ckv"], c["kpe"], kv_len=c["kv_len"] + 1)
    with pytest.raises(ValueError, match="kv_len must be"):
        w.run(c["qn"], c["qp"], c["ckv"], c["kpe"], kv_len=c["kv_len"][:1])
    with pytest.raises(ValueError, match="kv_len must be"):
        w.run(c["qn"], c["qp"], c["ckv"], c["kpe"], kv_len=c["kv_len"].astype(np.float32))
    swapped = table.copy()
    swapped[0, [0, 1]] = swapped[0, [1, 0]]
    with pytest.raises(ValueError, match="page_table row b must start with"):
        w.run(c["qn"], c["qp"], c["ckv"], c["kpe"], page_table=swapped)
    with pytest.raises(ValueError, match=r"page_table must be an integer array of shape \(batch=2, >= 3 pages\)"):
        w.run(c["qn"], c["qp"], c["ckv"], c["kpe"], page_table=table[:, :2])
    with pytest.raises(ValueError, match="page_table must be"):
        w.run(c["qn"], c["qp"], c["ckv"], c["kpe"], page_table=table[0])


def quantize_oracle(x, kv, scale):
    """fp8 ``kv`` bits of x / scale: clipped to +-(max finite), then rounded to nearest even (ml_dtypes)."""
    return np.clip(x.astype(np.float64) / scale, -FP8_MAX[kv], FP8_MAX[kv]).astype(np.float32).astype(FP8[kv])


def fp8_append_case(seed, kv):
    """An append of fp16 rows (some past the fp8 range) into two requests' pages: (args before the caches,
    page table, rows)."""
    c = mla_case(seed, [1, 1], [40, 9], 16)
    rng = np.random.default_rng(seed)
    rows_c = (rng.standard_normal((49, CKV)) * 4).astype(np.float16)
    rows_k = (rng.standard_normal((49, KPE)) * 4).astype(np.float16)
    rows_c[0, :4] = [60000, -60000, 1000, -1000]           # saturate (e4m3 at 448 x scale, e5m2 at 57344 x scale)
    bi, pos = cuattn.get_batch_indices_positions(np.array([0, 40, 49], np.int32), c["kv_len"], 49)
    last = np.array([8, 9], np.int32)
    return c, rows_c, rows_k, bi, pos, last


@pytest.mark.parametrize("kv", ["e4m3", "e5m2"])
def test_append_paged_mla_kv_cache_quantizes_to_fp8_saturating_numpy(kv):
    c, rows_c, rows_k, bi, pos, last = fp8_append_case(25, kv)
    scale = 0.5
    ckv = np.zeros(c["ckv"].shape, FP8[kv])
    kpe = np.zeros(c["kpe"].shape, np.uint8)                # a uint8 view, read as kv_data_type
    cuattn.append_paged_mla_kv_cache(rows_c, rows_k, bi, pos, ckv, kpe, c["kv_indices"], c["kv_indptr"], last,
                                     kv_scale=scale, kv_data_type=FP8[kv])
    want_c, want_k = quantize_oracle(rows_c, kv, scale), quantize_oracle(rows_k, kv, scale)
    assert np.isfinite(want_c.astype(np.float32)).all()
    for b, n in enumerate(c["kv_len"]):
        ids = c["kv_indices"][c["kv_indptr"][b]:c["kv_indptr"][b + 1]]
        lo = int(np.sum(c["kv_len"][:b]))
        np.testing.assert_array_equal(ckv[ids].reshape(-1, CKV)[:n].view(np.uint8), want_c[lo:lo + n].view(np.uint8))
        np.testing.assert_array_equal(kpe[ids].reshape(-1, KPE)[:n], want_k[lo:lo + n].view(np.uint8))
    assert np.abs(ckv.astype(np.float32)).max() == FP8_MAX[kv]     # rows_c[0, :2] saturated, not inf / NaN
    with pytest.raises(ValueError, match="kv_scale must be None unless the latent cache is fp8"):
        cuattn.append_paged_mla_kv_cache(rows_c, rows_k, bi, pos, np.zeros_like(c["ckv"]), np.zeros_like(c["kpe"]),
                                         c["kv_indices"], c["kv_indptr"], last, kv_scale=0.5)


# ============================================================================ kernels (CPU: NVRTC only)


@pytest.mark.parametrize("arch", jit.SHIPPED_ARCHS)
def test_shipped_mla_kernels_compile_without_spills(arch):
    specs = [s for s in mla.shipped_specs() if s.archs is None or arch in s.archs]
    assert {(s.dtype, s.kv) for s in specs} == {(d, kv) for d in ("f16", "bf16") for kv in ("", "e4m3", "e5m2")}
    assert {s.stages for s in specs if s.kv} == ({2, 4} if arch == "sm_90a" else {2})
    for spec in specs:
        res = jit.compile_kernel(spec, arch).resources
        for entry in (mla._ENTRY, mla._MERGE_ENTRY):
            r = res[entry]
            assert r["spill_stores"] == 0 and r["spill_loads"] == 0 and r["stack_frame"] == 0, (spec.name, entry, r)
        assert spec.smem_bytes <= (227 if arch == "sm_90a" else 163) * 1024, spec.name


@pytest.mark.parametrize("params", [mla.PARAMS, mla.MERGE_PARAMS], ids=lambda p: p.entry)
def test_mla_kernel_parameter_definition_matches_the_c_signature(params):
    assert c_signature("mla.cu", params.entry, {}) == list(zip(params.names, params.kinds))


def test_mla_plan_refuses_bad_split_arguments_on_every_path():
    c = mla_case(3, [1], [10], 16)
    w = cuattn.BatchMLAPagedAttentionWrapper()
    for bad in (0, 2.5, True):
        with pytest.raises(ValueError, match="fixed_split_size"):
            w.plan(c["qo_indptr"], c["kv_indptr"], c["kv_indices"], c["kv_len"], 16, CKV, KPE, 16, False, 0.1,
                   "float16", "float16", fixed_split_size=bad)


def kernel_ranges(wl, qo_lens, kv_lens, heads, causal):
    """mla.cu's key range of every work row, computed as the kernel computes it: (request, tile, kv_lo, kv_end)."""
    out = []
    for req, tile, piece, _ in wl.work:
        rows, n, qlen = int(qo_lens[req]) * heads, int(kv_lens[req]), int(qo_lens[req])
        end = min(n, max(0, (min(rows, (tile + 1) * mla.BLOCK_M) - 1) // heads + n - qlen + 1)) if causal else n
        lo = 0
        if wl.chunk > 0:
            lo, end = piece * wl.chunk, min(end, piece * wl.chunk + wl.chunk)
        out.append((int(req), int(tile), lo, end))
    return out


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 9), st.integers(0, 3000)), min_size=1, max_size=12),
       st.sampled_from([16, 32, 64, 128]), st.booleans(), st.sampled_from([None, 0, 1, 100, 700]))
def test_mla_work_list_covers_every_row_and_visible_key_once(lens, heads, causal, split):
    """plan.py's work list as plan() builds it, read with the kernel's key-range rule: every packed row
    (token x head) of every request is in one tile, and each tile's pieces cover the keys its last row
    sees exactly once, each piece non-empty; split pieces have distinct partial slots and one merge row."""
    from cuattn import plan as P
    qo_lens = np.array([q if not causal else min(q, n) for q, n in lens], np.int64)
    kv_lens = np.array([n for _, n in lens], np.int64)
    items = P.prefill_items(qo_lens, kv_lens, heads, mla.BLOCK_M, causal)
    chunk = (mla._choose_chunk(items[2], 132, 1021) if split is None
             else 0 if split == 0 else -(-split // mla.BLOCK_N) * mla.BLOCK_N)
    wl = P.prefill_work_list(qo_lens, kv_lens, heads, mla.BLOCK_M, mla.BLOCK_N, causal, chunk, items)
    tiles = {}
    for req, tile, lo, end in kernel_ranges(wl, qo_lens, kv_lens, heads, causal):
        tiles.setdefault((req, tile), []).append((lo, end))
    want = {(b, t) for b in range(len(lens)) for t in range(-(-int(qo_lens[b]) * heads // mla.BLOCK_M))}
    assert set(tiles) == want
    for (b, t), pieces in tiles.items():
        rows, n, qlen = int(qo_lens[b]) * heads, int(kv_lens[b]), int(qo_lens[b])
        last = min(rows, (t + 1) * mla.BLOCK_M) - 1
        ext = min(n, last // heads + n - qlen + 1) if causal else n
        covered = sorted(pieces)
        if len(covered) > 1:
            assert all(e > s for s, e in covered)
        assert covered[0][0] == 0 and covered[-1][1] == ext
        assert all(a[1] == b_[0] for a, b_ in zip(covered, covered[1:]))
    slots = wl.work[:, 3][wl.work[:, 3] >= 0]
    assert len(set(slots.tolist())) == len(slots) == wl.num_slots
    assert sorted((int(m[0]), int(m[1])) for m in wl.merge) == sorted(k for k, v in tiles.items() if len(v) > 1)


# ============================================================================ fp32 q (issue 22: cuattn/qcast.py)
# The GPU runs the 16-bit kernel of qcast.kernel_dtype (bf16 over a bf16 cache, else f16) on converted copies of
# q_nope and q_pe, the output converted back into a float32 out; the NumPy path computes with the float32 q.


def f32q_case(seed, qo_lens, kv_lens, page_size, kv_dtype, heads=16):
    """mla_case with float32 q_nope / q_pe (values a 16-bit type does not hold exactly) over a ``kv_dtype`` cache."""
    c = mla_case(seed, qo_lens, kv_lens, page_size, heads=heads, dtype=kv_dtype)
    rng = np.random.default_rng(seed + 1000)
    return dict(c, qn=rng.standard_normal(c["qn"].shape).astype(np.float32),
                qp=rng.standard_normal(c["qp"].shape).astype(np.float32))


def test_mla_f32_q_plans_the_16bit_kernel_of_the_compute_type():
    c = mla_case(41, [1, 2], [30, 9], 16)
    want = {"float16": ("f16", ""), "bfloat16": ("bf16", ""), "float8_e4m3fn": ("f16", "e4m3"),
            "float32": ("f16", None)}                      # (kernel q, kernel kv); None: no kernel (run() refuses)
    for kv, (q_short, kv_short) in want.items():
        w = cuattn.BatchMLAPagedAttentionWrapper()
        w.plan(c["qo_indptr"], c["kv_indptr"], c["kv_indices"], c["kv_len"], 16, CKV, KPE, 16, False, 0.1,
               "float32", kv)
        assert w._plan.q_dtype == np.float32                  # what run() checks q_nope, q_pe and out against
        assert (mla._q_short(w._plan), mla._kv_short(w._plan)) == (q_short, kv_short), kv


@pytest.mark.parametrize("kv", [np.float16, BF16], ids=["f16", "bf16"])
def test_mla_f32_q_numpy_path_matches_float64_oracle_and_checks_dtypes(kv):
    c = f32q_case(42, [1, 3], [70, 20], 16, kv)
    w = cuattn.BatchMLAPagedAttentionWrapper()
    w.plan(c["qo_indptr"], c["kv_indptr"], c["kv_indices"], c["kv_len"], 16, CKV, KPE, 16, True, 0.07, "float32",
           np.dtype(kv))
    out = np.full(c["qn"].shape, np.nan, np.float32)
    res, lse = w.run(c["qn"], c["qp"], c["ckv"], c["kpe"], out=out, return_lse=True, return_lse_base_on_e=True)
    ref_o, ref_s = oracle_fast(c, True, 0.07)
    assert res is out and out.dtype == np.float32
    assert rel_err(out, ref_o) < 1e-5 and np.abs(lse - ref_s).max() < 1e-5 * np.abs(ref_s).max()  # float32 arithmetic
    with pytest.raises(ValueError, match="q_pe must have dtype float32"):
        w.run(c["qn"], c["qp"].astype(kv), c["ckv"], c["kpe"])


# ============================================================================ GPU


def _cp():
    import cupy
    return cupy


def _dev(x):
    return _cp().asarray(x.view(np.uint16)) if x.dtype == BF16 else _cp().asarray(x)


def _host(x, dtype):
    a = _cp().asnumpy(x)
    return a.view(BF16) if dtype == BF16 else a


def _nan(shape, dtype):
    if dtype == BF16:
        return _cp().full(shape, 0x7FC0, np.uint16)
    return _cp().full(shape, np.nan, dtype)


def oracle_fast(c, causal, sm_scale, k_scale=1.0, v_scale=1.0):
    """float64, vectorised per request (rows = token x head at once); independent of cuattn.reference.
    The caches' stored values (any dtype, fp8 included) times the scales: key [ckv | kpe] x k_scale,
    value ckv x v_scale."""
    h = c["heads"]
    out = np.zeros(c["qn"].shape, np.float64)
    lse = np.full(c["qn"].shape[:2], -np.inf)
    for b in range(len(c["kv_len"])):
        q0, q1, n = int(c["qo_indptr"][b]), int(c["qo_indptr"][b + 1]), int(c["kv_len"][b])
        if q1 == q0 or n == 0:
            continue
        ids = c["kv_indices"][c["kv_indptr"][b]:c["kv_indptr"][b + 1]]
        ckv = c["ckv"][ids].reshape(-1, CKV)[:n].astype(np.float64)
        kpe = c["kpe"][ids].reshape(-1, KPE)[:n].astype(np.float64)
        q = np.concatenate([c["qn"][q0:q1], c["qp"][q0:q1]], axis=-1).astype(np.float64)   # [qo, h, 576]
        s = (q.reshape(-1, CKV + KPE) @ (np.concatenate([ckv, kpe], axis=1) * k_scale).T * sm_scale).reshape(q1 - q0, h, n)
        if causal:
            visible = np.arange(n)[None, :] <= np.arange(q1 - q0)[:, None] + (n - (q1 - q0))   # [qo, n]
            s = np.where(visible[:, None, :], s, -np.inf)
        m = s.max(-1, keepdims=True)
        w = np.exp(s - m)
        z = w.sum(-1, keepdims=True)
        out[q0:q1] = (w / z) @ (ckv * v_scale)
        lse[q0:q1] = m[..., 0] + np.log(z[..., 0])
    return out, lse


TOL = {"f16": 5e-3, "bf16": 1.5e-2}       # ||out - ref|| / ||ref||
ELEM_TOL = {"f16": 2e-2, "bf16": 6e-2}    # max |out - ref| / max |ref|, every element
SCALE = 1 / math.sqrt(CKV + KPE)


def check_gpu(c, causal, dtype, out, lse, lse_base_e, scales=(1.0, 1.0), kernel_dtype=None):
    """out (of ``dtype``) and lse against oracle_fast, within the tolerance of the kernel's q type (``kernel_dtype``;
    default ``dtype``: a float32 q runs a 16-bit kernel)."""
    key = "bf16" if (dtype if kernel_dtype is None else kernel_dtype) == BF16 else "f16"
    ref_o, ref_s = oracle_fast(c, causal, SCALE, *scales)
    o = _host(out, dtype).astype(np.float64)
    assert np.isfinite(o).all(), "NaN left in out: a row was not written"
    assert rel_err(o, ref_o) < TOL[key]
    assert np.abs(o - ref_o).max() <= ELEM_TOL[key] * max(np.abs(ref_o).max(), 1e-6)
    s = _cp().asnumpy(lse).astype(np.float64)
    if not lse_base_e:
        s = s * math.log(2)
    fin = np.isfinite(ref_s)
    assert np.array_equal(np.isfinite(s), fin) and np.all(s[~fin] == ref_s[~fin])
    assert np.abs(s[fin] - ref_s[fin]).max() < 2e-3 * max(1.0, np.abs(ref_s[fin]).max())


def run_gpu(c, causal, dtype, lse_base_e=False, **plan_kw):
    w = cuattn.BatchMLAPagedAttentionWrapper()
    w.plan(c["qo_indptr"], c["kv_indptr"], c["kv_indices"], c["kv_len"], c["heads"], CKV, KPE, c["page_size"],
           causal, SCALE, np.dtype(dtype), np.dtype(dtype), **plan_kw)
    out = _nan(c["qn"].shape, dtype)
    lse = _cp().full(c["qn"].shape[:2], np.nan, np.float32)
    res = w.run(_dev(c["qn"]), _dev(c["qp"]), _dev(c["ckv"]), _dev(c["kpe"]), out=out, lse=lse, return_lse=True,
                return_lse_base_on_e=lse_base_e)
    assert res[0] is out and res[1] is lse
    return w, out, lse


GPU_CASES = [   # (qo_lens, kv_lens, page_size, heads, causal): decode, then multi-token
    ([1, 1, 1], [1, 63, 1000], 1, 16, False),
    ([1] * 7, [5, 130, 777, 64, 1, 2049, 300], 16, 128, False),
    ([1], [16384], 64, 16, False),                 # small batch, long kv: split into pieces
    ([1, 1], [4097, 77], 64, 128, False),
    ([4, 1, 7], [100, 33, 7], 16, 16, True),       # speculative / chunked prefill, causal bottom-right
    ([2, 3, 9], [300, 1000, 9], 64, 128, True),
    ([3, 2], [40, 500], 1, 16, False),             # multi-token, no mask
]
GPU_IDS = [f"qo{sum(q)}-kv{max(k)}-b{len(k)}-ps{p}-h{h}-{'causal' if c else 'full'}" for q, k, p, h, c in GPU_CASES]


@pytest.mark.gpu
@pytest.mark.parametrize("qo_lens,kv_lens,page_size,heads,causal", GPU_CASES, ids=GPU_IDS)
@pytest.mark.parametrize("dtype", [np.float16, BF16], ids=["f16", "bf16"])
def test_mla_gpu_matches_float64_oracle(qo_lens, kv_lens, page_size, heads, causal, dtype):
    c = mla_case(11, qo_lens, kv_lens, page_size, heads=heads, dtype=dtype)
    _, out, lse = run_gpu(c, causal, dtype, lse_base_e=dtype == BF16)
    check_gpu(c, causal, dtype, out, lse, lse_base_e=dtype == BF16)


FP8_GPU = [   # (qo_lens, kv_lens, page_size, heads, causal, k_scale, v_scale, plan keywords): decode, multi-token
    ([1, 1, 1], [1, 63, 1000], 1, 16, False, 0.5, 0.5, {}),
    ([1] * 3, [5, 777, 2049], 64, 128, False, 2.0, 2.0, {}),
    ([4, 1, 7], [100, 33, 7], 64, 16, True, 0.25, 0.125, {}),        # v_scale apart from k_scale
    ([2, 3, 9], [300, 1000, 9], 1, 128, True, 1.0, 1.0, {}),
    ([1], [16384], 64, 16, False, 0.5, 0.5, {}),                     # batch of one: split by default
    ([1, 1], [9000, 3000], 64, 128, False, 4.0, 4.0, {"fixed_split_size": 1000}),
]
FP8_GPU_IDS = [f"qo{sum(q)}-kv{max(k)}-ps{p}-h{h}-{'causal' if c else 'full'}-ks{a}-vs{b}{'-split' if kw else ''}"
               for q, k, p, h, c, a, b, kw in FP8_GPU]


def run_gpu_fp8(c, ckv8, kpe8, causal, dtype, kv, k_scale, v_scale, **plan_kw):
    """Plan an fp8 ``kv`` cache, run on uint8 CuPy caches into NaN-poisoned out / lse."""
    w = cuattn.BatchMLAPagedAttentionWrapper()
    w.plan(c["qo_indptr"], c["kv_indptr"], c["kv_indices"], c["kv_len"], c["heads"], CKV, KPE, c["page_size"],
           causal, SCALE, np.dtype(dtype), FP8[kv], **plan_kw)
    out = _nan(c["qn"].shape, dtype)
    lse = _cp().full(c["qn"].shape[:2], np.nan, np.float32)
    res = w.run(_dev(c["qn"]), _dev(c["qp"]), _cp().asarray(ckv8.view(np.uint8)), _cp().asarray(kpe8.view(np.uint8)),
                out=out, lse=lse, return_lse=True, k_scale=k_scale, v_scale=v_scale)
    assert res[0] is out and res[1] is lse
    return w, out, lse


@pytest.mark.gpu
@pytest.mark.parametrize("qo_lens,kv_lens,page_size,heads,causal,ks,vs,plan_kw", FP8_GPU, ids=FP8_GPU_IDS)
@pytest.mark.parametrize("kv", ["e4m3", "e5m2"])
def test_mla_gpu_fp8_cache_matches_float64_on_the_dequantized_cache(qo_lens, kv_lens, page_size, heads, causal, ks,
                                                                    vs, plan_kw, kv):
    dtype = BF16 if (len(kv_lens) + (kv == "e5m2")) % 2 else np.float16     # both q dtypes over the grid
    c = mla_case(31, qo_lens, kv_lens, page_size, heads=heads, dtype=dtype)
    ckv8, kpe8, ref = fp8_case(c, kv, ks)
    w, out, lse = run_gpu_fp8(c, ckv8, kpe8, causal, dtype, kv, ks, vs, **plan_kw)
    assert f"_kv{kv}_" in w.describe()
    if plan_kw or len(kv_lens) == 1:
        assert "pieces of" in w.describe()
    check_gpu(ref, causal, dtype, out, lse, lse_base_e=False, scales=(ks, vs))


@pytest.mark.gpu
def test_mla_gpu_fp8_reads_device_scales_and_torch_float8_caches():
    cp = _cp()
    c = mla_case(32, [1, 3], [700, 90], 16, heads=16, dtype=BF16)
    ckv8, kpe8, ref = fp8_case(c, "e4m3", 0.5)
    # -- 1-element CUDA float32 scales (read by the kernel)
    _, out, lse = run_gpu_fp8(c, ckv8, kpe8, True, BF16, "e4m3", cp.asarray([0.5], np.float32),
                              cp.asarray([0.25], np.float32))
    check_gpu(ref, True, BF16, out, lse, lse_base_e=False, scales=(0.5, 0.25))
    torch = pytest.importorskip("torch")
    w = cuattn.BatchMLAPagedAttentionWrapper()
    w.plan(c["qo_indptr"], c["kv_indptr"], c["kv_indices"], c["kv_len"], 16, CKV, KPE, 16, True, SCALE,
           torch.bfloat16, torch.float8_e4m3fn)
    tq = [torch.from_numpy(c[k].view(np.int16)).cuda().view(torch.bfloat16) for k in ("qn", "qp")]
    tc = [torch.from_numpy(x.view(np.uint8)).cuda().view(torch.float8_e4m3fn) for x in (ckv8, kpe8)]
    o, s = w.run(*tq, *tc, return_lse=True, k_scale=0.5, v_scale=0.5)
    assert isinstance(o, torch.Tensor) and o.dtype == torch.bfloat16 and o.is_cuda
    check_gpu(ref, True, BF16, cp.asarray(o.view(torch.int16)).view(np.uint16), cp.asarray(s), lse_base_e=False,
              scales=(0.5, 0.5))


@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["e4m3", "e5m2"])
def test_mla_gpu_fp8_append_equals_numpy_bitwise(kv):
    cp = _cp()
    c, rows_c, rows_k, bi, pos, last = fp8_append_case(33, kv)
    host = [np.zeros(c["ckv"].shape, FP8[kv]), np.zeros(c["kpe"].shape, FP8[kv])]
    dev = [cp.zeros(x.shape, np.uint8) for x in host]
    cuattn.append_paged_mla_kv_cache(rows_c, rows_k, bi, pos, *host, c["kv_indices"], c["kv_indptr"], last,
                                     kv_scale=0.5)
    cuattn.append_paged_mla_kv_cache(cp.asarray(rows_c), cp.asarray(rows_k), cp.asarray(bi), cp.asarray(pos), *dev,
                                     cp.asarray(c["kv_indices"]), cp.asarray(c["kv_indptr"]), cp.asarray(last),
                                     kv_scale=0.5, kv_data_type=FP8[kv])
    for h, d in zip(host, dev):
        np.testing.assert_array_equal(h.view(np.uint8), cp.asnumpy(d))
    assert np.abs(host[0].astype(np.float32)).max() == FP8_MAX[kv]      # the saturated rows


@pytest.mark.gpu
def test_mla_gpu_run_checks_kv_len_and_page_table():
    cp = _cp()
    c = mla_case(34, [1, 1], [40, 9], 16)
    w = planned(c, False, sm_scale=SCALE)
    qn, qp, ckv, kpe = (cp.asarray(c[k]) for k in ("qn", "qp", "ckv", "kpe"))
    table = np.zeros((2, 3), np.int32)
    table[0, :3], table[1, :1] = c["kv_indices"][:3], c["kv_indices"][3:4]
    a = w.run(qn, qp, ckv, kpe)
    b = w.run(qn, qp, ckv, kpe, kv_len=cp.asarray(c["kv_len"]), page_table=cp.asarray(table))
    np.testing.assert_array_equal(cp.asnumpy(a), cp.asnumpy(b))
    with pytest.raises(ValueError, match="kv_len must be"):
        w.run(qn, qp, ckv, kpe, kv_len=cp.asarray(c["kv_len"][::-1].copy()))
    with pytest.raises(ValueError, match="page_table row b"):
        w.run(qn, qp, ckv, kpe, page_table=cp.asarray(table[::-1].copy()))


@pytest.mark.gpu
def test_mla_gpu_split_and_unsplit_agree_and_match_the_oracle():
    c = mla_case(12, [1, 1], [9000, 3000], 64, heads=128)
    w, out_split, lse_split = run_gpu(c, False, np.float16, fixed_split_size=1000)
    assert w.describe().count("split-KV: ") == 1 and "pieces of 1024 keys" in w.describe()
    w2, out_one, lse_one = run_gpu(c, False, np.float16, disable_split_kv=True)
    assert "split-KV: none" in w2.describe()
    for out, lse in ((out_split, lse_split), (out_one, lse_one)):
        check_gpu(c, False, np.float16, out, lse, lse_base_e=False)
    a, b = _cp().asnumpy(out_split).astype(np.float64), _cp().asnumpy(out_one).astype(np.float64)
    assert rel_err(a, b) < 2e-3
    # the default plan of a batch of one splits (132 SMs, one tile)
    w3, out3, lse3 = run_gpu(mla_case(13, [1], [20000], 64, heads=16), False, np.float16)
    assert "pieces of" in w3.describe()
    check_gpu(mla_case(13, [1], [20000], 64, heads=16), False, np.float16, out3, lse3, lse_base_e=False)


@pytest.mark.gpu
def test_mla_gpu_zero_length_kv_gives_zeros_and_minus_inf():
    c = mla_case(14, [1, 1, 2], [0, 50, 0], 16)
    _, out, lse = run_gpu(c, False, np.float16)
    o, s = _cp().asnumpy(out), _cp().asnumpy(lse)
    assert np.all(o[0] == 0) and np.all(o[2:] == 0) and np.all(s[0] == -np.inf) and np.all(s[2:] == -np.inf)
    check_gpu(c, False, np.float16, out, lse, lse_base_e=False)


@pytest.mark.gpu
def test_mla_gpu_cuda_graph_replays_after_replan():
    graph_replay_after_replan(16, "auto", 15)


def graph_replay_after_replan(heads, backend, seed, q_dtype=np.float16):
    """A captured run() replays a later plan with other lengths and other pieces (tests/test_mla_sm90.py
    runs it on the Hopper kernel too). ``q_dtype`` float32: q and out float32 over the float16 cache (the
    captured graph holds the q and out conversions around the kernel too)."""
    cp = _cp()
    ps = 16
    c0 = mla_case(seed, [1, 1], [3000, 40], ps, heads=heads)      # splits (2 items on 132 SMs at 16 heads)
    c1 = mla_case(seed + 1, [1, 1], [41, 5000], ps, heads=heads)  # other lengths, other pieces
    pages = max(len(c0["ckv"]), len(c1["ckv"]))
    ckv = cp.zeros((pages, ps, CKV), np.float16)
    kpe = cp.zeros((pages, ps, KPE), np.float16)
    qn, qp = cp.zeros(c0["qn"].shape, q_dtype), cp.zeros(c0["qp"].shape, q_dtype)    # (f16 values: exact in f32)
    out = _nan(c0["qn"].shape, q_dtype)
    lse = cp.full(c0["qn"].shape[:2], np.nan, np.float32)
    w = cuattn.BatchMLAPagedAttentionWrapper(use_cuda_graph=True, backend=backend)

    def load(c):
        ckv[:len(c["ckv"])] = cp.asarray(c["ckv"])
        kpe[:len(c["kpe"])] = cp.asarray(c["kpe"])
        qn[...] = cp.asarray(c["qn"])
        qp[...] = cp.asarray(c["qp"])
        out.fill(np.nan)
        lse.fill(np.nan)

    def plan(c):
        w.plan(c["qo_indptr"], c["kv_indptr"], c["kv_indices"], c["kv_len"], heads, CKV, KPE, ps, False, SCALE,
               np.dtype(q_dtype), "float16")

    stream = cp.cuda.Stream(non_blocking=True)
    cp.cuda.Device().synchronize()
    with stream:
        load(c0)
        plan(c0)
        assert "pieces of" in w.describe()
        w.run(qn, qp, ckv, kpe, out=out, lse=lse)      # warm-up: compiles, sets the shared-memory limit
        stream.begin_capture()
        w.run(qn, qp, ckv, kpe, out=out, lse=lse)
        graph = stream.end_capture()
        load(c0)
        graph.launch()
    stream.synchronize()
    check_gpu(c0, False, q_dtype, out, lse, lse_base_e=False, kernel_dtype=np.float16)
    with stream:
        plan(c1)
        load(c1)
        graph.launch()
    stream.synchronize()
    check_gpu(c1, False, q_dtype, out, lse, lse_base_e=False, kernel_dtype=np.float16)


F32Q_GPU = [   # (qo_lens, kv_lens, page_size, heads, causal, cache, backend)
    ([1, 1, 1], [1, 63, 1000], 1, 16, False, "float16", "fa2"),
    ([4, 1, 7], [100, 33, 7], 16, 128, True, "bfloat16", "auto"),     # sm_90: fa3
    ([1], [16384], 64, 16, False, "bfloat16", "auto"),                # split: the merge writes the 16-bit copy
    ([2, 1], [300, 45], 16, 16, True, "e4m3", "auto"),                # fp8 cache: f16 kernel, scales
]


@pytest.mark.gpu
@pytest.mark.parametrize("qo_lens,kv_lens,page_size,heads,causal,cache,backend", F32Q_GPU,
                         ids=[f"{x[5]}-{x[6]}-h{x[3]}-kv{max(x[1])}" for x in F32Q_GPU])
def test_mla_gpu_f32_q_matches_float64_oracle(qo_lens, kv_lens, page_size, heads, causal, cache, backend):
    cp = _cp()
    fp8 = cache == "e4m3"
    kdt = {"float16": np.float16, "bfloat16": BF16, "e4m3": np.float16}[cache]      # the kernel's q type
    c = f32q_case(43, qo_lens, kv_lens, page_size, kdt, heads=heads)
    ref, ckv, kpe, scales = c, _dev(c["ckv"]), _dev(c["kpe"]), (1.0, 1.0)
    if fp8:
        ckv8, kpe8, ref = fp8_case(c, "e4m3", 0.5)
        ckv, kpe, scales = cp.asarray(ckv8.view(np.uint8)), cp.asarray(kpe8.view(np.uint8)), (0.5, 0.25)
    w = cuattn.BatchMLAPagedAttentionWrapper(backend=backend)
    w.plan(c["qo_indptr"], c["kv_indptr"], c["kv_indices"], c["kv_len"], heads, CKV, KPE, page_size, causal, SCALE,
           "float32", FP8["e4m3"] if fp8 else np.dtype(kdt))
    qn = cp.asarray(c["qn"])
    if fp8:     # an fp32 q needs no 16-byte alignment (the kernel reads its copy): q_nope 4 bytes past one
        pad = cp.zeros(c["qn"].shape[:2] + (CKV + 1,), np.float32)
        pad[..., 1:] = qn
        qn = pad[..., 1:]
    out, lse = cp.full(c["qn"].shape, np.nan, np.float32), cp.full(c["qn"].shape[:2], np.nan, np.float32)
    res = w.run(qn, cp.asarray(c["qp"]), ckv, kpe, out=out, lse=lse, return_lse=True, k_scale=scales[0],
                v_scale=scales[1])
    assert res[0] is out and res[1] is lse and out.dtype == np.float32
    if len(kv_lens) == 1:
        assert "pieces of" in w.describe()
    check_gpu(ref, causal, np.float32, out, lse, lse_base_e=False, scales=scales, kernel_dtype=kdt)
    with pytest.raises(ValueError, match="q_nope must have dtype float32"):
        w.run(qn.astype(np.float16), cp.asarray(c["qp"]), ckv, kpe)
    with pytest.raises(ValueError, match="out must be .* float32"):
        w.run(qn, cp.asarray(c["qp"]), ckv, kpe, out=cp.empty(c["qn"].shape, np.float16))


@pytest.mark.gpu
def test_mla_gpu_f32_q_cuda_graph_replays_after_replan():
    graph_replay_after_replan(16, "auto", 17, q_dtype=np.float32)


@pytest.mark.gpu
def test_mla_gpu_rejects_bad_arrays_naming_them():
    cp = _cp()
    c = mla_case(17, [1, 1], [40, 9], 16)
    w = planned(c, False, sm_scale=SCALE)
    qn, qp, ckv, kpe = (cp.asarray(c[k]) for k in ("qn", "qp", "ckv", "kpe"))
    with pytest.raises(ValueError, match="q_pe must have shape"):
        w.run(qn, qp[:, :8], ckv, kpe)
    with pytest.raises(ValueError, match="kpe_cache must have shape"):
        w.run(qn, qp, ckv, kpe[:, :, :32])
    with pytest.raises(ValueError, match="ckv_cache must have dtype"):
        w.run(qn, qp, ckv.astype(np.float32), kpe)
    with pytest.raises(ValueError, match="kv_indices must be < num_pages"):
        w.run(qn, qp, ckv[:2], kpe[:2])
    with pytest.raises(ValueError, match="out must be"):
        w.run(qn, qp, ckv, kpe, out=cp.empty((2, 16, 256), np.float16))
    with pytest.raises(ValueError, match="lse must be"):
        w.run(qn, qp, ckv, kpe, lse=cp.empty((2, 16), np.float16))
    w32 = cuattn.BatchMLAPagedAttentionWrapper()
    w32.plan(c["qo_indptr"], c["kv_indptr"], c["kv_indices"], c["kv_len"], 16, CKV, KPE, 16, False, SCALE,
             "float32", "float32")
    with pytest.raises(UnsupportedError, match=r"kv_data_type q_data_type's \(float32 q: float16 or bfloat16\)"):
        w32.run(qn.astype(np.float32), qp.astype(np.float32), ckv.astype(np.float32), kpe.astype(np.float32))


@pytest.mark.gpu
def test_mla_gpu_append_equals_numpy():
    import cupy as cp
    c = mla_case(4, [1, 1], [40, 9], 16)
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


def test_vectorised_oracle_equals_the_loop_oracle():
    for causal, qo, kv in ((False, [1, 1, 2], [30, 0, 17]), (True, [3, 1], [9, 4])):
        c = mla_case(18, qo, kv, 4, heads=4)
        a, sa = oracle_fast(c, causal, 0.05)
        b, sb = mla_oracle(c, causal, 0.05)
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)
        np.testing.assert_array_equal(np.isinf(sa), np.isinf(sb))
        np.testing.assert_allclose(sa[np.isfinite(sa)], sb[np.isfinite(sb)], rtol=1e-12)
