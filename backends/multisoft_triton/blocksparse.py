"""Block-sparse softmax over the nonzero blocks (Z, nnz, B, B) of a layout.

The rows of a block-row are its B rows of elements, each spread over the block-row's blocks. Both
directions hold each row's first blocks in registers, ROW_WARPS rows a program, and stream the rest of a
longer row twice (row kernels; the forward of short rows holds them across a warp's lanes instead, several
rows a warp); layouts of float32 rows long enough for them take the backward's tile and loop kernels, which
hold ROWS rows a program as a [BLOCKS, ROWS, B] slab, BLOCKS the power of two that covers the launch's
longest block-row. When that pads the slabs enough less (a causal layout's block-rows run from one block
to all), the block-rows are grouped by their block count's power of two, one launch per group (decided
once per layout). The settings in capitals are in _tuning.

Non-finite scores follow backends/README.md: a row's unmasked elements get what dense softmax gives over them
(NaN throughout for a NaN or +inf among them, or when all are -inf: the shift guards only a max of -inf, and the
sum is divided unguarded), masked elements 0 (causal: a select in programs with such a row or one with no unmasked
element); the backward gives 0 wherever y is 0 (a select).
"""
import weakref

import torch
import triton
import triton.language as tl

from . import _tuning
from ._device import fast_exp2, safe_shift, widen
from ._launch import LAUNCH, launch, next_power_of_2, on_device, warps_for

MAX_GRID_Z = 65535  # a CUDA grid's second axis
LOG2E = 1.4426950408889634


