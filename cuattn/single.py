"""Single-request entry points (FlashInfer's ``single_decode_with_kv_cache`` and
``single_prefill_with_kv_cache``): each runs as a batch of one through its batch wrapper, planned
once per shape, options and stream and cached, so there is one launch path per kernel family.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any

import numpy as np

from . import arrays, variants
from .decode import BatchDecodeWithPagedKVCacheWrapper
from .errors import UnsupportedError
from .page import check_kv_layout
from .prefill import BatchPrefillWithRaggedKVCacheWrapper, _check_group, _check_q, _kv_dims, select_backend


@contextlib.contextmanager
def _on_call_stream(ctx: arrays.Context):
    """The call's device and stream current for CuPy (a plan uploads on CuPy's current stream for
    host metadata); nothing on the NumPy path."""
    if not ctx.on_gpu:
        yield
        return
    with arrays.cupy_module().cuda.Device(ctx.device), ctx.stream:
        yield


# ---------------------------------------------------------------------------- decode


@functools.lru_cache(maxsize=64)
def _decode_wrapper(kv_len: int, num_qo_heads: int, num_kv_heads: int, head_dim: int, q_dtype, kv_dtype,
                    kv_layout: str, ctx: arrays.Context, options: tuple):
    """A decode wrapper planned for one request whose contiguous K/V is one page of kv_len tokens,
    cached per shape, options and stream (a plan depends on nothing else; one wrapper per stream, so
    calls on different streams never share its split-KV workspace). The plan's upload runs on the
    call's stream."""
    w = BatchDecodeWithPagedKVCacheWrapper(kv_layout=kv_layout)
    with _on_call_stream(ctx):
        w.plan(np.array([0, 1], np.int32), np.zeros(1, np.int32), np.array([kv_len], np.int32), num_qo_heads,
               num_kv_heads, head_dim, kv_len, q_data_type=q_dtype, kv_data_type=kv_dtype, **dict(options))
    return w


