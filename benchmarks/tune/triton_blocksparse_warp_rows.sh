#!/usr/bin/env bash
# Session 23: Triton's block-sparse row kernels with the slab as [BLOCKS // INNER, ROWS, INNER, B], INNER blocks of
# a row side by side in a warp's lanes in 16-byte pieces (ROW_INNER by direction and element size; None: as many
# as fill the warp's 32 lanes, a warp a row, so that a row's max and sum are warp shuffles), against
# [ROWS, BLOCKS, B], whose layout spreads a row of a 4-row program over two warps (its reductions through shared
# memory and barriers).
#   ROUND=1: the working tree's package against the one in REF_DIR (the kernels before), in separate processes
#            (process_ab.sh): every layout, fp32 and bf16, forward and backward.
#   ROUND=4: round 1, then ROW_INNER by direction: a warp a row, or 1, 2 or 4 blocks side by side.
#   ROUND=5: the forward's ROW_INNER by element size: the kept rule (fp32 a warp a row, bf16 2 blocks), fp32 at 4
#            blocks, and a warp a row for both.
# Rounds 2 and 3, and round 5's streamed variants, timed settings that are gone (FORWARD_RAW, ROW_LANES,
# FORWARD_STREAM; their code: commits c5d9598, a85cec0 and bbbeac7); the numbers are in
# tuning/triton-blocksparse-warp-rows.txt. Every variant sets what it compares. Writes
# $OUT/process_ab_{tree,ref,tree_again}.csv (rounds 1 and 4), $OUT/triton_blocksparse_inner.csv (round 4),
# $OUT/triton_blocksparse_stream.csv (round 5).
set -uo pipefail
OUT=${OUT:-/tmp/multisoft-tune}
mkdir -p "$OUT"
ROUND=${ROUND:-1}
T='import multisoft_triton.blocksparse as t'
if [ "$ROUND" = 1 ] || [ "$ROUND" = 4 ]; then
  BACKEND=triton OPS=blocksparse_softmax DTYPES=fp32,bf16 CASES=b DIRECTIONS=forward,backward \
    bash benchmarks/tune/process_ab.sh
fi
inner() {   # ROW_INNER: forward fp32, forward bf16, backward (both sizes)
  echo "$T; t.ROW_INNER = {'forward': {4: $1, 2: $2}, 'backward': {4: $3, 2: $3}}"
}
if [ "$ROUND" = 4 ]; then
  python3 benchmarks/tune/tune.py --backend triton --ops blocksparse_softmax --dtypes fp32,bf16 --cases b \
    --directions forward,backward --csv "$OUT/triton_blocksparse_inner.csv" \
    --variant "warp_rows:$(inner None None None)" --variant "inner2:$(inner 2 2 2)" \
    --variant "inner1:$(inner 1 1 1)" --variant "inner4:$(inner 4 4 4)" \
    || echo "triton block-sparse inner tuning failed: rc=$?"
fi
if [ "$ROUND" = 5 ]; then
  python3 benchmarks/tune/tune.py --backend triton --ops blocksparse_softmax --dtypes fp32,bf16 --cases b \
    --directions forward --csv "$OUT/triton_blocksparse_stream.csv" \
    --variant "chosen:$(inner None 2 2)" --variant "fp32_inner4:$(inner 4 2 2)" \
    --variant "old_rule:$(inner None None 2)" \
    || echo "triton block-sparse forward inner tuning failed: rc=$?"
fi
