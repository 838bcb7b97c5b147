#!/usr/bin/env bash
# The whole GPU verification on a CUDA machine without network (the H200 test machine): install without
# downloads, `info`, the test suite, the `check` table and the benchmark. Logs and results go to $OUT.
# Usage: OUT=/some/dir bash benchmarks/gpu_run.sh [pytest args...]
set -uo pipefail
OUT=${OUT:-/tmp/multisoft-gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then   # peers carried as wheels (Liger-Kernel)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
{
  python3 -m multisoft info
  echo "== pytest"; python3 -m pytest -q -p no:cacheprovider "$@" 2>&1 | tail -60
  echo "== check"; python3 -m multisoft check
} 2>&1 | tee "$OUT/verify.log"
