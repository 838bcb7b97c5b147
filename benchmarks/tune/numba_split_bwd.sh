#!/usr/bin/env bash
# numba softmax backward of long rows split over blocks: parts of 256 threads x 16 float32 values (base) against
# 32 values per thread (half the parts) and 128-thread blocks of 32 values (Triton's 4096-element chunks of 4
# warps). Writes $OUT/numba_split_bwd.csv.
set -uo pipefail
OUT=${OUT:-/tmp/multisoft-tune}
mkdir -p "$OUT"
S='import multisoft_numba.softmax as s'
python3 benchmarks/tune/tune.py --backend numba --ops softmax --dtypes fp32,bf16 --directions backward \
  --cases 1024x65536,1024x131072,512x262144 --csv "$OUT/numba_split_bwd.csv" \
  --variant "base:" \
  --variant "c32:$S; s.SPLIT_CACHE_BWD = {4: 32, 2: 32}" \
  --variant "t128-c32:$S; s.SPLIT_THREADS = 128; s.SPLIT_CACHE_BWD = {4: 32, 2: 32}" \
  --variant "t128-c64:$S; s.SPLIT_THREADS = 128; s.SPLIT_CACHE_BWD = {4: 32, 2: 64}" \
  --variant "base_again:" \
  || echo "numba split backward tuning failed: rc=$?"
