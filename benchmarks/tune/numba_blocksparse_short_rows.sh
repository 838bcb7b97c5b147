#!/usr/bin/env bash
# Session 20, numba's 16-bit block-sparse rows held as words: the fewest values a lane PACKED_VALUES offered was 32
# (tiles of 1024), so rows of the 11 % layouts (about 460) fill half a tile and a block holds 56-64 registers a
# thread. base = that (the causal forward the fewest, 32); pv16f = also 16 values a lane (tiles of 512) for the
# forward, pv16 = for the backward too (its rule takes the most that the mean row fills, else the fewest), the causal
# forward then the fewest, 16; kept = the default since (16 offered, the causal forward from (16, 32) by the mean row).
# bf16, every layout. Writes $OUT/numba_blocksparse_short_rows.csv.
set -uo pipefail
OUT=${OUT:-/tmp/multisoft-tune}
mkdir -p "$OUT"
N='import multisoft_numba.blocksparse as n'
python3 benchmarks/tune/tune.py --backend numba --ops blocksparse_softmax --dtypes bf16 --cases b \
  --directions forward,backward --csv "$OUT/numba_blocksparse_short_rows.csv" \
  --variant "base:$N; n.PACKED_VALUES = {'forward': (32, 48, 64), 'causal': (32,), 'backward': (32, 48, 64)}" \
  --variant "pv16f:$N; n.PACKED_VALUES = {'forward': (16, 32, 48, 64), 'causal': (16,), 'backward': (32, 48, 64)}" \
  --variant "pv16:$N; n.PACKED_VALUES = {'forward': (16, 32, 48, 64), 'causal': (16,), 'backward': (16, 32, 48, 64)}" \
  --variant "kept:" \
  || echo "numba block-sparse short rows tuning failed: rc=$?"
