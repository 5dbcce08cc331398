"""Prefill / append attention on tensor cores: single request, ragged batch, paged batch.

Launches ``kernels_cu/prefill.cu`` (the portable "fa2" backend: mma.sync m16n8k16, ldmatrix,
cp.async; sm_80+), or on sm_90 ``kernels_cu/prefill_sm90.cu`` (backend "fa3": prefill_sm90.py).
NumPy inputs run ``reference.attention`` with the same API. Names and semantics follow FlashInfer:
causal masks align bottom-right when qo_len < kv_len; custom masks are flattened per-request
``qo_len x kv_len`` booleans or their little-bit-order packing (run by both backends as the built-in
variant ``variants.CUSTOM_MASK``: plan() packs and uploads the bits); a fully masked row gives zeros
and LSE -inf (natural log).

Scheduling is plan.py's: ``plan()`` builds a flat work list of (request, query tile, kv piece)
items on the host (longest first; long KV split into pieces when the items alone leave SMs idle,
the pieces merged exactly by a second kernel), uploads it with the page table into the wrapper's
plan buffers on the caller's stream, and the kernel's grid is (work items, num_kv_heads). Query
tiles pack the GQA group's heads into rows, so one CTA reads each K/V tile once for the whole
group. With ``use_cuda_graph=True`` the buffers and the grid keep the capacity of the first plan.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from . import arrays, fp8, jit, plan as _plan, prefill_sm90, qcast, reference, support, variants
from .params import Params
from .errors import UnsupportedError
from .mask import segment_packbits_host
from .page import check_kv_layout, paged_kv_host, paged_kv_tensors, validate_page_table
from .prefill_checks import (DTYPES, _check_group, _check_head_dim_vo, _check_kv_dtype, _check_out,
                             _check_q, _host_kv, _host_mask, _kv_dims, _kv_short, _scales, _split_pair)

_SOURCE = "prefill.cu"
_ENTRY = "cuattn_prefill"
HEAD_DIMS = support.TABLE["prefill"]["head_dims"]
KV_FP8 = {"e4m3": 1, "e5m2": 2}      # spec dtype_kv -> the kernel's KV_FP8 (K/V converted to f16 in smem)
SPLIT_TILES = (1, 64, 2)  # (num_mma_q, block_n, stages) for head_dim_vo != head_dim_qk: 128 x 32 spilled 8-16 bytes
BACKENDS = ("auto", "fa2", "fa3")
_NUM_THREADS = 128


# ---------------------------------------------------------------------------- specs


def tile_config(head_dim: int, custom_mask: bool, paged: bool = False, small_q: bool = False) -> tuple[int, int, int]:
    """(num_mma_q, block_n, stages): the largest tiles that compile without register spills,
    and as many K/V stages as keep two CTAs per SM within shared memory. hd128: 128 x 64 tiles
    (two stages: 96 KiB, two CTAs per SM), paged too since its page offsets live in smem.
    ``small_q``: no request has more than 64 packed query rows (block-sparse row blocks, decode
    steps): 64-row tiles, so half of every tile is not padding."""
    if head_dim == 64:
        return (1 if small_q else 2), 64, 3
    if head_dim == 128:
        if custom_mask:
            return 1, 64, 3
        if small_q:             # two stages: 81 KiB, two CTAs per SM (three stages fit one)
            return 1, 64, 2
        return 2, 64, 2
    return 1, 32, 2


@dataclass(frozen=True)
class PrefillSpec:
    head_dim: int          # 64 | 128 | 256
    dtype: str             # "f16" | "bf16" (q, k, v and out)
    causal: bool
    paged: bool
    num_mma_q: int         # 16-row m-tiles per warp; 4 warps
    block_n: int           # keys per K/V tile
    stages: int = 2        # K/V tiles in flight (cp.async pipeline depth)
    tuning: tuple = ()    # extra -D defines for tuning experiments (benchmarks); () in shipped specs
    variant: variants.Composite = variants.DEFAULT
    dtype_kv: str = ""     # "" (K/V of ``dtype``) | "e4m3" | "e5m2" | "f32"
    head_dim_vo: int = 0   # V / out columns when not head_dim (192 / 128: HEAD_DIM_PAIRS)
    source = _SOURCE

    @property
    def block_m(self) -> int:
        return 64 * self.num_mma_q

    @property
    def custom_mask(self) -> bool:       # the custom mask is a variant piece (variants.CUSTOM_MASK)
        return self.variant.has_custom_mask

    @property
    def kv_bytes(self) -> int:
        return {"": 2, "f32": 4}.get(self.dtype_kv, 1)

    @property
    def dim_vo(self) -> int:
        return self.head_dim_vo or self.head_dim

    @property
    def name(self) -> str:   # "prefill_hd128_qf16_causal_paged_bm128_bn32"
        return (f"prefill_hd{self.head_dim}{f'v{self.head_dim_vo}' if self.head_dim_vo else ''}_q{self.dtype}_{'causal' if self.causal else 'full'}"
                f"{'_paged' if self.paged else ''}"
                f"{'_kv' + self.dtype_kv if self.dtype_kv else ''}_bm{self.block_m}_bn{self.block_n}_s{self.stages}"
                + "".join("_" + v.replace("=", "").lower() for v in self.tuning) + self.variant.name)

    @property
    def prelude(self) -> str:
        return self.variant.prelude(f"{self.name}.cu")

    def defines(self) -> tuple[str, ...]:
        return (f"-DHEAD_DIM={self.head_dim}", f"-DDTYPE=cuattn::{self.dtype}",
                f"-DCAUSAL={int(self.causal)}", f"-DPAGED={int(self.paged)}", f"-DNUM_MMA_Q={self.num_mma_q}",
                f"-DBLOCK_N={self.block_n}", f"-DSTAGES={self.stages}", f"-DKV_FP8={KV_FP8.get(self.dtype_kv, 0)}",
                f"-DKV_F32={int(self.dtype_kv == 'f32')}",
                f"-DHEAD_DIM_VO={self.dim_vo}") + \
            tuple(f"-D{v}" for v in self.tuning)

    @property
    def smem_bytes(self) -> int:     # Q tile (2-byte elements) + STAGES K tiles + STAGES V tiles
        d, dv = self.head_dim, self.dim_vo
        tiles = self.block_m * d * 2 + self.stages * self.block_n * (d + dv) * self.kv_bytes
        if self.dtype_kv:            # fp8 / fp32: the converted 16-bit K and V tiles
            tiles += self.block_n * (d + dv) * 2
        # paged: row offsets (STAGES x BLOCK_N int) and page ids ((STAGES + 1) x BLOCK_N int)
        return tiles + (4 * (2 * self.stages + 1) * self.block_n if self.paged else 0)


def make_spec(head_dim: int, dtype: str, causal: bool, custom_mask: bool, paged: bool,
              variant: variants.Composite = variants.DEFAULT, small_q: bool = False, dtype_kv: str = "",
              head_dim_vo: int | None = None) -> PrefillSpec:
    """``custom_mask``: add the custom-mask variant to ``variant`` (where resolve() has not already)."""
    if custom_mask and not variant.has_custom_mask:
        variant = variants.Composite(variant.pieces + (variants.CUSTOM_MASK,))
    # a logits transform needs registers on every tile, as a custom mask does: the smaller tile
    # (hd128 128 x 64 spilled 8-76 bytes with ALiBi or soft-cap on sm_80 / sm_90a)
    num_mma_q, block_n, stages = tile_config(head_dim, variant.has_custom_mask or variant.has("logits_transform")
                                             or variant.has_qk_transform, paged, small_q)
    if head_dim_vo not in (None, head_dim):     # 192 / 128 (fp32 K/V: 64 x 64 spilled 12 bytes, paged)
        num_mma_q, block_n, stages = SPLIT_TILES if dtype_kv != "f32" else (1, 32, 2)
    elif dtype_kv == "f32":
        # fp32 K/V: 4-byte stages, two of them (three of hd64 took 128 KiB); hd128 128 x 32
        block_n, stages = (32 if (head_dim, num_mma_q, block_n) == (128, 2, 64) else block_n), 2
    elif dtype_kv not in ("", dtype) and (head_dim, num_mma_q, block_n) == (128, 2, 64):
        # fp8 K/V (tiles converted to f16 in smem): 128 x 64 spilled 4-100 bytes on sm_80 / sm_90a whatever
        # the load order; 128 x 32 with three stages is spill-free (73 KiB, two CTAs per SM)
        block_n, stages = 32, 3
    return PrefillSpec(head_dim, dtype, bool(causal), bool(paged), num_mma_q, block_n, stages,
                       variant=variant, dtype_kv="" if dtype_kv == dtype else dtype_kv,
                       head_dim_vo=0 if head_dim_vo in (None, head_dim) else int(head_dim_vo))


def shipped_specs() -> list[PrefillSpec]:
    """Every 16-bit case, and for fp8 K/V what serving runs: head_dim 128, paged (both tile heights),
    causal or not, no custom mask, fp16 / bf16 q, e4m3 / e5m2 (16 specs; others compile on first use)."""
    return [make_spec(d, t, c, m, p, small_q=s) for d in HEAD_DIMS for t in DTYPES for c in (False, True)
            for m in (False, True) for p in (False, True) for s in (False, True)
            if not s or (p and not m and d in (64, 128))] + \
        [make_spec(128, t, c, False, True, small_q=s, dtype_kv=kv) for t in DTYPES for kv in KV_FP8
         for c in (False, True) for s in (False, True)]


def select_backend(backend: str, fn: str) -> str:
    """Checks the name; the backend as far as it is known before a call: "fa2" for "auto" (a GPU
    call may resolve it to "fa3": ``resolve_backend``)."""
    if backend not in BACKENDS:
        raise ValueError(f"{fn}: backend must be one of {BACKENDS}, got {backend!r}")
    return "fa2" if backend == "auto" else backend


# ---------------------------------------------------------------------------- backend "fa3" (sm_90a)
# "auto" picks fa3 wherever it has a kernel: faster than fa2 in every measured case, causal or not
# (1.5-2.1x; benchmarks/results/prefill_sm90_notes.md); every other case, and every other arch, runs fa2.
# That holds for paged batches whose requests fill half of its 128-row tile too (H100, block-sparse
# 16k x 16k, 32 heads, 64 x 64 blocks: fa3 1705 / 7424 us at 10% / 50% density against fa2's 64-row
# tiles 2132 / 9141: benchmarks/results/sparse_H100_2026-11-25.json); fa2 runs its 64-row tiles where
# it runs such a batch (sm_80, page sizes fa3 cannot box).


def resolve_backend(backend: str, fn: str, *, arch: str | None, head_dim: int, dtype: str | None,
                    custom_mask: bool, paged: bool, rope: bool = False, page_size: int | None = None,
                    dtype_kv: str | None = None, head_dim_vo: int | None = None) -> str:
    """"fa2" or "fa3" for one call. backend="fa3" where fa3 has no kernel raises UnsupportedError naming
    the case; ``arch`` None checks everything but the device. ``dtype_kv``: the KV short name when it is
    not q's (fa3 reads 16-bit K/V of q's type or fp8); ``head_dim_vo``: V's head_dim (None: head_dim)."""
    if backend == "fa2":
        return "fa2"
    reason = prefill_sm90.unsupported_reason(arch, head_dim, dtype, custom_mask, paged, rope, page_size, dtype_kv,
                                             head_dim_vo)
    if backend == "fa3":
        if reason is not None:
            raise UnsupportedError(f"{fn}: backend='fa3': {reason}; use backend='fa2' or 'auto'")
        return "fa3"
    return "fa3" if reason is None and arch is not None else "fa2"


