"""Decode attention: one new query token per request over its KV (paged or contiguous).

GPU path: ``kernels_cu/decode.cu`` (tensor-core decode, query heads of a GQA group as the mma M
dimension, K/V read once per group; on sm_90 K/V arrive by TMA wherever page_size % 16 == 0, else
by cp.async) plus a merge kernel for split-KV. ``plan()`` builds the work
list on the host once per step; ``run()`` only launches. NumPy inputs run ``reference.py``.

LSE (``return_lse=True``) is in natural-log units (base e): ``lse = log(sum_j exp(s_j))``.
FlashInfer returns base 2; multiply cuattn's LSE by ``1 / ln 2`` to compare.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from . import arrays, fp8, jit, plan as _plan, plan_buffers as _buffers, qcast, reference, support, variants
from .errors import UnsupportedError
from .page import check_kv_layout, paged_kv_host, paged_kv_tensors, validate_page_table
from .decode_kernel import (  # noqa: F401  (re-exported: decode.DecodeSpec, decode.shipped_specs, decode.PARAMS, ...)
    _ENTRY, _MERGE_ENTRY, _THREADS, _TMA_ARCH, _TMA_ALIGN, DecodeSpec, F32_WARPS, shipped_specs, _make_spec, _num_sms,
    PARAMS, MERGE_PARAMS, _launchers, _paged_tensor_maps, _m_tiles, _page_shift, _short)

# Benchmark/test overrides (BatchDecodeWithPagedKVCacheWrapper._tuning), not API; 0: plan() chooses.
#   num_stages: cp.async depth (DecodeSpec.num_stages); num_warps: 4 | 8 warps per CTA;
#   fuse_merge: False launches the separate merge kernel for split requests;
#   l2_prefetch: the cp.async L2 prefetch hint (DecodeSpec.l2_prefetch);
#   tma: True / False forces the TMA kernel on or off (None: wherever it has a kernel).
_TUNING_DEFAULTS = {"num_stages": 0, "num_warps": 0, "fuse_merge": True, "l2_prefetch": 128, "tma": None}

SHORT_STAGES_MAX = 512   # keys: batches of requests no longer than this take 2 stages (plan(), below)

_ALIGN = {"q": 16, "out": 8, "lse": 4}      # bytes the kernels move at a time through run()'s arrays


class BatchDecodeWithPagedKVCacheWrapper:
    """Batch decode over a paged KV cache (FlashInfer's API): ``plan()`` once per step, ``run()``
    per layer.

    Parameters
    ----------
    workspace_buffer : array, optional
        GPU scratch for split-KV partial outputs (any framework, any dtype; FlashInfer's 128 MB
        torch uint8 buffer works). cuattn allocates its own when omitted.
    kv_layout : "NHD" or "HND"
    use_cuda_graph : bool
        Device buffers keep fixed addresses after the first ``plan()`` and the grid is sized for
        their capacity, so ``run()`` can be captured once and replayed after later plans.
    """

    def __init__(self, workspace_buffer: Any = None, kv_layout: str = "NHD", use_cuda_graph: bool = False,
                 use_tensor_cores: bool = False, paged_kv_indptr_buffer: Any = None,
                 paged_kv_indices_buffer: Any = None, paged_kv_last_page_len_buffer: Any = None,
                 backend: str = "auto", jit_args: Any = None):
        fn = "BatchDecodeWithPagedKVCacheWrapper"
        self._kv_layout = check_kv_layout(kv_layout, fn)
        self._use_cuda_graph = bool(use_cuda_graph)
        self._workspace, self._device = _buffers.workspace_of(workspace_buffer, "workspace_buffer", fn)
        self._bufs: _buffers.DeviceBuffers | None = None
        self._plan: _plan.Plan | None = None     # the last plan()'s
        self._graph_warps = 0      # use_cuda_graph: the warps per CTA of the first plan (captured kernel)
        self._graph_stages = -1    # use_cuda_graph: the first plan's stage count (-1: no plan yet; 0: the default)
        # Benchmark/test overrides, not API (benchmarks/bench_decode.py --variants, tests/test_decode.py):
        # keys of _TUNING_DEFAULTS; read only through _tuned().
        self._tuning: dict[str, Any] = {}
        self._kv_memo: dict[tuple, tuple] = {}     # run()'s cache descriptions (_kv_view)
        self._checked: dict[tuple, tuple] = {}     # layouts of q, out, lse that passed this plan (_operand)
        self._configs: dict[tuple, tuple] = {}     # plan()'s checked configurations (plan.config_key)
        self._launch_memo = None                   # (key, launch state) of the last plan (_build_launchers)
        self._f32q = qcast.F32Q("BatchDecodeWithPagedKVCacheWrapper", use_cuda_graph)   # an fp32 q's copies
        # use_tensor_cores / backend: the one kernel already uses tensor cores for every group size.

    # the last plan's work list and the kernel spec it runs (tests, benchmarks)
    _work = property(lambda self: None if self._plan is None else self._plan.work_list)
    _spec = property(lambda self: None if self._plan is None else self._plan.run_spec)

    # ------------------------------------------------------------------ plan

    def plan(self, indptr, indices, last_page_len, num_qo_heads: int, num_kv_heads: int, head_dim: int,
             page_size: int, pos_encoding_mode: str = "NONE", window_left: int = -1,
             logits_soft_cap: float | None = None, q_data_type: Any = "float16", kv_data_type: Any = None,
             data_type: Any = None, sm_scale: float | None = None, rope_scale: float | None = None,
             rope_theta: float | None = None, non_blocking: bool = True, *, fixed_split_size: int | None = None,
             disable_split_kv: bool = False, check_page_indices: bool = False, variant=None,
             rotary_dim: int | None = None) -> None:
        """Build the work list for one decode step (reused by every layer's ``run()``).

        The work list goes to the GPU asynchronously on the current stream of the caller's
        framework (that of ``indices``; CuPy's for NumPy input), as FlashInfer's does: runs on
        another stream must not overlap this plan() (or still run the previous plan).

        Parameters
        ----------
        indptr : int array, shape (batch + 1,)
            Host (NumPy) arrays avoid a device sync; GPU arrays are copied to the host once.
        indices : int32 array, shape (indptr[-1],)
            Page ids. A GPU array is used in place (not copied, not range-checked unless
            ``check_page_indices=True``, which syncs); a host array is uploaded and checked
            against the cache's num_pages at ``run()``.
        last_page_len : int array, shape (batch,), values in 1..page_size
        num_qo_heads, num_kv_heads : int, num_qo_heads % num_kv_heads == 0
        head_dim : int (GPU: 64, 128, 256)
        page_size : int >= 1
        q_data_type, kv_data_type : dtype (NumPy, string or torch); kv defaults to q's.
            kv: float16, bfloat16, float32, float8_e4m3fn or float8_e5m2 (a uint8 cache is read as the fp8
            type named here). With fp8 the tensor cores run f16: a bfloat16 q is converted to f16
            (exact for |q| in [2^-14, 65504]). q: float16, bfloat16 or float32 (the 16-bit kernel of
            ``qcast.kernel_dtype`` runs a float32 q: converted, saturating, at run(); out float32).
        sm_scale : float, optional, default ``1 / sqrt(head_dim)``
        fixed_split_size : int, optional
            Cut every request into pieces of this many tokens (split-KV), instead of the
            heuristic. ``disable_split_kv=True`` never splits.
        window_left, logits_soft_cap, pos_encoding_mode ("NONE" | "ALIBI"), variant :
            attention variants (``cuattn.variants``); a variant's parameters not fixed here are
            passed to ``run()`` positionally after the cache.
        """
        fn = "BatchDecodeWithPagedKVCacheWrapper.plan"
        # -- a configuration (all but the page table) checked before for these arguments: its results
        key = _plan.config_key(num_qo_heads, num_kv_heads, head_dim, page_size, pos_encoding_mode, window_left,
                               logits_soft_cap, q_data_type, kv_data_type, data_type, sm_scale, rope_scale,
                               rope_theta, variant, rotary_dim, self._tuned("num_stages"), self._tuned("l2_prefetch"))
        config = self._configs.get(key) if key is not None else None
        if config is None:
            options = dict(pos_encoding_mode=pos_encoding_mode, window_left=window_left,
                           logits_soft_cap=logits_soft_cap, rope_scale=rope_scale, rope_theta=rope_theta,
                           variant=variant, rotary_dim=rotary_dim)
            bound = variants.resolve(fn, num_qo_heads=num_qo_heads, head_dim=head_dim, **options)
        else:
            options, bound, q_dtype, kv_dtype, spec = config
        _plan.check_fixed_split(fn, fixed_split_size)
        if config is None:
            for name, val in (("num_qo_heads", num_qo_heads), ("num_kv_heads", num_kv_heads),
                              ("head_dim", head_dim), ("page_size", page_size)):
                if not isinstance(val, (int, np.integer)) or val < 1:
                    raise ValueError(f"{fn}: {name} must be a positive int, got {val!r}")
            if num_qo_heads % num_kv_heads:
                raise ValueError(f"{fn}: num_qo_heads must be a multiple of num_kv_heads, got "
                                 f"num_qo_heads={num_qo_heads}, num_kv_heads={num_kv_heads}")
            if data_type is not None and q_data_type == "float16":
                q_data_type = data_type
            q_dtype = arrays.as_dtype(q_data_type, "q_data_type", fn)
            kv_dtype = arrays.as_dtype(kv_data_type if kv_data_type is not None else q_dtype, "kv_data_type", fn)

        indptr_h = _plan.host_ints(indptr, "indptr", fn)
        lpl_h = _plan.host_ints(last_page_len, "last_page_len", fn)
        indices_dev = arrays.is_device_array(indices)
        if not indices_dev:
            indices_h = _plan.host_ints(indices, "indices", fn)
            num_indices = len(indices_h)
        else:
            idx_t = arrays.device_tensor(indices, "indices", fn)
            if idx_t.ndim != 1 or idx_t.dtype != np.int32:
                raise ValueError(f"{fn}: indices must be a 1-D int32 array, got shape {idx_t.shape} "
                                 f"dtype {idx_t.dtype}")
            num_indices = idx_t.shape[0]
            indices_h = None
        kv_lens = validate_page_table(fn, indptr_h, lpl_h, int(page_size), num_indices)
        if config is None:
            support.check("decode", fn, head_dim=head_dim, q_dtype=q_dtype, kv_dtype=kv_dtype)   # every path
            if (fp8.is_fp8(kv_dtype) or kv_dtype == np.float32) and bound.composite.has_qk_transform:
                raise UnsupportedError(f"{fn}: pos_encoding_mode='ROPE_LLAMA' (fused RoPE) and a variant's query / "
                                       f"key transform need a 16-bit KV cache, got kv_data_type={kv_dtype}")
            spec = _make_spec(int(head_dim), _short(qcast.kernel_dtype(q_dtype, kv_dtype)), _short(kv_dtype),
                              self._tuned("num_stages"), 4, self._tuned("l2_prefetch"), False, bound.composite)
            if key is not None:
                _plan.memo_put(self._configs, key, (options, bound, q_dtype, kv_dtype, spec))
        self._options = options
        max_index = _plan.max_index(indices_h) if indices_h is not None else -1
        if max_index is None:
            raise ValueError(f"{fn}: indices must be >= 0, got min {int(indices_h.min())}")
        if indices_dev and check_page_indices and num_indices:
            import cupy
            raw = cupy.asarray(idx_t.obj) if idx_t.framework == "cupy" else cupy.from_dlpack(indices)
            lo, hi = int(raw.min()), int(raw.max())   # syncs: opt-in
            if lo < 0:
                raise ValueError(f"{fn}: indices must be >= 0, got min {lo}")
            max_index = hi

        self._checked.clear()      # run()'s checks of q, out and lse depend on the plan
        p = _plan.Plan("BatchDecodeWithPagedKVCacheWrapper", len(kv_lens), int(num_qo_heads), int(num_kv_heads),
                       int(head_dim), q_dtype, kv_dtype, float(sm_scale) if sm_scale is not None else
                       1.0 / math.sqrt(head_dim), bound, page_size=int(page_size), spec=spec, run_spec=spec,
                       kv_lens=kv_lens, kv_indptr=indptr_h, kv_indices=indices_h, kv_indices_src=indices,
                       last_page_len=lpl_h, max_page=max_index)
        self._variants: dict[bool, tuple] = {}     # run()'s (launcher, bound) with / without sinks=
        self._plan = p

        device = self._device
        if device is None and indices_dev:
            device = idx_t.device
        if device is None and arrays.gpu_available():
            device = arrays.cupy_module().cuda.runtime.getDevice()
        self._device = p.device = device
        self._f32q.plan(p)       # fp32 q: the 16-bit copies of q and out (qcast.py)
        if device is None:       # CPU-only plan
            return

        heads_work = p.num_kv_heads * _m_tiles(p.group)
        # -- the lengths' maximum and sum, read once (the warps, the split choice, the work list's order); not their
        #    minimum (a reduction): the lengths (>= 0) are all equal iff max * batch == sum, all the order needs
        hi, tokens = _plan.int_top(kv_lens) if p.batch else (0, 0)
        bounds = (hi if hi * p.batch == tokens else 0, hi) if p.batch else None
        # -- 8 warps x 3 stages (one 217 KB CTA per SM) when the batch gives at most one CTA per
        #    SM (hd128; H200 2026-11-22: bs1x32k 55.5 -> 53.3 us, bs16x2048 51.9 -> 49.9, bs16x32k
        #    548 -> 541), else 4 warps x 3 stages, two CTAs per SM (8 warps: bs64x512 51.6 -> 58.9),
        #    except for many waves of long requests, where 8 warps win again (H100, same run:
        #    bs256x8192 2984 -> 2897 us, bs256x32k 12014 -> 11662; bs64x32k 2901 -> 2938, so >= 8 waves).
        #    A batch of <= 2048 tokens in all takes 4 warps too: its few short pieces start and merge
        #    sooner in smaller CTAs (H100, TMA kernel, same run: bs1x512 10.4 -> 9.5 us, bs1x2048
        #    13.3 -> 12.4; 32:32 bs1x512 12.4 -> 11.5; bs1x8192 prefers 8 warps, H200 18.3 vs 20.8).
        #    With use_cuda_graph the choice of the first plan is kept (the captured kernel).
        warps = self._tuned("num_warps")
        if not warps and p.run_spec.dtype_kv == "f32":
            warps = F32_WARPS[p.run_spec.head_dim]
        if not warps:
            warps = self._graph_warps if self._use_cuda_graph else 0
            if not warps and (fixed_split_size is not None or disable_split_kv):
                warps = 4     # batch invariance: the same kernel whatever the batch (8 warps split a tile otherwise)
            if not warps:
                ctas, sms = p.batch * heads_work, _num_sms(device)
                long_waves = ctas >= 8 * sms and tokens >= 2048 * p.batch
                # fp8 K/V: 8 warps for requests of >= 2048 tokens on average (H100, one run, bs64x8192
                # 32:8 e4m3, TMA: 4 warps x 5 stages 393.0 us, 8 warps 387.5; fp16 705.3)
                long_waves = long_waves or (p.run_spec.kv_bytes == 1 and tokens >= 2048 * p.batch)
                few_tokens = tokens <= 2048
                warps = (8 if p.run_spec.head_dim == 128 and not p.run_spec.num_stages
                         and ((ctas <= sms and not few_tokens) or long_waves) else 4)
            if self._use_cuda_graph:
                self._graph_warps = warps
        # -- TMA loads on Hopper wherever pages hold whole 16-slot boxes (pieces are cut to match)
        tma = self._tuned("tma")
        if tma is None:
            tma = jit.device_arch(device) == _TMA_ARCH and p.page_size % _TMA_ALIGN == 0 and p.run_spec.kv_bytes != 4
        elif tma and (jit.device_arch(device) != _TMA_ARCH or p.page_size % _TMA_ALIGN or p.run_spec.kv_bytes == 4):
            raise UnsupportedError(f"{fn}: the TMA decode kernel needs an sm_90 GPU, page_size % {_TMA_ALIGN} "
                                   f"== 0 and a 16-bit or fp8 cache, got {jit.device_arch(device)}, page_size="
                                   f"{p.page_size} and kv_data_type={p.kv_dtype}")
        # -- short requests only (<= SHORT_STAGES_MAX keys each), at least 3 CTAs per SM of them: 2 stages, so 3 CTAs
        #    share an SM instead of 2 (the TMA kernel, 4 warps, hd128, 16-bit K/V; H100, one process: bs128x256 52.9 ->
        #    51.6 us, bs256x256 98.5 -> 96.8, bs64x512 52.3 -> 50.9, bs256x512 185.9 -> 184.9, but bs128x1024 185.7 ->
        #    187.5; benchmarks/results/decode_notes.md, session 19). Not with fixed_split_size / disable_split_kv (one
        #    kernel whatever the batch); graph mode keeps the first plan's choice.
        stages = p.run_spec.num_stages
        if self._use_cuda_graph and self._graph_stages >= 0:
            stages = self._graph_stages
        elif (not stages and tma and warps == 4 and p.run_spec.head_dim == 128 and p.run_spec.kv_bytes == 2
              and fixed_split_size is None and not disable_split_kv and 0 < hi <= SHORT_STAGES_MAX
              and p.batch * heads_work >= 3 * _num_sms(device)):
            stages = 2
        if self._use_cuda_graph:
            self._graph_stages = stages
        if warps != p.run_spec.num_warps or tma or stages != p.run_spec.num_stages:
            s = p.run_spec
            p.run_spec = _make_spec(s.head_dim, s.dtype_q, s.dtype_kv, stages, warps, s.l2_prefetch, tma, s.variant)
        if disable_split_kv or not bound.composite.use_softmax:    # weights without softmax: never split
            chunk, why = 0, "disable_split_kv" if disable_split_kv else "the variant has no softmax to merge"
        elif fixed_split_size is not None:
            chunk, why = int(fixed_split_size), f"fixed_split_size={int(fixed_split_size)}"
        else:
            cps = p.run_spec.ctas_per_sm
            chunk = _plan.choose_chunk(kv_lens, heads_work, _num_sms(device), cps, p.run_spec.block_n,
                                       max_len=bounds and bounds[1], total=tokens)
            why = _plan.split_reason(p.batch * heads_work, _num_sms(device) * cps, chunk)
        p.split_why = why
        wl = _plan.decode_work_list(indptr_h, kv_lens, chunk, p.run_spec.block_n, _TMA_ALIGN if tma else 1, bounds)
        if len(wl.work) > 65535:
            raise UnsupportedError(f"{fn}: {len(wl.work)} work items exceed the grid limit 65535; "
                                   f"pass a larger fixed_split_size")
        p.work_list = wl
        self._upload(p, wl, indices_h, indices_dev, idx_t if indices_dev else None, fn)

    def _upload(self, p: _plan.Plan, wl, indices_h, indices_dev, idx_t, fn):
        cp = arrays.cupy_module()
        if self._bufs is None:
            self._bufs = _buffers.DeviceBuffers(self._device, self._use_cuda_graph)
        bufs = self._bufs
        n_work, n_merge = len(wl.work), len(wl.merge)
        if self._use_cuda_graph:
            # capacity fixed at the first plan (with headroom): the captured grid covers it
            if bufs.plan is None:
                self._cap_work = max(2 * n_work, 1024)
                self._cap_merge = max(2 * n_merge, 256)
            n_work_c, n_merge_c = self._cap_work, self._cap_merge
            if n_work > n_work_c or n_merge > n_merge_c:
                raise ValueError(f"{fn}: the work list ({n_work} items) must fit the capacity fixed by the "
                                 f"first plan with use_cuda_graph=True ({n_work_c}); make a new wrapper")
        else:
            n_work_c, n_merge_c = n_work, n_merge
        # -- one int32 buffer, one synchronous copy from pinned memory: work rows, merge rows, one
        #    zeroed counter per (merge row, grid x) for the kernel's fused merge (the merging CTA
        #    resets its counter, so replays find zeros), then the page ids when they are uploaded
        #    (host indices, or any indices with use_cuda_graph: fixed addresses)
        n_ctr = n_merge_c * p.num_kv_heads * _m_tiles(p.group)
        n_len = n_work_c if self._use_cuda_graph else p.batch     # every request's kv_len (variants)
        if n_len < p.batch:
            raise ValueError(f"{fn}: the batch ({p.batch} requests) must fit the capacity fixed by the first "
                             f"plan with use_cuda_graph=True ({n_len}); make a new wrapper")
        head = n_work_c * 8 + n_merge_c * 4 + n_ctr + n_len
        n_idx = idx_t.shape[0] if indices_dev else len(indices_h)
        upload_idx = not indices_dev or self._use_cuda_graph
        if self._use_cuda_graph:
            if bufs.plan is None:
                self._cap_idx = max(n_idx, 1)
            if n_idx > self._cap_idx:
                raise ValueError(f"{fn}: indices must fit the buffers captured with use_cuda_graph=True "
                                 f"({self._cap_idx} elements), got {n_idx}; plan the largest batch first "
                                 f"or make a new wrapper")
            idx_cap = self._cap_idx
        else:
            idx_cap = n_idx if upload_idx else 0
        n_host = head + (n_idx if not indices_dev else 0)
        host = bufs.staging(n_host)
        # -- every word written once: the rows, then -1 only past them (graph mode's padding)
        w_end, m_off = n_work * 8, n_work_c * 8
        host[:w_end] = wl.work.reshape(-1)
        if m_off > w_end:
            host[w_end:m_off] = -1
        m_end, c_off = m_off + n_merge * 4, m_off + n_merge_c * 4
        if n_merge:
            host[m_off:m_end] = wl.merge.reshape(-1)
        if c_off > m_end:
            host[m_end:c_off] = -1
        l_off = head - n_len
        if l_off > c_off:
            host[c_off:l_off] = 0
        host[l_off:l_off + p.batch] = wl.kv_lens
        if n_len > p.batch:
            host[l_off + p.batch:head] = -1
        if not indices_dev:
            host[head:n_host] = indices_h
        # -- no Device context unless a buffer grows (_ensure enters its own to allocate): the copies and the
        #    event record work from any current device (the event and the stream are both the plan's device)
        plan_dev = bufs.plan
        if plan_dev is None or plan_dev.size < head + idx_cap:
            plan_dev = bufs._ensure("plan", head + idx_cap, np.int32, "the work list and indices")
        # asynchronous on the caller's current stream: ordered after the runs of the previous
        # plan queued there and before the runs of this one
        stream = arrays.resolve_stream(arrays.framework_of(p.kv_indices_src), self._device)
        base = plan_dev.data.ptr
        bufs.upload(base, host, n_host, stream)
        p.grid_work, p.grid_merge = n_work_c, n_merge_c
        merge_ptr = base + n_work_c * 8 * 4
        meta = {"work": base, "merge": merge_ptr, "counters": merge_ptr + n_merge_c * 4 * 4,
                "req_kv_len": base + l_off * 4}
        has_merge = n_merge > 0 or (self._use_cuda_graph and n_merge_c > 0)
        # host page ids arrive by memcpy, which no kernel overlaps: the kernel may read them
        # before its PDL wait; device ones (even when copied here) may come from the kernel before
        ids_in_plan = int(not indices_dev)
        if upload_idx:
            meta["kv_indices"] = base + head * 4
            if indices_dev and n_idx:     # device to device, on the same stream as the upload
                cp.cuda.runtime.memcpyAsync(meta["kv_indices"], idx_t.ptr, n_idx * 4,
                                            cp.cuda.runtime.memcpyDeviceToDevice, stream.ptr)
        else:
            meta["kv_indices"] = idx_t.ptr
            p.keep = idx_t.obj
        # -- partial outputs for split requests: fp32 rows + LSE
        slots = max(wl.num_slots, 1)
        if self._use_cuda_graph:
            slots = max(slots, self._cap_work)
        need = slots * p.num_qo_heads * (p.head_dim + 1)
        if self._workspace is not None:
            ptr, nbytes, _ = self._workspace
            if need * 4 > nbytes:
                raise ValueError(f"{fn}: workspace_buffer must hold at least {need * 4} bytes for this "
                                 f"plan, got {nbytes}")
        else:
            part = bufs.partial
            ptr = (part if part is not None and part.size >= need else
                   bufs._ensure("partial", need, np.float32, "the split-KV workspace")).data.ptr
        meta["part_o"] = ptr
        meta["part_lse"] = ptr + slots * p.num_qo_heads * p.head_dim * 4
        p.meta = meta
        self._build_launchers(p, has_merge, ids_in_plan)

    def _build_launchers(self, p: _plan.Plan, has_merge: bool, ids_in_plan: int):
        """The plan's launch state: launchers, grids, packed kernel arguments (run() adds the call's)."""
        # split requests are merged inside the decode kernel (last piece to finish) unless the
        # fuse_merge override (benchmarks / tests only) asks for the separate merge kernel
        fuse = self._tuned("fuse_merge")
        # -- the same kernel, pointers and grids as the last plan: its launch state (packing costs ~10 µs)
        key = (p.run_spec, tuple(p.meta.values()), p.page_size, p.num_qo_heads, p.num_kv_heads, p.sm_scale,
               p.kv_dtype, p.bound, p.grid_work, p.grid_merge, has_merge, ids_in_plan, fuse, self._device)
        last = self._launch_memo
        if last is not None and last[0] == key:
            p.launchers, p.kernel_args, p.fixed_vargs, p.grid, p.merge_grid = last[1]
            return
        attention, merge = _launchers(p.run_spec, self._device)
        # what run()'s checks of a cache compare with (_kv_view)
        self._kv_geometry = (p.run_spec.tma, p.page_size, p.num_kv_heads, p.head_dim, p.kv_dtype,
                             self._device)
        p.grid = (p.num_kv_heads * _m_tiles(p.group), p.grid_work)
        p.kernel_args = PARAMS[p.run_spec.tma].group(
            "work", "req_kv_len", work=p.meta["work"], kv_indices=p.meta["kv_indices"], part_o=p.meta["part_o"],
            part_lse=p.meta["part_lse"], page_size=p.page_size, page_shift=_page_shift(p.page_size),
            num_qo_heads=p.num_qo_heads, group=p.group, m_tiles=_m_tiles(p.group),
            scale_log2=p.run_spec.variant.scale_log2(p.sm_scale), counters=p.meta["counters"] if fuse else 0,
            ids_in_plan=ids_in_plan, req_kv_len=p.meta["req_kv_len"])
        p.launchers = (attention, merge if has_merge and not fuse else None)
        p.fixed_vargs = p.bound.kernel_args(p.sm_scale, p.bound.fixed, "plan") \
            if not p.bound.runtime else None
        p.merge_grid = (p.grid_merge, -(-p.num_qo_heads // (_THREADS // (p.run_spec.head_dim // 4))))
        self._launch_memo = (key, (p.launchers, p.kernel_args, p.fixed_vargs, p.grid, p.merge_grid))

    def _tuned(self, key: str):
        """The override in ``self._tuning`` for ``key``, else its default (plan()'s own choice)."""
        unknown = self._tuning and set(self._tuning) - set(_TUNING_DEFAULTS)
        if unknown:
            raise KeyError(f"unknown decode tuning override(s) {sorted(unknown)}; "
                           f"known: {sorted(_TUNING_DEFAULTS)}")
        return self._tuning.get(key, _TUNING_DEFAULTS[key])

    def describe(self) -> str:
        """What the last plan() runs: the kernel specialization, its work items and split decision, and why."""
        fn = "BatchDecodeWithPagedKVCacheWrapper"
        p = self._plan
        if p is None:
            return f"{fn}: not planned"
        lines = [f"{fn}: batch {p.batch}, {p.num_qo_heads}:{p.num_kv_heads} heads, head_dim "
                 f"{p.head_dim}, page_size {p.page_size}, {int(p.kv_indptr[-1])} pages"]
        if p.work_list is None:
            return "\n".join(lines + ["NumPy reference path (no GPU at plan time)"])
        wl, spec, heads = p.work_list, p.run_spec, p.num_kv_heads * _m_tiles(p.group)
        lines.append(f"kernel: {spec.name} ({spec.num_warps} warps, {'TMA' if spec.tma else 'cp.async'} K/V loads, "
                     f"{spec.ctas_per_sm} CTAs/SM, {spec.block_n} keys per stage)")
        lines.append(f"work: {len(wl.work)} items x {heads} (kv head, 16-head tile) = {len(wl.work) * heads} CTAs on "
                     f"{_num_sms(self._device)} SMs" + (f"; grid padded to {p.grid_work} items (CUDA graph)"
                                                        if self._use_cuda_graph else ""))
        if wl.split:
            fused = "in the kernel (last piece)" if self._tuned("fuse_merge") else "by a merge kernel"
            lines.append(f"split-KV: {len(wl.merge)} of {p.batch} requests cut into pieces of <= {wl.chunk} keys, "
                         f"{wl.num_slots} partial rows, merged {fused}; {p.split_why}")
        else:
            lines.append(f"split-KV: none; {p.split_why}")
        lens = (wl.work[:, 3] - wl.work[:, 2]).astype(np.int64)
        tiles = -(-lens // spec.block_n) if len(lens) else np.zeros(1)
        lines.append(f"balance: {float(tiles.mean() / max(tiles.max(), 1)):.2f} (mean / max key tiles per work item)")
        return "\n".join(lines)

    # ------------------------------------------------------------------ run

    def run(self, q, paged_kv_cache, *args, out=None, lse=None, return_lse: bool = False,
            k_scale: float | None = None, v_scale: float | None = None, enable_pdl: bool | None = None,
            sinks=None, q_rope_offset=None, stream: Any = None):
        """Decode attention for the planned batch.

        Parameters
        ----------
        q : array, shape (batch, num_qo_heads, head_dim), dtype q_data_type
        paged_kv_cache : array [num_pages, 2, page_size, num_kv_heads, head_dim] (NHD) or
            [num_pages, 2, num_kv_heads, page_size, head_dim] (HND), or a (k_cache, v_cache) pair
            of [num_pages, page_size, num_kv_heads, head_dim] / [num_pages, num_kv_heads, page_size,
            head_dim]; dtype kv_data_type.
        out : array, optional, shape of q, dtype of q: written in place (no allocation).
        args : the plan's variant parameters not fixed by plan(), in order (``cuattn.variants``).
        k_scale, v_scale : float, or float32 array of shape (1,) or (num_kv_heads,), optional
            Stored value x scale = real value (FlashInfer's meaning; any KV dtype). A CUDA array is
            read by the kernel (no sync; its values are not checked); host values must be positive
            and finite (ValueError).
        lse : float32 array, optional, shape (batch, num_qo_heads): written in place.
        return_lse : bool
            Also return the LSE, float32 [batch, num_qo_heads], natural log (base e).
        enable_pdl : bool, optional
            Programmatic Dependent Launch: the kernel may start while the previous kernel in the
            stream finishes (it reads its work list and page ids, then waits for that kernel
            before touching q, the cache or the outputs), hiding its launch and start-up. None (the
            default, as in FlashInfer): on wherever the GPU has it (sm_90+); ignored below sm_90.
        q_rope_offset : int32 array, shape (batch,), optional
            With pos_encoding_mode="ROPE_LLAMA": each request's query position (default kv_len - 1).
        sinks : float32 array, shape (num_qo_heads,), optional
            Attention sinks (GPT-OSS): a learned logit per query head, natural-log units, whose
            ``exp`` joins the softmax denominator (a key with value zero).

        Returns
        -------
        out, or (out, lse) with ``return_lse``; in q's framework.
        """
        fn = "BatchDecodeWithPagedKVCacheWrapper.run"
        p = self._plan
        if p is None:
            raise ValueError(f"{fn}: plan() must be called before run()")
        arrays.writable(out, "out", fn)
        arrays.writable(lse, "lse", fn)
        launcher, bound = self._variant_state(sinks is not None, fn)
        bound.check_lse(return_lse, lse, fn)
        # -- the plan's own variant arguments unless this call adds some (the serving loop's case:
        #    no per-call dict or checks on top of the launch)
        plain = not args and sinks is None and q_rope_offset is None and not bound.runtime
        if not plain:
            values = self._variant_values(bound, args, sinks, q_rope_offset, fn)
        on_gpu = arrays.is_device_array(q, "q", fn)
        if k_scale is None and v_scale is None:
            scales = _NO_SCALES
        else:
            ks = fp8.parse_scale(k_scale, "k_scale", p.num_kv_heads, fn, on_gpu=on_gpu)
            vs = fp8.parse_scale(v_scale, "v_scale", p.num_kv_heads, fn, on_gpu=on_gpu)
            scales = (ks, vs)
        if not on_gpu:
            values = bound.values((), fn) if plain else values
            return self._run_host(q, paged_kv_cache, out, lse, return_lse, fn, bound, bound.host_values(values, fn),
                                  scales)
        q_ptr, q_strides, framework = self._operand(q, "q", fn)
        num_pages, cache_args = self._kv_view(paged_kv_cache, fn)
        if p.max_page >= num_pages:
            raise ValueError(f"{fn}: indices must be in 0..{num_pages - 1} (num_pages of the cache), "
                             f"got max {p.max_page}")
        ctx = arrays.Context(framework, self._device, arrays.resolve_stream(framework, self._device, stream))
        _buffers.refuse_capture(fn, self._use_cuda_graph, ctx.stream)
        if out is None:
            out = arrays.empty(ctx, (p.batch, p.num_qo_heads, p.head_dim), p.q_dtype)
        out_ptr, out_strides, _ = self._operand(out, "out", fn)
        lse_ptr = 0
        if lse is None and return_lse:
            lse = arrays.empty(ctx, (p.batch, p.num_qo_heads), np.float32)
        if lse is not None:
            lse_ptr = self._operand(lse, "lse", fn)[0]
        vargs = p.fixed_vargs if plain else bound.kernel_args(p.sm_scale, values, fn)
        ks, vs = scales
        if self._f32q.active:    # fp32 q: the kernel reads and writes 16-bit copies (qcast.py)
            qk, ok = self._f32q.begin(ctx, q_ptr, q_strides, out_ptr, out_strides)
            q_ptr, q_strides, out_ptr, out_strides = qk.ptr, qk.strides, ok.ptr, ok.strides
        self._launch(launcher, q_ptr, q_strides, cache_args, out_ptr, out_strides, lse_ptr, ctx.stream,
                     jit.pdl_launch(self._device, enable_pdl),
                     (ks.value, vs.value, ks.ptr, vs.ptr, int(ks.per_head) | 2 * int(vs.per_head)) + vargs)
        self._f32q.finish(ctx)
        result = arrays.export(ctx, out, p.q_dtype)
        if return_lse:
            return result, arrays.export(ctx, lse)
        return result

    forward = run

    def _operand(self, x, name: str, fn: str) -> tuple[int, tuple, str]:
        """(pointer, strides in elements, framework) of run()'s device array ``name`` (q, out or
        lse), checked against the plan. A CuPy / PyTorch array whose layout already passed in this
        plan skips the description and the checks (arrays.pointer_layout: the layout is all they
        read), leaving its pointer's alignment to check: a serving loop's layers pass arrays of one
        layout, and describing them costs 1-3 µs each of a run() whose driver launch costs 4-7."""
        p = self._plan
        found = arrays.pointer_layout(x)
        if found is not None:
            strides = self._checked.get((name, found[1]))
            if strides is not None and found[0] % _ALIGN[name] == 0:
                return found[0], strides, found[1][0]
        t = arrays.device_tensor(x, name, fn)
        if t.device != self._device or p.work_list is None:
            raise ValueError(f"{fn}: {name} must be on the GPU the plan was made for (GPU {self._device}), "
                             f"got GPU {t.device}")
        if name == "lse":
            shape = (p.batch, p.num_qo_heads)
            if t.shape != shape or t.dtype != np.float32 or not t.is_contiguous():
                raise ValueError(f"{fn}: lse must be a contiguous float32 array of shape {shape}, "
                                 f"got {t.shape} {t.dtype}")
        else:
            shape = (p.batch, p.num_qo_heads, p.head_dim)
            if t.shape != shape:
                raise ValueError(f"{fn}: {name} must have shape (batch, num_qo_heads, head_dim) = {shape}, "
                                 f"got {t.shape}")
            if not arrays.same_storage(t.dtype, p.q_dtype):
                raise ValueError(f"{fn}: {name} must have dtype {p.q_dtype} (q_data_type of plan), "
                                 f"got {t.dtype}")
        arrays.check_aligned(t, name, _ALIGN[name], fn)
        if found is not None:
            if len(self._checked) >= 256:
                self._checked.clear()
            self._checked[name, found[1]] = t.strides
        return t.ptr, t.strides, t.framework

    def _kv_view(self, paged_kv_cache, fn) -> tuple[int, tuple]:
        """(num_pages, the kernel's cache arguments) of a run()'s cache, checked against the plan's
        cache geometry and memoized on it and on the pointer and layout of the cache's arrays (all
        the description reads): a serving loop passes every layer's cache each step, and describing
        one costs ~4 µs of a run(). Entries hold no array, so the memo keeps no cache alive."""
        p = self._plan
        if isinstance(paged_kv_cache, (tuple, list)):
            key = (self._kv_geometry,) + tuple(map(arrays.pointer_layout, paged_kv_cache))
        else:
            key = (self._kv_geometry, arrays.pointer_layout(paged_kv_cache))
        hit = self._kv_memo.get(key)
        if hit is not None:
            return hit
        kv = paged_kv_tensors(paged_kv_cache, self._kv_layout, fn)
        if (kv.page_size, kv.num_kv_heads, kv.head_dim) != (p.page_size, p.num_kv_heads, p.head_dim):
            raise ValueError(f"{fn}: paged_kv_cache must have page_size, num_kv_heads, head_dim = "
                             f"{(p.page_size, p.num_kv_heads, p.head_dim)} as planned, got "
                             f"{(kv.page_size, kv.num_kv_heads, kv.head_dim)} (kv_layout={self._kv_layout})")
        if not arrays.same_storage(kv.dtype, p.kv_dtype):
            raise ValueError(f"{fn}: paged_kv_cache must have dtype {p.kv_dtype} (kv_data_type of plan), "
                             f"got {kv.dtype}")
        if kv.k.device != self._device:
            raise ValueError(f"{fn}: paged_kv_cache must be on GPU {self._device} like q, got GPU {kv.k.device}")
        arrays.check_aligned(kv.k, "paged_kv_cache", 16, fn)
        arrays.check_aligned(kv.v, "paged_kv_cache", 16, fn)
        maps = () if not p.run_spec.tma else _paged_tensor_maps(
            kv.k.ptr, kv.v.ptr, kv.num_pages, kv.page_size, kv.num_kv_heads, kv.head_dim, kv.stride_page,
            kv.stride_slot, kv.stride_head, p.run_spec.kv_bytes)
        cache = dict(k_cache=kv.k.ptr, v_cache=kv.v.ptr, s_page=kv.stride_page, s_tok=kv.stride_slot,
                     s_head=kv.stride_head)
        if maps:
            cache.update(tmap_k=maps[0], tmap_v=maps[1])
        view = kv.num_pages, PARAMS[p.run_spec.tma].group("k_cache", "tmap_v" if maps else "s_head", **cache)
        if None not in key:      # CuPy / PyTorch arrays (a JAX array is waited on by every run())
            if len(self._kv_memo) >= 1024:
                self._kv_memo.clear()
            self._kv_memo[key] = view
        return view

    def _variant_values(self, bound, args, sinks, q_rope_offset, fn) -> dict:
        """The variant's parameter values of a run() that passes some: positional ``args``, ``sinks=``
        and ``q_rope_offset=`` (checked here)."""
        p = self._plan
        values = bound.values(args + ((sinks,) if sinks is not None else ()), fn)
        if q_rope_offset is not None:
            if not bound.composite.has_rope:
                raise ValueError(f"{fn}: q_rope_offset needs a plan with pos_encoding_mode='ROPE_LLAMA'")
            shape = tuple(getattr(q_rope_offset, "shape", ()))
            if shape != (p.batch,):
                raise ValueError(f"{fn}: q_rope_offset must have shape (batch,) = ({p.batch},), got {shape}")
            values = {**values, "q_rope_offset": q_rope_offset}
        bound.check_sinks(values, p.num_qo_heads, fn)
        return values

    def _variant_state(self, with_sinks: bool, fn: str) -> tuple:
        """(decode launcher or None, bound variant) of a run() with or without ``sinks=``: a
        sink is a variant piece, so run(sinks=...) launches the plan's spec with it added."""
        p = self._plan
        if not with_sinks:
            return (p.launchers[0] if p.launchers else None), p.bound
        hit = self._variants.get(True)
        if hit is None:
            bound = variants.resolve(fn, num_qo_heads=p.num_qo_heads, head_dim=p.head_dim, sinks=True,
                                     **self._options)
            launcher = None
            if p.run_spec is not None and self._device is not None and p.work_list is not None:
                s = p.run_spec
                spec = _make_spec(s.head_dim, s.dtype_q, s.dtype_kv, s.num_stages, s.num_warps, s.l2_prefetch, s.tma,
                                  bound.composite)
                launcher = _launchers(spec, self._device)[0]
            hit = self._variants[True] = (launcher, bound)
        return hit

    def _launch(self, launcher, q_ptr, q_strides, cache_args, out_ptr, out_strides, lse_ptr, stream, pdl: bool,
                vargs: tuple):
        """vargs: the scale arguments (k_scale .. scale_per_head), then the variant's."""
        p = self._plan
        if not p.grid_work:       # an empty batch: nothing to launch (a grid of 0 is invalid)
            return
        launcher(p.grid, p.run_spec.threads, stream, *p.kernel_args, *cache_args,
                 q_ptr, out_ptr, lse_ptr, q_strides[0], q_strides[1], out_strides[0], out_strides[1], *vargs, pdl=pdl)
        if p.launchers[1] is not None:
            p.launchers[1](p.merge_grid, _THREADS, stream, p.meta["merge"], p.meta["part_o"], p.meta["part_lse"],
                           out_ptr, lse_ptr, out_strides[0], out_strides[1], p.num_qo_heads)

    def _run_host(self, q, paged_kv_cache, out, lse, return_lse, fn, bound, values, scales):
        p = self._plan
        qa = arrays.host_array(q, "q", fn)
        ctx = arrays.Context(arrays.framework_of(q), -1, None)
        want_q = (p.batch, p.num_qo_heads, p.head_dim)
        if qa.shape != want_q:
            raise ValueError(f"{fn}: q must have shape (batch, num_qo_heads, head_dim) = {want_q}, got {qa.shape}")
        if qa.dtype != p.q_dtype:
            raise ValueError(f"{fn}: q must have dtype {p.q_dtype} (q_data_type of plan), got {qa.dtype}")
        k_pages, v_pages = paged_kv_host(paged_kv_cache, self._kv_layout, fn)
        if k_pages.shape[1:] != (p.page_size, p.num_kv_heads, p.head_dim):
            raise ValueError(f"{fn}: paged_kv_cache must have page_size, num_kv_heads, head_dim = "
                             f"{(p.page_size, p.num_kv_heads, p.head_dim)} as planned, got "
                             f"{k_pages.shape[1:]} (kv_layout={self._kv_layout})")
        if k_pages.dtype == np.uint8 and fp8.is_fp8(p.kv_dtype):    # raw bits of the plan's fp8 type
            k_pages, v_pages = k_pages.view(p.kv_dtype), v_pages.view(p.kv_dtype)
        if k_pages.dtype != p.kv_dtype:
            raise ValueError(f"{fn}: paged_kv_cache must have dtype {p.kv_dtype} (kv_data_type of plan), "
                             f"got {k_pages.dtype}")
        indices = p.kv_indices
        if indices is None:
            indices = arrays.host_int_vector(p.kv_indices_src, "indices", fn)
        if len(indices) and (indices.min() < 0 or indices.max() >= k_pages.shape[0]):
            raise ValueError(f"{fn}: indices must be in 0..{k_pages.shape[0] - 1} (num_pages of the cache), "
                             f"got values in {int(indices.min())}..{int(indices.max())}")
        o = np.empty(want_q, np.float32)
        s = np.empty(want_q[:2], np.float32)
        for b in range(p.batch):
            k, v = reference.gather_paged_kv(k_pages, v_pages, indices, p.kv_indptr, p.last_page_len, b)
            if scales is not _NO_SCALES or fp8.is_fp8(p.kv_dtype):      # real values, float32
                ks, vs = scales
                k, v = fp8.dequantize(k, ks.host, 1), fp8.dequantize(v, vs.host, 1)
            ob, sb = reference.attention(qa[b:b + 1], k, v, sm_scale=p.sm_scale, variant=bound.composite,
                                         values=values, batch_idx=b, fn=fn)
            o[b], s[b] = ob[0], sb[0]
        return arrays.host_results(ctx, o, s, out, lse, return_lse, p.q_dtype, fn)


_NO_SCALES = (fp8.ONE, fp8.ONE)     # run() without k_scale / v_scale (host factors filled on use)

