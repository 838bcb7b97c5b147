"""Block-sparse softmax over the compressed blocks (Z, nnz, B, B), forward and backward: the launch shape for a
layout and the kernel that runs it (_blocksparse_float: rows held as float32; _blocksparse_packed: 16-bit rows held
as their words; _blocksparse_rows: what they share). The settings named here are the tables of _tuning
(docs/tuning.md, their names prefixed BLOCKSPARSE_), read at each call.

Row i of block-row g = h * Mb + r in batch z is the concatenation of row i of the
blocks offsets[g] .. offsets[g + 1]; rows of a batch entry are numbered (g, i), and
the grid's y index walks the batch (no division per row). A row takes `lanes` lanes of a
warp (32, or fewer for short rows: ROW_LANE_BYTES), WARPS warps per thread block,
grid-stride over the rows; under the simulator, which has no shuffles, one row per block.
The data is read and written in vectors of `width` elements, one access each
(_device.row_io; the widest that the tensors' alignment allows, see
_launch.vector_views), through 1-D views indexed with unsigned integers. Vector v of a
row lies in block v // V at vector v % V of its row (V vectors per block row); lane
`lane` holds the vectors t * TILE + k * lanes + lane (k < vectors per lane) of tile
t, so each load of a row's lanes reads consecutive vectors. A row of one tile is
read once and written from registers; a longer row keeps its first tiles in shared
memory for the second pass (STASH_BYTES) and reads the others again (the last one
excepted).

Causal masking keeps a prefix of each row: the look-up table lists a block-row's blocks
by ascending column, so the elements kept are those of the blocks left of the diagonal,
then i + 1 of the diagonal block if the row has it (the front's lut.causal, _blocksparse_rows.causal_kept);
elements past the prefix are -inf (the float kernel reads the row's vectors and masks them,
the 16-bit one reads no vector wholly past the prefix).

Non-finite scores follow backends/README.md: a row's unmasked elements get what dense softmax
gives over them (NaN throughout for a NaN or +inf among them, or when all are -inf: the shift
guards only a max of -inf and the sum is divided unguarded), masked elements 0 (a causal row
that comes out NaN has its masked elements set to 0 afterwards, nan_row); a row with no unmasked
element (from its kept prefix, never from its sum) zeros. The backward gives 0 wherever y is 0
(selected in rows whose dot is not finite: elsewhere the product is 0 already).
"""

import math

import numpy

from . import _tuning
from ._blocksparse_float import backward_kernel, forward_kernel
from ._blocksparse_packed import backward_packed_kernel, forward_packed_kernel
from ._intrinsics import LOG2E
from ._launch import SIMULATOR, launch, vector_views


