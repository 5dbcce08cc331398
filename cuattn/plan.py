"""Host-side scheduling (NumPy): the decode and prefill work lists, the split-KV choice they share,
and the Plan every wrapper's plan() produces. The device buffers a plan lives in (pinned staging,
asynchronous upload on the caller's stream inside plan(), fixed addresses and capacities for CUDA
graphs) are ``plan_buffers.py``'s.

A decode work item is one (request, kv range) piece; the kernel's grid runs every item for every
(kv head, tile of up to 16 query heads), so the items of one request cover its KV exactly once
per kv head. A request whose KV is cut into several pieces (split-KV) writes fp32 partial
outputs and LSEs (base e) into workspace slots, and a merge item combines them.

Work item rows are 8 int32: request, first page slot in ``kv_indices``, kv_start, kv_end,
partial slot (-1: the CTA writes the final output), and for pieces of a split request its merge
row, first slot and number of pieces (the kernel's fused merge: the last piece to finish merges;
0 otherwise). Merge rows are 4 int32: request, first slot, end slot, unused.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import arrays

BLOCK_N = 64          # tokens per pipeline stage of the decode kernel; pieces are multiples
MIN_CHUNK = 128       # never split a request into pieces shorter than this
SHORT_PIECE = 512     # with ~1 CTA per SM already, pieces shorter than this are not worth a split
WORK_COLS = 8
MERGE_COLS = 4
_NO_MERGE = np.zeros((0, 4), np.int32)     # the merge rows of a plan that splits nothing (decode, prefill: shared)
_NO_MERGE.flags.writeable = False


@dataclass(slots=True)       # (not frozen: a frozen dataclass's __init__ costs ~4x, every plan)
class DecodeWorkList:
    work: np.ndarray          # int32 [num_work, 8]
    merge: np.ndarray         # int32 [num_merge, 4]
    num_slots: int            # partial-output rows needed (pieces of split requests)
    chunk: int                # tokens per piece (0: nothing split)
    kv_lens: np.ndarray       # int64 [batch]

    @property
    def split(self) -> bool:
        return len(self.merge) > 0


def choose_chunk(kv_lens: np.ndarray, heads_work: int, num_sms: int, ctas_per_sm: int,
                 block_n: int = BLOCK_N, min_chunk: int = MIN_CHUNK, max_len: int | None = None,
                 total: int | None = None) -> int:
    """Tokens per piece for split-KV; 0 means no request is split.

    Enough CTAs to fill every SM with ctas_per_sm resident CTAs when the batch alone cannot (one
    CTA per SM does not reach the bandwidth wall: measured 48-62% on H100), and long requests in a
    skewed batch cut to ~2x the mean so one request does not set the time. ``max_len``, ``total``:
    ``kv_lens.max()``, ``kv_lens.sum()`` when the caller has them already.
    """
    batch = len(kv_lens)
    if batch == 0:
        return 0
    if total is None:
        total = int(kv_lens.sum())
    if max_len is None:
        max_len = int(kv_lens.max())
    mean = -(-total // batch)
    slots = num_sms * ctas_per_sm
    if batch * heads_work >= 0.9 * slots:              # the batch alone fills the GPU:
        chunk = 2 * mean                               # split only requests > 2x the mean
    else:
        # -- p pieces per (mean-length) request so that the CTAs fit one wave of `slots`
        #    (rounding p up would leave a mostly empty second wave)
        p = max(1, slots // (batch * heads_work))
        chunk = -(-mean // p)
    chunk = max(min_chunk, -(-chunk // block_n) * block_n)
    if chunk < SHORT_PIECE and batch * heads_work >= 0.9 * num_sms:
        # ~1 CTA per SM already and the pieces would be short: the split's extra partial
        # writes and merge cost more than the second CTA per SM gains (H200, 2026-11-22:
        # bs16 x 512 unsplit 20.5 us vs 2 pieces 22.7; bs1 x 512 still gains from 4 pieces)
        return 0
    return 0 if max_len <= chunk else chunk


def split_reason(ctas: int, slots: int, chunk: int) -> str:
    """Why the scheduler's split-KV choice (``choose_chunk`` / ``choose_prefill_chunk``) came out as it did."""
    if chunk:
        return (f"{ctas} unsplit CTAs for {slots} resident slots: long keys split so the pieces fill ~one wave"
                if ctas < 0.9 * slots else f"{ctas} CTAs fill the {slots} slots: only items over 2x the mean split")
    if ctas >= 0.9 * slots:
        return f"{ctas} CTAs already fill the {slots} resident slots and no item is over 2x the mean"
    return f"{ctas} CTAs for {slots} slots, but every item is short (pieces would cost more than they save)"


