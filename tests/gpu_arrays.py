"""CuPy round trips for GPU tests of 16-bit ops (bf16 travels as its uint16 bits: CuPy has no bf16)."""
import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)


def to_gpu(x):
    import cupy
    x = np.ascontiguousarray(x)
    return cupy.asarray(x.view(np.uint16) if x.dtype == BF16 else x)


def from_gpu(y, dtype):
    import cupy
    y = cupy.asnumpy(y)
    return y.view(BF16) if dtype == BF16 else y


def nan_like(shape, dtype):
    """A device array of NaN (bf16 as its uint16 bits 0x7fc0)."""
    import cupy
    if dtype == BF16:
        return cupy.full(shape, 0x7FC0, cupy.uint16)
    return cupy.full(shape, np.nan, dtype)
