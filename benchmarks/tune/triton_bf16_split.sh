#!/usr/bin/env bash
# Triton bf16 softmax on the split path with other chunks. Forward: rows of 32768 (now one tile a row, one
# program per multiprocessor, its loads and stores not overlapped) cut into 2 or 4 held chunks, whose few
# siblings wait on each other briefly. Backward: long rows with other (chunk, warps).
# Writes $OUT/triton_bf16_split.csv.
set -uo pipefail
OUT=${OUT:-/tmp/multisoft-tune}
mkdir -p "$OUT"
S='import multisoft_triton.softmax as s'
F="$S; s.FORWARD_TILE_MAX = {4: 32768, 2: 16384}; s.SPLIT_STREAM = {}"
python3 benchmarks/tune/tune.py --backend triton --ops softmax,log_softmax --dtypes bf16 \
  --cases 4096x32768,2048x32768 --directions forward --csv "$OUT/triton_bf16_split.csv" \
  --variant "base:" \
  --variant "c16k_w16:$F; s.SPLIT_CONFIGS = ((16384, 16),)" \
  --variant "c16k_w8:$F; s.SPLIT_CONFIGS = ((16384, 8),)" \
  --variant "c8k_w8:$F; s.SPLIT_CONFIGS = ((8192, 8),)" \
  --variant "c8k_w4:$F; s.SPLIT_CONFIGS = ((8192, 4),)" \
  || echo "triton bf16 split forward tuning failed: rc=$?"
python3 benchmarks/tune/tune.py --backend triton --ops softmax,log_softmax --dtypes bf16 \
  --cases 1024x131072,512x262144 --directions backward --csv "$OUT/triton_bf16_split.csv" \
  --variant "base:" \
  --variant "c8k_w8:$S; s.SPLIT_CONFIGS = ((8192, 8), (16384, 8))" \
  --variant "c8k_w4:$S; s.SPLIT_CONFIGS = ((8192, 4), (16384, 8))" \
  --variant "c4k_w2:$S; s.SPLIT_CONFIGS = ((4096, 2), (8192, 8), (16384, 8))" \
  --variant "c2k_w2:$S; s.SPLIT_CONFIGS = ((2048, 2), (8192, 8), (16384, 8))" \
  --variant "c4k_w8:$S; s.SPLIT_CONFIGS = ((4096, 8), (8192, 8), (16384, 8))" \
  || echo "triton bf16 split backward tuning failed: rc=$?"
