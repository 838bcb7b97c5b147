"""Block-sparse softmax over compressed blocks, using the front's LUT (blocksparse.cu)."""

from __future__ import annotations

import torch

from . import _catalog
from ._module import aligned, ctype, f32, i32, i64, launch, ptr

SOURCE = "blocksparse.cu"
# Values each thread holds in registers (a row longer than a warp's share is read in tiles, twice): the forward
# keeps one value per element, the backward two. By element size, choices: the first whose tile (a warp's share)
# holds the layout's mean row, else the last. Measured on an H200 (tuning/blocksparse-floats-round*.txt): 64 lost
# in the forward and in the bf16 backward everywhere; in the float32 backward it gained where rows are mostly
# longer than 32's tile (b128 0.90 -> 0.99, b64 50 % 0.76 -> 0.90) and lost where they are mostly shorter (b64 11 %
# causal 0.96 -> 0.78).
FORWARD_FLOATS = {4: (32,), 2: (32,)}
BACKWARD_FLOATS = {4: (32, 64), 2: (32,)}


def _common(data: torch.Tensor, lut, choices: dict) -> tuple:
    z, nnz, block, _ = data.shape
    groups = lut.heads * lut.block_rows
    rows = z * groups * block
    floats = _catalog.blocksparse_floats(choices[data.element_size()], lut.mean_blocks * block)
    cfg = _catalog.blocksparse_config(lut.max_blocks * block, data.element_size(), floats)
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
