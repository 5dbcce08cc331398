"""FP8 KV caches (issue 22, decode half): e4m3 / e5m2 caches with k_scale / v_scale in batch and single
decode (both decode kernels), saturating fp8 appends, and the NumPy path of both. The oracle is
float64 attention over the fp8-rounded K/V times their scales (tests/oracle.py)."""
import ml_dtypes
import numpy as np
import pytest

import cuattn
from cuattn import decode, fp8, jit, page
from cuattn.errors import UnsupportedError
from tests.oracle import dense_attention, rel_err

BF16 = np.dtype(ml_dtypes.bfloat16)
E4M3, E5M2 = np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e5m2)
FP8 = {"e4m3": E4M3, "e5m2": E5M2}
QDT = {"float16": np.dtype(np.float16), "bfloat16": BF16}
TOL = 1e-2          # ||out - ref|| / ||ref||: the K/V are exact; q (f16) and P round
LSE_TOL = 1e-3


def make_fp8_case(batch, kv_len, page_size, hq, hkv, head_dim, kv, q_dtype, scale_kind, seed=0, layout="NHD"):
    """Random fp8 cache (random page order), page table, scales and q; per request the real K/V
    (fp8 values times scales, float64) for the oracle."""
    rng = np.random.default_rng(seed)
    pages = -(-kv_len // page_size)
    num_pages = batch * pages + 2
    perm = rng.permutation(num_pages).astype(np.int32)
    indptr = (np.arange(batch + 1) * pages).astype(np.int32)
    indices = perm[:indptr[-1]]
    lpl = np.full(batch, kv_len - (pages - 1) * page_size, np.int32)
    if scale_kind == "tensor":
        k_scale, v_scale = 0.37, 1.9
        ks, vs = np.full(hkv, 0.37), np.full(hkv, 1.9)
    else:
        ks, vs = rng.uniform(0.1, 2.0, hkv).astype(np.float32), rng.uniform(0.1, 2.0, hkv).astype(np.float32)
        k_scale, v_scale = ks, vs
    k = (rng.standard_normal((num_pages, page_size, hkv, head_dim)) * 3).astype(FP8[kv])
    v = (rng.standard_normal((num_pages, page_size, hkv, head_dim)) * 3).astype(FP8[kv])
    q = rng.standard_normal((batch, hq, head_dim)).astype(QDT[q_dtype])
    # slots no request owns hold NaN bits (0x7f in both formats): the kernels must not read them into P V
    owned = np.zeros((num_pages, page_size), bool)
    for p_i, page_id in enumerate(indices):
        owned[page_id, :min(page_size, kv_len - (p_i % pages) * page_size)] = True
    k.view(np.uint8)[~owned] = 0x7f
    v.view(np.uint8)[~owned] = 0x7f
    real = []
    for b in range(batch):
        idx = indices[indptr[b]:indptr[b + 1]]
        kr = k[idx].reshape(-1, hkv, head_dim)[:kv_len].astype(np.float64) * np.asarray(ks, np.float64)[:, None]
        vr = v[idx].reshape(-1, hkv, head_dim)[:kv_len].astype(np.float64) * np.asarray(vs, np.float64)[:, None]
        real.append((kr, vr))
    if layout == "HND":
        k, v = k.transpose(0, 2, 1, 3).copy(), v.transpose(0, 2, 1, 3).copy()
    return dict(q=q, k=k, v=v, indptr=indptr, indices=indices, lpl=lpl, k_scale=k_scale, v_scale=v_scale, real=real)


def fp8_oracle(case):
    outs, lses = [], []
    for b, (k, v) in enumerate(case["real"]):
        o, s = dense_attention(case["q"][b:b + 1].astype(np.float64), k, v)
        outs.append(o[0])
        lses.append(s[0])
    return np.stack(outs), np.stack(lses)


def plan_fp8(case, hq, hkv, d, ps, kv, q_dtype, layout="NHD", tma=None):
    w = cuattn.BatchDecodeWithPagedKVCacheWrapper(kv_layout=layout)
    if tma is not None:
        w._tuning["tma"] = tma
    w.plan(case["indptr"], case["indices"], case["lpl"], hq, hkv, d, ps, q_data_type=q_dtype,
           kv_data_type=FP8[kv])
    return w


# ---------------------------------------------------------------------------- CPU path

CPU_CASES = [  # (batch, kv_len, page_size, hq, hkv, head_dim, kv, q dtype, scale kind, layout)
    (2, 37, 5, 8, 2, 64, "e4m3", "float16", "tensor", "NHD"),
    (3, 100, 16, 16, 4, 128, "e5m2", "bfloat16", "head", "HND"),
    (1, 9, 1, 4, 4, 64, "e4m3", "bfloat16", "head", "NHD"),
]


@pytest.mark.parametrize("case_args", CPU_CASES, ids=["-".join(map(str, c)) for c in CPU_CASES])
def test_fp8_batch_decode_numpy_path_matches_float64_oracle(case_args):
    b, n, ps, hq, hkv, d, kv, qdt, sk, layout = case_args
    case = make_fp8_case(b, n, ps, hq, hkv, d, kv, qdt, sk, seed=n, layout=layout)
    w = plan_fp8(case, hq, hkv, d, ps, kv, qdt, layout)
    out, lse = w.run(case["q"], (case["k"], case["v"]), k_scale=case["k_scale"], v_scale=case["v_scale"],
                     return_lse=True)
    ref_o, ref_lse = fp8_oracle(case)
    assert out.dtype == QDT[qdt]
    assert rel_err(out.astype(np.float64), ref_o) < TOL
    assert rel_err(lse, ref_lse) < LSE_TOL
    # a uint8 cache is read as the plan's kv_data_type
    out_raw = w.run(case["q"], (case["k"].view(np.uint8), case["v"].view(np.uint8)), k_scale=case["k_scale"],
                    v_scale=case["v_scale"])
    np.testing.assert_array_equal(out_raw.view(np.uint16), out.view(np.uint16))


def test_fp8_single_decode_numpy_path_matches_float64_oracle():
    case = make_fp8_case(1, 50, 50, 8, 2, 64, "e5m2", "float16", "head", seed=3)
    k = case["k"][case["indices"][0]]
    v = case["v"][case["indices"][0]]
    out = cuattn.single_decode_with_kv_cache(case["q"][0], k, v, k_scale=case["k_scale"], v_scale=case["v_scale"])
    ref_o, _ = fp8_oracle(case)
    assert rel_err(out.astype(np.float64), ref_o[0]) < TOL


@pytest.mark.parametrize("kv", ["e4m3", "e5m2"])
def test_fp8_quantize_saturates_at_max_finite(kv):
    m = fp8.MAX_FINITE[FP8[kv]]
    x = np.array([[[m, -m, m * 1.01, -m * 1.01, 1e30, -1e30, np.inf, -np.inf]]], np.float32)
    y = fp8.quantize(x, FP8[kv], np.ones(1, np.float32), 1)
    assert y.dtype == FP8[kv]
    np.testing.assert_array_equal(y.astype(np.float32)[0, 0], [m, -m, m, -m, m, -m, m, -m])
    # with a scale: 2 * max / 2 is max, 3 * max / 2 saturates
    y = fp8.quantize(np.array([[[2 * m, 3 * m, -3 * m]]], np.float32), FP8[kv], np.full(1, 2, np.float32), 1)
    np.testing.assert_array_equal(y.astype(np.float32)[0, 0], [m, m, -m])


@pytest.mark.parametrize("kv", ["float8_e4m3fn", "float8_e5m2"])
def test_fp8_paged_kv_cache_append_numpy_path_stores_scaled_values(kv):
    rng = np.random.default_rng(1)
    cache = cuattn.PagedKVCache(1, 2, 64, 4, 8, dtype=kv)
    batch = cache.reserve([cache.add_sequence(), cache.add_sequence()], [5, 3])
    keys = (rng.standard_normal((8, 2, 64)) * 1000).astype(np.float16)
    vals = (rng.standard_normal((8, 2, 64))).astype(np.float16)
    ks = np.array([0.5, 4.0], np.float32)
    cache.append(0, keys, vals, batch, k_scale=ks, v_scale=0.01)
    dt = np.dtype(cuattn.arrays.as_dtype(kv, "kv", "test"))
    want_k = np.clip(keys.astype(np.float32) / ks[None, :, None], -fp8.MAX_FINITE[dt], fp8.MAX_FINITE[dt]).astype(dt)
    want_v = (vals.astype(np.float32) / np.float32(0.01)).astype(dt)
    k_pages, v_pages = cache.layer(0)[:, 0], cache.layer(0)[:, 1]
    pages = batch.kv_indices[batch.kv_indptr[batch.batch_indices] + batch.positions // 4]
    got_k = k_pages[pages, batch.positions % 4]
    np.testing.assert_array_equal(got_k.view(np.uint8), want_k.view(np.uint8))
    np.testing.assert_array_equal(v_pages[pages, batch.positions % 4].view(np.uint8), want_v.view(np.uint8))
    assert np.isfinite(got_k.astype(np.float32)).all()


@pytest.mark.parametrize("arg,value,match", [
    ("k_scale", -1.0, "k_scale must be a positive"), ("k_scale", 0.0, "k_scale must be a positive"),
    ("v_scale", float("nan"), "v_scale must be a positive"), ("k_scale", np.ones(3, np.float32), "k_scale must be"),
    ("v_scale", np.array([1.0, -2.0], np.float32), "v_scale must be positive"),
    ("k_scale", np.zeros((2, 1), np.float32), "k_scale must be")])
def test_fp8_run_rejects_bad_scales(arg, value, match):
    case = make_fp8_case(1, 20, 16, 4, 2, 64, "e4m3", "float16", "tensor")
    w = plan_fp8(case, 4, 2, 64, 16, "e4m3", "float16")
    with pytest.raises(ValueError, match=match):
        w.run(case["q"], (case["k"], case["v"]), **{arg: value})
    with pytest.raises(ValueError, match=match):
        cuattn.single_decode_with_kv_cache(case["q"][0], case["k"][0], case["v"][0], **{arg: value})


def test_fp8_append_rejects_bad_scales():
    cache = cuattn.PagedKVCache(1, 2, 64, 4, 8, dtype="float8_e4m3fn")
    batch = cache.reserve([cache.add_sequence()], [3])
    x = np.ones((3, 2, 64), np.float16)
    with pytest.raises(ValueError, match="v_scale must be a positive"):
        cache.append(0, x, x, batch, k_scale=1.0, v_scale=0.0)
    with pytest.raises(ValueError, match="k_scale must be"):
        cache.append(0, x, x, batch, k_scale=np.ones(5, np.float32))


def test_fp8_fused_rope_is_refused_with_a_clear_message():
    w = cuattn.BatchPrefillWithPagedKVCacheWrapper()     # fp8 prefill itself: tests/test_prefill_fp8.py
    with pytest.raises(UnsupportedError, match="16-bit KV cache"):
        w.plan(np.array([0, 4], np.int32), np.array([0, 1], np.int32), np.array([0], np.int32),
               np.array([4], np.int32), 4, 4, 64, 16, q_data_type="float16", kv_data_type="float8_e4m3fn",
               pos_encoding_mode="ROPE_LLAMA")
    d = cuattn.BatchDecodeWithPagedKVCacheWrapper()
    with pytest.raises(UnsupportedError, match="16-bit KV cache"):
        d.plan(np.array([0, 1], np.int32), np.array([0], np.int32), np.array([4], np.int32), 4, 4, 64, 16,
               pos_encoding_mode="ROPE_LLAMA", kv_data_type="float8_e5m2")


@pytest.mark.parametrize("arch", jit.SHIPPED_ARCHS)
def test_fp8_shipped_specs_cover_both_formats_and_compile_without_spills(arch):
    specs = [s for s in decode.shipped_specs() if s.dtype_kv in ("e4m3", "e5m2")]
    assert {(s.head_dim, s.dtype_kv, s.tma) for s in specs} >= {(d, kv, t) for d in (64, 128, 256)
                                                                  for kv in ("e4m3", "e5m2") for t in (False, True)}
    for spec in [s for s in page.shipped_specs() if isinstance(s, page.PageFp8Spec)]:
        r = jit.compile_kernel(spec, arch).resources["cuattn_page_append_fp8"]
        assert r["spill_stores"] == r["spill_loads"] == r["stack_frame"] == 0, (spec.name, r)
    # the decode specs themselves: tests/test_decode.py::test_shipped_decode_kernels_compile_without_spills


# ---------------------------------------------------------------------------- GPU

# (batch, kv_len, page_size, hq, hkv, head_dim, kv, q dtype, scale kind, layout): page sizes 1 and 16,
# GQA 1 and 4, head_dim 64 / 128 / 256, per-tensor and per-head scales
GPU_CASES = [
    (3, 777, 16, 32, 8, 128, "e4m3", "float16", "tensor", "NHD"),
    (5, 300, 16, 8, 8, 64, "e5m2", "bfloat16", "head", "HND"),
    (2, 97, 1, 16, 4, 256, "e4m3", "bfloat16", "head", "NHD"),
    (7, 1500, 16, 8, 2, 256, "e5m2", "float16", "tensor", "NHD"),
    (1, 4097, 1, 4, 4, 128, "e5m2", "float16", "head", "HND"),
    (4, 2048, 16, 16, 4, 64, "e4m3", "float16", "head", "NHD"),
    (1, 16384, 16, 32, 8, 128, "e4m3", "bfloat16", "tensor", "NHD"),   # split-KV
]


def _cupy_fp8(x):
    import cupy
    return cupy.asarray(x.view(np.uint8))


def _scale_arg(x, device):
    if isinstance(x, float) or not device:
        return x
    import cupy
    return cupy.asarray(np.asarray(x, np.float32))


@pytest.mark.gpu
@pytest.mark.parametrize("tma", [False, True], ids=["cp_async", "tma"])
@pytest.mark.parametrize("case_args", GPU_CASES, ids=["-".join(map(str, c)) for c in GPU_CASES])
def test_fp8_batch_decode_gpu_matches_float64_oracle(case_args, tma):
    import cupy
    b, n, ps, hq, hkv, d, kv, qdt, sk, layout = case_args
    if tma and (jit.device_arch(0) != "sm_90a" or ps % 16):
        pytest.skip("the TMA kernel needs sm_90 and page_size % 16 == 0")
    case = make_fp8_case(b, n, ps, hq, hkv, d, kv, qdt, sk, seed=n + d, layout=layout)
    w = plan_fp8(case, hq, hkv, d, ps, kv, qdt, layout, tma=tma)
    assert w._spec.tma == tma and w._spec.dtype_kv == kv
    q = cupy.asarray(case["q"].view(np.uint16) if qdt == "bfloat16" else case["q"])    # CuPy: bf16 as uint16
    out = cupy.full((b, hq, d), 0x7fc0, np.uint16) if qdt == "bfloat16" else cupy.full((b, hq, d), np.nan, np.float16)
    lse = cupy.full((b, hq), np.nan, np.float32)
    dev = sk == "head"
    res = w.run(q, (_cupy_fp8(case["k"]), _cupy_fp8(case["v"])), out=out, lse=lse,
                k_scale=_scale_arg(case["k_scale"], dev), v_scale=_scale_arg(case["v_scale"], dev))
    assert res is out
    o = cupy.asnumpy(out).view(QDT[qdt]).astype(np.float64)                   # out was NaN-poisoned
    ref_o, ref_lse = fp8_oracle(case)
    assert np.isfinite(o).all()
    assert rel_err(o, ref_o) < TOL
    assert rel_err(cupy.asnumpy(lse), ref_lse) < LSE_TOL
    # host per-head scales (NumPy) give the same output as device ones
    if dev:
        o2 = w.run(q, (_cupy_fp8(case["k"]), _cupy_fp8(case["v"])), k_scale=case["k_scale"],
                   v_scale=case["v_scale"])
        np.testing.assert_array_equal(cupy.asnumpy(o2), cupy.asnumpy(out))


@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["e4m3", "e5m2"])
def test_fp8_single_decode_gpu_torch_float8_in_torch_out(kv):
    torch = pytest.importorskip("torch")
    case = make_fp8_case(1, 333, 333, 32, 8, 128, kv, "bfloat16", "tensor", seed=5)
    tdt = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}[kv]
    page_id = case["indices"][0]
    k = torch.from_numpy(case["k"][page_id].view(np.uint8).copy()).cuda().view(tdt)
    v = torch.from_numpy(case["v"][page_id].view(np.uint8).copy()).cuda().view(tdt)
    q = torch.from_numpy(case["q"][0].view(np.int16).copy()).cuda().view(torch.bfloat16)
    out = cuattn.single_decode_with_kv_cache(q, k, v, k_scale=case["k_scale"], v_scale=case["v_scale"])
    assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16 and out.is_cuda
    ref_o, _ = fp8_oracle(case)
    assert rel_err(out.float().cpu().numpy().astype(np.float64), ref_o[0]) < TOL
    # the batch wrapper takes a torch float8 paged cache as it is
    w = plan_fp8(case, 32, 8, 128, 333, kv, "bfloat16")
    kp = torch.from_numpy(case["k"].view(np.uint8).copy()).cuda()
    vp = torch.from_numpy(case["v"].view(np.uint8).copy()).cuda()
    out_b = w.run(q[None], torch.stack([kp, vp], dim=1).view(tdt), k_scale=case["k_scale"], v_scale=case["v_scale"])
    assert isinstance(out_b, torch.Tensor)
    assert rel_err(out_b.float().cpu().numpy()[0].astype(np.float64), ref_o[0]) < TOL


