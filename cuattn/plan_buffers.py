"""The device side of a plan: the device buffers every wrapper's plan lives in, the pinned staging memory
a plan is written into and its asynchronous upload on the caller's stream inside plan(), the fixed
addresses and capacities of graph mode (``use_cuda_graph=True``), and the split-KV workspace.

``DeviceBuffers``: decode's (its own layout: ``decode.py``'s ``_upload``). ``PlanBuffers``: named int32
segments in one upload, for every other wrapper (paged and ragged prefill, MLA, and through them the
cascade levels). The work lists themselves are ``plan.py``'s (host-side scheduling, NumPy).
"""
from __future__ import annotations

import numpy as np

from . import arrays

_MAX_STAGING = 8      # plan() staging buffers in flight at once (DeviceBuffers.staging)


class DeviceBuffers:
    """Device memory owned by a wrapper: plan rows, uploaded indices, partial outputs."""

    def __init__(self, device: int, fixed: bool, owner: str = "BatchDecodeWithPagedKVCacheWrapper"):
        self.device, self.fixed, self.owner = device, fixed, owner
        self.plan = None          # int32 cupy
        self.partial = None       # float32 cupy (when no workspace buffer was given)
        # plan() staging: pinned int32 host buffers, each with the event after its last upload;
        # plan() takes one whose upload has finished (event query, no wait), else a new one
        self._staging: list[list] = []    # [pinned memory, int32 NumPy view, event or None, address]
        self._current = 0

    def staging(self, size: int) -> np.ndarray:
        """Pinned int32 host buffer of >= size elements, free to write (its last upload is done).
        No waiting on an upload where avoidable: with two buffers used in turn, every other plan()
        took 0.8-1 ms in one H100 run (FlashInfer loaded in the same process; not pinned down
        further). With _MAX_STAGING buffers in flight, the next in turn is waited for."""
        for i, (_, view, copied, _) in enumerate(self._staging):
            if view.size >= size and (copied is None or copied.done):
                self._current = i
                return view
        if len(self._staging) < _MAX_STAGING:
            self._staging.append([None, None, None, 0])
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
            entry[3] = entry[1].__array_interface__["data"][0]     # (ndarray.ctypes.data costs ~15 µs)
        return entry[1]

    def upload(self, dst_ptr: int, host: np.ndarray, count: int, stream) -> None:
        """Copy ``count`` int32 from the staging buffer just returned to ``dst_ptr``, asynchronously
        on ``stream`` (H100: 3 µs of host time for 128 KB against 12 µs for a synchronous cudaMemcpy)."""
        cp = arrays.cupy_module()
        entry = self._staging[self._current]
        if entry[1] is not host:
            raise ValueError(f"{self.owner}: upload() takes the staging buffer staging() returned last")
        cp.cuda.runtime.memcpyAsync(dst_ptr, entry[3], count * 4, 1, stream.ptr)
        if entry[2] is None:
            with cp.cuda.Device(self.device):        # the event on the stream's device
                entry[2] = cp.cuda.Event(block=False, disable_timing=True)
        entry[2].record(stream)

    def _ensure(self, name: str, size: int, dtype, what: str):
        cp = arrays.cupy_module()
        cur = getattr(self, name)
        if cur is not None and cur.size >= size:
            return cur
        if cur is not None and self.fixed:
            raise ValueError(f"{self.owner}.plan: {what} must fit the buffers "
                             f"captured with use_cuda_graph=True ({cur.size} elements), got {size}; "
                             f"plan the largest batch first or make a new wrapper")
        with cp.cuda.Device(self.device):
            new = cp.empty(max(size, 1 if cur is None else 2 * cur.size), dtype)
        setattr(self, name, new)
        return new


def refuse_capture(fn: str, use_cuda_graph: bool, stream) -> None:
    """A wrapper built without ``use_cuda_graph`` refuses a run() on a stream capturing a CUDA graph:
    its plan buffers move and its grid follows each plan, so a replay would read stale memory
    (FlashInfer corrupts the output silently there: its issue #3904)."""
    if not use_cuda_graph and arrays.is_capturing(stream):
        raise RuntimeError(f"{fn}: the stream is capturing a CUDA graph, but this wrapper was built with "
                           f"use_cuda_graph=False (its plan buffers move and its grid follows each plan, so a "
                           f"replay would read stale memory); construct it with use_cuda_graph=True")


def as_words(data: np.ndarray) -> np.ndarray:
    """Bytes (a packed mask) as int32 words for a plan segment, zero-padded to a multiple of 4."""
    b = np.ascontiguousarray(data, np.uint8).ravel()
    if b.size % 4:
        b = np.concatenate([b, np.zeros(4 - b.size % 4, np.uint8)])
    return b.view(np.int32)


def workspace_of(buffer, name: str, owner: str) -> tuple:
    """((pointer, bytes, the array kept alive), device) of a caller's GPU workspace buffer (any
    framework and dtype), or (None, None) when there is none (or it is a host array: unused)."""
    if buffer is None or not arrays.is_device_array(buffer):
        return None, None
    t = arrays.device_tensor(buffer, name, owner)
    nbytes = t.dtype.itemsize
    for d in t.shape:
        nbytes *= d
    return (t.ptr, nbytes, buffer), t.device


_DEFAULT_GRAPH_WORKSPACE = 128 << 20    # bytes of split-KV partials a graph-mode wrapper takes when given none


