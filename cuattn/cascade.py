"""Merging partial attention states (split-KV, shared-prefix cascades): ``merge_state(s)``.

A state is (v, s): the attention output over a subset of the keys and its log-sum-exp. cuattn's
LSE is in natural-log units (base e) everywhere, as returned by ``return_lse=True`` of the decode
and prefill ops; FlashInfer's is base 2 (multiply by ln 2 before passing FlashInfer LSEs here).
Merged: ``s = log(sum_i exp(s_i))``, ``v = sum_i exp(s_i - s) * v_i``; a state with ``s_i = -inf``
contributes nothing.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from . import arrays, jit, reference

_SOURCE = "cascade.cu"
_DTYPES = {"f16": 0, "bf16": 1, "f32": 2}


@dataclass(frozen=True)
class MergeSpec:
    dtype_v: str          # "f16" | "bf16" | "f32"
    source = _SOURCE

    @property
    def name(self) -> str:      # "merge_vf16"
        return f"merge_v{self.dtype_v}"

    def defines(self) -> tuple[str, ...]:
        return (f"-DDTYPE_V={_DTYPES[self.dtype_v]}",)


def shipped_specs() -> list[MergeSpec]:
    return [MergeSpec(d) for d in _DTYPES]


def _spec_for(dtype: np.dtype, fn: str) -> MergeSpec:
    logical = arrays.logical_dtype(dtype)
    short = arrays.SHORT_NAME.get(logical)
    if short not in _DTYPES:
        raise TypeError(f"{fn}: v must be float16, bfloat16 or float32, got {dtype}")
    return MergeSpec(short)


def merge_state(v_a, s_a, v_b, s_b, *, stream: Any = None):
    """Merge two attention states over disjoint key sets.

    Parameters
    ----------
    v_a, v_b : array, shape (seq_len, num_heads, head_dim), float16, bfloat16 or float32
    s_a, s_b : float32 array, shape (seq_len, num_heads): LSE, natural log (base e)

    Returns
    -------
    (v, s) : v like ``v_a`` (same dtype and framework), s float32 (seq_len, num_heads), base e.
    """
    fn = "merge_state"
    ctx = arrays.context_of(fn, {"v_a": v_a, "s_a": s_a, "v_b": v_b, "s_b": s_b}, stream)
    if not ctx.on_gpu:
        va, sa, vb, sb = (arrays.host_array(x, n, fn) for x, n in
                          ((v_a, "v_a"), (s_a, "s_a"), (v_b, "v_b"), (s_b, "s_b")))
        _check_pair(fn, va.shape, sa.shape, vb.shape, sb.shape, va.dtype, vb.dtype, sa.dtype, sb.dtype)
        v, s = reference.merge_state(va, sa, vb, sb)
        return arrays.export(ctx, v.astype(va.dtype), va.dtype), arrays.export(ctx, s)
    ta, tsa, tb, tsb = (arrays.device_tensor(x, n, fn) for x, n in
                        ((v_a, "v_a"), (s_a, "s_a"), (v_b, "v_b"), (s_b, "s_b")))
    _check_pair(fn, ta.shape, tsa.shape, tb.shape, tsb.shape, ta.dtype, tb.dtype, tsa.dtype, tsb.dtype)
    seq_len, heads, head_dim = ta.shape
    spec = _spec_for(ta.dtype, fn)
    out, s_out, to, tso, logical = _merged_outputs(ctx, ta.dtype, seq_len, heads, head_dim, fn)
    launch_merge_state(ctx, spec, ta, tsa, tb, tsb, to, tso)
    return arrays.export(ctx, out, logical), arrays.export(ctx, s_out)


def launch_merge_state(ctx, spec: MergeSpec, ta, tsa, tb, tsb, to, tso) -> None:
    """The two-state merge kernel on checked device tensors; ``to`` / ``tso`` may be ``ta`` / ``tsa``
    (in place); ``tso`` contiguous."""
    seq_len, heads, head_dim = ta.shape
    if seq_len:
        launch = jit.get_launcher(spec, "cuattn_merge_state", ctx.device, "pppppp" "ii" "qqqqqqqqqq")
        launch((seq_len, heads), 128, ctx.stream, ta.ptr, tsa.ptr, tb.ptr, tsb.ptr, to.ptr, tso.ptr,
               heads, head_dim, *ta.strides[:2], *tb.strides[:2], *tsa.strides, *tsb.strides, *to.strides[:2])


def merge_states(v, s, *, stream: Any = None):
    """Merge ``num_states`` attention states per position.

    Parameters
    ----------
    v : array, shape (seq_len, num_states, num_heads, head_dim), float16, bfloat16 or float32
    s : float32 array, shape (seq_len, num_states, num_heads): LSE, natural log (base e)

    Returns
    -------
    (v, s) : v (seq_len, num_heads, head_dim) like ``v``, s float32 (seq_len, num_heads), base e.
    """
    fn = "merge_states"
    ctx = arrays.context_of(fn, {"v": v, "s": s}, stream)
    if not ctx.on_gpu:
        va, sa = arrays.host_array(v, "v", fn), arrays.host_array(s, "s", fn)
        _check_many(fn, va.shape, sa.shape, sa.dtype)
        out_v = np.zeros((va.shape[0],) + va.shape[2:], np.float32)
        out_s = np.full(sa.shape[:1] + sa.shape[2:], -np.inf, np.float32)
        for i in range(va.shape[1]):
            out_v, out_s = reference.merge_state(out_v, out_s, va[:, i], sa[:, i])
        return arrays.export(ctx, out_v.astype(va.dtype), va.dtype), arrays.export(ctx, out_s)
    tv, ts = arrays.device_tensor(v, "v", fn), arrays.device_tensor(s, "s", fn)
    _check_many(fn, tv.shape, ts.shape, ts.dtype)
    seq_len, num_states, heads, head_dim = tv.shape
    spec = _spec_for(tv.dtype, fn)
    out, s_out, to, tso, logical = _merged_outputs(ctx, tv.dtype, seq_len, heads, head_dim, fn)
    if seq_len:
        launch = jit.get_launcher(spec, "cuattn_merge_states", ctx.device, "pppp" "iii" "qqqqqqqq")
        launch((seq_len, heads), 128, ctx.stream, tv.ptr, ts.ptr, to.ptr, tso.ptr, num_states, heads, head_dim,
               *tv.strides[:3], *ts.strides[:3], *to.strides[:2])
    return arrays.export(ctx, out, logical), arrays.export(ctx, s_out)


def _merged_outputs(ctx, dtype, seq_len: int, heads: int, head_dim: int, fn: str):
    """Merged v (dtype of the inputs; bf16 from a uint16 view) and float32 LSE, with descriptors."""
    logical = arrays.logical_dtype(dtype)
    out = arrays.empty(ctx, (seq_len, heads, head_dim), logical)
    s_out = arrays.empty(ctx, (seq_len, heads), np.float32)
    return (out, s_out, arrays.device_tensor(out, "out", fn), arrays.device_tensor(s_out, "s_out", fn),
            logical)


def _check_pair(fn, va, sa, vb, sb, dva, dvb, dsa, dsb):
    if len(va) != 3 or va != vb:
        raise ValueError(f"{fn}: v_a and v_b must have the same shape (seq_len, num_heads, head_dim), "
                         f"got {va} and {vb}")
    if sa != va[:2] or sb != va[:2]:
        raise ValueError(f"{fn}: s_a and s_b must have shape (seq_len, num_heads) = {va[:2]}, got {sa} and {sb}")
    if dva != dvb:
        raise ValueError(f"{fn}: v_a and v_b must have the same dtype, got {dva} and {dvb}")
    if dsa != np.float32 or dsb != np.float32:
        raise TypeError(f"{fn}: s_a and s_b must be float32, got {dsa} and {dsb}")


def _check_many(fn, vs, ss, sd):
    if len(vs) != 4:
        raise ValueError(f"{fn}: v must have shape (seq_len, num_states, num_heads, head_dim), got {vs}")
    if ss != vs[:3]:
        raise ValueError(f"{fn}: s must have shape (seq_len, num_states, num_heads) = {vs[:3]}, got {ss}")
    if sd != np.float32:
        raise TypeError(f"{fn}: s must be float32, got {sd}")
