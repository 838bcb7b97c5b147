"""cross_entropy: autograd, torch.library ops, public function.

For class-index targets the gradient is computed in the forward, by the same
kernel pass as the loss (two passes over the logits in all, where a
forward that kept the log-sum-exp and a backward that read the logits again
take three): the forward writes each row's gradient times ``grad_scale``
(a mean's 1 / denominator, else 1) into a buffer that autograd keeps until the
backward, which only multiplies it by the incoming gradient (nothing at all when
that is one value of 1, as for ``loss.backward()``). Besides that buffer only
O(rows) state is kept; the logits are not (except with ``return_lse``). So a
graph can be differentiated once: a second backward, or a double backward,
raises. Class-probability targets take the same path through the backends'
``probabilities_forward``; only a target that itself requires grad is computed
with differentiable torch ops instead (its gradient is then torch's).

Under torch.compile, class-index targets go through ``cross_entropy_rows_op``
instead: the kernel only reads the logits, for each row's loss, lse, max and
sum of exponentials, and the backward graph computes the gradient from the
logits and those in torch ops, which the compiler fuses into one elementwise
pass (three passes over the logits in all, where a gradient written in the
forward would cost the compiled backward a copy of it: four).
"""

from __future__ import annotations

import warnings
from typing import NamedTuple, Optional

import torch

from . import _validate
from ._forward_ad import refuse_tangents, refuse_transforms
from ._registry import get_backend, resolve_name

REDUCTIONS = ("none", "mean", "sum")
_CACHED_VALUES_LIMIT = 64


def _stats_dtype(dtype: torch.dtype) -> torch.dtype:
    """Per-row losses, log-sum-exps and every loss returned: float32, or float64 for float64 logits."""
    return torch.promote_types(dtype, torch.float32)


_broadcast_values: dict[tuple, torch.Tensor] = {}


def _broadcast_value(rows: int, dtype: torch.dtype, device: torch.device, value: float = 1.0) -> torch.Tensor:
    """A (rows,) view at stride 0 of one cached ``value`` (no allocation per call): sum's and none's grad_scale
    (1), or a mean's over class-probability targets (1 / rows). Not cached when first asked for while a CUDA
    graph is being captured (the fill would not have run)."""
    key = (rows, dtype, device, value)
    broadcast = _broadcast_values.get(key)
    if broadcast is None:
        with torch.inference_mode(False):
            broadcast = torch.full((1,), value, dtype=dtype, device=device).expand(rows)
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return broadcast
        if len(_broadcast_values) >= _CACHED_VALUES_LIMIT:
            _broadcast_values.clear()
        _broadcast_values[key] = broadcast
    return broadcast


def _denominator(target, weight, ignore_index, classes, dtype):
    """A mean's denominator, sum over the rows of w[target] (1 without weights), 0 for an ignored row: from the
    targets alone, so that the forward can fold 1 / denominator into the gradient it writes. An out-of-range
    target adds a weight in bounds (its loss is NaN anyway). Weights that sum to 0 give NaN, so that the mean is
    NaN as torch's is (its weighted mean is 0 / 0 there, even where label smoothing or the z-loss add to the
    sum); without weights a sum of 0 means every row is ignored, and the losses' sum is 0 too."""
    counted = target != ignore_index
    if weight is None:
        return counted.sum(dtype=dtype)
    total = torch.where(counted, weight[target.clamp(0, classes - 1)], 0.0).sum()
    return torch.where(total != 0, total, float("nan"))


class _TargetTerms(NamedTuple):
    """What a row's loss and gradient take from its class-index target, over all the classes."""
    ignored: torch.Tensor   # (M,) bool: target == ignore_index
    valid: torch.Tensor     # (M,) bool: target in [0, classes)
    keep: object            # (1 - eps) * w[target]: (M,), or the float 1 - eps without weights
    weight_sum: object      # sum of the class weights: 0-d, or the float number of classes without weights


def check_targets_in_bounds(target, classes, ignore_index) -> None:
    """As torch: ``IndexError`` for a class-index target outside [0, classes) that is not ``ignore_index``, where
    the targets are on the CPU (reading them there costs no synchronisation). On a GPU the check would make the
    host wait for the device: such a row's loss and gradient are NaN instead, read in bounds."""
    if target.device.type != "cpu":
        return
    out_of_bounds = ((target < 0) | (target >= classes)) & (target != ignore_index)
    if out_of_bounds.any():
        raise IndexError(f"Target {int(target[out_of_bounds][0])} is out of bounds.")


def _target_terms(target, weight, classes, ignore_index, label_smoothing) -> _TargetTerms:
    """The rows' _TargetTerms; an invalid target reads a weight in bounds (its row is NaN anyway)."""
    keep = 1.0 - label_smoothing
    if weight is not None:
        keep = keep * weight[target.clamp(0, classes - 1)]
    weight_sum = weight.sum() if weight is not None else float(classes)
    return _TargetTerms(target == ignore_index, (target >= 0) & (target < classes), keep, weight_sum)


