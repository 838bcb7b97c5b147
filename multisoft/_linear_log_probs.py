"""linear_log_probs: ``multisoft.log_probs(F.linear(input, linear_weight, linear_bias), target, ...)`` without
holding the logits.

The rows go a chunk at a time through one logits buffer (``_linear_chunks.chunk_pass``). The forward computes each
chunk's logits by torch's matmul and the backend's ``log_probs.forward`` reads them once for three numbers a row,
from which the chunk's log-probabilities and entropy follow; it keeps those numbers (3 a row) and nothing of size
M x V. The incoming gradients of the log-probabilities and of the entropy are unknown until the backward, so the
backward computes each chunk's logits again, has ``log_probs.backward`` write their gradient in place of them (one
read, one write, rounded once from float32), and accumulates the gradients of input, linear_weight and linear_bias
from it: four matrix products of M x V x H in all, as any fused per-token op whose gradient is not known in the
forward needs.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

from . import _validate
from ._forward_ad import refuse_tangents, refuse_transforms
from ._linear_chunks import autocast_linear, check_linear_layer, chunk_pass, default_chunk_rows
from ._log_probs import ids_of, log_probs, rows_backward, rows_forward
from ._loss_rules import LossOptions, loss_options, run_eagerly, stats_dtype
from ._registry import resolve_name


class _Plan(NamedTuple):
    """What one call's chunk passes run with, passed as one value through the autograd Function."""
    options: LossOptions
    backend: str
    chunk_rows: int
    vocab_slice: object = None  # vocabulary-parallel: this rank's slice of the classes (a vocab_parallel.VocabSlice)


class _ForwardChunks:
    """The forward's per-chunk step: the chunk's log-probabilities, entropy and row statistics into (rows, K),
    (rows,) and (3, rows) outputs over all the rows."""

    def __init__(self, ids, plan: _Plan, log_probs, entropy, row_stats):
        self.ids, self.plan = ids, plan
        self.log_probs, self.entropy, self.row_stats = log_probs, entropy, row_stats

    def __call__(self, logits, rows: slice) -> None:
        log_probs, entropy, row_stats = rows_forward(logits, self.ids[rows], self.plan.options, self.plan.backend)
        self.log_probs[rows], self.entropy[rows], self.row_stats[:, rows] = log_probs, entropy, row_stats

    @staticmethod
    def input_gradient(grad_input):
        return grad_input


class _BackwardChunks:
    """The backward's per-chunk step: the gradient of the incoming gradients (either None) written in place of the
    chunk's logits, from the forward's row statistics."""

    def __init__(self, ids, row_stats, grad_log_probs, grad_entropy, plan: _Plan):
        self.ids, self.row_stats, self.plan = ids, row_stats, plan
        self.grad_log_probs, self.grad_entropy = grad_log_probs, grad_entropy

    def __call__(self, logits, rows: slice) -> None:
        grad_log_probs = self.grad_log_probs[rows] if self.grad_log_probs is not None else None
        grad_entropy = self.grad_entropy[rows] if self.grad_entropy is not None else None
        rows_backward(logits, self.ids[rows], self.row_stats[:, rows].contiguous(), grad_log_probs, grad_entropy,
                      self.plan.options, self.plan.backend, grad_logits=logits)

    @staticmethod
    def input_gradient(grad_input):
        return grad_input


def _forward(input2d, linear_weight, linear_bias, ids, plan: _Plan):
    """(log-probabilities (M, K), entropy (M,), row statistics (3, M)): one chunk pass, no gradient."""
    rows, dtype, device = input2d.shape[0], stats_dtype(input2d.dtype), input2d.device
    log_probs = torch.empty(ids.shape, dtype=dtype, device=device)
    entropy = torch.empty(rows, dtype=dtype, device=device)
    row_stats = torch.empty((3, rows), dtype=dtype, device=device)
    if plan.vocab_slice is None:
        step = _ForwardChunks(ids, plan, log_probs, entropy, row_stats)
    else:
        from .vocab_parallel import LinearLogProbsChunks

        step = LinearLogProbsChunks(ids, plan.vocab_slice, plan.options, plan.backend, row_stats,
                                    log_probs=log_probs, entropy=entropy)
    chunk_pass(input2d, linear_weight, linear_bias, plan.chunk_rows, step)
    return log_probs, entropy, row_stats