# ---------------------------------------------------------------------------- launch (argument checks: prefill_checks.py)


# kernel parameters (prefill.cu's signature), then the variant's (variants.Composite.arg_kinds)
PARAMS = Params.define(_ENTRY, "q:p k:p v:p o:p lse:p qo_indptr:p kv_indptr:p kv_indices:p kv_last_page_len:p "
                               "work:p part_o:p part_lse:p kv_chunk:p single_qo_len:i single_kv_len:i group:i page_size:i page_shift:i "
                               "page_rows:i q_s_tok:q q_s_head:q k_s_tok:q k_s_head:q k_s_page:q v_s_tok:q v_s_head:q "
                               "v_s_page:q o_s_tok:q o_s_head:q k_scale:f v_scale:f k_scales:p v_scales:p "
                               "scale_per_head:i scale_log2:f")


META = ("qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_len", "work", "part_o", "part_lse",
        "kv_chunk")     # the plan's device pointers, by kernel parameter name
MERGE_PARAMS = {entry: Params.define(entry, "merge:p qo_indptr:p part_o:p part_lse:p o:p lse:p group:i o_s_tok:q "
                                            "o_s_head:q") for entry in ("cuattn_prefill_merge", "cuattn_prefill_sm90_merge")}


def _launch(ctx, spec: PrefillSpec, *, q, k_ptr, v_ptr, out, lse_ptr, num_work: int, num_kv_heads: int,
            group: int, k_strides, v_strides, sm_scale: float, variant_args: tuple, single=(0, 0), meta=None,
            page_size: int = 1, pdl: bool = False, scales=(fp8.ONE, fp8.ONE)) -> None:
    """One launch; ``meta`` = the plan's device pointers by name (META) for batch mode, or None for
    the single-request case (lengths in single); ``variant_args`` = variants.Bound.kernel_args
    (sm_scale first; a custom mask's arrays among them); ``scales`` = run()'s (k, v) fp8.Scale."""
    if num_work == 0 or num_kv_heads == 0:
        return
    launch = jit.get_launcher(spec, _ENTRY, ctx.device, PARAMS.kinds + spec.variant.arg_kinds, spec.smem_bytes)
    if meta is None:
        meta = {}
    args = PARAMS.pack(
        q=q.ptr, k=k_ptr, v=v_ptr, o=out.ptr, lse=lse_ptr, **{n: meta.get(n, 0) for n in META},
        single_qo_len=single[0], single_kv_len=single[1], group=group, page_size=page_size,
        page_shift=page_size.bit_length() - 1 if page_size & (page_size - 1) == 0 else -1,
        page_rows=k_strides[2] // k_strides[0] if k_strides[0] else 0, q_s_tok=q.strides[0], q_s_head=q.strides[1],
        k_s_tok=k_strides[0], k_s_head=k_strides[1], k_s_page=k_strides[2], v_s_tok=v_strides[0],
        v_s_head=v_strides[1], v_s_page=v_strides[2], o_s_tok=out.strides[0], o_s_head=out.strides[1],
        k_scale=scales[0].value, v_scale=scales[1].value, k_scales=scales[0].ptr, v_scales=scales[1].ptr,
        scale_per_head=int(scales[0].per_head) | 2 * int(scales[1].per_head),
        scale_log2=spec.variant.scale_log2(sm_scale)) + tuple(variant_args)
    launch((num_work, num_kv_heads), _NUM_THREADS, ctx.stream, *args, pdl=pdl)


