#!/usr/bin/env bash
# CuPy softmax of long rows split over blocks that wait for each other through global memory (each block stages
# its chunk in shared memory) against the cluster and register kernels (`nosplit`), by chunk and block size,
# and split from 32768 columns on. Writes $OUT/cupy_split.csv.
set -uo pipefail
OUT=${OUT:-/tmp/multisoft-tune}
mkdir -p "$OUT"
K='import multisoft_cupy._catalog as k'
ALL32="(d, e): 32769 for d in ('fwd', 'bwd') for e in (2, 4)"
each() { echo "{(d, e): (($1),) for d in ('fwd', 'bwd') for e in (2, 4)}"; }
python3 benchmarks/tune/tune.py --backend cupy --ops softmax --dtypes fp32,bf16 \
  --cases 1024x65536,1024x131072,512x262144,128x524288,64x1048576 --directions forward,backward \
  --csv "$OUT/cupy_split.csv" \
  --variant "nosplit:$K; k.SPLIT_MIN_COLUMNS = {}" \
  --variant "split:" \
  --variant "c4k-t128:$K; k.SPLIT_CHUNKS = $(each '4096, 128')" \
  --variant "c4k-t256:$K; k.SPLIT_CHUNKS = $(each '4096, 256')" \
  --variant "c8k-t256:$K; k.SPLIT_CHUNKS = $(each '8192, 256')" \
  --variant "c8k-t512:$K; k.SPLIT_CHUNKS = $(each '8192, 512')" \
  --variant "c2k-t128:$K; k.SPLIT_CHUNKS = $(each '2048, 128')" \
  || echo "cupy split tuning failed: rc=$?"
python3 benchmarks/tune/tune.py --backend cupy --ops softmax --dtypes fp32,bf16 \
  --cases 4096x32768 --directions forward,backward --csv "$OUT/cupy_split.csv" \
  --variant "nosplit:$K; k.SPLIT_MIN_COLUMNS = {}" \
  --variant "from32k:$K; k.SPLIT_MIN_COLUMNS = {$ALL32}" \
  --variant "from32k-c4k:$K; k.SPLIT_MIN_COLUMNS = {$ALL32}; k.SPLIT_CHUNKS = $(each '4096, 256')" \
  || echo "cupy split tuning failed: rc=$?"
