"""Attention variants: the one place where what a call may change about attention is described.

A variant is a small set of device hooks that every kernel family (decode, prefill fa2, prefill
fa3) calls at the same points, plus the scalars and arrays those hooks read:

- ``logits_transform``: a logit in natural units (``q . k * sm_scale``) in, a logit out;
- ``row_state``: a value computed once per query row (per head and position; any type, float
  where it is a float: the body's return type) and passed to the transform and the mask as ``row``:
  what does not depend on the key (an ALiBi slope, a custom mask's row offset) is not recomputed per
  logit (ptxas recomputed such a value per logit when the transform computed it: 6.9x there; the
  custom mask's per-request offset load was issued per logit);
- ``logits_mask``: false drops the key (its logit becomes -inf);
- ``kv_begin``: the first key a query may see (keys before it are dropped; kernels skip the
  tiles wholly before it, so a sliding window reads only the window);
- ``sink``: the natural-log logit of an extra key whose value is zero (attention sinks): its
  ``exp`` joins the softmax denominator;
- ``use_softmax=False``: the transformed logits are the attention weights themselves (sigmoid
  attention): no max, no normalisation, no LSE;
- ``query_transform`` / ``key_transform``: a pair of a query / key row in, the pair out, before
  ``q . k``: pair ``j`` (``0 <= j < head_dim / 2``) is ``x = (x_j, x_{j + head_dim/2})`` (NeoX / Llama
  pairing, so a rotary embedding is one hook); the query hook sees ``batch_idx``, ``qo_pos`` and
  ``qo_head_idx``, the key hook ``batch_idx``, ``kv_idx`` and ``kv_head_idx``, both ``pair``. Decode
  and prefill (fa2, fa3) apply them in shared memory (a query row once, a key tile as it lands).

Each hook is a CUDA function body that returns a value. It sees ``params`` (a struct with
``sm_scale`` and the variant's declared parameters by name) and the position of the logit:
``batch_idx``; ``qo_idx`` (the query's index among its request's queries, as in FlashInfer; 0 in
decode); ``qo_pos`` (its position in the key sequence, bottom-right aligned: ``qo_idx + kv_len -
qo_len``; ``kv_len - 1`` in decode); ``kv_idx``; ``qo_head_idx``; ``kv_head_idx``; ``qo_len``;
``kv_len``. ``logits_transform`` also sees ``logits``, ``row`` and ``kv_base``, ``logits_mask`` ``row``
(0.f without a row_state); ``row_state`` sees the same positions with ``kv_idx`` 0. ``kv_base`` is a
key index the kernel holds fixed over the logits of one row it transforms together (a thread's first
key of a key tile): ``kv_idx - kv_base`` is then a compile-time constant in the kernels' unrolled loops,
and a term computed from ``kv_base``, ``row`` and the query alone is computed once per row and tile, so
a transform that splits its position arithmetic that way does its per-logit work with immediates (the
built-in ALiBi: ``row * (kv_idx - qo_pos)`` as ``row * (kv_base - qo_pos) + row * (kv_idx - kv_base)``,
an FFMA by an immediate per logit instead of an integer add and a conversion). Its result must not
depend on ``kv_base`` beyond rounding. ``sink`` sees ``params``, ``batch_idx``,
``qo_idx`` and ``qo_head_idx``; ``kv_begin`` sees ``params``, ``batch_idx``, ``qo_pos``,
``qo_len`` and ``kv_len``. Helpers in ``kernels_cu/common/variant_base.cuh`` (``fast_tanh``,
``fast_sigmoid``, ``small_int_to_float``, ``alibi_slope``) are in scope.

The built-in options (``logits_soft_cap``, ``window_left``, ``pos_encoding_mode="ALIBI"``,
sinks, prefill's ``custom_mask`` / ``packed_custom_mask``) are ``Variant`` objects made with the same
class a user calls; a call's pieces are
composed (transforms in order, masks and-ed, the latest ``kv_begin``) into one ``Composite``
that is part of the kernel specialization's name and cache key. ``resolve()`` is the one option
check every wrapper and ``single_*`` function calls. The fused RoPE (``pos_encoding_mode=
"ROPE_LLAMA"``) is a Variant too, but its query / key transform is built into the decode and
prefill kernels (``CUATTN_VARIANT_ROPE``: its float-float angles and angle addition along a key tile are
faster than a per-pair hook); a user's rotary embedding is a ``query_transform`` / ``key_transform``.

The NumPy path runs a variant through NumPy versions of the hooks (``numpy={hook: callable}``):
each callable takes ``(params, pos)`` (``logits_transform`` also ``logits``), where ``params`` maps
names to values (arrays as NumPy arrays) and ``pos`` has broadcastable int64 arrays named like
the CUDA arguments; it returns an array of the broadcast shape. ``query_transform`` /
``key_transform`` take ``(params, pos, a, b)``: ``a``, ``b`` the rows' first and second halves
[n, heads, head_dim / 2] (float32), ``pos`` with ``batch_idx``, ``pair`` [1, 1, head_dim / 2],
``qo_pos`` / ``kv_idx`` [n, 1, 1] and ``qo_head_idx`` / ``kv_head_idx`` [1, heads, 1]; they return
the new ``(a, b)``.
"""
from __future__ import annotations

