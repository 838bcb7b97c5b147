#!/usr/bin/env bash
# Session 16, numba's float32 block-sparse forward after the causal prefix came from lut.causal (7102457): 16 values
# a lane (the default) against 16 or 32 by the mean row, and 8 or 2 rows (warps) a block against 4; then the
# block-sparse tests with 16 or 32 values, patched in the test process. Writes $OUT/numba_bs_fp32_shape.csv.
set -uo pipefail
OUT=${OUT:-/tmp/multisoft-tune}
mkdir -p "$OUT"
N='import multisoft_numba.blocksparse as n'
python3 benchmarks/tune/tune.py --backend numba --ops blocksparse_softmax --dtypes fp32 --cases b \
  --directions forward --csv "$OUT/numba_bs_fp32_shape.csv" --variant "f16:" \
  --variant "f16_32:$N; n.FORWARD_FLOATS = {4: (16, 32), 2: (16,)}" \
  --variant "w8:$N; n.WARPS = 8" --variant "w2:$N; n.WARPS = 2" \
  || echo "numba fp32 forward shape failed: rc=$?"
for setting in "FORWARD_FLOATS = {4: (16, 32), 2: (16,)}"; do
  echo "== tests with $setting"
  python3 -c "import sys, pytest, multisoft_numba.blocksparse as n; n.$setting; sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', '-W', 'ignore', 'tests/test_backend_numba.py', 'tests/test_agreement.py', '-k', 'blocksparse and (numba or not agreement) and not values_per_lane']))" 2>&1 | tail -2
done
