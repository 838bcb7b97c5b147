"""README.md's promises that a test can keep: its CPU example runs as written and gives torch's values."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from multisoft import cli
from multisoft._registry import ENV_VAR

README = Path(__file__).resolve().parent.parent / "README.md"

# Run after the example, in its namespace: its results against float64 torch, at float32's tolerances.
CHECKS = """
from multisoft.check import error_ratio, reference_cross_entropy, reference_softmax
x64 = x.detach().double().requires_grad_()
expected_loss = reference_cross_entropy(x64, target)
(expected_grad,) = torch.autograd.grad(expected_loss, x64)
for name, got, want in (("y", y, reference_softmax(x.detach(), -1, False)), ("loss", loss, expected_loss),
                        ("x.grad", x.grad, expected_grad)):
    assert got.dtype == torch.float32, (name, got.dtype)
    assert error_ratio(got, want, torch.float32)[1] <= 1.0, (name, got, want)
"""


def usage_cpu_example() -> str:
    """The first Python block of the README's Usage section: the one that says it runs anywhere."""
    text = README.read_text()
    usage = text[text.index("\n## Usage\n"):]
    usage = usage[:usage.index("\n## ", 1)]
    return re.search(r"```python\n(.*?)```", usage, re.S).group(1)


def test_the_usage_cpu_example_runs_as_written():
    code = usage_cpu_example()
    assert "cuda" not in code, "the first Usage example is the one for any machine"
    # as a user runs it: the automatic choice, neither Triton's interpreter nor numba's simulator
    env = {k: v for k, v in os.environ.items() if k not in cli.SIMULATION_VARIABLES and k != ENV_VAR}
    result = subprocess.run([sys.executable, "-c", code + CHECKS], capture_output=True, text=True, env=env,
                            cwd=README.parent)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Warning" not in result.stderr, result.stderr
    assert result.stdout.strip(), "the example prints its results"
