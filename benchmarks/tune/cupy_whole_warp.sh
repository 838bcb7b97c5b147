#!/usr/bin/env bash
# Session 22: CuPy's block-sparse staged forward and register backward with a warp a row compiled as such
# (BLOCKSPARSE_COMPILED_LANES, then BLOCKSPARSE_WHOLE_WARP; commit f5f0cb1) against every lane count taken at launch
# (session 21's kernels), every layout, both directions. Kept: the forward's. Writes $OUT/cupy_whole_warp.csv.
set -uo pipefail
OUT=${OUT:-/tmp/multisoft-tune}
mkdir -p "$OUT"
C='import multisoft_cupy._catalog as c'
python3 benchmarks/tune/tune.py --backend cupy --ops blocksparse_softmax --dtypes fp32,bf16 --cases b \
  --directions forward,backward --csv "$OUT/cupy_whole_warp.csv" \
  --variant "runtime:$C; c.BLOCKSPARSE_COMPILED_LANES = {'fwd': (), 'bwd': ()}" \
  --variant "whole:$C; c.BLOCKSPARSE_COMPILED_LANES = {'fwd': (32,), 'bwd': (32,)}" \
  --variant "runtime_again:$C; c.BLOCKSPARSE_COMPILED_LANES = {'fwd': (), 'bwd': ()}" \
  || echo "cupy whole-warp tuning failed: rc=$?"
