"""Test configuration.

``--simulate`` runs the GPU backends on the CPU: it sets TRITON_INTERPRET=1 and
NUMBA_ENABLE_CUDASIM=1 here, before any test imports those frameworks (the
library itself never sets them). ``MULTISOFT_TEST_BACKENDS=a,b`` limits the
agreement harness to those backends.
"""

import os

import pytest
import torch


def pytest_addoption(parser):
    parser.addoption("--simulate", action="store_true",
                     help="run Triton under its interpreter and numba under its CUDA simulator, on the CPU")


def pytest_configure(config):
    if config.getoption("--simulate"):
        os.environ["TRITON_INTERPRET"] = "1"
        os.environ["NUMBA_ENABLE_CUDASIM"] = "1"


@pytest.fixture(autouse=True)
def _fresh_random_inputs(request):
    """A different but reproducible seed per test, so no two tests share inputs."""
    torch.manual_seed(abs(hash(request.node.nodeid)) % (2**31))
