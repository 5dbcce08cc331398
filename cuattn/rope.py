"""Rotary position embedding (RoPE) of queries and keys: FlashInfer's ``rope`` API.

Functions (FlashInfer 0.6 names, argument order and defaults; each also takes ``stream=``):

- ``apply_rope`` / ``apply_rope_inplace``: a ragged batch, positions from ``indptr`` and ``offsets``
  (token ``i`` of request ``b`` sits at ``offsets[b] + i - indptr[b]``);
- ``apply_rope_pos_ids`` / ``apply_rope_pos_ids_inplace``: one position per token;
- ``apply_llama31_rope`` (+ ``_inplace``, ``_pos_ids``, ``_pos_ids_inplace``): Llama 3.1 frequency
  smoothing (``low_freq_factor``, ``high_freq_factor``, ``old_context_len``);
- ``apply_rope_with_cos_sin_cache`` / ``_inplace``: the form vLLM and SGLang call, with a float32
  cache of cos and sin per position (``positions, query, key, head_size, cos_sin_cache, is_neox``).

Supported:

- styles: NeoX / Llama, pairs ``(j, j + rotary_dim/2)`` (``interleave=False``, ``is_neox=True``, the
  defaults), and GPT-J, pairs ``(2j, 2j + 1)`` (``interleave=True``, ``is_neox=False``);
- ``rotary_dim``: any even value up to ``head_dim`` and at most 512 (``MAX_ROTARY_DIM``); elements past
  it are left as they are (copied into the returned arrays);
- q and k in float16 or bfloat16 (NumPy: ``ml_dtypes.bfloat16``; CuPy: uint16 views), results in
  that dtype; any strides of the token and head dimensions with the last one contiguous (views into a
  packed qkv); the cos_sin_cache form also takes ``(nnz, num_heads * head_size)`` arrays;
- the frequencies of FlashInfer: ``freq_j = rope_theta^(-2j/rotary_dim)``, positions divided by
  ``rope_scale``, Llama 3.1 smoothing between the two wavelengths ``old_context_len / factor``;
- the returning forms allocate results in the caller's framework; the ``_inplace`` forms write into
  q and k (JAX arrays and read-only NumPy arrays are refused with a TypeError);
- NumPy arrays (and CPU tensors) run a float64 NumPy path, checking every input including the
  contents of the position metadata; GPU arrays run ``kernels_cu/rope.cu`` on the caller's stream
  with position metadata on the same GPU, checked in shape and dtype (int32 or int64) but not in
  contents (that would need a sync): a kernel never reads out of bounds, whatever they hold.

Precision: the kernel computes cos/sin in float-float arithmetic (``kernels_cu/common/rope.cuh``), so
the angle stays within 2e-7 rad of float64's up to position 2^24 and 1e-5 rad up to 2^31 - 1: results are
as accurate as fp16/bf16 can store them at any position (an angle computed in fp32, as FlashInfer
does, can be off by 0.06 rad at position 1e6).
"""
from __future__ import annotations

import functools
import math
import numbers
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from . import arrays, jit
from .errors import UnsupportedError

_SOURCE = "rope.cu"
_ENTRIES = {p: f"cuattn_rope_p{p}" for p in (1, 2, 4, 8)}     # pairs a lane owns: 32 * p >= rotary_dim / 2
_DTYPES = {"f16": 0, "bf16": 1}
_STORAGE = (np.dtype(np.float16), arrays.bfloat16)
_INDEX_DTYPES = (np.dtype(np.int32), np.dtype(np.int64))
MAX_ROTARY_DIM = 512               # rope.cu: at most 8 pairs per lane of a warp
_WARPS = 4                         # rope.cu's block: 4 warps, one token at a time each
_MIN_BLOCKS_PER_SM = 4             # rope.cu's __launch_bounds__(128, 4)
# q k q_out k_out pos_ids indptr offsets cache | nnz batch Hq Hk head_dim rotary_dim interleave idx64
# vector lanes_per_row tail_unit | 8 strides, cache stride, cache length | 5 float-float frequency parameters
_ARG_KINDS = "pppppppp" "iiiiiiiiiii" "qqqqqqqqqq" "ffffffffff"


