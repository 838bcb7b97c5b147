#!/usr/bin/env bash
# The sweep's weak cells below 32768 columns (benchmarks/results/results.md, session 10): CuPy and numba
# configurations for rows of 256 to 16384 columns. Writes $OUT/short_rows.csv.
# CuPy variants set multisoft_cupy._catalog rules (element size 4: fp32, 2: bf16; a rule applies for
# low < columns <= high) or the column ranges of its staged kernels (which come before the rules):
#  rows_a: several rows per warp (TPR 8 or 16) for 256 and 512 bf16 columns; 128-thread blocks for 2048;
#          float32 16384 forward in clusters of two 512-thread blocks.
#  rows_b: the other row-group width for 256/512; 2048 as a warp of 8 vectors per thread; float32 2048
#          forward staged by warps; float32 16384 forward staged by blocks.
#  staged: bf16 8192 and 16384 forward and 8192 backward staged by blocks; bf16 2048 backward staged by warps;
#          float32 8192 forward staged by blocks.
#  mixed:  bf16 2048 forward staged by warps; 16384 forward in clusters; 2048 backward 256-thread blocks
#          held to 64 registers.
# numba variants: ROW_GROUP_MAX by direction (rows of at most this many threads share blocks; 0: a block per
# row, the code before session 11). Round 1 had one ROW_GROUP_MAX for both directions (base 32, max16) and
# varied ROW_GROUP_BLOCK (128, 512: level or slower). PART=cupy or PART=numba runs one half.
set -uo pipefail
OUT=${OUT:-/tmp/multisoft-tune}
mkdir -p "$OUT"
CSV="$OUT/short_rows.csv"
K="import multisoft_cupy._catalog as k; R = k.RowConfig"
S='import multisoft_numba.softmax as s'
tune() { python3 benchmarks/tune/tune.py --csv "$CSV" "$@" || echo "tune.py failed: $*"; }

[ "${PART:-all}" = numba ] || tune --backend cupy --ops softmax --dtypes bf16,fp32 \
  --cases 262144x256,131072x512,32768x2048,8192x8192,4096x16384 --directions forward,backward \
  --variant "base:" \
  --variant "rows_a:$K; k.SOFTMAX_RULES = (('fwd', 2, 128, 256, R(8, 16, 4)), ('fwd', 2, 256, 512, R(16, 8, 4)), ('fwd', 2, 1024, 2048, R(128, 1, 2)), ('bwd', 2, 128, 256, R(8, 16, 4)), ('bwd', 2, 1024, 2048, R(128, 1, 2)), ('fwd', 4, 1024, 2048, R(128, 1, 4)), ('fwd', 4, 8192, 16384, R(512, 1, 4, 2)))" \
  --variant "rows_b:$K; k.SOFTMAX_RULES = (('fwd', 2, 128, 256, R(16, 8, 2)), ('fwd', 2, 256, 512, R(8, 16, 4)), ('fwd', 2, 1024, 2048, R(32, 4, 8)), ('bwd', 2, 128, 256, R(16, 8, 2)), ('bwd', 2, 1024, 2048, R(32, 4, 8))); k.STAGED_WARP_COLUMNS = {**k.STAGED_WARP_COLUMNS, ('fwd', 4): (512, 2048)}; k.STAGED_BLOCK_COLUMNS = {**k.STAGED_BLOCK_COLUMNS, ('fwd', 4): (16383, 1 << 62)}" \
  --variant "staged:$K; k.STAGED_WARP_COLUMNS = {**k.STAGED_WARP_COLUMNS, ('fwd', 2): (1024, 4096), ('bwd', 2): (512, 2048)}; k.STAGED_BLOCK_COLUMNS = {**k.STAGED_BLOCK_COLUMNS, ('fwd', 2): (8191, 1 << 62), ('bwd', 2): (8191, 1 << 62), ('fwd', 4): (8191, 1 << 62)}" \
  --variant "mixed:$K; k.STAGED_WARP_COLUMNS = {**k.STAGED_WARP_COLUMNS, ('fwd', 2): (1024, 8192)}; k.SOFTMAX_RULES = (('fwd', 2, 8192, 16384, R(512, 1, 4, 2)), ('bwd', 2, 1024, 2048, R(256, 1, 1, 1, 4)))"

[ "${PART:-all}" = cupy ] || tune --backend numba --ops softmax --dtypes bf16,fp32 \
  --cases 262144x256,131072x512,65536x1024 --directions forward,backward \
  --variant "base:" \
  --variant "block_per_row:$S; s.ROW_GROUP_MAX = {'forward': 0, 'backward': 0}" \
  --variant "max16:$S; s.ROW_GROUP_MAX = {'forward': 16, 'backward': 16}" \
  --variant "max32:$S; s.ROW_GROUP_MAX = {'forward': 32, 'backward': 32}"
