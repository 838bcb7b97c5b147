"""Block-sparse softmax over the nonzero blocks (Z, nnz, B, B) of a layout.

A program owns ROWS rows of one block-row of one batch entry and loads whole
[ROWS, B] slabs of each of the block-row's blocks (contiguous in memory).
When the block-row fits in registers (tile path) each element is read and
written once; otherwise (loop path) the blocks are streamed twice, first for
the row statistics, then for the output. Rows with no unmasked element give zeros.
"""
import triton
import triton.language as tl

from .utils import next_power_of_2, on_device, warps_for

TILE_MAX = 16384
TILE_ELEMENTS = 8192
LOOP_ROWS = 16


@triton.jit
def _slab(offsets_ptr, columns_ptr, pid, groups, row_chunks, nnz, block_rows, first_block,
          BLOCKS: tl.constexpr, ROWS: tl.constexpr, B: tl.constexpr):
    """Offsets, block mask and causal keep-mask of a [BLOCKS, ROWS, B] slab of this program's block-row."""
    chunk = pid % row_chunks
    rest = pid // row_chunks
    group = rest % groups
    z = rest // groups
    start = tl.load(offsets_ptr + group).to(tl.int64)
    count = tl.load(offsets_ptr + group + 1).to(tl.int64) - start
    k = first_block + tl.arange(0, BLOCKS)
    block_mask = k < count
    column = tl.load(columns_ptr + start + k, mask=block_mask, other=0)
    i = (chunk * ROWS).to(tl.int32) + tl.arange(0, ROWS)
    j = tl.arange(0, B)
    base = (z * nnz + start + k) * (B * B)
    offsets = base[:, None, None] + (i * B)[:, None][None, :, :] + j[None, None, :]
    mask = block_mask[:, None, None]
    # absolute column c*B + j <= absolute row r*B + i  <=>  j - i <= (r - c) * B
    block_row = (group % block_rows).to(tl.int32)
    causal_keep = (j[None, :] - i[:, None])[None, :, :] <= ((block_row - column) * B)[:, None, None]
    return offsets, mask, causal_keep


@triton.jit
def _block_count(offsets_ptr, pid, groups, row_chunks):
    group = (pid // row_chunks) % groups
    return tl.load(offsets_ptr + group + 1) - tl.load(offsets_ptr + group)


@triton.jit
def _scores(x_ptr, offsets, mask, causal_keep, scale, CAUSAL: tl.constexpr):
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32) * scale
    if CAUSAL:
        mask = mask & causal_keep
    return tl.where(mask, x, -float("inf"))


