"""The CuPy backend: CUDA C kernels (the package's .cu files) compiled with NVRTC through cupy.RawModule."""

from __future__ import annotations

import importlib.metadata
import importlib.util

import torch

from . import _catalog  # imports no CUDA framework

NAME = "cupy"
PRIORITY = 200
INSTALL = "pip install 'multisoft[cupy-cuda12]' or 'multisoft[cupy-cuda13]'"

_DISTRIBUTIONS = ("cupy-cuda13x", "cupy-cuda12x", "cupy")
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def version() -> str | None:
    """CuPy's version, read from the installed distribution without importing cupy."""
    for dist in _DISTRIBUTIONS:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def unavailable_reason(device: torch.device, dtype: torch.dtype) -> str | None:
    if device.type != "cuda":
        return "CuPy runs only on CUDA devices"
    if dtype not in _DTYPES:
        return f"no CuPy kernels for {dtype}"
    if version() is None or importlib.util.find_spec("cupy") is None:
        return f"cupy is not installed ({INSTALL})"
    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    major, _ = torch.cuda.get_device_capability(device)
    if major < 8:
        return "the CuPy kernels need compute capability 8.0 or newer"
    return None


def notes() -> list[str]:
    return [
        "kernels compile on first use per device, dtype and shape class (NVRTC); "
        "CuPy caches binaries on disk ($CUPY_CACHE_DIR)",
        "long rows are split over blocks that exchange their chunk's statistics through global memory (the "
        f"backward, and the float32 forward from {_catalog.SPLIT_MIN_COLUMNS[('fwd', 4)]} columns), or "
        "staged in shared memory (cp.async; a cluster of blocks per long row), where that measured faster, "
        "else held in registers; rows longer than any of these holds are read twice",
        "the block-sparse forward stages each row in shared memory (cp.async, a warp per row) where the layout's "
        f"mean row is {_catalog.BLOCKSPARSE_STAGED_FROM} elements or more",
    ]
