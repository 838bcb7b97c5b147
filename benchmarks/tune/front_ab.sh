#!/usr/bin/env bash
# A/B of the whole package (front and backends) in separate processes: the working tree (`tree`), a copy of an
# earlier tree in REF_DIR (its multisoft/ and backends/, put first on the path: `ref`), and the tree again.
# For changes in the front, which every backend's timings include.
#   REF_DIR=ab_ref OPS=cross_entropy CASES=8192x32000 BACKENDS=triton,cupy bash benchmarks/tune/front_ab.sh
# Writes $OUT/front_ab.csv.
set -uo pipefail
OUT=${OUT:-/tmp/multisoft-tune}
mkdir -p "$OUT"
run() {  # NAME BACKEND [tune.py path]
  python3 "${3:-benchmarks/tune/tune.py}" --backend "$2" --ops "${OPS:-cross_entropy}" --dtypes "${DTYPES:-fp32,bf16}" \
    --cases "${CASES:-8192x32000,8192x128256,4096x262144}" \
    --directions "${DIRECTIONS:-forward,backward,forward+backward}" --csv "$OUT/front_ab.csv" --variant "$1:" \
    || echo "front A/B ($1, $2) failed: rc=$?"
}
for backend in ${BACKENDS//,/ }; do
  run tree "$backend"
  PYTHONPATH="$REF_DIR:$REF_DIR/backends${PYTHONPATH:+:$PYTHONPATH}" run ref "$backend" "$REF_DIR/benchmarks/tune/tune.py"
  run tree_again "$backend"
done
