"""What the agreement tests run on: the device, the backends available there, tolerances, references.

A backend joins the harness by being installed and able to run on the test
device: no test code names it.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

import multisoft
from multisoft._registry import _default_backends

DEVICE = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
ON_GPU = DEVICE.type == "cuda"
DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# (atol, rtol) against a float64 reference computed from the same (rounded) inputs.
TOLERANCES = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (1e-4, 2e-3),
    torch.bfloat16: (1e-3, 1.6e-2),
    torch.float64: (1e-10, 1e-10),
}


def backends_under_test() -> list[str]:
    only = {n.strip() for n in os.environ.get("MULTISOFT_TEST_BACKENDS", "").split(",") if n.strip()}
    names = [b.name for b in _default_backends() if b.unavailable_reason(DEVICE, torch.float32) is None]
    return [n for n in names if not only or n in only]


def simulated(backend: str) -> bool:
    """True when ``backend`` runs on the CPU under an interpreter or simulator: keep shapes small."""
    return not ON_GPU and backend != "torch"


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    atol, rtol = TOLERANCES[dtype]
    actual64 = actual.detach().to("cpu", torch.float64)
    expected64 = expected.detach().to("cpu", torch.float64)
    assert actual64.shape == expected64.shape, f"{what}: shape {actual64.shape} != {expected64.shape}"
    same = (torch.isnan(actual64) & torch.isnan(expected64)) | (actual64 == expected64)
    error = (actual64 - expected64).abs()
    bound = atol + rtol * expected64.abs()
    bad = ~same & ~(error <= bound)
    if bad.any():
        index = bad.nonzero()[0].tolist()
        worst = torch.where(same, 0.0, error).nan_to_num(float("inf")).max().item()
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {bad.numel()} elements off (atol={atol}, rtol={rtol}); "
            f"first at {index}: got {actual64[tuple(index)].item()}, expected {expected64[tuple(index)].item()}; "
            f"max error {worst:.3g}")


# -- float64 references


def reference_softmax(x: torch.Tensor, dim: int, log: bool) -> torch.Tensor:
    x64 = x.double()
    return torch.log_softmax(x64, dim) if log else torch.softmax(x64, dim)


def reference_softmax_backward(y: torch.Tensor, dy: torch.Tensor, dim: int, log: bool) -> torch.Tensor:
    """The backward as a function of the forward's output, in float64 (gradcheck ties it to the derivative)."""
    y64, dy64 = y.detach().double(), dy.detach().double()
    if log:
        return dy64 - y64.exp() * dy64.sum(dim, keepdim=True)
    return y64 * (dy64 - (y64 * dy64).sum(dim, keepdim=True))


def reference_blocksparse_backward(y, dy, layout, block, scale) -> torch.Tensor:
    """dx = scale * y * (dy - rowsum(y * dy)) in float64, from the forward's output."""
    y64 = multisoft.blocksparse_to_dense(y.detach().double(), layout, block)
    dy64 = multisoft.blocksparse_to_dense(dy.detach().double(), layout, block)
    dx = scale * y64 * (dy64 - (y64 * dy64).sum(-1, keepdim=True))
    return multisoft.blocksparse_from_dense(dx, layout, block)


def reference_cross_entropy(logits, target, **kwargs) -> torch.Tensor:
    weight = kwargs.pop("weight", None)
    return F.cross_entropy(logits.double(), target.long(), weight=None if weight is None else weight.double(),
                           **kwargs)


def reference_blocksparse(x, layout, block, scale, is_causal) -> torch.Tensor:
    dense = multisoft.blocksparse_to_dense(x.double(), layout, block, fill=float("-inf")) * scale
    if is_causal:
        m, n = dense.shape[-2:]
        dense = dense.masked_fill(torch.ones(m, n, dtype=torch.bool, device=x.device).triu(1), float("-inf"))
    masked_row = torch.isinf(dense).all(-1, keepdim=True)
    y = torch.softmax(dense.masked_fill(masked_row, 0.0), -1).masked_fill(masked_row, 0.0)
    y = y.masked_fill(torch.isinf(dense), 0.0)
    return multisoft.blocksparse_from_dense(y, layout, block)
