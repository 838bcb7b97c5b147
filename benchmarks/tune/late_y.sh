#!/usr/bin/env bash
# The split log_softmax backward loading y after publishing its chunk's sum(dy), while it waits for the row,
# against loading y with dy (all three backends). Triton: SPLIT_LATE_Y in one process; CuPy: cupy_ab.sh
# against REF_FILE (softmax.cu before the change); numba: process_ab.sh against REF_DIR (the package before).
# Session 12 ran it with a flat SPLIT_LATE_Y (late: True, early: False) and the late loads in the CuPy and numba
# trees; those were not kept, so their A/Bs now compare the same code unless REF_FILE / REF_DIR hold a variant.
#   REF_FILE=ab_ref/softmax.cu REF_DIR=ab_ref bash benchmarks/tune/late_y.sh
set -uo pipefail
OUT=${OUT:-/tmp/multisoft-tune}
mkdir -p "$OUT"
CASES=${CASES:-4096x32768,1024x131072,512x262144}
python3 benchmarks/tune/tune.py --backend triton --ops log_softmax,softmax --dtypes fp32,bf16 --cases "$CASES" \
  --directions backward --csv "$OUT/late_y_triton.csv" --variant "default:" \
  --variant "early:import multisoft_triton.softmax as s; s.SPLIT_LATE_Y = {4: False, 2: False}" \
  --variant "late_all:import multisoft_triton.softmax as s; s.SPLIT_LATE_Y = {4: True, 2: True}" \
  || echo "triton late_y failed: rc=$?"
OPS=log_softmax,softmax CASES="$CASES" DIRECTIONS=backward REF_FILE="$REF_FILE" bash benchmarks/tune/cupy_ab.sh
OPS=log_softmax,softmax CASES="$CASES" DIRECTIONS=backward BACKEND=numba REF_DIR="$REF_DIR" \
  bash benchmarks/tune/process_ab.sh
