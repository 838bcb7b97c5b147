#!/usr/bin/env bash
# Session 23: Triton's block-sparse row kernels with the slab as [BLOCKS // INNER, ROWS, INNER, B], INNER blocks of
# a row side by side in a warp's lanes in 16-byte pieces (ROW_INNER; None: as many as fill the warp's 32 lanes, a
# warp a row, so that a row's max and sum are warp shuffles), against [ROWS, BLOCKS, B], whose layout spreads a
# row of a 4-row program over two warps (its reductions through shared memory and barriers).
#   ROUND=1: the working tree's package against the one in REF_DIR (the kernels before), in separate processes
#            (process_ab.sh): every layout, fp32 and bf16, forward and backward.
#   ROUND=2: the forward's 16-bit rows held as loaded (FORWARD_RAW, FORWARD_RAW_HELD elements), their terms
#            formed again for the output, against terms held as float32.
#   ROUND=4: round 1, then blocks of a row side by side in a warp (ROW_INNER) by direction (the streamed
#            variants of this round did not compile: a loop-carried name changed shape; fixed for round 5).
#   ROUND=5: the forward's rows past their held blocks streamed 2 or 4 blocks at a time (FORWARD_STREAM), fp32
#            forward rows at 4 blocks side by side, and the rule before (a warp a row in both directions).
# Round 2 also timed the backward at 32, 16 and 8 lanes a row, and round 3 rows sharing a warp with fewer warps a
# program, through a setting (ROW_LANES) that is gone: their numbers are in tuning/triton-blocksparse-warp-rows.txt.
# Every variant sets what it compares. Writes $OUT/process_ab_{tree,ref,tree_again}.csv (rounds 1 and 4),
# $OUT/triton_blocksparse_warp_rows_forward.csv (round 2), $OUT/triton_blocksparse_inner.csv (round 4),
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
if [ "$ROUND" = 2 ]; then
  python3 benchmarks/tune/tune.py --backend triton --ops blocksparse_softmax --dtypes bf16 --cases b \
    --directions forward --csv "$OUT/triton_blocksparse_warp_rows_forward.csv" \
    --variant "float_terms:$T; t.ROW_INNER = {'forward': {4: None, 2: None}, 'backward': {4: None, 2: None}}; t.FORWARD_RAW = False" \
    --variant "raw512:$T; t.ROW_INNER = {'forward': {4: None, 2: None}, 'backward': {4: None, 2: None}}; t.FORWARD_RAW = True; t.FORWARD_RAW_HELD = 512" \
    --variant "raw1024:$T; t.ROW_INNER = {'forward': {4: None, 2: None}, 'backward': {4: None, 2: None}}; t.FORWARD_RAW = True; t.FORWARD_RAW_HELD = 1024" \
    --variant "raw2048:$T; t.ROW_INNER = {'forward': {4: None, 2: None}, 'backward': {4: None, 2: None}}; t.FORWARD_RAW = True; t.FORWARD_RAW_HELD = 2048" \
    || echo "triton block-sparse raw forward tuning failed: rc=$?"
fi
if [ "$ROUND" = 4 ]; then
  inner() {   # blocks of a row side by side in a warp: forward, backward; blocks the forward streams at a time
    echo "$T; t.FORWARD_RAW = False; t.ROW_INNER = {'forward': {4: $1, 2: $1}, 'backward': {4: $2, 2: $2}}; t.FORWARD_STREAM = ${3:-None}"
  }
  python3 benchmarks/tune/tune.py --backend triton --ops blocksparse_softmax --dtypes fp32,bf16 --cases b \
    --directions forward,backward --csv "$OUT/triton_blocksparse_inner.csv" \
    --variant "warp_rows:$(inner None None)" --variant "inner2:$(inner 2 2)" --variant "inner1:$(inner 1 1)" \
    --variant "inner4:$(inner 4 4)" --variant "stream4:$(inner None 2 4)" \
    --variant "inner2_stream2:$(inner 2 2 2)" \
    || echo "triton block-sparse inner tuning failed: rc=$?"
fi
if [ "$ROUND" = 5 ]; then
  stream() {   # the forward's blocks of a row side by side in a warp, fp32 and bf16; blocks streamed at a time
    echo "$T; t.FORWARD_RAW = False; t.ROW_INNER = {'forward': {4: $1, 2: $2}, 'backward': {4: 2, 2: 2}}; t.FORWARD_STREAM = $3"
  }
  python3 benchmarks/tune/tune.py --backend triton --ops blocksparse_softmax --dtypes fp32,bf16 --cases b \
    --directions forward --csv "$OUT/triton_blocksparse_stream.csv" \
    --variant "chosen:$(stream None 2 None)" --variant "stream4:$(stream None 2 4)" \
    --variant "stream2:$(stream None 2 2)" --variant "fp32_inner4:$(stream 4 2 None)" \
    --variant "old_rule:$(stream None None None)" \
    || echo "triton block-sparse stream tuning failed: rc=$?"
fi
