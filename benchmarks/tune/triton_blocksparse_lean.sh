#!/usr/bin/env bash
# Session 18, Triton block-sparse forward: the row kernel in log2 units (FORWARD_LEAN: the max taken on the values as
# loaded, each term one multiply-add and one ex2) against session 16's (full), with 4, 2 or 1 rows (warps) a program,
# holding the backward's rule or 1024 elements; "all" variants take every layout onto the row kernels. Writes
# $OUT/triton_bs_lean.csv.
set -uo pipefail
OUT=${OUT:-/tmp/multisoft-tune}
mkdir -p "$OUT"
T='import multisoft_triton.blocksparse as b'
ALL="b.FORWARD_ROWS = {c: {4: (128, 0, 1e9), 2: (128, 0, 1e9)} for c in (False, True)}"
python3 benchmarks/tune/tune.py --backend triton --ops blocksparse_softmax --dtypes fp32,bf16 --cases b \
  --directions forward --csv "$OUT/triton_bs_lean.csv" \
  --variant "full:$T; b.FORWARD_LEAN = False" \
  --variant "lean:" \
  --variant "lean_w2:$T; b.FORWARD_WARPS = 2" \
  --variant "lean_w1:$T; b.FORWARD_WARPS = 1" \
  --variant "lean_w1_1024:$T; b.FORWARD_WARPS = 1; b.FORWARD_HELD = 1024" \
  --variant "all_lean:$T; $ALL" \
  --variant "all_w1_1024:$T; $ALL; b.FORWARD_WARPS = 1; b.FORWARD_HELD = 1024" \
  --variant "all_w2_1024:$T; $ALL; b.FORWARD_WARPS = 2; b.FORWARD_HELD = 1024" \
  || echo "triton block-sparse lean failed: rc=$?"
