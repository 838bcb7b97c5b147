#!/usr/bin/env bash
# Session 22: the numba cells that moved by 0.02-0.10 between two full runs with no numba change (session 21's
# run of c1b64d3 and session 22's of ae332f6), timed again alone, twice, with the defaults. Writes
# $OUT/numba_recheck.csv.
set -uo pipefail
OUT=${OUT:-/tmp/multisoft-tune}
mkdir -p "$OUT"
python3 benchmarks/tune/tune.py --backend numba --ops softmax,log_softmax --dtypes fp32,bf16 \
  --cases 4096x32768,2048x32768,512x131072,512x262144 --directions forward,backward \
  --csv "$OUT/numba_recheck.csv" --variant "defaults:" --variant "defaults_again:" \
  || echo "numba recheck failed: rc=$?"
