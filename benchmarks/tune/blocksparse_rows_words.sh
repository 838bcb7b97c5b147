#!/usr/bin/env bash
# Session 15, block-sparse. numba: 16-bit rows held as their words (PACK_16BIT, PACKED_VALUES: 32/48/64 values a
# lane by the mean row) against fixed 32 or 64 values and the float kernels (16 values, the rest re-read). Triton:
# the backward's row kernels (ROW_BACKWARD, a warp a row, ROW_CHUNK elements held) against the tile and loop
# kernels, with 1024 and 2048 elements held and 2 rows a program. Writes $OUT/numba_bs_words.csv and
# $OUT/triton_bs_rows.csv.
set -uo pipefail
OUT=${OUT:-/tmp/multisoft-tune}
mkdir -p "$OUT"
N='import multisoft_numba.blocksparse as n'
python3 benchmarks/tune/tune.py --backend numba --ops blocksparse_softmax --dtypes bf16 --cases b \
  --directions forward,backward --csv "$OUT/numba_bs_words.csv" --variant "words:" \
  --variant "w32:$N; n.PACKED_VALUES = {'forward': (32,), 'backward': (32,)}" \
  --variant "w64:$N; n.PACKED_VALUES = {'forward': (64,), 'backward': (64,)}" \
  --variant "floats:$N; n.PACK_16BIT = False" \
  || echo "numba block-sparse words failed: rc=$?"
T='import multisoft_triton.blocksparse as b'
python3 benchmarks/tune/tune.py --backend triton --ops blocksparse_softmax --dtypes fp32,bf16 --cases b \
  --directions backward --csv "$OUT/triton_bs_rows.csv" --variant "rows512:" \
  --variant "tiles:$T; b.ROW_BACKWARD = 'tiles'" \
  --variant "rows1024:$T; b.ROW_CHUNK = 1024" \
  --variant "rows2048:$T; b.ROW_CHUNK = 2048" \
  --variant "rows512w2:$T; b.ROW_WARPS = 2" \
  || echo "triton block-sparse rows failed: rc=$?"
