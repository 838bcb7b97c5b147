"""linear_cross_entropy: the cross-entropy of ``F.linear(input, linear_weight, linear_bias)`` without its logits.

A language model's last layer turns M hidden states of size H into M x V
logits (V the vocabulary): at M = 8192 and V = 128k that is 2 GiB in bf16,
and the logits' gradient as much again. Here the rows go a chunk at a time:

    logits = input[chunk] @ linear_weight.T (+ linear_bias)        torch (cuBLAS), in the input's dtype
    backend forward(logits, ..., grad_logits=logits, grad_scale)   one kernel call: loss, lse and, in place,
                                                                   the logits' gradient
    grad_input[chunk] = grad_logits @ linear_weight                torch
    grad_weight += grad_logits.T @ input[chunk]                    torch
    grad_bias += grad_logits.sum(0)

so only one chunk of logits exists at a time (one buffer, reused by every
chunk). ``grad_scale`` is a mean's 1 / denominator, computed from all the
targets before the first chunk, so each chunk's gradient is already the final
one for an incoming gradient of 1. With a reduced loss all of this happens in
the forward (as Liger-Kernel's fused linear cross-entropy does): autograd keeps
the gradients of input, linear_weight and linear_bias (O(M·H + V·H), nothing of
size M·V), and the backward multiplies them by the incoming gradient with the
backend's ``scale``, which on a GPU backend reads that gradient on the device
and returns at once when it is exactly 1 (no pass over the gradients, no host
synchronisation); elsewhere it is one in-place pass per gradient.

``reduction="none"`` cannot fold the incoming per-row gradients in beforehand:
its forward computes the loss only, and its backward runs the chunk loop again
with ``grad_scale`` = the incoming gradient (which the kernel then applies per
row): the logits' matmul twice, four matmuls of M·V·H in all instead of three.
A gradient through a returned lse is computed the same way, in the backward
(``p * du/dx`` per chunk in float32 torch ops).

The weight's gradient is accumulated over the chunks in the weight's dtype by
``addmm_`` (cuBLAS adds each chunk's product to it in float32 and rounds once a
chunk): a float32 copy of a 16-bit V x H gradient would cost more memory than
the chunk of logits and a pass over it a chunk (docs/tuning.md). With k chunks a
16-bit weight's gradient is rounded k times instead of once; one chunk is a
single matmul, as ``F.linear``'s backward computes it. The bias's gradient is
summed in float32 (it is only V values).

With ``process_group`` (vocabulary-parallel) each rank holds a slice of the
output layer's rows, so its chunk of logits is a slice of the classes: the
backend's forward is replaced per chunk by ``vocab_parallel.LinearChunks``
(pass 1, one all-gather of 4 floats a row, the combine, pass 2 in place), and
the input's gradient, a sum over the ranks, is all-reduced once after the last
chunk. Every rank runs as many chunks (the default chunk takes the widest
rank's width).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

from . import _validate
from ._cross_entropy import cross_entropy
from ._forward_ad import refuse_tangents, refuse_transforms
from ._linear_chunks import autocast_linear, check_linear_layer, chunk_pass, default_chunk_rows
from ._loss_rules import (LossOptions, broadcast_value, check_targets_in_bounds, check_weight, denominator,
                          double_backward_error, index_targets, loss_options, lse_gradient, reduce_rows,
                          run_eagerly, second_backward_error, stats_dtype)
from ._registry import get_backend, resolve_name


class _Plan(NamedTuple):
    """What one call's chunk passes run with, passed as one value through the autograd Function."""
    options: LossOptions
    backend: str
    chunk_rows: int
    vocab_slice: object = None  # vocabulary-parallel: this rank's slice of the classes (a vocab_parallel.VocabSlice)


