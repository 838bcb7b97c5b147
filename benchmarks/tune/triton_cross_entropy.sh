#!/usr/bin/env bash
# Triton cross-entropy forward of long rows (C > the tile path's 8192): one program per row streaming the
# logits once. The defaults (LOOP_CONFIGS; until session 12, 16384 columns per load and 8 warps for every
# element size, 2 programs per SM) against variants that trade columns per load, warps and loads in flight
# (STAGES >= 2 pipelines them through shared memory), with more programs per SM.
# Writes $OUT/triton_cross_entropy.csv.
set -uo pipefail
OUT=${OUT:-/tmp/multisoft-tune}
mkdir -p "$OUT"
S='import multisoft_triton.cross_entropy as c'
python3 benchmarks/tune/tune.py --backend triton --ops cross_entropy --dtypes fp32,bf16 \
  --directions forward,forward+backward --csv "$OUT/triton_cross_entropy.csv" \
  --variant "base:" \
  --variant "b8k:$S; c.LOOP_CONFIGS = {4: (8192, 8), 2: (8192, 8)}" \
  --variant "b4k_w4:$S; c.LOOP_CONFIGS = {4: (4096, 4), 2: (4096, 4)}" \
  --variant "b8k_s2:$S; c.LOOP_CONFIGS = {4: (8192, 8), 2: (8192, 8)}; c.LOOP_STAGES = 2" \
  --variant "b4k_s3:$S; c.LOOP_CONFIGS = {4: (4096, 8), 2: (4096, 8)}; c.LOOP_STAGES = 3" \
  --variant "b4k_w4_s3:$S; c.LOOP_CONFIGS = {4: (4096, 4), 2: (4096, 4)}; c.LOOP_STAGES = 3" \
  --variant "b16k_w16_s2:$S; c.LOOP_CONFIGS = {4: (16384, 16), 2: (16384, 16)}; c.LOOP_STAGES = 2" \
  || echo "triton cross-entropy tuning failed: rc=$?"
