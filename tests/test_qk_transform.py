"""User-defined query / key transforms (cuattn.Variant(query_transform=..., key_transform=...)): a
rotary embedding written as a user variant equals the built-in fused RoPE and the float64 formula, on
the NumPy path and in the decode and both prefill kernels (fa2; fa3 on sm_90: the fused RoPE too); a
per-head key scale reads an array parameter; fp8 KV refuses them; a snippet's compile error names its
line."""
import numpy as np
import pytest

import cuattn
from cuattn import jit, prefill, prefill_sm90, variants
from cuattn.errors import CompileError, UnsupportedError
from tests.conftest import gpu_cc
from tests.oracle import dense_attention, variant_attention
from tests.test_variants import BF16, _check, _cp, _paged_case, _poisoned_like, _rand, _rope_ref

THETA = 5e5


def _rope_pairs_np(p, pos, a, b, at):
    """NeoX rotation of the halves (a, b) at positions ``at`` (float64 math)."""
    half = a.shape[-1]
    ang = np.asarray(at, np.float64) * THETA ** (-2.0 * pos.pair / (2 * half))
    c, s = np.cos(ang), np.sin(ang)
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    return (a64 * c - b64 * s).astype(np.float32), (b64 * c + a64 * s).astype(np.float32)


# the whole head dim rotated (pairs (j, j + head_dim / 2), as the hooks pair them); float32 angles
_ROT = """
const float ang = float({pos}) * exp2f(-2.f * float(pair) / float(params.head_dim) * params.log2_theta);
float s, c;
sincosf(ang, &s, &c);
return make_float2(x.x * c - x.y * s, x.y * c + x.x * s);"""
USER_ROPE = cuattn.Variant(
    "user_rope", params=(("head_dim", "int"), ("log2_theta", "float")),
    query_transform=_ROT.format(pos="qo_pos"), key_transform=_ROT.format(pos="kv_idx"),
    numpy={"query_transform": lambda p, pos, a, b: _rope_pairs_np(p, pos, a, b, pos.qo_pos),
           "key_transform": lambda p, pos, a, b: _rope_pairs_np(p, pos, a, b, pos.kv_idx)})

# keys of kv head h scaled by scale[h] (an array parameter), queries untouched
KEY_SCALE = cuattn.Variant(
    "key_scale", params=(("kscale", "float*"),),
    key_transform="const float f = params.kscale[kv_head_idx];\nreturn make_float2(x.x * f, x.y * f);",
    numpy={"key_transform": lambda p, pos, a, b: (a * p["kscale"][pos.kv_head_idx], b * p["kscale"][pos.kv_head_idx])})


def _rope_args(d):
    return (d, float(np.log2(THETA)))


def _rope_oracle(q, k, v, causal):
    qo, kv = q.shape[0], k.shape[0]
    qr = _rope_ref(q, np.arange(qo) + kv - qo, q.shape[-1], 1.0, THETA)
    return variant_attention(qr, _rope_ref(k, np.arange(kv), q.shape[-1], 1.0, THETA), v, causal=causal)


def test_query_and_key_transforms_are_validated_and_part_of_the_code():
    assert USER_ROPE.code != cuattn.Variant("user_rope", params=USER_ROPE.params,
                                            query_transform=USER_ROPE.query_transform).code
    with pytest.raises(ValueError, match="reserved"):
        cuattn.Variant("v", params=(("pair", "int"),), key_transform="return x;")
    with pytest.raises(TypeError, match="key_transform"):
        cuattn.Variant("v", key_transform=3)
    comp = variants.Composite((USER_ROPE,))
    assert comp.has_qk_transform and not comp.has_rope
    assert "HAS_QUERY_TRANSFORM = true" in comp.prelude("t.cu") and "CUATTN_VARIANT_QK 1" in comp.prelude("t.cu")
    key_only = variants.Composite((KEY_SCALE,)).prelude("t.cu")
    assert "CUATTN_VARIANT_QK 1" in key_only and "HAS_QUERY_TRANSFORM = false" in key_only
    assert "CUATTN_VARIANT_QK 0" in variants.Composite((variants.SOFT_CAP,)).prelude("t.cu")


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_qk_transform_kernels_compile_without_spills(arch, tmp_cache_dir):
    comp = variants.Composite((USER_ROPE,))
    specs = [cuattn.decode.DecodeSpec(128, "f16", "f16", variant=comp),
             cuattn.prefill.make_spec(128, "bf16", True, False, True, comp),
             cuattn.prefill.make_spec(64, "f16", False, False, False, variants.Composite((KEY_SCALE,)))]
    if arch == "sm_90a":
        specs.append(cuattn.decode.DecodeSpec(128, "bf16", "bf16", tma=True, variant=comp))
    for spec in specs:
        res = jit.compile_kernel(spec, arch).resources
        assert all(r.get("spill_stores", 0) == 0 for r in res.values()), (spec.name, res)


