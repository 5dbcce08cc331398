"""Context-parallel decode: each rank (GPU) holds a shard of every request's KV, decodes over its
shard, and the partial states (output, LSE) are all-gathered and merged exactly.

Per layer a rank sends ``batch * num_qo_heads * (head_dim * itemsize + 4)`` bytes (its output in
q's dtype and its float32 LSE, one packed buffer, one all-gather), never KV. The merge is the
``merge_states`` kernel run over the gathered buffer in place: ``lse = log(sum_r exp(lse_r))``,
``out = sum_r exp(lse_r - lse) * out_r``, each rank's partial output rounded once to q's dtype. A
rank with no tokens of a request gives LSE -inf and output 0 for it, and drops out of the merge.

- ``KVSharding``: which rank owns each token position (round-robin blocks, or contiguous spans).
- ``ShardedPagedKVCache``: ``PagedKVCache`` shards, appends routed to the owning rank, each rank's
  local page table.
- ``ContextParallelDecodeWrapper``: plan() on the local page table; run() = local decode
  (``return_lse``) + all-gather + merge, every rank returning the same merged output.
- Communicators: ``NcclCommunicator`` (CuPy's NCCL; ``spawn_nccl`` starts one process per GPU),
  ``TorchCommunicator`` (a ``torch.distributed`` group), ``LocalCommunicator`` (world size 1: no
  exchange), ``simulated_group`` / ``run_simulated`` (ranks as threads of one process, for tests).

Position-dependent variants (ALiBi, fused RoPE, sliding windows) need global key positions, which a
shard does not have: plan() refuses them. CUDA graphs: with ``use_cuda_graph=True`` the local
decode is capturable as in ``BatchDecodeWithPagedKVCacheWrapper``, the exchange buffers keep fixed
addresses after the first run(), and NCCL all-gathers can be captured (NCCL >= 2.9.6, and for a
``torch.distributed`` group as PyTorch allows); run once before capturing, pass ``out=`` (and
``lse=``), keep the batch of the first plan (the captured all-gather has a fixed size), and re-plan
with ``check_ranks=False`` (its check is an uncaptured collective on the same communicator).
tests/test_distributed.py captures and replays at world size 1; NCCL capture has no test.
"""
from __future__ import annotations

import contextlib
import multiprocessing
import queue
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from . import arrays, jit
from .cascade import _spec_for, merge_states
from .decode import BatchDecodeWithPagedKVCacheWrapper
from .errors import CacheFullError, UnsupportedError
from .page import PagedKVCache

SHARDING_MODES = ("round_robin", "contiguous")


# ---------------------------------------------------------------------------- sharding


