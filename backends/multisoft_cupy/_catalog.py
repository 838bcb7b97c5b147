"""Which kernel instantiations exist and which one a call uses; imports no CUDA framework.

The NVRTC compile test (tests/test_cuda_sources_compile.py) builds exactly the
name expressions listed here, so every launchable kernel is compiled in CI.
"""

from __future__ import annotations

import math
import pathlib
from typing import NamedTuple

PACKAGE_DIR = pathlib.Path(__file__).resolve().parent
SOURCES = ("softmax.cu", "cross_entropy.cu", "blocksparse.cu")
HEADERS = ("common.cuh",)
CUDA_TYPES = ("float", "f16_t", "bf16_t")
INDEX_TYPES = ("int", "long long")
OPTIONS = ("--std=c++17", f"-I{PACKAGE_DIR}")
CLUSTER_MIN_CC = 90  # thread-block clusters: sm_90 and newer
MAX_GRID = 2**31 - 1


class RowConfig(NamedTuple):
    """TPR threads per row group, ROWS row groups per block, VPT 16-byte vectors per thread, CLUSTER blocks per row,
    MIN_BLOCKS resident blocks per multiprocessor that the register use must allow (0: the kernel's default)."""

    tpr: int
    rows: int
    vpt: int
    cluster: int = 1
    min_blocks: int = 0

    @property
    def threads(self) -> int:
        return self.tpr * self.rows

    def capacity(self, elem_size: int) -> int:
        """Columns one pass holds in registers."""
        return self.tpr * self.vpt * (16 // elem_size) * self.cluster


SOFTMAX_CONFIGS = (
    RowConfig(32, 4, 1), RowConfig(32, 4, 2), RowConfig(32, 4, 4), RowConfig(32, 4, 8),
    RowConfig(256, 1, 2), RowConfig(256, 1, 4), RowConfig(512, 1, 4), RowConfig(1024, 1, 4),
    RowConfig(1024, 1, 8),
    RowConfig(1024, 1, 4, 2), RowConfig(1024, 1, 4, 4), RowConfig(1024, 1, 4, 8),
    RowConfig(1024, 1, 8, 2), RowConfig(1024, 1, 8, 4), RowConfig(1024, 1, 8, 8),
    RowConfig(512, 1, 4, 2), RowConfig(512, 1, 4, 4), RowConfig(512, 1, 4, 8),
    RowConfig(512, 1, 8, 2), RowConfig(512, 1, 8, 4), RowConfig(512, 1, 8, 8),
)
# Compiled as well, for SOFTMAX_RULES only (softmax_config's heuristic takes SOFTMAX_CONFIGS): register caps,
# several rows per warp (TPR < 32).
SOFTMAX_RULE_CONFIGS = (
    RowConfig(32, 4, 2, 1, 8), RowConfig(32, 4, 4, 1, 8), RowConfig(128, 1, 1, 1, 8), RowConfig(256, 1, 1, 1, 4),
    RowConfig(8, 16, 4), RowConfig(16, 8, 2), RowConfig(16, 8, 4),
)
CE_FWD_CONFIGS = (
    RowConfig(32, 4, 2), RowConfig(256, 1, 4), RowConfig(256, 1, 4, 4), RowConfig(256, 1, 4, 8),
    RowConfig(32, 4, 4), RowConfig(256, 1, 4, 1, 4), RowConfig(256, 1, 8, 1, 4),
)
# Backward: TPR threads per block, VPT vectors per thread (rows, cluster unused).
CE_BWD_CONFIGS = (RowConfig(256, 1, 4, 1, 4), RowConfig(256, 1, 8, 1, 4), RowConfig(512, 1, 4, 1, 2),
                  RowConfig(256, 1, 4))
CE_BWD_CONFIG = CE_BWD_CONFIGS[0]
# Measured exceptions to the heuristics below, first match wins: softmax (direction, element size,
# low, high, config) and cross-entropy forward (element size, low, high, config) for low < columns <= high.
# A cluster configuration is skipped below CLUSTER_MIN_CC.
SOFTMAX_RULES = (
    # bf16 rows of 256 and 512 columns: several rows per warp. H200 (tuning/short-rows-round1.txt):
    # forward 0.63 -> 0.90 of copy at 256 columns, 0.86 -> 0.90 at 512; backward 0.92 -> 0.98 at 256.
    ("fwd", 2, 128, 256, RowConfig(8, 16, 4)),
    ("fwd", 2, 256, 512, RowConfig(16, 8, 4)),
    ("bwd", 2, 128, 256, RowConfig(16, 8, 2)),
)
CE_FWD_RULES: tuple = ()
# The block-sparse backward's lanes per row (blocksparse_backward_lanes): measured on an H200
# (tuning/cupy-blocksparse-lanes.txt, round 3), 64 bytes of the mean row a lane against a warp a row: the 11 % layouts
# bf16 0.89 -> 0.97 (causal 0.87 -> 0.94), the rest level; 128 took bf16 b16 causal 0.76 -> 0.82 but lost 0.02-0.06
# on the other bf16 layouts, 256 lost everywhere.
BLOCKSPARSE_BACKWARD_LANE_BYTES = 64
# By direction: the lanes a row compiled as constants (LOG2LANES in blocksparse.cu: constant strides and reductions)
# in the staged forward and the register backward; other lane counts are taken at launch. Measured on an H200: a warp
# a row so compiled (tuning/cupy-whole-warp.txt), forward fp32 +0.00-0.04 (50 % 0.88 -> 0.93), bf16 50 % 0.87 ->
# 0.91, backward bf16 causal 0.01-0.02 slower, the rest level; every lane count of the forward (the rows sharing a
# warp, tuning/cupy-compiled-lanes.txt) bf16 25 % and 11 % +0.02-0.04 (b64 0.83 -> 0.86, 11 % 0.83 -> 0.87), causal
# +0.01-0.03; the backward's fewer lanes level.
BLOCKSPARSE_LANE_COUNTS = (1, 2, 4, 8, 16, 32)  # every lanes a row the block-sparse kernels may take
BLOCKSPARSE_COMPILED_LANES = {"fwd": BLOCKSPARSE_LANE_COUNTS, "bwd": ()}
BLOCKSPARSE_CONFIGS = (RowConfig(32, 4, 2), RowConfig(32, 4, 4), RowConfig(32, 4, 5), RowConfig(32, 4, 8),
                       RowConfig(32, 4, 16))


class BlockSparseStaged(NamedTuple):
    """The staged forward: WARPS warps per block, LANES lanes per row (32 / LANES rows a warp), each row staged CAP
    16-byte vectors at a time; UNROLL vectors a lane works on at once; MIN_BLOCKS resident blocks per multiprocessor
    (0: the default)."""

    warps: int
    cap: int
    unroll: int = 1
    min_blocks: int = 0
    lanes: int = 32

    @property
    def row_stride(self) -> int:
        """16-byte vectors between two rows' buffers: CAP, and LANES more where fewer than 8 lanes a row (one
        shared-memory wavefront of 16-byte loads) would otherwise read the same banks in every row."""
        return self.cap + (self.lanes if self.lanes < 8 else 0)

    @property
    def rows(self) -> int:
        """Rows a block works on at once."""
        return self.warps * 32 // self.lanes

    @property
    def shared_bytes(self) -> int:
        return self.rows * self.row_stride * 16

    def grid(self, rows: int) -> int:
        """Blocks: one per `rows` rows, within the grid limit (beyond it the blocks walk rows)."""
        return min(-(-rows // self.rows), MAX_GRID)


# The block-sparse forward stages rows in shared memory (bs_fwd_staged) where the layout's mean row is
# BLOCKSPARSE_STAGED_FROM elements or more, in a buffer that holds the longest row, or BLOCKSPARSE_STAGED_MARGIN times
# the mean row if that is less: a larger buffer leaves room for fewer warps (longer rows are staged in parts,
# twice). Measured on an H200 (tuning/cupy-blocksparse-staged.txt), staged against the register kernel: bf16
# 0.64-0.80 -> 0.70-0.91 of copy (causal 0.55-0.71 -> 0.66-0.85), float32 0.78-0.92 -> 0.86-0.96; the 11 % layouts
# (mean row about 450) lost (0.61 against 0.64 bf16, 0.73 against 0.81 float32 causal); a buffer for the longest
# row took float32 causal 25 % layouts to 0.68-0.77 (against 0.86-0.90); 2 warps a block beat 4 and 8, 4 vectors
# at once and register caps were level or slower. The backward staged lost (bf16 0.66-0.80 against 0.75-0.90 on
# the 25 % causal layouts): it keeps the register kernel. Since session 21 a row takes the lanes that give each
# about BLOCKSPARSE_STAGED_LANE_VECTORS vectors of the mean row (blocksparse_staged_lanes), several rows a warp,
# and every layout is staged (tuning/cupy-blocksparse-lanes.txt, same run, against a warp a row and the register
# kernel below a mean row of 512): bf16 0.53-0.87 -> 0.69-0.87 (11 % 0.64 -> 0.84, causal 0.53 -> 0.78; b16 0.70 ->
# 0.74), float32 0.81-0.96 -> 0.85-0.96 (11 % 0.89 -> 0.95, causal 0.81 -> 0.92); 4 or 16 vectors a lane, 1 or 4
# warps a block were level or slower (1 warp: float32 50 % 0.88 -> 0.92, the rest 0.01-0.03 slower). The lane count
# read at run time made the kernel 0.02-0.04 slower on the 50 % layouts (full runs of sessions 20 and 21: bf16 0.905
# -> 0.864, float32 0.925 -> 0.881), where a row still takes a warp.
BLOCKSPARSE_STAGED_FROM = 0
BLOCKSPARSE_STAGED_MARGIN = 1.25
BLOCKSPARSE_STAGED_WARPS = 2
BLOCKSPARSE_STAGED_CAPS = (64, 128, 256, 512, 1024)
BLOCKSPARSE_STAGED_UNROLL = 1
BLOCKSPARSE_STAGED_MIN_BLOCKS = 0
BLOCKSPARSE_STAGED_LANE_VECTORS = 8


class StagedConfig(NamedTuple):
    """Rows staged in shared memory: TPR threads per row (a block, or a warp of ROWS per block),
    CLUSTER blocks per row (TPR > 32 only), SLICE columns per row group."""

    tpr: int
    rows: int
    cluster: int
    slice: int

    @property
    def threads(self) -> int:
        return self.tpr * self.rows

    def shared_bytes(self, direction: str, elem_size: int) -> int:
        return self.rows * _STAGED_TENSORS[direction] * self.slice * elem_size


_STAGED_TENSORS = {"fwd": 1, "bwd": 2}  # x; y and dy
STAGED_BLOCKS = ((256, 1), (512, 1))  # (TPR, ROWS) of a block per row, also in clusters
STAGED_WARPS = ((32, 4), (32, 8))  # (TPR, ROWS) of a warp per row
STAGED_CLUSTERS = (1, 2, 4, 8)
# A block (or cluster) per row for low < columns <= high, by (direction, element size); absent: never.
# Measured on an H200 (benchmarks/results/tuning/cupy-staged-round*.txt, short-rows-round1.txt): the float32
# backward is faster in registers; the forward of 16384 columns 0.80 -> 0.90 of copy (float32), 0.81 -> 0.85
# (bf16); float32 rows of 8192 and of 32768 stay in registers (0.92 against 0.90 at 8192), float32 rows from
# 65536 are split (SPLIT_MIN_COLUMNS) up to lengths whose slices no longer fit.
STAGED_BLOCK_COLUMNS = {("fwd", 4): (8192, 16384), ("fwd", 2): (8192, math.inf), ("bwd", 2): (65536, math.inf)}
STAGED_BLOCK_THREADS = {"fwd": 512, "bwd": 256}
# A warp per row, STAGED_WARP_ROWS rows per block, for low < columns <= high, by (direction, element size):
# where it measured faster than the register kernels on an H200 (cupy-staged-warps-round1.txt,
# short-rows-round1.txt; e.g. the bf16 forward of 4096 columns 0.76 -> 0.90 of copy, of 2048 0.89 -> 0.92,
# the float32 backward of 1024 columns 0.88 -> 0.96, the float32 forward of 2048 0.88 -> 0.96, the bf16
# backward of 2048 0.64 -> 0.97).
STAGED_WARP_COLUMNS = {("fwd", 4): (512, 2048), ("bwd", 4): (512, 1024), ("fwd", 2): (1024, 8192),
                       ("bwd", 2): (512, 2048)}
STAGED_WARP_ROWS = 4
# The most shared memory a block stages: three blocks per H200 multiprocessor. Longer slices (a float32 row of
# 262144 in a cluster of 8: one block per multiprocessor) measured slower than the register kernels.
STAGED_BLOCK_BYTES = 64 * 1024


class SplitConfig(NamedTuple):
    """A long row split over blocks that wait for each other through global memory (softmax.cu,
    softmax_{fwd,bwd}_split): THREADS per block holding VPT 16-byte vectors each of every tensor, so
    CHUNK = THREADS x VPT x VEC columns of the row per block."""

    threads: int
    vpt: int
    chunk: int


SPLIT_CONFIGS = ((128, 8), (128, 16))  # instantiated (threads, VPT)
# Split rows from these column counts on, by (direction, element size); absent: never. Measured on an H200
# against the cluster and register kernels (tuning/cupy-split-round2..4.txt), 128 threads of 16 vectors:
# backward float32 0.84 -> 0.98 at 131072 columns, 0.82 -> 0.95 at 262144; bf16 0.80 -> 0.91 at 262144 (rows
# of 32768 stay on the tile: 0.99 against 0.93 split). The forward only gains in float32, since it takes one
# exponential per element (tuning/split-exp-once-round1.txt, against the staged kernels): 0.83 -> 0.87 at
# 65536 columns, 0.87 -> 0.88 at 131072; bf16 loses (0.79 -> 0.66 at 262144), as do rows of 32768 (0.96 on the
# tile, 0.91 split). One exponential against two, same run (cupy-split-exp-once-round1.txt): softmax 0.83-0.85
# -> 0.87-0.88 at 65536-262144 columns, log_softmax (one either way) level.
SPLIT_MIN_COLUMNS = {("bwd", 4): 32768, ("bwd", 2): 65536, ("fwd", 4): 65536}
# (threads, VPT) by direction: the first that cuts the row into no more chunks than the GPU has multiprocessors
# (so that all chunks of a row can run at once).
SPLIT_CHOICES = {"fwd": ((128, 16),), "bwd": ((128, 16),)}
SPLIT_COUNTER_STRIDE = 32  # int32s between row counters; MS_COUNTER_STRIDE in softmax.cu


def _row_kernel(name: str, ctype: str, cfg: RowConfig, index_type: str | None = None) -> str:
    types = ctype if index_type is None else f"{ctype}, {index_type}"
    min_blocks = f", {cfg.min_blocks}" if cfg.min_blocks else ""
    if cfg.cluster > 1:
        return f"{name}_cluster<{types}, {cfg.tpr}, {cfg.vpt}, {cfg.cluster}{min_blocks}>"
    return f"{name}<{types}, {cfg.tpr}, {cfg.rows}, {cfg.vpt}{min_blocks}>"


def softmax_kernel(direction: str, ctype: str, cfg: RowConfig) -> str:
    return _row_kernel(f"softmax_{direction}", ctype, cfg)


def split_kernel(direction: str, ctype: str, cfg: SplitConfig) -> str:
    return f"softmax_{direction}_split<{ctype}, {cfg.threads}, {cfg.vpt}>"


def staged_kernel(direction: str, ctype: str, cfg: StagedConfig) -> str:
    if cfg.cluster > 1:
        return f"softmax_{direction}_staged_cluster<{ctype}, {cfg.tpr}, {cfg.cluster}>"
    return f"softmax_{direction}_staged<{ctype}, {cfg.tpr}, {cfg.rows}>"


def ce_fwd_kernel(ctype: str, index_type: str, cfg: RowConfig) -> str:
    return _row_kernel("ce_fwd", ctype, cfg, index_type)


def ce_bwd_kernel(ctype: str, index_type: str, cfg: RowConfig) -> str:
    min_blocks = f", {cfg.min_blocks}" if cfg.min_blocks else ""
    return f"ce_bwd<{ctype}, {index_type}, {cfg.tpr}, {cfg.vpt}{min_blocks}>"


def _log2lanes(direction: str, lanes: int) -> int:
    """The LOG2LANES template argument: log2(lanes) where compiled as a constant (BLOCKSPARSE_COMPILED_LANES), else -1
    (taken at launch)."""
    return lanes.bit_length() - 1 if lanes in BLOCKSPARSE_COMPILED_LANES[direction] else -1


def blocksparse_kernel(direction: str, ctype: str, cfg: RowConfig, lanes: int = 32) -> str:
    """The register kernel (the forward: a warp a row); the backward's lanes a row as _log2lanes."""
    if direction == "bwd":
        return f"bs_bwd<{ctype}, {cfg.tpr}, {cfg.rows}, {cfg.vpt}, {cfg.min_blocks}, {_log2lanes('bwd', lanes)}>"
    return _row_kernel(f"bs_{direction}", ctype, cfg)


def blocksparse_staged_kernel(ctype: str, cfg: BlockSparseStaged) -> str:
    """The staged forward, its lanes a row as _log2lanes."""
    log2lanes = _log2lanes("fwd", cfg.lanes)
    return f"bs_fwd_staged<{ctype}, {cfg.warps}, {cfg.cap}, {cfg.unroll}, {cfg.min_blocks}, {log2lanes}>"


def _usable(configs, cc: int):
    return [c for c in configs if c.cluster == 1 or cc >= CLUSTER_MIN_CC]


def expressions(source: str, ctype: str, cc: int) -> tuple[str, ...]:
    """Every name expression of `source` for element type `ctype` on compute capability `cc` (e.g. 90)."""
    if source == "softmax.cu":
        rows = [softmax_kernel(d, ctype, c) for d in ("fwd", "bwd")
                for c in _usable(SOFTMAX_CONFIGS + SOFTMAX_RULE_CONFIGS, cc)]
        clusters = [c for c in STAGED_CLUSTERS if c == 1 or cc >= CLUSTER_MIN_CC]
        staged = [StagedConfig(t, r, c, 0) for t, r in STAGED_BLOCKS for c in clusters]
        staged += [StagedConfig(t, r, 1, 0) for t, r in STAGED_WARPS]
        split = [split_kernel(d, ctype, SplitConfig(t, v, 0)) for d in ("fwd", "bwd") for t, v in SPLIT_CONFIGS]
        return tuple(rows + [staged_kernel(d, ctype, c) for d in ("fwd", "bwd") for c in staged] + split)
    if source == "cross_entropy.cu":
        fwd = [ce_fwd_kernel(ctype, i, c) for i in INDEX_TYPES for c in _usable(CE_FWD_CONFIGS, cc)]
        return tuple(fwd + [ce_bwd_kernel(ctype, i, c) for i in INDEX_TYPES for c in CE_BWD_CONFIGS])
    if source == "blocksparse.cu":
        lanes = BLOCKSPARSE_LANE_COUNTS
        staged = [blocksparse_staged_kernel(ctype, _staged(cap, n)) for cap in BLOCKSPARSE_STAGED_CAPS for n in lanes]
        registers = [blocksparse_kernel("fwd", ctype, c) for c in BLOCKSPARSE_CONFIGS]
        registers += [blocksparse_kernel("bwd", ctype, c, n) for c in BLOCKSPARSE_CONFIGS for n in lanes]
        return tuple(dict.fromkeys(registers + staged))
    raise ValueError(f"unknown source {source!r}")


def _smallest_fitting(configs, columns: int, elem_size: int):
    for cfg in configs:
        if cfg.capacity(elem_size) >= columns:
            return cfg
    return configs[-1]


def _half_forward_config(columns: int, cc: int) -> RowConfig:
    """16-bit forward. Measured on an H200: warps, or 512-thread blocks (two per multiprocessor)
    over two register tiles, beat one pass of 1024-thread blocks."""
    if columns <= 1024:
        return _smallest_fitting((RowConfig(32, 4, 1), RowConfig(32, 4, 2), RowConfig(32, 4, 4)), columns, 2)
    if columns <= 4096:
        return RowConfig(32, 4, 4)
    if columns <= 8192:
        return RowConfig(256, 1, 4)
    if columns <= 32768 or cc < CLUSTER_MIN_CC:
        return RowConfig(512, 1, 4)
    for cluster in (2, 4, 8):
        cfg = RowConfig(512, 1, 4, cluster)
        if 2 * cfg.capacity(2) >= columns:
            return cfg
    return RowConfig(512, 1, 4, 8)


def _ruled(rules, key: tuple, columns: int, cc: int) -> RowConfig | None:
    for *rule_key, low, high, cfg in rules:
        if tuple(rule_key) == key and low < columns <= high and _usable((cfg,), cc):
            return cfg
    return None


def softmax_config(direction: str, columns: int, elem_size: int, cc: int) -> RowConfig:
    """A SOFTMAX_RULES entry, else mostly the smallest configuration that holds the row in registers
    (the widest loops over tiles)."""
    ruled = _ruled(SOFTMAX_RULES, (direction, elem_size), columns, cc)
    if ruled is not None:
        return ruled
    if direction == "fwd" and elem_size == 2:
        return _half_forward_config(columns, cc)
    if direction == "bwd" and elem_size == 2 and 512 < columns <= 1024:
        return RowConfig(32, 4, 2)  # measured: two tiles per warp beat one
    usable = _usable(SOFTMAX_CONFIGS, cc)
    # 16-byte vectors per thread that stay in registers without spilling at 1024 threads
    budget = 8 if direction == "fwd" and elem_size == 4 else 4
    ordered = sorted((c for c in usable if c.vpt <= budget),
                     key=lambda c: (c.capacity(elem_size), c.cluster, -c.tpr))
    return _smallest_fitting(ordered, columns, elem_size)


def staged_config(direction: str, columns: int, elem_size: int, cc: int,
                  max_shared: int) -> StagedConfig | None:
    """Staging in shared memory (sm_80+, clusters sm_90+): a warp per row inside a STAGED_WARP_COLUMNS
    range, a block per row inside a STAGED_BLOCK_COLUMNS range, split over the fewest blocks of a cluster whose
    slices take at most STAGED_BLOCK_BYTES (and `max_shared`) per block; None when neither applies."""
    if cc < 80:
        return None
    key = (direction, elem_size)
    vec = 16 // elem_size
    limit = min(STAGED_BLOCK_BYTES, max_shared)
    low, high = STAGED_WARP_COLUMNS.get(key, (0, 0))
    if low < columns <= high:
        cfg = StagedConfig(32, STAGED_WARP_ROWS, 1, -(-columns // vec) * vec)
        return cfg if cfg.shared_bytes(direction, elem_size) <= limit else None
    low, high = STAGED_BLOCK_COLUMNS.get(key, (0, 0))
    if not low < columns <= high:
        return None
    for cluster in STAGED_CLUSTERS:
        if cluster > 1 and cc < CLUSTER_MIN_CC:
            break
        per_block = -(-columns // cluster)
        cfg = StagedConfig(STAGED_BLOCK_THREADS[direction], 1, cluster, -(-per_block // vec) * vec)
        if cfg.shared_bytes(direction, elem_size) <= limit:
            return cfg
    return None


def split_config(direction: str, rows: int, columns: int, elem_size: int, cc: int,
                 sm_count: int) -> SplitConfig | None:
    """Rows split over blocks (sm_80+) from SPLIT_MIN_COLUMNS on: the first compiled SPLIT_CHOICES entry
    whose chunks of a row all fit on the GPU at once; None when none applies."""
    key = (direction, elem_size)
    if cc < 80 or key not in SPLIT_MIN_COLUMNS or columns < SPLIT_MIN_COLUMNS[key]:
        return None
    for threads, vpt in SPLIT_CHOICES[direction]:
        cfg = SplitConfig(threads, vpt, threads * vpt * (16 // elem_size))
        chunks = -(-columns // cfg.chunk)
        if (threads, vpt) in SPLIT_CONFIGS and chunks <= sm_count and rows * chunks <= MAX_GRID:
            return cfg
    return None


def staged_grid(rows: int, cfg: StagedConfig) -> int:
    """Blocks for a staged launch: a cluster (or block) per row group, within the grid limit (beyond it they
    walk rows).
    Measured slower on an H200: persistent clusters (as many as fit, each walking its share of the rows;
    clusters that did not fit ran after the others), and two buffers per block copying the next row while
    working on the current one (fewer blocks per multiprocessor)."""
    return min(-(-rows // cfg.rows), MAX_GRID // cfg.cluster) * cfg.cluster


def ce_fwd_config(rows: int, classes: int, elem_size: int, cc: int, sm_count: int) -> RowConfig:
    """A CE_FWD_RULES entry, else a warp per short row; a 256-thread block per row; a cluster per row when
    rows are too few to fill the GPU."""
    ruled = _ruled(CE_FWD_RULES, (elem_size,), classes, cc)
    if ruled is not None:
        return ruled
    if classes <= CE_FWD_CONFIGS[0].capacity(elem_size):
        return CE_FWD_CONFIGS[0]
    tiles = -(-classes // CE_FWD_CONFIGS[1].capacity(elem_size))
    if cc < CLUSTER_MIN_CC or rows >= 2 * sm_count or tiles < 8:
        # 16-bit: held to 64 registers, four blocks per multiprocessor (H200: 0.69 -> 0.76 of copy at 32000
        # classes, 0.93 -> 0.99 at 128256)
        return RowConfig(256, 1, 4, 1, 4) if elem_size == 2 else CE_FWD_CONFIGS[1]
    return CE_FWD_CONFIGS[2] if rows >= sm_count // 2 else CE_FWD_CONFIGS[3]


def blocksparse_floats(choices: tuple, mean_row: float) -> int:
    """Values per thread: the first of `choices` whose tile (a warp's share of a row) holds `mean_row` elements,
    else the last."""
    return next((floats for floats in choices if 32 * floats >= mean_row), choices[-1])


def _nearest_lanes(share: float, least: int) -> int:
    """The power of two of lanes nearest `share` (at least 1), at most 32 and at least `least`."""
    return max(least, min(32, 1 << round(math.log2(max(1.0, share)))))


def blocksparse_backward_lanes(mean_row: float, block: int, elem_size: int) -> int:
    """Lanes per row of the backward (register kernel): the power of two nearest the mean row's bytes over
    BLOCKSPARSE_BACKWARD_LANE_BYTES (None: 32), at most 32, at least the vectors of a block's row and 32 / B (a
    warp's rows within one block-row)."""
    if BLOCKSPARSE_BACKWARD_LANE_BYTES is None:
        return 32
    least = max(32 // block, block * elem_size // 16)
    return _nearest_lanes(mean_row * elem_size / BLOCKSPARSE_BACKWARD_LANE_BYTES, least)


def blocksparse_config(row_length: float, elem_size: int, floats_per_thread: int) -> RowConfig:
    """A warp per row: the smallest tile holding `row_length` elements (the layout's mean row: longer rows take
    more tiles), at most `floats_per_thread` values per thread."""
    fitting = [c for c in BLOCKSPARSE_CONFIGS if c.vpt * (16 // elem_size) <= floats_per_thread]
    return _smallest_fitting(fitting or BLOCKSPARSE_CONFIGS[:1], row_length, elem_size)


def _staged(cap: int, lanes: int = 32) -> BlockSparseStaged:
    return BlockSparseStaged(BLOCKSPARSE_STAGED_WARPS, cap, BLOCKSPARSE_STAGED_UNROLL, BLOCKSPARSE_STAGED_MIN_BLOCKS,
                             lanes)


def blocksparse_staged_lanes(mean_row: float, block: int, elem_size: int) -> int:
    """Lanes per row of the staged forward: the power of two nearest the mean row's 16-byte vectors over
    BLOCKSPARSE_STAGED_LANE_VECTORS (None: 32), at most 32 and at least 32 / B (a warp's rows within one
    block-row)."""
    if BLOCKSPARSE_STAGED_LANE_VECTORS is None:
        return 32
    return _nearest_lanes(mean_row * elem_size / 16 / BLOCKSPARSE_STAGED_LANE_VECTORS, 32 // block)


def blocksparse_staged_config(mean_row: float, longest_row: int, elem_size: int, cc: int,
                              block: int) -> BlockSparseStaged | None:
    """The staged forward for a layout of this mean and longest row (elements) and block size on sm_80+, if its
    mean row is BLOCKSPARSE_STAGED_FROM or more: the smallest compiled buffer that holds the longest row, or
    BLOCKSPARSE_STAGED_MARGIN x the mean row if less, else the largest; blocksparse_staged_lanes lanes a row, or
    more where a block's row buffers would otherwise pass STAGED_BLOCK_BYTES; None otherwise."""
    if cc < 80 or mean_row < BLOCKSPARSE_STAGED_FROM:
        return None
    row_length = min(longest_row, BLOCKSPARSE_STAGED_MARGIN * mean_row)
    vectors = math.ceil(row_length / (16 // elem_size))
    cap = next((c for c in BLOCKSPARSE_STAGED_CAPS if c >= vectors), BLOCKSPARSE_STAGED_CAPS[-1])
    cfg = _staged(cap, blocksparse_staged_lanes(mean_row, block, elem_size))
    while cfg.shared_bytes > STAGED_BLOCK_BYTES and cfg.lanes < 32:
        cfg = cfg._replace(lanes=2 * cfg.lanes)
    return cfg


def grid_blocks(rows: int, cfg: RowConfig) -> int:
    """Blocks for a row-loop kernel: one row group per row, capped at the grid limit."""
    blocks = -(-rows // cfg.rows) * cfg.cluster
    return min(blocks, MAX_GRID // cfg.cluster * cfg.cluster)
