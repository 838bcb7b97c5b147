"""Forward-mode AD (``torch.autograd.forward_ad``): which inputs carry a tangent.

A kernel writes through raw pointers, so a dual tensor's tangent would be dropped without a word (forward AD
then reads it as zero). Every public op therefore asks here first: softmax and log_softmax compute the tangent
(their autograd Function's ``jvp``), the other ops refuse a tangent by name.
"""

from __future__ import annotations

import torch
import torch.autograd.forward_ad as _forward_ad


def has_tangent(*tensors) -> bool:
    """Whether any tensor among ``tensors`` (other values are skipped) carries a tangent at the current forward-AD
    level. Outside a ``dual_level`` (the level -1) this is one attribute read; where torch does not expose the
    level, every tensor is asked."""
    if getattr(_forward_ad, "_current_level", 0) < 0:
        return False
    return any(isinstance(t, torch.Tensor) and _forward_ad.unpack_dual(t).tangent is not None for t in tensors)


def refuse_tangents(op: str, **tensors) -> None:
    """Raises NotImplementedError, as torch does for an op without a forward-AD formula, naming ``op`` and the
    first argument of ``tensors`` that carries a tangent. Outside a ``dual_level``, one attribute read."""
    if not has_tangent(*tensors.values()):
        return
    name = next(name for name, tensor in tensors.items() if has_tangent(tensor))
    raise NotImplementedError(
        f"multisoft.{op} does not support forward-mode AD: {name} carries a tangent "
        f"(torch.autograd.forward_ad); compute its forward derivative with torch's own op")
