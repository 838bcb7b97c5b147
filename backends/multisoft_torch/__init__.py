"""The PyTorch backend: every op in PyTorch's own ops, on every device and dtype torch supports.

The automatic choice falls back to it where no GPU backend can run a call (a
CPU tensor, float64, a device without one). Arithmetic is float32 for 16-bit
inputs (as in the GPU kernels) and the input's own dtype for float32 and
float64; rows are taken a chunk at a time (``_chunks``) so that temporaries
stay bounded. The float64 reference is the separate backend ``reference``.
"""

from __future__ import annotations

import torch

NAME = "torch"
PRIORITY = 0
INSTALL = "pip install torch"


def version() -> str:
    return torch.__version__


def unavailable_reason(device: torch.device, dtype: torch.dtype) -> str | None:
    return None


def notes() -> list[str]:
    from . import _chunks

    return [f"16-bit inputs computed in float32; rows taken {_chunks.CHUNK_ELEMENTS:,} elements at a time on the "
            f"CPU, {_chunks.GPU_CHUNK_ELEMENTS:,} elsewhere"]
