#!/usr/bin/env bash
# numba softmax and cross-entropy: the defaults on every headline shape, then long rows through the
# looping kernel instead of the split path. Writes $OUT/numba.csv.
# Round 1 (same script, earlier variants) chose: 32 forward and 16 backward elements per thread, bf16
# read and written in pairs, cross-entropy backward 16 elements per thread.
set -uo pipefail
OUT=${OUT:-/tmp/multisoft-tune}
mkdir -p "$OUT"
tune() { python3 benchmarks/tune/tune.py --backend numba --csv "$OUT/numba.csv" "$@" || echo "tune.py failed: $*"; }
S='import multisoft_numba.softmax as s'
tune --ops softmax,cross_entropy --dtypes fp32,bf16 --directions forward,backward --variant base:
tune --ops softmax --dtypes fp32,bf16 --cases 4096x32768,1024x131072,512x262144 --directions forward,backward \
    --variant "looping:$S; s._max_parts = lambda index: 0" \
    --variant "looping16:$S; s._max_parts = lambda index: 0; s.UNROLL = 16"
