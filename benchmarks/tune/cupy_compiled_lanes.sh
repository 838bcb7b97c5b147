#!/usr/bin/env bash
# Session 22: CuPy's block-sparse staged forward and register backward with every lane count a row compiled as a
# constant (BLOCKSPARSE_COMPILED_LANES; the rows sharing a warp: bf16 25 % layouts 16 lanes, 11 % 8) against the
# defaults (a warp a row compiled, fewer lanes taken at launch; the backward's at launch). Every variant sets what it
# compares. Writes $OUT/cupy_compiled_lanes.csv.
set -uo pipefail
OUT=${OUT:-/tmp/multisoft-tune}
mkdir -p "$OUT"
C='import multisoft_cupy._catalog as c'
ALL="(1, 2, 4, 8, 16, 32)"
python3 benchmarks/tune/tune.py --backend cupy --ops blocksparse_softmax --dtypes fp32,bf16 --cases b \
  --directions forward,backward --csv "$OUT/cupy_compiled_lanes.csv" \
  --variant "base:$C; c.BLOCKSPARSE_COMPILED_LANES = {'fwd': (32,), 'bwd': ()}" \
  --variant "fwd_all:$C; c.BLOCKSPARSE_COMPILED_LANES = {'fwd': $ALL, 'bwd': ()}" \
  --variant "bwd_short:$C; c.BLOCKSPARSE_COMPILED_LANES = {'fwd': (32,), 'bwd': (1, 2, 4, 8, 16)}" \
  --variant "base_again:$C; c.BLOCKSPARSE_COMPILED_LANES = {'fwd': (32,), 'bwd': ()}" \
  || echo "cupy compiled lanes tuning failed: rc=$?"
