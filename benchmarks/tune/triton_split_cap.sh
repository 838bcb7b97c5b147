#!/usr/bin/env bash
# Triton split softmax kernels of long rows capped at fewer registers (triton_split_cap.py): the float32
# forward has 56 (9 programs per multiprocessor; 48: 10 with 5 words spilled to local memory, 40: 12
# with 16), the bf16 one 48 (40: 12 programs, 32: 16), the bf16 backward held as loaded 56 and the float32
# backward 85 (64: 8 programs instead of 5). The spilled part of a chunk waits in L1 instead of registers.
# Writes $OUT/triton_split_cap.csv.
set -uo pipefail
OUT=${OUT:-/tmp/multisoft-tune}
mkdir -p "$OUT"
export PYTHONPATH=benchmarks/tune${PYTHONPATH:+:$PYTHONPATH}
C='import triton_split_cap as c'
python3 benchmarks/tune/tune.py --backend triton --ops softmax,log_softmax --dtypes fp32,bf16 \
  --cases 4096x32768,1024x131072,512x262144 --directions forward,backward --csv "$OUT/triton_split_cap.csv" \
  --variant "base:" \
  --variant "f48_b64:$C; c.capped(48, 64)" \
  --variant "f40_b48:$C; c.capped(40, 48)" \
  --variant "f32_b40:$C; c.capped(32, 40)" \
  --variant "base_again:" \
  || echo "triton split cap tuning failed: rc=$?"
