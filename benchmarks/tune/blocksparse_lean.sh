#!/usr/bin/env bash
# CuPy block-sparse kernels rewritten for fewer instructions per element (session 14: a lane's vectors one stride
# apart, 32-bit row arithmetic, no per-element masks unless causal, raw words held in the backward) against the
# kernels before (REF_FILE, e.g. ab_ref/blocksparse.cu from `git show <rev>:backends/multisoft_cupy/blocksparse.cu`),
# then the values a thread holds and the register cap, which the leaner kernels may shift.
#   REF_FILE=ab_ref/blocksparse.cu bash benchmarks/tune/blocksparse_lean.sh
# Writes $OUT/cupy_ab.csv and $OUT/cupy_bs_lean.csv.
set -uo pipefail
OUT=${OUT:-/tmp/multisoft-tune}
mkdir -p "$OUT"
export OUT
SOURCE=blocksparse.cu CASES=b DIRECTIONS=forward,backward bash benchmarks/tune/cupy_ab.sh
C='import multisoft_cupy.blocksparse as c, multisoft_cupy._catalog as k, multisoft_cupy._module as m'
CAP="k.BLOCKSPARSE_CONFIGS = tuple(g._replace(min_blocks=6) if g.vpt <= 8 else g for g in k.BLOCKSPARSE_CONFIGS)"
python3 benchmarks/tune/tune.py --backend cupy --ops blocksparse_softmax --dtypes fp32,bf16 --cases b \
  --directions forward,backward --csv "$OUT/cupy_bs_lean.csv" --variant "tree:" \
  --variant "fwd64:$C; c.FORWARD_FLOATS = {4: (32, 64), 2: (32, 64)}" \
  --variant "bwd64:$C; c.BACKWARD_FLOATS = {4: (32, 64), 2: (32, 64)}" \
  --variant "cap6:$C; $CAP" \
  || echo "cupy block-sparse lean variants failed: rc=$?"
