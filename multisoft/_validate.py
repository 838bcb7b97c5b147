"""Argument checks shared by the public functions: each error names the argument.

Under ``torch.compile(dynamic=True)`` a number argument (and a default read from a function's defaults) is traced
as a symbolic number (``torch.SymFloat``, ``torch.SymInt``), which dynamo reports as a ``float`` or an ``int``.
The checks here take both and never call what dynamo cannot trace on one (``math.isfinite``): a type check passes
it, a comparison becomes a guard of the compiled graph, and it is returned as it is. dynamo traces a NaN or
infinite float as a constant, which the checks see; and multisoft's custom ops take Python floats, so dynamo
specialises a float option where it reaches one (a guard on its value): another value, NaN and infinity included,
recompiles and is checked in that trace. Error messages format a traced number through ``float()``/``int()``,
which dynamo can put in a string (an f-string of the symbolic number itself it cannot).
"""

from __future__ import annotations

import math
import numbers

import torch

INF = math.inf


def tensor(value, name: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def floating(value, name: str) -> torch.Tensor:
    tensor(value, name)
    if not value.is_floating_point():
        raise TypeError(f"{name} must have a floating dtype, got {value.dtype}")
    return value


def float_dtype(dtype, name: str = "dtype") -> torch.dtype | None:
    if dtype is None:
        return None
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"{name} must be a floating torch.dtype or None, got {dtype!r}")
    return dtype


def dim(value, ndim: int, name: str = "dim") -> int:
    value = integer(value, name)
    rank = max(ndim, 1)
    if not -rank <= value < rank:
        raise ValueError(f"{name}={int(value)} is out of range for a tensor of {ndim} dimension(s)")
    return value % rank


def integer(value, name: str) -> int:
    """An int (a bool is not one); a symbolic one (``torch.SymInt``) as it is."""
    if type(value) is int or isinstance(value, torch.SymInt):
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    return int(value)


def real(value, name: str) -> float:
    """A real number (a bool is not one) as a float; a symbolic one as a ``torch.SymFloat``."""
    if type(value) is float:
        return value
    if isinstance(value, (torch.SymFloat, torch.SymInt)):
        return torch.sym_float(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    return float(value)


def finite(value, name: str) -> float:
    """A finite real number (``real``). A comparison, not ``math.isfinite``, which dynamo cannot call on a
    symbolic float; NaN fails it too."""
    value = real(value, name)
    if not -INF < value < INF:
        raise ValueError(f"{name} must be finite, got {float(value)}")
    return value


def boolean(value, name: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value


def one_of(value, choices: tuple, name: str):
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}; got {value!r}")
    return value


def same_device(reference: torch.Tensor, reference_name: str, **others: torch.Tensor | None) -> None:
    for name, other in others.items():
        if other is not None and other.device != reference.device:
            raise ValueError(f"{name} is on {other.device} but {reference_name} is on {reference.device}")


def backend_name(value, name: str = "backend") -> str | None:
    """A backend name or None (the automatic choice); the registry says whether the name is known."""
    if value is not None and not isinstance(value, str):
        raise TypeError(f"{name} must be a backend name (str) or None, got {type(value).__name__}")
    return value
