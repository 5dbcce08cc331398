import math

import ml_dtypes
import numpy as np
import pytest

from cuattn import jit, rope
from cuattn.errors import UnsupportedError

from .conftest import memcheck

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = [np.dtype(np.float16), BF16]
DTYPE_IDS = ["f16", "bf16"]
# (num_qo_heads, num_kv_heads, head_dim, rotary_dim)
SHAPES = [(4, 2, 64, 64), (3, 1, 128, 32), (2, 2, 96, 18)]
SHAPE_IDS = [f"h{hq}:{hk}-hd{d}-rot{r}" for hq, hk, d, r in SHAPES]
# the NumPy path rounds a float64 result once: within half an ulp (2^-11 / 2^-8 relative) plus subnormals
REL = {np.dtype(np.float16): 2.0 ** -10, BF16: 2.0 ** -7}
# GPU: fp32 math and one rounding; error relative to the largest magnitude of the tensor
GPU_TOL = {np.dtype(np.float16): 2e-3, BF16: 1e-2}
LLAMA = dict(rope_scale=8.0, rope_theta=5e5, low_freq_factor=1.0, high_freq_factor=4.0, old_context_len=8192)


# ---------------------------------------------------------------------------- the float64 oracle


def base_frequencies(rotary_dim, rope_theta=1e4, rope_scale=1.0, llama=None):
    """Radians per position of each pair: theta^(-2j/d) / scale, or Llama 3.1's wavelength rule (as
    in Meta's reference code): short wavelengths kept, long ones divided by the scale, between blended."""
    w = rope_theta ** (-2.0 * np.arange(rotary_dim // 2) / rotary_dim)
    if llama is None:
        return w / rope_scale
    low, high, old = llama["low_freq_factor"], llama["high_freq_factor"], llama["old_context_len"]
    out = []
    for f in w:
        wavelength = 2 * math.pi / f
        if wavelength < old / high:
            out.append(f)
        elif wavelength > old / low:
            out.append(f / rope_scale)
        else:
            smooth = (old / wavelength - low) / (high - low)
            out.append((1 - smooth) * f / rope_scale + smooth * f)
    return np.array(out)


def rope_oracle(x, positions, rotary_dim, interleave, freqs=None, **freq_args):
    """float64 RoPE from the definition: pair j, read as the complex number x_a + i x_b, times
    exp(i * position * w_j); (a, b) = (2j, 2j+1) interleaved, (j, j + rotary_dim/2) otherwise."""
    x = np.asarray(x, np.float64)
    half = rotary_dim // 2
    w = base_frequencies(rotary_dim, **freq_args) if freqs is None else freqs
    j = np.arange(half)
    ia, ib = (2 * j, 2 * j + 1) if interleave else (j, j + half)
    turn = np.exp(1j * np.asarray(positions, np.float64)[:, None] * w[None, :])[:, None, :]
    z = (x[..., ia] + 1j * x[..., ib]) * turn
    out = x.copy()
    out[..., ia], out[..., ib] = z.real, z.imag
    return out


def assert_rounded_from(got, ref, dtype):
    """Every element of got is ref rounded to dtype (within half an ulp, with margin)."""
    assert got.dtype == dtype
    err = np.abs(got.astype(np.float64) - ref)
    assert np.all(err <= REL[dtype] * np.abs(ref) + 1e-6), float(err.max())


def qk(nnz, hq, hk, d, dtype, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((nnz, hq, d)).astype(dtype), rng.standard_normal((nnz, hk, d)).astype(dtype))


def ragged(lengths, seed=0):
    """indptr, offsets and the equivalent positions of requests with these lengths."""
    rng = np.random.default_rng(seed)
    indptr = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    offsets = rng.integers(0, 5000, len(lengths)).astype(np.int32)
    positions = np.concatenate([o + np.arange(n) for o, n in zip(offsets, lengths)]).astype(np.int64)
    return indptr, offsets, positions


def vllm_cache(max_len, rotary_dim, rope_theta=1e4):
    """vLLM's cos_sin_cache: row p = [cos(p w_j) for j] + [sin(p w_j) for j], float32."""
    angle = np.arange(max_len)[:, None] * base_frequencies(rotary_dim, rope_theta)[None, :]
    return np.concatenate([np.cos(angle), np.sin(angle)], axis=1).astype(np.float32)


def cache_rope64(x, cache, positions, rotary_dim, is_neox):
    """float64 RoPE of (nnz, heads, head_size) x with a float32 cos_sin_cache: the formula with its
    float32-rounded cos and sin, written out."""
    half = rotary_dim // 2
    c, s = (cache[positions, None, :half].astype(np.float64), cache[positions, None, half:].astype(np.float64))
    j = np.arange(half)
    ia, ib = (j, j + half) if is_neox else (2 * j, 2 * j + 1)
    x = np.asarray(x, np.float64)
    out = x.copy()
    out[..., ia] = x[..., ia] * c - x[..., ib] * s
    out[..., ib] = x[..., ib] * c + x[..., ia] * s
    return out


# ---------------------------------------------------------------------------- NumPy path


@pytest.mark.parametrize("interleave", [False, True], ids=["neox", "interleave"])
@pytest.mark.parametrize("hq,hk,d,rot", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_apply_rope_pos_ids_matches_float64_formula(dtype, hq, hk, d, rot, interleave):
    q, k = qk(37, hq, hk, d, dtype)
    pos = np.random.default_rng(1).integers(0, 70000, 37)
    q_rope, k_rope = rope.apply_rope_pos_ids(q, k, pos, rotary_dim=rot, interleave=interleave, rope_theta=5e4,
                                             rope_scale=2.0)
    assert q_rope.shape == q.shape and k_rope.shape == k.shape
    assert_rounded_from(q_rope, rope_oracle(q, pos, rot, interleave, rope_theta=5e4, rope_scale=2.0), dtype)
    assert_rounded_from(k_rope, rope_oracle(k, pos, rot, interleave, rope_theta=5e4, rope_scale=2.0), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_dims_past_rotary_dim_are_left_as_they_are(dtype):
    q, k = qk(9, 2, 2, 128, dtype)
    for interleave in (False, True):
        q_rope, k_rope = rope.apply_rope_pos_ids(q, k, np.arange(9) * 1000, rotary_dim=40, interleave=interleave)
        assert np.array_equal(q_rope[..., 40:].view(np.uint16), q[..., 40:].view(np.uint16))
        assert np.array_equal(k_rope[..., 40:].view(np.uint16), k[..., 40:].view(np.uint16))
        assert not np.array_equal(q_rope[1:, :, :40], q[1:, :, :40])


@pytest.mark.parametrize("interleave", [False, True], ids=["neox", "interleave"])
def test_apply_rope_ragged_equals_pos_ids_and_formula(interleave):
    indptr, offsets, positions = ragged([5, 0, 12, 1, 0])
    q, k = qk(18, 4, 1, 64, np.float16, seed=2)
    by_offsets = rope.apply_rope(q, k, indptr, offsets, interleave=interleave)
    by_positions = rope.apply_rope_pos_ids(q, k, positions, interleave=interleave)
    for a, b in zip(by_offsets, by_positions):
        assert np.array_equal(a, b)
    assert_rounded_from(by_offsets[0], rope_oracle(q, positions, 64, interleave), np.dtype(np.float16))


@pytest.mark.parametrize("factors", [LLAMA, dict(LLAMA, rope_scale=32.0, low_freq_factor=2.0, high_freq_factor=8.0,
                                                 old_context_len=4096)], ids=["llama3.1", "other-factors"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_apply_llama31_rope_matches_meta_wavelength_rule(dtype, factors):
    indptr, offsets, positions = ragged([7, 30], seed=3)
    positions = np.concatenate([positions, [131071, 500000, 1000000]])      # and long-context positions
    q, k = qk(40, 4, 2, 128, dtype, seed=3)
    freqs = base_frequencies(128, factors["rope_theta"], factors["rope_scale"], llama=factors)
    q_rope, k_rope = rope.apply_llama31_rope_pos_ids(q, k, positions, **factors)
    assert_rounded_from(q_rope, rope_oracle(q, positions, 128, False, freqs=freqs), dtype)
    assert_rounded_from(k_rope, rope_oracle(k, positions, 128, False, freqs=freqs), dtype)
    q2, _ = rope.apply_llama31_rope(q[:-3], k[:-3], indptr, offsets, **factors)
    assert np.array_equal(q2, q_rope[:-3])
    # defaults are FlashInfer's (rope_scale 8, theta 5e5, 1, 4, 8192)
    assert np.array_equal(rope.apply_llama31_rope_pos_ids(q, k, positions)[0],
                          rope.apply_llama31_rope_pos_ids(q, k, positions, **LLAMA)[0])


def test_large_positions_stay_accurate_on_numpy_path():
    q, k = qk(4, 2, 1, 128, np.float16, seed=4)
    pos = np.array([500000, 999999, 1 << 20, 2 ** 31 - 1])
    q_rope, _ = rope.apply_rope_pos_ids(q, k, pos, rope_theta=1e6)
    assert_rounded_from(q_rope, rope_oracle(q, pos, 128, False, rope_theta=1e6), np.dtype(np.float16))


@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_cos_sin_cache_form_matches_formula(dtype, is_neox):
    hq, hk, hs, rot = 4, 2, 64, 32
    q, k = qk(21, hq, hk, hs, dtype, seed=5)
    cache = vllm_cache(4096, rot)
    positions = np.random.default_rng(5).integers(0, 4096, 21)
    query, key = q.reshape(21, hq * hs), k.reshape(21, hk * hs)       # vLLM passes (nnz, heads * head_size)
    q_out, k_out = rope.apply_rope_with_cos_sin_cache(positions, query, key, hs, cache, is_neox=is_neox)
    assert q_out.shape == query.shape and k_out.shape == key.shape
    ref_q = cache_rope64(q, cache, positions, rot, is_neox)
    assert_rounded_from(q_out.reshape(q.shape), ref_q, dtype)
    # ... and the computed-frequency form agrees with it (same formula, exact cos/sin)
    q_pos, k_pos = rope.apply_rope_pos_ids(q, k, positions, rotary_dim=rot, interleave=not is_neox)
    assert np.abs(q_pos.astype(np.float64) - q_out.reshape(q.shape).astype(np.float64)).max() <= \
        4 * REL[dtype] * np.abs(ref_q).max()
    # 3-D query/key are accepted too, with the same result
    q3, k3 = rope.apply_rope_with_cos_sin_cache(positions, q, k, hs, cache, is_neox=is_neox)
    assert np.array_equal(q3.reshape(query.shape), q_out) and np.array_equal(k3.reshape(key.shape), k_out)


# (function, its positional arguments from q, k and the metadata m, keywords)
IN_PLACE_PAIRS = [
    ("apply_rope", lambda q, k, m: (q, k, m["indptr"], m["offsets"]), {}),
    ("apply_rope_pos_ids", lambda q, k, m: (q, k, m["positions"]), {"rotary_dim": 32, "interleave": True}),
    ("apply_llama31_rope", lambda q, k, m: (q, k, m["indptr"], m["offsets"]), {"rope_theta": 1e4}),
    ("apply_llama31_rope_pos_ids", lambda q, k, m: (q, k, m["positions"]), {"rotary_dim": 48}),
    ("apply_rope_with_cos_sin_cache", lambda q, k, m: (m["positions"], q, k, 64, m["cache"]), {"is_neox": False}),
]


@pytest.mark.parametrize("name,args,kwargs", IN_PLACE_PAIRS, ids=[p[0] for p in IN_PLACE_PAIRS])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_inplace_form_writes_what_the_returning_form_returns(dtype, name, args, kwargs):
    indptr, offsets, positions = ragged([3, 9, 0, 4], seed=6)
    meta = {"indptr": indptr, "offsets": offsets, "positions": positions, "cache": vllm_cache(8192, 64)}
    q, k = qk(16, 3, 2, 64, dtype, seed=6)
    expected = getattr(rope, name)(*args(q, k, meta), **kwargs)
    q_in, k_in = q.copy(), k.copy()
    assert getattr(rope, name + "_inplace")(*args(q_in, k_in, meta), **kwargs) is None
    assert np.array_equal(q_in, expected[0]) and np.array_equal(k_in, expected[1])
    assert not np.array_equal(q_in, q)


def test_inplace_writes_through_views_of_a_packed_qkv():
    hq, hk, d = 4, 2, 64
    qkv = np.random.default_rng(7).standard_normal((10, (hq + 2 * hk) * d)).astype(np.float16)
    original = qkv.copy()
    q = qkv[:, :hq * d].reshape(10, hq, d)
    k = qkv[:, hq * d:(hq + hk) * d].reshape(10, hk, d)
    pos = np.arange(10) + 17
    rope.apply_rope_pos_ids_inplace(q, k, pos)
    assert_rounded_from(q, rope_oracle(original[:, :hq * d].reshape(10, hq, d), pos, d, False), np.dtype(np.float16))
    assert np.array_equal(qkv[:, (hq + hk) * d:], original[:, (hq + hk) * d:])      # v untouched


def test_empty_inputs_return_empty_results():
    q, k = qk(0, 4, 2, 64, np.float16)
    for result in (rope.apply_rope(q, k, np.array([0]), np.array([], np.int32)),
                   rope.apply_rope(q, k, np.array([0, 0, 0]), np.array([3, 4])),
                   rope.apply_rope_pos_ids(q, k, np.array([], np.int64)),
                   rope.apply_llama31_rope_pos_ids(q, k, np.array([], np.int64), rotary_dim=32),
                   rope.apply_rope_with_cos_sin_cache(np.array([], np.int64), q.reshape(0, 256), k.reshape(0, 128),
                                                      64, vllm_cache(16, 64))):
        assert [r.shape[0] for r in result] == [0, 0] and result[0].dtype == np.float16
    assert rope.apply_rope_pos_ids_inplace(q, k, np.array([], np.int32)) is None


def _bad_calls():
    q, k = qk(6, 2, 2, 64, np.float16)
    ip, off, pos = np.array([0, 2, 6]), np.array([0, 9]), np.arange(6)
    cache = vllm_cache(16, 64)
    return [
        # (call, exception, message fragment naming the argument)
        (lambda: rope.apply_rope_pos_ids(q, k, pos, rotary_dim=7), ValueError, "rotary_dim must be even"),
        (lambda: rope.apply_rope_pos_ids(q, k, pos, rotary_dim=66), ValueError, "rotary_dim must be even"),
        (lambda: rope.apply_rope_pos_ids(q, k, pos, rotary_dim=0), ValueError, "rotary_dim"),
        (lambda: rope.apply_rope_pos_ids(q, k, pos, rotary_dim=32.0), TypeError, "rotary_dim must be an int"),
        (lambda: rope.apply_rope(q, k, np.array([1, 2, 6]), off), ValueError, "indptr must start at 0"),
        (lambda: rope.apply_rope(q, k, np.array([0, 4, 3, 6]), np.zeros(3, int)), ValueError,
         "indptr must be non-decreasing"),
        (lambda: rope.apply_rope(q, k, np.array([0, 2, 5]), off), ValueError, r"indptr\[-1\] must equal nnz=6"),
        (lambda: rope.apply_rope(q, k, np.array([], np.int32), off[:0]), ValueError, "indptr must start at 0"),
        (lambda: rope.apply_rope(q, k, ip, np.array([0])), ValueError, "offsets must have length 2"),
        (lambda: rope.apply_rope(q, k, ip.astype(np.float32), off), ValueError, "indptr must be a 1-D integer"),
        (lambda: rope.apply_rope_pos_ids(q, k, pos[:5]), ValueError, "pos_ids must have length 6"),
        (lambda: rope.apply_rope_pos_ids(q, k, pos.reshape(2, 3)), ValueError, "pos_ids must be a 1-D integer"),
        (lambda: rope.apply_rope_pos_ids(q.astype(np.float32), k.astype(np.float32), pos), TypeError,
         "q must be float16 or bfloat16"),
        (lambda: rope.apply_rope_pos_ids(q, k.astype(BF16), pos), TypeError, "q and k must have the same dtype"),
        (lambda: rope.apply_rope_pos_ids(q[:5], k, pos), ValueError, "same number of tokens"),
        (lambda: rope.apply_rope_pos_ids(q, k[..., :32], pos), ValueError, "same head_dim"),
        (lambda: rope.apply_rope_pos_ids(q.reshape(6, 128), k, pos), ValueError, "q must have shape"),
        (lambda: rope.apply_rope_pos_ids(q, k, pos, rope_theta=0), ValueError, "rope_theta must be a finite"),
        (lambda: rope.apply_rope(q, k, ip, off, rope_scale=float("nan")), ValueError, "rope_scale must be"),
        (lambda: rope.apply_llama31_rope_pos_ids(q, k, pos, low_freq_factor=4, high_freq_factor=4), ValueError,
         "high_freq_factor must be greater than low_freq_factor"),
        (lambda: rope.apply_llama31_rope(q, k, ip, off, old_context_len=0), ValueError, "old_context_len"),
        (lambda: rope.apply_rope_with_cos_sin_cache(pos, q, k, 64, cache.astype(np.float16)), TypeError,
         "cos_sin_cache must be float32"),
        (lambda: rope.apply_rope_with_cos_sin_cache(pos, q, k, 64, np.zeros((16, 66), np.float32)), ValueError,
         "rotary_dim"),
        (lambda: rope.apply_rope_with_cos_sin_cache(pos, q, k, 64, np.zeros((16, 31), np.float32)), ValueError,
         "rotary_dim"),
        (lambda: rope.apply_rope_with_cos_sin_cache(pos, q, k, 64, cache[0]), ValueError,
         "cos_sin_cache must have shape"),
        (lambda: rope.apply_rope_with_cos_sin_cache(pos + 11, q, k, 64, cache), ValueError,
         r"positions must be in \[0, max_seq_len=16\)"),
        (lambda: rope.apply_rope_with_cos_sin_cache(pos - 1, q, k, 64, cache), ValueError, "positions must be in"),
        (lambda: rope.apply_rope_with_cos_sin_cache(pos, q.reshape(6, 128), k.reshape(6, 128), 48, cache),
         ValueError, "query must have shape .* not a multiple of 48"),
        (lambda: rope.apply_rope_with_cos_sin_cache(pos, q, k, 32, cache), ValueError, "query must have head_size=32"),
        (lambda: rope.apply_rope_with_cos_sin_cache(pos, q, k, 0, cache), ValueError, "head_size must be a positive"),
        (lambda: rope.apply_rope_with_cos_sin_cache(pos, q, k, 64, None), TypeError, "cos_sin_cache must be"),
    ]


def test_bad_inputs_raise_naming_the_argument():
    for call, exc, match in _bad_calls():
        with pytest.raises(exc, match=match):
            call()


def test_rotary_dim_above_the_kernel_limit_is_unsupported_on_both_paths():
    q, k = qk(2, 1, 1, 1024, np.float16)
    with pytest.raises(UnsupportedError, match="rotary_dim=1024 has no kernel; at most 512"):
        rope.apply_rope_pos_ids(q, k, np.arange(2))
    q_rope, _ = rope.apply_rope_pos_ids(q, k, np.arange(2), rotary_dim=512)
    assert_rounded_from(q_rope, rope_oracle(q, np.arange(2), 512, False), np.dtype(np.float16))


def test_inplace_refuses_read_only_numpy_arrays():
    q, k = qk(3, 1, 1, 64, np.float16)
    q.flags.writeable = False
    with pytest.raises(TypeError, match="apply_rope_pos_ids_inplace: q must be writable"):
        rope.apply_rope_pos_ids_inplace(q, k, np.arange(3))
    k.flags.writeable = False
    with pytest.raises(TypeError, match="key must be writable"):
        rope.apply_rope_with_cos_sin_cache_inplace(np.arange(3), q.copy(), k, 64, vllm_cache(8, 64))


def test_inplace_refuses_jax_arrays_and_returning_form_accepts_them():
    jax = pytest.importorskip("jax")
    q, k = qk(3, 2, 1, 64, np.float16)
    cpu = jax.devices("cpu")[0]                 # the CPU path (metadata given as NumPy arrays)
    jq, jk = jax.device_put(q, cpu), jax.device_put(k, cpu)
    with pytest.raises(TypeError, match="apply_rope_inplace: q must be a mutable array"):
        rope.apply_rope_inplace(jq, jk, np.array([0, 3]), np.array([4]))
    q_rope, k_rope = rope.apply_rope(jq, jk, np.array([0, 3]), np.array([4]))
    assert type(q_rope).__module__.startswith("jax")
    assert np.array_equal(np.asarray(q_rope), rope.apply_rope(q, k, np.array([0, 3]), np.array([4]))[0])


# ---------------------------------------------------------------------------- kernels


def test_rope_specs_are_few_and_named_by_dtype():
    specs = rope.shipped_specs()
    assert [s.name for s in specs] == ["rope_f16", "rope_bf16"]
    assert specs[1].defines() == ("-DDTYPE=1",)
    one_wave = 4 * 132                                                     # H100: 4 blocks an SM
    assert specs[0].grid(nnz=1, heads=40, resident_blocks=one_wave) == (1, 20)   # decode: heads split over blocks
    assert specs[0].grid(nnz=64, heads=40, resident_blocks=one_wave) == (16, 20)
    # serving size: 4096 tokens over 2112 warps -> 2 tokens each, 512 blocks (one wave, not 1.9 waves)
    assert specs[0].grid(nnz=4096, heads=40, resident_blocks=one_wave) == (512, 1)
    blocks, splits = specs[0].grid(nnz=10 ** 6, heads=40, resident_blocks=one_wave)   # warps loop over tokens
    assert splits == 1 and blocks <= one_wave and blocks * 4 * -(-10 ** 6 // (4 * blocks)) >= 10 ** 6


def test_cos_sin_cache_entry_serves_only_vector_launches_without_tails():
    neox128 = rope._vector_layout(128, 128, False, False, [16 * 256])      # 8 pairs a lane, 16-byte runs
    assert neox128.pairs == 8 and neox128.access == 16
    assert rope._cache_entry(True, neox128, 0, False) == "cuattn_rope_cache_neox"
    assert rope._cache_entry(True, rope._vector_layout(128, 128, True, False, [256]), 0, True) == "cuattn_rope_cache_gptj"
    assert rope._cache_entry(True, rope._vector_layout(64, 128, False, False, [256]), 0, False) is not None   # in place
    assert rope._cache_entry(False, neox128, 0, False) is None               # frequencies: the general entry
    assert rope._cache_entry(True, neox128, 16, False) is None              # a tail to copy
    assert rope._cache_entry(True, rope._vector_layout(128, 128, False, False, [8]), 0, False) is None   # 4 pairs
    assert rope._cache_entry(True, rope._vector_layout(120, 120, False, False, [240]), 0, False) is None  # odd pairs


@pytest.mark.parametrize("freq", [rope._plain_freq("t", 1, 1e4), rope._plain_freq("t", 4.0, 5e5),
                                  rope._llama31_freq("t", 8, 5e5, 1, 4, 8192)], ids=["plain", "scaled", "llama3.1"])
def test_kernel_frequency_parameters_give_the_numpy_frequencies(freq):
    # rope.cuh: half-turns of pair j = step^j * (scaled_pi + smooth * unscaled_pi), smooth clamped to [0, 1]
    step, a, b, scaled_pi, unscaled_pi = (hi + lo for hi, lo in zip(*[iter(rope._kernel_freq(freq, 128))] * 2))
    f = step ** np.arange(64)
    half_turns = f * (scaled_pi + np.clip(a * f + b, 0, 1) * unscaled_pi)
    assert np.allclose(half_turns * np.pi, rope._inv_freq(freq, 128), rtol=1e-12, atol=0)
    assert np.allclose(rope._inv_freq(freq, 128),
                       base_frequencies(128, freq.rope_theta, freq.rope_scale,
                                        llama=None if freq.smooth_a == 0 else LLAMA), rtol=1e-12, atol=0)


@pytest.mark.parametrize("arch", jit.SHIPPED_ARCHS)
def test_shipped_rope_kernels_compile_without_spills(arch):
    for spec in rope.shipped_specs():
        compiled = jit.compile_kernel(spec, arch)
        for entry, r in compiled.resources.items():
            assert r["spill_stores"] == 0 and r["spill_loads"] == 0 and r["stack_frame"] == 0, (spec.name, arch, r)


# ---------------------------------------------------------------------------- GPU


def _dev(cp, x):
    """A CuPy copy of a NumPy f16/bf16 array (bf16 as its uint16 raw view)."""
    return cp.asarray(x.view(np.uint16) if x.dtype == BF16 else x)


def _host(cp, x, dtype):
    y = cp.asnumpy(x)
    return y.view(BF16) if dtype == BF16 else y


def assert_close_gpu(got, ref, dtype):
    assert got.dtype == dtype and np.all(np.isfinite(got.astype(np.float32)))
    err = np.abs(got.astype(np.float64) - ref).max()
    assert err <= GPU_TOL[dtype] * np.abs(ref).max(), (err, np.abs(ref).max())


# (num_qo_heads, num_kv_heads, head_dim, rotary_dim): every vector width and steps per lane
GPU_SHAPES = [(32, 8, 128, 128), (4, 2, 64, 32), (2, 1, 64, 36), (2, 1, 96, 18), (8, 1, 256, 256),
              (2, 2, 512, 512), (3, 1, 128, 64),
              # copy lanes with rows of 5 lanes (6 rows a warp, 2 lanes idle); a tail past 32 lanes (copied
              # after each row); P = 4 rotating lanes with P = 4 copy lanes
              (5, 1, 80, 32), (2, 1, 576, 64), (3, 2, 72, 40)]


@pytest.mark.gpu
@pytest.mark.parametrize("interleave", [False, True], ids=["neox", "interleave"])
@pytest.mark.parametrize("hq,hk,d,rot", GPU_SHAPES, ids=[f"h{a}:{b}-hd{c}-rot{e}" for a, b, c, e in GPU_SHAPES])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_gpu_rope_matches_float64_formula_and_numpy_path(dtype, hq, hk, d, rot, interleave):
    import cupy as cp
    q, k = qk(77, hq, hk, d, dtype, seed=10)
    pos = np.random.default_rng(10).integers(0, 1 << 20, 77)
    pos[:3] = [0, 500000, 999999]
    junk = cp.full(77 * (hq + hk) * d * 2, cp.nan, cp.float32)   # leave NaN where the pool will hand out results
    del junk
    q_rope, k_rope = rope.apply_rope_pos_ids(_dev(cp, q), _dev(cp, k), cp.asarray(pos), rotary_dim=rot,
                                             interleave=interleave, rope_theta=1e4)
    q_rope, k_rope = _host(cp, q_rope, dtype), _host(cp, k_rope, dtype)
    assert_close_gpu(q_rope, rope_oracle(q, pos, rot, interleave), dtype)
    assert_close_gpu(k_rope, rope_oracle(k, pos, rot, interleave), dtype)
    assert np.array_equal(q_rope[..., rot:], q[..., rot:])                      # tail copied bit-exactly
    ref_q, _ = rope.apply_rope_pos_ids(q, k, pos, rotary_dim=rot, interleave=interleave)
    assert np.abs(q_rope.astype(np.float64) - ref_q.astype(np.float64)).max() <= \
        GPU_TOL[dtype] * np.abs(ref_q.astype(np.float64)).max()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_gpu_large_positions_keep_fp16_bf16_precision(dtype):
    import cupy as cp
    q, k = qk(6, 8, 2, 128, dtype, seed=11)
    pos = np.array([500000, 500001, 999999, 1 << 20, 4_000_000, 16_000_000], np.int64)
    for call, freqs in ((lambda *a: rope.apply_rope_pos_ids(*a, rope_theta=5e5), base_frequencies(128, 5e5)),
                        (lambda *a: rope.apply_llama31_rope_pos_ids(*a, **LLAMA),
                         base_frequencies(128, 5e5, 8.0, llama=LLAMA))):
        q_rope, k_rope = call(_dev(cp, q), _dev(cp, k), cp.asarray(pos))
        assert_close_gpu(_host(cp, q_rope, dtype), rope_oracle(q, pos, 128, False, freqs=freqs), dtype)
        assert_close_gpu(_host(cp, k_rope, dtype), rope_oracle(k, pos, 128, False, freqs=freqs), dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("index_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_gpu_inplace_on_nan_poisoned_packed_qkv_writes_only_q_and_k(dtype, index_dtype):
    import cupy as cp
    hq, hk, d, pad = 8, 2, 128, 8
    indptr, offsets, positions = ragged([5, 0, 40, 1, 0, 17], seed=12)
    nnz = int(indptr[-1])
    q, k = qk(nnz, hq, hk, d, dtype, seed=12)
    row = (hq + 2 * hk) * d + pad
    buf = cp.full((nnz, row), 0x7fc0 if dtype == BF16 else 0x7e00, cp.uint16)      # NaN bits everywhere
    buf[:, :hq * d] = _dev(cp, q).reshape(nnz, hq * d).view(cp.uint16)
    buf[:, hq * d:(hq + hk) * d] = _dev(cp, k).reshape(nnz, hk * d).view(cp.uint16)
    view = buf if dtype == BF16 else buf.view(cp.float16)
    qv = view[:, :hq * d].reshape(nnz, hq, d)
    kv = view[:, hq * d:(hq + hk) * d].reshape(nnz, hk, d)
    assert qv.data.ptr == buf.data.ptr and kv.data.ptr == buf.data.ptr + hq * d * 2     # views, not copies
    for fn, freqs in ((rope.apply_rope_inplace, base_frequencies(d)),
                      (rope.apply_llama31_rope_inplace, base_frequencies(d, 5e5, 8.0, llama=LLAMA))):
        before = cp.asnumpy(buf)
        kwargs = {} if fn is rope.apply_rope_inplace else LLAMA
        assert fn(qv, kv, cp.asarray(indptr, index_dtype), cp.asarray(offsets, index_dtype), **kwargs) is None
        after = cp.asnumpy(buf)
        assert np.array_equal(after[:, (hq + hk) * d:], before[:, (hq + hk) * d:])       # v and padding: NaN still
        q_in = before[:, :hq * d].reshape(nnz, hq, d).view(dtype)
        got = after[:, :hq * d].reshape(nnz, hq, d).view(dtype)
        assert_close_gpu(got, rope_oracle(q_in, positions, d, False, freqs=freqs), dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_gpu_misaligned_views_and_many_tokens(dtype):
    import cupy as cp
    # views of one layout (row stride 200 elements) starting at element 0 and at element 1 of their
    # buffer: the first is read in 8-byte runs, the second (same launch plan) in 2-byte accesses
    q, k = qk(9, 3, 2, 64, dtype, seed=13)
    raw_q = cp.zeros((9, 200), cp.uint16)
    pos = np.arange(9) * 7919
    for start in (0, 1, 0):
        raw_q[:, start:start + 192] = _dev(cp, q).reshape(9, -1).view(cp.uint16)
        qv = raw_q[:, start:start + 192].reshape(9, 3, 64)
        qv = qv if dtype == BF16 else qv.view(cp.float16)
        for interleave in (False, True):
            q_rope, _ = rope.apply_rope_pos_ids(qv, _dev(cp, k), cp.asarray(pos), interleave=interleave)
            assert_close_gpu(_host(cp, q_rope, dtype), rope_oracle(q, pos, 64, interleave), dtype)
    # more tokens than the grid has warps: each warp loops over tokens
    q, k = qk(50000, 1, 1, 64, dtype, seed=14)
    pos = np.random.default_rng(14).integers(0, 100000, 50000)
    q_rope, k_rope = rope.apply_rope_pos_ids(_dev(cp, q), _dev(cp, k), cp.asarray(pos, cp.int32))
    assert_close_gpu(_host(cp, k_rope, dtype), rope_oracle(k, pos, 64, False), dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_gpu_ragged_search_over_many_requests_and_single_tokens(dtype):
    import cupy as cp
    # 1500 requests (3 rounds of rope.cu's 32-way search), many empty, first and last ones included
    lengths = np.random.default_rng(17).integers(0, 4, 1500)
    lengths[[0, 1, -1]] = [0, 2, 3]
    indptr, offsets, positions = ragged(lengths, seed=17)
    nnz = int(indptr[-1])
    q, k = qk(nnz, 4, 1, 128, dtype, seed=17)
    for index_dtype in (np.int32, np.int64):
        q_rope, k_rope = rope.apply_rope(_dev(cp, q), _dev(cp, k), cp.asarray(indptr, index_dtype),
                                         cp.asarray(offsets, index_dtype), rotary_dim=64)
        assert_close_gpu(_host(cp, q_rope, dtype), rope_oracle(q, positions, 64, False), dtype)
        assert_close_gpu(_host(cp, k_rope, dtype), rope_oracle(k, positions, 64, False), dtype)
        assert np.array_equal(_host(cp, k_rope, dtype)[..., 64:], k[..., 64:])
    # one token (decode of one request): every form, heads split over blocks
    q1, k1 = qk(1, 32, 8, 128, dtype, seed=18)
    pos = np.array([123457])
    for interleave in (False, True):
        got = rope.apply_rope_pos_ids(_dev(cp, q1), _dev(cp, k1), cp.asarray(pos), interleave=interleave)
        assert_close_gpu(_host(cp, got[0], dtype), rope_oracle(q1, pos, 128, interleave), dtype)
        got = rope.apply_rope(_dev(cp, q1), _dev(cp, k1), cp.asarray([0, 1], cp.int32), cp.asarray(pos, cp.int32),
                              rotary_dim=64, interleave=interleave)
        assert_close_gpu(_host(cp, got[1], dtype), rope_oracle(k1, pos, 64, interleave), dtype)
        assert np.array_equal(_host(cp, got[1], dtype)[..., 64:], k1[..., 64:])


@pytest.mark.gpu
@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("nnz", [33, 9000])      # 9000: every warp loops over tokens (positions read ahead)
@pytest.mark.parametrize("rot", [64, 128])       # 128: the returning form has no tail (rope.cu's cache entries)
def test_gpu_cos_sin_cache_form_matches_numpy_path(is_neox, nnz, rot):
    import cupy as cp
    hq, hk, hs = 8, 2, 128
    q, k = qk(nnz, hq, hk, hs, np.float16, seed=15)
    cache = vllm_cache(2048, rot)
    positions = np.random.default_rng(15).integers(0, 2048, nnz)
    query, key = q.reshape(nnz, -1), k.reshape(nnz, -1)
    ref = rope.apply_rope_with_cos_sin_cache(positions, query, key, hs, cache, is_neox=is_neox)
    dq, dk = cp.asarray(query), cp.asarray(key)
    out = rope.apply_rope_with_cos_sin_cache(cp.asarray(positions), dq, dk, hs, cp.asarray(cache), is_neox=is_neox)
    for got, want, x in zip(out, ref, (q, k)):
        assert got.shape == want.shape
        assert_close_gpu(cp.asnumpy(got), want.astype(np.float64), np.dtype(np.float16))
        assert_close_gpu(cp.asnumpy(got).reshape(x.shape), cache_rope64(x, cache, positions, rot, is_neox),
                         np.dtype(np.float16))
    rope.apply_rope_with_cos_sin_cache_inplace(cp.asarray(positions), dq, dk, hs, cp.asarray(cache), is_neox=is_neox)
    assert cp.array_equal(dq, out[0]) and cp.array_equal(dk, out[1])
    # positions outside the cache (not checked on the GPU) give NaN for those tokens, and nothing else
    bad = positions.copy()
    worse = [4, nnz - 1] + ([nnz // 2, nnz // 2 + 1] if nnz > 100 else [])
    bad[worse] = [2048, -1] + ([1 << 40, -(1 << 40)] if nnz > 100 else [])
    q_bad, _ = rope.apply_rope_with_cos_sin_cache(cp.asarray(bad), cp.asarray(query), cp.asarray(key), hs,
                                                  cp.asarray(cache), is_neox=is_neox)
    q_bad = cp.asnumpy(q_bad).reshape(nnz, hq, hs)
    assert np.all(np.isnan(q_bad[worse, :, :rot])) and np.array_equal(q_bad[worse, :, rot:], q[worse, :, rot:])
    assert np.all(np.isfinite(np.delete(q_bad, worse, axis=0)))


@pytest.mark.gpu
def test_gpu_rejects_host_metadata_and_float_positions():
    import cupy as cp
    q, k = qk(4, 2, 1, 64, np.float16)
    dq, dk = cp.asarray(q), cp.asarray(k)
    with pytest.raises(ValueError, match="pos_ids is on the CPU but q is on the GPU"):
        rope.apply_rope_pos_ids(dq, dk, np.arange(4))
    with pytest.raises(TypeError, match="pos_ids must be int32 or int64 on the GPU"):
        rope.apply_rope_pos_ids(dq, dk, cp.arange(4, dtype=cp.float32))
    with pytest.raises(TypeError, match="indptr and offsets must have the same dtype"):
        rope.apply_rope(dq, dk, cp.asarray([0, 4], cp.int32), cp.asarray([0], cp.int64))
    with pytest.raises(ValueError, match="indptr describes no requests"):
        rope.apply_rope(dq, dk, cp.asarray([0], cp.int32), cp.asarray([], cp.int32))
    empty = rope.apply_rope_pos_ids(dq[:0], dk[:0], cp.arange(0))
    assert empty[0].shape == (0, 2, 64)


@pytest.mark.gpu
def test_gpu_torch_tensors_bf16_inplace_on_torch_stream():
    torch = pytest.importorskip("torch")
    q, k = qk(19, 4, 2, 128, BF16, seed=16)
    tq = torch.from_numpy(q.view(np.int16).copy()).view(torch.bfloat16).cuda()      # the bits of q
    tk = torch.from_numpy(k.view(np.int16).copy()).view(torch.bfloat16).cuda()
    pos = torch.arange(19, device="cuda", dtype=torch.int64) * 31337
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        rope.apply_rope_pos_ids_inplace(tq, tk, pos, interleave=True)
    stream.synchronize()
    got = tq.cpu().view(torch.int16).numpy().view(BF16)
    assert_close_gpu(got, rope_oracle(q, pos.cpu().numpy(), 128, True), BF16)
    q_rope, _ = rope.apply_rope_pos_ids(tk, tk, pos)
    assert isinstance(q_rope, torch.Tensor) and q_rope.dtype == torch.bfloat16 and q_rope.is_cuda


def lane_elements(layout, rot, head_dim, interleave):
    """The row elements each lane of a row touches under rope.cu's vector layout (lane_span there:
    sub-lane s < rot / 2 / P rotates pairs sP.., interleaved at 2sP.., NeoX at sP.. and rot/2 + sP..;
    the lanes past them copy the 2P elements at 2sP)."""
    p, half = layout.pairs, rot // 2
    out = []
    for s in range(layout.lanes_per_row):
        if s * p < half and not interleave:
            out.append(list(range(p * s, p * s + p)) + list(range(half + p * s, half + p * s + p)))
        else:
            out.append(list(range(2 * p * s, 2 * p * s + 2 * p)))
    return out


LAYOUTS = [(2, 2), (16, 16), (18, 96), (32, 64), (36, 64), (40, 40), (64, 128), (96, 96), (128, 128),
           (256, 256), (512, 512), (32, 80), (64, 80), (16, 512), (64, 576)]     # (rotary_dim, head_dim)


@pytest.mark.parametrize("interleave", [False, True], ids=["neox", "interleave"])
@pytest.mark.parametrize("cover", [False, True], ids=["inplace", "returning"])
@pytest.mark.parametrize("rot,head_dim", LAYOUTS, ids=[f"rot{r}-hd{d}" for r, d in LAYOUTS])
def test_vector_layout_lanes_own_each_element_once(rot, head_dim, cover, interleave):
    """Rotated elements once each (pairs whole: a NeoX lane holds j and rot/2 + j), and with copy lanes
    (the returning forms) the tail once each, with a row's lanes within a warp."""
    strides = [head_dim * 2, 40 * head_dim * 2]
    layout = rope._vector_layout(rot, head_dim, interleave, cover and rot < head_dim, strides)
    half = rot // 2
    if layout.access == 0:              # no P fits: one warp a row, lane l owns pairs l + 32i
        assert layout.lanes_per_row == 32 and 32 * layout.pairs >= half
        return
    assert layout.pairs in (1, 2, 4, 8) and half % layout.pairs == 0 and layout.lanes_per_row <= 32
    touched = sorted(e for lane in lane_elements(layout, rot, head_dim, interleave) for e in lane)
    covered = head_dim if layout.lanes_per_row * layout.pairs > half else rot
    assert touched == list(range(covered))
    if cover and rot < head_dim and head_dim <= 512 and (head_dim - rot) % 16 == 0 and rot % 16 == 0:
        assert covered == head_dim and layout.pairs == 8       # serving shapes copy their tails in-lane
    for n_bytes in strides:             # the accesses the strides allow
        assert n_bytes % layout.access == 0


def test_vector_layout_falls_back_to_narrower_accesses_for_odd_strides():
    assert rope._vector_layout(128, 128, False, False, [256]) == (8, 8, 16)
    assert rope._vector_layout(128, 128, False, False, [264]) == (4, 16, 8)     # 8-byte runs fit 264
    assert rope._vector_layout(128, 128, False, False, [258]) == (rope._lane_pairs(128), 32, 0)   # 2-byte path
    assert rope._vector_layout(64, 128, False, False, [258]) == (1, 32, 2)      # one pair a lane, 32 lanes
    assert rope._vector_layout(64, 128, False, True, [256]) == (8, 8, 16)       # 4 rotating + 4 copy lanes
    assert rope._vector_layout(64, 128, False, False, [256]) == (8, 4, 16)      # in place: rotated part only


@pytest.mark.gpu
def test_gpu_cos_sin_cache_forms_are_memcheck_clean():
    assert "sanitize_rope: done" in memcheck("sanitize_rope.py")
