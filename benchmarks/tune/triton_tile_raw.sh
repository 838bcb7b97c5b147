#!/usr/bin/env bash
# Triton softmax forward of 16-bit rows of 16384-32768 columns: the tile held as loaded and capped at 32
# registers (two 32-warp programs per multiprocessor; see triton_tile_raw.py) against the current tile
# held as floats (base, 48 registers: one program). Writes $OUT/triton_tile_raw.csv.
set -uo pipefail
OUT=${OUT:-/tmp/multisoft-tune}
mkdir -p "$OUT"
export PYTHONPATH=benchmarks/tune${PYTHONPATH:+:$PYTHONPATH}
python3 benchmarks/tune/triton_tile_raw.py || echo "tile raw check failed: rc=$?"
T='import multisoft_triton.softmax as s, triton_tile_raw as t'
python3 benchmarks/tune/tune.py --backend triton --ops softmax,log_softmax --dtypes bf16 --directions forward \
  --cases 4096x32768,2048x32768,4096x16384,16384x4096 --csv "$OUT/triton_tile_raw.csv" \
  --variant "base:" \
  --variant "raw_nocap:$T; s.forward = t.tile_raw(None)" \
  --variant "raw_32:$T; s.forward = t.tile_raw(32)" \
  --variant "raw_32_w16:$T; s.forward = t.tile_raw(32, 16)" \
  --variant "raw_40_w16:$T; s.forward = t.tile_raw(40, 16)" \
  --variant "raw_32_4k:$T; s.forward = t.tile_raw(32, None, 4096)" \
  || echo "triton tile raw tuning failed: rc=$?"
