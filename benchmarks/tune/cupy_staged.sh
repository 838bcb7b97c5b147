#!/usr/bin/env bash
# CuPy softmax of long rows staged in shared memory (cp.async, a cluster per row) against the register
# kernels (`regs`: staging off). Variants: shared memory per block (STAGED_BLOCK_BYTES 32 or 96 KB instead
# of 64), 256 or 512 threads per block, staging from 16384 columns on, and the float32 backward staged.
# What the earlier rounds measured (results/tuning/cupy-staged-round1..3.txt, knobs since removed): persistent
# clusters walking their share of the rows (25-50 % slower: clusters that do not fit at once run after the
# others), two buffers per block prefetching the next row (slower: fewer blocks per multiprocessor), slices
# above 64 KB (one block per multiprocessor: slower than registers). Writes $OUT/cupy_staged.csv.
set -uo pipefail
OUT=${OUT:-/tmp/multisoft-tune}
mkdir -p "$OUT"
K='import multisoft_cupy._catalog as k'
ALL="(d, e): (16384, 1 << 62) for d in ('fwd', 'bwd') for e in (2, 4)"
python3 benchmarks/tune/tune.py --backend cupy --ops softmax --dtypes fp32,bf16 \
  --cases 4096x32768,1024x131072,512x262144 --directions forward,backward --csv "$OUT/cupy_staged.csv" \
  --variant "regs:$K; k.STAGED_BLOCK_COLUMNS = {}" \
  --variant "staged:" \
  --variant "kb32:$K; k.STAGED_BLOCK_BYTES = 32 * 1024" \
  --variant "kb96:$K; k.STAGED_BLOCK_BYTES = 96 * 1024" \
  --variant "t256:$K; k.STAGED_BLOCK_THREADS = {'fwd': 256, 'bwd': 256}" \
  --variant "t512:$K; k.STAGED_BLOCK_THREADS = {'fwd': 512, 'bwd': 512}" \
  --variant "from16k:$K; k.STAGED_BLOCK_COLUMNS = {$ALL}" \
  || echo "cupy staged tuning failed: rc=$?"
