#!/usr/bin/env bash
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
start=$SECONDS
timeout 240 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_prefill_sm90.py tests/test_mask_variant.py tests/test_cascade.py -o timeout=200 2>&1 | tail -6 | tee $OUT/t2.log
echo "tests $((SECONDS-start)) s"
B="python3 benchmarks/bench_prefill.py --no-sdpa --fp8 none --reps 10"
for a in "--gather always --fa3-stages 3" "--fa3-stages 3" "--gather always --fa3-tuning GATHER_NO_FENCE=1"; do
  echo "== $a"
  timeout 120 $B --shapes 1x4096 1x16384 8x2048 $a --out $OUT/b2_$(echo $a | tr -d ' -=').json 2>&1 | grep -A7 "^case" | cut -c1-22,62-80,116-132
done
for a in "" "--gather always"; do
  echo "== hd64/256 $a"
  timeout 150 $B --shapes 1x4096 1x16384 --head-dim 64 256 $a --out $OUT/b2_hd_$(echo $a | tr -d ' -=').json 2>&1 | grep -A9 "^case" | cut -c1-22,62-80
done
echo "total $((SECONDS-start)) s"
