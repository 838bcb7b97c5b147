"""Test configuration.

Without a CUDA device the GPU backends still run, on the CPU: Triton under its
interpreter and numba under its CUDA simulator. This file sets
TRITON_INTERPRET=1 and NUMBA_ENABLE_CUDASIM=1 for that, before any test imports
those frameworks (the library itself never sets them); ``--no-simulate`` turns
it off. ``MULTISOFT_TEST_BACKENDS=a,b`` limits the agreement harness to those
backends. The fixture ``one_large_test_at_a_time`` runs the tests of more than
2**31 elements (GPU only) one at a time across pytest-xdist's workers.
"""

import contextlib
import gc
import os
import tempfile
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


LARGE_GIB = 40  # GPU memory the largest test of more than 2**31 elements needs, with its reference


@pytest.fixture
def one_large_test_at_a_time():
    """For a test that needs tens of GiB of the GPU: one such test at a time across pytest-xdist's workers (a file
    lock), skipped where the GPU has less than LARGE_GIB free, its memory handed back to the driver after it."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (the interpreter and the simulator cannot hold 2**31 elements)")
    import fcntl

    with open(os.path.join(tempfile.gettempdir(), "multisoft-tests-large.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        with contextlib.ExitStack() as release:
            release.callback(torch.cuda.empty_cache)
            release.callback(gc.collect)
            free, _ = torch.cuda.mem_get_info()
            if free < LARGE_GIB << 30:
                pytest.skip(f"needs {LARGE_GIB} GiB of free GPU memory, has {free / 2**30:.0f}")
            yield


@pytest.fixture
def cross_entropy_calls(monkeypatch):
    """(kernel name, its arguments) of every cross-entropy ``forward`` and ``probabilities_forward`` call, on any
    backend: what the front hands the kernels (which buffer, which dtype, a gradient or None)."""
    from multisoft import _registry

    calls = []
    real = _registry.Backend.kernels

    def recording(module, name):
        def call(*args, **kwargs):
            calls.append((name, args))
            return getattr(module, name)(*args, **kwargs)
        return call

    def kernels(self, op):
        module = real(self, op)
        if op != "cross_entropy":
            return module

        class Recording:
            scale = staticmethod(module.scale)
            forward = staticmethod(recording(module, "forward"))
            probabilities_forward = staticmethod(recording(module, "probabilities_forward"))
        return Recording

    monkeypatch.setattr(_registry.Backend, "kernels", kernels)
    return calls


@pytest.fixture
def targets_unchecked_on_the_cpu(monkeypatch):
    """Without the front's check of class-index targets on the CPU (``IndexError`` there, as torch's): what the
    front does on a GPU, so that a CPU test sees the backends' own answer to a target outside the classes (a NaN
    row, read in bounds)."""
    from multisoft import _cross_entropy, _linear_cross_entropy, vocab_parallel

    for module in (_cross_entropy, _linear_cross_entropy, vocab_parallel):
        monkeypatch.setattr(module, "check_targets_in_bounds", lambda *_: None)
