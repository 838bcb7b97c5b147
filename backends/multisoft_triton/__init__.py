"""Triton backend: the primary GPU kernels of multisoft.

Importing this package imports torch, not triton; the op modules (softmax, cross_entropy, blocksparse, log_probs) do,
on first use. Their launch glue is _launch, their shared @triton.jit helpers _device, their choices by shape and dtype
_tuning. No OPS: it implements every op.
"""
import importlib.metadata
import importlib.util
import os

import torch

NAME = "triton"
PRIORITY = 300
INSTALL = "pip install 'multisoft[triton]'"

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def version():
    """The installed triton version, or None when triton is not installed."""
    try:
        return importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        return None


def simulated() -> bool:
    """True when Triton's interpreter runs the kernels on the CPU (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def unavailable_reason(device, dtype):
    """Why triton cannot run on `device`/`dtype`, or None when it can."""
    if importlib.util.find_spec("triton") is None:
        return f"triton is not installed ({INSTALL})"
    if dtype is not None and dtype not in DTYPES:
        return f"dtype {dtype} is not supported (float32, float16, bfloat16)"
    kind = getattr(device, "type", str(device).split(":")[0])
    if kind == "cuda":
        if not torch.cuda.is_available():
            return "torch.cuda is not available"
        return None
    if kind == "cpu":
        if simulated():
            return None
        return "runs on CUDA GPUs (on the CPU only under Triton's interpreter, TRITON_INTERPRET=1: slow, for tests)"
    return f"device type {kind!r} is not supported"


def notes():
    lines = []
    if simulated():
        lines.append("TRITON_INTERPRET=1: kernels run in the triton interpreter on CPU (slow)")
    lines.append("kernels compile on first use for each GPU, dtype and shape class; Triton keeps them in "
                 "~/.triton/cache ($TRITON_CACHE_DIR moves it)")
    return lines
