#!/usr/bin/env bash
# CuPy block-sparse softmax on a representative subset of the benchmark layouts; writes $OUT/blocksparse.csv.
# The kernels are a warp per row (old results: benchmarks/results/timings.csv); the variants move the values
# each thread holds in registers (rows longer than a warp's tile are read twice, but more warps fit):
#  fwd64: 64 values per thread in the forward (default 32, which measured 0.59 -> 0.67 of copy at b16 fp32).
#  bwd64: 64 values per thread in the backward (default 32; better for fp32 b64/b128, worse for bf16).
# A restructured Triton kernel (rows sorted into levels by length) was measured in the same round and lost
# to the existing one except on causal layouts; it was not kept.
set -uo pipefail
OUT=${OUT:-/tmp/multisoft-tune}
mkdir -p "$OUT"
python3 benchmarks/tune/tune.py --backend cupy --ops blocksparse_softmax --dtypes fp32,bf16 \
  --cases "b16 25% Z1,b16 25% causal,b64 26% causal,b128 27%" --directions forward,backward \
  --csv "$OUT/blocksparse.csv" \
  --variant "base:" \
  --variant "fwd64:import multisoft_cupy.blocksparse as b; b.FORWARD_FLOATS = {4: (64,), 2: (64,)}" \
  --variant "bwd64:import multisoft_cupy.blocksparse as b; b.BACKWARD_FLOATS = {4: (64,), 2: (64,)}" \
  || echo "cupy block-sparse tuning failed: rc=$?"
