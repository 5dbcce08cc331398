"""What the prefill K/V dtype tests share (tests/test_prefill_fp8.py, test_prefill_f32.py,
test_prefill_split_head_dims.py; tests/test_prefill_sm90.py and test_f32_kv_saturation.py import some too): fp8
K/V cases with their k_scale / v_scale and real (dequantised) values, the float64 oracle per request, the device
round trips and the GPU output check, and a contiguous K or V laid out as pages."""
import ml_dtypes
import numpy as np

from tests.oracle import dense_attention, rel_err

BF16 = np.dtype(ml_dtypes.bfloat16)
FP8 = {"e4m3": np.dtype(ml_dtypes.float8_e4m3fn), "e5m2": np.dtype(ml_dtypes.float8_e5m2)}
FP8_NAME = {"e4m3": "float8_e4m3fn", "e5m2": "float8_e5m2"}
QDT = {"float16": np.dtype(np.float16), "bfloat16": BF16}
TOL = 1e-2          # ||out - ref|| / ||ref||: K/V exact once dequantised; q (as f16), P and out round
LSE_TOL = 1e-3


def _scales(rng, kind, hkv):
    """(k_scale, v_scale) as passed (host values; the GPU tests move arrays to the device) and their
    per-head float64 factors."""
    if kind == "tensor":
        return (0.37, 1.9), (np.full(hkv, 0.37), np.full(hkv, 1.9))
    if kind == "one":
        return (np.array([0.61], np.float32), np.array([0.23], np.float32)), (np.full(hkv, 0.61, np.float32),
                                                                              np.full(hkv, 0.23, np.float32))
    ks, vs = rng.uniform(0.1, 2.0, hkv).astype(np.float32), rng.uniform(0.1, 2.0, hkv).astype(np.float32)
    return (ks, vs), (ks, vs)


def _q(rng, rows, hq, d, q_dtype):
    return rng.standard_normal((rows, hq, d)).astype(QDT[q_dtype])


def _fp8(rng, shape, kv):
    return (rng.standard_normal(shape) * 3).astype(FP8[kv])


def _real(x, factors, head_axis=1):
    shape = [1] * x.ndim
    shape[head_axis] = -1
    return x.astype(np.float64) * np.asarray(factors, np.float64).reshape(shape)


def _oracle(q, ks, vs, qo_indptr, causal):
    outs, lses = [], []
    for b in range(len(ks)):
        o, s = dense_attention(q[qo_indptr[b]:qo_indptr[b + 1]], ks[b], vs[b], causal=causal)
        outs.append(o)
        lses.append(s)
    return np.concatenate(outs), np.concatenate(lses)


