"""log_probs: per-token log-probabilities and entropy at a temperature, with any incoming gradients.

Reinforcement-learning trainers need, per token, the log-probability of the sampled token under
``softmax(u / temperature)`` and often the entropy of that distribution, and send arbitrary per-token gradients
back (advantages, ratios, KL terms). Those gradients are unknown in the forward, so the gradient is not computed
there: the forward reads the logits once for three numbers a row (the backend's ``log_probs.forward``: max m, sum
S of exp(u - m), and E = sum p (u - m)), from which the log-probabilities (u_t - m - log S) and the entropy
(log S - E) follow in O(rows) torch ops; the backward reads the logits once more and writes their gradient once
(``log_probs.backward``), rounded once from float32. Three passes over the logits in all, and nothing of their
size kept but the logits themselves.

Under torch.compile the same two steps are torch.library ops (``log_probs_forward_op`` and its backward).
"""

from __future__ import annotations

import torch

from . import _validate
from ._forward_ad import refuse_tangents, refuse_transforms
from ._loss_rules import (LossOptions, check_targets_in_bounds, is_dtensor, log_probs_coefficients,
                          log_probs_outputs, loss_options, run_eagerly, scaled_logits, stats_dtype)
from ._registry import get_backend, resolve_name


def rows_forward(logits, ids, options: LossOptions, backend):
    """(log-probabilities (rows, K), entropy (rows,), the kernel's row statistics (3, rows)) of contiguous
    (rows, C) logits and (rows, K) ids (``_loss_rules.log_probs_outputs``)."""
    rows, classes = logits.shape
    check_targets_in_bounds(ids, classes, options.ignore_index)
    dtype = stats_dtype(logits.dtype)
    row_stats = torch.empty((3, rows), dtype=dtype, device=logits.device)
    if rows:
        get_backend(backend).kernels("log_probs").forward(logits, row_stats, options)
    valid = (ids >= 0) & (ids < classes)
    picked = scaled_logits(logits.gather(1, torch.where(valid, ids, 0).long()).to(dtype), options)
    return *log_probs_outputs(row_stats, picked, ids, classes, options), row_stats


def rows_backward(logits, ids, row_stats, grad_log_probs, grad_entropy, options: LossOptions, backend,
                  grad_logits=None):
    """d(sum g * log_probs + sum c * entropy)/d logits by the backend's ``log_probs.backward``, either incoming
    gradient None for none, into ``grad_logits`` (a new buffer when None; ``logits`` itself allowed). An id outside
    the classes makes its row's gradient NaN, an ignored one adds nothing."""
    rows, classes = logits.shape
    grad_ids, coefficients = log_probs_coefficients(ids, grad_log_probs, grad_entropy, classes, options,
                                                    row_stats.dtype)
    if grad_logits is None:
        grad_logits = torch.empty_like(logits)
    if rows:
        kernel_ids = torch.where((ids >= 0) & (ids < classes) & (ids != options.ignore_index), ids, -1)
        get_backend(backend).kernels("log_probs").backward(logits, kernel_ids, row_stats, grad_ids, coefficients,
                                                           grad_logits, options)
    return grad_logits


# -- autograd Function, the eager path


class _LogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, ids, options: LossOptions, backend):
        log_probs, entropy, row_stats = rows_forward(logits, ids, options, backend)
        ctx.options, ctx.backend = options, backend
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(logits, ids, row_stats)
        return log_probs, entropy

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy):
        if torch.is_grad_enabled():
            raise RuntimeError("multisoft.log_probs does not support double backward (create_graph=True): its "
                               "gradient is computed by a kernel")
        if grad_log_probs is None and grad_entropy is None:
            return None, None, None, None
        logits, ids, row_stats = ctx.saved_tensors
        return rows_backward(logits, ids, row_stats, grad_log_probs, grad_entropy, ctx.options, ctx.backend), \
            None, None, None


# -- torch.library ops, used under torch.compile. Their signatures take the LossOptions field by field, in its
# order (torch.library takes no record).


