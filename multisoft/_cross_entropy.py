"""cross_entropy: autograd, torch.library ops, public function.

For a reduced loss over class-index targets the gradient is computed in the forward, by the same
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

``reduction="none"`` over class indices (per-token losses, whose incoming gradients are unknown until the
backward) takes ``_PerRowCrossEntropy`` instead: the forward reads the logits once for each row's loss, lse, max
and sum of exponentials, and the backward has the backend's ``gradient`` write the gradient of the incoming
per-row gradients from those (one read, one write): three passes in all, where a gradient written in the forward
and then scaled costs four, and a 16-bit gradient is rounded once, not twice.

Under torch.compile, class-index targets go through ``cross_entropy_rows_op``
instead: the kernel only reads the logits, for each row's loss, lse, max and
sum of exponentials, and the backward graph computes the gradient from the
logits and those in torch ops, which the compiler fuses into one elementwise
pass (three passes over the logits in all, where a gradient written in the
forward would cost the compiled backward a copy of it: four).
"""

from __future__ import annotations

from typing import Optional

import torch

from . import _validate
from ._forward_ad import refuse_tangents, refuse_transforms
from ._loss_rules import (LossOptions, add_lse_gradient, backward_scale, broadcast_value, check_classes,
                          check_logits_and_target, check_targets_in_bounds, check_weight, denominator,
                          double_backward_error, empty_rows, folds_mean, gradient_coefficients, inplace_lse_error,
                          is_dtensor, kernel_inputs, legacy_reduction, loss_options, reduce_rows,
                          refuse_inplace_on_a_leaf, run_eagerly, scale_by_incoming, second_backward_error,
                          shaped_result, stats_dtype, target_terms)
from ._registry import get_backend, resolve_name


def _kernel_forward(logits, target, weight, options: LossOptions, backend, want_grad, grad_logits=None,
                    separate=False, fold_mean=True):
    """Runs the backend's forward; returns (loss reduced, lse, grad_logits or None, what the backward must multiply
    the incoming gradient by (``backward_scale``), or None).

    One (3, M) allocation holds the per-row losses, row weights and lse (each allocation costs host time), or
    with ``separate`` (a custom op's outputs must not alias) three. With ``want_grad`` the gradient is written
    into ``grad_logits`` (a new buffer when None) scaled by the reduction's grad_scale: for a mean 1 / its
    denominator, unless ``fold_mean`` is False (then 1, and the backward's scale is returned)."""
    if target.is_floating_point():
        return _probabilities_forward(logits, target, weight, options, backend, want_grad, separate, fold_mean)
    rows, dtype, mean = logits.shape[0], stats_dtype(logits.dtype), options.reduction == "mean"
    check_targets_in_bounds(target, logits.shape[1], options.ignore_index)
    if separate:
        loss_rows, row_weight, lse = (torch.empty(rows, dtype=dtype, device=logits.device) for _ in range(3))
    else:
        loss_rows, row_weight, lse = torch.empty((3, rows), dtype=dtype, device=logits.device).unbind()
    mean_denominator = grad_scale = None
    if mean:
        mean_denominator = denominator(target, weight, options.ignore_index, logits.shape[1], dtype)
    if want_grad:
        if mean and fold_mean:
            grad_scale = mean_denominator.reciprocal().expand(rows)
        else:
            grad_scale = broadcast_value(rows, dtype, logits.device)
        if grad_logits is None:
            grad_logits = torch.empty_like(logits)
    get_backend(backend).kernels("cross_entropy").forward(
        logits, target, weight, loss_rows, lse, row_weight, grad_logits if want_grad else None, grad_scale, options)
    loss = reduce_rows(loss_rows, options.reduction, mean_denominator)
    unfolded = backward_scale(mean_denominator) if want_grad and mean and not fold_mean else None
    return loss, lse, grad_logits if want_grad else None, unfolded


