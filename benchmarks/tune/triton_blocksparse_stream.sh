#!/usr/bin/env bash
# Triton block-sparse (session 13): rows streamed, a program per STREAM_ROWS rows of a block-row walking its blocks
# twice (STREAM, the default) against the tile and loop kernels of session 12 (STREAM off), and the stream's step
# size and warps. Compiles first in parallel processes (triton's disk cache), then times serially.
# Writes $OUT/triton_blocksparse_stream.csv.
set -uo pipefail
OUT=${OUT:-/tmp/multisoft-tune}
mkdir -p "$OUT"
S='import multisoft_triton.blocksparse as b; b._schedules.clear()'
OFF="{'forward': {4: False, 2: False}, 'backward': {4: False, 2: False}}"
variants=(
  --variant "stream:$S"
  --variant "tile:$S; b.STREAM = $OFF"
  --variant "stream_e4k:$S; b.STREAM_ELEMENTS = 4096"
  --variant "stream_e4k_w8:$S; b.STREAM_ELEMENTS = 4096; b.STREAM_WARPS = 8"
  --variant "stream_e1k:$S; b.STREAM_ELEMENTS = 1024"
  --variant "stream_w8:$S; b.STREAM_WARPS = 8"
)
common=(--backend triton --ops blocksparse_softmax --directions forward,backward)
echo "warming $(date +%T)"
set -- "${variants[@]}"
while [ $# -gt 0 ]; do
  for dtype in fp32 bf16; do
    python3 benchmarks/tune/tune.py "${common[@]}" --dtypes "$dtype" --warmup 0.1 --rep 0.1 "$1" "$2" >/dev/null 2>&1 &
  done
  shift 2
done
wait
echo "timing $(date +%T)"
python3 benchmarks/tune/tune.py "${common[@]}" --dtypes bf16,fp32 --csv "$OUT/triton_blocksparse_stream.csv" \
  "${variants[@]}" || echo "triton block-sparse stream tuning failed: rc=$?"
echo "done $(date +%T)"
