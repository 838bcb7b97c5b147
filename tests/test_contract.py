"""The backend contract (backends/README.md), checked on every backend that can run here by calling its description
(``__init__``) and its kernel modules directly, as the front calls them, never through the public API.

Every tensor of a kernel call sits inside a larger buffer of sentinels (``Placement``): inputs must come back
bit for bit as they went in, outputs must be written in full (they start as NaN, or as a value the contract never
gives, where NaN is an expected answer) and nowhere outside their own elements. Expected values are the float64
references of multisoft/check.py, compared at its per-dtype tolerances by tests/harness.py's ``assert_close``.
The cross-entropy forward's checks (sentinels, invalid targets, the gradient in place) run on every kernel path a
backend declares in tests/kernel_paths.py, forced by its tuning constants.
Shapes stay small: the Triton interpreter and numba's simulator run them here.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from harness import (BACKENDS, DEVICE, assert_close, assert_row_stats, cross_entropy_contract, on_each_backend,
                     row_stats_contract, simulated)
from kernel_paths import each_path, force
from multisoft import LossOptions
from multisoft._blocksparse import lookup_table
from multisoft._registry import get_backend
from multisoft.check import (DTYPES, reference_blocksparse, reference_blocksparse_backward, reference_cross_entropy,
                             reference_slice_gradient, reference_softmax, reference_softmax_backward,
                             softmax_backward_magnitude)

each_dtype = pytest.mark.parametrize("dtype", DTYPES, ids=str)
# every (backend, path) pair of tests/kernel_paths.py: the cross-entropy forward on each of a backend's kernel paths
on_each_kernel_path = pytest.mark.parametrize("backend, path", each_path(BACKENDS))

NAN, INF = float("nan"), float("inf")
GUARD = 8                  # sentinel elements after every tensor, and before it unless a test asks for fewer
UNALIGNED = 1              # sentinel elements before every tensor where a test wants its data off 16-byte alignment
INPUT_SENTINEL = NAN       # around floating inputs: read past the end and used, it shows as NaN
TARGET_SENTINEL = 2**30 + 7  # around targets: read, it is a class out of range (a NaN loss, or ValueError)
OUTPUT_SENTINEL = -777.0   # around outputs (and the in-place gradient): a value no call here computes


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s memory as integers, so that comparisons are bitwise (NaN payloads included)."""
    if not t.is_floating_point():
        return t
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


class Placement:
    """The tensors of one kernel call, each inside a flat buffer of its own that holds sentinels around it.

    ``unchanged()`` asserts what the contract lets a backend write: nothing of an input (sentinels included), and
    of an output only its own elements.
    """

    def __init__(self, lead: int = GUARD):
        self.lead = lead   # sentinels before each tensor: GUARD keeps its data 16-byte aligned, UNALIGNED does not
        self._inputs: list[tuple[str, torch.Tensor, torch.Tensor]] = []
        self._outputs: list[tuple[str, torch.Tensor, torch.Tensor, int]] = []

    def _buffer(self, shape, dtype, sentinel) -> tuple[torch.Tensor, torch.Tensor]:
        numel = math.prod(shape)
        buffer = torch.full((self.lead + numel + GUARD,), sentinel, dtype=dtype, device=DEVICE)
        return buffer, buffer[self.lead:self.lead + numel].view(shape)

    def input(self, name: str, values: torch.Tensor) -> torch.Tensor:
        """``values`` placed in a buffer of INPUT_SENTINEL (TARGET_SENTINEL for integers); the call must not
        write any of it."""
        sentinel = INPUT_SENTINEL if values.is_floating_point() else TARGET_SENTINEL
        buffer, view = self._buffer(values.shape, values.dtype, sentinel)
        view.copy_(values)
        self._inputs.append((name, buffer, _bits(buffer).clone()))
        return view

    def output(self, name: str, shape, dtype: torch.dtype, fill: float = NAN) -> torch.Tensor:
        """An output of ``shape`` holding ``fill`` in a buffer of OUTPUT_SENTINEL; the call may write only it."""
        buffer, view = self._buffer(tuple(shape), dtype, OUTPUT_SENTINEL)
        view.fill_(fill)
        self._outputs.append((name, buffer, _bits(buffer).clone(), view.numel()))
        return view

    def in_place(self, name: str, values: torch.Tensor) -> torch.Tensor:
        """An input the call may overwrite (the in-place gradient) in a buffer of OUTPUT_SENTINEL."""
        view = self.output(name, values.shape, values.dtype)
        view.copy_(values)
        return view

    def unchanged(self) -> None:
        for name, buffer, before in self._inputs:
            changed = (_bits(buffer) != before).nonzero().flatten().tolist()
            assert not changed, f"the call wrote into its input {name} (buffer elements {changed[:8]})"
        for name, buffer, before, numel in self._outputs:
            outside = torch.ones(buffer.numel(), dtype=torch.bool, device=buffer.device)
            outside[self.lead:self.lead + numel] = False
            changed = ((_bits(buffer) != before) & outside).nonzero().flatten().tolist()
            assert not changed, (f"the call wrote outside its output {name}: buffer elements {changed[:8]}, "
                                 f"the output being elements {self.lead}..{self.lead + numel - 1}")


def _kernels(backend: str, op: str):
    """The backend's kernel module of ``op``; the test is skipped, saying so, where the backend lacks that op."""
    if not get_backend(backend).supports(op):
        pytest.skip(f"backend {backend!r} does not implement {op}")
    return get_backend(backend).kernels(op)


def _skip_unless_runs(backend: str, dtype: torch.dtype) -> None:
    reason = get_backend(backend).unavailable_reason(DEVICE, dtype)
    if reason is not None:
        pytest.skip(f"{backend} cannot run {dtype} on {DEVICE}: {reason}")


# -- __init__.py: the description


