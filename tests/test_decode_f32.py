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
