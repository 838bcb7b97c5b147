"""cross_entropy: torch.library ops, autograd, public function.

For class-index targets the backends compute per-row losses and keep only the
per-row log-sum-exp for the backward; the reduction is ordinary torch
arithmetic on M numbers. Class-probability targets are computed with torch ops
(float32 inside, float64 on the ``reference`` backend) until the backends have
kernels for them.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import _validate
from ._registry import get_backend, resolve_name

REDUCTIONS = ("none", "mean", "sum")


def _stats_dtype(dtype: torch.dtype) -> torch.dtype:
    """Per-row losses and log-sum-exps: float32, or float64 for float64 logits."""
    return torch.promote_types(dtype, torch.float32)


# -- the kernels of one backend on (M, C) rows, into torch-allocated outputs


def _forward(logits, target, weight, ignore_index, label_smoothing, backend, separate=False):
    """(per_row, lse): per_row[0] the rows' losses, per_row[1] the weight of each row in a mean (w[target], 0 for
    an ignored row), one (2, M) tensor so that a mean's two sums are one reduction; lse the rows' logsumexp.
    Both are views of one allocation (each costs host time), or with ``separate`` (the outputs of a custom op
    must not alias) two."""
    rows, dtype = logits.shape[0], _stats_dtype(logits.dtype)
    if separate:
        per_row = torch.empty((2, rows), dtype=dtype, device=logits.device)
        lse = torch.empty(rows, dtype=dtype, device=logits.device)
    else:
        stats = torch.empty((3, rows), dtype=dtype, device=logits.device)
        per_row, lse = stats[:2], stats[2]
    get_backend(backend).kernels("cross_entropy").forward(
        logits, target, weight, per_row[0], lse, per_row[1], ignore_index, label_smoothing)
    return per_row, lse


def _backward(logits, target, weight, weight_sum, lse, grad_loss, ignore_index, label_smoothing, backend,
              grad_logits=None):
    """grad_loss: each row's, or one value for every row (0-d, passed on as a broadcast view)."""
    if grad_logits is None:
        grad_logits = torch.empty_like(logits)
    if grad_loss.dtype != lse.dtype:
        grad_loss = grad_loss.to(lse.dtype)
    grad_loss = grad_loss.expand(lse.shape[0]) if grad_loss.ndim == 0 else grad_loss.contiguous()
    get_backend(backend).kernels("cross_entropy").backward(
        logits, target, weight, weight_sum, lse, grad_loss, grad_logits, ignore_index, label_smoothing)
    return grad_logits


def _reduce(per_row, reduction, out_dtype):
    """(loss, denominator) from _forward's per_row, outside autograd; denominator: a mean's sum of row weights."""
    if reduction == "none":
        return per_row[0].to(out_dtype), None
    if reduction == "sum":
        return per_row[0].sum().to(out_dtype), None
    totals = per_row.sum(1)
    return torch.div(totals[0], totals[1], out=per_row.new_empty((), dtype=out_dtype)), totals[1]


def _grad_per_row(grad, denominator):
    """The gradient of each row's loss from the reduced loss's: a 0-d tensor for every row when reduced."""
    return grad / denominator if denominator is not None else grad


# -- torch.library ops, used under torch.compile


