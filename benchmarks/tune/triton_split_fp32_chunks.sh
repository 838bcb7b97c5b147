#!/usr/bin/env bash
# Triton float32 split softmax forward (rows of 131072 and 262144) with other chunks than the 4096 elements of 4
# warps it shares with the backward: session 4 kept one chunk size for both dtypes ("each better for one dtype,
# worse for the other"), and the bf16 forward has streamed its chunks since session 5 (SPLIT_STREAM), so the
# float32 forward's chunk is free. Register caps (SPLIT_FORWARD_MAXNREG) as named.
# Writes $OUT/triton_split_fp32_chunks.csv.
set -uo pipefail
OUT=${OUT:-/tmp/multisoft-tune}
mkdir -p "$OUT"
S='import multisoft_triton.softmax as s'
python3 benchmarks/tune/tune.py --backend triton --ops softmax,log_softmax --dtypes fp32 --directions forward \
  --cases 1024x131072,512x262144 --csv "$OUT/triton_split_fp32_chunks.csv" \
  --variant "base:" \
  --variant "c8k_w4_nocap:$S; s.SPLIT_CONFIGS = ((8192, 4), (16384, 8)); s.SPLIT_FORWARD_MAXNREG = {2: 40}" \
  --variant "c8k_w4_cap96:$S; s.SPLIT_CONFIGS = ((8192, 4), (16384, 8)); s.SPLIT_FORWARD_MAXNREG = {4: 96, 2: 40}" \
  --variant "c8k_w8_cap48:$S; s.SPLIT_CONFIGS = ((8192, 8), (16384, 8))" \
  --variant "c8k_w8_nocap:$S; s.SPLIT_CONFIGS = ((8192, 8), (16384, 8)); s.SPLIT_FORWARD_MAXNREG = {2: 40}" \
  --variant "c2k_w2_cap48:$S; s.SPLIT_CONFIGS = ((2048, 2), (4096, 4), (8192, 8))" \
  --variant "c4k_w4_nocap:$S; s.SPLIT_FORWARD_MAXNREG = {2: 40}" \
  --variant "base_again:" \
  || echo "triton split fp32 chunk tuning failed: rc=$?"