def _gradient_coefficients(terms: _TargetTerms, lse, grad_scale, classes, label_smoothing, lse_square_scale):
    """(3, M) coefficients a, b, c of each row's loss gradient du/dx * (a * p - b * [j == t] - c * w_j), times
    ``grad_scale`` (0-d or (M,)): a = (1 - eps) * w_t + eps / C * W + 2 * s * lse, b = (1 - eps) * w_t,
    c = eps / C. NaN for a target outside the classes, 0 for an ignored row."""
    per_class = label_smoothing / classes
    grad_scale = torch.where(terms.valid, grad_scale, float("nan"))
    at_target = at_all = grad_scale * terms.keep
    if label_smoothing:  # only then: 0 * W is NaN for an infinite class weight
        at_all = at_all + grad_scale * (per_class * terms.weight_sum)
    if lse_square_scale:
        at_all = at_all + grad_scale * (2.0 * lse_square_scale * lse)
    return torch.where(terms.ignored, 0.0, torch.stack((at_all, at_target, grad_scale * per_class)))


def _folds_mean(dtype: torch.dtype) -> bool:
    """Whether a mean's 1 / denominator is folded into the gradient the forward writes (and the backward then
    costs nothing for ``loss.backward()``). Not for float16: a mean's gradient over N rows is the row gradient
    over N, which float16 (smallest normal 6e-5) rounds to 0 for small probabilities before a loss scale
    (``torch.amp.GradScaler``) multiplies it back in the backward; so float16 keeps the row gradient and the
    backward multiplies it by the incoming gradient over the denominator, as torch's own backward computes it."""
    return dtype != torch.float16


def _backward_scale(denominator):
    """What the backward multiplies the incoming gradient by where a mean's 1 / denominator was not folded into
    the gradient: that, or 0 where the denominator is 0 (every row ignored: the kernels wrote 0, and torch's
    gradient is 0). NaN weights' sums stay NaN."""
    return torch.where(denominator != 0, denominator.reciprocal(), 0.0)


def _kernel_forward(logits, target, weight, ignore_index, label_smoothing, softcap, lse_square_scale, backend,
                    reduction, want_grad, grad_logits=None, separate=False, fold_mean=True):
    """Runs the backend's forward; returns (loss reduced, lse, grad_logits or None, what the backward must multiply
    the incoming gradient by (``_backward_scale``), or None).

    One (3, M) allocation holds the per-row losses, row weights and lse (each allocation costs host time), or
    with ``separate`` (a custom op's outputs must not alias) three. With ``want_grad`` the gradient is written
    into ``grad_logits`` (a new buffer when None) scaled by the reduction's grad_scale: for a mean 1 / its
    denominator, unless ``fold_mean`` is False (then 1, and the backward's scale is returned)."""
    rows, dtype = logits.shape[0], _stats_dtype(logits.dtype)
    if target.is_floating_point():
        return _probabilities_forward(logits, target, weight, label_smoothing, softcap, lse_square_scale, backend,
                                      reduction, want_grad, separate, fold_mean)
    check_targets_in_bounds(target, logits.shape[1], ignore_index)
    if separate:
        loss_rows, row_weight, lse = (torch.empty(rows, dtype=dtype, device=logits.device) for _ in range(3))
    else:
        loss_rows, row_weight, lse = torch.empty((3, rows), dtype=dtype, device=logits.device).unbind()
    denominator = grad_scale = None
    if reduction == "mean":
        denominator = _denominator(target, weight, ignore_index, logits.shape[1], dtype)
    if want_grad:
        if reduction == "mean" and fold_mean:
            grad_scale = denominator.reciprocal().expand(rows)
        else:
            grad_scale = _broadcast_value(rows, dtype, logits.device)
    if want_grad and grad_logits is None:
        grad_logits = torch.empty_like(logits)
    get_backend(backend).kernels("cross_entropy").forward(
        logits, target, weight, loss_rows, lse, row_weight, grad_logits if want_grad else None, grad_scale,
        ignore_index, label_smoothing, softcap, lse_square_scale)
    if reduction == "none":
        loss = loss_rows
    elif reduction == "sum":
        loss = loss_rows.sum()
    else:
        loss = torch.div(loss_rows.sum(), denominator)
    unfolded = _backward_scale(denominator) if want_grad and reduction == "mean" and not fold_mean else None
    return loss, lse, grad_logits if want_grad else None, unfolded


