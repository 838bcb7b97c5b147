#!/usr/bin/env bash
# Triton exponentials: utils.fast_exp (one ex2.approx.ftz per element) against tl.exp (ex2.approx with a
# subnormal range fix-up: a compare and two multiplies more per element), every softmax, log_softmax and
# cross-entropy headline cell. The tl.exp run imports a copy of the package whose fast_exp is tl.exp (the
# interpreter's version), so the two differ in nothing else. Writes $OUT/triton_fast_exp.csv.
set -uo pipefail
OUT=${OUT:-/tmp/multisoft-tune}
mkdir -p "$OUT"
ARGS=(--backend triton --ops softmax,log_softmax,cross_entropy --dtypes fp32,bf16 --csv "$OUT/triton_fast_exp.csv")
python3 benchmarks/tune/tune.py "${ARGS[@]}" --variant "fast_exp:" || echo "fast_exp run failed: rc=$?"
COPY=$(mktemp -d)
cp -r backends/multisoft_triton "$COPY/"
sed -i 's/^if interpreting():/if True:/' "$COPY/multisoft_triton/utils.py"
grep -q '^if True:' "$COPY/multisoft_triton/utils.py" || { echo "could not patch fast_exp"; exit 1; }
PYTHONPATH="$COPY" python3 benchmarks/tune/tune.py "${ARGS[@]}" --variant "tl_exp:" || echo "tl.exp run failed: rc=$?"
rm -rf "$COPY"
