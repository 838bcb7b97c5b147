#!/usr/bin/env bash
# Triton block-sparse row kernels (session 14: a program holds ROWS rows of one block-row, their first blocks in
# registers and the rest streamed, no padding to the longest row) against the tile and loop kernels with their
# length buckets (ROW_KERNELS = False), and the row chunk halved.
#   bash benchmarks/tune/triton_blocksparse_rows.sh
# Writes $OUT/triton_bs_rows.csv.
set -uo pipefail
OUT=${OUT:-/tmp/multisoft-tune}
mkdir -p "$OUT"
B='import multisoft_triton.blocksparse as b'
python3 benchmarks/tune/tune.py --backend triton --ops blocksparse_softmax --dtypes fp32,bf16 --cases b \
  --directions forward,backward --csv "$OUT/triton_bs_rows.csv" --variant "rows:" \
  --variant "tiles:$B; b.ROW_KERNELS = False" --variant "rows512:$B; b.ROW_CHUNK = 512" \
  || echo "triton block-sparse rows failed: rc=$?"
