"""Per-row cross-entropy and its gradient in PyTorch, float64 arithmetic on a float64 copy of the logits.

A target outside [0, C) that is not ``ignore_index`` gives a NaN loss and a NaN gradient row, and is never read.
"""

import torch


def _capped(logits, softcap):
    x = logits.to(torch.float64)
    return softcap * torch.tanh(x / softcap) if softcap else x


def forward(logits, target, weight, loss, lse, row_weight, grad_logits, grad_scale, options, row_stats=None) -> None:
    ignore_index, label_smoothing = options.ignore_index, options.label_smoothing
    softcap, lse_square_scale = options.softcap, options.lse_square_scale
    classes = logits.shape[1]
    eps, s = label_smoothing, lse_square_scale
    u = _capped(logits, softcap)
    ignored = target == ignore_index
    in_range = (target >= 0) & (target < classes)
    safe = torch.where(in_range & ~ignored, target, 0).long()
    w = torch.ones(classes, dtype=torch.float64, device=u.device) if weight is None else weight.to(torch.float64)
    target_weight = torch.where(ignored, 0.0, w[safe])  # an ignored row takes no weight, as torch's
    row_lse = u.logsumexp(-1)
    per_row = (1.0 - eps) * target_weight * (row_lse - u.gather(1, safe.unsqueeze(1)).squeeze(1))
    if eps:  # only then: a -inf logit's lse - u is inf, and 0 * inf would make the loss NaN
        per_row = per_row + eps / classes * ((row_lse.unsqueeze(1) - u) * w).sum(-1)
    if s:
        per_row = per_row + s * row_lse.square()
    # a +inf logit: torch's log_softmax is NaN throughout the row (inf - inf), so its loss is NaN, not lse - u = inf
    per_row = torch.where(u.amax(-1) == float("inf"), float("nan"), per_row)
    lse.copy_(row_lse)
    loss.copy_(torch.where(ignored, 0.0, torch.where(in_range, per_row, float("nan"))))
    row_weight.copy_(torch.where(ignored, 0.0, target_weight))
    if row_stats is not None:
        row_max = u.amax(-1)
        row_sum = (u - row_max.unsqueeze(1)).exp().sum(-1)
        row_stats[0].copy_(row_max)
        row_stats[1].copy_(torch.where(row_max == float("-inf"), 0.0, row_sum))
        row_stats[2].copy_((u * w).sum(-1) if eps else torch.zeros_like(row_max))
    if grad_logits is None:
        return
    p = torch.softmax(u, -1)
    one_hot = torch.zeros_like(p).scatter_(1, safe.unsqueeze(1), 1.0)
    total = (1.0 - eps) * target_weight + 2.0 * s * row_lse
    if eps:  # only then: eps / C * w is NaN where a weight is infinite
        total = total + eps / classes * w.sum()
    grad_u = p * total.unsqueeze(1) - (1.0 - eps) * target_weight.unsqueeze(1) * one_hot
    if eps:
        grad_u = grad_u - eps / classes * w
    grad = grad_u * (1.0 - (u / softcap).square()) if softcap else grad_u
    g = torch.where(ignored, 0.0, torch.where(in_range, grad_scale.to(torch.float64), float("nan")))
    grad_logits.copy_(grad * g.unsqueeze(1))


def gradient(logits, target, weight, row_max_sum, coefficients, grad_logits, options) -> None:
    """For a slice of each row's classes, in float64, from the whole row's max m and sum S of exp(u - m):
    du/dx * (a * exp(u - m) / S - b at the target - c * w), (a, b, c) = ``coefficients``; a target outside
    these columns adds no target term."""
    softcap = options.softcap
    classes = logits.shape[1]
    u = _capped(logits, softcap)
    row_max, row_sum = row_max_sum.to(torch.float64).unsqueeze(2)
    at_all, at_target, per_class = coefficients.to(torch.float64).unsqueeze(2)
    w = torch.ones(classes, dtype=torch.float64, device=u.device) if weight is None else weight.to(torch.float64)
    columns = torch.arange(classes, device=u.device)
    is_target = columns == target.unsqueeze(1)  # never true for a target outside these columns
    grad_u = (u - row_max).exp() / row_sum * at_all - torch.where(is_target, at_target, 0.0) - per_class * w
    grad_logits.copy_(grad_u * (1.0 - (u / softcap).square()) if softcap else grad_u)


def probabilities_forward(logits, target, weight, loss, lse, grad_logits, grad_scale, options) -> None:
    """Class-probability targets in float64: ``-sum_j w_j q_j log p_j + s lse**2`` with
    ``q = (1 - eps) target + eps / C``, and its gradient ``p (A + 2 s lse) - w q`` (A = sum_j w_j q_j) through the
    cap, times grad_scale."""
    label_smoothing = options.label_smoothing
    softcap, lse_square_scale = options.softcap, options.lse_square_scale
    classes = logits.shape[1]
    u = _capped(logits, softcap)
    w = torch.ones(classes, dtype=torch.float64, device=u.device) if weight is None else weight.to(torch.float64)
    q = (1.0 - label_smoothing) * target.to(torch.float64) + label_smoothing / classes
    weighted = w * q
    row_lse = u.logsumexp(-1)
    per_row = -(weighted * torch.log_softmax(u, -1)).sum(-1)
    if lse_square_scale:
        per_row = per_row + lse_square_scale * row_lse.square()
    lse.copy_(row_lse)
    loss.copy_(per_row)
    if grad_logits is None:
        return
    mass = weighted.sum(-1) + 2.0 * lse_square_scale * row_lse
    grad_u = torch.softmax(u, -1) * mass.unsqueeze(1) - weighted
    grad = grad_u * (1.0 - (u / softcap).square()) if softcap else grad_u
    grad_logits.copy_(grad * grad_scale.to(torch.float64).unsqueeze(1))


def scale(grad_logits, factor) -> None:
    """grad_logits *= factor in float64 (one value, shape (1,), or one per row); one value of exactly 1 read on
    the host leaves grad_logits untouched (CPU tensors only: elsewhere that would synchronise)."""
    if factor.shape[0] == 1 and factor.device.type == "cpu" and factor.item() == 1.0:
        return
    grad_logits.copy_(grad_logits.to(torch.float64) * factor.to(torch.float64).unsqueeze(1))
