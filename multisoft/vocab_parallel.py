"""Vocabulary-parallel cross-entropy: each rank of a process group holds a contiguous slice of every row's classes.

Tensor-parallel training splits the output layer's classes across ranks, so each holds logits (M, V_r) for its
slice. Every rank computes the loss of the whole rows, and its slice of their gradient, with one collective:

1. The backend's forward reads the slice once (every target set to ``ignore_index``: its own loss is not used)
   and writes each row's max m_r, sum S_r of exp(u - m_r) and sum a_r of w_j * u_j over this rank's columns
   (``row_stats``). The rank that owns a row's target class picks its capped logit u_t (0 elsewhere).
2. One all-gather of those 4 numbers a row, on torch's current stream (no host synchronisation). Every rank
   then combines them alike: m = max m_r, S = sum S_r exp(m_r - m), lse = m + log S, a = sum a_r, u_t = sum.
3. When a gradient is wanted, the backend's ``gradient`` writes this rank's slice of it from the whole row's
   (m, S) and three coefficients a row, scaled as the unsplit forward scales it; autograd's backward only
   multiplies it by the incoming gradient, as for the unsplit call. Nothing is communicated there, and besides
   the gradient only O(M) state is kept (the logits too when a returned lse is differentiated).

The ranks' widths place this rank's columns among the V classes; they are learned the first time a (group, local
width) pair is seen (the only host synchronisation) and cached. Every call gathers each rank's width and the widths
it has cached for its own (one small all-gather before the first pass), so that a slicing changed on some ranks but
not on others raises on every rank instead of leaving them in collectives that do not match (``_slice_of``).

``multisoft.linear_cross_entropy`` with ``process_group`` runs the same steps on each chunk of its rows
(``LinearChunks``): pass 1, the gather and the combine, then pass 2 in place of the chunk's logits with a
grad_scale given for all the rows (a mean's 1 / denominator over every row, not the chunk's); the gradient of
its replicated input is then summed over the ranks by one all-reduce.
"""

from __future__ import annotations

import weakref
from typing import NamedTuple

import torch
import torch.distributed as dist

from . import _validate
from ._loss_rules import (LossOptions, TargetTerms, backward_scale, check_classes, check_logits_and_target,
                          check_targets_in_bounds, check_weight, denominator, double_backward_error, empty_rows,
                          folds_mean, gradient_coefficients, inplace_lse_error, kernel_inputs, log_probs_coefficients,
                          log_probs_outputs, reduce_rows, scale_by_incoming, scaled_logits, second_backward_error,
                          shaped_result, softcap_derivative_, stats_dtype, target_terms)
from ._registry import get_backend, resolve_name

__all__ = ["VocabSlice", "LinearChunks", "LinearLogProbsChunks", "cross_entropy", "log_probs"]

_STATS_PER_ROW = 4   # m_r, S_r, a_r, u_t (or 0): what one rank sends of a row
_CACHED_SLICES_LIMIT = 64


class VocabSlice(NamedTuple):
    """This rank's slice of the classes of a vocabulary-parallel call: its columns are
    [``start``, ``start + width``) of the ``total`` classes that the ``ranks`` ranks of ``group`` hold between them,
    in group-rank order; ``widest`` is the largest rank's width. ``VocabSlice.of`` learns it, once per call."""
    group: object
    ranks: int
    start: int
    width: int
    total: int
    widest: int

    @classmethod
    def of(cls, process_group, width: int, device: torch.device) -> "VocabSlice":
        """This rank's slice for a call with ``width`` local classes on ``device``: checks ``process_group``, then
        one small all-gather (``_slice_of``), every call, on every rank alike."""
        _check_group(process_group)
        return _slice_of(process_group, width, device)


# Per process group, weakly (a cache must not keep a group, nor its communication threads, alive after
# dist.destroy_process_group()): per local width, every rank's width (a tuple in group-rank order) and, per device,
# what this rank sends of it every call (made once: a copy to a GPU each call would synchronise with the host).
_slices: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_NOT_CACHED = -1


class _CachedWidths(NamedTuple):
    widths: tuple
    sent: dict


