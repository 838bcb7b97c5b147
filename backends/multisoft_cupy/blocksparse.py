"""Block-sparse softmax over compressed blocks, using the front's LUT (blocksparse.cu).

The forward stages rows in shared memory (bs_fwd_staged, several rows a warp for
short rows) on sm_80+ where the blocks are 16-byte aligned, else a warp per row
holds a tile in registers (bs_fwd); the backward holds its tiles in registers
(bs_bwd), with _tuning.blocksparse_backward_lanes lanes a row.
"""

from __future__ import annotations

import torch

from . import _instances, _tuning
from ._launch import aligned, ctype, device_index, device_info, f32, i32, i64, launch, ptr

SOURCE = _instances.BLOCKSPARSE_SOURCE


def _sizes(data: torch.Tensor, lut) -> tuple:
    z, nnz, block, _ = data.shape
    groups = lut.heads * lut.block_rows
    return z * groups * block, (i64(z), i64(nnz), i64(groups)), i32(block.bit_length() - 1)


def _staged_config(x: torch.Tensor, out: torch.Tensor, lut):
    """The staged forward's configuration for this call; None where the blocks are not 16-byte aligned (cp.async
    copies 16 bytes) or the GPU predates sm_80."""
    if not aligned(x, out):
        return None
    cc, _ = device_info(device_index(x))
    return _tuning.blocksparse_staged_config(lut.mean_blocks * lut.block, lut.max_blocks * lut.block,
                                             x.element_size(), cc, lut.block)


def _row_config(direction: str, data: torch.Tensor, lut, lanes: int = 32) -> tuple:
    """The register kernel's configuration for `lanes` lanes a row, and its grid."""
    rows, _, _ = _sizes(data, lut)
    cfg = _tuning.blocksparse_register_config(direction, lut.mean_blocks * lut.block, data.element_size(), lanes)
    return cfg, (_tuning.grid_blocks(rows * lanes // 32, cfg), 1, 1)


def forward(x, out, lut, scale: float, is_causal: bool) -> None:
    rows, sizes, log2b = _sizes(x, lut)
    staged = _staged_config(x, out, lut)
    if staged is not None:
        args = (ptr(x), ptr(out), ptr(lut.offsets), ptr(lut.causal), *sizes, log2b, f32(scale), i32(is_causal),
                i32(staged.row_stride))
        launch(x, SOURCE, _instances.blocksparse_staged_kernel(ctype(x.dtype), staged), (staged.grid(rows), 1, 1),
               (32 * staged.warps, 1, 1), args, shared_mem=staged.shared_bytes)
        return
    cfg, grid = _row_config("fwd", x, lut)
    args = (ptr(x), ptr(out), ptr(lut.offsets), ptr(lut.columns), *sizes, i32(lut.block_rows), log2b, f32(scale),
            i32(is_causal), i32(aligned(x, out)))
    launch(x, SOURCE, _instances.blocksparse_kernel("fwd", ctype(x.dtype), cfg), grid, (cfg.threads, 1, 1), args)


def backward(y, dy, dx, lut, scale: float) -> None:
    _, sizes, log2b = _sizes(y, lut)
    lanes = _tuning.blocksparse_backward_lanes(lut.mean_blocks * lut.block, lut.block, y.element_size())
    cfg, grid = _row_config("bwd", y, lut, lanes)
    args = (ptr(y), ptr(dy), ptr(dx), ptr(lut.offsets), *sizes, i32(lut.block_rows), log2b, f32(scale),
            i32(aligned(y, dy, dx)), i32(lanes.bit_length() - 1))
    launch(y, SOURCE, _instances.blocksparse_kernel("bwd", ctype(y.dtype), cfg), grid, (cfg.threads, 1, 1), args)
