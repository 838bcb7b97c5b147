#!/usr/bin/env bash
# Triton split softmax forward of long rows (see triton_split_pipeline.py): the current split path (base)
# against the same kernel without its wait (nowait: wrong results, the wait's cost) and against persistent
# programs that hold two chunks and load the next before waiting for the current one's row
# (pipe_CHUNK_WARPS_PERSM). Writes $OUT/triton_split_pipeline.csv.
set -uo pipefail
OUT=${OUT:-/tmp/multisoft-tune}
mkdir -p "$OUT"
export PYTHONPATH=benchmarks/tune${PYTHONPATH:+:$PYTHONPATH}
python3 benchmarks/tune/triton_split_pipeline.py || echo "pipelined check failed: rc=$?"
P='import multisoft_triton.softmax as s, triton_split_pipeline as p'
python3 benchmarks/tune/tune.py --backend triton --ops softmax,log_softmax --dtypes fp32,bf16 \
  --cases 4096x32768,1024x131072,512x262144 --directions forward --csv "$OUT/triton_split_pipeline.csv" \
  --variant "base:" \
  --variant "nowait_4k_4:$P; s.forward = p.nowait(4096, 4)" \
  --variant "nowait_8k_8:$P; s.forward = p.nowait(8192, 8)" \
  --variant "pipe_4k_4_5:$P; s.forward = p.pipelined(4096, 4, 5)" \
  --variant "pipe_4k_8_4:$P; s.forward = p.pipelined(4096, 8, 4)" \
  --variant "pipe_2k_4_8:$P; s.forward = p.pipelined(2048, 4, 8)" \
  --variant "pipe_8k_8_2:$P; s.forward = p.pipelined(8192, 8, 2)" \
  || echo "triton split pipeline tuning failed: rc=$?"
