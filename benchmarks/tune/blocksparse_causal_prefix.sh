#!/usr/bin/env bash
# Session 16: the causal mask's kept prefix from the front's look-up table (lut.causal, one load per row) instead of
# counted from the block columns (numba: by the lanes together; Triton's row kernels: by a loop over the columns; its
# tile kernels: a column load per block). Tree against REF_DIR (a copy of backends/ at the previous commit, e.g.
# `git archive <rev> backends/multisoft_numba backends/multisoft_triton | tar -x -C ab_ref --strip-components=1`),
# causal layouts, forward: Triton in one process each (rule; every layout on rows; tiles), numba by process_ab.sh.
# Writes $OUT/triton_causal_{tree,ref}.csv and $OUT/process_ab_*.csv. (Run with FORWARD_ROWS as pairs, before its
# (block, low, high) form: on that REF_DIR, $ALL needs pairs.) Since session 18 the Triton forward has neither setting:
# its part is gone from here (`git show 1eaf011:benchmarks/tune/blocksparse_causal_prefix.sh`); numba's remains.
set -uo pipefail
OUT=${OUT:-/tmp/multisoft-tune}
mkdir -p "$OUT"
CAUSAL="b16 25% causal,b32 26% causal,b64 26% causal,b128 28% causal,b64 11% causal,b64 51% causal"
BACKEND=numba OPS=blocksparse_softmax CASES="$CAUSAL" DIRECTIONS=forward bash benchmarks/tune/process_ab.sh
