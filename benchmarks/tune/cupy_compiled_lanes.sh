#!/usr/bin/env bash
# Session 22: CuPy's block-sparse staged forward and register backward with lanes a row compiled as constants
# (BLOCKSPARSE_COMPILED_LANES), every layout, both directions. ROUND 1 (tuning/cupy-whole-warp.txt; the setting was
# then BLOCKSPARSE_WHOLE_WARP, commit f5f0cb1): a warp a row so compiled against every lane count taken at launch
# (session 21's kernels); kept: the forward's. ROUND 2 (tuning/cupy-compiled-lanes.txt): every lane count of the
# staged forward (the rows sharing a warp: bf16 25 % layouts 16 lanes, 11 % 8), and the backward's fewer lanes,
# against round 1's choice. Every variant sets what it compares. Writes $OUT/cupy_compiled_lanes_round$ROUND.csv.
set -uo pipefail
OUT=${OUT:-/tmp/multisoft-tune}
ROUND=${ROUND:-2}
mkdir -p "$OUT"
C='import multisoft_cupy._catalog as c; c.BLOCKSPARSE_COMPILED_LANES ='
if [ "$ROUND" = 1 ]; then
  VARIANTS=(--variant "runtime:$C {'fwd': (), 'bwd': ()}"
            --variant "whole:$C {'fwd': (32,), 'bwd': (32,)}"
            --variant "runtime_again:$C {'fwd': (), 'bwd': ()}")
else
  VARIANTS=(--variant "base:$C {'fwd': (32,), 'bwd': ()}"
            --variant "fwd_all:$C {'fwd': (1, 2, 4, 8, 16, 32), 'bwd': ()}"
            --variant "bwd_short:$C {'fwd': (32,), 'bwd': (1, 2, 4, 8, 16)}"
            --variant "base_again:$C {'fwd': (32,), 'bwd': ()}")
fi
python3 benchmarks/tune/tune.py --backend cupy --ops blocksparse_softmax --dtypes fp32,bf16 --cases b \
  --directions forward,backward --csv "$OUT/cupy_compiled_lanes_round$ROUND.csv" "${VARIANTS[@]}" \
  || echo "cupy compiled lanes tuning failed: rc=$?"