def _launch_merge(ctx, spec, entry: str, meta: dict, num_merge: int, num_kv_heads: int, group: int, out,
                  lse_ptr: int) -> None:
    """The merge of split items' pieces (``entry`` of ``spec``'s module): grid (merge rows, kv heads)."""
    if num_merge == 0 or num_kv_heads == 0:
        return
    launch = jit.get_launcher(spec, entry, ctx.device, MERGE_PARAMS[entry].kinds)
    launch((num_merge, num_kv_heads), 128, ctx.stream,
           *MERGE_PARAMS[entry].pack(merge=meta["merge"], qo_indptr=meta["qo_indptr"], part_o=meta["part_o"],
                                     part_lse=meta["part_lse"], o=out.ptr, lse=lse_ptr, group=group,
                                     o_s_tok=out.strides[0], o_s_head=out.strides[1]))


# ---------------------------------------------------------------------------- batches


class _BatchPrefillBase:
    _fn = "BatchPrefill"

    def __init__(self, float_workspace_buffer=None, kv_layout: str = "NHD", use_cuda_graph: bool = False,
                 backend: str = "auto", **buffers):
        self._kv_layout = check_kv_layout(kv_layout, self._fn)
        self.backend = select_backend(backend, self._fn)     # the backend the last run used (or will use)
        self._backend_req = backend
        self._plan = None
        self._bufs = _plan.PlanBuffers(self._fn, float_workspace_buffer, use_cuda_graph)
        self._f32q = qcast.F32Q(self._fn, use_cuda_graph)     # an fp32 q's 16-bit copies (qcast.py)
        self._backend_memo: dict[tuple, tuple] = {}   # (backend, kernel spec) by device and spec (_plan_device)
        self._configs: dict[tuple, tuple] = {}        # plan()'s checked configurations (plan.config_key)

    def _plan_common(self, fn, qo_indptr, kv_lens, num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo,
                     custom_mask, packed_custom_mask, causal, sm_scale, q_data_type, kv_data_type, paged, options,
                     page_size=None):
        qo = _plan.host_ints(qo_indptr, "qo_indptr", fn).astype(np.int64)
        qo_lens = qo[1:] - qo[:-1]          # np.diff, without its wrapper's cost
        qo_range = (int(qo_lens.min()), int(qo_lens.max())) if len(qo_lens) else None
        if len(qo) < 1 or qo[0] != 0 or (qo_range and qo_range[0] < 0):
            raise ValueError(f"{fn}: qo_indptr must start at 0 and be non-decreasing, got {qo[:8]}")
        batch = len(qo) - 1
        if len(kv_lens) != batch:
            raise ValueError(f"{fn}: qo_indptr and the kv page table / kv_indptr must describe the same batch, "
                             f"got batch {batch} from qo_indptr and {len(kv_lens)} from kv")
        has_mask = custom_mask is not None or packed_custom_mask is not None
        # -- a configuration (all but the batch's arrays) checked before for these arguments: its results
        key = _plan.config_key(num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo, has_mask, causal, q_data_type,
                               kv_data_type, page_size, *options.values())
        config = self._configs.get(key) if key is not None else None
        if config is None:
            _check_group(num_qo_heads, num_kv_heads, fn)
            bound = variants.resolve(fn, num_qo_heads=num_qo_heads, head_dim=head_dim_qk, custom_mask=has_mask,
                                     **options)
            head_dim_vo = _check_head_dim_vo(head_dim_qk, head_dim_vo, bound, fn)
        else:
            bound, head_dim_vo, q_dt, kv_dt, kv_short, specs = config
        mask_host = mask_indptr = None
        if has_mask:
            sizes = qo_lens * kv_lens
            m = _host_mask(custom_mask, packed_custom_mask, int(sizes.sum()), fn)
            if custom_mask is not None:
                seg = np.zeros(batch + 1, np.int64)
                np.cumsum(sizes, out=seg[1:])
                mask_host, mask_indptr = segment_packbits_host(m, seg)
            else:
                mask_indptr = np.zeros(batch + 1, np.int32)
                np.cumsum((sizes + 7) // 8, out=mask_indptr[1:])
                if m.size != mask_indptr[-1]:
                    raise ValueError(f"{fn}: packed_custom_mask must have {mask_indptr[-1]} bytes (sum of "
                                     f"ceil(qo_len * kv_len / 8) per request), got {m.size}")
                mask_host = m
            bound.fixed.update(custom_mask=mask_host, mask_indptr=mask_indptr)   # the NumPy path's values
        if config is None:
            q_dt = arrays.as_dtype(q_data_type, "q_data_type", fn)
            kv_dt = arrays.as_dtype(kv_data_type, "kv_data_type", fn) if kv_data_type is not None else q_dt
            support.check("prefill", fn, head_dim=head_dim_qk, q_dtype=q_dt, kv_dtype=kv_dt, head_dim_vo=head_dim_vo)
            k_dt = qcast.kernel_dtype(q_dt, kv_dt)      # the kernels' q type (an fp32 q's 16-bit copy)
            kv_short = _kv_short(k_dt, kv_dt, bound, fn)
        group = num_qo_heads // num_kv_heads
        # every request within 64 packed rows (block-sparse row blocks, decode-only steps): 64-row
        # tiles; not in graph mode, whose kernel the first plan fixes for every later batch
        small_q = paged and not self._bufs.graph and batch > 0 and qo_range[1] * group <= 64
        if config is None:
            specs = {s: make_spec(head_dim_qk, arrays.SHORT_NAME[k_dt], causal, has_mask, paged, bound.composite, s,
                                  kv_short, head_dim_vo) if arrays.SHORT_NAME.get(k_dt) in DTYPES else None
                     for s in (False, True)}                # (support.check passed)
            resolve_backend(self._backend_req, fn, arch=None, head_dim=head_dim_qk, dtype=arrays.SHORT_NAME.get(k_dt),
                            custom_mask=has_mask, paged=paged, rope=bound.composite.has_qk_transform,
                            page_size=page_size, dtype_kv=kv_short,
                            head_dim_vo=head_dim_vo)   # fa3 asked where it has none
            if key is not None:
                _plan.memo_put(self._configs, key, (bound, head_dim_vo, q_dt, kv_dt, kv_short, specs))
        spec = specs[small_q]
        return _plan.Plan(self._fn, batch, num_qo_heads, num_kv_heads, head_dim_qk, q_dt, kv_dt,
                          sm_scale or 1 / math.sqrt(head_dim_qk), bound, bool(causal), page_size, spec,
                          kv_lens=kv_lens, qo_indptr=qo.astype(np.int32), qo_lens=qo_lens, qo_range=qo_range,
                          mask=mask_host, mask_indptr=mask_indptr, head_dim_vo=head_dim_vo)

    def _run_backend(self, ctx, fn, plan, paged: bool) -> str:
        """Resolves the backend of a GPU run on this device; ``self.backend`` reports it."""
        self.backend = resolve_backend(self._backend_req, fn, arch=jit.device_arch(ctx.device), head_dim=plan["head_dim"],
                                       dtype=plan["spec"].dtype, custom_mask=plan["mask"] is not None,
                                       paged=paged, rope=plan["bound"].composite.has_qk_transform,
                                       page_size=plan.get("page_size"), dtype_kv=plan["spec"].dtype_kv,
                                       head_dim_vo=plan["head_dim_vo"])
        return self.backend

    def _require_plan(self, fn):
        if self._plan is None:
            raise ValueError(f"{fn}: plan() must be called before run()")
        return self._plan

    def _plan_device(self, fn: str, plan: _plan.Plan, paged: bool, fixed_split_size, disable_split_kv: bool,
                     stream_of) -> None:
        """The GPU half of plan(): the backend for the device, the work list (split-KV chosen here, or
        ``fixed_split_size`` / ``disable_split_kv``), and one upload of it with the page table into the
        plan buffers, on the current stream of ``stream_of``'s framework. No GPU: a NumPy plan."""
        _plan.check_fixed_split(fn, fixed_split_size)
        bufs = self._bufs
        device = bufs.device_for(stream_of)
        plan.device = device
        self._f32q.plan(plan)       # fp32 q: the 16-bit copies of q and out
        if device is None or plan.spec is None:
            return
        composite = plan["bound"].composite
        # -- the backend and kernel of this configuration on this device: as the last plan's when
        #    everything they depend on is (a serving loop's steady state). The configuration memo
        #    (_plan_common) hands out the same spec object for the same configuration: its identity
        #    stands for every argument the backend depends on (the object is kept and compared).
        key = (device, id(plan.spec))
        hit = self._backend_memo.get(key)
        if hit is None or hit[0] is not plan.spec:
            backend = self._run_backend(arrays.Context("cupy", device, None), fn, plan, paged)
            spec = plan["spec"] if backend == "fa2" else prefill_sm90.make_spec(
                plan["spec"].dtype, plan["causal"], composite, paged, plan["spec"].dtype_kv,
                plan["head_dim"], plan["head_dim_vo"], plan.page_size if paged else None)
            _plan.memo_put(self._backend_memo, key, (plan.spec, backend, spec))
        else:
            _, backend, spec = hit
            self.backend = backend
        h_kv, group = plan.num_kv_heads, plan.num_qo_heads // plan.num_kv_heads
        items = _plan.prefill_items(plan.qo_lens, plan.kv_lens, group, spec.block_m, plan.causal, plan.qo_range)
        ext = items[2]
        top = int(ext.max()) if len(ext) else 0       # (read once: the split choice and the work list)
        slot_floats = h_kv * spec.block_m * (plan.head_dim + 1)      # a slot: every kv head's tile rows + LSE
        max_slots = bufs.max_partial(slot_floats)
        sms = _plan.num_sms(device)
        slots = sms * (2 if backend == "fa2" else 1)       # resident CTAs

        def auto():
            c = _plan.choose_prefill_chunk(ext, h_kv, sms, slots // sms, spec.block_n, max_slots, top)
            return c, _plan.split_reason(len(ext) * h_kv, slots, c)
        if composite.use_softmax:
            chunk, why = _plan.split_choice(disable_split_kv, fixed_split_size, spec.block_n, auto)
        else:                                     # weights without softmax: never split (nothing to merge)
            chunk, why = 0, "the variant has no softmax to merge"
        wl = _plan.prefill_work_list(plan.qo_lens, plan.kv_lens, group, spec.block_m, spec.block_n,
                                     plan.causal, chunk, items, top)
        if len(wl.work) > 2 ** 31 - 1:
            raise UnsupportedError(f"{fn}: {len(wl.work)} work items exceed the grid limit")
        mask = plan.mask
        segments = [("kv_chunk", (wl.chunk,), 0),
                    ("qo_indptr", plan.qo_indptr, 0), ("kv_indptr", plan.kv_indptr, 0),
                    ("kv_last_page_len", plan.last_page_len, 0), ("kv_indices", plan.kv_indices, 0),
                    ("mask_indptr", plan.mask_indptr, 0), ("mask", None if mask is None else _plan.as_words(mask), 0),
                    ("work", wl.work.reshape(-1), -1), ("merge", wl.merge.reshape(-1), -1)]
        ptrs = bufs.upload(fn, segments, (spec.name, plan.num_qo_heads, h_kv, plan.page_size) if bufs.graph else None,
                           stream_of)
        ptrs.update(bufs.partial(fn, slot_floats, wl.num_slots, spec.block_m * plan.head_dim * h_kv))
        plan.backend, plan.run_spec, plan.work_list, plan.meta, plan.split_why = backend, spec, wl, ptrs, why
        plan.grid_work = bufs.rows("work", len(wl.work), _plan.PREFILL_COLS)
        plan.grid_merge = bufs.rows("merge", len(wl.merge), _plan.PREFILL_COLS)

    def describe(self) -> str:
        """What the last plan() runs: the kernel specialization and its tiles, the work items, the
        split-KV decision and its reason, and the balance the scheduler reached."""
        p = self._plan
        if p is None:
            return f"{self._fn}: not planned"
        lines = [f"{self._fn}: batch {p['batch']}, {int(p['qo_indptr'][-1])} queries, {p['num_qo_heads']}:"
                 f"{p['num_kv_heads']} heads, head_dim {p['head_dim']}, {'causal' if p['causal'] else 'full'}"
                 + ("" if p["mask"] is None else ", custom mask")]
        if p.meta is None:
            return "\n".join(lines + ["NumPy reference path (no GPU at plan time)"])
        wl, spec, h = p["work_list"], p["run_spec"], p["num_kv_heads"]
        lines.append(f"kernel: {spec.name} (backend {p['backend']}), tiles of {spec.block_m} packed query rows x "
                     f"{spec.block_n} keys")
        lines.append(f"work: {len(wl.work)} items x {h} kv heads = {len(wl.work) * h} CTAs on "
                     f"{_plan.num_sms(p['device'])} SMs" + (f"; grid padded to {p['grid_work']} items (CUDA graph)"
                                                           if self._bufs.graph else ""))
        return "\n".join(lines + _plan.describe_split(wl, spec.block_n, p["split_why"]))

    def _merge(self, ctx, plan, ot, lse_ptr) -> None:
        """After the attention kernel: merge the pieces of split items (graph mode: always launched,
        over the merge rows' capacity, so a replay after a plan that splits merges too)."""
        if plan["grid_merge"] and (plan["work_list"].split or self._bufs.graph):
            entry = "cuattn_prefill_merge" if plan["backend"] == "fa2" else "cuattn_prefill_sm90_merge"
            _launch_merge(ctx, plan["run_spec"], entry, plan["meta"], plan["grid_merge"], plan["num_kv_heads"],
                          plan["group"], ot, lse_ptr)
        self._f32q.finish(ctx)      # fp32 q: the 16-bit output into the caller's out

    def _gpu_plan(self, ctx, plan, fn) -> None:
        """A GPU run needs the plan's device half, on this run's GPU; a stream capturing a CUDA graph
        needs a wrapper built for graphs."""
        if plan.device != ctx.device or plan.meta is None:
            raise ValueError(f"{fn}: the arrays must be on the GPU the plan was made for (GPU {plan.device}), "
                             f"got GPU {ctx.device}; plan() on that GPU (cupy.cuda.Device(i) current)")
        _plan.refuse_capture(fn, self._bufs.graph, ctx.stream)

    def _run_checks(self, fn, q, plan):
        qt = arrays.device_tensor(q, "q", fn)
        _check_q(qt.shape, fn, plan["num_qo_heads"], plan["head_dim"], int(plan["qo_indptr"][-1]))
        if arrays.logical_dtype(qt.dtype) != plan["q_dtype"]:
            raise ValueError(f"{fn}: q must have the q_data_type given to plan ({plan['q_dtype']}), got {qt.dtype}")
        return qt

    def _outputs(self, ctx, fn, plan, qt, out, lse, return_lse):
        rows = int(plan["qo_indptr"][-1])
        if lse is None and return_lse:
            lse = arrays.empty(ctx, (rows, plan["num_qo_heads"]), np.float32)
        out, ot, lse, lse_ptr = _check_out(ctx, out, lse, rows, plan["num_qo_heads"], plan["head_dim_vo"], qt.dtype, fn)
        qk, ok = self._f32q.begin(ctx, qt.ptr, qt.strides, ot.ptr, ot.strides) if self._f32q.active else (qt, ot)
        return out, qk, ok, lse, lse_ptr      # qk, ok: what the kernel reads and writes (fp32 q: 16-bit copies)

    def _variant_args(self, plan, args, return_lse, lse, fn, on_gpu: bool, sm_scale=None):
        """(sm_scale, the kernels' variant arguments or, on the NumPy path, the parameter values)
        from the plan's variant and run()'s extra positional arguments."""
        bound = plan["bound"]
        bound.check_lse(return_lse, lse, fn)
        # -- the plan's custom mask: on a GPU run, the bits and byte offsets plan() uploaded
        #    (a NumPy plan has none: _gpu_plan refuses that run)
        meta = plan["meta"] or {}
        dev = {} if not on_gpu or plan["mask"] is None else {
            "custom_mask": variants.Pointer(meta.get("mask", 0)), "mask_indptr": variants.Pointer(meta.get("mask_indptr", 0))}
        if on_gpu and not args and not bound.runtime and sm_scale is None:    # the plan's own: built once
            if plan.fixed_vargs is None:
                plan.fixed_vargs = bound.kernel_args(plan["sm_scale"], {**bound.fixed, **dev}, fn)
            return plan["sm_scale"], plan["fixed_vargs"]
        values = {**bound.values(tuple(args), fn), **dev}
        bound.check_sinks(values, plan["num_qo_heads"], fn)
        bound.check_custom_mask(values, plan["qo_lens"], plan["kv_lens"], fn)
        scale = plan["sm_scale"] if sm_scale is None else float(sm_scale)
        return scale, (bound.kernel_args(scale, values, fn) if on_gpu else bound.host_values(values, fn))

    def _reference_run(self, ctx, plan, q, gather, return_lse, fn, scale, values, out_arg, lse_arg):
        qa = arrays.host_array(q, "q", fn)
        _check_q(qa.shape, fn, plan["num_qo_heads"], plan["head_dim"], int(plan["qo_indptr"][-1]))
        if qa.dtype != plan["q_dtype"]:
            raise ValueError(f"{fn}: q must have the q_data_type given to plan ({plan['q_dtype']}), got {qa.dtype}")
        rows = qa.shape[0]
        out = np.zeros((rows, plan["num_qo_heads"], plan["head_dim_vo"]), np.float32)
        lse = np.full((rows, plan["num_qo_heads"]), -np.inf, np.float32)
        qo = plan["qo_indptr"]
        for b in range(plan["batch"]):       # (a custom mask: the variant's NumPy hook reads the packed bits)
            k, v = gather(b)
            o, s = reference.attention(qa[qo[b]:qo[b + 1]], k, v, sm_scale=scale, causal=plan["causal"],
                                       variant=plan["bound"].composite, values=values, batch_idx=b, fn=fn)
            out[qo[b]:qo[b + 1]] = o
            lse[qo[b]:qo[b + 1]] = s
        return arrays.host_results(ctx, out, lse, out_arg, lse_arg, return_lse, qa.dtype, fn)


class BatchPrefillWithRaggedKVCacheWrapper(_BatchPrefillBase):
    """Prefill over a ragged batch: request i's queries are ``q[qo_indptr[i]:qo_indptr[i+1]]`` and its
    keys ``k[kv_indptr[i]:kv_indptr[i+1]]`` (contiguous K/V, NHD ``(nnz_kv, num_kv_heads, head_dim)``
    or HND ``(num_kv_heads, nnz_kv, head_dim)``). ``plan()`` once per batch step, ``run()`` per layer.
    """
    _fn = "BatchPrefillWithRaggedKVCacheWrapper"

    def __init__(self, float_workspace_buffer=None, kv_layout: str = "NHD", use_cuda_graph: bool = False,
                 qo_indptr_buf=None, kv_indptr_buf=None, custom_mask_buf=None, mask_indptr_buf=None,
                 backend: str = "auto", jit_args=None):
        super().__init__(float_workspace_buffer, kv_layout, use_cuda_graph, backend)

    def plan(self, qo_indptr, kv_indptr, num_qo_heads: int, num_kv_heads: int, head_dim_qk: int,
             head_dim_vo: int | None = None, custom_mask=None, packed_custom_mask=None, causal: bool = False,
             pos_encoding_mode: str = "NONE", use_fp16_qk_reduction: bool = False, window_left: int = -1,
             logits_soft_cap=None, sm_scale: float | None = None, rope_scale=None, rope_theta=None,
             q_data_type="float16", kv_data_type=None, non_blocking: bool = True, *, variant=None,
             rotary_dim=None, fixed_split_size: int | None = None, disable_split_kv: bool = False) -> None:
        """Build the work list for a batch and upload it (asynchronously, on the current stream of
        ``qo_indptr``'s framework; CuPy's for NumPy input).

        Parameters
        ----------
        qo_indptr : array, shape (batch + 1,), int32 (host or device; copied to the host)
        kv_indptr : array, shape (batch + 1,), int32
        custom_mask : array, shape (sum(qo_len * kv_len),), bool, optional
        packed_custom_mask : array, uint8, optional: ``segment_packbits`` of the mask per request
        causal : bool (bottom-right aligned when qo_len < kv_len)
        window_left, logits_soft_cap, pos_encoding_mode ("NONE" | "ALIBI"), variant :
            attention variants (``cuattn.variants``); a variant's parameters not fixed here are passed
            to ``run()`` positionally after ``v``.
        fixed_split_size : int, optional
            Cut every query tile's keys into pieces of this many (rounded up to whole key tiles),
            merged exactly, instead of the scheduler's choice; ``disable_split_kv=True`` never splits.
            With either, a request's output is bitwise the same alone or inside any batch.
        """
        fn = f"{self._fn}.plan"
        options = dict(pos_encoding_mode=pos_encoding_mode, window_left=window_left, logits_soft_cap=logits_soft_cap,
                       use_fp16_qk_reduction=use_fp16_qk_reduction, rope_scale=rope_scale, rope_theta=rope_theta,
                       variant=variant, rotary_dim=rotary_dim)
        kv = _plan.host_ints(kv_indptr, "kv_indptr", fn).astype(np.int64)
        kv_lens = kv[1:] - kv[:-1]          # np.diff, without its wrapper's cost (twice)
        if len(kv) < 1 or kv[0] != 0 or (len(kv_lens) and kv_lens.min() < 0):
            raise ValueError(f"{fn}: kv_indptr must start at 0 and be non-decreasing, got {kv[:8]}")
        plan = self._plan_common(fn, qo_indptr, kv_lens, num_qo_heads, num_kv_heads, head_dim_qk,
                                 head_dim_vo, custom_mask, packed_custom_mask, causal, sm_scale, q_data_type,
                                 kv_data_type, paged=False, options=options)
        plan.kv_indptr = kv.astype(np.int32)
        self._plan_device(fn, plan, False, fixed_split_size, disable_split_kv, qo_indptr)
        self._plan = plan

    def run(self, q, k, v, *args, out=None, lse=None, return_lse: bool = False, k_scale=None, v_scale=None,
            enable_pdl=None, stream=None):
        """Attention for the planned batch.

        Parameters
        ----------
        q : array, shape (qo_indptr[-1], num_qo_heads, head_dim), q_data_type
        k, v : array, shape (kv_indptr[-1], num_kv_heads, head_dim) "NHD" or transposed "HND";
            kv_data_type (fp8: torch / ml_dtypes float8, or uint8 read as the plan's fp8 type)
        k_scale, v_scale : float, or float32 array of shape (1,) or (num_kv_heads,), optional
            Stored value x scale = real value (FlashInfer's meaning; any KV dtype; fa2 and fa3).
        out : array, optional, shape of ``q``; lse : float32 (qo_indptr[-1], num_qo_heads), optional
        enable_pdl : bool, optional
            Programmatic Dependent Launch (the kernel may be scheduled while the previous kernel in
            the stream finishes, and waits for it before reading anything); None (the default, as
            in FlashInfer): on wherever the GPU has it (sm_90+); ignored below sm_90.

        Returns
        -------
        out, or (out, lse) when ``return_lse`` (LSE natural log)
        """
        fn = f"{self._fn}.run"
        plan = self._require_plan(fn)
        ctx = arrays.context_of(fn, {"q": q, "k": k, "v": v}, stream)
        arrays.writable(out, "out", fn)
        arrays.writable(lse, "lse", fn)
        scale, vargs = self._variant_args(plan, args, return_lse, lse, fn, ctx.on_gpu)
        scales = _scales(plan, k_scale, v_scale, fn, ctx.on_gpu)
        if not ctx.on_gpu:
            ka, va = arrays.host_array(k, "k", fn), arrays.host_array(v, "v", fn)
            self._check_kv(ka.shape, va.shape, plan, fn)
            _check_kv_dtype(plan, ka.dtype, va.dtype, "k and v", fn)
            if self._kv_layout == "HND":
                ka, va = ka.transpose(1, 0, 2), va.transpose(1, 0, 2)
            kvp = plan["kv_indptr"]
            return self._reference_run(ctx, plan, q, lambda b: (_host_kv(ka[kvp[b]:kvp[b + 1]], plan, scales[0], 1),
                                                                _host_kv(va[kvp[b]:kvp[b + 1]], plan, scales[1], 1)),
                                       return_lse, fn, scale, vargs, out, lse)
        self._gpu_plan(ctx, plan, fn)
        qt = self._run_checks(fn, q, plan)
        kt, vt = arrays.device_tensor(k, "k", fn), arrays.device_tensor(v, "v", fn)
        self._check_kv(kt.shape, vt.shape, plan, fn)
        _check_kv_dtype(plan, kt.dtype, vt.dtype, "k and v", fn)
        out, qk, ot, lse, lse_ptr = self._outputs(ctx, fn, plan, qt, out, lse, return_lse)
        pdl = jit.pdl_launch(ctx.device, enable_pdl)
        tok, head = (0, 1) if self._kv_layout == "NHD" else (1, 0)
        if plan["backend"] == "fa3":
            with arrays.cupy_module().cuda.Device(ctx.device):
                prefill_sm90.launch(ctx, plan["run_spec"], q=qk, k=kt, v=vt, k_strides=(kt.strides[tok], kt.strides[head]),
                                    v_strides=(vt.strides[tok], vt.strides[head]), kv_tokens=kt.shape[tok], out=ot,
                                    lse_ptr=lse_ptr, num_work=plan["grid_work"], num_kv_heads=plan["num_kv_heads"],
                                    group=plan["group"], sm_scale=scale, variant_args=vargs, fn=fn, meta=plan["meta"],
                                    pdl=pdl, scales=scales)
        else:
            _launch(ctx, plan["spec"], q=qk, k_ptr=kt.ptr, v_ptr=vt.ptr, out=ot, lse_ptr=lse_ptr,
                    num_work=plan["grid_work"], num_kv_heads=plan["num_kv_heads"], group=plan["group"],
                    k_strides=(kt.strides[tok], kt.strides[head], 0), v_strides=(vt.strides[tok], vt.strides[head], 0),
                    sm_scale=scale, variant_args=vargs, meta=plan["meta"], pdl=pdl, scales=scales)
        self._merge(ctx, plan, ot, lse_ptr)
        o = arrays.export(ctx, out, arrays.logical_dtype(qt.dtype))
        return (o, arrays.export(ctx, lse)) if return_lse else o

    forward = run

    def _check_kv(self, ks, vs, plan, fn):
        nnz, hkv, d = _kv_dims(ks, self._kv_layout, "k", fn)
        if tuple(vs) != tuple(ks)[:-1] + (plan["head_dim_vo"],):
            raise ValueError(f"{fn}: v must have the shape of k {tuple(ks)} with head_dim_vo={plan['head_dim_vo']} "
                             f"last, got {tuple(vs)}")
        if hkv != plan["num_kv_heads"] or d != plan["head_dim"] or nnz < plan["kv_indptr"][-1]:
            raise ValueError(f"{fn}: k must have num_kv_heads={plan['num_kv_heads']}, head_dim={plan['head_dim']} "
                             f"and >= kv_indptr[-1]={plan['kv_indptr'][-1]} tokens, got shape {tuple(ks)} "
                             f"({self._kv_layout})")


class BatchPrefillWithPagedKVCacheWrapper(_BatchPrefillBase):
    """Prefill / append over a paged KV cache (FlashInfer's CSR page table). Request i's queries
    are ``q[qo_indptr[i]:qo_indptr[i+1]]``; its keys are the pages
    ``paged_kv_indices[paged_kv_indptr[i]:paged_kv_indptr[i+1]]``, the last one holding
    ``paged_kv_last_page_len[i]`` tokens. Cache: ``[num_pages, 2, page_size, num_kv_heads, head_dim]``
    (NHD), ``[num_pages, 2, num_kv_heads, page_size, head_dim]`` (HND), or a (k, v) pair.
    """
    _fn = "BatchPrefillWithPagedKVCacheWrapper"

    def __init__(self, float_workspace_buffer=None, kv_layout: str = "NHD", use_cuda_graph: bool = False,
                 qo_indptr_buf=None, paged_kv_indptr_buf=None, paged_kv_indices_buf=None,
                 paged_kv_last_page_len_buf=None, custom_mask_buf=None, mask_indptr_buf=None,
                 backend: str = "auto", jit_args=None):
        super().__init__(float_workspace_buffer, kv_layout, use_cuda_graph, backend)
        self._sinks = False       # BatchAttentionWithAttentionSinkWrapper: a sink per query head

    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads: int,
             num_kv_heads: int, head_dim_qk: int, page_size: int, head_dim_vo: int | None = None,
             custom_mask=None, packed_custom_mask=None, causal: bool = False, pos_encoding_mode: str = "NONE",
             use_fp16_qk_reduction: bool = False, window_left: int = -1, logits_soft_cap=None,
             sm_scale: float | None = None, rope_scale=None, rope_theta=None, q_data_type="float16",
             kv_data_type=None, non_blocking: bool = True, *, variant=None, rotary_dim=None,
             fixed_split_size: int | None = None, disable_split_kv: bool = False) -> None:
        """Build the work list for a batch over the page table (arrays int32, host or device) and
        upload it, on the current stream of ``paged_kv_indices``' framework. Variant options,
        ``fixed_split_size`` and ``disable_split_kv`` as in ``BatchPrefillWithRaggedKVCacheWrapper.plan``."""
        fn = f"{self._fn}.plan"
        options = dict(pos_encoding_mode=pos_encoding_mode, window_left=window_left, logits_soft_cap=logits_soft_cap,
                       use_fp16_qk_reduction=use_fp16_qk_reduction, rope_scale=rope_scale, rope_theta=rope_theta,
                       variant=variant, sinks=self._sinks, rotary_dim=rotary_dim)
        if page_size < 1:
            raise ValueError(f"{fn}: page_size must be >= 1, got {page_size}")
        # -- each array read once more than its host copy: no int64 round trips of the page ids
        indptr = _plan.host_ints(paged_kv_indptr, "paged_kv_indptr", fn)
        indices = _plan.host_ints(paged_kv_indices, "paged_kv_indices", fn)
        last = _plan.host_ints(paged_kv_last_page_len, "paged_kv_last_page_len", fn)
        kv_lens = validate_page_table(fn, indptr, last, page_size, len(indices), prefix="paged_kv_")
        hi = _plan.max_index(indices)
        if hi is None:      # validate_page_table's check of the ids, with their maximum kept for run()
            raise ValueError(f"{fn}: paged_kv_indices must be >= 0, got values in {int(indices.min())}.."
                             f"{int(indices.max())}")
        plan = self._plan_common(fn, qo_indptr, kv_lens, num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo,
                                 custom_mask, packed_custom_mask, causal, sm_scale, q_data_type, kv_data_type,
                                 paged=True, options=options, page_size=int(page_size))
        # -- the page ids as given until uploaded (the staging copy casts); a host snapshot only for a plan that
        #    does not upload them (the NumPy path reads it at run())
        plan.kv_indptr, plan.kv_indices = indptr.astype(np.int32), indices
        plan.last_page_len, plan.max_page = last.astype(np.int32), hi
        self._plan_device(fn, plan, True, fixed_split_size, disable_split_kv, paged_kv_indices)
        if plan.meta is None:
            plan.kv_indices = indices.astype(np.int32)
        self._plan = plan

    def run(self, q, paged_kv_cache, *args, out=None, lse=None, return_lse: bool = False, k_scale=None,
            v_scale=None, enable_pdl=None, stream=None):
        """Attention for the planned batch; ``q`` (qo_indptr[-1], num_qo_heads, head_dim); ``args``:
        the plan's variant parameters not fixed by plan(), in order. ``enable_pdl``: as in
        ``BatchPrefillWithRaggedKVCacheWrapper.run``.

        Returns out (shape of ``q``), or (out, lse) when ``return_lse`` (LSE natural log, float32).
        """
        return self._run_paged(q, paged_kv_cache, args, out, lse, return_lse, k_scale, v_scale, enable_pdl, stream,
                               None, f"{self._fn}.run")

    def _run_paged(self, q, paged_kv_cache, args, out, lse, return_lse, k_scale, v_scale, enable_pdl, stream,
                   sm_scale, fn):
        plan = self._require_plan(fn)
        cache = dict(enumerate(paged_kv_cache)) if isinstance(paged_kv_cache, (tuple, list)) else {"c": paged_kv_cache}
        ctx = arrays.context_of(fn, {"q": q, **{f"paged_kv_cache[{k}]": v for k, v in cache.items()}}, stream)
        arrays.writable(out, "out", fn)
        arrays.writable(lse, "lse", fn)
        scale, vargs = self._variant_args(plan, args, return_lse, lse, fn, ctx.on_gpu, sm_scale)
        scales = _scales(plan, k_scale, v_scale, fn, ctx.on_gpu)
        split = _split_pair(paged_kv_cache, plan, fn)     # head_dim_vo != head_dim_qk: (k, v) of their own dims
        if not ctx.on_gpu:
            kp, vp = (paged_kv_host(paged_kv_cache, self._kv_layout, fn) if split is None else
                      (paged_kv_host((split[0],) * 2, self._kv_layout, fn)[0],
                       paged_kv_host((split[1],) * 2, self._kv_layout, fn)[0]))
            self._check_cache(kp.shape[0], kp.shape[1], kp.shape[2], kp.shape[3], plan, fn)
            if split is not None:
                self._check_cache(*vp.shape, plan, fn, "v_cache", plan["head_dim_vo"])
            _check_kv_dtype(plan, kp.dtype, vp.dtype, "paged_kv_cache", fn)

            def gather(b):
                kb, vb = reference.gather_paged_kv(kp, vp, plan["kv_indices"], plan["kv_indptr"], plan["last_page_len"], b)
                return _host_kv(kb, plan, scales[0], 1), _host_kv(vb, plan, scales[1], 1)
            return self._reference_run(ctx, plan, q, gather, return_lse, fn, scale, vargs, out, lse)
        self._gpu_plan(ctx, plan, fn)
        qt = self._run_checks(fn, q, plan)
        kv = paged_kv_tensors(paged_kv_cache if split is None else (split[0],) * 2, self._kv_layout, fn)
        self._check_cache(kv.num_pages, kv.page_size, kv.num_kv_heads, kv.head_dim, plan, fn)
        vv = kv if split is None else paged_kv_tensors((split[1],) * 2, self._kv_layout, fn)
        if split is not None:
            self._check_cache(vv.num_pages, vv.page_size, vv.num_kv_heads, vv.head_dim, plan, fn, "v_cache",
                              plan["head_dim_vo"])
            if vv.stride_page * kv.stride_slot != kv.stride_page * vv.stride_slot:
                raise UnsupportedError(f"{fn}: k_cache and v_cache share row offsets (page * page stride / slot "
                                       f"stride + slot): their page / slot stride ratios must be equal, got "
                                       f"{kv.stride_page}/{kv.stride_slot} and {vv.stride_page}/{vv.stride_slot}")
        _check_kv_dtype(plan, kv.k.dtype, vv.v.dtype, "paged_kv_cache", fn)
        out, qk, ot, lse, lse_ptr = self._outputs(ctx, fn, plan, qt, out, lse, return_lse)
        strides = (kv.stride_slot, kv.stride_head, kv.stride_page)
        pdl = jit.pdl_launch(ctx.device, enable_pdl)
        if plan["backend"] == "fa3":        # TMA boxes per page (prefill_sm90.page_box) or the cp.async gather
            with arrays.cupy_module().cuda.Device(ctx.device):
                prefill_sm90.launch(ctx, plan["run_spec"], q=qk, k=kv.k, v=vv.v, k_strides=strides,
                                    v_strides=(vv.stride_slot, vv.stride_head, vv.stride_page),
                                    kv_tokens=kv.num_pages * kv.page_size, out=ot, lse_ptr=lse_ptr,
                                    num_work=plan["grid_work"], num_kv_heads=plan["num_kv_heads"], group=plan["group"],
                                    sm_scale=scale, variant_args=vargs, fn=fn, meta=plan["meta"], pdl=pdl,
                                    paged=(kv.page_size, kv.num_pages, vv.num_pages), scales=scales)
        else:
            if (kv.stride_page % kv.stride_slot or kv.num_pages * (kv.stride_page // kv.stride_slot) >= 2 ** 31
                    or kv.stride_slot * kv.dtype.itemsize >= 2 ** 31):
                raise UnsupportedError(f"{fn}: the paged kernel addresses rows as page * (page stride / slot stride) "
                                       f"+ slot in int32 and the slot stride in bytes in int32; page stride "
                                       f"{kv.stride_page} must be a multiple of slot stride {kv.stride_slot}, "
                                       f"num_pages * ratio < 2**31 and slot stride bytes < 2**31")
            _launch(ctx, plan["spec"], q=qk, k_ptr=kv.k.ptr, v_ptr=vv.v.ptr, out=ot, lse_ptr=lse_ptr,
                    num_work=plan["grid_work"], num_kv_heads=plan["num_kv_heads"], group=plan["group"],
                    k_strides=strides, v_strides=(vv.stride_slot, vv.stride_head, vv.stride_page), sm_scale=scale, variant_args=vargs, meta=plan["meta"],
                    page_size=plan["page_size"], pdl=pdl, scales=scales)
        self._merge(ctx, plan, ot, lse_ptr)
        o = arrays.export(ctx, out, arrays.logical_dtype(qt.dtype))
        return (o, arrays.export(ctx, lse)) if return_lse else o

    forward = run

    def _check_cache(self, num_pages, page_size, heads, head_dim, plan, fn, name="paged_kv_cache", want_dim=None):
        want_dim = plan["head_dim"] if want_dim is None else want_dim
        if page_size != plan["page_size"] or heads != plan["num_kv_heads"] or head_dim != want_dim:
            raise ValueError(f"{fn}: {name} must have page_size={plan['page_size']}, num_kv_heads="
                             f"{plan['num_kv_heads']}, head_dim={want_dim} ({self._kv_layout}), got "
                             f"page_size={page_size}, num_kv_heads={heads}, head_dim={head_dim}")
        if plan["max_page"] >= num_pages:
            raise ValueError(f"{fn}: paged_kv_indices must be < num_pages={num_pages} of the cache, got "
                             f"{plan['max_page']}")


class BatchAttentionWithAttentionSinkWrapper(BatchPrefillWithPagedKVCacheWrapper):
    """Paged attention with a learned sink logit per query head (GPT-OSS), FlashInfer's wrapper of
    the same name: ``plan()`` as ``BatchPrefillWithPagedKVCacheWrapper.plan`` (decode is qo_len 1),
    ``run(q, paged_kv_cache, sink, sm_scale)``. ``sink`` (float32 [num_qo_heads], natural-log units)
    is a key whose value is zero: ``exp(sink)`` joins each row's softmax denominator. Built on the
    built-in sink variant (``variants.SINK``) with ``window_left`` from the constructor.
    """
    _fn = "BatchAttentionWithAttentionSinkWrapper"

    def __init__(self, float_workspace_buffer=None, kv_layout: str = "NHD", use_cuda_graph: bool = False,
                 qo_indptr_buf=None, paged_kv_indptr_buf=None, paged_kv_indices_buf=None,
                 paged_kv_last_page_len_buf=None, custom_mask_buf=None, mask_indptr_buf=None, backend: str = "auto",
                 q_data_type="bfloat16", kv_data_type="bfloat16", head_dim_qk: int = 128, head_dim_vo: int = 128,
                 window_left: int = -1):
        super().__init__(float_workspace_buffer, kv_layout, use_cuda_graph, backend=backend)
        self._sinks = True
        self._defaults = dict(q_data_type=q_data_type, kv_data_type=kv_data_type, window_left=window_left)
        if head_dim_vo != head_dim_qk:
            raise UnsupportedError(f"{self._fn}: head_dim_vo={head_dim_vo} != head_dim_qk={head_dim_qk} has no kernel")

    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads: int,
             num_kv_heads: int, head_dim_qk: int, page_size: int, head_dim_vo: int | None = None, custom_mask=None,
             packed_custom_mask=None, causal: bool = False, pos_encoding_mode: str = "NONE",
             use_fp16_qk_reduction: bool = False, window_left: int | None = None, logits_soft_cap=None,
             sm_scale: float | None = None, rope_scale=None, rope_theta=None, q_data_type=None, kv_data_type=None,
             non_blocking: bool = True, *, variant=None, fixed_split_size: int | None = None,
             disable_split_kv: bool = False) -> None:
        """As ``BatchPrefillWithPagedKVCacheWrapper.plan``; dtypes and window_left default to the constructor's."""
        d = self._defaults
        super().plan(qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads,
                     num_kv_heads, head_dim_qk, page_size, head_dim_vo, custom_mask, packed_custom_mask, causal,
                     pos_encoding_mode, use_fp16_qk_reduction, d["window_left"] if window_left is None else window_left,
                     logits_soft_cap, sm_scale, rope_scale, rope_theta,
                     d["q_data_type"] if q_data_type is None else q_data_type,
                     d["kv_data_type"] if kv_data_type is None else kv_data_type, non_blocking, variant=variant,
                     fixed_split_size=fixed_split_size, disable_split_kv=disable_split_kv)

    def run(self, q, paged_kv_cache, sink, sm_scale: float | None = None, *, out=None, lse=None,
            return_lse: bool = False, enable_pdl=None, stream=None):
        """Attention with sinks; ``sm_scale`` (default: the plan's) scales q . k."""
        return self._run_paged(q, paged_kv_cache, (sink,), out, lse, return_lse, None, None, enable_pdl, stream,
                               sm_scale, f"{self._fn}.run")
