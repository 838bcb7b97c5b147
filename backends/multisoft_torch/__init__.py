"""The PyTorch reference backend: runs on every device and dtype torch supports, in float64 arithmetic."""

from __future__ import annotations

import torch

NAME = "torch"
PRIORITY = 0
INSTALL = "pip install torch"


def version() -> str:
    return torch.__version__


def unavailable_reason(device: torch.device, dtype: torch.dtype) -> str | None:
    return None