import functools
import hashlib
import math
import re
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Callable

import numpy as np

from .errors import UnsupportedError

HOOKS = ("logits_transform", "row_state", "logits_mask", "kv_begin", "sink", "query_transform", "key_transform")
_NUMPY_ONLY = ("qk_transform",)      # the built-in RoPE's NumPy side (its CUDA side is built into the kernels)
# parameter kinds: C type, launcher letter (jit.Launcher), Python check
PARAM_KINDS = {"float": ("float", "f"), "int": ("int", "i"), "float*": ("const float* __restrict__", "p"),
               "int*": ("const int* __restrict__", "p"), "uint8*": ("const unsigned char* __restrict__", "p")}
_ARRAY_DTYPES = {"float*": np.dtype(np.float32), "int*": np.dtype(np.int32), "uint8*": np.dtype(np.uint8)}
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_RESERVED = {"sm_scale", "params", "logits", "row", "batch_idx", "qo_idx", "qo_pos", "kv_idx", "qo_head_idx",
             "kv_head_idx", "qo_len", "kv_len", "x", "pair", "kv_base"}
_POS_ARGS = ("int batch_idx, int qo_idx, int qo_pos, int kv_idx, int qo_head_idx, int kv_head_idx, "
             "int qo_len, int kv_len")
_POS_NAMES = "batch_idx, qo_idx, qo_pos, kv_idx, qo_head_idx, kv_head_idx, qo_len, kv_len"
# ROW: the piece's row-state type (what its row_state returns; float without one)
_SIGNATURES = {
    "logits_transform": ("float", f"const Params& params, ROW row, float logits, {_POS_ARGS}, int kv_base"),
    "row_state": ("auto", f"const Params& params, {_POS_ARGS}"),
    "logits_mask": ("bool", f"const Params& params, ROW row, {_POS_ARGS}"),
    "kv_begin": ("int", "const Params& params, int batch_idx, int qo_pos, int qo_len, int kv_len"),
    "sink": ("float", "const Params& params, int batch_idx, int qo_idx, int qo_head_idx"),
    "query_transform": ("float2", "const Params& params, float2 x, int pair, int batch_idx, int qo_pos, "
                                  "int qo_head_idx"),
    "key_transform": ("float2", "const Params& params, float2 x, int pair, int batch_idx, int kv_idx, "
                                "int kv_head_idx"),
}
_PAIR_ARGS = {"query_transform": "x, pair, batch_idx, qo_pos, qo_head_idx",
              "key_transform": "x, pair, batch_idx, kv_idx, kv_head_idx"}


@dataclass(frozen=True, eq=False)
class Variant:
    """A user-defined (or built-in) attention variant: CUDA hook bodies and their parameters.

    Parameters
    ----------
    name : str
        An identifier; part of the kernel names (the cache key covers the code itself).
    params : sequence of (name, kind)
        Extra parameters in the order ``run()`` takes them positionally; kind is "float", "int",
        "float*" (a float32 GPU array, e.g. per-head values), "int*" (int32) or "uint8*" (uint8:
        bytes, e.g. packed bits).
    logits_transform, row_state, logits_mask, kv_begin, sink, query_transform, key_transform : str, optional
        CUDA function bodies (see the module docstring for what each sees and returns).
    use_softmax : bool
        False: the transformed logits are the attention weights (no softmax; no LSE).
    numpy : dict, optional
        NumPy versions of the hooks for the CPU path, by hook name; a hook without one makes
        the NumPy path refuse the variant.

    Examples of bodies: ``return params.cap * fast_tanh(logits / params.cap);`` (soft-cap),
    ``return kv_idx >= qo_pos - params.window;`` (a window as a mask).
    """
    name: str
    params: tuple = ()
    logits_transform: str | None = None
    row_state: str | None = None
    logits_mask: str | None = None
    kv_begin: str | None = None
    sink: str | None = None
    use_softmax: bool = True
    numpy: dict = field(default_factory=dict)
    query_transform: str | None = None
    key_transform: str | None = None

    def __post_init__(self):
        fn = "cuattn.Variant"
        if not isinstance(self.name, str) or not _IDENT.match(self.name):
            raise ValueError(f"{fn}: name must be an identifier, got {self.name!r}")
        params = tuple(tuple(p) for p in self.params)
        for p in params:
            if len(p) != 2 or not isinstance(p[0], str) or not _IDENT.match(p[0]) or p[1] not in PARAM_KINDS:
                raise ValueError(f"{fn}: params must be (name, kind) pairs with kind in {sorted(PARAM_KINDS)}, "
                                 f"got {p!r}")
            if p[0] in _RESERVED:
                raise ValueError(f"{fn}: parameter name {p[0]!r} is reserved (hook arguments: {sorted(_RESERVED)})")
        if len({p[0] for p in params}) != len(params):
            raise ValueError(f"{fn}: parameter names must be unique, got {[p[0] for p in params]}")
        object.__setattr__(self, "params", params)
        for hook in HOOKS:
            body = getattr(self, hook)
            if body is not None and not isinstance(body, str):
                raise TypeError(f"{fn}: {hook} must be a CUDA function body (str), got {type(body).__name__}")
        unknown = set(self.numpy) - set(HOOKS) - set(_NUMPY_ONLY)
        if unknown:
            raise ValueError(f"{fn}: numpy hooks must be named from {HOOKS}, got {sorted(unknown)}")
        if self.row_state is not None and self.logits_transform is None and self.logits_mask is None:
            raise ValueError(f"{fn}: row_state is read by the logits_transform and logits_mask; give one")
        if not self.use_softmax and self.logits_transform is None:
            raise ValueError(f"{fn}: use_softmax=False needs a logits_transform (the attention weight)")
        if not self.use_softmax and self.sink is not None:
            raise ValueError(f"{fn}: a sink joins the softmax denominator; it needs use_softmax=True")
        object.__setattr__(self, "numpy", dict(self.numpy))

    @property
    def code(self) -> tuple:
        """What the kernel depends on (equality and hashing: two objects with the same code are one variant)."""
        return (self.name, self.params, self.logits_transform, self.row_state, self.logits_mask, self.kv_begin, self.sink,
                self.use_softmax, self.query_transform, self.key_transform)

    def __eq__(self, other):
        return isinstance(other, Variant) and self.code == other.code

    def __getstate__(self):       # pickled for compile workers (jit.precompile): the NumPy hooks stay
        return {**self.__dict__, "numpy": {}}

    def __setstate__(self, state):
        for k, v in state.items():
            object.__setattr__(self, k, v)

    def __hash__(self):
        return hash(self.code)


