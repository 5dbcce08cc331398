"""Shared-prefix (cascade) attention over several levels of a paged KV cache (FlashInfer's
``MultiLevelCascadeAttentionWrapper``), and ``merge_state_in_place``.

Level i groups the queries by ``qo_indptr_arr[i]`` (contiguous runs of ``q`` that share that level's
KV) and gives each group its KV through that level's page table. Level 0 is typically one group of
every query over the shared prefix (system prompt), the last level one group per request over its
own tokens. A level whose groups hold one query each (the unique tokens of a decode step) runs the
decode kernel (``BatchDecodeWithPagedKVCacheWrapper``); any other level is one paged-prefill launch
(``BatchPrefillWithPagedKVCacheWrapper``): the shared KV is read once for all the queries that share
it, the group's queries packed into the kernel's rows, and the scheduler splits a long shared level's keys across the SMs (split-KV pieces
merged exactly inside the level); the levels' (output, LSE) states are then merged exactly, in place
(``merge_state_in_place``). ``causal`` applies to the last level (the unique tokens), as in
FlashInfer; shared levels are wholly visible. ``use_cuda_graph=True`` builds every level for graphs
and keeps the levels' states in buffers fixed by the first plan. A shared level whose arrays and arguments have the
values of its last plan keeps that plan (a serving loop's prefix: no work list, no upload).

Not yet: variants (the options are accepted only at their defaults).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from . import arrays
from .plan import config_key, host_ints
from .cascade import _check_pair, _spec_for, launch_merge_state, merge_state
from .errors import UnsupportedError
from .decode import BatchDecodeWithPagedKVCacheWrapper
from .prefill import BatchPrefillWithPagedKVCacheWrapper


def merge_state_in_place(v, s, v_other, s_other, mask=None, *, stream: Any = None) -> None:
    """Merge the state (v_other, s_other) into (v, s), in place (FlashInfer's signature).

    Parameters
    ----------
    v, v_other : array, shape (seq_len, num_heads, head_dim), float16, bfloat16 or float32
    s, s_other : float32 array, shape (seq_len, num_heads), natural-log LSE (base e)
    mask : bool array, shape (seq_len,), optional: rows to merge (others keep (v, s) unchanged)
    """
    fn = "merge_state_in_place"
    ctx = arrays.context_of(fn, {"v": v, "s": s, "v_other": v_other, "s_other": s_other}, stream)
    arrays.writable(v, "v", fn, "use merge_state for the returning form")
    arrays.writable(s, "s", fn, "use merge_state for the returning form")
    if ctx.on_gpu and mask is None and _merge_into(ctx, v, s, v_other, s_other, fn):
        return
    merged_v, merged_s = merge_state(v, s, v_other, s_other, stream=stream)
    if not ctx.on_gpu:
        vh, sh = arrays.host_array(v, "v", fn), arrays.host_array(s, "s", fn)
        mv, ms = arrays.host_array(merged_v, "v", fn), arrays.host_array(merged_s, "s", fn)
        rows = slice(None) if mask is None else _host_mask(mask, vh.shape[0], fn)
        vh[rows], sh[rows] = mv[rows], ms[rows]
        return
    cp = arrays.cupy_module()
    tv, ts = arrays.device_tensor(v, "v", fn), arrays.device_tensor(s, "s", fn)
    with cp.cuda.Device(ctx.device), ctx.stream:
        dv, ds = arrays.cupy_view(tv), arrays.cupy_view(ts)
        mv = arrays.cupy_view(arrays.device_tensor(merged_v, "v", fn))
        ms = arrays.cupy_view(arrays.device_tensor(merged_s, "s", fn))
        if mask is None:
            dv[...], ds[...] = mv, ms
        else:
            m = cp.asarray(_host_mask(mask, tv.shape[0], fn) if not arrays.is_device_array(mask)
                           else arrays.cupy_view(arrays.device_tensor(mask, "mask", fn)).astype(bool))
            if m.shape != (tv.shape[0],):
                raise ValueError(f"{fn}: mask must have shape (seq_len,) = ({tv.shape[0]},), got {m.shape}")
            dv[...] = cp.where(m[:, None, None], mv, dv)
            ds[...] = cp.where(m[:, None], ms, ds)


def _merge_into(ctx, v, s, v_other, s_other, fn: str) -> bool:
    """(v_other, s_other) merged into (v, s) by one kernel, in place on ``ctx``'s stream (no temporary,
    so a CUDA graph can hold it; the arrays may be of different frameworks). False where ``s`` is not
    a contiguous float32 array (the kernel writes it densely)."""
    t = [arrays.device_tensor(x, n, fn) for x, n in ((v, "v"), (s, "s"), (v_other, "v_other"), (s_other, "s_other"))]
    if not (t[1].is_contiguous() and t[1].dtype == np.float32):
        return False
    _check_pair(fn, t[0].shape, t[1].shape, t[2].shape, t[3].shape, arrays.logical_dtype(t[0].dtype),
                arrays.logical_dtype(t[2].dtype), t[1].dtype, t[3].dtype)
    with arrays.cupy_module().cuda.Device(ctx.device):
        launch_merge_state(ctx, _spec_for(t[0].dtype, fn), t[0], t[1], t[2], t[3], t[0], t[1])
    return True


def _level_key(cfg, causal: bool, qo: np.ndarray, kv_indptr: np.ndarray, ids, last) -> tuple | None:
    """The values of a prefill level's plan() arguments: the cascade's configuration (``plan.config_key``), the
    level's causal flag and its four arrays' dtypes and bytes; None (no reuse) unless the page ids and last page
    lengths are 1-D NumPy int arrays (``host_ints`` made qo and kv_indptr NumPy arrays already)."""
    if cfg is None or type(ids) is not np.ndarray or type(last) is not np.ndarray or ids.ndim != 1 or last.ndim != 1 \
            or ids.dtype.kind not in "iu" or last.dtype.kind not in "iu":
        return None
    return (cfg, causal, qo.dtype, qo.tobytes(), kv_indptr.dtype, kv_indptr.tobytes(), ids.dtype, ids.tobytes(),
            last.dtype, last.tobytes())


def _host_mask(mask, seq_len: int, fn: str) -> np.ndarray:
    m = np.asarray(arrays.to_host(mask, "mask", fn)).astype(bool).ravel()
    if m.shape != (seq_len,):
        raise ValueError(f"{fn}: mask must have shape (seq_len,) = ({seq_len},), got {m.shape}")
    return m


class MultiLevelCascadeAttentionWrapper:
    """Attention over a multi-level shared-prefix KV cache (FlashInfer's API).

    Parameters
    ----------
    num_levels : int >= 1
    float_workspace_buffer : array, optional
        GPU scratch for the split-KV partials of every level (any framework and dtype); each level
        allocates its own when omitted.
    kv_layout : "NHD" or "HND"
    use_cuda_graph : bool
        Every level's plan buffers, grid and state buffers keep the capacity of the first plan, so a
        captured ``run()`` replays after later plans (``run()`` once before capturing; pass ``out=``
        and ``lse=`` buffers that the graph keeps).
    """

    def __init__(self, num_levels: int, float_workspace_buffer: Any = None, kv_layout: str = "NHD",
                 use_cuda_graph: bool = False, qo_indptr_buf_arr=None, paged_kv_indptr_buf_arr=None,
                 paged_kv_indices_buf_arr=None, paged_kv_last_page_len_buf_arr=None):
        fn = "MultiLevelCascadeAttentionWrapper"
        if isinstance(num_levels, bool) or not isinstance(num_levels, (int, np.integer)) or num_levels < 1:
            raise ValueError(f"{fn}: num_levels must be an int >= 1, got {num_levels!r}")
        self._num_levels = int(num_levels)
        self._graph = bool(use_cuda_graph)
        self._make = {
            "decode": lambda: BatchDecodeWithPagedKVCacheWrapper(float_workspace_buffer, kv_layout, use_cuda_graph),
            "prefill": lambda: BatchPrefillWithPagedKVCacheWrapper(float_workspace_buffer, kv_layout, use_cuda_graph)}
        self._levels: list = [None] * self._num_levels     # each level's wrapper, of the kind its plan needs
        self._kinds: list = [None] * self._num_levels
        self._states = None        # (out, lse) of every level but the last, on the GPU (plan())
        self._planned = False
        self._iota_last = (0, None, b"")
        self._names = [(f"qo_indptr_arr[{i}]", f"paged_kv_indptr_arr[{i}]") for i in range(self._num_levels)]   # (plan())
        self._keys: list = [None] * self._num_levels     # each prefill level's last plan() arguments (_level_key)

    def plan(self, qo_indptr_arr, paged_kv_indptr_arr, paged_kv_indices_arr, paged_kv_last_page_len,
             num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int, causal: bool = False,
             pos_encoding_mode: str = "NONE", use_fp16_qk_reduction: bool = False, sm_scale: float | None = None,
             window_left: int = -1, logits_soft_cap: float | None = None, rope_scale: float | None = None,
             rope_theta: float | None = None, q_data_type="float16", kv_data_type=None, *,
             fixed_split_size: int | None = None, disable_split_kv: bool = False) -> None:
        """One plan per level, each an array per level (lists of ``num_levels`` arrays, level 0 first):
        ``qo_indptr_arr[i]`` (groups of queries, batch_i + 1; the last entry is the number of queries
        on every level), ``paged_kv_indptr_arr[i]``, ``paged_kv_indices_arr[i]``,
        ``paged_kv_last_page_len[i]`` (the page table of level i, one request per query group).
        ``fixed_split_size`` / ``disable_split_kv``: as for the prefill wrappers, on every level."""
        fn = "MultiLevelCascadeAttentionWrapper.plan"
        arrs = {"qo_indptr_arr": qo_indptr_arr, "paged_kv_indptr_arr": paged_kv_indptr_arr,
                "paged_kv_indices_arr": paged_kv_indices_arr, "paged_kv_last_page_len": paged_kv_last_page_len}
        n_lv = self._num_levels
        for name, a in arrs.items():
            if not isinstance(a, (list, tuple)) or len(a) != n_lv:
                raise ValueError(f"{fn}: {name} must be a list of num_levels={n_lv} arrays, got "
                                 f"{type(a).__name__} of length {len(a) if hasattr(a, '__len__') else '?'}")
        if pos_encoding_mode not in ("NONE", None) or window_left not in (-1, None) or \
                logits_soft_cap not in (None, 0, 0.0) or use_fp16_qk_reduction or rope_scale or rope_theta:
            raise UnsupportedError(f"{fn}: attention variants (pos_encoding_mode, window_left, logits_soft_cap, "
                                   f"use_fp16_qk_reduction, rope_*) are not supported by the cascade wrapper yet")
        totals = set()
        # -- a shared level whose plan() would get the values its last plan() got (a serving loop's prefix) keeps that
        #    plan as it is, keyed on every argument its plan() gets (the variant options are at their defaults): no
        #    work list, no upload. Exact: the plan is a pure function of those values, and the level's plan buffer
        #    on the GPU still holds what that plan uploaded (only the level's own plan() writes it; the kernels
        #    leave the fa3 item counter, the one word they write there, at zero). Graph mode alike (fixed buffers).
        cfg = config_key(num_qo_heads, num_kv_heads, head_dim, page_size, sm_scale, q_data_type, kv_data_type,
                         fixed_split_size, disable_split_kv)
        for i, (qo_name, kv_name) in enumerate(self._names):
            qo = host_ints(qo_indptr_arr[i], qo_name, fn)
            n = len(qo)
            rows = int(qo[-1]) if n else 0
            totals.add(rows)
            # -- one query per group (a decode step's own tokens): the decode kernel (causal changes nothing
            #    for one bottom-right query); else a paged prefill. (qo == 0, 1, ..., n - 1: the ends first,
            #    then the bytes against a kept 0..n-1 of qo's dtype: a memcmp, not an elementwise compare)
            kv_indptr = host_ints(paged_kv_indptr_arr[i], kv_name, fn)
            kind = "decode" if n > 1 and rows == n - 1 and len(kv_indptr) == n and qo[0] == 0 and \
                qo.tobytes() == self._iota(n, qo.dtype) else "prefill"
            if kind != self._kinds[i]:
                if self._graph and self._kinds[i] is not None:
                    raise ValueError(f"{fn}: level {i} must keep the kernel of the first plan with use_cuda_graph=True "
                                     f"({self._kinds[i]}), got a plan for {kind}; make a new wrapper")
                self._levels[i], self._kinds[i], self._keys[i] = self._make[kind](), kind, None
            # -- the levels' plan() arguments positional (~1-2 µs less than keywords per cascade plan): decode's
            #    pos_encoding_mode, window_left, logits_soft_cap, q_data_type, kv_data_type, data_type, sm_scale;
            #    prefill's head_dim_vo, custom_mask, packed_custom_mask, causal, pos_encoding_mode,
            #    use_fp16_qk_reduction, window_left, logits_soft_cap, sm_scale, rope_scale, rope_theta, q_data_type,
            #    kv_data_type (the variant options at their defaults: checked above)
            if kind == "decode":
                self._levels[i].plan(kv_indptr, paged_kv_indices_arr[i], paged_kv_last_page_len[i], num_qo_heads,
                                     num_kv_heads, head_dim, page_size, "NONE", -1, None, q_data_type, kv_data_type,
                                     None, sm_scale, fixed_split_size=fixed_split_size,
                                     disable_split_kv=disable_split_kv)
            else:
                ids, last = paged_kv_indices_arr[i], paged_kv_last_page_len[i]
                level_causal = bool(causal) and i == n_lv - 1
                key = _level_key(cfg, level_causal, qo, kv_indptr, ids, last)
                if key is not None and key == self._keys[i]:
                    continue        # (its plan, and the plan buffer it uploaded: see above)
                self._keys[i] = None
                self._levels[i].plan(qo, kv_indptr, ids, last, num_qo_heads, num_kv_heads, head_dim, page_size, None,
                                     None, None, level_causal, "NONE", False, -1, None, sm_scale, None, None,
                                     q_data_type, kv_data_type, fixed_split_size=fixed_split_size,
                                     disable_split_kv=disable_split_kv)
                self._keys[i] = key
        if len(totals) != 1:
            raise ValueError(f"{fn}: every level's qo_indptr_arr[i][-1] must be the same number of queries, got "
                             f"{sorted(totals)}")
        self._rows = totals.pop()
        self._plan_states(fn, int(num_qo_heads), int(head_dim))
        self._planned = True

    def _iota(self, n: int, dtype) -> bytes:
        """The bytes of 0, 1, ..., n - 1 in ``dtype`` (the last length and dtype's kept)."""
        if self._iota_last[:2] != (n, dtype):
            self._iota_last = (n, dtype, np.arange(n, dtype=dtype).tobytes())
        return self._iota_last[2]

    def _plan_states(self, fn: str, heads: int, head_dim: int) -> None:
        """The (out, lse) buffers of every level but the last, allocated here, not in run() (graph mode:
        at the first plan, with room for twice its queries), of the levels' q dtype."""
        first = self._levels[0]._plan      # plan.Plan, whichever kind the level is
        device, dtype = first.device, first.q_dtype
        if device is None or self._num_levels == 1:
            return
        if self._states is not None:
            cap, shape = self._states[0][0].shape[0], self._states[0][0].shape[1:]
            if shape == (heads, head_dim) and (self._rows <= cap if self._graph else self._rows == cap):
                return
            if self._graph:
                raise ValueError(f"{fn}: the queries ({self._rows}) and their heads ({heads} x {head_dim}) must fit "
                                 f"the level states fixed by the first plan with use_cuda_graph=True ({cap} x "
                                 f"{shape}); plan the largest batch first or make a new wrapper")
        cap = max(2 * self._rows, 256) if self._graph else self._rows
        cp = arrays.cupy_module()
        with cp.cuda.Device(device):
            ctx = arrays.Context("cupy", device, None)
            self._states = [(arrays.empty(ctx, (cap, heads, head_dim), dtype), cp.empty((cap, heads), np.float32))
                            for _ in range(self._num_levels - 1)]

    def run(self, q, paged_kv_cache, out=None, lse=None, return_lse: bool = False, *, enable_pdl=None,
            stream: Any = None):
        """Attention of ``q`` (num_queries, num_qo_heads, head_dim) over every level's KV, merged.

        Returns out (dtype of q), or (out, lse) with ``return_lse`` (float32, natural log)."""
        fn = "MultiLevelCascadeAttentionWrapper.run"
        if not self._planned:
            raise ValueError(f"{fn}: plan() must be called before run()")
        ctx = arrays.context_of(fn, {"q": q}, stream)
        last = self._levels[-1]
        out, lse = last.run(q, paged_kv_cache, out=out, lse=lse, return_lse=True, enable_pdl=enable_pdl,
                            stream=ctx.stream)
        for i, w in enumerate(self._levels[:-1]):
            if ctx.on_gpu and self._states is not None:
                o_buf, s_buf = self._states[i]
                o_i, s_i = o_buf[:self._rows], s_buf[:self._rows]
                w.run(q, paged_kv_cache, out=o_i, lse=s_i, return_lse=True, enable_pdl=enable_pdl, stream=ctx.stream)
                if not _merge_into(ctx, out, lse, o_i, s_i, fn):
                    raise ValueError(f"{fn}: lse must be a contiguous float32 array")
            else:
                o_i, s_i = w.run(q, paged_kv_cache, return_lse=True, enable_pdl=enable_pdl, stream=stream)
                merge_state_in_place(out, lse, o_i, s_i, stream=stream)
        return (out, lse) if return_lse else out

    forward = run

    def describe(self) -> str:
        """What the last plan() runs on every level (``BatchPrefillWithPagedKVCacheWrapper.describe``)."""
        if not self._planned:
            return "MultiLevelCascadeAttentionWrapper: not planned"
        lines = [f"MultiLevelCascadeAttentionWrapper: {self._num_levels} levels, {self._rows} queries, levels merged "
                 f"in place ({self._num_levels - 1} merge launches)" + (", CUDA-graph buffers" if self._graph else "")]
        for i, w in enumerate(self._levels):
            lines += [f"level {i}: " + w.describe().replace("\n", "\n  ")]
        return "\n".join(lines)
