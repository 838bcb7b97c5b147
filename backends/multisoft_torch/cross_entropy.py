"""Per-row cross-entropy and its gradient in PyTorch's own ops, a chunk of rows at a time.

Arithmetic is float32 (float64 for float64 logits): 16-bit logits are
converted a chunk at a time into a workspace of one chunk, reused by every
chunk, so forward plus backward allocate nothing of the logits' size but the
gradient (none in place, where ``grad_logits`` is ``logits``: each chunk is read
before it is overwritten). A target outside [0, C) that is not
``ignore_index`` gives a NaN loss and a NaN gradient row, decided on the device
(no host synchronisation), and is never read.
"""

import torch

from . import _chunks


class _Workspace:
    """Float32 (or float64) scratch of one chunk's rows, reused by every chunk of a call: on the CPU a fresh
    allocation of that size per chunk would cost page faults on every chunk."""

    def __init__(self, logits, compute):
        self.chunks = _chunks.slices(*logits.shape, logits.device)
        self.shape = (self.chunks[0].stop - self.chunks[0].start, logits.shape[1])
        self.compute, self.device = compute, logits.device
        self._buffers = {}

    def get(self, name, rows):
        if name not in self._buffers:
            self._buffers[name] = torch.empty(self.shape, dtype=self.compute, device=self.device)
        return self._buffers[name][: rows.stop - rows.start]

    def rows_of(self, tensor, rows):
        """``tensor[rows]`` in the compute dtype: the rows themselves when they have it, else a converted copy."""
        if tensor.dtype == self.compute:
            return tensor[rows]
        return self.get("converted", rows).copy_(tensor[rows])


def _targets(target: torch.Tensor, classes: int, ignore_index: int):
    """(ignored, in_range, safe): masks of the rows that are ignored and whose target is a class, and the targets
    as int64 indices with every row that is not a class pointed at class 0."""
    ignored = target == ignore_index
    in_range = (target >= 0) & (target < classes)
    safe = torch.where(in_range & ~ignored, target, 0).long()
    return ignored, in_range, safe


def _exponentials(x, out):
    """Writes torch.softmax(x) into ``out``; returns its row sums, added in a tree: ``out`` / sums is softmax(x).

    torch's own softmax kernel is the fastest way to the exponentials, but on the CPU it adds them in order,
    which over long rows is off by more than float32's tolerance: its output is exp(x - max) / S with that
    inexact S, whose row sums are the true sum of exp(x - max) over S.
    """
    torch.softmax(x, -1, out=out)
    return out.sum(-1)


def _log_sum_exp_shifted(x, scratch):
    """(row max m, log(sum(exp(x - m)))) per row, using ``scratch``: log(true sum / S) - log(1 / S), where 1 / S is
    the largest exponential that _exponentials writes (the max's, exp(0) / S). Kept apart, they give a row's
    losses as (m - x) + log-sum: both of its terms exact or small, where m + log-sum rounded to float32 would
    be off by half its unit in the last place (0.0005 for logits near 10^4)."""
    row_max = x.amax(-1)
    sums = _exponentials(x, scratch)
    return row_max, sums.log_().sub_(scratch.amax(-1).log_())


def forward(logits, target, weight, loss, lse, row_weight, ignore_index: int, label_smoothing: float) -> None:
    classes = logits.shape[1]
    keep, smooth_per_class = 1.0 - label_smoothing, label_smoothing / classes
    workspace = _Workspace(logits, lse.dtype)
    for rows in workspace.chunks:
        x = workspace.rows_of(logits, rows)
        scratch = workspace.get("scratch", rows)
        ignored, in_range, safe = _targets(target[rows], classes, ignore_index)
        row_max, log_sum = _log_sum_exp_shifted(x, scratch)
        # torch.logsumexp's value where the max is infinite (the shifted sum is NaN there)
        lse[rows] = torch.where(row_max.abs() == float("inf"), row_max, row_max + log_sum)
        nll = (row_max - x.gather(1, safe.unsqueeze(1)).squeeze(1)).add_(log_sum)
        if weight is not None:
            target_weight = weight[safe]
            nll = nll * target_weight
            row_weight[rows] = torch.where(ignored, 0.0, target_weight)
        else:
            row_weight[rows] = torch.where(ignored, 0.0, 1.0)
        per_row = keep * nll
        if label_smoothing:
            # sum_c w[c] * ((m - x[c]) + log-sum), term by term
            neg_log_p = torch.sub(row_max.unsqueeze(1), x, out=scratch).add_(log_sum.unsqueeze(1))
            smooth = neg_log_p @ weight if weight is not None else neg_log_p.sum(-1)
            per_row = per_row + smooth_per_class * smooth
        loss[rows] = torch.where(ignored, 0.0, torch.where(in_range, per_row, float("nan")))


def backward(logits, target, weight, weight_sum, lse, grad_loss, grad_logits, ignore_index: int,
             label_smoothing: float) -> None:
    """grad = g * ((1 - eps) * w[t] * (p - onehot(t)) + eps / C * (W * p - w)), as p * a - g * eps / C * w with
    a = g * ((1 - eps) * w[t] + eps / C * W), then g * (1 - eps) * w[t] taken off at the target. p is computed
    afresh (as the forward does), not from ``lse``: one pass of torch's softmax kernel instead of two."""
    classes = logits.shape[1]
    keep, smooth_per_class = 1.0 - label_smoothing, label_smoothing / classes
    workspace = _Workspace(logits, lse.dtype)
    direct = grad_logits.dtype == lse.dtype  # computed in the gradient's own memory (even when it is the logits)
    for rows in workspace.chunks:
        ignored, in_range, safe = _targets(target[rows], classes, ignore_index)
        g = torch.where(ignored, 0.0, torch.where(in_range, grad_loss[rows], float("nan")))
        x = workspace.rows_of(logits, rows)
        grad = grad_logits[rows] if direct else x  # x is then the chunk's converted copy, free to overwrite
        sums = _exponentials(x, grad)  # p = grad / sums
        if weight is None:
            grad.mul_((g / sums).unsqueeze(1))  # a = g: (1 - eps) + eps / C * C
            if label_smoothing:
                grad.sub_((g * smooth_per_class).unsqueeze(1))
            at_target = g * keep
        else:
            target_weight = weight[safe]
            grad.mul_((g * (keep * target_weight + smooth_per_class * weight_sum) / sums).unsqueeze(1))
            if label_smoothing:
                grad.addr_(g * smooth_per_class, weight, alpha=-1.0)
            at_target = g * keep * target_weight
        grad.scatter_add_(1, safe.unsqueeze(1), -at_target.unsqueeze(1))
        if not direct:
            grad_logits[rows] = grad
