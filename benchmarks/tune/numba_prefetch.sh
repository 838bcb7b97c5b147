#!/usr/bin/env bash
# numba forward of 16-bit rows that a block holds whole as words (one block a multiprocessor at rows of 32768: its
# loads and stores do not overlap) against persistent blocks, one a multiprocessor, that read their next row before
# they reduce and write the current one (PREFETCH_FROM, by held bytes). rule = rows of 32768 and longer, cached = none,
# from16k / from8k = from 16384 / 8192. Writes $OUT/numba_prefetch.csv.
set -uo pipefail
OUT=${OUT:-/tmp/multisoft-tune}
mkdir -p "$OUT"
S='import multisoft_numba.softmax as s'
python3 benchmarks/tune/tune.py --backend numba --ops softmax,log_softmax --dtypes bf16 \
  --cases 4096x32768,2048x32768,4096x16384,8192x8192,16384x4096 --directions forward \
  --csv "$OUT/numba_prefetch.csv" \
  --variant "rule:" \
  --variant "cached:$S; s.PREFETCH_FROM = {}" \
  --variant "from16k:$S; s.PREFETCH_FROM = {2: 16384}" \
  --variant "from8k:$S; s.PREFETCH_FROM = {2: 8192}" \
  || echo "numba prefetch tuning failed: rc=$?"
