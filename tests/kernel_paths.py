"""Each backend's cross-entropy kernel paths, as data: the one table (``CROSS_ENTROPY_PATHS``) that
tests/test_contract.py runs its sentinel, invalid-target and in-place checks on, every (backend, path) pair, and
that the per-backend tests force their paths from.

A path is a backend's tuning constants set for one test (``monkeypatch``, undone after it) so that the small rows
the tests use take a kernel, or a shape of it, that the tuning gives only to other rows (long ones, many or few)
or never on this device. ``"tuned"`` is the backend's own choice, nothing set; a backend the table does not name
has that path only. No test code here: ``force`` sets a path, and where the backend has a probe
(``FORWARD_PROBES``) returns a check that its class-index forward calls did take the path.
"""

from __future__ import annotations

import importlib
from typing import Callable, NamedTuple

import pytest
import torch

TUNED = "tuned"


class Returns(NamedTuple):
    """A setting that replaces a function (a chooser) by one returning its own module's ``name`` (its item
    ``index`` when given), whatever it is asked: the kernel configuration to force, named, not copied."""
    name: str
    index: int | None = None


class KernelPath(NamedTuple):
    """``settings``: {module: {attribute: value}} set for the test. ``takes``: the path the backend's probe
    (``FORWARD_PROBES``) must report for every class-index forward it sees (None: not probed). ``capability``: the
    least CUDA compute capability the path needs (None: any device)."""
    settings: dict = {}
    takes: str | None = None
    capability: tuple[int, int] | None = None


_TRITON = "multisoft_triton._tuning"
_TRITON_CHUNKS_OF_16 = {4: (16, 4), 2: (16, 4)}   # (classes a chunk, warps) by element size


def _cupy_config(name: str, index: int | None = None, capability: tuple[int, int] | None = None) -> KernelPath:
    """CuPy's forward configuration ``name`` (its item ``index``) for every forward, whatever the shape."""
    return KernelPath({"multisoft_cupy._tuning": {"ce_fwd_config": Returns(name, index)}}, capability=capability)


CROSS_ENTROPY_PATHS: dict[str, dict[str, KernelPath]] = {
    "torch": {
        TUNED: KernelPath(),
        # a chunk of 64 elements: a row of 37 classes a chunk (the in-place gradient written chunk by chunk)
        "row-chunks": KernelPath({"multisoft_torch._chunks": {"CHUNK_ELEMENTS": 64, "GPU_CHUNK_ELEMENTS": 64}}),
    },
    "triton": {
        TUNED: KernelPath(),   # the tile kernel for the rows of tests/test_contract.py, as many rows a program as fit
        # the tile kernel with 2 rows of up to 64 classes a program: 9 rows are 5 programs, the last half empty
        "tile": KernelPath({_TRITON: {"CE_TILE_ELEMENTS": 128}}, takes="tile"),
        # the loop kernel for every row (one of one class too), in chunks of 16 classes: 37 classes are 3 chunks,
        # the last of 5
        "loop": KernelPath({_TRITON: {"CE_TILE_MAX": 0, "CE_LOOP_CONFIGS": _TRITON_CHUNKS_OF_16,
                                      "CE_LOOP_GRAD_CONFIGS": _TRITON_CHUNKS_OF_16}}, takes="loop"),
    },
    "numba": {
        # the tuned choice: with a gradient, a row of up to CE_CACHE classes a thread of a block held in registers
        # while its gradient is written ("cached": up to 512 classes under the simulator's 16 threads a block);
        # longer rows, and every row without a gradient, looping
        TUNED: KernelPath(),
        # rows read and re-read 4 elements a thread a step
        "looping": KernelPath({"multisoft_numba._tuning": {"CE_CACHED_THREADS": 0, "CE_UNROLL": 4}},
                              takes="looping"),
    },
    "cupy": {   # each forward configuration (the tuned choice is one of them)
        "warp": _cupy_config("CE_FWD_WARP"),
        "block": _cupy_config("CE_FWD_BLOCK"),
        "block-16bit": _cupy_config("CE_FWD_BLOCK_16BIT"),
        "cluster-of-4": _cupy_config("CE_FWD_CLUSTERS", 0, capability=(9, 0)),
        "cluster-of-8": _cupy_config("CE_FWD_CLUSTERS", 1, capability=(9, 0)),
    },
}


