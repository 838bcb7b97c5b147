#!/usr/bin/env bash
# Session 21: CuPy's staged block-sparse forward with several rows a warp (BLOCKSPARSE_STAGED_STEP_BLOCKS: lanes
# per row = the row's pieces of that many blocks a step, B / VEC vectors each) against a warp a row (32), on the
# layouts it stages today (mean row 512 or more) and on every layout (BLOCKSPARSE_STAGED_FROM 0: the 11 % ones
# too). Writes $OUT/cupy_blocksparse_lanes_round$ROUND.csv.
set -uo pipefail
OUT=${OUT:-/tmp/multisoft-tune}
ROUND=${ROUND:-1}
mkdir -p "$OUT"
C='import multisoft_cupy._catalog as c'
VARIANTS=(--variant "warp:$C; c.BLOCKSPARSE_STAGED_STEP_BLOCKS = 32; c.BLOCKSPARSE_STAGED_FROM = 512"
          --variant "step1:$C; c.BLOCKSPARSE_STAGED_STEP_BLOCKS = 1; c.BLOCKSPARSE_STAGED_FROM = 512"
          --variant "step2:$C; c.BLOCKSPARSE_STAGED_STEP_BLOCKS = 2; c.BLOCKSPARSE_STAGED_FROM = 512"
          --variant "step4:$C; c.BLOCKSPARSE_STAGED_STEP_BLOCKS = 4; c.BLOCKSPARSE_STAGED_FROM = 512"
          --variant "step1-all:$C; c.BLOCKSPARSE_STAGED_STEP_BLOCKS = 1; c.BLOCKSPARSE_STAGED_FROM = 0"
          --variant "step2-all:$C; c.BLOCKSPARSE_STAGED_STEP_BLOCKS = 2; c.BLOCKSPARSE_STAGED_FROM = 0"
          --variant "step1-w4:$C; c.BLOCKSPARSE_STAGED_STEP_BLOCKS = 1; c.BLOCKSPARSE_STAGED_FROM = 512; c.BLOCKSPARSE_STAGED_WARPS = 4")
python3 benchmarks/tune/tune.py --backend cupy --ops blocksparse_softmax --dtypes fp32,bf16 \
  --directions forward --csv "$OUT/cupy_blocksparse_lanes_round$ROUND.csv" "${VARIANTS[@]}" || echo "tune failed: rc=$?"
