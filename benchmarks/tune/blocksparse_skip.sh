#!/usr/bin/env bash
# CuPy and numba block-sparse (session 13): vectors past the row's end for the whole warp skipped instead of
# computed on as padding (the tree) against the kernels before (REF_FILE: the CuPy blocksparse.cu, REF_DIR: a folder
# holding the numba package), then the values a thread holds, which the skip makes cheaper to raise.
#   REF_FILE=ab_ref/blocksparse.cu REF_DIR=ab_ref bash benchmarks/tune/blocksparse_skip.sh
# Writes $OUT/cupy_ab.csv, $OUT/process_ab_*.csv, $OUT/cupy_bs_floats.csv, $OUT/numba_bs_floats.csv. (Session 13 ran it
# with the skip in the tree, since reverted, and the values per thread as one setting, since by element size.)
set -uo pipefail
OUT=${OUT:-/tmp/multisoft-tune}
mkdir -p "$OUT"
export OUT
SOURCE=blocksparse.cu CASES=b DIRECTIONS=forward,backward bash benchmarks/tune/cupy_ab.sh
BACKEND=numba OPS=blocksparse_softmax CASES=b bash benchmarks/tune/process_ab.sh
C='import multisoft_cupy.blocksparse as c'
python3 benchmarks/tune/tune.py --backend cupy --ops blocksparse_softmax --dtypes fp32,bf16 --cases b \
  --directions forward,backward --csv "$OUT/cupy_bs_floats.csv" --variant "floats32:" \
  --variant "fwd64:$C; c.FORWARD_FLOATS = {4: (64,), 2: (64,)}" \
  --variant "bwd64:$C; c.BACKWARD_FLOATS = {4: (64,), 2: (64,)}" \
  || echo "cupy block-sparse floats failed: rc=$?"
N='import multisoft_numba.blocksparse as n'
python3 benchmarks/tune/tune.py --backend numba --ops blocksparse_softmax --dtypes fp32,bf16 --cases b \
  --directions forward,backward --csv "$OUT/numba_bs_floats.csv" --variant "floats16:" \
  --variant "fwd32:$N; n.FORWARD_FLOATS = {4: (32,), 2: (32,)}" \
  --variant "fwd16_32_64:$N; n.FORWARD_FLOATS = {4: (16, 32, 64), 2: (16, 32, 64)}" \
  --variant "bwd16_32:$N; n.BACKWARD_FLOATS = {4: (16, 32), 2: (16, 32)}" || echo "numba block-sparse floats failed: rc=$?"
