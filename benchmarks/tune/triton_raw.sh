#!/usr/bin/env bash
# Triton softmax of 16-bit rows held as loaded and widened again after each reduction (RAW_FROM, see
# utils.widen_again) against held as floats. Round 1 (results/tuning/triton-raw-round1.txt; its `base`
# held every path as loaded, `floats` none): the backward gained at rows of 16384 and more (4096x32768
# 0.92 -> 0.99, 1024x131072 0.79 -> 0.89) and lost 0.5 % on shorter tiles; the softmax forward lost
# (4096x32768 0.74 -> 0.63), the held-chunk split forward stayed behind the streaming one, and longer tiles
# or larger chunks did not help. Round 2: the defaults from that, against holding the forward tile as
# loaded for log_softmax too (one exponential per element, where softmax needs two).
# Writes $OUT/triton_raw.csv.
set -uo pipefail
OUT=${OUT:-/tmp/multisoft-tune}
mkdir -p "$OUT"
S='import multisoft_triton.softmax as s'
python3 benchmarks/tune/tune.py --backend triton --ops softmax,log_softmax --dtypes bf16 \
  --cases 32768x1024,16384x4096,4096x16384,4096x32768,2048x32768 --directions forward,backward \
  --csv "$OUT/triton_raw.csv" \
  --variant "base:" \
  --variant "floats:$S; s.RAW_FROM = {}" \
  --variant "fwd_tile_raw:$S; s.RAW_FROM = {**s.RAW_FROM, 'forward tile': 0}" \
  || echo "triton raw tuning failed: rc=$?"
