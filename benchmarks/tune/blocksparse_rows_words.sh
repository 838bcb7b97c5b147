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
T='import multisoft_triton.blocksparse as b'
if [ "${ROUND:-1}" = 3 ]; then
  # Round 3: CuPy's 16-bit forward holding its tiles as loaded (bs_fwd_row_words, in the tree of commit 9401adc,
  # reverted after) against the float kernels (REF_FILE, e.g. ab_ref/blocksparse.cu from `git show <rev>:backends/multisoft_cupy/blocksparse.cu`), at
  # 32 values a thread (the default), 40, and 40 or 64 with the registers capped (min blocks 8 or 6); numba's 16-bit
  # forward with 40 values a lane among its choices. Writes $OUT/cupy_ab.csv, $OUT/cupy_bs_words.csv and
  # $OUT/numba_bs_fwd40.csv.
  export OUT
  SOURCE=blocksparse.cu CASES=b DTYPES=bf16 DIRECTIONS=forward bash benchmarks/tune/cupy_ab.sh
  C='import multisoft_cupy.blocksparse as c; import multisoft_cupy._catalog as k'
  cap() { echo "k.BLOCKSPARSE_CONFIGS = tuple(g._replace(min_blocks=$1) if g.vpt == $2 else g for g in k.BLOCKSPARSE_CONFIGS)"; }
  python3 benchmarks/tune/tune.py --backend cupy --ops blocksparse_softmax --dtypes bf16 --cases b \
    --directions forward --csv "$OUT/cupy_bs_words.csv" --variant "words32:" \
    --variant "words40:$C; c.FORWARD_FLOATS = {4: (32,), 2: (40,)}" \
    --variant "words40cap8:$C; c.FORWARD_FLOATS = {4: (32,), 2: (40,)}; $(cap 8 5)" \
    --variant "words64cap6:$C; c.FORWARD_FLOATS = {4: (32,), 2: (64,)}; $(cap 6 8)" \
    --variant "words32cap8:$C; $(cap 8 4)" \
    || echo "cupy block-sparse words failed: rc=$?"
  python3 benchmarks/tune/tune.py --backend numba --ops blocksparse_softmax --dtypes bf16 --cases b \
    --directions forward --csv "$OUT/numba_bs_fwd40.csv" --variant "words:" \
    --variant "w40:$N; n.PACKED_VALUES = {'forward': (32, 40, 48, 64), 'backward': (32, 48, 64)}" \
    || echo "numba block-sparse forward 40 failed: rc=$?"
  exit 0
fi
if [ "${ROUND:-1}" = 2 ]; then
  # Round 2: Triton's 16-bit backward rows held as loaded (ROW_RAW: 51 registers at 512 held, 84 at 1024, against
  # 67 and 126 as floats), 512 or 1024 held; numba's float32 forward at 32 values a lane, or by the mean row.
  # Writes $OUT/triton_bs_raw.csv and $OUT/numba_bs_fp32.csv.
  python3 benchmarks/tune/tune.py --backend triton --ops blocksparse_softmax --dtypes bf16 --cases b \
    --directions backward --csv "$OUT/triton_bs_raw.csv" --variant "raw:" \
    --variant "floats:$T; b.ROW_RAW = False" \
    --variant "raw1024:$T; b.ROW_HELD = 1024" \
    --variant "raw1024w8:$T; b.ROW_HELD = 1024; b.ROW_WARPS = 8" \
    || echo "triton block-sparse raw rows failed: rc=$?"
  python3 benchmarks/tune/tune.py --backend numba --ops blocksparse_softmax --dtypes fp32 --cases b \
    --directions forward --csv "$OUT/numba_bs_fp32.csv" --variant "f16:" \
    --variant "f32:$N; n.FORWARD_FLOATS = {4: (32,), 2: (16,)}" \
    --variant "f16_32_64:$N; n.FORWARD_FLOATS = {4: (16, 32, 64), 2: (16,)}" \
    || echo "numba block-sparse fp32 forward failed: rc=$?"
  exit 0
fi
python3 benchmarks/tune/tune.py --backend numba --ops blocksparse_softmax --dtypes bf16 --cases b \
  --directions forward,backward --csv "$OUT/numba_bs_words.csv" --variant "words:" \
  --variant "w32:$N; n.PACKED_VALUES = {'forward': (32,), 'backward': (32,)}" \
  --variant "w64:$N; n.PACKED_VALUES = {'forward': (64,), 'backward': (64,)}" \
  --variant "floats:$N; n.PACK_16BIT = False" \
  || echo "numba block-sparse words failed: rc=$?"
python3 benchmarks/tune/tune.py --backend triton --ops blocksparse_softmax --dtypes fp32,bf16 --cases b \
  --directions backward --csv "$OUT/triton_bs_rows.csv" --variant "rows:" \
  --variant "tiles:$T; b.ROW_BACKWARD = 'tiles'" \
  --variant "rows512:$T; b.ROW_HELD_LONG = 512; b.ROW_MIN_BLOCKS = {4: 1, 2: 1}; b.TILES_FROM = {4: 1e9, 2: 1e9}" \
  --variant "rows1024:$T; b.ROW_HELD = b.ROW_HELD_LONG = 1024; b.TILES_FROM = {4: 1e9, 2: 1e9}" \
  --variant "rows512w2:$T; b.ROW_WARPS = 2" \
  || echo "triton block-sparse rows failed: rc=$?"
