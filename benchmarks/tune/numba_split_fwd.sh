#!/usr/bin/env bash
# numba softmax and log_softmax forward of long rows split over blocks: the defaults (256 threads of 32 float32
# or 64 16-bit values, compiled for 1024-thread blocks: 64 registers) against the split kernels compiled for
# their own block size (`b`: launch bounds (threads, 1)) holding more values per thread (`cN`) in blocks of
# `tT` threads. Writes $OUT/numba_split_fwd.csv.
set -uo pipefail
OUT=${OUT:-/tmp/multisoft-tune}
mkdir -p "$OUT"
S='import multisoft_numba.softmax as s; s.SPLIT_FWD_BOUNDED = True'
python3 benchmarks/tune/tune.py --backend numba --ops softmax,log_softmax --dtypes fp32,bf16 --directions forward \
  --cases 1024x131072,512x262144,4096x32768 --csv "$OUT/numba_split_fwd.csv" \
  --variant "base:" \
  --variant "b-t256-c32/64:$S" \
  --variant "b-t256-c64/128:$S; s.SPLIT_CACHE = {4: 64, 2: 128}" \
  --variant "b-t128-c64/128:$S; s.SPLIT_THREADS = 128; s.SPLIT_CACHE = {4: 64, 2: 128}" \
  --variant "b-t128-c32/64:$S; s.SPLIT_THREADS = 128" \
  --variant "base_again:" \
  || echo "numba split forward tuning failed: rc=$?"
