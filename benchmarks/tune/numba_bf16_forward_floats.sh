#!/usr/bin/env bash
# Session 16, numba's 16-bit block-sparse forward: held as words (the default: 32-64 values a lane by the mean row,
# the causal prefix counted before the loads) against the float kernel (16 values a lane; since 8098fe2 its causal
# prefix is counted while the first tile loads), and the float kernel at 16 or 32 by the mean row. Writes
# $OUT/numba_bs_bf16_floats.csv.
set -uo pipefail
OUT=${OUT:-/tmp/multisoft-tune}
mkdir -p "$OUT"
N='import multisoft_numba.blocksparse as n'
python3 benchmarks/tune/tune.py --backend numba --ops blocksparse_softmax --dtypes bf16 --cases b \
  --directions forward --csv "$OUT/numba_bs_bf16_floats.csv" --variant "words:" \
  --variant "floats:$N; n.PACK_16BIT = False" \
  --variant "floats16_32:$N; n.PACK_16BIT = False; n.FORWARD_FLOATS = {4: (16,), 2: (16, 32)}" \
  || echo "numba bf16 forward floats failed: rc=$?"
