#!/usr/bin/env bash
# numba split softmax (rows of 131072 and 262144), round 2 after numba_split_budget.sh (tuning/numba-split-budget-round1.txt,
# where CuPy's part shape, 128 threads of 64 float32 values, compiled for 5 blocks a multiprocessor, took the float32
# log_softmax forward from 0.77 to 0.85 and the softmax, keeping its exponentials, lost). Forward, float32: that shape
# without keeping the exponentials at 4-6 blocks a multiprocessor, and 128 threads of 32 values under the 1024-thread
# bound; bf16 (rows held as words): parts of other sizes under the 1024-thread bound ("before": the parts before this
# session, 256 threads of 32 / 64 values). Backward: SPLIT_BWD's parts with a register budget for 2-4 blocks a
# multiprocessor instead of none (1). Session 29 ran it with the settings of that tree (SPLIT_THREADS, SPLIT_CACHE,
# SPLIT_FORWARD_BLOCKS, SPLIT_BACKWARD_BLOCKS), which SPLIT_FORWARD and SPLIT_BWD's third field replaced.
# Writes $OUT/numba_split_shape.csv.
set -uo pipefail
OUT=${OUT:-/tmp/multisoft-tune}
mkdir -p "$OUT"
S='import multisoft_numba.softmax as s'
fwd() { echo "$S; s.SPLIT_FORWARD = {**s.SPLIT_FORWARD, $1: (($2),)}"; }
bwd() { echo "$S; s.SPLIT_BWD = {4: ((128, 32, $1), (256, 32, $1)), 2: ((256, 32, $1),)}"; }
run() {
  python3 benchmarks/tune/tune.py --backend numba --ops softmax,log_softmax --cases 1024x131072,512x262144 \
    --csv "$OUT/numba_split_shape.csv" "$@" || echo "numba split shape tuning failed: rc=$?"
}
run --directions forward --dtypes fp32 \
  --variant "before:$(fwd 4 '256, 32, 0')" \
  --variant "t128c64_b4:$(fwd 4 '128, 64, 4')" \
  --variant "t128c64_b5:$(fwd 4 '128, 64, 5')" \
  --variant "t128c64_b6:$(fwd 4 '128, 64, 6')" \
  --variant "t128c32:$(fwd 4 '128, 32, 0')" \
  --variant "before_again:$(fwd 4 '256, 32, 0')"
run --directions forward --dtypes bf16 \
  --variant "before:$(fwd 2 '256, 64, 0')" \
  --variant "t128:$(fwd 2 '128, 64, 0')" \
  --variant "c32:$(fwd 2 '256, 32, 0')" \
  --variant "t128c32:$(fwd 2 '128, 32, 0')" \
  --variant "t512:$(fwd 2 '512, 64, 0')" \
  --variant "before_again:$(fwd 2 '256, 64, 0')"
run --directions backward --dtypes fp32,bf16 \
  --variant "base:" \
  --variant "bwd_b2:$(bwd 2)" \
  --variant "bwd_b3:$(bwd 3)" \
  --variant "bwd_b4:$(bwd 4)" \
  --variant "base_again:"