def _probabilities_forward(logits, target, weight, label_smoothing, softcap, lse_square_scale, backend, reduction,
                           want_grad, separate, fold_mean=True):
    """_kernel_forward of class-probability targets (M, C), of the logits' dtype: the backend's
    probabilities_forward; a mean divides by the number of rows, as torch's does for probabilities."""
    rows, dtype = logits.shape[0], _stats_dtype(logits.dtype)
    if separate:
        loss_rows, lse = (torch.empty(rows, dtype=dtype, device=logits.device) for _ in range(2))
    else:
        loss_rows, lse = torch.empty((2, rows), dtype=dtype, device=logits.device).unbind()
    grad_logits = grad_scale = None
    fold = reduction == "mean" and fold_mean
    if want_grad:
        grad_scale = _broadcast_value(rows, dtype, logits.device, 1.0 / rows if fold else 1.0)
        grad_logits = torch.empty_like(logits)
    get_backend(backend).kernels("cross_entropy").probabilities_forward(
        logits, target, weight, loss_rows, lse, grad_logits, grad_scale, label_smoothing, softcap, lse_square_scale)
    if reduction == "none":
        loss = loss_rows
    elif reduction == "sum":
        loss = loss_rows.sum()
    else:
        loss = torch.div(loss_rows.sum(), rows)
    return loss, lse, grad_logits, 1.0 / rows if want_grad and reduction == "mean" and not fold else None


def _scale(grad_logits, grad, backend):
    """grad_logits *= the incoming gradient of the loss: one value for a reduced loss, or where every row's is
    the same (a stride-0 broadcast, as ``loss.sum().backward()`` gives), else one per row."""
    if grad.ndim == 0:
        factor = grad.reshape(1)
    elif not any(grad.stride()):
        factor = grad.reshape(-1)[:1]
    else:
        factor = grad.reshape(-1).contiguous()
    get_backend(backend).kernels("cross_entropy").scale(grad_logits, factor)
    return grad_logits


def _lse_gradient(logits, grad_lse, softcap):
    """d (sum_i grad_lse[i] * lse_i) / d logits in float32 (float64 for float64 logits) torch ops:
    grad_lse[i] * p * du/dx, p the softmax of the capped logits u."""
    x = logits.to(_stats_dtype(logits.dtype))
    if softcap:
        u = torch.tanh(x / softcap).mul_(softcap)
        return torch.softmax(u, -1).mul_(u.div_(softcap).square_().neg_().add_(1.0)).mul_(grad_lse.unsqueeze(1))
    return torch.softmax(x, -1).mul_(grad_lse.unsqueeze(1))


def _add_lse_gradient(grad_logits, logits, grad_lse, softcap):
    """The loss's gradient plus the lse's: added into the loss's buffer (computed in float32, rounded once)."""
    part = _lse_gradient(logits, grad_lse.reshape(-1), softcap)
    if grad_logits is None:
        return part.to(logits.dtype)
    return grad_logits.add_(part)


_SECOND_BACKWARD = ("multisoft.cross_entropy computes its gradient in the forward and hands it out in the first "
                    "backward: a second backward through the same graph is not possible (compute the loss again)")
_DOUBLE_BACKWARD = ("multisoft.cross_entropy does not support double backward (create_graph=True): its gradient is "
                    "computed in the forward and the logits are not kept")
_INPLACE_LSE = ("multisoft.cross_entropy with inplace_backward=True cannot differentiate the returned lse: the "
                "forward overwrote the logits with the loss's gradient")


# -- autograd Function, the eager path: the kernels and the reduction inside, so that a reduced loss's gradient
# reaches the buffer as one value


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, weight, ignore_index, label_smoothing, softcap, lse_square_scale, backend,
                reduction, return_lse, inplace):
        loss, lse, grad_logits, ctx.backward_scale = _kernel_forward(
            logits, target, weight, ignore_index, label_smoothing, softcap, lse_square_scale, backend, reduction,
            True, grad_logits=logits if inplace else None, fold_mean=_folds_mean(logits.dtype))
        if inplace:
            # The kernel wrote through a raw pointer: tell autograd, so that any op that saved the logits' old
            # values raises in its backward instead of reading the gradient.
            torch.autograd.graph.increment_version(logits)
            grad_logits = logits.detach()
        ctx.buffer, ctx.backend = grad_logits, backend
        if not return_lse:
            return loss
        ctx.set_materialize_grads(False)
        ctx.softcap, ctx.inplace = softcap, inplace
        if not inplace:
            ctx.save_for_backward(logits)
        return loss, lse

    @staticmethod
    def backward(ctx, grad, grad_lse=None):
        if torch.is_grad_enabled():
            raise RuntimeError(_DOUBLE_BACKWARD)
        grad_logits, ctx.buffer = ctx.buffer, None
        if grad_logits is None:
            raise RuntimeError(_SECOND_BACKWARD)
        if grad is None:
            grad_logits = None
        else:
            _scale(grad_logits, grad if ctx.backward_scale is None else grad * ctx.backward_scale, ctx.backend)
        if grad_lse is not None:
            if ctx.inplace:
                raise RuntimeError(_INPLACE_LSE)
            (logits,) = ctx.saved_tensors
            grad_logits = _add_lse_gradient(grad_logits, logits, grad_lse, ctx.softcap)
        return grad_logits, None, None, None, None, None, None, None, None, None, None


# -- torch.library ops for class-probability targets under torch.compile: a forward that returns the loss, the lse
# and the gradient buffer, and a backward that scales a copy of that buffer