def test_query_transform_compile_error_names_its_line(tmp_cache_dir):
    bad = cuattn.Variant("badq", query_transform="float2 y = x;\nreturn y +* 2;")
    with pytest.raises(CompileError) as err:
        jit.compile_kernel(cuattn.decode.DecodeSpec(64, "f16", "f16", variant=variants.Composite((bad,))), "sm_80")
    assert "variant badq: query_transform(2): error" in str(err.value)


def test_fp8_kv_refuses_qk_transforms_and_fa3_takes_them():
    w = cuattn.BatchPrefillWithRaggedKVCacheWrapper(backend="fa3")
    w.plan(np.array([0, 4], np.int32), np.array([0, 4], np.int32), 8, 8, 128, variant=USER_ROPE)
    for paged in (False, True):      # auto on sm_90 picks fa3 for the fused RoPE and a user transform
        assert prefill.resolve_backend("auto", "f", arch="sm_90a", head_dim=128, dtype="bf16", custom_mask=False,
                                       paged=paged, rope=True, page_size=16) == "fa3"
    d = cuattn.BatchDecodeWithPagedKVCacheWrapper()
    with pytest.raises(UnsupportedError, match="16-bit KV cache"):
        d.plan(np.array([0, 1], np.int32), np.array([0], np.int32), np.array([1], np.int32), 8, 8, 128, 16,
               kv_data_type="float8_e4m3fn", variant=KEY_SCALE)


def _rope_composite(rotary_dim=None):
    return variants.resolve("f", num_qo_heads=8, head_dim=128, pos_encoding_mode="ROPE_LLAMA",
                            rotary_dim=rotary_dim).composite


def test_fa3_transform_specs_compile_without_spills(tmp_cache_dir):
    """fa3 (sm_90a): the fused RoPE (producer warpgroup at 88 registers, consumers 208), a user query +
    key transform and a key-only one (56 / 224), contiguous and paged. The user rotary's sincosf keeps
    a stack frame for its slow path (its own code); nothing spills."""
    rope = [prefill_sm90.make_spec("f16", True, _rope_composite()),
            prefill_sm90.make_spec("bf16", False, _rope_composite(64), paged=True)]
    user = [prefill_sm90.make_spec("bf16", True, variants.Composite((USER_ROPE,))),
            prefill_sm90.make_spec("f16", True, variants.Composite((KEY_SCALE,)), paged=True)]
    for spec in rope + user:
        res = jit.compile_kernel(spec, "sm_90a").resources["cuattn_prefill_sm90"]
        assert res["spill_stores"] == 0 and res["spill_loads"] == 0, (spec.name, res)
        assert spec in user or res["stack_frame"] == 0, (spec.name, res)


def test_fa3_smem_has_room_for_the_transform_barriers():
    plain, rope = prefill_sm90.make_spec("f16", True), prefill_sm90.make_spec("f16", True, _rope_composite())
    assert rope.smem_bytes == plain.smem_bytes + 8 * rope.stages <= 227 * 1024


@pytest.mark.parametrize("causal", [False, True])
def test_user_rope_equals_builtin_and_oracle_on_cpu(causal):
    rng = np.random.default_rng(3)
    q, k, v = _rand(rng, (9, 8, 64)), _rand(rng, (40, 2, 64)), _rand(rng, (40, 2, 64))
    w = cuattn.BatchPrefillWithRaggedKVCacheWrapper()
    w.plan(np.array([0, 9], np.int32), np.array([0, 40], np.int32), 8, 2, 64, causal=causal, variant=USER_ROPE)
    user = w.run(q, k, v, *_rope_args(64))
    builtin = cuattn.single_prefill_with_kv_cache(q, k, v, causal=causal, pos_encoding_mode="ROPE_LLAMA",
                                                  rope_theta=THETA)
    _check(user, _rope_oracle(q, k, v, causal)[0])
    np.testing.assert_allclose(user, builtin, atol=2e-3)