def all_gather_into(output: torch.Tensor, local: torch.Tensor, group) -> None:
    """Every rank's ``local`` stacked into ``output`` in group-rank order (torch >= 2.13 names it
    all_gather_single, older releases all_gather_into_tensor)."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output, local, group=group)


def _slice_of(group, width: int, device: torch.device) -> VocabSlice:
    """This rank's slice of the classes. Every call, every rank sends its width and the widths it has cached for
    that width (or none) in one all-gather of P + 1 integers. A rank that had none reads the gathered widths on
    the host (its one host synchronisation for the pair) and caches them. Then every rank checks the same rule
    on the same gathered values: each rank that used cached widths had the widths every rank now has. Where a
    slicing changed on some ranks but not others (a width cached on one rank beside a new width on another), it
    fails on every rank, before any other collective: a ValueError where the values are on the host (gloo, or a
    rank that read them), else a device-side assertion (``torch._assert_async``: checking on the host would
    synchronise every call)."""
    ranks, rank = dist.get_world_size(group), dist.get_rank(group)
    of_group = _slices.setdefault(group, {})
    entry = of_group.get(width)
    cached = entry.widths if entry is not None else None
    sent = entry.sent.get(device) if entry is not None else None
    if sent is None:
        sent = torch.tensor([width, *(cached if cached is not None else (_NOT_CACHED,) * ranks)], device=device)
        if entry is not None:
            entry.sent[device] = sent
    gathered = torch.empty((ranks, ranks + 1), dtype=torch.int64, device=device)
    all_gather_into(gathered.view(-1), sent, group)
    if cached is None or device.type == "cpu":
        sent_by_rank = gathered.tolist()
        widths = tuple(row[0] for row in sent_by_rank)
        stale = [(r, tuple(row[1:])) for r, row in enumerate(sent_by_rank)
                 if row[1] != _NOT_CACHED and tuple(row[1:]) != widths]
        if stale:
            raise ValueError(_changed_slicing(widths, stale))
        if cached is None:
            if len(of_group) >= _CACHED_SLICES_LIMIT:
                of_group.clear()
            of_group[width] = _CachedWidths(widths, {device: torch.tensor([width, *widths], device=device)})
            cached = widths
    else:
        widths_now, cached_by_rank = gathered[:, 0], gathered[:, 1:]
        agree = (cached_by_rank == widths_now).all(1) | (cached_by_rank[:, 0] == _NOT_CACHED)
        torch._assert_async(agree.all(), "multisoft: " + _changed_slicing(None, None))
    return VocabSlice(group, ranks, sum(cached[:rank]), width, sum(cached), max(cached))


def _changed_slicing(widths, stale) -> str:
    """The error of a slicing that changed on some ranks only: ``stale`` lists (rank, the widths it had cached)."""
    where = ""
    if stale:
        where = (f": the ranks' widths are now {list(widths)}, but "
                 + "; ".join(f"rank {r} had {list(had)}" for r, had in stale))
    return ("process_group's slicing of the classes changed on some ranks and not on others since an earlier call"
            f"{where}. Each rank's width must stay what it was for the group (or change on every rank at once); "
            "for another slicing (another output layer), use another process group over the same ranks")


def _check_group(process_group) -> None:
    if not dist.is_available() or not isinstance(process_group, dist.ProcessGroup):
        raise TypeError(f"process_group must be a torch.distributed ProcessGroup or None, "
                        f"got {type(process_group).__name__}")
    if dist.get_rank(process_group) < 0:
        raise ValueError("process_group does not contain this process (its rank there is -1)")


def _replicated_local(tensor, name: str):
    """A DTensor ``target`` or ``weight`` must be replicated: its local tensor is all of it."""
    from torch.distributed.tensor import DTensor, Replicate

    if not isinstance(tensor, DTensor):
        return tensor
    if not all(isinstance(placement, Replicate) for placement in tensor.placements):
        raise ValueError(f"{name} as a DTensor must be replicated (placements Replicate()), got "
                         f"{tensor.placements}")
    return tensor.to_local()


def _from_dtensor(logits, target, weight, process_group):
    """A DTensor ``logits`` (the public function's ``input``) sharded on its class dimension over a 1-D mesh:
    (local shard, target, weight, the mesh's group); plain tensors pass through."""
    from torch.distributed.tensor import DTensor

    if not isinstance(logits, DTensor):
        for name, tensor in (("target", target), ("weight", weight)):
            if isinstance(tensor, DTensor):
                raise ValueError(f"{name} is a DTensor but input is not: pass plain tensors with process_group, "
                                 f"or input as a DTensor sharded on its class dimension")
        return logits, target, weight, process_group
    mesh, placements = logits.device_mesh, logits.placements
    class_dim = 1 if logits.ndim >= 2 else 0
    sharded = (mesh.ndim == 1 and len(placements) == 1 and placements[0].is_shard()
               and logits.ndim > 0 and placements[0].dim % logits.ndim == class_dim)
    if not sharded:
        raise ValueError(f"input as a DTensor must be sharded on its class dimension (placements "
                         f"(Shard({class_dim}),)) over a 1-D device mesh; got placements {placements} on a "
                         f"{mesh.ndim}-D mesh")
    group = mesh.get_group()
    if process_group is not None and (dist.get_process_group_ranks(process_group)
                                      != dist.get_process_group_ranks(group)):
        raise ValueError("process_group is not the group of the input's device mesh: leave it None for a DTensor")
    return logits.to_local(), _replicated_local(target, "target"), _replicated_local(weight, "weight"), group


def _local_target(target, vocab_slice: VocabSlice, ignore_index: int):
    """(owned, local): whether this rank holds the row's target class (and the row is not ignored), and that
    class's column here (-1 where it does not)."""
    local_target = target - vocab_slice.start
    owned = (local_target >= 0) & (local_target < vocab_slice.width) & (target != ignore_index)
    return owned, torch.where(owned, local_target, -1)


def _local_weight(weight, vocab_slice: VocabSlice):
    return weight[vocab_slice.start:vocab_slice.start + vocab_slice.width] if weight is not None else None


def _row_statistics(rows_2d, target, local_weight, vocab_slice: VocabSlice, options: LossOptions, backend):
    """Pass 1 and the all-gather: (P, 4, M) of every rank's m_r, S_r, a_r and u_t (or 0), and the local
    targets (-1 where this rank does not own the row's target class, or the row is ignored). ``local_weight``
    is this rank's slice of the class weights."""
    rows, dtype, device = rows_2d.shape[0], stats_dtype(rows_2d.dtype), rows_2d.device
    # this rank's part of the gather, then scratch for the loss, lse and row weights the forward also writes
    local = torch.empty((_STATS_PER_ROW + 3, rows), dtype=dtype, device=device)
    owned, local_target = _local_target(target, vocab_slice, options.ignore_index)
    if vocab_slice.width:
        every_row_ignored = torch.full((rows,), options.ignore_index, dtype=torch.int64, device=device)
        scratch_loss, scratch_lse, scratch_row_weight = local[_STATS_PER_ROW:]
        get_backend(backend).kernels("cross_entropy").forward(
            rows_2d, every_row_ignored, local_weight, scratch_loss, scratch_lse, scratch_row_weight, None, None,
            options._replace(lse_square_scale=0.0), row_stats=local[:3])
        picked = rows_2d.detach().gather(1, local_target.clamp(0, vocab_slice.width - 1).long().unsqueeze(1))
        picked = picked.squeeze(1).to(dtype)
        if options.softcap:
            picked = torch.tanh(picked / options.softcap) * options.softcap
        local[3] = torch.where(owned, picked, 0.0)
    else:
        local[0].fill_(float("-inf"))  # no classes here: m_r = -inf adds nothing to the combine
        local[1:_STATS_PER_ROW].zero_()
    gathered = torch.empty((vocab_slice.ranks * _STATS_PER_ROW, rows), dtype=dtype, device=device)
    all_gather_into(gathered, local[:_STATS_PER_ROW], vocab_slice.group)
    return gathered.view(vocab_slice.ranks, _STATS_PER_ROW, rows), local_target


def _lse(row_max, log_sum):
    """m + log S, and torch.logsumexp's value (m itself) where m is infinite."""
    return torch.where(row_max.abs() == float("inf"), row_max, row_max + log_sum)


def _combine(stats, terms: TargetTerms, vocab_slice: VocabSlice, options: LossOptions):
    """Every rank's (P, 4, M) row statistics combined alike on every rank into the whole rows' (per-row loss,
    lse, (2, M) max and sum of exponentials)."""
    rank_max, rank_sum, rank_smooth, rank_target_logit = stats.unbind(1)
    row_max = rank_max.amax(0)
    # a rank whose slice of a row is all -inf adds nothing (its S_r may be 0 or NaN there)
    row_sum = torch.where(rank_max == float("-inf"), 0.0, rank_sum * (rank_max - row_max).exp()).sum(0)
    log_sum = row_sum.log()
    lse = _lse(row_max, log_sum)
    target_logit = rank_target_logit.sum(0)
    eps, classes = options.label_smoothing, vocab_slice.total
    # lse - u_t and W lse - a with m kept apart from log S, as the unsplit forward keeps them
    per_row = terms.keep * ((row_max - target_logit) + log_sum)
    if eps:
        per_row = per_row + eps / classes * ((terms.weight_sum * row_max - rank_smooth.sum(0))
                                             + terms.weight_sum * log_sum)
    if options.lse_square_scale:
        per_row = per_row + options.lse_square_scale * lse.square()
    loss_rows = torch.where(terms.ignored, 0.0, torch.where(terms.valid, per_row, float("nan")))
    return loss_rows, lse, torch.stack((row_max, row_sum))


def _gradient(rows_2d, local_target, local_weight, row_max_sum, coefficients, grad_logits, vocab_slice: VocabSlice,
              options: LossOptions, backend):
    """Pass 2: this rank's slice of the gradient into ``grad_logits`` (``rows_2d`` itself allowed). The class
    weights enter it only through label smoothing's term: without smoothing they are not passed (a row then takes
    no weight but its target's, as torch's, even where another class's weight is infinite)."""
    if vocab_slice.width:
        get_backend(backend).kernels("cross_entropy").gradient(
            rows_2d, local_target, local_weight if options.label_smoothing else None, row_max_sum, coefficients,
            grad_logits, options)


def _forward(rows_2d, target, weight, vocab_slice: VocabSlice, options: LossOptions, backend, want_grad,
             grad_logits=None):
    """(loss reduced, lse, the whole rows' (2, M) max and sum, grad_logits or None, what the backward must multiply
    the incoming gradient by or None): pass 1, the gather, the combine, and with ``want_grad`` pass 2 into
    ``grad_logits`` (a new buffer when None), a mean's 1 / denominator folded in unless ``folds_mean`` says
    not (float16)."""
    classes = vocab_slice.total
    check_targets_in_bounds(target, classes, options.ignore_index)  # every rank alike, before the gather
    dtype = stats_dtype(rows_2d.dtype)
    local_weight = _local_weight(weight, vocab_slice)
    stats, local_target = _row_statistics(rows_2d, target, local_weight, vocab_slice, options, backend)
    terms = target_terms(target, weight, classes, options)
    loss_rows, lse, row_max_sum = _combine(stats, terms, vocab_slice, options)
    mean_denominator = None
    if options.reduction == "mean":
        mean_denominator = denominator(target, weight, options.ignore_index, classes, dtype)
    loss = reduce_rows(loss_rows, options.reduction, mean_denominator)
    if not want_grad:
        return loss, lse, row_max_sum, None, None
    # the unsplit forward's grad_scale: a mean's 1 / denominator where folded in, else 1 (and for an unfolded
    # mean the backward's scale)
    folded = mean_denominator is not None and folds_mean(rows_2d.dtype)
    unfolded = backward_scale(mean_denominator) if mean_denominator is not None and not folded else None
    grad_scale = mean_denominator.reciprocal() if folded else torch.ones((), dtype=dtype, device=lse.device)
    coefficients = gradient_coefficients(terms, lse, grad_scale, classes, options)
    if grad_logits is None:
        grad_logits = torch.empty_like(rows_2d)
    _gradient(rows_2d, local_target, local_weight, row_max_sum, coefficients, grad_logits, vocab_slice, options,
              backend)
    return loss, lse, row_max_sum, grad_logits, unfolded


def _lse_gradient(logits, grad_lse, row_max_sum, softcap):
    """d (sum_i grad_lse[i] * lse_i) / d logits for this rank's columns, in float32 (float64 for float64 logits)
    torch ops: grad_lse[i] * p * du/dx with p from the whole row's max and sum."""
    u = logits.to(stats_dtype(logits.dtype))
    if softcap:
        u = torch.tanh(u / softcap).mul_(softcap)
    row_max, row_sum = row_max_sum.unsqueeze(2)
    part = (u - row_max).exp_().mul_(grad_lse.reshape(-1, 1) / row_sum)
    if softcap:
        part.mul_(softcap_derivative_(u, softcap))
    return part


class LinearChunks:
    """multisoft.linear_cross_entropy's per-chunk step for this rank's slice of the classes (see that module):
    ``step(logits, rows)`` takes this rank's (chunk, V_r) logits of the rows ``rows`` (a slice of all M) and
    leaves in them their gradient, when one is asked for.

    In the forward (``loss_rows``, ``lse`` and ``row_max_sum`` to fill, each over all M rows): pass 1, one
    all-gather, the combine (the rows' loss, lse and whole-row max and sum written there), then pass 2 with
    ``grad_scale``. In the backward (``loss_rows`` None, ``row_max_sum`` the forward's): pass 2 from the saved
    whole rows' max and sum, no collective. ``grad_lse`` adds the returned lse's gradient. ``grad_scale`` and
    ``grad_lse`` are (M,) (a stride of 0 allowed), or None."""

    def __init__(self, target, weight, vocab_slice: VocabSlice, options: LossOptions, backend, row_max_sum, *,
                 loss_rows=None, lse=None, grad_scale=None, grad_lse=None):
        self.target, self.weight, self.vocab_slice = target, weight, vocab_slice
        self.options, self.backend = options, backend
        self.local_weight = _local_weight(weight, vocab_slice)
        self.row_max_sum, self.loss_rows, self.lse = row_max_sum, loss_rows, lse
        self.grad_scale, self.grad_lse = grad_scale, grad_lse

    def __call__(self, logits, rows: slice) -> None:
        target, vocab_slice, options = self.target[rows], self.vocab_slice, self.options
        classes = vocab_slice.total
        check_targets_in_bounds(target, classes, options.ignore_index)  # every rank alike, before the gather
        terms = target_terms(target, self.weight, classes, options)
        if self.loss_rows is not None:
            stats, local_target = _row_statistics(logits, target, self.local_weight, vocab_slice, options,
                                                  self.backend)
            loss_rows, lse, row_max_sum = _combine(stats, terms, vocab_slice, options)
            self.loss_rows[rows], self.lse[rows], self.row_max_sum[:, rows] = loss_rows, lse, row_max_sum
        else:
            _, local_target = _local_target(target, vocab_slice, options.ignore_index)
            row_max_sum = self.row_max_sum[:, rows].contiguous()
            lse = _lse(row_max_sum[0], row_max_sum[1].log())
        lse_part = None
        if self.grad_lse is not None:  # from the logits, before pass 2 overwrites them
            lse_part = _lse_gradient(logits, self.grad_lse[rows], row_max_sum, options.softcap)
        if self.grad_scale is not None:
            coefficients = gradient_coefficients(terms, lse, self.grad_scale[rows], classes, options)
            _gradient(logits, local_target, self.local_weight, row_max_sum, coefficients, logits, vocab_slice,
                      options, self.backend)
            if lse_part is not None:
                logits.add_(lse_part)
        elif lse_part is not None:
            logits.copy_(lse_part)

    def input_gradient(self, grad_input):
        """``input`` is the same on every rank, so its gradient is the sum over the ranks of each one's
        ``grad_logits_r @ linear_weight_r``: one all-reduce, in place."""
        dist.all_reduce(grad_input, group=self.vocab_slice.group)
        return grad_input


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """The forward computes this rank's slice of the gradient with the loss; the backward only scales it (and adds
    the returned lse's part, from the whole rows' max and sum), communicating nothing."""

    @staticmethod
    def forward(ctx, logits, target, weight, vocab_slice, options, backend, return_lse, inplace):
        loss, lse, row_max_sum, grad_logits, ctx.backward_scale = _forward(
            logits, target, weight, vocab_slice, options, backend, True, grad_logits=logits if inplace else None)
        if inplace:
            # written through the backend, not autograd: any op that saved the logits' old values must raise
            torch.autograd.graph.increment_version(logits)
            grad_logits = logits.detach()
        ctx.buffer, ctx.backend, ctx.softcap, ctx.inplace = grad_logits, backend, options.softcap, inplace
        ctx.set_materialize_grads(False)
        if not return_lse:
            ctx.mark_non_differentiable(lse)
        elif not inplace:
            ctx.save_for_backward(logits, row_max_sum)
        return loss, lse

    @staticmethod
    def backward(ctx, grad, grad_lse):
        if torch.is_grad_enabled():
            raise double_backward_error("cross_entropy")
        grad_logits, ctx.buffer = ctx.buffer, None
        if grad_logits is None:
            raise second_backward_error("cross_entropy")
        if grad is not None and ctx.backward_scale is not None:
            grad = grad * ctx.backward_scale
        grad_logits = None if grad is None else scale_by_incoming(grad_logits, grad, ctx.backend)
        if grad_lse is not None:
            if ctx.inplace:
                raise inplace_lse_error("cross_entropy")
            logits, row_max_sum = ctx.saved_tensors
            part = _lse_gradient(logits, grad_lse, row_max_sum, ctx.softcap)
            grad_logits = part.to(logits.dtype) if grad_logits is None else grad_logits.add_(part)
        return grad_logits, None, None, None, None, None, None, None


def cross_entropy(logits, target, weight, options: LossOptions, return_lse, backend, inplace_backward,
                  process_group):
    """``multisoft.cross_entropy`` with ``process_group`` given or a DTensor ``logits``, its ``options`` validated:
    see its docstring. Run eagerly (``_loss_rules.run_eagerly``): its collectives are not traced."""
    logits, target, weight, process_group = _from_dtensor(logits, target, weight, process_group)
    _check_group(process_group)
    classes, probabilities = check_logits_and_target(logits, target)
    _validate.same_device(logits, "input", target=target, weight=weight)
    _validate.boolean(return_lse, "return_lse")
    _validate.boolean(inplace_backward, "inplace_backward")
    if probabilities:
        raise ValueError("target must hold class indices (int64 or int32) with process_group: class-probability "
                         "targets are not supported for a slice of the classes")
    backend = resolve_name(logits.device, logits.dtype, _validate.backend_name(backend), "cross_entropy")
    vocab_slice = _slice_of(process_group, classes, logits.device)
    check_classes(vocab_slice.total, logits, target)
    check_weight(weight, vocab_slice.total, logits)  # all V classes, every rank's slice
    rows_2d, flat_target, weight, dtype = kernel_inputs(logits, target, weight, options.ignore_index)
    if flat_target.numel() == 0:
        loss, lse = empty_rows(rows_2d, options.reduction, dtype)
    elif rows_2d.requires_grad and torch.is_grad_enabled():
        loss, lse = _VocabParallelCrossEntropy.apply(rows_2d, flat_target, weight, vocab_slice, options, backend,
                                                     return_lse, inplace_backward)
    else:
        loss, lse, _, _, _ = _forward(rows_2d, flat_target, weight, vocab_slice, options, backend, False)
    return shaped_result(loss, lse, logits, options.reduction, return_lse)


# -- per-token log-probabilities (multisoft.log_probs and linear_log_probs with process_group): pass 1 writes each
# rank's (m_r, S_r, E_r) of its slice, one all-gather of 3 + K numbers a row (those and u at the ids it holds),
# combined alike on every rank into the whole rows' (m, S, E); the backward writes this rank's slice of the
# gradient from them, communicating nothing.


def _log_probs_statistics(rows_2d, ids, vocab_slice: VocabSlice, options: LossOptions, backend):
    """Pass 1 and the all-gather: (P, 3 + K, M) of every rank's m_r, S_r, A_r = S_r E_r and u at the (M, K) ids
    it holds (0 elsewhere), and this rank's ids as the kernel takes them (-1 where it does not hold them)."""
    rows, ids_a_row = ids.shape
    dtype, device = stats_dtype(rows_2d.dtype), rows_2d.device
    local = torch.empty((3 + ids_a_row, rows), dtype=dtype, device=device)
    local_ids = ids - vocab_slice.start
    held = (local_ids >= 0) & (local_ids < vocab_slice.width) & (ids != options.ignore_index)
    if vocab_slice.width:
        get_backend(backend).kernels("log_probs").forward(rows_2d, local[:3], options)
        rank_max, rank_sum, spread = local[:3]
        empty = rank_max == float("-inf")  # no class of the row here but -inf ones: the rank adds nothing
        local[1], local[2] = torch.where(empty, 0.0, rank_sum), torch.where(empty, 0.0, spread * rank_sum)
        picked = rows_2d.detach().gather(1, torch.where(held, local_ids, 0).long()).to(dtype)
        local[3:] = torch.where(held, scaled_logits(picked, options), 0.0).t()
    else:
        local[0].fill_(float("-inf"))
        local[1:].zero_()
    gathered = torch.empty((vocab_slice.ranks * (3 + ids_a_row), rows), dtype=dtype, device=device)
    all_gather_into(gathered, local, vocab_slice.group)
    return gathered.view(vocab_slice.ranks, 3 + ids_a_row, rows), torch.where(held, local_ids, -1)


def _combine_log_probs(stats):
    """The whole rows' (3, M) statistics (m, S, E) and u at the ids (M, K), alike on every rank, from every rank's
    (P, 3 + K, M): at m = max m_r, S = sum S_r e^(m_r - m), S E = sum e^(m_r - m) (A_r + (m_r - m) S_r)."""
    rank_max, rank_sum, rank_spread = stats[:, 0], stats[:, 1], stats[:, 2]
    row_max = rank_max.amax(0)
    present = rank_max != float("-inf")
    shift = torch.where(present, rank_max - row_max, 0.0)
    scale = torch.where(present, shift.exp(), 0.0)
    row_sum = (rank_sum * scale).sum(0)
    spread = (scale * (rank_spread + shift * rank_sum)).sum(0) / row_sum
    return torch.stack((row_max, row_sum, spread)), stats[:, 3:].sum(0).t()


def log_probs_forward(rows_2d, ids, vocab_slice: VocabSlice, options: LossOptions, backend):
    """(log-probabilities (M, K), entropy (M,), the whole rows' (3, M) statistics, this rank's kernel ids) of this
    rank's slice of the rows' classes: pass 1, one all-gather, the combine."""
    check_targets_in_bounds(ids, vocab_slice.total, options.ignore_index)  # every rank alike, before the gather
    stats, kernel_ids = _log_probs_statistics(rows_2d, ids, vocab_slice, options, backend)
    row_stats, picked = _combine_log_probs(stats)
    log_probs, entropy = log_probs_outputs(row_stats, picked, ids, vocab_slice.total, options)
    return log_probs, entropy, row_stats, kernel_ids


def log_probs_backward(rows_2d, ids, kernel_ids, row_stats, grad_log_probs, grad_entropy, vocab_slice: VocabSlice,
                       options: LossOptions, backend, grad_logits=None):
    """This rank's slice of the gradient (``rows_2d`` itself allowed as ``grad_logits``) from the whole rows'
    statistics: no collective."""
    grad_ids, coefficients = log_probs_coefficients(ids, grad_log_probs, grad_entropy, vocab_slice.total, options,
                                                    row_stats.dtype)
    if grad_logits is None:
        grad_logits = torch.empty_like(rows_2d)
    if vocab_slice.width and rows_2d.shape[0]:
        get_backend(backend).kernels("log_probs").backward(rows_2d, kernel_ids, row_stats, grad_ids, coefficients,
                                                           grad_logits, options)
    return grad_logits


class _VocabParallelLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, ids, vocab_slice, options, backend):
        log_probs, entropy, row_stats, kernel_ids = log_probs_forward(logits, ids, vocab_slice, options, backend)
        ctx.vocab_slice, ctx.options, ctx.backend = vocab_slice, options, backend
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(logits, ids, kernel_ids, row_stats)
        return log_probs, entropy

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy):
        if torch.is_grad_enabled():
            raise RuntimeError("multisoft.log_probs does not support double backward (create_graph=True): its "
                               "gradient is computed by a kernel")
        if grad_log_probs is None and grad_entropy is None:
            return None, None, None, None, None
        logits, ids, kernel_ids, row_stats = ctx.saved_tensors
        grad = log_probs_backward(logits, ids, kernel_ids, row_stats, grad_log_probs, grad_entropy, ctx.vocab_slice,
                                  ctx.options, ctx.backend)
        return grad, None, None, None, None


