#!/usr/bin/env bash
# Few long rows and the numba cached bf16 forward of 32768 columns (session 11, round 1). Writes $OUT/few_rows.csv.
# CuPy: split16 splits the bf16 forward from 524288 columns on (SPLIT_MIN_COLUMNS), as the float32 one is from
#       65536; rows8k takes bf16 rows of 8192 on 256-thread register blocks instead of staged warps.
# numba: wide adds 512-thread parts to the split backward (16-bit and float32) and makes the split forward's
#        parts 512 threads, so rows of 1048576 (64 parts or fewer) no longer loop; cached512/256 caps the
#        threads of a block holding a whole row, which moves bf16 rows of 32768 to the split path.
# (Session 29: the settings of that time written as today's: SPLIT_THREADS = 512 as SPLIT_FORWARD, SPLIT_BWD's bound.)
set -uo pipefail
OUT=${OUT:-/tmp/multisoft-tune}
mkdir -p "$OUT"
CSV="$OUT/few_rows.csv"
K="import multisoft_cupy._catalog as k; R = k.RowConfig"
S='import multisoft_numba.softmax as s'
tune() { python3 benchmarks/tune/tune.py --csv "$CSV" "$@" || echo "tune.py failed: $*"; }

tune --backend cupy --ops softmax --dtypes bf16 --cases 128x524288,64x1048576,8192x8192 --directions forward \
  --variant "base:" \
  --variant "split16:$K; k.SPLIT_MIN_COLUMNS = {**k.SPLIT_MIN_COLUMNS, ('fwd', 2): 524288}" \
  --variant "rows8k:$K; k.STAGED_WARP_COLUMNS = {**k.STAGED_WARP_COLUMNS, ('fwd', 2): (1024, 4096)}; k.SOFTMAX_RULES = k.SOFTMAX_RULES + (('fwd', 2, 4096, 8192, R(256, 1, 4)),)"

tune --backend numba --ops softmax --dtypes bf16,fp32 --cases 128x524288,64x1048576 --directions forward,backward \
  --variant "base:" \
  --variant "wide:$S; s.SPLIT_BWD = {4: ((128, 32, 1), (256, 32, 1), (512, 32, 1)), 2: ((256, 32, 1), (512, 32, 1))}; s.SPLIT_FORWARD = {4: ((512, 32, 0),), 2: ((512, 64, 0),)}"

tune --backend numba --ops softmax --dtypes bf16 --cases 4096x32768,2048x32768 --directions forward \
  --variant "base:" \
  --variant "cached512:$S; s.CACHED_THREADS = 512" \
  --variant "cached256:$S; s.CACHED_THREADS = 256"
