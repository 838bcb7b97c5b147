"""Row softmax and log_softmax in PyTorch, float64 arithmetic (the reference: accuracy over speed)."""

import torch


def forward(x: torch.Tensor, out: torch.Tensor, log: bool) -> None:
    op = torch.log_softmax if log else torch.softmax
    out.copy_(op(x, -1, dtype=torch.float64))


def backward(y: torch.Tensor, dy: torch.Tensor, dx: torch.Tensor, log: bool) -> None:
    y, dy = y.to(torch.float64), dy.to(torch.float64)
    if log:
        dx.copy_(dy - y.exp() * dy.sum(-1, keepdim=True))
    else:
        dx.copy_(y * (dy - (y * dy).sum(-1, keepdim=True)))