def _backward(input2d, linear_weight, linear_bias, ids, row_stats, grad_log_probs, grad_entropy, plan: _Plan, want):
    """The gradients of input, linear_weight and linear_bias that ``want`` asks for (each None otherwise): the
    backward's chunk pass, the logits computed again."""
    if grad_log_probs is None and grad_entropy is None:
        return None, None, None
    if plan.vocab_slice is None:
        step = _BackwardChunks(ids, row_stats, grad_log_probs, grad_entropy, plan)
    else:
        from .vocab_parallel import LinearLogProbsChunks

        step = LinearLogProbsChunks(ids, plan.vocab_slice, plan.options, plan.backend, row_stats,
                                    grad_log_probs=grad_log_probs, grad_entropy=grad_entropy)
    return chunk_pass(input2d, linear_weight, linear_bias, plan.chunk_rows, step, want)


class _LinearLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input2d, linear_weight, linear_bias, ids, plan: _Plan, want):
        log_probs, entropy, row_stats = _forward(input2d, linear_weight, linear_bias, ids, plan)
        ctx.plan, ctx.want = plan, want
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(input2d, linear_weight, linear_bias, ids, row_stats)
        return log_probs, entropy

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy):
        if torch.is_grad_enabled():
            raise RuntimeError("multisoft.linear_log_probs does not support double backward (create_graph=True): its "
                               "gradients are computed chunk by chunk and the logits are not kept")
        grads = _backward(*ctx.saved_tensors, grad_log_probs, grad_entropy, ctx.plan, ctx.want)
        return (*grads, None, None, None)


# -- torch.library ops, used under torch.compile: each chunk pass is one op. Their signatures take the LossOptions
# field by field, in its order (torch.library takes no record).


def _placeholder(grad, like):
    return grad if grad is not None else like.new_empty(0)