# ---------------------------------------------------------------------------- built-in variants
# Defined with the class a user calls; their NumPy hooks are the CPU path's definition.


def _alibi_slopes_np(num_heads: int) -> np.ndarray:
    n = 2 ** int(math.floor(math.log2(num_heads)))
    m0, m1 = 2.0 ** (-8.0 / n), 2.0 ** (-4.0 / n)
    h = np.arange(num_heads)
    return np.where(h < n, m0 ** (h + 1), m1 ** (2 * (h - n) + 1)).astype(np.float32)


# logits_soft_cap_inv = 1 / cap (resolve() sets it): a multiply per logit, not a division (the
# kernels' special-function unit already evaluates exp2 once per logit; tanh is a second use)
SOFT_CAP = Variant(
    "softcap", params=(("logits_soft_cap", "float"), ("logits_soft_cap_inv", "float")),
    logits_transform="return params.logits_soft_cap * fast_tanh(logits * params.logits_soft_cap_inv);",
    numpy={"logits_transform": lambda p, pos, logits: p["logits_soft_cap"] * np.tanh(logits / p["logits_soft_cap"])})

SLIDING_WINDOW = Variant(
    "window", params=(("window_left", "int"),),
    kv_begin="return qo_pos - params.window_left;",
    numpy={"kv_begin": lambda p, pos: pos.qo_pos - p["window_left"]})

# slope of head h: 2^(alibi_a * (h + 1)) below the largest power of two p <= num heads, else
# 2^(alibi_b * (2 (h - p) + 1)); resolve() sets p, a = -8 / p, b = -4 / p (no division per logit);
# key - query distances of up to 2^24 tokens (exact in float). The bias split at kv_base (module
# docstring): float(kv_base - qo_pos) once per row and tile, then per logit two FFMAs (the second by the
# immediate kv_idx - kv_base) after the kernel's scale multiply: 3 instructions a logit, was 4 (an IADD,
# small_int_to_float's FADD, an FFMA, the scale FMUL), and 5 with the key scale's own multiply. Of the
# equivalent forms tried this one leaves fa3's paged (gather) kernel spill-free: the 2-instruction form
# (logits + fmaf(row, kv_idx - kv_base, row * d), the add contracted) spilled 68 bytes in contiguous fa3
# and 136 with the gather; (d + (kv_idx - kv_base)) * row, 24 with the gather.
ALIBI = Variant(
    "alibi", params=(("alibi_p", "int"), ("alibi_a", "float"), ("alibi_b", "float")),
    row_state="return alibi_slope(qo_head_idx, params.alibi_p, params.alibi_a, params.alibi_b);",
    logits_transform="return fmaf(row, float(kv_idx - kv_base), fmaf(row, float(kv_base - qo_pos), logits));",
    numpy={"logits_transform": lambda p, pos, logits: logits + _alibi_slopes_np(p["alibi_heads"])[pos.qo_head_idx]
           * (pos.kv_idx - pos.qo_pos).astype(np.float32)})

# Fused RoPE (pos_encoding_mode="ROPE_LLAMA"): q rotated at its position (qo_pos; kv_len - 1 in
# decode), each key at its own, NeoX / Llama pairs (j, j + rotary_dim / 2), kernels_cu/common/rope.cuh's
# formula and float-float frequencies (rope.py's _kernel_freq: 10 floats). Query and key transforms are
# built in only: the kernels rotate K tiles in shared memory (variant.cuh rope_rotate_rows).
ROPE_FREQ = ("rope_step_hi", "rope_step_lo", "rope_sa_hi", "rope_sa_lo", "rope_sb_hi", "rope_sb_lo",
              "rope_scaled_pi_hi", "rope_scaled_pi_lo", "rope_unscaled_pi_hi", "rope_unscaled_pi_lo")