class _WholeChunks:
    """The per-chunk step over all the classes: ``step(logits, rows)`` takes the (chunk, V) logits of the rows
    ``rows`` (a slice of all M), runs the backend's forward on them (writing the rows' loss and lse into
    ``stats``, and with ``grad_scale`` their gradient times it in place of the logits) and adds ``grad_lse``'s
    part of the gradient (computed from the logits before the kernel overwrites them). ``stats`` (loss_rows,
    lse, row_weight), each (M,), or None without a loss to compute; ``grad_scale`` and ``grad_lse`` (M,) or
    None."""

    def __init__(self, target, weight, plan: _Plan, stats, grad_scale=None, grad_lse=None):
        self.target, self.weight, self.options, self.stats = target, weight, plan.options, stats
        self.grad_scale, self.grad_lse = grad_scale, grad_lse
        self.kernels = get_backend(plan.backend).kernels("cross_entropy")

    def __call__(self, logits, rows: slice) -> None:
        options, grad_scale = self.options, self.grad_scale
        check_targets_in_bounds(self.target[rows], logits.shape[1], options.ignore_index)
        lse_part = lse_gradient(logits, self.grad_lse[rows], options.softcap) if self.grad_lse is not None else None
        if self.stats is not None:
            loss_rows, lse, row_weight = self.stats
            self.kernels.forward(logits, self.target[rows], self.weight, loss_rows[rows], lse[rows], row_weight[rows],
                                 logits if grad_scale is not None else None,
                                 grad_scale[rows] if grad_scale is not None else None, options)
        if lse_part is not None:
            if grad_scale is not None:
                logits.add_(lse_part)
            else:
                logits.copy_(lse_part)

    @staticmethod
    def input_gradient(grad_input):
        return grad_input


def _stats(rows, dtype, device, separate=False):
    """(loss_rows, lse, row_weight): one (3, M) allocation, or three (a custom op's outputs must not alias)."""
    if separate:
        return tuple(torch.empty(rows, dtype=dtype, device=device) for _ in range(3))
    return tuple(torch.empty((3, rows), dtype=dtype, device=device).unbind())


def _sliced_chunks(target, weight, plan: _Plan, row_max_sum, **kwargs):
    """The vocabulary-parallel step (``vocab_parallel.LinearChunks``) of this plan."""
    from .vocab_parallel import LinearChunks

    return LinearChunks(target, weight, plan.vocab_slice, plan.options, plan.backend, row_max_sum, **kwargs)


def _forward(input2d, linear_weight, linear_bias, target, weight, plan: _Plan, want, separate=False):
    """(loss reduced, every row's lse, the gradients of input, linear_weight and linear_bias where ``want`` asks
    and the loss is reduced (for an incoming gradient of 1), and with a slice of the classes the whole rows'
    (2, M) max and sum of exponentials, else None)."""
    rows, dtype, device = input2d.shape[0], stats_dtype(input2d.dtype), input2d.device
    options = plan.options
    classes = plan.vocab_slice.total if plan.vocab_slice is not None else linear_weight.shape[0]
    mean_denominator = grad_scale = None
    with_grad = any(want) and options.reduction != "none"
    if options.reduction == "mean":
        mean_denominator = denominator(target, weight, options.ignore_index, classes, dtype)
        if with_grad:
            grad_scale = mean_denominator.reciprocal().expand(rows)
    elif with_grad:
        grad_scale = broadcast_value(rows, dtype, device)
    stats = _stats(rows, dtype, device, separate)
    row_max_sum = None
    if plan.vocab_slice is None:
        step = _WholeChunks(target, weight, plan, stats, grad_scale)
    else:
        row_max_sum = torch.empty((2, rows), dtype=dtype, device=device)
        step = _sliced_chunks(target, weight, plan, row_max_sum, loss_rows=stats[0], lse=stats[1],
                              grad_scale=grad_scale)
    grads = chunk_pass(input2d, linear_weight, linear_bias, plan.chunk_rows, step,
                       want if with_grad else (False, False, False))
    loss_rows, lse, _ = stats
    return reduce_rows(loss_rows, options.reduction, mean_denominator), lse, grads, row_max_sum


def _per_row_factor(grad, dtype):
    """A reduction="none" loss's incoming gradient as the kernel's grad_scale: (M,), contiguous or one value at
    stride 0 (as ``loss.sum().backward()`` gives)."""
    flat = grad.reshape(-1).to(dtype)
    return flat if flat.is_contiguous() or not any(flat.stride()) else flat.contiguous()


