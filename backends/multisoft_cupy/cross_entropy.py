"""Cross-entropy in one pass (loss, lse, row weight and, when wanted, the scaled gradient, and each row's
statistics), the same for class-probability targets, the backward's scaling of that gradient, and the gradient of a
slice of the classes from the whole row's statistics (vocabulary-parallel), from cross_entropy.cu."""

from __future__ import annotations

from . import _instances, _tuning
from ._launch import aligned, ctype, device_index, device_info, f32, i32, i64, index_ctype, launch, ptr

SOURCE = _instances.CROSS_ENTROPY_SOURCE
_FLOAT32_MAX = 3.4028234663852886e38


def _kernel_softcap(softcap: float) -> float:
    """The softcap as the kernels take it: 0 for none, and 0 too for a cap beyond float32's range (so large that
    softcap * tanh(x / softcap) rounds to x for every float32 x)."""
    return softcap if softcap <= _FLOAT32_MAX else 0.0


def forward(logits, target, weight, loss, lse, row_weight, grad_logits, grad_scale, options, row_stats=None) -> None:
    """A row group (warp, block or cluster) per row reads it once, and with `grad_logits` writes
    grad_scale[i] * dloss_i / dlogits (from registers, or re-reading the row's other tiles); with `row_stats`
    (3, M) each row's m, S and sum_c w[c] * u[c] (0 without label smoothing)."""
    ignore_index, label_smoothing = options.ignore_index, options.label_smoothing
    softcap, lse_square_scale = options.softcap, options.lse_square_scale
    rows, classes = logits.shape
    elem = logits.element_size()
    cc, sm_count = device_info(device_index(logits))
    cfg = _tuning.ce_fwd_config(rows, classes, elem, cc, sm_count)
    grad = grad_logits is not None
    softcap = _kernel_softcap(softcap)
    vec = classes % (16 // elem) == 0 and aligned(logits) and (not grad or aligned(grad_logits))
    scale_stride = grad_scale.stride(0) if grad else 0
    args = (ptr(logits), ptr(target), ptr(weight), ptr(loss), ptr(lse), ptr(row_weight), ptr(grad_logits),
            ptr(grad_scale if grad else None), i64(scale_stride), ptr(row_stats), i64(rows), i64(classes),
            i64(ignore_index), f32(label_smoothing), f32(softcap), f32(lse_square_scale), i32(vec))
    expression = _instances.ce_fwd_kernel(ctype(logits.dtype), index_ctype(target.dtype), grad, softcap != 0, cfg)
    launch(logits, SOURCE, expression, (_tuning.grid_blocks(rows, cfg), 1, 1), (cfg.threads, 1, 1), args)


def probabilities_forward(logits, target, weight, loss, lse, grad_logits, grad_scale, options) -> None:
    """Class-probability targets (M, C): a row group per row, as `forward` maps them, sweeps the row once for its
    loss and lse and, with `grad_logits`, a second time (the targets, and the logits but for the tile still in
    registers) for grad_scale[i] * dloss_i / dlogits."""
    label_smoothing = options.label_smoothing
    softcap, lse_square_scale = options.softcap, options.lse_square_scale
    rows, classes = logits.shape
    elem = logits.element_size()
    cc, sm_count = device_info(device_index(logits))
    cfg = _tuning.ce_fwd_config(rows, classes, elem, cc, sm_count)
    grad = grad_logits is not None
    softcap = _kernel_softcap(softcap)
    vec = classes % (16 // elem) == 0 and aligned(logits, target) and (not grad or aligned(grad_logits))
    scale_stride = grad_scale.stride(0) if grad else 0
    args = (ptr(logits), ptr(target), ptr(weight), ptr(loss), ptr(lse), ptr(grad_logits),
            ptr(grad_scale if grad else None), i64(scale_stride), i64(rows), i64(classes), f32(label_smoothing),
            f32(softcap), f32(lse_square_scale), i32(vec))
    expression = _instances.ce_probs_fwd_kernel(ctype(logits.dtype), grad, softcap != 0, cfg)
    launch(logits, SOURCE, expression, (_tuning.grid_blocks(rows, cfg), 1, 1), (cfg.threads, 1, 1), args)


def gradient(logits, target, weight, row_max_sum, coefficients, grad_logits, options) -> None:
    """grad_logits[i, c] = du/dx * (a_i * exp(u_c - m_i) / S_i - b_i * [c == t_i] - c_i * w[c]) with the whole
    row's (m, S) = row_max_sum[:, i] and (a, b, c) = coefficients[:, i]: a block per tile of a row and per row;
    grad_logits may be logits itself."""
    softcap = options.softcap
    rows, classes = logits.shape
    if rows == 0 or classes == 0:
        return
    elem = logits.element_size()
    cfg = _tuning.CE_GRADIENT_CONFIG
    grid = _tuning.ce_gradient_grid(rows, classes, elem)
    softcap = _kernel_softcap(softcap)
    vec = classes % (16 // elem) == 0 and aligned(logits, grad_logits)
    args = (ptr(logits), ptr(target), ptr(weight), ptr(row_max_sum), ptr(coefficients), ptr(grad_logits), i64(rows),
            i64(classes), f32(softcap), i32(vec))
    expression = _instances.ce_gradient_kernel(ctype(logits.dtype), index_ctype(target.dtype), softcap != 0, cfg)
    launch(logits, SOURCE, expression, grid, (cfg.threads, 1, 1), args)


def scale(grad_logits, factor) -> None:
    """grad_logits *= factor: one factor (shape (1,), read on the device; 1 returns at once) or one a row."""
    rows, classes = grad_logits.shape
    elem = grad_logits.element_size()
    cfg = _tuning.CE_SCALE_CONFIG
    _, sm_count = device_info(device_index(grad_logits))
    grid = _tuning.ce_scale_grid(rows, classes, elem, sm_count)
    vec = classes % (16 // elem) == 0 and aligned(grad_logits)
    factor_stride = 0 if factor.numel() == 1 else factor.stride(0)
    args = (ptr(grad_logits), ptr(factor), i64(factor_stride), i64(rows), i64(classes), i32(vec))
    expression = _instances.ce_scale_kernel(ctype(grad_logits.dtype), cfg)
    launch(grad_logits, SOURCE, expression, grid, (cfg.threads, 1, 1), args)