@torch.library.custom_op("multisoft::cross_entropy_forward", mutates_args=())
def cross_entropy_forward_op(logits: torch.Tensor, target: torch.Tensor, weight: Optional[torch.Tensor],
                             ignore_index: int, label_smoothing: float, softcap: float, lse_square_scale: float,
                             reduction: str, want_grad: bool, return_lse: bool, backend: str
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    loss, lse, grad_logits, _ = _kernel_forward(logits, target, weight, ignore_index, label_smoothing, softcap,
                                                lse_square_scale, backend, reduction, want_grad, separate=True)
    return loss, lse, grad_logits if grad_logits is not None else logits.new_empty(0)


@cross_entropy_forward_op.register_fake
def _(logits, target, weight, ignore_index, label_smoothing, softcap, lse_square_scale, reduction, want_grad,
      return_lse, backend):
    rows, dtype = logits.shape[0], _stats_dtype(logits.dtype)
    loss = logits.new_empty(rows if reduction == "none" else (), dtype=dtype)
    return loss, logits.new_empty(rows, dtype=dtype), torch.empty_like(logits) if want_grad else logits.new_empty(0)


@torch.library.custom_op("multisoft::cross_entropy_scale", mutates_args=())
def cross_entropy_scale_op(grad_logits: torch.Tensor, factor: torch.Tensor, backend: str) -> torch.Tensor:
    """The backend's scale on a copy: an op that mutated the saved buffer in place breaks AOT autograd's
    partitioner (the backward graph's output is then not computable from what the forward saves)."""
    scaled = grad_logits.clone()
    get_backend(backend).kernels("cross_entropy").scale(scaled, factor)
    return scaled


@cross_entropy_scale_op.register_fake
def _(grad_logits, factor, backend):
    return torch.empty_like(grad_logits)


def _setup_context(ctx, inputs, output):
    logits, _, _, _, _, ctx.softcap, _, ctx.reduction, _, return_lse, ctx.backend = inputs
    ctx.save_for_backward(output[2], logits if return_lse else None)  # the logits only to differentiate lse


def _op_backward(ctx, grad, grad_lse, _grad_buffer):
    grad_logits, logits = ctx.saved_tensors
    factor = grad.reshape(1) if ctx.reduction != "none" else grad.contiguous()
    grad_logits = cross_entropy_scale_op(grad_logits, factor, ctx.backend)
    if logits is not None and grad_lse is not None:
        grad_logits = _add_lse_gradient(grad_logits, logits, grad_lse, ctx.softcap)
    return grad_logits, None, None, None, None, None, None, None, None, None, None


cross_entropy_forward_op.register_autograd(_op_backward, setup_context=_setup_context)


# -- torch.library op for class-index targets under torch.compile: the kernel reads the logits once for each row's
# loss, lse and (max, sum of exponentials); the gradient is then computed in the backward graph by torch ops that
# torch.compile fuses into one elementwise pass (read the logits, write the gradient). Two reads and one write in
# all, the most a compiled graph can do here: a gradient written in the forward would cost the backward a copy
# (an op may not scale a saved buffer in place there), four passes.


@torch.library.custom_op("multisoft::cross_entropy_rows", mutates_args=())
def cross_entropy_rows_op(logits: torch.Tensor, target: torch.Tensor, weight: Optional[torch.Tensor],
                          ignore_index: int, label_smoothing: float, softcap: float, lse_square_scale: float,
                          backend: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's loss, lse and (3, M) statistics (max m of the capped logits u, sum S of exp(u - m), and a third
    row the backward does not use): the backend's forward, without a gradient."""
    check_targets_in_bounds(target, logits.shape[1], ignore_index)
    rows, dtype = logits.shape[0], _stats_dtype(logits.dtype)
    loss_rows, lse, row_weight = (torch.empty(rows, dtype=dtype, device=logits.device) for _ in range(3))
    row_stats = torch.empty((3, rows), dtype=dtype, device=logits.device)
    get_backend(backend).kernels("cross_entropy").forward(
        logits, target, weight, loss_rows, lse, row_weight, None, None, ignore_index, label_smoothing, softcap,
        lse_square_scale, row_stats=row_stats)
    return loss_rows, lse, row_stats


@cross_entropy_rows_op.register_fake
def _(logits, target, weight, ignore_index, label_smoothing, softcap, lse_square_scale, backend):
    rows, dtype = logits.shape[0], _stats_dtype(logits.dtype)
    return (logits.new_empty(rows, dtype=dtype), logits.new_empty(rows, dtype=dtype),
            logits.new_empty((3, rows), dtype=dtype))


def _rows_setup_context(ctx, inputs, output):
    logits, target, weight, ctx.ignore_index, ctx.label_smoothing, ctx.softcap, ctx.lse_square_scale, _ = inputs
    _, lse, row_stats = output
    ctx.save_for_backward(logits, target, weight, lse, row_stats)


def _rows_backward(ctx, grad_loss_rows, grad_lse, _grad_row_stats):
    logits, target, weight, lse, row_stats = ctx.saved_tensors
    grad = _rows_gradient(logits, target, weight, lse, row_stats, grad_loss_rows, grad_lse, ctx.ignore_index,
                          ctx.label_smoothing, ctx.softcap, ctx.lse_square_scale)
    return grad, None, None, None, None, None, None, None


def _rows_gradient(logits, target, weight, lse, row_stats, grad_loss_rows, grad_lse, ignore_index, label_smoothing,
                   softcap, lse_square_scale):
    """d (sum_i g_i * loss_i + sum_i h_i * lse_i) / d logits in torch ops, computed in the statistics' dtype:
    du/dx * (a * p - b * [j == t] - c * w_j) with p = exp(u - m) / S, a, b, c the loss's coefficients times g
    (_gradient_coefficients), and h added to a after an ignored row's are zeroed."""
    classes = logits.shape[1]
    terms = _target_terms(target, weight, classes, ignore_index, label_smoothing)
    at_all, at_target, per_class = _gradient_coefficients(terms, lse, grad_loss_rows, classes, label_smoothing,
                                                          lse_square_scale)
    if grad_lse is not None:
        at_all = at_all + grad_lse
    u = logits.to(lse.dtype)
    if softcap:
        u = torch.tanh(u / softcap) * softcap
    row_max, row_sum = row_stats[0].unsqueeze(1), row_stats[1].unsqueeze(1)
    columns = torch.arange(classes, device=logits.device)
    grad = (u - row_max).exp() / row_sum * at_all.unsqueeze(1)
    grad = grad - torch.where(columns == target.unsqueeze(1), at_target.unsqueeze(1), 0.0)
    if label_smoothing:
        grad = grad - per_class.unsqueeze(1) * (weight if weight is not None else 1.0)
    if softcap:
        grad = grad * (1.0 - (u / softcap).square())
    return grad.to(logits.dtype)


cross_entropy_rows_op.register_autograd(_rows_backward, setup_context=_rows_setup_context)


def _reduce(loss_rows, reduction, target, weight, ignore_index, classes):
    """The reduction of the per-row losses, in torch ops: a mean divides by the sum of the targets' weights."""
    if reduction == "none":
        return loss_rows
    if reduction == "sum":
        return loss_rows.sum()
    return loss_rows.sum() / _denominator(target, weight, ignore_index, classes, loss_rows.dtype)


def check_classes(classes, logits, target):
    """Rows to predict need classes to predict them from (errors name the logits ``input``, the public name)."""
    if classes == 0 and target.numel() > 0:
        raise ValueError(f"input has no classes (shape {tuple(logits.shape)}): there is nothing to predict from")


def check_weight(weight, classes, logits, differentiable=False):
    """``weight``: None, or one floating value per class on the logits' device; one that requires grad only where
    the loss is ``differentiable`` in it (class-probability targets, as with torch: its class-index loss is not
    differentiable in the weights either), rather than its gradient silently left out."""
    if weight is not None:
        _validate.floating(weight, "weight")
        if weight.shape != (classes,):
            raise ValueError(f"weight must have shape ({classes},), one per class, got {tuple(weight.shape)}")
        _validate.same_device(logits, "input", weight=weight)
        if weight.requires_grad and torch.is_grad_enabled() and not differentiable:
            raise ValueError("weight requires grad, but cross-entropy over class indices is not differentiable in "
                             "its class weights (nor is torch's): pass weight.detach()")


_INT64_MIN, _INT64_MAX = -2**63, 2**63 - 1
_INT32_MIN, _INT32_MAX = -2**31, 2**31 - 1


def index_targets(target, ignore_index):
    """Class-index targets as the kernels take them, contiguous (rows,): int32 ones as int64 where
    ``ignore_index`` lies outside int32 (compared in int32 it would wrap around and match a target it is not)."""
    flat = target.reshape(-1)
    if flat.dtype == torch.int32 and not _INT32_MIN <= ignore_index <= _INT32_MAX:
        return flat.long()
    return flat.contiguous()


def validate_arguments(logits, target, weight, ignore_index, reduction, label_smoothing, lse_square_scale, softcap,
                       return_lse, inplace_backward, sliced=False):
    """Validates the arguments; returns (number of classes, label_smoothing, lse_square_scale and softcap as
    floats, softcap 0.0 for none, probability targets?). With ``sliced`` the logits hold a slice of the classes:
    the number of classes and ``weight`` are left to ``check_classes`` and ``check_weight`` once the whole number
    is known. Errors name the logits ``input``, the public name. Under ``torch.compile`` the numbers may be
    symbolic (``_validate``'s module docstring)."""
    _validate.floating(logits, "input")
    _validate.tensor(target, "target")
    if logits.ndim == 0:
        raise ValueError("input must have shape (C,), (N, C) or (N, C, d1, ...), got a 0-d tensor")
    classes = logits.shape[1] if logits.ndim >= 2 else logits.shape[0]
    probabilities = target.is_floating_point()
    if probabilities:
        if target.shape != logits.shape:
            raise ValueError(f"target of class probabilities must have the input's shape {tuple(logits.shape)}, "
                             f"got {tuple(target.shape)}")
        if ignore_index != -100:
            raise ValueError("ignore_index is not supported with class-probability targets (floating target)")
    else:
        if target.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"target must hold class indices as int64 or int32, or class probabilities of a "
                            f"floating dtype, got {target.dtype}")
        expected = logits.shape[:1] + logits.shape[2:] if logits.ndim >= 2 else torch.Size()
        if target.shape != expected:
            raise ValueError(f"target must have shape {tuple(expected)} for input of shape "
                             f"{tuple(logits.shape)}, got {tuple(target.shape)}")
    if not sliced:
        check_classes(classes, logits, target)
        check_weight(weight, classes, logits, differentiable=probabilities)
    _validate.same_device(logits, "input", target=target, weight=weight)
    if not _INT64_MIN <= _validate.integer(ignore_index, "ignore_index") <= _INT64_MAX:
        raise ValueError(f"ignore_index must fit in int64 (a class index), got {ignore_index}")
    _validate.one_of(reduction, REDUCTIONS, "reduction")
    label_smoothing = _validate.real(label_smoothing, "label_smoothing")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {float(label_smoothing)}")
    lse_square_scale = _validate.finite(lse_square_scale, "lse_square_scale")
    if lse_square_scale < 0.0:
        raise ValueError(f"lse_square_scale must be >= 0, got {float(lse_square_scale)}")
    if softcap is None:
        softcap = 0.0
    else:
        softcap = _validate.real(softcap, "softcap")
        if not 0.0 < softcap < _validate.INF:  # not math.isfinite: dynamo cannot call it on a symbolic float
            raise ValueError(f"softcap must be a finite number > 0, or None for no cap; got {float(softcap)}")
    _validate.boolean(return_lse, "return_lse")
    _validate.boolean(inplace_backward, "inplace_backward")
    return classes, label_smoothing, lse_square_scale, softcap, probabilities


