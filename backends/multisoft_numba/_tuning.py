"""The numba backend's tables of choices: every tile size, threshold and launch shape the kernels take.

A setting marked (docs/tuning.md) has its measurement there (its gain, and what lost to it). "Held bytes" are
the bytes a row element takes in registers: 4 for float32 (and 16-bit rows read one element at a time), 2 for
16-bit rows read in pairs and held as their words (two values a register). The op modules read these names at
call time (but COUNTER_STRIDE), so a test can force a kernel path by setting one. Imports no framework.
"""

# -- softmax and log_softmax (softmax.py)

# Forward: row elements a thread holds in registers when a block (or thread group) holds the whole row, fewest
# first, by held bytes.
CACHE = {4: (32,), 2: (32,)}
# Backward: elements of y and of dy a thread holds, fewest first, by held bytes.
CACHE_BWD = {4: (16,), 2: (8, 32)}
CACHED_THREADS = 1024   # most threads of a block that holds a whole row
# Rows that take at most ROW_GROUP_MAX threads (by direction) share blocks of ROW_GROUP_BLOCK threads, a group of
# threads a row (docs/tuning.md).
ROW_GROUP_MAX = {"forward": 16, "backward": 32}
ROW_GROUP_BLOCK = 256
# Forward rows held as words of at least this many elements, a block each, run as persistent blocks that read their
# next row while they write the current one, by held bytes (docs/tuning.md).
PREFETCH_FROM = {2: 32768}
# Split rows, forward, by held bytes: (threads, elements a thread, blocks a multiprocessor the kernel is compiled
# for: launch bounds (threads, blocks); 0: the 1024-thread bound) of the blocks holding a row's parts; the first
# choice that makes at most SPLIT_FEW_PARTS parts, else the first whose parts can all be resident (docs/tuning.md).
SPLIT_FORWARD = {4: ((128, 64, 5),), 2: ((256, 64, 0),)}
# Split rows, backward: as SPLIT_FORWARD, elements of y and of dy a thread (docs/tuning.md).
SPLIT_BWD = {4: ((128, 32, 1), (256, 32, 1)), 2: ((256, 32, 1),)}
SPLIT_FEW_PARTS = 32
# The parts (as SPLIT_FORWARD) of rows too long for the choices above, by direction and held bytes
# (docs/tuning.md).
SPLIT_WIDE = {"forward": {4: (512, 32, 0), 2: (512, 64, 0)}, "backward": {4: (512, 32, 1), 2: (512, 32, 1)}}
# Most parts a row is split into, by held bytes (never more than half the multiprocessors) (docs/tuning.md).
MAX_PARTS = {4: 64, 2: 64}
# int32s from one split row's arrival counter to the next: one 128-byte line each; compiled into the split kernels,
# so read once, at import (docs/tuning.md).
COUNTER_STRIDE = 32
UNROLL = 8   # elements a thread reads per step of the looping kernels (rows that neither fit a block nor split)
# Hold 16-bit rows read in pairs as their words on the cached and split paths (docs/tuning.md).
PACK_16BIT = True

# -- cross-entropy (cross_entropy.py)

# Forward with a gradient: float32 values of its row a thread holds in registers, when the row then fits a block of
# at most CE_CACHED_THREADS threads; the gradient is written from them. Longer rows, and every forward without a
# gradient, read CE_UNROLL elements a thread a step (a block of about C / (4 * CE_UNROLL) threads) and re-read the
# row for the gradient, its last part first.
CE_CACHE = 32
CE_CACHED_THREADS = 1024
CE_UNROLL = 16             # (docs/tuning.md)
# probabilities_forward with a gradient: logits of its row a thread holds, and as many weighted targets (the
# registers of CE_CACHE floats), when the row then fits a block of at most CE_CACHED_THREADS threads; else as above.
CE_PROBABILITIES_CACHE = 16
# scale(): elements a thread, most threads a block, and blocks a multiprocessor at most (a block walks rows
# beyond: fewer blocks to return at once when the factor is 1).
CE_SCALE_UNROLL = 16       # (docs/tuning.md: the elementwise backward's CE_BACKWARD_UNROLL)
CE_SCALE_THREADS = 256
CE_SCALE_BLOCKS_PER_SM = 8
# gradient() (vocabulary-parallel), one elementwise sweep: elements a thread and most threads a block, scale()'s;
# a block per part of a row and per row (past 65535 rows the blocks walk rows).
CE_GRADIENT_UNROLL = 16
CE_GRADIENT_THREADS = 256

