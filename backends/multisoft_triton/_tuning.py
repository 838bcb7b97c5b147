"""The choices the Triton kernels' launches make by shape and dtype: tile sizes, thresholds, configs.

What each setting gained, and what lost against it, is in docs/tuning.md. The op modules read these at every call,
as attributes of this module, so that a test sets one (monkeypatch) to force a kernel path. Tables keyed by 4 and 2
are by element size in bytes (float32; float16 and bfloat16). Row lengths are in elements; "(p2)" marks a length
rounded up to a power of 2. Names that more than one op could claim carry the op's prefix (SOFTMAX_, CE_, LP_
for log_probs, BLOCKSPARSE_).
"""

# -- softmax and log_softmax (softmax.py)

# Longest row (p2) whose forward is a tile, the whole row in registers; longer rows split or loop (docs/tuning.md).
SOFTMAX_FORWARD_TILE_MAX = {4: 32768, 2: 32768}
# Longest row (p2) whose backward is a tile; longer rows split or loop (docs/tuning.md).
SOFTMAX_BACKWARD_TILE_MAX = {4: 16384, 2: 32768}
# Elements of one tile program: rows shorter than this share a program (docs/tuning.md).
SOFTMAX_TILE_ELEMENTS = {4: 4096, 2: 8192}
# Columns a loop-path program (one row, streamed twice) loads at once (docs/tuning.md).
SOFTMAX_LOOP_BLOCK = 4096
# (chunk, num_warps) of the split path: the first that cuts a row into no more chunks than multiprocessors
# (docs/tuning.md).
SPLIT_CONFIGS = ((4096, 4), (8192, 8), (16384, 8))
# int32s between the split path's per-row counters: a 128-byte line each (docs/tuning.md).
SPLIT_COUNTER_STRIDE = 32
# (chunk, sub-block, num_warps, stages) of the split forward that streams its chunk twice; absent: the chunk held in
# registers (docs/tuning.md).
SPLIT_STREAM = {2: (8192, 2048, 4, 1)}
# Row length (p2) from which each backward path holds 16-bit values as loaded, widening them twice, not as floats
# (docs/tuning.md).
RAW_FROM = {"backward tile": 16384, "backward split": 0}
# Registers a thread of the split forward kernels may take, ptxas .maxnreg (docs/tuning.md).
SPLIT_FORWARD_MAXNREG = {4: 48, 2: 40}
# Whether the log_softmax split backward loads y after publishing its chunk's sum(dy), while it waits (docs/tuning.md).
SPLIT_LATE_Y = {4: False, 2: True}
# Row length (p2) from which the forward tile runs as persistent programs that load their next row while they
# finish the current one (docs/tuning.md).
PREFETCH_FROM = {2: 32768}
# Elements those persistent programs hold per multiprocessor, which sets their number (docs/tuning.md).
PREFETCH_SM_ELEMENTS = 32768

# -- cross-entropy (cross_entropy.py)

# Longest row (p2) whose forward is a tile, held in registers from its one read to its gradient; longer rows are
# streamed by a program each, once, and again for the gradient (docs/tuning.md).
CE_TILE_MAX = 8192
# Elements of one forward tile program: shorter rows share a program (docs/tuning.md).
CE_TILE_ELEMENTS = 8192
# (columns loaded at once, num_warps) of a streamed row's forward program without a gradient (docs/tuning.md).
CE_LOOP_CONFIGS = {4: (16384, 8), 2: (8192, 4)}
# The same for a program that streams its row twice to write the gradient too (docs/tuning.md).
CE_LOOP_GRAD_CONFIGS = {4: (16384, 8), 2: (8192, 4)}
# (columns loaded at once, num_warps) of a streamed row of class-probability targets (`probabilities_forward`), with
# or without the gradient: each chunk loads the targets beside the logits, so half the float32 columns of
# CE_LOOP_CONFIGS and twice the 16-bit warps keep a thread's registers at what the class-index loop holds; not yet
# measured against other configs (no line in docs/tuning.md).
CE_PROBABILITIES_LOOP_CONFIGS = {4: (8192, 8), 2: (8192, 8)}
# Columns, and elements, of one program of the backward's scaling of the gradient (`scale`) (docs/tuning.md).
CE_SCALE_BLOCK = 8192
# The gradient of a slice of the classes from the whole row's statistics (`gradient`, vocabulary-parallel): most
# columns of one program, and its elements (shorter rows share a program), by element size; warps_for gives each
# thread 32 elements, eight 16-byte loads of float32 or four of 16-bit values in flight.
CE_GRADIENT_BLOCK = {4: 4096, 2: 8192}
CE_GRADIENT_ELEMENTS = {4: 4096, 2: 8192}