@on_each_backend
def test_description(backend):
    """NAME, PRIORITY, INSTALL, version(), unavailable_reason(), and the optional AUTOMATIC, OPS and notes(), of the
    types the README gives."""
    description = get_backend(backend).module
    assert description.NAME == backend
    assert type(description.PRIORITY) is int, f"PRIORITY is {description.PRIORITY!r}, not an int"
    assert isinstance(description.INSTALL, str) and description.INSTALL.strip(), "INSTALL must say how to install it"
    version = description.version()
    assert isinstance(version, str) and version, f"version() of an installed backend is {version!r}"
    assert type(getattr(description, "AUTOMATIC", True)) is bool
    ops = getattr(description, "OPS", ("softmax", "cross_entropy", "blocksparse"))
    assert isinstance(ops, tuple) and ops and all(isinstance(op, str) for op in ops), f"OPS is {ops!r}"
    for op in ops:  # each declared op has its file (found, not imported)
        assert importlib.util.find_spec(f"{get_backend(backend).package}.{op}") is not None, f"OPS has {op}, no {op}.py"
    if hasattr(description, "notes"):
        notes = description.notes()
        assert isinstance(notes, list) and all(isinstance(line, str) and line for line in notes), notes
    assert description.unavailable_reason(DEVICE, torch.float32) is None, "the harness found it runs here"
    for device in {DEVICE, torch.device("cpu")}:
        for dtype in (*DTYPES, torch.float64):
            reason = description.unavailable_reason(device, dtype)
            assert reason is None or (isinstance(reason, str) and reason), (device, dtype, reason)


# Imports the description in a fresh interpreter without the simulators, asks it about CPU tensors of every dtype
# and prints the top-level modules that appeared meanwhile, less the standard library's and the package's own.
_CHEAP_DESCRIPTION = """
import importlib, json, sys
import torch
before = set(sys.modules)
description = importlib.import_module(sys.argv[1])
reasons = [description.unavailable_reason(torch.device("cpu"), dtype)
           for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64)]
description.version()
own = sys.argv[1].split(".")[0]
new = {name.split(".")[0] for name in set(sys.modules) - before}
print(json.dumps({"reasons": reasons, "imported": sorted(new - set(sys.stdlib_module_names) - {own})}))
"""


@on_each_backend
def test_unavailable_reason_is_cheap(backend):
    """Answering for a CPU tensor with the simulators off imports nothing but the description (no framework),
    and a backend that runs here only under a simulator says why it cannot without one."""
    package = get_backend(backend).package
    environment = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "NUMBA_ENABLE_CUDASIM")}
    done = subprocess.run([sys.executable, "-c", _CHEAP_DESCRIPTION, package], env=environment,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout.strip().splitlines()[-1])
    assert answer["imported"] == [], f"unavailable_reason/version imported {answer['imported']}"
    assert all(r is None or (isinstance(r, str) and r) for r in answer["reasons"]), answer["reasons"]
    if simulated(backend):
        assert isinstance(answer["reasons"][0], str), "without its simulator it cannot run on the CPU: say why"


# -- softmax.py

SOFTMAX_SHAPES = [(1, 1), (1, 7), (3, 1), (6, 33), (2, 300)]
softmax_or_log = pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])


def _check_softmax_forward(backend, dtype, shape, log, lead=GUARD, x=None):
    call = Placement(lead)
    if x is None:
        x = (torch.randn(shape, device=DEVICE) * 3).to(dtype)
    x = call.input("x", x)
    out = call.output("out", x.shape, dtype)
    _kernels(backend, "softmax").forward(x, out, log)
    call.unchanged()
    assert_close(out, reference_softmax(x, -1, log), dtype, f"{'log_softmax' if log else 'softmax'} forward")


def _check_softmax_backward(backend, dtype, shape, log, lead=GUARD):
    call = Placement(lead)
    x = torch.randn(shape, device=DEVICE) * 3
    y = call.input("y", reference_softmax(x, -1, log).to(dtype))
    dy = call.input("dy", torch.randn(shape, device=DEVICE).to(dtype))
    dx = call.output("dx", shape, dtype)
    _kernels(backend, "softmax").backward(y, dy, dx, log)
    call.unchanged()
    assert_close(dx, reference_softmax_backward(y, dy, -1, log), dtype,
                 f"{'log_softmax' if log else 'softmax'} backward", softmax_backward_magnitude(y, dy, -1, log))


@pytest.mark.parametrize("shape", SOFTMAX_SHAPES, ids=lambda s: "x".join(map(str, s)))
@softmax_or_log
@each_dtype
@on_each_backend
def test_softmax_forward(backend, dtype, log, shape):
    """out = softmax(x) or log_softmax(x) along the last dim, x left as it was, nothing written but out."""
    _skip_unless_runs(backend, dtype)
    _check_softmax_forward(backend, dtype, shape, log)


@pytest.mark.parametrize("shape", SOFTMAX_SHAPES, ids=lambda s: "x".join(map(str, s)))
@softmax_or_log
@each_dtype
@on_each_backend
def test_softmax_backward(backend, dtype, log, shape):
    """softmax: dx = y * (dy - sum(y * dy)); log: dx = dy - exp(y) * sum(dy); y and dy left as they were."""
    _skip_unless_runs(backend, dtype)
    _check_softmax_backward(backend, dtype, shape, log)


@softmax_or_log
@each_dtype
@on_each_backend
def test_softmax_forward_infinities(backend, dtype, log):
    """-inf entries get 0 (log: -inf), a row that is all -inf gives NaN, like torch."""
    _skip_unless_runs(backend, dtype)
    x = torch.randn(4, 40, device=DEVICE).to(dtype)
    x[0, ::3] = -INF
    x[1, 1:] = -INF
    x[2] = -INF
    _check_softmax_forward(backend, dtype, x.shape, log, x=x)


# -- cross_entropy.py

# Rows of each batch whose target is ignore_index (where there are that many rows).
IGNORED_ROWS = (2, 5)