def legacy_reduction(size_average, reduce) -> str:
    """torch's deprecated ``size_average``/``reduce`` pair (each None or a bool) as a ``reduction``, as torch maps
    them, with a deprecation warning pointing at the caller of the function that calls this one."""
    for name, value in (("size_average", size_average), ("reduce", reduce)):
        if value is not None and not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool or None (deprecated: use reduction=), got {type(value).__name__}")
    warnings.warn("size_average and reduce are deprecated, as in torch: use reduction='none'|'mean'|'sum'",
                  stacklevel=3)
    if reduce is False:
        return "none"
    return "sum" if size_average is False else "mean"


def cross_entropy(input: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None = None,
                  size_average: bool | None = None, ignore_index: int = -100, reduce: bool | None = None,
                  reduction: str = "mean", label_smoothing: float = 0.0, *, lse_square_scale: float = 0.0,
                  softcap: float | None = None, return_lse: bool = False, backend: str | None = None,
                  inplace_backward: bool = False, process_group=None):
    """Cross-entropy between ``input`` (the logits) and ``target``, like ``F.cross_entropy``, with the options of
    LLM training.

    The parameters before ``*`` are ``F.cross_entropy``'s, by name and
    position, so that a call to it can be swapped for this one: ``input`` is
    (C,), (N, C) or (N, C, d1, ...). ``target`` holds class indices
    (int64/int32, the input's shape without C) or class probabilities (a
    floating tensor of the input's shape), as in ``F.cross_entropy``, with the
    same ``weight``, ``ignore_index`` (class indices only), ``reduction`` and
    ``label_smoothing``; torch's deprecated ``size_average`` and ``reduce``
    (None or a bool) override ``reduction`` as torch maps them, with a
    deprecation warning. The loss is float32 for 16-bit logits (what torch
    gives under autocast), reduced or not; float32 or float64 otherwise.

    ``softcap`` (a finite number > 0, or None): the logits are replaced by
    ``softcap * tanh(logits / softcap)`` before everything else (Gemma 2).
    ``lse_square_scale`` (>= 0): the z-loss, ``lse_square_scale * lse**2`` added
    to every row's loss that is not ignored, reduced with it (a mean divides it
    by the same sum of target weights); not multiplied by the class weight.
    ``return_lse=True`` returns ``(loss, lse)``: every row's logsumexp of the
    (capped) logits, ignored rows too, float32 (float64 for float64 logits), of
    the target's shape; it can be differentiated too.

    With class indices the gradient is computed in the forward, in the same pass
    over the logits as the loss, and kept (scaled by the mean's denominator)
    until the backward multiplies it by the incoming gradient: forward plus
    backward allocate nothing of the logits' size but that gradient. The graph
    can be differentiated once: a second backward through it, or double
    backward (``create_graph=True``), raises.

    ``inplace_backward=True`` has the forward write the gradient into ``input``
    itself (no gradient buffer at all): after the call ``input`` holds the
    gradient, not the logits, and ``input.grad`` is that same memory after the
    backward. The write bumps the logits' version counter, so autograd raises if
    anything else saved them for its own backward. Logits that are not a
    contiguous (N, C) or (C,) tensor are gathered into a contiguous copy first,
    which then holds the gradient. Eager mode and class-index targets only: under
    ``torch.compile`` the gradient gets its own buffer. A returned lse cannot be
    differentiated with it (the logits are gone). Logits that are a leaf that
    requires grad (an ``nn.Parameter``) or a view of one raise ``ValueError``, as
    torch refuses an in-place op there: the optimizer would step from the gradient.

    A class-index target outside [0, C) that is not ``ignore_index`` raises
    torch's ``IndexError`` where the targets are on the CPU; on a GPU (where
    checking would synchronise) its row's loss and gradient are NaN.

    ``process_group`` (a ``torch.distributed`` process group of P ranks):
    vocabulary-parallel cross-entropy. ``input`` is this rank's contiguous
    slice of the classes, the ranks' slices in group-rank order (widths may
    differ); ``target`` holds global class ids and ``weight`` (length V, all
    the classes) is the same on every rank. Every rank gets the loss (and lse)
    of the whole rows, and its slice of the gradient. The forward runs one
    all-gather of 4 numbers a row; the backward communicates nothing. The
    slices' widths are learned by one all-gather (and one host
    synchronisation) the first time a (group, local width) pair is seen, and
    cached: a group's slicing must then stay the same. Class-index targets
    only. ``input`` may instead be a DTensor sharded on its class dimension
    over a 1-D device mesh (``Shard(1)``, or ``Shard(0)`` for (C,) logits),
    as with torch's ``loss_parallel``: its local shard and the mesh's group
    are used, and plain tensors are returned. Not traced by
    ``torch.compile`` (it runs eagerly, a graph break; fullgraph=True fails).

    Inside a ``torch.func`` transform (``grad``, ``vmap``, ``jvp``, ...) it
    raises ``NotImplementedError``.
    """
    refuse_transforms("cross_entropy")
    refuse_tangents("cross_entropy", input=input, target=target, weight=weight)
    if size_average is not None or reduce is not None:
        reduction = legacy_reduction(size_average, reduce)
    if inplace_backward is True:
        refuse_inplace_on_a_leaf(input)
    if process_group is not None or _is_dtensor(input):
        from . import _vocab_parallel

        return _vocab_parallel.cross_entropy(
            input, target, weight, ignore_index, reduction, label_smoothing, lse_square_scale=lse_square_scale,
            softcap=softcap, return_lse=return_lse, backend=backend, inplace_backward=inplace_backward,
            process_group=process_group)
    classes, label_smoothing, lse_square_scale, softcap, probabilities = validate_arguments(
        input, target, weight, ignore_index, reduction, label_smoothing, lse_square_scale, softcap, return_lse,
        inplace_backward)
    logits = input
    backend = resolve_name(logits.device, logits.dtype, _validate.backend_name(backend), "cross_entropy")
    if probabilities:
        if inplace_backward:
            raise ValueError("inplace_backward=True is not supported with class-probability targets")
        if (target.requires_grad or weight is not None and weight.requires_grad) and torch.is_grad_enabled():
            loss, lse = _probability_targets(logits, target, weight, reduction, label_smoothing, softcap,
                                             lse_square_scale, backend)
            return (loss, lse) if return_lse else loss
        logits, target = _probability_dtypes(logits, target)
    stats_dtype = _stats_dtype(logits.dtype)
    rows_2d, flat_target = as_rows(logits, target, ignore_index)
    if weight is not None:
        weight = weight.to(stats_dtype).contiguous()
    if rows_2d.numel() == 0:
        loss, lse = _empty_rows(rows_2d, reduction, stats_dtype)
    elif torch.compiler.is_compiling() and not probabilities:
        loss_rows, lse, _ = cross_entropy_rows_op(rows_2d, flat_target, weight, ignore_index, label_smoothing,
                                                  softcap, lse_square_scale, backend)
        loss = _reduce(loss_rows, reduction, flat_target, weight, ignore_index, classes)
    elif torch.compiler.is_compiling():
        want_grad = rows_2d.requires_grad and torch.is_grad_enabled()
        loss, lse, _ = cross_entropy_forward_op(rows_2d, flat_target, weight, ignore_index, label_smoothing,
                                                softcap, lse_square_scale, reduction, want_grad, return_lse,
                                                backend)
    elif rows_2d.requires_grad and torch.is_grad_enabled():
        result = _CrossEntropy.apply(rows_2d, flat_target, weight, ignore_index, label_smoothing, softcap,
                                     lse_square_scale, backend, reduction, return_lse, inplace_backward)
        loss, lse = result if return_lse else (result, None)
    else:
        loss, lse, _, _ = _kernel_forward(rows_2d, flat_target, weight, ignore_index, label_smoothing, softcap,
                                          lse_square_scale, backend, reduction, False)
    row_shape = logits.shape[:1] + logits.shape[2:] if logits.ndim >= 2 else torch.Size()  # index targets' shape
    if reduction == "none" and logits.ndim != 2:
        loss = loss.reshape(row_shape)
    if not return_lse:
        return loss
    return loss, lse.reshape(row_shape) if logits.ndim != 2 else lse


