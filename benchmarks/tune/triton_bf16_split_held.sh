#!/usr/bin/env bash
# Triton bf16 split softmax forward (rows of 131072 and 262144) held in registers again, against the streaming kernel
# (SPLIT_STREAM) that replaced it in session 5 (0.63 -> 0.69 then) and has been tuned since (register cap, lanes):
# the held kernel has gained the ticket order and float32's register cap since, and was never timed again for bf16.
# hCHUNK_wWARPS_capN: SPLIT_STREAM off, SPLIT_CONFIGS' first entry (CHUNK, WARPS), SPLIT_FORWARD_MAXNREG[2] = N
# (0: none).
# Writes $OUT/triton_bf16_split_held.csv.
set -uo pipefail
OUT=${OUT:-/tmp/multisoft-tune}
mkdir -p "$OUT"
S='import multisoft_triton.softmax as s; s.SPLIT_STREAM = {}'
python3 benchmarks/tune/tune.py --backend triton --ops softmax,log_softmax --dtypes bf16 --directions forward \
  --cases 1024x131072,512x262144 --csv "$OUT/triton_bf16_split_held.csv" \
  --variant "base:" \
  --variant "h4k_w4_cap48:$S; s.SPLIT_FORWARD_MAXNREG = {4: 48, 2: 48}" \
  --variant "h8k_w8_cap48:$S; s.SPLIT_CONFIGS = ((8192, 8), (16384, 8)); s.SPLIT_FORWARD_MAXNREG = {4: 48, 2: 48}" \
  --variant "h8k_w4_cap0:$S; s.SPLIT_CONFIGS = ((8192, 4), (16384, 8)); s.SPLIT_FORWARD_MAXNREG = {4: 48}" \
  --variant "h8k_w4_cap96:$S; s.SPLIT_CONFIGS = ((8192, 4), (16384, 8)); s.SPLIT_FORWARD_MAXNREG = {4: 48, 2: 96}" \
  --variant "base_again:" \
  || echo "triton bf16 held split tuning failed: rc=$?"
