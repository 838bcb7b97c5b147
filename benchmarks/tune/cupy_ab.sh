#!/usr/bin/env bash
# A/B in one run: the CuPy kernels of one source file of the working tree (`tree`) against the same file at git
# revision REF (`ref`, default HEAD), whose kernels must keep the current names and arguments. SOURCE is the
# file (default softmax.cu; OPS defaults to the ops it serves). The ref source replaces it in the CuPy module
# cache (common.cuh stays the tree's); CuPy's disk cache is keyed by the code.
#   REF=6031936 CASES=1024x131072,512x262144 DTYPES=fp32 DIRECTIONS=forward bash benchmarks/tune/cupy_ab.sh
#   SOURCE=cross_entropy.cu CASES=8192x32000,8192x128256 bash benchmarks/tune/cupy_ab.sh
# REF_FILE=path takes the ref source from a file instead (a machine without the history). Writes
# $OUT/cupy_ab.csv. (Until session 10 this was cupy_softmax_ab.sh, softmax.cu only.)
set -uo pipefail
OUT=${OUT:-/tmp/multisoft-tune}
SOURCE=${SOURCE:-softmax.cu}
case "$SOURCE" in
  softmax.cu) DEFAULT_OPS=softmax,log_softmax ;;
  cross_entropy.cu) DEFAULT_OPS=cross_entropy ;;
  blocksparse.cu) DEFAULT_OPS=blocksparse_softmax ;;
  *) echo "unknown SOURCE $SOURCE"; exit 1 ;;
esac
mkdir -p "$OUT"
REF_SOURCE=$(mktemp --suffix=.cu)
if [ -n "${REF_FILE:-}" ]; then
  cp "$REF_FILE" "$REF_SOURCE"
else
  git show "${REF:-HEAD}:backends/multisoft_cupy/$SOURCE" > "$REF_SOURCE" || { echo "no $SOURCE at ${REF:-HEAD}"; exit 1; }
fi
M='import multisoft_cupy._module as m, multisoft_cupy._catalog as k'
ref="$M; m.clear_cache(); m._sources['$SOURCE'] = open('$REF_SOURCE').read().replace('#include \"common.cuh\"', (k.PACKAGE_DIR / 'common.cuh').read_text())"
python3 benchmarks/tune/tune.py --backend cupy --ops "${OPS:-$DEFAULT_OPS}" --dtypes "${DTYPES:-fp32,bf16}" \
  --cases "${CASES:-1024x65536,1024x131072,512x262144,128x524288}" --directions "${DIRECTIONS:-forward,backward}" \
  --csv "$OUT/cupy_ab.csv" --variant "tree:" --variant "ref:$ref" --variant "tree_again:$M; m.clear_cache()" \
  || echo "cupy A/B failed: rc=$?"
rm -f "$REF_SOURCE"
