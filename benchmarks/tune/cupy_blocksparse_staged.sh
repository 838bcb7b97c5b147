#!/usr/bin/env bash
# Session 17: CuPy's block-sparse rows staged in shared memory (a warp per row, the row copied with cp.async into the
# warp's buffer, read from global memory once) against the register kernels (a tile of a warp's share in
# registers, longer rows read twice). Every layout, fp32 and bf16.
# ROUND 1: staged (forward and backward) / registers / 2 or 8 warps a block. ROUND 2: the forward's lean terms (max
# of raw pairs, one FMA and ex2 per element). ROUND 3: two buffers a warp, the next row copied during the current
# one, with persistent launches (as many blocks as fit, warps walking rows); not kept. ROUND 4: forward only, one
# buffer, a tree sum per vector; 4 vectors at once (UNROLL), register caps (MIN_BLOCKS), 2 warps, staged on every
# layout. ROUND 5: 2 warps a block (the default since round 4) against 4; register caps; buffers of up to 1024
# vectors (float32 rows of 4096 in one part). ROUND 6 (default): the buffer sized for the longest row or 1.25 x the
# mean row if less (the default since round 5) against the longest row. Writes
# $OUT/cupy_blocksparse_staged_round$ROUND.csv.
set -uo pipefail
OUT=${OUT:-/tmp/multisoft-tune}
ROUND=${ROUND:-6}
mkdir -p "$OUT"
B='import multisoft_cupy.blocksparse as b'
C='import multisoft_cupy._catalog as c'
if [ "$ROUND" = 4 ]; then
  VARIANTS=(--variant "staged:" --variant "registers:$B; b.STAGED = False" --variant "everywhere:$C; c.BLOCKSPARSE_STAGED_FROM = 0"
            --variant "unroll4:$C; c.BLOCKSPARSE_STAGED_UNROLL = 4" --variant "min12:$C; c.BLOCKSPARSE_STAGED_MIN_BLOCKS = 12"
            --variant "min16:$C; c.BLOCKSPARSE_STAGED_MIN_BLOCKS = 16"
            --variant "unroll4-min12:$C; c.BLOCKSPARSE_STAGED_UNROLL = 4; c.BLOCKSPARSE_STAGED_MIN_BLOCKS = 12"
            --variant "warps2:$C; c.BLOCKSPARSE_STAGED_WARPS = 2")
elif [ "$ROUND" = 5 ]; then
  VARIANTS=(--variant "warps2:" --variant "warps4:$C; c.BLOCKSPARSE_STAGED_WARPS = 4"
            --variant "warps2-min24:$C; c.BLOCKSPARSE_STAGED_MIN_BLOCKS = 24"
            --variant "warps2-min32:$C; c.BLOCKSPARSE_STAGED_MIN_BLOCKS = 32"
            --variant "cap1024:$C; c.BLOCKSPARSE_STAGED_CAPS = (64, 128, 256, 512, 1024)"
            --variant "registers:$B; b.STAGED = False")
elif [ "$ROUND" = 6 ]; then
  VARIANTS=(--variant "margin:" --variant "longest:$C; c.BLOCKSPARSE_STAGED_MARGIN = 1e9" --variant "registers:$B; b.STAGED = False")
else
  echo "rounds 1-3 ran kernels since replaced (their settings are gone): see tuning/cupy-blocksparse-staged.txt"
  exit 1
fi
python3 benchmarks/tune/tune.py --backend cupy --ops blocksparse_softmax --dtypes fp32,bf16 \
  --directions forward --csv "$OUT/cupy_blocksparse_staged_round$ROUND.csv" "${VARIANTS[@]}" || echo "tune failed: rc=$?"
