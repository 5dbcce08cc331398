"""The framework boundary: the only module that knows NumPy, CuPy, PyTorch and JAX apart.

Every public op calls ``context_of`` on its array arguments. GPU arrays become ``Tensor``
descriptors (pointer, shape, strides, logical dtype) without a copy; CPU arrays from PyTorch or
JAX become NumPy views (the reference path). Results go back with ``export``: an array that
cuattn allocated with ``empty`` in the caller's framework, or a zero-copy DLPack view.
bf16 and fp8 cross DLPack as uint16 / uint8 views; ``Tensor.dtype`` keeps the logical type.
Arrays the caller gives cuattn to write (``out=``, ``lse=``, a KV cache) pass ``writable`` first
(JAX arrays are immutable); JAX tracers (inside ``jax.jit``) are refused by ``framework_of``.
"""
from __future__ import annotations

import functools
import math
import sys
from typing import Any, NamedTuple

import ml_dtypes
import numpy as np

from .errors import DeviceUnavailableError

bfloat16 = np.dtype(ml_dtypes.bfloat16)
float8_e4m3 = np.dtype(ml_dtypes.float8_e4m3fn)
float8_e5m2 = np.dtype(ml_dtypes.float8_e5m2)

# Spellings accepted for dtype arguments, beyond anything np.dtype() understands.
_DTYPE_NAMES = {"f16": np.float16, "fp16": np.float16, "half": np.float16, "float16": np.float16,
                "bf16": bfloat16, "bfloat16": bfloat16, "f32": np.float32, "fp32": np.float32,
                "float32": np.float32, "e4m3": float8_e4m3, "float8_e4m3fn": float8_e4m3,
                "fp8_e4m3": float8_e4m3, "e5m2": float8_e5m2, "float8_e5m2": float8_e5m2,
                "fp8_e5m2": float8_e5m2, "int32": np.int32, "uint8": np.uint8}
# Raw views a framework without the type (CuPy) may hold such data in.
RAW_VIEW = {bfloat16: np.dtype(np.uint16), float8_e4m3: np.dtype(np.uint8),
            float8_e5m2: np.dtype(np.uint8)}
SHORT_NAME = {np.dtype(np.float16): "f16", bfloat16: "bf16", np.dtype(np.float32): "f32",
              float8_e4m3: "e4m3", float8_e5m2: "e5m2"}


def logical_dtype(dtype) -> np.dtype:
    """The logical dtype of a device array's storage: CuPy has no bfloat16, so a CuPy (or raw
    DLPack) uint16 array given where a 16-bit float is expected is read as bfloat16."""
    dtype = np.dtype(dtype)
    return bfloat16 if dtype == np.uint16 else dtype


def same_storage(a: np.dtype, b: np.dtype) -> bool:
    """Equal dtypes, or one is the raw view (uint16 for bf16, uint8 for fp8) of the other."""
    return a == b or RAW_VIEW.get(a) == b or RAW_VIEW.get(b) == a


def as_dtype(value: Any, name: str, fn: str) -> np.dtype:
    """A dtype argument given as NumPy dtype, string, or a torch/JAX dtype."""
    if isinstance(value, str) and value.lower() in _DTYPE_NAMES:
        return np.dtype(_DTYPE_NAMES[value.lower()])
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.dtype):
        return _torch_to_numpy_dtype(value)
    try:
        return np.dtype(value)
    except TypeError:
        raise TypeError(f"{fn}: {name} must be a dtype (e.g. 'float16', 'bfloat16'), got {value!r}") from None


@functools.cache
def _torch_to_numpy_dtype(dtype) -> np.dtype:
    import torch
    table = {torch.float16: np.float16, torch.bfloat16: bfloat16, torch.float32: np.float32,
             torch.float8_e4m3fn: float8_e4m3, torch.float8_e5m2: float8_e5m2, torch.int32: np.int32,
             torch.int64: np.int64, torch.uint8: np.uint8, torch.int8: np.int8, torch.bool: np.bool_,
             torch.uint16: np.uint16}
    if dtype not in table:
        raise TypeError(f"torch dtype {dtype} is not supported by cuattn")
    return np.dtype(table[dtype])


# ---------------------------------------------------------------------------- CuPy


