"""Cross-entropy with class-index targets: weights, ignore_index, label smoothing, a softcap and a z-loss.

`forward` reads each row, writes its loss, logsumexp and weight and, when a gradient buffer is given, writes
grad_scale[i] * dloss_i / dlogits in the same kernel: the logits are read once and the gradient written once, so
the backward only scales that buffer (`scale`). Short rows share a program as one tile held in registers; a long
row is streamed by one program, twice when the gradient is wanted (statistics, then gradient, the second sweep
from the row's end, whose chunks the first read last and L2 most likely still holds). A row is never split across
programs: in place (grad_logits is logits) each program reads every element of its rows before writing any.
A target outside [0, C) that is not ignore_index is never loaded; its loss and gradient row are NaN.

With a `row_stats` buffer the forward also writes each row's max m and sum S of exp(u - m) and sum_j w_j u_j (a
separate specialisation, WRITE_STATS): the statistics of a slice of the classes, which the front combines across
ranks for vocabulary-parallel cross-entropy. `gradient` then writes that slice's gradient from the whole row's
statistics, one elementwise sweep cut into tiles of rows x columns: it has no reduction, so a row of any length is
shared among as many programs as it has tiles.

`probabilities_forward` is the forward for class-probability targets, (M, C) like the logits: the same tile / loop
split, each pass reading a row's targets beside its logits, its loss sum_j w_j q_j ((m - u_j) + log S) kept
relative to the (running) max so that no lse rounded to float32 enters it.
"""
import triton
import triton.language as tl

from . import _tuning, simulated
from ._device import fast_exp, online_max, safe_shift
from ._launch import LAUNCH, launch, next_power_of_2, on_device, warps_for

_FLOAT32_MAX = 3.4028234663852886e38

if simulated():   # the interpreter has no libdevice: tanh in float64, exact for float32 results
    @triton.jit
    def _tanh(y):
        wide = y.to(tl.float64)
        decay = tl.exp(-2.0 * tl.abs(wide))
        magnitude = (1.0 - decay) / (1.0 + decay)
        signed = tl.where(wide < 0.0, -magnitude, magnitude)
        # below 1e-4 tanh(y) = y to float64 precision, where 1 - decay would cancel
        return tl.where(tl.abs(wide) < 1e-4, wide, signed).to(tl.float32)
else:
    from triton.language.extra import libdevice

    @triton.jit
    def _tanh(y):
        return libdevice.tanh(y)


@triton.jit
def _capped(x, softcap, inv_softcap, SOFTCAP: tl.constexpr):
    """(u, du/dx) of float32 logits x: u = softcap * tanh(x / softcap), or x itself (du/dx 1) without a cap."""
    if SOFTCAP:
        t = _tanh(x * inv_softcap)
        u = softcap * t
        du = 1.0 - t * t
    else:
        u = x
        du = 1.0
    return u, du


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
def _row_loss(shift, log_sum, u_target, smooth, ignored, valid, target_weight, keep, smooth_per_class,
              lse_square_scale, SMOOTH: tl.constexpr, ZLOSS: tl.constexpr):
    """keep * w[t] * (lse - u_t) + eps / C * smooth + s * lse**2 with lse = shift + log_sum, lse - u_t as
    (shift - u_t) + log_sum: exact where lse rounded to float32 would not be; NaN for an invalid target, 0 for an
    ignored row. smooth is sum_j w_j * (lse - u_j)."""
    lse = shift + log_sum
    loss = keep * target_weight * ((shift - u_target) + log_sum)
    if SMOOTH:
        loss += smooth_per_class * smooth
    if ZLOSS:
        loss += lse_square_scale * lse * lse
    loss = tl.where(valid, loss, float("nan"))
    return tl.where(ignored, 0.0, loss)


