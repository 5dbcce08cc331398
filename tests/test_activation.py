import math

import ml_dtypes
import numpy as np
import pytest

from cuattn import activation, jit
from tests.gpu_arrays import from_gpu, nan_like, to_gpu

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = [np.dtype(np.float16), BF16]
DTYPE_IDS = ["f16", "bf16"]
SIZES = [128, 4099, 16384]               # d (the input's last dimension is 2 * d); 4099: scalar path
TOL = {np.dtype(np.float16): 2e-3, BF16: 1e-2}
OPS = {"silu": activation.silu_and_mul, "gelu": activation.gelu_and_mul,
       "gelu_tanh": activation.gelu_tanh_and_mul}


# ---------------------------------------------------------------------------- float64 oracle

_erf = np.vectorize(math.erf, otypes=[np.float64])
ACT64 = {
    "silu": lambda x: x / (1.0 + np.exp(-x)),
    "gelu": lambda x: 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0))),
    "gelu_tanh": lambda x: 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3))),
}


def act_and_mul64(act, x):
    x = np.asarray(x, np.float64)
    d = x.shape[-1] // 2
    return ACT64[act](x[..., :d]) * x[..., d:]


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


def randn(rng, shape, dtype):
    return (rng.standard_normal(shape) * 2.5).astype(dtype)


# ---------------------------------------------------------------------------- NumPy path


