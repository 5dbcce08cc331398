#!/usr/bin/env bash
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>&1 | tail -1
start=$SECONDS
CUATTN_WRITE_SPEC_JOURNAL=$OUT/gpu_specs.pickle timeout 330 python3 -m pytest -m gpu -q -p no:cacheprovider -o timeout=200 --durations=15 2>&1 | tail -45 > $OUT/gpu_tests.log
tail -22 $OUT/gpu_tests.log
echo "tests $((SECONDS-start)) s"
export PYTHONPATH=$PWD:/tmp/site
timeout 250 python3 benchmarks/bench_ops.py --out $OUT/ops.json --md $OUT/ops.md > $OUT/ops.log 2>&1
grep -A40 "^## Summary\|^| op" $OUT/ops.md | head -45
echo "total $((SECONDS-start)) s"
