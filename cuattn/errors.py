"""Exceptions raised by cuattn. Input mistakes raise the built-in ValueError/TypeError."""
from __future__ import annotations

import re
import sys


class CuattnError(Exception):
    """Base class of cuattn's own errors."""


class UnsupportedError(CuattnError, NotImplementedError):
    """A valid request that no shipped kernel implements; the message names the limit."""


class DeviceUnavailableError(CuattnError, RuntimeError):
    """A GPU call was made where no usable GPU or CUDA library is present."""


class CacheFullError(CuattnError, MemoryError):
    """PagedKVCache has too few free pages for a request; the cache is left unchanged."""


class CompileError(CuattnError):
    """NVRTC rejected a kernel. Carries the spec name, options, log and assembled source."""

    def __init__(self, spec_name: str, options: tuple[str, ...], log: str, source: str):
        self.spec_name = spec_name
        self.options = tuple(options)
        self.log = log
        self.source = source
        super().__init__(self._message())

    def _message(self) -> str:
        lines = self.source.splitlines()
        shown = []
        for line_no in sorted({int(m) for m in re.findall(r"\((\d+)\): (?:error|warning)", self.log)})[:5]:
            if 1 <= line_no <= len(lines):
                shown.append(f"  {line_no:5d} | {lines[line_no - 1]}")
        context = ("\nsource:\n" + "\n".join(shown)) if shown else ""
        return (f"NVRTC failed to compile {self.spec_name}\noptions: {' '.join(self.options)}\n"
                f"log:\n{self.log.strip()}{context}\n(CompileError.dump() writes the numbered source)")

    def dump(self, file=None) -> None:
        """Write the assembled source with line numbers (the numbers the NVRTC log uses)."""
        file = file or sys.stderr
        for i, line in enumerate(self.source.splitlines(), 1):
            print(f"{i:5d} | {line}", file=file)


def reject_unimplemented_variants(fn: str, pos_encoding_mode="NONE", window_left=-1, logits_soft_cap=None,
                                  use_fp16_qk_reduction=False, rope_scale=None, rope_theta=None) -> None:
    """Raise UnsupportedError for FlashInfer attention options that have no cuattn kernel yet."""
    if pos_encoding_mode not in ("NONE", None):
        raise UnsupportedError(f"{fn}: pos_encoding_mode={pos_encoding_mode!r} has no kernel; supported: 'NONE' "
                               f"(apply RoPE before the call)")
    if window_left not in (-1, None):
        raise UnsupportedError(f"{fn}: window_left={window_left} (sliding window) has no kernel; supported: -1")
    if logits_soft_cap not in (None, 0, 0.0):
        raise UnsupportedError(f"{fn}: logits_soft_cap={logits_soft_cap} has no kernel; supported: None")
    if use_fp16_qk_reduction:
        raise UnsupportedError(f"{fn}: use_fp16_qk_reduction=True has no kernel (QK accumulates in fp32)")
    if rope_scale is not None or rope_theta is not None:
        raise UnsupportedError(f"{fn}: rope_scale/rope_theta need pos_encoding_mode, which has no kernel")