@pytest.mark.parametrize("d", SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("act", list(OPS))
def test_act_and_mul_matches_float64_formula(act, dtype, d):
    x = randn(np.random.default_rng(d), (5, 2 * d), dtype)
    y = OPS[act](x)
    assert y.dtype == dtype and y.shape == (5, d)
    assert_close(y, act_and_mul64(act, x), dtype)


@pytest.mark.parametrize("act", list(OPS))
def test_act_and_mul_keeps_leading_dimensions_and_writes_out(act):
    x = randn(np.random.default_rng(3), (2, 3, 2 * 96), BF16)
    out = np.full((2, 3, 96), np.nan, BF16)
    assert OPS[act](x, out=out) is out
    assert_close(out, act_and_mul64(act, x), BF16)


def test_silu_and_mul_of_large_negative_gates_is_finite():
    x = np.array([[-100.0, -20.0, 0.0, 30.0, 2.0, 3.0, 4.0, 5.0]], np.float16)
    with np.errstate(invalid="raise", divide="raise"):
        y = activation.silu_and_mul(x)
    assert np.all(np.isfinite(y.astype(np.float32)))
    assert_close(y, act_and_mul64("silu", x), np.float16)


@pytest.mark.parametrize("act", list(OPS))
def test_act_and_mul_of_zero_rows_and_zero_width(act):
    assert OPS[act](np.empty((0, 4099 * 2), np.float16)).shape == (0, 4099)
    assert OPS[act](np.empty((4, 0), BF16)).shape == (4, 0)


def test_act_and_mul_rejects_bad_inputs_naming_the_argument():
    x = np.ones((3, 64), np.float16)
    with pytest.raises(ValueError, match="silu_and_mul: input must have shape \\(..., 2 \\* d\\)"):
        activation.silu_and_mul(np.ones((3, 63), np.float16))
    with pytest.raises(TypeError, match="gelu_and_mul: input must be float16 or bfloat16"):
        activation.gelu_and_mul(x.astype(np.float32))
    with pytest.raises(ValueError, match="gelu_tanh_and_mul: out must have shape"):
        activation.gelu_tanh_and_mul(x, out=np.empty((3, 64), np.float16))
    with pytest.raises(TypeError, match="silu_and_mul: out must have the dtype"):
        activation.silu_and_mul(x, out=np.empty((3, 32), BF16))
    frozen = np.empty((3, 32), np.float16)
    frozen.flags.writeable = False
    with pytest.raises(TypeError, match="silu_and_mul: out must be writable"):
        activation.silu_and_mul(x, out=frozen)


def jax_cpu(x):
    jax = pytest.importorskip("jax")
    return jax.device_put(np.asarray(x), jax.devices("cpu")[0])


def test_act_and_mul_refuses_a_jax_out_and_returns_jax_for_jax_input():
    x = np.ones((3, 64), np.float16)
    with pytest.raises(TypeError, match="silu_and_mul: out must be a mutable array"):
        activation.silu_and_mul(x, out=jax_cpu(np.zeros((3, 32), np.float16)))
    y = activation.gelu_and_mul(jax_cpu(x))
    assert type(y).__module__.startswith("jax") and y.shape == (3, 32)


@pytest.mark.parametrize("arch", jit.SHIPPED_ARCHS)
def test_shipped_activation_kernels_compile_without_spills(arch):
    for spec in activation.shipped_specs():
        resources = jit.compile_kernel(spec, arch).resources
        for entry, r in resources.items():
            assert r["spill_stores"] == 0 and r["spill_loads"] == 0 and r["stack_frame"] == 0, (spec.name, entry, r)
        assert set(resources) == set(activation._ENTRIES.values()) or not resources
        # FlashInfer's occupancy: 2048 threads an SM
        assert all(r["registers"] <= 32 for r in resources.values()), resources


def test_geometry_covers_every_output_once():
    for d in (1, 8, 100, 4096, 4099, 8192, 14336, 16384, 65536):
        threads, chunks = activation.geometry(d)
        assert threads % 32 == 0 and 32 <= threads <= 1024
        assert chunks * threads * 8 >= d > (chunks - 1) * threads * 8
        assert chunks == 1 or threads == 1024              # one block a row up to d = 8192


# ---------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("d", SIZES + [pytest.param(14336, marks=pytest.mark.slow)])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("act", list(OPS))
def test_act_and_mul_gpu_matches_float64_formula(act, dtype, d):
    x = randn(np.random.default_rng(d + 1), (23, 2 * d), dtype)
    out = nan_like((23, d), dtype)
    assert OPS[act](to_gpu(x), out=out) is out
    assert_close(from_gpu(out, dtype), act_and_mul64(act, x), dtype)
    y = OPS[act](to_gpu(x), enable_pdl=False)
    assert_close(from_gpu(y, dtype), act_and_mul64(act, x), dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_act_and_mul_gpu_misaligned_rows_and_leading_dimensions(dtype):
    rng = np.random.default_rng(5)
    # rows starting 2 bytes past a 16-byte boundary, row stride no multiple of 8
    big = to_gpu(randn(rng, (9, 2 * 4099 + 3), dtype))
    x = big[:, 1:1 + 2 * 4099]
    out = nan_like((9, 4099), dtype)
    activation.silu_and_mul(x, out=out)
    assert_close(from_gpu(out, dtype), act_and_mul64("silu", from_gpu(x, dtype)), dtype)
    # (batch, tokens, 2d) with strided rows that still collapse, 16-byte path
    big = to_gpu(randn(rng, (2, 3, 2 * 256 + 8), dtype))
    x = big[:, :, :512]
    y = activation.gelu_tanh_and_mul(x)
    assert y.shape == (2, 3, 256)
    assert_close(from_gpu(y, dtype), act_and_mul64("gelu_tanh", from_gpu(x, dtype)), dtype)
    # leading dimensions that do not collapse into one row stride are refused
    with pytest.raises(ValueError, match="silu_and_mul: input must have leading dimensions that collapse"):
        activation.silu_and_mul(to_gpu(randn(rng, (4, 3, 64), dtype))[:, :2])


@pytest.mark.gpu
def test_act_and_mul_gpu_of_zero_rows_launches_nothing():
    import cupy
    assert activation.silu_and_mul(cupy.empty((0, 2 * 4099), cupy.float16)).shape == (0, 4099)


# serving sizes, a non-multiple of 8 and two chunks a row (14336, 16384: more than 1024 threads' worth of groups)
SERVING_SIZES = [4096, pytest.param(8192, marks=pytest.mark.slow), pytest.param(16384, marks=pytest.mark.slow),
                 pytest.param(14336, marks=pytest.mark.slow), 4099]   # (slow: the same kernel paths as 4096)


@pytest.mark.gpu
@pytest.mark.parametrize("d", SERVING_SIZES)
@pytest.mark.parametrize("act", list(OPS))
def test_act_and_mul_gpu_serving_sizes_match_float64_formula(act, d):
    dtype = BF16 if d % 2 == 0 else np.dtype(np.float16)
    x = randn(np.random.default_rng(d + 7), (19, 2 * d), dtype)
    out = nan_like((19, d), dtype)
    assert OPS[act](to_gpu(x), out=out) is out
    assert_close(from_gpu(out, dtype), act_and_mul64(act, x), dtype)


@pytest.mark.gpu
def test_act_and_mul_gpu_misaligned_and_strided_rows_both_dtypes():
    rng = np.random.default_rng(9)
    for dtype in DTYPES:
        big = to_gpu(randn(rng, (9, 2 * 4099 + 3), dtype))
        x = big[:, 1:1 + 2 * 4099]                       # 2-byte accesses
        out = nan_like((9, 4099), dtype)
        activation.gelu_and_mul(x, out=out)
        assert_close(from_gpu(out, dtype), act_and_mul64("gelu", from_gpu(x, dtype)), dtype)
        big = to_gpu(randn(rng, (5, 2 * 4096 + 64), dtype))
        x = big[:, :2 * 4096]                            # 16-byte path, row stride past 2 * d
        out = nan_like((5, 4096), dtype)
        activation.silu_and_mul(x, out=out)
        assert_close(from_gpu(out, dtype), act_and_mul64("silu", from_gpu(x, dtype)), dtype)

