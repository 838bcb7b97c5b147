#!/usr/bin/env bash
# numba split softmax kernels compiled for five 256-thread blocks a multiprocessor (base: SPLIT_MIN_BLOCKS
# forward 5: 48 registers, 8 values spilled) against the common 1024-thread bound (64 registers, 4 blocks),
# and the backward bounded the same way. Each bound is its own kernel (_glue.kernel names it), so numba's
# disk cache keeps them apart. Writes $OUT/numba_split_bound.csv.
set -uo pipefail
OUT=${OUT:-/tmp/multisoft-tune}
mkdir -p "$OUT"
S='import multisoft_numba.softmax as s'
python3 benchmarks/tune/tune.py --backend numba --ops softmax,log_softmax --dtypes fp32,bf16 \
  --cases 1024x65536,1024x131072,512x262144 --directions forward,backward --csv "$OUT/numba_split_bound.csv" \
  --variant "base:" \
  --variant "bound1024:$S; s.SPLIT_MIN_BLOCKS = {'forward': 1, 'backward': 1}" \
  --variant "both5:$S; s.SPLIT_MIN_BLOCKS = {'forward': 5, 'backward': 5}" \
  --variant "base_again:" \
  || echo "numba split bound tuning failed: rc=$?"
