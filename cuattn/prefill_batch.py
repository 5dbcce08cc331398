"""The prefill batch wrappers' shared machinery (``_BatchPrefillBase``, subclassed in ``prefill.py``).

The "fa2" kernel's parameters and launches (``kernels_cu/prefill.cu``: ``PARAMS``, ``_launch``, and the
merge of split-KV pieces, ``_launch_merge``), plan()'s common half (arguments checked, the variant
resolved, the kernel spec chosen: ``_plan_common``) and device half (backend, work list, one upload into
the plan buffers: ``_plan_device``), ``describe()``, and run()'s shared steps: checks, outputs, variant
arguments, the merge, and the NumPy reference path. Specs and the backend choice: ``prefill_spec.py``.
"""
from __future__ import annotations

import math

import numpy as np

from . import (arrays, fp8, jit, plan as _plan, plan_buffers as _buffers, prefill_ahead, prefill_rope, prefill_sm90, qcast,
               reference, support, variants)
from .params import Params
from .errors import UnsupportedError
from .mask import segment_packbits_host
from .page import check_kv_layout
from .prefill_checks import (DTYPES, _check_group, _check_head_dim_vo, _check_out, _check_q, _host_mask,
                             _kv_short)
from .prefill_spec import PrefillSpec, make_spec, resolve_backend, select_backend

_ENTRY = "cuattn_prefill"
_NUM_THREADS = 128
_SCHED_ZEROS = np.zeros(2, np.int32)   # fa3's persistent item counter (prefill_sm90.cu PERSIST_DYNAMIC): zeros, left zero


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
            page_size: int = 1, pdl: bool = False, scales=(fp8.ONE, fp8.ONE), record: list | None = None) -> None:
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
    if record is not None:          # (prefill_sm90.launch's record)
        record.append((launch, (num_work, num_kv_heads), _NUM_THREADS, args, pdl))
    launch((num_work, num_kv_heads), _NUM_THREADS, ctx.stream, *args, pdl=pdl)