def single_decode_with_kv_cache(q, k, v, kv_layout: str = "NHD", pos_encoding_mode: str = "NONE",
                                use_tensor_cores: bool = False, q_scale=None, k_scale=None, v_scale=None,
                                window_left: int = -1, logits_soft_cap: float | None = None, *,
                                sm_scale: float | None = None, rope_scale=None, rope_theta=None,
                                return_lse: bool = False, variant=None, variant_args: tuple = (), rotary_dim=None,
                                kv_data_type: Any = None, stream: Any = None):
    """Attention of one new token over one request's contiguous KV.

    Parameters
    ----------
    q : array, shape (num_qo_heads, head_dim), float16, bfloat16 or float32 (a float32 q runs the 16-bit
        kernel, converted on the GPU: cuattn/qcast.py; out is float32)
        NumPy runs the reference path; CuPy, or any CUDA array exporting ``__dlpack__``
        (PyTorch, JAX), runs the CUDA kernel.
    k, v : array, shape (kv_len, num_kv_heads, head_dim) for "NHD",
        (num_kv_heads, kv_len, head_dim) for "HND"; last dimension contiguous; same strides.
        float16, bfloat16, float8_e4m3fn or float8_e5m2 (torch / ml_dtypes fp8, or uint8 read as
        ``kv_data_type``).
    k_scale, v_scale : float, or float32 array of shape (1,) or (num_kv_heads,), optional
        Stored value x scale = real value (see ``BatchDecodeWithPagedKVCacheWrapper.run``).
    kv_data_type : dtype, optional
        The fp8 type of a uint8 k / v ("float8_e4m3fn" or "float8_e5m2"); default: their dtype.
    sm_scale : float, optional
        Defaults to ``1 / sqrt(head_dim)``.
    return_lse : bool
        Also return the LSE, float32 (num_qo_heads,), natural log (base e).
    window_left, logits_soft_cap, pos_encoding_mode ("NONE" | "ALIBI"), variant, variant_args :
        attention variants (``cuattn.variants``); ``variant_args`` are the variant's parameters
        not fixed by the options, in order.

    Runs as a batch of one through ``BatchDecodeWithPagedKVCacheWrapper`` (the K/V one page).

    Returns
    -------
    out : array, shape (num_qo_heads, head_dim), dtype of ``q``, same framework as ``q``
    """
    fn = "single_decode_with_kv_cache"
    check_kv_layout(kv_layout, fn)
    options = dict(pos_encoding_mode=pos_encoding_mode, window_left=window_left, logits_soft_cap=logits_soft_cap,
                   sm_scale=sm_scale, rope_scale=rope_scale, rope_theta=rope_theta, variant=variant,
                   rotary_dim=rotary_dim)
    variants.resolve(fn, num_qo_heads=1, **{k: v for k, v in options.items() if k != "sm_scale"})
    if q_scale not in (None, 1.0):
        raise UnsupportedError(f"{fn}: q_scale (fp8 q) is not implemented; q is float16, bfloat16 or float32")
    ctx = arrays.context_of(fn, {"q": q, "k": k, "v": v}, stream)
    describe = arrays.device_tensor if ctx.on_gpu else arrays.host_array
    qt, kt, vt = (describe(x, n, fn) for x, n in ((q, "q"), (k, "k"), (v, "v")))
    hq, d, hkv = _check_single(fn, tuple(qt.shape), tuple(kt.shape), tuple(vt.shape), kv_layout)
    kv_len = kt.shape[0] if kv_layout == "NHD" else kt.shape[1]
    if not arrays.same_storage(vt.dtype, kt.dtype):
        raise ValueError(f"{fn}: k and v must have the same dtype, got k={kt.dtype}, v={vt.dtype}")
    if kv_len == 0:       # no key: output 0 and LSE -inf, as for a fully masked row
        q_dtype = arrays.logical_dtype(qt.dtype)
        if not ctx.on_gpu:
            o, s = np.zeros((hq, d), np.float32), np.full(hq, -np.inf, np.float32)
            return arrays.host_results(ctx, o, s, None, None, return_lse, q_dtype, fn)
        out, lse = arrays.empty(ctx, (hq, d), q_dtype), arrays.empty(ctx, (hq,), np.float32)
        arrays.fill(ctx, out, 0, "out", fn)
        arrays.fill(ctx, lse, -np.inf, "lse", fn)
        result = arrays.export(ctx, out, q_dtype)
        return (result, arrays.export(ctx, lse)) if return_lse else result
    # -- a batch of one: the contiguous K/V is one page of kv_len tokens
    kv_dt = arrays.logical_dtype(kt.dtype)
    if kv_data_type is not None:
        want = arrays.as_dtype(kv_data_type, "kv_data_type", fn)
        if not arrays.same_storage(kv_dt, want):
            raise ValueError(f"{fn}: k must have dtype {want} (kv_data_type) or its raw view, got {kt.dtype}")
        kv_dt = want
    w = _decode_wrapper(kv_len, hq, hkv, d, arrays.logical_dtype(qt.dtype), kv_dt,
                        kv_layout, ctx, tuple(sorted(options.items(), key=lambda kv: kv[0])))
    result = w.run(q[None], (k[None], v[None]), *variant_args, return_lse=return_lse, k_scale=k_scale,
                   v_scale=v_scale, stream=ctx.stream)
    if return_lse:
        return result[0][0], result[1][0]
    return result[0]


