"""Backend discovery and resolution.

Backends are packages found by name (top-level ``multisoft_<name>``) or
through the entry-point group ``multisoft.backends``; they are imported only when first
needed, and their kernel modules only when first called. The automatic choice
takes the highest-priority backend that can run a call and implements its op, never
one that declares ``AUTOMATIC = False`` (those run only when named). A backend may
implement a subset of the ops (``OPS`` in its ``__init__.py``; every op when it
declares none). See ``backends/README.md`` for the contract.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
import importlib.metadata
import importlib.util
import os
import pkgutil
import threading
from dataclasses import dataclass
from types import ModuleType
from typing import Iterator

import torch

OPS = ("softmax", "cross_entropy", "blocksparse", "log_probs")  # the kernel modules of the contract, one per op
ENV_VAR = "MULTISOFT_BACKEND"
ENTRY_POINT_GROUP = "multisoft.backends"
PACKAGE_PREFIX = "multisoft_"


class BackendUnavailableError(RuntimeError):
    """A backend that was asked for by name cannot run this call."""


class Backend:
    """A backend package, with its kernel modules loaded on first use."""

    def __init__(self, name: str, package: str):
        self.name = name
        self.package = package
        self._module: ModuleType | None = None
        self._kernels: dict[str, ModuleType] = {}
        self._reasons: dict[tuple, str | None] = {}

    @property
    def module(self) -> ModuleType:
        if self._module is None:
            self._module = importlib.import_module(self.package)
        return self._module

    @property
    def priority(self) -> int:
        return int(getattr(self.module, "PRIORITY", 0))

    @property
    def automatic(self) -> bool:
        """Whether the automatic choice may pick this backend; one with ``AUTOMATIC = False`` runs only by name."""
        return bool(getattr(self.module, "AUTOMATIC", True))

    @property
    def install_hint(self) -> str:
        return getattr(self.module, "INSTALL", f"install the package {self.package}")

    @property
    def ops(self) -> tuple[str, ...]:
        """The ops this backend implements, in ``OPS`` order: its package's ``OPS`` (every op when it declares none).
        Read from its ``__init__.py``: no kernel module or framework is imported. An op this front does not know
        (a backend newer than the front) is left out."""
        declared = getattr(self.module, "OPS", OPS)
        if isinstance(declared, str) or not all(isinstance(op, str) for op in declared):
            raise TypeError(f"backend {self.name!r}: OPS must be a tuple of op names (of {OPS}), got {declared!r}")
        return tuple(op for op in OPS if op in declared)

    def supports(self, op: str) -> bool:
        """Whether this backend implements ``op`` (one of ``OPS``), without importing its framework."""
        if op not in OPS:
            raise ValueError(f"op must be one of {OPS}, got {op!r}")
        return op in self.ops

    def version(self) -> str | None:
        return self.module.version()

    def notes(self) -> list[str]:
        notes = getattr(self.module, "notes", None)
        return list(notes()) if notes else []

    def unavailable_reason(self, device: torch.device, dtype: torch.dtype) -> str | None:
        """Why this backend cannot run on (device, dtype); None when it can. Cached."""
        key = (device.type, device.index, dtype)
        if key not in self._reasons:
            if self.version() is None:
                reason = f"not installed ({self.install_hint})"
            else:
                reason = self.module.unavailable_reason(device, dtype)
            self._reasons[key] = reason
        return self._reasons[key]

    def kernels(self, op: str) -> ModuleType:
        """The backend's kernel module for ``op`` (imports the framework)."""
        module = self._kernels.get(op)
        if module is None:
            module = importlib.import_module(f"{self.package}.{op}")
            self._kernels[op] = module
        return module

    def __repr__(self) -> str:
        return f"Backend({self.name!r})"


