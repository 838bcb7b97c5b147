#!/usr/bin/env bash
# Session 24: the block-sparse row kernels of Triton, CuPy and numba taking the rows from the last (each backend's
# LAST_FIRST setting) against layout order. A causal layout's block-rows grow down the layout, so in layout order
# the grid ends on a wave of its longest rows. Every layout, fp32 and bf16, forward and backward, one process per
# backend: layout order, last first, layout order again (the spread between the two is the noise).
# Writes $OUT/last_first_{triton,cupy,numba}.csv.
set -uo pipefail
OUT=${OUT:-/tmp/multisoft-tune}
mkdir -p "$OUT"
for backend in triton cupy numba; do
  case $backend in
    triton) set_order() { echo "import multisoft_triton.blocksparse as b; b.ROW_LAST_FIRST = {'forward': $1, 'backward': $1}"; } ;;
    cupy) set_order() { echo "import multisoft_cupy.blocksparse as b; b.LAST_FIRST = {'fwd': $1, 'bwd': $1}"; } ;;
    numba) set_order() { echo "import multisoft_numba.blocksparse as b; b.LAST_FIRST = {'forward': $1, 'backward': $1}"; } ;;
  esac
  python3 benchmarks/tune/tune.py --backend $backend --ops blocksparse_softmax --dtypes fp32,bf16 --cases b \
    --directions forward,backward --csv "$OUT/last_first_$backend.csv" \
    --variant "layout_order:$(set_order False)" --variant "last_first:$(set_order True)" \
    --variant "layout_order_again:$(set_order False)" \
    || echo "$backend last-first tuning failed: rc=$?"
done
