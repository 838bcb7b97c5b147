#!/usr/bin/env bash
# CuPy softmax of shorter rows staged in shared memory with a warp per row (ROWS warps per block) against
# the register kernels (`regs`): 4 or 8 rows per block, 64 / 96 / 128 KB of shared memory per block at most.
# Writes $OUT/cupy_staged_warps.csv.
set -uo pipefail
OUT=${OUT:-/tmp/multisoft-tune}
mkdir -p "$OUT"
K='import multisoft_cupy._catalog as k'
W="$K; k.STAGED_WARP_COLUMNS = {(d, e): (256, 8192) for d in ('fwd', 'bwd') for e in (2, 4)}"
python3 benchmarks/tune/tune.py --backend cupy --ops softmax --dtypes fp32,bf16 \
  --cases 32768x1024,16384x4096,8192x8192 --directions forward,backward --csv "$OUT/cupy_staged_warps.csv" \
  --variant "regs:" \
  --variant "w8:$W" \
  --variant "w4:$W; k.STAGED_WARP_ROWS = 4" \
  --variant "w8_kb96:$W; k.STAGED_BLOCK_BYTES = 96 * 1024" \
  --variant "w8_kb128:$W; k.STAGED_BLOCK_BYTES = 128 * 1024" \
  --variant "w4_kb128:$W; k.STAGED_WARP_ROWS = 4; k.STAGED_BLOCK_BYTES = 128 * 1024" \
  || echo "cupy staged warps tuning failed: rc=$?"
