#!/usr/bin/env bash
# numba softmax of 16-bit rows held as words, two elements per register (PACK_16BIT, _device.packed_io),
# against held as floats with the settings from before (`floats`: rows of over 32768 loop), and the
# elements per thread that the halved registers allow. Round 1 (results/tuning/numba-packed-round1.txt):
# the backward gained everywhere (4096x32768 0.66 -> 0.91, 1024x131072 0.51 -> 0.85), the cached forward
# stayed level, the split forward beat looping only with 64 elements per thread (`split64`: 0.63 -> 0.65),
# and 64 per thread cached (`fwd64`) or 512 threads per part were slower (the backward split then held 16
# values a thread, SPLIT_CACHE_BWD, now SPLIT_BWD; `threads512` now moves the forward only). Writes
# $OUT/numba_packed.csv.
# (Session 29: that time's SPLIT_THREADS and SPLIT_CACHE, and 1024-thread bounds, written as SPLIT_FORWARD and SPLIT_BWD.)
set -uo pipefail
OUT=${OUT:-/tmp/multisoft-tune}
mkdir -p "$OUT"
S='import multisoft_numba.softmax as s'
python3 benchmarks/tune/tune.py --backend numba --ops softmax --dtypes bf16 \
  --cases 32768x1024,16384x4096,8192x8192,4096x16384,4096x32768,1024x65536,1024x131072,512x262144 \
  --csv "$OUT/numba_packed.csv" \
  --variant "base:" \
  --variant "floats:$S; s.PACK_16BIT = False; s.CACHE = {4: (32,), 2: (32,)}; s.CACHE_BWD = {4: (8, 32), 2: (8, 32)}; s.MAX_PARTS = {4: 0, 2: 0}" \
  --variant "fwd64:$S; s.CACHE = {4: (32,), 2: (64,)}" \
  --variant "fwd16_32:$S; s.CACHE = {4: (32,), 2: (16, 32)}" \
  --variant "split64:$S; s.SPLIT_FORWARD = {4: ((256, 32, 0),), 2: ((256, 64, 0),)}; s.SPLIT_BWD = {4: ((256, 16, 0),), 2: ((256, 16, 0),)}" \
  --variant "split16:$S; s.SPLIT_FORWARD = {4: ((256, 32, 0),), 2: ((256, 16, 0),)}" \
  --variant "threads512:$S; s.SPLIT_FORWARD = {4: ((512, 32, 0),), 2: ((512, 64, 0),)}" \
  || echo "numba packed tuning failed: rc=$?"