@torch.library.custom_op("multisoft::log_probs_forward", mutates_args=())
def log_probs_forward_op(logits: torch.Tensor, ids: torch.Tensor, ignore_index: int, reduction: str,
                         label_smoothing: float, softcap: float, lse_square_scale: float, temperature: float,
                         backend: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    options = LossOptions(ignore_index, reduction, label_smoothing, softcap, lse_square_scale, temperature)
    return rows_forward(logits, ids, options, backend)


@log_probs_forward_op.register_fake
def _(logits, ids, ignore_index, reduction, label_smoothing, softcap, lse_square_scale, temperature, backend):
    dtype = stats_dtype(logits.dtype)
    rows = logits.shape[0]
    return ids.new_empty(ids.shape, dtype=dtype), logits.new_empty(rows, dtype=dtype), \
        logits.new_empty((3, rows), dtype=dtype)


@torch.library.custom_op("multisoft::log_probs_backward", mutates_args=())
def log_probs_backward_op(logits: torch.Tensor, ids: torch.Tensor, row_stats: torch.Tensor,
                          grad_log_probs: torch.Tensor, grad_entropy: torch.Tensor, ignore_index: int,
                          reduction: str, label_smoothing: float, softcap: float, lse_square_scale: float,
                          temperature: float, backend: str) -> torch.Tensor:
    options = LossOptions(ignore_index, reduction, label_smoothing, softcap, lse_square_scale, temperature)
    return rows_backward(logits, ids, row_stats, grad_log_probs, grad_entropy, options, backend)


@log_probs_backward_op.register_fake
def _(logits, ids, row_stats, grad_log_probs, grad_entropy, *options_and_backend):
    return torch.empty_like(logits)


def _setup_context(ctx, inputs, output):
    logits, ids, *options, ctx.backend = inputs
    ctx.options = options
    ctx.save_for_backward(logits, ids, output[2])


def _op_backward(ctx, grad_log_probs, grad_entropy, _grad_row_stats):
    logits, ids, row_stats = ctx.saved_tensors
    grad_log_probs = torch.zeros_like(row_stats[0]).unsqueeze(1).expand(ids.shape) if grad_log_probs is None \
        else grad_log_probs
    grad_entropy = torch.zeros_like(row_stats[0]) if grad_entropy is None else grad_entropy
    grad = log_probs_backward_op(logits, ids, row_stats, grad_log_probs, grad_entropy, *ctx.options, ctx.backend)
    return (grad, *(None,) * (len(ctx.options) + 2))


log_probs_forward_op.register_autograd(_op_backward, setup_context=_setup_context)


# -- the public function


def ids_of(target, rows_shape, of: str):
    """(``target`` as (rows, K) ids, whether one id a row was given): ``target`` of the rows' shape (one id a row),
    or of it with a trailing K (K ids a row); ``of`` names the tensor whose rows they are, for errors."""
    _validate.tensor(target, "target")
    if target.is_floating_point() or target.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"target must hold class ids as int64 or int32, got {target.dtype}")
    if target.shape == rows_shape:
        return target.reshape(-1, 1), True
    if target.ndim == len(rows_shape) + 1 and target.shape[:-1] == rows_shape:
        return target.reshape(-1, target.shape[-1]), False
    raise ValueError(f"target must have shape {tuple(rows_shape)} (one id a row) or {tuple(rows_shape)} + (K,) "
                     f"(K ids a row) for {of}, got {tuple(target.shape)}")