def _rope_np(p, x, pos):
    """x [n, heads, head_dim] rotated at positions pos [n] (float64 math, float32 out)."""
    rot, half = p["rotary_dim"], p["rotary_dim"] // 2
    inv_freq = (1.0 / p["rope_scale"]) * (1.0 / p["rope_theta"]) ** (2.0 * np.arange(half) / rot)
    ang = np.asarray(pos, np.float64)[:, None] * inv_freq[None, :]
    c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    y = x.astype(np.float64)
    a, b = y[..., :half].copy(), y[..., half:rot].copy()
    y[..., :half], y[..., half:rot] = a * c - b * s, b * c + a * s
    return y.astype(np.float32)


# q_rope_offset: decode's per-request query position (run(q_rope_offset=...), FlashInfer's name);
# null: kv_len - 1. Prefill places its queries at their bottom-right positions.
ROPE_LLAMA = Variant("rope", params=tuple((n, "float") for n in ROPE_FREQ) + (("rotary_dim", "int"),
                                                                              ("q_rope_offset", "int*")),
                     numpy={"qk_transform": _rope_np})
_OPTIONAL_POINTERS = {"q_rope_offset"}     # built-in array parameters that may be None (a null pointer)

SINK = Variant(
    "sink", params=(("sinks", "float*"),),
    sink="return params.sinks[qo_head_idx];",
    numpy={"sink": lambda p, pos: np.asarray(p["sinks"], np.float32)[pos.qo_head_idx]})


def _custom_mask_np(p, pos):
    bits = np.asarray(p["custom_mask"], np.uint8)
    bit = 8 * np.int64(np.asarray(p["mask_indptr"])[pos.batch_idx]) + pos.qo_idx * pos.kv_len + pos.kv_idx
    return ((bits[bit >> 3] >> (bit & 7)) & 1).astype(bool)


# Custom mask (prefill's custom_mask= / packed_custom_mask=), FlashInfer's layout: ``custom_mask``
# holds each request's qo_len x kv_len booleans packed 8 per byte, little bit order, request b's
# segment starting at byte ``mask_indptr[b]`` (segment_packbits); bit qo_idx * kv_len + kv_idx of the
# segment keeps the key (qo_idx: the query's index in its request, kv_idx: the key's, so split-KV
# pieces, query tiles and GQA's packed rows index it alike; kernels call the mask for keys < kv_len
# only). With plan()'s custom_mask= / packed_custom_mask= the plan packs and uploads both arrays;
# passed as variant= instead, it takes them positionally in run() (checked by Bound.check_custom_mask).
# row: the bit of the row's key 0, once per row. A tile's rows past the request (qo_idx >= qo_len)
# read the last row's bits (in bounds; those rows are never stored): no branch per logit (fa3 spilled
# 20-44 bytes with one, and with the byte-offset load per logit).
CUSTOM_MASK = Variant(
    "custom_mask", params=(("custom_mask", "uint8*"), ("mask_indptr", "int*")),
    row_state="return 8ll * __ldg(params.mask_indptr + batch_idx) + (long long)min(qo_idx, max(qo_len - 1, 0)) * kv_len;",
    logits_mask="const long long bit = row + kv_idx;\n"
                "return (__ldg(params.custom_mask + (bit >> 3)) >> (bit & 7)) & 1;",
    numpy={"logits_mask": _custom_mask_np})


@dataclass(frozen=True)
class Pointer:
    """A device address a wrapper passes for a built-in array parameter it uploaded itself (the
    plan's packed custom mask): taken as is by ``Bound.kernel_args``."""
    addr: int


# ---------------------------------------------------------------------------- composition