@functools.cache
def install_hint() -> str:
    """How to add the CUDA extra to this installation: a source checkout (kernels_cu/ beside the
    package) reinstalls itself editable; an installed wheel names the package."""
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent
    if (root / "pyproject.toml").is_file() and (root / "kernels_cu").is_dir():
        return (f'install the CUDA extra into this checkout: pip install -e "{root}[cu12]" (CUDA 12 driver) '
                f'or -e "{root}[cu13]" (CUDA 13 driver), never both')
    return 'install cuattn with a CUDA extra: pip install "cuattn[cu12]" (CUDA 12 driver) or "cuattn[cu13]" ' \
           '(CUDA 13 driver), never both'


@functools.cache
def cupy_module():
    """CuPy, or DeviceUnavailableError saying what to install."""
    try:
        import cupy
    except ImportError as e:
        raise DeviceUnavailableError(
            f"CuPy is not installed, so GPU arrays cannot be used; {install_hint()}. "
            f"NumPy arrays run the CPU path without it.") from e
    return cupy


def gpu_available() -> bool:
    """True when CuPy is installed and sees at least one usable GPU."""
    try:
        cp = cupy_module()
        return cp.cuda.runtime.getDeviceCount() > 0
    except DeviceUnavailableError:
        return False
    except Exception as e:  # CUDARuntimeError: no driver, insufficient driver, no device
        if type(e).__name__ == "CUDARuntimeError":
            return False
        raise


def require_gpu(fn: str) -> None:
    """Raise DeviceUnavailableError, saying what to do, unless a GPU is usable."""
    if not gpu_available():
        cupy_module()    # raises the install hint when CuPy is missing
        raise DeviceUnavailableError(
            f"{fn}: no usable CUDA GPU (CuPy sees no device, or the driver is missing or too old "
            f"for this CuPy build; `cuattn info` shows what was found). Use NumPy arrays / "
            f"device='cpu' for the CPU path.")


@functools.cache
def _external_stream(handle: int, device: int):
    import warnings
    with warnings.catch_warnings():   # CuPy 14 prefers Stream.from_external, which needs an object
        warnings.simplefilter("ignore", DeprecationWarning)
        return cupy_module().cuda.ExternalStream(handle, device)


# ---------------------------------------------------------------------------- descriptors


class Tensor(NamedTuple):
    """A GPU array seen through the boundary (a NamedTuple: cheap to make on every run()).
    Strides are in elements."""
    ptr: int
    shape: tuple
    strides: tuple
    dtype: np.dtype       # logical dtype; may differ from the raw dtype the framework reports
    device: int
    framework: str        # "cupy" | "torch" | "jax" | "cai" | "dlpack"
    obj: Any

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def is_contiguous(self) -> bool:
        if not all(self.shape):      # an empty array addresses nothing
            return True
        expected = 1
        for size, stride in zip(reversed(self.shape), reversed(self.strides)):
            if size != 1 and stride != expected:
                return False
            expected *= size
        return True


_MODULE_FRAMEWORK = {"numpy": "numpy", "cupy": "cupy", "torch": "torch", "jax": "jax", "jaxlib": "jax"}
_FRAMEWORK_OF_TYPE: dict[type, str] = {}     # filled by framework_of for types of those modules


def framework_of(x: Any, name: str | None = None, fn: str | None = None) -> str:
    """"numpy", "cupy", "torch", "jax", "cai", "dlpack" or "unknown".

    A JAX tracer (the abstract value an array becomes inside ``jax.jit``, ``vmap`` or ``grad``)
    raises TypeError here, at the boundary, naming ``name`` and ``fn`` when the caller gives them:
    cuattn reads concrete buffers, so without this the call would fail deeper inside with JAX's
    ConcretizationTypeError. Tracer types are never cached, so the fast path stays one lookup.
    """
    fw = _FRAMEWORK_OF_TYPE.get(type(x))      # run() calls this per argument: one dict lookup
    if fw is not None:
        return fw
    fw = _MODULE_FRAMEWORK.get(type(x).__module__.partition(".")[0])
    if fw == "jax" and isinstance(x, _jax_tracer_type()):
        raise TypeError(
            f"{fn or 'cuattn'}: {name or 'an array argument'} must be a concrete array, got a JAX tracer "
            f"of shape {tuple(x.shape)} {x.dtype} (an abstract value inside jax.jit, vmap or grad); cuattn "
            f"cannot be traced by jax.jit: call it outside jit (or, on the CPU path, through jax.pure_callback)")
    if fw is not None:
        _FRAMEWORK_OF_TYPE[type(x)] = fw
        return fw
    if isinstance(x, np.ndarray) or np.isscalar(x):
        return "numpy"
    if hasattr(x, "__cuda_array_interface__"):
        return "cai"
    if hasattr(x, "__dlpack__"):
        return "dlpack"
    return "unknown"


