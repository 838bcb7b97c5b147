"""Per-token log-probabilities' row statistics and gradient in PyTorch, float64 arithmetic on float64 copies."""

import torch


def _scaled(logits, options):
    """(u, du/dx) of the logits in float64: softcap first, then temperature."""
    x = logits.to(torch.float64)
    softcap, temperature = options.softcap, options.temperature
    if softcap:
        capped = softcap * torch.tanh(x / softcap)
        return capped / temperature, (1.0 - (capped / softcap).square()) / temperature
    return x / temperature, torch.full_like(x, 1.0 / temperature)


def forward(logits, row_stats, options) -> None:
    """Each row's max m of u, sum S of exp(u - m) and E = sum exp(u - m) (u - m) / S (an element of -inf adds 0)."""
    u, _ = _scaled(logits, options)
    row_max = u.amax(-1, keepdim=True)
    shifted = u - row_max
    weights = shifted.exp()
    row_sum = weights.sum(-1)
    spread = torch.where(u == float("-inf"), 0.0, weights * shifted).sum(-1) / row_sum
    row_stats.copy_(torch.stack((row_max.squeeze(-1), row_sum, spread)))


def backward(logits, target, row_stats, grad_target, row_coefficients, grad_logits, options) -> None:
    """du/dx * (sum_k g_k [j == t_k] - p_j (a + c ((u_j - m) - E))), the p term 0 where u_j is -inf."""
    u, du = _scaled(logits, options)
    classes = u.shape[-1]
    row_max, row_sum, spread = row_stats.to(torch.float64).unsqueeze(-1)
    at_all, at_entropy = row_coefficients.to(torch.float64).unsqueeze(-1)
    shifted = u - row_max
    p = shifted.exp() / row_sum
    spread_term = torch.where(u == float("-inf"), 0.0, p * (at_all + at_entropy * (shifted - spread)))
    ids = target.long()
    inside = (ids >= 0) & (ids < classes)
    picked = torch.zeros_like(u).scatter_add_(1, torch.where(inside, ids, 0),
                                              torch.where(inside, grad_target.to(torch.float64), 0.0))
    grad_logits.copy_(du * (picked - spread_term))
