"""The Hopper prefill kernel (backend "fa3"): ``kernels_cu/prefill_sm90.cu`` (wgmma, TMA, sm_90a only).

Used by ``prefill.py`` for ``single_prefill_with_kv_cache`` and ``BatchPrefillWithRaggedKVCacheWrapper``
when the backend resolves to "fa3" (``prefill_spec.resolve_backend``). Kept in its own module, beside the
portable launcher, because it pairs with its own CUDA file and launches with tensor maps
(``cuTensorMapEncodeTiled`` through ctypes) passed as ``__grid_constant__`` parameters.

Cases with a kernel: head_dim 64, 128, 256, or head_dim_qk / head_dim_vo 192 / 128 (``HEAD_DIMS``), fp16 /
bf16 q, K/V of q's dtype or fp8 (e4m3 / e5m2, converted to f16 on the way into shared memory; head_dim 64 and
128 only, ``FP8_HEAD_DIMS``), k_scale / v_scale of any value, causal or not, any GQA group, contiguous K/V (NHD
or HND: the tensor map takes both strides) or paged K/V (any page size: rows gathered by the producer warps,
``use_gather``; 16-bit rows with cp.async, fp8 rows through registers, converted), custom masks (a variant), device
sm_90; every attention variant, the fused RoPE and query / key transforms included (16-bit K/V).
``unsupported_reason`` names the first limit a call hits; callers raise UnsupportedError with it.
"""
from __future__ import annotations

import functools
import dataclasses
from dataclasses import dataclass

import numpy as np


from . import fp8, jit, variants
from .errors import UnsupportedError
from .params import Params

_SOURCE = "prefill_sm90.cu"
_ENTRY = "cuattn_prefill_sm90"
ARCH = "sm_90a"
HEAD_DIMS = ((64, 64), (128, 128), (256, 256), (192, 128))   # (head_dim_qk, head_dim_vo) with a kernel
FP8_HEAD_DIMS = ((64, 64), (128, 128))   # ... with an fp8 K/V kernel (prefill_sm90.cu LoadTile, SMEM_BYTES)
SMEM_LIMIT = 227 * 1024    # dynamic shared memory per block on sm_90
SMEM_LIMIT_2 = 113 * 1024  # ... each of two CTAs per SM (the 64-row tiles; prefill_sm90_layout.cuh checks it too)
# kernel parameters (prefill_sm90.cu's signature), then the variant's (variants.Composite.arg_kinds)
PARAMS = Params.define(_ENTRY, "tmap_k:t tmap_v:t q:p o:p lse:p qo_indptr:p kv_indptr:p kv_indices:p "
                               "kv_last_page_len:p page_size:i page_shift:i page_box:i k_cache:p v_cache:p k_s_row:q k_s_head:q "
                               "v_s_row:q v_s_head:q page_rows:i work:p part_o:p part_lse:p "
                               "kv_chunk:p sched:p num_work:i single_qo_len:i "
                               "single_kv_len:i group:i num_qo_heads:i q_s_tok:q q_s_head:q o_s_tok:q o_s_head:q "
                               "k_scale:f v_scale:f k_scales:p v_scales:p scale_per_head:i scale_log2:f")
KV_FP8 = {"e4m3": 1, "e5m2": 2}      # the kernel's KV_FP8 define by dtype_kv


def tile_n(head_dim_vo: int) -> int:
    """Keys per K/V tile: 128, or 64 where O's accumulator is 128 floats per thread (head_dim_vo 256):
    S (block_n / 2 floats) and O (head_dim_vo / 2) share a consumer's 232 registers."""
    return 128 if head_dim_vo <= 128 else 64