def test_key_scale_transform_on_cpu_decode():
    rng = np.random.default_rng(4)
    lens, ps, hkv, d = [30, 7], 16, 2, 64
    indptr, indices, last, kc, vc, per_req = _paged_case(rng, lens, ps, hkv, d)
    scale = np.array([0.5, 2.0], np.float32)
    q = _rand(rng, (2, 8, d))
    w = cuattn.BatchDecodeWithPagedKVCacheWrapper()
    w.plan(indptr, indices, last, 8, hkv, d, ps, variant=KEY_SCALE)
    out = w.run(q, (kc, vc), scale)
    for b, (k, v) in enumerate(per_req):
        _check(out[b:b + 1], variant_attention(q[b:b + 1], k.astype(np.float32) * scale[None, :, None], v)[0])


@pytest.mark.gpu
@pytest.mark.parametrize("d,page_size", [(128, 16), (64, 1)])
def test_user_rope_decode_and_prefill_on_gpu(d, page_size):
    """Decode (TMA at page 16 on sm_90, cp.async at page 1) and paged prefill (fa3 at page 16 on sm_90,
    else fa2): the user rotary variant against the float64 formula and the built-in fused RoPE; the
    per-head key scale."""
    cp = _cp()
    rng = np.random.default_rng(41)
    lens, qlens, hq, hkv = [300, 45, 1500], [20, 1, 7], 16, 4
    indptr, indices, last, kc, vc, per_req = _paged_case(rng, lens, page_size, hkv, d)
    kv = (cp.asarray(kc), cp.asarray(vc))
    qd = _rand(rng, (3, hq, d))
    w = cuattn.BatchDecodeWithPagedKVCacheWrapper()
    w.plan(indptr, indices, last, hq, hkv, d, page_size, variant=USER_ROPE)
    out = _poisoned_like(cp, qd.shape, np.float16)
    w.run(cp.asarray(qd), kv, *_rope_args(d), out=out)
    wb = cuattn.BatchDecodeWithPagedKVCacheWrapper()
    wb.plan(indptr, indices, last, hq, hkv, d, page_size, pos_encoding_mode="ROPE_LLAMA", rope_theta=THETA)
    builtin = cp.asnumpy(wb.run(cp.asarray(qd), kv))
    for b, (k, v) in enumerate(per_req):
        _check(cp.asnumpy(out)[b:b + 1], _rope_oracle(qd[b:b + 1], k, v, False)[0])
    np.testing.assert_allclose(cp.asnumpy(out).astype(np.float32), builtin.astype(np.float32), atol=1e-2)

    qo_indptr = np.concatenate([[0], np.cumsum(qlens)]).astype(np.int32)
    qp = _rand(rng, (qo_indptr[-1], hq, d))
    wp = cuattn.BatchPrefillWithPagedKVCacheWrapper()
    wp.plan(qo_indptr, indptr, indices, last, hq, hkv, d, page_size, causal=True, variant=USER_ROPE)
    out = _poisoned_like(cp, qp.shape, np.float16)
    wp.run(cp.asarray(qp), kv, *_rope_args(d), out=out)
    assert wp.backend == ("fa3" if gpu_cc() == 90 else "fa2")   # fa3 gathers any page size
    for b, (k, v) in enumerate(per_req):
        sl = slice(qo_indptr[b], qo_indptr[b + 1])
        _check(cp.asnumpy(out)[sl], _rope_oracle(qp[sl], k, v, True)[0])

    scale = np.array([0.5, 2.0, 1.0, 0.25], np.float32)
    wk = cuattn.BatchPrefillWithPagedKVCacheWrapper()
    wk.plan(qo_indptr, indptr, indices, last, hq, hkv, d, page_size, causal=True, variant=KEY_SCALE)
    out = _poisoned_like(cp, qp.shape, np.float16)
    wk.run(cp.asarray(qp), kv, cp.asarray(scale), out=out)
    for b, (k, v) in enumerate(per_req):
        sl = slice(qo_indptr[b], qo_indptr[b + 1])
        _check(cp.asnumpy(out)[sl], variant_attention(qp[sl], k.astype(np.float32) * scale[None, :, None], v,
                                                      causal=True)[0])


