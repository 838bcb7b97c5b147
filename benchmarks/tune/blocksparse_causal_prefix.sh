#!/usr/bin/env bash
# Session 16: the causal mask's kept prefix from the front's look-up table (lut.causal, one load per row) instead of
# counted from the block columns (numba: by the lanes together; Triton's row kernels: by a loop over the columns; its
# tile kernels: a column load per block). Tree against REF_DIR (a copy of backends/ at the previous commit, e.g.
# `git archive <rev> backends/multisoft_numba backends/multisoft_triton | tar -x -C ab_ref --strip-components=1`),
# causal layouts, forward: Triton in one process each (rule; every layout on rows; tiles), numba by process_ab.sh.
# Writes $OUT/triton_causal_{tree,ref}.csv and $OUT/process_ab_*.csv. (Run with FORWARD_ROWS as pairs, before its
# (block, low, high) form: on that REF_DIR, $ALL needs pairs.)
set -uo pipefail
OUT=${OUT:-/tmp/multisoft-tune}
mkdir -p "$OUT"
CAUSAL="b16 25% causal,b32 26% causal,b64 26% causal,b128 28% causal,b64 11% causal,b64 51% causal"
T='import multisoft_triton.blocksparse as b'
ALL="b.FORWARD_ROWS = {c: {4: (128, 0, 1e9), 2: (128, 0, 1e9)} for c in (False, True)}"
triton() {
  python3 benchmarks/tune/tune.py --backend triton --ops blocksparse_softmax --dtypes fp32,bf16 --cases "$CAUSAL" \
    --directions forward --csv "$OUT/triton_causal_$1.csv" --variant "$1-rule:" --variant "$1-rows:$T; $ALL" \
    --variant "$1-tiles:$T; b.ROW_FORWARD = 'tiles'" || echo "triton causal ($1) failed: rc=$?"
}
REF=$(cd "$REF_DIR" && pwd)
triton tree
PYTHONPATH="$REF${PYTHONPATH:+:$PYTHONPATH}" triton ref
BACKEND=numba OPS=blocksparse_softmax CASES="$CAUSAL" DIRECTIONS=forward bash benchmarks/tune/process_ab.sh
