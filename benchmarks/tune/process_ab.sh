#!/usr/bin/env bash
# A/B of a whole backend package in separate processes, one after another in one GPU session: the working
# tree's backends/$PACKAGE (`tree`), a copy of it at git revision REF or in folder REF_DIR (`ref`, put first
# on the path), and the tree again. For backends whose kernels cannot be swapped inside one process (numba
# compiles and caches them per function); CuPy has cupy_ab.sh. Each process measures its own copy.
#   BACKEND=numba REF_DIR=ab_ref CASES=1024x131072 DTYPES=bf16 DIRECTIONS=forward bash benchmarks/tune/process_ab.sh
# Writes $OUT/process_ab_{tree,ref,tree_again}.csv.
set -uo pipefail
OUT=${OUT:-/tmp/multisoft-tune}
BACKEND=${BACKEND:-numba}
PACKAGE=multisoft_$BACKEND
mkdir -p "$OUT"
REF_PATH=$(mktemp -d)
if [ -n "${REF_DIR:-}" ]; then
  cp -r "$REF_DIR/$PACKAGE" "$REF_PATH/"
else
  git archive "${REF:-HEAD}" "backends/$PACKAGE" | tar -x -C "$REF_PATH" --strip-components=1 \
    || { echo "no backends/$PACKAGE at ${REF:-HEAD}"; exit 1; }
fi
run() {
  python3 benchmarks/tune/tune.py --backend "$BACKEND" --ops "${OPS:-softmax,log_softmax}" \
    --dtypes "${DTYPES:-fp32,bf16}" --cases "${CASES:-1024x131072,512x262144}" \
    --directions "${DIRECTIONS:-forward,backward}" --csv "$OUT/process_ab_$1.csv" --variant "$1:" \
    || echo "process A/B ($1) failed: rc=$?"
}
run tree
PYTHONPATH="$REF_PATH${PYTHONPATH:+:$PYTHONPATH}" run ref
run tree_again
rm -rf "$REF_PATH"
