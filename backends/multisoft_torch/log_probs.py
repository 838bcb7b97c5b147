"""Per-token log-probabilities' row statistics and gradient in PyTorch's own ops, a chunk of rows at a time, in
float32 for 16-bit logits (the statistics' dtype otherwise)."""

import torch

from . import _chunks


def _scaled(x, options):
    """(u, du/dx) of logits ``x`` (already in the compute dtype): softcap first, then temperature."""
    softcap, temperature = options.softcap, options.temperature
    if softcap:
        capped = torch.tanh(x / softcap).mul_(softcap)
        derivative = (capped / softcap).square_().neg_().add_(1.0)
        return capped.div_(temperature), derivative.div_(temperature)
    return x / temperature, None


def forward(logits, row_stats, options) -> None:
    """Each row's max m of u, sum S of exp(u - m) and E = sum exp(u - m) (u - m) / S (an element of -inf adds 0)."""
    compute = row_stats.dtype
    for rows in _chunks.slices(*logits.shape, logits.device):
        u, _ = _scaled(logits[rows].to(compute), options)
        row_max = u.amax(-1, keepdim=True)
        shifted = u.sub_(row_max)
        weights = shifted.exp()
        row_sum = weights.sum(-1)
        spread = torch.where(shifted == float("-inf"), 0.0, weights.mul_(shifted)).sum(-1).div_(row_sum)
        row_stats[0, rows], row_stats[1, rows], row_stats[2, rows] = row_max.squeeze(-1), row_sum, spread


def backward(logits, target, row_stats, grad_target, row_coefficients, grad_logits, options) -> None:
    """du/dx * (sum_k g_k [j == t_k] - p_j (a + c ((u_j - m) - E))), the p term 0 where u_j is -inf; in place
    when ``grad_logits`` is ``logits`` (each chunk is read before it is written)."""
    compute, classes = row_stats.dtype, logits.shape[-1]
    for rows in _chunks.slices(*logits.shape, logits.device):
        u, derivative = _scaled(logits[rows].to(compute), options)
        row_max, row_sum, spread = row_stats[:, rows].unsqueeze(-1)
        at_all, at_entropy = row_coefficients[:, rows].unsqueeze(-1)
        shifted = u.sub_(row_max)
        minus_infinity = shifted == float("-inf")
        grad = shifted.sub(spread).mul_(at_entropy).add_(at_all).mul_(shifted.exp_().div_(row_sum))
        grad = torch.where(minus_infinity, 0.0, grad).neg_()
        ids = target[rows].long()
        inside = (ids >= 0) & (ids < classes)
        grad.scatter_add_(1, torch.where(inside, ids, 0), torch.where(inside, grad_target[rows].to(compute), 0.0))
        if derivative is not None:
            grad.mul_(derivative)
        else:
            grad.div_(options.temperature)
        grad_logits[rows] = grad