def refuse_inplace_on_a_leaf(logits) -> None:
    """``inplace_backward=True`` overwrites the logits with their gradient: refused, as torch refuses an in-place
    op, where autograd records the call and the logits are a leaf that requires grad (an ``nn.Parameter``, whose
    values the optimizer would then step from) or a view of one. A copy made for non-contiguous logits would
    spare them, but the rule does not depend on the layout."""
    if not (isinstance(logits, torch.Tensor) and logits.requires_grad and torch.is_grad_enabled()):
        return
    base = logits if logits._base is None else logits._base
    if base.is_leaf and base.requires_grad:
        what = "a leaf tensor that requires grad" if base is logits else "a view of a leaf tensor that requires grad"
        raise ValueError(f"inplace_backward=True would overwrite the logits, {what} (such as an nn.Parameter), "
                         f"with their gradient, as torch refuses an in-place op there: pass logits computed by "
                         f"the model (not a leaf), or inplace_backward=False")


def as_rows(logits, target, ignore_index):
    """(logits as contiguous (rows, C), targets as ``index_targets`` gives them, or (rows, C) for class
    probabilities): the class dimension moved last."""
    if target.is_floating_point():
        return _class_last(logits), _class_last(target)
    return _class_last(logits), index_targets(target, ignore_index)