def _floats(choices, row: int, lanes: int, width: int, filled: bool = False) -> int:
    """Values per lane: among `choices`, each rounded up to a multiple of width, the fewest
    whose tile holds `row` elements, else the most; `filled`: the most whose tile `row`
    elements fill, else the fewest."""
    rounded = sorted({-(-floats // width) * width for floats in choices})
    if filled:
        return next((floats for floats in reversed(rounded) if floats * lanes <= row), rounded[0])
    return next((floats for floats in rounded if floats * lanes >= row), rounded[-1])


def _stash_tiles(lut, values: int, lanes: int, warps: int, size: int) -> int:
    """Tiles a row kept in shared memory for the layout of `lut`, `values` a lane, `size` bytes held per value: all
    but the last of the layout's mean row, as many as BLOCKSPARSE_STASH_BYTES holds for the block's rows."""
    tile = lanes * values
    return max(0, min(math.ceil(lut.mean_blocks * lut.block / tile) - 1,
                      _tuning.BLOCKSPARSE_STASH_BYTES // (warps * tile * size)))


def _packed(width: int, element_size: int) -> bool:
    """Whether 16-bit rows are held as their words: read in pairs (width >= 2) and BLOCKSPARSE_PACK_16BIT."""
    return _tuning.BLOCKSPARSE_PACK_16BIT and element_size == 2 and width >= 2


def _row_lanes(row: float, element_size: int, block: int, direction: str) -> int:
    """Lanes per row on the GPU for rows of `row` elements on average (BLOCKSPARSE_ROW_LANE_BYTES)."""
    per_lane = _tuning.BLOCKSPARSE_ROW_LANE_BYTES[direction]
    if per_lane is None:
        return 32
    share = max(1.0, row * element_size / per_lane)
    return max(32 // block, min(32, 1 << round(math.log2(share))))


def _launch_shape(batch: int, rows: int, row: float, width: int, element_size: int, block: int, direction: str,
                  positive_scale: bool = True, causal: bool = False):
    """(lanes per row, rows per thread block, grid, values per lane) of the `direction` kernel for `batch` times
    `rows` rows of `row` elements on average, of blocks of `block`, read in vectors of `width`; 16-bit rows held
    as words (_packed) take BLOCKSPARSE_PACKED_VALUES, the forward only with a positive scale."""
    if SIMULATOR:
        lanes = _tuning.BLOCKSPARSE_SIMULATOR_LANES
        floats = _floats((_tuning.BLOCKSPARSE_SIMULATOR_FLOATS,), row, lanes, width)
        return lanes, 1, (max(1, min(rows, _tuning.BLOCKSPARSE_SIMULATOR_GRID)), 1), floats
    lanes = _row_lanes(row, element_size, block, direction)
    per_block = _tuning.BLOCKSPARSE_WARPS * 32 // lanes
    grid = (max(1, min(-(-rows // per_block), _tuning.BLOCKSPARSE_MAX_GRID)),
            max(1, min(batch, _tuning.BLOCKSPARSE_MAX_GRID_Y)))
    if not _packed(width, element_size) or (direction == "forward" and not positive_scale):
        choices = _tuning.BLOCKSPARSE_FORWARD_FLOATS if direction == "forward" else _tuning.BLOCKSPARSE_BACKWARD_FLOATS
        return lanes, per_block, grid, _floats(choices[element_size], row, lanes, width)
    packed_values = _tuning.BLOCKSPARSE_PACKED_VALUES
    if direction == "backward":
        return lanes, per_block, grid, _floats(packed_values["backward"], row, lanes, width, filled=True)
    return lanes, per_block, grid, _floats(packed_values["causal" if causal else "forward"], row, lanes, width)


def _common(tensors, lut, direction, positive_scale=True, causal=False):
    """(element format, vector width (at most B: no vector crosses blocks), 1-D word views,
    launch shape of the `direction` kernel, sizes: batch, rows per batch entry, nnz, log2 B, log2 of the vectors
    per block row)."""
    fmt, width, views = vector_views(tuple(t.view(-1) for t in tensors), lut.block)
    batch = tensors[0].shape[0]
    rows = lut.heads * lut.block_rows * lut.block
    log2b = lut.block.bit_length() - 1
    sizes = (batch, rows, lut.nnz, log2b, log2b - (width.bit_length() - 1))
    shape = _launch_shape(batch, rows, lut.mean_blocks * lut.block, width, tensors[0].element_size(), lut.block,
                          direction, positive_scale, causal)
    return fmt, width, views, shape, tuple(numpy.int64(v) for v in sizes)


def forward(x, out, lut, scale: float, is_causal: bool) -> None:
    fmt, width, views, shape, (batch, rows, nnz, log2b, log2v) = _common((x, out), lut, "forward", scale > 0,
                                                                         is_causal)
    lanes, warps, grid, floats = shape
    # held as words, masked elements are -inf bits, which only a positive scale keeps -inf
    packed = _packed(width, x.element_size()) and scale > 0
    build = forward_packed_kernel if packed else forward_kernel
    size = 2 if packed else 4   # bytes held per value
    stash = _stash_tiles(lut, floats, lanes, warps, size)
    launch(build(fmt, width, bool(is_causal), floats, lanes, warps), grid, lanes * warps,
           (*views, lut.offsets, lut.causal, batch, rows, nnz, log2b, log2v, numpy.float32(scale * LOG2E),
            numpy.int64(stash)), shared=stash * warps * lanes * floats * size)


def backward(y, dy, dx, lut, scale: float) -> None:
    fmt, width, views, (lanes, warps, grid, floats), sizes = _common((y, dy, dx), lut, "backward")
    args = (*views, lut.offsets, *sizes, numpy.float32(scale))
    if _packed(width, y.element_size()):
        launch(backward_packed_kernel(fmt, width, floats, lanes, warps), grid, lanes * warps, args)
        return
    stash = min(_tuning.BLOCKSPARSE_BACKWARD_STASH_TILES, _stash_tiles(lut, floats, lanes, warps, 8))   # y and dy
    launch(backward_kernel(fmt, width, floats, lanes, warps, stash), grid, lanes * warps, args)
