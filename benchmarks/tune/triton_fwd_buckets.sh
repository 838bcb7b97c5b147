#!/usr/bin/env bash
# Triton block-sparse: the forward's rows grouped into launches by length more eagerly (BUCKETS_SAVE["forward"]
# 0.1 or 0.0 against 0.3, every element size: less padding, more launches); the backward keeps 0.3. Then the
# cross-entropy forward loop's block and warps (LOOP_CONFIGS, LOOP_STAGES). Writes $OUT/triton_fwd_buckets.csv,
# $OUT/triton_ce_loop.csv. (Session 12 ran it with the settings of then: a flat BUCKETS_SAVE, LOOP_BLOCK, LOOP_WARPS.)
# Since session 18 the forward takes the row kernel on every layout, without launches by length: the block-sparse
# part is gone from here (`git show 1eaf011:benchmarks/tune/triton_fwd_buckets.sh`).
set -uo pipefail
OUT=${OUT:-/tmp/multisoft-tune}
mkdir -p "$OUT"
C='import multisoft_triton.cross_entropy as c'
python3 benchmarks/tune/tune.py --backend triton --ops cross_entropy --dtypes bf16,fp32 \
  --cases 8192x32000,8192x128256,4096x262144 --directions forward --csv "$OUT/triton_ce_loop.csv" \
  --variant "default:" --variant "b16k_w8:$C; c.LOOP_CONFIGS = {4: (16384, 8), 2: (16384, 8)}" \
  --variant "b8k_w4:$C; c.LOOP_CONFIGS = {4: (8192, 4), 2: (8192, 4)}" \
  --variant "b8k_w8:$C; c.LOOP_CONFIGS = {4: (8192, 8), 2: (8192, 8)}" \
  --variant "b16k_w16:$C; c.LOOP_CONFIGS = {4: (16384, 16), 2: (16384, 16)}" \
  --variant "s2:$C; c.LOOP_STAGES = 2" || echo "cross-entropy loop tuning failed: rc=$?"
