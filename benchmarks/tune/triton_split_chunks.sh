#!/usr/bin/env bash
# Triton split softmax (long rows) for bf16: chunks of 2048 (2 or 4 warps) against 4096 (4 warps).
# Writes $OUT/triton_split_chunks.csv.
set -uo pipefail
OUT=${OUT:-/tmp/multisoft-tune}
mkdir -p "$OUT"
S='import multisoft_triton.softmax as s'
python3 benchmarks/tune/tune.py --backend triton --ops softmax --dtypes bf16 \
  --cases 1024x131072,512x262144 --directions forward,backward --csv "$OUT/triton_split_chunks.csv" \
  --variant "base:" \
  --variant "c2k_w4:$S; s.SPLIT_CONFIGS = ((2048, 4), (4096, 4), (8192, 8), (16384, 8))" \
  --variant "c2k_w2:$S; s.SPLIT_CONFIGS = ((2048, 2), (4096, 4), (8192, 8), (16384, 8))" \
  --variant "c4k_w2:$S; s.SPLIT_CONFIGS = ((4096, 2), (8192, 8), (16384, 8))" \
  || echo "triton split tuning failed: rc=$?"
