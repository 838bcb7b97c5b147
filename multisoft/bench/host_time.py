"""Host time a call: wall-clock microseconds per call of each implementation on a tiny tensor, where the GPU's
work takes a few microseconds and the host's (Python, checks, allocation, autograd, launches) sets the pace."""

from __future__ import annotations

from typing import Callable

from . import impls, plan, timing
from .impls import Impl
from .records import HostTime, describe_error

HOST_SHAPE = (8, 128)
HOST_DTYPE = "fp32"
HOST_OPS = ("softmax", "cross_entropy")
HOST_DIRECTIONS = ("forward", "forward+backward")
HOST_CALLS = 2000


def host_case(op: str) -> plan.Case:
    rows, cols = HOST_SHAPE
    return plan.Case(op, "host", f"{rows}x{cols}", HOST_SHAPE, rows * cols, n=cols)


def host_call(impl: Impl, op: str, direction: str, inputs: dict) -> Callable:
    """One call as a training step makes it: ``f(x)``; for forward+backward ``f(x)`` of an x that requires grad,
    then ``loss.backward()`` (softmax: ``y.backward(g)``, g allocated once), x.grad cleared before each call: a
    new graph each call (impls.training_step), as multisoft's cross-entropy needs (its graph takes one backward)."""
    f = impl.make(op, inputs)
    x, grad = inputs["x"], inputs["grad"]
    if direction == "forward":
        own = x.detach().clone() if op in impl.inplace_ops else x  # one that writes into x: a copy, made once
        return lambda: f(own)
    leaf = x.detach().clone().requires_grad_(True)
    return impls.training_step(f, leaf, grad, impls.graph_input(impl, op, leaf))


def kernel_call(impl: Impl, inputs: dict) -> Callable:
    """A backend's softmax forward kernel called directly, into a preallocated output: no front."""
    from .._registry import get_backend

    kernel = get_backend(impl.name).kernels("softmax")
    x = inputs["x"]
    out = x.new_empty(x.shape)
    return lambda: kernel.forward(x, out, False)


def measure_host_times(runner, chosen: list[Impl], calls: int | None = None) -> list[HostTime]:
    """A HostTime per implementation in ``chosen``, op of HOST_OPS it runs and direction of HOST_DIRECTIONS it
    times, on a HOST_SHAPE HOST_DTYPE input, over ``calls`` calls (default HOST_CALLS); ``runner`` gives the device
    and why an implementation cannot run."""
    calls = calls or HOST_CALLS
    records = []
    for op in HOST_OPS:
        case = host_case(op)
        inputs = impls.make_inputs(case, HOST_DTYPE, runner.device)
        for impl in (impl for impl in chosen if op in impl.ops):
            skip = runner.skip_reason(impl, op, HOST_DTYPE)
            for direction in (d for d in HOST_DIRECTIONS if d in impls.directions_of(impl, op)):
                record = HostTime(impl.name, impl.role, op, HOST_DTYPE, case.label, direction, None, note=skip)
                records.append(record)
                if skip:
                    continue
                try:
                    record.us = timing.wall_us_per_call(host_call(impl, op, direction, inputs), calls)
                    if op == "softmax" and direction == "forward" and impl.role == "backend":
                        record.kernel_us = timing.wall_us_per_call(kernel_call(impl, inputs), calls)
                except Exception as error:  # noqa: BLE001 - noted in its row; the others are still measured
                    record.note = describe_error(error)
                    runner.note(f"host time {impl.name} {op} {direction}: {record.note}")
                    timing.recover()
    return records
