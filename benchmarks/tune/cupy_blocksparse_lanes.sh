#!/usr/bin/env bash
# Session 21: CuPy's staged block-sparse forward with several rows a warp against a warp a row. ROUND 1 (settings
# since replaced, see tuning/cupy-blocksparse-lanes.txt): lanes per row set by the blocks a step covers. ROUND 2:
# lanes per row the power of two nearest the mean row's vectors over BLOCKSPARSE_STAGED_LANE_VECTORS (4, 8, 16),
# staged on every layout (BLOCKSPARSE_STAGED_FROM 0), 2 or 4 warps a block, against a warp a row (None) on the
# layouts with a mean row of 512 or more (the 11 % ones then take the register kernel). ROUND 3: the backward
# (register kernel) with lanes per row the power of two nearest the mean row's bytes over
# BLOCKSPARSE_BACKWARD_LANE_BYTES (64, 128, 256) against a warp a row (None).
# ROUND 4 (session 22, every lane count of the forward compiled as a constant): the staged forward's
# BLOCKSPARSE_STAGED_LANE_VECTORS (4, 8, 16) again. Writes $OUT/cupy_blocksparse_lanes_round$ROUND.csv.
set -uo pipefail
OUT=${OUT:-/tmp/multisoft-tune}
ROUND=${ROUND:-3}
mkdir -p "$OUT"
C='import multisoft_cupy._catalog as c'
if [ "$ROUND" = 4 ]; then
  VARIANTS=()
  for v in 8 4 16; do
    VARIANTS+=(--variant "v$v:$C; c.BLOCKSPARSE_STAGED_LANE_VECTORS = $v; c.BLOCKSPARSE_STAGED_FROM = 0; c.BLOCKSPARSE_STAGED_WARPS = 2")
  done
  python3 benchmarks/tune/tune.py --backend cupy --ops blocksparse_softmax --dtypes fp32,bf16 \
    --directions forward --csv "$OUT/cupy_blocksparse_lanes_round$ROUND.csv" "${VARIANTS[@]}" || echo "tune failed: rc=$?"
  exit 0
fi
if [ "$ROUND" = 3 ]; then
  VARIANTS=()
  for v in None 64 128 256; do
    VARIANTS+=(--variant "b$v:$C; c.BLOCKSPARSE_BACKWARD_LANE_BYTES = $v")
  done
  python3 benchmarks/tune/tune.py --backend cupy --ops blocksparse_softmax --dtypes fp32,bf16 \
    --directions backward --csv "$OUT/cupy_blocksparse_lanes_round$ROUND.csv" "${VARIANTS[@]}" || echo "tune failed: rc=$?"
  exit 0
fi
if [ "$ROUND" != 2 ]; then
  echo "round 1 set BLOCKSPARSE_STAGED_STEP_BLOCKS, since replaced: see tuning/cupy-blocksparse-lanes.txt"
  exit 1
fi
VARIANTS=(--variant "warp:$C; c.BLOCKSPARSE_STAGED_LANE_VECTORS = None; c.BLOCKSPARSE_STAGED_FROM = 512; c.BLOCKSPARSE_STAGED_WARPS = 2")
for v in 4 8 16; do
  VARIANTS+=(--variant "v$v:$C; c.BLOCKSPARSE_STAGED_LANE_VECTORS = $v; c.BLOCKSPARSE_STAGED_FROM = 0; c.BLOCKSPARSE_STAGED_WARPS = 2")
done
VARIANTS+=(--variant "v8-w4:$C; c.BLOCKSPARSE_STAGED_LANE_VECTORS = 8; c.BLOCKSPARSE_STAGED_FROM = 0; c.BLOCKSPARSE_STAGED_WARPS = 4")
VARIANTS+=(--variant "v8-w1:$C; c.BLOCKSPARSE_STAGED_LANE_VECTORS = 8; c.BLOCKSPARSE_STAGED_FROM = 0; c.BLOCKSPARSE_STAGED_WARPS = 1")
python3 benchmarks/tune/tune.py --backend cupy --ops blocksparse_softmax --dtypes fp32,bf16 \
  --directions forward --csv "$OUT/cupy_blocksparse_lanes_round$ROUND.csv" "${VARIANTS[@]}" || echo "tune failed: rc=$?"
