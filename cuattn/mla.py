"""MLA (DeepSeek's multi-head latent attention) on a paged latent cache: FlashInfer's
``BatchMLAPagedAttentionWrapper`` and ``append_paged_mla_kv_cache``.

Each token stores one compressed latent vector (``ckv``, head_dim_ckv = 512 in DeepSeek V2/V3) and a
RoPE key part (``kpe``, 64) instead of per-head K and V. With the projections absorbed, every query
head scores against the same (ckv, kpe) of a token, ``s = (q_nope . ckv + q_pe . kpe) * sm_scale``,
and reads the same ckv as its value: ``out = softmax(s) . ckv``.

NumPy inputs run the reference path (float32 accumulation). GPU inputs run ``kernels_cu/mla.cu``
(mma.sync tensor cores, sm_80+; fp16 / bf16 with q and the caches of one dtype): plan() builds
plan.py's prefill work list over (request, tile of 64 packed query rows = token x head, kv piece),
splitting long kv when the items alone leave SMs idle (plan.choose_prefill_chunk), and uploads it
with the page table into ``plan.PlanBuffers`` (fixed addresses with ``use_cuda_graph=True``); run()
launches the attention kernel and, for split items, its merge kernel. Appending to the latent cache
on the GPU goes through the paged-cache append kernel, a (ckv, kpe) pair as one-head caches.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import arrays, jit, plan as _plan
from .errors import UnsupportedError
from .page import append_paged_kv_cache
from .params import Params

HEAD_DIM_CKV, HEAD_DIM_KPE = 512, 64
_SOURCE = "mla.cu"
_ENTRY = "cuattn_mla_paged"
_MERGE_ENTRY = "cuattn_mla_merge"
BLOCK_M, BLOCK_N, _THREADS = 64, 32, 256      # mla.cu's tile (packed query rows x keys) and block
_MERGE_THREADS = 128
_LN2 = math.log(2)


@dataclass(frozen=True)
class MLASpec:
    dtype: str          # "f16" | "bf16": q, ckv / kpe caches and out
    stages: int = 2     # key tiles in the cp.async ring: 2 fit sm_80's 163 KiB of shared memory, 3 sm_90's 227
    source = _SOURCE

    @property
    def name(self) -> str:   # "mla_ckv512_kpe64_qf16_bm64_bn32_s2"
        return f"mla_ckv{HEAD_DIM_CKV}_kpe{HEAD_DIM_KPE}_q{self.dtype}_bm{BLOCK_M}_bn{BLOCK_N}_s{self.stages}"

    def defines(self) -> tuple[str, ...]:
        return (f"-DDTYPE=cuattn::{self.dtype}", f"-DSTAGES={self.stages}")

    @property
    def archs(self) -> tuple[str, ...] | None:    # cli.shipped_specs: 3 stages need Hopper's shared memory
        return ("sm_90a",) if self.stages > 2 else None

    @property
    def smem_bytes(self) -> int:    # mla.cu SMEM_BYTES: Q tile + STAGES key tiles (rows padded by 8) + scores
        pitch = HEAD_DIM_CKV + HEAD_DIM_KPE + 8
        return (BLOCK_M + self.stages * BLOCK_N) * pitch * 2 + BLOCK_M * (BLOCK_N + 8) * 4


def shipped_specs() -> list[MLASpec]:
    return [MLASpec(d, s) for d in ("f16", "bf16") for s in (2, 3)]


def stages_for(arch: str) -> int:
    """Key-tile stages of the kernel a device runs: 3 on sm_90 (227 KiB of shared memory), else 2."""
    return 3 if arch.startswith("sm_90") else 2


PARAMS = Params.define(_ENTRY, "work:p kv_chunk:p qo_indptr:p kv_indptr:p kv_indices:p kv_len_arr:p q_nope:p q_pe:p "
                               "ckv_cache:p kpe_cache:p out:p lse:p part_o:p part_lse:p num_heads:i page_size:i "
                               "causal:i qn_s_tok:q qn_s_head:q qp_s_tok:q qp_s_head:q ckv_s_page:q ckv_s_tok:q "
                               "kpe_s_page:q kpe_s_tok:q o_s_tok:q o_s_head:q scale_log2:f lse_scale:f")
MERGE_PARAMS = Params.define(_MERGE_ENTRY, "merge:p qo_indptr:p part_o:p part_lse:p out:p lse:p num_heads:i "
                                           "o_s_tok:q o_s_head:q lse_scale:f")


def append_paged_mla_kv_cache(append_ckv, append_kpe, batch_indices, positions, ckv_cache, kpe_cache, kv_indices,
                              kv_indptr, kv_last_page_len, *, stream: Any = None) -> None:
    """Write appended tokens' latent vectors into their page slots (in place; FlashInfer's signature).

    Parameters
    ----------
    append_ckv : array, shape (nnz, head_dim_ckv); append_kpe : array, shape (nnz, head_dim_kpe)
    batch_indices, positions : int32 arrays, shape (nnz,) (``get_batch_indices_positions``)
    ckv_cache : array, shape (num_pages, page_size, head_dim_ckv); kpe_cache : (num_pages, page_size,
        head_dim_kpe); dtype of the appended rows
    kv_indices, kv_indptr, kv_last_page_len : the page table, already covering the appended positions
    """
    fn = "append_paged_mla_kv_cache"
    for x, name, cache, cname in ((append_ckv, "append_ckv", ckv_cache, "ckv_cache"),
                                  (append_kpe, "append_kpe", kpe_cache, "kpe_cache")):
        xs, cs = tuple(getattr(x, "shape", ())), tuple(getattr(cache, "shape", ()))
        if len(xs) != 2 or len(cs) != 3 or xs[1] != cs[2]:
            raise ValueError(f"{fn}: {name} must have shape (nnz, d) and {cname} (num_pages, page_size, d) with the "
                             f"same d, got {xs} and {cs}")
    # -- each part as a one-head paged cache (NHD), its rows written as both "K" and "V" of a (k, v)
    #    pair over the same array: the append kernel's checks, skips and dtype rules apply as they are
    for rows, cache in ((append_ckv, ckv_cache), (append_kpe, kpe_cache)):
        n, d = rows.shape
        c = cache.reshape(cache.shape[0], cache.shape[1], 1, d)
        r = rows.reshape(n, 1, d)
        append_paged_kv_cache(r, r, batch_indices, positions, (c, c), kv_indices, kv_indptr, kv_last_page_len,
                              stream=stream)


class BatchMLAPagedAttentionWrapper:
    """MLA attention over a paged latent cache (FlashInfer's API): ``plan()`` once per step, ``run()``
    per layer. NumPy inputs run the reference path; GPU inputs raise ``UnsupportedError`` (no kernel yet).

    Parameters
    ----------
    float_workspace_buffer : array, optional (for FlashInfer compatibility)
    use_cuda_graph, qo_indptr, kv_indptr, kv_indices, kv_len_arr, backend : accepted as FlashInfer's
    """

    _fn = "BatchMLAPagedAttentionWrapper"

    def __init__(self, float_workspace_buffer: Any = None, use_cuda_graph: bool = False, qo_indptr: Any = None,
                 kv_indptr: Any = None, kv_indices: Any = None, kv_len_arr: Any = None, backend: str = "auto"):
        if backend not in ("auto", "fa2", "fa3"):
            raise ValueError(f"{self._fn}: backend must be 'auto', 'fa2' or 'fa3', got {backend!r}")
        self._plan = None

    def plan(self, qo_indptr, kv_indptr, kv_indices, kv_len_arr, num_heads: int, head_dim_ckv: int,
             head_dim_kpe: int, page_size: int, causal: bool, sm_scale: float, q_data_type, kv_data_type,
             use_profiler: bool = False) -> None:
        """Plan a batch: request i's queries are ``q[qo_indptr[i]:qo_indptr[i+1]]`` and its keys the
        first ``kv_len_arr[i]`` slots of pages ``kv_indices[kv_indptr[i]:kv_indptr[i+1]]``; ``causal``
        aligns bottom-right (query t sees keys <= t + kv_len - qo_len)."""
        fn = f"{self._fn}.plan"
        if use_profiler:
            raise UnsupportedError(f"{fn}: use_profiler=True is not supported")
        if (head_dim_ckv, head_dim_kpe) != (HEAD_DIM_CKV, HEAD_DIM_KPE):
            raise UnsupportedError(f"{fn}: head_dim_ckv, head_dim_kpe must be ({HEAD_DIM_CKV}, {HEAD_DIM_KPE}) "
                                   f"(DeepSeek V2/V3), got ({head_dim_ckv}, {head_dim_kpe})")
        for name, val in (("num_heads", num_heads), ("page_size", page_size)):
            if isinstance(val, bool) or not isinstance(val, (int, np.integer)) or val < 1:
                raise ValueError(f"{fn}: {name} must be a positive int, got {val!r}")
        qo = arrays.host_int_vector(qo_indptr, "qo_indptr", fn).astype(np.int64)
        kp = arrays.host_int_vector(kv_indptr, "kv_indptr", fn).astype(np.int64)
        idx = arrays.host_int_vector(kv_indices, "kv_indices", fn).astype(np.int64)
        kvl = arrays.host_int_vector(kv_len_arr, "kv_len_arr", fn).astype(np.int64)
        batch = len(qo) - 1
        if batch < 0 or qo[0] != 0 or np.any(np.diff(qo) < 0):
            raise ValueError(f"{fn}: qo_indptr must start at 0 and be non-decreasing, got {qo[:8]}")
        if len(kp) != batch + 1 or len(kvl) != batch or kp[0] != 0 or np.any(np.diff(kp) < 0):
            raise ValueError(f"{fn}: kv_indptr (batch + 1 = {batch + 1}, from 0, non-decreasing) and kv_len_arr "
                             f"(batch) must describe qo_indptr's batch, got {len(kp)} and {len(kvl)} entries")
        if len(idx) < kp[-1] or (len(idx) and idx.min() < 0):
            raise ValueError(f"{fn}: kv_indices must hold kv_indptr[-1] = {kp[-1]} non-negative page ids, got "
                             f"{len(idx)} with min {idx.min() if len(idx) else None}")
        pages = np.diff(kp)
        if np.any(kvl < 0) or np.any(-(-kvl // page_size) != pages):
            b = int(np.argmax((kvl < 0) | (-(-kvl // page_size) != pages)))
            raise ValueError(f"{fn}: kv_len_arr must fit the request's pages (ceil(kv_len / page_size) == pages), "
                             f"got kv_len_arr[{b}]={int(kvl[b])} with {int(pages[b])} pages of {page_size}")
        if causal and np.any(np.diff(qo) > kvl):
            raise ValueError(f"{fn}: with causal=True every request needs qo_len <= kv_len")
        self._plan = dict(qo=qo, kv_indptr=kp, kv_indices=idx, kv_len=kvl, num_heads=int(num_heads),
                          page_size=int(page_size), causal=bool(causal),
                          sm_scale=float(sm_scale) if sm_scale is not None else 1 / math.sqrt(head_dim_ckv + head_dim_kpe),
                          q_dtype=arrays.as_dtype(q_data_type, "q_data_type", fn),
                          kv_dtype=arrays.as_dtype(kv_data_type, "kv_data_type", fn))

    def run(self, q_nope, q_pe, ckv_cache, kpe_cache, out=None, lse=None, return_lse: bool = False,
            profiler_buffer=None, kv_len=None, page_table=None, return_lse_base_on_e: bool = False):
        """q_nope (nnz_qo, num_heads, 512), q_pe (nnz_qo, num_heads, 64); caches (num_pages, page_size,
        512 / 64). Returns out (nnz_qo, num_heads, 512), or (out, lse); the LSE is base 2 unless
        ``return_lse_base_on_e`` (FlashInfer's default and flag; cuattn's other LSEs are base e)."""
        fn = f"{self._fn}.run"
        p = self._plan
        if p is None:
            raise ValueError(f"{fn}: plan() must be called before run()")
        if profiler_buffer is not None:
            raise UnsupportedError(f"{fn}: profiler_buffer is not supported")
        ctx = arrays.context_of(fn, {"q_nope": q_nope, "q_pe": q_pe, "ckv_cache": ckv_cache, "kpe_cache": kpe_cache})
        if ctx.on_gpu:
            raise UnsupportedError(f"{fn}: MLA has no GPU kernel yet; NumPy arrays run the reference path "
                                   f"(cuattn.mla's docstring says what runs)")
        qn, qp = arrays.host_array(q_nope, "q_nope", fn), arrays.host_array(q_pe, "q_pe", fn)
        ckv, kpe = arrays.host_array(ckv_cache, "ckv_cache", fn), arrays.host_array(kpe_cache, "kpe_cache", fn)
        rows, h = int(p["qo"][-1]), p["num_heads"]
        for x, name, want in ((qn, "q_nope", (rows, h, HEAD_DIM_CKV)), (qp, "q_pe", (rows, h, HEAD_DIM_KPE))):
            if x.shape != want:
                raise ValueError(f"{fn}: {name} must have shape {want}, got {x.shape}")
            if x.dtype != p["q_dtype"]:
                raise ValueError(f"{fn}: {name} must have dtype {p['q_dtype']} (q_data_type of plan), got {x.dtype}")
        for x, name, d in ((ckv, "ckv_cache", HEAD_DIM_CKV), (kpe, "kpe_cache", HEAD_DIM_KPE)):
            if x.ndim != 3 or x.shape[1:] != (p["page_size"], d):
                raise ValueError(f"{fn}: {name} must have shape (num_pages, page_size={p['page_size']}, {d}), "
                                 f"got {x.shape}")
            if x.dtype != p["kv_dtype"]:
                raise ValueError(f"{fn}: {name} must have dtype {p['kv_dtype']} (kv_data_type of plan), got {x.dtype}")
        if len(p["kv_indices"]) and p["kv_indices"][:p["kv_indptr"][-1]].max(initial=-1) >= min(len(ckv), len(kpe)):
            raise ValueError(f"{fn}: kv_indices must be < num_pages of the caches ({min(len(ckv), len(kpe))})")
        o = np.zeros((rows, h, HEAD_DIM_CKV), np.float32)
        s_out = np.full((rows, h), -np.inf, np.float32)
        for b in range(len(p["qo"]) - 1):
            q0, q1 = int(p["qo"][b]), int(p["qo"][b + 1])
            n = int(p["kv_len"][b])
            if q1 == q0 or n == 0:
                continue
            ids = p["kv_indices"][p["kv_indptr"][b]:p["kv_indptr"][b + 1]]
            c = ckv[ids].reshape(-1, HEAD_DIM_CKV)[:n].astype(np.float32)
            k = kpe[ids].reshape(-1, HEAD_DIM_KPE)[:n].astype(np.float32)
            s = (np.einsum("ihd,jd->hij", qn[q0:q1].astype(np.float32), c)
                 + np.einsum("ihd,jd->hij", qp[q0:q1].astype(np.float32), k)) * p["sm_scale"]
            if p["causal"]:
                allowed = np.arange(n)[None, :] <= np.arange(q1 - q0)[:, None] + (n - (q1 - q0))
                s = np.where(allowed[None], s, -np.inf)
            m = s.max(-1, keepdims=True)
            e = np.exp(s - m)
            z = e.sum(-1, keepdims=True)
            o[q0:q1] = np.einsum("hij,jd->ihd", e / z, c)
            s_out[q0:q1] = (m[..., 0] + np.log(z[..., 0])).T
        if not return_lse_base_on_e:
            s_out = s_out / np.float32(math.log(2))
        return arrays.host_results(ctx, o, s_out, out, lse, return_lse, p["q_dtype"], fn)

    forward = run
