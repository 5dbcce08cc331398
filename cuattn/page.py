"""The paged KV cache: FlashInfer's CSR page table, appends, and a page-owning cache class.

Page table (int32): ``kv_indptr[batch + 1]``, ``kv_indices[kv_indptr[-1]]``, ``kv_last_page_len[batch]``.
Storage: NHD ``[num_pages, 2, page_size, num_kv_heads, head_dim]``, HND ``[num_pages, 2,
num_kv_heads, page_size, head_dim]``, or a ``(k, v)`` pair of such arrays without the ``2``.
"""
from __future__ import annotations

from dataclasses import dataclass
from math import gcd
from typing import Any, NamedTuple

import numpy as np

from . import arrays, fp8, jit, reference
from .errors import CacheFullError
from .arrays import Tensor
from .plan import SHORT, int_bounds, int_min

_SOURCE = "page.cu"
KV_LAYOUTS = ("NHD", "HND")
KV_DTYPES = (np.dtype(np.float16), arrays.bfloat16, np.dtype(np.float32), arrays.float8_e4m3,
             arrays.float8_e5m2)


@dataclass(frozen=True)
class PageSpec:
    vec_bytes: int          # bytes per copy: 16 unless alignment forbids it
    source = _SOURCE

    @property
    def name(self) -> str:
        return f"page_vec{self.vec_bytes}"

    def defines(self) -> tuple[str, ...]:
        return (f"-DVEC_BYTES={self.vec_bytes}",)


@dataclass(frozen=True)
class PageFp8Spec:
    """cuattn_page_append_fp8: 16-bit rows in, fp8 rows stored (scaled, saturating)."""
    dtype_in: str           # "f16" | "bf16"
    dtype_kv: str           # "e4m3" | "e5m2"
    source = _SOURCE

    @property
    def name(self) -> str:
        return f"page_append_{self.dtype_in}_kv{self.dtype_kv}"

    def defines(self) -> tuple[str, ...]:
        return (f"-DIN_BF16={int(self.dtype_in == 'bf16')}", f"-DKV_FP8={1 if self.dtype_kv == 'e4m3' else 2}",
                "-DVEC_BYTES=16")


def shipped_specs() -> list:
    return [PageSpec(v) for v in (16, 8, 4, 2, 1)] + [PageFp8Spec(i, kv) for i in ("f16", "bf16")
                                                       for kv in ("e4m3", "e5m2")]


# ---------------------------------------------------------------------------- cache arrays


class PagedKV(NamedTuple):
    """A paged cache seen through the boundary: K and V tensors with shared element strides."""
    k: Tensor
    v: Tensor
    num_pages: int
    page_size: int
    num_kv_heads: int
    head_dim: int
    stride_page: int       # elements
    stride_slot: int
    stride_head: int

    @property
    def dtype(self) -> np.dtype:
        return self.k.dtype


def _layout_dims(shape: tuple, kv_layout: str) -> tuple[int, int, int, int]:
    """(num_pages, page_size, num_kv_heads, head_dim) of one K or V array."""
    if kv_layout == "NHD":
        return shape[0], shape[1], shape[2], shape[3]
    return shape[0], shape[2], shape[1], shape[3]


def check_kv_layout(kv_layout: str, fn: str) -> str:
    if kv_layout not in KV_LAYOUTS:
        raise ValueError(f"{fn}: kv_layout must be 'NHD' or 'HND', got {kv_layout!r}")
    return kv_layout


def _split_cache(paged_kv_cache: Any, fn: str) -> tuple[Any, Any, bool]:
    """(k, v, combined): the two halves of a cache given as one array or a (k, v) pair."""
    if isinstance(paged_kv_cache, (tuple, list)):
        if len(paged_kv_cache) != 2:
            raise ValueError(f"{fn}: paged_kv_cache must be one array or a (k_cache, v_cache) pair, "
                             f"got a sequence of {len(paged_kv_cache)}")
        return paged_kv_cache[0], paged_kv_cache[1], False
    return paged_kv_cache, None, True


