"""What the agreement tests run on: the device, the backends available there, tolerances, references.

A backend joins the harness by being installed and able to run on the test
device: no test code names it.
"""

from __future__ import annotations

import os

import torch

from multisoft._registry import _default_backends
from multisoft.check import TOLERANCES, error_ratio

DEVICE = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
ON_GPU = DEVICE.type == "cuda"


def backends_under_test() -> list[str]:
    only = {n.strip() for n in os.environ.get("MULTISOFT_TEST_BACKENDS", "").split(",") if n.strip()}
    names = [b.name for b in _default_backends() if b.unavailable_reason(DEVICE, torch.float32) is None]
    return [n for n in names if not only or n in only]


def simulated(backend: str) -> bool:
    """True when ``backend`` runs on the CPU under an interpreter or simulator: keep shapes small."""
    return not ON_GPU and backend != "torch"


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str,
                 magnitude: torch.Tensor | None = None) -> None:
    """Elementwise |actual - expected| <= atol + rtol * magnitude (default |expected|), the dtype's tolerances."""
    max_error, ratio = error_ratio(actual, expected, dtype, magnitude)
    atol, rtol = TOLERANCES[dtype]
    assert ratio <= 1.0, f"{what}: max error {max_error:.3g} is {ratio:.3g} x the tolerance (atol={atol}, rtol={rtol})"
