#!/usr/bin/env bash
# Session 18, Triton block-sparse forward in log2 units (the max taken on the values as loaded, each term one
# multiply-add and one ex2). Round 1 ran at commit 1eaf011, where the kernel sat beside session 16's behind settings
# since removed (FORWARD_LEAN, FORWARD_WARPS, FORWARD_HELD): `git show 1eaf011:benchmarks/tune/triton_blocksparse_lean.sh`.
# Round 2: every layout on the row kernel (the rule: 4 rows a program, 1 from a mean row of 2048) against 8, 2 or 1
# rows a program everywhere, 2 or 4 on the long rows, and other held lengths. Writes $OUT/triton_bs_lean2.csv. Its
# long2 and long4 variants set FORWARD_LONG_WARPS (the long rows' rows a program, 1), a setting of the working tree
# then that FORWARD_ONE_ROW_FROM replaced after this round; the rule of this round is 1eaf011's successor with
# FORWARD_ONE_ROW_FROM = {4: 1e9, 2: 1e9}.
set -uo pipefail
OUT=${OUT:-/tmp/multisoft-tune}
mkdir -p "$OUT"
T='import multisoft_triton.blocksparse as b'
python3 benchmarks/tune/tune.py --backend triton --ops blocksparse_softmax --dtypes fp32,bf16 --cases b \
  --directions forward --csv "$OUT/triton_bs_lean2.csv" \
  --variant "rule:" \
  --variant "w8:$T; b.ROW_WARPS = 8" \
  --variant "w2:$T; b.ROW_WARPS = 2" \
  --variant "w1:$T; b.ROW_WARPS = 1" \
  --variant "w1_256:$T; b.ROW_WARPS = 1; b.ROW_HELD = 256; b.ROW_MIN_BLOCKS = {4: 2, 2: 2}" \
  --variant "held1024:$T; b.ROW_HELD = 1024" \
  || echo "triton block-sparse lean failed: rc=$?"
