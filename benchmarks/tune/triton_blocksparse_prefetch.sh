#!/usr/bin/env bash
# Session 22: Triton's block-sparse row forward as persistent programs that load their next rows' held blocks before
# they reduce and store the current ones (FORWARD_PREFETCH_PROGRAMS a multiprocessor: 4 or 6; offline, sm_90: bf16
# b16x32 78 registers, 6 programs, against 63 and 8; float32 96 and 5 against 64 and 8) against a program per task
# (0), every layout (the 11 % ones take the across kernel either way). Every variant sets what it compares. Writes
# $OUT/triton_blocksparse_prefetch.csv.
set -uo pipefail
OUT=${OUT:-/tmp/multisoft-tune}
mkdir -p "$OUT"
B='import multisoft_triton.blocksparse as b'
python3 benchmarks/tune/tune.py --backend triton --ops blocksparse_softmax --dtypes fp32,bf16 --cases b \
  --directions forward --csv "$OUT/triton_blocksparse_prefetch.csv" \
  --variant "off:$B; b.FORWARD_PREFETCH_PROGRAMS = {4: 0, 2: 0}" \
  --variant "p4:$B; b.FORWARD_PREFETCH_PROGRAMS = {4: 4, 2: 4}" \
  --variant "p6:$B; b.FORWARD_PREFETCH_PROGRAMS = {4: 6, 2: 6}" \
  || echo "triton block-sparse prefetch tuning failed: rc=$?"
