"""cross_entropy with class-index targets: torch.library ops, autograd, public function.

The backends compute per-row losses and keep only the per-row log-sum-exp for
the backward; the reduction is ordinary torch arithmetic on M numbers.
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


def _forward(logits, target, weight, ignore_index, label_smoothing, backend):
    rows, dtype = logits.shape[0], _stats_dtype(logits.dtype)
    loss = torch.empty(rows, dtype=dtype, device=logits.device)
    lse = torch.empty(rows, dtype=dtype, device=logits.device)
    get_backend(backend).kernels("cross_entropy").forward(
        logits, target, weight, loss, lse, ignore_index, label_smoothing)
    return loss, lse


def _backward(logits, target, weight, weight_sum, lse, grad_loss, ignore_index, label_smoothing, backend,
              grad_logits=None):
    if grad_logits is None:
        grad_logits = torch.empty_like(logits)
    get_backend(backend).kernels("cross_entropy").backward(
        logits, target, weight, weight_sum, lse, grad_loss.to(lse.dtype).contiguous(), grad_logits,
        ignore_index, label_smoothing)
    return grad_logits


# -- torch.library ops, used under torch.compile


@torch.library.custom_op("multisoft::cross_entropy_forward", mutates_args=())
def cross_entropy_forward_op(logits: torch.Tensor, target: torch.Tensor, weight: Optional[torch.Tensor],
                             weight_sum: Optional[torch.Tensor], ignore_index: int, label_smoothing: float,
                             backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    return _forward(logits, target, weight, ignore_index, label_smoothing, backend)


@cross_entropy_forward_op.register_fake
def _(logits, target, weight, weight_sum, ignore_index, label_smoothing, backend):
    rows, dtype = logits.shape[0], _stats_dtype(logits.dtype)
    return logits.new_empty(rows, dtype=dtype), logits.new_empty(rows, dtype=dtype)


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


def _op_backward(ctx, grad_loss, _grad_lse):
    logits, target, weight, weight_sum, lse = ctx.saved_tensors
    grad = cross_entropy_backward_op(logits, target, weight, weight_sum, lse, grad_loss,
                                     ctx.ignore_index, ctx.label_smoothing, ctx.backend)
    return grad, None, None, None, None, None, None


cross_entropy_forward_op.register_autograd(_op_backward, setup_context=_setup_context)


# -- autograd Functions, the eager path


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, weight, weight_sum, ignore_index, label_smoothing, backend):
        loss, lse = _forward(logits, target, weight, ignore_index, label_smoothing, backend)
        ctx.args = (ignore_index, label_smoothing, backend)
        ctx.save_for_backward(logits, target, weight, weight_sum, lse)
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss):
        logits, target, weight, weight_sum, lse = ctx.saved_tensors
        grad = _backward(logits, target, weight, weight_sum, lse, grad_loss, *ctx.args)
        return grad, None, None, None, None, None, None


class _CrossEntropyInPlace(torch.autograd.Function):
    """Writes the gradient for ``expected_grad_loss`` into the logits during the forward."""

    @staticmethod
    def forward(ctx, logits, target, weight, weight_sum, ignore_index, label_smoothing, backend,
                expected_grad_loss):
        buffer = logits.detach()
        loss, lse = _forward(buffer, target, weight, ignore_index, label_smoothing, backend)
        _backward(buffer, target, weight, weight_sum, lse, expected_grad_loss, ignore_index, label_smoothing,
                  backend, grad_logits=buffer)
        ctx.save_for_backward(buffer, expected_grad_loss)
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss):
        buffer, expected = ctx.saved_tensors
        if not torch.equal(grad_loss, expected):
            scale = torch.where(expected == 0, 0.0, grad_loss / expected)
            buffer.mul_(scale.unsqueeze(1).to(buffer.dtype))
        return buffer, None, None, None, None, None, None, None


def _check(logits, target, weight, ignore_index, reduction, label_smoothing):
    _validate.floating(logits, "logits")
    _validate.tensor(target, "target")
    if target.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"target must hold class indices as int64 or int32, got {target.dtype}")
    if logits.ndim == 0:
        raise ValueError("logits must have shape (C,), (N, C) or (N, C, d1, ...), got a 0-d tensor")
    expected = logits.shape[:1] + logits.shape[2:] if logits.ndim >= 2 else torch.Size()
    if target.shape != expected:
        raise ValueError(f"target must have shape {tuple(expected)} for logits of shape {tuple(logits.shape)}, "
                         f"got {tuple(target.shape)}")
    classes = logits.shape[1] if logits.ndim >= 2 else logits.shape[0]
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
    return classes, label_smoothing


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, *, weight: torch.Tensor | None = None,
                  ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0,
                  backend: str | None = None, inplace_backward: bool = False) -> torch.Tensor:
    """Cross-entropy between ``logits`` and class-index ``target``, like ``F.cross_entropy``.

    ``logits`` is (C,), (N, C) or (N, C, d1, ...); ``target`` int64/int32 of the
    matching shape. Only the per-row log-sum-exp is kept for the backward, so
    forward plus backward allocate nothing of the logits' size but the gradient.

    ``inplace_backward=True`` computes the gradient during the forward and
    writes it into ``logits`` itself (no gradient buffer at all): ``logits`` is
    overwritten and must not be used afterwards. Eager mode only.
    """
    classes, label_smoothing = _check(logits, target, weight, ignore_index, reduction, label_smoothing)
    _validate.boolean(inplace_backward, "inplace_backward")
    out_dtype = logits.dtype
    stats_dtype = _stats_dtype(logits.dtype)
    if logits.ndim == 1:
        rows_2d, flat_target = logits.unsqueeze(0), target.reshape(1)
    elif logits.ndim == 2:
        rows_2d, flat_target = logits, target
    else:
        rows_2d = logits.movedim(1, -1).reshape(-1, classes)
        flat_target = target.reshape(-1)
    backend = resolve_name(logits.device, logits.dtype, backend)
    rows_2d = rows_2d.contiguous()
    flat_target = flat_target.contiguous()
    weight32 = weight.to(stats_dtype).contiguous() if weight is not None else None
    weight_sum = weight32.sum().reshape(1) if weight is not None else None
    if reduction == "mean":
        valid = flat_target != ignore_index
        if weight32 is None:
            denominator = valid.sum().to(stats_dtype)
        else:
            denominator = (weight32[flat_target.clamp(0, max(classes - 1, 0)).long()] * valid).sum()
    if rows_2d.numel() == 0:
        per_row = rows_2d.sum(-1).to(stats_dtype)
    elif inplace_backward and not torch.compiler.is_compiling():
        if reduction == "mean":
            expected = (1.0 / denominator).expand(rows_2d.shape[0]).contiguous()
        else:
            expected = torch.ones(rows_2d.shape[0], dtype=stats_dtype, device=logits.device)
        per_row = _CrossEntropyInPlace.apply(rows_2d, flat_target, weight32, weight_sum, ignore_index,
                                             label_smoothing, backend, expected)
    elif torch.compiler.is_compiling():
        per_row, _ = cross_entropy_forward_op(rows_2d, flat_target, weight32, weight_sum, ignore_index,
                                              label_smoothing, backend)
    elif rows_2d.requires_grad and torch.is_grad_enabled():
        per_row = _CrossEntropy.apply(rows_2d, flat_target, weight32, weight_sum, ignore_index,
                                      label_smoothing, backend)
    else:
        per_row, _ = _forward(rows_2d, flat_target, weight32, ignore_index, label_smoothing, backend)
    if reduction == "none":
        return per_row.reshape(target.shape).to(out_dtype)
    if reduction == "sum":
        return per_row.sum().to(out_dtype)
    return (per_row.sum() / denominator).to(out_dtype)