def _check_single(fn, qs, ks, vs, kv_layout):
    if len(qs) != 2:
        raise ValueError(f"{fn}: q must have shape (num_qo_heads, head_dim), got {qs}")
    if len(ks) != 3 or ks != vs:
        raise ValueError(f"{fn}: k and v must have the same 3-dim shape, got k={ks}, v={vs}")
    hq, d = qs
    hkv = ks[1] if kv_layout == "NHD" else ks[0]
    if ks[2] != d:
        raise ValueError(f"{fn}: k must have head_dim {d} (q's last dim), got {ks[2]}")
    if hq % hkv:
        raise ValueError(f"{fn}: num_qo_heads must be a multiple of num_kv_heads, got "
                         f"num_qo_heads={hq}, num_kv_heads={hkv}")
    return hq, d, hkv


# ---------------------------------------------------------------------------- prefill


def single_prefill_with_kv_cache(q, k, v, custom_mask=None, packed_custom_mask=None, causal: bool = False,
                                 kv_layout: str = "NHD", pos_encoding_mode: str = "NONE",
                                 use_fp16_qk_reduction: bool = False, sm_scale: float | None = None,
                                 window_left: int = -1, logits_soft_cap=None, rope_scale=None,
                                 rope_theta=None, backend: str = "auto", return_lse: bool = False,
                                 *, variant=None, variant_args: tuple = (), rotary_dim=None, k_scale=None,
                                 v_scale=None, kv_data_type: Any = None, stream=None):
    """Attention of one request's qo_len queries over its kv_len keys (prefill / append).

    Parameters
    ----------
    q : array, shape (qo_len, num_qo_heads, head_dim), float16, bfloat16 or float32 (as in
        ``single_decode_with_kv_cache``)
        NumPy runs the reference path; CuPy, PyTorch or JAX GPU arrays run the CUDA kernel.
    k, v : array, shape (kv_len, num_kv_heads, head_dim) for "NHD", (num_kv_heads, kv_len,
        head_dim) for "HND"; last dimension contiguous; v's head_dim may differ from k's (head_dim_qk /
        head_dim_vo 192 / 128 on fa2; out then has v's). dtype of ``q``, or float8_e4m3fn /
        float8_e5m2 (torch / ml_dtypes fp8, or uint8 read as ``kv_data_type``).
    k_scale, v_scale : float, or float32 array of shape (1,) or (num_kv_heads,), optional
        Stored value x scale = real value (FlashInfer's meaning; any KV dtype).
    kv_data_type : dtype, optional
        The fp8 type of a uint8 k / v ("float8_e4m3fn" or "float8_e5m2"); default: their dtype.
    custom_mask : array, shape (qo_len, kv_len) or flattened, bool, optional. True = attend.
    packed_custom_mask : array, shape (ceil(qo_len * kv_len / 8),), uint8, optional
        ``packbits(custom_mask)`` (little bit order).
    causal : bool
        Query i attends to keys j <= i + kv_len - qo_len (bottom-right aligned).
    sm_scale : float, optional
        Defaults to ``1 / sqrt(head_dim)``.
    backend : "auto" | "fa2" | "fa3"
        "fa2": mma.sync (sm_80+). "fa3": wgmma + TMA (sm_90, head_dim 128;
        UnsupportedError elsewhere). "auto": fa3 where it has a kernel on sm_90, else fa2.
    window_left, logits_soft_cap, pos_encoding_mode ("NONE" | "ALIBI"), variant, variant_args :
        attention variants (``cuattn.variants``); ``variant_args`` are the variant's parameters
        not fixed by the options, in order.

    Runs as a batch of one through ``BatchPrefillWithRaggedKVCacheWrapper``.

    Returns
    -------
    out : array, shape (qo_len, num_qo_heads, head_dim), dtype of ``q``
    lse : array, shape (qo_len, num_qo_heads), float32, natural log (only if ``return_lse``)
    """
    fn = "single_prefill_with_kv_cache"
    options = dict(pos_encoding_mode=pos_encoding_mode, window_left=window_left, logits_soft_cap=logits_soft_cap,
                   use_fp16_qk_reduction=use_fp16_qk_reduction, rope_scale=rope_scale, rope_theta=rope_theta,
                   variant=variant, rotary_dim=rotary_dim)
    variants.resolve(fn, num_qo_heads=1, **options)       # options checked before any array
    check_kv_layout(kv_layout, fn)
    select_backend(backend, fn)
    ctx = arrays.context_of(fn, {"q": q, "k": k, "v": v}, stream)
    describe = arrays.device_tensor if ctx.on_gpu else arrays.host_array
    qt, kt, vt = (describe(x, n, fn) for x, n in ((q, "q"), (k, "k"), (v, "v")))
    qo_len, hq, d, kv_len, hkv, dv = _single_dims(tuple(qt.shape), tuple(kt.shape), tuple(vt.shape), kv_layout, fn)
    q_dt, kv_dt = arrays.logical_dtype(qt.dtype), arrays.logical_dtype(kt.dtype)
    if arrays.logical_dtype(vt.dtype) != kv_dt:
        raise ValueError(f"{fn}: k and v must have the same dtype, got k={kt.dtype}, v={vt.dtype}")
    if kv_data_type is not None:
        want = arrays.as_dtype(kv_data_type, "kv_data_type", fn)
        if not arrays.same_storage(kv_dt, want):
            raise ValueError(f"{fn}: k must have dtype {want} (kv_data_type) or its raw view, got {kt.dtype}")
        kv_dt = want
    # -- a ragged batch of one through the batch wrapper (planned once per shape and options when
    #    there is no mask: a plan depends on nothing else)
    key = (qo_len, kv_len, hq, hkv, d, dv, q_dt, kv_dt, kv_layout, backend, bool(causal), sm_scale,
           tuple(sorted(options.items(), key=lambda kv: kv[0])), ctx)
    if custom_mask is None and packed_custom_mask is None:
        w = _prefill_wrapper(*key)
    else:
        w = _prefill_wrapper.__wrapped__(*key, custom_mask=custom_mask, packed_custom_mask=packed_custom_mask)
    return w.run(q, k, v, *variant_args, return_lse=return_lse, k_scale=k_scale, v_scale=v_scale, stream=ctx.stream)


