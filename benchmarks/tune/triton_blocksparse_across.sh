#!/usr/bin/env bash
# Session 21: Triton's block-sparse forward with its rows across a warp's lanes (FORWARD_ACROSS_WARPS: the slab as
# [BLOCKS, ROWS, B], as many rows a program as fill its warps' lanes with 16-byte pieces of a block, holding
# FORWARD_ACROSS_BLOCKS blocks of each, a 16-byte piece of each a thread) against a warp (or 4) a row. Every layout, fp32 and bf16, forward. Every
# variant sets what it compares. Writes $OUT/triton_blocksparse_across.csv.
set -uo pipefail
OUT=${OUT:-/tmp/multisoft-tune}
mkdir -p "$OUT"
T='import multisoft_triton.blocksparse as t'
python3 benchmarks/tune/tune.py --backend triton --ops blocksparse_softmax --dtypes fp32,bf16 --cases b \
  --directions forward --csv "$OUT/triton_blocksparse_across.csv" \
  --variant "rows:$T; t.FORWARD_ACROSS_WARPS = {4: None, 2: None}" \
  --variant "w1-b2:$T; t.FORWARD_ACROSS_WARPS = {4: 1, 2: 1}; t.FORWARD_ACROSS_BLOCKS = 2" \
  --variant "w1-b4:$T; t.FORWARD_ACROSS_WARPS = {4: 1, 2: 1}; t.FORWARD_ACROSS_BLOCKS = 4" \
  --variant "w1-b8:$T; t.FORWARD_ACROSS_WARPS = {4: 1, 2: 1}; t.FORWARD_ACROSS_BLOCKS = 8" \
  --variant "w2-b4:$T; t.FORWARD_ACROSS_WARPS = {4: 2, 2: 2}; t.FORWARD_ACROSS_BLOCKS = 4" \
  --variant "w4-b4:$T; t.FORWARD_ACROSS_WARPS = {4: 4, 2: 4}; t.FORWARD_ACROSS_BLOCKS = 4" \
  || echo "triton block-sparse across tuning failed: rc=$?"
