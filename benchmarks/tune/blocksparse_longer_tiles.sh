#!/usr/bin/env bash
# Session 16: tiles that hold more than the mean row, so that fewer rows of a 25 % layout (lengths about the mean
# +- 20 %) take a second tile and read their first again: CuPy's 16-bit forward at 40 values a thread (a 1280-element
# tile) against 32; numba's 16-bit forward held as words at 48 or 64 values a lane against the rule (the smallest
# choice whose tile holds the mean row: 32, a 1024-element tile). Writes $OUT/cupy_bs_f40.csv, $OUT/numba_bs_w48.csv.
set -uo pipefail
OUT=${OUT:-/tmp/multisoft-tune}
mkdir -p "$OUT"
python3 benchmarks/tune/tune.py --backend cupy --ops blocksparse_softmax --dtypes bf16 --cases b \
  --directions forward --csv "$OUT/cupy_bs_f40.csv" --variant "f32:" \
  --variant "f40:import multisoft_cupy.blocksparse as c; c.FORWARD_FLOATS = {4: (32,), 2: (40,)}" \
  || echo "cupy block-sparse 40 failed: rc=$?"
N='import multisoft_numba.blocksparse as n'
python3 benchmarks/tune/tune.py --backend numba --ops blocksparse_softmax --dtypes bf16 --cases b \
  --directions forward --csv "$OUT/numba_bs_w48.csv" --variant "rule:" \
  --variant "w48:$N; n.PACKED_VALUES = {'forward': (48, 64), 'backward': (32, 48, 64)}" \
  --variant "w64:$N; n.PACKED_VALUES = {'forward': (64,), 'backward': (32, 48, 64)}" \
  || echo "numba block-sparse 48 failed: rc=$?"