@dataclass(frozen=True)
class Composite:
    """The variant pieces of one call, in order; what a kernel spec carries."""
    pieces: tuple = ()

    def __post_init__(self):
        names = [p[0] for v in self.pieces for p in v.params]
        if len(set(names)) != len(names):
            raise ValueError(f"variant parameters must have distinct names across the combined variants, got {names}")
        if sum(v.sink is not None for v in self.pieces) > 1:
            raise ValueError("at most one variant may define a sink")
        # a mask alone (the custom mask, a user's logits_mask) only drops keys: it composes with anything
        mask_only = [v for v in self.pieces if v.logits_mask is not None and all(
            getattr(v, h) is None for h in HOOKS if h not in ("logits_mask", "row_state"))]
        if any(not v.use_softmax for v in self.pieces) and len(self.pieces) - len(mask_only) > 1:
            raise ValueError("a use_softmax=False variant cannot be combined with other variants (but masks)")

    @property
    def is_default(self) -> bool:
        return not self.pieces

    @property
    def params(self) -> tuple:
        return tuple(p for v in self.pieces for p in v.params)

    def has(self, hook: str) -> bool:
        return any(getattr(v, hook) is not None for v in self.pieces)

    @property
    def has_rope(self) -> bool:
        return any(v == ROPE_LLAMA for v in self.pieces)

    @property
    def has_custom_mask(self) -> bool:
        return any(v == CUSTOM_MASK for v in self.pieces)

    @property
    def has_qk_transform(self) -> bool:
        """The kernels rewrite q and K rows in shared memory: the built-in RoPE or a user query / key
        transform (no fp8 KV kernel)."""
        return self.has_rope or self.has("query_transform") or self.has("key_transform")

    @functools.cached_property      # (read by every plan(): once per composite)
    def use_softmax(self) -> bool:
        return all(v.use_softmax for v in self.pieces)

    @property
    def name(self) -> str:
        """"" for plain attention, else "_v" + piece names + a short hash of the code."""
        if not self.pieces:
            return ""
        digest = hashlib.sha256(repr([v.code for v in self.pieces]).encode()).hexdigest()[:8]
        return "_v" + "-".join(v.name for v in self.pieces) + "-" + digest

    @property
    def arg_kinds(self) -> str:
        """Launcher letters of the kernel's variant arguments: sm_scale, then each parameter."""
        return "f" + "".join(PARAM_KINDS[k][1] for _, k in self.params)

    def scale_log2(self, sm_scale: float) -> float:
        """The factor the kernels apply to a raw dot product before exp2: the logits transform
        sees natural-unit logits (the kernel multiplies by sm_scale first), so only log2(e) is left."""
        return LOG2E if self.has("logits_transform") else sm_scale * LOG2E

    def numpy_qk_transform(self):
        """The built-in RoPE's NumPy rotation (values, x, positions) -> rotated x, or None."""
        return _rope_np if self.has_rope else None

    def prelude(self, tu_name: str) -> str:
        """CUDA source put before the kernel file: the helpers of ``common/variant_base.cuh``, the
        Params struct, the hooks (each under a ``#line`` naming the variant and hook, so NVRTC
        reports an error at the snippet's own line), their composition and the launch macros."""
        from .jit import assemble_source
        lines = ["// ---- attention variant (generated by cuattn/variants.py)"]
        lines += assemble_source("common/variant_base.cuh").splitlines()
        lines += ["namespace cuattn { namespace variant {", "struct Params {", "  float sm_scale;"]
        lines += [f"  {PARAM_KINDS[k][0].replace(' __restrict__', '')} {n};" for n, k in self.params]
        lines.append("};")
        calls: dict[str, list[str]] = {h: [] for h in HOOKS}
        # -- the row_state hooks first: their return types (auto) type the pieces' rows (Row_i)
        order = ("row_state",) + tuple(h for h in HOOKS if h != "row_state")
        for hook in order:
            for i, v in enumerate(self.pieces):
                body = getattr(v, hook)
                if body is None:
                    continue
                ret, args = _SIGNATURES[hook]
                fname = f"{hook}_{i}_{v.name}"
                lines += [f"__device__ __forceinline__ {ret} {fname}({args.replace('ROW', f'Row{i}')}) {{",
                          f'#line 1 "variant {v.name}: {hook}"'] + body.splitlines()
                lines += [f'#line {len(lines) + 2} "{tu_name}"', "}"]     # back to the TU's own numbering
                calls[hook].append(fname)
                if hook == "row_state":
                    zeros = ", ".join(["0"] * 8)
                    lines.append(f"typedef decltype({fname}(*(const Params*)nullptr, {zeros})) Row{i};")
            if hook == "row_state":
                lines += [f"typedef float Row{i};" for i, v in enumerate(self.pieces) if v.row_state is None]
        # -- one row-state value per piece that has a transform or a mask (0.f where it has no row_state)
        t, m = calls["logits_transform"], calls["logits_mask"]
        rows = {i: f"row_state_{i}_{v.name}" if v.row_state is not None else None
                for i, v in enumerate(self.pieces) if v.logits_transform is not None or v.logits_mask is not None}
        lines += ["struct RowState {"] + [f"  Row{i} r{i};" for i in rows] + ["};"]
        lines += [f"__device__ __forceinline__ RowState row_state(const Params& params, {_POS_ARGS}) {{",
                  "  RowState rs;"]
        lines += [f"  rs.r{i} = {f}(params, {_POS_NAMES});" if f else f"  rs.r{i} = 0.f;" for i, f in rows.items()]
        lines += ["  return rs;", "}"]
        lines += ["__device__ __forceinline__ float logits_transform(const Params& params, const RowState& rs, "
                  f"float logits, {_POS_ARGS}, int kv_base) {{"]
        lines += [f"  logits = {f}(params, rs.r{i}, logits, {_POS_NAMES}, kv_base);"
                  for i, f in zip([i for i, v in enumerate(self.pieces) if v.logits_transform is not None], t)]
        lines += ["  return logits;", "}"]
        lines += [f"__device__ __forceinline__ bool logits_mask(const Params& params, const RowState& rs, {_POS_ARGS}) {{",
                  "  return " + (" && ".join(f"{f}(params, rs.r{i}, {_POS_NAMES})" for i, f in
                                             zip([i for i, v in enumerate(self.pieces) if v.logits_mask is not None], m))
                                 or "true") + ";", "}"]
        b = calls["kv_begin"]
        lines += ["__device__ __forceinline__ int kv_begin(const Params& params, int batch_idx, int qo_pos, "
                  "int qo_len, int kv_len) {", "  int lo = 0;"]
        lines += [f"  lo = max(lo, {f}(params, batch_idx, qo_pos, qo_len, kv_len));" for f in b]
        lines += ["  return lo;", "}"]
        s = calls["sink"]
        lines += ["__device__ __forceinline__ float sink(const Params& params, int batch_idx, int qo_idx, "
                  "int qo_head_idx) {",
                  f"  return {s[0]}(params, batch_idx, qo_idx, qo_head_idx);" if s else
                  "  return __int_as_float(0xff800000);", "}"]
        for hook, pos in (("query_transform", "int qo_pos, int qo_head_idx"),
                          ("key_transform", "int kv_idx, int kv_head_idx")):
            lines += [f"__device__ __forceinline__ float2 {hook}(const Params& params, float2 x, int pair, "
                      f"int batch_idx, {pos}) {{"]
            lines += [f"  x = {f}(params, {_PAIR_ARGS[hook]});" for f in calls[hook]]
            lines += ["  return x;", "}"]
        lines += [f"constexpr bool HAS_QUERY_TRANSFORM = {str(bool(calls['query_transform'])).lower()};",
                  f"constexpr bool HAS_KEY_TRANSFORM = {str(bool(calls['key_transform'])).lower()};"]
        lines += [f"constexpr bool HAS_TRANSFORM = {str(bool(t)).lower()};",
                  f"constexpr bool HAS_MASK = {str(bool(m)).lower()};",
                  f"constexpr bool HAS_KV_BEGIN = {str(bool(b)).lower()};",
                  f"constexpr bool HAS_SINK = {str(bool(s)).lower()};",
                  f"constexpr bool USE_SOFTMAX = {str(self.use_softmax).lower()};",
                  f"constexpr bool HAS_ROPE = {str(self.has_rope).lower()};",
                  "constexpr bool NEEDS_POSITION = HAS_TRANSFORM || HAS_MASK || HAS_KV_BEGIN || HAS_ROPE;",
                  "}}  // namespace cuattn::variant"]
        decl = "".join(f", {PARAM_KINDS[k][0]} vp_{n}" for n, k in self.params)
        init = "".join(f", vp_{n}" for n, _ in self.params)
        qk = self.has("query_transform") or self.has("key_transform")
        lines += [f"#define CUATTN_VARIANT_ROPE {int(self.has_rope)}",
                  f"#define CUATTN_VARIANT_QK {int(qk)}",
                  f"#define CUATTN_VARIANT_ARGS , float vp_sm_scale{decl}",
                  f"#define CUATTN_VARIANT_PARAMS {{vp_sm_scale{init}}}", ""]
        return "\n".join(lines)

    # -- NumPy path

    def numpy_hook(self, hook: str, fn: str) -> list[tuple[Variant, Callable]]:
        out = []
        for v in self.pieces:
            if getattr(v, hook) is None:
                continue
            f = v.numpy.get(hook)
            if f is None:
                raise UnsupportedError(f"{fn}: variant {v.name!r} has no NumPy version of its {hook} hook, so the "
                                       f"CPU path cannot run it; pass numpy={{'{hook}': ...}} to cuattn.Variant")
            out.append((v, f))
        return out


