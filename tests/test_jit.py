import subprocess
import sys
import textwrap
from dataclasses import dataclass

import pytest

from cuattn import jit
from cuattn.errors import CompileError
from cuattn.page import PageSpec


@dataclass(frozen=True)
class BrokenSpec:
    source = "page.cu"

    @property
    def name(self):
        return "page_broken"

    def defines(self):
        return ("-DVEC_BYTES=16", "-Dpositions=)")


def test_page_kernels_compile_for_shipped_archs_without_spills():
    for arch in jit.SHIPPED_ARCHS:
        for spec in [PageSpec(v) for v in (16, 8, 4, 2, 1)]:
            compiled = jit.compile_kernel(spec, arch)
            assert compiled.cubin[:4] == b"\x7fELF"
            for entry in ("cuattn_page_append", "cuattn_batch_indices_positions"):
                res = compiled.resources[entry]
                assert res["spill_stores"] == res["spill_loads"] == res["stack_frame"] == 0, (spec, arch, res)
                assert res["registers"] > 0


def test_assembled_source_inlines_headers_once():
    src = jit.assemble_source("page.cu")
    assert '#include "common/' not in src
    assert src.count("struct f16") == 1


def test_second_build_hits_disk_cache(tmp_cache_dir):
    first = jit.compile_kernel(PageSpec(8), "sm_80")
    assert not first.from_cache
    jit._memo.clear()
    second = jit.compile_kernel(PageSpec(8), "sm_80")
    assert second.from_cache and second.cubin == first.cubin
    assert second.resources == first.resources
    assert jit.cache_usage()[0] == 1


def test_corrupt_cache_entry_is_recompiled(tmp_cache_dir):
    first = jit.compile_kernel(PageSpec(4), "sm_80")
    (entry,) = list(tmp_cache_dir.glob("*.cubin"))
    data = bytearray(entry.read_bytes())
    data[-10] ^= 0xFF
    entry.write_bytes(bytes(data))
    jit._memo.clear()
    again = jit.compile_kernel(PageSpec(4), "sm_80")
    assert not again.from_cache and again.cubin == first.cubin
    jit._memo.clear()
    assert jit.compile_kernel(PageSpec(4), "sm_80").from_cache   # repaired on disk


def test_cache_key_covers_arch_and_defines():
    keys = {jit.cache_key(PageSpec(v), a) for v in (4, 16) for a in ("sm_80", "sm_90a")}
    assert len(keys) == 4


def test_two_processes_compiling_one_key_both_succeed(tmp_cache_dir):
    script = textwrap.dedent("""
        import sys
        from cuattn import jit
        from cuattn.page import PageSpec
        c = jit.compile_kernel(PageSpec(2), "sm_90a")
        sys.stdout.write(str(len(c.cubin)))
    """)
    env = {**__import__("os").environ, "CUATTN_CACHE_DIR": str(tmp_cache_dir)}
    procs = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, env=env) for _ in range(2)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert outs[0] == outs[1] and int(outs[0]) > 0
    assert len(list(tmp_cache_dir.glob("*.cubin"))) == 1


def test_compile_error_carries_name_options_and_numbered_log(tmp_cache_dir, capsys):
    with pytest.raises(CompileError) as info:
        jit.compile_kernel(BrokenSpec(), "sm_80")
    err = info.value
    assert err.spec_name == "page_broken"
    assert "-Dpositions=)" in err.options
    assert "error" in err.log
    assert "page_broken" in str(err) and "|" in str(err)   # offending source lines quoted
    err.dump()
    assert "    1 | " in capsys.readouterr().err


def test_parse_ptxas_log_reads_registers_and_spills():
    log = ("ptxas info    : Compiling entry function 'k' for 'sm_80'\n"
           "ptxas info    : Function properties for k\n"
           "ptxas         .     8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads\n"
           "ptxas info    : Used 255 registers, used 1 barriers, 400 bytes cmem[0]\n")
    assert jit.parse_ptxas_log(log) == {"k": {"stack_frame": 8, "spill_stores": 4, "spill_loads": 4,
                                              "registers": 255}}
