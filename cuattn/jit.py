"""Run-time compilation: kernels_cu/ sources -> NVRTC -> cubin (disk cache) -> CuPy module.

A kernel specialization is a frozen dataclass (a ``KernelSpec``): its ``name`` is readable,
``defines()`` gives the ``-D`` options, ``source`` names the file under ``kernels_cu/``.
``compile_kernel(spec, arch)`` works with no GPU (NVRTC is called directly through ctypes,
so CI compiles every shipped kernel for sm_80 and sm_90a); ``get_function`` loads the cubin
for a device and returns a launchable CuPy function.

Cache layout: one file per key in ``cache_dir()``; the key is a SHA-256 over the package
version, the assembled translation unit (our headers inlined), the options, the arch and
the NVRTC version. Entries carry a payload hash (a corrupt entry is recompiled), are
written atomically, and a per-key file lock keeps parallel workers from compiling twice.
"""
from __future__ import annotations

import ctypes
import fcntl
import functools
import hashlib
import json
import logging
import os
import re
import struct
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from ._version import __version__
from .arrays import install_hint
from .errors import CompileError, DeviceUnavailableError

# A wheel carries the sources inside the package; a checkout has them beside it.
_PACKAGED = Path(__file__).resolve().parent / "kernels_cu"
KERNELS_DIR = _PACKAGED if _PACKAGED.is_dir() else Path(__file__).resolve().parent.parent / "kernels_cu"

SHIPPED_ARCHS = ("sm_80", "sm_90a")
_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$', re.M)
_MAGIC = b"CUATTN1\n"
_log = logging.getLogger("cuattn")


class KernelSpec(Protocol):
    source: str                      # file name under kernels_cu/

    @property
    def name(self) -> str: ...       # readable and unique per specialization

    def defines(self) -> tuple[str, ...]: ...


@dataclass(frozen=True)
class CompiledKernel:
    spec_name: str
    arch: str
    cubin: bytes
    # entry -> {"registers", "spill_stores", "spill_loads", "stack_frame"} from the ptxas log; empty
    # when NVRTC prints no log (seen with NVRTC 13.0 on the test GPUs; cause not established)
    resources: dict
    seconds: float           # NVRTC wall time when it was compiled
    from_cache: bool


# ---------------------------------------------------------------------------- source


@functools.cache
def assemble_source(source: str) -> str:
    """The translation unit for ``kernels_cu/<source>``, our own headers inlined once each."""
    seen: set[Path] = set()

    def inline(path: Path) -> str:
        if path in seen:
            return ""
        seen.add(path)
        if not path.is_file():
            raise FileNotFoundError(f"kernel source {path} not found (KERNELS_DIR={KERNELS_DIR})")
        text = path.read_text()
        # include paths are relative to kernels_cu/, e.g. "common/dtypes.cuh"
        return _INCLUDE.sub(lambda m: inline((KERNELS_DIR / m.group(1)).resolve()), text)

    return inline((KERNELS_DIR / source).resolve())


# ---------------------------------------------------------------------------- NVRTC


class _Nvrtc:
    """The few NVRTC entry points we need, through ctypes (works with no GPU or driver)."""

    def __init__(self):
        try:
            from cuda import pathfinder
        except ImportError as e:
            raise DeviceUnavailableError(f"cuda-pathfinder is not installed; {install_hint()}") from e
        try:
            loaded = pathfinder.load_nvidia_dynamic_lib("nvrtc")
        except Exception as e:  # pathfinder raises several not-found types
            raise DeviceUnavailableError(f"NVRTC library not found ({e}); {install_hint()}") from e
        self.path = loaded.abs_path
        lib = ctypes.CDLL(loaded.abs_path)
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        self.lib = lib
        major, minor = ctypes.c_int(), ctypes.c_int()
        self._check(lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
        self.version = (major.value, minor.value)

    def _check(self, status: int, what: str) -> None:
        if status != 0:
            raise RuntimeError(f"{what} failed: {self.lib.nvrtcGetErrorString(status).decode()}")

    def compile(self, source: str, name: str, options: tuple[str, ...]) -> tuple[int, bytes, str]:
        """Returns (status, cubin, log); status != 0 means the program did not compile."""
        lib, prog = self.lib, ctypes.c_void_p()
        self._check(lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name.encode(),
                                           0, None, None), "nvrtcCreateProgram")
        try:
            opts = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
            status = lib.nvrtcCompileProgram(prog, len(options), opts)
            size = ctypes.c_size_t()
            self._check(lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size)), "nvrtcGetProgramLogSize")
            log = ctypes.create_string_buffer(size.value)
            self._check(lib.nvrtcGetProgramLog(prog, log), "nvrtcGetProgramLog")
            cubin = b""
            if status == 0:
                self._check(lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "nvrtcGetCUBINSize")
                buf = ctypes.create_string_buffer(size.value)
                self._check(lib.nvrtcGetCUBIN(prog, buf), "nvrtcGetCUBIN")
                cubin = buf.raw
            return status, cubin, log.value.decode(errors="replace")
        finally:
            lib.nvrtcDestroyProgram(ctypes.byref(prog))


