#!/usr/bin/env bash
# numba split softmax forward (rows of 131072 and 262144), round 1: its kernels compiled for their block size with a few
# blocks a multiprocessor (SPLIT_FORWARD's third field b: launch bounds (threads, b), a register budget of
# 65536 / (threads * b)) instead of the 1024-thread bound (b = 0, 64 registers), with and without the float32 softmax
# keeping exp(x - part max) between its passes (SPLIT_KEEP_EXP, which spilled under 64 registers:
# tuning/numba-split-keep-round1.txt), and CuPy's part shape for float32 (128 threads of 64 values). The parts before
# this round: 256 threads of 32 (float32) and 64 (bf16) values under the 1024-thread bound ("before"). Round 1 of the
# block size alone (numba-split-fwd-round1.txt) was (threads, 1): no register budget at all; session 7's
# numba_split_bound.sh (numba-split-bound-round1.txt) took 256 threads at 5 blocks (48 registers, spills): slower.
# Session 29 ran it with the settings of that tree (SPLIT_THREADS, SPLIT_CACHE, SPLIT_FORWARD_BLOCKS), which
# SPLIT_FORWARD replaced. Writes $OUT/numba_split_budget.csv.
set -uo pipefail
OUT=${OUT:-/tmp/multisoft-tune}
mkdir -p "$OUT"
S='import multisoft_numba.softmax as s'
parts() { echo "$S; s.SPLIT_FORWARD = {4: (($1),), 2: (($2),)}"; }
python3 benchmarks/tune/tune.py --backend numba --ops softmax,log_softmax --dtypes fp32,bf16 --directions forward \
  --cases 1024x131072,512x262144 --csv "$OUT/numba_split_budget.csv" \
  --variant "before:$(parts '256, 32, 0' '256, 64, 0')" \
  --variant "b3:$(parts '256, 32, 3' '256, 64, 3')" \
  --variant "b2:$(parts '256, 32, 2' '256, 64, 2')" \
  --variant "keep_b3:$(parts '256, 32, 3' '256, 64, 3'); s.SPLIT_KEEP_EXP = True" \
  --variant "keep_b2:$(parts '256, 32, 2' '256, 64, 2'); s.SPLIT_KEEP_EXP = True" \
  --variant "keep_t128c64_b4:$(parts '128, 64, 4' '128, 64, 4'); s.SPLIT_KEEP_EXP = True" \
  --variant "keep_t128c64_b5:$(parts '128, 64, 5' '128, 64, 5'); s.SPLIT_KEEP_EXP = True" \
  --variant "before_again:$(parts '256, 32, 0' '256, 64, 0')" \
  || echo "numba split budget tuning failed: rc=$?"
