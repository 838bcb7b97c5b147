#!/usr/bin/env bash
# Triton float32 split softmax forward: SPLIT_FORWARD_BAND (8192-column chunks over 4 warps at 128 registers
# for rows of 65536 < N <= 262144) against the general SPLIT_CONFIGS choice (4096 over 4 warps at 48), over
# several row counts of the band's lengths and beside it. Writes $OUT/triton_split_band.csv.
set -uo pipefail
OUT=${OUT:-/tmp/multisoft-tune}
mkdir -p "$OUT"
S='import multisoft_triton.softmax as s'
python3 benchmarks/tune/tune.py --backend triton --ops softmax,log_softmax --dtypes fp32 \
  --cases 1024x65536,1024x131072,512x131072,512x262144,256x262144,128x524288 --directions forward \
  --csv "$OUT/triton_split_band.csv" \
  --variant "band:" --variant "noband:$S; s.SPLIT_FORWARD_BAND = {}" --variant "band_again:" \
  || echo "triton split band tuning failed: rc=$?"