def paged_kv_tensors(paged_kv_cache: Any, kv_layout: str, fn: str) -> PagedKV:
    """Describe a GPU paged cache (either form, either layout) without copying it."""
    check_kv_layout(kv_layout, fn)
    k, v, combined = _split_cache(paged_kv_cache, fn)
    if combined:
        t = arrays.device_tensor(k, "paged_kv_cache", fn)
        if t.ndim != 5 or t.shape[1] != 2:
            raise ValueError(f"{fn}: paged_kv_cache must have shape [num_pages, 2, ...] (5 dims) for "
                             f"kv_layout={kv_layout}, got {t.shape}")
        shape = (t.shape[0],) + t.shape[2:]
        strides = (t.strides[0],) + t.strides[2:]
        kt = Tensor(t.ptr, shape, strides, t.dtype, t.device, t.framework, t.obj)
        vt = Tensor(t.ptr + t.strides[1] * t.dtype.itemsize, shape, strides, t.dtype, t.device,
                    t.framework, t.obj)
    else:
        kt = arrays.device_tensor(k, "k_cache", fn)
        vt = arrays.device_tensor(v, "v_cache", fn)
        for name, x in (("k_cache", kt), ("v_cache", vt)):
            if x.ndim != 4:
                raise ValueError(f"{fn}: {name} must have 4 dims for kv_layout={kv_layout}, got {x.shape}")
        if kt.shape != vt.shape or kt.strides != vt.strides:
            raise ValueError(f"{fn}: k_cache and v_cache must have the same shape and strides, got "
                             f"{kt.shape}/{kt.strides} and {vt.shape}/{vt.strides}")
        if kt.dtype != vt.dtype:
            raise ValueError(f"{fn}: k_cache and v_cache must have the same dtype, got "
                             f"k_cache={kt.dtype}, v_cache={vt.dtype}")
    num_pages, page_size, heads, head_dim = _layout_dims(kt.shape, kv_layout)
    s = kt.strides
    stride_slot, stride_head = (s[1], s[2]) if kv_layout == "NHD" else (s[2], s[1])
    return PagedKV(kt, vt, num_pages, page_size, heads, head_dim, s[0], stride_slot, stride_head)


def paged_kv_host(paged_kv_cache: Any, kv_layout: str, fn: str) -> tuple[np.ndarray, np.ndarray]:
    """NHD NumPy views (k_pages, v_pages), each [num_pages, page_size, num_kv_heads, head_dim]."""
    check_kv_layout(kv_layout, fn)
    k, v, combined = _split_cache(paged_kv_cache, fn)
    if combined:
        arr = arrays.host_array(k, "paged_kv_cache", fn)
        if arr.ndim != 5 or arr.shape[1] != 2:
            raise ValueError(f"{fn}: paged_kv_cache must have shape [num_pages, 2, ...] (5 dims), got {arr.shape}")
        return reference.split_paged_kv_cache(arr, kv_layout)
    ka, va = arrays.host_array(k, "k_cache", fn), arrays.host_array(v, "v_cache", fn)
    if ka.ndim != 4 or ka.shape != va.shape or ka.dtype != va.dtype:
        raise ValueError(f"{fn}: k_cache and v_cache must be 4-dim arrays of one shape and dtype, "
                         f"got {ka.shape}/{ka.dtype} and {va.shape}/{va.dtype}")
    return reference.split_paged_kv_cache((ka, va), kv_layout)


def validate_page_table(fn: str, indptr: np.ndarray, last_page_len: np.ndarray, page_size: int,
                        num_indices: int, *, prefix: str = "", indices: np.ndarray | None = None,
                        num_pages: int | None = None) -> np.ndarray:
    """Check host CSR page-table metadata; returns each request's kv_len (int64).

    ``prefix`` names the arguments in messages ("kv_" -> kv_indptr, kv_last_page_len, kv_indices).
    ``indices`` (host) are range-checked against ``num_pages`` when both are given.

    A valid table (every plan()'s steady state) builds no message: any failing check falls through to
    ``_page_table_error`` / ``_lpl_error``, which raise the first error in the order of the checks.
    """
    batch = len(indptr) - 1 if indptr.ndim == 1 else -1
    if batch < 0 or last_page_len.shape != (batch,) or indptr.dtype.kind not in "iu" \
            or last_page_len.dtype.kind not in "iu" or page_size < 1 or indptr[0] != 0 or indptr[-1] != num_indices:
        _page_table_error(fn, indptr, last_page_len, page_size, num_indices, prefix)
    if 0 < batch <= SHORT:    # a short table (a cascade's shared level, a small batch): as Python ints
        kv_lens = _short_kv_lens(indptr.tolist(), last_page_len.tolist(), page_size)
        if kv_lens is None:        # a check failed: its error, in the order of the checks
            _page_table_error(fn, indptr, last_page_len, page_size, num_indices, prefix)
            ip = indptr.astype(np.int64)
            _lpl_error(fn, ip[1:] - ip[:-1], last_page_len.astype(np.int64), page_size, prefix)
    else:
        kv_lens = _kv_lens(fn, indptr, last_page_len, page_size, num_indices, prefix)
    if indices is not None and len(indices):
        lo, hi = int(indices.min()), int(indices.max())
        if lo < 0 or (num_pages is not None and hi >= num_pages):
            limit = f"in 0..{num_pages - 1} (num_pages of the cache)" if num_pages is not None else ">= 0"
            raise ValueError(f"{fn}: {prefix}indices must be {limit}, got values in {lo}..{hi}")
    return kv_lens


