#!/usr/bin/env bash
# numba block-sparse kernels (128-thread blocks) compiled for several blocks a multiprocessor (BLOCKS_PER_SM: launch
# bounds (128, b), a register budget of 65536 / (128 * b) a thread) against the launch bounds (128) alone (b = 0, the
# default), the forwards and the backwards apart, on every bench layout. tune.py empties the kernel factories' caches
# before each variant, so each builds its kernels under its own bound. Round 1 (numba-blocksparse-bound-round1.txt)
# ran with b = 1 as its base: (128, 1) let ptxas take up to 255 registers and lost to every budget.
# Writes $OUT/numba_blocksparse_bound.csv.
set -uo pipefail
OUT=${OUT:-/tmp/multisoft-tune}
mkdir -p "$OUT"
S='import multisoft_numba.blocksparse as b'
run() {
  python3 benchmarks/tune/tune.py --backend numba --ops blocksparse_softmax \
    --csv "$OUT/numba_blocksparse_bound.csv" "$@" || echo "numba block-sparse bound tuning failed: rc=$?"
}
run --directions forward --dtypes bf16 --variant "base:" \
  --variant "fwd_b8:$S; b.BLOCKS_PER_SM = {**b.BLOCKS_PER_SM, 'forward': 8}" \
  --variant "fwd_b12:$S; b.BLOCKS_PER_SM = {**b.BLOCKS_PER_SM, 'forward': 12}" \
  --variant "base_again:"
run --directions backward --dtypes fp32 --variant "base:" \
  --variant "bwd_b4:$S; b.BLOCKS_PER_SM = {**b.BLOCKS_PER_SM, 'backward': 4}" \
  --variant "base_again:"
