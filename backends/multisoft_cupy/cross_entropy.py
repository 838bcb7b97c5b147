"""Cross-entropy forward (online logsumexp per row) and elementwise backward, from cross_entropy.cu."""

from __future__ import annotations

from . import _instances, _tuning
from ._launch import aligned, ctype, device_index, device_info, f32, i32, i64, index_ctype, launch, ptr

SOURCE = _instances.CROSS_ENTROPY_SOURCE


def forward(logits, target, weight, loss, lse, row_weight, ignore_index: int, label_smoothing: float) -> None:
    rows, classes = logits.shape
    elem = logits.element_size()
    cc, sm_count = device_info(device_index(logits))
    cfg = _tuning.ce_fwd_config(rows, classes, elem, cc, sm_count)
    vec = classes % (16 // elem) == 0 and aligned(logits)
    args = (ptr(logits), ptr(target), ptr(weight), ptr(loss), ptr(lse), ptr(row_weight), i64(rows), i64(classes),
            i64(ignore_index), f32(label_smoothing), i32(vec))
    expression = _instances.ce_fwd_kernel(ctype(logits.dtype), index_ctype(target.dtype), cfg)
    launch(logits, SOURCE, expression, (_tuning.grid_blocks(rows, cfg), 1, 1), (cfg.threads, 1, 1), args)


def backward(logits, target, weight, weight_sum, lse, grad_loss, grad_logits, ignore_index: int,
             label_smoothing: float) -> None:
    """The rows from the last one, which the forward read most recently (its tiles may still be in L2)."""
    rows, classes = logits.shape
    elem = logits.element_size()
    cfg = _tuning.CE_BWD_CONFIG
    tiles = -(-classes // cfg.capacity(elem))
    vec = classes % (16 // elem) == 0 and aligned(logits, grad_logits)
    args = (ptr(logits), ptr(target), ptr(weight), ptr(weight_sum), ptr(lse), ptr(grad_loss), i64(grad_loss.stride(0)),
            ptr(grad_logits), i64(rows), i64(classes), i64(ignore_index), f32(label_smoothing), i32(vec))
    expression = _instances.ce_bwd_kernel(ctype(logits.dtype), index_ctype(target.dtype), cfg)
    grid = (min(tiles, _tuning.MAX_GRID), min(rows, _tuning.MAX_GRID_Y), 1)
    launch(logits, SOURCE, expression, grid, (cfg.threads, 1, 1), args)
