"""Block-sparse softmax over the nonzero blocks (Z, nnz, B, B) of a layout.

The rows of a block-row are its B rows of elements, each spread over the
block-row's blocks. A launch's programs hold ROWS rows each as a [BLOCKS, ROWS,
B] slab, BLOCKS the power of two that covers the launch's longest block-row;
ROWS may span several block-rows. When that pads the slabs enough less (a
causal layout's block-rows run from one block to all), the block-rows are
grouped by their block count's power of two, one launch per group, so that a
short row is not padded to the layout's longest one (decided once per layout).
When a launch's rows fit in registers (tile path) each element is read and
written once; the longest rows (loop path) are streamed twice, first for the
row statistics, then for the output. Rows with no unmasked element give zeros.
"""
import weakref

import torch
import triton
import triton.language as tl

from .utils import fast_exp, fast_exp2, next_power_of_2, on_device, online_max, safe_shift, warps_for, widen

TILE_MAX = 16384
TILE_ELEMENTS = 2048
LOOP_ROWS = 16
# Group the block-rows by length (one launch per power of two of their block count) when that pads the slabs by
# this share less, by direction and element size. Padding costs instructions, which bind the 16-bit forward: measured
# on an H200 (tuning/triton-fwd-buckets-round1.txt), bf16 forward 0.3 -> 0.1: 0.62-0.71 -> 0.64-0.73 of copy on the
# 25 % layouts, 0.70 -> 0.77 at 50 %; float32 0.01-0.04 slower.
BUCKETS_SAVE = {"forward": {4: 0.3, 2: 0.1}, "backward": {4: 0.3, 2: 0.3}}
MAX_GRID_Z = 65535  # a CUDA grid's second axis


@triton.jit
def _rows(rows_ptr, rows, ROWS: tl.constexpr, B: tl.constexpr):
    """This program's rows: block-row, its first block, its number of blocks, row within the block.

    Row r of the launch is row r % B of the block-row described by rows_ptr[3 * (r // B):][:3] as
    (block-row, first block, blocks); the launch has `rows` rows."""
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_mask = r < rows
    entry = rows_ptr + (r // B) * 3
    group = tl.load(entry, mask=row_mask, other=0)
    start = tl.load(entry + 1, mask=row_mask, other=0)
    count = tl.load(entry + 2, mask=row_mask, other=0)
    return group, start, count, r % B


@triton.jit
def _slab(rows_ptr, columns_ptr, rows, nnz, block_rows, first_block,
          BLOCKS: tl.constexpr, ROWS: tl.constexpr, B: tl.constexpr):
    """Offsets, mask and causal keep-mask of this program's [BLOCKS, ROWS, B] slab, from block first_block."""
    group, start, count, i = _rows(rows_ptr, rows, ROWS, B)
    k = first_block + tl.arange(0, BLOCKS)
    j = tl.arange(0, B)
    block_mask = k[:, None] < count[None, :]
    z = tl.program_id(1).to(tl.int64)
    base = (z * nnz + start[None, :] + k[:, None]) * (B * B) + (i * B)[None, :]
    offsets = base[:, :, None] + j[None, None, :]
    # absolute column c*B + j <= absolute row r*B + i  <=>  j - i <= (r - c) * B
    column = tl.load(columns_ptr + start[None, :] + k[:, None], mask=block_mask, other=0)
    reach = (group % block_rows)[None, :] - column
    causal_keep = (j[None, None, :] - i[None, :, None]) <= (reach * B)[:, :, None]
    return offsets, block_mask[:, :, None], causal_keep


@triton.jit
def _longest(rows_ptr, rows, ROWS: tl.constexpr, B: tl.constexpr):
    """The most blocks of any of this program's rows."""
    _, _, count, _ = _rows(rows_ptr, rows, ROWS, B)
    return tl.max(count, axis=0)


@triton.jit
def _scores(x_ptr, offsets, mask, causal_keep, scale, CAUSAL: tl.constexpr):
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32) * scale
    if CAUSAL:
        mask = mask & causal_keep
    return tl.where(mask, x, -float("inf"))


