"""Forward-mode AD (``torch.autograd.forward_ad``): which inputs carry a tangent; and ``torch.func`` transforms.

A kernel writes through raw pointers, so a dual tensor's tangent would be dropped without a word (forward AD
then reads it as zero). Every public op therefore asks here first: softmax and log_softmax compute the tangent
(their autograd Function's ``jvp``), the other ops refuse a tangent by name.

``torch.func``'s transforms (``grad``, ``vmap``, ``jvp``, ``jacrev``, ...) wrap tensors that a kernel cannot read
(and the autograd Functions do not define what the transforms need): every public op refuses to run inside one,
by name, before anything else (``refuse_transforms``).
"""

from __future__ import annotations

import torch
import torch.autograd.forward_ad as _forward_ad

_transforms_active = torch._C._are_functorch_transforms_active  # what autograd.Function.apply asks too


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


def refuse_transforms(op: str) -> None:
    """Raises NotImplementedError naming ``op`` inside a ``torch.func`` transform (``grad``, ``vmap``, ``jvp``,
    ``jacrev``, ``jacfwd``, ``hessian``, ...), where it would otherwise fail inside torch with a message about
    autograd Functions or batching rules, or have a kernel read a wrapped tensor's memory. Whether any transform
    is active, not whether this op's tensors are wrapped: an autograd Function refuses to run inside one either
    way. ``torch.func.functional_call`` is not a transform. One call into torch's C++ per op call."""
    if _transforms_active():
        raise NotImplementedError(
            f"multisoft.{op} does not support torch.func transforms (grad, vmap, jvp, jacrev, ...): call it outside "
            f"the transform (torch.autograd.grad computes its gradient), or use torch's own op inside it")
