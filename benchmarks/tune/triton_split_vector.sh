#!/usr/bin/env bash
# Session 22: Triton's held-chunk split forward with statistics per 16-byte vector (SPLIT_VECTOR_STATS: one
# exponential per element, one block-wide reduction before publishing) against the defaults, float32 (bf16 takes
# the streaming kernel), at the register caps 48 (the default: 20 words spilled, offline sm_90), 56 and 64 (7).
# Every variant sets what it compares. Writes $OUT/triton_split_vector.csv.
set -uo pipefail
OUT=${OUT:-/tmp/multisoft-tune}
mkdir -p "$OUT"
S='import multisoft_triton.softmax as s'
python3 benchmarks/tune/tune.py --backend triton --ops softmax,log_softmax --dtypes fp32 \
  --cases 1024x65536,1024x131072,512x262144,128x524288 --directions forward \
  --csv "$OUT/triton_split_vector.csv" \
  --variant "base:$S; s.SPLIT_VECTOR_STATS = {4: False, 2: False}; s.SPLIT_FORWARD_MAXNREG = {4: 48, 2: 40}" \
  --variant "vec48:$S; s.SPLIT_VECTOR_STATS = {4: True, 2: False}; s.SPLIT_FORWARD_MAXNREG = {4: 48, 2: 40}" \
  --variant "vec56:$S; s.SPLIT_VECTOR_STATS = {4: True, 2: False}; s.SPLIT_FORWARD_MAXNREG = {4: 56, 2: 40}" \
  --variant "vec64:$S; s.SPLIT_VECTOR_STATS = {4: True, 2: False}; s.SPLIT_FORWARD_MAXNREG = {4: 64, 2: 40}" \
  --variant "base_again:$S; s.SPLIT_VECTOR_STATS = {4: False, 2: False}; s.SPLIT_FORWARD_MAXNREG = {4: 48, 2: 40}" \
  || echo "triton split vector tuning failed: rc=$?"