def _probabilities_forward(logits, target, weight, options: LossOptions, backend, want_grad, separate,
                           fold_mean=True):
    """_kernel_forward of class-probability targets (M, C), of the logits' dtype: the backend's
    probabilities_forward; a mean divides by the number of rows, as torch's does for probabilities."""
    rows, dtype = logits.shape[0], stats_dtype(logits.dtype)
    if separate:
        loss_rows, lse = (torch.empty(rows, dtype=dtype, device=logits.device) for _ in range(2))
    else:
        loss_rows, lse = torch.empty((2, rows), dtype=dtype, device=logits.device).unbind()
    grad_logits = grad_scale = None
    mean = options.reduction == "mean"
    fold = mean and fold_mean
    if want_grad:
        grad_scale = broadcast_value(rows, dtype, logits.device, 1.0 / rows if fold else 1.0)
        grad_logits = torch.empty_like(logits)
    get_backend(backend).kernels("cross_entropy").probabilities_forward(
        logits, target, weight, loss_rows, lse, grad_logits, grad_scale, options)
    loss = reduce_rows(loss_rows, options.reduction, rows)
    return loss, lse, grad_logits, 1.0 / rows if want_grad and mean and not fold else None


# -- autograd Function, the eager path: the kernels and the reduction inside, so that a reduced loss's gradient
# reaches the buffer as one value


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, weight, options: LossOptions, backend, return_lse, inplace):
        loss, lse, grad_logits, ctx.backward_scale = _kernel_forward(
            logits, target, weight, options, backend, True, grad_logits=logits if inplace else None,
            fold_mean=folds_mean(logits.dtype))
        if inplace:
            # The kernel wrote through a raw pointer: tell autograd, so that any op that saved the logits' old
            # values raises in its backward instead of reading the gradient.
            torch.autograd.graph.increment_version(logits)
            grad_logits = logits.detach()
        ctx.buffer, ctx.backend = grad_logits, backend
        if not return_lse:
            return loss
        ctx.set_materialize_grads(False)
        ctx.softcap, ctx.inplace = options.softcap, inplace
        if not inplace:
            ctx.save_for_backward(logits)
        return loss, lse

    @staticmethod
    def backward(ctx, grad, grad_lse=None):
        if torch.is_grad_enabled():
            raise double_backward_error("cross_entropy")
        grad_logits, ctx.buffer = ctx.buffer, None
        if grad_logits is None:
            raise second_backward_error("cross_entropy")
        if grad is None:
            grad_logits = None
        else:
            scale_by_incoming(grad_logits, grad if ctx.backward_scale is None else grad * ctx.backward_scale,
                              ctx.backend)
        if grad_lse is not None:
            if ctx.inplace:
                raise inplace_lse_error("cross_entropy")
            (logits,) = ctx.saved_tensors
            grad_logits = add_lse_gradient(grad_logits, logits, grad_lse, ctx.softcap)
        return grad_logits, None, None, None, None, None, None


class _PerRowCrossEntropy(torch.autograd.Function):
    """``reduction="none"`` over class indices (module docstring): the forward keeps the logits and O(rows)
    statistics, the backward writes the gradient once from them."""

    @staticmethod
    def forward(ctx, logits, target, weight, options: LossOptions, backend):
        check_targets_in_bounds(target, logits.shape[1], options.ignore_index)
        rows, dtype = logits.shape[0], stats_dtype(logits.dtype)
        loss_rows, lse, row_weight = torch.empty((3, rows), dtype=dtype, device=logits.device).unbind()
        row_stats = torch.empty((3, rows), dtype=dtype, device=logits.device)
        get_backend(backend).kernels("cross_entropy").forward(
            logits, target, weight, loss_rows, lse, row_weight, None, None, options, row_stats=row_stats)
        ctx.options, ctx.backend = options, backend
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(logits, target, weight, lse, row_stats)
        return loss_rows, lse

    @staticmethod
    def backward(ctx, grad, grad_lse):
        if torch.is_grad_enabled():
            raise double_backward_error("cross_entropy")
        if grad is None and grad_lse is None:
            return None, None, None, None, None
        logits, target, weight, lse, row_stats = ctx.saved_tensors
        options, classes = ctx.options, logits.shape[1]
        grad_rows = grad.reshape(-1).to(lse.dtype) if grad is not None else torch.zeros_like(lse)
        at_all, at_target, per_class = gradient_coefficients(target_terms(target, weight, classes, options), lse,
                                                             grad_rows, classes, options)
        if grad_lse is not None:
            at_all = at_all + grad_lse.reshape(-1).to(lse.dtype)
        grad_logits = torch.empty_like(logits)
        get_backend(ctx.backend).kernels("cross_entropy").gradient(
            logits, target, weight if options.label_smoothing else None, row_stats[:2],
            torch.stack((at_all, at_target, per_class)), grad_logits, options)
        return grad_logits, None, None, None, None


