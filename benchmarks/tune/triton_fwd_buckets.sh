#!/usr/bin/env bash
# Triton block-sparse: the forward's rows grouped into launches by length more eagerly (BUCKETS_SAVE["forward"]
# 0.1 or 0.0 against 0.3, every element size: less padding, more launches); the backward keeps 0.3. Then the
# cross-entropy forward loop's block and warps (LOOP_CONFIGS, LOOP_STAGES). Writes $OUT/triton_fwd_buckets.csv,
# $OUT/triton_ce_loop.csv. (Session 12 ran it with the settings of then: a flat BUCKETS_SAVE, LOOP_BLOCK, LOOP_WARPS.)
set -uo pipefail
OUT=${OUT:-/tmp/multisoft-tune}
mkdir -p "$OUT"
B='import multisoft_triton.blocksparse as b'
python3 benchmarks/tune/tune.py --backend triton --ops blocksparse_softmax --dtypes bf16,fp32 --cases b \
  --directions forward --csv "$OUT/triton_fwd_buckets.csv" --variant "default:" \
  --variant "save0.3:$B; b.BUCKETS_SAVE = {'forward': {4: 0.3, 2: 0.3}, 'backward': {4: 0.3, 2: 0.3}}" \
  --variant "save0.1:$B; b.BUCKETS_SAVE = {'forward': {4: 0.1, 2: 0.1}, 'backward': {4: 0.3, 2: 0.3}}" \
  --variant "save0.0:$B; b.BUCKETS_SAVE = {'forward': {4: 0.0, 2: 0.0}, 'backward': {4: 0.3, 2: 0.3}}" \
  || echo "blocksparse buckets tuning failed: rc=$?"
C='import multisoft_triton.cross_entropy as c'
python3 benchmarks/tune/tune.py --backend triton --ops cross_entropy --dtypes bf16,fp32 \
  --cases 8192x32000,8192x128256,4096x262144 --directions forward --csv "$OUT/triton_ce_loop.csv" \
  --variant "default:" --variant "b16k_w8:$C; c.LOOP_CONFIGS = {4: (16384, 8), 2: (16384, 8)}" \
  --variant "b8k_w4:$C; c.LOOP_CONFIGS = {4: (8192, 4), 2: (8192, 4)}" \
  --variant "b8k_w8:$C; c.LOOP_CONFIGS = {4: (8192, 8), 2: (8192, 8)}" \
  --variant "b16k_w16:$C; c.LOOP_CONFIGS = {4: (16384, 16), 2: (16384, 16)}" \
  --variant "s2:$C; c.LOOP_STAGES = 2" || echo "cross-entropy loop tuning failed: rc=$?"
