"""Host-side scheduling (NumPy): page-table checks, the decode work list, and the device buffers a
wrapper's plan lives in (pinned staging, asynchronous upload, fixed addresses for CUDA graphs).

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

from dataclasses import dataclass

import numpy as np

from . import arrays

BLOCK_N = 64          # tokens per pipeline stage of the decode kernel; pieces are multiples
MIN_CHUNK = 128       # never split a request into pieces shorter than this
SHORT_PIECE = 512     # with ~1 CTA per SM already, pieces shorter than this are not worth a split
_MAX_STAGING = 8      # plan() staging buffers in flight at once (DeviceBuffers.staging)
WORK_COLS = 8
MERGE_COLS = 4


@dataclass(frozen=True)
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
                 block_n: int = BLOCK_N) -> int:
    """Tokens per piece for split-KV; 0 means no request is split.

    Enough CTAs to fill every SM with ctas_per_sm resident CTAs when the batch alone cannot (one
    CTA per SM does not reach the bandwidth wall: measured 48-62% on H100), and long requests in a
    skewed batch cut to ~2x the mean so one request does not set the time.
    """
    batch = len(kv_lens)
    if batch == 0:
        return 0
    total = int(kv_lens.sum())
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
    chunk = max(MIN_CHUNK, -(-chunk // block_n) * block_n)
    if chunk < SHORT_PIECE and batch * heads_work >= 0.9 * num_sms:
        # ~1 CTA per SM already and the pieces would be short: the split's extra partial
        # writes and merge cost more than the second CTA per SM gains (H200, 2026-11-22:
        # bs16 x 512 unsplit 20.5 us vs 2 pieces 22.7; bs1 x 512 still gains from 4 pieces)
        return 0
    return 0 if max_len <= chunk else chunk


def decode_work_list(indptr: np.ndarray, kv_lens: np.ndarray, chunk: int,
                     block_n: int = BLOCK_N, align: int = 1) -> DecodeWorkList:
    """Pieces of at most ``chunk`` tokens (0: one piece per request), longest first; pieces start
    at multiples of ``align`` (the TMA kernel's 16-slot boxes), rounding ``chunk`` up if needed."""
    batch = len(kv_lens)
    kv_lens = kv_lens.astype(np.int64)
    if chunk <= 0 or (batch and kv_lens.max() <= chunk):     # nothing split: one row per request
        work = np.zeros((batch, WORK_COLS), np.int32)
        work[:, 0] = np.arange(batch)
        work[:, 1] = indptr[:-1]
        work[:, 3] = kv_lens
        work[:, 4] = -1
        if batch > 1 and kv_lens.min() != kv_lens.max():
            work = work[np.argsort(-kv_lens, kind="stable")]
        return DecodeWorkList(work, np.zeros((0, MERGE_COLS), np.int32), 0, 0, kv_lens)
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
    if lens.min() != lens.max():
        work = work[np.argsort(-lens, kind="stable")]
    sreqs = np.nonzero(split_req)[0]
    merge = np.zeros((len(sreqs), MERGE_COLS), np.int32)
    merge[:, 0] = sreqs
    merge[:, 1] = slot_base[sreqs]
    merge[:, 2] = slot_base[sreqs] + n_pieces[sreqs]
    return DecodeWorkList(work, merge, int(sp_pieces.sum()), int(chunk), kv_lens)


# ---------------------------------------------------------------------------- plan buffers




class DeviceBuffers:
    """Device memory owned by a wrapper: plan rows, uploaded indices, partial outputs."""

    def __init__(self, device: int, fixed: bool):
        self.device, self.fixed = device, fixed
        self.plan = None          # int32 cupy
        self.partial = None       # float32 cupy (when no workspace buffer was given)
        # plan() staging: pinned int32 host buffers, each with the event after its last upload;
        # plan() takes one whose upload has finished (event query, no wait), else a new one
        self._staging: list[list] = []    # [pinned memory, int32 NumPy view, event or None]
        self._current = 0

    def staging(self, size: int) -> np.ndarray:
        """Pinned int32 host buffer of >= size elements, free to write (its last upload is done).
        No waiting on an upload where avoidable: with two buffers used in turn, every other plan()
        took 0.8-1 ms in one H100 run (FlashInfer loaded in the same process; not pinned down
        further). With _MAX_STAGING buffers in flight, the next in turn is waited for."""
        for i, (_, view, copied) in enumerate(self._staging):
            if view.size >= size and (copied is None or copied.done):
                self._current = i
                return view
        if len(self._staging) < _MAX_STAGING:
            self._staging.append([None, None, None])
            self._current = len(self._staging) - 1
        else:
            self._current = (self._current + 1) % _MAX_STAGING
        entry = self._staging[self._current]
        if entry[2] is not None:
            entry[2].synchronize()
        if entry[1] is None or entry[1].size < size:
            cp = arrays.cupy_module()
            n = max(size, 1024) if entry[1] is None else max(size, 2 * entry[1].size)
            entry[0] = cp.cuda.alloc_pinned_memory(n * 4)
            entry[1] = np.frombuffer(entry[0], np.int32, n)
        return entry[1]

    def upload(self, dst_ptr: int, host: np.ndarray, count: int, stream) -> None:
        """Copy ``count`` int32 from the staging buffer just returned to ``dst_ptr``, asynchronously
        on ``stream`` (H100: 3 µs of host time for 128 KB against 12 µs for a synchronous cudaMemcpy)."""
        cp = arrays.cupy_module()
        cp.cuda.runtime.memcpyAsync(dst_ptr, host.ctypes.data, count * 4, 1, stream.ptr)
        entry = self._staging[self._current]
        if entry[2] is None:
            entry[2] = cp.cuda.Event(block=False, disable_timing=True)
        entry[2].record(stream)

    def _ensure(self, name: str, size: int, dtype, what: str):
        cp = arrays.cupy_module()
        cur = getattr(self, name)
        if cur is not None and cur.size >= size:
            return cur
        if cur is not None and self.fixed:
            raise ValueError(f"BatchDecodeWithPagedKVCacheWrapper.plan: {what} must fit the buffers "
                             f"captured with use_cuda_graph=True ({cur.size} elements), got {size}; "
                             f"plan the largest batch first or make a new wrapper")
        with cp.cuda.Device(self.device):
            new = cp.empty(max(size, 1 if cur is None else 2 * cur.size), dtype)
        setattr(self, name, new)
        return new
