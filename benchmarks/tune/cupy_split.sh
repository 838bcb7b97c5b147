#!/usr/bin/env bash
# CuPy softmax of long rows split over blocks that wait for each other through global memory, against the
# cluster and register kernels (`nosplit`): chunks staged in shared memory (`sN-tT`: N columns, T threads) or
# held in registers (`rT-vV`: T threads of V 16-byte vectors), and split from 32768 or 65536 columns on.
# Round 1 (tuning/cupy-split-round1.txt) measured staged chunks of 2048-8192 columns on 128-512 threads.
# Writes $OUT/cupy_split.csv.
set -uo pipefail
OUT=${OUT:-/tmp/multisoft-tune}
mkdir -p "$OUT"
K='import multisoft_cupy._catalog as k'
staged() { echo "$K; k.SPLIT_CHUNKS = {(d, e): (($1, $2, 0),) for d in ('fwd', 'bwd') for e in (2, 4)}"; }
regs() { echo "$K; k.SPLIT_CHUNKS = {(d, e): (($1 * $2 * 16 // e, $1, $2),) for d in ('fwd', 'bwd') for e in (2, 4)}"; }
from() { echo "k.SPLIT_MIN_COLUMNS = {(d, e): $1 for d in ('fwd', 'bwd') for e in (2, 4)}"; }
python3 benchmarks/tune/tune.py --backend cupy --ops softmax --dtypes fp32,bf16 \
  --cases 1024x131072,512x262144,128x524288,64x1048576 --directions forward,backward \
  --csv "$OUT/cupy_split.csv" \
  --variant "nosplit:$K; k.SPLIT_MIN_COLUMNS = {}" \
  --variant "s8k-t256:$(staged 8192 256)" \
  --variant "r128-v4:$(regs 128 4)" \
  --variant "r128-v8:$(regs 128 8)" \
  --variant "r256-v4:$(regs 256 4)" \
  --variant "r256-v8:$(regs 256 8)" \
  || echo "cupy split tuning failed: rc=$?"
python3 benchmarks/tune/tune.py --backend cupy --ops softmax --dtypes fp32,bf16 \
  --cases 4096x32768,1024x65536 --directions forward,backward --csv "$OUT/cupy_split.csv" \
  --variant "nosplit:$K; k.SPLIT_MIN_COLUMNS = {}" \
  --variant "from32k-r128-v4:$(regs 128 4); $(from 32768)" \
  --variant "from32k-r128-v8:$(regs 128 8); $(from 32768)" \
  --variant "from32k-r256-v4:$(regs 256 4); $(from 32768)" \
  --variant "from32k-s8k-t256:$(staged 8192 256); $(from 32768)" \
  || echo "cupy split tuning failed: rc=$?"
