#!/usr/bin/env bash
# Every tuning script of this folder in one GPU session (the H200 machine, no network): install without
# downloads, then each script with a time limit, logs and CSVs under $OUT.
# Usage: OUT=/some/dir bash benchmarks/tune/run_all.sh [script names without .sh ...]
set -uo pipefail
OUT=${OUT:-/tmp/multisoft-tune}
LIMIT=${LIMIT:-200}
mkdir -p "$OUT"
export OUT PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
names=("$@")
if [ ${#names[@]} -eq 0 ]; then
  for script in benchmarks/tune/*.sh; do
    name=$(basename "$script" .sh)
    [ "$name" = run_all ] || names+=("$name")
  done
fi
for name in "${names[@]}"; do
  echo "== $name $(date +%T)"
  timeout "$LIMIT" bash "benchmarks/tune/$name.sh" >"$OUT/$name.log" 2>&1
  echo "rc=$? $(date +%T)"
  tail -n 80 "$OUT/$name.log"
done