def decode_work_list(indptr: np.ndarray, kv_lens: np.ndarray, chunk: int,
                     block_n: int = BLOCK_N, align: int = 1, bounds: tuple | None = None) -> DecodeWorkList:
    """Pieces of at most ``chunk`` tokens (0: one piece per request), longest first; pieces start
    at multiples of ``align`` (the TMA kernel's 16-slot boxes), rounding ``chunk`` up if needed.
    ``bounds``: (``kv_lens.min()``, ``kv_lens.max()``) when the caller has them already; the first may be any
    lower bound >= 0 that equals the maximum only when every length does (it decides whether to sort)."""
    batch = len(kv_lens)
    kv_lens = np.asarray(kv_lens, np.int64)      # (read only: no copy of an int64 array)
    if batch and bounds is None:
        bounds = int_bounds(kv_lens)
    if chunk <= 0 or (batch and bounds[1] <= chunk):     # nothing split: one row per request
        work = np.zeros((batch, WORK_COLS), np.int32)
        lo, hi = bounds if batch > 1 else (0, 0)
        if lo != hi:     # longest first: the columns gathered in that order (1-D gathers, not one of rows)
            order = descending(kv_lens, lo, hi)
            work[:, 0] = order
            work[:, 1] = indptr[order]
            work[:, 3] = kv_lens[order]
        else:
            work[:, 0] = np.arange(batch)
            work[:, 1] = indptr[:-1]
            work[:, 3] = kv_lens
        work[:, 4] = -1
        return DecodeWorkList(work, _NO_MERGE, 0, 0, kv_lens)
    # -- even pieces, each a multiple of the tile where possible (vectorized: ~25 NumPy calls)
    n_pieces = np.maximum(1, -(-kv_lens // chunk))
    piece = -(-kv_lens // n_pieces)
    piece = np.maximum(np.where(piece > block_n, -(-piece // block_n) * block_n, -(-piece // align) * align), 1)
    n_pieces = np.maximum(1, -(-kv_lens // piece))
    ends = np.cumsum(n_pieces)
    total = int(ends[-1])
    req = np.repeat(np.arange(batch, dtype=np.int64), n_pieces)
    k = np.arange(total, dtype=np.int64) - (ends - n_pieces)[req]    # piece index within its request
    piece_r = piece[req]
    start = k * piece_r
    end = np.minimum(start + piece_r, kv_lens[req])
    # -- slots: pieces of split requests, numbered in request order; merge rows likewise
    split_req = n_pieces > 1
    sp_pieces = np.where(split_req, n_pieces, 0)
    slot_base = np.cumsum(sp_pieces) - sp_pieces                      # first slot of each request
    row_of = np.cumsum(split_req) - 1                                 # merge row of each request
    sp = split_req[req]
    work = np.empty((total, WORK_COLS), np.int32)
    work[:, 0] = req
    work[:, 1] = indptr[:-1][req]
    work[:, 2] = start
    work[:, 3] = end
    work[:, 4] = np.where(sp, slot_base[req] + k, -1)
    work[:, 5] = np.where(sp, row_of[req], 0)
    work[:, 6] = np.where(sp, slot_base[req], 0)
    work[:, 7] = np.where(sp, n_pieces[req], 0)
    lens = end - start
    lo, hi = int(lens.min()), int(lens.max())
    if lo != hi:
        work = work[descending(lens, lo, hi)]
    sreqs = np.nonzero(split_req)[0]
    merge = np.zeros((len(sreqs), MERGE_COLS), np.int32)
    merge[:, 0] = sreqs
    merge[:, 1] = slot_base[sreqs]
    merge[:, 2] = slot_base[sreqs] + n_pieces[sreqs]
    return DecodeWorkList(work, merge, int(sp_pieces.sum()), int(chunk), kv_lens)


@functools.cache
@functools.cache     # (CuPy's Device.attributes queries every attribute: once per device, not per plan / sampling call)
def num_sms(device: int) -> int:
    cp = arrays.cupy_module()
    return cp.cuda.Device(device).attributes["MultiProcessorCount"]


# ---------------------------------------------------------------------------- prefill

PREFILL_MIN_CHUNK = 512   # a prefill piece reads at least this many keys (its partial rows cost a tile's worth)
PREFILL_COLS = 4          # work rows (request, query tile, kv piece, partial slot); merge rows
                          # (request, query tile, first slot, pieces): common/prefill_tile.cuh


@dataclass(slots=True)
class PrefillWorkList:
    work: np.ndarray          # int32 [num_work, 4]
    merge: np.ndarray         # int32 [num_merge, 4]
    num_slots: int            # partial (request, tile) rows per kv head: pieces of split items
    chunk: int                # keys per piece (0: nothing split)
    extents: np.ndarray       # int64 [num_work]: keys each work row reads (its piece, causal-trimmed)

    @property
    def split(self) -> bool:
        return len(self.merge) > 0

    def balance(self, block_n: int) -> float:
        """Mean over max of the work rows' key tiles: 1.0 when every CTA reads as many tiles."""
        if not len(self.work):
            return 1.0
        tiles = -(-self.extents // block_n)
        return float(tiles.mean() / max(int(tiles.max()), 1))


def descending(keys: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """``np.argsort(-keys, kind="stable")``, the same order, by NumPy's radix sort of 16-bit keys where their
    range ``lo..hi`` fits (512 keys: ~3x faster than the int64 merge sort, 8192: ~6x)."""
    if 0 <= lo and hi <= 32767:
        return np.argsort(np.negative(keys, dtype=np.int16, casting="unsafe"), kind="stable")
    return np.argsort(-keys, kind="stable")


def _div(k: np.ndarray, d: int) -> np.ndarray:
    """``k // d`` (a shift for a power of two: exact for negative values too, and cheaper than int64 division)."""
    d = int(d)
    return k >> (d.bit_length() - 1) if d > 0 and d & (d - 1) == 0 else k // d


def _cyclic(k: np.ndarray, period: int) -> np.ndarray:
    """``k % period`` (a mask for a power of two: int64 division costs more than the call)."""
    return k & (period - 1) if period & (period - 1) == 0 else k % period


_UNIFORM_ITEMS: dict[tuple, tuple] = {}     # _uniform_items' arrays by (batch, tiles, block_m, group)


def _uniform_items(n: int, t0: int, block_m: int, group: int) -> tuple:
    """(request, tile) of a batch of ``n`` requests of ``t0`` query tiles each, and ``lim_t + 1`` of its tiles
    (``prefill_items``): read-only arrays kept per shape (a serving loop's batches repeat their shapes; the
    four NumPy calls that build them cost ~3 µs)."""
    key = (n, t0, block_m, group)
    hit = _UNIFORM_ITEMS.get(key)
    if hit is None:
        if t0 == 1:
            req, tile = np.arange(n), np.zeros(n, np.int64)
        else:
            req = np.arange(n).repeat(t0)
            tile = _cyclic(np.arange(n * t0), t0)
        lim = np.arange(block_m - 1, t0 * block_m, block_m) // group + 1          # lim_t + 1, t < t0
        for a in (req, tile, lim):
            a.flags.writeable = False
        if len(_UNIFORM_ITEMS) >= 32:
            _UNIFORM_ITEMS.clear()
        hit = _UNIFORM_ITEMS[key] = (req, tile, lim)
    return hit


def prefill_items(qo_lens: np.ndarray, kv_lens: np.ndarray, group: int, block_m: int, causal: bool,
                  qo_range: tuple | None = None):
    """(request, tile, keys it reads) of every query tile of ``block_m`` packed rows (the GQA group's
    heads packed with the tokens), causal tiles trimmed to their last row's keys (bottom-right).
    ``qo_range``: (``qo_lens.min()``, ``qo_lens.max()``) when the caller has them already (a uniform batch
    then builds no tile counts).

    Causal: tile t's last row is query ``min(q - 1, lim_t)``, ``lim_t = ((t + 1) * block_m - 1) // group``,
    and it reads ``max(0, min(q - 1, lim_t) + kv - q + 1) = max(0, min(lim_t + kv - q + 1, kv))`` keys."""
    qo_lens, kv_lens = np.asarray(qo_lens, np.int64), np.asarray(kv_lens, np.int64)
    n = len(qo_lens)
    if not n:
        e = np.zeros(0, np.int64)
        return e, e.copy(), e.copy()
    if qo_range is not None:
        t0, t_min = (qo_range[1] * group + block_m - 1) // block_m, (qo_range[0] * group + block_m - 1) // block_m
        uniform = t0 == t_min
    else:
        tiles = _div(qo_lens * group + (block_m - 1), block_m)
        t0 = int(tiles.max())
        uniform = int(tiles.sum()) == n * t0
    if t0 and uniform:          # every request t0 tiles (a uniform batch): no repeats of request arrays
        req, tile, lim = _uniform_items(n, t0, block_m, group)
        if not causal:
            return req, tile, (kv_lens.copy() if t0 == 1 else kv_lens.repeat(t0))
        # -- ext[r, t] computed as its transpose (t0, n): the inner loop runs over the requests
        d = kv_lens - qo_lens
        ext = np.add.outer(lim, d)
        np.minimum(ext, kv_lens, out=ext)
        np.maximum(ext, 0, out=ext)
        return req, tile, (ext[0] if t0 == 1 else ext.T.ravel())
    if qo_range is not None:
        tiles = _div(qo_lens * group + (block_m - 1), block_m)
    total = int(tiles.sum())
    ends = np.cumsum(tiles)
    req = np.arange(n).repeat(tiles)
    tile = np.arange(total) - (ends - tiles)[req]
    kv = kv_lens[req]
    if not causal:
        return req, tile, kv
    ext = (kv_lens - qo_lens)[req]
    ext += ((tile + 1) * block_m - 1) // group + 1
    np.minimum(ext, kv, out=ext)
    np.maximum(ext, 0, out=ext)
    return req, tile, ext


def prefill_work_list(qo_lens, kv_lens, group: int, block_m: int, block_n: int, causal: bool,
                      chunk: int = 0, items: tuple | None = None, bounds: tuple | None = None) -> PrefillWorkList:
    """Work rows for every (request, query tile), each cut into pieces of ``chunk`` keys (0: none),
    the most key tiles first (long pieces start early); split items' pieces get partial slots and a
    merge row each. ``items``: ``prefill_items``' result when the caller has it already; ``bounds``: the
    smallest and largest of its extents (``int_bounds(items[2])``), likewise."""
    req, tile, ext = items if items is not None else prefill_items(np.asarray(qo_lens), np.asarray(kv_lens), group,
                                                                  block_m, causal)
    n = len(req)
    if bounds is None:
        bounds = int_bounds(ext) if n else (0, 0)
    bottom, top = bounds
    if chunk <= 0 or top <= chunk:               # nothing split: one row per item
        work = np.empty((n, PREFILL_COLS), np.int32)
        # -- equal key tiles everywhere (the fewest, the bottom's, equal the top's): the stable order is the identity
        lo, hi = (bottom + block_n - 1) // block_n, (top + block_n - 1) // block_n
        if lo != hi:
            tiles = (ext + (block_n - 1)) // block_n
            order = descending(tiles, lo, hi)
            req, tile, ext = req[order], tile[order], ext[order]
        work[:, 0] = req
        work[:, 1] = tile
        work[:, 2] = 0
        work[:, 3] = -1
        return PrefillWorkList(work, _NO_MERGE, 0, 0, ext)
    p0 = (top + chunk - 1) // chunk                  # p0 > 1: the most pieces of an item
    if (bottom + chunk - 1) // chunk == p0:
        # -- every item cut into p0 pieces (a shared prefix's tiles): (items, p0) grids; pieces k < p0 - 1 read
        #    chunk keys, the last ext - (p0 - 1) * chunk (in 1..chunk); the partial slot of row i is i
        total = n * p0
        merge = np.empty((n, PREFILL_COLS), np.int32)
        merge[:, 0] = req
        merge[:, 1] = tile
        merge[:, 2] = np.arange(0, total, p0)
        merge[:, 3] = p0
        # -- each item's merge row (request, tile, first slot, p0) once per piece, then k = slot - first slot and
        #    the slot (strided writes into an (n, p0, 4) grid cost twice as much)
        work = merge.repeat(p0, axis=0)
        slot = np.arange(total, dtype=np.int32)
        np.subtract(slot, work[:, 2], out=work[:, 2])
        work[:, 3] = slot
        piece_ext = np.empty((n, p0), np.int64)
        piece_ext.fill(chunk)                        # (np.full costs twice as much)
        np.subtract(ext, (p0 - 1) * chunk, out=piece_ext[:, -1], casting="unsafe")   # (as an assignment casts)
        piece_ext = piece_ext.reshape(total)
        lo, hi = (bottom - (p0 - 1) * chunk + block_n - 1) // block_n, (chunk + block_n - 1) // block_n
        if lo != hi:
            tiles = (piece_ext + (block_n - 1)) // block_n
            order = descending(tiles, lo, hi)                       # most key tiles first
            work, piece_ext = work[order], piece_ext[order]
        return PrefillWorkList(work, merge, total, int(chunk), piece_ext)
    pieces = (ext + (chunk - 1)) // chunk
    np.maximum(pieces, 1, out=pieces)
    ends = np.cumsum(pieces)
    total = int(ends[-1])
    item = np.arange(n).repeat(pieces)
    k = np.arange(total) - (ends - pieces)[item]                        # piece index within its item
    split = pieces > 1
    sp = pieces * split
    slot_base = np.cumsum(sp) - sp
    work = np.empty((total, PREFILL_COLS), np.int32)
    work[:, 0], work[:, 1], work[:, 2] = req[item], tile[item], k
    slot = slot_base[item] + k
    slot[~split[item]] = -1
    work[:, 3] = slot
    piece_ext = ext[item] - k * chunk
    np.minimum(piece_ext, chunk, out=piece_ext)                          # (>= 0: k < ceil(ext / chunk))
    np.maximum(piece_ext, 0, out=piece_ext)
    tiles = (piece_ext + (block_n - 1)) // block_n
    order = descending(tiles, 0, (chunk + block_n - 1) // block_n)  # most key tiles first (piece_ext <= chunk)
    work, piece_ext = work[order], piece_ext[order]
    s_items = np.flatnonzero(split)
    merge = np.empty((len(s_items), PREFILL_COLS), np.int32)
    merge[:, 0], merge[:, 1] = req[s_items], tile[s_items]
    merge[:, 2], merge[:, 3] = slot_base[s_items], pieces[s_items]
    return PrefillWorkList(work, merge, int(sp.sum()), int(chunk) if len(s_items) else 0, piece_ext)


def choose_prefill_chunk(extents: np.ndarray, num_kv_heads: int, num_sms: int, ctas_per_sm: int, block_n: int,
                         max_slots: int | None = None, top: int | None = None, total: int | None = None) -> int:
    """Keys per piece for split-KV prefill (0: none split): decode's rule (``choose_chunk``) over the
    (request, query tile) items, pieces of at least PREFILL_MIN_CHUNK keys; then as large as needed
    for the partial slots to fit ``max_slots`` (a fixed workspace). ``top``, ``total``: ``extents.max()``,
    ``extents.sum()`` when known."""
    if len(extents) and top is None:
        top = int(extents.max())
    chunk = choose_chunk(extents, num_kv_heads, num_sms, ctas_per_sm, block_n, min_chunk=PREFILL_MIN_CHUNK,
                         max_len=top, total=total)
    if chunk and max_slots is not None:
        while chunk and int(np.where(extents > chunk, -(-extents // chunk), 0).sum()) > max_slots:
            chunk *= 2
    return 0 if chunk and chunk >= top else chunk


_SCHEDULES: dict[tuple, tuple] = {}      # prefill_schedule's results for short batches, by every argument's value


def prefill_schedule(qo_lens: np.ndarray, kv_lens: np.ndarray, qo_range: tuple | None, group: int, block_m: int,
                     block_n: int, causal: bool, num_kv_heads: int, num_sms: int, slots: int, max_slots: int | None,
                     fixed_split_size, disable_split_kv: bool, use_softmax: bool) -> tuple:
    """(why, work list) of a prefill-style plan: its query tiles (``prefill_items``), the split-KV
    choice (none without softmax or with ``disable_split_kv``, ``fixed_split_size``'s, else ``choose_prefill_chunk``'s
    for ``slots`` resident CTAs on ``num_sms`` SMs and ``max_slots`` partial slots, None: the workspace grows)
    and the work list. A short batch's (<= SHORT requests: a cascade's shared levels, a small step) is kept per
    the values of all these arguments, whose pure function it is (its arrays read-only): a dictionary look-up
    instead of ~20 NumPy calls."""
    if len(qo_lens) > SHORT:
        return _prefill_schedule(qo_lens, kv_lens, qo_range, group, block_m, block_n, causal, num_kv_heads, num_sms,
                                 slots, max_slots, fixed_split_size, disable_split_kv, use_softmax)
    key = (tuple(qo_lens.tolist()), tuple(kv_lens.tolist()), group, block_m, block_n, bool(causal), num_kv_heads,
           num_sms, slots, max_slots, fixed_split_size, bool(disable_split_kv), bool(use_softmax))
    hit = _SCHEDULES.get(key)
    if hit is None:         # (from arrays of the key's values: nothing kept aliases the caller's arrays)
        hit = _prefill_schedule(np.array(key[0], np.int64), np.array(key[1], np.int64), qo_range, *key[2:])
        for a in (hit[1].work, hit[1].merge, hit[1].extents):
            a.flags.writeable = False
        if len(_SCHEDULES) >= 64:
            _SCHEDULES.clear()
        _SCHEDULES[key] = hit
    return hit


def _prefill_schedule(qo_lens, kv_lens, qo_range, group, block_m, block_n, causal, num_kv_heads, num_sms, slots,
                      max_slots, fixed_split_size, disable_split_kv, use_softmax) -> tuple:
    items = prefill_items(qo_lens, kv_lens, group, block_m, causal, qo_range)
    ext = items[2]
    # -- the extents' range (and sum, for the scheduler's choice), read once: the split choice and the work list
    stats = int_bounds(ext, fixed_split_size is None and not disable_split_kv) if len(ext) else (0, 0, 0)

    def auto():
        c = choose_prefill_chunk(ext, num_kv_heads, num_sms, slots // num_sms, block_n, max_slots, stats[1], stats[2])
        return c, split_reason(len(ext) * num_kv_heads, slots, c)
    if use_softmax:
        chunk, why = split_choice(disable_split_kv, fixed_split_size, block_n, auto)
    else:                                     # weights without softmax: never split (nothing to merge)
        chunk, why = 0, "the variant has no softmax to merge"
    return why, prefill_work_list(qo_lens, kv_lens, group, block_m, block_n, causal, chunk, items, stats[:2])


# ---------------------------------------------------------------------------- the plan


@dataclass(eq=False, slots=True)
class Plan:
    """One planned batch, the one structure every wrapper's plan() produces (decode, ragged and paged
    prefill, and through them the cascade levels, block-sparse, BatchAttention, context-parallel) and
    its run() and describe() read. Declared fields only (slots: a misspelt field raises).

    The host part is filled on every path (the NumPy path runs from it alone); the GPU part is left
    at its defaults on a NumPy plan (``meta is None``). Prefill's run() still reads fields by
    subscript (``plan["num_kv_heads"]``, the dict this replaced): ``__getitem__`` reads the declared
    field of that name.
    """
    # -- the batch and its configuration (every path)
    owner: str                          # the wrapper class (error messages)
    batch: int
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int                       # q / k columns
    q_dtype: np.dtype
    kv_dtype: np.dtype
    sm_scale: float
    bound: Any                          # variants.Bound: the plan's variant and its fixed parameters
    causal: bool = False
    page_size: int | None = None        # None: contiguous K/V (ragged prefill)
    spec: Any = None                    # the kernel spec known without a device (decode: before warps/TMA; fa2)
    # -- host metadata (int32 unless said)
    kv_lens: np.ndarray | None = None   # int64 [batch]: keys of every request
    qo_indptr: np.ndarray | None = None     # [batch + 1] (prefill)
    qo_lens: np.ndarray | None = None       # int64 [batch] (prefill)
    qo_range: tuple | None = None       # (min, max) of qo_lens (prefill, MLA: read once)
    kv_indptr: np.ndarray | None = None     # [batch + 1]: pages (paged) or keys (ragged)
    kv_indices: np.ndarray | None = None    # [nnz pages]: host page ids (None: decode's device ids; paged
                                        # prefill on a GPU: the caller's array, read only by the upload)
    kv_indices_src: Any = None          # decode: the caller's page ids as given (a device array used in place)
    last_page_len: np.ndarray | None = None
    max_page: int = -1                  # largest page id (-1: none, or not known on the host)
    mask: np.ndarray | None = None      # packed custom mask, uint8 (prefill)
    mask_indptr: np.ndarray | None = None
    head_dim_vo: int | None = None      # v / output columns (prefill; head_dim when they are equal)
    rope_prepass: bool = False          # ragged prefill: run() rotates q and K ahead of a kernel without the RoPE (prefill_rope)
    kv_ahead: bool = False              # fa3 prefill (pages, fp8 rows): run() gathers the rows ahead of the contiguous kernel (prefill_ahead)
    # -- the GPU half (defaults on a NumPy plan)
    device: int | None = None
    backend: str = ""                   # prefill: "fa2" | "fa3"
    run_spec: Any = None                # the kernel spec run() launches
    work_list: Any = None               # DecodeWorkList | PrefillWorkList
    split_why: str = ""                 # why split-KV came out as it did (describe())
    meta: dict | None = None            # device pointers by name (plan segments, partial workspace)
    grid_work: int = 0                  # work rows the grid covers (graph mode: the capacity)
    grid_merge: int = 0                 # merge rows the merge grid covers
    fixed_vargs: tuple | None = None    # the variant's kernel arguments when run() adds none (built once)
    # -- launch state prepared at plan() (decode: run() launches with no per-call packing)
    launchers: tuple = ()               # (attention launcher, merge launcher or None)
    kernel_args: tuple = ()             # the plan's kernel arguments, packed in the kernel's order
    grid: tuple = ()                    # attention grid
    merge_grid: tuple = ()              # merge grid
    keep: Any = None                    # a device array the plan's pointers point into (kept alive)

    @property
    def group(self) -> int:             # query heads per kv head
        return self.num_qo_heads // self.num_kv_heads

    @property
    def on_gpu(self) -> bool:
        return self.meta is not None

    def __getitem__(self, name: str):
        return getattr(self, name)

    def get(self, name: str, default=None):       # as the dict's: a declared field (None when unset)
        return getattr(self, name)


def host_ints(x, name: str, fn: str) -> np.ndarray:
    """``arrays.host_int_vector`` without its framework dispatch for what plan() is mostly given, a
    contiguous 1-D NumPy int array (returned as is, as there): ~1.5 µs each, 11 per 2-level cascade plan."""
    if type(x) is np.ndarray and x.ndim == 1 and x.dtype.kind in "iu" and (len(x) < 2 or x.strides[0] == x.itemsize):
        return x
    return arrays.host_int_vector(x, name, fn)


_UNSIGNED = {np.dtype(s): np.dtype(u) for s, u in ((np.int8, np.uint8), (np.int16, np.uint16), (np.int32, np.uint32),
                                                    (np.int64, np.uint64))}     # (a view by dtype string: +0.3 µs)


def max_index(ids: np.ndarray) -> int | None:
    """The largest value of a host int array (-1 when empty), or None when a value is negative, in one
    pass (min and max were two: ~10 µs for a batch-256 page table): a signed array viewed as unsigned
    puts every negative value above every non-negative one."""
    if not len(ids):
        return -1
    dt = ids.dtype
    if dt.kind == "i":
        u = _UNSIGNED.get(dt)           # (None for a byte-swapped dtype: by its string)
        top = int(np.maximum.reduce(ids.view(u if u is not None else dt.str.replace("i", "u"))))
        return None if top >> (8 * ids.itemsize - 1) else top
    return int(np.maximum.reduce(ids))


SHORT = 32      # int_bounds: arrays up to this long are reduced as a Python list


def int_bounds(a: np.ndarray, total: bool = False) -> tuple:
    """(min, max) of a non-empty 1-D array as Python ints, and its sum with ``total``. A short array (a shared
    prefix's few query tiles, a small batch) goes through a list: a NumPy reduction costs ~0.7 µs whatever the
    size, a list of up to SHORT ints and all three of min / max / sum ~0.4."""
    if len(a) <= SHORT:
        v = a.tolist()
        lo, hi = int(min(v)), int(max(v))
        return (lo, hi, int(sum(v))) if total else (lo, hi)
    lo, hi = int(np.minimum.reduce(a)), int(np.maximum.reduce(a))
    return (lo, hi, int(np.add.reduce(a))) if total else (lo, hi)


def int_top(a: np.ndarray) -> tuple:
    """(max, sum) of a non-empty 1-D array as Python ints (a short one through a list, as ``int_bounds``)."""
    if len(a) <= SHORT:
        v = a.tolist()
        return int(max(v)), int(sum(v))
    return int(np.maximum.reduce(a)), int(np.add.reduce(a))


def int_min(a: np.ndarray) -> int:
    """The minimum of a non-empty 1-D array as a Python int (a short one through a list, as ``int_bounds``)."""
    return int(min(a.tolist())) if len(a) <= SHORT else int(np.minimum.reduce(a))


def config_key(*args) -> tuple | None:
    """A memo key of plan()'s configuration arguments, each with its type (16 and 16.0 are different
    arguments to a check), or None when one is unhashable (a user variant without __hash__): no memo."""
    key = (args, tuple(map(type, args)))
    try:
        hash(key)
    except TypeError:
        return None
    return key


def memo_put(memo: dict, key: tuple, value) -> None:
    """Store a checked configuration (a few per wrapper; cleared past 64)."""
    if len(memo) >= 64:
        memo.clear()
    memo[key] = value


def check_fixed_split(fn: str, fixed_split_size) -> None:
    """``fixed_split_size`` of any plan(): None, or an int >= 1 (checked on every path, GPU or NumPy)."""
    if fixed_split_size is None:
        return
    if isinstance(fixed_split_size, bool) or not isinstance(fixed_split_size, (int, np.integer)) or fixed_split_size < 1:
        raise ValueError(f"{fn}: fixed_split_size must be None or an int >= 1, got {fixed_split_size!r}")


def split_choice(disable_split_kv: bool, fixed_split_size, block_n: int, auto) -> tuple[int, str]:
    """(keys per piece, why) of a prefill-style plan: none with ``disable_split_kv``, the caller's
    ``fixed_split_size`` rounded up to whole ``block_n``-key tiles, else ``auto()`` (the scheduler's)."""
    if disable_split_kv:
        return 0, "disable_split_kv"
    if fixed_split_size is not None:
        return (-(-int(fixed_split_size) // block_n) * block_n,
                f"fixed_split_size={int(fixed_split_size)} (whole {block_n}-key tiles)")
    return auto()


def describe_split(wl, block_n: int, why: str) -> list[str]:
    """describe()'s split-KV and balance lines of a prefill work list (prefill, cascade levels, MLA)."""
    head = (f"split-KV: {len(wl.merge)} query tiles cut into pieces of {wl.chunk} keys, {wl.num_slots} partial "
            f"slots, merged by a second kernel; {why}") if wl.split else f"split-KV: none; {why}"
    return [head, f"balance: {wl.balance(block_n):.2f} (mean / max key tiles per CTA)"]
