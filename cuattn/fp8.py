"""FP8 KV caches: the ``k_scale`` / ``v_scale`` arguments shared by decode and append, and the
NumPy (ml_dtypes) conversions of the CPU path.

A scale has FlashInfer's meaning: stored value x scale = real value. It is a Python float, a
1-element array, or an array of shape (num_kv_heads,) (one scale per kv head); on the GPU path a
CUDA float32 array is read by the kernel (no host sync: its values are not checked here), any host
value is checked to be positive and finite.
"""
from __future__ import annotations

import numbers
from typing import Any, NamedTuple

import numpy as np

from . import arrays

FP8_DTYPES = (arrays.float8_e4m3, arrays.float8_e5m2)
MAX_FINITE = {arrays.float8_e4m3: 448.0, arrays.float8_e5m2: 57344.0}


def is_fp8(dtype) -> bool:
    return np.dtype(dtype) in FP8_DTYPES


class Scale(NamedTuple):
    """A checked scale argument: ``value`` (host factor) times ``ptr[head if per_head else 0]``
    when ``ptr`` (a CUDA float32 array) is set; ``host`` the per-head factors on the NumPy path."""
    value: float
    ptr: int
    per_head: bool
    host: np.ndarray | None      # float32 (num_kv_heads,) or None (device array)
    keep: Any                    # the array ptr points into (alive for the launch)


ONE = Scale(1.0, 0, False, None, None)


def parse_scale(x, name: str, num_kv_heads: int, fn: str, *, on_gpu: bool) -> Scale:
    """Check one scale argument (None: 1.0)."""
    if x is None:
        return ONE if on_gpu else ONE._replace(host=np.ones(num_kv_heads, np.float32))
    if isinstance(x, numbers.Real) and not isinstance(x, bool):
        v = float(x)
        if not (np.isfinite(v) and v > 0):
            raise ValueError(f"{fn}: {name} must be a positive finite number, got {x!r}")
        return Scale(v, 0, False, None if on_gpu else np.full(num_kv_heads, v, np.float32), None)   # run()'s hot path
    try:
        device = arrays.is_device_array(x, name, fn)
    except TypeError:
        raise ValueError(f"{fn}: {name} must be a float or an array of shape (1,) or (num_kv_heads,) = "
                         f"({num_kv_heads},), got {type(x).__name__}") from None
    shape = tuple(getattr(x, "shape", ()))
    size = int(np.prod(shape)) if shape else 1
    if len(shape) > 1 or size not in (1, num_kv_heads):
        raise ValueError(f"{fn}: {name} must be a float or an array of shape (1,) or (num_kv_heads,) = "
                         f"({num_kv_heads},), got shape {shape}")
    if device:
        if not on_gpu:
            raise ValueError(f"{fn}: {name} must be a host value on the NumPy path, got a GPU array")
        t = arrays.device_tensor(x, name, fn)
        if t.dtype != np.float32 or not t.is_contiguous():
            raise ValueError(f"{fn}: {name} must be a contiguous float32 array, got {t.dtype} strides {t.strides}")
        return Scale(1.0, t.ptr, size > 1, None, x)
    a = np.asarray(arrays.host_array(x, name, fn), np.float64).reshape(-1)
    if not np.all(np.isfinite(a) & (a > 0)):
        raise ValueError(f"{fn}: {name} must be positive and finite, got {a.tolist()}")
    host = np.broadcast_to(a.astype(np.float32), (num_kv_heads,)).copy()
    if size == 1:
        return Scale(float(host[0]), 0, False, host, None)
    if not on_gpu:
        return Scale(1.0, 0, True, host, None)
    cp = arrays.cupy_module()
    dev = cp.asarray(host)              # a host per-head array on the GPU path: uploaded per call
    return Scale(1.0, dev.data.ptr, True, host, dev)


def dequantize(x: np.ndarray, scale: np.ndarray, head_axis: int) -> np.ndarray:
    """float32 real values of a cache slice (fp8 or 16-bit) times the per-head ``scale`` (None: 1)."""
    if scale is None:
        return x.astype(np.float32)
    shape = [1] * x.ndim
    shape[head_axis] = -1
    return x.astype(np.float32) * scale.reshape(shape)


def quantize(x: np.ndarray, dtype, scale: np.ndarray, head_axis: int) -> np.ndarray:
    """x [..., num_kv_heads, ...] (fp16 / bf16 / fp32) -> ``dtype``: x / scale in float32, then for
    fp8 clipped to +-(max finite) (saturating: no NaN or inf from overflow) and rounded to nearest
    even. The GPU's append (page.cu) computes the same bits."""
    dtype = np.dtype(dtype)
    shape = [1] * x.ndim
    shape[head_axis] = -1
    y = x.astype(np.float32) / scale.astype(np.float32).reshape(shape)
    if dtype in MAX_FINITE:
        m = np.float32(MAX_FINITE[dtype])
        y = np.clip(y, -m, m)
    return y.astype(dtype)
