#!/usr/bin/env bash
# Session 16, Triton block-sparse forward: the row kernels (ROW_FORWARD, a warp a row, the held blocks'
# exponentials kept, the causal mask a prefix of each row) against the tile and loop kernels, holding 512 (the
# backward's rule), 1024 or 256 elements, with 2 or 8 rows a program (round 1: tree of session 16 before its
# rule, every layout on rows). Writes $OUT/triton_bs_fwd_rows.csv.
set -uo pipefail
OUT=${OUT:-/tmp/multisoft-tune}
mkdir -p "$OUT"
T='import multisoft_triton.blocksparse as b'
ALL="b.FORWARD_ROWS = {c: {4: (128, 0, 1e9), 2: (128, 0, 1e9)} for c in (False, True)}"  # every layout on rows
# Round 3 timed FORWARD_RAW (16-bit row kernels holding their blocks as loaded), code that was only in the working
# tree of b4cbdef and was not kept: its command is gone, its results are in the tuning log.
if [ "${ROUND:-1}" = 2 ]; then
  # Round 2: after round 1's rule (rows for the layouts without the causal mask whose mean row is under 512 float32
  # or 2048 16-bit elements), the causal row kernel counting each row's kept prefix while its held blocks load
  # (round 1 counted first), against the tile kernels; float32 25 % layouts on rows holding 256.
  python3 benchmarks/tune/tune.py --backend triton --ops blocksparse_softmax --dtypes fp32,bf16 --cases b \
    --directions forward --csv "$OUT/triton_bs_fwd_rows2.csv" --variant "rule:" \
    --variant "rows:$T; $ALL" \
    --variant "rows256:$T; $ALL; b.ROW_HELD = b.ROW_HELD_LONG = 256; b.ROW_MIN_BLOCKS = {4: 2, 2: 2}" \
    --variant "tiles:$T; b.ROW_FORWARD = 'tiles'" \
    || echo "triton block-sparse forward rows failed: rc=$?"
  exit 0
fi
python3 benchmarks/tune/tune.py --backend triton --ops blocksparse_softmax --dtypes fp32,bf16 --cases b \
  --directions forward --csv "$OUT/triton_bs_fwd_rows.csv" --variant "rows:" \
  --variant "tiles:$T; b.ROW_FORWARD = 'tiles'" \
  --variant "rows1024:$T; b.ROW_HELD = b.ROW_HELD_LONG = 1024" \
  --variant "rows256:$T; b.ROW_HELD = b.ROW_HELD_LONG = 256; b.ROW_MIN_BLOCKS = {4: 2, 2: 2}" \
  --variant "rows512w2:$T; b.ROW_WARPS = 2" \
  --variant "rows512w8:$T; b.ROW_WARPS = 8" \
  || echo "triton block-sparse forward rows failed: rc=$?"
