#!/usr/bin/env bash
# CuPy softmax of long rows split over blocks that wait for each other through global memory
# (softmax_{fwd,bwd}_split, chunks held in registers). ROUND=4 (default): the backward's 128 threads of 16
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
if [ "${ROUND:-4}" = 3 ]; then
  fwd() { echo "$K; k.SPLIT_MIN_COLUMNS = {**k.SPLIT_MIN_COLUMNS, ('fwd', 4): 65536, ('fwd', 2): 65536}; k.SPLIT_CHOICES = {**k.SPLIT_CHOICES, 'fwd': (($1, $2),)}"; }
  tune --ops softmax --dtypes fp32,bf16 --directions forward,backward \
    --cases 4096x32768,1024x65536,1024x131072,512x262144,128x524288,64x1048576 \
    --variant "nosplit:$K; k.SPLIT_MIN_COLUMNS = {}" --variant "base:" \
    --variant "fwd-t128-v8:$(fwd 128 8)" --variant "fwd-t128-v16:$(fwd 128 16)"
else
  tune --ops softmax,log_softmax --dtypes fp32,bf16 --directions backward \
    --cases 4096x32768,1024x65536,1024x131072,512x262144,128x524288 \
    --variant "base:" --variant "bwd-t128-v8:$K; k.SPLIT_CHOICES = {**k.SPLIT_CHOICES, 'bwd': ((128, 8),)}"
fi