CROSS_ENTROPY_CASES = {
    "plain": dict(shape=(9, 37)),
    "weighted-smoothed-int32": dict(shape=(9, 700), weighted=True, label_smoothing=0.1, target_dtype=torch.int32),
    "smoothed-int32": dict(shape=(9, 37), label_smoothing=0.1, target_dtype=torch.int32),
    "ignore-a-class": dict(shape=(9, 37), weighted=True, label_smoothing=0.2, ignore_index=3),
    "one-class": dict(shape=(3, 1), label_smoothing=0.1),
    "one-row": dict(shape=(1, 37), weighted=True, target_dtype=torch.int32),
    "softcap": dict(shape=(9, 300), softcap=2.0),
    "softcap-z-loss-weighted-smoothed": dict(shape=(9, 37), weighted=True, label_smoothing=0.1, softcap=4.0,
                                             lse_square_scale=0.01),
    "z-loss": dict(shape=(9, 37), lse_square_scale=0.05, target_dtype=torch.int32),
}


def _cross_entropy_inputs(dtype, shape, weighted=False, label_smoothing=0.0, ignore_index=-100,
                          target_dtype=torch.int64, softcap=0.0, lse_square_scale=0.0):
    """(logits, target, weight or None, the kernels' ``options`` record) of a case."""
    rows, classes = shape
    logits = (torch.randn(shape, device=DEVICE) * 2).to(dtype)
    target = torch.randint(0, classes, (rows,), device=DEVICE)
    target[[r for r in IGNORED_ROWS if r < rows]] = ignore_index
    weight = torch.rand(classes, device=DEVICE) + 0.5 if weighted else None
    return logits, target.to(target_dtype), weight, LossOptions(ignore_index=ignore_index,
                                                                label_smoothing=label_smoothing, softcap=softcap,
                                                                lse_square_scale=lse_square_scale)


def _cross_entropy_forward(backend, logits, target, weight, options, grad=None, grad_scale_values=None,
                           broadcast=False, lead=GUARD, loss_fill=NAN, with_row_stats=False):
    """Runs the forward with every tensor placed: ``grad`` None (no gradient), "separate" (a tensor of its own) or
    "in-place" (the logits themselves), grad_scale as given or its first value at stride 0. Returns (loss, lse,
    row_weight, grad_logits or None), and with ``with_row_stats`` the (3, M) row_stats it also asked for, after
    checking that nothing else was written."""
    call = Placement(lead)
    rows = logits.shape[0]
    placed_logits = call.in_place("logits", logits) if grad == "in-place" else call.input("logits", logits)
    target = call.input("target", target)
    weight = None if weight is None else call.input("weight", weight)
    loss = call.output("loss", (rows,), torch.float32, fill=loss_fill)
    lse, row_weight = (call.output(name, (rows,), torch.float32) for name in ("lse", "row_weight"))
    grad_logits = grad_scale = None
    if grad is not None:
        if broadcast:
            grad_scale = call.input("grad_scale", grad_scale_values[:1]).expand(rows)
            assert grad_scale.stride(0) == 0
        else:
            grad_scale = call.input("grad_scale", grad_scale_values)
        grad_logits = placed_logits if grad == "in-place" else call.output("grad_logits", logits.shape, logits.dtype)
    stats = {}
    if with_row_stats:   # -777 is a value m, S or sum(w * u) of these logits could be: NaN is an answer here
        stats["row_stats"] = call.output("row_stats", (3, rows), torch.float32, fill=12345.0)
    _kernels(backend, "cross_entropy").forward(placed_logits, target, weight, loss, lse, row_weight, grad_logits,
                                               grad_scale, options, **stats)
    call.unchanged()
    if with_row_stats:
        return loss, lse, row_weight, grad_logits, stats["row_stats"]
    return loss, lse, row_weight, grad_logits


@pytest.mark.parametrize("case", list(CROSS_ENTROPY_CASES), ids=str)
@each_dtype
@on_each_kernel_path
def test_cross_entropy_forward(backend, path, dtype, case, monkeypatch):
    """Without a gradient, on each kernel path: loss (0 for an ignored row; plus the z-loss otherwise), lse of the
    capped logits (every row, ignored ones too) and row_weight (w[t], 0 when ignored) all written, the logits only
    read. loss and lse are float32 from float32 arithmetic on the logits as given: the float32 tolerance whatever
    their dtype."""
    _skip_unless_runs(backend, dtype)
    assert_took = force(monkeypatch, backend, path)
    logits, target, weight, options = _cross_entropy_inputs(dtype, **CROSS_ENTROPY_CASES[case])
    loss, lse, row_weight, _ = _cross_entropy_forward(backend, logits, target, weight, options)
    assert_took(at_least_once=False)   # (without a gradient numba has one path)
    expected = cross_entropy_contract(logits, target, weight, options=options)
    assert_close(loss, expected.loss, torch.float32, "loss")
    assert_close(lse, expected.lse, torch.float32, "lse")
    assert torch.equal(row_weight, expected.row_weight.float()), (row_weight, expected.row_weight)


CROSS_ENTROPY_GRADIENT_CASES = {
    # case of CROSS_ENTROPY_CASES, grad_scale one value broadcast to every row (stride 0), grad_logits is logits
    "plain": ("plain", False, False),
    "broadcast-weighted": ("weighted-smoothed-int32", True, False),
    "in-place-weighted": ("ignore-a-class", False, True),
    "in-place-broadcast": ("smoothed-int32", True, True),
    "one-class-broadcast": ("one-class", True, False),
    "one-row-in-place": ("one-row", False, True),
    "softcap-in-place": ("softcap", False, True),
    "softcap-z-loss-broadcast": ("softcap-z-loss-weighted-smoothed", True, False),
    "softcap-z-loss-in-place": ("softcap-z-loss-weighted-smoothed", False, True),
    "z-loss": ("z-loss", False, False),
}