@dataclass(frozen=True)
class Sm90PrefillSpec:
    dtype: str                 # "f16" | "bf16"
    causal: bool
    head_dim_qk: int = 128     # q / K columns (HEAD_DIMS)
    head_dim_vo: int = 128     # V / out columns
    block_n: int = 128         # keys per K/V tile (tile_n)
    stages: int = 2            # K/V tiles in flight (TMA pipeline depth)
    tuning: tuple = ()        # extra -D defines for experiments; () in shipped specs
    variant: variants.Composite = variants.DEFAULT
    paged: bool = False        # K/V from a paged cache: a TMA box per page (page_size % 16 == 0), or
    gather: bool = False       # ... rows gathered by the producer warpgroup (any page size; fp8: converted)
    dtype_kv: str = ""         # "" (K/V of q's dtype) | "e4m3" | "e5m2"
    persistent: bool = False   # at most one CTA per SM, each looping over work items (PERSISTENT; make_spec: persists)
    block_m: int = 128         # packed query rows a CTA: 128 (two consumer warpgroups) or 64 (one: small_tile)
    fp8_ring: int = 0          # the fp8 gather: 0 rows through registers, n a cp.async ring of n fp8 tiles (FP8_RING)
    backend = "fa3"
    archs = (ARCH,)            # built for sm_90a alone (cli.shipped_specs(arch))
    source = _SOURCE

    dim_vo = property(lambda self: self.head_dim_vo)     # as fa2's PrefillSpec.dim_vo
    num_threads = property(lambda self: 128 * (self.block_m // 64 + 1))   # a producer and the consumer warpgroups
    ctas_per_sm = property(lambda self: 1 if self.block_m == 128 else 2)   # prefill_sm90_layout.cuh CTAS_PER_SM

    @property
    def name(self) -> str:     # "prefill_sm90_hd128_qf16_causal_paged_kve4m3_bm128_bn128_s2", "prefill_sm90_hd192v128_..."
        return spec_name("prefill_sm90", self.head_dim_qk, self.head_dim_vo, self.dtype, self.causal,
                         "_gather" if self.gather else "_paged" if self.paged else "", self)

    @property
    def prelude(self) -> str:
        return self.variant.prelude(f"{self.name}.cu")

    def defines(self) -> tuple[str, ...]:
        return (f"-DHEAD_DIM_QK={self.head_dim_qk}", f"-DHEAD_DIM_VO={self.head_dim_vo}",
                f"-DDTYPE=cuattn::{self.dtype}", f"-DCAUSAL={int(self.causal)}", f"-DBLOCK_N={self.block_n}",
                f"-DSTAGES={self.stages}", f"-DPAGED={2 if self.gather else int(self.paged)}", f"-DKV_FP8={KV_FP8.get(self.dtype_kv, 0)}",
                f"-DSPEC_SMEM_BYTES={self.smem_bytes}", f"-DPERSISTENT={int(self.persistent)}",
                f"-DNUM_CONSUMERS={self.block_m // 64}", f"-DFP8_RING={self.fp8_ring}") + tuple(f"-D{v}" for v in self.tuning)

    @property
    def spill_bytes(self) -> int:
        """The ptxas spill (stores, loads, stack frame, bytes each) this spec may have: 0 for every spec make_spec
        gives. The persistent fp8 gather's register form at head_dim 128 over e4m3 (shipped until session 22, now the
        ring's: ``ring``) spills 36 bytes at its 104 producer registers (NVRTC 12.9); an experiment that builds it
        (fp8_ring=0, stages=3) may. Tests check every spec against this bound."""
        return 64 if self.persistent and self.gather and self.dtype_kv == "e4m3" and self.head_dim_qk == 128 and \
            not self.fp8_ring else 0

    @property
    def kv_bytes(self) -> int:     # bytes per K/V element as the TMA loads it
        return 1 if self.dtype_kv else 2

    @property
    def k_xform(self) -> bool:     # the kernel's K_XFORM: producer warps transform each K tile (READY_K)
        return self.variant.has_rope or self.variant.has("key_transform")

    @property
    def smem_bytes(self) -> int:
        """prefill_sm90.cu's SMEM_BYTES (the kernel checks the two agree at compile time): alignment slack
        + Q + STAGES (K + V) 16-bit tiles + 4 STAGES mbarriers; fp8 staged by the TMA (not the gather): +
        STAGES (K + V) staging tiles + 4 STAGES mbarriers (225 KiB at head_dim 128: within sm_90's 227 KiB); a
        key transform (16-bit K/V only): + STAGES "K tile transformed" mbarriers; persistent: + 2 item slots of 64
        bytes and their 4 mbarriers."""
        kv_cols = self.head_dim_qk + self.head_dim_vo
        total = 1024 + self.block_m * self.head_dim_qk * 2 + self.stages * self.block_n * kv_cols * 2
        bars = 4 * self.stages
        if self.dtype_kv and not self.gather:
            total += self.stages * self.block_n * kv_cols
            bars += 4 * self.stages
        elif self.k_xform:
            bars += self.stages
        if self.persistent:      # two item slots (64 bytes) and their two mbarriers each
            bars += 4
            total += 2 * 64
        total += self.fp8_ring * self.block_n * kv_cols      # the fp8 ring's K and V tiles
        return total + 8 * bars


def spec_name(family: str, head_dim_qk: int, head_dim_vo: int, dtype: str, causal: bool, layout: str, spec) -> str:
    """The prefill kernels' one naming scheme (fa2's PrefillSpec and this module's): family, head dims (the
    V one when it differs), q dtype, mask, K/V layout, KV dtype, tiles and stages, tuning defines, variant;
    ``spec`` gives dtype_kv, block_m, block_n, stages, tuning and variant."""
    vo = f"v{head_dim_vo}" if head_dim_vo and head_dim_vo != head_dim_qk else ""
    return (f"{family}_hd{head_dim_qk}{vo}_q{dtype}_{'causal' if causal else 'full'}{layout}"
            f"{'_kv' + spec.dtype_kv if spec.dtype_kv else ''}_bm{spec.block_m}_bn{spec.block_n}_s{spec.stages}"
            f"{'_persist' if getattr(spec, 'persistent', False) else ''}"
            f"{f'_ring{spec.fp8_ring}' if getattr(spec, 'fp8_ring', 0) else ''}"
            + "".join("_" + v.replace("=", "").lower() for v in spec.tuning) + spec.variant.name)


def make_spec(dtype: str, causal: bool, variant: variants.Composite = variants.DEFAULT,
              paged: bool = False, dtype_kv: str = "", head_dim_qk: int = 128,
              head_dim_vo: int | None = None, page_size: int | None = None,
              gather: bool | None = None, small: bool = False) -> Sm90PrefillSpec:
    """``dtype_kv``: "" or q's dtype for a 16-bit cache, "e4m3" / "e5m2" for an fp8 one; ``head_dim_vo``
    None: ``head_dim_qk``. ``gather`` None: the paged producer ``use_gather`` picks (``page_size`` None:
    any page size). The gather takes 3 K/V stages where they fit shared memory (head_dim 64, 128); the fp8 gather at
    head_dim 128 copies its rows by cp.async into a ring of 2 fp8 tiles ahead of their conversion, with 2 stages (``ring``:
    FP8_RING). ``small``:
    every request has at most 64 packed query rows (block-sparse row blocks, decode and speculative steps):
    64-row tiles where ``small_tile`` allows, else the 128-row one."""
    dv = head_dim_qk if head_dim_vo is None else int(head_dim_vo)
    kv = "" if dtype_kv == dtype else dtype_kv
    if gather is None:
        gather = bool(paged) and use_gather(page_size, tile_n(dv), variant.has_rope and head_dim_qk == 256)
    bm = 64 if small and small_tile(int(head_dim_qk), dv, kv, variant) else 128
    spec = Sm90PrefillSpec(dtype, bool(causal), int(head_dim_qk), dv, tile_n(dv) if bm == 128 else 64, variant=variant,
                           paged=bool(paged), gather=bool(gather), dtype_kv=kv,
                           persistent=persists(int(head_dim_qk), kv, bool(gather), variant), block_m=bm,
                           fp8_ring=ring(bool(gather), kv, int(head_dim_qk)))
    if spec.fp8_ring:
        return spec
    deeper = dataclasses.replace(spec, stages=3)
    return deeper if spec.gather and deeper.smem_bytes <= (SMEM_LIMIT if bm == 128 else SMEM_LIMIT_2) else spec


def ring(gather: bool, dtype_kv: str, head_dim_qk: int) -> int:
    """The fp8 gather's ring (FP8_RING, prefill_sm90_gather_fp8.cuh): its rows copied by cp.async into 2 fp8 tiles ahead
    of their conversion (up to 2 tiles of K and V in flight a CTA; through registers, one half tile), 2 K/V stages (the
    ring takes the third's shared memory), 56 producer registers where the register form took 104 and spilled. H100,
    head_dim 128, against the register form (3 stages), bitwise the same output: 0.81-0.98x the time at every shape
    measured (8 x 64 queries over 4096 keys 0.85, 64 x 4 over 4096 0.81, 16 x 16 over 8192 0.83, 1 x 4096 causal 0.98,
    1 x 16384 causal 0.96); at head_dim 64 (8-byte copies) 1.03-1.06x: not there (prefill_sm90_notes.md, session 22)."""
    return 2 if gather and dtype_kv in KV_FP8 and head_dim_qk == 128 else 0


def small_tile(head_dim_qk: int, head_dim_vo: int, dtype_kv: str, variant: variants.Composite) -> bool:
    """Whether 64-row tiles run (NUM_CONSUMERS 1: one consumer warpgroup, two CTAs per SM in 113 KiB each, so one
    CTA's softmax runs beside the other's GEMMs): 16-bit K/V at head_dim 64 and 128 (keys 64 a tile, two stages;
    the fp8 gather's rows are laid out for 128-key tiles, head_dim 256's stages do not fit), not the fused RoPE at
    head_dim 128 (4-8 bytes spilled in 128 registers a thread)."""
    return not dtype_kv and head_dim_qk == head_dim_vo and head_dim_qk <= 128 and not (variant.has_rope and
                                                                                       head_dim_qk == 128)


def persists(head_dim_qk: int, dtype_kv: str, gather: bool, variant: variants.Composite) -> bool:
    """Whether a spec runs persistent (PERSISTENT: at most one CTA per SM, two with 64-row tiles, each taking the next
    work item from a counter as it frees up, in turns with a logits mask; the producer hands each item to the consumers
    through shared memory, and the next item's K/V tiles and Q load while one finishes): 16-bit K/V at head_dim_qk <=
    128, but not a custom mask's gather spec, and the fp8 gather of plain attention. H100, against the one-CTA-an-item
    grid: 0.88-0.95x the time at 8 x 2048, 0.95-0.99x at 1 x 4096 and 1 x 1024, 1 x 16384 within the noise, the mixed
    step 0.99x (benchmarks/results/prefill_sm90_notes.md, session 18); the fp8 gather 0.93-0.98x at 8 x 2048 and 1 x
    4096, 1 x 16384 within the noise (session 20). Where it is not used, its registers spilled (head_dim 192 and 256:
    8-76 bytes, the custom mask's gather: 12, the fp8 gather's register form with a variant's logits transform: 104;
    its ring spills nothing there, but persistent it ran 0.93-1.04x the one-CTA time with variants, session 22: not
    taken), or the fp8 producers count their tiles from 0 (contiguous fp8, the TMA-staged converters)."""
    return (not dtype_kv or (gather and variant.is_default)) and head_dim_qk <= 128 and not (gather and variant.has_custom_mask)


def use_gather(page_size: int | None, block_n: int, rope_256: bool = False) -> bool:
    """The paged producer: the gather for every cache (any page size; 16-bit: at pages of 16, 5-12% faster
    than a TMA box per page on an H100; fp8: rows converted in registers, 3 stages instead of the TMA-staged
    converters' 2; benchmarks/results/prefill_sm90_notes.md), TMA boxes for the fused RoPE at head_dim 256
    (whose transform and the gather spill the producer's registers; pages no box fits run on fa2 there)."""
    return not rope_256 or page_size is None or page_box(page_size, block_n) is None


def shipped_specs() -> list[Sm90PrefillSpec]:
    """Compiled for sm_90a only (``cuattn precompile`` on an sm_90 device, CPU tests): head_dim 128, fp16 /
    bf16, causal or not, contiguous or paged; for fp8 K/V at head_dim 128 and the other head dims what
    serving runs (fp8: paged, causal or not, both formats; other head dims: paged causal prefill; 16-bit
    paged specs gather any page size; and the 64-row paged tiles of requests within 64 packed rows). 26 specs; the
    rest compile on first use (~1.5 s each)."""
    return [make_spec(t, c, paged=p, small=sm) for t in ("f16", "bf16") for c in (False, True)
            for p, sm in ((False, False), (True, False), (True, True))] + \
        [make_spec(t, c, paged=True, dtype_kv=kv) for t in ("f16", "bf16") for c in (False, True) for kv in KV_FP8] + \
        [make_spec(t, True, paged=True, head_dim_qk=dk, head_dim_vo=dv) for dk, dv in HEAD_DIMS if dk != 128
         for t in ("f16", "bf16")]


def page_box(page_size: int, block_n: int = 128) -> int | None:
    """Keys per TMA box of a paged tile: min(page_size, block_n) when it divides both (page sizes 16,
    32, 64 and multiples of block_n; 128 too where block_n is 128), else None (no fa3 kernel: the fa2
    gather path)."""
    box = min(page_size, block_n)
    return box if box >= 16 and page_size % box == 0 and block_n % box == 0 else None


def unsupported_reason(arch: str | None, head_dim: int, dtype: str | None, custom_mask: bool,
                       paged: bool, rope: bool = False, page_size: int | None = None,
                       dtype_kv: str | None = None, head_dim_vo: int | None = None) -> str | None:
    """Why backend "fa3" has no kernel for a case (None: it has one). ``arch`` None: not checked.
    ``head_dim`` is q's and K's, ``head_dim_vo`` (None: the same) V's and the output's. ``dtype_kv``: the
    KV short name when it is not q's ("e4m3", "e5m2", "f32"). ``rope`` (the fused RoPE or a query / key
    transform) limits nothing by itself: fa3 runs them on 16-bit K/V."""
    dv = head_dim if head_dim_vo is None else head_dim_vo
    if arch is not None and arch != ARCH:
        return f"the fa3 kernel needs an sm_90 GPU (wgmma, TMA); this device compiles for {arch}"
    if (head_dim, dv) not in HEAD_DIMS:
        got = f"head_dim={head_dim}" if dv == head_dim else f"head_dim_qk={head_dim}, head_dim_vo={dv}"
        return (f"fa3 has kernels for head_dim 64, 128, 256 and head_dim_qk / head_dim_vo 192 / 128, got {got}")
    if dtype not in ("f16", "bf16"):
        return f"fa3 has a kernel for float16 / bfloat16 only, got {dtype}"
    if dtype_kv not in (None, "", dtype) and dtype_kv not in KV_FP8:
        return (f"fa3 reads K/V of q's dtype or fp8 (float8_e4m3fn / float8_e5m2) only, got an {dtype_kv} KV cache "
                f"(the fa2 kernel reads it)")
    if dtype_kv in KV_FP8 and (head_dim, dv) not in FP8_HEAD_DIMS:
        got = f"head_dim={head_dim}" if dv == head_dim else f"head_dim_qk={head_dim}, head_dim_vo={dv}"
        return (f"fa3 reads an fp8 KV cache at head_dim 64 and 128 only, got {got} (head_dim 256: the fp8 "
                f"staging tiles and the 16-bit ones do not fit 227 KiB of shared memory; 192: the fp8 converter "
                f"reads rows of 64 or a multiple of 128 bytes; the fa2 kernel reads it)")
    if paged and page_size is not None and rope and head_dim == 256 and page_box(page_size, tile_n(dv)) is None:
        return (f"fa3 gathers pages of {page_size} keys (no TMA box fits them) with no query / key transform or "
                f"fused RoPE at head_dim 256 (the producer's registers: it spills; the fa2 kernel runs it)")
    return None


# ---------------------------------------------------------------------------- tensor maps


def box_cols(head_dim: int, elem_bytes: int) -> int:
    """Columns per TMA box row: 128 bytes (64 16-bit or 128 fp8 elements; the kernel's swizzle), or a whole
    narrower fp8 row (head_dim 64: 64 bytes, 64-byte swizzle); the kernel's LoadTile<head_dim>::COLS."""
    return min(128 // elem_bytes, head_dim)


@functools.lru_cache(maxsize=256)      # serving loops reuse each layer's K/V buffers
def kv_tensor_map(ptr: int, head_dim: int, tokens: int, heads: int, s_tok: int, s_head: int, block_n: int,
                  fn: str, elem_bytes: int = 2) -> bytes:
    """The tensor map of a K or V array of ``elem_bytes`` elements (2: fp16 / bf16, 1: fp8): dims
    (head_dim, tokens, heads) (K: head_dim_qk, V: head_dim_vo), element strides s_tok / s_head, box
    (box_cols, block_n, 1) with the swizzle of box_cols * elem_bytes bytes the kernel expects."""
    cols = box_cols(head_dim, elem_bytes)
    return jit.tensor_map(ptr, (head_dim, max(tokens, 1), max(heads, 1)), (s_tok, s_head), (cols, block_n, 1),
                          "the fa3 kernel", fn, elem_bytes=elem_bytes, swizzle_bytes=cols * elem_bytes)


@functools.lru_cache(maxsize=256)
def paged_tensor_map(ptr: int, head_dim: int, page_size: int, heads: int, num_pages: int, strides: tuple, box: int,
                     fn: str, elem_bytes: int = 2) -> bytes:
    """The tensor map of a paged K or V cache: dims (head_dim, page_size, heads, pages) (K: head_dim_qk,
    V: head_dim_vo), element strides (slot, head, page), box (box_cols, box, 1, 1), swizzled as
    ``kv_tensor_map``'s."""
    cols = box_cols(head_dim, elem_bytes)
    return jit.tensor_map(ptr, (head_dim, page_size, max(heads, 1), max(num_pages, 1)), strides, (cols, box, 1, 1),
                          "the fa3 paged kernel", fn, elem_bytes=elem_bytes, swizzle_bytes=cols * elem_bytes)


# ---------------------------------------------------------------------------- launch

_NO_MAP = bytes(128)     # the tensor-map parameters of a gather spec (its producer reads the caches by pointer)


def gather_args(k, v, k_strides, v_strides, paged: tuple, kv_bytes: int, fn: str) -> dict:
    """The gather producer's cache parameters: pointers, byte strides of a slot and a head, and the page
    stride in slots (K's and V's must agree: one row index serves both). Rows are addressed as page *
    page_rows + slot in int32, slot strides under 4 GiB. (Pointers and strides are 16-byte multiples: run() checks
    that before any launch, arrays.check_aligned.)"""
    (ks, kh, kp), (vs, vh, vp) = k_strides, v_strides
    num_pages = max(paged[1], paged[2])
    if kp % ks or vp * ks != kp * vs or num_pages * (kp // ks) >= 2 ** 31:
        raise UnsupportedError(f"{fn}: the fa3 gather addresses rows as page * (page stride / slot stride) + slot "
                               f"in int32: the page strides must be multiples of the slot strides, with the "
                               f"same ratio for K and V and num_pages * ratio < 2**31; got K {kp}/{ks}, V {vp}/{vs}")
    if max(ks, vs) * kv_bytes >= 2 ** 32:
        raise UnsupportedError(f"{fn}: the fa3 gather takes a slot stride under 4 GiB (a row offset is one 32 x 32 -> "
                               f"64-bit multiply-add); got K {ks * kv_bytes}, V {vs * kv_bytes} bytes")
    return dict(k_cache=k.ptr, v_cache=v.ptr, k_s_row=ks * kv_bytes, k_s_head=kh * kv_bytes, v_s_row=vs * kv_bytes,
                v_s_head=vh * kv_bytes, page_rows=kp // ks)


META = ("qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_len", "work", "part_o", "part_lse",
        "kv_chunk", "sched")   # the plan's pointers


def launch(ctx, spec: Sm90PrefillSpec, *, q, k, v, k_strides, v_strides, kv_tokens: int, out, lse_ptr: int,
           num_work: int, num_kv_heads: int, group: int, sm_scale: float, fn: str, variant_args: tuple,
           single=(0, 0), meta: dict | None = None, pdl: bool = False, paged: tuple | None = None,
           scales=(fp8.ONE, fp8.ONE), record: list | None = None) -> None:
    """One launch. k / v: device tensors (K with spec.head_dim_qk columns, V with spec.head_dim_vo; of
    ``spec.kv_bytes`` elements: an fp8 cache may be uint8); k_strides / v_strides = (token, head) element
    strides, or (slot, head, page) when paged; ``meta`` = the plan's device pointers by parameter name
    (qo_indptr, kv_indptr, work, part_o, part_lse, kv_chunk; the page table when paged) in batch mode, None
    for a single request. ``paged`` = (page_size, K's num_pages, V's num_pages): k / v are a paged cache's
    K and V. ``scales`` = run()'s (k, v) fp8.Scale. ``record``: each launch appended as (launcher, grid, threads,
    arguments, pdl), None for work that is not a launch (prefill_batch's run replay)."""
    if num_work == 0 or num_kv_heads == 0:
        return
    if kv_tokens == 0:    # no key at all (no tensor map of an empty array): output 0, LSE -inf
        if record is not None:
            record.append(None)
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
    gather = dict(k_cache=0, v_cache=0, k_s_row=0, k_s_head=0, v_s_row=0, v_s_head=0, page_rows=0)
    if spec.gather:
        page_size = paged[0]
        tk = tv = _NO_MAP
        gather = gather_args(k, v, k_strides, v_strides, paged, spec.kv_bytes, fn)
    elif paged is not None:
        page_size, k_pages, v_pages = paged
        box = page_box(page_size, spec.block_n)
        tk = paged_tensor_map(k.ptr, spec.head_dim_qk, page_size, num_kv_heads, k_pages, tuple(k_strides), box, fn,
                              spec.kv_bytes)
        tv = paged_tensor_map(v.ptr, spec.head_dim_vo, page_size, num_kv_heads, v_pages, tuple(v_strides), box, fn,
                              spec.kv_bytes)
    else:
        tk = kv_tensor_map(k.ptr, spec.head_dim_qk, kv_tokens, num_kv_heads, *k_strides, spec.block_n, fn, spec.kv_bytes)
        tv = kv_tensor_map(v.ptr, spec.head_dim_vo, kv_tokens, num_kv_heads, *v_strides, spec.block_n, fn, spec.kv_bytes)
    launcher = jit.get_launcher(spec, _ENTRY, ctx.device, PARAMS.kinds + spec.variant.arg_kinds, spec.smem_bytes)
    args = PARAMS.pack(tmap_k=tk, tmap_v=tv, q=q.ptr, o=out.ptr, lse=lse_ptr,
                       **{n: (meta or {}).get(n, 0) for n in META}, page_size=page_size,
                       page_shift=page_size.bit_length() - 1 if page_size and page_size & (page_size - 1) == 0 else -1,
                       page_box=box, **gather, num_work=num_work, single_qo_len=single[0],
                       single_kv_len=single[1], group=group, num_qo_heads=q.shape[1], q_s_tok=q.strides[0],
                       q_s_head=q.strides[1], o_s_tok=out.strides[0], o_s_head=out.strides[1],
                       k_scale=scales[0].value, v_scale=scales[1].value, k_scales=scales[0].ptr, v_scales=scales[1].ptr,
                       scale_per_head=int(scales[0].per_head) | 2 * int(scales[1].per_head),
                       scale_log2=spec.variant.scale_log2(sm_scale))
    grid = ((min(num_work * num_kv_heads, _num_sms(ctx.device) * spec.ctas_per_sm), 1) if spec.persistent
            else (num_work, num_kv_heads))
    args += tuple(variant_args)
    if record is not None:
        record.append((launcher, grid, spec.num_threads, args, pdl))
    launcher(grid, spec.num_threads, ctx.stream, *args, pdl=pdl)


@functools.lru_cache(maxsize=None)
def _num_sms(device: int) -> int:
    from .plan import num_sms
    return num_sms(device)
