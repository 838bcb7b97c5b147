#!/usr/bin/env bash
# CuPy softmax of long rows split over blocks that wait for each other through global memory
# (softmax_{fwd,bwd}_split, chunks held in registers). ROUND=5 (default): blocks walking rows
# (SPLIT_WALK_BLOCKS_PER_SM), with and without loading the next row's chunk before the wait (PREFETCH), against
# one row per block, forward from 32768 columns in both dtypes and the backward. ROUND=4: the backward's 128 threads of 16
# vectors (base) against 8 (twice the chunks per row). ROUND=3: the split against the cluster and register
# kernels (`nosplit`) and the forward split (`fwd-tT-vV`: T threads of V 16-byte vectors) from 65536 columns.
# Earlier rounds (tuning/cupy-split-round1..2.txt): chunks staged in shared memory (slower, since removed),
# 128-256 threads of 4 or 8 vectors, splitting from 32768 columns; round 4 also measured 12 vectors (since
# removed). Writes $OUT/cupy_split.csv.
set -uo pipefail
OUT=${OUT:-/tmp/multisoft-tune}
mkdir -p "$OUT"
K='import multisoft_cupy._catalog as k'
tune() { python3 benchmarks/tune/tune.py --backend cupy --csv "$OUT/cupy_split.csv" "$@" || echo "cupy split tuning failed: rc=$?"; }
if [ "${ROUND:-5}" = 5 ]; then
  # split DIRECTION THREADS VPT PREFETCH; walk DIRECTION THREADS VPT PREFETCH BLOCKS_PER_SM
  split() { echo "$K; k.SPLIT_MIN_COLUMNS = {**k.SPLIT_MIN_COLUMNS, ('fwd', 4): 32768, ('fwd', 2): 32768}; k.SPLIT_CHOICES = {**k.SPLIT_CHOICES, '$1': (($2, $3, $4),)}"; }
  walk() { echo "$(split "$1" "$2" "$3" "$4"); k.SPLIT_WALK_BLOCKS_PER_SM = {'$1': $5}"; }
  tune --ops softmax,log_softmax --dtypes fp32,bf16 --directions forward \
    --cases 4096x32768,1024x65536,1024x131072,512x262144,128x524288,64x1048576 \
    --variant "base:" --variant "row-v16:$(split fwd 128 16 0)" \
    --variant "walk4-v16:$(walk fwd 128 16 0 4)" \
    --variant "pf-v8-w4:$(walk fwd 128 8 1 4)" --variant "pf-v8-w6:$(walk fwd 128 8 1 6)" \
    --variant "pf-v16-w2:$(walk fwd 128 16 1 2)" --variant "pf-v16-w3:$(walk fwd 128 16 1 3)"
  tune --ops softmax --dtypes fp32,bf16 --directions backward \
    --cases 1024x131072,512x262144,128x524288,64x1048576 \
    --variant "base:" --variant "bwd-pf-v8-w3:$(walk bwd 128 8 1 3)" --variant "bwd-pf-v8-w4:$(walk bwd 128 8 1 4)"
elif [ "${ROUND}" = 3 ]; then
  fwd() { echo "$K; k.SPLIT_MIN_COLUMNS = {**k.SPLIT_MIN_COLUMNS, ('fwd', 4): 65536, ('fwd', 2): 65536}; k.SPLIT_CHOICES = {**k.SPLIT_CHOICES, 'fwd': (($1, $2, 0),)}"; }
  tune --ops softmax --dtypes fp32,bf16 --directions forward,backward \
    --cases 4096x32768,1024x65536,1024x131072,512x262144,128x524288,64x1048576 \
    --variant "nosplit:$K; k.SPLIT_MIN_COLUMNS = {}" --variant "base:" \
    --variant "fwd-t128-v8:$(fwd 128 8)" --variant "fwd-t128-v16:$(fwd 128 16)"
else
  tune --ops softmax,log_softmax --dtypes fp32,bf16 --directions backward \
    --cases 4096x32768,1024x65536,1024x131072,512x262144,128x524288 \
    --variant "base:" --variant "bwd-t128-v8:$K; k.SPLIT_CHOICES = {**k.SPLIT_CHOICES, 'bwd': ((128, 8, 0),)}"
fi