@pytest.mark.gpu
@pytest.mark.parametrize("in_dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("kv", ["float8_e4m3fn", "float8_e5m2"])
def test_fp8_append_gpu_equals_numpy_path_bit_for_bit(kv, in_dtype):
    import cupy
    rng = np.random.default_rng(7)
    heads, d, ps = 4, 128, 16
    caches = [cuattn.PagedKVCache(1, heads, d, ps, 40, dtype=kv, device=dev) for dev in ("cpu", "cuda")]
    batches = []
    for c in caches:
        seqs = [c.add_sequence() for _ in range(3)]
        batches.append(c.reserve(seqs, [100, 1, 77]))
    mag = np.exp(rng.uniform(-20, 12, (178, heads, d)))          # fp8 subnormals .. beyond max finite (f16: inf)
    keys = (rng.choice([-1, 1], mag.shape) * mag).astype(QDT[in_dtype])
    vals = (rng.standard_normal((178, heads, d)) * 300).astype(QDT[in_dtype])
    ks = rng.uniform(0.05, 3, heads).astype(np.float32)
    caches[0].append(0, keys, vals, batches[0], k_scale=ks, v_scale=0.7)
    dev = (lambda x: cupy.asarray(x.view(np.uint16))) if in_dtype == "bfloat16" else cupy.asarray   # CuPy: bf16 as uint16
    caches[1].append(0, dev(keys), dev(vals), batches[1], k_scale=cupy.asarray(ks), v_scale=0.7)
    host = caches[0].layer(0).view(np.uint8)
    gpu = cupy.asnumpy(caches[1].layer(0))
    np.testing.assert_array_equal(gpu, host)
    assert np.isfinite(caches[0].layer(0).astype(np.float32)).all()
