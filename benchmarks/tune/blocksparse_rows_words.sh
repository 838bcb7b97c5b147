#!/usr/bin/env bash
# Session 15, block-sparse. numba: 16-bit rows held as their words (PACK_16BIT, PACKED_VALUES: 32/48/64 values a
# lane by the mean row) against fixed 32 or 64 values and the float kernels (16 values, the rest re-read). Triton:
# the backward's row kernels (ROW_BACKWARD, a warp a row, ROW_HELD elements held) against the tile and loop
# kernels, with 1024 and 2048 elements held and 2 rows a program. Writes $OUT/numba_bs_words.csv and
# $OUT/triton_bs_rows.csv. (Round 1 ran before the rules by the mean row: there "rows512" held 512 elements
# everywhere, as ROW_HELD alone, "rows1024"/"rows2048" set the one chunk these settings replace.)
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
  --directions backward --csv "$OUT/triton_bs_rows.csv" --variant "rows:" \
  --variant "tiles:$T; b.ROW_BACKWARD = 'tiles'" \
  --variant "rows512:$T; b.ROW_HELD_LONG = 512; b.ROW_MIN_BLOCKS = {4: 1, 2: 1}; b.TILES_FROM = {4: 1e9, 2: 1e9}" \
  --variant "rows1024:$T; b.ROW_HELD = b.ROW_HELD_LONG = 1024; b.TILES_FROM = {4: 1e9, 2: 1e9}" \
  --variant "rows512w2:$T; b.ROW_WARPS = 2" \
  || echo "triton block-sparse rows failed: rc=$?"
