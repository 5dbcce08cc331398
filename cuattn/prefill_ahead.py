"""Prefill on fa3 with the batch's K / V rows gathered once (fp8: and converted), ahead of the contiguous kernel.

The fa3 paged kernel gathers each K / V tile's rows from the pages in its producer warps (fp8 rows converted to
f16 there too), once for every query tile that reads the tile; the contiguous kernel loads whole tiles by TMA.
Where many query tiles read each key (a long prompt), that per-read work costs: on an H100 the fp16 paged kernel
took 1.15-1.18x the contiguous kernel's time at 1 x 16384 and 8 x 2048, and the fp8 conversion made fp8 paged
prefill 0.86-0.90x the fp16 paged speed at 1 x 4096 (``benchmarks/results/prefill_sm90_notes.md``, sessions 21-22).
Where enough query tiles share each key (``pays``), plan() picks the contiguous fa3 kernel of 16-bit K / V instead
and uploads the batch's token offsets as its ``kv_indptr``; run() first copies the batch's rows from the pages into
a buffer of the wrapper, in token order (page.cu ``cuattn_kv_rows``: one pass; an fp8 cache's rows converted to q's
16-bit type on the way, exactly: every e4m3 and e5m2 value is an f16 and a bf16 value), and the kernel reads them
with run()'s k_scale / v_scale as it would the cache's. A ragged batch of fp8 K / V (``single_prefill_with_kv_cache``
too), whose contiguous fp8 kernel stages each tile by TMA for converter warps (H100: 0.45-0.64x the fp16 speed),
converts its rows the same way at every size. Output: the in-kernel path's, bit for bit in the GPU tests (an fp8
cache with a bf16 q keeps its bf16 products, where the fp8 kernel rounds q to f16).

The buffer holds kv_indptr[-1] x num_kv_heads x (head_dim_qk + head_dim_vo) 16-bit values, sized at plan(), at most
``MAX_BYTES`` (a larger batch reads the pages in the kernel). Not in CUDA-graph mode (the first plan fixes the
kernel for every batch replayed), not for K and V of different head dims, and not on fa2.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import arrays, jit
from .errors import UnsupportedError

# (key, query tile) reads per key, on average over the batch, before the rows are gathered ahead, and at least
# MIN_READS reads (the pass's fixed cost, a second launch and its tail, ~5 us, paid back), by the cache's kind. The
# pass moves 3 bytes a value (fp8) or 4 (16-bit) once (H100, 8 kv heads: 15 us at 4096 keys, 86-93 us at 32k); the
# kernel then reads 2 bytes a value where an fp8 kernel read 1. H100, 32:8, head_dim 128 (prefill_sm90_notes.md,
# session 22), ahead over in the kernel: fp8 at 4 reads a key 0.81x the speed, 8 0.99x, 16 1.15x, 1 x 1024 causal
# (16k reads) 0.95x, not causal (32k) 1.07x; 16-bit (the kernel's gather costs less than a conversion) at 16 reads
# a key 0.89x, 32 1.00-1.01x, 64-128 1.03-1.14x; contiguous fp8 rows (a ragged batch: its in-kernel form the
# TMA-staged converters) at every shape measured, 1.35-1.85x (1 x 1024 to 1 x 16384, a chunk of 512 over 32k).
MIN_SHARING = {"fp8": 8, "16": 64, "fp8_rows": 0}
MIN_READS = {"fp8": 32768, "16": 32768, "fp8_rows": 0}
MAX_BYTES = 256 << 20   # the buffer of gathered rows (64k keys at 8 kv heads, head_dim 128): a batch needing more
                        # reads the pages in the kernel
_TILE_ROWS = 128
_THREADS = 256


@dataclass(frozen=True)
class KvRowsSpec:
    """page.cu's cuattn_kv_rows: paged K / V rows -> contiguous 16-bit rows (compile-time: the cache's type, "e4m3" /
    "e5m2" converted to ``dtype_out``, or "b16": 16-bit rows copied as they are)."""
    dtype_kv: str           # "e4m3" | "e5m2" | "b16"
    dtype_out: str = "b16"  # "f16" | "bf16" (fp8), "b16" (copied)
    source = "page.cu"

    @property
    def name(self) -> str:      # "page_rows_e4m3_f16", "page_rows_b16"
        return f"page_rows_{self.dtype_kv}" + ("" if self.dtype_kv == "b16" else f"_{self.dtype_out}")

    def defines(self) -> tuple[str, ...]:
        fp8 = {"e4m3": 1, "e5m2": 2}.get(self.dtype_kv, 0)
        return ("-DKV_ROWS=1", "-DVEC_BYTES=16", f"-DKV_FP8={fp8}", f"-DOUT_BF16={int(self.dtype_out == 'bf16')}")


def shipped_specs() -> list[KvRowsSpec]:
    return [KvRowsSpec(kv, o) for o in ("f16", "bf16") for kv in ("e4m3", "e5m2")] + [KvRowsSpec("b16")]


def kind(dtype_kv: str, paged: bool = True) -> str:
    """The K / V kind for the thresholds: "fp8" (pages), "fp8_rows" (contiguous fp8 rows) or "16" (16-bit pages)."""
    return ("fp8" if paged else "fp8_rows") if dtype_kv in ("e4m3", "e5m2") else "16"


def pays(qo_lens: np.ndarray, kv_lens: np.ndarray, group: int, causal: bool, row_bytes: int, cache: str) -> bool:
    """Whether an fa3 plan of this batch gathers its rows ahead (``row_bytes``: a token's 16-bit K and V rows over
    all kv heads; ``cache``: ``kind``)."""
    keys = int(kv_lens.sum()) if len(kv_lens) else 0
    if keys == 0 or keys * row_bytes > MAX_BYTES:
        return False
    return (reads := tile_reads(qo_lens, kv_lens, group, causal)) >= MIN_SHARING[cache] * keys and \
        reads >= MIN_READS[cache]


def tile_reads(qo_lens: np.ndarray, kv_lens: np.ndarray, group: int, causal: bool) -> int:
    """The batch's (key, query tile) reads: each of a request's T tiles (of 128 packed rows) reads its keys; causal
    (bottom-right) tile t reads kv_len - qo_len plus its queries up to its last, min((t + 1) R, qo_len) with R = 128 /
    group queries a tile (a prompt: half of T x kv_len; a chunk at the end of a long context: nearly all of it)."""
    tiles = -(-qo_lens * group // _TILE_ROWS)
    if not causal:
        return int((tiles * kv_lens).sum())
    r = _TILE_ROWS / group
    return int((tiles * (kv_lens - qo_lens) + r * tiles * (tiles + 1) / 2 - np.maximum(tiles * r - qo_lens, 0)).sum())


def token_indptr(kv_lens: np.ndarray) -> np.ndarray:
    """The batch's token offsets (int32 [batch + 1]): the contiguous kernel's kv_indptr over the gathered rows."""
    out = np.zeros(len(kv_lens) + 1, np.int64)
    np.cumsum(kv_lens, out=out[1:])
    return out.astype(np.int32)


def segments(plan, paged: bool) -> list:
    """The plan segments the gathering reads besides kv_indptr (the token offsets): the paged batch's page indptr
    (its kv_indices are uploaded anyway), or for contiguous rows (a ragged batch) one "page" a request, numbered by its
    first row (the kernel's page stride is then the row stride)."""
    if paged:
        return [("page_indptr", plan.kv_indptr, 0)]
    return [("page_indptr", np.arange(plan.batch + 1, dtype=np.int32), 0), ("row_starts", plan.kv_indptr[:-1], 0)]


def gather_rows(ctx, k, v, k_strides: tuple, v_strides: tuple, page_size: int, heads: int, head_dim: int,
                spec: KvRowsSpec, ptrs: tuple, nnz: int, batch: int, k_out: int, v_out: int, record: list | None = None,
                pdl: bool = False) -> None:
    """One launch on ``ctx``'s stream: the planned rows of K / V (device tensors; ``heads`` rows of ``head_dim`` a
    token, addressed by (page, slot, head) element strides ``k_strides`` / ``v_strides``) into ``k_out`` / ``v_out``
    (contiguous [nnz, num_kv_heads, head_dim] of 16-bit values); ``ptrs``: device pointers of the token offsets, the
    page indptr and the page ids (int32). ``record`` as prefill_sm90.launch's; ``pdl``: launched with programmatic
    dependent launch (the kernel waits for the previous grid before reading, and lets the next one start its
    prologue)."""
    item = k.dtype.itemsize
    if nnz == 0 or heads == 0:
        return
    chunks = head_dim // 8                   # pieces of 8 values a row (16 bytes out; head_dim 64 .. 256: a power of two)
    total = nnz * heads * chunks
    if chunks & (chunks - 1) or total >= 2 ** 31:
        raise UnsupportedError(f"gathering K / V rows ahead: {head_dim}-value rows and {total} pieces of 8 values "
                               f"(a power of two a row, under 2**31 in all) have no launch")
    launch = jit.get_launcher(spec, "cuattn_kv_rows", ctx.device, "ppppppp" "iiiiii" "qqqqqq")
    args = (k.ptr, v.ptr, *ptrs, k_out, v_out, nnz, batch, heads, chunks.bit_length() - 1, page_size,
            page_size.bit_length() - 1 if page_size & (page_size - 1) == 0 else -1,
            *(x * item for x in k_strides), *(x * item for x in v_strides))
    grid = (-(-total // _THREADS),)
    if record is not None:
        record.append((launch, grid, _THREADS, args, pdl))
    launch(grid, _THREADS, ctx.stream, *args, pdl=pdl)


class RowsAhead:
    """A prefill wrapper's gathered rows: ``plan(p)`` at every GPU plan sizes the buffer (so run() allocates nothing),
    ``gather`` in run() fills it before the attention launch."""

    def __init__(self):
        self._buf = None            # uint16 CuPy array: K's rows, then V's (kept across plans, grown where needed)

    def plan(self, p) -> None:
        """Sizes the buffer for a GPU plan ``p`` that gathers its rows ahead (``p.kv_ahead``); else nothing."""
        if not (p.kv_ahead and p.device is not None):
            return
        self._nnz = nnz = int(p.kv_lens.sum())
        h = p.num_kv_heads
        self._k_elems = nnz * h * p.head_dim
        short = arrays.SHORT_NAME[p.kv_dtype]      # the pass's kernel: fp8 converted to the kernel's type, or copied
        self._spec = KvRowsSpec(short, p.run_spec.dtype) if kind(short) != "16" else KvRowsSpec("b16")
        need = max(self._k_elems + nnz * h * p.head_dim_vo, 8)
        if self._buf is None or self._buf.size < need or self._buf.device.id != p.device:
            cp = arrays.cupy_module()
            self._buf = None        # (freed before the new one is allocated)
            with cp.cuda.Device(p.device):
                self._buf = cp.empty(need, np.uint16)

    def gather(self, ctx, plan, k, v, k_strides: tuple, v_strides: tuple, page_size: int | None, record: list | None,
               pdl: bool = False):
        """The plan's rows of K / V (device tensors; (page, slot, head) element strides; ``page_size`` None: contiguous
        rows of a ragged batch, ``k_strides`` then (token, head)) gathered (fp8: converted) into the buffer on the
        run's stream; returns the (k, v) tensors there, contiguous NHD in q's 16-bit type (the kernel's). The pass loads
        16 bytes of a 16-bit row, 8 of an fp8 one: run() has checked that pointers and strides are 16-byte multiples
        (arrays.check_aligned)."""
        meta = plan.meta
        if page_size is None:            # one "page" a request, numbered by its first row: page stride = row stride
            k_strides, v_strides = (k_strides[0], *k_strides), (v_strides[0], *v_strides)
            ptrs, page_size = (meta["kv_indptr"], meta["page_indptr"], meta["row_starts"]), 2 ** 30
        else:
            ptrs = (meta["kv_indptr"], meta["page_indptr"], meta["kv_indices"])
        nnz, h = self._nnz, plan.num_kv_heads
        base = self._buf.data.ptr
        gather_rows(ctx, k, v, k_strides, v_strides, page_size, h, plan.head_dim, self._spec, ptrs, nnz, plan.batch,
                    base, base + 2 * self._k_elems, record, pdl)
        dtype = arrays.bfloat16 if plan.run_spec.dtype == "bf16" else np.dtype(np.float16)
        return tuple(arrays.Tensor(ptr, (nnz, h, d), (h * d, d, 1), dtype, ctx.device, "cupy", self._buf)
                     for ptr, d in ((base, plan.head_dim), (base + 2 * self._k_elems, plan.head_dim_vo)))
