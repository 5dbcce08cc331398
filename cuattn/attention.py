"""A serving step's mixed batch in one launch: FlashInfer's ``BatchAttention``.

Prefill requests (qo_len > 1, possibly a chunk appended to a cached prefix) and decode requests
(qo_len = 1) of one step over one paged cache run as one paged-prefill batch: one attention launch
whose work items are balanced by the shared scheduler (long KV of any request split across the SMs
and merged exactly by a second, small launch when the step needs it), the answer equal to running the
prefill and decode wrappers separately. FlashInfer's plan takes every request's ``kv_len`` instead of
the last page's length; ``run()`` returns ``(out, lse)``.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from . import arrays
from .errors import UnsupportedError
from .prefill import BatchPrefillWithPagedKVCacheWrapper


class BatchAttention:
    """Mixed prefill + decode attention over a paged KV cache in one launch (FlashInfer's API).

    Parameters
    ----------
    kv_layout : "NHD" or "HND"
    device : accepted for FlashInfer compatibility (the GPU is the current one at plan())
    float_workspace_buffer, use_cuda_graph : keyword, as ``BatchPrefillWithPagedKVCacheWrapper``
    """

    _fn = "BatchAttention"

    def __init__(self, kv_layout: str = "NHD", device: Any = "cuda", *, float_workspace_buffer: Any = None,
                 use_cuda_graph: bool = False):
        self._inner = BatchPrefillWithPagedKVCacheWrapper(float_workspace_buffer, kv_layout, use_cuda_graph)
        self._soft_cap = None

    def plan(self, qo_indptr, kv_indptr, kv_indices, kv_len_arr, num_qo_heads: int, num_kv_heads: int,
             head_dim_qk: int, head_dim_vo: int, page_size: int, causal: bool = False, sm_scale: float | None = None,
             logits_soft_cap: float | None = None, q_data_type="bfloat16", kv_data_type="bfloat16",
             use_profiler: bool = False, *, fixed_split_size: int | None = None,
             disable_split_kv: bool = False) -> None:
        """qo_indptr (batch + 1), kv_indptr / kv_indices (the CSR page table), kv_len_arr (batch,):
        every request's number of keys (its pages must hold exactly that many: ceil(kv_len / page_size))."""
        fn = f"{self._fn}.plan"
        if use_profiler:
            raise UnsupportedError(f"{fn}: use_profiler=True is not supported (no profiler buffer in cuattn)")
        kv_ptr = arrays.host_int_vector(kv_indptr, "kv_indptr", fn).astype(np.int64)
        kv_len = arrays.host_int_vector(kv_len_arr, "kv_len_arr", fn).astype(np.int64)
        if page_size < 1:
            raise ValueError(f"{fn}: page_size must be >= 1, got {page_size}")
        if len(kv_len) != len(kv_ptr) - 1:
            raise ValueError(f"{fn}: kv_len_arr must have one entry per request ({len(kv_ptr) - 1}), got {len(kv_len)}")
        pages = np.diff(kv_ptr)
        need = -(-kv_len // page_size)
        if len(kv_len) and (kv_len.min() < 0 or np.any(need != pages)):
            b = int(np.argmax((kv_len < 0) | (need != pages)))
            raise ValueError(f"{fn}: kv_len_arr must fit the request's pages (ceil(kv_len / page_size) == pages), "
                             f"got kv_len_arr[{b}]={int(kv_len[b])} with {int(pages[b])} pages of {page_size}")
        last = np.where(pages > 0, kv_len - (pages - 1) * page_size, 0).astype(np.int32)
        self._soft_cap = logits_soft_cap or None
        self._inner.plan(qo_indptr, kv_ptr.astype(np.int32), kv_indices, last, num_qo_heads, num_kv_heads, head_dim_qk,
                         page_size, head_dim_vo=head_dim_vo, causal=causal, sm_scale=sm_scale,
                         logits_soft_cap=self._soft_cap, q_data_type=q_data_type, kv_data_type=kv_data_type,
                         fixed_split_size=fixed_split_size, disable_split_kv=disable_split_kv)

    def run(self, q, kv_cache, out=None, lse=None, k_scale=None, v_scale=None, logits_soft_cap: float = 0.0,
            profiler_buffer=None, *, enable_pdl: bool | None = None, stream: Any = None):
        """q (qo_indptr[-1], num_qo_heads, head_dim); kv_cache as for the paged wrappers.
        Returns (out, lse) (LSE natural log, float32)."""
        fn = f"{self._fn}.run"
        if profiler_buffer is not None:
            raise UnsupportedError(f"{fn}: profiler_buffer is not supported")
        if logits_soft_cap not in (0, 0.0, None) and logits_soft_cap != self._soft_cap:
            raise ValueError(f"{fn}: logits_soft_cap must be the plan's ({self._soft_cap or 0.0}): the cap is "
                             f"compiled into the kernel at plan(), got {logits_soft_cap}")
        if lse is None:
            return self._inner.run(q, kv_cache, out=out, return_lse=True, k_scale=k_scale, v_scale=v_scale,
                                   enable_pdl=enable_pdl, stream=stream)
        out = self._inner.run(q, kv_cache, out=out, lse=lse, k_scale=k_scale, v_scale=v_scale, enable_pdl=enable_pdl,
                              stream=stream)
        return out, lse

    def describe(self) -> str:
        return f"{self._fn} over " + self._inner.describe()
