"""The numba-cuda backend: kernels written in Python with numba.cuda.jit.

Runs on CUDA tensors, or on CPU tensors under numba's CUDA simulator
(NUMBA_ENABLE_CUDASIM=1, for tests). This module never imports numba.
"""

from __future__ import annotations

import importlib.metadata
import os

import torch

NAME = "numba"
PRIORITY = 100
INSTALL = "pip install 'multisoft[numba]'"

DTYPES = (torch.float32, torch.float16, torch.bfloat16)   # the dtypes the kernels run


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def simulated() -> bool:
    """Whether numba's CUDA simulator is switched on (NUMBA_ENABLE_CUDASIM=1): kernels then run on CPU tensors."""
    return os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"


def version() -> str | None:
    """'numba X, numba-cuda Y'; None unless both are installed."""
    numba, numba_cuda = _dist_version("numba"), _dist_version("numba-cuda")
    if numba is None or numba_cuda is None:
        return None
    return f"numba {numba}, numba-cuda {numba_cuda}"


def unavailable_reason(device: torch.device, dtype: torch.dtype) -> str | None:
    if version() is None:
        return f"numba and numba-cuda are not both installed ({INSTALL})"
    if dtype not in DTYPES:
        return f"{dtype} is not supported (float32, float16, bfloat16)"
    if device.type == "cpu":
        return None if simulated() else ("runs on CUDA GPUs (on the CPU only under numba's CUDA simulator, "
                                         "NUMBA_ENABLE_CUDASIM=1: slow, for tests)")
    if device.type != "cuda":
        return f"runs on CUDA devices, not {device.type}"
    if simulated():
        return "NUMBA_ENABLE_CUDASIM=1 is set: numba runs its simulator on CPU tensors only"
    return None


def notes() -> list[str]:
    lines = []
    if simulated():
        lines.append("NUMBA_ENABLE_CUDASIM=1: kernels run in numba's CUDA simulator (CPU, slow)")
    import numpy
    if not hasattr(numpy, "row_stack"):
        lines.append(f"numpy {numpy.__version__} has no numpy.row_stack, which numba-cuda "
                     f"{_dist_version('numba-cuda')} still names: multisoft lends it a stand-in while numba-cuda "
                     "imports (harmless)")
    lines.append("kernels compile on first use (seconds each) and are cached on disk beside multisoft_numba's "
                 "sources ($NUMBA_CACHE_DIR moves the cache)")
    return lines
