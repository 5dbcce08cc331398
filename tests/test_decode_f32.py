"""fp32 KV caches in decode (issue 22): an fp32 paged cache with an fp16 / bf16 q, in batch and single
decode, the NumPy path and the GPU kernel (K/V fp32 in shared memory, rounded to q's type in the
fragments). The oracle is float64 attention over the fp32 K/V (tests/oracle.py)."""
import ml_dtypes
import numpy as np
import pytest

import cuattn
from cuattn import decode, jit
from cuattn.errors import UnsupportedError
from tests.gpu_arrays import from_gpu, nan_like, to_gpu
from tests.oracle import dense_attention, rel_err

QDT = {"float16": np.dtype(np.float16), "bfloat16": np.dtype(ml_dtypes.bfloat16)}
TOL = 1e-2          # K/V round to q's type in the tensor cores


def make_case(batch, kv_len, page_size, hq, hkv, d, q_dtype, seed, layout="NHD"):
    """Random fp32 cache (random page order; slots no request owns hold NaN), page table and q."""
    rng = np.random.default_rng(seed)
    pages = -(-kv_len // page_size)
    num_pages = batch * pages + 2
    indices = rng.permutation(num_pages).astype(np.int32)[:batch * pages]
    indptr = (np.arange(batch + 1) * pages).astype(np.int32)
    lpl = np.full(batch, kv_len - (pages - 1) * page_size, np.int32)
    k = np.full((num_pages, page_size, hkv, d), np.nan, np.float32)
    v = np.full_like(k, np.nan)
    real = []
    for b in range(batch):
        kr, vr = rng.standard_normal((2, kv_len, hkv, d)).astype(np.float32) * 2
        flat_k = k[indices[indptr[b]:indptr[b + 1]]].reshape(-1, hkv, d)
        flat_v = v[indices[indptr[b]:indptr[b + 1]]].reshape(-1, hkv, d)
        flat_k[:kv_len], flat_v[:kv_len] = kr, vr
        k[indices[indptr[b]:indptr[b + 1]]] = flat_k.reshape(pages, page_size, hkv, d)
        v[indices[indptr[b]:indptr[b + 1]]] = flat_v.reshape(pages, page_size, hkv, d)
        real.append((kr, vr))
    q = rng.standard_normal((batch, hq, d)).astype(QDT[q_dtype])
    if layout == "HND":
        k, v = k.transpose(0, 2, 1, 3).copy(), v.transpose(0, 2, 1, 3).copy()
    return dict(q=q, k=k, v=v, indptr=indptr, indices=indices, lpl=lpl, real=real)


def oracle(case):
    res = [dense_attention(case["q"][b:b + 1], k, v) for b, (k, v) in enumerate(case["real"])]
    return np.concatenate([o for o, _ in res]), np.concatenate([s for _, s in res])


def plan(case, hq, hkv, d, ps, q_dtype, layout="NHD", **kw):
    w = cuattn.BatchDecodeWithPagedKVCacheWrapper(kv_layout=layout)
    w.plan(case["indptr"], case["indices"], case["lpl"], hq, hkv, d, ps, q_data_type=q_dtype,
           kv_data_type="float32", **kw)
    return w


def test_f32_batch_decode_numpy_path_matches_float64_oracle():
    case = make_case(3, 37, 5, 8, 2, 64, "bfloat16", seed=1)
    w = plan(case, 8, 2, 64, 5, "bfloat16")
    out, lse = w.run(case["q"], (case["k"], case["v"]), return_lse=True)
    ref_o, ref_lse = oracle(case)
    assert out.dtype == QDT["bfloat16"]
    assert rel_err(out.astype(np.float64), ref_o) < TOL
    assert rel_err(lse, ref_lse) < 1e-3


def test_f32_cache_refuses_fused_rope_and_a_cache_of_another_dtype():
    case = make_case(1, 20, 16, 4, 4, 64, "float16", seed=2)
    with pytest.raises(UnsupportedError, match="need a 16-bit KV cache, got kv_data_type=float32"):
        plan(case, 4, 4, 64, 16, "float16", pos_encoding_mode="ROPE_LLAMA")
    w = plan(case, 4, 4, 64, 16, "float16")
    with pytest.raises(ValueError, match="paged_kv_cache must have dtype float32"):
        w.run(case["q"], (case["k"].astype(np.float16), case["v"].astype(np.float16)))


@pytest.mark.parametrize("arch", jit.SHIPPED_ARCHS)
def test_f32_decode_specs_compile_without_spills(arch):
    specs = [decode.DecodeSpec(d, q, "f32", num_warps=decode.F32_WARPS[d]) for d in (64, 128, 256)
             for q in ("f16", "bf16")]
    for s in specs:
        assert s.smem_bytes <= 163 * 1024, (s.name, s.smem_bytes)      # sm_80's limit
        r = jit.compile_kernel(s, arch).resources["cuattn_decode_paged"]
        assert r["spill_stores"] == r["spill_loads"] == r["stack_frame"] == 0, (s.name, r)


# ---------------------------------------------------------------------------- GPU

GPU_CASES = [  # (batch, kv_len, page_size, hq, hkv, head_dim, q dtype, layout)
    (3, 777, 16, 32, 8, 128, "float16", "NHD"),
    (5, 300, 1, 8, 8, 64, "bfloat16", "HND"),
    (2, 1000, 16, 16, 4, 256, "bfloat16", "NHD"),
    (1, 9000, 16, 32, 8, 128, "bfloat16", "NHD"),     # split-KV
]


@pytest.mark.gpu
@pytest.mark.parametrize("case_args", GPU_CASES, ids=["-".join(map(str, c)) for c in GPU_CASES])
def test_f32_batch_decode_gpu_matches_float64_oracle(case_args):
    b, n, ps, hq, hkv, d, qdt, layout = case_args
    case = make_case(b, n, ps, hq, hkv, d, qdt, seed=n + d, layout=layout)
    w = plan(case, hq, hkv, d, ps, qdt, layout)
    assert w._spec.dtype_kv == "f32" and not w._spec.tma
    out, lse = nan_like((b, hq, d), QDT[qdt]), nan_like((b, hq), np.float32)
    res = w.run(to_gpu(case["q"]), (to_gpu(case["k"]), to_gpu(case["v"])), out=out, lse=lse)
    assert res is out
    o = from_gpu(out, QDT[qdt]).astype(np.float64)
    ref_o, ref_lse = oracle(case)
    assert rel_err(o, ref_o) < TOL
    assert rel_err(from_gpu(lse, np.float32), ref_lse) < 1e-3


@pytest.mark.gpu
def test_f32_single_decode_gpu_torch_in_torch_out():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(3)
    q = rng.standard_normal((32, 128)).astype(np.float16)
    k, v = rng.standard_normal((2, 500, 8, 128)).astype(np.float32)
    out = cuattn.single_decode_with_kv_cache(torch.from_numpy(q).cuda(), torch.from_numpy(k).cuda(),
                                             torch.from_numpy(v).cuda())
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float16
    ref, _ = dense_attention(q[None], k, v)
    assert rel_err(out.cpu().numpy().astype(np.float64), ref[0]) < TOL


# ============================================================================ fp32 q (issue 22)
# An fp32 q runs the 16-bit kernels (cuattn/qcast.py): converted on the GPU to bf16 for a bf16 cache, else
# to f16 saturating at +-65504, the output converted back to fp32. The NumPy path computes with the fp32 q.

KV_F32Q = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16), "bfloat16": QDT["bfloat16"]}


