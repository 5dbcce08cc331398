"""The portable prefill kernel's specialization, and the choice of backend for a prefill call.

``PrefillSpec`` is the compile-time key of ``kernels_cu/prefill.cu`` (backend "fa2"): its name, ``-D``
defines and shared memory, built by ``make_spec`` from a call's configuration with the tiles of
``tile_config``; ``shipped_specs`` is what ``cuattn precompile`` builds. ``select_backend`` checks a
wrapper's ``backend=`` argument and ``resolve_backend`` picks "fa2" or "fa3" (``prefill_sm90.py``) for
one call. The batch machinery that uses them is ``prefill_batch.py``; the wrappers, ``prefill.py``.
"""
from __future__ import annotations

from dataclasses import dataclass

from . import prefill_sm90, support, variants
from .errors import UnsupportedError
from .prefill_checks import DTYPES

_SOURCE = "prefill.cu"
HEAD_DIMS = support.TABLE["prefill"]["head_dims"]
KV_FP8 = {"e4m3": 1, "e5m2": 2}      # spec dtype_kv -> the kernel's KV_FP8 (K/V converted to f16 in smem)
SPLIT_TILES = (1, 64, 2)  # (num_mma_q, block_n, stages) for head_dim_vo != head_dim_qk: 128 x 32 spilled 8-16 bytes
BACKENDS = ("auto", "fa2", "fa3")


# ---------------------------------------------------------------------------- specs


def tile_config(head_dim: int, custom_mask: bool, paged: bool = False, small_q: bool = False) -> tuple[int, int, int]:
    """(num_mma_q, block_n, stages): the largest tiles that compile without register spills,
    and as many K/V stages as keep two CTAs per SM within shared memory. hd128: 128 x 64 tiles
    (two stages: 96 KiB, two CTAs per SM), paged too since its page offsets live in smem.
    ``small_q``: no request has more than 64 packed query rows (block-sparse row blocks, decode
    steps): 64-row tiles, so half of every tile is not padding."""
    if head_dim == 64:
        return (1 if small_q else 2), 64, 3
    if head_dim == 128:
        if custom_mask:
            return 1, 64, 3
        if small_q:             # two stages: 81 KiB, two CTAs per SM (three stages fit one)
            return 1, 64, 2
        return 2, 64, 2
    return 1, 32, 2


@dataclass(frozen=True)
class PrefillSpec:
    head_dim: int          # 64 | 128 | 256
    dtype: str             # "f16" | "bf16" (q, k, v and out)
    causal: bool
    paged: bool
    num_mma_q: int         # 16-row m-tiles per warp; 4 warps
    block_n: int           # keys per K/V tile
    stages: int = 2        # K/V tiles in flight (cp.async pipeline depth)
    tuning: tuple = ()    # extra -D defines for tuning experiments (benchmarks); () in shipped specs
    variant: variants.Composite = variants.DEFAULT
    dtype_kv: str = ""     # "" (K/V of ``dtype``) | "e4m3" | "e5m2" | "f32"
    head_dim_vo: int = 0   # V / out columns when not head_dim (192 / 128: HEAD_DIM_PAIRS)
    source = _SOURCE

    @property
    def block_m(self) -> int:
        return 64 * self.num_mma_q

    @property
    def custom_mask(self) -> bool:       # the custom mask is a variant piece (variants.CUSTOM_MASK)
        return self.variant.has_custom_mask

    @property
    def kv_bytes(self) -> int:
        return {"": 2, "f32": 4}.get(self.dtype_kv, 1)

    @property
    def dim_vo(self) -> int:
        return self.head_dim_vo or self.head_dim

    @property
    def name(self) -> str:   # "prefill_hd128_qf16_causal_paged_bm128_bn32"
        return prefill_sm90.spec_name("prefill", self.head_dim, self.head_dim_vo, self.dtype, self.causal,
                                      "_paged" if self.paged else "", self)

    @property
    def prelude(self) -> str:
        return self.variant.prelude(f"{self.name}.cu")

    def defines(self) -> tuple[str, ...]:
        return (f"-DHEAD_DIM={self.head_dim}", f"-DDTYPE=cuattn::{self.dtype}",
                f"-DCAUSAL={int(self.causal)}", f"-DPAGED={int(self.paged)}", f"-DNUM_MMA_Q={self.num_mma_q}",
                f"-DBLOCK_N={self.block_n}", f"-DSTAGES={self.stages}", f"-DKV_FP8={KV_FP8.get(self.dtype_kv, 0)}",
                f"-DKV_F32={int(self.dtype_kv == 'f32')}",
                f"-DHEAD_DIM_VO={self.dim_vo}") + \
            tuple(f"-D{v}" for v in self.tuning)

    @property
    def smem_bytes(self) -> int:     # Q tile (2-byte elements) + STAGES K tiles + STAGES V tiles
        d, dv = self.head_dim, self.dim_vo
        tiles = self.block_m * d * 2 + self.stages * self.block_n * (d + dv) * self.kv_bytes
        if self.dtype_kv:            # fp8 / fp32: the converted 16-bit K and V tiles
            tiles += self.block_n * (d + dv) * 2
        # paged: row offsets (STAGES x BLOCK_N int) and page ids ((STAGES + 1) x BLOCK_N int)
        return tiles + (4 * (2 * self.stages + 1) * self.block_n if self.paged else 0)


