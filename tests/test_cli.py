import subprocess
import sys

import pytest

from cuattn import cli, jit


def run_cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "cuattn.cli", *args], capture_output=True, text=True,
                          env=env, timeout=600)


def test_info_reports_versions_gpu_and_cache():
    out = run_cli("info")
    assert out.returncode == 0, out.stderr
    for word in ("cuattn", "cupy", "nvrtc", "gpu", "cache"):
        assert word in out.stdout


def test_every_shipped_kernel_compiles_for_sm80_and_sm90a_without_spills(announce):
    jobs = [(spec, arch) for arch in jit.SHIPPED_ARCHS for spec in cli.shipped_specs(arch)]
    announce(f"compiling {len(jobs)} kernels for {' and '.join(jit.SHIPPED_ARCHS)} with NVRTC over the cores "
             f"(about a minute on 2 cores; later tests load them from the cache)")
    jit.precompile(jobs)          # in parallel over the cores into the session's cache; then checked
    for arch in jit.SHIPPED_ARCHS:
        for spec in cli.shipped_specs(arch):
            compiled = jit.compile_kernel(spec, arch)
            for entry, res in compiled.resources.items():
                allowed = getattr(spec, "spill_bytes", 0)     # (one fa3 spec: prefill_sm90.Sm90PrefillSpec.spill_bytes)
                assert max(res.get("spill_stores", 0), res.get("spill_loads", 0)) <= allowed, (spec.name, arch, entry, res)


def test_precompile_then_cache_clear(tmp_cache_dir, announce):
    import os
    announce("cuattn precompile --arch sm_80 into an empty cache (a minute or so on 2 cores)")
    env = {**os.environ, "CUATTN_CACHE_DIR": str(tmp_cache_dir)}
    out = run_cli("precompile", "--arch", "sm_80", env=env)
    assert out.returncode == 0, out.stderr
    n = len(cli.shipped_specs("sm_80"))
    assert f"precompiled {n} kernels for sm_80" in out.stdout
    assert len(list(tmp_cache_dir.glob("*.cubin"))) == n
    assert "\r" not in out.stderr          # no progress bar into a pipe
    out = run_cli("cache", "clear", env=env)
    assert out.returncode == 0 and not list(tmp_cache_dir.glob("*.cubin"))


@pytest.mark.parametrize("arch", ["sm_75", "foo", "sm_"])
def test_precompile_rejects_unsupported_arch_with_exit_code_2(arch, tmp_cache_dir):
    import os
    out = run_cli("precompile", "--arch", arch, env={**os.environ, "CUATTN_CACHE_DIR": str(tmp_cache_dir)})
    assert out.returncode == 2
    assert "not a supported arch" in out.stderr and "sm_80" in out.stderr and "Traceback" not in out.stderr
    assert not list(tmp_cache_dir.glob("*.cubin"))


def test_demo_runs_on_the_cpu_path_and_says_so():
    out = run_cli("demo", "--cpu")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "CPU (NumPy reference path)" in out.stdout and "demo OK" in out.stdout


@pytest.mark.gpu
def test_demo_and_precompile_on_the_gpu(shipped_kernels_compiled):
    # the session's cache, once conftest has compiled every shipped kernel for this GPU's arch into it: the
    # command finds each one a fresh process asks for there, and compiles none again (NVRTC compiling them
    # for sm_90a / sm_80 is the CPU suite's test_every_shipped_kernel_compiles_...; into an empty cache, with
    # --arch, test_precompile_then_cache_clear)
    arch = jit.device_arch(0)
    out = run_cli("demo")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "running on the GPU" in out.stdout and "demo OK" in out.stdout
    out = run_cli("precompile")
    assert out.returncode == 0, out.stderr
    n = len(cli.shipped_specs(arch))
    assert f"precompiled {n} kernels for {arch} (0 compiled, {n} from cache)" in out.stdout, out.stdout


def test_missing_cupy_says_what_to_install_for_a_checkout():
    code = ("import sys; sys.modules['cupy'] = None\n"
            "from cuattn import arrays\n"
            "try:\n    arrays.cupy_module()\nexcept Exception as e:\n    print(type(e).__name__, e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "DeviceUnavailableError" in out.stdout
    assert 'pip install -e "' in out.stdout and '[cu12]"' in out.stdout, out.stdout   # this is a checkout