@torch.library.custom_op("multisoft::linear_log_probs_forward", mutates_args=())
def linear_log_probs_forward_op(
        input2d: torch.Tensor, linear_weight: torch.Tensor, linear_bias: Optional[torch.Tensor], ids: torch.Tensor,
        ignore_index: int, reduction: str, label_smoothing: float, softcap: float, lse_square_scale: float,
        temperature: float, backend: str, chunk_rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    options = LossOptions(ignore_index, reduction, label_smoothing, softcap, lse_square_scale, temperature)
    return _forward(input2d, linear_weight, linear_bias, ids, _Plan(options, backend, chunk_rows))


@linear_log_probs_forward_op.register_fake
def _(input2d, linear_weight, linear_bias, ids, *options_and_plan):
    dtype, rows = stats_dtype(input2d.dtype), input2d.shape[0]
    return (ids.new_empty(ids.shape, dtype=dtype), input2d.new_empty(rows, dtype=dtype),
            input2d.new_empty((3, rows), dtype=dtype))


@torch.library.custom_op("multisoft::linear_log_probs_backward", mutates_args=())
def linear_log_probs_backward_op(
        input2d: torch.Tensor, linear_weight: torch.Tensor, linear_bias: Optional[torch.Tensor], ids: torch.Tensor,
        row_stats: torch.Tensor, grad_log_probs: torch.Tensor, grad_entropy: torch.Tensor, ignore_index: int,
        reduction: str, label_smoothing: float, softcap: float, lse_square_scale: float, temperature: float,
        backend: str, chunk_rows: int, want_input: bool, want_weight: bool, want_bias: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    options = LossOptions(ignore_index, reduction, label_smoothing, softcap, lse_square_scale, temperature)
    grads = _backward(input2d, linear_weight, linear_bias, ids, row_stats, grad_log_probs, grad_entropy,
                      _Plan(options, backend, chunk_rows), (want_input, want_weight, want_bias))
    return tuple(_placeholder(g, input2d) for g in grads)


@linear_log_probs_backward_op.register_fake
def _(input2d, linear_weight, linear_bias, ids, row_stats, grad_log_probs, grad_entropy, *rest):
    want = rest[-3:]
    likes = (input2d, linear_weight, linear_bias)
    return tuple(torch.empty_like(like) if wanted else input2d.new_empty(0) for like, wanted in zip(likes, want))


def _setup_context(ctx, inputs, output):
    input2d, linear_weight, linear_bias, ids, *ctx.arguments = inputs
    ctx.save_for_backward(input2d, linear_weight, linear_bias, ids, output[2])


def _op_backward(ctx, grad_log_probs, grad_entropy, _grad_row_stats):
    input2d, linear_weight, linear_bias, ids, row_stats = ctx.saved_tensors
    want = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], linear_bias is not None and ctx.needs_input_grad[2])
    if grad_log_probs is None:
        grad_log_probs = row_stats.new_zeros(ids.shape)
    if grad_entropy is None:
        grad_entropy = row_stats.new_zeros(row_stats.shape[1])
    grads = linear_log_probs_backward_op(input2d, linear_weight, linear_bias, ids, row_stats, grad_log_probs,
                                         grad_entropy, *ctx.arguments, *want)
    grads = tuple(g if wanted else None for g, wanted in zip(grads, want))
    return (*grads, *(None,) * (len(ctx.arguments) + 1))


linear_log_probs_forward_op.register_autograd(_op_backward, setup_context=_setup_context)


# -- the public function


def linear_log_probs(input: torch.Tensor, linear_weight: torch.Tensor, target: torch.Tensor, *,
                     linear_bias: torch.Tensor | None = None, temperature: float = 1.0, softcap: float | None = None,
                     ignore_index: int = -100, return_entropy: bool = False, chunk_size: int | None = None,
                     backend: str | None = None, process_group=None):
    """``multisoft.log_probs(F.linear(input, linear_weight, linear_bias), target, ...)`` without holding the logits:
    per-token log-probabilities of the ``target`` ids (and the entropy) from a language model's last hidden states
    and its output layer.

    ``input`` (M, H) or (B, T, H), ``linear_weight`` (V, H) (the model's ``lm_head.weight``) and ``linear_bias``
    (V,) or None, of one dtype and device (under ``torch.autocast`` cast to its dtype first, as ``F.linear`` casts
    them); ``target`` (int64 or int32) of the input's shape without H, one id a row, or with a trailing K, K ids a
    row. ``temperature``, ``softcap``, ``ignore_index`` and ``return_entropy`` are those of
    ``multisoft.log_probs``; the results are float32 (float64 for float64 inputs).

    The logits are computed ``chunk_size`` rows at a time (the default as ``linear_cross_entropy``'s) by torch's
    matmul; the forward keeps 3 numbers a row besides its inputs. The backward, given any incoming gradients of
    the log-probabilities and the entropy, computes each chunk's logits again, writes their gradient in place of
    them, and accumulates the gradients of ``input``, ``linear_weight`` and ``linear_bias`` (four matrix products
    in all). Peak memory beyond the gradients: one chunk of logits. A row's results given its logits are bitwise
    the same whatever the batch (as ``log_probs``'s), but the logits themselves are torch's matmul's, whose bits
    may depend on the number of rows in a chunk (cuBLAS picks its algorithm per shape). Double backward,
    forward-mode AD and ``torch.func`` transforms are not supported (they raise). Works under
    ``torch.compile(fullgraph=True)``.

    ``process_group`` (a ``torch.distributed`` process group of P ranks): vocabulary-parallel, as
    ``linear_cross_entropy``'s. ``linear_weight`` (V_r, H) and ``linear_bias`` (V_r,) are this rank's contiguous
    rows of the output layer, the ranks' slices in group-rank order (widths may differ, and may be 0); ``input``
    and ``target`` (global ids) are the same on every rank, and so must the incoming gradients be. Every rank gets
    the log-probabilities and entropy of the whole rows; ``linear_weight`` and ``linear_bias`` get this rank's
    slice of the gradient, ``input`` the whole of it (one all-reduce in the backward: a model whose
    tensor-parallel layer also all-reduces that gradient must not). The forward runs one all-gather of 3 + K
    numbers a row per chunk; ``chunk_size`` must be the same on every rank (the default is). Not traced by
    ``torch.compile`` (it runs eagerly, a graph break).
    """
    refuse_transforms("linear_log_probs")
    refuse_tangents("linear_log_probs", input=input, linear_weight=linear_weight, linear_bias=linear_bias)
    options = loss_options(ignore_index, "none", 0.0, softcap, 0.0, temperature)
    _validate.boolean(return_entropy, "return_entropy")
    input, linear_weight, linear_bias = autocast_linear(input, linear_weight, linear_bias)
    arguments = (input, linear_weight, target, linear_bias, options, return_entropy, chunk_size, backend,
                 process_group)
    if process_group is not None:
        return run_eagerly(_linear_log_probs, *arguments)
    return _linear_log_probs(*arguments)