LOG2E = 1.4426950408889634
DEFAULT = Composite()


@dataclass(frozen=True)
class Bound:
    """A call's variant and the values of its parameters: ``fixed`` from plan()'s options,
    the rest (``runtime``, by name in order) passed to run() positionally."""
    composite: Composite
    fixed: dict
    runtime: tuple

    def values(self, args: tuple, fn: str) -> dict:
        """Parameter values by name: the fixed ones and ``args`` (run()'s extra positional arguments)."""
        if len(args) != len(self.runtime):
            if not self.runtime:
                raise TypeError(f"{fn}: got {len(args)} unexpected positional argument(s) after the cache; this "
                                f"plan's variant takes none")
            raise TypeError(f"{fn}: the variant's parameters {list(self.runtime)} must be passed positionally "
                            f"after the cache, got {len(args)} value(s)")
        return {**self.fixed, **dict(zip(self.runtime, args))}

    def kernel_args(self, sm_scale: float, values: dict, fn: str) -> tuple:
        """The kernels' variant arguments (``Composite.arg_kinds``): sm_scale, then each parameter;
        arrays must be contiguous 1-D GPU arrays of float32 ("float*") or int32 ("int*")."""
        from . import arrays
        out = [float(sm_scale)]
        for name, kind in self.composite.params:
            v = values[name]
            if kind == "float":
                out.append(_number(v, name, fn))
            elif kind == "int":
                if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                    raise TypeError(f"{fn}: variant parameter {name} must be an int, got {v!r}")
                out.append(int(v))
            elif v is None and name in _OPTIONAL_POINTERS:
                out.append(0)
            elif isinstance(v, Pointer):
                out.append(v.addr)
            else:
                want = _ARRAY_DTYPES[kind]
                if not arrays.is_device_array(v):
                    raise TypeError(f"{fn}: variant parameter {name} must be a GPU array ({want}) on a GPU "
                                    f"call, got {type(v).__name__}")
                t = arrays.device_tensor(v, name, fn)
                if t.dtype != want or t.ndim != 1 or not t.is_contiguous():
                    raise ValueError(f"{fn}: variant parameter {name} must be a contiguous 1-D {want} "
                                     f"array, got shape {t.shape} dtype {t.dtype}")
                out.append(t.ptr)
        return tuple(out)

    def host_values(self, values: dict, fn: str) -> dict:
        """The parameter values for the NumPy path (arrays copied to the host)."""
        from . import arrays
        out = dict(values)
        for name, kind in self.composite.params:
            if kind.endswith("*") and values[name] is not None:
                out[name] = np.asarray(arrays.to_host(values[name], name, fn))
        return out

    def check_lse(self, return_lse: bool, lse, fn: str) -> None:
        if (return_lse or lse is not None) and not self.composite.use_softmax:
            raise ValueError(f"{fn}: return_lse / lse need softmax attention; this variant has use_softmax=False "
                             f"(no log-sum-exp)")

    def check_custom_mask(self, values: dict, qo_lens, kv_lens, fn: str) -> None:
        """The built-in custom mask's arrays (``CUSTOM_MASK``) against the batch's lengths."""
        if self.composite.has_custom_mask:
            _check_custom_mask(values, qo_lens, kv_lens, fn)

    def check_sinks(self, values: dict, num_qo_heads: int, fn: str) -> None:
        """The built-in sink's array: one float32 logit per query head."""
        if "sinks" in values and any(p == SINK for p in self.composite.pieces):
            shape = tuple(getattr(values["sinks"], "shape", ()))
            if shape != (num_qo_heads,):
                raise ValueError(f"{fn}: sinks must have shape (num_qo_heads,) = ({num_qo_heads},), got {shape}")


