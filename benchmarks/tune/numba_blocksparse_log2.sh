#!/usr/bin/env bash
# Session 18, numba block-sparse forward in log2 units (scores c * x with c = scale * log2(e), each term one ex2;
# the lanes' (max, sum) merged as a max, then a sum of rescaled sums: lanes_merge_log2) against REF_DIR, a copy of
# backends/ at the commit before (`git archive <rev> backends/multisoft_numba | tar -x -C ab_ref
# --strip-components=1`), every layout, forward, by process_ab.sh. Writes $OUT/process_ab_*.csv.
set -uo pipefail
BACKEND=numba OPS=blocksparse_softmax CASES=b DTYPES=fp32,bf16 DIRECTIONS=forward \
  bash benchmarks/tune/process_ab.sh
