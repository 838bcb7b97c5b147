#!/usr/bin/env bash
# numba's packed 16-bit cached softmax forward compiled for two 1024-thread blocks per multiprocessor
# (base: PACKED_FORWARD_MIN_BLOCKS = 2, at most 32 registers) against one (41 registers): a row that
# takes 1024 threads then no longer has a multiprocessor to itself. Each bound is its own kernel
# (_glue.kernel names it), so numba's disk cache keeps them apart. Writes $OUT/numba_min_blocks.csv.
set -uo pipefail
OUT=${OUT:-/tmp/multisoft-tune}
mkdir -p "$OUT"
S='import multisoft_numba.softmax as s'
python3 benchmarks/tune/tune.py --backend numba --ops softmax,log_softmax --dtypes bf16 --directions forward \
  --cases 32768x1024,16384x4096,4096x32768,262144x256,131072x512,32768x2048,8192x8192,4096x16384,2048x32768 \
  --csv "$OUT/numba_min_blocks.csv" \
  --variant "base:" --variant "one_block:$S; s.PACKED_FORWARD_MIN_BLOCKS = 1" --variant "base_again:" \
  || echo "numba min blocks tuning failed: rc=$?"
