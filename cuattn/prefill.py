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

This module holds the three batch wrappers (their plan() arguments and run() paths) and re-exports the
names below it: their shared machinery (plan halves, kernel launches, run steps) is ``prefill_batch.py``,
the kernel spec and the backend choice ``prefill_spec.py``, the argument checks ``prefill_checks.py``; a batch whose
keys many query tiles read runs on its rows gathered once ahead of the kernel (``prefill_ahead.py``).
"""
from __future__ import annotations

import numpy as np

from . import arrays, jit, plan as _plan, prefill_sm90, reference
from .errors import UnsupportedError
from .page import paged_kv_host, paged_kv_tensors, validate_page_table
from .prefill_batch import _BatchPrefillBase, _launch
from .prefill_checks import _check_kv_dtype, _host_kv, _kv_dims, _scales, _split_pair
# re-exported: cuattn.prefill is the import path of the spec, the backend choice and the launch
# (tests, benchmarks, single.py)
from .prefill_batch import MERGE_PARAMS, META, PARAMS  # noqa: F401
from .prefill_checks import DTYPES, _check_group, _check_q  # noqa: F401
from .prefill_spec import (BACKENDS, HEAD_DIMS, KV_FP8, SPLIT_TILES, PrefillSpec, make_spec,  # noqa: F401
                           resolve_backend, select_backend, shipped_specs, tile_config)


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
        key, ptrs = self._replay_key(plan, (q, k, v), out, lse, return_lse, not args and k_scale is None and v_scale is None,
                               enable_pdl)
        if key is not None:
            hit = self._replay(plan, key, ptrs, out, lse, return_lse, stream, fn)
            if hit is not None:
                return hit
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
            kvp = plan.kv_indptr
            return self._reference_run(ctx, plan, q, lambda b: (_host_kv(ka[kvp[b]:kvp[b + 1]], plan, scales[0], 1),
                                                                _host_kv(va[kvp[b]:kvp[b + 1]], plan, scales[1], 1)),
                                       return_lse, fn, scale, vargs, out, lse)
        self._gpu_plan(ctx, plan, fn)
        qt = self._run_checks(fn, q, plan)
        kt, vt = arrays.device_tensor(k, "k", fn), arrays.device_tensor(v, "v", fn)
        self._check_kv(kt.shape, vt.shape, plan, fn)
        arrays.check_aligned(kt, "k", 16, fn)       # (16-byte copies and TMA boxes)
        arrays.check_aligned(vt, "v", 16, fn)
        _check_kv_dtype(plan, kt.dtype, vt.dtype, "k and v", fn)
        out, qk, ot, lse, lse_ptr = self._outputs(ctx, fn, plan, qt, out, lse, return_lse)
        pdl = jit.pdl_launch(ctx.device, enable_pdl)
        record = [] if key is not None else None
        tok, head = (0, 1) if self._kv_layout == "NHD" else (1, 0)
        k_tok, k_head = tok, head
        if self._rope.active:       # fused RoPE: q and the keys rotated once, contiguous NHD (prefill_rope.py)
            (qk, kt), k_tok, k_head = self._rope.rotate(ctx, plan, qk, kt, tok, head), 0, 1
        v_tok, v_head, caches = tok, head, (kt.ptr, vt.ptr)     # (the caller's K / V: _keep_record)
        if plan.kv_ahead:           # fp8 K / V converted once, contiguous NHD in q's type (prefill_ahead.py)
            with arrays.cupy_module().cuda.Device(ctx.device):
                kt, vt = self._ahead.gather(ctx, plan, kt, vt, (kt.strides[tok], kt.strides[head]),
                                            (vt.strides[tok], vt.strides[head]), None, record, pdl)
            k_tok, k_head, v_tok, v_head = 0, 1, 0, 1
        if plan.backend == "fa3":
            with arrays.cupy_module().cuda.Device(ctx.device):
                prefill_sm90.launch(ctx, plan.run_spec, q=qk, k=kt, v=vt, k_strides=(kt.strides[k_tok], kt.strides[k_head]),
                                    v_strides=(vt.strides[v_tok], vt.strides[v_head]), kv_tokens=kt.shape[k_tok], out=ot,
                                    lse_ptr=lse_ptr, num_work=plan.grid_work, num_kv_heads=plan.num_kv_heads,
                                    group=plan.group, sm_scale=scale, variant_args=vargs, fn=fn, meta=plan.meta,
                                    pdl=pdl, scales=scales, record=record)
        else:
            _launch(ctx, plan.spec, q=qk, k_ptr=kt.ptr, v_ptr=vt.ptr, out=ot, lse_ptr=lse_ptr,
                    num_work=plan.grid_work, num_kv_heads=plan.num_kv_heads, group=plan.group,
                    k_strides=(kt.strides[k_tok], kt.strides[k_head], 0), v_strides=(vt.strides[tok], vt.strides[head], 0),
                    sm_scale=scale, variant_args=vargs, meta=plan.meta, pdl=pdl, scales=scales, record=record)
        self._merge(ctx, plan, ot, lse_ptr, record)
        self._keep_record(plan, key, record, dict(q=qk.ptr, out=ot.ptr, lse=lse_ptr), caches)
        o = arrays.export(ctx, out, arrays.logical_dtype(qt.dtype))
        return (o, arrays.export(ctx, lse)) if return_lse else o

    forward = run

    def _check_kv(self, ks, vs, plan, fn):
        nnz, hkv, d = _kv_dims(ks, self._kv_layout, "k", fn)
        if tuple(vs) != tuple(ks)[:-1] + (plan.head_dim_vo,):
            raise ValueError(f"{fn}: v must have the shape of k {tuple(ks)} with head_dim_vo={plan.head_dim_vo} "
                             f"last, got {tuple(vs)}")
        if hkv != plan.num_kv_heads or d != plan.head_dim or nnz < plan.kv_indptr[-1]:
            raise ValueError(f"{fn}: k must have num_kv_heads={plan.num_kv_heads}, head_dim={plan.head_dim} "
                             f"and >= kv_indptr[-1]={plan.kv_indptr[-1]} tokens, got shape {tuple(ks)} "
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
        key, ptrs = self._replay_key(plan, (q, *paged_kv_cache) if isinstance(paged_kv_cache, (tuple, list)) else
                               (q, paged_kv_cache), out, lse, return_lse,
                               not args and k_scale is None and v_scale is None and sm_scale is None, enable_pdl)
        if key is not None:
            hit = self._replay(plan, key, ptrs, out, lse, return_lse, stream, fn)
            if hit is not None:
                return hit
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
                self._check_cache(*vp.shape, plan, fn, "v_cache", plan.head_dim_vo)
            _check_kv_dtype(plan, kp.dtype, vp.dtype, "paged_kv_cache", fn)

            def gather(b):
                kb, vb = reference.gather_paged_kv(kp, vp, plan.kv_indices, plan.kv_indptr, plan.last_page_len, b)
                return _host_kv(kb, plan, scales[0], 1), _host_kv(vb, plan, scales[1], 1)
            return self._reference_run(ctx, plan, q, gather, return_lse, fn, scale, vargs, out, lse)
        self._gpu_plan(ctx, plan, fn)
        qt = self._run_checks(fn, q, plan)
        kv = paged_kv_tensors(paged_kv_cache if split is None else (split[0],) * 2, self._kv_layout, fn)
        self._check_cache(kv.num_pages, kv.page_size, kv.num_kv_heads, kv.head_dim, plan, fn)
        vv = kv if split is None else paged_kv_tensors((split[1],) * 2, self._kv_layout, fn)
        if split is not None:
            self._check_cache(vv.num_pages, vv.page_size, vv.num_kv_heads, vv.head_dim, plan, fn, "v_cache",
                              plan.head_dim_vo)
            if vv.stride_page * kv.stride_slot != kv.stride_page * vv.stride_slot:
                raise UnsupportedError(f"{fn}: k_cache and v_cache share row offsets (page * page stride / slot "
                                       f"stride + slot): their page / slot stride ratios must be equal, got "
                                       f"{kv.stride_page}/{kv.stride_slot} and {vv.stride_page}/{vv.stride_slot}")
        _check_kv_dtype(plan, kv.k.dtype, vv.v.dtype, "paged_kv_cache", fn)
        for t in (kv.k, vv.v):                        # (16-byte copies and TMA boxes)
            arrays.check_aligned(t, "paged_kv_cache", 16, fn)
        out, qk, ot, lse, lse_ptr = self._outputs(ctx, fn, plan, qt, out, lse, return_lse)
        strides = (kv.stride_slot, kv.stride_head, kv.stride_page)
        pdl = jit.pdl_launch(ctx.device, enable_pdl)
        record = [] if key is not None else None
        if plan.kv_ahead:       # the rows gathered (fp8: converted) once, then the contiguous fa3 kernel (prefill_ahead.py)
            with arrays.cupy_module().cuda.Device(ctx.device):
                kt, vt = self._ahead.gather(ctx, plan, kv.k, vv.v, (kv.stride_page, kv.stride_slot, kv.stride_head),
                                            (vv.stride_page, vv.stride_slot, vv.stride_head), kv.page_size, record, pdl)
                prefill_sm90.launch(ctx, plan.run_spec, q=qk, k=kt, v=vt, k_strides=kt.strides[:2],
                                    v_strides=vt.strides[:2], kv_tokens=kt.shape[0], out=ot, lse_ptr=lse_ptr,
                                    num_work=plan.grid_work, num_kv_heads=plan.num_kv_heads, group=plan.group,
                                    sm_scale=scale, variant_args=vargs, fn=fn, meta=plan.meta, pdl=pdl,
                                    scales=scales, record=record)
        elif plan.backend == "fa3":        # TMA boxes per page (prefill_sm90.page_box) or the cp.async gather
            with arrays.cupy_module().cuda.Device(ctx.device):
                prefill_sm90.launch(ctx, plan.run_spec, q=qk, k=kv.k, v=vv.v, k_strides=strides,
                                    v_strides=(vv.stride_slot, vv.stride_head, vv.stride_page),
                                    kv_tokens=kv.num_pages * kv.page_size, out=ot, lse_ptr=lse_ptr,
                                    num_work=plan.grid_work, num_kv_heads=plan.num_kv_heads, group=plan.group,
                                    sm_scale=scale, variant_args=vargs, fn=fn, meta=plan.meta, pdl=pdl,
                                    paged=(kv.page_size, kv.num_pages, vv.num_pages), scales=scales, record=record)
        else:
            if (kv.stride_page % kv.stride_slot or kv.num_pages * (kv.stride_page // kv.stride_slot) >= 2 ** 31
                    or kv.stride_slot * kv.dtype.itemsize >= 2 ** 31):
                raise UnsupportedError(f"{fn}: the paged kernel addresses rows as page * (page stride / slot stride) "
                                       f"+ slot in int32 and the slot stride in bytes in int32; page stride "
                                       f"{kv.stride_page} must be a multiple of slot stride {kv.stride_slot}, "
                                       f"num_pages * ratio < 2**31 and slot stride bytes < 2**31")
            _launch(ctx, plan.spec, q=qk, k_ptr=kv.k.ptr, v_ptr=vv.v.ptr, out=ot, lse_ptr=lse_ptr,
                    num_work=plan.grid_work, num_kv_heads=plan.num_kv_heads, group=plan.group,
                    k_strides=strides, v_strides=(vv.stride_slot, vv.stride_head, vv.stride_page), sm_scale=scale, variant_args=vargs, meta=plan.meta,
                    page_size=plan.page_size, pdl=pdl, scales=scales, record=record)
        self._merge(ctx, plan, ot, lse_ptr, record)
        self._keep_record(plan, key, record, dict(q=qk.ptr, out=ot.ptr, lse=lse_ptr), (kv.k.ptr, vv.v.ptr))
        o = arrays.export(ctx, out, arrays.logical_dtype(qt.dtype))
        return (o, arrays.export(ctx, lse)) if return_lse else o

    forward = run

    def _check_cache(self, num_pages, page_size, heads, head_dim, plan, fn, name="paged_kv_cache", want_dim=None):
        want_dim = plan.head_dim if want_dim is None else want_dim
        if page_size != plan.page_size or heads != plan.num_kv_heads or head_dim != want_dim:
            raise ValueError(f"{fn}: {name} must have page_size={plan.page_size}, num_kv_heads="
                             f"{plan.num_kv_heads}, head_dim={want_dim} ({self._kv_layout}), got "
                             f"page_size={page_size}, num_kv_heads={heads}, head_dim={head_dim}")
        if plan.max_page >= num_pages:
            raise ValueError(f"{fn}: paged_kv_indices must be < num_pages={num_pages} of the cache, got "
                             f"{plan.max_page}")


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
