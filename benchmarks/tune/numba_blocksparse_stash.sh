#!/usr/bin/env bash
# Session 20, numba block-sparse rows longer than one tile: the second pass takes the first tiles from shared memory,
# where the first pass kept them, against reading them again (off): the forwards as many as the layout's longest row
# has but its last (STASH_ROW "longest") or its mean row (mean), in at most STASH_BYTES a block (48 KiB, or 24 KiB:
# s24k, mean24k; mean, 48 KiB, is the default since); the float backward at most BACKWARD_STASH_TILES (1). Every
# layout, forward and backward. Writes $OUT/numba_blocksparse_stash.csv.
set -uo pipefail
OUT=${OUT:-/tmp/multisoft-tune}
mkdir -p "$OUT"
N='import multisoft_numba.blocksparse as n'
python3 benchmarks/tune/tune.py --backend numba --ops blocksparse_softmax --dtypes fp32,bf16 --cases b \
  --directions forward,backward --csv "$OUT/numba_blocksparse_stash.csv" \
  --variant "off:$N; n.STASH_BYTES = 0" \
  --variant "s48k:$N; n.STASH_ROW = 'longest'" \
  --variant "s24k:$N; n.STASH_ROW = 'longest'; n.STASH_BYTES = 24 * 1024" \
  --variant "mean:$N; n.STASH_ROW = 'mean'" \
  --variant "mean24k:$N; n.STASH_ROW = 'mean'; n.STASH_BYTES = 24 * 1024" \
  || echo "numba block-sparse stash tuning failed: rc=$?"