def _launch_merge(ctx, spec, entry: str, meta: dict, num_merge: int, num_kv_heads: int, group: int, out,
                  lse_ptr: int, record: list | None = None) -> None:
    """The merge of split items' pieces (``entry`` of ``spec``'s module): grid (merge rows, kv heads, row
    chunks), one row of the tile per dim_vo / 4 threads of a 128-thread CTA (prefill_tile.cuh merge_pieces).
    (The earlier grid, one CTA per (merge row, kv head) looping over the tile's rows, took 16 us a piece at
    4 tiles x 8 kv heads on an H100: a third of a 128 x 32k split prefill.)"""
    if num_merge == 0 or num_kv_heads == 0:
        return
    launch = jit.get_launcher(spec, entry, ctx.device, MERGE_PARAMS[entry].kinds)
    grid = (num_merge, num_kv_heads, max(1, spec.block_m * spec.dim_vo // 512))
    args = MERGE_PARAMS[entry].pack(merge=meta["merge"], qo_indptr=meta["qo_indptr"], part_o=meta["part_o"],
                                    part_lse=meta["part_lse"], o=out.ptr, lse=lse_ptr, group=group,
                                    o_s_tok=out.strides[0], o_s_head=out.strides[1])
    if record is not None:          # (prefill_sm90.launch's record)
        record.append((launch, grid, 128, args, False))
    launch(grid, 128, ctx.stream, *args)


# ---------------------------------------------------------------------------- batches


class _BatchPrefillBase:
    _fn = "BatchPrefill"

    def __init__(self, float_workspace_buffer=None, kv_layout: str = "NHD", use_cuda_graph: bool = False,
                 backend: str = "auto", **buffers):
        self._kv_layout = check_kv_layout(kv_layout, self._fn)
        self.backend = select_backend(backend, self._fn)     # the backend the last run used (or will use)
        self._backend_req = backend
        self._plan = None
        self._bufs = _buffers.PlanBuffers(self._fn, float_workspace_buffer, use_cuda_graph)
        self._f32q = qcast.F32Q(self._fn, use_cuda_graph)     # an fp32 q's 16-bit copies (qcast.py)
        self._rope = prefill_rope.RopeAhead()                 # ragged fused RoPE: q and K rotated ahead (prefill_rope.py)
        self._ahead = prefill_ahead.RowsAhead()               # fa3: pages / fp8 rows gathered ahead (prefill_ahead.py)
        self._backend_memo: dict[tuple, tuple] = {}   # (backend, kernel spec) by device and spec (_plan_device)
        self._configs: dict[tuple, tuple] = {}        # plan()'s checked configurations (plan.config_key)
        self._runs: dict[tuple, tuple] = {}      # launches of plain GPU run()s by their arrays' layouts (_replay)
        self._runs_plan = None                     # the plan they were recorded on

    def _plan_common(self, fn, qo_indptr, kv_lens, num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo,
                     custom_mask, packed_custom_mask, causal, sm_scale, q_data_type, kv_data_type, paged, options,
                     page_size=None):
        qo = _plan.host_ints(qo_indptr, "qo_indptr", fn).astype(np.int64)
        qo_lens = qo[1:] - qo[:-1]          # np.diff, without its wrapper's cost
        qo_range = _plan.int_bounds(qo_lens) if len(qo_lens) else None
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
        # -- ragged fused RoPE over keys many query tiles share: q and K rotated once per run, the kernel without it
        prepass = not paged and not self._bufs.graph and spec is not None and prefill_rope.pays(
            bound.composite, qo_lens, kv_lens, group, causal)
        if prepass:
            spec = specs.get("rope_ahead")
            if spec is None:
                spec = specs["rope_ahead"] = make_spec(head_dim_qk, specs[False].dtype, causal, has_mask, paged,
                                                       prefill_rope.kernel_composite(bound.composite), False,
                                                       kv_short, head_dim_vo)
        return _plan.Plan(self._fn, batch, num_qo_heads, num_kv_heads, head_dim_qk, q_dt, kv_dt,
                          sm_scale or 1 / math.sqrt(head_dim_qk), bound, bool(causal), page_size, spec,
                          kv_lens=kv_lens, qo_indptr=qo.astype(np.int32), qo_lens=qo_lens, qo_range=qo_range,
                          mask=mask_host, mask_indptr=mask_indptr, head_dim_vo=head_dim_vo, rope_prepass=prepass)

    def _run_backend(self, ctx, fn, plan, paged: bool) -> str:
        """Resolves the backend of a GPU run on this device; ``self.backend`` reports it."""
        self.backend = resolve_backend(self._backend_req, fn, arch=jit.device_arch(ctx.device), head_dim=plan.head_dim,
                                       dtype=plan.spec.dtype, custom_mask=plan.mask is not None,
                                       paged=paged, rope=plan.bound.composite.has_qk_transform,
                                       page_size=plan.get("page_size"), dtype_kv=plan.spec.dtype_kv,
                                       head_dim_vo=plan.head_dim_vo)
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
        self._rope.plan(plan)       # ragged fused RoPE: the buffer of the rotated q and K
        if device is None or plan.spec is None:
            return
        composite = plan.spec.variant       # the kernel's (the plan's, or without its RoPE: prefill_rope.py)
        # -- the backend and kernel of this configuration on this device: as the last plan's when
        #    everything they depend on is (a serving loop's steady state). The configuration memo
        #    (_plan_common) hands out the same spec object for the same configuration: its identity
        #    stands for every argument the backend depends on (the object is kept and compared).
        key = (device, id(plan.spec))
        hit = self._backend_memo.get(key)
        if hit is None or hit[0] is not plan.spec:
            backend = self._run_backend(arrays.Context("cupy", device, None), fn, plan, paged)
            spec = plan.spec if backend == "fa2" else prefill_sm90.make_spec(
                plan.spec.dtype, plan.causal, composite, paged, plan.spec.dtype_kv,
                plan.head_dim, plan.head_dim_vo, plan.page_size if paged else None,
                small=plan.spec.block_m == 64)         # (fa2's 64-row tiles: every request within 64 packed rows)
            ahead_spec = prefill_sm90.make_spec(        # the rows gathered ahead: the contiguous 16-bit kernel
                plan.spec.dtype, plan.causal, composite, False, "", plan.head_dim, plan.head_dim_vo
            ) if ((paged or spec.dtype_kv in prefill_sm90.KV_FP8) and backend == "fa3" and plan.head_dim == plan.head_dim_vo
                  and not bufs.graph) else None
            _plan.memo_put(self._backend_memo, key, (plan.spec, backend, spec, ahead_spec))
        else:
            _, backend, spec, ahead_spec = hit
            self.backend = backend
        h_kv, group = plan.num_kv_heads, plan.num_qo_heads // plan.num_kv_heads
        if ahead_spec is not None and prefill_ahead.pays(plan.qo_lens, plan.kv_lens, group, plan.causal,
                                                         2 * h_kv * (plan.head_dim + plan.head_dim_vo),
                                                         prefill_ahead.kind(spec.dtype_kv, paged)):
            spec, plan.kv_ahead = ahead_spec, True
        slot_floats = h_kv * spec.block_m * (plan.head_dim + 1)      # a slot: every kv head's tile rows + LSE
        sms = _plan.num_sms(device)
        why, wl = _plan.prefill_schedule(
            plan.qo_lens, plan.kv_lens, plan.qo_range, group, spec.block_m, spec.block_n, plan.causal, h_kv, sms,
            sms * (2 if backend == "fa2" else spec.ctas_per_sm), bufs.max_partial(slot_floats),   # (resident CTAs)
            fixed_split_size, disable_split_kv, composite.use_softmax)
        if len(wl.work) > 2 ** 31 - 1:
            raise UnsupportedError(f"{fn}: {len(wl.work)} work items exceed the grid limit")
        mask = plan.mask
        segments = [("kv_chunk", (wl.chunk,), 0), ("sched", _SCHED_ZEROS, 0),
                    ("qo_indptr", plan.qo_indptr, 0),
                    ("kv_indptr", prefill_ahead.token_indptr(plan.kv_lens) if plan.kv_ahead else plan.kv_indptr, 0),
                    ("kv_last_page_len", plan.last_page_len, 0), ("kv_indices", plan.kv_indices, 0),
                    ("mask_indptr", plan.mask_indptr, 0),
                    ("mask", None if mask is None else _buffers.as_words(mask), 0),
                    ("work", wl.work.reshape(-1), -1), ("merge", wl.merge.reshape(-1), -1),
                    ("rope_offsets", prefill_rope.offsets(plan.qo_lens, plan.kv_lens) if plan.rope_prepass else None, 0)]
        if plan.kv_ahead:       # (the kernel's kv_indptr: token offsets into the gathered rows; the pages' here)
            segments += prefill_ahead.segments(plan, paged)
        ptrs = bufs.upload(fn, segments, (spec.name, plan.num_qo_heads, h_kv, plan.page_size) if bufs.graph else None,
                           stream_of)
        ptrs.update(bufs.partial(fn, slot_floats, wl.num_slots, spec.block_m * plan.head_dim * h_kv))
        plan.backend, plan.run_spec, plan.work_list, plan.meta, plan.split_why = backend, spec, wl, ptrs, why
        plan.grid_work = bufs.rows("work", len(wl.work), _plan.PREFILL_COLS)
        plan.grid_merge = bufs.rows("merge", len(wl.merge), _plan.PREFILL_COLS)
        self._ahead.plan(plan)      # the rows gathered ahead: the buffer sized

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
        if p.rope_prepass:
            lines.append("fused RoPE: q and the keys rotated once per run ahead of the kernel (prefill_rope.py)")
        if p.kv_ahead:
            lines.append(f"K / V: the batch's {int(p.kv_lens.sum())} rows gathered ahead"
                         + (" from the pages" if p.page_size is not None else "") + " once per run"
                         + (", converted to 16 bits" if p.spec.dtype_kv in prefill_sm90.KV_FP8 else "")
                         + ", for the contiguous kernel (prefill_ahead.py)")
        items, sms = len(wl.work) * h, _plan.num_sms(p["device"])
        if getattr(spec, "persistent", False):     # (fa3: prefill_sm90.persists)
            ctas = min(p["grid_work"] * h, sms * spec.ctas_per_sm)
            work = (f"work: {len(wl.work)} items x {h} kv heads = {items} items on {ctas} persistent CTAs "
                    f"({spec.ctas_per_sm} per SM at most, ~{-(-items // max(ctas, 1))} items each, taken from a counter "
                    f"as they free up" + (", in turns: a logits mask" if spec.variant.has("logits_mask") else "") + ")")
        else:
            work = f"work: {len(wl.work)} items x {h} kv heads = {items} CTAs on {sms} SMs"
        lines.append(work + (f"; grid padded to {p['grid_work']} items (CUDA graph)" if self._bufs.graph else ""))
        return "\n".join(lines + _plan.describe_split(wl, spec.block_n, p["split_why"]))

    def _merge(self, ctx, plan, ot, lse_ptr, record: list | None = None) -> None:
        """After the attention kernel: merge the pieces of split items (graph mode: always launched,
        over the merge rows' capacity, so a replay after a plan that splits merges too)."""
        if plan.grid_merge and (plan.work_list.split or self._bufs.graph):
            entry = "cuattn_prefill_merge" if plan.backend == "fa2" else "cuattn_prefill_sm90_merge"
            _launch_merge(ctx, plan.run_spec, entry, plan.meta, plan.grid_merge, plan.num_kv_heads,
                          plan.group, ot, lse_ptr, record)
        self._f32q.finish(ctx)      # fp32 q: the 16-bit output into the caller's out

    # -- run()'s replay: a plain GPU call (no run-time variant arguments, scales or sm_scale; no fp32 q, no fused-RoPE
    #    prepass) records its launches, keyed by its arrays' layouts (arrays.pointer_layout: CuPy and CUDA torch
    #    arrays), the caches' pointers too (contiguous K/V's tensor maps carry them), q's / out's / lse's only by their
    #    alignment (pointer mod 256), and whether run() allocated out / lse. A later call on the same plan object with
    #    the same key (a layer's cache again, one record per layer; a fresh q or out each call included) replays them
    #    on its own stream, after the capture check, with its own q / out / lse pointers patched into the arguments
    #    that held the recorded ones, without the checks and packing the first call did (they would come out the same:
    #    everything they read is in the key). A new plan() is a new object: the records are dropped at its first run().
    def _replay_key(self, plan, arrs: tuple, out, lse, return_lse: bool, plain: bool, enable_pdl):
        """(key, pointers): the replay key of a call and its q / out / lse pointers (None: run() allocates it), or
        (None, None) for a call that is not replayed."""
        if not plain or plan.bound.runtime:
            return None, None
        key = [return_lse, enable_pdl]
        ptrs = {}
        for i, x in enumerate(arrs):
            pl = arrays.pointer_layout(x)
            if pl is None:
                return None, None
            if i == 0:
                ptrs["q"] = pl[0]
                key.append((pl[1], pl[0] % 256))                  # q: patched
            else:
                key.append(pl)                                    # the caches: as they are
        for role, x, wanted in (("out", out, True), ("lse", lse, return_lse)):
            if x is None:
                ptrs[role] = None if wanted else 0
                key.append("new" if wanted else None)             # run() allocates it
                continue
            pl = arrays.pointer_layout(x)
            if pl is None:
                return None, None
            ptrs[role] = pl[0]
            key.append((pl[1], pl[0] % 256))
        return tuple(key), ptrs

    def _replay(self, plan, key: tuple, ptrs: dict, out, lse, return_lse: bool, stream, fn: str):
        """run()'s result by replaying the recorded launches, or None when no record has this call's key."""
        found = self._runs.get(key) if self._runs_plan is plan else None
        if found is None:
            return None
        launches, patches, recorded = found
        fw, _, _, _, device = key[2][0]            # q's arrays.pointer_layout layout: (framework, .., device)
        s = arrays.resolve_stream(fw, device, stream)
        _buffers.refuse_capture(fn, self._bufs.graph, s)
        new_out, new_lse = out is None, return_lse and lse is None
        if new_out or new_lse:
            ctx = arrays.Context(fw, device, s)
            ptrs = dict(ptrs)
            if new_out:
                out = arrays.empty(ctx, (int(plan.qo_indptr[-1]), plan.num_qo_heads, plan.head_dim_vo), plan.q_dtype)
                ptrs["out"] = arrays.pointer_layout(out)[0]
            if new_lse:
                lse = arrays.empty(ctx, (int(plan.qo_indptr[-1]), plan.num_qo_heads), np.float32)
                ptrs["lse"] = arrays.pointer_layout(lse)[0]
        same = ptrs == recorded              # the recorded arrays again: their arguments as they are
        for (launcher, grid, threads, args, pdl), patch in zip(launches, patches):
            if patch and not same:
                args = list(args)
                for i, role in patch:
                    args[i] = ptrs[role]
            launcher(grid, threads, s, *args, pdl=pdl)
        o = arrays.export(ctx, out, plan.q_dtype) if new_out else out
        if not return_lse:
            return o
        return o, (arrays.export(ctx, lse) if new_lse else lse)

    _MAX_RUNS = 256     # records kept per plan (a model's layers, each with its own cache)

    def _keep_record(self, plan, key: tuple | None, record: list | None, ptrs: dict | None = None,
                     caches: tuple = ()) -> None:
        """Keep a plain call's launches for ``_replay`` (not when a step was not a recorded launch), with where each
        of ``ptrs`` (q, out, lse: the pointers launched) sits in their arguments. Not kept when two of those
        pointers, or one of them and a cache's (``caches``), are equal (a patch could not tell them apart), or when
        one of them is in no argument as itself (something else would carry it)."""
        if self._runs_plan is not plan:
            self._runs, self._runs_plan = {}, plan
        if key is None or record is None or None in record or self._f32q.active or self._rope.active:
            return
        roles = {p: r for r, p in (ptrs or {}).items() if p}
        if len(roles) != sum(1 for p in (ptrs or {}).values() if p) or any(c in roles for c in caches):
            return
        patches = tuple(tuple((i, roles[a]) for i, a in enumerate(args)
                              if isinstance(a, (int, np.integer)) and not isinstance(a, bool) and a in roles)
                        for _, _, _, args, _ in record)
        if {r for patch in patches for _, r in patch} != set(roles.values()):
            return
        if len(self._runs) >= self._MAX_RUNS:
            self._runs.clear()
        self._runs[key] = (tuple(record), patches, {r: (ptrs or {}).get(r, 0) for r in ("q", "out", "lse")})

    def _gpu_plan(self, ctx, plan, fn) -> None:
        """A GPU run needs the plan's device half, on this run's GPU; a stream capturing a CUDA graph
        needs a wrapper built for graphs."""
        if plan.device != ctx.device or plan.meta is None:
            raise ValueError(f"{fn}: the arrays must be on the GPU the plan was made for (GPU {plan.device}), "
                             f"got GPU {ctx.device}; plan() on that GPU (cupy.cuda.Device(i) current)")
        _buffers.refuse_capture(fn, self._bufs.graph, ctx.stream)

    def _run_checks(self, fn, q, plan):
        qt = arrays.device_tensor(q, "q", fn)
        _check_q(qt.shape, fn, plan.num_qo_heads, plan.head_dim, int(plan.qo_indptr[-1]))
        if arrays.logical_dtype(qt.dtype) != plan.q_dtype:
            raise ValueError(f"{fn}: q must have the q_data_type given to plan ({plan.q_dtype}), got {qt.dtype}")
        if not self._f32q.active:       # the kernels' 16-byte copies (an fp32 q: they read an aligned copy)
            arrays.check_aligned(qt, "q", 16, fn)
        return qt

    def _outputs(self, ctx, fn, plan, qt, out, lse, return_lse):
        rows = int(plan.qo_indptr[-1])
        if lse is None and return_lse:
            lse = arrays.empty(ctx, (rows, plan.num_qo_heads), np.float32)
        out, ot, lse, lse_ptr = _check_out(ctx, out, lse, rows, plan.num_qo_heads, plan.head_dim_vo, qt.dtype, fn)
        if not self._f32q.active:       # the epilogue's 4-byte stores (an fp32 q: the kernels write a copy)
            arrays.check_aligned(ot, "out", 4, fn)
        qk, ok = self._f32q.begin(ctx, qt.ptr, qt.strides, ot.ptr, ot.strides) if self._f32q.active else (qt, ot)
        return out, qk, ok, lse, lse_ptr      # qk, ok: what the kernel reads and writes (fp32 q: 16-bit copies)

    def _variant_args(self, plan, args, return_lse, lse, fn, on_gpu: bool, sm_scale=None):
        """(sm_scale, the kernels' variant arguments or, on the NumPy path, the parameter values)
        from the plan's variant and run()'s extra positional arguments."""
        bound = plan.bound
        bound.check_lse(return_lse, lse, fn)
        # -- the plan's custom mask: on a GPU run, the bits and byte offsets plan() uploaded
        #    (a NumPy plan has none: _gpu_plan refuses that run)
        meta = plan.meta or {}
        dev = {} if not on_gpu or plan.mask is None else {
            "custom_mask": variants.Pointer(meta.get("mask", 0)), "mask_indptr": variants.Pointer(meta.get("mask_indptr", 0))}
        if on_gpu and not args and not bound.runtime and sm_scale is None:    # the plan's own: built once
            if plan.fixed_vargs is None:
                plan.fixed_vargs = prefill_rope.kernel_bound(plan).kernel_args(plan.sm_scale, {**bound.fixed, **dev}, fn)
            return plan.sm_scale, plan.fixed_vargs
        values = {**bound.values(tuple(args), fn), **dev}
        bound.check_sinks(values, plan.num_qo_heads, fn)
        bound.check_custom_mask(values, plan.qo_lens, plan.kv_lens, fn)
        scale = plan.sm_scale if sm_scale is None else float(sm_scale)
        return scale, (prefill_rope.kernel_bound(plan).kernel_args(scale, values, fn) if on_gpu
                       else bound.host_values(values, fn))

    def _reference_run(self, ctx, plan, q, gather, return_lse, fn, scale, values, out_arg, lse_arg):
        qa = arrays.host_array(q, "q", fn)
        _check_q(qa.shape, fn, plan.num_qo_heads, plan.head_dim, int(plan.qo_indptr[-1]))
        if qa.dtype != plan.q_dtype:
            raise ValueError(f"{fn}: q must have the q_data_type given to plan ({plan.q_dtype}), got {qa.dtype}")
        rows = qa.shape[0]
        out = np.zeros((rows, plan.num_qo_heads, plan.head_dim_vo), np.float32)
        lse = np.full((rows, plan.num_qo_heads), -np.inf, np.float32)
        qo = plan.qo_indptr
        for b in range(plan.batch):       # (a custom mask: the variant's NumPy hook reads the packed bits)
            k, v = gather(b)
            o, s = reference.attention(qa[qo[b]:qo[b + 1]], k, v, sm_scale=scale, causal=plan.causal,
                                       variant=plan.bound.composite, values=values, batch_idx=b, fn=fn)
            out[qo[b]:qo[b + 1]] = o
            lse[qo[b]:qo[b + 1]] = s
        return arrays.host_results(ctx, out, lse, out_arg, lse_arg, return_lse, qa.dtype, fn)