@functools.cache
def _nvrtc() -> _Nvrtc:
    return _Nvrtc()


def nvrtc_version() -> tuple[int, int]:
    return _nvrtc().version


def source_text(spec: KernelSpec) -> str:
    """The whole translation unit of a spec: its variant prelude (``spec.prelude``, generated by
    variants.py; empty for kernels without variants), then ``kernels_cu/<spec.source>``."""
    return getattr(spec, "prelude", "") + assemble_source(spec.source)


def compile_options(spec: KernelSpec, arch: str) -> tuple[str, ...]:
    cc = re.sub(r"\D", "", arch)
    return (f"--gpu-architecture={arch}", "--std=c++17", "--ptxas-options=-v",
            f"-DCUATTN_ARCH={cc}") + tuple(spec.defines())


_PTXAS_ENTRY = re.compile(r"Function properties for (\w+)\s*\n[^\d\n]*(\d+) bytes stack frame, "
                          r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_PTXAS_REGS = re.compile(r"Compiling entry function '(\w+)'.*?Used (\d+) registers", re.S)


def parse_ptxas_log(log: str) -> dict:
    """Per-function register, spill and stack counts from ``--ptxas-options=-v`` output."""
    out: dict[str, dict[str, int]] = {}
    for name, stack, stores, loads in _PTXAS_ENTRY.findall(log):
        out.setdefault(name, {}).update(stack_frame=int(stack), spill_stores=int(stores),
                                        spill_loads=int(loads))
    for name, regs in _PTXAS_REGS.findall(log):
        out.setdefault(name, {})["registers"] = int(regs)
    return out


# ---------------------------------------------------------------------------- disk cache


def cache_dir() -> Path:
    env = os.environ.get("CUATTN_CACHE_DIR")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "cuattn"


def cache_key(spec: KernelSpec, arch: str) -> str:
    h = hashlib.sha256()
    for part in (__version__, spec.name, source_text(spec), "\0".join(compile_options(spec, arch)),
                 arch, "%d.%d" % nvrtc_version()):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


def _entry_path(spec: KernelSpec, arch: str, key: str) -> Path:
    return cache_dir() / f"{spec.name}.{arch}.{key[:24]}.cubin"


def _read_entry(path: Path) -> tuple[bytes, dict] | None:
    """The cubin and metadata of a cache entry, or None if it is missing or corrupt."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    head = len(_MAGIC) + 32
    if len(data) < head + 4 or not data.startswith(_MAGIC):
        return None
    payload = data[head:]
    if hashlib.sha256(payload).digest() != data[len(_MAGIC):head]:
        return None
    (meta_len,) = struct.unpack_from("<I", payload)
    try:
        meta = json.loads(payload[4:4 + meta_len])
    except ValueError:
        return None
    return payload[4 + meta_len:], meta


def _write_entry(path: Path, cubin: bytes, meta: dict) -> None:
    meta_bytes = json.dumps(meta).encode()
    payload = struct.pack("<I", len(meta_bytes)) + meta_bytes + cubin
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(_MAGIC + hashlib.sha256(payload).digest() + payload)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


_memo: dict[tuple[str, str], CompiledKernel] = {}
_requested: list[tuple[KernelSpec, str]] = []     # (spec, arch) in first-use order: specs_requested()


def specs_requested() -> list[tuple[KernelSpec, str]]:
    """Every (spec, arch) this process asked ``compile_kernel`` for, in first-use order (a test
    session records what it used, so the next one can compile those up front in parallel)."""
    return list(_requested)


def compile_kernel(spec: KernelSpec, arch: str) -> CompiledKernel:
    """Compile ``spec`` for ``arch`` (e.g. "sm_90a"), or fetch it from the memo / disk cache."""
    key = cache_key(spec, arch)
    memo_key = (str(cache_dir()), key)
    if memo_key in _memo:
        return _memo[memo_key]
    _requested.append((spec, arch))
    path = _entry_path(spec, arch, key)
    path.parent.mkdir(parents=True, exist_ok=True)
    entry = _read_entry(path)
    if entry is None:
        with open(path.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)     # another process may be compiling this key
            entry = _read_entry(path)
            if entry is None:
                compiled = _compile_now(spec, arch)
                _write_entry(path, compiled.cubin, {"resources": compiled.resources,
                                                    "seconds": compiled.seconds})
                _memo[memo_key] = compiled
                return compiled
    cubin, meta = entry
    compiled = CompiledKernel(spec.name, arch, cubin, meta["resources"], meta["seconds"], True)
    _memo[memo_key] = compiled
    return compiled


def _compile_now(spec: KernelSpec, arch: str) -> CompiledKernel:
    source, options = source_text(spec), compile_options(spec, arch)
    if os.environ.get("CUATTN_SAVE_SOURCE"):
        (cache_dir() / f"{spec.name}.{arch}.cu").write_text(source)
    start = time.perf_counter()
    status, cubin, log = _nvrtc().compile(source, f"{spec.name}.cu", options)
    seconds = time.perf_counter() - start
    if status != 0:
        raise CompileError(spec.name, options, log, source)
    if os.environ.get("CUATTN_VERBOSE") and _log.level != logging.INFO:   # the README's knob: on stderr
        _log.setLevel(logging.INFO)
        if not _log.handlers:
            _log.addHandler(logging.StreamHandler())
    _log.info("cuattn: compiled %s for %s in %.2f s", spec.name, arch, seconds)
    return CompiledKernel(spec.name, arch, cubin, parse_ptxas_log(log), seconds, False)


def _compile_job(job):
    spec, arch = job
    return compile_kernel(spec, arch).from_cache


def precompile(jobs, workers: int | None = None, progress=None) -> int:
    """Compile (spec, arch) ``jobs`` into the disk cache over ``workers`` processes (default: every
    core; each NVRTC call is single-threaded); ``progress(i, total, spec, arch)`` after each, in
    order. Returns how many were compiled (the rest came from the cache)."""
    import concurrent.futures
    import multiprocessing
    import sys
    jobs = list(jobs)
    workers = workers or os.cpu_count() or 1
    main_file = getattr(sys.modules.get("__main__"), "__file__", None)
    if main_file is None or main_file.startswith("<"):
        workers = 1      # spawned workers re-import __main__: impossible for stdin / interactive code
    compiled = 0
    if workers <= 1 or len(jobs) <= 1:
        results = map(_compile_job, jobs)
        pool = None
    else:   # "spawn": no CUDA context or CuPy state is forked into the workers
        pool = concurrent.futures.ProcessPoolExecutor(min(workers, len(jobs)),
                                                      mp_context=multiprocessing.get_context("spawn"))
        results = pool.map(_compile_job, jobs)
    try:
        for i, (job, from_cache) in enumerate(zip(jobs, results), 1):
            compiled += not from_cache
            if progress is not None:
                progress(i, len(jobs), *job)
    finally:
        if pool is not None:
            pool.shutdown()
    return compiled


def clear_cache() -> int:
    """Delete every cache entry; returns how many files were removed."""
    removed = 0
    if cache_dir().is_dir():
        for p in cache_dir().iterdir():
            if p.suffix in (".cubin", ".lock", ".cu") or p.name.startswith(".tmp-"):
                p.unlink(missing_ok=True)
                removed += 1
    return removed


def cache_usage() -> tuple[int, int]:
    """(number of cached kernels, total bytes)."""
    if not cache_dir().is_dir():
        return 0, 0
    files = [p for p in cache_dir().iterdir() if p.suffix == ".cubin"]
    return len(files), sum(p.stat().st_size for p in files)


# ---------------------------------------------------------------------------- loading


@functools.cache
def device_arch(device_id: int) -> str:
    """The NVRTC target for a device: sm_90a on Hopper (wgmma, setmaxnreg), else sm_XY."""
    from .arrays import cupy_module
    cc = cupy_module().cuda.Device(device_id).compute_capability
    return "sm_90a" if cc == "90" else f"sm_{cc}"


def pdl_launch(device_id: int, enable_pdl: bool | None) -> bool:
    """Whether a run() launches with Programmatic Dependent Launch: ``enable_pdl`` None (FlashInfer's
    default) or True, on a GPU that has it (sm_90+; ignored below)."""
    return (enable_pdl is None or bool(enable_pdl)) and _has_pdl(device_id)


@functools.cache
def _has_pdl(device_id: int) -> bool:
    return int(device_arch(device_id)[3:].rstrip("a")) >= 90


@functools.cache
def _module(spec: KernelSpec, device_id: int):
    from .arrays import cupy_module
    cp = cupy_module()
    compiled = compile_kernel(spec, device_arch(device_id))
    with cp.cuda.Device(device_id):
        module = cp.cuda.function.Module()
        module.load(compiled.cubin)
    return module       # memoized: its functions stay valid for the process


@functools.cache
def get_function(spec: KernelSpec, entry: str, device_id: int):
    """A launchable ``cupy.cuda.function.Function`` for ``entry`` of ``spec`` on ``device_id``."""
    return _module(spec, device_id).get_function(entry)


# ---------------------------------------------------------------------------- tensor maps (TMA)

_TMAP_UINT8 = 0           # 8-bit elements (fp8)
_TMAP_UINT16 = 1          # 16-bit elements (fp16 / bf16: the copy moves bits)
_TMAP_SWIZZLE_64B = 2
_TMAP_SWIZZLE_128B = 3
_TMAP_L2_256B = 3


@functools.cache
def _encode_tiled():
    lib = ctypes.CDLL("libcuda.so.1")
    f = lib.cuTensorMapEncodeTiled
    f.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint64),
                  ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint32),
                  ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    f.restype = ctypes.c_int
    return f


def tensor_map(ptr: int, dims: tuple, strides: tuple, box: tuple, user: str, fn: str, *, elem_bytes: int = 2,
               swizzle_bytes: int = 128) -> bytes:
    """A 128-byte CUtensorMap (``cuTensorMapEncodeTiled``) of 16-bit or 8-bit (``elem_bytes``)
    elements, for a kernel's ``__grid_constant__`` parameter (launcher kind "t"): ``dims`` innermost
    first (dimension 0 contiguous), ``strides`` in elements of dimensions 1.., ``box`` the tile one
    TMA load copies, written with the 128- or 64-byte swizzle (box[0] * elem_bytes = swizzle_bytes),
    the L2 fetching 256 bytes at once. ``user`` names the kernel in the error for misaligned inputs."""
    if ptr % 16 or any((s * elem_bytes) % 16 for s in strides):
        raise ValueError(f"{fn}: {user} loads K/V with TMA, which needs a 16-byte aligned base and strides; "
                         f"got base {ptr:#x} and strides {tuple(strides)} elements")
    rank = len(dims)
    buf = (ctypes.c_uint64 * 24)()        # 128 bytes, plus room to align them to 64
    addr = (ctypes.addressof(buf) + 63) & ~63
    c_dims = (ctypes.c_uint64 * rank)(*dims)
    c_strides = (ctypes.c_uint64 * (rank - 1))(*(s * elem_bytes for s in strides))
    c_box = (ctypes.c_uint32 * rank)(*box)
    c_elem = (ctypes.c_uint32 * rank)(*([1] * rank))
    dtype = {1: _TMAP_UINT8, 2: _TMAP_UINT16}[elem_bytes]
    swizzle = {64: _TMAP_SWIZZLE_64B, 128: _TMAP_SWIZZLE_128B}[swizzle_bytes]
    status = _encode_tiled()(addr, dtype, rank, ptr, c_dims, c_strides, c_box, c_elem, 0, swizzle, _TMAP_L2_256B, 0)
    if status != 0:
        raise RuntimeError(f"{fn}: cuTensorMapEncodeTiled failed with CUresult {status} (dims {list(dims)}, "
                           f"element strides {list(strides)}, box {list(box)})")
    return ctypes.string_at(addr, 128)


_ARG_FORMATS = {"p": "Q", "q": "q", "i": "i4x", "f": "f4x", "t": "128s"}   # 8-byte slots; "t" 128 bytes
_ARG_SIZES = {"t": 128}     # a CUtensorMap (__grid_constant__), 64-byte aligned; every other kind 8


class _LaunchAttribute(ctypes.Structure):      # CUlaunchAttribute: id, 4 bytes padding, a 64-byte union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int),
                ("value_rest", ctypes.c_char * 60)]


class _LaunchConfig(ctypes.Structure):         # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared_mem_bytes", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_LaunchAttribute)),
                ("num_attrs", ctypes.c_uint)]


_CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6


class Launcher:
    """A kernel launched through ``cuLaunchKernelEx`` (ctypes), arguments packed by one
    ``struct.pack_into`` into preallocated 8-byte slots. CuPy's generic marshalling costs
    1-2 µs per NumPy scalar argument, which a decode step's ~10 µs kernels cannot hide.

    ``arg_kinds`` has one letter per kernel parameter: p (pointer), q (int64), i (int32),
    f (float32), t (a 128-byte CUtensorMap passed by value: ``bytes``); ``smem_bytes`` above 48 KB
    raises the function's dynamic shared-memory limit. ``pdl=True`` launches with programmatic
    stream serialization (sm_90+: the grid may start while the previous kernel in the stream
    finishes; see common/grid_dependency.cuh).

    One Launcher serves every caller of its kernel (``get_launcher`` memoizes it), so a lock keeps
    the packed arguments and the configuration of one call from being overwritten by another
    thread's before the driver has read them (the ctypes call releases the GIL): ranks or layers
    launched from several threads got each other's arguments without it (H100, 2026-11-25: four
    simulated context-parallel ranks as threads disagreed).
    """

    _libcuda = None

    def __init__(self, spec: KernelSpec, entry: str, device_id: int, arg_kinds: str, smem_bytes: int = 0):
        if Launcher._libcuda is None:
            # no argtypes: every argument is a ctypes object already, and argtypes' conversions
            # would double the call's own cost (0.36 against 0.18 µs on a 2-core dev machine)
            Launcher._libcuda = ctypes.CDLL("libcuda.so.1")
            Launcher._libcuda.cuLaunchKernelEx.restype = ctypes.c_int
        from .arrays import cupy_module
        cp = cupy_module()
        function = get_function(spec, entry, device_id)
        if smem_bytes > 48 * 1024:
            driver = cp.cuda.driver
            driver.funcSetAttribute(function.ptr, driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem_bytes)
            # all of the unified L1/shared memory as shared memory, so several CTAs fit per SM
            driver.funcSetAttribute(function.ptr, driver.CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, 100)
        self._runtime, self._device = cp.cuda.runtime, cp.cuda.Device(device_id)
        self.name = f"{spec.name}:{entry}"
        self.device_id = device_id
        self._function = function                       # keeps the handle below valid
        self._func = ctypes.c_void_p(function.ptr)
        offsets, fmt, end = [], "<", 0
        for k in arg_kinds:          # 8-byte slots; a tensor map starts 64-byte aligned
            size = _ARG_SIZES.get(k, 8)
            pad = -end % min(size, 64)
            fmt += f"{pad}x" * bool(pad) + _ARG_FORMATS[k]
            offsets.append(end + pad)
            end += pad + size
        self._pack = struct.Struct(fmt).pack_into
        self._slots = (ctypes.c_uint64 * (end // 8 + 8))()
        base = ctypes.addressof(self._slots)
        lead = -base % 64            # the packed arguments start at a 64-byte boundary of the slots
        self._pack_offset = lead
        self._params = (ctypes.c_void_p * len(arg_kinds))(*[base + lead + o for o in offsets])
        self._pdl_attr = _LaunchAttribute(id=_CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, value=1)
        self._config = _LaunchConfig(shared_mem_bytes=smem_bytes, attrs=ctypes.pointer(self._pdl_attr))
        self._config.block[1:] = 1, 1
        self._config_ref = ctypes.byref(self._config)
        self._configured = None      # (grid, block, stream, pdl) in the config
        self._lock = threading.Lock()

    def __call__(self, grid: tuple, block: int, stream, *args, pdl: bool = False) -> None:
        """Launch ``grid`` x ``block`` threads on ``stream`` (a CuPy stream) with ``args``."""
        with self._lock:
            self._pack(self._slots, self._pack_offset, *args)
            self.configure(grid, block, stream.ptr, pdl)
            if self._runtime.getDevice() != self.device_id:     # the launch uses the current context
                with self._device:
                    return self.launch()
            self.launch()

    def configure(self, grid: tuple, block: int, stream_ptr: int, pdl: bool) -> None:
        """Write the launch configuration (ctypes field writes cost ~0.2 µs each: only on a change)."""
        if (grid, block, stream_ptr, pdl) == self._configured:
            return
        cfg = self._config
        cfg.grid[:] = grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1
        cfg.block[0] = block
        cfg.stream = stream_ptr
        cfg.num_attrs = int(pdl)
        self._configured = (grid, block, stream_ptr, pdl)

    def launch(self) -> None:
        """cuLaunchKernelEx with the packed arguments and the configuration as they stand."""
        status = Launcher._libcuda.cuLaunchKernelEx(self._config_ref, self._func, self._params, None)
        if status != 0:
            raise RuntimeError(f"cuLaunchKernelEx({self.name}) failed with CUresult {status}")


@functools.cache
def get_launcher(spec: KernelSpec, entry: str, device_id: int, arg_kinds: str, smem_bytes: int = 0) -> Launcher:
    """The memoized ``Launcher`` of ``entry`` of ``spec`` on a device."""
    return Launcher(spec, entry, device_id, arg_kinds, smem_bytes)
