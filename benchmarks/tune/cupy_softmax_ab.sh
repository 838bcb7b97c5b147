#!/usr/bin/env bash
# A/B in one run: the CuPy softmax kernels of the working tree (`tree`) against softmax.cu at git revision REF
# (`ref`, default HEAD), whose kernels must keep the current names and arguments. The ref source replaces
# softmax.cu in the CuPy module cache (common.cuh stays the tree's); CuPy's disk cache is keyed by the code.
#   REF=6031936 CASES=1024x131072,512x262144 DTYPES=fp32 DIRECTIONS=forward bash benchmarks/tune/cupy_softmax_ab.sh
# REF_FILE=path takes the ref source from a file instead (a machine without the history). Writes
# $OUT/cupy_softmax_ab.csv.
set -uo pipefail
OUT=${OUT:-/tmp/multisoft-tune}
mkdir -p "$OUT"
REF_SOURCE=$(mktemp --suffix=.cu)
if [ -n "${REF_FILE:-}" ]; then
  cp "$REF_FILE" "$REF_SOURCE"
else
  git show "${REF:-HEAD}:backends/multisoft_cupy/softmax.cu" > "$REF_SOURCE" || { echo "no softmax.cu at ${REF:-HEAD}"; exit 1; }
fi
M='import multisoft_cupy._module as m, multisoft_cupy._catalog as k'
ref="$M; m.clear_cache(); m._sources['softmax.cu'] = open('$REF_SOURCE').read().replace('#include \"common.cuh\"', (k.PACKAGE_DIR / 'common.cuh').read_text())"
python3 benchmarks/tune/tune.py --backend cupy --ops "${OPS:-softmax,log_softmax}" --dtypes "${DTYPES:-fp32,bf16}" \
  --cases "${CASES:-1024x65536,1024x131072,512x262144,128x524288}" --directions "${DIRECTIONS:-forward,backward}" \
  --csv "$OUT/cupy_softmax_ab.csv" --variant "tree:" --variant "ref:$ref" --variant "tree_again:$M; m.clear_cache()" \
  || echo "cupy softmax A/B failed: rc=$?"
rm -f "$REF_SOURCE"
