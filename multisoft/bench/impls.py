"""The implementations compared: each backend through multisoft's public calls (and its in-place cross-entropy),
torch's own ops and Liger-Kernel's as peers; the inputs they are given (cross-entropy's options among them) and the
calls that are timed."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import inspect
from typing import Callable

from . import plan
from .records import describe_error

TORCH_PEER = "torch-native"
LIGER_PEER = "liger"
# The keyword options of multisoft.cross_entropy a case may carry (plan.Case.options) and the torch peer composes.
CROSS_ENTROPY_OPTIONS = ("label_smoothing", "lse_square_scale", "softcap")


@dataclasses.dataclass
class Impl:
    """A backend or a peer: ``make(op, inputs)`` gives the function x -> output (a loss for cross-entropy)."""

    name: str
    role: str  # "backend" or "peer"
    ops: tuple
    make: Callable
    inplace_ops: tuple = ()  # ops whose call may write into x (the gradient): each timing gets a copy of x
    directions: tuple = plan.DIRECTIONS  # what is timed of each op (of those plan.OP_DIRECTIONS names)
    options: tuple = CROSS_ENTROPY_OPTIONS  # the cross-entropy options its make() passes on


def lacking_options(impl: Impl, options: dict) -> str:
    """Why ``impl`` is not timed on a case with these cross-entropy ``options``: the ones it does not take ("" when
    it takes them all); such a case is left out rather than run without them."""
    missing = [name for name in options if name not in impl.options]
    return f"not timed: {impl.name} takes no {', '.join(missing)}" if missing else ""


def directions_of(impl: Impl, op: str) -> tuple:
    """The directions timed of ``impl`` running ``op``: its own, of those the op has (plan.OP_DIRECTIONS)."""
    return tuple(direction for direction in impl.directions if direction in plan.OP_DIRECTIONS[op])


def backend_impl(name: str) -> Impl:
    def make(op, inputs):
        import multisoft

        if op == "softmax":
            return lambda x: multisoft.softmax(x, -1, backend=name)
        if op == "log_softmax":
            return lambda x: multisoft.log_softmax(x, -1, backend=name)
        if op == "cross_entropy":
            target, options = inputs["target"], inputs.get("options", {})
            return lambda x: multisoft.cross_entropy(x, target, backend=name, **options)
        layout, block, causal = inputs["layout"], inputs["block"], inputs["causal"]
        return lambda x: multisoft.blocksparse_softmax(x, layout, block, scale=plan.SCALE, is_causal=causal,
                                                       backend=name)
    return Impl(name, "backend", plan.OPS, make)


def inplace_impl(name: str) -> Impl:
    """A backend's cross-entropy with inplace_backward=True, named "<backend> inplace": forward+backward only (a
    forward of logits that do not require grad writes nothing: it is the ordinary forward)."""
    def make(op, inputs):
        import multisoft

        target, options = inputs["target"], inputs.get("options", {})
        return lambda x: multisoft.cross_entropy(x, target, backend=name, inplace_backward=True, **options)
    return Impl(f"{name} inplace", "backend", ("cross_entropy",), make, inplace_ops=("cross_entropy",),
                directions=("forward+backward",))


def torch_cross_entropy(x, target, label_smoothing: float = 0.0, lse_square_scale: float = 0.0,
                        softcap: float | None = None):
    """multisoft.cross_entropy's options as a user without multisoft writes them in torch ops: ``F.cross_entropy``
    of the capped logits ``softcap * tanh(x / softcap)``, plus the z-loss ``lse_square_scale`` times the mean of
    their squared logsumexp."""
    import torch
    import torch.nn.functional as F

    capped = x if softcap is None else softcap * torch.tanh(x / softcap)
    loss = F.cross_entropy(capped, target, label_smoothing=label_smoothing)
    if lse_square_scale:
        loss = loss + lse_square_scale * (torch.logsumexp(capped, -1) ** 2).mean()
    return loss


def torch_peer() -> Impl:
    def make(op, inputs):
        import torch
        import torch.nn.functional as F

        if op == "softmax":
            return lambda x: torch.softmax(x, -1)
        if op == "log_softmax":
            return lambda x: torch.log_softmax(x, -1)
        target, options = inputs["target"], inputs.get("options", {})
        if options:
            return lambda x: torch_cross_entropy(x, target, **options)
        return lambda x: F.cross_entropy(x, target)
    return Impl(TORCH_PEER, "peer", ("softmax", "log_softmax", "cross_entropy"), make)


def _parameters(function: Callable) -> list:
    """The parameters of a method, less the first (``ctx`` of an autograd Function's forward, ``self``)."""
    return list(inspect.signature(function).parameters.values())[1:]


def _options_taken(function: Callable) -> tuple:
    names = {parameter.name for parameter in _parameters(function)}
    return tuple(name for name in CROSS_ENTROPY_OPTIONS if name in names)


def positional_arguments(parameters: list, values: dict) -> list:
    """``values`` by their position in ``parameters``, each parameter before the last of them at its default: an
    autograd Function's ``apply`` takes no keywords."""
    names = [parameter.name for parameter in parameters]
    unknown = [name for name in values if name not in names]
    if unknown:
        raise TypeError(f"takes no {', '.join(unknown)}")
    last = max((names.index(name) for name in values), default=-1)
    arguments = []
    for parameter in parameters[:last + 1]:
        if parameter.name in values:
            arguments.append(values[parameter.name])
        elif parameter.default is inspect.Parameter.empty:
            raise TypeError(f"no value for its argument {parameter.name!r}")
        else:
            arguments.append(parameter.default)
    return arguments


def liger_function_call(function, inputs: dict) -> Callable:
    """x -> the loss of Liger-Kernel's ``LigerCrossEntropyFunction`` (``function``) on ``inputs``' targets, its
    options (``weight`` None where it has one) passed by their position in its forward's signature."""
    parameters = _parameters(function.forward)[2:]  # after the logits and the targets
    values = {"weight": None} if any(parameter.name == "weight" for parameter in parameters) else {}
    rest = positional_arguments(parameters, {**values, **inputs.get("options", {})})
    target = inputs["target"]

    def call(x):
        out = function.apply(x, target, *rest)
        return out[0] if isinstance(out, tuple) else out
    return call


def liger_peer() -> tuple[Impl | None, str]:
    """Liger-Kernel's softmax and cross-entropy as a peer, or None and why not; its cross-entropy takes the options
    its signature names (``options`` of the Impl)."""
    try:
        version = importlib.metadata.version("liger-kernel")
    except importlib.metadata.PackageNotFoundError:
        return None, "not installed"
    ops, reasons, options = {}, [], ()
    try:
        from liger_kernel.ops.cross_entropy import LigerCrossEntropyFunction
    except Exception as error:  # noqa: BLE001 - any import failure just leaves the peer out
        try:
            from liger_kernel.transformers import LigerCrossEntropyLoss
        except Exception:  # noqa: BLE001
            reasons.append(f"cross-entropy: {describe_error(error)}")
        else:
            def module_call(inputs):
                module, target = LigerCrossEntropyLoss(**inputs.get("options", {})), inputs["target"]
                return lambda x: module(x, target)
            ops["cross_entropy"] = module_call
            options = _options_taken(LigerCrossEntropyLoss.__init__)
    else:
        ops["cross_entropy"] = lambda inputs: liger_function_call(LigerCrossEntropyFunction, inputs)
        options = _options_taken(LigerCrossEntropyFunction.forward)
    try:
        from liger_kernel.ops.softmax import LigerSoftmaxFunction
    except Exception as error:  # noqa: BLE001
        reasons.append(f"softmax: {describe_error(error)}")
    else:
        ops["softmax"] = lambda inputs: LigerSoftmaxFunction.apply
    if not ops:
        return None, f"{version}, not importable ({'; '.join(reasons)})"

    def make(op, inputs):
        return ops[op](inputs)
    note = f"{version}" + (f" ({'; '.join(reasons)})" if reasons else "")
    # Liger's forward writes the gradient into its input (some versions even when it does not require grad)
    return Impl(LIGER_PEER, "peer", tuple(ops), make, inplace_ops=("cross_entropy",), options=options), note


def make_inputs(case: plan.Case, dtype_name: str, device) -> dict:
    """Random inputs of ``case`` on ``device``: x, the incoming gradient (None for a loss), the targets and options
    or the layout."""
    import torch

    dtype = getattr(torch, plan.DTYPES[dtype_name])
    x = torch.randn(case.shape, device=device, dtype=dtype)
    inputs = {"x": x}
    if case.op == "cross_entropy":
        inputs["target"] = torch.randint(0, case.shape[1], (case.shape[0],), device=device)
        inputs["grad"] = None
        inputs["options"] = dict(case.options)
    else:
        inputs["grad"] = torch.randn_like(x)
    if case.op == "blocksparse_softmax":
        inputs.update(layout=case.layout, block=case.block, causal=case.causal)
    return inputs


def training_step(f: Callable, leaf, grad, graph_input=None) -> Callable:
    """One call as a training step makes it: ``leaf.grad`` cleared (as ``zero_grad()`` does), then ``f(leaf)``
    (``f(graph_input)`` where given, a function of ``leaf``) and its backward, ``loss.backward()`` (an output's:
    ``y.backward(grad)``). Each call builds a new graph."""
    x = leaf if graph_input is None else graph_input

    def step():
        leaf.grad = None
        f(x).backward(grad)
    return step


def graph_input(impl: Impl, op: str, leaf):
    """What a forward+backward calls ``f`` on: ``leaf``, or for an implementation that writes its gradient into
    its input (``inplace_ops``) a copy of ``leaf`` made once, here, outside the timed calls. A model's logits are
    an activation, not a leaf that requires grad (multisoft's inplace_backward refuses one, as torch refuses an
    in-place op there); the gradient written into the copy reaches ``leaf.grad`` through clone's backward, which
    passes it on without a copy."""
    return leaf.clone() if op in impl.inplace_ops else leaf


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
    return training_step(f, leaf, grad, graph_input(impl, op, leaf))
