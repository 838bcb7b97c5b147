#!/usr/bin/env bash
# numba float32 split softmax forward, SPLIT_FORWARD's 128 x 64 parts at 5 blocks a multiprocessor (the default since
# numba-split-shape-round1.txt) against the 256 x 32 parts under the 1024-thread bound before it, on every row length
# that splits (the sweep's 65536-1048576 columns and the headline shapes).
# Writes $OUT/numba_split_forward_sizes.csv.
set -uo pipefail
OUT=${OUT:-/tmp/multisoft-tune}
mkdir -p "$OUT"
S='import multisoft_numba.softmax as s'
python3 benchmarks/tune/tune.py --backend numba --ops softmax,log_softmax --dtypes fp32 --directions forward \
  --cases 1024x65536,1024x131072,512x131072,512x262144,256x262144,128x524288,64x1048576 \
  --csv "$OUT/numba_split_forward_sizes.csv" \
  --variant "base:" \
  --variant "before:$S; s.SPLIT_FORWARD = {**s.SPLIT_FORWARD, 4: ((256, 32, 0),)}" \
  --variant "base_again:" \
  || echo "numba split forward sizes tuning failed: rc=$?"
