"""Block-sparse softmax over compressed blocks, using the front's LUT (blocksparse.cu)."""

from __future__ import annotations

import torch

from . import _catalog
from ._module import aligned, ctype, device_index, device_info, f32, i32, i64, launch, ptr

SOURCE = "blocksparse.cu"
# The forward stages rows in shared memory (bs_fwd_staged, several rows a warp for short rows) where the blocks are
# 16-byte aligned and _catalog.blocksparse_staged_config says so; else a warp per row holds a tile in registers
# (bs_fwd); the backward holds its tiles in registers too, with _catalog.blocksparse_backward_lanes lanes a row
# (bs_bwd).
STAGED = True
# Values each thread of the register kernels holds (a row longer than a warp's share is read in tiles, twice): the
# forward keeps one value per element, the backward two. By element size, choices: the first whose tile (a warp's
# share) holds the layout's mean row, else the last; the tile itself is then the smallest that holds the mean row.
# Measured on an H200 with session 14's kernels (tuning/blocksparse-lean-round*.txt): 64 lost in the forward; the
# bf16 backward gains from 40 (a 1280-element tile) where the mean row is just over 1024 (b16 at 25 % 0.80 -> 0.87)
# and from 64 where it is about 2048 (50 % 0.80 -> 0.94). Sizing the tile for the mean rather than the longest row
# took the forward at 11 % from 0.51 to 0.64 (bf16) and 0.84 to 0.89 (float32).
FORWARD_FLOATS = {4: (32,), 2: (32,)}
BACKWARD_FLOATS = {4: (32, 64), 2: (40, 64)}


def _sizes(data: torch.Tensor, lut) -> tuple:
    z, nnz, block, _ = data.shape
    groups = lut.heads * lut.block_rows
    return z * groups * block, (i64(z), i64(nnz), i64(groups)), i32(block.bit_length() - 1)


def _staged_config(x: torch.Tensor, out: torch.Tensor, lut):
    """The staged forward's configuration for this call, or None."""
    if not STAGED or not aligned(x, out):
        return None
    cc, _ = device_info(device_index(x))
    return _catalog.blocksparse_staged_config(lut.mean_blocks * lut.block, lut.max_blocks * lut.block,
                                              x.element_size(), cc, lut.block)


def _row_config(data: torch.Tensor, lut, choices: dict, lanes: int = 32) -> tuple:
    """The register kernel's configuration and grid for `lanes` lanes a row: the values a thread holds and the
    tile chosen for the mean row as a warp's share would hold it."""
    rows, _, _ = _sizes(data, lut)
    share = lut.mean_blocks * lut.block * 32 / lanes
    floats = _catalog.blocksparse_floats(choices[data.element_size()], share)
    cfg = _catalog.blocksparse_config(share, data.element_size(), floats)
    return cfg, (_catalog.grid_blocks(rows * lanes // 32, cfg), 1, 1)


def forward(x, out, lut, scale: float, is_causal: bool) -> None:
    rows, sizes, log2b = _sizes(x, lut)
    staged = _staged_config(x, out, lut)
    if staged is not None:
        args = (ptr(x), ptr(out), ptr(lut.offsets), ptr(lut.causal), *sizes, log2b, f32(scale), i32(is_causal),
                i32(staged.lanes.bit_length() - 1), i32(staged.row_stride))
        launch(x, SOURCE, _catalog.blocksparse_staged_kernel(ctype(x.dtype), staged), (staged.grid(rows), 1, 1),
               (32 * staged.warps, 1, 1), args, shared_mem=staged.shared_bytes)
        return
    cfg, grid = _row_config(x, lut, FORWARD_FLOATS)
    args = (ptr(x), ptr(out), ptr(lut.offsets), ptr(lut.columns), *sizes, i32(lut.block_rows), log2b, f32(scale),
            i32(is_causal), i32(aligned(x, out)))
    launch(x, SOURCE, _catalog.blocksparse_kernel("fwd", ctype(x.dtype), cfg), grid, (cfg.threads, 1, 1), args)


def backward(y, dy, dx, lut, scale: float) -> None:
    _, sizes, log2b = _sizes(y, lut)
    lanes = _catalog.blocksparse_backward_lanes(lut.mean_blocks * lut.block, lut.block, y.element_size())
    cfg, grid = _row_config(y, lut, BACKWARD_FLOATS, lanes)
    args = (ptr(y), ptr(dy), ptr(dx), ptr(lut.offsets), *sizes, i32(lut.block_rows), log2b, f32(scale),
            i32(aligned(y, dy, dx)), i32(lanes.bit_length() - 1))
    launch(y, SOURCE, _catalog.blocksparse_kernel("bwd", ctype(y.dtype), cfg, lanes), grid, (cfg.threads, 1, 1),
           args)