def _class_last(tensor):
    """A (C,), (N, C) or (N, C, d1, ...) tensor as contiguous (rows, C)."""
    if tensor.ndim == 2:
        return tensor.contiguous()
    if tensor.ndim == 1:
        return tensor.unsqueeze(0)
    return tensor.movedim(1, -1).reshape(-1, tensor.shape[1]).contiguous()


def _probability_dtypes(logits, target):
    """(logits, target) of one dtype, as the kernels take them: the logits' own where the target's converts to
    it without loss, else float32 (16-bit logits with a wider target: the logits are converted, a copy, and their
    gradient converted back by autograd); float32 logits take a float64 target rounded to float32."""
    if target.dtype == logits.dtype:
        return logits, target
    common = torch.promote_types(logits.dtype, target.dtype)
    if common == logits.dtype or common == torch.float64:
        return logits, target.to(logits.dtype)
    return logits.to(common), target.to(common)


def _is_dtensor(tensor) -> bool:
    """Whether ``tensor`` is a DTensor (or of a subclass), from its classes' names: without importing
    torch.distributed.tensor, and without reading ``sys.modules``, which torch.compile would trace as a dict that
    another thread's import can change while it is read. A plain tensor or a Parameter (of any Parameter class:
    a DTensor made a Parameter keeps its DTensor class) is answered first, without the classes' ``__mro__``, which
    torch.compile (torch 2.13) cannot iterate for a Parameter."""
    cls = type(tensor)
    if cls is torch.Tensor or issubclass(cls, torch.nn.Parameter):
        return False
    return any(base.__name__ == "DTensor" and base.__module__ == "torch.distributed.tensor" for base in cls.__mro__)


