"""User-defined query / key transforms (cuattn.Variant(query_transform=..., key_transform=...)): a
rotary embedding written as a user variant equals the built-in fused RoPE and the float64 formula, on
the NumPy path and in the decode and fa2 prefill kernels; a per-head key scale reads an array
parameter; fa3 and fp8 KV refuse them; a snippet's compile error names its line."""
import numpy as np
import pytest

import cuattn
from cuattn import jit, variants
from cuattn.errors import CompileError, UnsupportedError
from tests.oracle import variant_attention
from tests.test_variants import _check, _cp, _paged_case, _poisoned_like, _rand, _rope_ref

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


def test_fa3_and_fp8_kv_refuse_qk_transforms():
    w = cuattn.BatchPrefillWithRaggedKVCacheWrapper(backend="fa3")
    with pytest.raises(UnsupportedError, match="query / key transform"):
        w.plan(np.array([0, 4], np.int32), np.array([0, 4], np.int32), 8, 8, 128, variant=USER_ROPE)
    d = cuattn.BatchDecodeWithPagedKVCacheWrapper()
    with pytest.raises(UnsupportedError, match="16-bit KV cache"):
        d.plan(np.array([0, 1], np.int32), np.array([0], np.int32), np.array([1], np.int32), 8, 8, 128, 16,
               kv_data_type="float8_e4m3fn", variant=KEY_SCALE)


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
    """Decode (TMA at page 16 on sm_90, cp.async at page 1) and paged fa2 prefill: the user rotary
    variant against the float64 formula and the built-in fused RoPE; the per-head key scale."""
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
    assert wp.backend == "fa2"
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
