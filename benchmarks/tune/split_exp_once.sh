#!/usr/bin/env bash
# The split softmax forward of long rows taking one exponential per element (session 9): softmax keeps
# exp(x - the chunk's or thread's max) and rescales it once the row's statistics are in, instead of taking
# exp(x - row max) again. CuPy: the defaults (float32 split from 262144 columns, bf16 staged) against the
# split from 32768 columns in both dtypes, 128 threads of 16 or 8 vectors. Triton: the defaults (bf16 streams
# its chunk twice) against bf16 chunks held in registers (`held`), without the register cap, and bf16 rows of
# 32768 split instead of tiled. Round 1 (results/tuning/split-exp-once-round1.txt) kept CuPy's kernel and
# reverted Triton's, so the Triton section now times the kept kernel (two exponentials) under the same
# variants. Writes $OUT/split_exp_once.csv.
set -uo pipefail
OUT=${OUT:-/tmp/multisoft-tune}
mkdir -p "$OUT"
CASES=4096x32768,1024x65536,1024x131072,512x262144,128x524288
K='import multisoft_cupy._catalog as k'
split() { echo "$K; k.SPLIT_MIN_COLUMNS = {**k.SPLIT_MIN_COLUMNS, ('fwd', 4): 32768, ('fwd', 2): 32768}; k.SPLIT_CHOICES = {**k.SPLIT_CHOICES, 'fwd': ((128, $1),)}"; }
python3 benchmarks/tune/tune.py --backend cupy --ops softmax,log_softmax --dtypes fp32,bf16 --cases "$CASES" \
  --directions forward --csv "$OUT/split_exp_once.csv" \
  --variant "base:" --variant "split-v16:$(split 16)" --variant "split-v8:$(split 8)" \
  || echo "cupy tuning failed: rc=$?"
S='import multisoft_triton.softmax as s'
python3 benchmarks/tune/tune.py --backend triton --ops softmax,log_softmax --dtypes fp32,bf16 --cases "$CASES" \
  --directions forward --csv "$OUT/split_exp_once.csv" \
  --variant "base:" --variant "held:$S; s.SPLIT_STREAM = {}" \
  --variant "uncapped:$S; s.SPLIT_FORWARD_MAXNREG = {}" \
  --variant "held-uncapped:$S; s.SPLIT_STREAM = {}; s.SPLIT_FORWARD_MAXNREG = {}" \
  --variant "held-split32k:$S; s.SPLIT_STREAM = {}; s.FORWARD_TILE_MAX = {4: 32768, 2: 16384}" \
  || echo "triton tuning failed: rc=$?"
