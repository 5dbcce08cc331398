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
    assert "ERR" in out.stdout and "pip install" in out.stdout and '[cu12]"' in out.stdout   # checkout or wheel form


@pytest.mark.skipif(arrays.gpu_available(), reason="checks the no-GPU message")
def test_gpu_cache_without_a_gpu_raises_a_clear_error():
    pytest.importorskip("cupy")
    import cuattn
    with pytest.raises(cuattn.DeviceUnavailableError, match="no usable CUDA GPU"):
        cuattn.PagedKVCache(1, 1, 8, 4, 4, device="cuda")


# ---------------------------------------------------------------------------- JAX: immutable, traced


def _jax_cpu(x):
    jax = pytest.importorskip("jax")
    return jax.device_put(np.asarray(x), jax.devices("cpu")[0])


def _append_args(cache):
    """append_paged_kv_cache arguments: 3 tokens of one request into page 0 of ``cache``."""
    k = np.ones((3, 1, 8), np.float16)
    return (k, k, np.zeros(3, np.int32), np.arange(3, dtype=np.int32), cache, np.array([0], np.int32),
            np.array([0, 1], np.int32), np.array([3], np.int32))


def test_writable_refuses_jax_and_read_only_arrays_and_passes_mutable_ones():
    arrays.writable(None, "lse", "f")
    arrays.writable(np.zeros(3), "out", "f")
    frozen = np.zeros(3)
    frozen.flags.writeable = False
    with pytest.raises(TypeError, match=r"f: out must be writable to be written in place, got a read-only NumPy"):
        arrays.writable(frozen, "out", "f")
    x = _jax_cpu(np.zeros(3, np.float32))
    with pytest.raises(TypeError, match=r"f: out must be a mutable array \(NumPy, CuPy or PyTorch\) to be written in "
                                        r"place, got a JAX array \(JAX arrays are immutable\); pass a mutable array, "
                                        r"or leave out out= and use the returned array"):
        arrays.writable(x, "out", "f")


def test_append_into_a_jax_cache_says_jax_arrays_are_immutable():
    import cuattn
    cache = np.zeros((2, 2, 4, 1, 8), np.float16)
    jcache = _jax_cpu(cache)
    with pytest.raises(TypeError, match=r"append_paged_kv_cache: paged_kv_cache must be a mutable array .* got a JAX "
                                        r"array \(JAX arrays are immutable\); keep the KV cache in a NumPy"):
        cuattn.append_paged_kv_cache(*_append_args(jcache))
    with pytest.raises(TypeError, match=r"paged_kv_cache\[1\] must be a mutable array"):
        cuattn.append_paged_kv_cache(*_append_args((cache[:, 0].copy(), _jax_cpu(cache[:, 1]))))
    np.testing.assert_array_equal(np.asarray(jcache), cache)     # untouched
    cuattn.append_paged_kv_cache(*_append_args(cache))           # the same call into NumPy storage writes
    assert np.all(cache[0, :, :3] == 1) and not cache[0, :, 3:].any()


def test_cuattn_inside_jax_jit_says_to_call_it_outside_jit():
    jax = pytest.importorskip("jax")
    import cuattn
    rng = np.random.default_rng(0)
    q = _jax_cpu(rng.standard_normal((3, 4, 64)).astype(np.float16))
    cache = _jax_cpu(rng.standard_normal((2, 2, 16, 1, 64)).astype(np.float16))
    page_table = np.array([0, 2], np.int32), np.array([0, 1], np.int32), np.array([5], np.int32)
    prefill = cuattn.BatchPrefillWithPagedKVCacheWrapper()
    prefill.plan(np.array([0, 3], np.int32), *page_table, 4, 1, 64, 16)
    traced = r"must be a concrete array, got a JAX tracer .*cannot be traced by jax.jit: call it outside jit"
    with pytest.raises(TypeError, match=r"BatchPrefillWithPagedKVCacheWrapper.run: q " + traced):
        jax.jit(prefill.run)(q, cache)
    with pytest.raises(TypeError, match=r"BatchPrefillWithPagedKVCacheWrapper.run: paged_kv_cache\[c\] " + traced):
        jax.jit(lambda c: prefill.run(q, c))(cache)
    decode = cuattn.BatchDecodeWithPagedKVCacheWrapper()
    decode.plan(*page_table, 4, 1, 64, 16)
    with pytest.raises(TypeError, match=traced):
        jax.jit(decode.run)(q[:1], cache)
    with pytest.raises(TypeError, match=r"BatchDecodeWithPagedKVCacheWrapper.plan: indptr " + traced):
        jax.jit(lambda indptr: decode.plan(indptr, *page_table[1:], 4, 1, 64, 16))(page_table[0])
    with pytest.raises(TypeError, match=r"merge_state: v_a " + traced):
        jax.vmap(lambda v: cuattn.merge_state(v, np.zeros((2, 4), np.float32), v, np.zeros((2, 4), np.float32)))(
            _jax_cpu(np.zeros((3, 2, 4, 64), np.float16)))
    with pytest.raises(TypeError, match=r"append_paged_kv_cache: paged_kv_cache " + traced):
        jax.jit(lambda c: cuattn.append_paged_kv_cache(*_append_args(c)))(_jax_cpu(np.zeros((2, 2, 4, 1, 8), np.float16)))
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda x: x + 1)(q)), np.asarray(q) + 1)   # JAX itself unharmed
