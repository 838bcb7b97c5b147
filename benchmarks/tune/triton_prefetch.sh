#!/usr/bin/env bash
# Triton forward of long 16-bit rows as persistent programs that load their next row into registers before they
# reduce and store the current one (PREFETCH_FROM: from which row length; PREFETCH_SM_ELEMENTS: elements a
# multiprocessor holds) against one program a row (tile: the row as floats, one program a multiprocessor at 32768,
# its loads and stores not overlapped). Round 1 (results/tuning/triton-prefetch-round1.txt) ran an uncommitted tree
# whose setting, PERSISTENT_TILE, also offered staging the next row in shared memory through the pipeliner (its
# variants are listed in that file); this script is round 2. Writes $OUT/triton_prefetch2.csv.
set -uo pipefail
OUT=${OUT:-/tmp/multisoft-tune}
mkdir -p "$OUT"
S='import multisoft_triton.softmax as s'
python3 benchmarks/tune/tune.py --backend triton --ops softmax,log_softmax --dtypes bf16,fp32 \
  --cases 4096x32768,2048x32768,4096x16384,8192x8192,16384x4096 --directions forward \
  --csv "$OUT/triton_prefetch2.csv" \
  --variant "rule:" \
  --variant "tile:$S; s.PREFETCH_FROM = {}" \
  --variant "from16k:$S; s.PREFETCH_FROM = {2: 16384}" \
  --variant "from16k_1:$S; s.PREFETCH_FROM = {2: 16384}; s.PREFETCH_SM_ELEMENTS = 16384" \
  --variant "from8k:$S; s.PREFETCH_FROM = {2: 8192}" \
  --variant "f32_16k:$S; s.PREFETCH_FROM = {4: 16384, 2: 32768}; s.PREFETCH_SM_ELEMENTS = 16384" \
  || echo "triton prefetch tuning failed: rc=$?"
