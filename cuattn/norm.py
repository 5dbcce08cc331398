"""Normalization layers of a transformer block: RMSNorm (plain, Gemma-style, fused with the residual
add) and LayerNorm, with FlashInfer's names, argument order and semantics (``flashinfer.norm``).

Inputs are float16 or bfloat16 (CuPy holds bfloat16 as a uint16 view); sums and the scaling run in
float32 and the result is rounded to the input's dtype. NumPy arrays run the reference path here,
GPU arrays the kernels of ``kernels_cu/norm.cu`` on the caller's stream. Rows have at most
``NormSpec.max_hidden`` (32768) elements on both paths; any number of rows, 0 included.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import arrays, jit
from .errors import UnsupportedError

_SOURCE = "norm.cu"
_DTYPES = {"f16": 0, "bf16": 1}
_GROUP = 8              # elements per thread per group: one 16-byte access of 16-bit values
_MAX_THREADS = 1024
# Calls of at most this many elements (rows * hidden) run a thread per 8 elements, larger ones a thread per
# 32 (NormSpec.threads). H100, 2026-11-24, both shapes timed with the L2 flushed: at or below it the first
# is as fast or up to 20% faster (fused add 64 x 4096: 5.3 against 6.4 µs), above it the second up to 2x
# (rmsnorm 4096 x 8192: 43 against 81 µs); layernorm 512-1024 x 4096 would still gain ~15% from the first.
_LATENCY_ELEMENTS = 1 << 20
# Large layernorm calls (rows * hidden above _LATENCY_ELEMENTS) with 16-byte accesses and hidden <= _ROWS_HIDDEN
# run cuattn_layernorm_rows (two rows a thread, gamma / beta through L1), the others cuattn_layernorm (a row a
# block). H100, session 17, 4096 x 4096 / 8192: 92-94% of a same-bytes copy, against 72-81% for the persistent
# pipelined form it replaced (benchmarks/results/ops_notes_session17.md; the rejected forms' code: git history,
# d07b337).
_ROWS_HIDDEN = 8192
_ROWS_BLOCK = 128           # cuattn_layernorm_rows: rows of fewer threads share blocks of this many
_LN_ROWS = 2                # norm.cu's LN_ROWS: rows a thread of cuattn_layernorm_rows
# fused_add_rmsnorm's large calls (rows * hidden above _LATENCY_ELEMENTS) with hidden <= 8192 run NormSpec
# max_groups 1 (32 registers, a thread per 8 elements: FlashInfer's geometry, 512 threads and 4 rows an SM at
# hidden 4096); the others max_groups 4. Session 12's H100 A/B of these launch forms (and layernorm's, and the
# activations'): benchmarks/results/ops_notes_session12.md. Of those large max_groups 1 calls, the ones with
# 16-byte accesses run the register-pipelined form (cuattn_fused_add_rmsnorm_regs: blocks of one wave looping
# over rows, two rows in flight), except bf16 rows over _REGS_BF16_HIDDEN, where the one-row-a-block form was
# 1.5% faster (session 13's H100 A/B, benchmarks/results/ops_notes_session13.md: fp16 4096 / 8192 5% / 9%
# faster, bf16 4096 1.4%).
_REGS_BF16_HIDDEN = 4096


@dataclass(frozen=True)
class NormSpec:
    """One compiled norm.cu: its three entry points (rmsnorm, fused add + rmsnorm, layernorm) for one
    storage dtype. Sizes (hidden, rows, strides) are run-time arguments."""
    dtype: str               # "f16" | "bf16": input, residual, weight and output storage
    max_groups: int = 4      # groups of 8 elements one thread holds in registers
    source = _SOURCE

    @property
    def name(self) -> str:   # "norm_bf16_g4"
        return f"norm_{self.dtype}_g{self.max_groups}"

    def defines(self) -> tuple[str, ...]:
        return (f"-DDTYPE={_DTYPES[self.dtype]}", f"-DMAX_GROUPS={self.max_groups}", f"-DMAX_THREADS={_MAX_THREADS}")

    @property
    def max_hidden(self) -> int:
        return _GROUP * self.max_groups * _MAX_THREADS

    def threads(self, hidden: int, rows: int) -> int:
        """Block size (one block per row) for ``rows`` rows of ``hidden`` elements: for small calls
        (``_LATENCY_ELEMENTS``) a thread per 8 elements (each block is on the critical path: the fewest
        dependent loads a thread), for larger ones the fewest warps that hold a row in registers (up to
        max_groups 16-byte loads a thread in flight, more blocks resident per SM)."""
        vectors = -(-hidden // _GROUP)                 # groups of 8 elements in a row
        latency = rows * hidden <= _LATENCY_ELEMENTS
        threads = vectors if latency else -(-vectors // self.max_groups)
        return min(_MAX_THREADS, max(32, -(-threads // 32) * 32))

    def layernorm_geometry(self, hidden: int, rows: int, vec: bool = True) -> tuple[str, int, int, int]:
        """(entry, threads a row, rows a block, block) of norm.cu's layernorm. Large calls with 16-byte accesses
        (``vec``) and hidden <= _ROWS_HIDDEN run cuattn_layernorm_rows: sub-blocks of ``threads`` threads, as many
        as make a block of at least _ROWS_BLOCK, each thread the same columns of _LN_ROWS rows, a grid over every
        row; the others run cuattn_layernorm, a row a block with gamma and beta from L2."""
        threads = self.threads(hidden, rows)
        if rows * hidden <= _LATENCY_ELEMENTS or hidden > _ROWS_HIDDEN or not vec:
            return "cuattn_layernorm", threads, 1, threads
        subs = max(1, _ROWS_BLOCK // threads)                              # sub-blocks of a row's threads
        return "cuattn_layernorm_rows", threads, subs * _LN_ROWS, subs * threads


def fused_add_spec(dtype: str, hidden: int, rows: int) -> NormSpec:
    """The NormSpec (its max_groups) that runs fused_add_rmsnorm on rows x hidden; its
    ``threads(hidden, rows)`` is the block. Small calls and rows over 8192 elements: max_groups 4; large
    calls of up to 8192: max_groups 1 (a thread per 8 elements)."""
    if rows * hidden > _LATENCY_ELEMENTS:
        small = NormSpec(dtype, 1)
        if hidden <= small.max_hidden:
            return small
    return NormSpec(dtype)


def fused_add_entry(dtype: str, hidden: int, rows: int, vec: int) -> str:
    """norm.cu's entry for fused_add_rmsnorm on rows x hidden of ``dtype`` ("f16" | "bf16"), with 16-byte
    accesses or not (``vec``): the register-pipelined form for large calls (``fused_add_spec`` max_groups 1)
    with 16-byte accesses, except bf16 rows over _REGS_BF16_HIDDEN; else one row a block."""
    regs = (fused_add_spec(dtype, hidden, rows).max_groups == 1 and vec
            and not (dtype == "bf16" and hidden > _REGS_BF16_HIDDEN))
    return "cuattn_fused_add_rmsnorm_regs" if regs else "cuattn_fused_add_rmsnorm"


def shipped_specs() -> list[NormSpec]:
    return [NormSpec(d, g) for d in _DTYPES for g in (4, 1)]


# ---------------------------------------------------------------------------- public API


def rmsnorm(input, weight, eps: float = 1e-6, out=None, enable_pdl: bool | None = None, *, stream: Any = None):
    """Root mean square normalization: ``out = input / sqrt(mean(input**2, -1) + eps) * weight``.

    Parameters
    ----------
    input : array, shape (batch, hidden_size) or (batch, num_heads, hidden_size), float16 or bfloat16
        Last dimension contiguous; other strides free (e.g. the q part of a fused qkv array).
        NumPy runs the reference path; CuPy, or any CUDA array exporting ``__dlpack__``, the kernel.
    weight : array, shape (hidden_size,), dtype of ``input``
    eps : float
    out : array, optional
        Shape and dtype of ``input``; written in place (may be ``input`` itself) and returned.
    enable_pdl : bool, optional
        Programmatic dependent launch on sm_90+ (None: on where the GPU has it, as FlashInfer).

    Returns
    -------
    out : array, shape and dtype of ``input``, same framework

    Raises
    ------
    TypeError
        If a dtype is not float16/bfloat16, ``weight``'s differs from ``input``'s, or ``out`` cannot be
        written (a JAX or read-only array).
    ValueError
        If shapes disagree.
    """
    return _rmsnorm("rmsnorm", input, weight, eps, out, enable_pdl, stream, weight_bias=0.0)


def gemma_rmsnorm(input, weight, eps: float = 1e-6, out=None, enable_pdl: bool | None = None, *,
                  stream: Any = None):
    """Gemma-style RMSNorm: ``out = input / sqrt(mean(input**2, -1) + eps) * (weight + 1)``.

    Arguments, result and errors as :func:`rmsnorm`.
    """
    return _rmsnorm("gemma_rmsnorm", input, weight, eps, out, enable_pdl, stream, weight_bias=1.0)


def fused_add_rmsnorm(input, residual, weight, eps: float = 1e-6, enable_pdl: bool | None = None, *,
                      stream: Any = None) -> None:
    """Residual add and RMSNorm, in place: ``residual += input``, then
    ``input = residual / sqrt(mean(residual**2, -1) + eps) * weight``.

    As FlashInfer's kernel, the normalization reads the float32 sum ``input + residual``, not the sum
    rounded into ``residual``.

    Parameters
    ----------
    input : array, shape (batch, hidden_size), float16 or bfloat16; overwritten with the normalized sum
    residual : array, shape and dtype of ``input``; overwritten with ``input + residual``
    weight : array, shape (hidden_size,), dtype of ``input``
    eps : float
    enable_pdl : bool, optional
        As in :func:`rmsnorm`.

    Returns
    -------
    None

    Raises
    ------
    TypeError
        As :func:`rmsnorm`; also if ``input`` or ``residual`` cannot be written (JAX, read-only).
    ValueError
        If shapes disagree or ``input`` and ``residual`` are the same array.
    """
    _fused_add_rmsnorm("fused_add_rmsnorm", input, residual, weight, eps, enable_pdl, stream, weight_bias=0.0)


def gemma_fused_add_rmsnorm(input, residual, weight, eps: float = 1e-6, enable_pdl: bool | None = None, *,
                            stream: Any = None) -> None:
    """Gemma-style :func:`fused_add_rmsnorm`: ``residual += input``, then
    ``input = residual / sqrt(mean(residual**2, -1) + eps) * (weight + 1)``. In place; returns None."""
    _fused_add_rmsnorm("gemma_fused_add_rmsnorm", input, residual, weight, eps, enable_pdl, stream,
                       weight_bias=1.0)


def layernorm(input, gemma, beta, eps: float = 1e-6, *, stream: Any = None):
    """Layer normalization: ``out = (input - mean) / sqrt(var + eps) * gemma + beta`` over the last
    dimension, ``var`` the biased variance (FlashInfer's ``layernorm``; ``gemma`` is its name for gamma).

    Parameters
    ----------
    input : array, shape (batch, hidden_size), float16 or bfloat16 (FlashInfer takes bfloat16 only)
    gemma, beta : float32 array, shape (hidden_size,)
    eps : float

    Returns
    -------
    out : array, shape and dtype of ``input``, same framework

    Raises
    ------
    TypeError
        If ``input`` is not float16/bfloat16 or ``gemma``/``beta`` not float32.
    ValueError
        If shapes disagree.
    """
    fn = "layernorm"
    ctx = arrays.context_of(fn, {"input": input, "gemma": gemma, "beta": beta}, stream)
    if not ctx.on_gpu:
        x, g, b = (arrays.host_array(a, n, fn) for a, n in ((input, "input"), (gemma, "gemma"), (beta, "beta")))
        dtype = _check_layernorm(fn, x.shape, x.dtype, g.shape, g.dtype, b.shape, b.dtype)
        xf = x.astype(np.float32)
        mean = xf.mean(axis=-1, keepdims=True, dtype=np.float32)
        centered = xf - mean
        var = np.square(centered).mean(axis=-1, keepdims=True, dtype=np.float32)
        y = centered * (1 / np.sqrt(var + np.float32(eps))) * g.astype(np.float32) + b.astype(np.float32)
        return arrays.export(ctx, y.astype(dtype), dtype)
    tx, tg, tb = (arrays.device_tensor(a, n, fn) for a, n in ((input, "input"), (gemma, "gemma"), (beta, "beta")))
    dtype = _check_layernorm(fn, tx.shape, tx.dtype, tg.shape, tg.dtype, tb.shape, tb.dtype)
    out = arrays.empty(ctx, tx.shape, dtype)
    to = arrays.device_tensor(out, "out", fn)
    rows, hidden = tx.shape
    if rows:
        spec, vec = NormSpec(arrays.SHORT_NAME[dtype]), _aligned((tx, to, tg, tb))
        entry, threads, per_block, block = spec.layernorm_geometry(hidden, rows, bool(vec))
        if entry == "cuattn_layernorm_rows":
            launch = jit.get_launcher(spec, entry, ctx.device, "pppp" "iii" "qq" "f" "i")
            launch((-(-rows // per_block),), block, ctx.stream, tx.ptr, tg.ptr, tb.ptr, to.ptr, rows, hidden, threads,
                   tx.strides[0], to.strides[0], float(eps), vec)
        else:
            launch = jit.get_launcher(spec, entry, ctx.device, "pppp" "i" "qq" "f" "i")
            launch((rows,), block, ctx.stream, tx.ptr, tg.ptr, tb.ptr, to.ptr, hidden, tx.strides[0], to.strides[0],
                   float(eps), vec)
    return arrays.export(ctx, out, dtype)


# ---------------------------------------------------------------------------- implementation


def _rmsnorm(fn, input, weight, eps, out, enable_pdl, stream, weight_bias: float):
    arrays.writable(out, "out", fn)
    ctx = arrays.context_of(fn, {"input": input, "weight": weight, "out": out}, stream)
    if not ctx.on_gpu:
        x, w = arrays.host_array(input, "input", fn), arrays.host_array(weight, "weight", fn)
        o = None if out is None else arrays.host_array(out, "out", fn)
        dtype = _check_rmsnorm(fn, x.shape, x.dtype, w.shape, w.dtype, o)
        y = _rms_scale(x.astype(np.float32), w, eps, weight_bias).astype(dtype)
        if out is None:
            return arrays.export(ctx, y, dtype)
        o[...] = y
        return out
    tx, tw = arrays.device_tensor(input, "input", fn), arrays.device_tensor(weight, "weight", fn)
    to = None if out is None else arrays.device_tensor(out, "out", fn)
    dtype = _check_rmsnorm(fn, tx.shape, tx.dtype, tw.shape, tw.dtype, to)
    if out is None:
        out = arrays.empty(ctx, tx.shape, dtype)
        to = arrays.device_tensor(out, "out", fn)
    hidden = tx.shape[-1]
    if len(tx.shape) == 3:        # rows (b, h) at b * s0 + h * s1
        heads, in_s, out_s = tx.shape[1], tx.strides[:2], to.strides[:2]
    else:
        heads, in_s, out_s = 1, (tx.strides[0], 0), (to.strides[0], 0)
    rows = tx.shape[0] * heads
    if rows:
        spec = NormSpec(arrays.SHORT_NAME[dtype])
        launch = jit.get_launcher(spec, "cuattn_rmsnorm", ctx.device, "ppp" "ii" "qqqq" "ff" "i")
        launch((rows,), spec.threads(hidden, rows), ctx.stream, tx.ptr, tw.ptr, to.ptr, hidden, heads,
               *in_s, *out_s, float(weight_bias), float(eps), _aligned((tx, to, tw)),
               pdl=jit.pdl_launch(ctx.device, enable_pdl))
    return arrays.export(ctx, out, dtype)


def _fused_add_rmsnorm(fn, input, residual, weight, eps, enable_pdl, stream, weight_bias: float) -> None:
    arrays.writable(input, "input", fn)
    arrays.writable(residual, "residual", fn)
    ctx = arrays.context_of(fn, {"input": input, "residual": residual, "weight": weight}, stream)
    if not ctx.on_gpu:
        x, r, w = (arrays.host_array(a, n, fn) for a, n in
                   ((input, "input"), (residual, "residual"), (weight, "weight")))
        dtype = _check_fused(fn, x.shape, x.dtype, r.shape, r.dtype, w.shape, w.dtype,
                             np.shares_memory(x, r) if x.size and r.size else False)
        total = x.astype(np.float32) + r.astype(np.float32)
        r[...] = total.astype(dtype)
        x[...] = _rms_scale(total, w, eps, weight_bias).astype(dtype)
        return None
    tx, tr, tw = (arrays.device_tensor(a, n, fn) for a, n in
                  ((input, "input"), (residual, "residual"), (weight, "weight")))
    dtype = _check_fused(fn, tx.shape, tx.dtype, tr.shape, tr.dtype, tw.shape, tw.dtype,
                         tx.ptr == tr.ptr and all(tx.shape))
    rows, hidden = tx.shape
    if rows:
        spec = fused_add_spec(arrays.SHORT_NAME[dtype], hidden, rows)
        vec, threads, pdl = _aligned((tx, tr, tw)), spec.threads(hidden, rows), jit.pdl_launch(ctx.device, enable_pdl)
        entry = fused_add_entry(spec.dtype, hidden, rows, vec)
        if entry == "cuattn_fused_add_rmsnorm_regs":
            launch = jit.get_launcher(spec, entry, ctx.device, "ppp" "ii" "qq" "ff")
            grid = min(rows, _resident_blocks(spec, entry, ctx.device, threads))
            launch((grid,), threads, ctx.stream, tx.ptr, tr.ptr, tw.ptr, rows, hidden, tx.strides[0], tr.strides[0],
                   float(weight_bias), float(eps), pdl=pdl)
            return None
        launch = jit.get_launcher(spec, "cuattn_fused_add_rmsnorm", ctx.device, "ppp" "i" "qq" "ff" "i")
        launch((rows,), threads, ctx.stream, tx.ptr, tr.ptr, tw.ptr, hidden, tx.strides[0],
               tr.strides[0], float(weight_bias), float(eps), vec, pdl=pdl)
    return None


@functools.cache
def _resident_blocks(spec: NormSpec, entry: str, device: int, block: int) -> int:
    """Blocks of ``block`` threads the device holds at once (one wave)."""
    cp = arrays.cupy_module()
    function = jit.get_function(spec, entry, device)
    with cp.cuda.Device(device):
        per_sm = cp.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(function.ptr, block, 0)
    return cp.cuda.Device(device).attributes["MultiProcessorCount"] * max(1, per_sm)


def _rms_scale(x: np.ndarray, weight: np.ndarray, eps: float, weight_bias: float) -> np.ndarray:
    """x (float32) / sqrt(mean(x^2) + eps) * (weight_bias + weight), in float32."""
    mean_sq = np.square(x).mean(axis=-1, keepdims=True, dtype=np.float32)
    return x * (1 / np.sqrt(mean_sq + np.float32(eps))) * (np.float32(weight_bias) + weight.astype(np.float32))


def _aligned(tensors) -> int:
    """1 when the kernels may use 16-byte accesses on every array: bases 16-byte aligned, and the
    strides of all but the last dimension multiples of 8 elements (of 16-bit values; 4-byte gamma
    and beta are 1-D, so only their base counts)."""
    for t in tensors:
        if t.ptr % 16 or any(s % _GROUP for n, s in zip(t.shape[:-1], t.strides[:-1]) if n > 1):
            return 0
    return 1


# ---------------------------------------------------------------------------- checks


def _storage_dtype(fn: str, name: str, dtype) -> np.dtype:
    logical = arrays.logical_dtype(dtype)
    if arrays.SHORT_NAME.get(logical) not in _DTYPES:
        raise TypeError(f"{fn}: {name} must be float16 or bfloat16, got {np.dtype(dtype)}")
    return logical


def _check_hidden(fn: str, hidden: int) -> None:
    limit = NormSpec("f16").max_hidden
    if hidden < 1:
        raise ValueError(f"{fn}: hidden_size (the last dimension of input) must be >= 1, got {hidden}")
    if hidden > limit:
        raise UnsupportedError(f"{fn}: hidden_size={hidden} has no kernel; supported: 1 to {limit} "
                               f"(a row is held in one block's registers)")


def _check_weight(fn: str, name: str, shape, dtype, hidden: int, want) -> None:
    if tuple(shape) != (hidden,):
        raise ValueError(f"{fn}: {name} must have shape (hidden_size,) = ({hidden},), got {tuple(shape)}")
    if not arrays.same_storage(np.dtype(dtype), want):
        raise TypeError(f"{fn}: {name} must have the dtype of input ({want}), got {np.dtype(dtype)}")


def _check_rmsnorm(fn, shape, dtype, w_shape, w_dtype, out) -> np.dtype:
    if len(shape) not in (2, 3):
        raise ValueError(f"{fn}: input must have shape (batch, hidden_size) or (batch, num_heads, hidden_size), "
                         f"got {tuple(shape)}")
    logical = _storage_dtype(fn, "input", dtype)
    _check_hidden(fn, shape[-1])
    _check_weight(fn, "weight", w_shape, w_dtype, shape[-1], logical)
    if out is not None:
        if tuple(out.shape) != tuple(shape):
            raise ValueError(f"{fn}: out must have the shape of input {tuple(shape)}, got {tuple(out.shape)}")
        if not arrays.same_storage(np.dtype(out.dtype), logical):
            raise TypeError(f"{fn}: out must have the dtype of input ({logical}), got {np.dtype(out.dtype)}")
    return logical


def _check_fused(fn, shape, dtype, r_shape, r_dtype, w_shape, w_dtype, same_memory: bool) -> np.dtype:
    if len(shape) != 2:
        raise ValueError(f"{fn}: input must have shape (batch, hidden_size), got {tuple(shape)}")
    logical = _storage_dtype(fn, "input", dtype)
    if tuple(r_shape) != tuple(shape):
        raise ValueError(f"{fn}: residual must have the shape of input {tuple(shape)}, got {tuple(r_shape)}")
    if not arrays.same_storage(np.dtype(r_dtype), logical):
        raise TypeError(f"{fn}: residual must have the dtype of input ({logical}), got {np.dtype(r_dtype)}")
    _check_hidden(fn, shape[-1])
    _check_weight(fn, "weight", w_shape, w_dtype, shape[-1], logical)
    if same_memory:
        raise ValueError(f"{fn}: input and residual must be different arrays (both are written), "
                         f"got overlapping memory")
    return logical


def _check_layernorm(fn, shape, dtype, g_shape, g_dtype, b_shape, b_dtype) -> np.dtype:
    if len(shape) != 2:
        raise ValueError(f"{fn}: input must have shape (batch, hidden_size), got {tuple(shape)}")
    logical = _storage_dtype(fn, "input", dtype)
    _check_hidden(fn, shape[-1])
    for name, s, d in (("gemma", g_shape, g_dtype), ("beta", b_shape, b_dtype)):
        if tuple(s) != (shape[-1],):
            raise ValueError(f"{fn}: {name} must have shape (hidden_size,) = ({shape[-1]},), got {tuple(s)}")
        if np.dtype(d) != np.float32:
            raise TypeError(f"{fn}: {name} must be float32, got {np.dtype(d)}")
    return logical
