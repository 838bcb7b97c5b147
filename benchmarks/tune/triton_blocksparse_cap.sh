#!/usr/bin/env bash
# Session 25: Triton's block-sparse forward with its registers capped (FORWARD_MAXNREG; ptxas .maxnreg) against no
# cap (base, first and last). Offline (triton_resources.py, sm_90): bf16 b64x8 56 registers, 9 programs a
# multiprocessor; capped at 48 / 40 / 32: 10 / 12 / 16 programs, 24 / 56 / 104 bytes of stack. Writes
# $OUT/triton_bs_cap.csv.
set -uo pipefail
OUT=${OUT:-/tmp/multisoft-tune}
mkdir -p "$OUT"
T='import multisoft_triton.blocksparse as b'
python3 benchmarks/tune/tune.py --backend triton --ops blocksparse_softmax --dtypes fp32,bf16 --cases b \
  --directions forward --csv "$OUT/triton_bs_cap.csv" \
  --variant "base:$T; b.FORWARD_MAXNREG = {4: None, 2: None}" \
  --variant "c48:$T; b.FORWARD_MAXNREG = {4: 48, 2: 48}" \
  --variant "c40:$T; b.FORWARD_MAXNREG = {4: 40, 2: 40}" \
  --variant "c32:$T; b.FORWARD_MAXNREG = {4: 32, 2: 32}" \
  --variant "base_again:$T; b.FORWARD_MAXNREG = {4: None, 2: None}" \
  || echo "triton block-sparse cap failed: rc=$?"
