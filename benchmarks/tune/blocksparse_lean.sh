#!/usr/bin/env bash
# CuPy block-sparse kernels rewritten for fewer instructions per element (session 14: a lane's vectors one stride
# apart, 32-bit row arithmetic, no per-element masks unless causal, raw words held in the backward) against the
# kernels before (REF_FILE, e.g. ab_ref/blocksparse.cu from `git show <rev>:backends/multisoft_cupy/blocksparse.cu`),
# then the values a thread holds and the register cap, which the leaner kernels may shift.
#   REF_FILE=ab_ref/blocksparse.cu bash benchmarks/tune/blocksparse_lean.sh
# Writes $OUT/cupy_ab.csv and $OUT/cupy_bs_lean.csv (ROUND=1, default), $OUT/cupy_bs_lean2.csv (ROUND=2).
set -uo pipefail
OUT=${OUT:-/tmp/multisoft-tune}
mkdir -p "$OUT"
export OUT
C='import multisoft_cupy.blocksparse as c; import multisoft_cupy._catalog as k'
if [ "${ROUND:-1}" = 1 ]; then
SOURCE=blocksparse.cu CASES=b DIRECTIONS=forward,backward bash benchmarks/tune/cupy_ab.sh
CAP="k.BLOCKSPARSE_CONFIGS = tuple(g._replace(min_blocks=6) if g.vpt <= 8 else g for g in k.BLOCKSPARSE_CONFIGS)"
python3 benchmarks/tune/tune.py --backend cupy --ops blocksparse_softmax --dtypes fp32,bf16 --cases b \
  --directions forward,backward --csv "$OUT/cupy_bs_lean.csv" --variant "tree:" \
  --variant "fwd64:$C; c.FORWARD_FLOATS = {4: (32, 64), 2: (32, 64)}" \
  --variant "bwd64:$C; c.BACKWARD_FLOATS = {4: (32, 64), 2: (32, 64)}" \
  --variant "cap6:$C; $CAP" \
  || echo "cupy block-sparse lean variants failed: rc=$?"
fi
# Round 2 (ROUND=2): tiles of 5 and 10 vectors (40 values per thread, a 1280-element tile that holds most rows of
# the 25 % layouts, whose mean row is just over 1024) and the tile sized for the layout's mean row instead of its
# longest (longer rows then take two tiles).
if [ "${ROUND:-1}" = 2 ]; then
  R='from multisoft_cupy._catalog import RowConfig as R'
  VPT5="$R; k.BLOCKSPARSE_CONFIGS = tuple(R(32, 4, v) for v in (2, 4, 5, 8, 10, 16)); c.FORWARD_FLOATS = {4: (40,), 2: (40,)}; c.BACKWARD_FLOATS = {4: (40, 64), 2: (40, 64)}"
  MEAN="import dataclasses, math; o = c._common; c._common = lambda d, lut, ch, o=o: o(d, dataclasses.replace(lut, max_blocks=math.ceil(lut.mean_blocks)), ch)"
  python3 benchmarks/tune/tune.py --backend cupy --ops blocksparse_softmax --dtypes fp32,bf16 --cases b \
    --directions forward,backward --csv "$OUT/cupy_bs_lean2.csv" --variant "tree:" \
    --variant "vpt5:$C; $VPT5" --variant "mean:$C; $MEAN" --variant "vpt5_mean:$C; $VPT5; $MEAN" \
    || echo "cupy block-sparse round 2 failed: rc=$?"
fi