def _short_kv_lens(ip: list, lpl: list, page_size: int) -> np.ndarray | None:
    """``_kv_lens`` of a short table as lists (~3x cheaper than NumPy calls at batch 1-32), or None where a check
    fails: a decreasing indptr, or a last_page_len out of 1..page_size where its request has pages."""
    kv, prev = [], ip[0]
    for end, last in zip(ip[1:], lpl):
        pages = end - prev
        if pages > 0:
            if last < 1 or last > page_size:
                return None
            kv.append((pages - 1) * page_size + last)
        elif pages:
            return None
        else:
            kv.append(0)
        prev = end
    return np.array(kv, np.int64)


def _kv_lens(fn: str, indptr: np.ndarray, last_page_len: np.ndarray, page_size: int, num_indices: int,
             prefix: str) -> np.ndarray:
    """Each request's kv_len (int64) of a table whose indptr passed the first checks (NumPy calls)."""
    ip = indptr.astype(np.int64)
    pages = ip[1:] - ip[:-1]                          # (np.diff costs ~5 µs more)
    lpl = last_page_len.astype(np.int64)
    kv_lens = (pages - 1) * page_size + lpl
    if len(pages):  # (plan.int_min / int_bounds: a short table's through a list, no NumPy reductions)
        min_pages = int_min(pages)
        if min_pages < 0:
            _page_table_error(fn, indptr, last_page_len, page_size, num_indices, prefix)
        lo, hi = int_bounds(lpl)
        if lo < 1 or hi > page_size:    # (fast path: all in range)
            _lpl_error(fn, pages, lpl, page_size, prefix)
        if min_pages == 0:
            kv_lens[pages == 0] = 0
    return kv_lens


def _page_table_error(fn: str, indptr: np.ndarray, last_page_len: np.ndarray, page_size: int, num_indices: int,
                      prefix: str) -> None:
    """The first error of ``validate_page_table``'s checks of the indptr (raised; returns only if none fails)."""
    n_indptr, n_last, n_indices = f"{prefix}indptr", f"{prefix}last_page_len", f"{prefix}indices"
    if indptr.ndim != 1 or len(indptr) < 1:
        raise ValueError(f"{fn}: {n_indptr} must be 1-D of length batch + 1, got shape {indptr.shape}")
    batch = len(indptr) - 1
    if last_page_len.shape != (batch,):
        raise ValueError(f"{fn}: {n_last} must have shape (batch,) = ({batch},) to match {n_indptr}, "
                         f"got {last_page_len.shape}")
    if indptr.dtype.kind not in "iu" or last_page_len.dtype.kind not in "iu":
        raise TypeError(f"{fn}: {n_indptr} and {n_last} must be integer arrays, "
                        f"got {indptr.dtype} and {last_page_len.dtype}")
    if page_size < 1:
        raise ValueError(f"{fn}: page_size must be >= 1, got {page_size}")
    if int(indptr[0]) != 0:
        raise ValueError(f"{fn}: {n_indptr}[0] must be 0 (CSR offsets into {n_indices}), got {int(indptr[0])}")
    pages = indptr.astype(np.int64)[1:] - indptr.astype(np.int64)[:-1]
    if batch and int(pages.min()) < 0:
        bad = int(np.argmax(pages < 0))
        raise ValueError(f"{fn}: {n_indptr} must be non-decreasing, got {n_indptr}[{bad}]={int(indptr[bad])} > "
                         f"{n_indptr}[{bad + 1}]={int(indptr[bad + 1])}")
    if int(indptr[-1]) != num_indices:
        raise ValueError(f"{fn}: {n_indptr}[-1] must equal len({n_indices}) = {num_indices}, got {int(indptr[-1])}")


def _lpl_error(fn: str, pages: np.ndarray, last_page_len: np.ndarray, page_size: int, prefix: str) -> None:
    """A last_page_len out of 1..page_size: an error where its request has pages (requests without pages
    may hold any value there)."""
    lpl = last_page_len
    bad = (pages > 0) & ((lpl < 1) | (lpl > page_size))
    if np.any(bad):
        b = int(np.argmax(bad))
        raise ValueError(f"{fn}: {prefix}last_page_len must be in 1..page_size={page_size} for every request "
                         f"with pages, got {prefix}last_page_len[{b}]={int(lpl[b])}")


# ---------------------------------------------------------------------------- ops


