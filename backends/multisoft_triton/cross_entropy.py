"""Cross-entropy with class-index targets, weights, ignore_index and label smoothing.

forward reads each logit once and keeps O(rows) state (lse, loss): short rows
share a program as one tile, long rows are streamed once with an online
logsumexp. backward is elementwise given lse, so it tiles (rows, columns)
freely and reads and writes each logit once (grad_logits may be the logits).
A target outside [0, C) that is not ignore_index is never loaded; its loss is NaN.
"""
import triton
import triton.language as tl

from . import _tuning
from ._device import fast_exp, online_max, safe_shift
from ._launch import LAUNCH, launch, next_power_of_2, on_device, warps_for


@triton.jit
def _targets(target_ptr, weight_ptr, rows, row_mask, C, ignore_index, HAS_WEIGHT: tl.constexpr):
    """Each row's target, whether it is ignored, whether it is a class in [0, C), and its weight."""
    target = tl.load(target_ptr + rows, mask=row_mask, other=0).to(tl.int64)
    ignored = target == ignore_index
    valid = (target >= 0) & (target < C) & (~ignored)
    if HAS_WEIGHT:
        target_weight = tl.load(weight_ptr + target, mask=row_mask & valid, other=0.0).to(tl.float32)
    else:
        target_weight = tl.where(valid, 1.0, 0.0)
    return target, ignored, valid, target_weight


@triton.jit
def _row_loss(nll, smooth, ignored, valid, target_weight, keep, smooth_per_class, SMOOTH: tl.constexpr):
    loss = keep * target_weight * nll
    if SMOOTH:
        loss += smooth_per_class * smooth
    loss = tl.where(valid, loss, float("nan"))
    return tl.where(ignored, 0.0, loss)