@functools.cache
def _jax_tracer_type() -> type:
    import jax.core      # only reached for objects of JAX's modules: JAX is imported already
    return jax.core.Tracer


def is_device_array(x: Any, name: str | None = None, fn: str | None = None) -> bool:
    fw = framework_of(x, name, fn)
    if fw == "numpy":
        return False
    if fw == "torch":
        return x.is_cuda
    if fw == "jax":
        return any(d.platform == "gpu" for d in x.devices())
    if fw in ("cupy", "cai"):
        return True
    if fw == "dlpack":
        return x.__dlpack_device__()[0] in (2, 3, 13)  # CUDA, CUDA host, CUDA managed
    return False


def _check_strides(shape, strides, name: str, fn: str) -> None:
    if strides and min(strides) < 0:
        raise ValueError(f"{fn}: {name} must not have negative strides, got strides {tuple(strides)}")
    if shape and shape[-1] > 1 and strides[-1] != 1 and all(shape):    # an empty array addresses nothing
        raise ValueError(f"{fn}: {name} must be contiguous in its last dimension, "
                         f"got stride {strides[-1]} (elements); call .contiguous()/ascontiguousarray")


def check_aligned(t, name: str, nbytes: int, fn: str) -> None:
    """A kernel moves ``nbytes`` at a time through ``t`` (a ``Tensor``): its base address and strides must be
    multiples of that (a misaligned access would fault and poison the CUDA context): ValueError naming ``name``."""
    elems = max(nbytes // t.dtype.itemsize, 1)
    if t.ptr % nbytes or math.gcd(*t.strides[:-1]) % elems:     # elems divides every stride
        raise ValueError(f"{fn}: {name} must start at a {nbytes}-byte aligned address with strides that are "
                         f"multiples of {elems} elements, got address {t.ptr:#x} and strides {t.strides}")


def pointer_layout(x: Any) -> tuple | None:
    """(pointer, layout) of a CuPy or CUDA PyTorch array, cheap enough to read on every call
    (0.4-1.4 µs against 1.2-3 µs for ``device_tensor`` on the H100 VMs): the layout (framework,
    shape, strides, dtype, device) is everything ``device_tensor`` checks but the pointer, so a
    layout that passed a check once passes it again. None for other arrays (and CPU tensors)."""
    fw = framework_of(x)
    if fw == "cupy":
        data = x.data
        return data.ptr, (fw, x.shape, x.strides, x.dtype, data.device_id)
    if fw == "torch":
        device = x.get_device()       # -1 on the CPU
        if device >= 0:
            return x.data_ptr(), (fw, x.shape, x.stride(), x.dtype, device)
    return None


def device_tensor(x: Any, name: str, fn: str) -> Tensor:
    """Describe a GPU array without copying it."""
    fw = framework_of(x, name, fn)
    if fw == "cupy":
        itemsize, data = x.itemsize, x.data
        strides = tuple([s // itemsize for s in x.strides])
        if strides and (strides[-1] != 1 or min(strides) < 0):     # else _check_strides passes
            _check_strides(x.shape, strides, name, fn)
        return Tensor(data.ptr, x.shape, strides, x.dtype, data.device_id, fw, x)
    if fw == "torch":
        if not x.is_cuda:
            raise ValueError(f"{fn}: {name} is a CPU tensor where a CUDA tensor is needed")
        t = Tensor(x.data_ptr(), tuple(x.shape), x.stride(), _torch_to_numpy_dtype(x.dtype),
                   x.get_device(), fw, x)
    elif fw == "jax":
        # JAX arrays are dense row-major; wait for the computation that produces x (JAX runs on
        # its own streams), then read its buffer directly: zero-copy for every dtype, bf16/fp8 too.
        x.block_until_ready()
        shape = tuple(x.shape)
        strides = tuple(int(np.prod(shape[i + 1:], dtype=np.int64)) for i in range(len(shape)))
        t = Tensor(x.unsafe_buffer_pointer(), shape, strides, np.dtype(x.dtype), _device_id(x), fw, x)
    elif fw in ("cai", "dlpack"):
        raw = cupy_module().from_dlpack(x) if fw == "dlpack" else cupy_module().asarray(x)
        itemsize = raw.dtype.itemsize
        t = Tensor(raw.data.ptr, raw.shape, tuple(s // itemsize for s in raw.strides), np.dtype(raw.dtype),
                   raw.device.id, fw, x)
    else:
        raise TypeError(f"{fn}: {name} must be a NumPy, CuPy, PyTorch or JAX array (or export "
                        f"__dlpack__/__cuda_array_interface__), got {type(x).__name__}")
    _check_strides(t.shape, t.strides, name, fn)
    return t


def host_array(x: Any, name: str, fn: str) -> np.ndarray:
    """A NumPy view of a CPU array (NumPy, PyTorch-CPU, JAX-CPU, any __dlpack__ exporter)."""
    fw = framework_of(x, name, fn)
    if fw == "numpy":
        arr = np.asarray(x)
    elif fw == "torch":
        logical = _torch_to_numpy_dtype(x.dtype)
        if logical in RAW_VIEW:  # NumPy's DLPack has no bf16 / fp8 codes
            import torch
            raw = torch.uint16 if logical.itemsize == 2 else torch.uint8
            arr = np.from_dlpack(x.detach().view(raw)).view(logical)
        else:
            arr = np.from_dlpack(x.detach())
    elif fw == "jax":
        arr = np.asarray(x)   # zero-copy view of a CPU buffer
    elif hasattr(x, "__dlpack__"):
        arr = np.from_dlpack(x)
    else:
        raise TypeError(f"{fn}: {name} must be a NumPy, CuPy, PyTorch or JAX array, "
                        f"got {type(x).__name__}")
    if arr.ndim:
        itemsize = arr.dtype.itemsize
        _check_strides(arr.shape, tuple(s // itemsize for s in arr.strides), name, fn)
    return arr


def cupy_view(t: Tensor, dtype=None):
    """A CuPy array over a device Tensor's memory (no copy); ``dtype`` defaults to the raw one."""
    cp = cupy_module()
    dtype = np.dtype(dtype if dtype is not None else RAW_VIEW.get(t.dtype, t.dtype))
    extent = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.strides)) if all(t.shape) else 0
    mem = cp.cuda.UnownedMemory(t.ptr, max(extent, 1) * dtype.itemsize, t.obj, t.device)
    return cp.ndarray(t.shape, dtype, cp.cuda.MemoryPointer(mem, 0),
                      strides=tuple(s * dtype.itemsize for s in t.strides))


def to_host(x: Any, name: str, fn: str) -> np.ndarray:
    """A NumPy array of ``x``: a view for CPU arrays, a copy (a sync) for GPU arrays."""
    if is_device_array(x, name, fn):
        return cupy_view(device_tensor(x, name, fn)).get()
    return host_array(x, name, fn)


def host_int_vector(x: Any, name: str, fn: str, length: int | None = None) -> np.ndarray:
    """Host copy of 1-D integer metadata (lists, or arrays of any framework), checked."""
    a = np.asarray(x) if isinstance(x, (list, tuple)) else to_host(x, name, fn)
    if a.ndim != 1 or a.dtype.kind not in "iu":
        raise ValueError(f"{fn}: {name} must be a 1-D integer array, got shape {a.shape} dtype {a.dtype}")
    if length is not None and len(a) != length:
        raise ValueError(f"{fn}: {name} must have length {length}, got {len(a)}")
    return a


# ---------------------------------------------------------------------------- a call's context


class Context(NamedTuple):
    """Where a call runs: the caller's framework, and for GPU calls the device and stream."""
    framework: str
    device: int           # -1 on the CPU path
    stream: Any           # a CuPy stream object on the GPU path, else None

    @property
    def on_gpu(self) -> bool:
        return self.device >= 0


def context_of(fn: str, arrays: dict[str, Any], stream: Any = None) -> Context:
    """The shared framework/device of a call's arrays; mixing them is an error."""
    named = [(k, v) for k, v in arrays.items() if v is not None]
    if not named:
        raise ValueError(f"{fn}: no array arguments")
    kinds = {k: (framework_of(v, k, fn), is_device_array(v, k, fn)) for k, v in named}
    first_name, (fw, on_gpu) = named[0][0], kinds[named[0][0]]
    for k, (kfw, kgpu) in kinds.items():
        if kgpu != on_gpu:
            raise ValueError(f"{fn}: {k} is on the {'GPU' if kgpu else 'CPU'} but {first_name} is on "
                             f"the {'GPU' if on_gpu else 'CPU'}; all arrays of a call must be on one device")
        if kfw != fw and on_gpu:
            raise TypeError(f"{fn}: {k} is a {kfw} array but {first_name} is a {fw} array; "
                            f"pass arrays of one framework per call")
    if not on_gpu:
        return Context(fw, -1, None)
    device = _device_id(named[0][1])
    for k, v in named[1:]:
        if _device_id(v) != device:
            raise ValueError(f"{fn}: {k} is on GPU {_device_id(v)} but {first_name} is on GPU {device}")
    return Context(fw, device, resolve_stream(fw, device, stream))


def _device_id(x) -> int:
    fw = framework_of(x)
    if fw == "cupy":
        return x.data.device_id
    if fw == "torch":
        return x.get_device()
    if fw == "jax":
        return next(iter(x.devices())).id
    if fw == "dlpack":
        return x.__dlpack_device__()[1]
    return cupy_module().cuda.runtime.getDevice()


def resolve_stream(framework: str, device: int, stream: Any = None):
    """The stream to launch on: ``stream`` if given, else the caller framework's current one."""
    cp = cupy_module()
    if stream is not None:
        if isinstance(stream, (cp.cuda.Stream, cp.cuda.ExternalStream)):
            return stream
        handle = getattr(stream, "cuda_stream", stream)   # torch.cuda.Stream or a raw handle
        if not isinstance(handle, int):
            raise TypeError(f"stream must be a CuPy stream, a torch.cuda.Stream or an int handle, "
                            f"got {type(stream).__name__}")
        return _external_stream(handle, device)
    if framework == "torch":
        return _external_stream(_torch_stream_handle(device), device)
    return cp.cuda.get_current_stream(device)


def is_capturing(stream) -> bool:
    """Whether ``stream`` (a CuPy stream object) is capturing a CUDA graph (0.2 µs)."""
    return bool(cupy_module().cuda.runtime.streamIsCapturing(stream.ptr))


def _torch_stream_handle(device: int) -> int:
    """PyTorch's current stream on ``device`` as a handle (its private raw getter when present:
    0.1 µs against 2 µs for torch.cuda.current_stream, which builds a Stream object per call)."""
    torch = sys.modules["torch"]
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return raw(device) if raw is not None else torch.cuda.current_stream(device).cuda_stream


# ---------------------------------------------------------------------------- outputs


@functools.cache
def _numpy_to_torch_dtype(dtype: np.dtype):
    import torch
    return {np.dtype(np.float16): torch.float16, bfloat16: torch.bfloat16, np.dtype(np.float32): torch.float32,
            np.dtype(np.int32): torch.int32, float8_e4m3: torch.float8_e4m3fn, float8_e5m2: torch.float8_e5m2,
            np.dtype(np.uint8): torch.uint8}[dtype]


@functools.cache
def _torch_device(index: int):
    import torch
    return torch.device("cuda", index)


def rearranged(x: Any, shape: tuple, axes: tuple, out_shape: tuple):
    """``x`` viewed as ``shape``, its axes permuted by ``axes`` and copied contiguous as ``out_shape``,
    in x's own framework (NumPy, CuPy, PyTorch, JAX): one copy, on the framework's current stream."""
    v = x.reshape(shape)
    if framework_of(x) == "torch":
        return v.permute(*axes).contiguous().reshape(out_shape)
    v = v.transpose(axes)
    if framework_of(x) == "cupy":
        return cupy_module().ascontiguousarray(v).reshape(out_shape)
    if framework_of(x) == "numpy":
        return np.ascontiguousarray(v).reshape(out_shape)
    return v.reshape(out_shape)          # JAX: a new array either way


def writable(x: Any, name: str, fn: str, hint: str | None = None) -> None:
    """Refuse an array that the caller gives cuattn to write in place (``out=``, ``lse=``, a paged
    KV cache) when it cannot be written: a JAX array (immutable; on the GPU a kernel would change
    a buffer JAX assumes constant, on the CPU NumPy would say "assignment destination is
    read-only") or a read-only NumPy array raises TypeError, the one error for "cuattn cannot
    write into this". ``hint`` replaces the default advice (leave ``name`` out and use the
    returned array). None passes."""
    if x is None:
        return
    fw = framework_of(x, name, fn)
    if fw == "jax":
        raise TypeError(f"{fn}: {name} must be a mutable array (NumPy, CuPy or PyTorch) to be written in place, "
                        f"got a JAX array (JAX arrays are immutable); "
                        f"{hint or f'pass a mutable array, or leave out {name}= and use the returned array'}")
    if fw == "numpy" and isinstance(x, np.ndarray) and not x.flags.writeable:
        raise TypeError(f"{fn}: {name} must be writable to be written in place, got a read-only NumPy array "
                        f"(flags.writeable is False); pass a writable copy (np.array(...))")


def empty(ctx: Context, shape: tuple, dtype: np.dtype):
    """Allocate an uninitialised result in the caller's framework (CuPy for JAX callers)."""
    dtype = np.dtype(dtype)
    if not ctx.on_gpu:
        return np.empty(shape, dtype)
    if ctx.framework == "torch":
        import torch
        return torch.empty(shape, dtype=_numpy_to_torch_dtype(dtype), device=_torch_device(ctx.device))
    cp = cupy_module()
    with cp.cuda.Device(ctx.device):
        return cp.empty(shape, RAW_VIEW.get(dtype, dtype))


def export(ctx: Context, x: Any, dtype: np.dtype | None = None):
    """Hand ``x`` (allocated by ``empty`` or a NumPy result) back in the caller's framework."""
    if ctx.framework in ("numpy", "cupy", "cai", "dlpack") or (ctx.framework == "torch" and ctx.on_gpu):
        return x
    if ctx.framework == "torch":                      # NumPy result -> torch CPU, zero-copy
        import torch
        logical = np.dtype(dtype or x.dtype)
        if logical in RAW_VIEW:
            return torch.from_dlpack(np.ascontiguousarray(x).view(RAW_VIEW[logical])).view(
                {bfloat16: torch.bfloat16, float8_e4m3: torch.float8_e4m3fn,
                 float8_e5m2: torch.float8_e5m2}[logical])
        return torch.from_dlpack(x)
    if ctx.framework == "jax":
        import jax
        logical = np.dtype(dtype or x.dtype)
        if not ctx.on_gpu:
            return jax.numpy.asarray(x)
        out = jax.dlpack.from_dlpack(x)
        if logical in RAW_VIEW:
            out = jax.lax.bitcast_convert_type(out, logical)
        return out
    raise TypeError(f"cannot export to framework {ctx.framework}")


def fill(ctx: Context, x: Any, value: float, name: str, fn: str) -> None:
    """Set every element of the device array ``x`` to ``value`` on the call's stream (results that
    need no kernel: empty KV gives output 0 and LSE -inf)."""
    t = device_tensor(x, name, fn)
    if not all(t.shape):
        return
    cp = cupy_module()
    with cp.cuda.Device(t.device), ctx.stream:
        view = cupy_view(t)
        if value != 0 and view.dtype != np.float32:
            raise TypeError(f"{fn}: fill({name}, {value}) needs a float32 array (0 fills any dtype)")
        view.fill(value)          # 0: all-zero bits, 0 in every float type (bf16 / fp8 raw views included)


def host_results(ctx: Context, o: np.ndarray, s: np.ndarray, out, lse, return_lse: bool, q_dtype, fn: str):
    """The NumPy path's results in the caller's framework: ``o`` (float32, cast to ``q_dtype``) and
    ``s`` (the LSE) written into ``out`` / ``lse`` when given (checked), else exported."""
    o = o.astype(q_dtype)
    if out is not None:
        oa = host_array(out, "out", fn)
        if oa.shape != o.shape or oa.dtype != q_dtype:
            raise ValueError(f"{fn}: out must have shape {o.shape} and dtype {q_dtype}, got {oa.shape} {oa.dtype}")
        oa[...] = o
        result = out
    else:
        result = export(ctx, o, q_dtype)
    if lse is not None:
        la = host_array(lse, "lse", fn)
        if la.shape != s.shape or la.dtype != np.float32:
            raise ValueError(f"{fn}: lse must be float32 of shape {s.shape}, got {la.shape} {la.dtype}")
        la[...] = s
    if return_lse:
        return result, (lse if lse is not None else export(ctx, s))
    return result