def get_batch_indices_positions(append_indptr, seq_lens, nnz: int, *, stream=None):
    """Request index and position of every appended token.

    Parameters
    ----------
    append_indptr : array, shape (batch + 1,), int32
        Appended tokens of request i are rows ``append_indptr[i]:append_indptr[i+1]``.
    seq_lens : array, shape (batch,), int32
        KV length of each request after the append.
    nnz : int
        Number of appended tokens (``append_indptr[-1]``).

    Returns
    -------
    batch_indices, positions : arrays, shape (nnz,), int32, in the framework of ``append_indptr``
    """
    fn = "get_batch_indices_positions"
    ctx = arrays.context_of(fn, {"append_indptr": append_indptr, "seq_lens": seq_lens}, stream)
    if not ctx.on_gpu:
        indptr = arrays.host_int_vector(append_indptr, "append_indptr", fn)
        lens = arrays.host_int_vector(seq_lens, "seq_lens", fn, len(indptr) - 1)
        if indptr[-1] != nnz:
            raise ValueError(f"{fn}: nnz must equal append_indptr[-1]={indptr[-1]}, got {nnz}")
        if np.any(np.diff(indptr) > lens):
            raise ValueError(f"{fn}: seq_lens must be >= the appended length of each request")
        b, p = reference.get_batch_indices_positions(indptr, lens, nnz)
        return arrays.export(ctx, b), arrays.export(ctx, p)
    indptr_t = arrays.device_tensor(append_indptr, "append_indptr", fn)
    lens_t = arrays.device_tensor(seq_lens, "seq_lens", fn)
    for name, t in (("append_indptr", indptr_t), ("seq_lens", lens_t)):
        if t.dtype != np.int32 or t.ndim != 1:
            raise ValueError(f"{fn}: {name} must be a 1-D int32 array, got {t.dtype} {t.shape}")
    batch = indptr_t.shape[0] - 1
    if lens_t.shape[0] != batch:
        raise ValueError(f"{fn}: seq_lens must have length batch={batch}, got {lens_t.shape[0]}")
    b, p = arrays.empty(ctx, (nnz,), np.int32), arrays.empty(ctx, (nnz,), np.int32)
    if nnz:
        launch = jit.get_launcher(PageSpec(16), "cuattn_batch_indices_positions", ctx.device, "ppppii")
        bt, pt = arrays.device_tensor(b, "out", fn), arrays.device_tensor(p, "out", fn)
        launch(((nnz + 255) // 256,), 256, ctx.stream, indptr_t.ptr, lens_t.ptr, bt.ptr, pt.ptr, batch, nnz)
    return arrays.export(ctx, b), arrays.export(ctx, p)


def append_paged_kv_cache(append_key, append_value, batch_indices, positions, paged_kv_cache,
                          kv_indices, kv_indptr, kv_last_page_len, kv_layout: str = "NHD", *,
                          k_scale=None, v_scale=None, kv_data_type=None, stream=None) -> None:
    """Write appended tokens' K/V rows into their page slots (in place).

    Parameters
    ----------
    append_key, append_value : array, shape (nnz, num_kv_heads, head_dim), dtype of the cache, or
        float16 / bfloat16 for an fp8 cache: stored as round(x / scale) (nearest even), saturating
        at +-(max finite) (448 e4m3, 57344 e5m2): no NaN or inf from overflow.
    batch_indices, positions : array, shape (nnz,), int32
        From ``get_batch_indices_positions``: each token's request and position in its KV.
    paged_kv_cache : array or (k_cache, v_cache)
        See the module docstring for shapes; fp16, bf16, fp32, fp8 e4m3/e5m2 (fp8 and bf16 may
        be given as uint8 / uint16 views from frameworks without those types).
    kv_indices, kv_indptr, kv_last_page_len : array, int32
        The page table, already covering the appended positions.
    k_scale, v_scale : float, or float32 array of shape (1,) or (num_kv_heads,), optional
        fp8 caches: stored value x scale = real value (as the decode's ``run(k_scale=, v_scale=)``).
    kv_data_type : dtype, optional
        The fp8 type of a uint8 cache ("float8_e4m3fn" or "float8_e5m2"); default: the cache's dtype.

    On the GPU, a token whose position lies beyond its request's pages, or whose page index is
    out of range, is skipped rather than written out of bounds; NumPy inputs raise ValueError.

    Raises
    ------
    TypeError
        If the cache is a JAX array (immutable: it cannot be written in place) or a JAX tracer
        (cuattn cannot run inside ``jax.jit``).
    """
    fn = "append_paged_kv_cache"
    check_kv_layout(kv_layout, fn)
    named = {"append_key": append_key, "append_value": append_value, "batch_indices": batch_indices,
             "positions": positions, "kv_indices": kv_indices, "kv_indptr": kv_indptr,
             "kv_last_page_len": kv_last_page_len}
    k0, v0, combined = _split_cache(paged_kv_cache, fn)
    ctx = arrays.context_of(fn, {**named, "paged_kv_cache": k0, "v_cache": v0}, stream)
    hint = "keep the KV cache in a NumPy, CuPy or PyTorch array (cuattn.PagedKVCache allocates one)"
    arrays.writable(k0, "paged_kv_cache" if combined else "paged_kv_cache[0]", fn, hint)
    arrays.writable(v0, "paged_kv_cache[1]", fn, hint)
    want = arrays.as_dtype(kv_data_type, "kv_data_type", fn) if kv_data_type is not None else None
    if want is not None and not fp8.is_fp8(want):
        raise ValueError(f"{fn}: kv_data_type must be float8_e4m3fn or float8_e5m2 (the type of a uint8 cache), "
                         f"got {want}")
    if not ctx.on_gpu:
        _append_host(fn, kv_layout, paged_kv_cache, **named, k_scale=k_scale, v_scale=v_scale, kv_dtype=want)
        return
    cache = paged_kv_tensors(paged_kv_cache, kv_layout, fn)
    ak = arrays.device_tensor(append_key, "append_key", fn)
    av = arrays.device_tensor(append_value, "append_value", fn)
    kv_dtype = _cache_dtype(cache.dtype, want, fn)
    quantize = fp8.is_fp8(kv_dtype) and ak.dtype in (np.dtype(np.float16), arrays.bfloat16, np.dtype(np.uint16))
    expected = (ak.shape[0], cache.num_kv_heads, cache.head_dim)
    for name, t in (("append_key", ak), ("append_value", av)):
        if t.shape != expected:
            raise ValueError(f"{fn}: {name} must have shape (nnz, num_kv_heads, head_dim)={expected}, got {t.shape}")
        if quantize:
            if t.dtype != ak.dtype:
                raise TypeError(f"{fn}: append_key and append_value must have the same dtype, got {ak.dtype} "
                                f"and {av.dtype}")
        elif not arrays.same_storage(t.dtype, cache.dtype):
            raise TypeError(f"{fn}: {name} must have the cache's dtype {cache.dtype}"
                            + (" or float16 / bfloat16" if fp8.is_fp8(kv_dtype) else "") + f", got {t.dtype}")
    if not quantize and (k_scale is not None or v_scale is not None):
        raise ValueError(f"{fn}: k_scale / v_scale must be None unless float16 / bfloat16 rows are stored into "
                         f"an fp8 cache, got a {kv_dtype} cache and {ak.dtype} rows")
    nnz = ak.shape[0]
    meta = {}
    for name, length in (("batch_indices", nnz), ("positions", nnz), ("kv_indptr", None), ("kv_indices", None)):
        t = arrays.device_tensor(named[name], name, fn)
        if t.dtype != np.int32 or t.ndim != 1 or (length is not None and t.shape[0] != length):
            raise ValueError(f"{fn}: {name} must be a 1-D int32 array" + (f" of length {length}" if length else "")
                             + f", got {t.dtype} {t.shape}")
        meta[name] = t
    if nnz == 0:
        return
    if quantize:
        _launch_append_fp8(fn, ctx, cache, ak, av, meta, nnz, kv_dtype, k_scale, v_scale)
        return
    item = cache.dtype.itemsize
    row_bytes = cache.head_dim * item
    strides_bytes = [s * item for s in (ak.strides[0], ak.strides[1], av.strides[0], av.strides[1],
                                        cache.stride_page, cache.stride_slot, cache.stride_head)]
    vec = 16
    for n in [row_bytes, ak.ptr, av.ptr, cache.k.ptr, cache.v.ptr, *strides_bytes]:
        vec = gcd(vec, n)
    launch = jit.get_launcher(PageSpec(vec), "cuattn_page_append", ctx.device, "pppppppp" "q" "iiii" "qqqqqqq")
    vecs_per_row = row_bytes // vec
    total = nnz * cache.num_kv_heads * vecs_per_row
    launch(((total + 255) // 256,), 256, ctx.stream,
           ak.ptr, av.ptr, meta["batch_indices"].ptr, meta["positions"].ptr, cache.k.ptr, cache.v.ptr,
           meta["kv_indices"].ptr, meta["kv_indptr"].ptr, nnz, cache.num_kv_heads, vecs_per_row,
           cache.page_size, cache.num_pages, *strides_bytes)


def _cache_dtype(stored: np.dtype, want, fn: str) -> np.dtype:
    """The cache's element type: ``want`` (kv_data_type) for a uint8 cache, else its own dtype."""
    if want is None:
        return stored
    if not arrays.same_storage(stored, want):
        raise ValueError(f"{fn}: paged_kv_cache must have dtype {want} (kv_data_type) or uint8, got {stored}")
    return want


def _launch_append_fp8(fn, ctx, cache, ak, av, meta, nnz, kv_dtype, k_scale, v_scale):
    """cuattn_page_append_fp8: 8 values per thread (16 bytes of input, 8 of cache)."""
    ks = fp8.parse_scale(k_scale, "k_scale", cache.num_kv_heads, fn, on_gpu=True)
    vs = fp8.parse_scale(v_scale, "v_scale", cache.num_kv_heads, fn, on_gpu=True)
    strides_in = [s * 2 for s in (ak.strides[0], ak.strides[1], av.strides[0], av.strides[1])]
    strides_c = [s for s in (cache.stride_page, cache.stride_slot, cache.stride_head)]
    if cache.head_dim % 8 or any(x % 16 for x in [ak.ptr, av.ptr, *strides_in]) or \
            any(x % 8 for x in [cache.k.ptr, cache.v.ptr, *strides_c]):
        raise ValueError(f"{fn}: storing into an fp8 cache needs head_dim % 8 == 0, 16-byte aligned append_key / "
                         f"append_value rows and 8-byte aligned cache rows, got head_dim {cache.head_dim}, "
                         f"input strides {strides_in} bytes, cache strides {strides_c} bytes")
    spec = PageFp8Spec("bf16" if ak.dtype != np.float16 else "f16", arrays.SHORT_NAME[kv_dtype])
    launch = jit.get_launcher(spec, "cuattn_page_append_fp8", ctx.device, "pppppppp" "q" "iiii" "qqqqqqq" "ffppi")
    vecs_per_row = cache.head_dim // 8
    total = nnz * cache.num_kv_heads * vecs_per_row
    launch(((total + 255) // 256,), 256, ctx.stream,
           ak.ptr, av.ptr, meta["batch_indices"].ptr, meta["positions"].ptr, cache.k.ptr, cache.v.ptr,
           meta["kv_indices"].ptr, meta["kv_indptr"].ptr, nnz, cache.num_kv_heads, vecs_per_row,
           cache.page_size, cache.num_pages, *strides_in, *strides_c,
           ks.value, vs.value, ks.ptr, vs.ptr, int(ks.per_head) | 2 * int(vs.per_head))


def _append_host(fn, kv_layout, paged_kv_cache, append_key, append_value, batch_indices, positions,
                 kv_indices, kv_indptr, kv_last_page_len, k_scale=None, v_scale=None, kv_dtype=None):
    k_pages, v_pages = paged_kv_host(paged_kv_cache, kv_layout, fn)
    kv_dtype = _cache_dtype(k_pages.dtype, kv_dtype, fn)
    if k_pages.dtype != kv_dtype:        # raw uint8 bits of an fp8 cache
        k_pages, v_pages = k_pages.view(kv_dtype), v_pages.view(kv_dtype)
    num_pages, page_size, heads, head_dim = k_pages.shape
    ak = arrays.host_array(append_key, "append_key", fn)
    av = arrays.host_array(append_value, "append_value", fn)
    quantize = fp8.is_fp8(kv_dtype) and ak.dtype in (np.dtype(np.float16), arrays.bfloat16)
    for name, a in (("append_key", ak), ("append_value", av)):
        if a.ndim != 3 or a.shape[1:] != (heads, head_dim):
            raise ValueError(f"{fn}: {name} must have shape (nnz, {heads}, {head_dim}), got {a.shape}")
        if a.dtype != (ak.dtype if quantize else k_pages.dtype):
            raise TypeError(f"{fn}: {name} must have the cache's dtype {k_pages.dtype}"
                            + (" or float16 / bfloat16" if fp8.is_fp8(kv_dtype) else "") + f", got {a.dtype}")
    if quantize:
        ks = fp8.parse_scale(k_scale, "k_scale", heads, fn, on_gpu=False)
        vs = fp8.parse_scale(v_scale, "v_scale", heads, fn, on_gpu=False)
        ak, av = fp8.quantize(ak, kv_dtype, ks.host, 1), fp8.quantize(av, kv_dtype, vs.host, 1)
    elif k_scale is not None or v_scale is not None:
        raise ValueError(f"{fn}: k_scale / v_scale must be None unless float16 / bfloat16 rows are stored into "
                         f"an fp8 cache, got a {kv_dtype} cache and {ak.dtype} rows")
    nnz = ak.shape[0]
    if av.shape[0] != nnz:
        raise ValueError(f"{fn}: append_value must have {nnz} rows like append_key, got {av.shape[0]}")
    b = arrays.host_int_vector(batch_indices, "batch_indices", fn, nnz)
    p = arrays.host_int_vector(positions, "positions", fn, nnz)
    indptr = arrays.host_int_vector(kv_indptr, "kv_indptr", fn)
    indices = arrays.host_int_vector(kv_indices, "kv_indices", fn)
    last = arrays.host_int_vector(kv_last_page_len, "kv_last_page_len", fn)
    validate_page_table(fn, indptr, last, page_size, len(indices), prefix="kv_", indices=indices,
                        num_pages=num_pages)
    batch = len(indptr) - 1
    if nnz and (b.min() < 0 or b.max() >= batch):
        raise ValueError(f"{fn}: batch_indices must be in 0..{batch - 1}, got {b.min()}..{b.max()}")
    capacity = (np.diff(indptr) * page_size)[b] if nnz else np.zeros(0, np.int32)
    if nnz and (np.any(p < 0) or np.any(p >= capacity)):
        raise ValueError(f"{fn}: positions must lie within each request's pages (0..pages*page_size-1)")
    reference.append_paged_kv_cache(ak, av, b, p, k_pages, v_pages, indices, indptr)


# ---------------------------------------------------------------------------- PagedKVCache


@dataclass(frozen=True)
class AppendBatch:
    """Where one step's new tokens go; made by ``PagedKVCache.reserve``, used by every layer.

    Host arrays are NumPy; on a GPU cache, ``device`` holds the same arrays uploaded once.
    """
    seq_ids: tuple[int, ...]
    append_indptr: np.ndarray       # [batch + 1]
    batch_indices: np.ndarray       # [nnz]
    positions: np.ndarray           # [nnz]
    kv_indptr: np.ndarray           # page table of seq_ids after the append
    kv_indices: np.ndarray
    kv_last_page_len: np.ndarray
    device: dict | None = None      # same names -> device arrays (GPU caches)

    @property
    def nnz(self) -> int:
        return int(self.append_indptr[-1])


class PagedKVCache:
    """KV storage for all layers, with page allocation per sequence.

    Storage is one array ``[num_layers, max_num_pages, 2, page_size, num_kv_heads, head_dim]``
    (NHD) or ``[..., 2, num_kv_heads, page_size, head_dim]`` (HND); ``layer(i)`` is the
    ``paged_kv_cache`` argument of the attention wrappers. ``device="cpu"`` stores NumPy arrays
    (the reference path), ``"cuda"`` or ``"cuda:N"`` CuPy arrays (bf16/fp8 as uint16/uint8 views).

    A step: ``batch = cache.reserve(seq_ids, num_new_tokens)`` grows the sequences (all or
    nothing), then ``cache.append(layer, keys, values, batch)`` for each layer, and
    ``cache.page_table(seq_ids)`` gives the CSR arrays for attention.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, page_size: int,
                 max_num_pages: int, dtype="float16", kv_layout: str = "NHD", device: str = "cpu"):
        fn = "PagedKVCache"
        for name, value in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads),
                            ("head_dim", head_dim), ("page_size", page_size), ("max_num_pages", max_num_pages)):
            if not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"{fn}: {name} must be a positive int, got {value!r}")
        self.dtype = arrays.as_dtype(dtype, "dtype", fn)
        if self.dtype not in KV_DTYPES:
            raise ValueError(f"{fn}: dtype must be one of float16, bfloat16, float32, float8_e4m3fn, "
                             f"float8_e5m2, got {self.dtype}")
        self.kv_layout = check_kv_layout(kv_layout, fn)
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.page_size, self.max_num_pages = page_size, max_num_pages
        inner = (page_size, num_kv_heads) if kv_layout == "NHD" else (num_kv_heads, page_size)
        shape = (num_layers, max_num_pages, 2, *inner, head_dim)
        if device == "cpu":
            self.device_id = -1
            self.storage = np.zeros(shape, self.dtype)
        elif device.startswith("cuda"):
            self.device_id = int(device.partition(":")[2] or 0)
            arrays.require_gpu(fn)
            cp = arrays.cupy_module()
            with cp.cuda.Device(self.device_id):
                self.storage = cp.zeros(shape, arrays.RAW_VIEW.get(self.dtype, self.dtype))
        else:
            raise ValueError(f"{fn}: device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")
        self._free = list(range(max_num_pages - 1, -1, -1))     # pop() hands out low pages first
        self._pages: dict[int, list[int]] = {}
        self._lens: dict[int, int] = {}
        self._next_id = 0

    # -- bookkeeping

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def seq_ids(self) -> list[int]:
        return list(self._pages)

    def seq_len(self, seq_id: int) -> int:
        return self._lens[self._check_seq(seq_id)]

    def pages_of(self, seq_id: int) -> list[int]:
        return list(self._pages[self._check_seq(seq_id)])

    def _check_seq(self, seq_id: int) -> int:
        if seq_id not in self._pages:
            raise KeyError(f"PagedKVCache: no sequence with id {seq_id!r}")
        return seq_id

    def add_sequence(self) -> int:
        """Start an empty sequence; returns its id."""
        seq_id = self._next_id
        self._next_id += 1
        self._pages[seq_id], self._lens[seq_id] = [], 0
        return seq_id

    def remove_sequence(self, seq_id: int) -> None:
        """Free a finished sequence's pages."""
        self._check_seq(seq_id)
        self._free.extend(reversed(self._pages.pop(seq_id)))
        del self._lens[seq_id]

    def reserve(self, seq_ids, num_new_tokens) -> AppendBatch:
        """Grow each sequence by its count of new tokens, allocating pages; all or nothing.

        Raises CacheFullError (leaving the cache unchanged) if the free pages do not suffice.
        """
        seq_ids = [self._check_seq(int(s)) for s in seq_ids]
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"PagedKVCache.reserve: seq_ids must be distinct, got {seq_ids}")
        counts = np.asarray(num_new_tokens, np.int64).reshape(-1)
        if len(counts) != len(seq_ids) or np.any(counts < 0):
            raise ValueError(f"PagedKVCache.reserve: num_new_tokens must be {len(seq_ids)} counts >= 0, "
                             f"got {list(counts)}")
        new_lens = [self._lens[s] + int(c) for s, c in zip(seq_ids, counts)]
        needed = [-(-n // self.page_size) - len(self._pages[s]) for s, n in zip(seq_ids, new_lens)]
        if sum(needed) > len(self._free):
            raise CacheFullError(f"PagedKVCache.reserve: needs {sum(needed)} free pages, only "
                                 f"{len(self._free)} of {self.max_num_pages} are free; free finished "
                                 f"sequences (remove_sequence) or make a larger cache")
        for s, n, k in zip(seq_ids, new_lens, needed):
            self._pages[s].extend(self._free.pop() for _ in range(k))
            self._lens[s] = n
        append_indptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
        batch_indices, positions = reference.get_batch_indices_positions(
            append_indptr, np.asarray(new_lens, np.int32), int(append_indptr[-1]))
        kv_indptr, kv_indices, kv_last_page_len = self.page_table(seq_ids)
        host = dict(append_indptr=append_indptr, batch_indices=batch_indices, positions=positions,
                    kv_indptr=kv_indptr, kv_indices=kv_indices, kv_last_page_len=kv_last_page_len)
        device = None
        if self.device_id >= 0:
            cp = arrays.cupy_module()
            with cp.cuda.Device(self.device_id):
                device = {k: cp.asarray(v) for k, v in host.items()}
        return AppendBatch(tuple(seq_ids), device=device, **host)

    def page_table(self, seq_ids) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(kv_indptr, kv_indices, kv_last_page_len) as NumPy int32 for these sequences, in order."""
        pages = [self._pages[self._check_seq(int(s))] for s in seq_ids]
        kv_indptr = np.concatenate([[0], np.cumsum([len(p) for p in pages])]).astype(np.int32)
        kv_indices = np.asarray([i for p in pages for i in p], np.int32)
        lens = np.asarray([self._lens[int(s)] for s in seq_ids], np.int64)
        kv_last_page_len = np.where(lens > 0, (lens - 1) % self.page_size + 1, 0).astype(np.int32)
        return kv_indptr, kv_indices, kv_last_page_len

    # -- data

    def layer(self, layer: int):
        """The paged_kv_cache array of one layer: [max_num_pages, 2, ...] in the cache's layout."""
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"PagedKVCache.layer: layer must be in 0..{self.num_layers - 1}, got {layer}")
        return self.storage[layer]

    def append(self, layer: int, keys, values, batch: AppendBatch, *, k_scale=None, v_scale=None,
               stream=None) -> None:
        """Write one layer's new K/V rows ([nnz, num_kv_heads, head_dim]) where ``batch`` says; an
        fp8 cache takes float16 / bfloat16 rows and stores them scaled (``append_paged_kv_cache``)."""
        meta = batch.device if self.device_id >= 0 else batch.__dict__
        append_paged_kv_cache(keys, values, meta["batch_indices"], meta["positions"], self.layer(layer),
                              meta["kv_indices"], meta["kv_indptr"], meta["kv_last_page_len"],
                              self.kv_layout, k_scale=k_scale, v_scale=v_scale,
                              kv_data_type=self.dtype if fp8.is_fp8(self.dtype) else None, stream=stream)
