"""The CuPy backend: CUDA C kernels (the package's .cu files) compiled with NVRTC through cupy.RawModule."""

from __future__ import annotations

import importlib.metadata
import importlib.util

import torch

NAME = "cupy"
PRIORITY = 200
OPS = ("softmax", "cross_entropy", "blocksparse", "log_probs")
INSTALL = "pip install 'multisoft[cupy-cuda12]' or 'multisoft[cupy-cuda13]'"

DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # the dtypes the kernels run

_DISTRIBUTIONS = ("cupy-cuda13x", "cupy-cuda12x", "cupy")


def simulated() -> bool:
    """Always False: CuPy has no CPU simulator, its kernels run only on a GPU."""
    return False


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
    if dtype not in DTYPES:
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
        "needs an NVIDIA GPU of compute capability 8.0 or newer and the CuPy wheel of its CUDA major version "
        "(cupy-cuda12x or cupy-cuda13x)",
        "kernels compile on first use for each GPU, dtype and shape class; CuPy keeps the binaries in "
        "~/.cupy/kernel_cache ($CUPY_CACHE_DIR moves it)",
    ]
