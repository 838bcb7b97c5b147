#!/usr/bin/env bash
# Tests under NVIDIA's compute-sanitizer on a CUDA machine (the H200 test machine has it in /usr/local/cuda/bin):
# memcheck checks every global and shared memory access of every kernel of every backend against the allocation it
# falls in. torch's caching allocator is switched off, so that each tensor is an allocation of its own and an access
# past a tensor's end is reported, not hidden inside a cached segment. First a planted write one element past a
# tensor's end (tests/sanitize_planted.py) must be reported, or the sanitizer's silence about the tests proves nothing;
# under racecheck, a planted shared-memory race in a kernel that CuPy compiles at run time (the same file; it needs
# CuPy; racecheck on an H200 does not report a plant of one write and one read, so two warps each read what the
# other writes).
#   OUT=/some/dir [TOOL=memcheck] [WORKERS=0] bash tests/gpu_sanitize.sh [pytest args, default tests/test_agreement.py]
#   (or, for every op, backend and dtype at the GPU shapes of `multisoft check`: ... gpu_sanitize.sh --check)
# TOOL: memcheck, synccheck or racecheck (for racecheck, leave out torch's own kernels, whose reductions the float64
# references use and which fill its report: SANITIZER_ARGS="--kernel-name-exclude kns=native"); initcheck reports
# torch.empty buffers that kernels read on purpose, as the in-place cross-entropy does its logits. SANITIZER_ARGS:
# more compute-sanitizer options, before the command (the planted write runs with them too). API errors are not
# reported: numba-cuda probes optional driver entry points through cuGetProcAddress, 34 "errors" at its start.
# WORKERS: pytest-xdist workers, 0 for none (the sanitizer's report of a run with 14 workers held only the main
# process's header). The report goes to $OUT/$TOOL.log; the script exits non-zero when the planted write or race went
# unreported, the sanitizer found an error, or a test failed.
set -uo pipefail
OUT=${OUT:-/tmp/multisoft-sanitize}
TOOL=${TOOL:-memcheck}
export PATH=$PATH:/usr/local/cuda/bin
mkdir -p "$OUT"
export PYTORCH_NO_CUDA_MEMORY_CACHING=1
sanitize() {
  compute-sanitizer --tool "$TOOL" --report-api-errors no --error-exitcode 86 --print-limit 100 ${SANITIZER_ARGS:-} "$@"
}
if [ "$TOOL" = memcheck ]; then
  sanitize python3 tests/sanitize_planted.py > "$OUT/planted.log" 2>&1
  if [ $? != 86 ] || ! grep -q "Invalid __global__ write" "$OUT/planted.log"; then
    echo "the planted out-of-bounds write was not reported ($OUT/planted.log)"
    exit 1
  fi
  echo "== the planted out-of-bounds write was reported"
fi
if [ "$TOOL" = racecheck ]; then
  sanitize python3 tests/sanitize_planted.py race > "$OUT/planted.log" 2>&1
  if [ $? != 86 ] || ! grep -Eq "Race reported|RACECHECK SUMMARY: [1-9]" "$OUT/planted.log"; then
    echo "the planted shared-memory race was not reported ($OUT/planted.log)"
    exit 1
  fi
  echo "== the planted shared-memory race was reported"
fi
if [ "${1:-}" = --check ]; then
  shift
  sanitize --log-file "$OUT/$TOOL.log" python3 -m multisoft check "$@"
else
  [ $# -gt 0 ] || set -- tests/test_agreement.py
  sanitize --log-file "$OUT/$TOOL.log" python3 -m pytest -q -p no:cacheprovider -n "${WORKERS:-0}" "$@"
fi
rc=$?
grep -h "SUMMARY" "$OUT/$TOOL.log"
echo "== exit status $rc (86: the sanitizer reported errors, in $OUT/$TOOL.log)"
[ "$rc" = 0 ]
