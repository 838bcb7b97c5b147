"""Per-row cross-entropy and, in the same pass, its gradient, in PyTorch's own ops, a chunk of rows at a time.

Arithmetic is float32 (float64 for float64 logits): 16-bit logits are
converted a chunk at a time into a workspace of one chunk, reused by every
chunk, so the forward allocates nothing of the logits' size but the gradient
the front hands it (none in place, where ``grad_logits`` is ``logits``: each
chunk is read before it is overwritten). A target outside [0, C) that is not
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


def _log_sum_shifted(exponentials):
    """(row sums of ``exponentials``, log(sum(exp(u - m)))) from torch.softmax(u)'s output.

    torch's own softmax kernel is the fastest way to the exponentials, but on the CPU it adds them in order,
    which over long rows is off by more than float32's tolerance: its output is exp(u - m) / S with that
    inexact S. Its row sums, added in a tree, are the true sum of exp(u - m) over S, and its largest element
    (the max's, exp(0) / S) is 1 / S: so p = output / sums, and log of the true sum is log(sums) - log(1 / S).
    Kept apart from m, a row's loss is (m - u[t]) + that log: both terms exact or small, where m + log rounded
    to float32 would be off by half its unit in the last place (0.0005 for logits near 10^4).
    """
    sums = exponentials.sum(-1)
    return sums, sums.log().sub_(exponentials.amax(-1).log_())


def forward(logits, target, weight, loss, lse, row_weight, grad_logits, grad_scale, options, row_stats=None) -> None:
    """With u = softcap * tanh(x / softcap) (or x), per row: lse, loss (plus lse_square_scale * lse**2 when not
    ignored), row_weight, and when ``grad_logits`` is given, grad_scale[i] * d loss_i / d x, as
    p * a - (1 - eps) * w[t] at the target - eps / C * w with a = (1 - eps) * w[t] + eps / C * W + 2 * s * lse,
    times 1 - (u / softcap)**2 under a softcap. With ``row_stats`` also every row's max m of u, sum S of
    exp(u - m) (0 for a row that is all -inf) and, under label smoothing, sum_j w_j * u_j (else 0)."""
    ignore_index, label_smoothing = options.ignore_index, options.label_smoothing
    softcap, lse_square_scale = options.softcap, options.lse_square_scale
    classes = logits.shape[1]
    keep, smooth_per_class = 1.0 - label_smoothing, label_smoothing / classes
    compute = lse.dtype
    workspace = _Workspace(logits, compute)
    weight_sum = weight.sum() if weight is not None else classes
    # the gradient is computed in its own memory when it has the compute dtype (even when it is the logits)
    direct = grad_logits is not None and grad_logits.dtype == compute
    converted = logits.dtype != compute  # each chunk of x is then a copy of its own
    for rows in workspace.chunks:
        x = workspace.rows_of(logits, rows)
        if softcap:
            u = torch.div(x, softcap, out=workspace.get("capped", rows)).tanh_().mul_(softcap)
        else:
            u = x
        ignored, in_range, safe = _targets(target[rows], classes, ignore_index)
        row_max = u.amax(-1)
        shifted_target = row_max - u.gather(1, safe.unsqueeze(1)).squeeze(1)
        if label_smoothing:
            # sum_c w[c] * (m - u[c]): every term >= 0, read before the exponentials may overwrite u
            shifted = torch.sub(row_max.unsqueeze(1), u, out=workspace.get("scratch", rows))
            shifted_smooth = shifted @ weight if weight is not None else shifted.sum(-1)
        if row_stats is not None:
            row_stats[0, rows] = row_max
            row_stats[2, rows] = (u @ weight if weight is not None else u.sum(-1)) if label_smoothing else 0.0
        if direct:
            exponentials = grad_logits[rows]
        elif converted:
            exponentials = x  # a converted copy, no longer needed once u is known
        else:
            exponentials = workspace.get("scratch", rows)
        torch.softmax(u, -1, out=exponentials)
        sums, log_sum = _log_sum_shifted(exponentials)
        if row_stats is not None:
            # the sum of exp(u - m) is the output's row sum over its largest element (see _log_sum_shifted)
            row_stats[1, rows] = torch.where(row_max == float("-inf"), 0.0, sums / exponentials.amax(-1))
        # torch.logsumexp's value where the max is infinite (the shifted sum is NaN there)
        row_lse = torch.where(row_max.abs() == float("inf"), row_max, row_max + log_sum)
        lse[rows] = row_lse
        # an ignored row takes no weight (torch's): weight[0] may be inf or NaN, and 0 * inf is NaN
        target_weight = torch.where(ignored, 0.0, weight[safe]) if weight is not None else None
        nll = shifted_target.add_(log_sum)
        per_row = keep * (nll * target_weight if target_weight is not None else nll)
        if label_smoothing:
            per_row = per_row + smooth_per_class * (shifted_smooth + weight_sum * log_sum)
        if lse_square_scale:
            per_row = per_row + lse_square_scale * row_lse.square()
        loss[rows] = torch.where(ignored, 0.0, torch.where(in_range, per_row, float("nan")))
        row_weight[rows] = torch.where(ignored, 0.0, target_weight if target_weight is not None else 1.0)
        if grad_logits is None:
            continue
        g = torch.where(ignored, 0.0, torch.where(in_range, grad_scale[rows], float("nan")))
        at_target = g * keep * target_weight if target_weight is not None else g * keep
        factor = keep * target_weight if target_weight is not None else keep
        if label_smoothing:  # 0 * weight_sum is NaN for an infinite weight
            factor = factor + smooth_per_class * weight_sum
        if lse_square_scale:
            factor = factor + 2.0 * lse_square_scale * row_lse
        grad = exponentials.mul_((g * factor / sums).unsqueeze(1))
        if label_smoothing:
            if weight is not None:
                grad.addr_(g * smooth_per_class, weight, alpha=-1.0)
            else:
                grad.sub_((g * smooth_per_class).unsqueeze(1))
        grad.scatter_add_(1, safe.unsqueeze(1), -at_target.unsqueeze(1))
        if softcap:
            grad.mul_(u.div_(softcap).square_().neg_().add_(1.0))
        if not direct:
            grad_logits[rows] = grad


def probabilities_forward(logits, target, weight, loss, lse, grad_logits, grad_scale, options) -> None:
    """Class-probability targets, a chunk of rows at a time in float32 (float64 for float64 logits): with
    q = (1 - eps) * target + eps / C and A = sum_j w_j q_j, loss = sum_j w_j q_j ((m - u_j) + log S) + s lse**2
    and, when ``grad_logits`` is given, grad_scale * du/dx * (p * (A + 2 s lse) - w q)."""
    label_smoothing = options.label_smoothing
    softcap, lse_square_scale = options.softcap, options.lse_square_scale
    classes = logits.shape[1]
    compute = lse.dtype
    for rows in _chunks.slices(*logits.shape, logits.device):
        u = logits[rows].to(compute)
        if softcap:
            u = torch.tanh(u / softcap).mul_(softcap)
        weighted = target[rows].to(compute).mul(1.0 - label_smoothing).add_(label_smoothing / classes)
        if weight is not None:
            weighted.mul_(weight)
        row_max = u.amax(-1, keepdim=True)
        shifted = row_max - u  # m - u_j >= 0 (NaN where the max is infinite, as torch's log_softmax is there)
        exponentials = torch.exp(-shifted)
        sums = exponentials.sum(-1)
        log_sum = sums.log()
        row_max = row_max.squeeze(1)
        row_lse = torch.where(row_max.abs() == float("inf"), row_max, row_max + log_sum)
        mass = weighted.sum(-1)
        per_row = (weighted * shifted).sum(-1) + mass * log_sum
        if lse_square_scale:
            per_row = per_row + lse_square_scale * row_lse.square()
        lse[rows] = row_lse
        loss[rows] = per_row
        if grad_logits is None:
            continue
        if lse_square_scale:
            mass = mass + 2.0 * lse_square_scale * row_lse
        grad = exponentials.mul_((mass / sums).unsqueeze(1)).sub_(weighted)
        if softcap:
            grad.mul_(u.div_(softcap).square_().neg_().add_(1.0))
        grad_logits[rows] = grad.mul_(grad_scale[rows].unsqueeze(1))


def gradient(logits, target, weight, row_max_sum, coefficients, grad_logits, options) -> None:
    """For a slice of each row's classes, from the whole row's max m and sum S of exp(u - m):
    grad_logits = du/dx * (a * exp(u - m) / S - b at the target - c * w), (a, b, c) = ``coefficients``; a
    target outside these columns adds no target term. A chunk of rows at a time, in float32 (float64 for float64
    statistics); in place when ``grad_logits`` is ``logits`` (each chunk is read before it is written)."""
    softcap = options.softcap
    classes = logits.shape[1]
    compute = row_max_sum.dtype
    workspace = _Workspace(logits, compute)
    direct = grad_logits.dtype == compute
    for rows in workspace.chunks:
        x = workspace.rows_of(logits, rows)
        if softcap:
            u = torch.div(x, softcap, out=workspace.get("capped", rows)).tanh_().mul_(softcap)
        else:
            u = x
        row_max, row_sum = row_max_sum[0, rows], row_max_sum[1, rows]
        at_all, at_target, per_class = coefficients[:, rows]
        # in place with the logits' dtype, grad and u (when uncapped) are the same memory: elementwise, so fine
        grad = grad_logits[rows] if direct else workspace.get("scratch", rows)
        torch.sub(u, row_max.unsqueeze(1), out=grad).exp_().mul_((at_all / row_sum).unsqueeze(1))
        if weight is not None:
            grad.addr_(per_class, weight, alpha=-1.0)
        else:
            grad.sub_(per_class.unsqueeze(1))
        local_target = target[rows]
        here = (local_target >= 0) & (local_target < classes)
        safe = torch.where(here, local_target, 0).long()
        grad.scatter_add_(1, safe.unsqueeze(1), torch.where(here, -at_target, 0.0).unsqueeze(1))
        if softcap:
            grad.mul_(u.div_(softcap).square_().neg_().add_(1.0))
        if not direct:
            grad_logits[rows] = grad


def scale(grad_logits, factor) -> None:
    """grad_logits *= factor, one value (shape (1,)) or one per row (shape (M,)). One value of exactly 1 leaves
    grad_logits untouched where it can be read without a host synchronisation (a CPU tensor); elsewhere it is
    multiplied, on the device."""
    if factor.shape[0] == 1 and factor.device.type == "cpu" and factor.item() == 1.0:
        return
    grad_logits.mul_(factor.unsqueeze(1))
