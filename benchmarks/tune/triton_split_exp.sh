#!/usr/bin/env bash
# Triton float32 split softmax forward: CuPy's chunk layout (8192 columns over 4 warps: 64 values per thread)
# under register caps of 128 and 96 (SPLIT_FORWARD_MAXNREG), against the general choice (4096 columns over 4
# warps, capped at 48 registers). Offline (triton 3.9, sm_90): 8192/4 warps takes 128 registers at 128 (4
# programs per SM), 96 with 16 words spilled at 96 (5 programs). Round 1 (results/tuning/
# triton-split-exp-round1.txt) also timed one exponential per element (SPLIT_EXP_ONCE, code in 9637f43, removed:
# no gain), and triton-split-band-round1.txt the 8192/4-warp layout again for 65536 < N <= 262144 (code in
# f939245, removed: its gain did not repeat). Writes $OUT/triton_split_exp.csv.
set -uo pipefail
OUT=${OUT:-/tmp/multisoft-tune}
mkdir -p "$OUT"
S='import multisoft_triton.softmax as s'
c8k() { echo "$S; s.SPLIT_CONFIGS = ((8192, 4), (16384, 8)); s.SPLIT_FORWARD_MAXNREG = {4: $1}"; }
python3 benchmarks/tune/tune.py --backend triton --ops softmax,log_softmax --dtypes fp32 \
  --cases 1024x65536,1024x131072,512x262144,128x524288 --directions forward --csv "$OUT/triton_split_exp.csv" \
  --variant "base:" \
  --variant "c8k-cap128:$(c8k 128)" --variant "c8k-cap96:$(c8k 96)" \
  || echo "triton split exp tuning failed: rc=$?"