@triton.jit
def _fwd_tile_kernel(x_ptr, out_ptr, offsets_ptr, columns_ptr, groups, row_chunks, nnz, block_rows, scale,
                     BLOCKS: tl.constexpr, ROWS: tl.constexpr, B: tl.constexpr, CAUSAL: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    offsets, mask, causal_keep = _slab(offsets_ptr, columns_ptr, pid, groups, row_chunks, nnz, block_rows,
                                       0, BLOCKS, ROWS, B)
    x = _scores(x_ptr, offsets, mask, causal_keep, scale, CAUSAL)
    row_max = tl.max(tl.max(x, axis=2), axis=0)
    safe_max = tl.where(row_max == -float("inf"), 0.0, row_max)
    e = tl.exp(x - safe_max[None, :, None])
    total = tl.sum(tl.sum(e, axis=2), axis=0)
    inverse = tl.where(total > 0.0, 1.0 / total, 0.0)
    y = e * inverse[None, :, None]
    tl.store(out_ptr + offsets, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _fwd_loop_kernel(x_ptr, out_ptr, offsets_ptr, columns_ptr, groups, row_chunks, nnz, block_rows, scale,
                     BLOCKS: tl.constexpr, ROWS: tl.constexpr, B: tl.constexpr, CAUSAL: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    count = _block_count(offsets_ptr, pid, groups, row_chunks)
    run_max = tl.full((ROWS,), -float("inf"), tl.float32)
    run_sum = tl.zeros((ROWS,), tl.float32)
    for first in range(0, count, BLOCKS):
        offsets, mask, causal_keep = _slab(offsets_ptr, columns_ptr, pid, groups, row_chunks, nnz, block_rows,
                                           first, BLOCKS, ROWS, B)
        x = _scores(x_ptr, offsets, mask, causal_keep, scale, CAUSAL)
        new_max = tl.maximum(run_max, tl.max(tl.max(x, axis=2), axis=0))
        safe_max = tl.where(new_max == -float("inf"), 0.0, new_max)
        e = tl.exp(x - safe_max[None, :, None])
        run_sum = run_sum * tl.exp(run_max - safe_max) + tl.sum(tl.sum(e, axis=2), axis=0)
        run_max = new_max
    safe_max = tl.where(run_max == -float("inf"), 0.0, run_max)
    inverse = tl.where(run_sum > 0.0, 1.0 / run_sum, 0.0)
    for first in range(0, count, BLOCKS):
        offsets, mask, causal_keep = _slab(offsets_ptr, columns_ptr, pid, groups, row_chunks, nnz, block_rows,
                                           first, BLOCKS, ROWS, B)
        x = _scores(x_ptr, offsets, mask, causal_keep, scale, CAUSAL)
        y = tl.exp(x - safe_max[None, :, None]) * inverse[None, :, None]
        tl.store(out_ptr + offsets, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _bwd_tile_kernel(y_ptr, dy_ptr, dx_ptr, offsets_ptr, columns_ptr, groups, row_chunks, nnz, block_rows,
                     scale, BLOCKS: tl.constexpr, ROWS: tl.constexpr, B: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    offsets, mask, _ = _slab(offsets_ptr, columns_ptr, pid, groups, row_chunks, nnz, block_rows,
                             0, BLOCKS, ROWS, B)
    y = tl.load(y_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    dot = tl.sum(tl.sum(y * dy, axis=2), axis=0)
    dx = scale * y * (dy - dot[None, :, None])
    tl.store(dx_ptr + offsets, dx.to(dx_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _bwd_loop_kernel(y_ptr, dy_ptr, dx_ptr, offsets_ptr, columns_ptr, groups, row_chunks, nnz, block_rows,
                     scale, BLOCKS: tl.constexpr, ROWS: tl.constexpr, B: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    count = _block_count(offsets_ptr, pid, groups, row_chunks)
    dot = tl.zeros((ROWS,), tl.float32)
    for first in range(0, count, BLOCKS):
        offsets, mask, _ = _slab(offsets_ptr, columns_ptr, pid, groups, row_chunks, nnz, block_rows,
                                 first, BLOCKS, ROWS, B)
        y = tl.load(y_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        dot += tl.sum(tl.sum(y * dy, axis=2), axis=0)
    for first in range(0, count, BLOCKS):
        offsets, mask, _ = _slab(offsets_ptr, columns_ptr, pid, groups, row_chunks, nnz, block_rows,
                                 first, BLOCKS, ROWS, B)
        y = tl.load(y_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        dx = scale * y * (dy - dot[None, :, None])
        tl.store(dx_ptr + offsets, dx.to(dx_ptr.dtype.element_ty), mask=mask)


def _plan(lut):
    """(tile?, blocks per slab, rows per program) for this layout's widest block-row."""
    block = lut.block
    widest = next_power_of_2(lut.max_blocks) * block
    if widest <= TILE_MAX:
        rows = max(1, min(block, TILE_ELEMENTS // widest))
        return True, next_power_of_2(lut.max_blocks), rows
    rows = min(block, LOOP_ROWS)
    return False, max(1, TILE_ELEMENTS // (rows * block)), rows


def _launch(kernels, lut, tensors, scale, **constexprs):
    tile, blocks, rows = _plan(lut)
    kernel = kernels[0] if tile else kernels[1]
    groups = lut.heads * lut.block_rows
    row_chunks = lut.block // rows
    grid = (tensors[0].shape[0] * groups * row_chunks,)
    with on_device(tensors[0]):
        kernel[grid](*tensors, lut.offsets, lut.columns, groups, row_chunks, lut.nnz, lut.block_rows, float(scale),
                     BLOCKS=blocks, ROWS=rows, B=lut.block, num_warps=warps_for(blocks * rows * lut.block),
                     **constexprs)


def forward(x, out, lut, scale, is_causal):
    """out = softmax(scale * x) over each row of each block-row (causal mask optional)."""
    if x.numel() == 0 or lut.max_blocks == 0:
        return
    _launch((_fwd_tile_kernel, _fwd_loop_kernel), lut, (x, out), scale, CAUSAL=bool(is_causal))


def backward(y, dy, dx, lut, scale):
    """dx = scale * y * (dy - sum_row(y * dy))."""
    if y.numel() == 0 or lut.max_blocks == 0:
        return
    _launch((_bwd_tile_kernel, _bwd_loop_kernel), lut, (y, dy, dx), scale)
