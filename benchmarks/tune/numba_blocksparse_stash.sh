#!/usr/bin/env bash
# Session 20, numba block-sparse rows longer than one tile: the second pass takes the first tiles from shared memory,
# where the first pass kept them (STASH_BYTES a block, default 48 KiB), against reading them again (off), every
# layout, forward and backward; s24k = at most 24 KiB a block; s48k_f32 = also 32 float32 values a lane forward for
# rows over 512 (fewer, longer tiles). Writes $OUT/numba_blocksparse_stash.csv.
set -uo pipefail
OUT=${OUT:-/tmp/multisoft-tune}
mkdir -p "$OUT"
N='import multisoft_numba.blocksparse as n'
python3 benchmarks/tune/tune.py --backend numba --ops blocksparse_softmax --dtypes fp32,bf16 --cases b \
  --directions forward,backward --csv "$OUT/numba_blocksparse_stash.csv" \
  --variant "off:$N; n.STASH_BYTES = 0" \
  --variant "s48k:" \
  --variant "s24k:$N; n.STASH_BYTES = 24 * 1024" \
  --variant "s48k_f32:$N; n.FORWARD_FLOATS = {4: (16, 32), 2: (16,)}" \
  || echo "numba block-sparse stash tuning failed: rc=$?"
