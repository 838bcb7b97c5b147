#!/usr/bin/env bash
# CuPy softmax forward of long rows: the split kernel (one exponential per element since session 9) from 32768
# columns in both dtypes, 128 threads of 16 or 8 vectors, against the staged and register kernels (`nosplit`);
# the comparison that set SPLIT_MIN_COLUMNS[("fwd", 4)] to 65536. Round 1
# (results/tuning/split-exp-once-round1.txt) also timed a one-exponential Triton split forward (code in
# 9637f43, removed) under the Triton variants of triton_split_cap.sh, triton_split_stream.sh and
# triton_bf16_split.sh; those scripts time them now. Writes $OUT/split_exp_once.csv.
set -uo pipefail
OUT=${OUT:-/tmp/multisoft-tune}
mkdir -p "$OUT"
K='import multisoft_cupy._catalog as k'
nosplit="$K; k.SPLIT_MIN_COLUMNS = {key: v for key, v in k.SPLIT_MIN_COLUMNS.items() if key[0] != 'fwd'}"
split() { echo "$K; k.SPLIT_MIN_COLUMNS = {**k.SPLIT_MIN_COLUMNS, ('fwd', 4): 32768, ('fwd', 2): 32768}; k.SPLIT_CHOICES = {**k.SPLIT_CHOICES, 'fwd': ((128, $1),)}"; }
python3 benchmarks/tune/tune.py --backend cupy --ops softmax,log_softmax --dtypes fp32,bf16 \
  --cases 4096x32768,1024x65536,1024x131072,512x262144,128x524288 --directions forward \
  --csv "$OUT/split_exp_once.csv" \
  --variant "nosplit:$nosplit" --variant "split-v16:$(split 16)" --variant "split-v8:$(split 8)" \
  || echo "cupy tuning failed: rc=$?"
