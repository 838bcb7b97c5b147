#!/usr/bin/env bash
# numba softmax backward of long rows split over blocks: parts of 256 threads x 16 values compiled for
# 1024-thread blocks (base: 64 registers) against the same compiled for their own block size (`bounded`, up to
# 255 registers), and bounded blocks of 128 threads x 32 values (CuPy's split: tuning/cupy-split-round2.txt).
# Round 1 (numba-split-bwd-round1.txt): 32 values per thread without the bound spill (half the speed).
# Writes $OUT/numba_split_bwd.csv.
set -uo pipefail
OUT=${OUT:-/tmp/multisoft-tune}
mkdir -p "$OUT"
S='import multisoft_numba.softmax as s'
python3 benchmarks/tune/tune.py --backend numba --ops softmax --dtypes fp32,bf16 --directions backward \
  --cases 4096x32768,1024x65536,1024x131072,512x262144,128x524288 --csv "$OUT/numba_split_bwd.csv" \
  --variant "base:" \
  --variant "bounded:$S; s.SPLIT_BWD_BOUNDED = True" \
  --variant "t128-c32:$S; s.SPLIT_BWD_BOUNDED = True; s.SPLIT_THREADS_BWD = 128; s.SPLIT_CACHE_BWD = {4: 32, 2: 32}" \
  --variant "t128-c64:$S; s.SPLIT_BWD_BOUNDED = True; s.SPLIT_THREADS_BWD = 128; s.SPLIT_CACHE_BWD = {4: 32, 2: 64}" \
  --variant "t256-c32:$S; s.SPLIT_BWD_BOUNDED = True; s.SPLIT_CACHE_BWD = {4: 32, 2: 32}" \
  --variant "base_again:" \
  || echo "numba split backward tuning failed: rc=$?"