def _linear_log_probs(input, linear_weight, target, linear_bias, options: LossOptions, return_entropy, chunk_size,
                      backend, process_group):
    _validate.tensor(target, "target")
    classes = check_linear_layer("linear_log_probs", input, linear_weight, linear_bias, chunk_size, target=target)
    ids, one_id = ids_of(target, input.shape[:-1], f"input of shape {tuple(input.shape)}")
    vocab_slice, where, widest = None, "", classes
    if process_group is not None:
        from .vocab_parallel import VocabSlice

        vocab_slice = VocabSlice.of(process_group, classes, input.device)
        classes, where, widest = vocab_slice.total, " on any rank of process_group", vocab_slice.widest
    if classes == 0 and ids.numel() > 0:
        raise ValueError(f"linear_weight has no rows{where} (no classes): there is nothing to score")
    backend = resolve_name(input.device, input.dtype, _validate.backend_name(backend), "log_probs")
    input2d = input.reshape(-1, input.shape[-1]).contiguous()
    ids = ids.contiguous()
    rows = input2d.shape[0]
    if rows == 0:
        return log_probs(F.linear(input, linear_weight, linear_bias), target, temperature=options.temperature,
                         softcap=options.softcap or None, ignore_index=options.ignore_index,
                         return_entropy=return_entropy, backend=backend, process_group=process_group)
    # every rank of a group runs as many chunks (one all-gather each): the rows a chunk takes on the widest
    chunk_rows = chunk_size if chunk_size is not None else default_chunk_rows(rows, widest, input.element_size())
    plan = _Plan(options, backend, max(1, min(chunk_rows, rows)), vocab_slice)
    want = tuple(bool(torch.is_grad_enabled() and t is not None and t.requires_grad)
                 for t in (input2d, linear_weight, linear_bias))
    if torch.compiler.is_compiling() and vocab_slice is None:
        result, entropy, _ = linear_log_probs_forward_op(input2d, linear_weight, linear_bias, ids, *options, backend,
                                                         plan.chunk_rows)
    elif any(want):
        result, entropy = _LinearLogProbs.apply(input2d, linear_weight, linear_bias, ids, plan, want)
    else:
        result, entropy, _ = _forward(input2d, linear_weight, linear_bias, ids, plan)
    result = result.reshape(target.shape) if one_id else result.reshape(*input.shape[:-1], ids.shape[1])
    if not return_entropy:
        return result
    return result, entropy.reshape(input.shape[:-1])
