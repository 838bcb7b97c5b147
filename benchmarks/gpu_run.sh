#!/usr/bin/env bash
# The whole GPU verification on a CUDA machine without network (the H200 test machine): install without
# downloads, `info`, the test suite, the `check` table, then the benchmark. Logs and results go to $OUT.
# Usage: OUT=/some/dir [CHECK_ARGS=...] [BENCH_ARGS=...] bash benchmarks/gpu_run.sh [--no-bench] [pytest args...]
set -uo pipefail
OUT=${OUT:-/tmp/multisoft-gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
bench=1
if [ "${1:-}" = "--no-bench" ]; then bench=0; shift; fi
if compgen -G ".whl/*.whl" >/dev/null; then   # peers carried as wheels (Liger-Kernel)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
{
  python3 -m multisoft info
  echo "== pytest"
  python3 -m pytest -q -p no:cacheprovider --durations=15 "$@" 2>&1 | grep -v '^\.*\s*\[ *[0-9]*%\]$'
  echo "== check"
  python3 -m multisoft check ${CHECK_ARGS:-}
} 2>&1 | tee "$OUT/verify.log"
if [ "$bench" = 1 ]; then
  python3 -m multisoft bench --out "$OUT/results" --shortfalls benchmarks/shortfalls.csv ${BENCH_ARGS:-} \
    2>"$OUT/bench-progress.log" | tee "$OUT/bench.log"
  tar -C "$OUT" -czf "$OUT/results.tar.gz" results && rm -rf "$OUT/results"
fi
