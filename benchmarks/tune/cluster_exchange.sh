#!/usr/bin/env bash
# CuPy's staged cluster kernels: row statistics exchanged by st.async into mbarrier-counted slots (tree,
# ClusterExchange in common.cuh) against two cluster barriers per row (barriers: MS_CLUSTER_EXCHANGE=0), in one
# run, tree measured again last. Writes $OUT/cluster_exchange.csv.
set -uo pipefail
OUT=${OUT:-/tmp/multisoft-tune}
mkdir -p "$OUT"
M='import multisoft_cupy._module as m, multisoft_cupy._catalog as k'
python3 benchmarks/tune/tune.py --backend cupy --ops softmax,log_softmax --dtypes bf16 \
  --cases "${CASES:-1024x131072,512x262144,2048x65536,1024x65536}" --directions forward --csv "$OUT/cluster_exchange.csv" \
  --variant "tree:$M; m.clear_cache()" \
  --variant "barriers:$M; m.clear_cache(); k.OPTIONS = k.OPTIONS + ('-DMS_CLUSTER_EXCHANGE=0',)" \
  --variant "tree_again:$M; m.clear_cache()"
