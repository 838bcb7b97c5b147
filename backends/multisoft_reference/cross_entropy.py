"""Per-row cross-entropy and its gradient in PyTorch, float64 arithmetic; raises on targets out of range."""

import torch


def _check_targets(target: torch.Tensor, classes: int, ignore_index: int) -> torch.Tensor:
    valid = target != ignore_index
    if bool((valid & ((target < 0) | (target >= classes))).any()):
        raise ValueError(f"target holds class indices outside [0, {classes}) that are not ignore_index={ignore_index}")
    return valid


def _probabilities(logits, lse):
    x = logits.to(torch.float64)
    return x, (x - lse.to(x.dtype).unsqueeze(1)).exp()


def forward(logits, target, weight, loss, lse, row_weight, ignore_index: int, label_smoothing: float) -> None:
    classes = logits.shape[1]
    valid = _check_targets(target, classes, ignore_index)
    x = logits.to(torch.float64)
    row_lse = x.logsumexp(-1)
    lse.copy_(row_lse)
    safe_target = torch.where(valid, target, 0).long()
    nll = row_lse - x.gather(1, safe_target.unsqueeze(1)).squeeze(1)
    w = weight.to(x.dtype) if weight is not None else None
    target_weight = w[safe_target] if w is not None else torch.ones_like(nll)
    row_weight.copy_(torch.where(valid, target_weight, 0.0))
    nll = nll * target_weight
    per_row = (1.0 - label_smoothing) * nll
    if label_smoothing:
        neg_log_p = row_lse.unsqueeze(1) - x
        smooth = (neg_log_p * w).sum(-1) if w is not None else neg_log_p.sum(-1)
        per_row = per_row + label_smoothing / classes * smooth
    loss.copy_(torch.where(valid, per_row, 0.0))


def backward(logits, target, weight, weight_sum, lse, grad_loss, grad_logits, ignore_index: int,
             label_smoothing: float) -> None:
    classes = logits.shape[1]
    valid = _check_targets(target, classes, ignore_index)
    x, p = _probabilities(logits, lse)
    safe_target = torch.where(valid, target, 0).long()
    one_hot = torch.zeros_like(p).scatter_(1, safe_target.unsqueeze(1), 1.0)
    if weight is not None:
        w = weight.to(p.dtype)
        grad = (1.0 - label_smoothing) * w[safe_target].unsqueeze(1) * (p - one_hot)
        grad = grad + label_smoothing / classes * (weight_sum.to(p.dtype) * p - w)
    else:
        grad = (1.0 - label_smoothing) * (p - one_hot) + label_smoothing / classes * (classes * p - 1.0)
    scale = torch.where(valid, grad_loss.to(p.dtype), 0.0).unsqueeze(1)
    grad_logits.copy_(grad * scale)
