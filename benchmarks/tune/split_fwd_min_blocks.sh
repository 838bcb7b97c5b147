#!/usr/bin/env bash
# Session 22: the split softmax forward of CuPy and numba with its registers capped for more resident blocks a
# multiprocessor, so more chunks wait at once. numba (SPLIT_FWD_MIN_BLOCKS, launch bounds (SPLIT_THREADS, k)):
# 0 = the 1024-thread bound (64 registers, 4 blocks of 256), 5 (48 registers, 32 bytes spilled, offline sm_90), 6
# (40, 108). CuPy float32 (SPLIT_FWD_MIN_BLOCKS, softmax_fwd_split_capped): 0 = uncapped (95 registers, 5 blocks of
# 128), 6 (80, 208 bytes spilled), 7 (72, 252). Session 22 measured first (tuning/split-fwd-bound.txt) that numba
# compiled for its block size, with more registers and fewer blocks, lost. Every variant sets what it compares.
# Writes $OUT/split_fwd_min_blocks_{numba,cupy}.csv.
set -uo pipefail
OUT=${OUT:-/tmp/multisoft-tune}
mkdir -p "$OUT"
CASES=1024x65536,1024x131072,512x262144,128x524288
S='import multisoft_numba.softmax as s'
python3 benchmarks/tune/tune.py --backend numba --ops softmax,log_softmax --dtypes fp32,bf16 --cases $CASES \
  --directions forward --csv "$OUT/split_fwd_min_blocks_numba.csv" \
  --variant "min0:$S; s.SPLIT_FWD_MIN_BLOCKS = 0; s.SPLIT_THREADS = 256" \
  --variant "min5:$S; s.SPLIT_FWD_MIN_BLOCKS = 5; s.SPLIT_THREADS = 256" \
  --variant "min6:$S; s.SPLIT_FWD_MIN_BLOCKS = 6; s.SPLIT_THREADS = 256" \
  --variant "min0_again:$S; s.SPLIT_FWD_MIN_BLOCKS = 0; s.SPLIT_THREADS = 256" \
  || echo "numba split forward tuning failed: rc=$?"
C='import multisoft_cupy._catalog as c'
python3 benchmarks/tune/tune.py --backend cupy --ops softmax,log_softmax --dtypes fp32 --cases $CASES \
  --directions forward --csv "$OUT/split_fwd_min_blocks_cupy.csv" \
  --variant "min0:$C; c.SPLIT_FWD_MIN_BLOCKS = 0" \
  --variant "min6:$C; c.SPLIT_FWD_MIN_BLOCKS = 6" \
  --variant "min7:$C; c.SPLIT_FWD_MIN_BLOCKS = 7" \
  --variant "min0_again:$C; c.SPLIT_FWD_MIN_BLOCKS = 0" \
  || echo "cupy split forward tuning failed: rc=$?"
