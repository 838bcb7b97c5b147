#!/usr/bin/env bash
# numba with 16-byte vector accesses: the defaults on every headline shape of softmax, cross-entropy and the
# block-sparse subset, then the split path for rows of 32768 and more with smaller blocks (more parts per
# row, more blocks per SM), and the block-sparse values per lane. Writes $OUT/numba.csv.
# Earlier rounds of the vector kernels (variants no longer listed here) kept: 32 forward and 16 backward
# elements per thread, cross-entropy 16 elements per thread (8 and 32 slower for bf16), the whole row of
# 32768 in one block of 1024 threads (blocks of 512 split or looping were slower), the looping kernel at 8
# elements per step (16 and 32 no faster), at most 4 parts of 512 threads per row (8 and 16 slower).
set -uo pipefail
OUT=${OUT:-/tmp/multisoft-tune}
mkdir -p "$OUT"
tune() { python3 benchmarks/tune/tune.py --backend numba --csv "$OUT/numba.csv" "$@" || echo "tune.py failed: $*"; }
S='import multisoft_numba.softmax as s'
B='import multisoft_numba.blocksparse as b'
LAYOUTS="b16 25% Z1,b16 25% causal,b64 26% causal,b128 27%"
tune --ops softmax,cross_entropy --dtypes fp32,bf16 --directions forward,backward --variant base:
tune --ops softmax --dtypes fp32,bf16 --cases 4096x32768,1024x131072,512x262144 --directions forward,backward \
    --variant "split256:$S; s.SPLIT_THREADS = 256; s.MAX_PARTS = 64; s.CACHED_THREADS = 512" \
    --variant "split128:$S; s.SPLIT_THREADS = 128; s.MAX_PARTS = 64; s.CACHED_THREADS = 512"
tune --ops blocksparse_softmax --dtypes fp32,bf16 --cases "$LAYOUTS" --directions forward,backward \
    --variant base: --variant "fwd16:$B; b.FORWARD_FLOATS = (16,)" --variant "fwd32:$B; b.FORWARD_FLOATS = (16, 32)" \
    --variant "warps8:$B; b.WARPS = 8"