def _recompute(input2d, linear_weight, linear_bias, target, weight, row_max_sum, plan: _Plan, want, grad, grad_lse):
    """The backward's own chunk pass: the loss's gradient times ``grad`` per row (reduction="none"; None: no
    gradient of the loss) plus the lse's gradient (``grad_lse``, or None). With a slice of the classes
    ``row_max_sum`` is the forward's whole rows' max and sum, so that nothing is gathered again."""
    dtype = stats_dtype(input2d.dtype)
    grad_scale = _per_row_factor(grad, dtype) if grad is not None else None
    grad_lse = grad_lse.reshape(-1).to(dtype) if grad_lse is not None else None
    if grad_scale is None and grad_lse is None:
        return None, None, None
    if plan.vocab_slice is None:
        stats = _stats(input2d.shape[0], dtype, input2d.device) if grad_scale is not None else None
        step = _WholeChunks(target, weight, plan, stats, grad_scale, grad_lse)
    else:
        step = _sliced_chunks(target, weight, plan, row_max_sum, grad_scale=grad_scale, grad_lse=grad_lse)
    return chunk_pass(input2d, linear_weight, linear_bias, plan.chunk_rows, step, want)


def _add(grads, more):
    return tuple(g if m is None else (m if g is None else g.add_(m)) for g, m in zip(grads, more))


def _scale_in_place(grads, grad, backend):
    """Every gradient *= the reduced loss's incoming gradient (0-d), by the backend's ``scale`` (which leaves
    them untouched, without a host synchronisation, where that gradient is exactly 1)."""
    factor = grad.reshape(1)
    scale = get_backend(backend).kernels("cross_entropy").scale
    for g in grads:
        if g is not None and g.numel():  # a rank without classes has empty gradients of linear_weight/linear_bias
            scale(g.view(-1, g.shape[-1]), factor)
    return grads


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input2d, linear_weight, linear_bias, target, weight, plan: _Plan, want, return_lse):
        loss, lse, grads, row_max_sum = _forward(input2d, linear_weight, linear_bias, target, weight, plan, want)
        ctx.plan, ctx.want, ctx.grads = plan, want, grads
        ctx.set_materialize_grads(False)
        if plan.options.reduction == "none" or return_lse:
            ctx.save_for_backward(input2d, linear_weight, linear_bias, target, weight, row_max_sum)
        return (loss, lse) if return_lse else loss

    @staticmethod
    def backward(ctx, grad, grad_lse=None):
        if torch.is_grad_enabled():
            raise double_backward_error("linear_cross_entropy")
        plan = ctx.plan
        if plan.options.reduction == "none":
            grads = _recompute(*ctx.saved_tensors, plan, ctx.want, grad, grad_lse)
        else:
            grads, ctx.grads = ctx.grads, None
            if grads is None:
                raise second_backward_error("linear_cross_entropy")
            grads = _scale_in_place(grads, grad, plan.backend) if grad is not None else (None, None, None)
            if grad_lse is not None:
                grads = _add(grads, _recompute(*ctx.saved_tensors, plan, ctx.want, None, grad_lse))
        return (*grads, None, None, None, None, None)


# -- torch.library ops, used under torch.compile: the whole chunk loop is one op (forward: loss, lse and, for a
# reduced loss, the three gradients; backward: the recomputing pass), the incoming gradient applied by a torch
# multiplication (one pass over each gradient, where the eager path skips a gradient of 1). Their signatures take
# the LossOptions field by field, in its order, then the backend and the chunk's rows (torch.library takes no
# record).


def _placeholder(grad, like):
    return grad if grad is not None else like.new_empty(0)