@triton.jit
def _rows(rows_ptr, rows, ROWS: tl.constexpr, B: tl.constexpr):
    """This program's rows: their block-row's first block and number of blocks, and the row within the block.

    Row r of the launch is row r % B of the block-row described by rows_ptr[2 * (r // B):][:2] as
    (first block, blocks); the launch has `rows` rows."""
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_mask = r < rows
    entry = rows_ptr + (r // B) * 2
    start = tl.load(entry, mask=row_mask, other=0)
    count = tl.load(entry + 1, mask=row_mask, other=0)
    return start, count, r % B


@triton.jit
def _slab(rows_ptr, rows, nnz, first_block, BLOCKS: tl.constexpr, ROWS: tl.constexpr, B: tl.constexpr):
    """Offsets and mask of this program's [BLOCKS, ROWS, B] slab, from block first_block."""
    start, count, i = _rows(rows_ptr, rows, ROWS, B)
    k = first_block + tl.arange(0, BLOCKS)
    j = tl.arange(0, B)
    block_mask = k[:, None] < count[None, :]
    z = tl.program_id(1).to(tl.int64)
    base = (z * nnz + start[None, :] + k[:, None]) * (B * B) + (i * B)[None, :]
    return base[:, :, None] + j[None, None, :], block_mask[:, :, None]


@triton.jit
def _longest(rows_ptr, rows, ROWS: tl.constexpr, B: tl.constexpr):
    """The most blocks of any of this program's rows."""
    _, count, _ = _rows(rows_ptr, rows, ROWS, B)
    return tl.max(count, axis=0)


@triton.jit
def _any_not_finite(v):
    """Whether any of the per-row values v is NaN or infinite (a scalar, for a branch the whole program takes)."""
    return tl.min((tl.abs(v) < float("inf")).to(tl.int32), axis=0) == 0


@triton.jit
def _grad(y, dy, dot, scale):
    """scale * y * (dy - dot), 0 wherever y is 0 (masked elements, zero probabilities), also in a row whose dot is
    NaN (a select, docs/tuning.md)."""
    return tl.where(y == 0.0, 0.0, scale * y * (dy - dot))


@triton.jit
def _bwd_tile_kernel(y_ptr, dy_ptr, dx_ptr, rows_ptr, rows, nnz, scale,
                     BLOCKS: tl.constexpr, ROWS: tl.constexpr, B: tl.constexpr):
    offsets, mask = _slab(rows_ptr, rows, nnz, 0, BLOCKS, ROWS, B)
    y = tl.load(y_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    dot = tl.sum(tl.sum(y * dy, axis=2), axis=0)
    dx = _grad(y, dy, dot[None, :, None], scale)
    tl.store(dx_ptr + offsets, dx.to(dx_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _bwd_loop_kernel(y_ptr, dy_ptr, dx_ptr, rows_ptr, rows, nnz, scale,
                     BLOCKS: tl.constexpr, ROWS: tl.constexpr, B: tl.constexpr):
    count = _longest(rows_ptr, rows, ROWS, B)
    dot = tl.zeros((ROWS,), tl.float32)
    for first in range(0, count, BLOCKS):
        offsets, mask = _slab(rows_ptr, rows, nnz, first, BLOCKS, ROWS, B)
        y = tl.load(y_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        dot += tl.sum(tl.sum(y * dy, axis=2), axis=0)
    for first in range(0, count, BLOCKS):
        offsets, mask = _slab(rows_ptr, rows, nnz, first, BLOCKS, ROWS, B)
        y = tl.load(y_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        dx = _grad(y, dy, dot[None, :, None], scale)
        tl.store(dx_ptr + offsets, dx.to(dx_ptr.dtype.element_ty), mask=mask)


# Row kernels: a program holds ROW_WARPS rows of one block-row (a warp's worth of threads each), the first blocks of
# each in registers and the rest, if any, streamed twice; no power-of-two padding of whole rows, which the tile kernels
# pay on layouts whose block-rows differ in length (causal). A row holds ROW_HELD elements (ROW_HELD_LONG where the
# layout's mean row is ROW_LONG or more), at least ROW_MIN_BLOCKS blocks, at most the power of two covering its mean
# row. Their slab is [BLOCKS // INNER, ROWS, INNER, B]: INNER blocks of a row lie side by side in a warp's lanes
# (ROW_INNER; None: as many as fill its 32 lanes, a warp a row, whose max and sum are then warp shuffles). With fewer,
# a warp's lanes take several rows and a row spreads over several warps, its reductions through shared memory.


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
def _row_blocks_at(first_block, BLOCKS: tl.constexpr, INNER: tl.constexpr):
    """The block indices of a slab from block first_block, as [BLOCKS // INNER, INNER]."""
    return first_block + tl.arange(0, BLOCKS // INNER)[:, None] * INNER + tl.arange(0, INNER)[None, :]


@triton.jit
def _row_slab(start, count, i, nnz, first_block, BLOCKS: tl.constexpr, ROWS: tl.constexpr, B: tl.constexpr,
              INNER: tl.constexpr):
    """Offsets and mask of the [BLOCKS // INNER, ROWS, INNER, B] slab of rows i (of the block-row that starts at
    block `start` and has `count` blocks), BLOCKS blocks from block first_block. Triton lays a tensor's fastest
    dimensions across a warp's lanes first: with INNER * B * element size = 32 lanes * 16 bytes a warp's lanes
    take INNER blocks of one row and its warps take the rows, so that a row's reductions stay within its warp;
    with INNER = 1 and rows of a few pieces, the rows lie across the lanes, several a warp."""
    k = _row_blocks_at(first_block, BLOCKS, INNER)
    j = tl.arange(0, B)
    z = tl.program_id(1).to(tl.int64)
    base = (z * nnz + start + k) * (B * B)
    offsets = base[:, None, :, None] + (i * B)[None, :, None, None] + j[None, None, None, :]
    mask = (k < count)[:, None, :, None]
    return offsets, mask


@triton.jit
def _per_row(v):
    """A value per row, shaped to broadcast over a slab of _row_slab."""
    return v[None, :, None, None]


@triton.jit
def _row_sum(x):
    """The sum over each row of a slab of _row_slab."""
    return tl.sum(tl.sum(tl.sum(x, axis=3), axis=2), axis=0)


@triton.jit
def _bwd_rows_kernel(y_ptr, dy_ptr, dx_ptr, offsets_ptr, nnz, scale, zero,
                     BLOCKS: tl.constexpr, ROWS: tl.constexpr, B: tl.constexpr, INNER: tl.constexpr,
                     RAW: tl.constexpr):
    _, start, count, i = _row_program(offsets_ptr, ROWS, B)
    offsets, mask = _row_slab(start, count, i, nnz, 0, BLOCKS, ROWS, B, INNER)
    y0 = tl.load(y_ptr + offsets, mask=mask, other=0.0)
    dy0 = tl.load(dy_ptr + offsets, mask=mask, other=0.0)
    dot = _row_sum(y0.to(tl.float32) * dy0.to(tl.float32))
    for first in range(BLOCKS, count, BLOCKS):
        offsets, mask = _row_slab(start, count, i, nnz, first, BLOCKS, ROWS, B, INNER)
        y = tl.load(y_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        dot += _row_sum(y * dy)
    for first in range(BLOCKS, count, BLOCKS):
        offsets, mask = _row_slab(start, count, i, nnz, first, BLOCKS, ROWS, B, INNER)
        y = tl.load(y_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        dx = _grad(y, dy, _per_row(dot), scale)
        tl.store(dx_ptr + offsets, dx.to(dx_ptr.dtype.element_ty), mask=mask)
    offsets, mask = _row_slab(start, count, i, nnz, 0, BLOCKS, ROWS, B, INNER)
    dx0 = _grad(widen(y0, zero, RAW), widen(dy0, zero, RAW), _per_row(dot), scale)
    tl.store(dx_ptr + offsets, dx0.to(dx_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _causal_kept(causal_ptr, group, i, B: tl.constexpr):
    """Elements of rows i of block-row `group` that the causal mask keeps, a prefix of each row (lut.causal)."""
    c = tl.load(causal_ptr + group)
    return (c >> 1) * B + (c & 1) * (i + 1)


@triton.jit
def _row_kept(kept, first_block, BLOCKS: tl.constexpr, B: tl.constexpr, INNER: tl.constexpr):
    """Where a slab of _row_slab from block first_block lies in its rows' kept prefixes (the causal mask)."""
    position = _row_blocks_at(first_block, BLOCKS, INNER)[:, None, :, None] * B + tl.arange(0, B)
    return position < _per_row(kept)


@triton.jit
def _row_values(x_ptr, offsets, mask, kept, first_block, SIGN: tl.constexpr, BLOCKS: tl.constexpr,
                B: tl.constexpr, CAUSAL: tl.constexpr, INNER: tl.constexpr):
    """Rows i's values as loaded, where masked (past the row's blocks or, causal, past its kept prefix) the value
    that a scale of sign SIGN sends to -inf: -inf, or +inf for a negative scale. For a zero scale (SIGN 0): the
    scores 0 * x themselves, as float32 (0, or NaN where x is not finite), -inf where masked."""
    if SIGN < 0:
        worst = float("inf")
    else:
        worst = -float("inf")
    x = tl.load(x_ptr + offsets, mask=mask, other=worst)
    if CAUSAL:
        keep = _row_kept(kept, first_block, BLOCKS, B, INNER)
        mask = mask & keep
        if SIGN != 0:
            x = tl.where(keep, x, tl.full(x.shape, worst, x.dtype))   # as loaded (a float would widen it)
    if SIGN == 0:
        x = tl.where(mask, x.to(tl.float32) * 0.0, -float("inf"))
    return x


@triton.jit
def _row_top(x, c, SIGN: tl.constexpr):
    """The max over each row of c * x (with c > 0, or c < 0 for SIGN -1), from _row_values."""
    if SIGN < 0:
        top = tl.min(tl.min(tl.min(x, axis=3), axis=2), axis=0)
    else:
        top = tl.max(tl.max(tl.max(x, axis=3), axis=2), axis=0)
    return top.to(tl.float32) * c


@triton.jit
def _fwd_rows_kernel(x_ptr, out_ptr, offsets_ptr, nnz, c, causal_ptr, zero, BLOCKS: tl.constexpr,
                     ROWS: tl.constexpr, B: tl.constexpr, CAUSAL: tl.constexpr, SIGN: tl.constexpr,
                     INNER: tl.constexpr):
    """softmax(scale * x) in log2 units, c = scale * log2 e (1 for a zero scale, whose scores _row_values gives):
    the max is taken on the values as loaded and each term is 2**(c * x - t), one multiply-add and one ex2, t the
    running max of c * x. The held blocks' terms stay in registers; the rest of a longer row is streamed for an
    online max and sum, then again for its output. INNER: the slab's layout (_row_slab). The shift is the max
    but where that is -inf (safe_shift), never where it is +inf or NaN, and the sum's inverse is taken unguarded, so
    that a row's unmasked elements come out as dense softmax gives them (NaN throughout for a NaN or +inf among them,
    or when all are -inf). The causal mask's elements come out 0 but in such a row, or one with nothing unmasked
    (max -inf, sum 0: 0 * inf): where the program has one, they are set to 0 (a select the others leave out). The
    held part's mask is then formed again from `zero`, a run-time 0: from 0 itself the compiler keeps the load's
    mask alive through the streaming loops, which costs registers and speed (docs/tuning.md)."""
    group, start, count, i = _row_program(offsets_ptr, ROWS, B)
    kept = i
    if CAUSAL:
        kept = _causal_kept(causal_ptr, group, i, B)
    offsets, mask = _row_slab(start, count, i, nnz, 0, BLOCKS, ROWS, B, INNER)
    x0 = _row_values(x_ptr, offsets, mask, kept, 0, SIGN, BLOCKS, B, CAUSAL, INNER)
    held_max = _row_top(x0, c, SIGN)
    e0 = fast_exp2(x0.to(tl.float32) * c - _per_row(safe_shift(held_max)))
    run_max = held_max
    run_sum = _row_sum(e0)
    for first in range(BLOCKS, count, BLOCKS):
        part, part_mask = _row_slab(start, count, i, nnz, first, BLOCKS, ROWS, B, INNER)
        x = _row_values(x_ptr, part, part_mask, kept, first, SIGN, BLOCKS, B, CAUSAL, INNER)
        new_max = tl.maximum(run_max, _row_top(x, c, SIGN))
        shift = safe_shift(new_max)
        terms = fast_exp2(x.to(tl.float32) * c - _per_row(shift))
        run_sum = run_sum * fast_exp2(run_max - shift) + _row_sum(terms)
        run_max = new_max
    safe_max = safe_shift(run_max)
    inverse = 1.0 / run_sum
    remask = False
    if CAUSAL:
        remask = _any_not_finite(run_max + inverse)
    for first in range(BLOCKS, count, BLOCKS):
        part, part_mask = _row_slab(start, count, i, nnz, first, BLOCKS, ROWS, B, INNER)
        x = _row_values(x_ptr, part, part_mask, kept, first, SIGN, BLOCKS, B, CAUSAL, INNER)
        y = fast_exp2(x.to(tl.float32) * c - _per_row(safe_max)) * _per_row(inverse)
        if remask:
            y = tl.where(_row_kept(kept, first, BLOCKS, B, INNER), y, 0.0)
        tl.store(out_ptr + part, y.to(out_ptr.dtype.element_ty), mask=part_mask)
    offsets, mask = _row_slab(start, count, i, nnz, 0, BLOCKS, ROWS, B, INNER)
    # 2**(c * x0 - safe_max) = e0 * 2**(held_max - safe_max): 0 where the held part is -inf only (or masked) and
    # the row is not NaN
    y0 = e0 * _per_row(fast_exp2(held_max - safe_max) * inverse)
    if remask:
        y0 = tl.where(_row_kept(kept, zero, BLOCKS, B, INNER), y0, 0.0)
    tl.store(out_ptr + offsets, y0.to(out_ptr.dtype.element_ty), mask=mask)


def _row_blocks(lut, element_size):
    """Blocks of each row that the row kernels hold (see ROW_HELD)."""
    mean_row = lut.mean_blocks * lut.block
    held = _tuning.ROW_HELD_LONG if mean_row >= _tuning.ROW_LONG else _tuning.ROW_HELD
    return min(next_power_of_2(lut.mean_blocks), max(held // lut.block, _tuning.ROW_MIN_BLOCKS[element_size]))


def _row_inner(direction, element_size, block, blocks):
    """INNER of the row kernels' slab (_row_slab): blocks of a row side by side in a warp's lanes, a 16-byte piece
    each, by ROW_INNER, or as many as fill the warp's 32 lanes; at most the `blocks` held."""
    inner = _tuning.ROW_INNER[direction][element_size] or 32 * 16 // (element_size * block)
    return max(1, min(blocks, inner))


def _batch_parts(tensors):
    """The tensors in parts of at most MAX_GRID_Z batch entries, the grid's second axis: as they are when they fit
    (slicing costs host time on every call)."""
    z = tensors[0].shape[0]
    if z <= MAX_GRID_Z:
        return [tensors]
    return [[t[first:first + MAX_GRID_Z] for t in tensors] for first in range(0, z, MAX_GRID_Z)]


def _launch_rows(kernel, lut, tensors, scale, *extra, rows, warps=None, blocks=None, across=False, **constexprs):
    """One program per `rows` rows of a block-row, a warp's worth of threads a row laid out by _row_inner (or `warps`
    warps in all, across: the rows across their lanes), holding _row_blocks of each (or `blocks`); `extra` are the
    kernel's arguments after the scale."""
    block = lut.block
    size = tensors[0].element_size()
    blocks = blocks or _row_blocks(lut, size)
    rows = min(block, rows)
    inner = 1 if across else _row_inner("backward" if kernel is _bwd_rows_kernel else "forward", size, block, blocks)
    with on_device(tensors[0]):
        for part in _batch_parts(tensors):
            grid = (lut.heads * lut.block_rows * (block // rows), part[0].shape[0])
            launch(kernel, grid, *part, lut.offsets, lut.nnz, float(scale), *extra, BLOCKS=blocks, ROWS=rows, B=block,
                   INNER=inner, num_warps=warps or rows, **LAUNCH, **constexprs)


def _plan(blocks, block):
    """(tile?, blocks per slab, rows per program) for block-rows of up to `blocks` (a power of 2) blocks."""
    widest = blocks * block
    if widest <= _tuning.BLOCKSPARSE_TILE_MAX:
        return True, blocks, max(1, _tuning.BLOCKSPARSE_TILE_ELEMENTS // widest)
    rows = min(block, _tuning.BLOCKSPARSE_LOOP_ROWS)
    return False, max(1, _tuning.BLOCKSPARSE_TILE_ELEMENTS // (rows * block)), rows


def _padded(counts, block):
    """Slab elements read (per B x B) for block-rows of these block counts, all with one plan: the
    loop path pads each row to a multiple of its slab and reads it twice."""
    tile, blocks, _ = _plan(next_power_of_2(max(counts)), block)
    return blocks * len(counts) if tile else 2 * sum(blocks * -(-count // blocks) for count in counts)


# (id(lut), save) -> [(block-row table, block-rows, plan), ...]; an entry leaves with its look-up table.
_schedules = {}


def _schedule(lut, save):
    """The launches for this look-up table: (its block-rows' table on the device, block-rows, plan) each.

    The table holds (first block, blocks) per block-row, read in one round trip by each
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
        table = torch.tensor([(offsets[g], counts[g]) for g in groups], dtype=torch.int32,
                             device=lut.offsets.device)
        longest = max(counts[g] for g in groups)
        launches.append((table, len(groups), _plan(next_power_of_2(longest), lut.block)))
    _schedules[key] = launches
    weakref.finalize(lut, _schedules.pop, key, None)
    return launches


def _launch_tiles(kernels, lut, tensors, scale):
    """The tile and loop kernels (`kernels`) over the launches of _schedule."""
    save = _tuning.BUCKETS_SAVE[tensors[0].element_size()]
    with on_device(tensors[0]):
        for part in _batch_parts(tensors):
            for table, groups, (tile, blocks, rows) in _schedule(lut, save):
                kernel = kernels[0] if tile else kernels[1]
                grid = (triton.cdiv(groups * lut.block, rows), part[0].shape[0])
                launch(kernel, grid, *part, table, groups * lut.block, lut.nnz, float(scale), BLOCKS=blocks, ROWS=rows,
                       B=lut.block, num_warps=warps_for(blocks * rows * lut.block), **LAUNCH)


def forward(x, out, lut, scale, is_causal):
    """out = softmax(scale * x) over each row of each block-row (causal mask optional), on the row kernel: its rows
    across a warp's lanes where the mean row is FORWARD_ACROSS_UNTIL or less, otherwise ROW_WARPS rows a program, one
    for blocks of FORWARD_ONE_ROW_FROM or more and where the mean row is ROW_LONG or more."""
    sign = (scale > 0) - (scale < 0)
    size = x.element_size()
    args = (_fwd_rows_kernel, lut, (x, out), scale * LOG2E if sign else 1.0, lut.causal, 0)
    if lut.mean_blocks * lut.block <= _tuning.FORWARD_ACROSS_UNTIL[size]:
        # the warps' lanes hold 16-byte pieces of their rows' blocks: B * size / 16 lanes a row
        warps = _tuning.FORWARD_ACROSS_WARPS
        rows = min(lut.block, max(1, warps * 32 * 16 // (lut.block * size)))
        blocks = min(next_power_of_2(lut.mean_blocks), _tuning.FORWARD_ACROSS_BLOCKS[size])
        _launch_rows(*args, rows=rows, warps=warps, blocks=blocks, across=True, CAUSAL=bool(is_causal), SIGN=sign)
        return
    one_row = lut.block >= _tuning.FORWARD_ONE_ROW_FROM[size] or lut.mean_blocks * lut.block >= _tuning.ROW_LONG
    _launch_rows(*args, rows=1 if one_row else _tuning.ROW_WARPS, CAUSAL=bool(is_causal), SIGN=sign)


def backward(y, dy, dx, lut, scale):
    """dx = scale * y * (dy - sum_row(y * dy)): the row kernel, or the tile and loop kernels for layouts whose mean
    row is TILES_FROM or more."""
    if lut.mean_blocks * lut.block < _tuning.TILES_FROM[y.element_size()]:
        # 16-bit rows are held as loaded and widened twice (docs/tuning.md)
        _launch_rows(_bwd_rows_kernel, lut, (y, dy, dx), scale, 0, rows=_tuning.ROW_WARPS, RAW=y.element_size() == 2)
        return
    _launch_tiles((_bwd_tile_kernel, _bwd_loop_kernel), lut, (y, dy, dx), scale)
