"""The Hopper MLA kernel (backend "fa3" of ``BatchMLAPagedAttentionWrapper``): ``kernels_cu/mla_sm90.cu``
(wgmma, mbarriers, warp specialisation; sm_90a only).

``mla.py`` plans and launches it: the kernel takes mla.cu's parameter list (``mla.PARAMS``, under the entry
``cuattn_mla_sm90``) and the same work list, page table and split-KV partial layout (64 packed rows a
tile), so the plan and mla.cu's merge kernel serve both kernels; only the spec, the key tile (64 keys
instead of 32, which sets the split granularity) and the launch geometry differ.

Two schedules of one source (the header of mla_sm90.cu; ``pick_schedule`` chooses per plan):
- halves (``seesaw=False``): consumer A computes S and P for every tile and shares P with consumer B; each key
  stage fills and frees as two halves with their own mbarriers, so a stage's refill overlaps the products
  instead of following them (a version that filled and freed a stage whole was removed: H100, 64 x 16k, 128
  heads 853 -> 691 us, 16 heads 84 -> 92% of the read ceiling; benchmarks/results/mla_H100_2026-11-25_session11_v1_v2.log);
- seesaw (FlashMLA's schedule): tiles in pairs, each warpgroup computes S of one tile of the pair and both
  P V halves of its output columns, the running max handed over through shared memory: the tensor work split
  evenly between the consumers (H100, 128 heads: 1.05-1.11x at 4k-16k keys a request).

Cases with a kernel: device sm_90, q and the latent caches float16 or bfloat16 of one dtype (no fp8
cache), any page size (the producer warpgroup gathers rows through the page table with cp.async),
causal or not, any number of heads and query tokens. ``unsupported_reason`` names the first limit a call
hits: backend "fa3" raises UnsupportedError with it, "auto" runs mla.cu.
"""
from __future__ import annotations

from dataclasses import dataclass

from .errors import UnsupportedError

ARCH = "sm_90a"
ENTRY = "cuattn_mla_sm90"
BLOCK_M, BLOCK_N, THREADS = 64, 64, 384      # packed query rows, keys per tile, 3 warpgroups
_D_QK = 512 + 64


@dataclass(frozen=True)
class Sm90MLASpec:
    dtype: str              # "f16" | "bf16": q, ckv / kpe caches and out
    seesaw: bool = False    # FlashMLA's seesaw schedule (both warpgroups compute S, of alternate tiles)
    source = "mla_sm90.cu"
    entry = ENTRY
    threads = THREADS
    block_n = BLOCK_N
    backend = "fa3"
    archs = (ARCH,)         # built for sm_90a alone (cli.shipped_specs(arch))

    @property
    def name(self) -> str:   # "mla_sm90_ckv512_kpe64_qf16_bm64_bn64_v2" (_v2: the name it had beside version 1)
        return f"mla_sm90_ckv512_kpe64_q{self.dtype}_bm{BLOCK_M}_bn{BLOCK_N}_" + ("seesaw" if self.seesaw else "v2")

    def defines(self) -> tuple[str, ...]:
        return (f"-DDTYPE=cuattn::{self.dtype}", f"-DSEESAW={int(self.seesaw)}")

    @property
    def smem_bytes(self) -> int:
        """mla_sm90.cu SMEM_BYTES + 1024 of alignment slack: Q, 2 key tiles (64 x 576 16-bit each), then the halves
        schedule's P (64 x 64 16-bit) and two rows of 64 floats, or the seesaw's five rows of 64 floats (its P
        lives in the key tiles), and 10 mbarriers."""
        tile = BLOCK_M * _D_QK * 2
        if self.seesaw:
            return 1024 + 3 * tile + 5 * 256 + 10 * 8
        return 1024 + 3 * tile + BLOCK_M * BLOCK_N * 2 + 2 * 256 + 10 * 8


def shipped_specs() -> list[Sm90MLASpec]:
    """Compiled for sm_90a only (``cuattn precompile`` on an sm_90 device, CPU tests)."""
    return [Sm90MLASpec(d, seesaw) for d in ("f16", "bf16") for seesaw in (False, True)]


