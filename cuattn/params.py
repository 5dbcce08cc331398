"""Kernel parameter lists by name: one definition per kernel entry, mirrored by that entry's C
signature in ``kernels_cu/``. The launcher's argument kinds (jit.Launcher: p pointer, i int32,
q int64, f float32, t a 128-byte tensor map) and the order of the values come from it, so adding a
kernel parameter is one line here and one in the C signature; tests/test_params.py parses every
entry's signature and checks names and kinds against these definitions.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Params:
    entry: str                 # the kernel's extern "C" name
    names: tuple
    kinds: str                 # one launcher letter per parameter

    @classmethod
    def define(cls, entry: str, spec: str) -> "Params":
        """``spec``: whitespace-separated ``name:kind`` items in the C signature's order."""
        items = [item.split(":") for item in spec.split()]
        bad = [i for i in items if len(i) != 2 or i[1] not in "pqift" or len(i[1]) != 1]
        if bad:
            raise ValueError(f"Params.define({entry}): items must be name:kind with kind in p q i f t, got {bad}")
        return cls(entry, tuple(n for n, _ in items), "".join(k for _, k in items))

    def pack(self, **values) -> tuple:
        """The values in signature order; every parameter named once (a missing or unknown name is a
        programming error: KeyError naming it)."""
        try:
            out = tuple([values[n] for n in self.names])
        except KeyError as e:
            raise KeyError(f"{self.entry}: parameter {e.args[0]} not given") from None
        if len(values) != len(out):      # (every name found: more values than names means unknown ones)
            raise KeyError(f"{self.entry}: unknown parameter(s) {sorted(set(values) - set(self.names))}")
        return out

    def group(self, first: str, last: str, **values) -> tuple:
        """The values of the contiguous parameters ``first`` .. ``last`` (a run()'s prebuilt groups)."""
        i, j = self.names.index(first), self.names.index(last) + 1
        sub = Params(self.entry, self.names[i:j], self.kinds[i:j])
        return sub.pack(**values)

    def kinds_of(self, first: str, last: str) -> str:
        return self.kinds[self.names.index(first):self.names.index(last) + 1]
