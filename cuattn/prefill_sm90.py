"""The Hopper prefill kernel (backend "fa3"): ``kernels_cu/prefill_sm90.cu`` (wgmma, TMA, sm_90a only).

Used by ``prefill.py`` for ``single_prefill_with_kv_cache`` and ``BatchPrefillWithRaggedKVCacheWrapper``
when the backend resolves to "fa3" (``prefill.resolve_backend``). Kept in its own module, beside the
portable launcher, because it pairs with its own CUDA file and launches with tensor maps
(``cuTensorMapEncodeTiled`` through ctypes) passed as ``__grid_constant__`` parameters.

Cases with a kernel: head_dim 128, fp16 / bf16 q, K/V of q's dtype or fp8 (e4m3 / e5m2: staged by the
TMA, converted to f16 in smem), k_scale / v_scale of any value, causal or not, any GQA group, contiguous
K/V (NHD or HND: the tensor map takes both strides) or pages the TMA can box, no custom mask, device
sm_90; every attention variant, the fused RoPE and query / key transforms included (16-bit K/V).
``unsupported_reason`` names the first limit a call hits; callers raise UnsupportedError with it.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np


from . import fp8, jit, variants
from .params import Params

_SOURCE = "prefill_sm90.cu"
_ENTRY = "cuattn_prefill_sm90"
ARCH = "sm_90a"
HEAD_DIM = 128
BLOCK_M = 128
NUM_THREADS = 384
# kernel parameters (prefill_sm90.cu's signature), then the variant's (variants.Composite.arg_kinds)
PARAMS = Params.define(_ENTRY, "tmap_k:t tmap_v:t q:p o:p lse:p qo_indptr:p kv_indptr:p kv_indices:p "
                               "kv_last_page_len:p page_size:i page_shift:i page_box:i work:p part_o:p part_lse:p "
                               "kv_chunk:p single_qo_len:i "
                               "single_kv_len:i group:i num_qo_heads:i q_s_tok:q q_s_head:q o_s_tok:q o_s_head:q "
                               "k_scale:f v_scale:f k_scales:p v_scales:p scale_per_head:i scale_log2:f")
KV_FP8 = {"e4m3": 1, "e5m2": 2}      # the kernel's KV_FP8 define by dtype_kv


@dataclass(frozen=True)
class Sm90PrefillSpec:
    dtype: str                 # "f16" | "bf16"
    causal: bool
    head_dim: int = HEAD_DIM
    block_n: int = 128         # keys per K/V tile
    stages: int = 2            # K/V tiles in flight (TMA pipeline depth)
    tuning: tuple = ()        # extra -D defines for experiments; () in shipped specs
    variant: variants.Composite = variants.DEFAULT
    paged: bool = False        # K/V from a paged cache: a TMA box per page (page_size % 16 == 0)
    dtype_kv: str = ""         # "" (K/V of q's dtype) | "e4m3" | "e5m2"
    backend = "fa3"
    archs = (ARCH,)            # built for sm_90a alone (cli.shipped_specs(arch))
    source = _SOURCE

    block_m = BLOCK_M

    @property
    def name(self) -> str:     # "prefill_sm90_hd128_qf16_causal_paged_kve4m3_bm128_bn128_s2"
        return (f"prefill_sm90_hd{self.head_dim}_q{self.dtype}_{'causal' if self.causal else 'full'}"
                f"{'_paged' if self.paged else ''}{'_kv' + self.dtype_kv if self.dtype_kv else ''}"
                f"_bm{self.block_m}_bn{self.block_n}_s{self.stages}"
                + "".join("_" + v.replace("=", "").lower() for v in self.tuning) + self.variant.name)

    @property
    def prelude(self) -> str:
        return self.variant.prelude(f"{self.name}.cu")

    def defines(self) -> tuple[str, ...]:
        return (f"-DHEAD_DIM={self.head_dim}", f"-DDTYPE=cuattn::{self.dtype}", f"-DCAUSAL={int(self.causal)}",
                f"-DBLOCK_N={self.block_n}", f"-DSTAGES={self.stages}", f"-DPAGED={int(self.paged)}",
                f"-DKV_FP8={KV_FP8.get(self.dtype_kv, 0)}") + tuple(f"-D{v}" for v in self.tuning)

    @property
    def kv_bytes(self) -> int:     # bytes per K/V element as the TMA loads it
        return 1 if self.dtype_kv else 2

    @property
    def smem_bytes(self) -> int:
        """Alignment slack + Q + STAGES (K + V) 16-bit tiles + 4 STAGES mbarriers (+ STAGES "K tile
        transformed" mbarriers with a query / key transform); fp8: + STAGES (K + V) staging tiles + 4
        STAGES mbarriers (224 KiB at head_dim 128: within sm_90's 227 KiB)."""
        bars = 5 if self.variant.has_qk_transform else 4
        tiles = (self.block_m + 2 * self.stages * self.block_n) * self.head_dim * 2 + 8 * bars * self.stages
        if self.dtype_kv:
            tiles += 2 * self.stages * self.block_n * self.head_dim + 32 * self.stages
        return 1024 + tiles


def make_spec(dtype: str, causal: bool, variant: variants.Composite = variants.DEFAULT,
              paged: bool = False, dtype_kv: str = "") -> Sm90PrefillSpec:
    """``dtype_kv``: "" or q's dtype for a 16-bit cache, "e4m3" / "e5m2" for an fp8 one."""
    return Sm90PrefillSpec(dtype, bool(causal), variant=variant, paged=bool(paged),
                           dtype_kv="" if dtype_kv == dtype else dtype_kv)


def shipped_specs() -> list[Sm90PrefillSpec]:
    """Compiled for sm_90a only (``cuattn precompile`` on an sm_90 device, CPU tests): every 16-bit case,
    and for fp8 K/V what serving runs (paged, causal or not, both formats; contiguous fp8 compiles on
    first use)."""
    return [make_spec(t, c, paged=p) for t in ("f16", "bf16") for c in (False, True) for p in (False, True)] + \
        [make_spec(t, c, paged=True, dtype_kv=kv) for t in ("f16", "bf16") for c in (False, True) for kv in KV_FP8]


def page_box(page_size: int, block_n: int = 128) -> int | None:
    """Keys per TMA box of a paged tile: min(page_size, block_n) when it divides both (page sizes 16,
    32, 64, 128 and multiples of 128), else None (no fa3 kernel: the fa2 gather path)."""
    box = min(page_size, block_n)
    return box if box >= 16 and page_size % box == 0 and block_n % box == 0 else None


def unsupported_reason(arch: str | None, head_dim: int, dtype: str | None, custom_mask: bool,
                       paged: bool, rope: bool = False, page_size: int | None = None,
                       dtype_kv: str | None = None) -> str | None:
    """Why backend "fa3" has no kernel for a case (None: it has one). ``arch`` None: not checked.
    ``dtype_kv``: the KV short name when it is not q's ("e4m3", "e5m2", "f32"). ``rope`` (the fused RoPE
    or a query / key transform) limits nothing by itself: fa3 runs them on 16-bit K/V."""
    if arch is not None and arch != ARCH:
        return f"the fa3 kernel needs an sm_90 GPU (wgmma, TMA); this device compiles for {arch}"
    if head_dim != HEAD_DIM:
        return f"fa3 has a kernel for head_dim 128 only, got head_dim={head_dim}"
    if dtype not in ("f16", "bf16"):
        return f"fa3 has a kernel for float16 / bfloat16 only, got {dtype}"
    if dtype_kv not in (None, "", dtype) and dtype_kv not in KV_FP8:
        return (f"fa3 reads K/V of q's dtype or fp8 (float8_e4m3fn / float8_e5m2) only, got an {dtype_kv} KV cache "
                f"(the fa2 kernel reads it)")
    if paged and page_size is not None and page_box(page_size) is None:
        return (f"fa3 reads pages of 16, 32, 64, 128 or a multiple of 128 keys with TMA boxes, got page_size="
                f"{page_size} (the fa2 kernel gathers any page size)")
    return None


# ---------------------------------------------------------------------------- tensor maps


def box_cols(head_dim: int, elem_bytes: int) -> int:
    """Columns per TMA box row: 128 bytes (64 16-bit or 128 fp8 elements; the kernel's swizzle), or a whole
    narrower fp8 row (head_dim 64: 64 bytes, 64-byte swizzle); the kernel's LOAD_COLS."""
    return min(128 // elem_bytes, head_dim)


@functools.lru_cache(maxsize=256)      # serving loops reuse each layer's K/V buffers
def kv_tensor_map(ptr: int, tokens: int, heads: int, s_tok: int, s_head: int, block_n: int, fn: str,
                  elem_bytes: int = 2) -> bytes:
    """The tensor map of a K or V array of ``elem_bytes`` elements (2: fp16 / bf16, 1: fp8): dims
    (HEAD_DIM, tokens, heads), element strides s_tok / s_head, box (box_cols, block_n, 1) with the swizzle
    of box_cols * elem_bytes bytes the kernel expects."""
    cols = box_cols(HEAD_DIM, elem_bytes)
    return jit.tensor_map(ptr, (HEAD_DIM, max(tokens, 1), max(heads, 1)), (s_tok, s_head), (cols, block_n, 1),
                          "the fa3 kernel", fn, elem_bytes=elem_bytes, swizzle_bytes=cols * elem_bytes)


@functools.lru_cache(maxsize=256)
def paged_tensor_map(ptr: int, page_size: int, heads: int, num_pages: int, strides: tuple, box: int, fn: str,
                     elem_bytes: int = 2) -> bytes:
    """The tensor map of a paged K or V cache: dims (HEAD_DIM, page_size, heads, pages), element
    strides (slot, head, page), box (box_cols, box, 1, 1), swizzled as ``kv_tensor_map``'s."""
    cols = box_cols(HEAD_DIM, elem_bytes)
    return jit.tensor_map(ptr, (HEAD_DIM, page_size, max(heads, 1), max(num_pages, 1)), strides, (cols, box, 1, 1),
                          "the fa3 paged kernel", fn, elem_bytes=elem_bytes, swizzle_bytes=cols * elem_bytes)


# ---------------------------------------------------------------------------- launch

META = ("qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_len", "work", "part_o", "part_lse",
        "kv_chunk")   # the plan's pointers


def launch(ctx, spec: Sm90PrefillSpec, *, q, k, v, k_strides, v_strides, kv_tokens: int, out, lse_ptr: int,
           num_work: int, num_kv_heads: int, group: int, sm_scale: float, fn: str, variant_args: tuple,
           single=(0, 0), meta: dict | None = None, pdl: bool = False, paged: tuple | None = None,
           scales=(fp8.ONE, fp8.ONE)) -> None:
    """One launch. k / v: device tensors (of ``spec.kv_bytes`` elements: an fp8 cache may be uint8);
    k_strides / v_strides = (token, head) element strides; ``meta`` = the plan's device pointers by
    parameter name (qo_indptr, kv_indptr, work, part_o, part_lse, kv_chunk; the page table when paged) in
    batch mode, None for a single request. ``paged`` = (page_size, num_pages, (s_tok, s_head, s_page)): k / v
    are a paged cache's K and V. ``scales`` = run()'s (k, v) fp8.Scale."""
    if num_work == 0 or num_kv_heads == 0:
        return
    if kv_tokens == 0:    # no key at all (no tensor map of an empty array): output 0, LSE -inf
        from . import arrays
        cp = arrays.cupy_module()
        with cp.cuda.Device(ctx.device), ctx.stream:
            arrays.cupy_view(out).fill(0)
            if lse_ptr:
                cp.ndarray((out.shape[0], out.shape[1]), cp.float32,
                           cp.cuda.MemoryPointer(cp.cuda.UnownedMemory(lse_ptr, out.shape[0] * out.shape[1] * 4, None), 0)
                           ).fill(-np.inf)
        return
    page_size, box = 0, 0
    if paged is not None:
        page_size, num_pages, strides = paged
        box = page_box(page_size, spec.block_n)
        tk, tv = (paged_tensor_map(x.ptr, page_size, num_kv_heads, num_pages, strides, box, fn, spec.kv_bytes)
                  for x in (k, v))
    else:
        tk = kv_tensor_map(k.ptr, kv_tokens, num_kv_heads, k_strides[0], k_strides[1], spec.block_n, fn, spec.kv_bytes)
        tv = kv_tensor_map(v.ptr, kv_tokens, num_kv_heads, v_strides[0], v_strides[1], spec.block_n, fn, spec.kv_bytes)
    launcher = jit.get_launcher(spec, _ENTRY, ctx.device, PARAMS.kinds + spec.variant.arg_kinds, spec.smem_bytes)
    args = PARAMS.pack(tmap_k=tk, tmap_v=tv, q=q.ptr, o=out.ptr, lse=lse_ptr,
                       **{n: (meta or {}).get(n, 0) for n in META}, page_size=page_size,
                       page_shift=page_size.bit_length() - 1 if page_size and page_size & (page_size - 1) == 0 else -1,
                       page_box=box, single_qo_len=single[0],
                       single_kv_len=single[1], group=group, num_qo_heads=q.shape[1], q_s_tok=q.strides[0],
                       q_s_head=q.strides[1], o_s_tok=out.strides[0], o_s_head=out.strides[1],
                       k_scale=scales[0].value, v_scale=scales[1].value, k_scales=scales[0].ptr, v_scales=scales[1].ptr,
                       scale_per_head=int(scales[0].per_head) | 2 * int(scales[1].per_head),
                       scale_log2=spec.variant.scale_log2(sm_scale))
    launcher((num_work, num_kv_heads), NUM_THREADS, ctx.stream, *args, *variant_args, pdl=pdl)
