"""Block-sparse attention (FlashInfer's ``BlockSparseAttentionWrapper`` and
``VariableBlockSparseAttentionWrapper``) as what it is: a paged KV cache whose pages are blocks.

A BSR matrix of R x C blocks over M queries and N keys is a paged batch: row block i is a request
of R queries (the last one M - R (MB - 1)), its non-zero column blocks ``indices[indptr[i]:
indptr[i+1]]`` are its pages of C keys, and the K/V arrays (N, num_kv_heads, head_dim) are a paged
cache of N / C pages, viewed in place. So every block-sparse call runs the paged prefill kernel,
its scheduler (split-KV across the SMs), its variants, its CUDA-graph mode and its NumPy path; no
kernel family of its own. Per-block masks become the kernel's custom mask (each request's R x
(blocks x C) bits); ``causal`` is the paged kernel's (bottom-right within a row block's gathered keys,
as FlashInfer's, whose block-sparse wrapper runs its paged kernel the same way).

The variable wrapper (blocks of per-kv-head sizes) pads the kv heads into the rows, as FlashInfer
does: request (head h, row block r) holds ``block_row_sz[h, r]`` queries of the head's group, and
its keys are single-token pages (page size 1) listing the tokens of the head's selected column
blocks. Its run() rearranges q, K/V and the output (one copy each).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from . import arrays
from .errors import UnsupportedError
from .prefill import BatchPrefillWithPagedKVCacheWrapper


def _int_scalar(value, name: str, fn: str, low: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise ValueError(f"{fn}: {name} must be an int >= {low}, got {value!r}")
    return int(value)


def bsr_mask_layout(mask: np.ndarray, indptr: np.ndarray, row_lens: np.ndarray) -> np.ndarray:
    """Per-block masks (nnz, R, C) as the paged kernel's flat custom mask: for row block i, its
    ``row_lens[i]`` rows by its blocks' keys in order (R x (blocks x C) bits, row-major)."""
    parts = []
    for i in range(len(indptr) - 1):
        blocks = mask[indptr[i]:indptr[i + 1], :row_lens[i]]              # (n_i, r_i, C)
        parts.append(blocks.transpose(1, 0, 2).reshape(-1))
    return np.concatenate(parts) if parts else np.zeros(0, bool)