def f32q_case(batch, kv_len, page_size, hq, hkv, d, kv_dtype, seed, layout="NHD"):
    """make_case with an fp32 q (scaled past 1, so rounding it to 16 bits shows) and a cache of ``kv_dtype``
    (the real K/V are the stored values: the oracle reads them back)."""
    case = make_case(batch, kv_len, page_size, hq, hkv, d, "float16", seed, layout)
    rng = np.random.default_rng(seed + 1)
    case["q"] = (rng.standard_normal((batch, hq, d)) * 3).astype(np.float32)
    dt = KV_F32Q[kv_dtype]
    case["k"], case["v"] = case["k"].astype(dt), case["v"].astype(dt)
    case["real"] = [(k.astype(dt), v.astype(dt)) for k, v in case["real"]]
    return case


def plan_f32q(case, hq, hkv, d, ps, kv_dtype, layout="NHD", use_cuda_graph=False, **kw):
    w = cuattn.BatchDecodeWithPagedKVCacheWrapper(kv_layout=layout, use_cuda_graph=use_cuda_graph)
    w.plan(case["indptr"], case["indices"], case["lpl"], hq, hkv, d, ps, q_data_type="float32",
           kv_data_type=kv_dtype, **kw)
    return w


def test_f32_q_compute_type_is_bf16_for_a_bf16_cache_else_f16():
    from cuattn import qcast
    want = {"float16": "f16", "bfloat16": "bf16", "float32": "f16", "float8_e4m3fn": "f16", "float8_e5m2": "f16"}
    for kv, short in want.items():
        w = cuattn.BatchDecodeWithPagedKVCacheWrapper()
        w.plan(np.array([0, 1], np.int32), np.zeros(1, np.int32), np.array([3], np.int32), 8, 2, 128, 16,
               q_data_type="float32", kv_data_type=kv)
        assert w._spec.dtype_q == short, (kv, w._spec.name)
        assert w._plan.q_dtype == np.float32        # what run() checks q and out against
    assert qcast.kernel_dtype(np.float32, QDT["bfloat16"]) == QDT["bfloat16"]
    assert qcast.kernel_dtype(np.float32, np.float32) == np.float16
    assert qcast.kernel_dtype(QDT["bfloat16"], np.float32) == QDT["bfloat16"]      # a 16-bit q is its own


