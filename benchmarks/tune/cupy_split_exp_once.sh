#!/usr/bin/env bash
# CuPy float32 split softmax forward, one exponential per element (c1bf49d, `once`) against the kernel before it
# (cea5d5d's softmax.cu, two exponentials: `twice`), in one run, both splitting every row here (from 65536
# columns). The old source comes from git history and replaces softmax.cu in the CuPy module cache (same kernel
# names and arguments); CuPy's disk cache is keyed by the code. Writes $OUT/cupy_split_exp_once.csv.
set -uo pipefail
OUT=${OUT:-/tmp/multisoft-tune}
mkdir -p "$OUT"
OLD=$(mktemp --suffix=.cu)
git show cea5d5d:backends/multisoft_cupy/softmax.cu > "$OLD" || { echo "needs the git history (cea5d5d)"; exit 1; }
M='import multisoft_cupy._module as m, multisoft_cupy._catalog as k'
twice="$M; m.clear_cache(); m._sources['softmax.cu'] = open('$OLD').read().replace('#include \"common.cuh\"', (k.PACKAGE_DIR / 'common.cuh').read_text())"
python3 benchmarks/tune/tune.py --backend cupy --ops softmax,log_softmax --dtypes fp32 \
  --cases 1024x65536,1024x131072,512x131072,512x262144,256x262144,128x524288,64x1048576 --directions forward \
  --csv "$OUT/cupy_split_exp_once.csv" --variant "once:" --variant "twice:$twice" \
  --variant "once_again:$M; m.clear_cache()" \
  || echo "cupy split exp-once tuning failed: rc=$?"
rm -f "$OLD"
