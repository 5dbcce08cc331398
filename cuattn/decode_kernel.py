"""The decode kernel's description: ``kernels_cu/decode.cu``'s specialization (DecodeSpec: head_dim,
dtypes, pipeline depth, warps, TMA, variant), its launch parameters (PARAMS / MERGE_PARAMS, mirrored
by the .cu signatures), the shipped specializations, and the launchers and tensor maps that
``decode.py``'s wrapper uses. The wrapper (plan / run / the NumPy path) lives in ``decode.py``.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from . import arrays, jit, plan as _plan, support, variants
from .params import Params

_SOURCE = "decode.cu"
_ENTRY = "cuattn_decode_paged"
_MERGE_ENTRY = "cuattn_decode_merge"
HEAD_DIMS = support.TABLE["decode"]["head_dims"]
_M_TILE = 16                  # query heads per CTA (mma M)
_THREADS = 128
_TMA_ARCH = "sm_90a"
_TMA_ALIGN = 16               # TMA kernel: tokens per warp-box; pages and pieces are multiples of it


@dataclass(frozen=True)
class DecodeSpec:
    """A decode kernel's specialization. The derived sizes that plan() reads (stages, shared memory, CTAs per
    SM) are cached on the instance (plan()'s specs are kept by ``_make_spec``: computed once, not per plan)."""
    head_dim: int       # 64 | 128 | 256
    dtype_q: str        # "f16" | "bf16"
    dtype_kv: str       # "f16" | "bf16" | "e4m3" | "e5m2" | "f32" (fp8: to f16, fp32: to q's type when fragments load)
    num_stages: int = 0  # cp.async depth; 0: the default for head_dim (tuning experiments only)
    num_warps: int = 4   # warps per CTA (16 tokens each per stage); plan() picks 8 at <= 1 CTA/SM (hd128)
    # cp.async L2 prefetch size hint in bytes (0 | 128 | 256). 128 on H100 (same run, read flush):
    # bs16x32k 742 -> 729 us (96.2 -> 98.0% of read BW), bs64x32k 2974 -> 2919, bs16x2048 54.5 -> 53.5
    l2_prefetch: int = 128
    # K/V by TMA (sm_90 only: page_size % 16 == 0 and work items starting at multiples of 16)
    tma: bool = False
    variant: variants.Composite = variants.DEFAULT
    source = _SOURCE

    @property
    def name(self) -> str:     # "decode_hd128_qf16_kvf16"
        extra = f"_s{self.num_stages}" if self.num_stages else ""
        extra += f"_w{self.num_warps}" if self.num_warps != 4 else ""
        extra += f"_pf{self.l2_prefetch}" if self.l2_prefetch != 128 else ""
        extra += "_tma" if self.tma else ""
        return f"decode_hd{self.head_dim}_q{self.dtype_q}_kv{self.dtype_kv}{extra}{self.variant.name}"

    @property
    def prelude(self) -> str:
        return self.variant.prelude(f"{self.name}.cu")

    @property
    def archs(self) -> tuple[str, ...] | None:   # cli.shipped_specs: TMA kernels for Hopper alone
        return (_TMA_ARCH,) if self.tma else None

    @functools.cached_property
    def kv_bytes(self) -> int:   # bytes per K/V element
        return 1 if self.dtype_kv in FP8 else 4 if self.dtype_kv == "f32" else 2

    @functools.cached_property
    def stages(self) -> int:   # pipeline depth: ~70-135 KB of K/V in flight per CTA
        if self.num_stages:
            return self.num_stages
        if self.kv_bytes == 1:   # stages of half the bytes: more of them (as many as keep 2 CTAs/SM at hd128)
            return {64: 8, 128: 5, 256: 4}[self.head_dim]
        if self.kv_bytes == 4:   # twice the bytes: fewer (hd256 runs 2 warps: F32_WARPS)
            return {64: 3, 128: 2, 256: 2}[self.head_dim]
        return {64: 4, 128: 3, 256: 2}[self.head_dim]

    def defines(self) -> tuple[str, ...]:
        return (f"-DHEAD_DIM={self.head_dim}", f"-DQ_BF16={int(self.dtype_q == 'bf16')}",
                f"-DKV_BF16={int(self.dtype_kv == 'bf16')}", f"-DKV_FP8={FP8.get(self.dtype_kv, 0)}",
                f"-DKV_F32={int(self.dtype_kv == 'f32')}",
                f"-DSTAGES={self.stages}",
                f"-DNUM_WARPS={self.num_warps}", f"-DL2_PREFETCH={self.l2_prefetch}", f"-DTMA={int(self.tma)}")

    @property
    def threads(self) -> int:
        return 32 * self.num_warps

    @property
    def block_n(self) -> int:  # tokens per pipeline stage
        return 16 * self.num_warps

    @functools.cached_property
    def smem_bytes(self) -> int:
        q_rows = _M_TILE * (self.head_dim * 2 + 16)
        kvb = self.kv_bytes
        if self.tma:     # 1024-byte alignment, unpadded stages, query rows, an mbarrier per (warp, stage)
            return 1024 + self.stages * 2 * self.block_n * self.head_dim * kvb + q_rows + 8 * self.num_warps * self.stages
        row = self.head_dim * kvb + 16
        return self.stages * 2 * self.block_n * row + q_rows + 2 * 512 * 4   # + page-id windows

    @functools.cached_property
    def ctas_per_sm(self) -> int:
        return max(1, min(4, (228 * 1024) // (self.smem_bytes + 1024)))


FP8 = {"e4m3": 1, "e5m2": 2}      # spec dtype_kv -> the kernel's KV_FP8
F32_WARPS = {64: 4, 128: 4, 256: 2}   # fp32 K/V: warps per CTA (hd256: 4 warps x 2 stages exceed shared memory)


def shipped_specs() -> list[DecodeSpec]:
    dts = [(q, kv) for q in ("f16", "bf16") for kv in ("f16", "bf16", "e4m3", "e5m2")]
    return [DecodeSpec(d, q, kv, tma=tma) for tma in (False, True) for d in HEAD_DIMS for q, kv in dts] + \
        [DecodeSpec(128, q, kv, num_warps=8, tma=tma) for tma in (False, True) for q, kv in dts] + \
        [DecodeSpec(128, q, kv, num_stages=2, tma=True) for q, kv in dts if kv in ("f16", "bf16")] + \
        [DecodeSpec(128, q, "f32") for q in ("f16", "bf16")]


@functools.cache
def _make_spec(head_dim: int, dtype_q: str, dtype_kv: str, num_stages: int, num_warps: int,
               l2_prefetch: int, tma: bool, variant: variants.Composite = variants.DEFAULT) -> DecodeSpec:
    """plan()'s specs, memoized (dataclasses.replace cost ~5 µs per plan)."""
    return DecodeSpec(head_dim, dtype_q, dtype_kv, num_stages, num_warps, l2_prefetch, tma, variant)


@functools.cache
def _num_sms(device: int) -> int:
    return _plan.num_sms(device)


# kernel parameters (decode.cu's signatures), grouped by how long they hold: the plan's (work ..
# req_kv_len), the cache's (k_cache .. s_head [+ the K and V tensor maps]), the call's (q .. o_s_h),
# then the variant's (variants.Composite.arg_kinds: sm_scale and its parameters)
_PLAN = ("work:p kv_indices:p part_o:p part_lse:p page_size:i page_shift:i num_qo_heads:i group:i m_tiles:i "
         "scale_log2:f counters:p ids_in_plan:i req_kv_len:p ")
_CACHE, _MAPS = "k_cache:p v_cache:p s_page:q s_tok:q s_head:q ", "tmap_k:t tmap_v:t "
_CALL = "q:p out:p lse:p q_s_b:q q_s_h:q o_s_b:q o_s_h:q k_scale:f v_scale:f k_scales:p v_scales:p scale_per_head:i"
PARAMS = {tma: Params.define(_ENTRY, _PLAN + _CACHE + (_MAPS if tma else "") + _CALL) for tma in (False, True)}
MERGE_PARAMS = Params.define(_MERGE_ENTRY, "merge:p part_o:p part_lse:p out:p lse:p o_s_b:q o_s_h:q num_qo_heads:i")


def _launchers(spec: DecodeSpec, device: int):
    """(decode kernel, merge kernel) launchers; the kernel's shared memory set at first use."""
    kinds = PARAMS[spec.tma].kinds + spec.variant.arg_kinds
    return (jit.get_launcher(spec, _ENTRY, device, kinds, spec.smem_bytes),
            jit.get_launcher(spec, _MERGE_ENTRY, device, MERGE_PARAMS.kinds))


@functools.lru_cache(maxsize=256)      # every layer's cache: hit after the first step
def _paged_tensor_maps(k_ptr: int, v_ptr: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
                       s_page: int, s_tok: int, s_head: int, kv_bytes: int = 2) -> tuple[bytes, bytes]:
    """The TMA kernel's views of the K and V caches: dims (head_dim, page_size, num_kv_heads,
    num_pages), box (128 bytes of dims, or the whole row if shorter) x 16 slots of one page and head."""
    cols = min(head_dim, 128 // kv_bytes)
    return tuple(jit.tensor_map(ptr, (head_dim, page_size, num_kv_heads, num_pages), (s_tok, s_head, s_page),
                                (cols, _TMA_ALIGN, 1, 1), "the TMA decode kernel",
                                "BatchDecodeWithPagedKVCacheWrapper.run", elem_bytes=kv_bytes,
                                swizzle_bytes=cols * kv_bytes) for ptr in (k_ptr, v_ptr))


def _m_tiles(group: int) -> int:
    """CTAs per kv head: tiles of up to 16 of its query heads (mma M)."""
    return -(-group // _M_TILE)


def _page_shift(page_size: int) -> int:
    """log2(page_size) for a power of two (the kernel then shifts and masks), else -1."""
    return page_size.bit_length() - 1 if page_size & (page_size - 1) == 0 else -1


def _short(dtype: np.dtype) -> str:
    dtype = np.dtype(dtype)
    return arrays.SHORT_NAME.get(dtype) or str(dtype)     # str(dtype) costs ~10 µs: only when needed