# -- log-probabilities and entropy (log_probs.py)

# forward: a block a row streams it once, LP_UNROLL elements a thread a step (whole chunks: the widest vector of at
# most 16 bytes whose length divides C), a block of about C / (LP_STEPS * LP_UNROLL) threads, at most
# LP_FORWARD_THREADS, so that two or more blocks share a multiprocessor and one block's merge at its row's end
# overlaps another's loads. Chosen from C and the dtype only: they set the order of a row's sums (docs/tuning.md).
LP_UNROLL = 16
LP_STEPS = 4
LP_FORWARD_THREADS = 512
# backward, one elementwise sweep: elements a thread and most threads a block, cross-entropy's gradient()'s
# (docs/tuning.md); a block per part of a row and per row, at most LP_BACKWARD_ROW_BLOCKS along the rows (the grid's
# y limit): past that the blocks walk the rows.
LP_BACKWARD_UNROLL = 16
LP_BACKWARD_THREADS = 256
LP_BACKWARD_ROW_BLOCKS = 65535

# -- block-sparse softmax (blocksparse.py)

# Values a lane holds (a tile is the row's lanes times that), forward, and of each of y and dy, backward, by element
# size: the fewest whose tile holds the layout's mean row, else the most; each rounded up to whole vectors
# (docs/tuning.md).
BLOCKSPARSE_FORWARD_FLOATS = {4: (16,), 2: (16,)}
BLOCKSPARSE_BACKWARD_FLOATS = {4: (16, 32), 2: (16,)}
# Hold 16-bit rows read in pairs as their words (the forward only with a positive scale) (docs/tuning.md).
BLOCKSPARSE_PACK_16BIT = True
# Values a lane of those rows holds: forward ("causal": the causal forward) the fewest whose tile holds the mean row,
# else the most; backward the most whose tile the mean row fills, else the fewest (docs/tuning.md).
BLOCKSPARSE_PACKED_VALUES = {"forward": (16, 32, 48, 64), "causal": (16, 32), "backward": (16, 32, 48, 64)}
# Bytes of shared memory a block keeps the first tiles of its rows in for the second pass (all but the last tile of
# the layout's mean row, as many as fit): the forwards (dynamic shared memory: at most 48 KiB), and the float
# backward, at most BLOCKSPARSE_BACKWARD_STASH_TILES tiles there (compiled in) (docs/tuning.md).
BLOCKSPARSE_STASH_BYTES = 48 * 1024
BLOCKSPARSE_BACKWARD_STASH_TILES = 1
BLOCKSPARSE_WARPS = 4   # warps a thread block on the GPU (docs/tuning.md)
# Lanes a row on the GPU, by direction: the power of two nearest the mean row's bytes over this (None: 32), at most
# 32 and at least 32 / B (docs/tuning.md).
BLOCKSPARSE_ROW_LANE_BYTES = {"forward": 128, "backward": 64}
BLOCKSPARSE_MAX_GRID = 1 << 20   # most thread blocks along the rows; more rows are walked grid-stride
BLOCKSPARSE_MAX_GRID_Y = 65535   # most along the batch, the same
# The simulator runs a thread a lane and pays for each and for every barrier: lanes a row, most blocks, values a lane.
BLOCKSPARSE_SIMULATOR_LANES = 1
BLOCKSPARSE_SIMULATOR_GRID = 4
BLOCKSPARSE_SIMULATOR_FLOATS = 4