def resolve(fn: str, *, num_qo_heads: int, pos_encoding_mode: Any = "NONE", window_left: Any = -1,
            logits_soft_cap: Any = None, use_fp16_qk_reduction: Any = False, rope_scale: Any = None,
            rope_theta: Any = None, variant: Variant | None = None, sinks: bool = False,
            head_dim: int | None = None, rotary_dim: Any = None, custom_mask: bool = False) -> Bound:
    """The one option check: FlashInfer's attention options and a user variant -> a Bound variant.

    Order of the pieces: user variant, ALiBi, soft-cap (applied to the biased logits), window,
    custom mask, sink. ``custom_mask``: the call has a custom / packed mask (prefill); its two arrays
    are fixed parameters the caller fills (the packed bits and byte offsets, host arrays or, for a GPU
    run, ``Pointer``s). Raises ValueError / TypeError naming the argument, UnsupportedError for what
    has no kernel.
    """
    pieces, fixed = [], {}
    if variant is not None:
        if not isinstance(variant, Variant):
            raise TypeError(f"{fn}: variant must be a cuattn.Variant, got {type(variant).__name__}")
        pieces.append(variant)
    mode = "NONE" if pos_encoding_mode is None else pos_encoding_mode
    if mode == "ALIBI":
        pieces.append(ALIBI)
        p = 1 << (int(num_qo_heads).bit_length() - 1)
        fixed.update(alibi_heads=int(num_qo_heads), alibi_p=p, alibi_a=-8.0 / p, alibi_b=-4.0 / p)
    elif mode == "ROPE_LLAMA":
        pieces.append(ROPE_LLAMA)
        fixed.update(_rope_values(fn, head_dim, rotary_dim, rope_scale, rope_theta))
    elif mode != "NONE":
        raise ValueError(f"{fn}: pos_encoding_mode must be 'NONE', 'ROPE_LLAMA' or 'ALIBI', got {pos_encoding_mode!r}")
    if mode != "ROPE_LLAMA" and (rope_scale is not None or rope_theta is not None or rotary_dim is not None):
        raise ValueError(f"{fn}: rope_scale / rope_theta / rotary_dim belong to pos_encoding_mode='ROPE_LLAMA', "
                         f"got pos_encoding_mode={pos_encoding_mode!r}")
    if logits_soft_cap not in (None, 0, 0.0):
        cap = _number(logits_soft_cap, "logits_soft_cap", fn)
        if not cap > 0 or not math.isfinite(cap):
            raise ValueError(f"{fn}: logits_soft_cap must be a positive finite float (or None / 0: off), got "
                             f"{logits_soft_cap!r}")
        pieces.append(SOFT_CAP)
        fixed.update(logits_soft_cap=cap, logits_soft_cap_inv=1.0 / cap)
    if window_left is None:
        window_left = -1
    if isinstance(window_left, bool) or not isinstance(window_left, (int, np.integer)):
        raise TypeError(f"{fn}: window_left must be an int (-1: no window), got {window_left!r}")
    if window_left < -1:
        raise ValueError(f"{fn}: window_left must be -1 (no window) or >= 0, got {window_left}")
    if window_left >= 0:
        pieces.append(SLIDING_WINDOW)
        fixed["window_left"] = int(window_left)
    if use_fp16_qk_reduction:
        raise UnsupportedError(f"{fn}: use_fp16_qk_reduction=True has no kernel: Q K^T accumulates in fp32 (the "
                               f"fp16 accumulation of FlashInfer's fa2 saves no time on sm_80+ tensor cores here)")
    if custom_mask:
        pieces.append(CUSTOM_MASK)
        fixed.update(custom_mask=None, mask_indptr=None)      # the plan's (prefill_batch._plan_common)
    if sinks:
        pieces.append(SINK)
    composite = Composite(tuple(pieces))
    runtime = tuple(n for n, _ in composite.params if n not in fixed)
    return Bound(composite, fixed, runtime)


