"""Gated activations of a transformer MLP, with FlashInfer's names and semantics
(``flashinfer.activation``): for input ``[..., 2 * d]``, ``out = act(input[..., :d]) * input[..., d:]``,
act = SiLU (``silu_and_mul``), exact GELU (``gelu_and_mul``) or tanh-approximated GELU
(``gelu_tanh_and_mul``).

Inputs are float16 or bfloat16 (CuPy holds bfloat16 as a uint16 view), computed in float32 and rounded
to the input's dtype. NumPy arrays run the reference path here, GPU arrays the kernels of
``kernels_cu/activation.cu`` on the caller's stream. Unlike FlashInfer, ``d`` need not make rows of a
multiple of 16 bytes: other sizes and alignments take the kernels' scalar path.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import arrays, jit
from .errors import UnsupportedError

_SOURCE = "activation.cu"
_DTYPES = {"f16": 0, "bf16": 1}
_GROUP = 8               # outputs per thread: one 16-byte access of 16-bit values
_MAX_THREADS = 1024      # the largest block (activation.cu's __launch_bounds__)
_ENTRIES = {"silu": "cuattn_silu_and_mul", "gelu": "cuattn_gelu_and_mul", "gelu_tanh": "cuattn_gelu_tanh_and_mul"}


@dataclass(frozen=True)
class ActSpec:
    """One compiled activation.cu: the three ``*_and_mul`` entry points for one storage dtype; the
    sizes (rows, d, strides) are run-time arguments."""
    dtype: str               # "f16" | "bf16": input and output storage
    source = _SOURCE

    @property
    def name(self) -> str:   # "act_and_mul_bf16"
        return f"act_and_mul_{self.dtype}"

    def defines(self) -> tuple[str, ...]:
        return (f"-DDTYPE={_DTYPES[self.dtype]}",)


def geometry(d: int) -> tuple[int, int]:
    """(threads, chunks a row): a thread per group of 8 outputs, up to _MAX_THREADS a block (a multiple of
    32), ``chunks`` blocks to cover d (FlashInfer's geometry: one block a row for d <= 8192). Session 12's
    H100 A/B (benchmarks/results/ops_notes_session12.md) kept this form over a (rows, chunks) grid of
    256-thread blocks, two groups a thread and streaming cache hints."""
    vectors = -(-d // _GROUP)                      # groups of 8 outputs in a row
    threads = min(_MAX_THREADS, max(32, -(-vectors // 32) * 32))
    return threads, -(-vectors // threads)


def shipped_specs() -> list[ActSpec]:
    return [ActSpec(d) for d in _DTYPES]


# ---------------------------------------------------------------------------- public API


def silu_and_mul(input, out=None, enable_pdl: bool | None = None, *, stream: Any = None):
    """Fused SiLU and multiply: ``out = silu(input[..., :d]) * input[..., d:]``, silu(x) = x * sigmoid(x).

    Parameters
    ----------
    input : array, shape (..., 2 * d), float16 or bfloat16
        Last dimension contiguous, the leading dimensions viewable as one (rows). NumPy runs the
        reference path; CuPy, or any CUDA array exporting ``__dlpack__``, runs the kernel.
    out : array, optional
        Shape (..., d), dtype of ``input``; written in place and returned.
    enable_pdl : bool, optional
        Programmatic dependent launch on sm_90+ (None: on where the GPU has it, as FlashInfer).

    Returns
    -------
    out : array, shape (..., d), dtype of ``input``, same framework

    Raises
    ------
    TypeError
        If a dtype is not float16/bfloat16, ``out``'s differs from ``input``'s, or ``out`` cannot be
        written (a JAX or read-only array).
    ValueError
        If the last dimension of ``input`` is odd or ``out`` has the wrong shape.
    """
    return _act_and_mul("silu_and_mul", "silu", input, out, enable_pdl, stream)


def gelu_and_mul(input, out=None, enable_pdl: bool | None = None, *, stream: Any = None):
    """Fused exact GELU and multiply: ``out = gelu(input[..., :d]) * input[..., d:]``,
    gelu(x) = x / 2 * (1 + erf(x / sqrt(2))). Arguments, result and errors as :func:`silu_and_mul`."""
    return _act_and_mul("gelu_and_mul", "gelu", input, out, enable_pdl, stream)


def gelu_tanh_and_mul(input, out=None, enable_pdl: bool | None = None, *, stream: Any = None):
    """Fused tanh-approximated GELU and multiply: ``out = gelu_tanh(input[..., :d]) * input[..., d:]``,
    gelu_tanh(x) = x / 2 * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x**3))). Arguments, result and
    errors as :func:`silu_and_mul`."""
    return _act_and_mul("gelu_tanh_and_mul", "gelu_tanh", input, out, enable_pdl, stream)


# ---------------------------------------------------------------------------- implementation


def _act_and_mul(fn: str, act: str, input, out, enable_pdl, stream):
    arrays.writable(out, "out", fn)
    ctx = arrays.context_of(fn, {"input": input, "out": out}, stream)
    if not ctx.on_gpu:
        x = arrays.host_array(input, "input", fn)
        o = None if out is None else arrays.host_array(out, "out", fn)
        dtype, d = _check(fn, x.shape, x.dtype, o)
        xf = x.astype(np.float32)
        y = (_ACTIVATIONS[act](xf[..., :d]) * xf[..., d:]).astype(dtype)
        if out is None:
            return arrays.export(ctx, y, dtype)
        o[...] = y
        return out
    tx = arrays.device_tensor(input, "input", fn)
    to = None if out is None else arrays.device_tensor(out, "out", fn)
    dtype, d = _check(fn, tx.shape, tx.dtype, to)
    if out is None:
        out = arrays.empty(ctx, tx.shape[:-1] + (d,), dtype)
        to = arrays.device_tensor(out, "out", fn)
    rows, in_s = _rows(fn, "input", tx)
    _, out_s = _rows(fn, "out", to)
    if rows and d:
        spec = ActSpec(arrays.SHORT_NAME[dtype])
        vec = int(tx.ptr % 16 == 0 and to.ptr % 16 == 0 and d % _GROUP == 0 and in_s % _GROUP == 0
                  and out_s % _GROUP == 0)
        threads, chunks = geometry(d)
        if rows * chunks >= 2 ** 31:
            raise UnsupportedError(f"{fn}: {rows} rows of d={d} exceed the launch grid; supported: "
                                   f"rows * ceil(d / {_GROUP * threads}) < 2**31")
        launch = jit.get_launcher(spec, _ENTRIES[act], ctx.device, "pp" "i" "qq" "i" "i")
        launch((rows * chunks,), threads, ctx.stream, tx.ptr, to.ptr, d, in_s, out_s, vec, chunks,
               pdl=jit.pdl_launch(ctx.device, enable_pdl))
    return arrays.export(ctx, out, dtype)


def _rows(fn: str, name: str, t) -> tuple[int, int]:
    """(rows, row stride in elements) of a device array seen as (rows, last dimension): its leading
    dimensions must collapse into one (each stride the next one's stride times its size)."""
    rows = math.prod(t.shape[:-1])
    lead = [(n, s) for n, s in zip(t.shape[:-1], t.strides[:-1]) if n != 1]
    if rows == 0 or not lead:
        return rows, 0
    for (_, outer), (n, inner) in zip(lead, lead[1:]):
        if outer != inner * n:
            raise ValueError(f"{fn}: {name} must have leading dimensions that collapse into one (rows of one "
                             f"stride), got shape {tuple(t.shape)} strides {tuple(t.strides)} (elements); "
                             f"pass a contiguous array")
    return rows, lead[-1][1]


def _check(fn: str, shape, dtype, out) -> tuple[np.dtype, int]:
    logical = arrays.logical_dtype(dtype)
    if arrays.SHORT_NAME.get(logical) not in _DTYPES:
        raise TypeError(f"{fn}: input must be float16 or bfloat16, got {np.dtype(dtype)}")
    if len(shape) < 1 or shape[-1] % 2:
        raise ValueError(f"{fn}: input must have shape (..., 2 * d), an even last dimension, got {tuple(shape)}")
    d = shape[-1] // 2
    if out is not None:
        want = tuple(shape[:-1]) + (d,)
        if tuple(out.shape) != want:
            raise ValueError(f"{fn}: out must have shape (..., d) = {want}, got {tuple(out.shape)}")
        if not arrays.same_storage(np.dtype(out.dtype), logical):
            raise TypeError(f"{fn}: out must have the dtype of input ({logical}), got {np.dtype(out.dtype)}")
    return logical, d


# ---------------------------------------------------------------------------- NumPy activations (float32)


def _silu(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):       # exp(-x) overflows to inf for x < -88: silu -> -0
        return x / (np.float32(1) + np.exp(-x))


def _erf(x: np.ndarray) -> np.ndarray:
    """erf in float32 (NumPy has none): Abramowitz & Stegun 7.1.26, absolute error <= 1.5e-7."""
    a = np.abs(x)
    t = np.float32(1) / (np.float32(1) + np.float32(0.3275911) * a)
    poly = t * (np.float32(0.254829592) + t * (np.float32(-0.284496736) + t * (
        np.float32(1.421413741) + t * (np.float32(-1.453152027) + t * np.float32(1.061405429)))))
    return np.sign(x) * (np.float32(1) - poly * np.exp(-a * a))


def _gelu(x: np.ndarray) -> np.ndarray:
    return np.float32(0.5) * x * (np.float32(1) + _erf(x * np.float32(1 / math.sqrt(2))))


def _gelu_tanh(x: np.ndarray) -> np.ndarray:
    inner = np.float32(math.sqrt(2 / math.pi)) * (x + np.float32(0.044715) * x * x * x)
    return np.float32(0.5) * x * (np.float32(1) + np.tanh(inner))


_ACTIVATIONS = {"silu": _silu, "gelu": _gelu, "gelu_tanh": _gelu_tanh}
