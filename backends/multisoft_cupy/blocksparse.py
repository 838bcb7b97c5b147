"""Block-sparse softmax over compressed blocks, using the front's LUT (blocksparse.cu)."""

from __future__ import annotations

import torch

from . import _catalog
from ._module import aligned, ctype, f32, i32, i64, launch, ptr

SOURCE = "blocksparse.cu"
# Values each thread holds in registers (a row longer than a warp's share is read in tiles, twice): the forward
# keeps one value per element, the backward two. By element size, choices: the first whose tile (a warp's share)
# holds the layout's mean row, else the last; the tile itself is then the smallest that holds the mean row.
# Measured on an H200 with session 14's kernels (tuning/blocksparse-lean-round*.txt): 64 lost in the forward; the
# bf16 backward gains from 40 (a 1280-element tile) where the mean row is just over 1024 (b16 at 25 % 0.80 -> 0.87)
# and from 64 where it is about 2048 (50 % 0.80 -> 0.94). Sizing the tile for the mean rather than the longest row
# took the forward at 11 % from 0.51 to 0.64 (bf16) and 0.84 to 0.89 (float32).
FORWARD_FLOATS = {4: (32,), 2: (32,)}
BACKWARD_FLOATS = {4: (32, 64), 2: (40, 64)}


def _common(data: torch.Tensor, lut, choices: dict) -> tuple:
    z, nnz, block, _ = data.shape
    groups = lut.heads * lut.block_rows
    rows = z * groups * block
    floats = _catalog.blocksparse_floats(choices[data.element_size()], lut.mean_blocks * block)
    cfg = _catalog.blocksparse_config(lut.mean_blocks * block, data.element_size(), floats)
    grid = (_catalog.grid_blocks(rows, cfg), 1, 1)
    sizes = (i64(z), i64(nnz), i64(groups), i32(lut.block_rows), i32(block.bit_length() - 1))
    return cfg, grid, sizes


def forward(x, out, lut, scale: float, is_causal: bool) -> None:
    cfg, grid, sizes = _common(x, lut, FORWARD_FLOATS)
    args = (ptr(x), ptr(out), ptr(lut.offsets), ptr(lut.columns), *sizes, f32(scale), i32(is_causal),
            i32(aligned(x, out)))
    launch(x, SOURCE, _catalog.blocksparse_kernel("fwd", ctype(x.dtype), cfg), grid, (cfg.threads, 1, 1), args)


def backward(y, dy, dx, lut, scale: float) -> None:
    cfg, grid, sizes = _common(y, lut, BACKWARD_FLOATS)
    args = (ptr(y), ptr(dy), ptr(dx), ptr(lut.offsets), *sizes, f32(scale), i32(aligned(y, dy, dx)))
    launch(y, SOURCE, _catalog.blocksparse_kernel("bwd", ctype(y.dtype), cfg), grid, (cfg.threads, 1, 1), args)
