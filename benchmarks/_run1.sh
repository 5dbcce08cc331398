#!/usr/bin/env bash
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader
start=$SECONDS
timeout 300 python3 -m pytest -m gpu -q -p no:cacheprovider -x tests/test_prefill_sm90.py -o timeout=200 2>&1 | tail -25 | tee $OUT/t1.log
echo "tests $((SECONDS-start)) s"
for a in "--page-size 16" "--page-size 16 --gather always" "--page-size 1"; do
  echo "== $a"
  timeout 150 python3 benchmarks/bench_prefill.py --shapes 1x4096 1x16384 8x2048 --no-sdpa --fp8 none --reps 10 $a --out $OUT/b_$(echo $a | tr -d ' -').json 2>&1 | grep -A12 "^case" | head -8
done
echo "total $((SECONDS-start)) s"
