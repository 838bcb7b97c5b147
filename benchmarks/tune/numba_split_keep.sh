#!/usr/bin/env bash
# numba float32 split softmax forward (rows of 65536 and more): holding x between the passes and taking
# the exponential again (base: SPLIT_KEEP_EXP = False; 64 registers, no spills for sm_90) against holding
# exp(x - part max) and rescaling it (`keep`, the earlier code: 64 registers and 60 bytes of spills).
# Each setting is its own kernel (an argument of the factory), so numba's disk cache keeps them apart.
# Writes $OUT/numba_split_keep.csv.
set -uo pipefail
OUT=${OUT:-/tmp/multisoft-tune}
mkdir -p "$OUT"
S='import multisoft_numba.softmax as s'
python3 benchmarks/tune/tune.py --backend numba --ops softmax --dtypes fp32 --directions forward \
  --cases 1024x65536,1024x131072,512x262144,256x262144,128x524288 --csv "$OUT/numba_split_keep.csv" \
  --variant "base:" --variant "keep:$S; s.SPLIT_KEEP_EXP = True" --variant "base_again:" \
  || echo "numba split keep tuning failed: rc=$?"