_lock = threading.Lock()
_backends: dict[str, Backend] = {}
_discovered = False
_default_order: list[Backend] | None = None
_resolved: dict[tuple, Backend] = {}
_current: contextvars.ContextVar[str | None] = contextvars.ContextVar("multisoft_backend", default=None)


def _discover() -> None:
    global _discovered
    with _lock:
        if _discovered:
            return
        for entry in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            _backends.setdefault(entry.name, Backend(entry.name, entry.value.split(":")[0]))
        for module in pkgutil.iter_modules():
            if module.name.startswith(PACKAGE_PREFIX):
                name = module.name[len(PACKAGE_PREFIX):]
                _backends.setdefault(name, Backend(name, module.name))
        _discovered = True


def backend_names() -> list[str]:
    """Every backend whose package imports here (its framework installed or not), in default priority order."""
    return [b.name for b in _default_backends()]


def _default_backends() -> list[Backend]:
    global _default_order
    if _default_order is None:
        _discover()
        found = []
        for backend in _backends.values():
            try:
                backend.module
            except ImportError:
                continue
            found.append(backend)
        _default_order = sorted(found, key=lambda b: -b.priority)
    return _default_order


def get_backend(name: str) -> Backend:
    """The backend called ``name``; ValueError listing the known ones if none is."""
    backend = _backends.get(name)
    if backend is not None:
        return backend
    _discover()
    if name not in _backends:
        package = PACKAGE_PREFIX + name
        if name.isidentifier() and importlib.util.find_spec(package) is not None:
            _backends[name] = Backend(name, package)
        else:
            known = ", ".join(sorted(backend_names()))
            raise ValueError(f"unknown backend {name!r}; known backends: {known}")
    return _backends[name]


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Run the ops inside this block on backend ``name`` (thread- and task-local).

    Under ``torch.compile`` the backend is chosen when a graph is traced, and the graph keeps it: a compiled
    function traced outside this block (or under another ``$MULTISOFT_BACKEND``) goes on running the backend
    it was traced with inside it, with no recompilation. Pass ``backend=`` in the compiled code, or choose
    the backend before the first call and trace again after changing it (``torch.compiler.reset()``).
    """
    get_backend(name)
    token = _current.set(name)
    try:
        yield
    finally:
        _current.reset(token)


def _require(name: str, device: torch.device, dtype: torch.dtype, op: str | None, chosen_by: str = "") -> Backend:
    backend = get_backend(name)
    if op is not None and not backend.supports(op):
        others = ", ".join(b.name for b in _default_backends() if b.supports(op)) or "none"
        raise BackendUnavailableError(f"{chosen_by}backend {name!r} does not implement {op} (it implements "
                                      f"{', '.join(backend.ops) or 'no op'}); backends that implement {op}: {others}")
    reason = backend.unavailable_reason(device, dtype)
    if reason is not None:
        raise BackendUnavailableError(f"{chosen_by}backend {name!r} cannot run on {device} with {dtype}: {reason}")
    return backend


def environment_backends(value: str) -> list[str]:
    """The backend names of a ``$MULTISOFT_BACKEND`` value (one name, or a comma-separated priority list; none
    for an empty one); a ValueError naming the variable and its value for a name that is not a backend here."""
    names = [n.strip() for n in value.split(",") if n.strip()]
    for name in names:
        try:
            get_backend(name)
        except ValueError as error:
            raise ValueError(f"environment variable {ENV_VAR}={value!r}: {error} (one name, or a comma-separated "
                             f"priority list; unset it for the automatic choice)") from None
    return names


def resolve(device: torch.device, dtype: torch.dtype, backend: str | None = None, op: str | None = None) -> Backend:
    """The backend for a call of ``op`` (one of ``OPS``): argument, then use_backend, then $MULTISOFT_BACKEND, then
    the automatic choice (the highest-priority backend that implements ``op`` and can run, skipping those with
    ``AUTOMATIC = False``). A list in $MULTISOFT_BACKEND and the automatic choice pass over a backend that does not
    implement ``op``; one named alone raises BackendUnavailableError. ``op=None`` asks about the device and dtype
    only. Cached per (backend, $MULTISOFT_BACKEND, device, dtype, op)."""
    if backend is None:
        backend = _current.get()
    env = os.environ.get(ENV_VAR, "") if backend is None else None
    key = (backend, env, device, dtype, op)
    found = _resolved.get(key)
    if found is None:
        if op is not None and op not in OPS:
            raise ValueError(f"op must be one of {OPS}, got {op!r}")
        found = _resolve(device, dtype, backend, env.strip() if env is not None else "", op)
        _resolved[key] = found
    return found


def clear_caches() -> None:
    """Forget resolutions and availability answers (after installing a backend, or in tests)."""
    _resolved.clear()
    for backend in _backends.values():
        backend._reasons.clear()


def _resolve(device: torch.device, dtype: torch.dtype, backend: str | None, env: str, op: str | None) -> Backend:
    if backend is not None:
        return _require(backend, device, dtype, op)
    names = environment_backends(env) if env else []
    if len(names) == 1:
        return _require(names[0], device, dtype, op, f"{ENV_VAR}={env!r}: ")
    if names:
        candidates = [get_backend(n) for n in names]
    else:
        candidates = [b for b in _default_backends() if b.automatic]
    for candidate in candidates:
        if (op is None or candidate.supports(op)) and candidate.unavailable_reason(device, dtype) is None:
            return candidate
    what = "" if op is None else f" {op}"
    if names:
        raise BackendUnavailableError(f"no backend of {ENV_VAR}={env!r} can run{what} on {device} with {dtype}")
    raise BackendUnavailableError(f"no installed backend can run{what} on {device} with {dtype}")


def resolve_name(device: torch.device, dtype: torch.dtype, backend: str | None = None, op: str | None = None) -> str:
    """``resolve(...).name``; under torch.compile it runs once, at trace time, as a constant."""
    return resolve(device, dtype, backend, op).name


# What torch.compiler.assume_constant_result(resolve_name) does, without importing torch._dynamo (and
# with it triton) at import time; test_torch_compile_fullgraph_no_graph_break guards it.
resolve_name._dynamo_marked_constant = True


@dataclass(frozen=True)
class BackendInfo:
    """One installed backend, as ``multisoft.backends()`` describes it."""

    name: str
    version: str | None           # its framework's version; None when the framework is not installed
    priority: int                 # the automatic choice tries higher first
    automatic: bool               # False: never chosen automatically, only by name
    unavailable_reason: str | None  # why it cannot run on the device and dtype asked about; None when it can
    notes: tuple[str, ...]        # what ``python -m multisoft info`` prints under it
    ops: tuple[str, ...]          # the ops it implements (of OPS); a backend may implement a subset

    @property
    def available(self) -> bool:
        return self.unavailable_reason is None


def _default_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def backends(device: torch.device | str | None = None, dtype: torch.dtype = torch.float32) -> list[BackendInfo]:
    """Every backend installed here, in default priority order, and whether it can run on ``device`` (default:
    the current CUDA device, else the CPU) with ``dtype``; those with ``automatic`` False run only when named."""
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, got {type(dtype).__name__}")
    device = _default_device() if device is None else torch.device(device)
    return [BackendInfo(b.name, b.version(), b.priority, b.automatic, b.unavailable_reason(device, dtype),
                        tuple(b.notes()), b.ops) for b in _default_backends()]


def available_backends(op: str | None = None) -> list[str]:
    """Backends installed here that can run on this machine's default device, best first (those chosen only by
    name, such as ``reference``, included); with ``op`` (one of ``OPS``), only those that implement it."""
    if op is not None and op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    device = _default_device()
    return [b.name for b in _default_backends()
            if (op is None or b.supports(op)) and b.unavailable_reason(device, torch.float32) is None]
