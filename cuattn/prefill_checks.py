"""Checks of prefill's arguments and arrays (prefill.py, prefill_batch.py and single.py): shapes, dtypes,
masks, outputs, head_dim_vo, and the fp8 KV pieces (k_scale / v_scale through fp8.parse_scale, the
spec's dtype_kv, the NumPy path's dequantised K/V). Every message follows STYLE.md's pattern."""
from __future__ import annotations

import numpy as np

from . import arrays, fp8
from .errors import UnsupportedError

DTYPES = ("f16", "bf16")     # q (and 16-bit K/V) short names with a kernel


def _check_head_dim_vo(head_dim_qk: int, head_dim_vo, bound, fn: str) -> int:
    """head_dim_vo (None: head_dim_qk) as an int; a pair support.check takes, without fused RoPE."""
    if head_dim_vo is None or head_dim_vo == head_dim_qk:
        return head_dim_qk
    if isinstance(head_dim_vo, bool) or not isinstance(head_dim_vo, (int, np.integer)):
        raise TypeError(f"{fn}: head_dim_vo must be an int or None, got {head_dim_vo!r}")
    if bound.composite.has_qk_transform:
        raise UnsupportedError(f"{fn}: pos_encoding_mode='ROPE_LLAMA' (fused RoPE) and a variant's query / key "
                               f"transform need head_dim_vo == head_dim_qk, got {head_dim_qk}/{head_dim_vo}")
    return int(head_dim_vo)


def _check_q(shape: tuple, fn: str, num_qo_heads=None, head_dim=None, rows=None) -> None:
    if len(shape) != 3:
        raise ValueError(f"{fn}: q must have shape (qo_len, num_qo_heads, head_dim), got {tuple(shape)}")
    for what, want, got in (("q.shape[1] (num_qo_heads)", num_qo_heads, shape[1]),
                            ("q.shape[2] (head_dim)", head_dim, shape[2]), ("q.shape[0] (qo_indptr[-1])", rows, shape[0])):
        if want is not None and got != want:
            raise ValueError(f"{fn}: {what} must be {want}, got {got}")


def _kv_dims(shape: tuple, kv_layout: str, name: str, fn: str) -> tuple[int, int, int]:
    """(kv_len, num_kv_heads, head_dim) of a contiguous K or V array."""
    if len(shape) != 3:
        raise ValueError(f"{fn}: {name} must have 3 dims ({'kv_len, num_kv_heads' if kv_layout == 'NHD' else 'num_kv_heads, kv_len'}, "
                         f"head_dim) for kv_layout={kv_layout!r}, got {tuple(shape)}")
    return (shape[0], shape[1], shape[2]) if kv_layout == "NHD" else (shape[1], shape[0], shape[2])


def _check_group(num_qo_heads: int, num_kv_heads: int, fn: str) -> None:
    if num_kv_heads < 1 or num_qo_heads % num_kv_heads:
        raise ValueError(f"{fn}: num_qo_heads must be a multiple of num_kv_heads, got "
                         f"num_qo_heads={num_qo_heads}, num_kv_heads={num_kv_heads}")


def _host_mask(custom_mask, packed_custom_mask, total: int, fn: str) -> np.ndarray | None:
    """Host bool mask of ``total`` entries from either form (None when neither is given)."""
    if custom_mask is not None and packed_custom_mask is not None:
        raise ValueError(f"{fn}: pass custom_mask or packed_custom_mask, not both")
    if custom_mask is not None:
        m = np.asarray(arrays.to_host(custom_mask, "custom_mask", fn)).ravel()
        if m.dtype != np.bool_ and m.dtype.kind not in "iu":
            raise TypeError(f"{fn}: custom_mask must be a boolean array (True = attend), got dtype {m.dtype}")
        if m.size != total:
            raise ValueError(f"{fn}: custom_mask must have {total} entries (sum of qo_len * kv_len), got {m.size}")
        return m.astype(bool)
    if packed_custom_mask is not None:
        p = np.asarray(arrays.to_host(packed_custom_mask, "packed_custom_mask", fn)).ravel()
        if p.dtype != np.uint8:
            raise TypeError(f"{fn}: packed_custom_mask must be uint8, got {p.dtype}")
        return p
    return None


