#!/usr/bin/env bash
# Triton cross-entropy forward of long rows: cut into parts whose statistics a second kernel combines
# (base: PARTS_FROM, PART_BLOCK, PART_WARPS) against one program streaming each row (loop) and other parts.
# Writes $OUT/triton_ce_parts.csv.
set -uo pipefail
OUT=${OUT:-/tmp/multisoft-tune}
mkdir -p "$OUT"
C='import multisoft_triton.cross_entropy as c'
python3 benchmarks/tune/tune.py --backend triton --ops cross_entropy --dtypes fp32,bf16 \
  --directions forward,forward+backward --csv "$OUT/triton_ce_parts.csv" \
  --variant "base:" \
  --variant "loop:$C; c.PARTS_FROM = None" \
  --variant "p8k_w8:$C; c.PART_BLOCK, c.PART_WARPS = 8192, 8" \
  --variant "p8k_w4:$C; c.PART_BLOCK, c.PART_WARPS = 8192, 4" \
  --variant "p2k_w4:$C; c.PART_BLOCK, c.PART_WARPS = 2048, 4" \
  --variant "p16k_w8:$C; c.PART_BLOCK, c.PART_WARPS = 16384, 8" \
  || echo "triton cross-entropy parts tuning failed: rc=$?"
