#!/usr/bin/env bash
# CuPy softmax and cross-entropy configurations on the shapes below 0.90 of copy bandwidth.
# Run from the repo root on the GPU machine after the editable install; writes $OUT/cupy_dense.csv.
# Variants set multisoft_cupy._catalog.SOFTMAX_RULES / CE_FWD_RULES (element size 4: fp32, 2: bf16;
# a rule applies for low < columns <= high), CE_BWD_CONFIG, or cross_entropy.BACKWARD_LAST_ROW_FIRST.
# Variants with rules for long rows turn the split path (cupy_split.sh) off, which would take those rows.
# Round 1 chose: cross-entropy forward 16-bit 256-thread blocks held to 64 registers (now in the heuristic);
# the one-instruction 16-bit packing it also tried measured slower and was reverted.
set -uo pipefail
OUT=${OUT:-/tmp/multisoft-tune}
mkdir -p "$OUT"
CSV="$OUT/cupy_dense.csv"
K="import multisoft_cupy._catalog as k; R = k.RowConfig"
X="import multisoft_cupy.cross_entropy as x"
ALL=$((1 << 40))  # "every column count"

# softmax forward (log_softmax shares the kernels).
#  fwd_a: 512-thread cluster blocks with the row in registers, two blocks per multiprocessor (fp32 long rows,
#         bf16 32768 and 131072); bf16 262144 in one pass of 1024-thread blocks; bf16 <= 4096 warps held
#         to 64 registers (8 blocks per multiprocessor instead of 6).
#  fwd_b: 512-thread blocks over 2 (131072) or 4 (262144) fp32 tiles; bf16 1024 as one 128-thread block
#         per row, 4096 as one 256-thread pass, 32768 as one 1024-thread pass, 131072 as one pass of
#         1024-thread blocks in clusters of 4.
python3 benchmarks/tune/tune.py --backend cupy --ops softmax --dtypes fp32,bf16 \
  --cases 32768x1024,16384x4096,4096x32768,1024x131072,512x262144 --directions forward --csv "$CSV" \
  --variant "base:" \
  --variant "fwd_a:$K; k.SPLIT_MIN_COLUMNS = {}; k.SOFTMAX_RULES = (('fwd', 4, 65536, 262144, R(512, 1, 8, 8)), ('fwd', 2, 512, 4096, R(32, 4, 4, 1, 8)), ('fwd', 2, 16384, 32768, R(512, 1, 4, 2)), ('fwd', 2, 65536, 131072, R(512, 1, 4, 8)), ('fwd', 2, 131072, 262144, R(1024, 1, 4, 8)))" \
  --variant "fwd_b:$K; k.SPLIT_MIN_COLUMNS = {}; k.SOFTMAX_RULES = (('fwd', 4, 65536, 262144, R(512, 1, 4, 8)), ('fwd', 2, 512, 1024, R(128, 1, 1, 1, 8)), ('fwd', 2, 2048, 4096, R(256, 1, 2)), ('fwd', 2, 16384, 32768, R(1024, 1, 4)), ('fwd', 2, 65536, 131072, R(1024, 1, 4, 4)))" \
  || echo "softmax forward tuning failed: rc=$?"

# softmax backward.
#  bwd_a: 1024 columns in one pass with every thread busy (fp32: 256 threads, bf16: 128 threads per row);
#         fp32 131072 and bf16 131072/262144 as 512-thread cluster blocks, two per multiprocessor.
#  bwd_b: 1024 columns as two tiles per warp (fp32) or the current bf16 warps held to 64 registers.
python3 benchmarks/tune/tune.py --backend cupy --ops softmax --dtypes fp32,bf16 \
  --cases 32768x1024,1024x131072,512x262144 --directions backward --csv "$CSV" \
  --variant "base:" \
  --variant "bwd_a:$K; k.SPLIT_MIN_COLUMNS = {}; k.SOFTMAX_RULES = (('bwd', 4, 512, 1024, R(256, 1, 1, 1, 4)), ('bwd', 4, 65536, 131072, R(512, 1, 4, 8)), ('bwd', 2, 512, 1024, R(128, 1, 1, 1, 8)), ('bwd', 2, 65536, 262144, R(512, 1, 4, 8)))" \
  --variant "bwd_b:$K; k.SOFTMAX_RULES = (('bwd', 4, 512, 1024, R(32, 4, 4)), ('bwd', 2, 512, 1024, R(32, 4, 2, 1, 8)))" \
  || echo "softmax backward tuning failed: rc=$?"

# cross-entropy forward, bf16: a warp per row, or 256-thread blocks held to 64 registers (4 blocks per
# multiprocessor instead of 3) with 4 or 8 vectors per thread.
python3 benchmarks/tune/tune.py --backend cupy --ops cross_entropy --dtypes bf16 \
  --cases 8192x32000,8192x128256,4096x262144 --directions forward --csv "$CSV" \
  --variant "base:" \
  --variant "ce_fwd_warp:$K; k.CE_FWD_RULES = ((2, 0, $ALL, R(32, 4, 4)),)" \
  --variant "ce_fwd_cap:$K; k.CE_FWD_RULES = ((2, 0, $ALL, R(256, 1, 4, 1, 4)),)" \
  --variant "ce_fwd_v8:$K; k.CE_FWD_RULES = ((2, 0, $ALL, R(256, 1, 8, 1, 4)),)" \
  || echo "cross_entropy forward tuning failed: rc=$?"

# cross-entropy backward. base: 256 threads x 4 vectors held to 64 registers, last row first.
#  ce_bwd_nocap: no register cap (bf16 then takes 80-90 registers); ce_bwd_first_row: rows in order
#  (isolates the L2 reuse after the forward); ce_bwd_v8: 8 vectors per thread; ce_bwd_512: 512 threads.
python3 benchmarks/tune/tune.py --backend cupy --ops cross_entropy --dtypes bf16,fp32 \
  --cases 8192x32000,8192x128256,4096x262144 --directions backward,forward+backward --csv "$CSV" \
  --variant "base:" \
  --variant "ce_bwd_nocap:$K; k.CE_BWD_CONFIG = R(256, 1, 4)" \
  --variant "ce_bwd_first_row:$X; x.BACKWARD_LAST_ROW_FIRST = False" \
  --variant "ce_bwd_v8:$K; k.CE_BWD_CONFIG = R(256, 1, 8, 1, 4)" \
  --variant "ce_bwd_512:$K; k.CE_BWD_CONFIG = R(512, 1, 4, 1, 2)" \
  || echo "cross_entropy backward tuning failed: rc=$?"
