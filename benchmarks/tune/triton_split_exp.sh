#!/usr/bin/env bash
# Triton float32 split softmax forward: one exponential per element (SPLIT_EXP_ONCE) and CuPy's chunk layout
# (8192 columns over 4 warps: 64 values per thread) under several register caps (SPLIT_FORWARD_MAXNREG), against
# the defaults (4096 columns over 4 warps, capped at 48 registers, two exponentials). Offline (triton 3.9,
# sm_90): 4096/4 warps with EXP_ONCE takes 59 registers at a cap of 64 (8 programs per SM); 8192/4 warps 120
# at 128 (4 programs), 96 with 32 words spilled at 96 (5 programs). Writes $OUT/triton_split_exp.csv.
set -uo pipefail
OUT=${OUT:-/tmp/multisoft-tune}
mkdir -p "$OUT"
S='import multisoft_triton.softmax as s'
c8k() { echo "$S; s.SPLIT_CONFIGS = ((8192, 4), (16384, 8)); s.SPLIT_FORWARD_MAXNREG = {4: $1}; s.SPLIT_EXP_ONCE = $2"; }
python3 benchmarks/tune/tune.py --backend triton --ops softmax,log_softmax --dtypes fp32 \
  --cases 1024x65536,1024x131072,512x262144,128x524288 --directions forward --csv "$OUT/triton_split_exp.csv" \
  --variant "base:" \
  --variant "once-cap64:$S; s.SPLIT_EXP_ONCE = True; s.SPLIT_FORWARD_MAXNREG = {4: 64}" \
  --variant "c8k-cap128:$(c8k 128 False)" --variant "c8k-cap128-once:$(c8k 128 True)" \
  --variant "c8k-cap96:$(c8k 96 False)" --variant "c8k-cap96-once:$(c8k 96 True)" \
  --variant "base_again:" \
  || echo "triton split exp tuning failed: rc=$?"