@torch.library.custom_op("multisoft::cross_entropy_forward", mutates_args=())
def cross_entropy_forward_op(logits: torch.Tensor, target: torch.Tensor, weight: Optional[torch.Tensor],
                             weight_sum: Optional[torch.Tensor], ignore_index: int, label_smoothing: float,
                             backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    return _forward(logits, target, weight, ignore_index, label_smoothing, backend, separate=True)


@cross_entropy_forward_op.register_fake
def _(logits, target, weight, weight_sum, ignore_index, label_smoothing, backend):
    rows, dtype = logits.shape[0], _stats_dtype(logits.dtype)
    return logits.new_empty((2, rows), dtype=dtype), logits.new_empty(rows, dtype=dtype)


@torch.library.custom_op("multisoft::cross_entropy_backward", mutates_args=())
def cross_entropy_backward_op(logits: torch.Tensor, target: torch.Tensor, weight: Optional[torch.Tensor],
                              weight_sum: Optional[torch.Tensor], lse: torch.Tensor, grad_loss: torch.Tensor,
                              ignore_index: int, label_smoothing: float, backend: str) -> torch.Tensor:
    return _backward(logits, target, weight, weight_sum, lse, grad_loss, ignore_index, label_smoothing, backend)


@cross_entropy_backward_op.register_fake
def _(logits, target, weight, weight_sum, lse, grad_loss, ignore_index, label_smoothing, backend):
    return torch.empty_like(logits)


def _setup_context(ctx, inputs, output):
    logits, target, weight, weight_sum, ctx.ignore_index, ctx.label_smoothing, ctx.backend = inputs
    ctx.save_for_backward(logits, target, weight, weight_sum, output[1])


def _op_backward(ctx, grad_per_row, _grad_lse):
    logits, target, weight, weight_sum, lse = ctx.saved_tensors
    # per_row[1], the row weights, are piecewise constant in the logits: their gradient is dropped
    grad = cross_entropy_backward_op(logits, target, weight, weight_sum, lse, grad_per_row[0],
                                     ctx.ignore_index, ctx.label_smoothing, ctx.backend)
    return grad, None, None, None, None, None, None


cross_entropy_forward_op.register_autograd(_op_backward, setup_context=_setup_context)


def _compiled(rows_2d, flat_target, weight, weight_sum, ignore_index, label_smoothing, backend, reduction,
              out_dtype):
    """The loss under torch.compile: the custom op, then the reduction as ordinary (traced) torch ops."""
    per_row, _ = cross_entropy_forward_op(rows_2d, flat_target, weight, weight_sum, ignore_index, label_smoothing,
                                          backend)
    if reduction == "none":
        return per_row[0].to(out_dtype)
    if reduction == "sum":
        return per_row[0].sum().to(out_dtype)
    return (per_row[0].sum() / per_row[1].sum()).to(out_dtype)


# -- autograd Functions, the eager path: the reduction inside, so that a reduced loss's gradient reaches the
# kernels as one broadcast value (no per-row tensor, no kernels for the reduction's own backward)


class _CrossEntropy(torch.autograd.Function):
    """The backward writes the gradient into a new tensor, or with ``inplace`` into the logits' own buffer (the
    backward kernels read each element before they write it)."""

    @staticmethod
    def forward(ctx, logits, target, weight, weight_sum, ignore_index, label_smoothing, backend, reduction,
                out_dtype, inplace):
        per_row, lse = _forward(logits, target, weight, ignore_index, label_smoothing, backend)
        loss, denominator = _reduce(per_row, reduction, out_dtype)
        ctx.args = (ignore_index, label_smoothing, backend)
        ctx.inplace = inplace
        ctx.save_for_backward(logits, target, weight, weight_sum, lse, denominator)
        return loss

    @staticmethod
    def backward(ctx, grad):
        logits, target, weight, weight_sum, lse, denominator = ctx.saved_tensors
        grad_rows = _grad_per_row(grad, denominator)
        if torch.is_grad_enabled():  # create_graph=True: a gradient that can itself be differentiated
            if ctx.inplace:
                raise RuntimeError("multisoft.cross_entropy with inplace_backward=True does not support double "
                                   "backward (create_graph=True): its gradient overwrites the logits")
            return (_differentiable_grad(logits, target, weight, grad_rows, *ctx.args[:2]),
                    None, None, None, None, None, None, None, None, None)
        grad_logits = _backward(logits, target, weight, weight_sum, lse, grad_rows,
                                *ctx.args, grad_logits=logits.detach() if ctx.inplace else None)
        if ctx.inplace:
            # The kernels wrote through a raw pointer: tell autograd, so that any other use of the logits'
            # old values (another op that saved them, a second backward) raises instead of reading the gradient.
            torch.autograd.graph.increment_version(logits)
        return grad_logits, None, None, None, None, None, None, None, None, None


def _row_losses(rows_2d, flat_target, weight, ignore_index, label_smoothing):
    """Per-row losses of class-index targets in differentiable torch ops (the backends' formula), computed in
    float32 (float64 for float64 logits): the double-backward path."""
    x = rows_2d.to(_stats_dtype(rows_2d.dtype))
    neg_log_p = -torch.log_softmax(x, -1)
    valid = flat_target != ignore_index
    safe_target = torch.where(valid, flat_target, 0).long()
    nll = neg_log_p.gather(1, safe_target.unsqueeze(1)).squeeze(1)
    if weight is not None:
        nll = nll * weight[safe_target]
    loss = (1.0 - label_smoothing) * nll
    if label_smoothing:
        smooth = neg_log_p @ weight if weight is not None else neg_log_p.sum(-1)
        loss = loss + label_smoothing / rows_2d.shape[1] * smooth
    return torch.where(valid, loss, 0.0)


def _differentiable_grad(logits, target, weight, grad_rows, ignore_index, label_smoothing):
    with torch.enable_grad():
        losses = _row_losses(logits, target, weight, ignore_index, label_smoothing)
        grad_rows = grad_rows.expand_as(losses) if grad_rows.ndim == 0 else grad_rows
        (grad,) = torch.autograd.grad(losses, logits, grad_rows.to(losses.dtype), create_graph=True)
    return grad


def _check(logits, target, weight, ignore_index, reduction, label_smoothing):
    """Validates the arguments; returns (number of classes, label_smoothing as float, probability targets?)."""
    _validate.floating(logits, "logits")
    _validate.tensor(target, "target")
    if logits.ndim == 0:
        raise ValueError("logits must have shape (C,), (N, C) or (N, C, d1, ...), got a 0-d tensor")
    classes = logits.shape[1] if logits.ndim >= 2 else logits.shape[0]
    probabilities = target.is_floating_point()
    if probabilities:
        if target.shape != logits.shape:
            raise ValueError(f"target of class probabilities must have the logits' shape {tuple(logits.shape)}, "
                             f"got {tuple(target.shape)}")
        if ignore_index != -100:
            raise ValueError("ignore_index is not supported with class-probability targets (floating target)")
    else:
        if target.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"target must hold class indices as int64 or int32, or class probabilities of a "
                            f"floating dtype, got {target.dtype}")
        expected = logits.shape[:1] + logits.shape[2:] if logits.ndim >= 2 else torch.Size()
        if target.shape != expected:
            raise ValueError(f"target must have shape {tuple(expected)} for logits of shape "
                             f"{tuple(logits.shape)}, got {tuple(target.shape)}")
    if classes == 0 and target.numel() > 0:
        raise ValueError(f"logits has no classes (shape {tuple(logits.shape)}): there is nothing to predict from")
    if weight is not None:
        _validate.floating(weight, "weight")
        if weight.shape != (classes,):
            raise ValueError(f"weight must have shape ({classes},), one per class, got {tuple(weight.shape)}")
    _validate.same_device(logits, "logits", target=target, weight=weight)
    _validate.integer(ignore_index, "ignore_index")
    _validate.one_of(reduction, REDUCTIONS, "reduction")
    label_smoothing = _validate.real(label_smoothing, "label_smoothing")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    return classes, label_smoothing, probabilities


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None = None,
                  ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0, *,
                  backend: str | None = None, inplace_backward: bool = False) -> torch.Tensor:
    """Cross-entropy between ``logits`` and ``target``, like ``F.cross_entropy``.

    ``logits`` is (C,), (N, C) or (N, C, d1, ...). ``target`` holds class
    indices (int64/int32, the logits' shape without C) or class probabilities
    (a floating tensor of the logits' shape), as in ``F.cross_entropy``, with
    the same ``weight``, ``ignore_index`` (class indices only), ``reduction``
    and ``label_smoothing``. With class indices only the per-row log-sum-exp is
    kept for the backward, so forward plus backward allocate nothing of the
    logits' size but the gradient.

    ``inplace_backward=True`` has the backward write the gradient into
    ``logits`` itself (no gradient buffer at all): ``logits`` is overwritten by
    the backward and must not be used after it (``logits.grad`` is that same
    memory). The write bumps the logits' version counter, so autograd raises if
    anything else saved them for its own backward. Logits that are not a
    contiguous (N, C) or (C,) tensor are gathered into a contiguous copy first,
    which then holds the gradient. Eager mode and class-index targets only:
    under ``torch.compile`` the gradient gets its own buffer.

    Double backward (``create_graph=True``) works, except with ``inplace_backward``.
    """
    classes, label_smoothing, probabilities = _check(logits, target, weight, ignore_index, reduction,
                                                     label_smoothing)
    _validate.boolean(inplace_backward, "inplace_backward")
    backend = resolve_name(logits.device, logits.dtype, _validate.backend_name(backend))
    if probabilities:
        if inplace_backward:
            raise ValueError("inplace_backward=True is not supported with class-probability targets")
        return _probability_targets(logits, target, weight, reduction, label_smoothing, backend)
    out_dtype = logits.dtype
    stats_dtype = _stats_dtype(logits.dtype)
    if logits.ndim == 1:
        rows_2d, flat_target = logits.unsqueeze(0), target.reshape(1)
    elif logits.ndim == 2:
        rows_2d, flat_target = logits, target
    else:
        rows_2d = logits.movedim(1, -1).reshape(-1, classes)
        flat_target = target.reshape(-1)
    rows_2d = rows_2d.contiguous()
    flat_target = flat_target.contiguous()
    weight32 = weight.to(stats_dtype).contiguous() if weight is not None else None
    weight_sum = weight32.sum().reshape(1) if weight is not None else None
    args = (rows_2d, flat_target, weight32, weight_sum, ignore_index, label_smoothing, backend, reduction, out_dtype)
    if rows_2d.numel() == 0:
        loss = _empty_rows(rows_2d, flat_target, weight32, ignore_index, reduction, stats_dtype).to(out_dtype)
    elif torch.compiler.is_compiling():
        loss = _compiled(*args)
    elif rows_2d.requires_grad and torch.is_grad_enabled():
        loss = _CrossEntropy.apply(*args, inplace_backward)
    else:
        per_row, _ = _forward(rows_2d, flat_target, weight32, ignore_index, label_smoothing, backend)
        loss, _ = _reduce(per_row, reduction, out_dtype)
    return loss.reshape(target.shape) if reduction == "none" else loss


