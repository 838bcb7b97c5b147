#!/usr/bin/env bash
# Session 21: numba's block-sparse kernels with several rows a warp (ROW_LANE_BYTES: lanes per row the power of
# two nearest the mean row's bytes over it) against a warp a row (None), forward and backward, fp32 and bf16, every
# layout (each variant the same for both directions); lanes128-c64 also lets the causal 16-bit forward hold 64
# values a lane. Every variant sets what it compares. Kept: forward 128, backward 64. Writes $OUT/numba_blocksparse_lanes.csv.
set -uo pipefail
OUT=${OUT:-/tmp/multisoft-tune}
mkdir -p "$OUT"
N='import multisoft_numba.blocksparse as n'
PV="n.PACKED_VALUES = {'forward': (16, 32, 48, 64), 'causal': (16, 32), 'backward': (16, 32, 48, 64)}"
PV64="n.PACKED_VALUES = {'forward': (16, 32, 48, 64), 'causal': (16, 32, 64), 'backward': (16, 32, 48, 64)}"
python3 benchmarks/tune/tune.py --backend numba --ops blocksparse_softmax --dtypes fp32,bf16 --cases b \
  --directions forward,backward --csv "$OUT/numba_blocksparse_lanes.csv" \
  --variant "warp:$N; n.ROW_LANE_BYTES = {'forward': None, 'backward': None}; $PV" \
  --variant "lanes64:$N; n.ROW_LANE_BYTES = {'forward': 64, 'backward': 64}; $PV" \
  --variant "lanes128:$N; n.ROW_LANE_BYTES = {'forward': 128, 'backward': 128}; $PV" \
  --variant "lanes256:$N; n.ROW_LANE_BYTES = {'forward': 256, 'backward': 256}; $PV" \
  --variant "lanes128-c64:$N; n.ROW_LANE_BYTES = {'forward': 128, 'backward': 128}; $PV64" \
  || echo "numba block-sparse lanes tuning failed: rc=$?"
