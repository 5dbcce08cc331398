"""Paged prefill over an fp8 cache with each K / V row converted once, ahead of the kernel.

The fa3 paged kernel converts fp8 rows to f16 in its producer warps as it gathers them, so a row is converted
once for every query tile that reads it: at 1 x 4096 (32:8 heads, head_dim 128) each K / V tile is converted
by 32 query tiles, and where the kernel is compute-bound (its K / V in L2) those conversions take the
consumers' issue slots (H100: 0.86-0.90x the fp16 paged kernel's speed; ``benchmarks/results/
prefill_sm90_notes.md``, session 21). Where enough query tiles share each key (``pays``), plan() picks the
contiguous 16-bit fa3 kernel instead and uploads the batch's token offsets as its ``kv_indptr``; run() first
converts the batch's rows from the pages into a buffer of the wrapper (page.cu ``cuattn_kv_dequant``: one
pass, 3 bytes a value moved; exact: every e4m3 and e5m2 value is an f16 and a bf16 value), in q's dtype,
and the kernel reads them by TMA tiles with run()'s k_scale / v_scale as it would the fp8 rows. The output
is the in-kernel path's (bitwise at an f16 q in the probe; a bf16 q keeps its bf16 products, where the fp8
kernel rounds q to f16).

The buffer holds kv_indptr[-1] x num_kv_heads x (head_dim_qk + head_dim_vo) values, sized at plan(), at most
``MAX_BYTES`` (a larger batch converts in the kernel). Not in CUDA-graph mode (the first plan fixes the kernel
for every batch replayed), and not on fa2 (sm_80: its fp8 tiles are converted in registers, unmeasured).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import arrays, jit, prefill_sm90

# query tiles (128 packed rows) reading a key, on average over the batch's keys (twice that when causal), before
# the rows are converted ahead: the pass moves 3 bytes a value once (H100: 15 us at 1 x 4096, 86 us for 32k keys of
# 8 heads), and the kernel then reads 2 bytes a value where it read 1. H100, 8 requests of 4096 keys (32:8 heads,
# head_dim 128; benchmarks/results/prefill_sm90_notes.md, session 22): ahead over in the kernel at 4 tiles a key
# 0.81x the speed, 8 tiles 0.99x, 16 tiles 1.15x (causal 8: 0.99x, 16: 1.15x)
MIN_SHARING = 8
# ... and at least this many (key, query tile) reads (half the product when causal), so that the pass's fixed cost
# (a second launch and its tail, ~5 us) is paid back: H100, 1 x 1024 causal (16k) 0.95x the in-kernel speed, not
# causal (32k) 1.07x
MIN_READS = 32768
MAX_BYTES = 1 << 30     # the buffer of converted rows: a batch needing more converts in the kernel
_TILE_ROWS = 128
_THREADS = 256


@dataclass(frozen=True)
class PageDequantSpec:
    """page.cu's cuattn_kv_dequant: fp8 paged rows -> 16-bit rows (compile-time: the two types)."""
    dtype_out: str          # "f16" | "bf16"
    dtype_kv: str           # "e4m3" | "e5m2"
    source = "page.cu"

    @property
    def name(self) -> str:      # "page_dequant_e4m3_f16"
        return f"page_dequant_{self.dtype_kv}_{self.dtype_out}"

    def defines(self) -> tuple[str, ...]:
        return ("-DKV_DEQUANT=1", "-DVEC_BYTES=16", f"-DKV_FP8={1 if self.dtype_kv == 'e4m3' else 2}",
                f"-DOUT_BF16={int(self.dtype_out == 'bf16')}")


def shipped_specs() -> list[PageDequantSpec]:
    return [PageDequantSpec(o, kv) for o in ("f16", "bf16") for kv in ("e4m3", "e5m2")]