@torch.library.custom_op("multisoft::linear_cross_entropy_forward", mutates_args=())
def linear_cross_entropy_forward_op(
        input2d: torch.Tensor, linear_weight: torch.Tensor, linear_bias: Optional[torch.Tensor],
        target: torch.Tensor, weight: Optional[torch.Tensor], ignore_index: int, reduction: str,
        label_smoothing: float, softcap: float, lse_square_scale: float, temperature: float, backend: str,
        chunk_rows: int, want_input: bool, want_weight: bool, want_bias: bool, return_lse: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    options = LossOptions(ignore_index, reduction, label_smoothing, softcap, lse_square_scale, temperature)
    plan = _Plan(options, backend, chunk_rows)
    loss, lse, grads, _ = _forward(input2d, linear_weight, linear_bias, target, weight, plan,
                                   (want_input, want_weight, want_bias), separate=True)
    return loss, lse, *(_placeholder(g, input2d) for g in grads)


def _fake_grads(input2d, linear_weight, linear_bias, want):
    likes = (input2d, linear_weight, linear_bias)
    return tuple(torch.empty_like(like) if wanted else input2d.new_empty(0) for like, wanted in zip(likes, want))


@linear_cross_entropy_forward_op.register_fake
def _(input2d, linear_weight, linear_bias, target, weight, ignore_index, reduction, label_smoothing, softcap,
      lse_square_scale, temperature, backend, chunk_rows, want_input, want_weight, want_bias, return_lse):
    rows, dtype = input2d.shape[0], stats_dtype(input2d.dtype)
    loss = input2d.new_empty(rows if reduction == "none" else (), dtype=dtype)
    want = (want_input, want_weight, want_bias) if reduction != "none" else (False, False, False)
    return loss, input2d.new_empty(rows, dtype=dtype), *_fake_grads(input2d, linear_weight, linear_bias, want)


@torch.library.custom_op("multisoft::linear_cross_entropy_backward", mutates_args=())
def linear_cross_entropy_backward_op(
        input2d: torch.Tensor, linear_weight: torch.Tensor, linear_bias: Optional[torch.Tensor],
        target: torch.Tensor, weight: Optional[torch.Tensor], grad: Optional[torch.Tensor],
        grad_lse: Optional[torch.Tensor], ignore_index: int, reduction: str, label_smoothing: float,
        softcap: float, lse_square_scale: float, temperature: float, backend: str, chunk_rows: int, want_input: bool,
        want_weight: bool, want_bias: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The recomputing pass of the backward (the loss's gradient per row as reduction="none" computes it, and
    the lse's), whatever ``reduction`` the forward had."""
    options = LossOptions(ignore_index, "none", label_smoothing, softcap, lse_square_scale, temperature)
    plan = _Plan(options, backend, chunk_rows)
    grads = _recompute(input2d, linear_weight, linear_bias, target, weight, None, plan,
                       (want_input, want_weight, want_bias), grad, grad_lse)
    return tuple(_placeholder(g, input2d) for g in grads)


@linear_cross_entropy_backward_op.register_fake
def _(input2d, linear_weight, linear_bias, target, weight, grad, grad_lse, ignore_index, reduction, label_smoothing,
      softcap, lse_square_scale, temperature, backend, chunk_rows, want_input, want_weight, want_bias):
    return _fake_grads(input2d, linear_weight, linear_bias, (want_input, want_weight, want_bias))


_OPTION_FIELDS = len(LossOptions._fields)


def _setup_context(ctx, inputs, output):
    input2d, linear_weight, linear_bias, target, weight, *rest = inputs
    ctx.options = LossOptions(*rest[:_OPTION_FIELDS])
    ctx.backend, ctx.chunk_rows, *want, ctx.return_lse = rest[_OPTION_FIELDS:]
    ctx.want, ctx.arguments = tuple(want), len(inputs)
    ctx.save_for_backward(input2d, linear_weight, linear_bias, target, weight, *output[2:])


def _op_backward(ctx, grad, grad_lse, *_grad_of_gradients):
    input2d, linear_weight, linear_bias, target, weight, *saved = ctx.saved_tensors
    arguments = (*ctx.options, ctx.backend, ctx.chunk_rows, *ctx.want)
    grad_lse = grad_lse if ctx.return_lse else None
    if ctx.options.reduction == "none":
        grads = linear_cross_entropy_backward_op(input2d, linear_weight, linear_bias, target, weight, grad,
                                                 grad_lse, *arguments)
    else:
        grads = tuple(g * grad.to(g.dtype) for g in saved)
        if grad_lse is not None:
            more = linear_cross_entropy_backward_op(input2d, linear_weight, linear_bias, target, weight, None,
                                                    grad_lse, *arguments)
            grads = tuple(g + m for g, m in zip(grads, more))
    grads = tuple(g if wanted else None for g, wanted in zip(grads, ctx.want))
    return (*grads, *(None,) * (ctx.arguments - 3))


linear_cross_entropy_forward_op.register_autograd(_op_backward, setup_context=_setup_context)


# -- the public function


def _check(input, linear_weight, target, linear_bias, weight, options: LossOptions, return_lse, chunk_size,
           process_group):
    """Validates the tensors and the flags (the loss options are validated already); returns this rank's slice of
    the classes (a ``vocab_parallel.VocabSlice``), or None without ``process_group``. What needs no other rank is
    checked first; then with ``process_group`` the ranks' slices are learned (one small all-gather) and the number
    of classes and ``weight`` are checked against all of them."""
    _validate.tensor(target, "target")
    classes = check_linear_layer("linear_cross_entropy", input, linear_weight, linear_bias, chunk_size,
                                 target=target, weight=weight)
    if target.is_floating_point() or target.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"target must hold class indices as int64 or int32 (linear_cross_entropy takes no "
                        f"class-probability targets), got {target.dtype}")
    if target.shape != input.shape[:-1]:
        raise ValueError(f"target must have shape {tuple(input.shape[:-1])} for input of shape "
                         f"{tuple(input.shape)}, got {tuple(target.shape)}")
    _validate.boolean(return_lse, "return_lse")
    vocab_slice, where = None, ""
    if process_group is not None:
        from .vocab_parallel import VocabSlice

        vocab_slice = VocabSlice.of(process_group, classes, input.device)
        classes, where = vocab_slice.total, " on any rank of process_group"
    if classes == 0 and target.numel() > 0:
        raise ValueError(f"linear_weight has no rows{where} (no classes): there is nothing to predict from")
    # all V classes with process_group; errors name the logits ``input``, as multisoft.cross_entropy's do
    check_weight(weight, classes, input)
    return vocab_slice


def linear_cross_entropy(input: torch.Tensor, linear_weight: torch.Tensor, target: torch.Tensor, *,
                         linear_bias: torch.Tensor | None = None, weight: torch.Tensor | None = None,
                         reduction: str = "mean", ignore_index: int | None = -100, label_smoothing: float = 0.0,
                         lse_square_scale: float = 0.0, softcap: float | None = None, return_lse: bool = False,
                         backend: str | None = None, chunk_size: int | None = None, process_group=None):
    """``multisoft.cross_entropy(F.linear(input, linear_weight, linear_bias), target, ...)`` without the logits.

    ``input`` is (M, H) or (B, T, H) hidden states, ``linear_weight`` (V, H) and
    ``linear_bias`` (V,) or None, of the input's dtype and device (under
    ``torch.autocast`` the three are cast to its dtype first, as ``F.linear``
    casts them, so a float32 output layer takes 16-bit hidden states); ``target``
    (M,) or (B, T) class indices (int64 or int32). ``weight``, ``reduction``,
    ``ignore_index``, ``label_smoothing``, ``lse_square_scale`` (z-loss),
    ``softcap`` and ``return_lse`` are those of ``multisoft.cross_entropy``
    (the loss of 16-bit inputs is float32).

    The logits are computed ``chunk_size`` rows at a time (default: an eighth
    of the rows or 256 MiB of logits, whichever is fewer rows, but at least 1024
    rows) by torch's matmul, and each chunk's loss and gradient by ``backend``'s
    cross-entropy kernel in place of its logits; the gradients of ``input``,
    ``linear_weight`` and ``linear_bias`` are accumulated chunk by chunk. A
    reduced loss computes them in the forward (when any of the three requires
    grad) and keeps only them until the backward; ``reduction="none"`` computes
    them in the backward, computing the logits again (one more matmul). Peak
    memory beyond the gradients: one chunk of logits (plus the backend's
    workspace) instead of all M x V logits and their gradient. As with
    ``multisoft.cross_entropy``, the graph can be differentiated once for a
    reduced loss, and not twice over (``create_graph=True`` raises).

    ``process_group`` (a ``torch.distributed`` process group of P ranks):
    vocabulary-parallel. ``linear_weight`` (V_r, H) is this rank's contiguous
    rows of the output layer and ``linear_bias`` (V_r,) its slice, the ranks'
    slices in group-rank order (widths may differ, and may be 0); ``input``
    is the same hidden states on every rank, ``target`` global class ids and
    ``weight`` all V class weights, the same on every rank; ``chunk_size``
    must be the same on every rank (the default is). Every rank gets the loss
    (and lse) of the whole rows. ``linear_weight`` and ``linear_bias`` get
    this rank's slice of the unsplit gradient. ``input``'s gradient is the
    unsplit one on every rank: the sum over the ranks of their shares, summed
    by one all-reduce here. A model whose tensor-parallel layer also
    all-reduces the gradient of the hidden states entering the output layer
    (Megatron's ``copy_to_tensor_model_parallel_region``) must not use it
    around this call: the sum would be taken twice. The incoming gradient of
    the loss must be the same on every rank. Communication per chunk of
    rows: one all-gather of 4 floats a row (as ``multisoft.cross_entropy``
    with ``process_group``); then one all-reduce of ``input``'s gradient (M x
    H). A reduced loss does all of it in the forward, and its backward
    communicates nothing. ``reduction="none"`` computes the loss in the
    forward, keeps the whole rows' max and sum of exponentials (2 floats a
    row), and in the backward computes the gradients again from them without
    gathering anything, but all-reduces ``input``'s gradient there (it
    depends on the incoming gradient); so does a gradient through a returned
    lse. DTensor arguments are not taken. Not traced by ``torch.compile`` (it
    runs eagerly, a graph break).

    ``ignore_index=None`` means -100, as in torch's ``F.linear_cross_entropy``.
    Forward-mode AD is not supported (a tangent raises), nor are ``torch.func``
    transforms (``NotImplementedError``).
    """
    refuse_transforms("linear_cross_entropy")
    refuse_tangents("linear_cross_entropy", input=input, linear_weight=linear_weight, linear_bias=linear_bias,
                    weight=weight)
    if ignore_index is None:
        ignore_index = -100
    options = loss_options(ignore_index, reduction, label_smoothing, softcap, lse_square_scale)
    input, linear_weight, linear_bias = autocast_linear(input, linear_weight, linear_bias)
    arguments = (input, linear_weight, target, linear_bias, weight, options, return_lse, backend, chunk_size,
                 process_group)
    if process_group is not None:
        return run_eagerly(_linear_cross_entropy, *arguments)
    return _linear_cross_entropy(*arguments)


def _linear_cross_entropy(input, linear_weight, target, linear_bias, weight, options: LossOptions, return_lse,
                          backend, chunk_size, process_group):
    vocab_slice = _check(input, linear_weight, target, linear_bias, weight, options, return_lse, chunk_size,
                         process_group)
    backend = resolve_name(input.device, input.dtype, _validate.backend_name(backend), "cross_entropy")
    input2d = input.reshape(target.numel(), input.shape[-1])
    flat_target = index_targets(target, options.ignore_index)
    rows = input2d.shape[0]
    if rows == 0:
        return cross_entropy(F.linear(input2d, linear_weight, linear_bias), flat_target, weight,
                             ignore_index=options.ignore_index, reduction=options.reduction,
                             label_smoothing=options.label_smoothing, lse_square_scale=options.lse_square_scale,
                             softcap=options.softcap or None, return_lse=return_lse, backend=backend,
                             process_group=process_group)
    input2d = input2d.contiguous()
    if weight is not None:
        weight = weight.to(stats_dtype(input.dtype)).contiguous()
    # every rank of a group runs as many chunks (one all-gather each): the rows a chunk takes on the widest
    widest = vocab_slice.widest if vocab_slice is not None else linear_weight.shape[0]
    chunk_rows = chunk_size if chunk_size is not None else default_chunk_rows(rows, widest, input.element_size())
    plan = _Plan(options, backend, min(chunk_rows, rows), vocab_slice)
    grad_enabled = torch.is_grad_enabled()
    want = tuple(bool(grad_enabled and t is not None and t.requires_grad)
                 for t in (input2d, linear_weight, linear_bias))
    if torch.compiler.is_compiling() and vocab_slice is None:
        loss, lse, *_ = linear_cross_entropy_forward_op(
            input2d, linear_weight, linear_bias, flat_target, weight, *options, backend, plan.chunk_rows, *want,
            return_lse)
    elif any(want):
        result = _LinearCrossEntropy.apply(input2d, linear_weight, linear_bias, flat_target, weight, plan, want,
                                           return_lse)
        loss, lse = result if return_lse else (result, None)
    else:
        loss, lse, _, _ = _forward(input2d, linear_weight, linear_bias, flat_target, weight, plan, want)
    if options.reduction == "none":
        loss = loss.reshape(target.shape)
    if not return_lse:
        return loss
    return loss, lse.reshape(target.shape)
