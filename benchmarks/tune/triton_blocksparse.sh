#!/usr/bin/env bash
# Triton block-sparse softmax: block-rows in launches by length (the default; BUCKETS_SAVE) against one
# launch padded to the longest block-row ("single"), tile sizes, and the previous kernels ("old", only when
# benchmarks/tune/_old_blocksparse.py holds the previous module). Writes $OUT/triton_blocksparse.csv. Since session
# 18 only the backward takes the tile kernels and BUCKETS_SAVE.
set -uo pipefail
OUT=${OUT:-/tmp/multisoft-tune}
mkdir -p "$OUT"
S='import multisoft_triton.blocksparse as b; b._schedules.clear()'
old=()
if [ -f benchmarks/tune/_old_blocksparse.py ]; then
  old=(--variant "old:$S; import _old_blocksparse as o; b.forward = o.forward; b.backward = o.backward")
fi
python3 benchmarks/tune/tune.py --backend triton --ops blocksparse_softmax --dtypes fp32,bf16 \
  --directions forward,backward --csv "$OUT/triton_blocksparse.csv" \
  "${old[@]}" \
  --variant "base:$S" \
  --variant "tile4k:$S; b.TILE_ELEMENTS = 4096" \
  --variant "tile8k:$S; b.TILE_ELEMENTS = 8192" \
  --variant "save0.1:$S; b.BUCKETS_SAVE = {4: 0.1, 2: 0.1}" \
  || echo "triton block-sparse tuning failed: rc=$?"