# The seesaw schedule runs where every query tile is full (decode at >= 64 heads: compute bound) and work items
# stream at least this many keys on average. H100, bf16, page 64, 128 heads (benchmarks/results/mla_notes.md,
# session 26, both schedules with the staged epilogue): seesaw's speed over the halves schedule's at batch 64
# x 2k / 4k / 8k / 16k / 32k keys 0.95 / 0.98 / 1.00 / 1.02 / 1.02x, 128 x 8k 1.01x, 16 x 16k in pieces of 4k 0.99x
# (both warpgroups wait for their own first tile: a longer start, then a shorter time a tile); 16 heads (16
# rows of a 64-row tile) 0.98-1.01x (session 25).
SEESAW_MIN_KEYS = 8192


def schedule_specs(dtype: str) -> tuple[Sm90MLASpec, Sm90MLASpec]:
    """The two schedules' specs of a dtype: (halves, seesaw); ``pick_schedule`` chooses per plan."""
    return Sm90MLASpec(dtype), Sm90MLASpec(dtype, True)


def pick_schedule(specs: tuple[Sm90MLASpec, Sm90MLASpec], rows_per_tile: float, keys_per_item: float) -> Sm90MLASpec:
    """Seesaw where the plan's query tiles hold BLOCK_M packed rows on average (all full) and its work items
    ``keys_per_item`` >= SEESAW_MIN_KEYS on average; the halves schedule otherwise."""
    return specs[1] if rows_per_tile >= BLOCK_M and keys_per_item >= SEESAW_MIN_KEYS else specs[0]


def unsupported_reason(arch: str | None, q_dtype: str | None, kv_dtype: str | None) -> str | None:
    """Why backend "fa3" has no MLA kernel for a case (None: it has one). ``arch`` None: not checked.
    Dtypes are short names ("f16", "bf16", "e4m3", ...; None: another dtype)."""
    if arch is not None and arch != ARCH:
        return f"the fa3 MLA kernel needs an sm_90 GPU (wgmma); this device compiles for {arch}"
    if q_dtype not in ("f16", "bf16"):
        return f"the fa3 MLA kernel takes float16 / bfloat16 queries, got q_data_type {q_dtype}"
    if kv_dtype != q_dtype:
        return (f"the fa3 MLA kernel reads a latent cache of the queries' dtype ({q_dtype}), got kv_data_type "
                f"{kv_dtype} (no fp8 cache)")
    return None


def resolve_backend(backend: str, fn: str, arch: str | None, q_dtype: str | None, kv_dtype: str | None) -> str:
    """"fa2" (mla.cu) or "fa3" (mla_sm90.cu) for a GPU plan: "fa2" as asked; "fa3" where it has a kernel,
    else UnsupportedError naming the case; "auto": "fa3" where it has a kernel, else "fa2"."""
    if backend == "fa2":
        return "fa2"
    reason = unsupported_reason(arch, q_dtype, kv_dtype)
    if reason is None:
        return "fa3"
    if backend == "fa3":
        raise UnsupportedError(f"{fn}: backend='fa3': {reason}; use backend='fa2' or 'auto'")
    return "fa2"


def check_cache_strides(ckv, kpe, fn: str) -> None:
    """The kernel addresses a cache row as two 32 x 32 -> 64-bit multiply-adds (page, slot): byte strides of a
    page and a token must be in [0, 4 GiB) (UnsupportedError naming them otherwise)."""
    for name, t in (("ckv_cache", ckv), ("kpe_cache", kpe)):
        (sp, st), size = t.strides[:2], t.dtype.itemsize      # (plain comparisons: this runs in every run())
        if sp < 0 or st < 0 or sp * size >= 2 ** 32 or st * size >= 2 ** 32:
            raise UnsupportedError(f"{fn}: backend 'fa3' takes {name} page and token strides in [0, 4 GiB); got "
                                   f"{tuple(int(s) * t.dtype.itemsize for s in t.strides[:2])} bytes")