def log_probs(logits: torch.Tensor, target: torch.Tensor, *, temperature: float = 1.0, softcap: float | None = None,
              ignore_index: int = -100, return_entropy: bool = False, backend: str | None = None,
              process_group=None):
    """The log-probability of each ``target`` id under ``softmax(u / temperature)``, ``u`` the (soft-capped)
    logits, and optionally each row's entropy of that distribution; differentiable with any incoming gradients.

    ``logits`` (..., V), the classes last (a language model's (B, T, V) logits, or (M, V)), of any floating dtype;
    ``target`` (int64 or int32) of the logits' shape without V, one id a row, giving log-probabilities of that
    shape, or with a trailing K, K ids a row (TRL's ``selective_log_softmax`` of several ids), giving (..., K).
    The results are float32 (float64 for float64 logits): ``log_softmax(u / temperature)[target]``, 0 where an id
    equals ``ignore_index``. ``softcap`` (a finite number > 0, or None): the logits become
    ``softcap * tanh(logits / softcap)`` first, then are divided by ``temperature`` (finite, > 0), as a model and
    then its sampler apply them. ``return_entropy=True`` returns ``(log_probs, entropy)``, ``entropy`` (...) each
    row's ``-sum_j p_j log p_j`` of the same distribution (a -inf logit, a masked class, adds 0: 0 log 0 = 0),
    computed for every row whatever its ids.

    Both outputs can be differentiated with any incoming gradients, together or apart: the forward reads the
    logits once and keeps three numbers a row besides them; the backward reads them once more and writes their
    gradient once, rounded once from float32 (three passes over the logits in all). A row's results are bitwise
    the same whatever the other rows and their number on the GPU backends (Triton, CuPy, numba).

    An id outside [0, V) that is not ``ignore_index`` raises ``IndexError`` where the ids are on the CPU; on a GPU
    (where checking would synchronise) its log-probability and its row's gradient are NaN. Rows whose logits hold
    NaN or +inf, or are all -inf, give NaN, as torch's ``log_softmax`` does. Double backward, forward-mode AD and
    ``torch.func`` transforms are not supported (they raise). Works under ``torch.compile(fullgraph=True)``.

    ``process_group`` (a ``torch.distributed`` process group of P ranks): vocabulary-parallel. ``logits`` is this
    rank's contiguous slice of the classes, the ranks' slices in group-rank order (widths may differ, and may be
    0); ``target`` holds global ids, the same on every rank. Every rank gets the log-probabilities and entropy of
    the whole rows, and its slice of the gradient. The forward runs one all-gather of 3 + K numbers a row; the
    backward communicates nothing (every rank's incoming gradients must be the same). Not traced by
    ``torch.compile`` (it runs eagerly, a graph break).
    """
    refuse_transforms("log_probs")
    refuse_tangents("log_probs", logits=logits)
    options = loss_options(ignore_index, "none", 0.0, softcap, 0.0, temperature)
    if is_dtensor(logits):
        raise TypeError("logits is a DTensor: log_probs takes this rank's local slice of the classes with "
                        "process_group (logits.to_local())")
    _validate.floating(logits, "logits")
    if logits.ndim == 0:
        raise ValueError("logits must have shape (..., V), the classes last, got a 0-d tensor")
    _validate.boolean(return_entropy, "return_entropy")
    ids, one_id = ids_of(target, logits.shape[:-1], f"logits of shape {tuple(logits.shape)}")
    _validate.same_device(logits, "logits", target=target)
    classes = logits.shape[-1]
    if classes == 0 and ids.numel() > 0 and process_group is None:
        raise ValueError(f"logits have no classes (shape {tuple(logits.shape)}): there is nothing to score")
    backend = resolve_name(logits.device, logits.dtype, _validate.backend_name(backend), "log_probs")
    rows_2d = logits.reshape(ids.shape[0], classes).contiguous()
    ids = ids.contiguous()
    if process_group is not None:
        from . import vocab_parallel

        result, entropy = run_eagerly(vocab_parallel.log_probs, rows_2d, ids, options, backend, process_group)
    elif torch.compiler.is_compiling():
        result, entropy, _ = log_probs_forward_op(rows_2d, ids, *options, backend)
    elif rows_2d.requires_grad and torch.is_grad_enabled():
        result, entropy = _LogProbs.apply(rows_2d, ids, options, backend)
    else:
        result, entropy, _ = rows_forward(rows_2d, ids, options, backend)
    result = result.reshape(target.shape) if one_id else result.reshape(*logits.shape[:-1], ids.shape[1])
    if not return_entropy:
        return result
    return result, entropy.reshape(logits.shape[:-1])