def paged_fp8_case(qo_lens, kv_lens, page_size, hq, hkv, d, kv, q_dtype, scale_kind, layout="NHD", seed=0):
    """q, a random-order fp8 (k, v) page pair (free slots and pages hold NaN bits), the page table,
    the scales as passed and the float64 oracle's out / lse."""
    rng = np.random.default_rng(seed)
    npages = [-(-n // page_size) for n in kv_lens]
    total = sum(npages) + 2
    perm = rng.permutation(total).astype(np.int32)[:sum(npages)]
    indptr = np.concatenate([[0], np.cumsum(npages)]).astype(np.int32)
    last = np.array([n - (p - 1) * page_size if p else 0 for n, p in zip(kv_lens, npages)], np.int32)
    k = np.full((total, page_size, hkv, d), 0x7F, np.uint8).view(FP8[kv])     # NaN bits in both formats
    v = k.copy()
    for b, n in enumerate(kv_lens):   # the owned slots: real values
        flat_k, flat_v = _fp8(rng, (n, hkv, d), kv), _fp8(rng, (n, hkv, d), kv)
        for i, p in enumerate(perm[indptr[b]:indptr[b + 1]]):
            m = min(page_size, n - i * page_size)
            k[p, :m], v[p, :m] = flat_k[i * page_size:i * page_size + m], flat_v[i * page_size:i * page_size + m]
    passed, factors = _scales(rng, scale_kind, hkv)
    qo_indptr = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
    q = _q(rng, int(qo_indptr[-1]), hq, d, q_dtype)
    ks = [_real(k[perm[indptr[b]:indptr[b + 1]]].reshape(-1, hkv, d)[:n], factors[0]) for b, n in enumerate(kv_lens)]
    vs = [_real(v[perm[indptr[b]:indptr[b + 1]]].reshape(-1, hkv, d)[:n], factors[1]) for b, n in enumerate(kv_lens)]
    if layout == "HND":
        k, v = k.transpose(0, 2, 1, 3).copy(), v.transpose(0, 2, 1, 3).copy()
    return dict(q=q, k=k, v=v, qo_indptr=qo_indptr, indptr=indptr, indices=perm, last=last, scales=passed, ks=ks,
                vs=vs)


def ragged_fp8_case(qo_lens, kv_lens, hq, hkv, d, kv, q_dtype, scale_kind, seed=0):
    rng = np.random.default_rng(seed)
    qo_indptr = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
    kv_indptr = np.concatenate([[0], np.cumsum(kv_lens)]).astype(np.int32)
    k, v = _fp8(rng, (int(kv_indptr[-1]), hkv, d), kv), _fp8(rng, (int(kv_indptr[-1]), hkv, d), kv)
    passed, factors = _scales(rng, scale_kind, hkv)
    q = _q(rng, int(qo_indptr[-1]), hq, d, q_dtype)
    ks = [_real(k[kv_indptr[b]:kv_indptr[b + 1]], factors[0]) for b in range(len(kv_lens))]
    vs = [_real(v[kv_indptr[b]:kv_indptr[b + 1]], factors[1]) for b in range(len(kv_lens))]
    return dict(q=q, k=k, v=v, qo_indptr=qo_indptr, kv_indptr=kv_indptr, scales=passed, ks=ks, vs=vs)


def _cp():
    import cupy
    return cupy


def _dev(x):
    cp = _cp()
    if x.dtype == BF16:
        return cp.asarray(x.view(np.uint16))
    if x.dtype in FP8.values():
        return cp.asarray(x.view(np.uint8))
    return cp.asarray(x)


def _dev_scale(s):
    return s if isinstance(s, float) else _cp().asarray(s)


def _poisoned(shape, q_dtype):
    cp = _cp()
    return cp.full(shape, 0x7FC0, np.uint16) if q_dtype == "bfloat16" else cp.full(shape, np.nan, np.float16)


def _check(out, lse, ref_o, ref_s, q_dtype):
    o = _cp().asnumpy(out)
    o = o.view(BF16) if q_dtype == "bfloat16" else o
    assert np.all(np.isfinite(o.astype(np.float32))), "unwritten or non-finite output"
    assert rel_err(o, ref_o) < TOL
    # every element: within TOL of the reference's largest magnitude
    assert np.max(np.abs(o.astype(np.float64) - ref_o)) < TOL * 4 * np.max(np.abs(ref_o)) + 1e-6
    assert rel_err(_cp().asnumpy(lse), ref_s) < LSE_TOL


def run_paged_fp8_and_check(w, c, hq, d, q_dtype, causal):
    """Run planned paged wrapper ``w`` over ``paged_fp8_case`` ``c`` into poisoned out / LSE (the case's
    scales as device arrays) and check every element against the float64 oracle of the dequantised K / V."""
    rows = int(c["qo_indptr"][-1])
    out, lse = _poisoned((rows, hq, d), q_dtype), _cp().full((rows, hq), np.nan, np.float32)
    w.run(_dev(c["q"]), (_dev(c["k"]), _dev(c["v"])), out=out, lse=lse, k_scale=_dev_scale(c["scales"][0]),
          v_scale=_dev_scale(c["scales"][1]))
    ref_o, ref_s = _oracle(c["q"], c["ks"], c["vs"], c["qo_indptr"], causal)
    _check(out, lse, ref_o, ref_s, q_dtype)


def _ids(cases):
    return ["-".join(str(x).replace(" ", "") for x in c) for c in cases]


def to_pages(x, kv_indptr, page_size, perm_seed=0, layout="NHD"):
    """A contiguous [nnz, heads, d] K or V as a random-order page array (pages past the requests hold
    NaN) and its page table."""
    lens = np.diff(kv_indptr)
    npages = [-(-int(n) // page_size) for n in lens]
    total = sum(npages) + 2
    perm = np.random.default_rng(perm_seed).permutation(total).astype(np.int32)[:sum(npages)]
    indptr = np.concatenate([[0], np.cumsum(npages)]).astype(np.int32)
    last = np.array([int(n) - (p - 1) * page_size for n, p in zip(lens, npages)], np.int32)
    pages = np.full((total, page_size) + x.shape[1:], np.nan, np.float32).astype(x.dtype)
    for b, n in enumerate(lens):
        for i, p in enumerate(perm[indptr[b]:indptr[b + 1]]):
            m = min(page_size, int(n) - i * page_size)
            pages[p, :m] = x[kv_indptr[b] + i * page_size:kv_indptr[b] + i * page_size + m]
    if layout == "HND":
        pages = pages.transpose(0, 2, 1, 3).copy()
    return pages, indptr, perm, last