@pytest.mark.parametrize("kv_dtype", ["float32", "float16", "bfloat16"])
def test_f32_q_batch_decode_numpy_path_matches_float64_oracle(kv_dtype):
    case = f32q_case(3, 37, 5, 8, 2, 64, kv_dtype, seed=11)
    w = plan_f32q(case, 8, 2, 64, 5, kv_dtype)
    out, lse = np.full((3, 8, 64), np.nan, np.float32), np.full((3, 8), np.nan, np.float32)
    res = w.run(case["q"], (case["k"], case["v"]), out=out, lse=lse, return_lse=True)
    assert res[0] is out and res[1] is lse
    ref_o, ref_lse = oracle(case)
    assert out.dtype == np.float32
    assert rel_err(out, ref_o) < 1e-5           # float32 arithmetic on the exact q: no 16-bit rounding
    assert rel_err(lse, ref_lse) < 1e-6
    single = cuattn.single_decode_with_kv_cache(case["q"][1], *case["real"][1])
    assert single.dtype == np.float32 and rel_err(single, ref_o[1]) < 1e-5


@pytest.mark.parametrize("opts", [dict(logits_soft_cap=7.0), dict(pos_encoding_mode="ALIBI"), dict(window_left=9),
                                  dict(sinks=True)], ids=["softcap", "alibi", "window", "sinks"])
def test_f32_q_decode_variants_numpy_path_match_float64_oracle(opts):
    from tests.oracle import variant_attention
    case = f32q_case(2, 30, 8, 8, 2, 64, "float16", seed=12)
    sinks = np.random.default_rng(3).standard_normal(8).astype(np.float32) if opts.get("sinks") else None
    w = plan_f32q(case, 8, 2, 64, 8, "float16", **{k: v for k, v in opts.items() if k != "sinks"})
    out, lse = w.run(case["q"], (case["k"], case["v"]), return_lse=True, sinks=sinks)
    for b, (k, v) in enumerate(case["real"]):
        ro, rs = variant_attention(case["q"][b:b + 1], k, v, soft_cap=opts.get("logits_soft_cap"),
                                   window_left=opts.get("window_left", -1),
                                   alibi=opts.get("pos_encoding_mode") == "ALIBI", sinks=sinks)
        assert rel_err(out[b:b + 1], ro) < 1e-5 and rel_err(lse[b:b + 1], rs) < 1e-5