class BlockSparseAttentionWrapper:
    """Attention under a block-sparse (BSR) mask of R x C blocks (FlashInfer's API); runs the paged
    prefill kernel over K/V viewed as pages of C keys.

    Parameters
    ----------
    float_workspace_buffer : array, optional
        GPU scratch for split-KV partials (any framework and dtype); allocated when omitted.
    backend : "auto" | "fa2" | "fa3" (the paged prefill kernels; fa3: Hopper, 64-row tiles for row blocks of <= 64 packed rows)
    use_cuda_graph : bool, keyword
        As for ``BatchPrefillWithPagedKVCacheWrapper``: buffers and grid fixed by the first plan.
    """

    _fn = "BlockSparseAttentionWrapper"

    def __init__(self, float_workspace_buffer: Any = None, backend: str = "auto", *, use_cuda_graph: bool = False):
        self._inner = BatchPrefillWithPagedKVCacheWrapper(float_workspace_buffer, "NHD", use_cuda_graph,
                                                          backend=backend)
        self._shape = None

    def plan(self, indptr, indices, M: int, N: int, R: int, C: int, num_qo_heads: int, num_kv_heads: int,
             head_dim: int, mask=None, packed_mask=None, causal: bool = False, pos_encoding_mode: str = "NONE",
             use_fp16_qk_reduction: bool = False, logits_soft_cap: float | None = None,
             sm_scale: float | None = None, rope_scale: float | None = None, rope_theta: float | None = None,
             q_data_type="float16", kv_data_type=None, o_data_type=None, non_blocking: bool = True, *,
             window_left: int = -1, variant=None, fixed_split_size: int | None = None,
             disable_split_kv: bool = False) -> None:
        """Plan attention of M queries over N keys under the BSR mask.

        Parameters
        ----------
        indptr : int array, shape (MB + 1,), MB = ceil(M / R): row blocks' offsets into ``indices``
        indices : int array, shape (nnz,): column block of each non-zero block, in 0 .. N / C - 1
        M, N, R, C : int; N must be a multiple of C
        mask : bool array, shape (nnz, R, C), optional: which entries of each non-zero block attend
        packed_mask : uint8 array, optional: the mask already in the paged kernel's layout (each row
            block's R x (blocks x C) bits), bit-packed per row block (``segment_packbits``), as FlashInfer
        causal, pos_encoding_mode, logits_soft_cap, window_left, variant, sm_scale, rope_* :
            as ``BatchPrefillWithPagedKVCacheWrapper.plan`` (positions are those of each row block's
            gathered keys)
        o_data_type : the output dtype; None (the default): q_data_type's. Must be q's (no other output
            dtype has a kernel: an explicit other dtype raises UnsupportedError). FlashInfer 0.6.4 defaults
            it to "float16" (so its bf16-q plans write fp16); cuattn's output always has q's dtype.
        """
        fn = f"{self._fn}.plan"
        M, N, R, C = (_int_scalar(v, n, fn, 0 if n == "M" else 1) for v, n in ((M, "M"), (N, "N"), (R, "R"), (C, "C")))
        if N % C:
            raise ValueError(f"{fn}: N must be a multiple of C, got N={N}, C={C}")
        q_dt = arrays.as_dtype(q_data_type, "q_data_type", fn)
        if o_data_type is not None and arrays.as_dtype(o_data_type, "o_data_type", fn) != q_dt:
            raise UnsupportedError(f"{fn}: o_data_type must be q_data_type ({q_dt}), got {o_data_type}")
        ip = arrays.host_int_vector(indptr, "indptr", fn).astype(np.int64)
        idx = arrays.host_int_vector(indices, "indices", fn).astype(np.int64)
        mb, nb = -(-M // R), N // C
        if len(ip) != mb + 1:
            raise ValueError(f"{fn}: indptr must have ceil(M / R) + 1 = {mb + 1} entries, got {len(ip)}")
        if len(idx) and (idx.min() < 0 or idx.max() >= nb):
            raise ValueError(f"{fn}: indices must be in 0..N / C - 1 = {nb - 1}, got values in "
                             f"{int(idx.min())}..{int(idx.max())}")
        qo_indptr = np.minimum(np.arange(mb + 1, dtype=np.int64) * R, M).astype(np.int32)
        custom = None
        if mask is not None and packed_mask is None:
            m = np.asarray(arrays.to_host(mask, "mask", fn)).astype(bool)
            if m.shape != (len(idx), R, C):
                raise ValueError(f"{fn}: mask must have shape (nnz, R, C) = {(len(idx), R, C)}, got {m.shape}")
            custom = bsr_mask_layout(m, ip, np.diff(qo_indptr))
        self._inner.plan(qo_indptr, ip.astype(np.int32), idx.astype(np.int32), np.full(mb, C, np.int32),
                         num_qo_heads, num_kv_heads, head_dim, C, custom_mask=custom, packed_custom_mask=packed_mask,
                         causal=causal, pos_encoding_mode=pos_encoding_mode,
                         use_fp16_qk_reduction=use_fp16_qk_reduction, window_left=window_left,
                         logits_soft_cap=logits_soft_cap, sm_scale=sm_scale, rope_scale=rope_scale,
                         rope_theta=rope_theta, q_data_type=q_data_type, kv_data_type=kv_data_type,
                         variant=variant, fixed_split_size=fixed_split_size, disable_split_kv=disable_split_kv)
        self._shape = (M, N, C, int(num_kv_heads), int(head_dim))

    def run(self, q, k, v, *args, scale_q=None, scale_k=None, scale_v=None, out=None, lse=None,
            return_lse: bool = False, enable_pdl: bool | None = None, stream: Any = None):
        """q (M, num_qo_heads, head_dim); k, v (N, num_kv_heads, head_dim) NHD, dtype kv_data_type;
        ``args``: the plan's variant parameters not fixed by plan(). Returns out, or (out, lse)."""
        fn = f"{self._fn}.run"
        if self._shape is None:
            raise ValueError(f"{fn}: plan() must be called before run()")
        if any(s is not None for s in (scale_q, scale_k, scale_v)):
            raise UnsupportedError(f"{fn}: scale_q / scale_k / scale_v (fp8 inputs) have no kernel")
        M, N, C, hkv, d = self._shape
        pages = []
        for x, name in ((k, "k"), (v, "v")):
            shape = tuple(getattr(x, "shape", ()))
            if shape != (N, hkv, d):
                raise ValueError(f"{fn}: {name} must have shape (N, num_kv_heads, head_dim) = {(N, hkv, d)}, got {shape}")
            pages.append(x.reshape(N // C, C, hkv, d))
        return self._inner.run(q, tuple(pages), *args, out=out, lse=lse, return_lse=return_lse,
                               enable_pdl=enable_pdl, stream=stream)

    forward = run

    def describe(self) -> str:
        return f"{self._fn} over " + self._inner.describe()


class VariableBlockSparseAttentionWrapper:
    """Block-sparse attention whose blocks have per-kv-head row and column sizes (FlashInfer's API).

    q (num_qo_heads, qo_len, head_dim), k / v (num_kv_heads, kv_len, head_dim) (HND, FlashInfer's
    layout for this wrapper); the qo heads of a GQA group share their kv head's pattern. No CUDA-graph
    mode: run() rearranges its arrays (one copy each) before and after the paged kernel.
    """

    _fn = "VariableBlockSparseAttentionWrapper"

    def __init__(self, float_workspace_buffer: Any = None, backend: str = "auto"):
        self._inner = BatchPrefillWithPagedKVCacheWrapper(float_workspace_buffer, "NHD", backend=backend)
        self._shape = None

    def plan(self, block_mask_map, block_row_sz, block_col_sz, num_qo_heads: int, num_kv_heads: int, head_dim: int,
             causal: bool = False, pos_encoding_mode: str = "NONE", use_fp16_qk_reduction: bool = False,
             logits_soft_cap: float | None = None, sm_scale: float | None = None, rope_scale: float | None = None,
             rope_theta: float | None = None, non_blocking: bool = True, q_data_type="float16",
             kv_data_type=None, *, fixed_split_size: int | None = None, disable_split_kv: bool = False) -> None:
        """block_mask_map: bool (num_kv_heads, MB, NB); block_row_sz: int (num_kv_heads, MB), each
        head's row-block sizes (summing to qo_len); block_col_sz: int (num_kv_heads, NB) (summing to
        kv_len). ``causal``: bottom-right within each (head, row block)'s gathered keys, as FlashInfer."""
        fn = f"{self._fn}.plan"
        bmap = np.asarray(arrays.to_host(block_mask_map, "block_mask_map", fn)).astype(bool)
        rows = np.asarray(arrays.to_host(block_row_sz, "block_row_sz", fn))
        cols = np.asarray(arrays.to_host(block_col_sz, "block_col_sz", fn))
        hkv = _int_scalar(num_kv_heads, "num_kv_heads", fn)
        if bmap.ndim != 3 or bmap.shape[0] != hkv:
            raise ValueError(f"{fn}: block_mask_map must have shape (num_kv_heads={hkv}, MB, NB), got {bmap.shape}")
        mb, nb = bmap.shape[1:]
        for a, name, want in ((rows, "block_row_sz", (hkv, mb)), (cols, "block_col_sz", (hkv, nb))):
            if a.shape != want or a.dtype.kind not in "iu" or (a.size and a.min() < 0):
                raise ValueError(f"{fn}: {name} must be non-negative ints of shape {want}, got {a.shape} {a.dtype}")
        qo_len, kv_len = rows.sum(1), cols.sum(1)
        if len(set(qo_len.tolist())) > 1 or len(set(kv_len.tolist())) > 1:
            raise ValueError(f"{fn}: every kv head's block_row_sz (and block_col_sz) must sum to the same qo_len "
                             f"(kv_len), got {qo_len.tolist()} ({kv_len.tolist()})")
        rows64, cols64 = rows.astype(np.int64), cols.astype(np.int64)
        qo_indptr = np.concatenate([[0], np.cumsum(rows64.ravel())]).astype(np.int32)
        # -- each (head, row block)'s keys: the tokens of its selected column blocks, as single-token
        #    pages of the kv heads laid end to end (head h's token t is page h * kv_len + t)
        col_start = np.cumsum(cols64, 1) - cols64 + (np.arange(hkv) * int(kv_len[0] if hkv else 0))[:, None]
        h, r, c = np.nonzero(bmap)
        lengths = cols64[h, c]
        row_len = np.zeros(hkv * mb, np.int64)
        np.add.at(row_len, h * mb + r, lengths)
        kv_indptr = np.concatenate([[0], np.cumsum(row_len)]).astype(np.int32)
        starts = np.repeat(col_start[h, c] - np.concatenate([[0], np.cumsum(lengths)[:-1]]), lengths)
        kv_indices = (starts + np.arange(int(lengths.sum()))).astype(np.int32)
        group = int(num_qo_heads) // hkv if hkv and int(num_qo_heads) % hkv == 0 else -1
        if group < 1:
            raise ValueError(f"{fn}: num_qo_heads must be a multiple of num_kv_heads, got {num_qo_heads}, {hkv}")
        self._inner.plan(qo_indptr, kv_indptr, kv_indices, np.ones(hkv * mb, np.int32), group, 1, head_dim, 1,
                         causal=causal, pos_encoding_mode=pos_encoding_mode,
                         use_fp16_qk_reduction=use_fp16_qk_reduction, logits_soft_cap=logits_soft_cap,
                         sm_scale=sm_scale, rope_scale=rope_scale, rope_theta=rope_theta, q_data_type=q_data_type,
                         kv_data_type=kv_data_type, fixed_split_size=fixed_split_size,
                         disable_split_kv=disable_split_kv)
        self._shape = (int(num_qo_heads), hkv, group, int(qo_len[0]), int(kv_len[0]), int(head_dim))

    def run(self, q, k, v, out=None, lse=None, return_lse: bool = False, enable_pdl: bool | None = None,
            stream: Any = None):
        """Returns out (num_qo_heads, qo_len, head_dim), or (out, lse (num_qo_heads, qo_len))."""
        fn = f"{self._fn}.run"
        if self._shape is None:
            raise ValueError(f"{fn}: plan() must be called before run()")
        if out is not None or lse is not None:
            raise UnsupportedError(f"{fn}: out= / lse= are not supported (run() rearranges its output; use the "
                                   f"returned arrays)")
        hq, hkv, g, lq, lk, d = self._shape
        for x, name, want in ((q, "q", (hq, lq, d)), (k, "k", (hkv, lk, d)), (v, "v", (hkv, lk, d))):
            if tuple(getattr(x, "shape", ())) != want:
                raise ValueError(f"{fn}: {name} must have shape {want}, got {tuple(getattr(x, 'shape', ()))}")
        # q (hkv g, lq, d) -> rows (hkv lq) of g heads; K/V (hkv, lk, d) -> single-token pages
        qr = arrays.rearranged(q, (hkv, g, lq, d), (0, 2, 1, 3), (hkv * lq, g, d))
        kp, vp = (x.reshape(hkv * lk, 1, 1, d) for x in (k, v))
        o, s = self._inner.run(qr, (kp, vp), return_lse=True, enable_pdl=enable_pdl, stream=stream)
        o = arrays.rearranged(o, (hkv, lq, g, d), (0, 2, 1, 3), (hq, lq, d))
        if not return_lse:
            return o
        return o, arrays.rearranged(s, (hkv, lq, g), (0, 2, 1), (hq, lq))

    forward = run

    def describe(self) -> str:
        return f"{self._fn} over " + self._inner.describe()
