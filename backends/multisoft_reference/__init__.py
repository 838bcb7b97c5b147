"""The float64 reference backend: every op in PyTorch with float64 arithmetic, on every device and dtype.

Exact answers over speed (and a float64 copy of every input), for anyone who
wants them: name it (``backend="reference"``). The automatic choice never
picks it (``AUTOMATIC = False``); its fast sibling is ``torch``. The tests and
``python -m multisoft check`` do not compare against it: they compare every
backend, this one included, against the float64 references of
``multisoft/check.py`` (through ``tests/harness.py``).
"""

from __future__ import annotations

import torch

NAME = "reference"
PRIORITY = -100
AUTOMATIC = False
INSTALL = "pip install torch"


def version() -> str:
    return torch.__version__


def unavailable_reason(device: torch.device, dtype: torch.dtype) -> str | None:
    return None


def notes() -> list[str]:
    return ["float64 arithmetic on a float64 copy of the inputs; chosen only by name, never automatically"]