def paths(backend: str) -> dict[str, KernelPath]:
    """``backend``'s cross-entropy paths by name (``{"tuned": KernelPath()}`` for a backend the table does not
    name)."""
    return CROSS_ENTROPY_PATHS.get(backend, {TUNED: KernelPath()})


def forced_paths(backend: str) -> list[str]:
    """The names of ``backend``'s paths that set something (what its own tests parametrize over)."""
    return [name for name, path in paths(backend).items() if path.settings]


def each_path(backends) -> list:
    """pytest parameters ``(backend, path)`` of every path of each of ``backends``, with ids "backend-path"."""
    return [pytest.param(backend, name, id=f"{backend}-{name}") for backend in backends for name in paths(backend)]


def _triton_forward_kernels(monkeypatch, taken: list) -> None:
    """Appends "tile" or "loop" for every class-index forward Triton launches."""
    from multisoft_triton import cross_entropy

    kernels = ((cross_entropy._tile_kernel, "tile"), (cross_entropy._loop_kernel, "loop"))
    real = cross_entropy.launch

    def launch(kernel, *args, **kwargs):
        taken.extend(name for candidate, name in kernels if candidate is kernel)
        return real(kernel, *args, **kwargs)

    monkeypatch.setattr(cross_entropy, "launch", launch)


def _numba_forward_kinds(monkeypatch, taken: list) -> None:
    """Appends "cached" or "looping" for every class-index forward numba compiles or reuses with a gradient (without
    one every row loops: no choice to probe)."""
    from multisoft_numba import cross_entropy

    real = cross_entropy._forward

    def forward(fmt, width, per_thread, cached, smooth, has_weight, capped, with_grad, with_stats):
        if with_grad:
            taken.append("cached" if cached else "looping")
        return real(fmt, width, per_thread, cached, smooth, has_weight, capped, with_grad, with_stats)

    monkeypatch.setattr(cross_entropy, "_forward", forward)


# backend -> probe(monkeypatch, taken): records which path each class-index forward took
FORWARD_PROBES: dict[str, Callable] = {"triton": _triton_forward_kernels, "numba": _numba_forward_kinds}


def _returning(value):
    return lambda *args, **kwargs: value


def force(monkeypatch, backend: str, name: str) -> Callable[..., None]:
    """Sets ``backend``'s path ``name`` for the rest of the test (skipped where the device lacks what it needs) and
    returns ``assert_took(at_least_once=True)``: every class-index forward since that could take another path took
    this one, and (unless ``at_least_once`` is False: a test whose calls cannot choose) one did at least."""
    path = paths(backend)[name]
    if path.capability is not None:
        if not torch.cuda.is_available() or torch.cuda.get_device_capability() < path.capability:
            pytest.skip(f"{backend}'s path {name} needs compute capability {path.capability}")
    for module_name, attributes in path.settings.items():
        module = importlib.import_module(module_name)
        for attribute, value in attributes.items():
            if isinstance(value, Returns):
                chosen = getattr(module, value.name)
                value = _returning(chosen if value.index is None else chosen[value.index])
            monkeypatch.setattr(module, attribute, value)
    taken: list[str] = []
    if path.takes is not None:
        FORWARD_PROBES[backend](monkeypatch, taken)

    def assert_took(at_least_once: bool = True) -> None:
        if path.takes is None:
            return
        assert all(kind == path.takes for kind in taken), f"{backend}, path {name}: the forward took {taken}"
        assert taken or not at_least_once, f"{backend}, path {name}: no forward call took {path.takes}"

    return assert_took