# ---------------------------------------------------------------------------- fa3 (sm_90)

sm90 = pytest.mark.skipif(gpu_cc() != 90, reason="the fa3 kernel needs an sm_90 GPU")


def _rope64(x, pos, rot, scale=1.0, theta=THETA):
    """float64 NeoX rotation of x [n, heads, d] at positions pos [n] (the first rot dims), vectorized."""
    x = np.asarray(x, np.float64).copy()
    half = rot // 2
    ang = np.asarray(pos, np.float64)[:, None, None] / scale / theta ** (2 * np.arange(half) / rot)
    a, b = x[..., :half].copy(), x[..., half:rot].copy()
    x[..., :half] = a * np.cos(ang) - b * np.sin(ang)
    x[..., half:rot] = b * np.cos(ang) + a * np.sin(ang)
    return x


def test_vectorized_rope_oracle_equals_the_written_out_one():
    rng = np.random.default_rng(50)
    x, pos = rng.standard_normal((6, 3, 128)), np.array([0, 1, 7, 300, 1999, 65000])
    for rot, scale in ((128, 1.0), (64, 2.0)):
        np.testing.assert_allclose(_rope64(x, pos, rot, scale), _rope_ref(x, pos, rot, scale, THETA), atol=1e-9)


def _batch_oracle(q, ks, vs, qo_indptr, rot=None, scale=1.0):
    """Causal float64 attention per request; with ``rot``, q (at qo_idx + kv_len - qo_len) and the keys
    (at their index) rotated first."""
    outs, lses = [], []
    for b, (k, v) in enumerate(zip(ks, vs)):
        qb = q[qo_indptr[b]:qo_indptr[b + 1]]
        qo, kv = qb.shape[0], k.shape[0]
        if rot is not None:
            qb, k = _rope64(qb, np.arange(qo) + kv - qo, rot, scale), _rope64(k, np.arange(kv), rot, scale)
        o, s = dense_attention(qb, k, v, causal=True)
        outs.append(o)
        lses.append(s)
    return np.concatenate(outs), np.concatenate(lses)


def _dev(cp, x):
    return cp.asarray(x.view(np.uint16) if x.dtype == BF16 else x)


def _host(cp, x, dtype):
    return cp.asnumpy(x).view(dtype) if dtype == BF16 else cp.asnumpy(x)


def _poisoned(cp, shape, dtype):
    return cp.full(shape, 0x7FC0, np.uint16) if dtype == BF16 else _poisoned_like(cp, shape, dtype)


@pytest.mark.gpu
@sm90
def test_fa3_fused_rope_single_and_split_match_oracle_on_gpu():
    """backend="auto" runs the fused RoPE on fa3: one request, causal, qo_len < kv_len, rope_scale /
    rope_theta not the defaults (single_prefill_with_kv_cache and its wrapper agree bitwise); then the
    same kernel with the request's keys split into pieces (positions stay the request's); rotary_dim 64."""
    cp = _cp()
    rng = np.random.default_rng(52)
    qo, kv, hq, hkv, d = 300, 1000, 16, 4, 128
    q, k, v = _rand(rng, (qo, hq, d)), _rand(rng, (kv, hkv, d)), _rand(rng, (kv, hkv, d))
    qd, kd, vd = cp.asarray(q), cp.asarray(k), cp.asarray(v)
    for rot, split in ((None, None), (64, 256)):
        opts = dict(pos_encoding_mode="ROPE_LLAMA", rotary_dim=rot, rope_scale=2.0, rope_theta=THETA)
        w = cuattn.BatchPrefillWithRaggedKVCacheWrapper()
        w.plan(np.array([0, qo], np.int32), np.array([0, kv], np.int32), hq, hkv, d, causal=True,
               fixed_split_size=split, **opts)
        out, lse = _poisoned_like(cp, q.shape, np.float16), _poisoned_like(cp, q.shape[:2], np.float32)
        w.run(qd, kd, vd, out=out, lse=lse)
        assert w.backend == "fa3"
        assert split is None or "query tiles cut into pieces" in w.describe()
        want, want_lse = _batch_oracle(q, [k], [v], [0, qo], rot or d, 2.0)
        _check(cp.asnumpy(out), want, cp.asnumpy(lse), want_lse)
        if split is None:
            single = cuattn.single_prefill_with_kv_cache(qd, kd, vd, causal=True, **opts)
            assert cp.array_equal(single, out)


