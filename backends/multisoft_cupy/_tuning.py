"""Every configuration the CuPy kernels take, by shape, dtype and GPU, and the functions that pick one.

Imports no CUDA framework (tests/test_cuda_sources_compile.py imports it without
cupy). What each setting gained and what lost against it: docs/tuning.md.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

CLUSTER_MIN_CC = 90  # thread-block clusters: sm_90 and newer
MAX_GRID = 2**31 - 1  # blocks in a grid's x dimension
MAX_GRID_Y = 65535  # blocks in a grid's y dimension


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


def usable(configs, cc: int) -> list:
    """The configurations of `configs` that compute capability `cc` (e.g. 90) can launch."""
    return [c for c in configs if c.cluster == 1 or cc >= CLUSTER_MIN_CC]


def grid_blocks(rows: int, cfg: RowConfig) -> int:
    """Blocks for a row-loop kernel: one row group per row, capped at the grid limit."""
    blocks = -(-rows // cfg.rows) * cfg.cluster
    return min(blocks, MAX_GRID // cfg.cluster * cfg.cluster)


# ---- softmax, rows in registers (softmax_rows.cu)

# The configurations softmax_config's heuristic chooses among.
SOFTMAX_CONFIGS = (
    RowConfig(32, 4, 1), RowConfig(32, 4, 2), RowConfig(32, 4, 4), RowConfig(32, 4, 8),
    RowConfig(256, 1, 2), RowConfig(256, 1, 4), RowConfig(512, 1, 4), RowConfig(1024, 1, 4),
    RowConfig(1024, 1, 8),
    RowConfig(1024, 1, 4, 2), RowConfig(1024, 1, 4, 4), RowConfig(1024, 1, 4, 8),
    RowConfig(1024, 1, 8, 2), RowConfig(1024, 1, 8, 4), RowConfig(1024, 1, 8, 8),
    RowConfig(512, 1, 4, 2), RowConfig(512, 1, 4, 4), RowConfig(512, 1, 4, 8),
    RowConfig(512, 1, 8, 2), RowConfig(512, 1, 8, 4), RowConfig(512, 1, 8, 8),
)
# Exceptions to the heuristic, first match wins: (direction, element size, low, high, config) for
# low < columns <= high; a cluster configuration is skipped below CLUSTER_MIN_CC. bf16 rows of 256 and 512
# columns in several row groups a warp (docs/tuning.md).
SOFTMAX_RULES = (
    ("fwd", 2, 128, 256, RowConfig(8, 16, 4)),
    ("fwd", 2, 256, 512, RowConfig(16, 8, 4)),
    ("bwd", 2, 128, 256, RowConfig(16, 8, 2)),
)


def _smallest_fitting(configs, columns: int, elem_size: int):
    for cfg in configs:
        if cfg.capacity(elem_size) >= columns:
            return cfg
    return configs[-1]


def _half_forward_config(columns: int, cc: int) -> RowConfig:
    """16-bit forward: warps, or 512-thread blocks (two per multiprocessor) over two register tiles
    (docs/tuning.md)."""
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


def softmax_config(direction: str, columns: int, elem_size: int, cc: int) -> RowConfig:
    """A SOFTMAX_RULES entry, else mostly the smallest configuration that holds the row in registers
    (the widest loops over tiles)."""
    for rule_direction, rule_size, low, high, cfg in SOFTMAX_RULES:
        if (rule_direction, rule_size) == (direction, elem_size) and low < columns <= high and usable((cfg,), cc):
            return cfg
    if direction == "fwd" and elem_size == 2:
        return _half_forward_config(columns, cc)
    if direction == "bwd" and elem_size == 2 and 512 < columns <= 1024:
        return RowConfig(32, 4, 2)  # two tiles a warp (docs/tuning.md)
    # 16-byte vectors per thread that stay in registers without spilling at 1024 threads
    budget = 8 if direction == "fwd" and elem_size == 4 else 4
    return _smallest_fitting(_ordered(SOFTMAX_CONFIGS, cc, budget, elem_size), columns, elem_size)


@functools.lru_cache(maxsize=None)
def _ordered(configs: tuple, cc: int, budget: int, elem_size: int) -> tuple:
    """The configurations of at most `budget` vectors a thread that `cc` can launch, smallest capacity first."""
    return tuple(sorted((c for c in usable(configs, cc) if c.vpt <= budget),
                        key=lambda c: (c.capacity(elem_size), c.cluster, -c.tpr)))


# ---- softmax, rows staged in shared memory (softmax_staged.cu)

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
# A block (or cluster) per row for low < columns <= high, by (direction, element size); absent: never
# (docs/tuning.md).
STAGED_BLOCK_COLUMNS = {("fwd", 4): (8192, 16384), ("fwd", 2): (8192, math.inf), ("bwd", 2): (65536, math.inf)}
STAGED_BLOCK_THREADS = {"fwd": 512, "bwd": 256}  # threads of a block that stages a row, by direction
STAGED_CLUSTERS = (1, 2, 4, 8)  # blocks a row may be staged over, fewest first
# A warp per row for low < columns <= high, by (direction, element size); absent: never (docs/tuning.md).
STAGED_WARP_COLUMNS = {("fwd", 4): (512, 2048), ("bwd", 4): (512, 1024), ("fwd", 2): (1024, 8192),
                       ("bwd", 2): (512, 2048)}
STAGED_WARP_ROWS = 4  # rows (warps) of a block that stages a warp per row (docs/tuning.md)
STAGED_BLOCK_BYTES = 64 * 1024  # the most shared memory a block stages (docs/tuning.md)


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


def staged_grid(rows: int, cfg: StagedConfig) -> int:
    """Blocks for a staged launch: a cluster (or block) per row group, within the grid limit (beyond it they
    walk rows)."""
    return min(-(-rows // cfg.rows), MAX_GRID // cfg.cluster) * cfg.cluster


# ---- softmax, long rows split over blocks (softmax_split.cu)

class SplitConfig(NamedTuple):
    """A long row split over blocks that wait for each other through global memory (softmax_split.cu): THREADS per
    block holding VPT 16-byte vectors each of every tensor, so CHUNK = THREADS x VPT x VEC columns of the row per
    block."""

    threads: int
    vpt: int
    chunk: int


# Split rows from these column counts on, by (direction, element size); absent: never (docs/tuning.md).
SPLIT_MIN_COLUMNS = {("bwd", 4): 32768, ("bwd", 2): 65536, ("fwd", 4): 65536}
# (threads, VPT) by direction: the first that cuts the row into no more chunks than the GPU has multiprocessors
# (so that all chunks of a row can run at once) (docs/tuning.md).
SPLIT_CHOICES = {"fwd": ((128, 16),), "bwd": ((128, 16),)}


def split_config(direction: str, rows: int, columns: int, elem_size: int, cc: int,
                 sm_count: int) -> SplitConfig | None:
    """Rows split over blocks (sm_80+) from SPLIT_MIN_COLUMNS on: the first SPLIT_CHOICES entry whose chunks of a
    row all fit on the GPU at once; None when none applies."""
    key = (direction, elem_size)
    if cc < 80 or key not in SPLIT_MIN_COLUMNS or columns < SPLIT_MIN_COLUMNS[key]:
        return None
    for threads, vpt in SPLIT_CHOICES[direction]:
        cfg = SplitConfig(threads, vpt, threads * vpt * (16 // elem_size))
        chunks = -(-columns // cfg.chunk)
        if chunks <= sm_count and rows * chunks <= MAX_GRID:
            return cfg
    return None


# ---- cross-entropy (cross_entropy.cu)

CE_FWD_WARP = RowConfig(32, 4, 2)  # forward: a warp per row, for rows one tile holds
CE_FWD_BLOCK = RowConfig(256, 1, 4)  # forward, float32: a block per row
CE_FWD_BLOCK_16BIT = RowConfig(256, 1, 4, 1, 4)  # forward, 16-bit: a block per row, 4 blocks a multiprocessor
# forward, rows too few to fill the GPU: a cluster per row, of 4 blocks from half as many rows as multiprocessors,
# else of 8
CE_FWD_CLUSTERS = (RowConfig(256, 1, 4, 4), RowConfig(256, 1, 4, 8))
CE_FWD_CONFIGS = (CE_FWD_WARP, CE_FWD_BLOCK, CE_FWD_BLOCK_16BIT, *CE_FWD_CLUSTERS)  # every forward configuration
# The gradient's scaling (ce_scale): TPR threads per block, VPT vectors per thread, MIN_BLOCKS a multiprocessor
# (rows, cluster unused) (docs/tuning.md).
CE_SCALE_CONFIG = RowConfig(256, 1, 4, 1, 4)
CE_SCALE_BLOCKS_PER_SM = 8  # blocks of ce_scale a multiprocessor at most (two waves of four), walking the rows


# The gradient of a slice of the classes from the whole row's statistics (ce_gradient, vocabulary-parallel), one
# elementwise sweep: ce_scale's block shape (TPR threads, VPT 16-byte vectors a thread, MIN_BLOCKS a multiprocessor).
CE_GRADIENT_CONFIG = RowConfig(256, 1, 4, 1, 4)


def ce_fwd_config(rows: int, classes: int, elem_size: int, cc: int, sm_count: int) -> RowConfig:
    """A warp per short row; a 256-thread block per row; a cluster per row when rows are too few to fill the GPU
    (docs/tuning.md)."""
    if classes <= CE_FWD_WARP.capacity(elem_size):
        return CE_FWD_WARP
    tiles = -(-classes // CE_FWD_BLOCK.capacity(elem_size))
    if cc < CLUSTER_MIN_CC or rows >= 2 * sm_count or tiles < 8:
        return CE_FWD_BLOCK_16BIT if elem_size == 2 else CE_FWD_BLOCK
    return CE_FWD_CLUSTERS[0] if rows >= sm_count // 2 else CE_FWD_CLUSTERS[1]


def ce_scale_grid(rows: int, classes: int, elem_size: int, sm_count: int) -> tuple[int, int, int]:
    """ce_scale's grid: a block per tile of a row (x), rows in y up to CE_SCALE_BLOCKS_PER_SM blocks a
    multiprocessor in all (fewer blocks to return at once when the factor is 1; beyond, the blocks walk rows)."""
    tiles = -(-classes // CE_SCALE_CONFIG.capacity(elem_size))
    row_blocks = max(1, CE_SCALE_BLOCKS_PER_SM * sm_count // tiles)
    return min(tiles, MAX_GRID), min(rows, MAX_GRID_Y, row_blocks), 1


def ce_gradient_grid(rows: int, classes: int, elem_size: int) -> tuple[int, int, int]:
    """ce_gradient's grid: a block per tile of a row (x) and per row (y), every block of an elementwise sweep in
    flight as the GPU schedules them; past the grid's limits the blocks walk tiles and rows."""
    tiles = -(-classes // CE_GRADIENT_CONFIG.capacity(elem_size))
    return min(tiles, MAX_GRID), min(rows, MAX_GRID_Y), 1


# ---- log-probabilities (log_probs.cu)

# Batch invariance (backends/README.md, log_probs.py): every choice here comes from the column count, the element
# size and nothing else (no row count, no multiprocessor count, no cluster), so a row's arithmetic is the same in
# every batch. Not measured yet (docs/tuning.md).
LP_FWD_WARP = RowConfig(32, 4, 2)  # forward: a warp per row, looping over tiles, for rows up to LP_FWD_WARP_COLUMNS
LP_FWD_BLOCK = RowConfig(256, 1, 4, 1, 4)  # forward: a 256-thread block per row, 4 blocks a multiprocessor
LP_FWD_CONFIGS = (LP_FWD_WARP, LP_FWD_BLOCK)  # every forward configuration
LP_FWD_WARP_COLUMNS = {4: 2048, 2: 4096}  # the longest rows a warp takes, by element size (8 KiB)
# The backward, one elementwise sweep (lp_bwd): ce_gradient's block shape (TPR threads, VPT 16-byte vectors a
# thread, MIN_BLOCKS a multiprocessor); a thread's elements (VPT x 16 / element size) must be at most 32.
LP_BWD_CONFIG = RowConfig(256, 1, 4, 1, 4)


def lp_fwd_config(classes: int, elem_size: int) -> RowConfig:
    """A warp per row up to LP_FWD_WARP_COLUMNS columns, a block per row beyond: from C and the element size only."""
    return LP_FWD_WARP if classes <= LP_FWD_WARP_COLUMNS[elem_size] else LP_FWD_BLOCK


def lp_bwd_grid(rows: int, classes: int, elem_size: int) -> tuple[int, int, int]:
    """lp_bwd's grid: a block per tile of a row (x) and per row (y); past the grid's limits the blocks walk tiles
    and rows (which block takes an element changes no arithmetic)."""
    tiles = -(-classes // LP_BWD_CONFIG.capacity(elem_size))
    return min(tiles, MAX_GRID), min(rows, MAX_GRID_Y), 1


# ---- block-sparse softmax (blocksparse.cu)

# The register kernels' tiles: a warp per row of 32 lanes (the backward: of fewer lanes, several rows a warp).
BLOCKSPARSE_CONFIGS = (RowConfig(32, 4, 2), RowConfig(32, 4, 4), RowConfig(32, 4, 5), RowConfig(32, 4, 8),
                       RowConfig(32, 4, 16))
# Values each thread of the register kernels holds, by element size: the first choice whose tile (a warp's share)
# holds the layout's mean row, else the last (docs/tuning.md). The forward keeps one value per element, the
# backward two.
BLOCKSPARSE_FORWARD_FLOATS = {4: (32,), 2: (32,)}
BLOCKSPARSE_BACKWARD_FLOATS = {4: (32, 64), 2: (40, 64)}
BLOCKSPARSE_BACKWARD_LANE_BYTES = 64  # bytes of the mean row per lane of the backward (docs/tuning.md)
BLOCKSPARSE_LANE_COUNTS = (1, 2, 4, 8, 16, 32)  # every lanes a row the block-sparse kernels may take


class BlockSparseStaged(NamedTuple):
    """The staged forward: WARPS warps per block, LANES lanes per row (32 / LANES rows a warp), each row staged CAP
    16-byte vectors at a time."""

    warps: int
    cap: int
    lanes: int

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


# The staged forward's buffer holds the longest row, or BLOCKSPARSE_STAGED_MARGIN times the mean row if that is
# less (longer rows are staged in parts, twice), in the smallest of BLOCKSPARSE_STAGED_CAPS (16-byte vectors)
# that does (docs/tuning.md).
BLOCKSPARSE_STAGED_MARGIN = 1.25
BLOCKSPARSE_STAGED_CAPS = (64, 128, 256, 512, 1024)
BLOCKSPARSE_STAGED_WARPS = 2  # warps per block of the staged forward (docs/tuning.md)
BLOCKSPARSE_STAGED_LANE_VECTORS = 8  # 16-byte vectors of the mean row per lane of the staged forward (docs/tuning.md)


def blocksparse_floats(choices: tuple, mean_row: float) -> int:
    """Values per thread: the first of `choices` whose tile (a warp's share of a row) holds `mean_row` elements,
    else the last."""
    return next((floats for floats in choices if 32 * floats >= mean_row), choices[-1])


def blocksparse_config(row_length: float, elem_size: int, floats_per_thread: int) -> RowConfig:
    """A warp per row: the smallest tile holding `row_length` elements (the layout's mean row: longer rows take
    more tiles), at most `floats_per_thread` values per thread."""
    fitting = [c for c in BLOCKSPARSE_CONFIGS if c.vpt * (16 // elem_size) <= floats_per_thread]
    return _smallest_fitting(fitting or BLOCKSPARSE_CONFIGS[:1], row_length, elem_size)


def blocksparse_register_config(direction: str, mean_row: float, elem_size: int, lanes: int = 32) -> RowConfig:
    """The register kernel's tile for `lanes` lanes a row: the values a thread holds (BLOCKSPARSE_FORWARD_FLOATS or
    BLOCKSPARSE_BACKWARD_FLOATS) and the tile chosen for the mean row as a warp's share would hold it."""
    share = mean_row * 32 / lanes
    choices = BLOCKSPARSE_FORWARD_FLOATS if direction == "fwd" else BLOCKSPARSE_BACKWARD_FLOATS
    return blocksparse_config(share, elem_size, blocksparse_floats(choices[elem_size], share))


def _nearest_lanes(share: float, least: int) -> int:
    """The power of two of lanes nearest `share` (at least 1), at most 32 and at least `least`."""
    return max(least, min(32, 1 << round(math.log2(max(1.0, share)))))


def blocksparse_backward_lanes(mean_row: float, block: int, elem_size: int) -> int:
    """Lanes per row of the backward (register kernel): the power of two nearest the mean row's bytes over
    BLOCKSPARSE_BACKWARD_LANE_BYTES, at most 32, at least the vectors of a block's row and 32 / B (a warp's rows
    within one block-row)."""
    least = max(32 // block, block * elem_size // 16)
    return _nearest_lanes(mean_row * elem_size / BLOCKSPARSE_BACKWARD_LANE_BYTES, least)


def blocksparse_staged_lanes(mean_row: float, block: int, elem_size: int) -> int:
    """Lanes per row of the staged forward: the power of two nearest the mean row's 16-byte vectors over
    BLOCKSPARSE_STAGED_LANE_VECTORS, at most 32 and at least 32 / B (a warp's rows within one block-row)."""
    return _nearest_lanes(mean_row * elem_size / 16 / BLOCKSPARSE_STAGED_LANE_VECTORS, 32 // block)


def blocksparse_staged_config(mean_row: float, longest_row: int, elem_size: int, cc: int,
                              block: int) -> BlockSparseStaged | None:
    """The staged forward for a layout of this mean and longest row (elements) and block size on sm_80+: the
    smallest BLOCKSPARSE_STAGED_CAPS buffer that holds the longest row, or BLOCKSPARSE_STAGED_MARGIN x the mean row
    if less, else the largest; blocksparse_staged_lanes lanes a row, or more where a block's row buffers would
    otherwise pass STAGED_BLOCK_BYTES. None before sm_80 (no cp.async)."""
    if cc < 80:
        return None
    row_length = min(longest_row, BLOCKSPARSE_STAGED_MARGIN * mean_row)
    vectors = math.ceil(row_length / (16 // elem_size))
    cap = next((c for c in BLOCKSPARSE_STAGED_CAPS if c >= vectors), BLOCKSPARSE_STAGED_CAPS[-1])
    cfg = BlockSparseStaged(BLOCKSPARSE_STAGED_WARPS, cap, blocksparse_staged_lanes(mean_row, block, elem_size))
    while cfg.shared_bytes > STAGED_BLOCK_BYTES and cfg.lanes < 32:
        cfg = cfg._replace(lanes=2 * cfg.lanes)
    return cfg
