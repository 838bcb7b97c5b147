#!/usr/bin/env bash
# Session 22: numba's log_softmax split backward reading y after publishing its part's sum(dy), while it waits for
# the row's other parts (SPLIT_LATE_Y; Triton's took bf16 +0.03-0.04), against reading y and dy first, float32 and
# bf16. Every variant sets what it compares. Writes $OUT/numba_split_late_y.csv.
set -uo pipefail
OUT=${OUT:-/tmp/multisoft-tune}
mkdir -p "$OUT"
S='import multisoft_numba.softmax as s'
python3 benchmarks/tune/tune.py --backend numba --ops log_softmax --dtypes fp32,bf16 \
  --cases 1024x65536,1024x131072,512x262144,128x524288 --directions backward \
  --csv "$OUT/numba_split_late_y.csv" \
  --variant "early:$S; s.SPLIT_LATE_Y = {4: False, 2: False}" \
  --variant "late:$S; s.SPLIT_LATE_Y = {4: True, 2: True}" \
  --variant "early_again:$S; s.SPLIT_LATE_Y = {4: False, 2: False}" \
  || echo "numba split late-y tuning failed: rc=$?"