def _check_out(ctx, out, lse, rows: int, num_qo_heads: int, head_dim: int, dtype, fn: str):
    """Allocate or validate out / lse; returns (out array, out Tensor, lse array, lse ptr)."""
    if out is None:
        out = arrays.empty(ctx, (rows, num_qo_heads, head_dim), arrays.logical_dtype(dtype))
    ot = arrays.device_tensor(out, "out", fn)
    if ot.shape != (rows, num_qo_heads, head_dim) or arrays.logical_dtype(ot.dtype) != arrays.logical_dtype(dtype) or ot.device != ctx.device:
        raise ValueError(f"{fn}: out must be a ({rows}, {num_qo_heads}, {head_dim}) {dtype} array on GPU "
                         f"{ctx.device}, got {ot.shape} {ot.dtype} on GPU {ot.device}")
    lse_ptr = 0
    if lse is not None:
        lt = arrays.device_tensor(lse, "lse", fn)
        if lt.shape != (rows, num_qo_heads) or lt.dtype != np.float32 or not lt.is_contiguous():
            raise ValueError(f"{fn}: lse must be a contiguous ({rows}, {num_qo_heads}) float32 array, "
                             f"got {lt.shape} {lt.dtype}")
        lse_ptr = lt.ptr
    return out, ot, lse, lse_ptr


def _check_kv_dtype(plan, k_dtype, v_dtype, name: str, fn: str) -> None:
    """K and V have the plan's kv_data_type, or its raw view (uint8 for fp8, uint16 for bf16) (both paths)."""
    for dt in (k_dtype, v_dtype):
        if not arrays.same_storage(np.dtype(dt), plan.kv_dtype):
            raise ValueError(f"{fn}: {name} must have dtype {plan.kv_dtype} (kv_data_type of plan) or its raw "
                             f"view, got {dt}")


def _split_pair(paged_kv_cache, plan, fn: str):
    """The (k_cache, v_cache) pair of a plan with head_dim_vo != head_dim_qk (None otherwise)."""
    if plan.head_dim_vo == plan.head_dim:
        return None
    if not isinstance(paged_kv_cache, (tuple, list)) or len(paged_kv_cache) != 2:
        raise ValueError(f"{fn}: paged_kv_cache must be a (k_cache, v_cache) pair when head_dim_vo="
                         f"{plan.head_dim_vo} != head_dim_qk={plan.head_dim}")
    return tuple(paged_kv_cache)


def _kv_short(q_dt, kv_dt, bound, fn: str) -> str:
    """The spec's dtype_kv: "" for K/V of q's dtype, "e4m3" / "e5m2" for an fp8 cache, "f32" for an fp32
    one (support.check passed)."""
    if np.dtype(kv_dt) == np.float32 and np.dtype(q_dt) != np.float32:
        if bound.composite.has_rope:
            raise UnsupportedError(f"{fn}: pos_encoding_mode='ROPE_LLAMA' (fused RoPE) needs a 16-bit KV cache, "
                                   f"got kv_data_type={kv_dt}")
        return "f32"
    if not fp8.is_fp8(kv_dt):
        return ""
    if bound.composite.has_qk_transform:
        raise UnsupportedError(f"{fn}: pos_encoding_mode='ROPE_LLAMA' (fused RoPE) and a variant's query / key "
                               f"transform need a 16-bit KV cache, got kv_data_type={kv_dt}")
    return arrays.SHORT_NAME[np.dtype(kv_dt)]


def _scales(plan, k_scale, v_scale, fn: str, on_gpu: bool):
    """(k, v) fp8.Scale of run()'s k_scale / v_scale (None: 1.0), checked as decode checks them."""
    return (fp8.parse_scale(k_scale, "k_scale", plan.num_kv_heads, fn, on_gpu=on_gpu),
            fp8.parse_scale(v_scale, "v_scale", plan.num_kv_heads, fn, on_gpu=on_gpu))


def _host_kv(x: np.ndarray, plan, scale, head_axis: int) -> np.ndarray:
    """A host K or V slice as the reference reads it: uint8 viewed as the plan's fp8 type; real values
    (float32, times the per-head scale) for an fp8 cache or a scale other than 1."""
    if x.dtype == np.uint8 and fp8.is_fp8(plan.kv_dtype):
        x = x.view(plan.kv_dtype)
    if fp8.is_fp8(plan.kv_dtype) or np.any(scale.host != 1):
        return fp8.dequantize(x, scale.host, head_axis)
    return x
