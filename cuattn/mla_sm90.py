"""The Hopper MLA kernel (backend "fa3" of ``BatchMLAPagedAttentionWrapper``): ``kernels_cu/mla_sm90.cu``
(wgmma, mbarriers, warp specialisation; sm_90a only).

``mla.py`` plans and launches it: the kernel takes mla.cu's parameter list (``mla.PARAMS``, under the entry
``cuattn_mla_sm90``) and the same work list, page table and split-KV partial layout (64 packed rows a
tile), so the plan and mla.cu's merge kernel serve both kernels; only the spec, the key tile (64 keys
instead of 32, which sets the split granularity) and the launch geometry differ.

Versions (``Sm90MLASpec.version``, the kernel's VERSION; the header of mla_sm90.cu describes both): 1 fills
and frees a key stage whole; 2 as two halves with their own mbarriers, so a stage's refill overlaps the
products instead of following them. ``spec_for`` gives plan() the spec of ``DEFAULT_VERSION``.

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


VERSIONS = (1, 2)
DEFAULT_VERSION = 2      # the version plan() runs (spec_for; H100, 64 x 16k: 128 heads 853 -> 691 us, 16 heads 84 -> 92% of
# the read ceiling; 16 heads x 4096: 4% slower; mla_H100_2026-11-25_session11_v1_v2.log); bench_mla.py --sm90-version and the tests set it


@dataclass(frozen=True)
class Sm90MLASpec:
    dtype: str              # "f16" | "bf16": q, ckv / kpe caches and out
    version: int = 1        # mla_sm90.cu VERSION: 1 a key stage fills / frees whole; 2 as two halves (earlier refills)
    source = "mla_sm90.cu"
    entry = ENTRY
    threads = THREADS
    block_n = BLOCK_N
    backend = "fa3"
    archs = (ARCH,)         # built for sm_90a alone (cli.shipped_specs(arch))

    @property
    def name(self) -> str:   # "mla_sm90_ckv512_kpe64_qf16_bm64_bn64", version 2: "..._bn64_v2"
        v = f"_v{self.version}" if self.version != 1 else ""
        return f"mla_sm90_ckv512_kpe64_q{self.dtype}_bm{BLOCK_M}_bn{BLOCK_N}{v}"

    def defines(self) -> tuple[str, ...]:
        return (f"-DDTYPE=cuattn::{self.dtype}", f"-DVERSION={self.version}")

    @property
    def smem_bytes(self) -> int:
        """mla_sm90.cu SMEM_BYTES + 1024 of alignment slack: Q, 2 key tiles (64 x 576 16-bit each), P
        (64 x 64 16-bit), two rows of 64 floats, 6 mbarriers (version 2: 10)."""
        tile = BLOCK_M * _D_QK * 2
        return 1024 + 3 * tile + BLOCK_M * BLOCK_N * 2 + 2 * 256 + (10 if self.version >= 2 else 6) * 8


def spec_for(dtype: str) -> Sm90MLASpec:
    """The spec a GPU plan() with backend "fa3" runs: version ``DEFAULT_VERSION``."""
    if DEFAULT_VERSION not in VERSIONS:
        raise ValueError(f"mla_sm90.DEFAULT_VERSION must be one of {VERSIONS}, got {DEFAULT_VERSION!r}")
    return Sm90MLASpec(dtype, DEFAULT_VERSION)


def shipped_specs() -> list[Sm90MLASpec]:
    """Compiled for sm_90a only (``cuattn precompile`` on an sm_90 device, CPU tests)."""
    return [Sm90MLASpec(d, v) for v in VERSIONS for d in ("f16", "bf16")]


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