class PlanBuffers:
    """A wrapper's plan on the GPU, for every wrapper that uses it (prefill, and through it the
    cascade): named int32 segments (page table, work list, merge rows, ...) written into pinned
    staging memory and uploaded with one asynchronous copy on the caller's stream inside plan(),
    and the fp32 workspace of split-KV partial rows (``float_workspace_buffer`` when given).

    With ``use_cuda_graph=True`` the first plan fixes what a captured run() holds: every segment's
    capacity (twice its size, at least 256 int32; the merge rows as many as the work rows) and so its
    address, the grid (padded with empty work items), the workspace (128 MiB unless given) and the
    kernel configuration. A later plan past any of them raises ValueError saying which.
    """

    def __init__(self, owner: str, workspace=None, use_cuda_graph: bool = False):
        self.owner, self.graph = owner, bool(use_cuda_graph)
        self._workspace, self.device = workspace_of(workspace, "float_workspace_buffer", owner)
        self._bufs: DeviceBuffers | None = None
        self.caps: dict | None = None      # graph mode: capacity of every segment (int32), from the first plan
        self.kernel = None                 # graph mode: the first plan's kernel configuration
        self._slots = None                 # graph mode: partial slots of the fixed workspace

    def device_for(self, like) -> int | None:
        """The GPU of this wrapper's plans (the workspace's, a device array ``like``'s, or the current
        one), or None on a machine without one (a NumPy plan)."""
        if self.device is None:
            if arrays.is_device_array(like):
                self.device = arrays.device_tensor(like, "plan array", self.owner).device
            elif arrays.gpu_available():
                self.device = arrays.cupy_module().cuda.runtime.getDevice()
        return self.device

    def upload(self, fn: str, segments: list, kernel, like) -> dict[str, int]:
        """Device pointers by segment name (0 for an empty one) after one asynchronous upload of
        ``segments`` = [(name, int32 array or None, fill of the rows past it)] on the current stream
        of ``like``'s framework. ``kernel``: the configuration a captured run() launches (graph mode; unread
        otherwise)."""
        caps = None         # eager: every segment's capacity is its length
        if self.graph:
            sizes = {name: 0 if a is None else len(a) for name, a, _ in segments}
            if self.caps is None:
                self.caps = {n: (s if n == "kv_chunk" else max(2 * s, 256)) for n, s in sizes.items()}
                if "merge" in self.caps and "work" in self.caps:
                    self.caps["merge"] = self.caps["work"]
                self.kernel = kernel
            elif kernel != self.kernel:
                raise ValueError(f"{fn}: with use_cuda_graph=True every plan must run the kernel configuration of "
                                 f"the first plan ({self.kernel}), got {kernel}; make a wrapper per configuration")
            for n, s in sizes.items():
                if s > self.caps[n]:
                    raise ValueError(f"{fn}: {n} ({s} int32) must fit the capacity fixed by the first plan with "
                                     f"use_cuda_graph=True ({self.caps[n]}); plan the largest batch first or make "
                                     f"a new wrapper")
            caps = self.caps
        layout, total = [], 0        # (name, array, fill, offset, length, capacity) per segment
        for name, a, fill in segments:
            n = 0 if a is None else len(a)
            cap = n if caps is None else caps[name]
            layout.append((name, a, fill, total, n, cap))
            total += (cap + 3) & ~3                        # 16-byte aligned segments (int4 loads)
        bufs = self._bufs
        if bufs is None:
            bufs = self._bufs = DeviceBuffers(self.device, self.graph, self.owner)
        # -- no Device context unless the buffer grows (_ensure makes its own): the copy and the event
        #    record work from any current device (the event and the stream are both this device's)
        dev = bufs.plan
        if dev is None or dev.size < total:
            dev = bufs._ensure("plan", total, np.int32, "the plan")
        base = dev.data.ptr
        host = bufs.staging(total)
        ptrs = {}
        for name, a, fill, o, n, cap in layout:
            if n:
                if type(a) is tuple:                       # a scalar segment (kv_chunk)
                    host[o] = a[0]
                else:
                    host[o:o + n] = a
            if cap > n:
                host[o + n:o + cap] = fill
            ptrs[name] = base + 4 * o if cap else 0
        bufs.upload(base, host, total, arrays.resolve_stream(arrays.framework_of(like), self.device))
        return ptrs

    def rows(self, name: str, n: int, cols: int) -> int:
        """The grid's extent for segment ``name`` of ``n`` rows: its capacity in graph mode."""
        return self.caps[name] // cols if self.graph else n

    def max_partial(self, slot_floats: int) -> int | None:
        """Partial slots of ``slot_floats`` floats that a fixed workspace holds (None: grows as needed)."""
        if self._workspace is not None:
            return self._workspace[1] // (4 * slot_floats)
        if self.graph:
            if self._slots is None:
                self._slots = _DEFAULT_GRAPH_WORKSPACE // (4 * slot_floats)
            return self._slots
        return None

    def partial(self, fn: str, slot_floats: int, num_slots: int, row_floats: int) -> dict[str, int]:
        """Pointers ``part_o`` (slots x row_floats fp32) and ``part_lse`` (after them) of the workspace."""
        fixed = self.max_partial(slot_floats)
        slots = fixed if fixed is not None else max(num_slots, 1)
        if num_slots > slots:
            raise ValueError(f"{fn}: float_workspace_buffer must hold {num_slots * slot_floats * 4} bytes of split-KV "
                             f"partials for this plan, got {slots * slot_floats * 4}; pass a larger one or "
                             f"fixed_split_size / disable_split_kv=True")
        if self._workspace is not None:
            base = self._workspace[0]
        else:       # (_ensure enters the Device context only to allocate)
            base = self._bufs._ensure("partial", slots * slot_floats, np.float32, "the split-KV workspace").data.ptr
        return {"part_o": base, "part_lse": base + 4 * slots * row_floats}
