#!/usr/bin/env bash
# Triton split softmax forward of long rows: the held chunk (base: the chunk in registers across the wait)
# against streaming it twice (SPLIT_STREAM: chunk, sub-block, warps, stages): statistics, then the output
# from a second read that should hit L2. Stages >= 2 pipeline the loads through shared memory (cp.async),
# so a program's bytes in flight are not bounded by registers that hold 16-bit data as floats.
# `tile16k` also sends bf16 rows of 32768 to the split path. Writes $OUT/triton_split_stream.csv.
set -uo pipefail
OUT=${OUT:-/tmp/multisoft-tune}
mkdir -p "$OUT"
S='import multisoft_triton.softmax as s'
# Round 1 (results/tuning/triton-split-stream-round1.txt): pipelined loads (stages 2-4) and every float32 variant
# were slower; bf16 without pipelining (8192, 2048, 4, 1) 0.69 against 0.63. Round 2: around that one.
python3 benchmarks/tune/tune.py --backend triton --ops softmax --dtypes bf16 \
  --cases 1024x131072,512x262144 --directions forward --csv "$OUT/triton_split_stream.csv" \
  --variant "base:" \
  --variant "s1_8k_2k:$S; s.SPLIT_STREAM = {2: (8192, 2048, 4, 1)}" \
  --variant "s1_4k_2k:$S; s.SPLIT_STREAM = {2: (4096, 2048, 4, 1)}" \
  --variant "s1_16k_2k:$S; s.SPLIT_STREAM = {2: (16384, 2048, 4, 1)}" \
  --variant "s1_8k_1k_w2:$S; s.SPLIT_STREAM = {2: (8192, 1024, 2, 1)}" \
  --variant "s1_8k_4k_w8:$S; s.SPLIT_STREAM = {2: (8192, 4096, 8, 1)}" \
  --variant "s1_16k_4k_w8:$S; s.SPLIT_STREAM = {2: (16384, 4096, 8, 1)}" \
  --variant "s1_32k_4k_w8:$S; s.SPLIT_STREAM = {2: (32768, 4096, 8, 1)}" \
  || echo "triton split stream tuning failed: rc=$?"