# -- torch.library ops for class-probability targets under torch.compile: a forward that returns the loss, the lse
# and the gradient buffer, and a backward that scales a copy of that buffer. Their signatures take the
# LossOptions field by field, in its order (torch.library takes no record).


@torch.library.custom_op("multisoft::cross_entropy_forward", mutates_args=())
def cross_entropy_forward_op(logits: torch.Tensor, target: torch.Tensor, weight: Optional[torch.Tensor],
                             ignore_index: int, reduction: str, label_smoothing: float, softcap: float,
                             lse_square_scale: float, temperature: float, want_grad: bool, return_lse: bool,
                             backend: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    options = LossOptions(ignore_index, reduction, label_smoothing, softcap, lse_square_scale, temperature)
    loss, lse, grad_logits, _ = _kernel_forward(logits, target, weight, options, backend, want_grad, separate=True)
    return loss, lse, grad_logits if grad_logits is not None else logits.new_empty(0)


@cross_entropy_forward_op.register_fake
def _(logits, target, weight, ignore_index, reduction, label_smoothing, softcap, lse_square_scale, temperature,
      want_grad, return_lse, backend):
    rows, dtype = logits.shape[0], stats_dtype(logits.dtype)
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
    logits, _, _, _, ctx.reduction, _, ctx.softcap, _, _, _, return_lse, ctx.backend = inputs
    ctx.save_for_backward(output[2], logits if return_lse else None)  # the logits only to differentiate lse


def _op_backward(ctx, grad, grad_lse, _grad_buffer):
    grad_logits, logits = ctx.saved_tensors
    factor = grad.reshape(1) if ctx.reduction != "none" else grad.contiguous()
    grad_logits = cross_entropy_scale_op(grad_logits, factor, ctx.backend)
    if logits is not None and grad_lse is not None:
        grad_logits = add_lse_gradient(grad_logits, logits, grad_lse, ctx.softcap)
    return grad_logits, None, None, None, None, None, None, None, None, None, None, None


cross_entropy_forward_op.register_autograd(_op_backward, setup_context=_setup_context)


# -- torch.library op for class-index targets under torch.compile: the kernel reads the logits once for each row's
# loss, lse and (max, sum of exponentials); the gradient is then computed in the backward graph by torch ops that
# torch.compile fuses into one elementwise pass (read the logits, write the gradient). Two reads and one write in
# all, the most a compiled graph can do here: a gradient written in the forward would cost the backward a copy
# (an op may not scale a saved buffer in place there), four passes.


@torch.library.custom_op("multisoft::cross_entropy_rows", mutates_args=())
def cross_entropy_rows_op(logits: torch.Tensor, target: torch.Tensor, weight: Optional[torch.Tensor],
                          ignore_index: int, reduction: str, label_smoothing: float, softcap: float,
                          lse_square_scale: float, temperature: float, backend: str
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's loss, lse and (3, M) statistics (max m of the capped logits u, sum S of exp(u - m), and a third
    row the backward does not use): the backend's forward, without a gradient (``reduction`` is not used)."""
    check_targets_in_bounds(target, logits.shape[1], ignore_index)
    rows, dtype = logits.shape[0], stats_dtype(logits.dtype)
    loss_rows, lse, row_weight = (torch.empty(rows, dtype=dtype, device=logits.device) for _ in range(3))
    row_stats = torch.empty((3, rows), dtype=dtype, device=logits.device)
    options = LossOptions(ignore_index, reduction, label_smoothing, softcap, lse_square_scale, temperature)
    get_backend(backend).kernels("cross_entropy").forward(
        logits, target, weight, loss_rows, lse, row_weight, None, None, options, row_stats=row_stats)
    return loss_rows, lse, row_stats


@cross_entropy_rows_op.register_fake
def _(logits, target, weight, ignore_index, reduction, label_smoothing, softcap, lse_square_scale, temperature,
      backend):
    rows, dtype = logits.shape[0], stats_dtype(logits.dtype)
    return (logits.new_empty(rows, dtype=dtype), logits.new_empty(rows, dtype=dtype),
            logits.new_empty((3, rows), dtype=dtype))


def _rows_setup_context(ctx, inputs, output):
    logits, target, weight, *options, _ = inputs
    ctx.options = LossOptions(*options)
    _, lse, row_stats = output
    ctx.save_for_backward(logits, target, weight, lse, row_stats)


def _rows_backward(ctx, grad_loss_rows, grad_lse, _grad_row_stats):
    logits, target, weight, lse, row_stats = ctx.saved_tensors
    grad = _rows_gradient(logits, target, weight, lse, row_stats, grad_loss_rows, grad_lse, ctx.options)
    return (grad, *(None,) * (len(LossOptions._fields) + 3))


def _rows_gradient(logits, target, weight, lse, row_stats, grad_loss_rows, grad_lse, options: LossOptions):
    """d (sum_i g_i * loss_i + sum_i h_i * lse_i) / d logits in torch ops, computed in the statistics' dtype:
    du/dx * (a * p - b * [j == t] - c * w_j) with p = exp(u - m) / S, a, b, c the loss's coefficients times g
    (gradient_coefficients), and h added to a after an ignored row's are zeroed."""
    classes, softcap = logits.shape[1], options.softcap
    terms = target_terms(target, weight, classes, options)
    at_all, at_target, per_class = gradient_coefficients(terms, lse, grad_loss_rows, classes, options)
    if grad_lse is not None:
        at_all = at_all + grad_lse
    u = logits.to(lse.dtype)
    if softcap:
        u = torch.tanh(u / softcap) * softcap
    row_max, row_sum = row_stats[0].unsqueeze(1), row_stats[1].unsqueeze(1)
    columns = torch.arange(classes, device=logits.device)
    grad = (u - row_max).exp() / row_sum * at_all.unsqueeze(1)
    grad = grad - torch.where(columns == target.unsqueeze(1), at_target.unsqueeze(1), 0.0)
    if options.label_smoothing:
        grad = grad - per_class.unsqueeze(1) * (weight if weight is not None else 1.0)
    if softcap:
        grad = grad * (1.0 - (u / softcap).square())
    return grad.to(logits.dtype)


cross_entropy_rows_op.register_autograd(_rows_backward, setup_context=_rows_setup_context)


def _check_arguments(logits, target, weight, options: LossOptions, return_lse, inplace_backward) -> tuple[int, bool]:
    """The tensors' checks, and the flags'; returns (the number of classes, class-probability targets?)."""
    classes, probabilities = check_logits_and_target(logits, target)
    if probabilities and options.ignore_index != -100:
        raise ValueError("ignore_index is not supported with class-probability targets (floating target)")
    check_classes(classes, logits, target)
    check_weight(weight, classes, logits, differentiable=probabilities)
    _validate.same_device(logits, "input", target=target, weight=weight)
    _validate.boolean(return_lse, "return_lse")
    _validate.boolean(inplace_backward, "inplace_backward")
    return classes, probabilities


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
    options = loss_options(ignore_index, reduction, label_smoothing, softcap, lse_square_scale)
    if process_group is not None or is_dtensor(input):
        from . import vocab_parallel

        return run_eagerly(vocab_parallel.cross_entropy, input, target, weight, options, return_lse, backend,
                           inplace_backward, process_group)
    classes, probabilities = _check_arguments(input, target, weight, options, return_lse, inplace_backward)
    logits = input
    backend = resolve_name(logits.device, logits.dtype, _validate.backend_name(backend), "cross_entropy")
    if probabilities:
        if inplace_backward:
            raise ValueError("inplace_backward=True is not supported with class-probability targets")
        if (target.requires_grad or weight is not None and weight.requires_grad) and torch.is_grad_enabled():
            loss, lse = _probability_targets(logits, target, weight, options, backend)
            return (loss, lse) if return_lse else loss
        logits, target = _probability_dtypes(logits, target)
    rows_2d, flat_target, weight, dtype = kernel_inputs(logits, target, weight, options.ignore_index)
    if rows_2d.numel() == 0:
        loss, lse = empty_rows(rows_2d, options.reduction, dtype)
    elif torch.compiler.is_compiling() and not probabilities:
        loss_rows, lse, _ = cross_entropy_rows_op(rows_2d, flat_target, weight, *options, backend)
        mean_denominator = None
        if options.reduction == "mean":
            mean_denominator = denominator(flat_target, weight, options.ignore_index, classes, loss_rows.dtype)
        loss = reduce_rows(loss_rows, options.reduction, mean_denominator)
    elif torch.compiler.is_compiling():
        want_grad = rows_2d.requires_grad and torch.is_grad_enabled()
        loss, lse, _ = cross_entropy_forward_op(rows_2d, flat_target, weight, *options, want_grad, return_lse,
                                                backend)
    elif (rows_2d.requires_grad and torch.is_grad_enabled() and options.reduction == "none" and not probabilities
          and not inplace_backward):
        loss, lse = _PerRowCrossEntropy.apply(rows_2d, flat_target, weight, options, backend)
    elif rows_2d.requires_grad and torch.is_grad_enabled():
        result = _CrossEntropy.apply(rows_2d, flat_target, weight, options, backend, return_lse, inplace_backward)
        loss, lse = result if return_lse else (result, None)
    else:
        loss, lse, _, _ = _kernel_forward(rows_2d, flat_target, weight, options, backend, False)
    return shaped_result(loss, lse, logits, options.reduction, return_lse)


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


def _probability_targets(logits, target, weight, options: LossOptions, backend):
    """(loss, lse) of class-probability targets that require grad themselves (soft labels being learned), in
    differentiable torch ops, computed in float32 (float64 for
    float64 logits or on the ``reference`` backend): ``-sum_c w[c] * q[c] * log_softmax(u)[c] + s * lse(u)**2``
    per row with ``q = (1 - eps) * target + eps / C`` and u the capped logits; a mean divides by the number of
    rows, as torch does."""
    out_dtype = stats_dtype(logits.dtype)
    compute = torch.float64 if backend == "reference" else out_dtype
    class_dim = 1 if logits.ndim >= 2 else 0
    u = logits.to(compute)
    if options.softcap:
        u = options.softcap * torch.tanh(u / options.softcap)
    lse = torch.logsumexp(u, class_dim)
    log_p = u - lse.unsqueeze(class_dim)
    q = target.to(compute)
    classes = logits.shape[class_dim]
    if options.label_smoothing:
        q = (1.0 - options.label_smoothing) * q + options.label_smoothing / classes
    if weight is not None:
        shape = (classes,) + (1,) * (logits.ndim - 2) if logits.ndim >= 2 else (classes,)
        q = q * weight.to(compute).reshape(shape)
    per_row = -(q * log_p).sum(class_dim)
    if options.lse_square_scale:
        per_row = per_row + options.lse_square_scale * lse.square()
    loss = reduce_rows(per_row, options.reduction, per_row.numel())
    return loss.to(out_dtype), lse.to(out_dtype)
