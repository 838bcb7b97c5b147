#!/usr/bin/env bash
# Block-sparse slabs (session 13). Triton: tile programs holding the whole eighths of their slab that their rows
# need (SLAB_STEPS 8, the default) against whole quarters (4), the whole power-of-two slab (1: the kernels of
# session 12), eighths in tiles of 4096 elements, and eighths with the launches by length always or never
# (BUCKETS_SAVE 0 / 1). CuPy: the values a thread holds (FORWARD_FLOATS, BACKWARD_FLOATS 32 -> 64, so that a
# row of up to 2048 bf16 elements is one tile, read once). Compiles first in parallel processes (the kernels'
# disk caches), then times serially. Writes $OUT/blocksparse_slabs_triton.csv, $OUT/blocksparse_slabs_cupy.csv.
set -uo pipefail
OUT=${OUT:-/tmp/multisoft-tune}
mkdir -p "$OUT"
S='import multisoft_triton.blocksparse as b; b._schedules.clear()'
triton=(
  --variant "steps8:$S"
  --variant "steps1:$S; b.SLAB_STEPS = 1"
  --variant "steps4:$S; b.SLAB_STEPS = 4"
  --variant "steps8_tile4k:$S; b.TILE_ELEMENTS = 4096"
  --variant "steps8_save0:$S; b.BUCKETS_SAVE = {'forward': {4: 0.0, 2: 0.0}, 'backward': {4: 0.0, 2: 0.0}}"
  --variant "steps8_save1:$S; b.BUCKETS_SAVE = {'forward': {4: 1.0, 2: 1.0}, 'backward': {4: 1.0, 2: 1.0}}"
)
C='import multisoft_cupy.blocksparse as c'
cupy=(
  --variant "floats32:"
  --variant "floats64:$C; c.FORWARD_FLOATS = 64; c.BACKWARD_FLOATS = 64"
  --variant "fwd64:$C; c.FORWARD_FLOATS = 64"
)
common=(--ops blocksparse_softmax --directions forward,backward)
warm() {  # $1: backend; then the variants (flag, value pairs): one process per variant and dtype, in parallel
  local backend=$1
  shift
  while [ $# -gt 0 ]; do
    for dtype in fp32 bf16; do
      python3 benchmarks/tune/tune.py --backend "$backend" "${common[@]}" --dtypes "$dtype" --warmup 0.1 --rep 0.1 \
        "$1" "$2" >/dev/null 2>&1 &
    done
    shift 2
  done
  wait
}
echo "warming $(date +%T)"
warm triton "${triton[@]}"
warm cupy "${cupy[@]}"
echo "timing $(date +%T)"
python3 benchmarks/tune/tune.py --backend triton "${common[@]}" --dtypes bf16,fp32 \
  --csv "$OUT/blocksparse_slabs_triton.csv" "${triton[@]}" || echo "triton block-sparse slabs failed: rc=$?"
python3 benchmarks/tune/tune.py --backend cupy "${common[@]}" --dtypes bf16,fp32 \
  --csv "$OUT/blocksparse_slabs_cupy.csv" "${cupy[@]}" || echo "cupy block-sparse floats failed: rc=$?"
echo "done $(date +%T)"