@functools.lru_cache(maxsize=64)
def _prefill_wrapper(qo_len, kv_len, num_qo_heads, num_kv_heads, head_dim, head_dim_vo, q_dtype, kv_dtype, kv_layout, backend,
                    causal, sm_scale, options, ctx, custom_mask=None, packed_custom_mask=None):
    """The ragged wrapper of single_prefill_with_kv_cache, planned once per shape, options and ``ctx``
    (the call's framework, device and stream: the plan's upload runs on that stream, and calls on
    other streams have wrappers of their own)."""
    w = BatchPrefillWithRaggedKVCacheWrapper(kv_layout=kv_layout, backend=backend)
    with _on_call_stream(ctx):
        w.plan(np.array([0, qo_len], np.int32), np.array([0, kv_len], np.int32), num_qo_heads, num_kv_heads,
               head_dim, head_dim_vo, custom_mask=custom_mask, packed_custom_mask=packed_custom_mask, causal=causal,
               sm_scale=sm_scale, q_data_type=q_dtype, kv_data_type=kv_dtype, **dict(options))
    return w


def _single_dims(qs, ks, vs, kv_layout, fn):
    _check_q(qs, fn)
    kv_len, hkv, dk = _kv_dims(ks, kv_layout, "k", fn)
    if len(vs) != 3 or tuple(vs[:-1]) != tuple(ks[:-1]):
        raise ValueError(f"{fn}: v must have the shape of k {tuple(ks)} but for its last dim (head_dim_vo), "
                         f"got {tuple(vs)}")
    qo_len, hq, d = qs
    if dk != d:
        raise ValueError(f"{fn}: k head_dim must equal q head_dim={d}, got {dk}")
    _check_group(hq, hkv, fn)
    return qo_len, hq, d, kv_len, hkv, vs[-1]