def test_f32_q_decode_run_refuses_a_q_or_out_of_another_dtype():
    case = f32q_case(2, 20, 16, 4, 4, 64, "float16", seed=13)
    w = plan_f32q(case, 4, 4, 64, 16, "float16")
    cache = (case["k"], case["v"])
    with pytest.raises(ValueError, match="q must have dtype float32"):
        w.run(case["q"].astype(np.float16), cache)
    with pytest.raises(ValueError, match="out must have shape .* and dtype float32"):
        w.run(case["q"], cache, out=np.empty((2, 4, 64), np.float16))
    w16 = plan(case, 4, 4, 64, 16, "float16")
    with pytest.raises(ValueError, match="q must have dtype float16"):
        w16.run(case["q"], (case["k"].astype(np.float32), case["v"].astype(np.float32)))
    with pytest.raises(UnsupportedError, match="need a 16-bit KV cache"):      # as for a 16-bit q
        plan_f32q(case, 4, 4, 64, 16, "float32", pos_encoding_mode="ROPE_LLAMA")


@pytest.mark.parametrize("arch", jit.SHIPPED_ARCHS)
def test_f32_q_conversion_kernels_compile_without_spills(arch):
    from cuattn import qcast
    for spec in qcast.shipped_specs():
        for entry, r in jit.compile_kernel(spec, arch).resources.items():
            assert r["spill_stores"] == r["spill_loads"] == r["stack_frame"] == 0, (spec.name, entry, r)


