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
        for file, line_no in sorted(set(re.findall(r'^(.*?)\((\d+)\): (?:error|warning)', self.log, re.M)))[:5]:
            # a variant hook's lines are numbered from its own #line directive (variants.py)
            start = lines.index(f'#line 1 "{file}"') + 1 if f'#line 1 "{file}"' in lines else 0
            at = start + int(line_no)
            if 1 <= at <= len(lines):
                shown.append(f"  {file if start else ''}{'(' + line_no + ')' if start else f'{int(line_no):5d}'} | "
                             f"{lines[at - 1]}")
        context = ("\nsource:\n" + "\n".join(shown)) if shown else ""
        return (f"NVRTC failed to compile {self.spec_name}\noptions: {' '.join(self.options)}\n"
                f"log:\n{self.log.strip()}{context}\n(CompileError.dump() writes the numbered source)")

    def dump(self, file=None) -> None:
        """Write the assembled source with line numbers (the numbers the NVRTC log uses)."""
        file = file or sys.stderr
        for i, line in enumerate(self.source.splitlines(), 1):
            print(f"{i:5d} | {line}", file=file)
