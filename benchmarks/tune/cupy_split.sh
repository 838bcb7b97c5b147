#!/usr/bin/env bash
# CuPy softmax of long rows split over blocks that wait for each other through global memory
# (softmax_{fwd,bwd}_split, chunks held in registers), against the cluster and register kernels (`nosplit`).
# Variants: the forward split (`fwd-tT-vV`: T threads of V 16-byte vectors; the defaults split only the
# backward). Earlier rounds (tuning/cupy-split-round1..2.txt): chunks staged in shared memory (slower, since
# removed), 128-256 threads of 4 or 8 vectors, splitting from 32768 columns. Writes $OUT/cupy_split.csv.
set -uo pipefail
OUT=${OUT:-/tmp/multisoft-tune}
mkdir -p "$OUT"
K='import multisoft_cupy._catalog as k'
fwd() { echo "$K; k.SPLIT_MIN_COLUMNS = {**k.SPLIT_MIN_COLUMNS, ('fwd', 4): 65536, ('fwd', 2): 65536}; k.SPLIT_CHOICES = {**k.SPLIT_CHOICES, 'fwd': (($1, $2),)}"; }
python3 benchmarks/tune/tune.py --backend cupy --ops softmax --dtypes fp32,bf16 \
  --cases 4096x32768,1024x65536,1024x131072,512x262144,128x524288,64x1048576 --directions forward,backward \
  --csv "$OUT/cupy_split.csv" \
  --variant "nosplit:$K; k.SPLIT_MIN_COLUMNS = {}" \
  --variant "base:" \
  --variant "fwd-t128-v8:$(fwd 128 8)" \
  --variant "fwd-t128-v16:$(fwd 128 16)" \
  --variant "fwd-t256-v8:$(fwd 256 8)" \
  || echo "cupy split tuning failed: rc=$?"
