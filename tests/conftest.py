import functools
import os
import pickle
from pathlib import Path

import pytest

from cuattn import arrays


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", help="also run tests marked slow")


@functools.cache
def gpu_cc() -> int:
    """Compute capability of GPU 0 as an int (90 for H100), or 0 without a usable GPU."""
    if not arrays.gpu_available():
        return 0
    return int(arrays.cupy_module().cuda.Device(0).compute_capability)


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="no CUDA GPU (cupy sees none)")
    skip_slow = pytest.mark.skip(reason="slow; pass --runslow")
    for item in items:
        if "gpu" in item.keywords and not gpu_cc():
            item.add_marker(skip_gpu)
        if "slow" in item.keywords and not config.getoption("--runslow"):
            item.add_marker(skip_slow)


def requires_sm(cc: int):
    return pytest.mark.skipif(gpu_cc() < cc, reason=f"needs compute capability >= {cc / 10:.1f}")


@pytest.fixture
def announce(capsys, request):
    """say(msg): a line on the terminal now, past pytest's capture, for a test that compiles for
    a minute or more (so the suite does not sit silent)."""
    def say(msg: str) -> None:
        with capsys.disabled():
            print(f"\n  [{request.node.name}] {msg}", flush=True)
    return say


@pytest.fixture
def tmp_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("CUATTN_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


JOURNAL = Path(__file__).with_name("gpu_specs.pickle")


def _journal_specs(arch: str) -> list:
    """The specs a previous GPU test session compiled on first use (tests/gpu_specs.pickle; one
    pickled (spec, arch) per entry): an entry that no longer unpickles (the spec class changed) is
    skipped; one that names a spec the code no longer uses only costs a compile."""
    try:
        entries = pickle.loads(JOURNAL.read_bytes())
    except (OSError, pickle.UnpicklingError, EOFError):
        return []
    specs = []
    for blob in entries:
        try:
            spec, spec_arch = pickle.loads(blob)
        except Exception:      # noqa: BLE001 - a stale entry (renamed class or field): skip it
            continue
        if spec_arch == arch:
            specs.append(spec)
    return specs


def _write_journal(path: str, shipped: list) -> None:
    from cuattn import jit
    seen = {(s.name, a) for s, a in shipped}
    entries = []
    for spec, arch in jit.specs_requested():
        if (spec.name, arch) in seen:
            continue
        seen.add((spec.name, arch))
        try:
            entries.append(pickle.dumps((spec, arch)))
        except Exception:      # noqa: BLE001 - a user variant with NumPy lambdas does not pickle
            continue
    Path(path).write_bytes(pickle.dumps(entries))


@pytest.fixture(autouse=True, scope="session")
def _shared_cache_dir(tmp_path_factory):
    """Tests share one cache dir of their own unless CUATTN_CACHE_DIR is set. On a GPU machine the
    shipped kernels for its arch, and the specs the GPU tests compiled on first use last time
    (tests/gpu_specs.pickle), are compiled first, in parallel over the cores (a fresh machine would
    otherwise compile them one by one as tests reach them). CUATTN_WRITE_SPEC_JOURNAL=path writes
    this session's first-use specs there (copy it over tests/gpu_specs.pickle to refresh it)."""
    if "CUATTN_CACHE_DIR" not in os.environ:
        os.environ["CUATTN_CACHE_DIR"] = str(tmp_path_factory.mktemp("cuattn-cache"))
    shipped = []
    if gpu_cc():
        from cuattn import cli, jit
        arch = jit.device_arch(0)
        shipped = [(spec, arch) for spec in cli.shipped_specs(arch)]
        jit.precompile(shipped + [(spec, arch) for spec in _journal_specs(arch)])
    yield
    if gpu_cc() and os.environ.get("CUATTN_WRITE_SPEC_JOURNAL"):
        _write_journal(os.environ["CUATTN_WRITE_SPEC_JOURNAL"], shipped)
