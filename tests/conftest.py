"""Test configuration.

Without a CUDA device the GPU backends still run, on the CPU: Triton under its
interpreter and numba under its CUDA simulator. This file sets
TRITON_INTERPRET=1 and NUMBA_ENABLE_CUDASIM=1 for that, before any test imports
those frameworks (the library itself never sets them); ``--no-simulate`` turns
it off. ``MULTISOFT_TEST_BACKENDS=a,b`` limits the agreement harness to those
backends.
"""

import os
import zlib

import pytest
import torch

from multisoft.cli import SIMULATION_VARIABLES  # the CLI's --simulate sets the same ones; imports no framework


def pytest_addoption(parser):
    parser.addoption("--no-simulate", action="store_true",
                     help="without a GPU, do not run Triton's interpreter and numba's CUDA simulator")


def pytest_configure(config):
    if not config.getoption("--no-simulate") and not torch.cuda.is_available():
        for name, value in SIMULATION_VARIABLES.items():
            os.environ.setdefault(name, value)


@pytest.fixture(autouse=True)
def _fresh_registry_caches():
    """Tests that patch a backend's availability must not see answers cached by earlier tests."""
    from multisoft._registry import clear_caches

    clear_caches()
    yield
    clear_caches()


@pytest.fixture(autouse=True)
def _fresh_random_inputs(request):
    """A different but reproducible seed per test, so no two tests share inputs. crc32, not hash():
    Python salts str hashes per process, so hash() gave each run other inputs (and other skips, where a
    random layout's size decides them)."""
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))
