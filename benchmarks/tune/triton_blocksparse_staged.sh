#!/usr/bin/env bash
# Session 28: Triton's block-sparse forward as persistent programs that take whole rows (ROWS a task, one launch per
# power of two of the block-rows' block counts) a grid apart, the pipeliner (tl.range num_stages) copying the next
# tasks' rows into shared memory (cp.async) while the current one is reduced (_fwd_staged_kernel), against the row
# kernels (off). A variant is FORWARD_STAGED's (stages, rows a task, warps a multiprocessor, elements of a row a
# warp); s1 is the same programs without the pipeline. Every layout, fp32 and bf16, forward. Writes
# $OUT/triton_blocksparse_staged.csv.
set -uo pipefail
OUT=${OUT:-/tmp/multisoft-tune}
mkdir -p "$OUT"
T='import multisoft_triton.blocksparse as t'
python3 benchmarks/tune/tune.py --backend triton --ops blocksparse_softmax --dtypes fp32,bf16 --cases b \
  --directions forward --csv "$OUT/triton_blocksparse_staged.csv" \
  --variant "off:$T; t.FORWARD_STAGED = {}" \
  --variant "s3-r1-w32-e1024:$T; t.FORWARD_STAGED = {4: (3, 1, 32, 1024), 2: (3, 1, 32, 1024)}" \
  --variant "s3-r1-w48-e1024:$T; t.FORWARD_STAGED = {4: (3, 1, 48, 1024), 2: (3, 1, 48, 1024)}" \
  --variant "s3-r1-w24-e1024:$T; t.FORWARD_STAGED = {4: (3, 1, 24, 1024), 2: (3, 1, 24, 1024)}" \
  --variant "s2-r1-w48-e1024:$T; t.FORWARD_STAGED = {4: (2, 1, 48, 1024), 2: (2, 1, 48, 1024)}" \
  --variant "s4-r1-w48-e1024:$T; t.FORWARD_STAGED = {4: (4, 1, 48, 1024), 2: (4, 1, 48, 1024)}" \
  --variant "s3-r1-w48-e512:$T; t.FORWARD_STAGED = {4: (3, 1, 48, 512), 2: (3, 1, 48, 512)}" \
  --variant "s3-r4-w48-e1024:$T; t.FORWARD_STAGED = {4: (3, 4, 48, 1024), 2: (3, 4, 48, 1024)}" \
  --variant "s1-r1-w48-e1024:$T; t.FORWARD_STAGED = {4: (1, 1, 48, 1024), 2: (1, 1, 48, 1024)}" \
  || echo "triton block-sparse staged tuning failed: rc=$?"
