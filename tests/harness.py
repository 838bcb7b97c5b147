"""What the agreement tests run on: the device, the backends available there (`on_each_backend`), tolerances,
references.

A backend joins the harness by being installed and able to run on the test
device: no test code names it.
"""

from __future__ import annotations

import os

import pytest
import torch

import multisoft
from multisoft.check import TOLERANCES, error_ratio

DEVICE = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
ON_GPU = DEVICE.type == "cuda"
SELECTION_VARIABLE = "MULTISOFT_TEST_BACKENDS"
NATIVE_ON_CPU = ("torch", "reference")  # torch's own ops: neither interpreted nor simulated on the CPU


def backends_under_test() -> list[str]:
    """Every installed backend that can run on DEVICE (those chosen only by name, such as ``reference``, too), or
    those of them that $MULTISOFT_TEST_BACKENDS lists; a name there that is not installed, or a list of which
    none can run here, is a ValueError rather than a run that tests nothing."""
    installed = multisoft.backends(DEVICE)
    only = [n.strip() for n in os.environ.get(SELECTION_VARIABLE, "").split(",") if n.strip()]
    unknown = [n for n in only if n not in {b.name for b in installed}]
    if unknown:
        raise ValueError(f"{SELECTION_VARIABLE} names {', '.join(map(repr, unknown))}, not an installed backend; "
                         f"installed: {', '.join(b.name for b in installed)}")
    names = [b.name for b in installed if b.available and (not only or b.name in only)]
    if only and not names:
        reasons = "; ".join(f"{b.name}: {b.unavailable_reason}" for b in installed if b.name in only)
        raise ValueError(f"no backend that {SELECTION_VARIABLE}={','.join(only)!r} lists can run on {DEVICE} "
                         f"({reasons})")
    return names


BACKENDS = backends_under_test()
on_each_backend = pytest.mark.parametrize("backend", BACKENDS)  # the one parametrization over the backends


def simulated(backend: str) -> bool:
    """True when ``backend`` runs on the CPU under an interpreter or simulator: keep shapes small."""
    return not ON_GPU and backend not in NATIVE_ON_CPU


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str,
                 magnitude: torch.Tensor | None = None) -> None:
    """Elementwise |actual - expected| <= atol + rtol * magnitude (default |expected|), the dtype's tolerances."""
    max_error, ratio = error_ratio(actual, expected, dtype, magnitude)
    atol, rtol = TOLERANCES[dtype]
    assert ratio <= 1.0, f"{what}: max error {max_error:.3g} is {ratio:.3g} x the tolerance (atol={atol}, rtol={rtol})"


def float16_gradient_error_ratio(actual: torch.Tensor, expected: torch.Tensor, logits: torch.Tensor) -> float:
    """The largest |actual - expected| over its bound, for a float16 cross-entropy gradient against float64: float16's
    rtol (2e-3) * |expected| + two subnormal steps (2**-23) + half a float32 step of the row's largest |logit|
    (2**-24 * max |x| over the row of ``logits``, whole rows even where ``actual`` is a slice of their classes):
    a kernel computes p = exp(x - lse) in float32, and at the target p - 1, near 0 for a confident row, keeps the
    rounding of the lse (torch's own op computed in float32 reaches 0.3 of this bound, in float16 300 times it)."""
    lse_rounding = 2.0 ** -24 * logits.detach().double().abs().amax(-1, keepdim=True)
    bound = 2e-3 * expected.abs() + 2.0 ** -23 + lse_rounding
    return ((actual.double() - expected).abs() / bound).max().item()


def activation(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(leaf, logits): a leaf that requires grad holding ``values``, and a copy of it that is an activation, as a
    model's logits are (``inplace_backward=True`` refuses a leaf that requires grad, as torch refuses an in-place
    op there). A gradient written into the logits reaches ``leaf.grad`` through clone's backward without a copy."""
    leaf = values.detach().clone().requires_grad_(True)
    return leaf, leaf.clone()