@dataclass(frozen=True)
class RopeSpec:
    """The RoPE kernels of one storage dtype (compile-time). The rest (head_dim, rotary_dim, style,
    position source, frequencies, vectorized accesses) are launch arguments of a memory-bound kernel,
    whose branches on them are uniform across a warp; the four entries of rope.cu (pairs a lane owns)
    keep registers sized to the rotary_dim. Two specs cover everything."""
    dtype: str            # "f16" | "bf16": storage of q, k and the results
    source = _SOURCE

    @property
    def name(self) -> str:     # "rope_f16"
        return f"rope_{self.dtype}"

    def defines(self) -> tuple[str, ...]:
        return (f"-DDTYPE={_DTYPES[self.dtype]}",)

    def grid(self, nnz: int, heads: int, resident_blocks: int) -> tuple[int, int]:
        """(blocks, head_splits) for ``resident_blocks`` blocks the GPU holds at once (one wave): a warp
        per token, the tokens spread evenly over the warps of at most one wave (a warp loops over its
        tokens; a second, partial wave would leave most SMs idle at its end); fewer tokens than that
        split their heads over more blocks (two heads a warp at least)."""
        per_warp = -(-nnz // (_WARPS * resident_blocks))            # tokens a warp
        blocks = -(-nnz // (_WARPS * per_warp))
        return blocks, max(1, min(-(-heads // 2), resident_blocks // blocks))


def shipped_specs() -> list[RopeSpec]:
    return [RopeSpec(d) for d in _DTYPES]


_SPECS = {arrays.bfloat16 if d == "bf16" else np.dtype(np.float16): RopeSpec(d) for d in _DTYPES}


# ---------------------------------------------------------------------------- frequencies


class _Freq(NamedTuple):
    """Frequency parameters: FlashInfer's rope_scale, rope_theta and smoothing (0, 0: none)."""
    rope_scale: float
    rope_theta: float
    smooth_a: float = 0.0
    smooth_b: float = 0.0


def _positive(fn: str, name: str, v) -> float:
    if type(v) not in (int, float) and (isinstance(v, bool) or not isinstance(v, numbers.Real)):
        raise ValueError(f"{fn}: {name} must be a finite number > 0, got {v!r}")
    if not 0 < v < math.inf:
        raise ValueError(f"{fn}: {name} must be a finite number > 0, got {v!r}")
    return float(v)


def _plain_freq(fn: str, rope_scale, rope_theta) -> _Freq:
    return _Freq(_positive(fn, "rope_scale", rope_scale), _positive(fn, "rope_theta", rope_theta))


def _llama31_freq(fn: str, rope_scale, rope_theta, low_freq_factor, high_freq_factor, old_context_len) -> _Freq:
    base = _plain_freq(fn, rope_scale, rope_theta)
    low = _positive(fn, "low_freq_factor", low_freq_factor)
    high = _positive(fn, "high_freq_factor", high_freq_factor)
    old = _positive(fn, "old_context_len", old_context_len)
    if high <= low:
        raise ValueError(f"{fn}: high_freq_factor must be greater than low_freq_factor, got "
                         f"high_freq_factor={high_freq_factor}, low_freq_factor={low_freq_factor}")
    # smooth = clamp(freq * a + b, 0, 1) = (old_context_len / wavelength - low) / (high - low)
    return base._replace(smooth_a=old / (2 * math.pi * (high - low)), smooth_b=-1.0 / (high / low - 1.0))


def _inv_freq(f: _Freq, rotary_dim: int) -> np.ndarray:
    """float64 (rotary_dim // 2,): the angle per position of each pair (the NumPy path)."""
    freq = (1.0 / f.rope_theta) ** (2.0 * np.arange(rotary_dim // 2) / rotary_dim)
    smooth = np.clip(freq * f.smooth_a + f.smooth_b, 0.0, 1.0)
    return (1.0 - smooth) * freq / f.rope_scale + smooth * freq


def _split(x: float) -> tuple[float, float]:
    """x as a float-float pair (hi, lo) of float32 values, hi + lo = x to ~2^-48."""
    hi = np.float32(x)
    return float(hi), float(np.float32(x - float(hi)))


@functools.lru_cache(maxsize=64)
def _kernel_freq(f: _Freq, rotary_dim: int) -> tuple[float, ...]:
    """rope.cuh's RopeFreq: step = rcp_theta^(2/rotary_dim), smooth_a, smooth_b, rcp_scale/pi,
    (1 - rcp_scale)/pi, each split into float-float pairs (computed in float64 here)."""
    rcp_scale = 1.0 / f.rope_scale
    step = (1.0 / f.rope_theta) ** (2.0 / rotary_dim)
    return (*_split(step), *_split(f.smooth_a), *_split(f.smooth_b), *_split(rcp_scale / math.pi),
            *_split((1.0 - rcp_scale) / math.pi))


# ---------------------------------------------------------------------------- checks


class _Ragged(NamedTuple):
    indptr: Any
    offsets: Any

    def named(self) -> dict:
        return {"indptr": self.indptr, "offsets": self.offsets}


class _PosIds(NamedTuple):
    pos_ids: Any
    name: str = "pos_ids"          # "positions" in the cos_sin_cache form

    def named(self) -> dict:
        return {self.name: self.pos_ids}


def _heads_shape(shape: tuple, head_size: int | None, name: str, fn: str) -> tuple:
    """(nnz, num_heads, head_dim) of q or k: 3-D, or with ``head_size`` also (nnz, num_heads * head_size)."""
    if head_size is not None and len(shape) == 2:
        if shape[1] % head_size:
            raise ValueError(f"{fn}: {name} must have shape (nnz, num_heads * head_size) with head_size="
                             f"{head_size}, got {shape} ({shape[1]} is not a multiple of {head_size})")
        return (shape[0], shape[1] // head_size, head_size)
    if len(shape) != 3:
        expected = "(nnz, num_heads, head_size) or (nnz, num_heads * head_size)" if head_size else \
            "(nnz, num_heads, head_dim)"
        raise ValueError(f"{fn}: {name} must have shape {expected}, got {shape}")
    if head_size is not None and shape[2] != head_size:
        raise ValueError(f"{fn}: {name} must have head_size={head_size} elements in its last dimension, "
                         f"got shape {shape}")
    return tuple(shape)


def _check_qk(fn: str, names: tuple, q3: tuple, k3: tuple, q_dtype, k_dtype) -> np.dtype:
    qn, kn = names
    if q_dtype not in _STORAGE:
        raise TypeError(f"{fn}: {qn} must be float16 or bfloat16, got {q_dtype}")
    if k_dtype != q_dtype:
        raise TypeError(f"{fn}: {qn} and {kn} must have the same dtype, got {qn}={q_dtype}, {kn}={k_dtype}")
    if k3[0] != q3[0]:
        raise ValueError(f"{fn}: {qn} and {kn} must have the same number of tokens (nnz), got "
                         f"{qn} {q3} and {kn} {k3}")
    if k3[2] != q3[2]:
        raise ValueError(f"{fn}: {qn} and {kn} must have the same head_dim, got {qn} {q3} and {kn} {k3}")
    if q3[0] >= 2 ** 31 or q3[1] + k3[1] >= 2 ** 31:
        raise UnsupportedError(f"{fn}: nnz and num_heads must be below 2^31, got {qn} {q3}, {kn} {k3}")
    return q_dtype


def _check_rotary_dim(fn: str, rotary_dim, head_dim: int, name: str = "rotary_dim") -> int:
    if rotary_dim is None:
        rotary_dim = head_dim
    if isinstance(rotary_dim, bool) or not isinstance(rotary_dim, numbers.Integral):
        raise TypeError(f"{fn}: {name} must be an int or None, got {rotary_dim!r}")
    rotary_dim = int(rotary_dim)
    if rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > head_dim:
        raise ValueError(f"{fn}: {name} must be even and in 2..head_dim={head_dim}, got {rotary_dim}")
    if rotary_dim > MAX_ROTARY_DIM:
        raise UnsupportedError(f"{fn}: {name}={rotary_dim} has no kernel; at most {MAX_ROTARY_DIM}")
    return rotary_dim


def _check_cache(fn: str, shape: tuple, dtype, head_size: int) -> int:
    """The rotary_dim a cos_sin_cache (max_seq_len, rotary_dim) float32 gives."""
    if dtype != np.float32:
        raise TypeError(f"{fn}: cos_sin_cache must be float32, got {dtype}; convert it once (e.g. .float())")
    if len(shape) != 2:
        raise ValueError(f"{fn}: cos_sin_cache must have shape (max_seq_len, rotary_dim), got {shape}")
    return _check_rotary_dim(fn, shape[1], head_size, "cos_sin_cache.shape[1] (rotary_dim)")


def _host_positions(fn: str, where, nnz: int) -> np.ndarray:
    """int64 (nnz,) positions from host metadata, every value checked."""
    if isinstance(where, _PosIds):
        return arrays.host_int_vector(where.pos_ids, where.name, fn, nnz).astype(np.int64)
    indptr = arrays.host_int_vector(where.indptr, "indptr", fn).astype(np.int64)
    if len(indptr) == 0 or indptr[0] != 0:
        raise ValueError(f"{fn}: indptr must start at 0 (shape (batch_size + 1,)), got {indptr[:4]}")
    steps = np.diff(indptr)
    if np.any(steps < 0):
        at = int(np.argmax(steps < 0))
        raise ValueError(f"{fn}: indptr must be non-decreasing, got indptr[{at}]={indptr[at]} > "
                         f"indptr[{at + 1}]={indptr[at + 1]}")
    if indptr[-1] != nnz:
        raise ValueError(f"{fn}: indptr[-1] must equal nnz={nnz} (the tokens of q and k), got {indptr[-1]}")
    offsets = arrays.host_int_vector(where.offsets, "offsets", fn, len(indptr) - 1).astype(np.int64)
    request = np.repeat(np.arange(len(steps)), steps)
    return offsets[request] + np.arange(nnz) - indptr[request]


# ---------------------------------------------------------------------------- the two paths


def _rope(fn: str, q, k, where, rotary_dim, interleave, freq: _Freq | None, *, inplace: bool, stream,
          cache=None, head_size: int | None = None, names: tuple = ("q", "k")):
    operands = (q, k) + tuple(where[:-1] if isinstance(where, _PosIds) else where) + \
        (() if cache is None else (cache,))
    # -- a serving loop passes arrays of the same layouts every layer: a layout key whose checks passed
    #    once (CuPy / PyTorch arrays only: arrays.pointer_layout) finds its launch plan, so a call costs
    #    the pointers, the stream and the launch rather than 10-20 µs of descriptions and checks
    found = [arrays.pointer_layout(x) for x in operands]
    key = None
    if None not in found:
        key = (fn, rotary_dim, bool(interleave), freq, head_size, tuple(f[1] for f in found))
        plan = _PLANS.get(key)
        if plan is not None:
            return _run_plan(plan, [f[0] for f in found], arrays.resolve_stream(plan.framework, plan.device, stream))
    qn, kn = names
    named = {qn: q, kn: k, **where.named()}
    if cache is not None:
        named["cos_sin_cache"] = cache
    ctx = arrays.context_of(fn, named, stream)
    if inplace:
        arrays.writable(q, qn, fn)
        arrays.writable(k, kn, fn)
    if not ctx.on_gpu:
        return _rope_host(fn, ctx, q, k, where, rotary_dim, bool(interleave), freq, inplace, cache, head_size, names)
    plan, pointers = _plan_device(fn, ctx, q, k, where, rotary_dim, bool(interleave), freq, inplace, cache,
                                  head_size, names)
    if key is not None:
        if len(_PLANS) >= 256:
            _PLANS.clear()
        _PLANS[key] = plan
    return _run_plan(plan, pointers, ctx.stream)


def _rope_host(fn, ctx, q, k, where, rotary_dim, interleave, freq, inplace, cache, head_size, names):
    qn, kn = names
    qa, ka = arrays.host_array(q, qn, fn), arrays.host_array(k, kn, fn)
    q3, k3 = _heads_shape(qa.shape, head_size, qn, fn), _heads_shape(ka.shape, head_size, kn, fn)
    dtype = _check_qk(fn, names, q3, k3, qa.dtype, ka.dtype)
    nnz, head_dim = q3[0], q3[2]
    if cache is not None:
        ca = arrays.host_array(cache, "cos_sin_cache", fn)
        rot = _check_cache(fn, ca.shape, ca.dtype, head_dim)
    else:
        rot = _check_rotary_dim(fn, rotary_dim, head_dim)
    pos = _host_positions(fn, where, nnz)
    half = rot // 2
    if cache is not None:
        bad = (pos < 0) | (pos >= ca.shape[0])
        if np.any(bad):
            at = int(np.argmax(bad))
            raise ValueError(f"{fn}: {where.name} must be in [0, max_seq_len={ca.shape[0]}) (rows of "
                             f"cos_sin_cache), got {where.name}[{at}]={pos[at]}")
        cos, sin = ca[pos, :half].astype(np.float64), ca[pos, half:rot].astype(np.float64)
    else:
        angle = pos[:, None].astype(np.float64) * _inv_freq(freq, rot)[None, :]
        cos, sin = np.cos(angle), np.sin(angle)
    qv, kv = qa.reshape(q3), ka.reshape(k3)      # views: only the last dimension is split
    q_rot, k_rot = (_rotate_host(x, cos, sin, rot, interleave) for x in (qv, kv))
    if inplace:
        qv[..., :rot] = q_rot.astype(dtype)
        kv[..., :rot] = k_rot.astype(dtype)
        return None
    outs = []
    for view, rotated, shape in ((qv, q_rot, qa.shape), (kv, k_rot, ka.shape)):
        out = np.array(view, dtype=dtype)           # a copy, the elements past rot included
        out[..., :rot] = rotated.astype(dtype)
        outs.append(arrays.export(ctx, out.reshape(shape), dtype))
    return tuple(outs)


def _rotate_host(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, rot: int, interleave: bool) -> np.ndarray:
    """float64 (nnz, heads, rot): the first rot elements of x (nnz, heads, head_dim) rotated."""
    y = x[..., :rot].astype(np.float64)
    a = y[..., 0::2] if interleave else y[..., :rot // 2]
    b = y[..., 1::2] if interleave else y[..., rot // 2:]
    c, s = cos[:, None, :], sin[:, None, :]
    a_new, b_new = a * c - b * s, b * c + a * s
    out = np.empty_like(y)
    if interleave:
        out[..., 0::2], out[..., 1::2] = a_new, b_new
    else:
        out[..., :rot // 2], out[..., rot // 2:] = a_new, b_new
    return out


def _device_view(t: arrays.Tensor, head_size: int | None, name: str, fn: str) -> tuple[tuple, tuple]:
    """(shape, element strides) of a device q/k (or output) as (nnz, num_heads, head_dim)."""
    shape = _heads_shape(t.shape, head_size, name, fn)
    if len(t.shape) == 2:
        return shape, (t.strides[0], head_size, 1)
    return shape, tuple(t.strides)


def _device_index(t: arrays.Tensor, name: str, fn: str, length: int | None = None) -> arrays.Tensor:
    if t.ndim != 1 or (length is not None and t.shape[0] != length):
        expected = f"shape ({length},)" if length is not None else "a 1-D shape"
        raise ValueError(f"{fn}: {name} must have {expected}, got {t.shape}")
    if t.dtype not in _INDEX_DTYPES:
        raise TypeError(f"{fn}: {name} must be int32 or int64 on the GPU, got {t.dtype}")
    return t


def _lane_pairs(rotary_dim: int) -> int:
    """rope.cu's P for 2-byte accesses: the pairs a lane owns, the fewest with 32 * P >= rotary_dim / 2."""
    return next(p for p in _ENTRIES if 32 * p >= rotary_dim // 2)


class _Layout(NamedTuple):
    pairs: int             # rope.cu's P (its entry)
    lanes_per_row: int     # vector: lanes serving a row (copy lanes included); 32 for 2-byte accesses
    access: int            # bytes a vector access needs every pointer aligned to; 0: 2-byte accesses only


def _vector_layout(rotary_dim: int, head_dim: int, interleave: bool, cover_tail: bool, strides: list) -> _Layout:
    """rope.cu's lane layout: the most pairs a lane (P of 8, 4, 2, 1) whose accesses (2P elements, in
    runs of P for NeoX) the strides allow and whose rotary_dim / 2 / P lanes fit a warp; the returning
    forms with rotary_dim < head_dim add lanes that copy the tail (2P elements each) where the tail
    splits into such runs and the row's lanes still fit a warp (else rope.cu copies tails after each
    row). Otherwise (no P fits) one warp a row in coalesced 2-byte accesses."""
    half = rotary_dim // 2
    for p in (8, 4, 2, 1):
        access = min((4 if interleave else 2) * p, 16)
        if half % p or half // p > 32 or any(s % access for s in strides):
            continue
        lanes = half // p
        if cover_tail and (head_dim - rotary_dim) % (2 * p) == 0 and head_dim // (2 * p) <= 32:
            lanes = head_dim // (2 * p)
        return _Layout(p, lanes, access)
    return _Layout(_lane_pairs(rotary_dim), 32, 0)


@functools.cache
def _resident_blocks(spec: RopeSpec, entry: str, device: int) -> int:
    """Blocks of rope.cu's entry one wave of the device holds: SMs x the driver's occupancy (registers,
    shared memory, threads; at least __launch_bounds__' 4)."""
    cp = arrays.cupy_module()
    function = jit.get_function(spec, entry, device)
    with cp.cuda.Device(device):
        per_sm = cp.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(function.ptr, _WARPS * 32, 0)
    return cp.cuda.Device(device).attributes["MultiProcessorCount"] * max(_MIN_BLOCKS_PER_SM, per_sm)


class _Plan(NamedTuple):
    """A checked device call without its pointers: everything a launch needs but them, for a layout key."""
    framework: str
    device: int
    dtype: np.dtype
    out_shapes: tuple | None   # (q, k) result shapes; None for the in-place forms
    ragged: bool               # operands after q, k: (indptr, offsets) or (pos_ids,), then the cache if cached
    cached: bool
    launcher: Any              # None: nothing to launch (no tokens or no heads)
    grid: tuple
    layout: _Layout            # lanes and vector access; pointers are checked per call
    tail_unit: int             # widest access (bytes) the tails' offsets and strides allow; 0: no copy
    ints: tuple                # nnz .. idx64
    rest: tuple                # strides, cache stride and length, frequencies
    cache_launch: tuple | None = None   # (launcher, grid) of rope.cu's cos_sin_cache entry: calls with vector accesses


_PLANS: dict = {}


def _run_plan(plan: _Plan, pointers: list, stream):
    """Launch a plan on ``pointers`` (q, k, the metadata, the cache) and return what the call returns."""
    q, k = pointers[0], pointers[1]
    results = None
    if plan.out_shapes is None:
        q_out, k_out = q, k
    else:
        ctx = arrays.Context(plan.framework, plan.device, stream)
        results = tuple(arrays.empty(ctx, shape, plan.dtype) for shape in plan.out_shapes)
        q_out, k_out = (arrays.pointer_layout(r)[0] for r in results)
    if plan.launcher is not None:
        meta = (0, pointers[2], pointers[3]) if plan.ragged else (pointers[2], 0, 0)
        vector, tail_unit = _access(plan.layout, plan.tail_unit, q | k | q_out | k_out)
        launcher, grid = plan.cache_launch if vector and plan.cache_launch else (plan.launcher, plan.grid)
        launcher(grid, _WARPS * 32, stream, q, k, q_out, k_out, *meta, pointers[-1] if plan.cached else 0,
                      *plan.ints, vector, plan.layout.lanes_per_row, tail_unit, *plan.rest)
    if results is None:
        return None
    ctx = arrays.Context(plan.framework, plan.device, stream)
    return arrays.export(ctx, results[0], plan.dtype), arrays.export(ctx, results[1], plan.dtype)


def _access(layout: _Layout, tail_unit: int, bits: int) -> tuple[int, int]:
    """(vector, tail_unit) of a launch whose pointers OR to ``bits``: vector accesses and tail copies only
    as wide as the pointers' alignment allows too."""
    return int(layout.access != 0 and bits % layout.access == 0), min(tail_unit, bits & -bits)


def _launch_shape(spec: RopeSpec, device: int, nnz: int, heads: int, head_dim: int, rot: int, interleave: bool,
                  copy_tail: bool, strides: list):
    """(tail_unit, layout, launcher, grid) of a launch over ``heads`` rows a token whose strides in bytes
    are ``strides``; ``copy_tail``: the results are new arrays, the elements past ``rot`` copied into them
    (in the widest access the tails, bases and strides allow). launcher None: nothing to launch."""
    tail_unit = 0 if not copy_tail or rot == head_dim else next(
        u for u in (16, 8, 4, 2) if (rot * 2) % u == 0 and ((head_dim - rot) * 2) % u == 0 and
        all(s % u == 0 for s in strides))
    layout = _vector_layout(rot, head_dim, interleave, tail_unit != 0, strides)
    if not (nnz and heads):
        return tail_unit, layout, None, (0, 0)
    entry = _ENTRIES[layout.pairs]
    return (tail_unit, layout, jit.get_launcher(spec, entry, device, _ARG_KINDS),
            spec.grid(nnz, heads, _resident_blocks(spec, entry, device)))


def _cache_entry(cached: bool, layout: _Layout, tail_unit: int, interleave: bool) -> str | None:
    """rope.cu's cos_sin_cache entry where it serves a launch (a cache, 8 pairs a lane in vector accesses, no tail
    to copy), else None: the general entry serves it."""
    if not (cached and layout.pairs == 8 and layout.access and tail_unit == 0):
        return None
    return "cuattn_rope_cache_gptj" if interleave else "cuattn_rope_cache_neox"


def _cache_launch(spec: RopeSpec, device: int, entry: str | None, nnz: int, heads: int):
    """(launcher, grid) of ``entry`` (``_cache_entry``'s), None where there is none or nothing to launch."""
    if entry is None or not (nnz and heads):
        return None
    return (jit.get_launcher(spec, entry, device, _ARG_KINDS),
            spec.grid(nnz, heads, _resident_blocks(spec, entry, device)))


def rotate_rows(ctx, src: arrays.Tensor, dst_ptr: int, indptr_ptr: int, offsets_ptr: int, batch: int,
                rotary_dim: int, freq_args: tuple) -> None:
    """Ragged prefill's RoPE ahead of the kernel (prefill_rope.py): the rows (nnz, heads, head_dim) of ``src``
    (element strides, the last 1; ``src.dtype`` the logical 16-bit type) rotated into ``dst_ptr`` (contiguous),
    token t of request b at position offsets[b] + t - indptr[b] (int32 device arrays of batch + 1 and batch
    entries); NeoX pairs, elements past ``rotary_dim`` copied; ``freq_args``: ``_kernel_freq``'s 10 values.
    One launch on ``ctx``'s stream."""
    nnz, heads, head_dim = src.shape
    s_str, d_str = src.strides, (heads * head_dim, head_dim, 1)
    strides = [2 * s for st in (s_str, d_str) for n, s in zip((nnz, heads), st[:2]) if n > 1]
    tail_unit, layout, launcher, grid = _launch_shape(_SPECS[src.dtype], ctx.device, nnz, heads, head_dim,
                                                      rotary_dim, False, True, strides)
    if launcher is not None:
        vector, tail_unit = _access(layout, tail_unit, src.ptr | dst_ptr)
        launcher(grid, _WARPS * 32, ctx.stream, src.ptr, src.ptr, dst_ptr, dst_ptr, 0, indptr_ptr, offsets_ptr, 0,
                 nnz, batch, heads, 0, head_dim, rotary_dim, 0, 0, vector, layout.lanes_per_row, tail_unit,
                 s_str[0], s_str[1], s_str[0], s_str[1], d_str[0], d_str[1], d_str[0], d_str[1], 0, 0, *freq_args)


def _plan_device(fn, ctx, q, k, where, rotary_dim, interleave, freq, inplace, cache, head_size, names):
    """Check a device call's operands; returns its plan and their pointers."""
    qn, kn = names
    tq, tk = arrays.device_tensor(q, qn, fn), arrays.device_tensor(k, kn, fn)
    (q3, q_str), (k3, k_str) = _device_view(tq, head_size, qn, fn), _device_view(tk, head_size, kn, fn)
    dtype = _check_qk(fn, names, q3, k3, arrays.logical_dtype(tq.dtype), arrays.logical_dtype(tk.dtype))
    nnz, head_dim = q3[0], q3[2]
    cache_n = cache_len = 0
    if cache is not None:
        tc = arrays.device_tensor(cache, "cos_sin_cache", fn)
        rot = _check_cache(fn, tc.shape, tc.dtype, head_dim)
        cache_n, cache_len = tc.strides[0], tc.shape[0]
        freq_args = (0.0,) * 10
    else:
        rot = _check_rotary_dim(fn, rotary_dim, head_dim)
        freq_args = _kernel_freq(freq, rot)
    batch = 0
    if isinstance(where, _PosIds):
        tp = _device_index(arrays.device_tensor(where.pos_ids, where.name, fn), where.name, fn, nnz)
        meta, idx_dtype = [tp], tp.dtype
    else:
        ti = _device_index(arrays.device_tensor(where.indptr, "indptr", fn), "indptr", fn)
        if ti.shape[0] == 0:
            raise ValueError(f"{fn}: indptr must have shape (batch_size + 1,), got (0,)")
        batch = ti.shape[0] - 1
        to = _device_index(arrays.device_tensor(where.offsets, "offsets", fn), "offsets", fn, batch)
        if to.dtype != ti.dtype:
            raise TypeError(f"{fn}: indptr and offsets must have the same dtype, got indptr={ti.dtype}, "
                            f"offsets={to.dtype}")
        if batch == 0 and nnz:
            raise ValueError(f"{fn}: indptr describes no requests (shape (1,)) but {qn} has nnz={nnz} tokens")
        meta, idx_dtype = [ti, to], ti.dtype
    if inplace:
        qo_str, ko_str = q_str, k_str
    else:   # results are allocated contiguous: (nnz, heads, head_dim) strides of their own shapes
        qo_str, ko_str = (q3[1] * head_dim, head_dim, 1), (k3[1] * head_dim, head_dim, 1)
    heads = q3[1] + k3[1]
    spec = _SPECS[dtype]
    strides = [s * 2 for shape, stride in ((q3, q_str), (k3, k_str), (q3, qo_str), (k3, ko_str))
               for n, s in zip(shape[:2], stride[:2]) if n > 1]            # bytes
    tail_unit, layout, launcher, grid = _launch_shape(spec, ctx.device, nnz, heads, head_dim, rot, interleave,
                                                      not inplace, strides)
    plan = _Plan(ctx.framework, ctx.device, dtype, None if inplace else (tq.shape, tk.shape),
                 not isinstance(where, _PosIds), cache is not None, launcher, grid, layout, tail_unit,
                 (nnz, batch, q3[1], k3[1], head_dim, rot, int(interleave), int(idx_dtype == np.int64)),
                 (q_str[0], q_str[1], k_str[0], k_str[1], qo_str[0], qo_str[1], ko_str[0], ko_str[1], cache_n,
                  cache_len, *freq_args), _cache_launch(spec, ctx.device, _cache_entry(
                     cache is not None, layout, tail_unit, interleave), nnz, heads))
    pointers = [tq.ptr, tk.ptr] + [t.ptr for t in meta] + ([tc.ptr] if cache is not None else [])
    return plan, pointers


# ---------------------------------------------------------------------------- public API


def apply_rope(q, k, indptr, offsets, rotary_dim=None, interleave=False, rope_scale=1, rope_theta=1e4, *,
               stream=None):
    """Rotary embedding of a ragged batch of queries and keys, positions from ``indptr`` and ``offsets``.

    Parameters
    ----------
    q : array, shape (nnz, num_qo_heads, head_dim), float16 or bfloat16
        NumPy runs the float64 reference path; CuPy, or any CUDA array exporting ``__dlpack__``
        (PyTorch, JAX), runs the CUDA kernel. The first two dimensions may have any strides (views
        into a packed qkv); the last must be contiguous.
    k : array, shape (nnz, num_kv_heads, head_dim), dtype of ``q``
    indptr : int array, shape (batch_size + 1,)
        Request ``b`` holds tokens ``indptr[b]:indptr[b+1]``; ``indptr[0] == 0``, ``indptr[-1] == nnz``.
        On the same device as ``q``; int32 or int64 on the GPU.
    offsets : int array, shape (batch_size,)
        Token ``i`` of request ``b`` sits at position ``offsets[b] + i - indptr[b]``.
    rotary_dim : int, optional
        Rotate the first ``rotary_dim`` elements of each head (even, <= head_dim, <= 512); None: all.
    interleave : bool
        False (NeoX / Llama): pairs ``(j, j + rotary_dim/2)``; True (GPT-J): pairs ``(2j, 2j + 1)``.
    rope_scale : float
        Positions are divided by it (linear position interpolation).
    rope_theta : float
        Pair ``j`` turns by ``rope_theta ** (-2j / rotary_dim)`` radians per position.
    stream : optional
        A CuPy stream, ``torch.cuda.Stream`` or raw handle; default: the caller framework's current one.

    Returns
    -------
    (q_rope, k_rope) : arrays like ``q`` and ``k`` (shape, dtype, framework); elements past
        ``rotary_dim`` copied.

    Raises
    ------
    ValueError, TypeError
        Naming the argument: shapes, dtypes, ``rotary_dim`` odd or above head_dim; on the CPU path also
        ``indptr`` not starting at 0, decreasing or not ending at nnz, and wrong metadata lengths.
    UnsupportedError
        If ``rotary_dim`` > 512.
    """
    fn = "apply_rope"
    return _rope(fn, q, k, _Ragged(indptr, offsets), rotary_dim, interleave, _plain_freq(fn, rope_scale, rope_theta),
                 inplace=False, stream=stream)


def apply_rope_inplace(q, k, indptr, offsets, rotary_dim=None, interleave=False, rope_scale=1, rope_theta=1e4,
                       *, stream=None) -> None:
    """``apply_rope`` written into ``q`` and ``k`` (elements past ``rotary_dim`` untouched); returns None.
    A JAX (immutable) or read-only NumPy ``q`` or ``k`` raises TypeError."""
    fn = "apply_rope_inplace"
    return _rope(fn, q, k, _Ragged(indptr, offsets), rotary_dim, interleave, _plain_freq(fn, rope_scale, rope_theta),
                 inplace=True, stream=stream)


def apply_rope_pos_ids(q, k, pos_ids, rotary_dim=None, interleave=False, rope_scale=1, rope_theta=1e4, *,
                       stream=None):
    """Rotary embedding with one position per token: ``apply_rope`` with ``pos_ids`` (int array,
    shape (nnz,), on the device of ``q``) in place of ``indptr`` and ``offsets``.

    Returns (q_rope, k_rope) like ``q`` and ``k``; see ``apply_rope`` for the other arguments.
    """
    fn = "apply_rope_pos_ids"
    return _rope(fn, q, k, _PosIds(pos_ids), rotary_dim, interleave, _plain_freq(fn, rope_scale, rope_theta),
                 inplace=False, stream=stream)


def apply_rope_pos_ids_inplace(q, k, pos_ids, rotary_dim=None, interleave=False, rope_scale=1, rope_theta=1e4,
                               *, stream=None) -> None:
    """``apply_rope_pos_ids`` written into ``q`` and ``k``; returns None (see ``apply_rope_inplace``)."""
    fn = "apply_rope_pos_ids_inplace"
    return _rope(fn, q, k, _PosIds(pos_ids), rotary_dim, interleave, _plain_freq(fn, rope_scale, rope_theta),
                 inplace=True, stream=stream)


def apply_llama31_rope(q, k, indptr, offsets, rotary_dim=None, interleave=False, rope_scale=8, rope_theta=5e5,
                       low_freq_factor=1, high_freq_factor=4, old_context_len=8192, *, stream=None):
    """Llama 3.1 rotary embedding of a ragged batch: ``apply_rope`` with smoothed frequencies.

    Parameters
    ----------
    q, k, indptr, offsets, rotary_dim, interleave, stream
        As in ``apply_rope``.
    rope_scale : float
        The factor the low frequencies are divided by.
    rope_theta : float
    low_freq_factor, high_freq_factor : float
        Wavelengths below ``old_context_len / high_freq_factor`` keep their frequency, those above
        ``old_context_len / low_freq_factor`` are divided by ``rope_scale``, those between are
        interpolated. ``high_freq_factor > low_freq_factor > 0``.
    old_context_len : int
        The context length the model was trained with before the scaling.

    Returns
    -------
    (q_rope, k_rope) : arrays like ``q`` and ``k``.
    """
    fn = "apply_llama31_rope"
    freq = _llama31_freq(fn, rope_scale, rope_theta, low_freq_factor, high_freq_factor, old_context_len)
    return _rope(fn, q, k, _Ragged(indptr, offsets), rotary_dim, interleave, freq, inplace=False, stream=stream)


def apply_llama31_rope_inplace(q, k, indptr, offsets, rotary_dim=None, interleave=False, rope_scale=8,
                               rope_theta=5e5, low_freq_factor=1, high_freq_factor=4, old_context_len=8192, *,
                               stream=None) -> None:
    """``apply_llama31_rope`` written into ``q`` and ``k``; returns None (see ``apply_rope_inplace``)."""
    fn = "apply_llama31_rope_inplace"
    freq = _llama31_freq(fn, rope_scale, rope_theta, low_freq_factor, high_freq_factor, old_context_len)
    return _rope(fn, q, k, _Ragged(indptr, offsets), rotary_dim, interleave, freq, inplace=True, stream=stream)


def apply_llama31_rope_pos_ids(q, k, pos_ids, rotary_dim=None, interleave=False, rope_scale=8, rope_theta=5e5,
                               low_freq_factor=1, high_freq_factor=4, old_context_len=8192, *, stream=None):
    """``apply_llama31_rope`` with one position per token (``pos_ids`` as in ``apply_rope_pos_ids``)."""
    fn = "apply_llama31_rope_pos_ids"
    freq = _llama31_freq(fn, rope_scale, rope_theta, low_freq_factor, high_freq_factor, old_context_len)
    return _rope(fn, q, k, _PosIds(pos_ids), rotary_dim, interleave, freq, inplace=False, stream=stream)


def apply_llama31_rope_pos_ids_inplace(q, k, pos_ids, rotary_dim=None, interleave=False, rope_scale=8,
                                       rope_theta=5e5, low_freq_factor=1, high_freq_factor=4, old_context_len=8192,
                                       *, stream=None) -> None:
    """``apply_llama31_rope_pos_ids`` written into ``q`` and ``k``; returns None."""
    fn = "apply_llama31_rope_pos_ids_inplace"
    freq = _llama31_freq(fn, rope_scale, rope_theta, low_freq_factor, high_freq_factor, old_context_len)
    return _rope(fn, q, k, _PosIds(pos_ids), rotary_dim, interleave, freq, inplace=True, stream=stream)


def apply_rope_with_cos_sin_cache(positions, query, key, head_size, cos_sin_cache, is_neox=True, *, stream=None):
    """Rotary embedding with precomputed cos/sin: the form vLLM and SGLang call.

    Parameters
    ----------
    positions : int array, shape (nnz,)
        The ``cos_sin_cache`` row of each token, in ``[0, max_seq_len)``: checked on the CPU path; on
        the GPU a position outside gives NaN in that token's rotated elements.
    query : array, shape (nnz, num_qo_heads * head_size) or (nnz, num_qo_heads, head_size), float16 or bfloat16
    key : array, shape (nnz, num_kv_heads * head_size) or (nnz, num_kv_heads, head_size), dtype of ``query``
    head_size : int
    cos_sin_cache : float32 array, shape (max_seq_len, rotary_dim)
        Row p holds ``cos(p * freq_j)`` for ``j < rotary_dim / 2``, then ``sin(p * freq_j)``; the
        rotary_dim (even, <= head_size) is taken from its shape.
    is_neox : bool
        True: pairs ``(j, j + rotary_dim/2)``; False (GPT-J): pairs ``(2j, 2j + 1)``.
    stream : optional
        As in ``apply_rope``.

    Returns
    -------
    (query_out, key_out) : arrays like ``query`` and ``key``.
    """
    return _cache_form("apply_rope_with_cos_sin_cache", positions, query, key, head_size, cos_sin_cache,
                       is_neox, False, stream)


def apply_rope_with_cos_sin_cache_inplace(positions, query, key, head_size, cos_sin_cache, is_neox=True, *,
                                          stream=None) -> None:
    """``apply_rope_with_cos_sin_cache`` written into ``query`` and ``key``; returns None."""
    return _cache_form("apply_rope_with_cos_sin_cache_inplace", positions, query, key, head_size, cos_sin_cache,
                       is_neox, True, stream)


def _cache_form(fn, positions, query, key, head_size, cos_sin_cache, is_neox, inplace, stream):
    if isinstance(head_size, bool) or not isinstance(head_size, numbers.Integral) or head_size <= 0:
        raise ValueError(f"{fn}: head_size must be a positive int, got {head_size!r}")
    if cos_sin_cache is None:
        raise TypeError(f"{fn}: cos_sin_cache must be a float32 array of shape (max_seq_len, rotary_dim), got None")
    return _rope(fn, query, key, _PosIds(positions, "positions"), None, not is_neox, None, inplace=inplace,
                 stream=stream, cache=cos_sin_cache, head_size=int(head_size), names=("query", "key"))