@pytest.mark.parametrize("case", list(CROSS_ENTROPY_GRADIENT_CASES), ids=str)
@each_dtype
@on_each_kernel_path
def test_cross_entropy_forward_with_gradient(backend, path, dtype, case, monkeypatch):
    """On each kernel path, grad_logits = grad_scale[i] * d loss_i / d logits (0 for ignored rows) into a tensor of
    its own or into the logits (each element read before it is overwritten: bit for bit what a tensor of its own
    gets), with the same loss, lse and row_weight as without it; grad_scale contiguous or one value at stride 0,
    which gives exactly what that value repeated per row gives."""
    _skip_unless_runs(backend, dtype)
    assert_took = force(monkeypatch, backend, path)
    inputs, broadcast, in_place = CROSS_ENTROPY_GRADIENT_CASES[case]
    logits, target, weight, options = _cross_entropy_inputs(dtype, **CROSS_ENTROPY_CASES[inputs])
    rows = logits.shape[0]
    grad_scale = torch.rand(rows, device=DEVICE) + 0.5
    if broadcast:
        grad_scale = grad_scale[:1].repeat(rows)
    mode = "in-place" if in_place else "separate"
    loss, lse, row_weight, grad = _cross_entropy_forward(backend, logits, target, weight, options, mode, grad_scale,
                                                         broadcast)
    expected = cross_entropy_contract(logits, target, weight, grad_scale, options)
    assert_close(loss, expected.loss, torch.float32, "loss")
    assert_close(lse, expected.lse, torch.float32, "lse")
    assert torch.equal(row_weight, expected.row_weight.float())
    assert_close(grad, expected.grad, dtype, "grad_logits")
    ignored = target == options.ignore_index
    assert (grad[ignored] == 0).all(), "an ignored row's gradient is 0"
    if broadcast:
        *_, per_row = _cross_entropy_forward(backend, logits, target, weight, options, mode, grad_scale, False)
        assert torch.equal(grad, per_row), "a grad_scale at stride 0 must give what one value per row gives"
    if in_place:
        separate = _cross_entropy_forward(backend, logits, target, weight, options, "separate", grad_scale, broadcast)
        for name, value, into_its_own in zip(("loss", "lse", "row_weight", "grad_logits"),
                                             (loss, lse, row_weight, grad), separate):
            assert torch.equal(_bits(value), _bits(into_its_own)), f"{name} in place differs from into a tensor"
    assert_took()


def _check_scale(backend, dtype, factor_values, lead=GUARD):
    """Runs scale on a placed gradient of 5 rows with a placed factor; returns (before, after)."""
    call = Placement(lead)
    before = (torch.randn(5, 37, device=DEVICE) * 3).to(dtype)
    before[:, 0] = 0.0
    grad_logits = call.in_place("grad_logits", before)
    factor = call.input("factor", factor_values.to(torch.float32))
    _kernels(backend, "cross_entropy").scale(grad_logits, factor)
    call.unchanged()
    return before, grad_logits


@each_dtype
@on_each_backend
def test_cross_entropy_scale_by_one_value(backend, dtype):
    """scale with a factor of shape (1,): exactly 1 leaves the gradient bit for bit as it was; another value
    multiplies every row by it; nothing outside grad_logits written, the factor only read."""
    _skip_unless_runs(backend, dtype)
    before, after = _check_scale(backend, dtype, torch.ones(1, device=DEVICE))
    assert torch.equal(_bits(after), _bits(before)), "a factor of exactly 1 must leave grad_logits untouched"
    before, after = _check_scale(backend, dtype, torch.full((1,), -2.75, device=DEVICE))
    assert_close(after, before.double() * -2.75, dtype, "grad_logits * -2.75")


@each_dtype
@on_each_backend
def test_cross_entropy_scale_per_row(backend, dtype):
    """scale with a factor of shape (M,): row i times factor[i]; inf and NaN propagate (0 * inf is NaN)."""
    _skip_unless_runs(backend, dtype)
    factor = torch.tensor([0.5, 1.0, 3.25, INF, NAN], device=DEVICE)
    before, after = _check_scale(backend, dtype, factor)
    assert_close(after, before.double() * factor.double().unsqueeze(1), dtype, "grad_logits * factor")
    assert torch.isnan(after[3, 0]) and torch.isnan(after[4]).all(), "0 * inf and x * NaN are NaN"


PROBABILITY_CASES = {
    "plain": dict(shape=(9, 37)),
    "weighted-smoothed": dict(shape=(9, 700), weighted=True, label_smoothing=0.1),
    "softcap-z-loss-weighted-smoothed": dict(shape=(9, 300), weighted=True, label_smoothing=0.05, softcap=3.0,
                                             lse_square_scale=0.02),
    "one-class": dict(shape=(3, 1), label_smoothing=0.1),
    "one-row": dict(shape=(1, 37), weighted=True),
    "long-rows": dict(shape=(3, 20000), weighted=True, label_smoothing=0.1, lse_square_scale=0.01),
    "long-rows-softcap": dict(shape=(2, 9000), softcap=5.0),
}