@triton.jit
def _gradient_scales(lse, total, target_weight, valid, grad_scale, weight_sum, keep, smooth_per_class,
                     lse_square_scale, SMOOTH: tl.constexpr, ZLOSS: tl.constexpr):
    """Per-row factors of grad = exp(u - m) * p_factor - [j == t] * target_factor - w_j * weight_factor
    (times du/dx), each already times the row's grad_scale; p_factor includes the 1 / S of p = exp(u - m) / S.
    An invalid target makes them NaN."""
    target_factor = tl.where(valid, keep * target_weight * grad_scale, float("nan"))
    p_scale = target_factor
    weight_factor = smooth_per_class * grad_scale
    if SMOOTH:
        p_scale += weight_factor * weight_sum
    if ZLOSS:
        p_scale += 2.0 * lse_square_scale * lse * grad_scale
    return p_scale / total, target_factor, weight_factor


@triton.jit
def _logsumexp(shift, lse):
    """The lse to store: shift + log S, or the shift where it is +inf, torch's logsumexp of a row holding +inf (whose
    S is NaN, from exp(inf - inf)); the loss and gradient of such a row stay NaN, as torch's are. tl.max passes a NaN
    over: a row holding both +inf and NaN gets +inf, where torch's logsumexp is NaN."""
    return tl.where(shift == float("inf"), shift, lse)


@triton.jit
def _store_row_stats(stats_ptr, stats_stride, rows, mask, row_max, total, weighted_sum):
    """row_stats[:, rows] = (m, S, sum_j w_j u_j). m is the max as found (-inf for a row of -inf, whose S is 0); a
    NaN among the logits, which makes S NaN but which the max may pass over, makes it NaN as torch's max is (an S
    that is NaN from a +inf logit keeps m = +inf)."""
    row_max = tl.where((total != total) & (row_max != float("inf")), float("nan"), row_max)
    tl.store(stats_ptr + rows, row_max, mask=mask)
    tl.store(stats_ptr + stats_stride + rows, total, mask=mask)
    tl.store(stats_ptr + 2 * stats_stride + rows, weighted_sum, mask=mask)