F32Q_GPU = [  # (batch, kv_len, page_size, hq, hkv, head_dim, kv dtype, layout)
    (3, 777, 16, 32, 8, 128, "float32", "NHD"),
    (5, 300, 1, 8, 8, 64, "float16", "HND"),
    (2, 1000, 16, 16, 4, 128, "bfloat16", "NHD"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case_args", F32Q_GPU, ids=["-".join(map(str, c)) for c in F32Q_GPU])
def test_f32_q_batch_decode_gpu_matches_float64_oracle(case_args):
    import cupy
    b, n, ps, hq, hkv, d, kv_dtype, layout = case_args
    case = f32q_case(b, n, ps, hq, hkv, d, kv_dtype, seed=n + d, layout=layout)
    w = plan_f32q(case, hq, hkv, d, ps, kv_dtype, layout)
    assert w._spec.dtype_q == ("bf16" if kv_dtype == "bfloat16" else "f16")
    out, lse = nan_like((b, hq, d), np.float32), nan_like((b, hq), np.float32)
    cache = (to_gpu(case["k"]), to_gpu(case["v"]))
    res = w.run(to_gpu(case["q"]), cache, out=out, lse=lse)
    assert res is out and out.dtype == np.float32
    ref_o, ref_lse = oracle(case)
    o = from_gpu(out, np.float32)
    assert np.all(np.isfinite(o)), "unwritten or non-finite output"
    assert rel_err(o, ref_o) < TOL
    assert np.max(np.abs(o - ref_o)) < 4 * TOL * np.max(np.abs(ref_o))      # every element
    assert rel_err(from_gpu(lse, np.float32), ref_lse) < 1e-3
    # a 16-bit q, or an out not of q's dtype, is refused (naming the argument)
    with pytest.raises(ValueError, match="q must have dtype float32"):
        w.run(cupy.asarray(case["q"].astype(np.float16)), cache)
    with pytest.raises(ValueError, match="out must have dtype float32"):
        w.run(to_gpu(case["q"]), cache, out=cupy.empty((b, hq, d), np.float16))


@pytest.mark.gpu
def test_f32_q_gpu_saturates_at_f16_max_and_single_decode_returns_fp32():
    """|q| past 65504 (inf and 65520, the first value that rounds to inf, included) runs as +-65504 (the same
    output as a q clipped there, all finite), not as inf; a NaN in q stays NaN through the conversion (its head's
    row: as the 16-bit kernel gives it for that NaN)."""
    import cupy
    rng = np.random.default_rng(5)
    q = rng.standard_normal((8, 64)).astype(np.float32) * 1e-3
    q[0, :4] = [1e6, -3e38, 70000.0, 65504.0]
    q[1, :3] = [np.inf, -np.inf, 65520.0]
    q[3, 5] = np.nan
    k, v = rng.standard_normal((2, 200, 2, 64)).astype(np.float16) * 1e-3
    big = cuattn.single_decode_with_kv_cache(cupy.asarray(q), cupy.asarray(k), cupy.asarray(v))
    clipped = cuattn.single_decode_with_kv_cache(cupy.asarray(np.clip(q, -65504, 65504)), cupy.asarray(k),
                                                 cupy.asarray(v))
    assert big.dtype == np.float32 and big.shape == (8, 64)
    big, clipped = cupy.asnumpy(big), cupy.asnumpy(clipped)
    # the conversion keeps a NaN a NaN: its row is what the 16-bit kernel gives for the same NaN q (the
    # decode kernel's max ignores NaN logits, so that row comes out as a fully masked one, not as the
    # attention of a finite q that a NaN turned into 0 or 65504 would give)
    q16 = np.clip(q, -65504, 65504).astype(np.float16)
    nan16 = cupy.asnumpy(cuattn.single_decode_with_kv_cache(cupy.asarray(q16), cupy.asarray(k), cupy.asarray(v)))
    np.testing.assert_array_equal(big[3], nan16[3].astype(np.float32))
    q0 = q16.copy()
    q0[3, 5] = 0                                                   # a NaN read as 0 would differ
    zero16 = cupy.asnumpy(cuattn.single_decode_with_kv_cache(cupy.asarray(q0), cupy.asarray(k), cupy.asarray(v)))
    assert not np.array_equal(nan16[3], zero16[3])
    rows = [0, 1, 2, 4, 5, 6, 7]
    assert np.all(np.isfinite(big[rows]))
    np.testing.assert_array_equal(big[rows], clipped[rows])
    q_ref = np.nan_to_num(np.clip(q, -65504, 65504), nan=0.0)      # (row 3 unchecked: GQA needs all 8 heads)
    ref, _ = dense_attention(q_ref.astype(np.float16)[None], k, v)
    assert rel_err(big[rows], ref[0][rows]) < TOL


@pytest.mark.gpu
def test_f32_q_batch_decode_gpu_cuda_graph_replays_after_replan():
    import cupy
    case0 = f32q_case(2, 300, 16, 16, 4, 128, "float16", seed=21)
    w = plan_f32q(case0, 16, 4, 128, 16, "float16", use_cuda_graph=True)
    q = to_gpu(case0["q"])
    k, v = to_gpu(case0["k"]), to_gpu(case0["v"])
    out = nan_like((2, 16, 128), np.float32)
    stream = cupy.cuda.Stream(non_blocking=True)
    cupy.cuda.Device().synchronize()
    with stream:
        w.plan(case0["indptr"], case0["indices"], case0["lpl"], 16, 4, 128, 16, q_data_type="float32",
               kv_data_type="float16")
        w.run(q, (k, v), out=out)            # warm-up
        out.fill(np.nan)
        stream.begin_capture()
        w.run(q, (k, v), out=out)
        graph = stream.end_capture()
        graph.launch()
    stream.synchronize()
    assert rel_err(from_gpu(out, np.float32), oracle(case0)[0]) < TOL
    # new lengths and contents, same shapes: replan, refill q / cache / out, replay
    case1 = f32q_case(2, 301, 16, 16, 4, 128, "float16", seed=22)
    with stream:
        w.plan(case1["indptr"], case1["indices"], case1["lpl"], 16, 4, 128, 16, q_data_type="float32",
               kv_data_type="float16")
        q[...] = to_gpu(case1["q"])
        k[...], v[...] = to_gpu(case1["k"]), to_gpu(case1["v"])
        out.fill(np.nan)
        graph.launch()
    stream.synchronize()
    o = from_gpu(out, np.float32)
    assert np.all(np.isfinite(o)) and rel_err(o, oracle(case1)[0]) < TOL
