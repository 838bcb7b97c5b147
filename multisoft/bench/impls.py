"""The implementations compared: each backend through multisoft's public calls (and its in-place cross-entropy),
torch's own ops and Liger-Kernel's as peers; the inputs they are given and the calls that are timed."""

from __future__ import annotations

import dataclasses
import importlib.metadata
from typing import Callable

from . import plan
from .records import describe_error

TORCH_PEER = "torch-native"
LIGER_PEER = "liger"


@dataclasses.dataclass
class Impl:
    """A backend or a peer: ``make(op, inputs)`` gives the function x -> output (a loss for cross-entropy)."""

    name: str
    role: str  # "backend" or "peer"
    ops: tuple
    make: Callable
    inplace_ops: tuple = ()  # ops whose call may write into x (the gradient): each timing gets a copy of x
    directions: tuple = plan.DIRECTIONS  # what is timed of each op (of those plan.OP_DIRECTIONS names)


def directions_of(impl: Impl, op: str) -> tuple:
    """The directions timed of ``impl`` running ``op``: its own, of those the op has (plan.OP_DIRECTIONS)."""
    return tuple(direction for direction in impl.directions if direction in plan.OP_DIRECTIONS[op])


def backend_impl(name: str) -> Impl:
    def make(op, inputs):
        import multisoft

        if op == "softmax":
            return lambda x: multisoft.softmax(x, backend=name)
        if op == "log_softmax":
            return lambda x: multisoft.log_softmax(x, backend=name)
        if op == "cross_entropy":
            target = inputs["target"]
            return lambda x: multisoft.cross_entropy(x, target, backend=name)
        layout, block, causal = inputs["layout"], inputs["block"], inputs["causal"]
        return lambda x: multisoft.blocksparse_softmax(x, layout, block, scale=plan.SCALE, is_causal=causal,
                                                       backend=name)
    return Impl(name, "backend", plan.OPS, make)


def inplace_impl(name: str) -> Impl:
    """A backend's cross-entropy with inplace_backward=True, named "<backend> inplace": forward+backward only (a
    forward of logits that do not require grad writes nothing: it is the ordinary forward)."""
    def make(op, inputs):
        import multisoft

        target = inputs["target"]
        return lambda x: multisoft.cross_entropy(x, target, backend=name, inplace_backward=True)
    return Impl(f"{name} inplace", "backend", ("cross_entropy",), make, inplace_ops=("cross_entropy",),
                directions=("forward+backward",))


def torch_peer() -> Impl:
    def make(op, inputs):
        import torch
        import torch.nn.functional as F

        if op == "softmax":
            return lambda x: torch.softmax(x, -1)
        if op == "log_softmax":
            return lambda x: torch.log_softmax(x, -1)
        target = inputs["target"]
        return lambda x: F.cross_entropy(x, target)
    return Impl(TORCH_PEER, "peer", ("softmax", "log_softmax", "cross_entropy"), make)


def liger_peer() -> tuple[Impl | None, str]:
    """Liger-Kernel's softmax and cross-entropy as a peer, or None and why not."""
    try:
        version = importlib.metadata.version("liger-kernel")
    except importlib.metadata.PackageNotFoundError:
        return None, "not installed"
    ops, reasons = {}, []
    try:
        from liger_kernel.ops.cross_entropy import LigerCrossEntropyFunction
    except Exception as error:  # noqa: BLE001 - any import failure just leaves the peer out
        try:
            from liger_kernel.transformers import LigerCrossEntropyLoss
        except Exception:  # noqa: BLE001
            reasons.append(f"cross-entropy: {describe_error(error)}")
        else:
            module = LigerCrossEntropyLoss()
            ops["cross_entropy"] = lambda target: (lambda x: module(x, target))
    else:
        def cross_entropy(target):
            def call(x):
                out = LigerCrossEntropyFunction.apply(x, target, None)
                return out[0] if isinstance(out, tuple) else out
            return call
        ops["cross_entropy"] = cross_entropy
    try:
        from liger_kernel.ops.softmax import LigerSoftmaxFunction
    except Exception as error:  # noqa: BLE001
        reasons.append(f"softmax: {describe_error(error)}")
    else:
        ops["softmax"] = lambda target: LigerSoftmaxFunction.apply
    if not ops:
        return None, f"{version}, not importable ({'; '.join(reasons)})"

    def make(op, inputs):
        return ops[op](inputs.get("target"))
    note = f"{version}" + (f" ({'; '.join(reasons)})" if reasons else "")
    # Liger's forward writes the gradient into its input (some versions even when it does not require grad)
    return Impl(LIGER_PEER, "peer", tuple(ops), make, inplace_ops=("cross_entropy",)), note


def make_inputs(case: plan.Case, dtype_name: str, device) -> dict:
    """Random inputs of ``case`` on ``device``: x, the incoming gradient (None for a loss), the targets or layout."""
    import torch

    dtype = getattr(torch, plan.DTYPES[dtype_name])
    x = torch.randn(case.shape, device=device, dtype=dtype)
    inputs = {"x": x}
    if case.op == "cross_entropy":
        inputs["target"] = torch.randint(0, case.shape[1], (case.shape[0],), device=device)
        inputs["grad"] = None
    else:
        inputs["grad"] = torch.randn_like(x)
    if case.op == "blocksparse_softmax":
        inputs.update(layout=case.layout, block=case.block, causal=case.causal)
    return inputs


def training_step(f: Callable, leaf, grad) -> Callable:
    """One call as a training step makes it: ``leaf.grad`` cleared (as ``zero_grad()`` does), then ``f(leaf)``
    and its backward, ``loss.backward()`` (an output's: ``y.backward(grad)``). Each call builds a new graph."""
    def step():
        leaf.grad = None
        f(leaf).backward(grad)
    return step


def prepare(impl: Impl, op: str, direction: str, inputs: dict) -> Callable:
    """The zero-argument call to time for one direction of plan.OP_DIRECTIONS[op].

    forward: ``f(x)`` of an x that does not require grad (cross-entropy only reads the logits then).
    backward (not of cross-entropy): the backward of one forward's graph, kept for every call.
    forward+backward: training_step on a leaf that requires grad.
    An implementation that writes into x (``inplace_ops``) gets its own copy of x, made here, outside the timed
    call: the shared inputs stay intact, and from the second call on it runs on the gradient the previous call
    left in that copy (cross-entropy of a mean: values in [-1/M, 1/M], finite, and as many bytes to move).
    """
    import torch

    if direction not in plan.OP_DIRECTIONS[op]:
        raise ValueError(f"{op} has no {direction} of its own to time (plan.OP_DIRECTIONS)")
    f = impl.make(op, inputs)
    x, grad = inputs["x"], inputs["grad"]
    if op in impl.inplace_ops:
        x = x.detach().clone()
    if direction == "forward":
        return lambda: f(x)
    leaf = x.detach().requires_grad_(True)
    if direction == "backward":
        y = f(leaf)
        return lambda: torch.autograd.grad(y, leaf, grad, retain_graph=True)
    return training_step(f, leaf, grad)
