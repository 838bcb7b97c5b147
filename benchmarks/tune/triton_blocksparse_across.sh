#!/usr/bin/env bash
# Session 21: Triton's block-sparse forward with its rows across a warp's lanes on every layout (the slab as
# [BLOCKS, ROWS, B], as many rows a program as fill its FORWARD_ACROSS_WARPS warps' lanes with 16-byte pieces of a
# block, holding FORWARD_ACROSS_BLOCKS blocks of each, a piece each a thread) against the row kernel (a warp a row).
# Kept: across on the layouts whose mean row is 512 or less (FORWARD_ACROSS_UNTIL), 1 warp, 4 float32 or 2 bf16
# blocks. Every layout, fp32 and bf16, forward. Every
# variant sets what it compares. Writes $OUT/triton_blocksparse_across.csv.
set -uo pipefail
OUT=${OUT:-/tmp/multisoft-tune}
mkdir -p "$OUT"
T='import multisoft_triton.blocksparse as t'
python3 benchmarks/tune/tune.py --backend triton --ops blocksparse_softmax --dtypes fp32,bf16 --cases b \
  --directions forward --csv "$OUT/triton_blocksparse_across.csv" \
  --variant "rows:$T; t.FORWARD_ACROSS_UNTIL = {4: 0, 2: 0}" \
  --variant "w1-b2:$T; t.FORWARD_ACROSS_UNTIL = {4: 1e9, 2: 1e9}; t.FORWARD_ACROSS_WARPS = 1; t.FORWARD_ACROSS_BLOCKS = {4: 2, 2: 2}" \
  --variant "w1-b4:$T; t.FORWARD_ACROSS_UNTIL = {4: 1e9, 2: 1e9}; t.FORWARD_ACROSS_WARPS = 1; t.FORWARD_ACROSS_BLOCKS = {4: 4, 2: 4}" \
  --variant "w1-b8:$T; t.FORWARD_ACROSS_UNTIL = {4: 1e9, 2: 1e9}; t.FORWARD_ACROSS_WARPS = 1; t.FORWARD_ACROSS_BLOCKS = {4: 8, 2: 8}" \
  --variant "w2-b4:$T; t.FORWARD_ACROSS_UNTIL = {4: 1e9, 2: 1e9}; t.FORWARD_ACROSS_WARPS = 2; t.FORWARD_ACROSS_BLOCKS = {4: 4, 2: 4}" \
  --variant "w4-b4:$T; t.FORWARD_ACROSS_UNTIL = {4: 1e9, 2: 1e9}; t.FORWARD_ACROSS_WARPS = 4; t.FORWARD_ACROSS_BLOCKS = {4: 4, 2: 4}" \
  || echo "triton block-sparse across tuning failed: rc=$?"
