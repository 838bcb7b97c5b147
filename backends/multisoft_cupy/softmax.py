"""Row softmax and log_softmax: long rows split over blocks (softmax_split.cu), rows staged in shared memory
(softmax_staged.cu) or held in registers (softmax_rows.cu), as _tuning chooses."""

from __future__ import annotations

import torch

from . import _instances, _tuning
from ._launch import aligned, ctype, device_index, device_info, i32, i64, launch, ptr, shared_memory


def _run(direction: str, tensors: list[torch.Tensor], out: torch.Tensor, log: bool) -> None:
    rows, cols = out.shape
    elem = out.element_size()
    index = device_index(out)
    cc, sm_count = device_info(index)
    vec = cols % (16 // elem) == 0 and aligned(*tensors, out)
    split = _tuning.split_config(direction, rows, cols, elem, cc, sm_count)
    if split is not None:
        chunks = -(-cols // split.chunk)
        partial = torch.empty(rows * chunks * (2 if direction == "fwd" else 1), dtype=torch.float32,
                              device=out.device)
        counters = torch.zeros((rows + 1) * _instances.SPLIT_COUNTER_STRIDE, dtype=torch.int32, device=out.device)
        args = (*(ptr(t) for t in tensors), ptr(out), ptr(partial), ptr(counters), i64(cols), i32(chunks), i32(log),
                i32(vec))
        launch(out, _instances.SOFTMAX_SPLIT_SOURCE, _instances.split_kernel(direction, ctype(out.dtype), split),
               (rows * chunks, 1, 1), (split.threads, 1, 1), args)
        return
    # staging copies whole 16-byte vectors: other rows take the register kernels (element-wise loads)
    staged = _tuning.staged_config(direction, cols, elem, cc, shared_memory(index)) if vec else None
    if staged is not None:
        args = (*(ptr(t) for t in tensors), ptr(out), i64(rows), i64(cols), i64(staged.slice), i32(log))
        grid = _tuning.staged_grid(rows, staged)
        launch(out, _instances.SOFTMAX_STAGED_SOURCE, _instances.staged_kernel(direction, ctype(out.dtype), staged),
               (grid, 1, 1), (staged.threads, 1, 1), args, shared_mem=staged.shared_bytes(direction, elem))
        return
    cfg = _tuning.softmax_config(direction, cols, elem, cc)
    args = (*(ptr(t) for t in tensors), ptr(out), i64(rows), i64(cols), i32(log), i32(vec))
    launch(out, _instances.SOFTMAX_ROWS_SOURCE, _instances.softmax_kernel(direction, ctype(out.dtype), cfg),
           (_tuning.grid_blocks(rows, cfg), 1, 1), (cfg.threads, 1, 1), args)


def forward(x: torch.Tensor, out: torch.Tensor, log: bool) -> None:
    _run("fwd", [x], out, log)


def backward(y: torch.Tensor, dy: torch.Tensor, dx: torch.Tensor, log: bool) -> None:
    _run("bwd", [y, dy], dx, log)
