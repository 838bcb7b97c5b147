#!/usr/bin/env bash
# Triton softmax on long rows: the split path (programs exchange per-chunk statistics and wait for each
# other) against the loop path (two passes per row) with few enough programs that the rows being worked
# on stay in L2 for the second pass. Writes $OUT/triton_dense.csv.
# Round 1 (same script, earlier variants) chose: fp32 tiles of 4096 elements, bf16 split chunks from
# 4096, per-row counters on their own 128-byte line, CE backward programs of 8192 columns.
set -uo pipefail
OUT=${OUT:-/tmp/multisoft-tune}
mkdir -p "$OUT"
S='import multisoft_triton.softmax as s'
L="$S; s.LOOP_FORWARD = True; s.LOOP_BACKWARD = True; s.FORWARD_TILE_MAX = {4: 32768, 2: 16384}"
python3 benchmarks/tune/tune.py --backend triton --ops softmax --dtypes fp32,bf16 \
  --cases 4096x32768,1024x131072,512x262144 --directions forward,backward --csv "$OUT/triton_dense.csv" \
  --variant "split:" \
  --variant "loop_per_row:$L" \
  --variant "loop1x16:$L; s.LOOP_PROGRAMS_PER_SM = 1; s.LOOP_BLOCK = 8192; s.LOOP_WARPS = 16" \
  --variant "loop1x8:$L; s.LOOP_PROGRAMS_PER_SM = 1; s.LOOP_BLOCK = 4096; s.LOOP_WARPS = 8" \
  --variant "loop2x8:$L; s.LOOP_PROGRAMS_PER_SM = 2; s.LOOP_BLOCK = 4096; s.LOOP_WARPS = 8" \
  --variant "loop4x4:$L; s.LOOP_PROGRAMS_PER_SM = 4; s.LOOP_BLOCK = 2048; s.LOOP_WARPS = 4" \
  || echo "softmax tuning failed: rc=$?"
