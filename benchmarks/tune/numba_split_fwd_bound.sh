#!/usr/bin/env bash
# Session 22 (lost; tuning/split-fwd-bound.txt): numba's split softmax forward compiled for its block size
# (SPLIT_FWD_MIN_BLOCKS = 1: launch bounds (SPLIT_THREADS, 1)) against the 1024-thread bound of before (at most 64
# registers), and, so bounded, more values a thread (SPLIT_CACHE: 64 float32 / 128 16-bit, half the parts and half the
# per-part overhead: offline, sm_90, 2128 instructions for 64 float32 values against 1704 for 32) over 128 or 256
# threads. Every variant sets what it compares. Writes $OUT/numba_split_fwd_bound.csv.
set -uo pipefail
OUT=${OUT:-/tmp/multisoft-tune}
mkdir -p "$OUT"
S='import multisoft_numba.softmax as s'
D="s.SPLIT_KEEP_EXP = False"
python3 benchmarks/tune/tune.py --backend numba --ops softmax,log_softmax --dtypes fp32,bf16 \
  --cases 1024x65536,1024x131072,512x262144,128x524288,64x1048576 --directions forward \
  --csv "$OUT/numba_split_fwd_bound.csv" \
  --variant "unbounded:$S; $D; s.SPLIT_FWD_MIN_BLOCKS = 0; s.SPLIT_THREADS = 256; s.SPLIT_CACHE = {4: 32, 2: 64}" \
  --variant "b256:$S; $D; s.SPLIT_FWD_MIN_BLOCKS = 1; s.SPLIT_THREADS = 256; s.SPLIT_CACHE = {4: 32, 2: 64}" \
  --variant "b128:$S; $D; s.SPLIT_FWD_MIN_BLOCKS = 1; s.SPLIT_THREADS = 128; s.SPLIT_CACHE = {4: 32, 2: 64}" \
  --variant "b256-x2:$S; $D; s.SPLIT_FWD_MIN_BLOCKS = 1; s.SPLIT_THREADS = 256; s.SPLIT_CACHE = {4: 64, 2: 128}" \
  --variant "b128-x2:$S; $D; s.SPLIT_FWD_MIN_BLOCKS = 1; s.SPLIT_THREADS = 128; s.SPLIT_CACHE = {4: 64, 2: 128}" \
  --variant "b128-x2-keep:$S; s.SPLIT_KEEP_EXP = True; s.SPLIT_FWD_MIN_BLOCKS = 1; s.SPLIT_THREADS = 128; s.SPLIT_CACHE = {4: 64, 2: 128}" \
  || echo "numba split forward tuning failed: rc=$?"
