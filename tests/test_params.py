"""Each kernel's parameter definition (cuattn/params.py users) matches its C signature in kernels_cu/:
the same names in the same order, and launcher kinds that fit the C types."""
import re

import pytest

from cuattn import decode, jit, prefill, prefill_sm90, qcast


def c_signature(source: str, entry: str, flags: dict) -> list[tuple[str, str]]:
    """(name, kind) of each parameter of ``entry`` in ``source``, ``#if FLAG`` blocks kept per ``flags``."""
    text = jit.assemble_source(source)
    start = re.search(rf"\b{entry}\(", text).end()
    body = text[start:text.index(") {", start)]
    kept, keep = [], [True]
    for line in body.splitlines():
        m = re.match(r"\s*#\s*if\s+(\w+)", line)
        if m:
            keep.append(keep[-1] and bool(flags[m.group(1)]))
            continue
        if re.match(r"\s*#\s*endif", line):
            keep.pop()
            continue
        if keep[-1]:
            kept.append(line.split("//")[0])
    decls = [d.strip() for d in " ".join(kept).replace("CUATTN_VARIANT_ARGS", "").split(",") if d.strip()]
    out = []
    for d in decls:
        name = re.findall(r"\w+", d)[-1]
        kind = ("t" if "TmaDesc" in d else "p" if "*" in d else "q" if "int64_t" in d else "f" if "float" in d
                else "i" if re.search(r"\bint\b", d) else "?")
        out.append((name, kind))
    return out


CASES = [
    ("decode.cu", decode.PARAMS[False], {"TMA": 0}),
    ("decode.cu", decode.PARAMS[True], {"TMA": 1}),
    ("decode.cu", decode.MERGE_PARAMS, {}),
    ("prefill.cu", prefill.PARAMS, {}),
    ("prefill_sm90.cu", prefill_sm90.PARAMS, {}),
    ("qcast.cu", qcast.PARAMS["cuattn_cast_to_16"], {}),
    ("qcast.cu", qcast.PARAMS["cuattn_cast_to_f32"], {}),
]


@pytest.mark.parametrize("source,params,flags", CASES, ids=[f"{c[1].entry}-{c[2]}" for c in CASES])
def test_kernel_parameter_definition_matches_the_c_signature(source, params, flags):
    assert c_signature(source, params.entry, flags) == list(zip(params.names, params.kinds))


def test_pack_names_every_parameter():
    with pytest.raises(KeyError, match="not given"):
        prefill_sm90.PARAMS.pack(q=1)
    with pytest.raises(KeyError, match="unknown parameter"):
        decode.MERGE_PARAMS.pack(**dict.fromkeys(decode.MERGE_PARAMS.names, 0), extra=1)