def _probability_inputs(dtype, shape, weighted=False, label_smoothing=0.0, softcap=0.0, lse_square_scale=0.0):
    """(logits, target probabilities of the logits' dtype, weight or None, the ``options`` record): row 0's target
    one-hot, row 1's (where there is one) spread over a few classes, the others a softmax of random scores."""
    rows, classes = shape
    logits = (torch.randn(shape, device=DEVICE) * 2).to(dtype)
    target = torch.softmax(torch.randn(shape, device=DEVICE) * 3, -1)
    target[0] = 0.0
    target[0, classes // 2] = 1.0
    if rows > 1:
        target[1] = 0.0
        target[1, : min(classes, 4)] = 1.0 / min(classes, 4)
    weight = torch.rand(classes, device=DEVICE) + 0.5 if weighted else None
    return logits, target.to(dtype), weight, LossOptions(label_smoothing=label_smoothing, softcap=softcap,
                                                         lse_square_scale=lse_square_scale)


def _probability_reference(logits, target, weight, options):
    """(per-row loss, lse) in float64 of probability targets: torch's F.cross_entropy of the capped logits plus
    the z-loss (multisoft.check's reference)."""
    return reference_cross_entropy(logits, target.double(), weight=weight, reduction="none", return_lse=True,
                                   label_smoothing=options.label_smoothing, softcap=options.softcap or None,
                                   lse_square_scale=options.lse_square_scale)


def _probabilities_forward(backend, logits, target, weight, options, grad_scale_values=None, broadcast=False,
                           lead=GUARD):
    """Runs probabilities_forward with every tensor placed (grad_scale_values None: no gradient); returns (loss,
    lse, grad_logits or None) after checking that nothing else was written."""
    call = Placement(lead)
    rows = logits.shape[0]
    logits = call.input("logits", logits)
    target = call.input("target", target)
    weight = None if weight is None else call.input("weight", weight)
    loss, lse = (call.output(name, (rows,), torch.float32) for name in ("loss", "lse"))
    grad_logits = grad_scale = None
    if grad_scale_values is not None:
        if broadcast:
            grad_scale = call.input("grad_scale", grad_scale_values[:1]).expand(rows)
        else:
            grad_scale = call.input("grad_scale", grad_scale_values)
        grad_logits = call.output("grad_logits", logits.shape, logits.dtype)
    _kernels(backend, "cross_entropy").probabilities_forward(logits, target, weight, loss, lse, grad_logits,
                                                             grad_scale, options)
    call.unchanged()
    return loss, lse, grad_logits


@pytest.mark.parametrize("case", list(PROBABILITY_CASES), ids=str)
@each_dtype
@on_each_backend
def test_cross_entropy_probabilities_forward(backend, dtype, case):
    """Class-probability targets: loss and lse of every row (float32 tolerance: float32 arithmetic on the inputs
    as given), and with a gradient grad_scale[i] * d loss_i / d logits, grad_scale per row or one value at
    stride 0, against torch's float64 F.cross_entropy of the capped logits plus the z-loss."""
    _skip_unless_runs(backend, dtype)
    logits, target, weight, options = _probability_inputs(dtype, **PROBABILITY_CASES[case])
    expected, expected_lse = _probability_reference(logits, target, weight, options)
    loss, lse, _ = _probabilities_forward(backend, logits, target, weight, options)
    assert_close(loss, expected, torch.float32, "loss")
    assert_close(lse, expected_lse, torch.float32, "lse")
    rows = logits.shape[0]
    for broadcast in (False, True):
        grad_scale = torch.rand(rows, device=DEVICE) + 0.5
        if broadcast:
            grad_scale = grad_scale[:1].repeat(rows)
        loss, lse, grad = _probabilities_forward(backend, logits, target, weight, options, grad_scale, broadcast)
        assert_close(loss, expected, torch.float32, "loss (with the gradient)")
        assert_close(lse, expected_lse, torch.float32, "lse (with the gradient)")
        logits64 = logits.double().requires_grad_()
        reference_loss, _ = _probability_reference(logits64, target, weight, options)
        (expected_grad,) = torch.autograd.grad(reference_loss, logits64, grad_scale.double())
        where = "at stride 0" if broadcast else "per row"
        assert_close(grad, expected_grad, dtype, f"grad_logits (grad_scale {where})")


@each_dtype
@on_each_backend
def test_cross_entropy_probabilities_forward_unaligned(backend, dtype):
    """Every tensor off 16-byte alignment: the same values, nothing read or written outside."""
    _skip_unless_runs(backend, dtype)
    logits, target, weight, options = _probability_inputs(dtype, (5, 301), weighted=True, label_smoothing=0.1)
    grad_scale = torch.rand(5, device=DEVICE) + 0.5
    loss, lse, grad = _probabilities_forward(backend, logits, target, weight, options, grad_scale, lead=UNALIGNED)
    expected, expected_lse = _probability_reference(logits, target, weight, options)
    assert_close(loss, expected, torch.float32, "loss")
    assert_close(lse, expected_lse, torch.float32, "lse")
    logits64 = logits.double().requires_grad_()
    reference_loss, _ = _probability_reference(logits64, target, weight, options)
    (expected_grad,) = torch.autograd.grad(reference_loss, logits64, grad_scale.double())
    assert_close(grad, expected_grad, dtype, "grad_logits")


@pytest.mark.parametrize("classes", [37, 9000], ids=lambda c: f"C{c}")
@on_each_backend
def test_cross_entropy_probabilities_forward_non_finite(backend, classes):
    """torch's values at the edges: a -inf logit where q is 0 gives a NaN loss (0 * inf) and where q > 0 an inf
    loss, with a finite gradient row; a NaN logit, or a NaN target, makes its row's loss and gradient NaN; a row
    of -inf is NaN; the other rows are untouched by their neighbours."""
    dtype = torch.float32
    _skip_unless_runs(backend, dtype)
    logits, target, _, options = _probability_inputs(dtype, (6, classes))
    logits[0, 3] = float("-inf")          # row 0: one-hot elsewhere, q = 0 there: NaN
    logits[1, 1] = float("-inf")          # row 1: q = 1/4 there: +inf
    logits[2, classes - 1] = float("nan")
    target[3, classes // 3] = float("nan")
    logits[4] = float("-inf")
    grad_scale = torch.ones(6, device=DEVICE)
    loss, lse, grad = _probabilities_forward(backend, logits, target, None, options, grad_scale)
    assert torch.isnan(loss[0]) and loss[1] == float("inf"), loss[:2]
    assert torch.isfinite(grad[:2]).all(), "the gradient of a row with a -inf logit stays finite"
    for row in (2, 3, 4):
        assert torch.isnan(loss[row]), (row, loss[row])
        assert torch.isnan(grad[row]).all(), (row, grad[row])
    expected, expected_lse = _probability_reference(logits, target, None, options)
    assert_close(loss[5:], expected[5:], torch.float32, "loss of the finite row")
    logits64 = logits[5:].double().requires_grad_()
    reference_loss, _ = _probability_reference(logits64, target[5:], None, options)
    (expected_grad,) = torch.autograd.grad(reference_loss.sum(), logits64)
    assert_close(grad[5:], expected_grad, dtype, "grad of the finite row")
    finite_two = _probability_reference(logits[:2].double().requires_grad_(), target[:2], None, options)
    assert torch.isnan(finite_two[0][0]) and finite_two[0][1] == float("inf"), "torch's own values, as asserted"


def _invalid_targets(target_dtype, classes):
    """Targets of 8 rows: classes 0 and 5, ignore_index -100, and five outside [0, classes), int64 ones among them
    that a kernel reading only their low 32 bits would take for classes 3 and 0."""
    info = torch.iinfo(target_dtype)
    if target_dtype == torch.int64:
        far = [2**32 + 3, -(2**32)]
    else:
        far = [info.max, info.min]
    return torch.tensor([0, classes, -1, *far, 5, -100, classes + 1], dtype=target_dtype, device=DEVICE)


@pytest.mark.parametrize("target_dtype", [torch.int64, torch.int32], ids=str)
@on_each_kernel_path
def test_cross_entropy_invalid_targets(backend, path, target_dtype, monkeypatch):
    """On each kernel path, a target outside [0, C) that is not ignore_index: a NaN loss for its row (the other rows
    right, lse right for every row); its gradient row is unspecified but written in bounds, here into the logits
    themselves, which sit between sentinels."""
    assert_took = force(monkeypatch, backend, path)
    classes = 37
    target = _invalid_targets(target_dtype, classes)
    rows = target.numel()
    invalid = ~((target >= 0) & (target < classes)) & (target != -100)
    known = ~invalid
    logits = torch.randn(rows, classes, device=DEVICE) * 2
    options = LossOptions(ignore_index=-100, label_smoothing=0.1, softcap=0.0, lse_square_scale=0.01)
    weight = torch.rand(classes, device=DEVICE) + 0.5
    grad_scale = torch.rand(rows, device=DEVICE) + 0.5
    for grad in (None, "in-place"):
        # NaN is an answer here: the loss starts from another value
        loss, lse, row_weight, grad_logits = _cross_entropy_forward(backend, logits, target, weight, options, grad,
                                                                    grad_scale, loss_fill=0.5)
        assert torch.isnan(loss[invalid]).all(), f"loss of the rows with invalid targets: {loss[invalid]}"
        expected = cross_entropy_contract(logits, target, weight, grad_scale, options)
        assert_close(loss[known], expected.loss[known], torch.float32, "loss of the other rows")
        assert_close(lse, expected.lse, torch.float32, "lse")
        assert torch.equal(row_weight[known], expected.row_weight[known].float())
        if grad is not None:
            assert_close(grad_logits[known], expected.grad[known], torch.float32, "gradient of the other rows")
    assert_took()


# -- cross_entropy.py, a slice of the classes (vocabulary-parallel): row_stats and gradient


def _capped64(x, softcap):
    """u of float64 logits: softcap * tanh(x / softcap), or x (softcap 0)."""
    return softcap * torch.tanh(x / softcap) if softcap else x


# case of CROSS_ENTROPY_CASES, gradient (None, "separate", "in-place")
ROW_STATS_CASES = {
    "plain": ("plain", None),
    "weighted-smoothed-gradient": ("weighted-smoothed-int32", "separate"),
    "softcap-z-loss-in-place": ("softcap-z-loss-weighted-smoothed", "in-place"),
    "ignore-a-class-in-place": ("ignore-a-class", "in-place"),
    "one-class": ("one-class", None),
}


@pytest.mark.parametrize("case", list(ROW_STATS_CASES), ids=str)
@each_dtype
@on_each_backend
def test_cross_entropy_row_stats(backend, dtype, case):
    """forward(..., row_stats): row_stats[:, i] = (m, S, sum_j w_j u_j) of every row (ignored rows, a row with a
    NaN among its logits and a row with an invalid target too), everything else written bit for bit as without
    it."""
    _skip_unless_runs(backend, dtype)
    inputs, grad = ROW_STATS_CASES[case]
    logits, target, weight, options = _cross_entropy_inputs(dtype, **CROSS_ENTROPY_CASES[inputs])
    rows, classes = logits.shape
    logits[min(1, rows - 1), classes // 2] = NAN
    if rows > 3:
        target[3] = classes + 2
    grad_scale = torch.rand(rows, device=DEVICE) + 0.5
    *outputs, row_stats = _cross_entropy_forward(backend, logits, target, weight, options, grad, grad_scale,
                                                 loss_fill=0.5, with_row_stats=True)
    without = _cross_entropy_forward(backend, logits, target, weight, options, grad, grad_scale, loss_fill=0.5)
    for name, value, plain in zip(("loss", "lse", "row_weight", "grad_logits"), outputs, without):
        if value is not None:
            assert torch.equal(_bits(value), _bits(plain)), f"{name} differs from the call without row_stats"
    assert_row_stats(row_stats, row_stats_contract(logits, weight, options), "row_stats")


@on_each_backend
def test_cross_entropy_row_stats_of_a_row_of_minus_infinity(backend):
    """A row whose logits (this slice of its classes) are all -inf: m = -inf and S = 0, which add nothing when
    the front combines the slices' statistics; the rows beside it as usual."""
    logits, target, weight, options = _cross_entropy_inputs(torch.float32, (4, 37))
    logits[1] = -INF
    logits[2, ::3] = -INF
    *_, row_stats = _cross_entropy_forward(backend, logits, target, weight, options, with_row_stats=True)
    assert row_stats[0, 1] == -INF and row_stats[1, 1] == 0, row_stats[:, 1]
    assert_row_stats(row_stats, row_stats_contract(logits, weight, options), "row_stats")


def _slice_inputs(dtype, rows, classes, weighted, softcap, first=3, wider=11):
    """Logits (rows, classes) in ``dtype``: columns first..first + classes of wider float64 rows (of classes +
    wider columns), and the float64 u, m and S of those WHOLE rows; a weight of the slice's classes or None."""
    wide = (torch.randn(rows, classes + wider, device=DEVICE, dtype=torch.float64) * 3).to(dtype).double()
    wide[:, 0] += 4.0   # the row's max mostly outside the slice
    u = _capped64(wide, softcap)
    m = u.max(1).values
    total = torch.exp(u - m[:, None]).sum(1)
    logits = wide[:, first:first + classes].to(dtype)
    weight = torch.rand(classes, device=DEVICE) + 0.5 if weighted else None
    return logits, torch.stack([m, total]).float(), weight


def _slice_targets(rows, classes, target_dtype):
    """Targets of ``rows`` rows cycling through: inside the slice (its first and last class, one between), below
    it, past it, ignore_index, and (int64) values whose low 32 bits are classes of the slice."""
    outside = [-1, classes, -100, classes + 5]
    if target_dtype == torch.int64:
        outside += [2**32 + min(1, classes - 1), -(2**32)]
    cycle = [0, classes - 1, classes // 2, *outside]
    return torch.tensor([cycle[i % len(cycle)] for i in range(rows)], dtype=target_dtype, device=DEVICE)


def _check_slice_gradient(backend, dtype, shape, weighted=False, softcap=0.0, in_place=False,
                          target_dtype=torch.int64, lead=GUARD, edit=None):
    """Runs gradient on placed tensors (grad_logits the logits themselves with ``in_place``) and checks it against
    the float64 formula; ``edit(logits, row_max_sum)`` changes the inputs first. Returns the gradient."""
    rows, classes = shape
    logits, row_max_sum, weight = _slice_inputs(dtype, rows, classes, weighted, softcap)
    if edit is not None:
        edit(logits, row_max_sum)
    target = _slice_targets(rows, classes, target_dtype)
    coefficients = torch.stack([torch.rand(rows, device=DEVICE) + 0.5, torch.rand(rows, device=DEVICE) + 0.5,
                                torch.rand(rows, device=DEVICE) * 0.1])
    call = Placement(lead)
    placed = call.in_place("logits", logits) if in_place else call.input("logits", logits)
    placed_target = call.input("target", target)
    placed_weight = None if weight is None else call.input("weight", weight)
    placed_stats = call.input("row_max_sum", row_max_sum)
    placed_coefficients = call.input("coefficients", coefficients)
    grad_logits = placed if in_place else call.output("grad_logits", shape, dtype)
    _kernels(backend, "cross_entropy").gradient(placed, placed_target, placed_weight, placed_stats,
                                                placed_coefficients, grad_logits, LossOptions(softcap=softcap))
    call.unchanged()
    expected, magnitude = reference_slice_gradient(logits, target, weight, row_max_sum, coefficients, softcap)
    assert_close(grad_logits, expected, dtype, "gradient of the slice", magnitude)
    return grad_logits


# (rows, classes, weighted, softcap, in place, target dtype)
SLICE_GRADIENT_CASES = {
    "plain": ((7, 37), False, 0.0, False, torch.int64),
    "weighted-in-place": ((7, 40), True, 0.0, True, torch.int32),
    "softcap": ((7, 37), False, 3.0, False, torch.int32),
    "softcap-weighted-in-place": ((7, 37), True, 2.5, True, torch.int64),
    "one-column": ((7, 1), True, 0.0, False, torch.int64),
    "one-column-in-place-softcap": ((7, 1), False, 4.0, True, torch.int32),
    "long-rows": ((3, 700), True, 0.0, False, torch.int64),
}


@pytest.mark.parametrize("case", list(SLICE_GRADIENT_CASES), ids=str)
@each_dtype
@on_each_backend
def test_cross_entropy_gradient_of_a_slice(backend, dtype, case):
    """gradient: du/dx * (a exp(u - m) / S - b [j == t] - c w_j) from the whole (wider) row's m and S, for targets
    inside the slice and outside it (below, past, ignore_index, int64 beyond 32 bits), with and without weights and
    a softcap, in place or into a tensor of its own, rows of one column; nothing written outside grad_logits."""
    _skip_unless_runs(backend, dtype)
    shape, weighted, softcap, in_place, target_dtype = SLICE_GRADIENT_CASES[case]
    _check_slice_gradient(backend, dtype, shape, weighted, softcap, in_place, target_dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@on_each_backend
def test_cross_entropy_gradient_of_a_slice_unaligned(backend, dtype):
    """The same on tensors one element past a 16-byte boundary (rows read element by element), in place and not."""
    _skip_unless_runs(backend, dtype)
    for in_place in (False, True):
        _check_slice_gradient(backend, dtype, (5, 37), True, 2.0, in_place, lead=UNALIGNED)


@on_each_backend
def test_cross_entropy_gradient_of_a_slice_with_nan(backend):
    """A NaN statistic (m or S) makes its row's gradient NaN; a NaN logit makes its own element NaN, the rest of its
    row as usual."""
    def poison(logits, row_max_sum):
        row_max_sum[0, 1] = NAN
        row_max_sum[1, 2] = NAN
        logits[3, 5] = NAN

    grad = _check_slice_gradient(backend, torch.float32, (4, 37), True, 0.0, edit=poison)
    assert torch.isnan(grad[1:3]).all(), "NaN statistics"
    assert torch.isnan(grad[3]).sum() == 1 and torch.isnan(grad[3, 5]), "a NaN logit"


# -- blocksparse.py

# Head 0: block-row 1 holds no block. Head 1: block-row 0 holds only a block right of the diagonal, so with
# is_causal its rows have no unmasked element (zeros).
TWO_HEADS = [[[1, 0, 1], [0, 0, 0], [1, 1, 1]],
             [[0, 0, 1], [1, 1, 0], [0, 1, 1]]]

BLOCKSPARSE_CASES = {
    "b16": dict(layout=TWO_HEADS, block=16, z=2, scale=0.7),
    "b32-negative-scale": dict(layout=[[[1, 1], [1, 1]]], block=32, z=1, scale=-0.5),
    "one-block": dict(layout=[[[1]]], block=16, z=1, scale=1.3),
    "b64": dict(layout=[[[1, 0], [1, 1]]], block=64, z=1, scale=0.7),
    "b128": dict(layout=[[[1]]], block=128, z=1, scale=0.7),
}
causal_or_not = pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])


def _blocksparse_inputs(dtype, layout, block, z, scale):
    """(x, layout, look-up table) of a case: x of (z, nnz, block, block) in ``dtype``."""
    layout = torch.tensor(layout)
    x = (torch.randn(z, int(layout.sum()), block, block, device=DEVICE) * 2).to(dtype)
    return x, layout, lookup_table(layout, block, DEVICE)


def _check_blocksparse_forward(backend, x, layout, lut, scale, is_causal, lead=GUARD):
    call = Placement(lead)
    x = call.input("x", x)
    out = call.output("out", x.shape, x.dtype)
    _kernels(backend, "blocksparse").forward(x, out, lut, scale, is_causal)
    call.unchanged()
    assert_close(out, reference_blocksparse(x, layout, lut.block, scale, is_causal), x.dtype, "forward")


def _check_blocksparse_backward(backend, x, layout, lut, scale, is_causal, lead=GUARD):
    call = Placement(lead)
    y = call.input("y", reference_blocksparse(x, layout, lut.block, scale, is_causal).to(x.dtype))
    dy = call.input("dy", torch.randn(x.shape, device=DEVICE).to(x.dtype))
    dx = call.output("dx", x.shape, x.dtype)
    _kernels(backend, "blocksparse").backward(y, dy, dx, lut, scale)
    call.unchanged()
    expected, magnitude = reference_blocksparse_backward(y, dy, layout, lut.block, scale)
    assert_close(dx, expected, x.dtype, "backward", magnitude)


@pytest.mark.parametrize("case", list(BLOCKSPARSE_CASES), ids=str)
@causal_or_not
@each_dtype
@on_each_backend
def test_blocksparse_forward(backend, dtype, is_causal, case):
    """out = softmax(scale * x) over each row of a block-row's blocks; with is_causal, elements past the diagonal
    are 0 and a row with nothing unmasked is zeros; x left as it was, nothing written but out."""
    _skip_unless_runs(backend, dtype)
    spec = BLOCKSPARSE_CASES[case]
    x, layout, lut = _blocksparse_inputs(dtype, spec["layout"], spec["block"], spec["z"], spec["scale"])
    _check_blocksparse_forward(backend, x, layout, lut, spec["scale"], is_causal)


@pytest.mark.parametrize("case", list(BLOCKSPARSE_CASES), ids=str)
@causal_or_not
@each_dtype
@on_each_backend
def test_blocksparse_backward(backend, dtype, is_causal, case):
    """dx = scale * y * (dy - sum_row(y * dy)), 0 wherever y is 0 (masked elements, rows of zeros); y and dy left
    as they were, nothing written but dx."""
    _skip_unless_runs(backend, dtype)
    spec = BLOCKSPARSE_CASES[case]
    x, layout, lut = _blocksparse_inputs(dtype, spec["layout"], spec["block"], spec["z"], spec["scale"])
    _check_blocksparse_backward(backend, x, layout, lut, spec["scale"], is_causal)


@causal_or_not
@on_each_backend
def test_blocksparse_non_finite_basics(backend, is_causal):
    """A few rows of the non-finite contract, forward and backward (tests/test_blocksparse_nonfinite.py has them
    all): some -inf among finite values get 0, a NaN makes its row's unmasked elements NaN, a row of -inf is NaN."""
    dtype = torch.float32
    x, layout, lut = _blocksparse_inputs(dtype, TWO_HEADS, 16, 2, 0.7)
    x[0, 0, 3, ::4] = -INF      # head 0, block-row 0 (blocks 0 and 1), row 3: some -inf
    x[0, 1, 7, 2] = NAN         # the same block-row, row 7: a NaN in its second block (masked when causal)
    x[0, 2, 9, 5] = NAN         # head 0, block-row 2 (blocks 2..4), row 9: a NaN in its first block, never masked
    x[1, 0:2, 11] = -INF        # batch entry 1, head 0, block-row 0, row 11: -inf throughout
    _check_blocksparse_forward(backend, x, layout, lut, 0.7, is_causal)
    _check_blocksparse_backward(backend, x, layout, lut, 0.7, is_causal)


# -- unaligned tensors: the same calls with every tensor one element past a 16-byte boundary


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@on_each_backend
def test_unaligned_tensors_stay_in_bounds(backend, dtype):
    """Every op, forward and backward, on tensors whose data starts one element past alignment (contiguous, as the
    front hands them over, but at an offset into their storage): right answers, nothing written outside them."""
    _skip_unless_runs(backend, dtype)
    for log in (False, True):
        _check_softmax_forward(backend, dtype, (3, 70), log, lead=UNALIGNED)
        _check_softmax_backward(backend, dtype, (3, 70), log, lead=UNALIGNED)
    logits, target, weight, options = _cross_entropy_inputs(
        dtype, **CROSS_ENTROPY_CASES["softcap-z-loss-weighted-smoothed"])
    grad_scale = torch.rand(logits.shape[0], device=DEVICE) + 0.5
    expected = cross_entropy_contract(logits, target, weight, grad_scale, options)
    for grad in (None, "separate", "in-place"):
        loss, _, _, grad_logits = _cross_entropy_forward(backend, logits, target, weight, options, grad, grad_scale,
                                                         lead=UNALIGNED)
        assert_close(loss, expected.loss, torch.float32, f"loss ({grad or 'no'} gradient)")
        if grad is not None:
            assert_close(grad_logits, expected.grad, dtype, f"grad_logits {grad}")
    factor = torch.rand(5, device=DEVICE) + 0.5
    before, after = _check_scale(backend, dtype, factor, lead=UNALIGNED)
    assert_close(after, before.double() * factor.double().unsqueeze(1), dtype, "scale per row")
    spec = BLOCKSPARSE_CASES["b16"]
    x, layout, lut = _blocksparse_inputs(dtype, spec["layout"], spec["block"], spec["z"], spec["scale"])
    _check_blocksparse_forward(backend, x, layout, lut, spec["scale"], True, lead=UNALIGNED)
    _check_blocksparse_backward(backend, x, layout, lut, spec["scale"], True, lead=UNALIGNED)
