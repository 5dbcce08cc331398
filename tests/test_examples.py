"""Every example script, every notebook and the README's usage snippet run, on the NumPy path (CI) and,
with the ``gpu`` marker, on a GPU (scripts with --gpu). Notebooks' saved outputs are checked against a
fresh run: cells tagged ``check-output`` must print the same text (error magnitudes in e-notation within
a factor of 2, since BLAS summation order differs between machines)."""
import copy
import re
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import ALONE_ON_THE_GPU

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))
NOTEBOOKS = sorted((ROOT / "examples" / "notebooks").glob("*.ipynb"))
CHECK_TAG = "check-output"
SCI = re.compile(r"[-+]?\d+(?:\.\d+)?e[-+]\d+")


def run_script(path, *args):
    out = subprocess.run([sys.executable, str(path), *args], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_runs(path):
    run_script(path)


@pytest.mark.gpu
@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_runs_on_the_gpu(path, gpu_examples):
    """The scripts run in the background beside the other tests (conftest's _GpuExamples): this waits for
    its own and checks it as run_script does; jax_interop.py runs here, by itself, once the others are done."""
    if path.name in ALONE_ON_THE_GPU or gpu_examples is None:     # (None: CUATTN_TEST_SERIAL=1)
        if gpu_examples is not None:
            gpu_examples.finish_all()
        run_script(path, "--gpu")
        return
    returncode, output = gpu_examples.finish(path.name)
    assert returncode == 0, output


def test_there_are_examples_and_notebooks():
    assert len(EXAMPLES) >= 8 and len(NOTEBOOKS) >= 5


def test_examples_use_only_public_api():
    for path in EXAMPLES:
        text = path.read_text()
        assert not re.search(r"from cuattn\.|import cuattn\.|cuattn\.(reference|arrays|jit|plan)\b", text), path.name


def readme_snippet() -> str:
    """The python block after the README's ``<!-- runnable -->`` marker."""
    text = (ROOT / "README.md").read_text()
    m = re.search(r"<!-- runnable[^>]*-->\s*```python\n(.*?)```", text, re.S)
    assert m, "README.md: no <!-- runnable --> python block"
    return m.group(1)


def test_readme_usage_snippet_runs_as_written():
    out = subprocess.run([sys.executable, "-c", readme_snippet()], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr


def printed(cell) -> str:
    """What a code cell printed: its stdout and its results' text/plain."""
    parts = []
    for o in cell.get("outputs", []):
        if o["output_type"] == "stream" and o["name"] == "stdout":
            parts.append(o["text"])
        elif o["output_type"] == "execute_result":
            parts.append(o["data"].get("text/plain", ""))
    return "".join(parts)


def same_output(saved: str, fresh: str) -> bool:
    if SCI.sub("#", saved) != SCI.sub("#", fresh):
        return False
    for a, b in zip(SCI.findall(saved), SCI.findall(fresh)):
        a, b = abs(float(a)), abs(float(b))
        if max(a, b) > 1e-6 and not (0.5 <= (a + 1e-12) / (b + 1e-12) <= 2):
            return False
    return True


def execute(path):
    nbformat = pytest.importorskip("nbformat", reason="notebook tests need the test extra (nbformat, nbclient)")
    nbclient = pytest.importorskip("nbclient", reason="notebook tests need the test extra (nbformat, nbclient)")
    saved = nbformat.read(path, as_version=4)
    fresh = copy.deepcopy(saved)
    nbclient.NotebookClient(fresh, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}}).execute()
    return saved, fresh


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_and_its_saved_outputs_are_current(path):
    saved, fresh = execute(path)         # a cell that raises fails execute() with its traceback
    checked = 0
    for i, (s, f) in enumerate(zip(saved.cells, fresh.cells)):
        if s.cell_type == "code" and CHECK_TAG in s.metadata.get("tags", []):
            checked += 1
            assert same_output(printed(s), printed(f)), (
                f"{path.name} cell {i}: saved output differs from a fresh run; re-execute the notebook and save it\n"
                f"--- saved\n{printed(s)}\n--- fresh\n{printed(f)}")
    assert checked, f"{path.name}: no cell tagged {CHECK_TAG!r}"


@pytest.mark.gpu
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_its_gpu_cells_on_the_gpu(path):
    """On a GPU every cell runs (the GPU cells too: none prints its no-GPU skip message); the saved
    outputs, made on the NumPy path, are compared by the test above."""
    _, fresh = execute(path)
    text = "".join(printed(c) for c in fresh.cells if c.cell_type == "code")
    assert "no GPU" not in text, f"{path.name}: a cell took its no-GPU branch on a GPU machine:\n{text}"


def test_same_output_tolerates_error_digits_only():
    assert same_output("err = 9.3e-04\n", "err = 9.8e-04\n")
    assert not same_output("err = 9.3e-04\n", "err = 9.3e-02\n")
    assert not same_output("lengths [38, 6]\n", "lengths [38, 7]\n")
