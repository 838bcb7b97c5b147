"""Argument checks shared by the public functions: each error names the argument."""

from __future__ import annotations

import math
import numbers

import torch


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
    if type(value) is not int and (isinstance(value, bool) or not isinstance(value, numbers.Integral)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    rank = max(ndim, 1)
    if not -rank <= value < rank:
        raise ValueError(f"{name}={value} is out of range for a tensor of {ndim} dimension(s)")
    return int(value) % rank


def integer(value, name: str) -> int:
    if type(value) is not int and (isinstance(value, bool) or not isinstance(value, numbers.Integral)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    return int(value)


def real(value, name: str) -> float:
    if type(value) is not float and (isinstance(value, bool) or not isinstance(value, numbers.Real)):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    return float(value)


def finite(value, name: str) -> float:
    value = real(value, name)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
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
