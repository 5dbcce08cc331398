"""MLA (DeepSeek's multi-head latent attention) on a paged latent cache: FlashInfer's
``BatchMLAPagedAttentionWrapper`` and ``append_paged_mla_kv_cache``.

Each token stores one compressed latent vector (``ckv``, head_dim_ckv = 512 in DeepSeek V2/V3) and a
RoPE key part (``kpe``, 64) instead of per-head K and V. With the projections absorbed, every query
head scores against the same (ckv, kpe) of a token, ``s = (q_nope . ckv + q_pe . kpe) * sm_scale``,
and reads the same ckv as its value: ``out = softmax(s) . ckv``.

NumPy inputs run the reference path (float32 accumulation). GPU inputs run ``kernels_cu/mla.cu``
(backend "fa2": mma.sync tensor cores, sm_80+; q fp16 / bf16, the caches of q's dtype or fp8 e4m3 / e5m2
with run()'s ``k_scale`` / ``v_scale``, converted to q's dtype in shared memory; an fp32 q runs the 16-bit
kernel of ``qcast.kernel_dtype``, q_nope and q_pe converted into 16-bit copies and the output back into
the fp32 out around the launch, as in decode and prefill: ``qcast.py``) or, on sm_90,
``kernels_cu/mla_sm90.cu`` (backend "fa3", ``mla_sm90.py``: wgmma, warp-specialised; 16-bit caches): plan() builds
plan.py's prefill work list over (request, tile of 64 packed query rows = token x head, kv piece),
splitting long kv when the items alone leave SMs idle (plan.choose_prefill_chunk), and uploads it
with the page table into ``plan_buffers.PlanBuffers`` (fixed addresses with ``use_cuda_graph=True``); run()
launches the attention kernel and, for split items, its merge kernel. Appending to the latent cache
on the GPU goes through the paged-cache append kernel, a (ckv, kpe) pair as one-head caches.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import arrays, fp8, jit, mla_sm90, plan as _plan, plan_buffers as _buffers, qcast
from .errors import UnsupportedError
from .page import append_paged_kv_cache
from .params import Params
from .prefill_checks import _host_kv

HEAD_DIM_CKV, HEAD_DIM_KPE = 512, 64
_SOURCE = "mla.cu"
_ENTRY = "cuattn_mla_paged"
_MERGE_ENTRY = "cuattn_mla_merge"
BLOCK_M, BLOCK_N, _THREADS = 64, 32, 256      # mla.cu's tile (packed query rows x keys) and block
_MERGE_THREADS = 128
_LN2 = math.log(2)


_KV_FP8 = {"": 0, "e4m3": 1, "e5m2": 2}     # mla.cu KV_FP8


@dataclass(frozen=True)
class MLASpec:
    dtype: str          # "f16" | "bf16": q and out (and the ckv / kpe caches unless kv)
    stages: int = 2     # key tiles in the cp.async ring (stages_for: what fits the arch's shared memory)
    kv: str = ""        # "": caches of dtype; "e4m3" | "e5m2": fp8 caches, converted to dtype in shared memory
    source = _SOURCE
    entry, threads, block_n, backend = _ENTRY, _THREADS, BLOCK_N, "fa2"   # as mla_sm90.Sm90MLASpec's

    @property
    def name(self) -> str:   # "mla_ckv512_kpe64_qf16_bm64_bn32_s2", fp8: "mla_ckv512_kpe64_qbf16_kve4m3_bm64_bn32_s4"
        kv = f"_kv{self.kv}" if self.kv else ""
        return f"mla_ckv{HEAD_DIM_CKV}_kpe{HEAD_DIM_KPE}_q{self.dtype}{kv}_bm{BLOCK_M}_bn{BLOCK_N}_s{self.stages}"

    def defines(self) -> tuple[str, ...]:
        return (f"-DDTYPE=cuattn::{self.dtype}", f"-DSTAGES={self.stages}", f"-DKV_FP8={_KV_FP8[self.kv]}")

    @property
    def archs(self) -> tuple[str, ...] | None:    # cli.shipped_specs: more than 2 stages need Hopper's shared memory
        return ("sm_90a",) if self.stages > 2 else None

    @property
    def smem_bytes(self) -> int:
        """mla.cu SMEM_BYTES: Q tile + the copy ring (16-bit: STAGES tiles, rows padded by 8; fp8: STAGES plain
        byte tiles and one converted 16-bit tile) + scores."""
        d = HEAD_DIM_CKV + HEAD_DIM_KPE
        tile = BLOCK_N * (d + 8) * 2
        ring = self.stages * BLOCK_N * d + tile if self.kv else self.stages * tile
        return BLOCK_M * (d + 8) * 2 + ring + BLOCK_M * (BLOCK_N + 8) * 4


MIN_PIECE = 256   # keys per split-KV piece at least: a piece reads 288 KiB, its partial rows (<= 64 x 2 KiB) cost less


def _choose_chunk(extents: np.ndarray, num_sms: int, max_slots: int | None, block_n: int = BLOCK_N,
                  top: int | None = None, total: int | None = None) -> int:
    """Keys per piece (0: none split): plan.choose_chunk over the (request, query tile) items with one
    resident CTA per SM (the kernel takes 156-193 KiB of shared memory) and pieces of >= MIN_PIECE
    keys (a batch of one 32k request: 128 pieces; plan.choose_prefill_chunk's 512 would leave half of
    132 SMs idle); then doubled until the partial slots fit ``max_slots`` (a fixed workspace). ``top``,
    ``total``: ``extents.max()``, ``extents.sum()`` when the caller has them."""
    if top is None and len(extents):
        top = int(extents.max())
    chunk = _plan.choose_chunk(extents, 1, num_sms, 1, block_n, min_chunk=MIN_PIECE, max_len=top, total=total)
    if chunk and max_slots is not None:
        while int(np.where(extents > chunk, -(-extents // chunk), 0).sum()) > max_slots:
            chunk *= 2
    return 0 if chunk and chunk >= top else chunk


def shipped_specs() -> list[MLASpec]:
    return [MLASpec(d, stages_for(a, kv), kv) for d in ("f16", "bf16") for kv in _KV_FP8 for a in ("sm_80", "sm_90a")]


def stages_for(arch: str, kv: str = "") -> int:
    """Key-tile stages of the kernel a device runs: on sm_90 (227 KiB of shared memory) 3, or 4 of an fp8
    cache (tiles of half the bytes); else 2 (sm_80's 163 KiB)."""
    return (4 if kv else 3) if arch.startswith("sm_90") else 2


PARAMS = Params.define(_ENTRY, "work:p kv_chunk:p qo_indptr:p kv_indptr:p kv_indices:p kv_len_arr:p q_nope:p q_pe:p "
                               "ckv_cache:p kpe_cache:p out:p lse:p part_o:p part_lse:p num_heads:i page_size:i "
                               "causal:i qn_s_tok:q qn_s_head:q qp_s_tok:q qp_s_head:q ckv_s_page:q ckv_s_tok:q "
                               "kpe_s_page:q kpe_s_tok:q o_s_tok:q o_s_head:q scale_log2:f lse_scale:f k_scale:f "
                               "v_scale:f k_scales:p v_scales:p")
MERGE_PARAMS = Params.define(_MERGE_ENTRY, "merge:p qo_indptr:p part_o:p part_lse:p out:p lse:p num_heads:i "
                                           "o_s_tok:q o_s_head:q lse_scale:f")


def append_paged_mla_kv_cache(append_ckv, append_kpe, batch_indices, positions, ckv_cache, kpe_cache, kv_indices,
                              kv_indptr, kv_last_page_len, *, kv_scale=None, kv_data_type=None,
                              stream: Any = None) -> None:
    """Write appended tokens' latent vectors into their page slots (in place; FlashInfer's signature).

    Parameters
    ----------
    append_ckv : array, shape (nnz, head_dim_ckv); append_kpe : array, shape (nnz, head_dim_kpe)
        dtype of the caches, or float16 / bfloat16 for an fp8 cache: stored as round(x / kv_scale)
        (nearest even), saturating at +-(max finite) (448 e4m3, 57344 e5m2).
    batch_indices, positions : int32 arrays, shape (nnz,) (``get_batch_indices_positions``)
    ckv_cache : array, shape (num_pages, page_size, head_dim_ckv); kpe_cache : (num_pages, page_size,
        head_dim_kpe); float16, bfloat16, float8_e4m3fn / float8_e5m2 (or a uint8 view of those)
    kv_indices, kv_indptr, kv_last_page_len : the page table, already covering the appended positions
    kv_scale : float or float32 array of shape (1,), optional
        Beyond FlashInfer (whose MLA append has no fp8 scale; vLLM's ``concat_and_cache_mla`` takes one):
        the fp8 latent cache's scale, stored value x kv_scale = real value, for ckv and kpe alike; read
        it back with ``run(k_scale=kv_scale, v_scale=kv_scale)``. None: 1.
    kv_data_type : dtype, optional
        The fp8 type of a uint8 cache ("float8_e4m3fn" or "float8_e5m2").
    """
    fn = "append_paged_mla_kv_cache"
    if kv_scale is not None:
        cdt = (arrays.device_tensor(ckv_cache, "ckv_cache", fn).dtype if arrays.is_device_array(ckv_cache, "ckv_cache", fn)
               else arrays.host_array(ckv_cache, "ckv_cache", fn).dtype)
        if not (fp8.is_fp8(cdt) or cdt == np.uint8):
            raise ValueError(f"{fn}: kv_scale must be None unless the latent cache is fp8, got a {cdt} cache")
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
                              k_scale=kv_scale, v_scale=kv_scale, kv_data_type=kv_data_type, stream=stream)


