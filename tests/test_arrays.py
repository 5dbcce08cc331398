import numpy as np
import pytest

from cuattn import arrays


def test_as_dtype_accepts_strings_numpy_and_torch_dtypes():
    assert arrays.as_dtype("bf16", "x", "f") == arrays.bfloat16
    assert arrays.as_dtype(np.float16, "x", "f") == np.float16
    assert arrays.as_dtype("float8_e4m3fn", "x", "f") == arrays.float8_e4m3
    with pytest.raises(TypeError, match="x must be a dtype"):
        arrays.as_dtype(object(), "x", "f")
    torch = pytest.importorskip("torch")
    assert arrays.as_dtype(torch.bfloat16, "x", "f") == arrays.bfloat16


def test_host_array_rejects_negative_and_non_unit_inner_strides():
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    with pytest.raises(ValueError, match="x must not have negative strides"):
        arrays.host_array(a[::-1], "x", "f")
    with pytest.raises(ValueError, match="contiguous in its last dimension"):
        arrays.host_array(a[:, ::2], "x", "f")
    assert arrays.host_array(a[1:], "x", "f").base is not None   # a view, not a copy


def test_numpy_context_runs_on_cpu():
    ctx = arrays.context_of("f", {"a": np.zeros(3), "b": np.ones(2)})
    assert not ctx.on_gpu and ctx.framework == "numpy"


def test_torch_cpu_round_trip_is_zero_copy():
    torch = pytest.importorskip("torch")
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn):
        t = torch.randn(5, 8).to(dtype)
        a = arrays.host_array(t, "t", "f")
        assert a.ctypes.data == t.data_ptr()
        assert a.dtype == arrays._torch_to_numpy_dtype(dtype)
        back = arrays.export(arrays.Context("torch", -1, None), a)
        assert back.data_ptr() == t.data_ptr() and back.dtype == dtype


def test_jax_cpu_import_is_zero_copy():
    jax = pytest.importorskip("jax")
    x = jax.device_put(jax.numpy.arange(16, dtype=jax.numpy.float32).reshape(4, 4), jax.devices("cpu")[0])
    a = arrays.host_array(x, "x", "f")
    assert a.ctypes.data == x.unsafe_buffer_pointer()
    np.testing.assert_array_equal(a, np.arange(16, dtype=np.float32).reshape(4, 4))


def test_mixing_cpu_frameworks_and_devices_is_reported():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU to mix devices")
    with pytest.raises(ValueError, match="b is on the GPU but a is on the CPU"):
        arrays.context_of("f", {"a": np.zeros(2), "b": torch.zeros(2, device="cuda")})


@pytest.mark.gpu
def test_gpu_frameworks_are_imported_zero_copy():
    cp = arrays.cupy_module()
    x = cp.arange(32, dtype=cp.float16).reshape(4, 8)
    t = arrays.device_tensor(x, "x", "f")
    assert t.ptr == x.data.ptr and t.shape == (4, 8) and t.strides == (8, 1)
    torch = pytest.importorskip("torch")
    y = torch.randn(4, 8, device="cuda").to(torch.bfloat16)
    ty = arrays.device_tensor(y, "y", "f")
    assert ty.ptr == y.data_ptr() and ty.dtype == arrays.bfloat16
    with pytest.raises(ValueError, match="negative strides"):
        arrays.device_tensor(x[::-1], "x", "f")
    with pytest.raises(TypeError, match="y is a torch array but x is a cupy array"):
        arrays.context_of("f", {"x": x, "y": y})
    jax = pytest.importorskip("jax")
    z = jax.device_put(jax.numpy.ones((4, 8), jax.numpy.float16), jax.devices("gpu")[0])
    tz = arrays.device_tensor(z, "z", "f")
    assert tz.ptr == z.unsafe_buffer_pointer()


def test_import_and_cpu_path_work_without_cupy_and_gpu_calls_say_what_to_install():
    import subprocess
    import sys
    script = (
        "import sys; sys.modules['cupy'] = None\n"           # makes `import cupy` fail
        "import numpy as np, cuattn\n"
        "c = cuattn.PagedKVCache(1, 1, 8, 4, 4)\n"
        "s = c.add_sequence(); b = c.reserve([s], [3])\n"
        "c.append(0, np.ones((3, 1, 8), np.float16), np.ones((3, 1, 8), np.float16), b)\n"
        "try:\n"
        "    cuattn.PagedKVCache(1, 1, 8, 4, 4, device='cuda')\n"
        "except cuattn.DeviceUnavailableError as e:\n"
        "    print('ERR', e)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "ERR" in out.stdout and 'pip install "cuattn[cu12]"' in out.stdout


@pytest.mark.skipif(arrays.gpu_available(), reason="checks the no-GPU message")
def test_gpu_cache_without_a_gpu_raises_a_clear_error():
    pytest.importorskip("cupy")
    import cuattn
    with pytest.raises(cuattn.DeviceUnavailableError, match="no usable CUDA GPU"):
        cuattn.PagedKVCache(1, 1, 8, 4, 4, device="cuda")
