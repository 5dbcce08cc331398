import math

import ml_dtypes
import numpy as np
import pytest

from cuattn import arrays, jit, norm
from cuattn.errors import UnsupportedError
from tests.gpu_arrays import from_gpu, nan_like, to_gpu

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = [np.dtype(np.float16), BF16]
DTYPE_IDS = ["f16", "bf16"]
HIDDEN = [128, 4099, 16384]          # 4099: not a multiple of 8 (scalar path, misaligned rows)
TOL = {np.dtype(np.float16): 2e-3, BF16: 1e-2}
MODES = ["latency", "throughput"]     # the two block shapes of NormSpec.threads: a thread per 8 / per 32 elements


def rows_for(mode, hidden):
    """Rows that make a call of ``hidden`` take the block shape ``mode``."""
    rows = 37 if mode == "latency" else norm._LATENCY_ELEMENTS // hidden + 3
    assert (rows * hidden <= norm._LATENCY_ELEMENTS) == (mode == "latency")
    return rows


# ---------------------------------------------------------------------------- float64 oracle


def rmsnorm64(x, w, eps, weight_bias=0.0):
    x = np.asarray(x, np.float64)
    rms = np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return x / rms * (np.asarray(w, np.float64) + weight_bias)


def layernorm64(x, gamma, beta, eps):
    x = np.asarray(x, np.float64)
    mean = x.mean(axis=-1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * np.asarray(gamma, np.float64) + np.asarray(beta, np.float64)


def assert_close(got, ref, dtype):
    """Elementwise: |got - ref| <= tol * (|ref| + rms(ref)), and the error's norm <= tol * ||ref||."""
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    assert got.shape == ref.shape
    if not ref.size:
        return
    tol = TOL[np.dtype(dtype)]
    assert np.all(np.isfinite(got)), "non-finite values (unwritten NaN poison?)"
    scale = math.sqrt(np.mean(ref * ref))
    err = np.abs(got - ref)
    worst = np.unravel_index(np.argmax(err - tol * (np.abs(ref) + scale)), ref.shape)
    assert np.all(err <= tol * (np.abs(ref) + scale)), (worst, got[worst], ref[worst])
    assert np.linalg.norm(got - ref) <= tol * np.linalg.norm(ref)


def randn(rng, shape, dtype, scale=1.0, shift=0.0):
    """Random values that are never all zero: normal * scale + shift, rounded to dtype."""
    return (rng.standard_normal(shape) * scale + shift).astype(dtype)


# ---------------------------------------------------------------------------- NumPy path


@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("gemma", [False, True], ids=["rmsnorm", "gemma"])
def test_rmsnorm_matches_float64_formula(gemma, dtype, hidden):
    rng = np.random.default_rng(hidden)
    x = randn(rng, (5, hidden), dtype, scale=3.0)
    w = randn(rng, (hidden,), dtype)
    op = norm.gemma_rmsnorm if gemma else norm.rmsnorm
    y = op(x, w, 1e-5)
    assert y.dtype == dtype and y.shape == x.shape
    assert_close(y, rmsnorm64(x, w, 1e-5, 1.0 if gemma else 0.0), dtype)


def test_rmsnorm_of_heads_takes_a_strided_3d_view():
    rng = np.random.default_rng(1)
    qkv = randn(rng, (6, 3 * 4, 128), np.float16)
    q = qkv[:, :4]                                  # (tokens, heads, head_dim), non-contiguous rows
    w = randn(rng, (128,), np.float16)
    y = norm.rmsnorm(q, w)
    assert y.shape == (6, 4, 128)
    assert_close(y, rmsnorm64(q, w, 1e-6), np.float16)


def test_rmsnorm_writes_out_in_place_and_returns_it():
    rng = np.random.default_rng(2)
    x = randn(rng, (3, 4099), BF16)
    w = randn(rng, (4099,), BF16)
    ref = rmsnorm64(x, w, 1e-6)
    out = np.full_like(x, np.nan)
    assert norm.rmsnorm(x, w, out=out) is out
    assert_close(out, ref, BF16)
    assert norm.rmsnorm(x, w, out=x) is x           # out may be the input itself
    assert_close(x, ref, BF16)


@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("gemma", [False, True], ids=["fused", "gemma_fused"])
def test_fused_add_rmsnorm_updates_residual_and_input(gemma, dtype, hidden):
    rng = np.random.default_rng(hidden + 1)
    x = randn(rng, (4, hidden), dtype)
    r = randn(rng, (4, hidden), dtype, scale=2.0, shift=0.5)
    w = randn(rng, (hidden,), dtype)
    total = x.astype(np.float64) + r.astype(np.float64)
    op = norm.gemma_fused_add_rmsnorm if gemma else norm.fused_add_rmsnorm
    assert op(x, r, w, 1e-6) is None
    assert_close(r, total, dtype)                                   # residual += input
    assert_close(x, rmsnorm64(total, w, 1e-6, 1.0 if gemma else 0.0), dtype)


@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_layernorm_matches_float64_formula(dtype, hidden):
    rng = np.random.default_rng(hidden + 2)
    x = randn(rng, (5, hidden), dtype, scale=2.0, shift=3.0)          # a mean far from 0
    gamma = randn(rng, (hidden,), np.float32)
    beta = randn(rng, (hidden,), np.float32)
    y = norm.layernorm(x, gamma, beta, 1e-5)
    assert y.dtype == dtype
    assert_close(y, layernorm64(x, gamma, beta, 1e-5), dtype)


def test_norms_of_zero_rows_return_empty_results():
    w = np.ones(4099, np.float16)
    x = np.empty((0, 4099), np.float16)
    assert norm.rmsnorm(x, w).shape == (0, 4099)
    assert norm.gemma_rmsnorm(np.empty((0, 8, 4099), np.float16), w).shape == (0, 8, 4099)
    assert norm.fused_add_rmsnorm(x, np.empty_like(x), w) is None
    assert norm.layernorm(x, np.ones(4099, np.float32), np.zeros(4099, np.float32)).shape == (0, 4099)


def test_fused_add_spec_follows_the_call_size_and_the_row_limits():
    for hidden, groups in [(4096, 1), (4099, 1), (8192, 1), (8200, 4), (16384, 4), (32768, 4)]:
        big = norm._LATENCY_ELEMENTS // hidden + 1
        spec = norm.fused_add_spec("bf16", hidden, big)
        assert spec.max_groups == groups and spec.max_hidden >= hidden
        assert spec.threads(hidden, big) * 8 * spec.max_groups >= hidden
        assert norm.fused_add_spec("bf16", hidden, 1).max_groups == 4      # small calls: max_groups 4


def test_fused_add_entry_picks_the_register_pipelined_form_for_large_aligned_calls():
    big = norm._LATENCY_ELEMENTS // 4096 + 1
    assert norm.fused_add_entry("bf16", 4096, big, 1) == "cuattn_fused_add_rmsnorm_regs"
    assert norm.fused_add_entry("f16", 8192, big, 1) == "cuattn_fused_add_rmsnorm_regs"
    assert norm.fused_add_entry("bf16", 8192, big, 1) == "cuattn_fused_add_rmsnorm"     # measured faster there
    assert norm.fused_add_entry("f16", 4096, big, 0) == "cuattn_fused_add_rmsnorm"      # 2-byte accesses
    assert norm.fused_add_entry("f16", 4096, 4, 1) == "cuattn_fused_add_rmsnorm"        # small call
    assert norm.fused_add_entry("f16", 16384, big, 1) == "cuattn_fused_add_rmsnorm"     # max_groups 4


def test_layernorm_geometry_runs_large_16_byte_calls_up_to_8192_two_rows_a_thread():
    spec = norm.NormSpec("bf16")
    assert spec.layernorm_geometry(4096, 4) == ("cuattn_layernorm", 512, 1, 512)          # small: a row a block
    assert spec.layernorm_geometry(16384, 4096)[0::2] == ("cuattn_layernorm", 1)          # hidden > 8192
    assert spec.layernorm_geometry(4096, 4096, vec=False) == ("cuattn_layernorm", 128, 1, 128)  # 2-byte accesses
    for hidden in (64, 1000, 4090, 4096, 4099, 7000, 8192):
        rows = norm._LATENCY_ELEMENTS // hidden + 1
        entry, threads, per_block, block = spec.layernorm_geometry(hidden, rows)
        assert entry == "cuattn_layernorm_rows"
        assert threads * 4 * 2 * spec.max_groups >= hidden                     # QUADS quads a thread cover a row
        assert block == max(1, norm._ROWS_BLOCK // threads) * threads <= 256   # the kernel's launch bound
        assert per_block == block // threads * 2                               # two rows a sub-block
    assert spec.layernorm_geometry(4096, 4096) == ("cuattn_layernorm_rows", 128, 2, 128)   # serving sizes
    assert spec.layernorm_geometry(8192, 4096) == ("cuattn_layernorm_rows", 256, 2, 256)


def test_norms_reject_bad_inputs_naming_the_argument():
    x = np.ones((2, 64), np.float16)
    w = np.ones(64, np.float16)
    with pytest.raises(ValueError, match="rmsnorm: weight must have shape"):
        norm.rmsnorm(x, np.ones(63, np.float16))
    with pytest.raises(TypeError, match="rmsnorm: weight must have the dtype of input"):
        norm.rmsnorm(x, w.astype(BF16))
    with pytest.raises(TypeError, match="rmsnorm: input must be float16 or bfloat16"):
        norm.rmsnorm(x.astype(np.float32), w)
    with pytest.raises(ValueError, match="rmsnorm: input must have shape"):
        norm.rmsnorm(np.ones(64, np.float16), w)
    with pytest.raises(ValueError, match="gemma_rmsnorm: out must have the shape"):
        norm.gemma_rmsnorm(x, w, out=np.empty((2, 65), np.float16))
    with pytest.raises(TypeError, match="rmsnorm: out must have the dtype"):
        norm.rmsnorm(x, w, out=np.empty((2, 64), np.float32))
    with pytest.raises(ValueError, match="hidden_size .* must be >= 1"):
        norm.rmsnorm(np.ones((2, 0), np.float16), np.ones(0, np.float16))
    with pytest.raises(UnsupportedError, match="hidden_size=32776 has no kernel"):
        norm.rmsnorm(np.ones((1, 32776), np.float16), np.ones(32776, np.float16))


def test_fused_add_rmsnorm_rejects_bad_and_unwritable_arrays_naming_the_argument():
    x = np.ones((2, 64), BF16)
    w = np.ones(64, BF16)
    with pytest.raises(ValueError, match="fused_add_rmsnorm: residual must have the shape"):
        norm.fused_add_rmsnorm(x, np.ones((3, 64), BF16), w)
    with pytest.raises(TypeError, match="fused_add_rmsnorm: residual must have the dtype"):
        norm.fused_add_rmsnorm(x, np.ones((2, 64), np.float16), w)
    with pytest.raises(ValueError, match="input must have shape \\(batch, hidden_size\\)"):
        norm.fused_add_rmsnorm(np.ones((2, 2, 64), BF16), np.ones((2, 2, 64), BF16), w)
    with pytest.raises(ValueError, match="input and residual must be different arrays"):
        norm.fused_add_rmsnorm(x, x, w)
    frozen = np.ones((2, 64), BF16)
    frozen.flags.writeable = False
    with pytest.raises(TypeError, match="gemma_fused_add_rmsnorm: residual must be writable"):
        norm.gemma_fused_add_rmsnorm(x, frozen, w)
    with pytest.raises(TypeError, match="fused_add_rmsnorm: input must be writable"):
        norm.fused_add_rmsnorm(frozen, x, w)


def jax_cpu(x):
    jax = pytest.importorskip("jax")
    return jax.device_put(np.asarray(x), jax.devices("cpu")[0])


def test_in_place_norms_refuse_jax_arrays_naming_the_argument():
    x = np.ones((2, 64), np.float16)
    w = np.ones(64, np.float16)
    with pytest.raises(TypeError, match="fused_add_rmsnorm: input must be a mutable array"):
        norm.fused_add_rmsnorm(jax_cpu(x), np.ones_like(x), w)
    with pytest.raises(TypeError, match="rmsnorm: out must be a mutable array"):
        norm.rmsnorm(x, w, out=jax_cpu(x))
    y = norm.rmsnorm(jax_cpu(x), jax_cpu(w))                  # the returning form hands back JAX
    assert type(y).__module__.startswith("jax") and y.shape == (2, 64)


def test_layernorm_rejects_bad_inputs_naming_the_argument():
    x = np.ones((2, 64), BF16)
    g, b = np.ones(64, np.float32), np.zeros(64, np.float32)
    with pytest.raises(TypeError, match="layernorm: gemma must be float32"):
        norm.layernorm(x, g.astype(BF16), b)
    with pytest.raises(ValueError, match="layernorm: beta must have shape"):
        norm.layernorm(x, g, np.zeros(65, np.float32))
    with pytest.raises(TypeError, match="layernorm: input must be float16 or bfloat16"):
        norm.layernorm(x.astype(np.float32), g, b)


@pytest.mark.parametrize("arch", jit.SHIPPED_ARCHS)
def test_shipped_norm_kernels_compile_without_spills(arch):
    for spec in norm.shipped_specs():
        resources = jit.compile_kernel(spec, arch).resources
        assert set(resources) == {"cuattn_rmsnorm", "cuattn_fused_add_rmsnorm", "cuattn_layernorm",
                                  "cuattn_layernorm_rows"} | ({"cuattn_fused_add_rmsnorm_regs"} if spec.max_groups == 1
                                                              else set()) or not resources
        if spec.max_groups == 1 and spec.dtype == "bf16" and resources:  # keeps 2048 threads an SM
            assert resources["cuattn_fused_add_rmsnorm"]["registers"] <= 32, resources
        if resources:                         # 3 blocks of 256 an SM (two rows of 8192 a thread need 80)
            assert resources["cuattn_layernorm_rows"]["registers"] <= 80, resources
        for entry, r in resources.items():
            assert r["spill_stores"] == 0 and r["spill_loads"] == 0 and r["stack_frame"] == 0, (spec.name, entry, r)


# ---------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("hidden", HIDDEN + [4096])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("gemma", [False, True], ids=["rmsnorm", "gemma"])
def test_rmsnorm_gpu_matches_float64_formula(gemma, dtype, hidden, mode):
    rng = np.random.default_rng(hidden + 10)
    x = randn(rng, (rows_for(mode, hidden), hidden), dtype, scale=3.0)
    w = randn(rng, (hidden,), dtype)
    op = norm.gemma_rmsnorm if gemma else norm.rmsnorm
    ref = rmsnorm64(x, w, 1e-5, 1.0 if gemma else 0.0)
    out = nan_like(x.shape, dtype)
    assert op(to_gpu(x), to_gpu(w), 1e-5, out=out) is out
    assert_close(from_gpu(out, dtype), ref, dtype)
    assert_close(from_gpu(op(to_gpu(x), to_gpu(w), 1e-5, enable_pdl=False), dtype), ref, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_rmsnorm_gpu_strided_heads_and_misaligned_rows(dtype):
    rng = np.random.default_rng(11)
    # (tokens, heads, head_dim) view of a fused qkv array: 16-byte path with two row strides
    qkv = to_gpu(randn(rng, (9, 3 * 8, 128), dtype))
    q = qkv[:, :8]
    w = randn(rng, (128,), dtype)
    out = nan_like(q.shape, dtype)
    norm.rmsnorm(q, to_gpu(w), out=out)
    assert_close(from_gpu(out, dtype), rmsnorm64(from_gpu(q, dtype), w, 1e-6), dtype)
    # rows that start 2 bytes past a 16-byte boundary, of a stride that is no multiple of 8
    big = to_gpu(randn(rng, (7, 4100), dtype))
    x = big[:, 1:]
    w = randn(rng, (4099,), dtype)
    y = norm.rmsnorm(x, to_gpu(w))
    assert_close(from_gpu(y, dtype), rmsnorm64(from_gpu(x, dtype), w, 1e-6), dtype)
    # in place: out is the input
    ref = rmsnorm64(from_gpu(x, dtype), w, 1e-6)
    norm.rmsnorm(x, to_gpu(w), out=x)
    assert_close(from_gpu(x, dtype), ref, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("gemma", [False, True], ids=["fused", "gemma_fused"])
def test_fused_add_rmsnorm_gpu_updates_residual_and_input(gemma, dtype, hidden, mode):
    check_fused_add_gpu(gemma, dtype, rows_for(mode, hidden), hidden, np.random.default_rng(hidden + 12))


def check_fused_add_gpu(gemma, dtype, rows, hidden, rng):
    """(gemma_)fused_add_rmsnorm on the GPU: residual and input against float64, and the residual bit for bit
    as the NumPy path computes it (one rounding of the float32 sum)."""
    x = randn(rng, (rows, hidden), dtype)
    r = randn(rng, (rows, hidden), dtype, scale=2.0, shift=0.5)
    w = randn(rng, (hidden,), dtype)
    total = x.astype(np.float64) + r.astype(np.float64)
    dx, dr = to_gpu(x), to_gpu(r)
    op = norm.gemma_fused_add_rmsnorm if gemma else norm.fused_add_rmsnorm
    assert op(dx, dr, to_gpu(w), 1e-6) is None
    assert_close(from_gpu(dr, dtype), total, dtype)
    assert_close(from_gpu(dx, dtype), rmsnorm64(total, w, 1e-6, 1.0 if gemma else 0.0), dtype)
    op(x, r, w, 1e-6)
    np.testing.assert_array_equal(from_gpu(dr, dtype).view(np.uint16), r.view(np.uint16))


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_layernorm_gpu_matches_float64_formula(dtype, hidden, mode):
    rng = np.random.default_rng(hidden + 13)
    x = randn(rng, (rows_for(mode, hidden), hidden), dtype, scale=2.0, shift=3.0)
    gamma = randn(rng, (hidden,), np.float32)
    beta = randn(rng, (hidden,), np.float32)
    import cupy
    y = norm.layernorm(to_gpu(x), cupy.asarray(gamma), cupy.asarray(beta), 1e-5)
    assert_close(from_gpu(y, dtype), layernorm64(x, gamma, beta, 1e-5), dtype)


# (rows, hidden, row stride): large layernorm calls; cuattn_layernorm_rows (two rows a thread, gamma and beta
# through L1) at hidden 8192, 7000, 6144 and 1024 (4 sub-blocks of 32 threads a block), a last block part empty
# (odd rows); cuattn_layernorm (a row a block, gamma and beta from L2) for rows of a stride that is no multiple
# of 8 (2-byte accesses) and hidden 16384
LARGE = [(1001, 8192, 8192), (777, 7000, 7000), (513, 6144, 6144), (4097, 1024, 1024), (301, 4100, 4103),
         (131, 16384, 16384)]


def poison_pool(nbytes):
    """Leave a freed block of NaN bits (0x7FC0: NaN as bf16 and as f16) in CuPy's memory pool, so that a
    fresh output of ``nbytes`` (the pool reuses the block) starts as poison, not as an earlier result."""
    import cupy
    junk = cupy.full(nbytes // 2, 0x7FC0, cupy.uint16)
    cupy.cuda.get_current_stream().synchronize()
    del junk


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [pytest.param(DTYPES[0], marks=pytest.mark.slow), DTYPES[1]], ids=DTYPE_IDS)
def test_layernorm_gpu_large_calls_match_float64_formula(dtype):
    import cupy
    # + the serving sizes over more than one wave of blocks, and 2-byte accesses at 4099
    for rows, hidden, stride in LARGE + [(2500, 4096, 4096), (1500, 8192, 8192), (1203, 4099, 4099)]:
        assert (rows * hidden > norm._LATENCY_ELEMENTS) and (stride >= hidden)
        rng = np.random.default_rng(rows + hidden)
        x = randn(rng, (rows, hidden), dtype, scale=2.0, shift=3.0)
        gamma, beta = randn(rng, (hidden,), np.float32), randn(rng, (hidden,), np.float32)
        raw = to_gpu(np.zeros((rows, stride), dtype))
        view = raw[:, stride - hidden:]          # contiguous, or starting 6 bytes into a row of odd stride
        view[...] = to_gpu(x)
        g_dev, b_dev = cupy.asarray(gamma), cupy.asarray(beta)
        poison_pool(2 * rows * hidden)
        y = norm.layernorm(view, g_dev, b_dev, 1e-5)
        assert_close(from_gpu(y, dtype), layernorm64(x, gamma, beta, 1e-5), dtype)
    # rows of 4092 read at an aligned stride of 4096 (the output's, 4092 contiguous, make it 2-byte accesses)
    rng = np.random.default_rng(17)
    raw = to_gpu(randn(rng, (1500, 4096), dtype, scale=2.0, shift=-1.0))
    view = raw[:, :4092]
    gamma, beta = randn(rng, (4092,), np.float32), randn(rng, (4092,), np.float32)
    g_dev, b_dev = cupy.asarray(gamma), cupy.asarray(beta)
    poison_pool(2 * 1500 * 4092)
    y = norm.layernorm(view, g_dev, b_dev, 1e-5)
    assert_close(from_gpu(y, dtype), layernorm64(from_gpu(view, dtype), gamma, beta, 1e-5), dtype)


# large layernorm calls on rows that stress the statistics (layernorm_rows_mix): (rows, hidden, row stride);
# hidden 4096 / 8192 at 1101 rows: cuattn_layernorm_rows' branch-free blocks (2 rows a block) and a last block
# with one row; 1000: rows of 32 threads sharing blocks (8 rows a block), 2001 rows: a last block part empty; 7000:
# threads with fewer quads; hidden no multiple of 8 (the output's rows, contiguous, then allow no 16-byte
# accesses): cuattn_layernorm, 4090 read at a stride of 4096, 4099 contiguous
MIX_SHAPES = [(1101, 4096, 4096), (1101, 8192, 8192), (1501, 4090, 4096), (2001, 1000, 1000), (777, 7000, 7000),
              (301, 4099, 4099)]


def layernorm_rows_mix(rng, rows, hidden, dtype):
    """Rows that stress the statistics, by row % 5: normal; a mean far from 0 with a small spread (f16: 300 +- 1;
    bf16: 1000 +- 16, spaced 4-8 there); the first element an outlier (2e4) among normal values; all equal
    (variance 0: out = beta); a large spread (5e3)."""
    x = rng.standard_normal((rows, hidden))
    kind = np.arange(rows) % 5
    big_mean, spread = (300.0, 1.0) if dtype == np.float16 else (1000.0, 16.0)
    x[kind == 1] = big_mean + spread * x[kind == 1]
    x[kind == 2, 0] = 2e4
    x[kind == 3] = 0.75
    x[kind == 4] *= 5e3
    return x.astype(dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_layernorm_gpu_large_calls_of_adversarial_rows_match_float64_formula(dtype):
    import cupy
    for rows, hidden, stride in MIX_SHAPES:
        entry = norm.NormSpec("bf16").layernorm_geometry(hidden, rows, hidden % 8 == 0)[0]
        assert entry == ("cuattn_layernorm_rows" if hidden in (4096, 8192, 1000, 7000) else "cuattn_layernorm")
        rng = np.random.default_rng(rows + hidden + 5)
        x = layernorm_rows_mix(rng, rows, hidden, dtype)
        gamma, beta = randn(rng, (hidden,), np.float32), randn(rng, (hidden,), np.float32)
        raw = to_gpu(np.zeros((rows, stride), dtype))
        view = raw[:, :hidden]
        view[...] = to_gpu(x)
        poison_pool(2 * rows * hidden)
        y = norm.layernorm(view, cupy.asarray(gamma), cupy.asarray(beta), 1e-5)
        ref = layernorm64(x, gamma, beta, 1e-5)
        got = from_gpu(y, dtype)
        for kind in range(5):                    # each kind of row against its own scale
            assert_close(got[kind::5], ref[kind::5], dtype)


# fused_add_rmsnorm at large calls: the serving sizes and a non-multiple of 8 (max_groups 1, a thread per 8
# elements), rows past 8192 (16384, 32768: max_groups 4)
FUSED_LARGE_HIDDEN = [4096, pytest.param(8192, marks=pytest.mark.slow), pytest.param(16384, marks=pytest.mark.slow),
                      4099, 32768]          # (slow: same paths as 4096 / 32768; keeps pytest -m gpu within 5 min)


@pytest.mark.gpu
@pytest.mark.parametrize("rows, hidden, dtype", [(2111, 4096, BF16), (1501, 8192, np.dtype(np.float16)),
                                                 (1333, 4000, BF16)])
def test_fused_add_rmsnorm_gpu_persistent_blocks_loop_over_rows(rows, hidden, dtype):
    """The register-pipelined form (cuattn_fused_add_rmsnorm_regs): blocks of one wave loop over several rows
    each, two rows in flight, a last round part empty; 4000: a thread past the row's end."""
    assert norm.fused_add_entry(arrays.SHORT_NAME[np.dtype(dtype)], hidden, rows, 1) == "cuattn_fused_add_rmsnorm_regs"
    check_fused_add_gpu(False, dtype, rows, hidden, np.random.default_rng(rows))


@pytest.mark.gpu
@pytest.mark.parametrize("hidden", FUSED_LARGE_HIDDEN)
@pytest.mark.parametrize("gemma", [False, True], ids=["fused", "gemma_fused"])
def test_fused_add_rmsnorm_gpu_large_calls_update_residual_and_input(gemma, hidden):
    dtype = BF16 if hidden % 2 == 0 else np.dtype(np.float16)
    check_fused_add_gpu(gemma, dtype, rows_for("throughput", hidden), hidden, np.random.default_rng(hidden + 15))


@pytest.mark.gpu
def test_norms_gpu_take_torch_tensors_and_refuse_jax_in_place():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(14)
    x = randn(rng, (5, 4099), BF16)
    r = randn(rng, (5, 4099), BF16)
    w = randn(rng, (4099,), BF16)
    tx, tr, tw = (torch.from_numpy(a.astype(np.float32)).to(torch.bfloat16).cuda() for a in (x, r, w))  # exact
    y = norm.rmsnorm(tx, tw)
    assert isinstance(y, torch.Tensor) and y.dtype == torch.bfloat16 and y.is_cuda
    assert_close(y.float().cpu().numpy(), rmsnorm64(x, w, 1e-6), BF16)
    total = x.astype(np.float64) + r.astype(np.float64)
    norm.fused_add_rmsnorm(tx, tr, tw)
    assert_close(tr.float().cpu().numpy(), total, BF16)
    assert_close(tx.float().cpu().numpy(), rmsnorm64(total, w, 1e-6), BF16)
    jax = pytest.importorskip("jax")
    jx = jax.device_put(np.ones((2, 64), np.float16), jax.devices("gpu")[0])
    with pytest.raises(TypeError, match="fused_add_rmsnorm: input must be a mutable array"):
        norm.fused_add_rmsnorm(jx, jx, jax.device_put(np.ones(64, np.float16), jax.devices("gpu")[0]))


@pytest.mark.gpu
def test_norms_gpu_of_zero_rows_launch_nothing():
    import cupy
    x = cupy.empty((0, 4099), cupy.float16)
    w = cupy.ones(4099, cupy.float16)
    assert norm.rmsnorm(x, w).shape == (0, 4099)
    assert norm.fused_add_rmsnorm(x, cupy.empty_like(x), w) is None
    assert norm.layernorm(x, cupy.ones(4099, cupy.float32), cupy.zeros(4099, cupy.float32)).shape == (0, 4099)
