"""The wheel must carry kernels_cu/ inside the package and find it there when installed."""
import os
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_wheel_carries_kernel_sources_and_finds_them(tmp_path):
    subprocess.run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(tmp_path)],
                   cwd=ROOT, check=True, capture_output=True)
    (wheel,) = tmp_path.glob("cuattn-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    shipped = {p.relative_to(ROOT).as_posix() for p in (ROOT / "kernels_cu").rglob("*") if p.suffix in (".cu", ".cuh")}
    assert shipped and {"cuattn/" + s for s in shipped} <= set(names)
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    script = "import cuattn.jit as j; print(j.KERNELS_DIR); print(len(j.assemble_source('page.cu')))"
    env = {**os.environ, "PYTHONPATH": str(site)}
    out = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, check=True,
                         capture_output=True, text=True).stdout.split()
    assert Path(out[0]) == site / "cuattn" / "kernels_cu"
    assert int(out[1]) > 1000
