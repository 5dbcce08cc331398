"""Bit-packed attention masks (FlashInfer's ``packbits`` / ``segment_packbits``).

A custom mask is boolean, True = attend. Packed form: 8 mask entries per uint8, little bit
order (entry ``8 * i + j`` is bit ``j`` of byte ``i``). A batch mask is the concatenation of each
request's flattened ``qo_len x kv_len`` mask; ``segment_packbits`` packs each request separately
so every request starts on a byte boundary, and returns the byte offsets (``mask_indptr``).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from . import arrays

BITORDERS = ("little",)


def _check_bitorder(bitorder: str, fn: str) -> None:
    if bitorder not in BITORDERS:
        raise ValueError(f"{fn}: bitorder must be 'little' (the order the kernels read), got {bitorder!r}")


def _device_bool(x: Any, name: str, fn: str):
    t = arrays.device_tensor(x, name, fn)
    if t.dtype != np.bool_ and t.dtype.kind not in "iu":
        raise TypeError(f"{fn}: {name} must be a boolean array, got dtype {t.dtype}")
    return arrays.cupy_view(t) != 0


def _to_framework(ctx: arrays.Context, packed):
    """Copy a CuPy uint8 result into an array of the caller's framework."""
    if ctx.framework != "torch":
        return arrays.export(ctx, packed)
    out = arrays.empty(ctx, packed.shape, np.uint8)
    arrays.cupy_view(arrays.device_tensor(out, "out", "packbits"))[...] = packed
    return arrays.export(ctx, out)


def packbits(x: Any, bitorder: str = "little"):
    """Pack a boolean array (flattened) into uint8, 8 entries per byte, little bit order.

    Parameters
    ----------
    x : array, any shape, bool
    bitorder : "little"

    Returns
    -------
    array, shape (ceil(x.size / 8),), uint8, same framework and device as ``x``
    """
    fn = "packbits"
    _check_bitorder(bitorder, fn)
    ctx = arrays.context_of(fn, {"x": x})
    if not ctx.on_gpu:
        a = arrays.host_array(x, "x", fn)
        return arrays.export(ctx, np.packbits(np.asarray(a, bool).ravel(), bitorder="little"))
    cp = arrays.cupy_module()
    with cp.cuda.Device(ctx.device), ctx.stream:
        packed = cp.packbits(_device_bool(x, "x", fn).ravel(), bitorder="little")
        return _to_framework(ctx, packed)


def segment_packbits_host(x: np.ndarray, indptr: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """NumPy core of ``segment_packbits``: (packed uint8, byte indptr int32)."""
    x = np.asarray(x, bool).ravel()
    lens = np.diff(indptr)
    new_indptr = np.zeros(len(indptr), np.int32)
    np.cumsum((lens + 7) // 8, out=new_indptr[1:])
    packed = np.zeros(int(new_indptr[-1]), np.uint8)
    for i in range(len(lens)):
        seg = np.packbits(x[indptr[i]:indptr[i + 1]], bitorder="little")
        packed[new_indptr[i]:new_indptr[i] + len(seg)] = seg
    return packed, new_indptr


def segment_packbits(x: Any, indptr: Any, bitorder: str = "little"):
    """Pack each segment ``x[indptr[i]:indptr[i+1]]`` separately (each starts on a byte).

    Parameters
    ----------
    x : array, shape (indptr[-1],), bool
    indptr : array, shape (num_segments + 1,), integer
    bitorder : "little"

    Returns
    -------
    packed : array, shape (new_indptr[-1],), uint8, framework of ``x``
    new_indptr : array, shape (num_segments + 1,), int32: byte offsets of the segments
    """
    fn = "segment_packbits"
    _check_bitorder(bitorder, fn)
    ctx = arrays.context_of(fn, {"x": x})
    ind = arrays.host_int_vector(indptr, "indptr", fn).astype(np.int64)
    if len(ind) < 1 or ind[0] != 0 or np.any(np.diff(ind) < 0):
        raise ValueError(f"{fn}: indptr must start at 0 and be non-decreasing, got {ind[:8]}")
    if not ctx.on_gpu:
        a = np.asarray(arrays.host_array(x, "x", fn), bool).ravel()
        if ind[-1] != a.size:
            raise ValueError(f"{fn}: indptr[-1] must equal the size of x ({a.size}), got {ind[-1]}")
        packed, new_indptr = segment_packbits_host(a, ind)
        return arrays.export(ctx, packed), arrays.export(ctx, new_indptr)
    cp = arrays.cupy_module()
    with cp.cuda.Device(ctx.device), ctx.stream:
        bits = _device_bool(x, "x", fn).ravel()
        if ind[-1] != bits.size:
            raise ValueError(f"{fn}: indptr[-1] must equal the size of x ({bits.size}), got {ind[-1]}")
        lens = np.diff(ind)
        new_indptr = np.zeros(len(ind), np.int64)
        np.cumsum((lens + 7) // 8, out=new_indptr[1:])
        # -- scatter every entry to its padded position, then pack the padded vector at once
        seg = np.repeat(np.arange(len(lens)), lens)
        dest = np.arange(int(ind[-1])) - ind[:-1][seg] + 8 * new_indptr[:-1][seg]
        padded = cp.zeros(int(new_indptr[-1]) * 8, bool)
        padded[cp.asarray(dest)] = bits
        packed = cp.packbits(padded, bitorder="little")
        return _to_framework(ctx, packed), _to_framework_int(ctx, new_indptr.astype(np.int32))


def _to_framework_int(ctx: arrays.Context, host: np.ndarray):
    cp = arrays.cupy_module()
    dev = cp.asarray(host)
    if ctx.framework == "torch":
        out = arrays.empty(ctx, host.shape, np.int32)
        arrays.cupy_view(arrays.device_tensor(out, "out", "segment_packbits"))[...] = dev
        return out
    return arrays.export(ctx, dev)


def unpack_host(packed: np.ndarray, count: int) -> np.ndarray:
    """The first ``count`` entries of a little-bit-order packed mask, as bool."""
    return np.unpackbits(np.asarray(packed, np.uint8), count=count, bitorder="little").astype(bool)
