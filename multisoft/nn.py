"""Drop-in modules for ``torch.nn.Softmax``, ``torch.nn.LogSoftmax`` and ``torch.nn.CrossEntropyLoss``."""

from __future__ import annotations

import torch

from ._cross_entropy import cross_entropy
from ._softmax import log_softmax, softmax


class Softmax(torch.nn.Module):
    def __init__(self, dim: int = -1, *, backend: str | None = None):
        super().__init__()
        self.dim, self.backend = dim, backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return softmax(x, self.dim, backend=self.backend)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, backend={self.backend!r}"


class LogSoftmax(Softmax):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return log_softmax(x, self.dim, backend=self.backend)


class CrossEntropyLoss(torch.nn.Module):
    def __init__(self, weight: torch.Tensor | None = None, ignore_index: int = -100, reduction: str = "mean",
                 label_smoothing: float = 0.0, *, backend: str | None = None, inplace_backward: bool = False):
        super().__init__()
        self.register_buffer("weight", weight)
        self.ignore_index, self.reduction, self.label_smoothing = ignore_index, reduction, label_smoothing
        self.backend, self.inplace_backward = backend, inplace_backward

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return cross_entropy(logits, target, weight=self.weight, ignore_index=self.ignore_index,
                             reduction=self.reduction, label_smoothing=self.label_smoothing,
                             backend=self.backend, inplace_backward=self.inplace_backward)

    def extra_repr(self) -> str:
        return f"ignore_index={self.ignore_index}, reduction={self.reduction!r}, backend={self.backend!r}"