@dataclass(frozen=True)
class KVSharding:
    """Which rank owns each token position of a request.

    ``"round_robin"``: block ``p // block_size`` goes to rank ``block % world_size`` (decode load
    stays balanced as requests grow; a block of ``page_size`` tokens fills whole local pages).
    ``"contiguous"``: rank r owns positions ``[r * block_size, (r + 1) * block_size)``, the last
    rank everything from ``(world_size - 1) * block_size`` on (a prompt split into spans).
    """
    world_size: int
    mode: str = "round_robin"
    block_size: int = 16

    def __post_init__(self):
        fn = "KVSharding"
        for name in ("world_size", "block_size"):
            v = getattr(self, name)
            if not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"{fn}: {name} must be a positive int, got {v!r}")
        if self.mode not in SHARDING_MODES:
            raise ValueError(f"{fn}: mode must be 'round_robin' or 'contiguous', got {self.mode!r}")

    def owner(self, positions) -> np.ndarray:
        """Rank owning each position (int64 array like ``positions``)."""
        p = np.asarray(positions, np.int64)
        if self.mode == "round_robin":
            return (p // self.block_size) % self.world_size
        return np.minimum(p // self.block_size, self.world_size - 1)

    def local_len(self, seq_lens, rank: int) -> np.ndarray:
        """Tokens of each request (of lengths ``seq_lens``) that ``rank`` holds (int64)."""
        self.check_rank(rank, "KVSharding.local_len")
        n, b, w = np.asarray(seq_lens, np.int64), self.block_size, self.world_size
        if self.mode == "round_robin":
            cycles, rem = np.divmod(n, b * w)
            return cycles * b + np.clip(rem - rank * b, 0, b)
        if rank < w - 1:
            return np.clip(n - rank * b, 0, b)
        return np.maximum(n - (w - 1) * b, 0)

    def check_rank(self, rank: int, fn: str) -> int:
        if not isinstance(rank, (int, np.integer)) or not 0 <= rank < self.world_size:
            raise ValueError(f"{fn}: rank must be in 0..{self.world_size - 1} (world_size={self.world_size}), "
                             f"got {rank!r}")
        return int(rank)


@dataclass(frozen=True)
class ShardedAppendBatch:
    """One step's appends, per held rank: the shard's ``AppendBatch`` and which rows of the
    step's keys/values (``[nnz, num_kv_heads, head_dim]``, requests in order) that rank stores."""
    seq_ids: tuple[int, ...]
    nnz: int
    shards: dict      # rank -> (AppendBatch, rows: slice or index array (device array on GPU caches))


class ShardedPagedKVCache:
    """A paged KV cache whose every sequence is sharded over ``sharding.world_size`` ranks.

    Each rank this process holds (``ranks``, default all: a simulation in one process) owns a
    ``PagedKVCache(num_layers, num_kv_heads, head_dim, page_size, max_num_pages, dtype, kv_layout)``
    on its ``device`` (one string, or one per held rank). In a multi-process job each process holds
    ``ranks=[rank]`` and makes the same ``add_sequence`` / ``reserve`` / ``remove_sequence`` calls
    (a replicated scheduler); ``append`` takes the step's full keys and values and stores the rows
    its ranks own. ``page_table(seq_ids, rank)`` is a rank's local CSR page table for
    ``ContextParallelDecodeWrapper.plan``, ``layer(i, rank)`` its cache array.
    """

    def __init__(self, sharding: KVSharding, num_layers: int, num_kv_heads: int, head_dim: int, page_size: int,
                 max_num_pages: int, dtype="float16", kv_layout: str = "NHD", device="cpu", *, ranks=None):
        fn = "ShardedPagedKVCache"
        if not isinstance(sharding, KVSharding):
            raise TypeError(f"{fn}: sharding must be a KVSharding, got {type(sharding).__name__}")
        self.sharding = sharding
        ranks = list(range(sharding.world_size)) if ranks is None else [sharding.check_rank(r, fn) for r in ranks]
        if not ranks or len(set(ranks)) != len(ranks):
            raise ValueError(f"{fn}: ranks must be distinct and non-empty, got {ranks}")
        devices = [device] * len(ranks) if isinstance(device, str) else list(device)
        if len(devices) != len(ranks):
            raise ValueError(f"{fn}: device must be one string or one per held rank ({len(ranks)}), got {device!r}")
        self.ranks = tuple(ranks)
        self.shards = {r: PagedKVCache(num_layers, num_kv_heads, head_dim, page_size, max_num_pages, dtype,
                                       kv_layout, d) for r, d in zip(ranks, devices)}
        self.page_size = page_size
        self._lens: dict[int, int] = {}
        self._local: dict[int, dict[int, int]] = {}     # seq_id -> {rank: local seq id}
        self._next_id = 0

    def seq_len(self, seq_id: int) -> int:
        """The sequence's length over all ranks."""
        return self._lens[self._check_seq(seq_id)]

    def _check_seq(self, seq_id: int) -> int:
        if seq_id not in self._lens:
            raise KeyError(f"ShardedPagedKVCache: no sequence with id {seq_id!r}")
        return seq_id

    def add_sequence(self) -> int:
        seq_id, self._next_id = self._next_id, self._next_id + 1
        self._lens[seq_id] = 0
        self._local[seq_id] = {r: c.add_sequence() for r, c in self.shards.items()}
        return seq_id

    def remove_sequence(self, seq_id: int) -> None:
        for r, local in self._local.pop(self._check_seq(seq_id)).items():
            self.shards[r].remove_sequence(local)
        del self._lens[seq_id]

    def reserve(self, seq_ids, num_new_tokens) -> ShardedAppendBatch:
        """Grow each sequence by its count of new tokens on the ranks that own them; all or nothing
        over the held ranks (CacheFullError leaves every shard unchanged)."""
        fn = "ShardedPagedKVCache.reserve"
        seq_ids = [self._check_seq(int(s)) for s in seq_ids]
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"{fn}: seq_ids must be distinct, got {seq_ids}")
        counts = np.asarray(num_new_tokens, np.int64).reshape(-1)
        if len(counts) != len(seq_ids) or np.any(counts < 0):
            raise ValueError(f"{fn}: num_new_tokens must be {len(seq_ids)} counts >= 0, got {list(counts)}")
        old = np.asarray([self._lens[s] for s in seq_ids], np.int64)
        new = old + counts
        positions = np.concatenate([np.arange(o, n) for o, n in zip(old, new)] or [np.zeros(0, np.int64)])
        owners = self.sharding.owner(positions)
        plans = {}
        for r, cache in self.shards.items():
            local = [self._local[s][r] for s in seq_ids]
            grow = self.sharding.local_len(new, r) - self.sharding.local_len(old, r)
            pages = -(-self.sharding.local_len(new, r) // cache.page_size)
            needed = int(sum(max(0, int(p) - len(cache.pages_of(ls))) for p, ls in zip(pages, local)))
            if needed > cache.num_free_pages:
                raise CacheFullError(f"{fn}: rank {r} needs {needed} free pages, only {cache.num_free_pages} of "
                                     f"{cache.max_num_pages} are free; free finished sequences or make larger shards")
            plans[r] = (local, grow)
        shards = {}
        for r, (local, grow) in plans.items():
            batch = self.shards[r].reserve(local, grow)
            rows = np.nonzero(owners == r)[0]
            if len(rows) and rows[-1] - rows[0] + 1 == len(rows):
                rows = slice(int(rows[0]), int(rows[-1]) + 1)    # one span: a view, no gather
            elif self.shards[r].device_id >= 0:
                cp = arrays.cupy_module()
                with cp.cuda.Device(self.shards[r].device_id):
                    rows = cp.asarray(rows)
            shards[r] = (batch, rows)
        for s, n in zip(seq_ids, new):
            self._lens[s] = int(n)
        return ShardedAppendBatch(tuple(seq_ids), len(positions), shards)

    def append(self, layer: int, keys, values, batch: ShardedAppendBatch, *, stream=None) -> None:
        """Store the rows of ``keys``/``values`` ([nnz, num_kv_heads, head_dim], the whole step's
        new tokens) that each held rank owns into that rank's shard."""
        for r, (local, rows) in batch.shards.items():
            if local.nnz:
                self.shards[r].append(layer, keys[rows], values[rows], local, stream=stream)

    def page_table(self, seq_ids, rank: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(kv_indptr, kv_indices, kv_last_page_len) of ``rank``'s shard for these sequences (NumPy
        int32); a sequence with no tokens there has no pages and last_page_len 0."""
        rank = self._held(rank, "ShardedPagedKVCache.page_table")
        return self.shards[rank].page_table([self._local[self._check_seq(int(s))][rank] for s in seq_ids])

    def layer(self, layer: int, rank: int):
        """``rank``'s paged_kv_cache array of one layer."""
        return self.shards[self._held(rank, "ShardedPagedKVCache.layer")].layer(layer)

    def _held(self, rank: int, fn: str) -> int:
        rank = self.sharding.check_rank(rank, fn)
        if rank not in self.shards:
            raise ValueError(f"{fn}: rank must be one this process holds {list(self.ranks)}, got {rank}")
        return rank


# ---------------------------------------------------------------------------- communicators


class Communicator:
    """All-gathers over ``world_size`` ranks. ``all_gather(send, recv, stream)``: ``send`` 1-D uint8
    of n bytes, ``recv`` (world_size, n) uint8 receiving rank r's bytes in row r, ordered on
    ``stream`` (a CuPy stream; None for NumPy buffers). ``gather_host(values)``: a small int64
    vector from every rank as (world_size, n) NumPy (may synchronize)."""
    rank: int = 0
    world_size: int = 1

    def all_gather(self, send, recv, stream) -> None:
        raise NotImplementedError

    def gather_host(self, values: np.ndarray) -> np.ndarray:
        raise NotImplementedError


class LocalCommunicator(Communicator):
    """World size 1: the gathered buffer is the local one (no copy, no launch)."""

    def all_gather(self, send, recv, stream) -> None:
        pass      # ContextParallelDecodeWrapper makes send a view of recv[0] at world size 1

    def gather_host(self, values: np.ndarray) -> np.ndarray:
        return np.asarray(values, np.int64)[None]


class NcclCommunicator(Communicator):
    """CuPy's NCCL bindings: ``NcclCommunicator.create(unique_id, world_size, rank, device)``, the
    unique id from ``cupy.cuda.nccl.get_unique_id()`` on one process, sent to the others; or wrap
    an existing ``cupy.cuda.nccl.NcclCommunicator``. Device (CuPy) buffers only."""

    def __init__(self, comm, device: int | None = None):
        self._comm = comm
        self.rank, self.world_size = comm.rank_id(), comm.size()
        self.device = comm.device_id() if device is None else device

    @classmethod
    def create(cls, unique_id, world_size: int, rank: int, device: int) -> "NcclCommunicator":
        from cupy.cuda import nccl
        cp = arrays.cupy_module()
        with cp.cuda.Device(device):
            return cls(nccl.NcclCommunicator(world_size, unique_id, rank), device)

    def all_gather(self, send, recv, stream) -> None:
        from cupy.cuda import nccl
        self._comm.allGather(send.data.ptr, recv.data.ptr, send.size, nccl.NCCL_UINT8, stream.ptr)

    def gather_host(self, values: np.ndarray) -> np.ndarray:
        cp = arrays.cupy_module()
        with cp.cuda.Device(self.device):
            cp.cuda.Device().synchronize()    # no all-gather of a run() still in flight on another stream
            send = cp.asarray(np.asarray(values, np.int64)).view(cp.uint8)
            recv = cp.empty((self.world_size, send.size), cp.uint8)
            self.all_gather(send, recv, cp.cuda.get_current_stream())
            return recv.get().view(np.int64)


class TorchCommunicator(Communicator):
    """A ``torch.distributed`` process group (``group=None``: the default group). Buffers are
    handed to PyTorch through DLPack (no copy); the collective runs on ``stream``."""

    def __init__(self, group=None):
        import torch.distributed as dist
        self._dist, self._group = dist, group
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self._views: dict[tuple, tuple] = {}      # (send, recv) pointers -> torch views of them

    def all_gather(self, send, recv, stream) -> None:
        import torch
        if stream is None:                          # NumPy buffers
            self._dist.all_gather(list(torch.from_numpy(recv).unbind(0)), torch.from_numpy(send), group=self._group)
            return
        key = (send.data.ptr, recv.data.ptr, send.size)
        if key not in self._views:
            self._views[key] = (torch.from_dlpack(send), torch.from_dlpack(recv))
        s, r = self._views[key]
        same = stream.ptr == torch.cuda.current_stream(s.device).cuda_stream
        ext = contextlib.nullcontext() if same else torch.cuda.stream(torch.cuda.ExternalStream(stream.ptr, s.device))
        with ext:
            self._dist.all_gather_into_tensor(r, s, group=self._group)

    def gather_host(self, values: np.ndarray) -> np.ndarray:
        import torch
        v = torch.from_numpy(np.asarray(values, np.int64))
        if self._dist.get_backend(self._group) == "nccl":
            v = v.cuda()
        out = torch.empty((self.world_size,) + tuple(v.shape), dtype=v.dtype, device=v.device)
        self._dist.all_gather(list(out.unbind(0)), v, group=self._group)
        return out.cpu().numpy()


class SimulatedCommunicator(Communicator):
    """One of ``world_size`` ranks running as threads of this process (``simulated_group``):
    the all-gather waits for every rank at a barrier. NumPy or CuPy buffers; device ranks
    synchronize their stream before exchanging (a test tool, not a fast path)."""

    def __init__(self, rank: int, world_size: int, shared: dict):
        self.rank, self.world_size, self._shared = rank, world_size, shared

    def _exchange(self, item, copy: Callable[[list], None]):
        slots, barrier = self._shared["slots"], self._shared["barrier"]
        slots[self.rank] = item
        barrier.wait()
        copy(list(slots))
        barrier.wait()           # nobody overwrites a slot before every rank has copied it

    def all_gather(self, send, recv, stream) -> None:
        if stream is not None:
            stream.synchronize()            # this rank's send is complete before others read it

        def copy(got):
            with stream if stream is not None else contextlib.nullcontext():
                for r, x in enumerate(got):
                    recv[r][...] = x
            if stream is not None:
                stream.synchronize()        # copied before the owners may overwrite their sends
        self._exchange(send, copy)

    def gather_host(self, values: np.ndarray) -> np.ndarray:
        out = []
        self._exchange(np.asarray(values, np.int64), lambda got: out.extend(got))
        return np.stack(out)


def simulated_group(world_size: int, timeout: float = 60.0) -> list[SimulatedCommunicator]:
    """``world_size`` communicators of one simulated group: give each to its own thread."""
    if not isinstance(world_size, (int, np.integer)) or world_size < 1:
        raise ValueError(f"simulated_group: world_size must be a positive int, got {world_size!r}")
    shared = {"slots": [None] * world_size, "barrier": threading.Barrier(world_size, timeout=timeout)}
    return [SimulatedCommunicator(r, world_size, shared) for r in range(world_size)]


def run_simulated(world_size: int, fn: Callable[[int, Communicator], Any], timeout: float = 60.0) -> list:
    """Run ``fn(rank, comm)`` for every rank of a simulated group, each in a thread; returns the
    results by rank. The first exception is re-raised (the others' barriers are broken)."""
    comms = simulated_group(world_size, timeout)
    results, errors = [None] * world_size, [None] * world_size

    def body(r):
        try:
            results[r] = fn(r, comms[r])
        except BaseException as e:   # noqa: BLE001 - handed to the caller below
            errors[r] = e
            comms[r]._shared["barrier"].abort()

    threads = [threading.Thread(target=body, args=(r,)) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    first = next((e for e in errors if e is not None and not isinstance(e, threading.BrokenBarrierError)), None)
    first = first or next((e for e in errors if e is not None), None)
    if first is not None:
        raise first
    return results


def spawn_nccl(world_size: int, fn: Callable, *args, timeout: float = 600.0) -> list:
    """Run ``fn(rank, comm, *args)`` in ``world_size`` processes, rank r on GPU r with an
    ``NcclCommunicator`` (torchrun-like: the NCCL unique id is made here and handed to the spawned
    processes). ``fn`` must be importable (module level) and return something picklable; returns
    the results by rank, or raises RuntimeError with a failed rank's traceback."""
    from cupy.cuda import nccl
    uid = nccl.get_unique_id()
    mp = multiprocessing.get_context("spawn")
    results = mp.Queue()
    procs = [mp.Process(target=_spawned_rank, args=(r, world_size, uid, fn, args, results)) for r in range(world_size)]
    for p in procs:
        p.start()
    out, failed, got, deadline = [None] * world_size, None, 0, time.monotonic() + timeout
    while got < world_size and not failed:
        try:
            rank, ok, value = results.get(timeout=1.0)
        except queue.Empty:
            dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if dead or time.monotonic() > deadline:
                failed = (f"spawn_nccl: rank {dead[0]} exited with code {procs[dead[0]].exitcode}" if dead
                          else f"spawn_nccl: no result from every rank within {timeout} s")
            continue
        out[rank], got = value, got + 1
        if not ok:
            failed = f"spawn_nccl: rank {rank} failed:\n{value}"
    for p in procs:
        if failed:
            p.terminate()
        p.join()
    if failed:
        raise RuntimeError(failed)
    return out


def _spawned_rank(rank, world_size, uid, fn, args, results):
    try:
        arrays.cupy_module().cuda.Device(rank).use()
        comm = NcclCommunicator.create(uid, world_size, rank, rank)
        results.put((rank, True, fn(rank, comm, *args)))
    except BaseException:      # noqa: BLE001 - reported to the parent
        results.put((rank, False, traceback.format_exc()))


# ---------------------------------------------------------------------------- the wrapper

_SIGNATURE = ("batch", "num_qo_heads", "num_kv_heads", "head_dim", "q_data_type", "kv_data_type", "sm_scale",
              "logits_soft_cap", "world_size")
_DTYPES = list(arrays.SHORT_NAME)      # dtype codes of the signature


class ContextParallelDecodeWrapper:
    """Decode over a KV cache sharded across ranks: local decode, all-gather of (out, LSE), merge.

    Every rank makes one, with its communicator, plans with its local page table (from
    ``ShardedPagedKVCache.page_table(seq_ids, rank)``), and runs with the same ``q`` and its own
    cache shard; every rank returns the merged output.

    Parameters
    ----------
    comm : Communicator, optional
        ``NcclCommunicator``, ``TorchCommunicator``, a ``simulated_group`` member; default
        ``LocalCommunicator()`` (world size 1).
    workspace_buffer, kv_layout, use_cuda_graph :
        as ``BatchDecodeWithPagedKVCacheWrapper`` (the local decode); see the module docstring
        for what CUDA graphs capture.
    """

    def __init__(self, comm: Communicator | None = None, workspace_buffer: Any = None, kv_layout: str = "NHD",
                 use_cuda_graph: bool = False):
        self._comm = LocalCommunicator() if comm is None else comm
        if not isinstance(self._comm, Communicator):
            raise TypeError(f"ContextParallelDecodeWrapper: comm must be a cuattn.distributed.Communicator, "
                            f"got {type(comm).__name__}")
        self._decode = BatchDecodeWithPagedKVCacheWrapper(workspace_buffer, kv_layout, use_cuda_graph)
        self._use_cuda_graph = bool(use_cuda_graph)
        self._bufs: dict[int, tuple] = {}       # device (-1 host) -> (flat recv buffer, its capacity)
        self._views = None
        self._planned = False

    @property
    def rank(self) -> int:
        return self._comm.rank

    @property
    def world_size(self) -> int:
        return self._comm.world_size

    def plan(self, indptr, indices, last_page_len, num_qo_heads: int, num_kv_heads: int, head_dim: int,
             page_size: int, pos_encoding_mode: str = "NONE", window_left: int = -1,
             logits_soft_cap: float | None = None, q_data_type: Any = "float16", kv_data_type: Any = None,
             data_type: Any = None, sm_scale: float | None = None, *, fixed_split_size: int | None = None,
             disable_split_kv: bool = False, world_size: int | None = None, check_ranks: bool = True) -> None:
        """Plan the local decode of one step on this rank's page table.

        Parameters
        ----------
        indptr, indices, last_page_len : int32 arrays, this rank's CSR page table
            (``ShardedPagedKVCache.page_table``); a request with no tokens here has no pages.
        num_qo_heads, num_kv_heads, head_dim, page_size, logits_soft_cap, q_data_type,
        kv_data_type, sm_scale, fixed_split_size, disable_split_kv :
            as ``BatchDecodeWithPagedKVCacheWrapper.plan``; must agree on every rank (but page_size).
        world_size : int, optional
            The world size the cache was sharded for; checked against the communicator's.
        check_ranks : bool
            All-gather the step's shape (batch, heads, head_dim, dtypes, scale) and refuse a
            mismatch between ranks, which would otherwise corrupt or hang the exchange. Costs a
            small all-gather and, with NCCL, a wait for the stream's queued work: a serving loop
            may pass False once its ranks are known to agree.

        Raises
        ------
        UnsupportedError
            For ``pos_encoding_mode`` other than "NONE" or ``window_left >= 0``.
        ValueError
            If ``world_size`` differs from the communicator's or the ranks disagree.
        """
        fn = "ContextParallelDecodeWrapper.plan"
        if pos_encoding_mode != "NONE" or window_left != -1:
            raise UnsupportedError(f"{fn}: pos_encoding_mode must be 'NONE' and window_left -1 under context "
                                   f"parallelism (a shard has no global key positions), got "
                                   f"pos_encoding_mode={pos_encoding_mode!r}, window_left={window_left}")
        if world_size is not None and world_size != self._comm.world_size:
            raise ValueError(f"{fn}: world_size must equal the communicator's world size "
                             f"{self._comm.world_size}, got {world_size}")
        self._planned = False
        self._decode.plan(indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
                          logits_soft_cap=logits_soft_cap, q_data_type=q_data_type, kv_data_type=kv_data_type,
                          data_type=data_type, sm_scale=sm_scale, fixed_split_size=fixed_split_size,
                          disable_split_kv=disable_split_kv)
        d = self._decode._plan      # plan.Plan of the local decode
        if self._use_cuda_graph and getattr(self, "_batch", d.batch) != d.batch:
            raise ValueError(f"{fn}: batch must stay {self._batch} (the first plan's) with use_cuda_graph=True (the "
                             f"captured all-gather has a fixed size), got {d.batch}; use one wrapper per batch size")
        if check_ranks and self._comm.world_size > 1:
            f64 = lambda x: int(np.float64(x if x is not None else np.nan).view(np.int64))   # noqa: E731
            crc = lambda dt: _DTYPES.index(dt) if dt in _DTYPES else -1                      # noqa: E731
            mine = np.array([d.batch, d.num_qo_heads, d.num_kv_heads, d.head_dim, crc(d.q_dtype),
                             crc(d.kv_dtype), f64(d.sm_scale), f64(logits_soft_cap),
                             -1 if world_size is None else world_size], np.int64)
            every = self._comm.gather_host(mine)
            for i, name in enumerate(_SIGNATURE):
                if np.any(every[:, i] != every[0, i]):
                    raise ValueError(f"{fn}: {name} must be the same on every rank, got "
                                     f"{self._describe(every[:, i], name)} by rank")
        self._batch, self._q_dtype = d.batch, d.q_dtype
        self._shape = (d.batch, d.num_qo_heads, d.head_dim)
        self._o_bytes = d.batch * d.num_qo_heads * d.head_dim * d.q_dtype.itemsize
        self._nbytes = -(-(self._o_bytes + d.batch * d.num_qo_heads * 4) // 16) * 16   # per rank: out, LSE, pad
        self._views = None
        self._planned = True

    @staticmethod
    def _describe(column: np.ndarray, name: str) -> list:
        if name in ("sm_scale", "logits_soft_cap"):
            return [float(np.int64(v).view(np.float64)) for v in column]
        return [str(_DTYPES[v]) if 0 <= v < len(_DTYPES) else "other" for v in column] \
            if name.endswith("data_type") else [int(v) for v in column]

    def _exchange_views(self, device: int):
        """(send, recv, send_out, send_lse) over one buffer: recv (world_size, nbytes) uint8, send its
        row of this rank at world size 1 (no copy) and a separate buffer otherwise."""
        if self._views is not None and self._views[0] == device:
            return self._views[1]
        world, n = self._comm.world_size, self._nbytes
        need = (world + (world > 1)) * n
        flat, cap = self._bufs.get(device, (None, -1))
        if cap < need:
            if flat is not None and self._use_cuda_graph:
                raise ValueError("ContextParallelDecodeWrapper.run: the exchange buffers are fixed with "
                                 "use_cuda_graph=True; plan the largest batch first")
            if device < 0:
                flat = np.zeros(max(need, 1), np.uint8)
            else:
                cp = arrays.cupy_module()
                with cp.cuda.Device(device):
                    flat = cp.zeros(max(need, 1), cp.uint8)
            self._bufs[device] = (flat, need)
        recv = flat[:world * n].reshape(world, n)
        send = recv[0] if world == 1 else flat[world * n:(world + 1) * n]
        raw = arrays.RAW_VIEW.get(self._q_dtype, self._q_dtype) if device >= 0 else self._q_dtype
        send_out = send[:self._o_bytes].view(raw).reshape(self._shape)
        send_lse = send[self._o_bytes:self._o_bytes + self._shape[0] * self._shape[1] * 4].view(np.float32).reshape(
            self._shape[:2])
        views = (send, recv, send_out, send_lse)
        self._views = (device, views)
        return views

    def run(self, q, paged_kv_cache, *, out=None, lse=None, return_lse: bool = False,
            enable_pdl: bool | None = None, stream: Any = None):
        """Merged decode attention over every rank's shard.

        Parameters
        ----------
        q : array, shape (batch, num_qo_heads, head_dim), q_data_type; the same on every rank
        paged_kv_cache : this rank's shard (``ShardedPagedKVCache.layer(i, rank)``), any form
            ``BatchDecodeWithPagedKVCacheWrapper.run`` takes.
        out : array, optional, shape and dtype of q: written in place.
        lse : float32 array, optional, shape (batch, num_qo_heads): written in place.
        return_lse : bool
            Also return the merged LSE (natural log), float32 (batch, num_qo_heads).

        Returns
        -------
        out, or (out, lse) with ``return_lse``; in q's framework, equal on every rank.
        """
        fn = "ContextParallelDecodeWrapper.run"
        if not self._planned:
            raise ValueError(f"{fn}: plan() must be called before run()")
        if not arrays.is_device_array(q, "q", fn):
            return self._run_host(q, paged_kv_cache, out, lse, return_lse, fn)
        device, framework = self._decode._device, arrays.framework_of(q)
        st = arrays.resolve_stream(framework, device, stream)
        send, recv, send_out, send_lse = self._exchange_views(device)
        self._decode.run(q, paged_kv_cache, out=send_out, lse=send_lse, enable_pdl=enable_pdl, stream=st)
        if self._comm.world_size > 1 and self._batch:
            self._comm.all_gather(send, recv, st)
        ctx = arrays.Context(framework, device, st)
        batch, heads, head_dim = self._shape
        if out is None:
            out = arrays.empty(ctx, self._shape, self._q_dtype)
        if lse is None and return_lse:
            lse = arrays.empty(ctx, self._shape[:2], np.float32)
        to = arrays.device_tensor(out, "out", fn)
        if to.shape != self._shape or not arrays.same_storage(to.dtype, self._q_dtype) or to.device != device:
            raise ValueError(f"{fn}: out must have shape {self._shape} and dtype {self._q_dtype} on GPU {device}, "
                             f"got {to.shape} {to.dtype} on GPU {to.device}")
        lse_ptr = 0
        if lse is not None:
            tl = arrays.device_tensor(lse, "lse", fn)
            if tl.shape != self._shape[:2] or tl.dtype != np.float32 or not tl.is_contiguous() or tl.device != device:
                raise ValueError(f"{fn}: lse must be a contiguous float32 array of shape {self._shape[:2]} on GPU "
                                 f"{device}, got {tl.shape} {tl.dtype}")
            lse_ptr = tl.ptr
        if batch:     # merge_states' kernel over the gathered buffer: v (batch, rank, head, d), s likewise
            item = self._q_dtype.itemsize
            launch = jit.get_launcher(_spec_for(self._q_dtype, fn), "cuattn_merge_states", device, "ppppiiiqqqqqqqq")
            launch((batch, heads), 128, st, recv.data.ptr, recv.data.ptr + self._o_bytes, to.ptr, lse_ptr,
                   self._comm.world_size, heads, head_dim, heads * head_dim, self._nbytes // item, head_dim,
                   heads, self._nbytes // 4, 1, to.strides[0], to.strides[1])
        result = arrays.export(ctx, out, self._q_dtype)
        return (result, arrays.export(ctx, lse)) if return_lse else result

    forward = run

    def _run_host(self, q, paged_kv_cache, out, lse, return_lse, fn):
        send, recv, send_out, send_lse = self._exchange_views(-1)
        self._decode.run(q, paged_kv_cache, out=send_out, lse=send_lse)
        if self._comm.world_size > 1:
            self._comm.all_gather(send, recv, None)
        world, (batch, heads, head_dim) = self._comm.world_size, self._shape
        o_all = recv[:, :self._o_bytes].view(self._q_dtype).reshape(world, batch, heads, head_dim)
        s_all = recv[:, self._o_bytes:self._o_bytes + batch * heads * 4].view(np.float32).reshape(world, batch, heads)
        o, s = merge_states(o_all.transpose(1, 0, 2, 3), s_all.transpose(1, 0, 2))
        ctx = arrays.Context(arrays.framework_of(q), -1, None)
        return arrays.host_results(ctx, np.asarray(o, np.float32), s, out, lse, return_lse, self._q_dtype, fn)