# -- log-probabilities and entropy (log_probs.py). Every setting here is chosen from the row length C and the element
# size only, never from the row count M: a row's statistics and gradient are bitwise the same whatever the batch
# (backends/README.md). Not yet measured for this op: the values are those cross-entropy measured best with.

# Longest row (p2) whose forward is a tile held in registers; longer rows are streamed by a program each, once
# (CE_TILE_MAX's value; docs/tuning.md).
LP_TILE_MAX = 8192
# Elements of one forward tile program: shorter rows share a program, LP_TILE_ELEMENTS // C (p2) of them
# (CE_TILE_ELEMENTS' value; docs/tuning.md).
LP_TILE_ELEMENTS = 8192
# (columns loaded at once, num_warps) of a streamed row's forward program (CE_LOOP_CONFIGS' values; docs/tuning.md).
LP_LOOP_CONFIGS = {4: (16384, 8), 2: (8192, 4)}
# The backward's tiles of rows x columns, by element size: most columns of one tile, and its elements (shorter rows
# share a tile); warps_for gives each thread 32 elements (CE_GRADIENT_BLOCK's and CE_GRADIENT_ELEMENTS' values;
# docs/tuning.md).
LP_BACKWARD_BLOCK = {4: 4096, 2: 8192}
LP_BACKWARD_ELEMENTS = {4: 4096, 2: 8192}

# -- block-sparse softmax (blocksparse.py)

# Longest block-row (blocks (p2) x B) the backward's tile kernel holds whole; longer: the loop kernel (docs/tuning.md).
BLOCKSPARSE_TILE_MAX = 16384
# Elements of a tile- or loop-kernel program's [BLOCKS, ROWS, B] slab (at least one row of a tile) (docs/tuning.md).
BLOCKSPARSE_TILE_ELEMENTS = 2048
# Rows of a loop-kernel program, at most B (docs/tuning.md).
BLOCKSPARSE_LOOP_ROWS = 16
# Share of the slabs' padding that launching the tile kernels once per block-row length must save (docs/tuning.md).
BUCKETS_SAVE = {4: 0.3, 2: 0.3}
# Elements of each row the row kernels hold in registers; the rest of a longer row streams twice (docs/tuning.md).
ROW_HELD = 512
# ROW_HELD where the layout's mean row is ROW_LONG or more (docs/tuning.md).
ROW_HELD_LONG = 1024
# Mean row from which rows are long: ROW_HELD_LONG held, one row a forward program (docs/tuning.md).
ROW_LONG = 2048
# Fewest blocks of each row the row kernels hold (docs/tuning.md).
ROW_MIN_BLOCKS = {4: 8, 2: 4}
# Mean row from which the backward takes the tile and loop kernels instead of the row kernel (docs/tuning.md).
TILES_FROM = {4: 2048, 2: float("inf")}
# Rows of a row-kernel program, a warp's worth of threads each (docs/tuning.md).
ROW_WARPS = 4
# Block size B from which a forward row-kernel program takes one row, not ROW_WARPS (docs/tuning.md).
FORWARD_ONE_ROW_FROM = {4: 64, 2: 128}
# Mean row up to which the forward takes the row kernel with its rows across a warp's lanes (docs/tuning.md).
FORWARD_ACROSS_UNTIL = {4: 512, 2: 512}
# Warps of such a program (docs/tuning.md).
FORWARD_ACROSS_WARPS = 1
# Blocks of each row such a program holds, at most the mean row's; the rest streams twice (docs/tuning.md).
FORWARD_ACROSS_BLOCKS = {4: 4, 2: 2}
# Blocks of a row side by side in a warp's lanes in the row kernels (INNER), by direction; None: as many as fill
# its 32 lanes, a warp a row (docs/tuning.md).
ROW_INNER = {"forward": {4: None, 2: 2}, "backward": {4: 2, 2: 2}}