def log_probs(rows_2d, ids, options: LossOptions, backend, process_group):
    """``multisoft.log_probs`` with ``process_group``: (log-probabilities (M, K), entropy (M,)) of this rank's
    (M, V_r) slice of the logits' classes, the ranks' slices in group-rank order. Run eagerly
    (``_loss_rules.run_eagerly``)."""
    vocab_slice = VocabSlice.of(process_group, rows_2d.shape[1], rows_2d.device)
    if vocab_slice.total == 0 and ids.numel() > 0:
        raise ValueError("logits have no classes on any rank of process_group: there is nothing to score")
    if rows_2d.requires_grad and torch.is_grad_enabled():
        return _VocabParallelLogProbs.apply(rows_2d, ids, vocab_slice, options, backend)
    log_probs, entropy, _, _ = log_probs_forward(rows_2d, ids, vocab_slice, options, backend)
    return log_probs, entropy


class LinearLogProbsChunks:
    """multisoft.linear_log_probs's per-chunk step for this rank's slice of the classes: in the forward
    (``log_probs``, ``entropy`` and ``row_stats`` to fill over all M rows) pass 1, one all-gather and the combine
    of each chunk; in the backward (``row_stats`` the forward's; ``grad_log_probs``/``grad_entropy`` over all M
    rows, either None) this rank's slice of the gradient in place of the chunk's logits, communicating nothing.
    The input's gradient is then summed over the ranks by one all-reduce."""

    def __init__(self, ids, vocab_slice: VocabSlice, options: LossOptions, backend, row_stats, *, log_probs=None,
                 entropy=None, grad_log_probs=None, grad_entropy=None):
        self.ids, self.vocab_slice, self.options, self.backend = ids, vocab_slice, options, backend
        self.row_stats, self.log_probs, self.entropy = row_stats, log_probs, entropy
        self.grad_log_probs, self.grad_entropy = grad_log_probs, grad_entropy

    def __call__(self, logits, rows: slice) -> None:
        ids = self.ids[rows]
        if self.log_probs is not None:
            log_probs, entropy, row_stats, _ = log_probs_forward(logits, ids, self.vocab_slice, self.options,
                                                                 self.backend)
            self.log_probs[rows], self.entropy[rows], self.row_stats[:, rows] = log_probs, entropy, row_stats
            return
        local_ids = ids - self.vocab_slice.start
        held = (local_ids >= 0) & (local_ids < self.vocab_slice.width) & (ids != self.options.ignore_index)
        grad_log_probs = self.grad_log_probs[rows] if self.grad_log_probs is not None else None
        grad_entropy = self.grad_entropy[rows] if self.grad_entropy is not None else None
        log_probs_backward(logits, ids, torch.where(held, local_ids, -1), self.row_stats[:, rows].contiguous(),
                           grad_log_probs, grad_entropy, self.vocab_slice, self.options, self.backend,
                           grad_logits=logits)

    def input_gradient(self, grad_input):
        """The sum over the ranks of each one's share of ``input``'s gradient: one all-reduce, in place."""
        dist.all_reduce(grad_input, group=self.vocab_slice.group)
        return grad_input
