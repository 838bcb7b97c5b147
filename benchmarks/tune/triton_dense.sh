#!/usr/bin/env bash
# Triton softmax on long rows: the split path (programs exchange per-chunk statistics and wait for each
# other) against the loop path (one program per row, two passes). Writes $OUT/triton_dense.csv.
# Round 1 (same script, earlier variants) chose: fp32 tiles of 4096 elements, bf16 split chunks from
# 4096, per-row counters on their own 128-byte line, CE backward programs of 8192 columns. Round 2 also
# timed a persistent loop path with few enough programs that their rows stay in L2 (LOOP_PROGRAMS_PER_SM,
# 0.42-0.62 of copy, slower than the split); its code and variants were removed in 8176655.
set -uo pipefail
OUT=${OUT:-/tmp/multisoft-tune}
mkdir -p "$OUT"
S='import multisoft_triton.softmax as s'
python3 benchmarks/tune/tune.py --backend triton --ops softmax --dtypes fp32,bf16 \
  --cases 4096x32768,1024x131072,512x262144 --directions forward,backward --csv "$OUT/triton_dense.csv" \
  --variant "split:" \
  --variant "loop_per_row:$S; s.SPLIT_CONFIGS = (); s.FORWARD_TILE_MAX = {4: 32768, 2: 16384}" \
  || echo "softmax tuning failed: rc=$?"
