"""Shared-prefix (cascade) attention over several levels of a paged KV cache (FlashInfer's
``MultiLevelCascadeAttentionWrapper``), and ``merge_state_in_place``.

Level i groups the queries by ``qo_indptr_arr[i]`` (contiguous runs of ``q`` that share that level's
KV) and gives each group its KV through that level's page table. Level 0 is typically one group of
every query over the shared prefix (system prompt), the last level one group per request over its
own tokens. Each level is one paged-prefill launch (``BatchPrefillWithPagedKVCacheWrapper``): the
shared KV is read once for all the queries that share it, the group's queries packed into the
kernel's rows; the levels' (output, LSE) states are merged exactly (``merge_state``). ``causal``
applies to the last level (the unique tokens), as in FlashInfer; shared levels are wholly visible.

Not yet: CUDA-graph mode (``use_cuda_graph=True`` is refused, as the prefill wrappers refuse it), a
split of a long shared level across more CTAs than its kv heads x query tiles (the scheduler work of
the cascade issue), and variants (the options are accepted only at their defaults).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from . import arrays
from .cascade import merge_state
from .errors import UnsupportedError
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
    float_workspace_buffer : array, optional (accepted for FlashInfer compatibility; unused)
    kv_layout : "NHD" or "HND"
    """

    def __init__(self, num_levels: int, float_workspace_buffer: Any = None, kv_layout: str = "NHD",
                 use_cuda_graph: bool = False, qo_indptr_buf_arr=None, paged_kv_indptr_buf_arr=None,
                 paged_kv_indices_buf_arr=None, paged_kv_last_page_len_buf_arr=None):
        fn = "MultiLevelCascadeAttentionWrapper"
        if isinstance(num_levels, bool) or not isinstance(num_levels, (int, np.integer)) or num_levels < 1:
            raise ValueError(f"{fn}: num_levels must be an int >= 1, got {num_levels!r}")
        if use_cuda_graph:
            raise UnsupportedError(f"{fn}: use_cuda_graph=True is not supported yet (the prefill wrappers it runs "
                                   f"have no graph mode); run it eagerly")
        self._num_levels = int(num_levels)
        self._levels = [BatchPrefillWithPagedKVCacheWrapper(kv_layout=kv_layout) for _ in range(self._num_levels)]
        self._planned = False

    def plan(self, qo_indptr_arr, paged_kv_indptr_arr, paged_kv_indices_arr, paged_kv_last_page_len,
             num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int, causal: bool = False,
             pos_encoding_mode: str = "NONE", use_fp16_qk_reduction: bool = False, sm_scale: float | None = None,
             window_left: int = -1, logits_soft_cap: float | None = None, rope_scale: float | None = None,
             rope_theta: float | None = None, q_data_type="float16", kv_data_type=None) -> None:
        """One plan per level, each an array per level (lists of ``num_levels`` arrays, level 0 first):
        ``qo_indptr_arr[i]`` (groups of queries, batch_i + 1; the last entry is the number of queries
        on every level), ``paged_kv_indptr_arr[i]``, ``paged_kv_indices_arr[i]``,
        ``paged_kv_last_page_len[i]`` (the page table of level i, one request per query group)."""
        fn = "MultiLevelCascadeAttentionWrapper.plan"
        arrs = {"qo_indptr_arr": qo_indptr_arr, "paged_kv_indptr_arr": paged_kv_indptr_arr,
                "paged_kv_indices_arr": paged_kv_indices_arr, "paged_kv_last_page_len": paged_kv_last_page_len}
        for name, a in arrs.items():
            if not isinstance(a, (list, tuple)) or len(a) != self._num_levels:
                raise ValueError(f"{fn}: {name} must be a list of num_levels={self._num_levels} arrays, got "
                                 f"{type(a).__name__} of length {len(a) if hasattr(a, '__len__') else '?'}")
        if pos_encoding_mode not in ("NONE", None) or window_left not in (-1, None) or \
                logits_soft_cap not in (None, 0, 0.0) or use_fp16_qk_reduction or rope_scale or rope_theta:
            raise UnsupportedError(f"{fn}: attention variants (pos_encoding_mode, window_left, logits_soft_cap, "
                                   f"use_fp16_qk_reduction, rope_*) are not supported by the cascade wrapper yet")
        totals = set()
        for i, w in enumerate(self._levels):
            qo = arrays.host_int_vector(qo_indptr_arr[i], f"qo_indptr_arr[{i}]", fn)
            totals.add(int(qo[-1]) if len(qo) else 0)
            w.plan(qo, paged_kv_indptr_arr[i], paged_kv_indices_arr[i], paged_kv_last_page_len[i], num_qo_heads,
                   num_kv_heads, head_dim, page_size, causal=bool(causal) and i == self._num_levels - 1,
                   sm_scale=sm_scale, q_data_type=q_data_type, kv_data_type=kv_data_type)
        if len(totals) != 1:
            raise ValueError(f"{fn}: every level's qo_indptr_arr[i][-1] must be the same number of queries, got "
                             f"{sorted(totals)}")
        self._planned = True

    def run(self, q, paged_kv_cache, out=None, lse=None, return_lse: bool = False, *, enable_pdl=None,
            stream: Any = None):
        """Attention of ``q`` (num_queries, num_qo_heads, head_dim) over every level's KV, merged.

        Returns out (dtype of q), or (out, lse) with ``return_lse`` (float32, natural log)."""
        fn = "MultiLevelCascadeAttentionWrapper.run"
        if not self._planned:
            raise ValueError(f"{fn}: plan() must be called before run()")
        last = self._levels[-1]
        out, lse = last.run(q, paged_kv_cache, out=out, lse=lse, return_lse=True, enable_pdl=enable_pdl, stream=stream)
        for w in self._levels[:-1]:
            o_i, s_i = w.run(q, paged_kv_cache, return_lse=True, enable_pdl=enable_pdl, stream=stream)
            merge_state_in_place(out, lse, o_i, s_i, stream=stream)
        return (out, lse) if return_lse else out

    forward = run