def _probability_targets(logits, target, weight, reduction, label_smoothing, softcap, lse_square_scale, backend):
    """(loss, lse) of class-probability targets that require grad themselves (soft labels being learned), in
    differentiable torch ops, computed in float32 (float64 for
    float64 logits or on the ``reference`` backend): ``-sum_c w[c] * q[c] * log_softmax(u)[c] + s * lse(u)**2``
    per row with ``q = (1 - eps) * target + eps / C`` and u the capped logits; a mean divides by the number of
    rows, as torch does."""
    out_dtype = _stats_dtype(logits.dtype)
    compute = torch.float64 if backend == "reference" else out_dtype
    class_dim = 1 if logits.ndim >= 2 else 0
    u = logits.to(compute)
    if softcap:
        u = softcap * torch.tanh(u / softcap)
    lse = torch.logsumexp(u, class_dim)
    log_p = u - lse.unsqueeze(class_dim)
    q = target.to(compute)
    classes = logits.shape[class_dim]
    if label_smoothing:
        q = (1.0 - label_smoothing) * q + label_smoothing / classes
    if weight is not None:
        shape = (classes,) + (1,) * (logits.ndim - 2) if logits.ndim >= 2 else (classes,)
        q = q * weight.to(compute).reshape(shape)
    per_row = -(q * log_p).sum(class_dim)
    if lse_square_scale:
        per_row = per_row + lse_square_scale * lse.square()
    if reduction == "none":
        loss = per_row
    elif reduction == "sum":
        loss = per_row.sum()
    else:
        loss = per_row.mean() if per_row.numel() else per_row.sum() / 0.0
    return loss.to(out_dtype), lse.to(out_dtype)


def _empty_rows(rows_2d, reduction, stats_dtype):
    """(loss, lse) of logits with no rows, from torch ops: torch's loss (an empty tensor, 0, or NaN for a mean),
    part of autograd as torch's would be."""
    per_row = rows_2d.sum(-1).to(stats_dtype)
    if reduction == "none":
        loss = per_row
    else:
        loss = per_row.sum() if reduction == "sum" else per_row.sum() / 0.0
    return loss, per_row
