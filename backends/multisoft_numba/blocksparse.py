"""Block-sparse softmax over the compressed blocks (Z, nnz, B, B), forward and backward.

A softmax row is row i of block-row g = h*Mb + r in batch z: column j of blocks
offsets[g] .. offsets[g + 1], walked twice (statistics, then output). One thread
block per row on the GPU (grid x over (g, i), y over z); under the simulator one
per block-row, looping over its B rows (each simulated block costs a lot).
The data is viewed as (Z * nnz * B, B) rows.
"""

import numpy
from numba import cuda, float32

from ._device import NEG_INF, block_online_merge, block_sum, expf, kahan_add, load, online_add, store
from ._glue import MAX_THREADS, SIMULATOR, is_bf16, kernel, launch, threads_for

MAX_GRID_Y = 65535


@kernel
def _forward(x, out, offsets, columns, batch, nnz, block_rows, shift, rows_per_block, scale, is_causal, bf16):
    tid = cuda.threadIdx.x
    threads = cuda.blockDim.x
    width = 1 << shift
    slices = width // rows_per_block
    group = cuda.blockIdx.x // slices
    first_row = (cuda.blockIdx.x % slices) * rows_per_block
    first = offsets[group]
    length = (offsets[group + 1] - first) << shift
    buf_m = cuda.shared.array(MAX_THREADS, float32)
    buf_s = cuda.shared.array(MAX_THREADS, float32)
    for z in range(cuda.blockIdx.y, batch, cuda.gridDim.y):
        base = z * nnz + first
        for i in range(first_row, first_row + rows_per_block):
            absolute_row = (group % block_rows) * width + i
            m = NEG_INF
            s = float32(0.0)
            for e in range(tid, length, threads):
                block = e >> shift
                j = e & (width - 1)
                v = scale * load(x, (base + block) * width + i, j, bf16)
                if is_causal and columns[first + block] * width + j > absolute_row:
                    v = NEG_INF
                m, s = online_add(m, s, v)
            m, s = block_online_merge(buf_m, buf_s, m, s)
            inv_s = float32(1.0) / s
            for e in range(tid, length, threads):
                block = e >> shift
                j = e & (width - 1)
                row = (base + block) * width + i
                value = float32(0.0)
                if m != NEG_INF and not (is_causal and columns[first + block] * width + j > absolute_row):
                    value = expf(scale * load(x, row, j, bf16) - m) * inv_s
                store(out, row, j, value, bf16)


@kernel
def _backward(y, dy, dx, offsets, batch, nnz, shift, rows_per_block, scale, bf16):
    tid = cuda.threadIdx.x
    threads = cuda.blockDim.x
    width = 1 << shift
    slices = width // rows_per_block
    group = cuda.blockIdx.x // slices
    first_row = (cuda.blockIdx.x % slices) * rows_per_block
    first = offsets[group]
    length = (offsets[group + 1] - first) << shift
    buf = cuda.shared.array(MAX_THREADS, float32)
    for z in range(cuda.blockIdx.y, batch, cuda.gridDim.y):
        base = z * nnz + first
        for i in range(first_row, first_row + rows_per_block):
            acc = float32(0.0)
            lost = float32(0.0)
            for e in range(tid, length, threads):
                row = (base + (e >> shift)) * width + i
                j = e & (width - 1)
                acc, lost = kahan_add(acc, lost, load(y, row, j, bf16) * load(dy, row, j, bf16))
            acc = block_sum(buf, acc - lost)
            for e in range(tid, length, threads):
                row = (base + (e >> shift)) * width + i
                j = e & (width - 1)
                store(dx, row, j, scale * load(y, row, j, bf16) * (load(dy, row, j, bf16) - acc), bf16)


def _geometry(x, lut):
    """(batch, rows per thread block, threads, grid)."""
    batch = x.shape[0]
    rows_per_block = lut.block if SIMULATOR else 1
    threads = threads_for(max(lut.max_blocks, 1) * lut.block, 32 if SIMULATOR else 4)
    grid = (lut.heads * lut.block_rows * (lut.block // rows_per_block), min(max(batch, 1), MAX_GRID_Y))
    return batch, rows_per_block, threads, grid


def _rows(t, lut):
    return t.view(-1, lut.block)


def forward(x, out, lut, scale: float, is_causal: bool) -> None:
    if x.numel() == 0:
        return
    batch, rows_per_block, threads, grid = _geometry(x, lut)
    shift = lut.block.bit_length() - 1
    launch(_forward, grid, threads,
           (_rows(x, lut), _rows(out, lut), lut.offsets, lut.columns, numpy.int64(batch), numpy.int64(lut.nnz),
            numpy.int64(lut.block_rows), numpy.int64(shift), numpy.int64(rows_per_block), numpy.float32(scale),
            bool(is_causal), is_bf16(x)))


def backward(y, dy, dx, lut, scale: float) -> None:
    if y.numel() == 0:
        return
    batch, rows_per_block, threads, grid = _geometry(y, lut)
    shift = lut.block.bit_length() - 1
    launch(_backward, grid, threads,
           (_rows(y, lut), _rows(dy, lut), _rows(dx, lut), lut.offsets, numpy.int64(batch), numpy.int64(lut.nnz),
            numpy.int64(shift), numpy.int64(rows_per_block), numpy.float32(scale), is_bf16(y)))