@triton.jit
def _fwd_tile_kernel(logits_ptr, target_ptr, weight_ptr, loss_ptr, lse_ptr, row_weight_ptr, M, C, ignore_index,
                     keep, smooth_per_class, ROWS: tl.constexpr, BLOCK: tl.constexpr,
                     HAS_WEIGHT: tl.constexpr, SMOOTH: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    row_mask = rows < M
    mask = row_mask[:, None] & (cols[None, :] < C)
    x = tl.load(logits_ptr + rows[:, None] * C + cols[None, :], mask=mask, other=-float("inf")).to(tl.float32)
    row_max = tl.max(x, axis=1)
    safe_max = safe_shift(row_max)
    lse = safe_max + tl.log(tl.sum(fast_exp(x - safe_max[:, None]), axis=1))
    target, ignored, valid, target_weight = _targets(target_ptr, weight_ptr, rows, row_mask, C,
                                                     ignore_index, HAS_WEIGHT)
    x_target = tl.load(logits_ptr + rows * C + target, mask=row_mask & valid, other=0.0).to(tl.float32)
    smooth = tl.zeros((ROWS,), tl.float32)
    if SMOOTH:
        if HAS_WEIGHT:
            w = tl.load(weight_ptr + cols, mask=cols < C, other=0.0).to(tl.float32)[None, :]
        else:
            w = 1.0
        smooth = tl.sum(tl.where(mask, w * (lse[:, None] - x), 0.0), axis=1)
    loss = _row_loss(lse - x_target, smooth, ignored, valid, target_weight, keep, smooth_per_class, SMOOTH)
    tl.store(lse_ptr + rows, lse, mask=row_mask)
    tl.store(loss_ptr + rows, loss, mask=row_mask)
    tl.store(row_weight_ptr + rows, target_weight, mask=row_mask)


@triton.jit
def _fwd_loop_kernel(logits_ptr, target_ptr, weight_ptr, loss_ptr, lse_ptr, row_weight_ptr, C, ignore_index,
                     keep, smooth_per_class, BLOCK: tl.constexpr, HAS_WEIGHT: tl.constexpr, SMOOTH: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    row_start = row * C
    cols = tl.arange(0, BLOCK)
    run_max = tl.full((), -float("inf"), tl.float32)
    run_sum = tl.zeros((), tl.float32)
    # label smoothing: shifted_sum = sum(w * (x - ref)) over the columns seen, ref follows the max
    ref = tl.zeros((), tl.float32)
    shifted_sum = tl.zeros((), tl.float32)
    weight_seen = tl.zeros((), tl.float32)
    for start in tl.range(0, C, BLOCK):
        mask = start + cols < C
        x = tl.load(logits_ptr + row_start + start + cols, mask=mask, other=-float("inf")).to(tl.float32)
        run_max, shift, run_sum = online_max(run_max, run_sum, tl.max(x, axis=0))
        run_sum += tl.sum(fast_exp(x - shift), axis=0)
        if SMOOTH:
            if HAS_WEIGHT:
                w = tl.load(weight_ptr + start + cols, mask=mask, other=0.0).to(tl.float32)
            else:
                w = tl.where(mask, 1.0, 0.0)
            shifted_sum += (ref - shift) * weight_seen
            shifted_sum += tl.sum(tl.where(mask, w * (x - shift), 0.0), axis=0)
            weight_seen += tl.sum(w, axis=0)
            ref = shift
    lse = run_max + tl.log(run_sum)
    smooth = weight_seen * (lse - ref) - shifted_sum
    target, ignored, valid, target_weight = _targets(target_ptr, weight_ptr, row, row >= 0, C,
                                                     ignore_index, HAS_WEIGHT)
    x_target = tl.load(logits_ptr + row_start + target, mask=valid, other=0.0).to(tl.float32)
    loss = _row_loss(lse - x_target, smooth, ignored, valid, target_weight, keep, smooth_per_class, SMOOTH)
    tl.store(lse_ptr + row, lse)
    tl.store(loss_ptr + row, loss)
    tl.store(row_weight_ptr + row, target_weight)


@triton.jit
def _bwd_kernel(logits_ptr, target_ptr, weight_ptr, weight_sum_ptr, lse_ptr, grad_loss_ptr, grad_stride, grad_ptr,
                M, C, ignore_index, keep, smooth_per_class, ROWS: tl.constexpr, BLOCK: tl.constexpr,
                HAS_WEIGHT: tl.constexpr, SMOOTH: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    row_mask = rows < M
    col_mask = cols < C
    mask = row_mask[:, None] & col_mask[None, :]
    offsets = rows[:, None] * C + cols[None, :]
    target, ignored, valid, target_weight = _targets(target_ptr, weight_ptr, rows, row_mask, C,
                                                     ignore_index, HAS_WEIGHT)
    lse = tl.load(lse_ptr + rows, mask=row_mask, other=0.0)
    grad_loss = tl.load(grad_loss_ptr + rows * grad_stride, mask=row_mask, other=0.0)
    # grad = p * p_scale - (c == t) * target_scale - w[c] * weight_scale, with per-row scales
    target_scale = tl.where(valid, keep * target_weight * grad_loss, float("nan"))
    p_scale = target_scale
    if SMOOTH:
        if HAS_WEIGHT:
            total_weight = tl.load(weight_sum_ptr)
        else:
            total_weight = C * 1.0
        weight_scale = smooth_per_class * grad_loss
        p_scale += weight_scale * total_weight
    x = tl.load(logits_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    p = fast_exp(x - lse[:, None])
    is_target = cols[None, :] == target[:, None]
    grad = p * p_scale[:, None] - tl.where(is_target, target_scale[:, None], 0.0)
    if SMOOTH:
        if HAS_WEIGHT:
            w = tl.load(weight_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
            grad -= weight_scale[:, None] * w[None, :]
        else:
            grad -= weight_scale[:, None]
    grad = tl.where(ignored[:, None], 0.0, grad)
    tl.store(grad_ptr + offsets, grad.to(grad_ptr.dtype.element_ty), mask=mask)


def _coefficients(label_smoothing, C):
    smoothing = float(label_smoothing)
    return 1.0 - smoothing, smoothing / C, smoothing > 0.0


def forward(logits, target, weight, loss, lse, row_weight, ignore_index, label_smoothing):
    """Per-row loss, logsumexp and weight in a mean of the (M, C) logits."""
    M, C = logits.shape
    if M == 0:
        return
    keep, smooth_per_class, smooth = _coefficients(label_smoothing, C)
    has_weight = weight is not None
    weight_arg = weight if has_weight else lse
    block = next_power_of_2(C)
    with on_device(logits):
        if block <= _tuning.CE_TILE_MAX:
            rows = max(1, min(_tuning.CE_TILE_ELEMENTS // block, next_power_of_2(M)))
            launch(_fwd_tile_kernel, (triton.cdiv(M, rows),), logits, target, weight_arg, loss, lse, row_weight, M, C,
                   int(ignore_index), keep, smooth_per_class, ROWS=rows, BLOCK=block, HAS_WEIGHT=has_weight,
                   SMOOTH=smooth, num_warps=warps_for(rows * block), **LAUNCH)
        else:
            loop_block, warps = _tuning.CE_LOOP_CONFIGS[logits.element_size()]
            launch(_fwd_loop_kernel, (M,), logits, target, weight_arg, loss, lse, row_weight, C, int(ignore_index),
                   keep, smooth_per_class, BLOCK=loop_block, HAS_WEIGHT=has_weight, SMOOTH=smooth, num_warps=warps,
                   **LAUNCH)


def backward(logits, target, weight, weight_sum, lse, grad_loss, grad_logits, ignore_index, label_smoothing):
    """grad_logits (possibly the logits themselves) from lse and the per-row (or broadcast) grad_loss."""
    M, C = logits.shape
    if M == 0:
        return
    keep, smooth_per_class, smooth = _coefficients(label_smoothing, C)
    has_weight = weight is not None
    block = min(next_power_of_2(C), _tuning.CE_BACKWARD_BLOCK)
    rows = max(1, min(_tuning.CE_BACKWARD_BLOCK // block, next_power_of_2(M)))
    grid = (triton.cdiv(M, rows), triton.cdiv(C, block))
    with on_device(logits):
        launch(_bwd_kernel, grid, logits, target, weight if has_weight else lse, weight_sum if has_weight else lse, lse,
               grad_loss, grad_loss.stride(0), grad_logits, M, C, int(ignore_index), keep, smooth_per_class, ROWS=rows,
               BLOCK=block, HAS_WEIGHT=has_weight, SMOOTH=smooth, num_warps=warps_for(rows * block), **LAUNCH)
