import functools
import os
import pickle
import subprocess
import sys
import threading
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


def memcheck(script: str) -> str:
    """Runs tests/<script> under compute-sanitizer memcheck (skips the test where the tool is missing); asserts the
    script exited 0 with no error in memcheck's summary, and returns its stdout."""
    import shutil
    tool = shutil.which("compute-sanitizer") or next(
        (p for p in ("/usr/local/cuda/bin/compute-sanitizer",) if os.path.exists(p)), None)
    if tool is None:
        pytest.skip("compute-sanitizer is not installed")
    r = subprocess.run([tool, "--tool", "memcheck", "--error-exitcode", "3", sys.executable,
                        str(Path(__file__).with_name(script))], capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "ERROR SUMMARY: 0 errors" in r.stdout + r.stderr
    return r.stdout


@pytest.fixture
def pages_in_kernel(monkeypatch):
    """Paged fa3 prefill reading the pages in the kernel (prefill_ahead's gathering of the rows ahead off)."""
    from cuattn import prefill_ahead
    monkeypatch.setattr(prefill_ahead, "MIN_SHARING", {k: float("inf") for k in prefill_ahead.MIN_SHARING})


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


class _Precompile(threading.Thread):
    """``jit.precompile`` of the session's jobs on a thread, so the tests run while its pool compiles
    (they waited 20-26 s for it before the first test on the H100 hosts of session 19). A test that
    reaches a spec first compiles it itself, or waits on the per-key lock of the worker compiling it
    (jit.compile_kernel), and the worker that gets to it later reads it from the cache: nothing is
    compiled twice. One core is left to the tests; with one worker or none it runs before the tests, as
    it did. ``wait(n)``: the first n jobs are in the cache; ``close()``: all of them (the session ends
    with every job compiled, as before), raising a compile error."""

    def __init__(self, jobs, workers: int | None = None, background: bool = True):
        super().__init__(name="cuattn-precompile", daemon=True)
        self.jobs, self.done, self.error = jobs, 0, None
        self.workers = workers or max(1, (os.cpu_count() or 1) - (1 if background else 0))
        self._progress = threading.Condition()
        if self.workers > 1 and background:
            self.start()
        else:
            self.run()

    def run(self):
        from cuattn import jit

        def progress(i, total, spec, arch):        # called in job order: the first i are compiled
            with self._progress:
                self.done = i
                self._progress.notify_all()
        try:
            jit.precompile(self.jobs, self.workers, progress)
        except BaseException as e:      # noqa: BLE001 - raised in the session by wait() / close()
            self.error = e
        finally:
            with self._progress:
                self.done = len(self.jobs)
                self._progress.notify_all()

    def wait(self, n: int | None = None, raise_error: bool = True) -> None:
        with self._progress:
            self._progress.wait_for(lambda: self.done >= (len(self.jobs) if n is None else n))
        if self.error is not None and raise_error:
            raise self.error

    def close(self) -> None:
        self.wait()
        if self.ident is not None:
            self.join()


_precompile: _Precompile | None = None
# CUATTN_TEST_SERIAL=1: the session's setup as before a6cb89a (the precompile on every core before the first test,
# each GPU example script run by its own test), for timing the suite both ways on one machine
SERIAL = os.environ.get("CUATTN_TEST_SERIAL") == "1"


@pytest.fixture
def shipped_kernels_compiled():
    """Waits until every shipped kernel for this GPU's arch is in the session's cache (on a GPU machine
    the session compiles them in the background, first of its jobs)."""
    if _precompile is not None:
        from cuattn import cli, jit
        _precompile.wait(len(cli.shipped_specs(jit.device_arch(0))))


@pytest.fixture(autouse=True, scope="session")
def _shared_cache_dir(tmp_path_factory):
    """Tests share one cache dir of their own unless CUATTN_CACHE_DIR is set. On a GPU machine the
    shipped kernels for its arch, and the specs the GPU tests compiled on first use last time
    (tests/gpu_specs.pickle), are compiled in parallel over the cores while the tests run (a fresh machine
    would otherwise compile them one by one as tests reach them): _Precompile. CUATTN_WRITE_SPEC_JOURNAL=path
    writes this session's first-use specs there (copy it over tests/gpu_specs.pickle to refresh it)."""
    global _precompile
    if "CUATTN_CACHE_DIR" not in os.environ:
        os.environ["CUATTN_CACHE_DIR"] = str(tmp_path_factory.mktemp("cuattn-cache"))
    shipped = []
    if gpu_cc():
        from cuattn import cli, jit
        arch = jit.device_arch(0)
        shipped = [(spec, arch) for spec in cli.shipped_specs(arch)]
        _precompile = _Precompile(shipped + [(spec, arch) for spec in _journal_specs(arch)], background=not SERIAL)
    yield
    if _precompile is not None:
        _precompile, running = None, _precompile
        running.close()
    if gpu_cc() and os.environ.get("CUATTN_WRITE_SPEC_JOURNAL"):
        _write_journal(os.environ["CUATTN_WRITE_SPEC_JOURNAL"], shipped)


# ---------------------------------------------------------------------------- example scripts on the GPU

EXAMPLES_DIR = Path(__file__).resolve().parent.parent / "examples"
GPU_EXAMPLE_TEST = "test_example_runs_on_the_gpu"      # tests/test_examples.py, parametrized by script path
ALONE_ON_THE_GPU = {"jax_interop.py"}     # run by its test, by itself: JAX takes 75% of the GPU's memory


class _Script:
    """An example script started with --gpu, its output going to files (a pipe that nobody reads could
    fill and stall it)."""

    def __init__(self, path: Path, out_dir: Path):
        self.out, self.err = out_dir / f"{path.name}.out", out_dir / f"{path.name}.err"
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.proc = subprocess.Popen([sys.executable, str(path), "--gpu"], stdout=out, stderr=err, text=True,
                                         cwd=EXAMPLES_DIR.parent)

    def finish(self, timeout: float = 600) -> tuple[int, str]:
        """Waits for the script: (exit status, stdout + stderr); killed after ``timeout`` s."""
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        return self.proc.returncode, self.out.read_text() + self.err.read_text()


class _GpuExamples:
    """The example scripts this session checks on the GPU (GPU_EXAMPLE_TEST's selected cases, but
    ALONE_ON_THE_GPU), started side by side in the background once the session's precompile is done
    (its cores free; the scripts then load the shipped kernels from the cache). Each is its own process and
    CUDA context, and most of a script's time is on the CPU (importing torch / transformers, CUDA and CuPy
    start-up): one after another in their tests they took ~38 s on the H100 host
    (benchmarks/results/gpu_tests_H100_2026-11-26_session19.log), which the other tests now hide.
    ``finish(name)``: its test waits for the script and checks it."""

    def __init__(self, names: set, out_dir: Path, after: _Precompile | None):
        self.names, self.out_dir, self.after = names, out_dir, after
        self.scripts: dict[str, _Script] = {}
        self.closed = False
        self._started = threading.Event()
        self._lock = threading.Lock()
        threading.Thread(target=self._start, name="cuattn-gpu-examples", daemon=True).start()

    def _start(self):
        try:
            if self.after is not None:
                self.after.wait(raise_error=False)
            with self._lock:
                for name in sorted(self.names):
                    if not self.closed:
                        self.scripts[name] = _Script(EXAMPLES_DIR / name, self.out_dir)
        finally:
            self._started.set()

    def finish(self, name: str) -> tuple[int, str]:
        self._started.wait()
        return self.scripts[name].finish()

    def finish_all(self) -> None:
        self._started.wait()
        for script in self.scripts.values():
            script.finish()

    def close(self) -> None:
        """Kills the scripts no test waited for (-x, an error) and any not started yet."""
        with self._lock:
            self.closed = True
            for script in self.scripts.values():
                if script.proc.poll() is None:
                    script.proc.kill()
                    script.proc.wait()


@pytest.fixture(autouse=True, scope="session")
def gpu_examples(request, tmp_path_factory, _shared_cache_dir):
    """The session's _GpuExamples (None without a GPU or with none of GPU_EXAMPLE_TEST's cases selected)."""
    names = {item.callspec.params["path"].name for item in request.session.items
             if getattr(item, "originalname", None) == GPU_EXAMPLE_TEST and item.get_closest_marker("skip") is None
             } - ALONE_ON_THE_GPU
    if not (gpu_cc() and names) or SERIAL:
        yield None
        return
    examples = _GpuExamples(names, tmp_path_factory.mktemp("gpu-examples"), _precompile)
    yield examples
    examples.close()