@triton.jit
def _fwd_tile_kernel(x_ptr, out_ptr, rows_ptr, columns_ptr, rows, nnz, block_rows, scale,
                     BLOCKS: tl.constexpr, ROWS: tl.constexpr, B: tl.constexpr, CAUSAL: tl.constexpr):
    offsets, mask, causal_keep = _slab(rows_ptr, columns_ptr, rows, nnz, block_rows, 0, BLOCKS, ROWS, B)
    x = _scores(x_ptr, offsets, mask, causal_keep, scale, CAUSAL)
    row_max = tl.max(tl.max(x, axis=2), axis=0)
    safe_max = safe_shift(row_max)
    e = fast_exp(x - safe_max[None, :, None])
    total = tl.sum(tl.sum(e, axis=2), axis=0)
    inverse = tl.where(total > 0.0, 1.0 / total, 0.0)
    y = e * inverse[None, :, None]
    tl.store(out_ptr + offsets, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _fwd_loop_kernel(x_ptr, out_ptr, rows_ptr, columns_ptr, rows, nnz, block_rows, scale,
                     BLOCKS: tl.constexpr, ROWS: tl.constexpr, B: tl.constexpr, CAUSAL: tl.constexpr):
    count = _longest(rows_ptr, rows, ROWS, B)
    run_max = tl.full((ROWS,), -float("inf"), tl.float32)
    run_sum = tl.zeros((ROWS,), tl.float32)
    for first in range(0, count, BLOCKS):
        offsets, mask, causal_keep = _slab(rows_ptr, columns_ptr, rows, nnz, block_rows, first,
                                           BLOCKS, ROWS, B)
        x = _scores(x_ptr, offsets, mask, causal_keep, scale, CAUSAL)
        run_max, shift, run_sum = online_max(run_max, run_sum, tl.max(tl.max(x, axis=2), axis=0))
        run_sum += tl.sum(tl.sum(fast_exp(x - shift[None, :, None]), axis=2), axis=0)
    safe_max = safe_shift(run_max)
    inverse = tl.where(run_sum > 0.0, 1.0 / run_sum, 0.0)
    for first in range(0, count, BLOCKS):
        offsets, mask, causal_keep = _slab(rows_ptr, columns_ptr, rows, nnz, block_rows, first,
                                           BLOCKS, ROWS, B)
        x = _scores(x_ptr, offsets, mask, causal_keep, scale, CAUSAL)
        y = fast_exp(x - safe_max[None, :, None]) * inverse[None, :, None]
        tl.store(out_ptr + offsets, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _bwd_tile_kernel(y_ptr, dy_ptr, dx_ptr, rows_ptr, columns_ptr, rows, nnz, block_rows, scale,
                     BLOCKS: tl.constexpr, ROWS: tl.constexpr, B: tl.constexpr):
    offsets, mask, _ = _slab(rows_ptr, columns_ptr, rows, nnz, block_rows, 0, BLOCKS, ROWS, B)
    y = tl.load(y_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    dot = tl.sum(tl.sum(y * dy, axis=2), axis=0)
    dx = scale * y * (dy - dot[None, :, None])
    tl.store(dx_ptr + offsets, dx.to(dx_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _bwd_loop_kernel(y_ptr, dy_ptr, dx_ptr, rows_ptr, columns_ptr, rows, nnz, block_rows, scale,
                     BLOCKS: tl.constexpr, ROWS: tl.constexpr, B: tl.constexpr):
    count = _longest(rows_ptr, rows, ROWS, B)
    dot = tl.zeros((ROWS,), tl.float32)
    for first in range(0, count, BLOCKS):
        offsets, mask, _ = _slab(rows_ptr, columns_ptr, rows, nnz, block_rows, first, BLOCKS, ROWS, B)
        y = tl.load(y_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        dot += tl.sum(tl.sum(y * dy, axis=2), axis=0)
    for first in range(0, count, BLOCKS):
        offsets, mask, _ = _slab(rows_ptr, columns_ptr, rows, nnz, block_rows, first, BLOCKS, ROWS, B)
        y = tl.load(y_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        dx = scale * y * (dy - dot[None, :, None])
        tl.store(dx_ptr + offsets, dx.to(dx_ptr.dtype.element_ty), mask=mask)


# Backward row kernels: a program holds ROW_WARPS rows of one block-row (a warp each), the first blocks of each in
# registers and the rest, if any, streamed twice (for the dot, then for the output); no power-of-two padding of
# whole rows, which the tile kernels pay on layouts whose block-rows differ in length (causal). A row holds
# ROW_HELD elements (ROW_HELD_LONG where the layout's mean row is ROW_LONG or more), at least ROW_MIN_BLOCKS blocks
# by element size, at most the power of two covering its mean row. Float32 layouts whose mean row is TILES_FROM
# or more take the tile kernels. Measured on an H200 in sessions 14 and 15 (tuning/triton-blocksparse-rows-*.txt):
# 512 held against 1024 (152 registers, 3 programs a multiprocessor, against 80 and 6) on the 25 % layouts, fp32
# 0.93-0.98 against 0.83-0.87, bf16 0.77-0.84 against 0.70-0.77; 1024 at 50 % (bf16 0.85 against 0.81) and at
# B = 128 in float32 (0.98-0.99 against 0.85-0.94), the tile kernels at fp32 50 % (0.96-1.01 against 0.91-0.93).
ROW_BACKWARD = "rows"   # "rows", or "tiles" for the tile and loop kernels only
ROW_HELD, ROW_HELD_LONG, ROW_LONG = 512, 1024, 2048
ROW_MIN_BLOCKS = {4: 8, 2: 4}
TILES_FROM = {4: 2048, 2: float("inf")}
ROW_WARPS = 4
# The forward's row kernels (the same programs and held blocks, each held element's exponential kept, a causal row's
# kept prefix from lut.causal) where they measured faster: FORWARD_ROWS[causal][element size] is (the largest block,
# the mean row from which, and below which); the rest take the tile and loop kernels. Measured on an H200 in session
# 16 (tuning/triton-blocksparse-forward-rows.txt), rows against tiles: bf16 0.64-0.72 -> 0.70-0.76 on the 25 %
# layouts, 0.77 -> 0.57 at 50 %; fp32 0.86 -> 0.91 at 11 %, 0.83-0.92 -> 0.82-0.85 at 25 %; causal 25 % layouts
# (mean row 1024) b16-b32 0.64-0.71 -> 0.73 (fp32), b16-b64 0.46-0.58 -> 0.57-0.60 (bf16), the others 0.01-0.27
# slower (those rows past the held blocks, streamed twice, cost more than the tiles' padding). Holding 1024 or 256
# elements, or 2 or 8 rows a program, lost.
ROW_FORWARD = "rows"   # "rows", or "tiles" for the tile and loop kernels only
FORWARD_ROWS = {False: {4: (128, 0, 512), 2: (128, 0, 2048)}, True: {4: (32, 512, 2048), 2: (64, 512, 2048)}}
FORWARD_LEAN = True   # experiment: _fwd_rows_lean_kernel
FORWARD_WARPS = 4
FORWARD_HELD = 0      # 0: the backward's rule
LOG2E = 1.4426950408889634
ROW_RAW = True   # 16-bit rows held as loaded, widened again for the output (utils.widen): 51 registers, not 67;
#                  bf16 0.77-0.87 -> 0.82-0.93 of copy (tuning/blocksparse-raw-rows-round2.txt)


@triton.jit
def _row_program(offsets_ptr, ROWS: tl.constexpr, B: tl.constexpr):
    """This program's block-row (of all heads' block-rows), its first block, its block count, its rows in the block."""
    PARTS: tl.constexpr = B // ROWS
    pid = tl.program_id(0)
    group = pid // PARTS
    i = (pid % PARTS) * ROWS + tl.arange(0, ROWS)
    start = tl.load(offsets_ptr + group)
    count = tl.load(offsets_ptr + group + 1) - start
    return group, start, count, i


@triton.jit
def _row_slab(start, count, i, nnz, first_block, BLOCKS: tl.constexpr, ROWS: tl.constexpr, B: tl.constexpr):
    """Offsets and mask of the [ROWS, BLOCKS, B] slab of rows i (of the block-row that starts at block `start` and
    has `count` blocks) from block first_block."""
    k = first_block + tl.arange(0, BLOCKS)
    j = tl.arange(0, B)
    z = tl.program_id(1).to(tl.int64)
    base = (z * nnz + start + k) * (B * B)
    offsets = base[None, :, None] + (i * B)[:, None, None] + j[None, None, :]
    return offsets, (k < count)[None, :, None]


@triton.jit
def _bwd_rows_kernel(y_ptr, dy_ptr, dx_ptr, offsets_ptr, nnz, scale, zero,
                     BLOCKS: tl.constexpr, ROWS: tl.constexpr, B: tl.constexpr, RAW: tl.constexpr):
    _, start, count, i = _row_program(offsets_ptr, ROWS, B)
    offsets, mask = _row_slab(start, count, i, nnz, 0, BLOCKS, ROWS, B)
    y0 = tl.load(y_ptr + offsets, mask=mask, other=0.0)
    dy0 = tl.load(dy_ptr + offsets, mask=mask, other=0.0)
    dot = tl.sum(tl.sum(y0.to(tl.float32) * dy0.to(tl.float32), axis=2), axis=1)
    for first in range(BLOCKS, count, BLOCKS):
        offsets, mask = _row_slab(start, count, i, nnz, first, BLOCKS, ROWS, B)
        y = tl.load(y_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        dot += tl.sum(tl.sum(y * dy, axis=2), axis=1)
    for first in range(BLOCKS, count, BLOCKS):
        offsets, mask = _row_slab(start, count, i, nnz, first, BLOCKS, ROWS, B)
        y = tl.load(y_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        dx = scale * y * (dy - dot[:, None, None])
        tl.store(dx_ptr + offsets, dx.to(dx_ptr.dtype.element_ty), mask=mask)
    offsets, mask = _row_slab(start, count, i, nnz, 0, BLOCKS, ROWS, B)
    dx0 = scale * widen(y0, zero, RAW) * (widen(dy0, zero, RAW) - dot[:, None, None])
    tl.store(dx_ptr + offsets, dx0.to(dx_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _causal_kept(causal_ptr, group, i, B: tl.constexpr):
    """Elements of rows i of block-row `group` that the causal mask keeps, a prefix of each row (lut.causal)."""
    c = tl.load(causal_ptr + group)
    return (c >> 1) * B + (c & 1) * (i + 1)


@triton.jit
def _row_scores(x, mask, kept, first_block, scale, BLOCKS: tl.constexpr, B: tl.constexpr, CAUSAL: tl.constexpr):
    """scale * x as float32, -inf where masked: past the row's blocks or, causal, past the kept prefix."""
    if CAUSAL:
        position = (first_block + tl.arange(0, BLOCKS))[:, None] * B + tl.arange(0, B)[None, :]
        mask = mask & (position[None, :, :] < kept[:, None, None])
    return tl.where(mask, x.to(tl.float32) * scale, -float("inf"))


@triton.jit
def _fwd_rows_kernel(x_ptr, out_ptr, offsets_ptr, nnz, scale, causal_ptr,
                     BLOCKS: tl.constexpr, ROWS: tl.constexpr, B: tl.constexpr, CAUSAL: tl.constexpr):
    """The held blocks' exponentials stay in registers (one exponential per element); the rest of a longer row
    is streamed for an online max and sum, then again for its output."""
    group, start, count, i = _row_program(offsets_ptr, ROWS, B)
    offsets, mask = _row_slab(start, count, i, nnz, 0, BLOCKS, ROWS, B)
    x0 = tl.load(x_ptr + offsets, mask=mask, other=0.0)
    kept = i
    if CAUSAL:
        kept = _causal_kept(causal_ptr, group, i, B)
    s0 = _row_scores(x0, mask, kept, 0, scale, BLOCKS, B, CAUSAL)
    held_max = tl.max(tl.max(s0, axis=2), axis=1)
    e0 = fast_exp(s0 - safe_shift(held_max)[:, None, None])
    run_max = held_max
    run_sum = tl.sum(tl.sum(e0, axis=2), axis=1)
    for first in range(BLOCKS, count, BLOCKS):
        offsets, mask = _row_slab(start, count, i, nnz, first, BLOCKS, ROWS, B)
        s = _row_scores(tl.load(x_ptr + offsets, mask=mask, other=0.0), mask, kept, first, scale, BLOCKS, B,
                        CAUSAL)
        run_max, shift, run_sum = online_max(run_max, run_sum, tl.max(tl.max(s, axis=2), axis=1))
        run_sum += tl.sum(tl.sum(fast_exp(s - shift[:, None, None]), axis=2), axis=1)
    safe_max = safe_shift(run_max)
    inverse = tl.where(run_sum > 0.0, 1.0 / run_sum, 0.0)
    for first in range(BLOCKS, count, BLOCKS):
        offsets, mask = _row_slab(start, count, i, nnz, first, BLOCKS, ROWS, B)
        s = _row_scores(tl.load(x_ptr + offsets, mask=mask, other=0.0), mask, kept, first, scale, BLOCKS, B,
                        CAUSAL)
        y = fast_exp(s - safe_max[:, None, None]) * inverse[:, None, None]
        tl.store(out_ptr + offsets, y.to(out_ptr.dtype.element_ty), mask=mask)
    offsets, mask = _row_slab(start, count, i, nnz, 0, BLOCKS, ROWS, B)
    # exp(s0 - safe_max) = e0 * exp(held_max - safe_max); a held part with no unmasked element gives 0
    held_scale = fast_exp(held_max - safe_max) * inverse
    tl.store(out_ptr + offsets, (e0 * held_scale[:, None, None]).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _lean_scores(x_ptr, offsets, mask, kept, first_block, NEGATIVE: tl.constexpr, BLOCKS: tl.constexpr,
                 B: tl.constexpr, CAUSAL: tl.constexpr):
    """x as loaded, the worst value (-inf, or +inf for a negative scale) where masked: past the row's blocks or,
    causal, past its kept prefix. Scaled by c < 0, +inf gives the -inf score that masks it."""
    if NEGATIVE:
        worst = float("inf")
    else:
        worst = -float("inf")
    x = tl.load(x_ptr + offsets, mask=mask, other=worst)
    if CAUSAL:
        position = (first_block + tl.arange(0, BLOCKS))[:, None] * B + tl.arange(0, B)[None, :]
        x = tl.where(position[None, :, :] < kept[:, None, None], x, worst)
    return x


@triton.jit
def _lean_top(x, c, NEGATIVE: tl.constexpr):
    """max over each row of c * x (log2 units), from the loaded values: their max, or min for c < 0."""
    if NEGATIVE:
        top = tl.min(tl.min(x, axis=2), axis=1)
    else:
        top = tl.max(tl.max(x, axis=2), axis=1)
    return top.to(tl.float32) * c


@triton.jit
def _fwd_rows_lean_kernel(x_ptr, out_ptr, offsets_ptr, nnz, c, causal_ptr, BLOCKS: tl.constexpr,
                          ROWS: tl.constexpr, B: tl.constexpr, CAUSAL: tl.constexpr, NEGATIVE: tl.constexpr):
    """_fwd_rows_kernel in log2 units, c = scale * log2 e (nonzero): the max is taken on the values as loaded, and
    each term is 2**(c * x - t), one multiply-add and one ex2 (t: the running max of c * x)."""
    group, start, count, i = _row_program(offsets_ptr, ROWS, B)
    kept = i
    if CAUSAL:
        kept = _causal_kept(causal_ptr, group, i, B)
    offsets, mask = _row_slab(start, count, i, nnz, 0, BLOCKS, ROWS, B)
    x0 = _lean_scores(x_ptr, offsets, mask, kept, 0, NEGATIVE, BLOCKS, B, CAUSAL)
    held_max = _lean_top(x0, c, NEGATIVE)
    e0 = fast_exp2(x0.to(tl.float32) * c - safe_shift(held_max)[:, None, None])
    run_max = held_max
    run_sum = tl.sum(tl.sum(e0, axis=2), axis=1)
    for first in range(BLOCKS, count, BLOCKS):
        offsets, mask = _row_slab(start, count, i, nnz, first, BLOCKS, ROWS, B)
        x = _lean_scores(x_ptr, offsets, mask, kept, first, NEGATIVE, BLOCKS, B, CAUSAL)
        new_max = tl.maximum(run_max, _lean_top(x, c, NEGATIVE))
        shift = safe_shift(new_max)
        run_sum = run_sum * fast_exp2(run_max - shift) + tl.sum(tl.sum(
            fast_exp2(x.to(tl.float32) * c - shift[:, None, None]), axis=2), axis=1)
        run_max = new_max
    safe_max = safe_shift(run_max)
    inverse = tl.where(run_sum > 0.0, 1.0 / run_sum, 0.0)
    for first in range(BLOCKS, count, BLOCKS):
        offsets, mask = _row_slab(start, count, i, nnz, first, BLOCKS, ROWS, B)
        x = _lean_scores(x_ptr, offsets, mask, kept, first, NEGATIVE, BLOCKS, B, CAUSAL)
        y = fast_exp2(x.to(tl.float32) * c - safe_max[:, None, None]) * inverse[:, None, None]
        tl.store(out_ptr + offsets, y.to(out_ptr.dtype.element_ty), mask=mask)
    offsets, mask = _row_slab(start, count, i, nnz, 0, BLOCKS, ROWS, B)
    held_scale = fast_exp2(held_max - safe_max) * inverse
    tl.store(out_ptr + offsets, (e0 * held_scale[:, None, None]).to(out_ptr.dtype.element_ty), mask=mask)


def _row_blocks(lut, element_size):
    """Blocks of each row that the backward's row kernels hold (see ROW_HELD)."""
    mean_row = lut.mean_blocks * lut.block
    held = ROW_HELD_LONG if mean_row >= ROW_LONG else ROW_HELD
    return min(next_power_of_2(lut.mean_blocks), max(held // lut.block, ROW_MIN_BLOCKS[element_size]))


def _launch_rows(kernel, lut, tensors, scale, *extra, warps=None, blocks=None, **constexprs):
    """One program per `warps` rows of a block-row (ROW_WARPS), a warp a row, holding `blocks` of each
    (_row_blocks); `extra` are the kernel's arguments after the scale."""
    block = lut.block
    blocks = blocks or _row_blocks(lut, tensors[0].element_size())
    rows = min(block, warps or ROW_WARPS)
    with on_device(tensors[0]):
        for first in range(0, tensors[0].shape[0], MAX_GRID_Z):
            part = [t[first:first + MAX_GRID_Z] for t in tensors]
            grid = (lut.heads * lut.block_rows * (block // rows), part[0].shape[0])
            kernel[grid](*part, lut.offsets, lut.nnz, float(scale), *extra,
                         BLOCKS=blocks, ROWS=rows, B=block, num_warps=rows, **constexprs)


def _plan(blocks, block):
    """(tile?, blocks per slab, rows per program) for block-rows of up to `blocks` (a power of 2) blocks."""
    widest = blocks * block
    if widest <= TILE_MAX:
        return True, blocks, max(1, TILE_ELEMENTS // widest)
    rows = min(block, LOOP_ROWS)
    return False, max(1, TILE_ELEMENTS // (rows * block)), rows


def _padded(counts, block):
    """Slab elements read (per B x B) for block-rows of these block counts, all with one plan: the
    loop path pads each row to a multiple of its slab and reads it twice."""
    tile, blocks, _ = _plan(next_power_of_2(max(counts)), block)
    return blocks * len(counts) if tile else 2 * sum(blocks * -(-count // blocks) for count in counts)


# (id(lut), save) -> [(block-row table, block-rows, plan), ...]; an entry leaves with its look-up table.
_schedules = {}


def _schedule(lut, save):
    """The launches for this look-up table: (its block-rows' table on the device, block-rows, plan) each.

    The table holds (block-row, first block, blocks) per block-row, read in one round trip by each
    program. The non-empty block-rows, in memory order (DRAM pages in sequence), go in one launch, or in
    one launch per power of two of their block count (all rows past the tile path's reach in one loop
    launch) when that pads the slabs by the share `save` less (BUCKETS_SAVE)."""
    key = (id(lut), save)
    if key in _schedules:
        return _schedules[key]
    offsets = lut.offsets.tolist()
    counts = [end - start for start, end in zip(offsets[:-1], offsets[1:])]
    order = [group for group, count in enumerate(counts) if count > 0]
    buckets = {}
    for group in order:
        tile, blocks, _ = _plan(next_power_of_2(counts[group]), lut.block)
        buckets.setdefault(blocks if tile else 0, []).append(group)
    single = _padded([counts[g] for g in order], lut.block) if order else 0
    split = sum(_padded([counts[g] for g in groups], lut.block) for groups in buckets.values())
    if split > (1 - save) * single:
        buckets = {None: order} if order else {}
    launches = []
    for groups in buckets.values():
        table = torch.tensor([(g, offsets[g], counts[g]) for g in groups], dtype=torch.int32,
                             device=lut.offsets.device)
        longest = max(counts[g] for g in groups)
        launches.append((table, len(groups), _plan(next_power_of_2(longest), lut.block)))
    _schedules[key] = launches
    weakref.finalize(lut, _schedules.pop, key, None)
    return launches


def _launch(kernels, lut, tensors, scale, direction, **constexprs):
    save = BUCKETS_SAVE[direction][tensors[0].element_size()]
    with on_device(tensors[0]):
        for first in range(0, tensors[0].shape[0], MAX_GRID_Z):  # the grid's second axis holds Z
            part = [t[first:first + MAX_GRID_Z] for t in tensors]
            for table, groups, (tile, blocks, rows) in _schedule(lut, save):
                kernel = kernels[0] if tile else kernels[1]
                grid = (triton.cdiv(groups * lut.block, rows), part[0].shape[0])
                kernel[grid](*part, table, lut.columns, groups * lut.block, lut.nnz, lut.block_rows,
                             float(scale), BLOCKS=blocks, ROWS=rows, B=lut.block,
                             num_warps=warps_for(blocks * rows * lut.block), **constexprs)


def forward(x, out, lut, scale, is_causal):
    """out = softmax(scale * x) over each row of each block-row (causal mask optional)."""
    if x.numel() == 0 or lut.max_blocks == 0:
        return
    causal = bool(is_causal)
    largest_block, low, high = FORWARD_ROWS[causal][x.element_size()]
    if ROW_FORWARD == "rows" and lut.block <= largest_block and low <= lut.mean_blocks * lut.block < high:
        if FORWARD_LEAN and scale != 0:
            blocks = None
            if FORWARD_HELD:
                blocks = min(next_power_of_2(lut.mean_blocks), max(1, FORWARD_HELD // lut.block))
            _launch_rows(_fwd_rows_lean_kernel, lut, (x, out), scale * LOG2E, lut.causal, warps=FORWARD_WARPS,
                         blocks=blocks, CAUSAL=causal, NEGATIVE=scale < 0)
            return
        _launch_rows(_fwd_rows_kernel, lut, (x, out), scale, lut.causal, CAUSAL=causal)
        return
    _launch((_fwd_tile_kernel, _fwd_loop_kernel), lut, (x, out), scale, "forward", CAUSAL=causal)


def backward(y, dy, dx, lut, scale):
    """dx = scale * y * (dy - sum_row(y * dy))."""
    if y.numel() == 0 or lut.max_blocks == 0:
        return
    if ROW_BACKWARD == "rows" and lut.mean_blocks * lut.block < TILES_FROM[y.element_size()]:
        _launch_rows(_bwd_rows_kernel, lut, (y, dy, dx), scale, 0, RAW=ROW_RAW and y.element_size() == 2)
        return
    _launch((_bwd_tile_kernel, _bwd_loop_kernel), lut, (y, dy, dx), scale, "backward")