def make_spec(head_dim: int, dtype: str, causal: bool, custom_mask: bool, paged: bool,
              variant: variants.Composite = variants.DEFAULT, small_q: bool = False, dtype_kv: str = "",
              head_dim_vo: int | None = None) -> PrefillSpec:
    """``custom_mask``: add the custom-mask variant to ``variant`` (where resolve() has not already)."""
    if custom_mask and not variant.has_custom_mask:
        variant = variants.Composite(variant.pieces + (variants.CUSTOM_MASK,))
    # a logits transform needs registers on every tile, as a custom mask does: the smaller tile
    # (hd128 128 x 64 spilled 8-76 bytes with ALiBi or soft-cap on sm_80 / sm_90a)
    num_mma_q, block_n, stages = tile_config(head_dim, variant.has_custom_mask or variant.has("logits_transform")
                                             or variant.has_qk_transform, paged, small_q)
    if head_dim_vo not in (None, head_dim):     # 192 / 128 (fp32 K/V: 64 x 64 spilled 12 bytes, paged)
        num_mma_q, block_n, stages = SPLIT_TILES if dtype_kv != "f32" else (1, 32, 2)
    elif dtype_kv == "f32":
        # fp32 K/V: 4-byte stages, two of them (three of hd64 took 128 KiB); hd128 128 x 32
        block_n, stages = (32 if (head_dim, num_mma_q, block_n) == (128, 2, 64) else block_n), 2
    elif dtype_kv not in ("", dtype) and (head_dim, num_mma_q, block_n) == (128, 2, 64):
        # fp8 K/V (tiles converted to f16 in smem): 128 x 64 spilled 4-100 bytes on sm_80 / sm_90a whatever
        # the load order; 128 x 32 with three stages is spill-free (73 KiB, two CTAs per SM)
        block_n, stages = 32, 3
    return PrefillSpec(head_dim, dtype, bool(causal), bool(paged), num_mma_q, block_n, stages,
                       variant=variant, dtype_kv="" if dtype_kv == dtype else dtype_kv,
                       head_dim_vo=0 if head_dim_vo in (None, head_dim) else int(head_dim_vo))


def shipped_specs() -> list[PrefillSpec]:
    """Every 16-bit case, and for fp8 K/V what serving runs: head_dim 128, paged (both tile heights),
    causal or not, no custom mask, fp16 / bf16 q, e4m3 / e5m2 (16 specs; others compile on first use)."""
    return [make_spec(d, t, c, m, p, small_q=s) for d in HEAD_DIMS for t in DTYPES for c in (False, True)
            for m in (False, True) for p in (False, True) for s in (False, True)
            if not s or (p and not m and d in (64, 128))] + \
        [make_spec(128, t, c, False, True, small_q=s, dtype_kv=kv) for t in DTYPES for kv in KV_FP8
         for c in (False, True) for s in (False, True)]


def select_backend(backend: str, fn: str) -> str:
    """Checks the name; the backend as far as it is known before a call: "fa2" for "auto" (a GPU
    call may resolve it to "fa3": ``resolve_backend``)."""
    if backend not in BACKENDS:
        raise ValueError(f"{fn}: backend must be one of {BACKENDS}, got {backend!r}")
    return "fa2" if backend == "auto" else backend


# ---------------------------------------------------------------------------- backend "fa3" (sm_90a)
# "auto" picks fa3 wherever it has a kernel: faster than fa2 in every measured case, causal or not
# (1.5-2.1x; benchmarks/results/prefill_sm90_notes.md); every other case, and every other arch, runs fa2.
# That holds for paged batches whose requests fill half of its 128-row tile too (H100, block-sparse
# 16k x 16k, 32 heads, 64 x 64 blocks: fa3 1705 / 7424 us at 10% / 50% density against fa2's 64-row
# tiles 2132 / 9141: benchmarks/results/sparse_H100_2026-11-25.json); fa2 runs its 64-row tiles where
# it runs such a batch (sm_80, page sizes fa3 cannot box).


def resolve_backend(backend: str, fn: str, *, arch: str | None, head_dim: int, dtype: str | None,
                    custom_mask: bool, paged: bool, rope: bool = False, page_size: int | None = None,
                    dtype_kv: str | None = None, head_dim_vo: int | None = None) -> str:
    """"fa2" or "fa3" for one call. backend="fa3" where fa3 has no kernel raises UnsupportedError naming
    the case; ``arch`` None checks everything but the device. ``dtype_kv``: the KV short name when it is
    not q's (fa3 reads 16-bit K/V of q's type or fp8); ``head_dim_vo``: V's head_dim (None: head_dim)."""
    if backend == "fa2":
        return "fa2"
    reason = prefill_sm90.unsupported_reason(arch, head_dim, dtype, custom_mask, paged, rope, page_size, dtype_kv,
                                             head_dim_vo)
    if backend == "fa3":
        if reason is not None:
            raise UnsupportedError(f"{fn}: backend='fa3': {reason}; use backend='fa2' or 'auto'")
        return "fa3"
    return "fa3" if reason is None and arch is not None else "fa2"
