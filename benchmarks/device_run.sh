#!/usr/bin/env bash
# Device calls (device tool, carry=[".whl"] for FlashInfer): logs under $OUT, short tables last.
# Usage: bash benchmarks/device_run.sh tests   every GPU test (+ the slow decode grid), precompile
#        bash benchmarks/device_run.sh bench   host probe, full decode and prefill benchmarks
#        bash benchmarks/device_run.sh quick   GPU tests, then a subset of both benchmarks
#        bash benchmarks/device_run.sh variants  GPU tests (TESTS=paths: those), variant and JIT benchmarks
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD     # absolute: notebook kernels start in examples/notebooks
# FlashInfer for same-run comparisons, from wheels carried in .whl/ (git-ignored; fetch them here with
# pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64
#   -d .whl flashinfer-python==0.6.4 apache-tvm-ffi==0.1.15.post2) and the device tool's carry=[".whl"]
# Notebook tests need nbclient and ipykernel, which the device image lacks: carry their wheels in .whl_nb/
# (git-ignored; pip download --no-deps of the versions `pip freeze` shows in a venv with the test extra).
wheels=$(ls .whl/*.whl .whl_nb/*.whl 2>/dev/null)
if [ -n "$wheels" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      $wheels && export PYTHONPATH=$PWD:/tmp/site
fi
OUT=${OUT:-/tmp/cuattn-out}
mkdir -p "$OUT"
mode=${1:-quick}
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader | tee "$OUT/device.txt"

if [ "$mode" = tests ] || [ "$mode" = quick ]; then
  # the specs the tests compile on first use: copy $OUT/gpu_specs.pickle over tests/gpu_specs.pickle
  # (tests/conftest.py) so the next fresh machine compiles them up front, in parallel
  start=$SECONDS
  CUATTN_WRITE_SPEC_JOURNAL="$OUT/gpu_specs.pickle" python3 -m pytest -m gpu -q -p no:cacheprovider \
      --durations=30 2>&1 | tee "$OUT/gpu_tests.log" | tail -40
  echo "pytest -m gpu: $((SECONDS - start)) s wall" | tee -a "$OUT/gpu_tests.log"
  if [ "$mode" = tests ]; then
    python3 -m pytest -m gpu -q -p no:cacheprovider --runslow tests/test_decode.py -k full_grid 2>&1 \
        | tee -a "$OUT/gpu_tests.log" | tail -2
  fi
  # the boundary's PyTorch/JAX CPU round trips need those frameworks, which the device image has
  python3 -m pytest tests/test_arrays.py -q -p no:cacheprovider 2>&1 | tee -a "$OUT/gpu_tests.log" | tail -2
  python3 -m cuattn.cli precompile 2>/dev/null | tee -a "$OUT/gpu_tests.log"
  python3 - <<'PY' | tee -a "$OUT/gpu_tests.log"
from cuattn import cli, jit
arch = jit.device_arch(0)
worst = max(((r.get("registers", 0), s.name) for s in cli.shipped_specs(arch)
             for r in jit.compile_kernel(s, arch).resources.values()), default=None)
spills = [s.name for s in cli.shipped_specs(arch) for r in jit.compile_kernel(s, arch).resources.values()
          if r.get("spill_stores", 0)]
if worst is None:   # NVRTC 13.0 on the GPU machines prints no ptxas log (jit.CompiledKernel.resources)
    print(f"device NVRTC {jit.nvrtc_version()}: no ptxas log, so no register/spill counts here "
          f"(the CPU tests check them with the NVRTC installed there)")
else:
    print(f"device NVRTC {jit.nvrtc_version()}: most registers {worst}; specs with spills: {spills or 'none'}")
PY
fi
if [ "$mode" = bench ]; then
  python3 benchmarks/bench_scheduler.py --out "$OUT/scheduler.json" 2>&1 | tee "$OUT/scheduler.log" | tail -30
  python3 benchmarks/bench_decode.py --stream --out "$OUT/decode.json" 2>&1 | tee "$OUT/decode.log" | tail -40
  python3 benchmarks/bench_prefill.py --out "$OUT/prefill.json" 2>&1 | tee "$OUT/prefill.log" | tail -20
fi
if [ "$mode" = quick ]; then
  python3 benchmarks/bench_decode.py --batch 1 16 64 --kv-len 512 2048 32768 --heads 32:8 --reps 30 \
      --out "$OUT/decode.json" 2>&1 | tee "$OUT/decode.log" | tail -14
  python3 benchmarks/bench_prefill.py --shapes 1x1024 1x16384 8x2048 --out "$OUT/prefill.json" 2>&1 \
      | tee "$OUT/prefill.log" | tail -12
fi
if [ "$mode" = variants ]; then
  python3 -m pytest -m gpu -q -p no:cacheprovider --durations=10 ${TESTS:-} 2>&1 | tee "$OUT/gpu_tests.log" | tail -30
  python3 benchmarks/bench_variants.py --out "$OUT/variants.json" 2>&1 | tee "$OUT/variants.log" | tail -40
  python3 benchmarks/bench_jit.py --flashinfer --out "$OUT/jit.json" 2>&1 | tee "$OUT/jit.log" | tail -12
fi