def _probability_targets(logits, target, weight, reduction, label_smoothing, backend):
    """Class-probability targets in differentiable torch ops, computed in float32 (float64 for float64 logits
    or on the ``reference`` backend): ``-sum_c w[c] * q[c] * log_softmax(logits)[c]`` per row with
    ``q = (1 - eps) * target + eps / C``; a mean divides by the number of rows, as torch does."""
    compute = torch.float64 if backend == "reference" else _stats_dtype(logits.dtype)
    log_p = torch.log_softmax(logits.to(compute), 1 if logits.ndim >= 2 else 0)
    q = target.to(compute)
    classes = logits.shape[1] if logits.ndim >= 2 else logits.shape[0]
    if label_smoothing:
        q = (1.0 - label_smoothing) * q + label_smoothing / classes
    if weight is not None:
        shape = (classes,) + (1,) * (logits.ndim - 2) if logits.ndim >= 2 else (classes,)
        q = q * weight.to(compute).reshape(shape)
    per_row = -(q * log_p).sum(1 if logits.ndim >= 2 else 0)
    if reduction == "none":
        loss = per_row
    elif reduction == "sum":
        loss = per_row.sum()
    else:
        loss = per_row.mean() if per_row.numel() else per_row.sum() / 0.0
    return loss.to(logits.dtype)


def _empty_rows(rows_2d, flat_target, weight, ignore_index, reduction, stats_dtype):
    """The loss of logits with no rows, from torch ops: torch's (an empty tensor, 0, or NaN for a mean)."""
    per_row = rows_2d.sum(-1).to(stats_dtype)
    if reduction == "none":
        return per_row
    return per_row.sum() if reduction == "sum" else per_row.sum() / 0.0
