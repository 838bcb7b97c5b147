#!/usr/bin/env bash
# numba with 16-byte vector accesses: the defaults on every headline shape, then the alternatives that the
# defaults were chosen against (logs of each round: benchmarks/results/tuning/numba-vectors-round*.txt):
# rows of 32768 and more split over blocks (float32; 16-bit rows loop), threads per part, backward
# elements per thread, cross-entropy elements per thread, block-sparse values per lane. Writes $OUT/numba.csv.
# (Session 29: SPLIT_THREADS = 512, with that time's 32 / 64 values, written as SPLIT_FORWARD.)
set -uo pipefail
OUT=${OUT:-/tmp/multisoft-tune}
mkdir -p "$OUT"
tune() { python3 benchmarks/tune/tune.py --backend numba --csv "$OUT/numba.csv" "$@" || echo "tune.py failed: $*"; }
S='import multisoft_numba.softmax as s'
C='import multisoft_numba.cross_entropy as c'
B='import multisoft_numba.blocksparse as b'
LONG=4096x32768,1024x131072,512x262144
tune --ops softmax,cross_entropy,blocksparse_softmax --dtypes fp32,bf16 --directions forward,backward --variant base:
tune --ops softmax --dtypes fp32,bf16 --cases $LONG --directions forward,backward \
    --variant "looping:$S; s.MAX_PARTS = {4: 0, 2: 0}" \
    --variant "split16bit:$S; s.MAX_PARTS = {4: 64, 2: 64}" \
    --variant "threads512:$S; s.SPLIT_FORWARD = {4: ((512, 32, 0),), 2: ((512, 64, 0),)}"
tune --ops softmax --dtypes fp32,bf16 --cases 32768x1024,16384x4096,4096x32768 --directions backward \
    --variant "bwd16:$S; s.CACHE_BWD = {4: (16,), 2: (16,)}" --variant "bwd8:$S; s.CACHE_BWD = {4: (8,), 2: (8,)}"
tune --ops cross_entropy --dtypes fp32,bf16 --directions forward,backward \
    --variant "ce8:$C; c.UNROLL = 8; c.BACKWARD_UNROLL = 8" --variant "ce32:$C; c.UNROLL = 32; c.BACKWARD_UNROLL = 32"
tune --ops blocksparse_softmax --dtypes fp32,bf16 --cases "b16 25% Z1,b16 25% causal,b64 26% causal,b128 27%" \
    --directions forward,backward --variant "fwd-wide:$B; b.FORWARD_FLOATS = {4: (16, 40, 64), 2: (16, 40, 64)}" --variant "warps8:$B; b.WARPS = 8"