def _check_custom_mask(values: dict, qo_lens: np.ndarray, kv_lens: np.ndarray, fn: str) -> None:
    """The custom-mask variant's arrays against the batch: ``custom_mask`` 1-D uint8, ``mask_indptr``
    int32 of batch + 1 entries; on the host also every request's segment inside ``custom_mask``
    (device arrays: shapes and dtypes only, no copy back)."""
    from . import arrays
    if isinstance(values["custom_mask"], Pointer) or values["custom_mask"] is None:   # the plan's own upload
        return
    desc = {}
    for name, want in (("custom_mask", np.uint8), ("mask_indptr", np.int32)):
        x = values[name]
        if arrays.is_device_array(x, name, fn):
            t = arrays.device_tensor(x, name, fn)
            shape, dt, host = tuple(t.shape), np.dtype(t.dtype), None
        else:
            host = np.asarray(x)
            shape, dt = host.shape, host.dtype
        if len(shape) != 1 or dt != want:
            raise ValueError(f"{fn}: {name} must be a 1-D {np.dtype(want)} array, got shape {shape} dtype {dt}")
        desc[name] = (shape[0], host)
    batch = len(qo_lens)
    (nbytes, _), (n_ind, ind) = desc["custom_mask"], desc["mask_indptr"]
    if n_ind != batch + 1:
        raise ValueError(f"{fn}: mask_indptr must have batch + 1 = {batch + 1} entries (byte offsets of each "
                         f"request's mask), got {n_ind}")
    if ind is None or not batch:
        return
    start = ind[:-1].astype(np.int64)
    if start.min() < 0 or (start * 8 + np.asarray(qo_lens, np.int64) * np.asarray(kv_lens, np.int64)).max() > 8 * nbytes:
        raise ValueError(f"{fn}: mask_indptr must be byte offsets >= 0 whose segments of ceil(qo_len * kv_len / 8) "
                         f"bytes fit in custom_mask ({nbytes} bytes), got {ind[:8]}")


def _rope_values(fn, head_dim, rotary_dim, rope_scale, rope_theta) -> dict:
    """The fixed parameters of the fused RoPE: rotary_dim (default head_dim) a power of two >= 16
    and <= head_dim (the kernels rotate 8-element chunk pairs, a fixed chunk per thread), and
    rope.cuh's float-float frequencies."""
    from .rope import _Freq, _kernel_freq
    rot = head_dim if rotary_dim is None else rotary_dim
    if rot is None:      # head_dim unknown yet (an options pre-check): checked again with it
        return {}
    if isinstance(rot, bool) or not isinstance(rot, (int, np.integer)):
        raise TypeError(f"{fn}: rotary_dim must be an int, got {rotary_dim!r}")
    rot = int(rot)
    if rot < 16 or rot & (rot - 1) or (head_dim is not None and rot > head_dim):
        raise UnsupportedError(f"{fn}: rotary_dim={rot} has no fused-RoPE kernel; supported: a power of two from 16 "
                               f"to head_dim={head_dim}")
    scale = 1.0 if rope_scale is None else _number(rope_scale, "rope_scale", fn)
    theta = 1e4 if rope_theta is None else _number(rope_theta, "rope_theta", fn)
    if not (scale > 0 and theta > 0 and math.isfinite(scale) and math.isfinite(theta)):
        raise ValueError(f"{fn}: rope_scale and rope_theta must be positive finite floats, got {rope_scale!r}, "
                         f"{rope_theta!r}")
    return {**dict(zip(ROPE_FREQ, _kernel_freq(_Freq(scale, theta), rot))), "rotary_dim": rot,
            "rope_scale": scale, "rope_theta": theta, "q_rope_offset": None}


def _number(x, name, fn) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float, np.integer, np.floating)):
        raise TypeError(f"{fn}: {name} must be a float, got {x!r}")
    return float(x)


def numpy_positions(batch_idx: int, qo_len: int, kv_len: int, num_qo_heads: int, num_kv_heads: int):
    """Broadcastable index grids over (head, query, key) for the NumPy hooks."""
    group = num_qo_heads // num_kv_heads
    qh = np.arange(num_qo_heads, dtype=np.int64)[:, None, None]
    qi = np.arange(qo_len, dtype=np.int64)[None, :, None]
    return SimpleNamespace(batch_idx=np.int64(batch_idx), qo_idx=qi, qo_pos=qi + (kv_len - qo_len),
                           kv_idx=np.arange(kv_len, dtype=np.int64)[None, None, :], qo_head_idx=qh,
                           kv_head_idx=qh // group, qo_len=np.int64(qo_len), kv_len=np.int64(kv_len))