class BatchMLAPagedAttentionWrapper:
    """MLA attention over a paged latent cache (FlashInfer's API): ``plan()`` once per step, ``run()``
    per layer. NumPy inputs run the reference path; GPU inputs run ``kernels_cu/mla.cu``.

    Parameters
    ----------
    float_workspace_buffer : array, optional
        GPU scratch for split-KV partial rows (any framework and dtype); cuattn allocates its own
        when omitted (128 MiB with ``use_cuda_graph``).
    use_cuda_graph : bool
        The first GPU ``plan()`` fixes the plan buffers' addresses and capacities, the grid and the
        kernel, so a captured ``run()`` replays correctly after later plans that fit them.
    qo_indptr, kv_indptr, kv_indices, kv_len_arr : accepted as FlashInfer's (cuattn keeps its own plan
        buffers)
    backend : "auto" | "fa2" | "fa3"
        The GPU kernel: "fa2" mla.cu (sm_80+); "fa3" the Hopper kernel mla_sm90.cu (UnsupportedError at a
        GPU plan() where it has none: ``mla_sm90.unsupported_reason``); "auto" fa3 where it has a kernel,
        else fa2. ``describe()`` names the kernel a plan runs.
    """

    _fn = "BatchMLAPagedAttentionWrapper"

    def __init__(self, float_workspace_buffer: Any = None, use_cuda_graph: bool = False, qo_indptr: Any = None,
                 kv_indptr: Any = None, kv_indices: Any = None, kv_len_arr: Any = None, backend: str = "auto"):
        if backend not in ("auto", "fa2", "fa3"):
            raise ValueError(f"{self._fn}: backend must be 'auto', 'fa2' or 'fa3', got {backend!r}")
        self._plan = None
        self._backend = backend
        self._bufs = _buffers.PlanBuffers(self._fn, float_workspace_buffer, use_cuda_graph)
        self._f32q = qcast.F32Q(self._fn, use_cuda_graph)     # an fp32 q's 16-bit copies (qcast.py)
        self._device_memo: dict[tuple, tuple] = {}    # (backend, spec, run spec) by device and dtypes (_plan_device)

    def plan(self, qo_indptr, kv_indptr, kv_indices, kv_len_arr, num_heads: int, head_dim_ckv: int,
             head_dim_kpe: int, page_size: int, causal: bool, sm_scale: float, q_data_type, kv_data_type,
             use_profiler: bool = False, *, fixed_split_size: int | None = None,
             disable_split_kv: bool = False) -> None:
        """Plan a batch: request i's queries are ``q[qo_indptr[i]:qo_indptr[i+1]]`` and its keys the
        first ``kv_len_arr[i]`` slots of pages ``kv_indices[kv_indptr[i]:kv_indptr[i+1]]``; ``causal``
        aligns bottom-right (query t sees keys <= t + kv_len - qo_len). ``q_data_type``: float16, bfloat16 or
        float32 (the GPU runs the 16-bit kernel of ``qcast.kernel_dtype``: bfloat16 for a bfloat16 cache, else
        float16; q converted, saturating, at run(); out float32). ``kv_data_type``: q_data_type's (a float32 q:
        float16 or bfloat16), or float8_e4m3fn / float8_e5m2 (a uint8 cache is read as that type; run()'s
        k_scale / v_scale apply).

        With a GPU (the device of ``kv_indices``, else the current one) the work list is built and
        uploaded here, on the current stream of ``kv_indices``' framework. ``fixed_split_size`` cuts
        every (request, query tile) into pieces of that many keys (whole key tiles: 32 keys fa2, 64 fa3);
        ``disable_split_kv=True`` never splits; by default plan.choose_prefill_chunk decides."""
        fn = f"{self._fn}.plan"
        _plan.check_fixed_split(fn, fixed_split_size)
        if use_profiler:
            raise UnsupportedError(f"{fn}: use_profiler=True is not supported")
        if (head_dim_ckv, head_dim_kpe) != (HEAD_DIM_CKV, HEAD_DIM_KPE):
            raise UnsupportedError(f"{fn}: head_dim_ckv, head_dim_kpe must be ({HEAD_DIM_CKV}, {HEAD_DIM_KPE}) "
                                   f"(DeepSeek V2/V3), got ({head_dim_ckv}, {head_dim_kpe})")
        for name, val in (("num_heads", num_heads), ("page_size", page_size)):
            if isinstance(val, bool) or not isinstance(val, (int, np.integer)) or val < 1:
                raise ValueError(f"{fn}: {name} must be a positive int, got {val!r}")
        # -- host copies read once, no int64 copy of the page ids (their maximum and sign in one pass)
        qo = _plan.host_ints(qo_indptr, "qo_indptr", fn).astype(np.int64)
        kp = _plan.host_ints(kv_indptr, "kv_indptr", fn).astype(np.int64)
        idx = _plan.host_ints(kv_indices, "kv_indices", fn)
        kvl = _plan.host_ints(kv_len_arr, "kv_len_arr", fn).astype(np.int64)
        batch = len(qo) - 1
        qo_lens, pages = qo[1:] - qo[:-1], kp[1:] - kp[:-1]        # np.diff, without its wrapper's cost
        qo_range = _plan.int_bounds(qo_lens) if batch > 0 else None
        if batch < 0 or qo[0] != 0 or (qo_range and qo_range[0] < 0):
            raise ValueError(f"{fn}: qo_indptr must start at 0 and be non-decreasing, got {qo[:8]}")
        if len(kp) != batch + 1 or len(kvl) != batch or kp[0] != 0 or (batch and pages.min() < 0):
            raise ValueError(f"{fn}: kv_indptr (batch + 1 = {batch + 1}, from 0, non-decreasing) and kv_len_arr "
                             f"(batch) must describe qo_indptr's batch, got {len(kp)} and {len(kvl)} entries")
        n_idx = int(kp[-1])
        hi = _plan.max_index(idx)           # None: a negative id
        if len(idx) < n_idx or hi is None:
            raise ValueError(f"{fn}: kv_indices must hold kv_indptr[-1] = {kp[-1]} non-negative page ids, got "
                             f"{len(idx)} with min {idx.min() if len(idx) else None}")
        if batch and (kvl.min() < 0 or (_plan._div(kvl + (page_size - 1), page_size) != pages).any()):
            b = int(np.argmax((kvl < 0) | (-(-kvl // page_size) != pages)))
            raise ValueError(f"{fn}: kv_len_arr must fit the request's pages (ceil(kv_len / page_size) == pages), "
                             f"got kv_len_arr[{b}]={int(kvl[b])} with {int(pages[b])} pages of {page_size}")
        if causal and batch and (qo_lens > kvl).any():
            raise ValueError(f"{fn}: with causal=True every request needs qo_len <= kv_len")
        n_idx = int(kp[-1])
        q_dt, kv_dt = arrays.as_dtype(q_data_type, "q_data_type", fn), arrays.as_dtype(kv_data_type, "kv_data_type", fn)
        if fp8.is_fp8(q_dt):
            raise UnsupportedError(f"{fn}: q_data_type must be float16, bfloat16 or float32: q and out stay "
                                   f"16-bit (or float32) over an fp8 cache, got {q_dt}")
        p = _plan.Plan(self._fn, batch, int(num_heads), 1, head_dim_ckv + head_dim_kpe, q_dt, kv_dt,
                       float(sm_scale) if sm_scale is not None else 1 / math.sqrt(head_dim_ckv + head_dim_kpe),
                       None, bool(causal), int(page_size), kv_lens=kvl, qo_indptr=qo, qo_lens=qo_lens,
                       qo_range=qo_range, kv_indptr=kp, kv_indices=idx.astype(np.int32),
                       max_page=(hi if len(idx) == n_idx else int(idx[:n_idx].max()) if n_idx else -1))
        self._plan = None
        self._plan_device(fn, p, kv_indices, fixed_split_size, disable_split_kv)
        self._plan = p

    def _plan_device(self, fn: str, p: dict, like, fixed_split_size, disable_split_kv: bool) -> None:
        """The GPU half of plan(): the spec for the device, the work list (plan.py's prefill items: a
        tile is 64 packed rows, token x head, of one request; long kv cut into pieces) and one upload
        of it with the page table. No GPU: a NumPy plan. A dtype the kernel lacks is refused at run()."""
        bufs = self._bufs
        device = bufs.device_for(like)
        p.device = device
        self._f32q.plan(p, (HEAD_DIM_CKV, HEAD_DIM_KPE), HEAD_DIM_CKV)    # fp32 q: copies of q_nope, q_pe and out
        if device is None:
            return
        # -- the backend and kernels of these dtypes on this device: as the last plan's (a serving loop's steady
        #    state); a refusal (UnsupportedError) is never stored, so it comes again
        key = (device, p.q_dtype, p.kv_dtype)
        hit = self._device_memo.get(key)
        if hit is None:
            short = _q_short(p)
            arch, kv = jit.device_arch(device), _kv_short(p)
            backend = mla_sm90.resolve_backend(self._backend, fn, arch, short,
                                               arrays.SHORT_NAME.get(arrays.logical_dtype(p.kv_dtype)))
            if backend == "fa2" and (short not in ("f16", "bf16") or kv is None):
                hit = (backend, None, None)
            else:
                # -- the attention kernel (mla.cu or mla_sm90.cu: one work list, page table and partial layout)
                #    and mla.cu's spec, whose merge kernel joins split pieces of either
                fa2 = MLASpec(short, stages_for(arch, kv), kv)
                hit = (backend, fa2, fa2 if backend == "fa2" else mla_sm90.schedule_specs(short))
            _plan.memo_put(self._device_memo, key, hit)
        backend, fa2, spec = hit
        if fa2 is None:
            return
        p.spec = fa2
        fa3_specs, spec = (spec, spec[0]) if backend == "fa3" else (None, spec)    # (one block_n: the split's unit)
        h, qo_lens = p.num_qo_heads, p.qo_lens
        items = _plan.prefill_items(qo_lens, p.kv_lens, h, BLOCK_M, p.causal, p.qo_range)
        # -- the extents' range (and sum, for the scheduler's choice), read once: the split choice and the work list
        stats = _plan.int_bounds(items[2], fixed_split_size is None and not disable_split_kv) if len(items[2]) \
            else (0, 0, 0)
        slot_floats = BLOCK_M * (HEAD_DIM_CKV + 1)          # a slot: a tile's fp32 rows and their LSEs
        sms = _plan.num_sms(device)

        def auto():
            c = _choose_chunk(items[2], sms, bufs.max_partial(slot_floats), spec.block_n, stats[1], stats[2])
            return c, _plan.split_reason(len(items[2]), sms, c)
        chunk, why = _plan.split_choice(disable_split_kv, fixed_split_size, spec.block_n, auto)
        wl = _plan.prefill_work_list(qo_lens, p.kv_lens, h, BLOCK_M, spec.block_n, p.causal, chunk, items, stats[:2])
        if len(wl.work) > 2 ** 31 - 1:
            raise UnsupportedError(f"{fn}: {len(wl.work)} work items exceed the grid limit")
        if fa3_specs is not None and len(wl.work):
            # -- the fa3 schedule. Graph mode: the first plan's (its kernel must stay), chosen by the tiles' rows
            #    alone (a capture's first plan may be a short warm-up batch; its rows per request are the step's)
            rows_per_tile = h * int(p.qo_indptr[-1]) / len(items[2])
            if bufs.graph and bufs.kernel is not None:
                spec = fa3_specs[int(bufs.kernel[0] == fa3_specs[1].name)]
            else:
                keys = math.inf if bufs.graph else (stats[2] if len(stats) > 2 else int(items[2].sum())) / len(wl.work)
                spec = mla_sm90.pick_schedule(fa3_specs, rows_per_tile, keys)
        segments = [("kv_chunk", (wl.chunk,), 0), ("qo_indptr", p.qo_indptr, 0),       # (int64 values: the
                    ("kv_indptr", p.kv_indptr, 0), ("kv_len", p.kv_lens, 0),             # staging copy casts)
                    ("kv_indices", p.kv_indices, 0), ("work", wl.work.reshape(-1), -1),
                    ("merge", wl.merge.reshape(-1), -1)]
        kernel = (spec.name, h, p.page_size, p.causal, p.sm_scale) if bufs.graph else None    # (graph mode's check)
        ptrs = bufs.upload(fn, segments, kernel, like)
        ptrs.update(bufs.partial(fn, slot_floats, wl.num_slots, BLOCK_M * HEAD_DIM_CKV))
        p.run_spec, p.backend, p.work_list, p.meta, p.split_why = spec, backend, wl, ptrs, why
        p.grid_work = bufs.rows("work", len(wl.work), _plan.PREFILL_COLS)
        p.grid_merge = bufs.rows("merge", len(wl.merge), _plan.PREFILL_COLS)

    def describe(self) -> str:
        """What the last plan() runs: the kernel, its work items and the split-KV decision."""
        p = self._plan
        if p is None:
            return f"{self._fn}: not planned"
        batch = len(p.qo_indptr) - 1
        lines = [f"{self._fn}: batch {batch}, {int(p.qo_indptr[-1])} queries x {p.num_qo_heads} heads, page_size "
                 f"{p.page_size}, {'causal' if p.causal else 'full'}"]
        if p.meta is None:
            return "\n".join(lines + ["NumPy reference path (no GPU kernel planned)"])
        wl = p.work_list
        lines.append(f"kernel: {p.run_spec.name} (backend {p.backend}), tiles of {BLOCK_M} packed rows (token x "
                     f"head) x {p.run_spec.block_n} keys")
        lines.append(f"work: {len(wl.work)} CTAs on {_plan.num_sms(p.device)} SMs"
                     + (f"; grid padded to {p.grid_work} (CUDA graph)" if self._bufs.graph else ""))
        return "\n".join(lines + _plan.describe_split(wl, p.run_spec.block_n, p.split_why))

    def run(self, q_nope, q_pe, ckv_cache, kpe_cache, out=None, lse=None, return_lse: bool = False,
            profiler_buffer=None, kv_len=None, page_table=None, return_lse_base_on_e: bool = False, *,
            k_scale=None, v_scale=None):
        """MLA attention for the planned batch.

        Parameters
        ----------
        q_nope : array, shape (nnz_qo, num_heads, 512); q_pe : array, shape (nnz_qo, num_heads, 64)
            dtype q_data_type; last dimension contiguous. NumPy runs the reference path; CuPy or any CUDA
            array exporting ``__dlpack__`` runs the kernel (q float16 / bfloat16: base addresses and
            strides 16-byte aligned; float32: any, converted into the plan's 16-bit copies first).
        ckv_cache : array, shape (num_pages, page_size, 512); kpe_cache : (num_pages, page_size, 64)
            dtype kv_data_type (q's, or fp8: float8_e4m3fn / float8_e5m2 arrays, or uint8 read as
            kv_data_type).
        out : array, optional, shape (nnz_qo, num_heads, 512), dtype of q (float32 for a float32 q: the 16-bit
            kernel's output converted into it): written in place.
        lse : float32 array, optional, shape (nnz_qo, num_heads), contiguous: written in place.
        kv_len : int array, optional, shape (batch,); page_table : int array, optional, shape (batch,
            max_num_pages)
            FlashInfer's cutlass backend reads the batch here; cuattn's kernel reads the batch planned in
            plan(), so given ones must restate it (kv_len == kv_len_arr, row b of page_table starting with
            request b's pages) or ValueError is raised. Checking them costs a host copy (a sync for GPU
            arrays; refused during a CUDA-graph capture): leave them None in a serving loop.
        return_lse_base_on_e : bool
            The LSE is base 2 (FlashInfer's MLA default) unless this is True (cuattn's other LSEs
            are base e).
        k_scale, v_scale : float, or float32 array of shape (1,), optional
            Beyond FlashInfer (its MLA wrapper takes no scales): stored value x scale = real value, as in
            cuattn's decode / prefill ``run``. ``k_scale`` scales the key [ckv | kpe] (the logits),
            ``v_scale`` the value ckv (the output); a latent cache stored with one scale passes it as both.
            A CUDA array is read by the kernel (no sync; values unchecked); host values must be positive and
            finite. Any cache dtype; None: 1.

        Returns
        -------
        out, or (out, lse) with ``return_lse``; a row whose request has no keys gives 0 and LSE -inf.
        """
        fn = f"{self._fn}.run"
        p = self._plan
        if p is None:
            raise ValueError(f"{fn}: plan() must be called before run()")
        if profiler_buffer is not None:
            raise UnsupportedError(f"{fn}: profiler_buffer is not supported")
        ctx = arrays.context_of(fn, {"q_nope": q_nope, "q_pe": q_pe, "ckv_cache": ckv_cache, "kpe_cache": kpe_cache})
        arrays.writable(out, "out", fn)
        arrays.writable(lse, "lse", fn)
        if kv_len is not None or page_table is not None:
            _check_batch_args(fn, p, kv_len, page_table, ctx)
        scales = (fp8.parse_scale(k_scale, "k_scale", 1, fn, on_gpu=ctx.on_gpu),
                  fp8.parse_scale(v_scale, "v_scale", 1, fn, on_gpu=ctx.on_gpu))
        if ctx.on_gpu:
            return self._run_gpu(ctx, fn, p, q_nope, q_pe, ckv_cache, kpe_cache, out, lse, return_lse,
                                 return_lse_base_on_e, scales)
        qn, qp = arrays.host_array(q_nope, "q_nope", fn), arrays.host_array(q_pe, "q_pe", fn)
        ckv, kpe = arrays.host_array(ckv_cache, "ckv_cache", fn), arrays.host_array(kpe_cache, "kpe_cache", fn)
        rows, h = int(p.qo_indptr[-1]), p.num_qo_heads
        for x, name, want in ((qn, "q_nope", (rows, h, HEAD_DIM_CKV)), (qp, "q_pe", (rows, h, HEAD_DIM_KPE))):
            if x.shape != want:
                raise ValueError(f"{fn}: {name} must have shape {want}, got {x.shape}")
            if x.dtype != p.q_dtype:
                raise ValueError(f"{fn}: {name} must have dtype {p.q_dtype} (q_data_type of plan), got {x.dtype}")
        for x, name, d in ((ckv, "ckv_cache", HEAD_DIM_CKV), (kpe, "kpe_cache", HEAD_DIM_KPE)):
            if x.ndim != 3 or x.shape[1:] != (p.page_size, d):
                raise ValueError(f"{fn}: {name} must have shape (num_pages, page_size={p.page_size}, {d}), "
                                 f"got {x.shape}")
            if x.dtype != p.kv_dtype and not (x.dtype == np.uint8 and fp8.is_fp8(p.kv_dtype)):
                raise ValueError(f"{fn}: {name} must have dtype {p.kv_dtype} (kv_data_type of plan)"
                                 + (" or uint8" if fp8.is_fp8(p.kv_dtype) else "") + f", got {x.dtype}")
        if p.max_page >= min(len(ckv), len(kpe)):
            raise ValueError(f"{fn}: kv_indices must be < num_pages of the caches ({min(len(ckv), len(kpe))})")
        ks, vs = scales
        o = np.zeros((rows, h, HEAD_DIM_CKV), np.float32)
        s_out = np.full((rows, h), -np.inf, np.float32)
        for b in range(len(p.qo_indptr) - 1):
            q0, q1 = int(p.qo_indptr[b]), int(p.qo_indptr[b + 1])
            n = int(p.kv_lens[b])
            if q1 == q0 or n == 0:
                continue
            ids = p.kv_indices[p.kv_indptr[b]:p.kv_indptr[b + 1]]
            c_raw, k_raw = ckv[ids].reshape(-1, HEAD_DIM_CKV)[:n], kpe[ids].reshape(-1, HEAD_DIM_KPE)[:n]
            # -- real values (fp8 bits viewed as kv_data_type, times the scales): key [ckv | kpe] x k_scale, value ckv x v_scale
            c = _host_kv(c_raw, p, ks, 0).astype(np.float32)
            k = _host_kv(k_raw, p, ks, 0).astype(np.float32)
            v = _host_kv(c_raw, p, vs, 0).astype(np.float32)
            s = (np.einsum("ihd,jd->hij", qn[q0:q1].astype(np.float32), c)
                 + np.einsum("ihd,jd->hij", qp[q0:q1].astype(np.float32), k)) * p.sm_scale
            if p.causal:
                allowed = np.arange(n)[None, :] <= np.arange(q1 - q0)[:, None] + (n - (q1 - q0))
                s = np.where(allowed[None], s, -np.inf)
            m = s.max(-1, keepdims=True)
            e = np.exp(s - m)
            z = e.sum(-1, keepdims=True)
            o[q0:q1] = np.einsum("hij,jd->ihd", e / z, v)
            s_out[q0:q1] = (m[..., 0] + np.log(z[..., 0])).T
        if not return_lse_base_on_e:
            s_out = s_out / np.float32(math.log(2))
        return arrays.host_results(ctx, o, s_out, out, lse, return_lse, p.q_dtype, fn)

    forward = run

    def _run_gpu(self, ctx, fn, p, q_nope, q_pe, ckv_cache, kpe_cache, out, lse, return_lse, base_e, scales):
        if p.device is None or p.meta is None:
            if _q_short(p) not in ("f16", "bf16") or _kv_short(p) is None:
                raise UnsupportedError(f"{fn}: the GPU kernel needs q_data_type float16, bfloat16 or float32 and "
                                       f"kv_data_type q_data_type's (float32 q: float16 or bfloat16) or float8_e4m3fn / "
                                       f"float8_e5m2, got {p.q_dtype} and {p.kv_dtype}")
            raise ValueError(f"{fn}: the plan was made without a GPU; plan() again with a GPU present")
        if p.device != ctx.device:
            raise ValueError(f"{fn}: the arrays must be on the GPU the plan was made for (GPU {p.device}), "
                             f"got GPU {ctx.device}; plan() on that GPU (cupy.cuda.Device(i) current)")
        _buffers.refuse_capture(fn, self._bufs.graph, ctx.stream)
        rows, h = int(p.qo_indptr[-1]), p.num_qo_heads
        ts = {}
        for x, name, want, dt in ((q_nope, "q_nope", (rows, h, HEAD_DIM_CKV), p.q_dtype),
                                  (q_pe, "q_pe", (rows, h, HEAD_DIM_KPE), p.q_dtype),
                                  (ckv_cache, "ckv_cache", None, p.kv_dtype),
                                  (kpe_cache, "kpe_cache", None, p.kv_dtype)):
            t = arrays.device_tensor(x, name, fn)
            if want is None:
                d = HEAD_DIM_CKV if name == "ckv_cache" else HEAD_DIM_KPE
                if t.ndim != 3 or t.shape[1:] != (p.page_size, d):
                    raise ValueError(f"{fn}: {name} must have shape (num_pages, page_size={p.page_size}, {d}), "
                                     f"got {t.shape}")
            elif t.shape != want:
                raise ValueError(f"{fn}: {name} must have shape {want}, got {t.shape}")
            if not arrays.same_storage(t.dtype, dt):
                raise ValueError(f"{fn}: {name} must have dtype {dt} ({'q' if want else 'kv'}_data_type of plan), "
                                 f"got {t.dtype}")
            if want is None or not self._f32q.active:     # (an fp32 q: the kernel reads its aligned copy)
                arrays.check_aligned(t, name, 16, fn)
            ts[name] = t
        num_pages = min(ts["ckv_cache"].shape[0], ts["kpe_cache"].shape[0])
        if p.max_page >= num_pages:        # the page ids' maximum, found once in plan()
            raise ValueError(f"{fn}: kv_indices must be < num_pages of the caches ({num_pages}), got {p.max_page}")
        if out is None:
            out = arrays.empty(ctx, (rows, h, HEAD_DIM_CKV), p.q_dtype)
        ot = arrays.device_tensor(out, "out", fn)
        if ot.shape != (rows, h, HEAD_DIM_CKV) or not arrays.same_storage(ot.dtype, p.q_dtype) \
                or ot.device != ctx.device:
            raise ValueError(f"{fn}: out must be a ({rows}, {h}, {HEAD_DIM_CKV}) {p.q_dtype} array on GPU "
                             f"{ctx.device}, got {ot.shape} {ot.dtype} on GPU {ot.device}")
        if not self._f32q.active:
            arrays.check_aligned(ot, "out", 8, fn)
        if lse is None and return_lse:
            lse = arrays.empty(ctx, (rows, h), np.float32)
        lse_ptr = 0
        if lse is not None:
            lt = arrays.device_tensor(lse, "lse", fn)
            if lt.shape != (rows, h) or lt.dtype != np.float32 or not lt.is_contiguous() or lt.device != ctx.device:
                raise ValueError(f"{fn}: lse must be a contiguous ({rows}, {h}) float32 array on GPU {ctx.device}, "
                                 f"got {lt.shape} {lt.dtype}")
            lse_ptr = lt.ptr
        if self._f32q.active:   # fp32 q: the kernels read and write 16-bit copies (qcast.py)
            (ts["q_nope"], ts["q_pe"]), ok = self._f32q.begin_many(
                ctx, [(ts["q_nope"].ptr, ts["q_nope"].strides), (ts["q_pe"].ptr, ts["q_pe"].strides)], ot.ptr, ot.strides)
            self._launch(ctx, p, ts, ok, lse_ptr, _LN2 if base_e else 1.0, scales)
            self._f32q.finish(ctx)
        else:
            self._launch(ctx, p, ts, ot, lse_ptr, _LN2 if base_e else 1.0, scales)
        o = arrays.export(ctx, out, p.q_dtype)
        return (o, arrays.export(ctx, lse)) if return_lse else o

    def _launch(self, ctx, p, ts, ot, lse_ptr: int, lse_scale: float, scales) -> None:
        spec, meta = p.run_spec, p.meta
        ks, vs = scales
        qn, qp, ckv, kpe = ts["q_nope"], ts["q_pe"], ts["ckv_cache"], ts["kpe_cache"]
        if spec.backend == "fa3":
            mla_sm90.check_cache_strides(ckv, kpe, self._fn)
        if p.grid_work:
            launch = jit.get_launcher(spec, spec.entry, ctx.device, PARAMS.kinds, spec.smem_bytes)
            launch((p.grid_work,), spec.threads, ctx.stream, *PARAMS.pack(
                work=meta["work"], kv_chunk=meta["kv_chunk"], qo_indptr=meta["qo_indptr"],
                kv_indptr=meta["kv_indptr"], kv_indices=meta["kv_indices"], kv_len_arr=meta["kv_len"],
                q_nope=qn.ptr, q_pe=qp.ptr, ckv_cache=ckv.ptr, kpe_cache=kpe.ptr, out=ot.ptr, lse=lse_ptr,
                part_o=meta["part_o"], part_lse=meta["part_lse"], num_heads=p.num_qo_heads,
                page_size=p.page_size, causal=int(p.causal), qn_s_tok=qn.strides[0], qn_s_head=qn.strides[1],
                qp_s_tok=qp.strides[0], qp_s_head=qp.strides[1], ckv_s_page=ckv.strides[0], ckv_s_tok=ckv.strides[1],
                kpe_s_page=kpe.strides[0], kpe_s_tok=kpe.strides[1], o_s_tok=ot.strides[0], o_s_head=ot.strides[1],
                scale_log2=p.sm_scale / _LN2, lse_scale=lse_scale, k_scale=ks.value, v_scale=vs.value,
                k_scales=ks.ptr, v_scales=vs.ptr))
        # -- split items' pieces (graph mode: always, over the merge rows' capacity, so a replay after a
        #    plan that splits merges too)
        if p.grid_merge and (p.work_list.split or self._bufs.graph):
            merge = jit.get_launcher(p.spec, _MERGE_ENTRY, ctx.device, MERGE_PARAMS.kinds)   # mla.cu's
            merge((p.grid_merge, BLOCK_M), _MERGE_THREADS, ctx.stream, *MERGE_PARAMS.pack(
                merge=meta["merge"], qo_indptr=meta["qo_indptr"], part_o=meta["part_o"], part_lse=meta["part_lse"],
                out=ot.ptr, lse=lse_ptr, num_heads=p.num_qo_heads, o_s_tok=ot.strides[0], o_s_head=ot.strides[1],
                lse_scale=lse_scale))


def _q_short(p) -> str | None:
    """The kernels' q dtype of a plan as a short name: q's, or for an fp32 q its 16-bit copy's (qcast)."""
    return arrays.SHORT_NAME.get(arrays.logical_dtype(qcast.kernel_dtype(p.q_dtype, p.kv_dtype)))


def _kv_short(p) -> str | None:
    """The spec's kv of a plan: "" for caches of the kernels' q dtype (``_q_short``), "e4m3" / "e5m2" for fp8,
    None: no kernel."""
    if p.kv_dtype == qcast.kernel_dtype(p.q_dtype, p.kv_dtype):
        return ""
    return arrays.SHORT_NAME[p.kv_dtype] if fp8.is_fp8(p.kv_dtype) else None


def _check_batch_args(fn: str, p, kv_len, page_table, ctx) -> None:
    """run()'s kv_len / page_table (FlashInfer's cutlass backend takes the batch there) must restate the
    planned batch: the kernel reads plan()'s. A host copy of each (refused while capturing a graph)."""
    if ctx.on_gpu and arrays.is_capturing(ctx.stream):
        raise ValueError(f"{fn}: kv_len / page_table are checked against the plan on the host, which a CUDA-graph "
                         f"capture cannot do; pass None (plan() holds the batch)")
    again = "cuattn reads the batch from plan(): plan() again for another batch"
    if kv_len is not None:
        a = np.asarray(arrays.to_host(kv_len, "kv_len", fn))
        if a.shape != (p.batch,) or a.dtype.kind not in "iu" or np.any(a != p.kv_lens):
            raise ValueError(f"{fn}: kv_len must be an integer array equal to plan()'s kv_len_arr "
                             f"{p.kv_lens[:8].tolist()}{'...' if p.batch > 8 else ''}, got {a.dtype} {a.ravel()[:8].tolist()} "
                             f"of shape {a.shape}; {again}")
    if page_table is not None:
        t = np.asarray(arrays.to_host(page_table, "page_table", fn))
        pages = np.diff(p.kv_indptr)
        need = int(pages.max()) if len(pages) else 0
        if t.ndim != 2 or t.dtype.kind not in "iu" or t.shape[0] != p.batch or t.shape[1] < need:
            raise ValueError(f"{fn}: page_table must be an integer array of shape (batch={p.batch}, >= {need} pages), "
                             f"got {t.dtype} {t.shape}")
        used = np.arange(t.shape[1])[None, :] < pages[:, None]       # row b: its first pages[b] entries
        if not np.array_equal(t[used], p.kv_indices[:int(p.kv_indptr[-1])]):
            raise ValueError(f"{fn}: page_table row b must start with plan()'s pages of request b "
                             f"(kv_indices[kv_indptr[b]:kv_indptr[b + 1]]); {again}")

