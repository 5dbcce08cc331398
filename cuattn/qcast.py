"""A float32 q through the 16-bit attention kernels: the one place decode and prefill take it (issue 22).

No attention kernel loads an fp32 q. A plan for ``q_data_type="float32"`` plans the 16-bit kernel of the
compute type ``kernel_dtype`` chooses, and on the GPU every ``run()`` of the decode, prefill and MLA wrappers
(and so of ``single_decode_with_kv_cache``, ``single_prefill_with_kv_cache`` and the wrappers built on
them) converts q (MLA: q_nope and q_pe) into a 16-bit copy before the attention launch and the kernel's
16-bit output into the caller's fp32 ``out`` after it (``kernels_cu/qcast.cu``: elementwise launches on the
run's stream).
The LSE is the kernel's (fp32). The copies live in a buffer allocated at ``plan()``, so ``run()``
allocates nothing but a missing ``out`` and a CUDA-graph capture holds fixed addresses. The NumPy path
runs an fp32 q as it is (float32 arithmetic, no rounding of q).

The compute type: a bf16 KV cache needs bf16 (the kernels take q of K/V's 16-bit type); every other
cache (fp16, fp32, fp8) runs fp16, which keeps 11 significant bits of q against bf16's 8. fp16 ends at
65504, where an fp32 value would round to inf (and the softmax to NaN), so the conversion saturates:
|q| above 65504 (inf too) becomes +-65504 (bf16: its largest finite value); NaN stays NaN. An fp32 KV
cache rounds to the same type in the attention kernels with the same conversion
(``kernels_cu/common/dtypes.cuh`` from_float_sat / pack2_sat).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import arrays, jit
from .params import Params

_SOURCE = "qcast.cu"
_DTYPES = {"f16": 0, "bf16": 1}
_F32 = np.dtype(np.float32)
PARAMS = {entry: Params.define(entry, "src:p dst:p dim:i src_s_tok:q src_s_head:q dst_s_tok:q dst_s_head:q")
          for entry in ("cuattn_cast_to_16", "cuattn_cast_to_f32")}


def kernel_dtype(q_dtype, kv_dtype) -> np.dtype:
    """The q dtype the attention kernels run for a plan's q and KV dtypes: q's own unless q is float32,
    then bfloat16 for a bfloat16 cache, else float16 (module docstring)."""
    q = np.dtype(q_dtype)
    if q != _F32:
        return q
    return arrays.bfloat16 if np.dtype(kv_dtype) == arrays.bfloat16 else np.dtype(np.float16)


@dataclass(frozen=True)
class CastSpec:
    """qcast.cu for one compute type: both conversions."""
    dtype: str               # "f16" | "bf16"
    source = _SOURCE

    @property
    def name(self) -> str:   # "qcast_bf16"
        return f"qcast_{self.dtype}"

    def defines(self) -> tuple[str, ...]:
        return (f"-DDTYPE={_DTYPES[self.dtype]}",)


def shipped_specs() -> list[CastSpec]:
    return [CastSpec(d) for d in _DTYPES]


class F32Q:
    """A wrapper's fp32-q state: the 16-bit copies of q and out of its plan, and the conversions around
    its attention launch. ``plan(p)`` at every GPU plan; in ``run()``, ``begin`` (q converted; returns the
    copies the kernel reads and writes) before the launch and ``finish`` (out converted) after it. A wrapper
    with several q inputs (MLA: q_nope, q_pe) names their widths at plan() and calls ``begin_many``."""

    def __init__(self, owner: str, use_cuda_graph: bool):
        self.owner, self.graph = owner, bool(use_cuda_graph)
        self.active = False         # the last plan has an fp32 q and a GPU
        self._buf = None            # uint16 CuPy array: the q copies, then out's (each 16-byte aligned)
        self._launchers = None      # (to 16, to f32)
        self._shapes = None         # ((q shape, offset in elements) per q, (out shape, offset), dtype) of the last plan
        self._pending = None        # (out pointer, out strides, out copy) between begin() and finish()

    def plan(self, p, q_dims: tuple = None, out_dim: int | None = None) -> None:
        """Room for plan ``p``'s copies (a ``plan.Plan``; decode: batch rows, prefill and MLA: qo_indptr[-1]), and
        the launchers, so that run() compiles and allocates nothing. ``q_dims``: the last dimension of each q
        input (default ``(p.head_dim,)``); ``out_dim``: out's (default ``p.head_dim_vo or p.head_dim``). With
        ``use_cuda_graph=True`` the first plan fixes the buffer (twice its size): a later plan past it raises
        ValueError."""
        self.active = p.q_dtype == _F32 and p.device is not None
        if not self.active:
            return
        rows = int(p.qo_indptr[-1]) if p.qo_indptr is not None else p.batch
        heads = p.num_qo_heads
        dims = tuple(q_dims) if q_dims is not None else (p.head_dim,)
        shapes, need = [], 0
        for d in dims + (out_dim or p.head_dim_vo or p.head_dim,):
            shapes.append(((rows, heads, d), need))
            need += -(-(rows * heads * d) // 8) * 8        # the next copy 16-byte aligned
        short = arrays.SHORT_NAME[kernel_dtype(p.q_dtype, p.kv_dtype)]
        if self._buf is None or self._buf.size < need:
            if self._buf is not None and self.graph:
                raise ValueError(f"{self.owner}.plan: the 16-bit copies of an fp32 q and out ({need} elements) must "
                                 f"fit the buffer fixed by the first plan with use_cuda_graph=True "
                                 f"({self._buf.size}); plan the largest batch first or make a new wrapper")
            cp = arrays.cupy_module()
            with cp.cuda.Device(p.device):
                self._buf = cp.empty(max(need * (2 if self.graph else 1), 8), np.uint16)
        spec = CastSpec(short)
        self._launchers = tuple(jit.get_launcher(spec, e, p.device, PARAMS[e].kinds) for e in PARAMS)
        self._shapes = (shapes[:-1], shapes[-1], arrays.bfloat16 if short == "bf16" else np.dtype(np.float16))

    def begin(self, ctx, q_ptr: int, q_strides: tuple, out_ptr: int, out_strides: tuple):
        """Convert the caller's fp32 q (shape and dtype checked by the wrapper) into its 16-bit copy on the
        run's stream; returns (q copy, out copy) as ``arrays.Tensor`` (contiguous) for the attention launch."""
        qs, ok = self.begin_many(ctx, [(q_ptr, q_strides)], out_ptr, out_strides)
        return qs[0], ok

    def begin_many(self, ctx, qs, out_ptr: int, out_strides: tuple):
        """``begin`` for the plan's q inputs: ``qs`` a (pointer, strides) per q, in plan()'s ``q_dims`` order;
        returns ([q copies], out copy)."""
        q_shapes, (out_shape, out_offset), dtype = self._shapes
        copies = []
        for (ptr, strides), (shape, offset) in zip(qs, q_shapes, strict=True):
            t = self._copy(ctx, shape, offset, dtype)
            self._cast(0, ctx, ptr, strides, t.ptr, t.strides, shape)
            copies.append(t)
        ok = self._copy(ctx, out_shape, out_offset, dtype)
        self._pending = (out_ptr, out_strides, ok)
        return copies, ok

    def finish(self, ctx) -> None:
        """After the attention launch (and its merge): the 16-bit output into the caller's fp32 out."""
        if self._pending is not None:
            out_ptr, out_strides, ok = self._pending
            self._pending = None
            self._cast(1, ctx, ok.ptr, ok.strides, out_ptr, out_strides, ok.shape)

    def _copy(self, ctx, shape, offset, dtype):
        return arrays.Tensor(self._buf.data.ptr + 2 * offset, shape, _contiguous(shape), dtype, ctx.device, "cupy",
                             self._buf)

    def _cast(self, which: int, ctx, src, src_strides, dst, dst_strides, shape) -> None:
        rows, heads, dim = shape
        if rows and heads and dim:
            block = min(256, -(-dim // 32) * 32)
            self._launchers[which]((rows, heads), block, ctx.stream, src, dst, dim, src_strides[0], src_strides[1],
                                   dst_strides[0], dst_strides[1])


def _contiguous(shape: tuple) -> tuple:
    return (shape[1] * shape[2], shape[2], 1)
