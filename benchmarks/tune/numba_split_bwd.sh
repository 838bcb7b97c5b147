#!/usr/bin/env bash
# numba softmax and log_softmax backward of long rows split over blocks (SPLIT_BWD: 32 values of y and dy per
# thread, blocks compiled for their own size): 128 threads only (more parts), 256 only (fewer), and the
# default choice (128 up to SPLIT_FEW_PARTS parts, else 256) with a threshold of 64 parts.
# Round 1 (numba-split-bwd-round1.txt): 32 values per thread under the 1024-thread bound spill (half the speed);
# round 2 (numba-split-bwd-round2.txt): the bound per block size against 256 x 16 values (the old default).
# Writes $OUT/numba_split_bwd.csv.
# (Session 29: SPLIT_BWD's choices have a third field since, the blocks of their launch bounds: 1 as then.)
set -uo pipefail
OUT=${OUT:-/tmp/multisoft-tune}
mkdir -p "$OUT"
S='import multisoft_numba.softmax as s'
python3 benchmarks/tune/tune.py --backend numba --ops softmax,log_softmax --dtypes fp32 --directions backward \
  --cases 1024x65536,1024x131072,512x262144,128x524288 --csv "$OUT/numba_split_bwd.csv" \
  --variant "base:" \
  --variant "t128:$S; s.SPLIT_BWD = {**s.SPLIT_BWD, 4: ((128, 32, 1),)}" \
  --variant "t256:$S; s.SPLIT_BWD = {**s.SPLIT_BWD, 4: ((256, 32, 1),)}" \
  --variant "few64:$S; s.SPLIT_FEW_PARTS = 64" \
  --variant "base_again:" \
  || echo "numba split backward tuning failed: rc=$?"