def pays(qo_lens: np.ndarray, kv_lens: np.ndarray, group: int, causal: bool, row_bytes: int) -> bool:
    """Whether a paged fp8 plan of this batch converts its rows ahead (``row_bytes``: a token's 16-bit K and V
    rows over all kv heads)."""
    keys = int(kv_lens.sum()) if len(kv_lens) else 0
    if keys == 0 or keys * row_bytes > MAX_BYTES:
        return False
    reads = int((-(-qo_lens * group // _TILE_ROWS) * kv_lens).sum()) // (2 if causal else 1)
    return reads >= MIN_SHARING * keys and reads >= MIN_READS


def token_indptr(kv_lens: np.ndarray) -> np.ndarray:
    """The batch's token offsets (int32 [batch + 1]): the contiguous kernel's kv_indptr over the converted rows."""
    out = np.zeros(len(kv_lens) + 1, np.int64)
    np.cumsum(kv_lens, out=out[1:])
    return out.astype(np.int32)


def dequant_rows(ctx, kv, dtype_out: str, dtype_kv: str, meta: dict, nnz: int, batch: int, k_out: int, v_out: int,
                 record: list | None = None, pdl: bool = False) -> None:
    """One launch on ``ctx``'s stream: the planned rows of ``kv`` (page.PagedKV of an fp8 cache; K and V of one
    head_dim) into ``k_out`` / ``v_out`` (contiguous [nnz, num_kv_heads, head_dim] of ``dtype_out``); ``meta``:
    the plan's device pointers (kv_indptr: token offsets, page_indptr, kv_indices). ``record`` as
    prefill_sm90.launch's; ``pdl``: launched with programmatic dependent launch (the kernel waits for the previous
    grid before reading, and lets the next one start its prologue)."""
    if nnz == 0 or kv.num_kv_heads == 0:
        return
    chunks = kv.head_dim // 16
    launch = jit.get_launcher(PageDequantSpec(dtype_out, dtype_kv), "cuattn_kv_dequant", ctx.device,
                              "ppppppp" "q" "iiii" "qqq")
    total = nnz * kv.num_kv_heads * chunks
    args = (kv.k.ptr, kv.v.ptr, meta["kv_indptr"], meta["page_indptr"], meta["kv_indices"], k_out, v_out, nnz, batch,
            kv.num_kv_heads, chunks, kv.page_size, kv.stride_page, kv.stride_slot, kv.stride_head)
    grid = (-(-total // _THREADS),)
    if record is not None:
        record.append((launch, grid, _THREADS, args, pdl))
    launch(grid, _THREADS, ctx.stream, *args, pdl=pdl)


class DequantAhead:
    """A paged wrapper's converted rows: ``plan(p)`` at every GPU plan sizes the buffer (so run() allocates
    nothing), ``convert`` in run() fills it before the attention launch."""

    def __init__(self):
        self.active = False
        self._buf = None            # uint16 CuPy array: K's rows, then V's

    def plan(self, p) -> None:
        self.active = p.fp8_ahead and p.device is not None
        if not self.active:
            return
        self._nnz = nnz = int(p.kv_lens.sum())
        h = p.num_kv_heads
        self._k_elems = nnz * h * p.head_dim
        need = max(self._k_elems + nnz * h * p.head_dim_vo, 8)
        if self._buf is None or self._buf.size < need or self._buf.device.id != p.device:
            cp = arrays.cupy_module()
            self._buf = None        # (freed before the new one is allocated)
            with cp.cuda.Device(p.device):
                self._buf = cp.empty(need, np.uint16)

    def convert(self, ctx, plan, kv, record: list | None, fn: str, pdl: bool = False):
        """The plan's rows of ``kv`` (page.PagedKV, fp8) converted into the buffer on the run's stream; returns
        the (k, v) tensors there, contiguous NHD in q's dtype (the kernel's). The cache's pointers and strides
        must suit 16-byte loads, as the fa3 gather's (prefill_sm90.gather_args raises UnsupportedError)."""
        strides = (kv.stride_slot, kv.stride_head, kv.stride_page)
        prefill_sm90.gather_args(kv.k, kv.v, strides, strides, (kv.page_size, kv.num_pages, kv.num_pages), 1, fn)
        nnz, h = self._nnz, plan.num_kv_heads
        base = self._buf.data.ptr
        dt = plan.run_spec.dtype
        dequant_rows(ctx, kv, dt, arrays.SHORT_NAME[plan.kv_dtype], plan.meta, nnz, plan.batch, base,
                     base + 2 * self._k_elems, record, pdl)
        dtype = arrays.bfloat16 if dt == "bf16" else np.dtype(np.float16)
        return tuple(arrays.Tensor(ptr, (nnz, h, d), (h * d, d, 1), dtype, ctx.device, "cupy", self._buf)
                     for ptr, d in ((base, plan.head_dim), (base + 2 * self._k_elems, plan.head_dim_vo)))