@pytest.mark.gpu
@sm90
def test_fa3_user_transforms_ragged_and_paged_match_oracle_on_gpu():
    """backend="auto" runs user transforms on fa3: the user rotary (query + key hooks) over a ragged
    bf16 batch and a paged fp16 one (page 16, NaN in the free slots of each last page), the per-head key
    scale (key hook alone) and the built-in RoPE over the same pages; GQA group 4, causal."""
    cp = _cp()
    rng = np.random.default_rng(53)
    qlens, lens, hq, hkv, d = [1, 37, 300, 5], [54, 500, 1333, 5], 16, 4, 128
    qo_indptr = np.concatenate([[0], np.cumsum(qlens)]).astype(np.int32)
    # -- ragged, bf16
    kv_indptr = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    q, k, v = (_rand(rng, (n, h, d), BF16) for n, h in ((qo_indptr[-1], hq), (kv_indptr[-1], hkv),
                                                       (kv_indptr[-1], hkv)))
    w = cuattn.BatchPrefillWithRaggedKVCacheWrapper()
    w.plan(qo_indptr, kv_indptr, hq, hkv, d, causal=True, q_data_type="bfloat16", variant=USER_ROPE)
    out, lse = _poisoned(cp, q.shape, BF16), _poisoned_like(cp, q.shape[:2], np.float32)
    w.run(_dev(cp, q), _dev(cp, k), _dev(cp, v), *_rope_args(d), out=out, lse=lse)
    assert w.backend == "fa3"
    ks = [k[kv_indptr[b]:kv_indptr[b + 1]] for b in range(len(lens))]
    vs = [v[kv_indptr[b]:kv_indptr[b + 1]] for b in range(len(lens))]
    want, want_lse = _batch_oracle(q, ks, vs, qo_indptr, d)
    _check(_host(cp, out, BF16), want, cp.asnumpy(lse), want_lse)
    # -- paged, fp16, page 16
    indptr, indices, last, kc, vc, per_req = _paged_case(rng, lens, 16, hkv, d)
    for b in range(len(lens)):
        kc[indices[indptr[b + 1] - 1], last[b]:] = np.nan
        vc[indices[indptr[b + 1] - 1], last[b]:] = np.nan
    kv = (cp.asarray(kc), cp.asarray(vc))
    qp = _rand(rng, (qo_indptr[-1], hq, d))
    ks, vs = [k for k, _ in per_req], [v for _, v in per_req]
    scale = np.array([0.5, 2.0, 1.0, 0.25], np.float32)
    rope_want = _batch_oracle(qp, ks, vs, qo_indptr, d)
    runs = [(dict(variant=USER_ROPE), _rope_args(d), rope_want),
            (dict(pos_encoding_mode="ROPE_LLAMA", rope_theta=THETA), (), rope_want),
            (dict(variant=KEY_SCALE), (cp.asarray(scale),),
             _batch_oracle(qp, [k.astype(np.float64) * scale[None, :, None] for k in ks], vs, qo_indptr))]
    for opts, args, (want, want_lse) in runs:
        wp = cuattn.BatchPrefillWithPagedKVCacheWrapper()
        wp.plan(qo_indptr, indptr, indices, last, hq, hkv, d, 16, causal=True, **opts)
        out, lse = _poisoned_like(cp, qp.shape, np.float16), _poisoned_like(cp, qp.shape[:2], np.float32)
        wp.run(cp.asarray(qp), kv, *args, out=out, lse=lse)
        assert wp.backend == "fa3", opts
        _check(cp.asnumpy(out), want, cp.asnumpy(lse), want_lse)