@triton.jit
def _tile_kernel(logits_ptr, target_ptr, weight_ptr, loss_ptr, lse_ptr, row_weight_ptr, grad_ptr, grad_scale_ptr,
                 grad_scale_stride, stats_ptr, stats_stride, M, C, ignore_index, keep, smooth_per_class, softcap,
                 inv_softcap, lse_square_scale, ROWS: tl.constexpr, BLOCK: tl.constexpr, HAS_WEIGHT: tl.constexpr,
                 SMOOTH: tl.constexpr, SOFTCAP: tl.constexpr, ZLOSS: tl.constexpr, WRITE_GRAD: tl.constexpr,
                 WRITE_STATS: tl.constexpr):
    """ROWS whole rows of BLOCK (>= C) columns a program, held in registers from the one read to the gradient."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    row_mask = rows < M
    col_mask = cols < C
    mask = row_mask[:, None] & col_mask[None, :]
    offsets = rows[:, None] * C + cols[None, :]
    x = tl.load(logits_ptr + offsets, mask=mask, other=-float("inf")).to(tl.float32)
    target, ignored, valid, target_weight = _targets(target_ptr, weight_ptr, rows, row_mask, C,
                                                     ignore_index, HAS_WEIGHT)
    x_target = tl.load(logits_ptr + rows * C + target, mask=row_mask & valid, other=0.0).to(tl.float32)
    u, du = _capped(x, softcap, inv_softcap, SOFTCAP)
    if SOFTCAP:
        u = tl.where(mask, u, -float("inf"))
    u_target, _ = _capped(x_target, softcap, inv_softcap, SOFTCAP)
    row_max = tl.max(u, axis=1)
    shift = safe_shift(row_max)
    e = fast_exp(u - shift[:, None])
    total = tl.sum(e, axis=1)
    log_sum = tl.log(total)
    lse = shift + log_sum
    smooth = tl.zeros((ROWS,), tl.float32)
    weight_sum = C * 1.0
    w = 1.0
    if SMOOTH:
        if HAS_WEIGHT:
            w_cols = tl.load(weight_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
            weight_sum = tl.sum(w_cols, axis=0)
            w = w_cols[None, :]
        smooth = tl.sum(tl.where(mask, w * ((shift[:, None] - u) + log_sum[:, None]), 0.0), axis=1)
    loss = _row_loss(shift, log_sum, u_target, smooth, ignored, valid, target_weight, keep, smooth_per_class,
                     lse_square_scale, SMOOTH, ZLOSS)
    tl.store(lse_ptr + rows, _logsumexp(shift, lse), mask=row_mask)
    tl.store(loss_ptr + rows, loss, mask=row_mask)
    tl.store(row_weight_ptr + rows, target_weight, mask=row_mask)
    if WRITE_STATS:
        weighted_sum = tl.zeros((ROWS,), tl.float32)
        if SMOOTH:
            weighted_sum = tl.sum(tl.where(mask, w * u, 0.0), axis=1)
        _store_row_stats(stats_ptr, stats_stride, rows, row_mask, row_max, total, weighted_sum)
    if WRITE_GRAD:
        grad_scale = tl.load(grad_scale_ptr + rows * grad_scale_stride, mask=row_mask, other=0.0)
        p_factor, target_factor, weight_factor = _gradient_scales(
            lse, total, target_weight, valid, grad_scale, weight_sum, keep, smooth_per_class, lse_square_scale,
            SMOOTH, ZLOSS)
        grad = e * p_factor[:, None] - tl.where(cols[None, :] == target[:, None], target_factor[:, None], 0.0)
        if SMOOTH:
            grad -= weight_factor[:, None] * w
        grad = tl.where(ignored[:, None], 0.0, grad * du)
        # in place, the target logits above were read by other threads than those that write them: all reads first
        tl.debug_barrier()
        tl.store(grad_ptr + offsets, grad.to(grad_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _loop_kernel(logits_ptr, target_ptr, weight_ptr, loss_ptr, lse_ptr, row_weight_ptr, grad_ptr, grad_scale_ptr,
                 grad_scale_stride, stats_ptr, stats_stride, C, ignore_index, keep, smooth_per_class, softcap,
                 inv_softcap, lse_square_scale, BLOCK: tl.constexpr, HAS_WEIGHT: tl.constexpr, SMOOTH: tl.constexpr,
                 SOFTCAP: tl.constexpr, ZLOSS: tl.constexpr, WRITE_GRAD: tl.constexpr, WRITE_STATS: tl.constexpr):
    """One row a program, streamed in chunks of BLOCK with an online logsumexp; with WRITE_GRAD streamed again,
    last chunk first, to write the gradient."""
    row = tl.program_id(0).to(tl.int64)
    row_start = row * C
    cols = tl.arange(0, BLOCK)
    run_max = tl.full((), -float("inf"), tl.float32)
    run_sum = tl.zeros((), tl.float32)
    # label smoothing: shifted_sum = sum(w * (u - ref)) over the columns seen, ref follows the max
    ref = tl.zeros((), tl.float32)
    shifted_sum = tl.zeros((), tl.float32)
    weight_seen = tl.zeros((), tl.float32)
    for start in tl.range(0, C, BLOCK):
        mask = start + cols < C
        x = tl.load(logits_ptr + row_start + start + cols, mask=mask, other=-float("inf")).to(tl.float32)
        u, _ = _capped(x, softcap, inv_softcap, SOFTCAP)
        if SOFTCAP:
            u = tl.where(mask, u, -float("inf"))
        run_max, shift, run_sum = online_max(run_max, run_sum, tl.max(u, axis=0))
        run_sum += tl.sum(fast_exp(u - shift), axis=0)
        if SMOOTH:
            if HAS_WEIGHT:
                w = tl.load(weight_ptr + start + cols, mask=mask, other=0.0).to(tl.float32)
            else:
                w = tl.where(mask, 1.0, 0.0)
            shifted_sum += (ref - shift) * weight_seen
            shifted_sum += tl.sum(tl.where(mask, w * (u - shift), 0.0), axis=0)
            weight_seen += tl.sum(w, axis=0)
            ref = shift
    row_max = tl.where(run_max == -float("inf"), 0.0, run_max)   # the shift run_sum is relative to
    log_sum = tl.log(run_sum)
    lse = row_max + log_sum
    smooth = weight_seen * ((row_max - ref) + log_sum) - shifted_sum
    target, ignored, valid, target_weight = _targets(target_ptr, weight_ptr, row, row >= 0, C,
                                                     ignore_index, HAS_WEIGHT)
    x_target = tl.load(logits_ptr + row_start + target, mask=valid, other=0.0).to(tl.float32)
    u_target, _ = _capped(x_target, softcap, inv_softcap, SOFTCAP)
    loss = _row_loss(row_max, log_sum, u_target, smooth, ignored, valid, target_weight, keep, smooth_per_class,
                     lse_square_scale, SMOOTH, ZLOSS)
    tl.store(lse_ptr + row, _logsumexp(row_max, lse))
    tl.store(loss_ptr + row, loss)
    tl.store(row_weight_ptr + row, target_weight)
    if WRITE_STATS:
        weighted_sum = tl.zeros((), tl.float32)
        if SMOOTH:
            weighted_sum = shifted_sum + ref * weight_seen   # ref is the final shift, row_max
        _store_row_stats(stats_ptr, stats_stride, row, row >= 0, run_max, run_sum, weighted_sum)
    if WRITE_GRAD:
        weight_sum = C * 1.0
        if HAS_WEIGHT:
            weight_sum = weight_seen
        grad_scale = tl.load(grad_scale_ptr + row * grad_scale_stride)
        p_factor, target_factor, weight_factor = _gradient_scales(
            lse, run_sum, target_weight, valid, grad_scale, weight_sum, keep, smooth_per_class, lse_square_scale,
            SMOOTH, ZLOSS)
        # in place, the target logit above was read by one thread and may be written by another: all reads first
        tl.debug_barrier()
        chunks = tl.cdiv(C, BLOCK)
        read = tl.where(ignored, 0, C)   # an ignored row's gradient is 0: written without reading the row
        for chunk in tl.range(0, chunks):
            start = (chunks - 1 - chunk) * BLOCK
            offsets = start + cols
            mask = offsets < C
            x = tl.load(logits_ptr + row_start + offsets, mask=offsets < read, other=0.0).to(tl.float32)
            u, du = _capped(x, softcap, inv_softcap, SOFTCAP)
            grad = fast_exp(u - row_max) * p_factor - tl.where(offsets == target, target_factor, 0.0)
            if SMOOTH:
                if HAS_WEIGHT:
                    grad -= weight_factor * tl.load(weight_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
                else:
                    grad -= weight_factor
            grad = tl.where(ignored, 0.0, grad * du)
            tl.store(grad_ptr + row_start + offsets, grad.to(grad_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _scale_kernel(grad_ptr, factor_ptr, M, C, ROWS: tl.constexpr, BLOCK: tl.constexpr, PER_ROW: tl.constexpr):
    """grad[rows, cols] *= factor[row] (PER_ROW) or factor[0]; one factor of exactly 1 leaves grad untouched."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    row_mask = rows < M
    mask = row_mask[:, None] & (cols[None, :] < C)
    offsets = rows[:, None] * C + cols[None, :]
    if PER_ROW:
        factor = tl.load(factor_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)[:, None]
        grad = tl.load(grad_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        tl.store(grad_ptr + offsets, (grad * factor).to(grad_ptr.dtype.element_ty), mask=mask)
    else:
        factor = tl.load(factor_ptr).to(tl.float32)
        if factor != 1.0:
            grad = tl.load(grad_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
            tl.store(grad_ptr + offsets, (grad * factor).to(grad_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gradient_kernel(logits_ptr, target_ptr, weight_ptr, row_max_sum_ptr, coefficients_ptr, grad_ptr, M, C, softcap,
                     inv_softcap, ROWS: tl.constexpr, BLOCK: tl.constexpr, HAS_WEIGHT: tl.constexpr,
                     SOFTCAP: tl.constexpr):
    """grad = du/dx * (a * exp(u - m) / S - b * [j == t] - c * w_j) over a tile of ROWS rows x BLOCK columns, each
    element read, then written by the same thread (in place allowed). A target outside this tile's columns never
    matches one of them; it is compared, never used as an index."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    row_mask = rows < M
    col_mask = cols < C
    mask = row_mask[:, None] & col_mask[None, :]
    offsets = rows[:, None] * C + cols[None, :]
    x = tl.load(logits_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    target = tl.load(target_ptr + rows, mask=row_mask, other=-1).to(tl.int64)
    row_max = tl.load(row_max_sum_ptr + rows, mask=row_mask, other=0.0)
    total = tl.load(row_max_sum_ptr + M + rows, mask=row_mask, other=1.0)
    p_factor = tl.load(coefficients_ptr + rows, mask=row_mask, other=0.0) / total
    target_factor = tl.load(coefficients_ptr + M + rows, mask=row_mask, other=0.0)
    weight_factor = tl.load(coefficients_ptr + 2 * M + rows, mask=row_mask, other=0.0)
    u, du = _capped(x, softcap, inv_softcap, SOFTCAP)
    grad = fast_exp(u - row_max[:, None]) * p_factor[:, None]
    grad -= tl.where(cols[None, :] == target[:, None], target_factor[:, None], 0.0)
    if HAS_WEIGHT:
        w = tl.load(weight_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
        grad -= weight_factor[:, None] * w[None, :]
    else:
        grad -= weight_factor[:, None]
    tl.store(grad_ptr + offsets, (grad * du).to(grad_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _weighted_probabilities(target, weight_ptr, cols, col_mask, mask, keep, smooth_per_class,
                            HAS_WEIGHT: tl.constexpr, SMOOTH: tl.constexpr):
    """w_j * q_j of float32 targets, q_j = (1 - eps) * target_j + eps / C; 0 outside the row (where mask is
    False). cols and col_mask index the weight and broadcast against target."""
    q = target
    if SMOOTH:
        q = keep * target + smooth_per_class
    if HAS_WEIGHT:
        q = q * tl.load(weight_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    return tl.where(mask, q, 0.0)


@triton.jit
def _probabilities_tile_kernel(logits_ptr, target_ptr, weight_ptr, loss_ptr, lse_ptr, grad_ptr, grad_scale_ptr,
                               grad_scale_stride, M, C, keep, smooth_per_class, softcap, inv_softcap,
                               lse_square_scale, ROWS: tl.constexpr, BLOCK: tl.constexpr, HAS_WEIGHT: tl.constexpr,
                               SMOOTH: tl.constexpr, SOFTCAP: tl.constexpr, ZLOSS: tl.constexpr,
                               WRITE_GRAD: tl.constexpr):
    """ROWS whole rows of BLOCK (>= C) columns a program, logits and targets held in registers from their one read
    to the gradient."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    row_mask = rows < M
    col_mask = cols < C
    mask = row_mask[:, None] & col_mask[None, :]
    offsets = rows[:, None] * C + cols[None, :]
    x = tl.load(logits_ptr + offsets, mask=mask, other=-float("inf")).to(tl.float32)
    target = tl.load(target_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    u, du = _capped(x, softcap, inv_softcap, SOFTCAP)
    if SOFTCAP:
        u = tl.where(mask, u, -float("inf"))
    shift = safe_shift(tl.max(u, axis=1))
    e = fast_exp(u - shift[:, None])
    total = tl.sum(e, axis=1)
    log_sum = tl.log(total)
    lse = shift + log_sum
    wq = _weighted_probabilities(target, weight_ptr, cols[None, :], col_mask[None, :], mask, keep,
                                 smooth_per_class, HAS_WEIGHT, SMOOTH)
    # outside the row wq is 0 and u -inf: 0 * inf there is no NaN of the row's
    loss = tl.sum(tl.where(mask, wq * ((shift[:, None] - u) + log_sum[:, None]), 0.0), axis=1)
    if ZLOSS:
        loss += lse_square_scale * lse * lse
    tl.store(lse_ptr + rows, _logsumexp(shift, lse), mask=row_mask)
    tl.store(loss_ptr + rows, loss, mask=row_mask)
    if WRITE_GRAD:
        grad_scale = tl.load(grad_scale_ptr + rows * grad_scale_stride, mask=row_mask, other=0.0)
        p_scale = tl.sum(wq, axis=1)
        if ZLOSS:
            p_scale += 2.0 * lse_square_scale * lse
        p_factor = p_scale * grad_scale / total
        grad = (e * p_factor[:, None] - wq * grad_scale[:, None]) * du
        tl.store(grad_ptr + offsets, grad.to(grad_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _probabilities_loop_kernel(logits_ptr, target_ptr, weight_ptr, loss_ptr, lse_ptr, grad_ptr, grad_scale_ptr,
                               grad_scale_stride, C, keep, smooth_per_class, softcap, inv_softcap, lse_square_scale,
                               BLOCK: tl.constexpr, HAS_WEIGHT: tl.constexpr, SMOOTH: tl.constexpr,
                               SOFTCAP: tl.constexpr, ZLOSS: tl.constexpr, WRITE_GRAD: tl.constexpr):
    """One row a program, logits and targets streamed in chunks of BLOCK with an online logsumexp; with WRITE_GRAD
    streamed again, last chunk first, to write the gradient."""
    row = tl.program_id(0).to(tl.int64)
    row_start = row * C
    cols = tl.arange(0, BLOCK)
    run_max = tl.full((), -float("inf"), tl.float32)
    run_sum = tl.zeros((), tl.float32)
    # shifted_sum = sum(w q (shift - u)) over the columns seen, relative to the latest shift; wq_sum = sum(w q)
    shift = tl.zeros((), tl.float32)
    shifted_sum = tl.zeros((), tl.float32)
    wq_sum = tl.zeros((), tl.float32)
    for start in tl.range(0, C, BLOCK):
        mask = start + cols < C
        x = tl.load(logits_ptr + row_start + start + cols, mask=mask, other=-float("inf")).to(tl.float32)
        target = tl.load(target_ptr + row_start + start + cols, mask=mask, other=0.0).to(tl.float32)
        u, _ = _capped(x, softcap, inv_softcap, SOFTCAP)
        if SOFTCAP:
            u = tl.where(mask, u, -float("inf"))
        previous_shift = shift
        run_max, shift, run_sum = online_max(run_max, run_sum, tl.max(u, axis=0))
        run_sum += tl.sum(fast_exp(u - shift), axis=0)
        wq = _weighted_probabilities(target, weight_ptr, start + cols, mask, mask, keep, smooth_per_class,
                                     HAS_WEIGHT, SMOOTH)
        shifted_sum += wq_sum * (shift - previous_shift)
        shifted_sum += tl.sum(tl.where(mask, wq * (shift - u), 0.0), axis=0)
        wq_sum += tl.sum(wq, axis=0)
    log_sum = tl.log(run_sum)
    lse = shift + log_sum
    loss = shifted_sum + wq_sum * log_sum
    if ZLOSS:
        loss += lse_square_scale * lse * lse
    tl.store(lse_ptr + row, _logsumexp(shift, lse))
    tl.store(loss_ptr + row, loss)
    if WRITE_GRAD:
        grad_scale = tl.load(grad_scale_ptr + row * grad_scale_stride)
        p_scale = wq_sum
        if ZLOSS:
            p_scale += 2.0 * lse_square_scale * lse
        p_factor = p_scale * grad_scale / run_sum
        chunks = tl.cdiv(C, BLOCK)
        for chunk in tl.range(0, chunks):
            start = (chunks - 1 - chunk) * BLOCK
            offsets = start + cols
            mask = offsets < C
            x = tl.load(logits_ptr + row_start + offsets, mask=mask, other=0.0).to(tl.float32)
            target = tl.load(target_ptr + row_start + offsets, mask=mask, other=0.0).to(tl.float32)
            u, du = _capped(x, softcap, inv_softcap, SOFTCAP)
            wq = _weighted_probabilities(target, weight_ptr, offsets, mask, mask, keep, smooth_per_class,
                                         HAS_WEIGHT, SMOOTH)
            grad = (fast_exp(u - shift) * p_factor - wq * grad_scale) * du
            tl.store(grad_ptr + row_start + offsets, grad.to(grad_ptr.dtype.element_ty), mask=mask)


def forward(logits, target, weight, loss, lse, row_weight, grad_logits, grad_scale, options, row_stats=None):
    """Per-row loss, logsumexp and weight of the (M, C) logits and, when grad_logits is given (it may be the logits
    themselves), grad_scale[i] * dloss_i / dlogits into it; with row_stats (3, M), each row's m, S and
    sum_j w_j u_j (0 without label smoothing) too."""
    ignore_index, label_smoothing = options.ignore_index, options.label_smoothing
    softcap, lse_square_scale = options.softcap, options.lse_square_scale
    M, C = logits.shape
    if M == 0:
        return
    smoothing = float(label_smoothing)
    keep, smooth_per_class = 1.0 - smoothing, smoothing / C
    capped, softcap = _capped_softcap(softcap)
    write_grad = grad_logits is not None
    write_stats = row_stats is not None
    flags = dict(HAS_WEIGHT=weight is not None, SMOOTH=smoothing > 0.0, SOFTCAP=capped,
                 ZLOSS=float(lse_square_scale) > 0.0, WRITE_GRAD=write_grad, WRITE_STATS=write_stats)
    args = (logits, target, weight if weight is not None else lse, loss, lse, row_weight,
            grad_logits if write_grad else lse, grad_scale if write_grad else lse,
            grad_scale.stride(0) if write_grad else 0, row_stats if write_stats else lse, M if write_stats else 0)
    scalars = (int(ignore_index), keep, smooth_per_class, softcap, 1.0 / softcap, float(lse_square_scale))
    block = next_power_of_2(C)
    with on_device(logits):
        if block <= _tuning.CE_TILE_MAX:
            rows = max(1, min(_tuning.CE_TILE_ELEMENTS // block, next_power_of_2(M)))
            launch(_tile_kernel, (triton.cdiv(M, rows),), *args, M, C, *scalars, ROWS=rows, BLOCK=block,
                   num_warps=warps_for(rows * block), **flags, **LAUNCH)
        else:
            configs = _tuning.CE_LOOP_GRAD_CONFIGS if write_grad else _tuning.CE_LOOP_CONFIGS
            loop_block, warps = configs[logits.element_size()]
            launch(_loop_kernel, (M,), *args, C, *scalars, BLOCK=loop_block, num_warps=warps, **flags, **LAUNCH)


def _capped_softcap(softcap):
    """(whether the logits are capped, the cap the kernels take): a cap past float32's range (inf as a float32) is
    no cap, softcap * tanh(x / softcap) rounding to x for |x| < 1e35."""
    capped = 0.0 < float(softcap) <= _FLOAT32_MAX
    return capped, float(softcap) if capped else 1.0


def gradient(logits, target, weight, row_max_sum, coefficients, grad_logits, options):
    """grad_logits[i, j] = du_j/dx_j * (a_i * exp(u_j - m_i) / S_i - b_i * [j == t_i] - c_i * w_j), (m, S) =
    row_max_sum[:, i] of the whole row, (a, b, c) = coefficients[:, i]; a target outside [0, C) has no term here.
    grad_logits may be logits itself."""
    softcap = options.softcap
    M, C = logits.shape
    if M == 0 or C == 0:
        return
    capped, softcap = _capped_softcap(softcap)
    block = min(next_power_of_2(C), _tuning.CE_GRADIENT_BLOCK[logits.element_size()])
    rows = max(1, min(_tuning.CE_GRADIENT_ELEMENTS[logits.element_size()] // block, next_power_of_2(M)))
    grid = (triton.cdiv(M, rows), triton.cdiv(C, block))
    with on_device(logits):
        launch(_gradient_kernel, grid, logits, target, weight if weight is not None else row_max_sum, row_max_sum,
               coefficients, grad_logits, M, C, softcap, 1.0 / softcap, ROWS=rows, BLOCK=block,
               HAS_WEIGHT=weight is not None, SOFTCAP=capped, num_warps=warps_for(rows * block), **LAUNCH)


def scale(grad_logits, factor):
    """grad_logits (M, C) *= factor: factor (1,) is read on the device (exactly 1: nothing is touched), (M,) is a
    factor a row."""
    M, C = grad_logits.shape
    if M == 0 or C == 0:
        return
    block = min(next_power_of_2(C), _tuning.CE_SCALE_BLOCK)
    rows = max(1, min(_tuning.CE_SCALE_BLOCK // block, next_power_of_2(M)))
    grid = (triton.cdiv(M, rows), triton.cdiv(C, block))
    per_row = factor.numel() != 1
    with on_device(grad_logits):
        launch(_scale_kernel, grid, grad_logits, factor, M, C, ROWS=rows, BLOCK=block, PER_ROW=per_row,
               num_warps=warps_for(rows * block), **LAUNCH)


def probabilities_forward(logits, target, weight, loss, lse, grad_logits, grad_scale, options):
    """Per-row loss and logsumexp of the (M, C) logits against (M, C) class-probability targets and, when
    grad_logits is given (never the logits themselves), grad_scale[i] * dloss_i / dlogits into it."""
    label_smoothing = options.label_smoothing
    softcap, lse_square_scale = options.softcap, options.lse_square_scale
    M, C = logits.shape
    if M == 0:
        return
    smoothing = float(label_smoothing)
    capped, softcap = _capped_softcap(softcap)
    write_grad = grad_logits is not None
    flags = dict(HAS_WEIGHT=weight is not None, SMOOTH=smoothing > 0.0, SOFTCAP=capped,
                 ZLOSS=float(lse_square_scale) > 0.0, WRITE_GRAD=write_grad)
    args = (logits, target, weight if weight is not None else lse, loss, lse, grad_logits if write_grad else lse,
            grad_scale if write_grad else lse, grad_scale.stride(0) if write_grad else 0)
    scalars = (1.0 - smoothing, smoothing / C, softcap, 1.0 / softcap, float(lse_square_scale))
    block = next_power_of_2(C)
    with on_device(logits):
        if block <= _tuning.CE_TILE_MAX:
            rows = max(1, min(_tuning.CE_TILE_ELEMENTS // block, next_power_of_2(M)))
            launch(_probabilities_tile_kernel, (triton.cdiv(M, rows),), *args, M, C, *scalars, ROWS=rows,
                   BLOCK=block, num_warps=warps_for(rows * block), **flags, **LAUNCH)
        else:
            loop_block, warps = _tuning.CE_PROBABILITIES_LOOP_CONFIGS[logits.element_size()]
            launch(_probabilities_loop_kernel, (M,), *args, C, *scalars, BLOCK=loop_block, num_warps=warps,
                   **flags, **LAUNCH)
