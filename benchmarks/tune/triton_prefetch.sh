#!/usr/bin/env bash
# Triton forward of rows of 32768 (one program a row holds the row as floats, one program a multiprocessor, its
# loads and stores not overlapped) against persistent programs (PERSISTENT_TILE: smallest block, programs a
# multiprocessor, warps, stages) that have the next row's loads in flight while they reduce and store the current
# one: prefetched into registers (stages 0) or staged in shared memory by the pipeliner (stages >= 2).
# Round 1 (results/tuning/triton-prefetch-round1.txt) ran an uncommitted tree with a setting since replaced,
# PERSISTENT_TILE (its variants are listed in that file); the prefetch it kept is PREFETCH_FROM. Round 2: the row
# length from which to prefetch and the elements a multiprocessor holds. Writes $OUT/triton_prefetch2.csv.
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
