"""torch.compile(fullgraph=True) of multisoft's ops with dynamic shapes, and of models that hand them nn.Parameters.

``dynamic=True`` traces every number as a symbolic one, the defaults of the ops' options included: argument
validation must take those, and still raise for a bad value, naming it. A model passes its Parameters straight to
the ops (the logits it learns, its output layer's weight: ``linear_cross_entropy(hidden, self.lm_head.weight,
labels)``, README's example), which dynamo traces otherwise than plain tensors (torch 2.13): each case compiles a
module holding Parameters, static and dynamic, and checks its output and every Parameter's gradient against
float64 torch (``multisoft.check``'s references, ``check.TOLERANCES``) on every backend under test (compiling costs
the same on each, the ops being opaque to the compiler; the simulated ones run tiny shapes). ``aot_eager``: the
custom ops run as in eager, and AOT autograd builds the backward graph. Every compiled test starts from
``torch._dynamo.reset()``: cases share their functions' code objects, and past dynamo's recompile limit a
``fullgraph=True`` call fails.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import multisoft
from harness import DEVICE, assert_close, on_each_backend
from multisoft.check import (reference_blocksparse, reference_blocksparse_backward, reference_cross_entropy,
                             softmax_backward_magnitude)

each_shape_mode = pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])

LAYOUT = torch.tensor([[[1, 0], [1, 1]]])  # 3 blocks of 16 x 16
HIDDEN, CLASSES = 6, 11


def _linear_gradient_magnitudes(leaves, size):
    """The size of the terms each linear gradient sums (as in test_linear_cross_entropy): ``size`` is
    |d logits| (M, V); input's gradient sums |d logits| |W|, the weight's |d logits|^T |X|, the bias's the rows."""
    x64, w64 = leaves["input"], leaves["lm_head.weight"]
    return {"input": size @ w64.detach().abs(), "lm_head.weight": size.t() @ x64.detach().abs(),
            "lm_head.bias": size.sum(0)}


# -- dynamic=True: the options are symbolic numbers


def _default_option_call(op, size):
    """(tensors to pass op, those that require grad, and for an incoming gradient ``incoming`` the float64
    (output, [(gradient, magnitude of its terms or None)])): ``size`` rows, or blocks' batch."""
    if op == "blocksparse_softmax":
        blocks = (torch.randn(size, 3, 16, 16, device=DEVICE) * 2).requires_grad_()

        def expected(incoming):
            y = reference_blocksparse(blocks, LAYOUT, 16, 1.0, False)
            return y, [reference_blocksparse_backward(y, incoming, LAYOUT, 16, 1.0)]

        return (blocks, LAYOUT, 16), (blocks,), expected
    target = torch.randint(0, CLASSES, (size,), device=DEVICE)
    target[1] = -100
    if op == "cross_entropy":
        logits = (torch.randn(size, CLASSES, device=DEVICE) * 2).requires_grad_()

        def expected(incoming):
            logits64 = logits.detach().double().requires_grad_()
            loss = reference_cross_entropy(logits64, target)
            return loss, [(torch.autograd.grad(loss, logits64, incoming)[0], None)]

        return (logits, target), (logits,), expected
    hidden = torch.randn(size, HIDDEN, device=DEVICE, requires_grad=True)
    linear_weight = torch.randn(CLASSES, HIDDEN, device=DEVICE, requires_grad=True)

    def expected(incoming):
        leaves = {"input": hidden.detach().double(), "lm_head.weight": linear_weight.detach().double()}
        logits = (leaves["input"] @ leaves["lm_head.weight"].t()).requires_grad_()
        loss = reference_cross_entropy(logits, target)
        (grad_logits,) = torch.autograd.grad(loss, logits, incoming)
        magnitudes = _linear_gradient_magnitudes(leaves, grad_logits.abs())
        return loss, [(grad_logits @ leaves["lm_head.weight"], magnitudes["input"]),
                      (grad_logits.t() @ leaves["input"], magnitudes["lm_head.weight"])]

    return (hidden, linear_weight, target), (hidden, linear_weight), expected


@pytest.mark.parametrize("op", ["cross_entropy", "linear_cross_entropy", "blocksparse_softmax"])
def test_dynamic_shapes_at_default_options(op):
    """torch.compile(fullgraph=True, dynamic=True) traces the options' defaults (floats of the functions'
    signatures) as symbolic numbers, which validation must take. Two sizes, forward and backward against
    float64."""
    function = getattr(multisoft, op)
    torch._dynamo.reset()
    compiled = torch.compile(lambda *args: function(*args, backend="torch"), fullgraph=True, dynamic=True,
                             backend="aot_eager")
    for size in (5, 8) if op != "blocksparse_softmax" else (1, 2):
        args, leaves, expected = _default_option_call(op, size)
        out = compiled(*args)
        incoming = torch.rand_like(out)
        grads = torch.autograd.grad(out, leaves, incoming)
        want, want_grads = expected(incoming.double())
        assert_close(out, want, torch.float32, f"{op} output, size {size}")
        for grad, (wanted, magnitude) in zip(grads, want_grads):
            assert_close(grad, wanted, torch.float32, f"{op} gradient, size {size}", magnitude)


def _options_call(logits, target, hidden, linear_weight, blocks, ignore_index, label_smoothing, lse_square_scale,
                  softcap, chunk_size, scale):
    """Every op with its numbers given, so that dynamic=True traces them as symbolic numbers."""
    loss = multisoft.cross_entropy(logits, target, ignore_index=ignore_index, label_smoothing=label_smoothing,
                                   lse_square_scale=lse_square_scale, softcap=softcap, backend="torch")
    linear = multisoft.linear_cross_entropy(hidden, linear_weight, target, ignore_index=ignore_index,
                                            label_smoothing=label_smoothing, lse_square_scale=lse_square_scale,
                                            softcap=softcap, chunk_size=chunk_size, backend="torch")
    return loss, linear, multisoft.blocksparse_softmax(blocks, LAYOUT, 16, scale=scale, backend="torch")


def _options_inputs():
    target = torch.tensor([3, 1, 10, 4, 3, 0], device=DEVICE)
    return (torch.randn(6, CLASSES, device=DEVICE) * 2, target, torch.randn(6, HIDDEN, device=DEVICE),
            torch.randn(CLASSES, HIDDEN, device=DEVICE), torch.randn(1, 3, 16, 16, device=DEVICE))


GOOD_OPTIONS = dict(ignore_index=3, label_smoothing=0.1, lse_square_scale=0.01, softcap=5.0, chunk_size=4, scale=0.5)
BAD_OPTIONS = [  # (argument, value, error, message)
    ("label_smoothing", 1.5, ValueError, r"label_smoothing must be in \[0, 1\], got 1.5"),
    ("label_smoothing", float("nan"), ValueError, r"label_smoothing must be in \[0, 1\], got nan"),
    ("label_smoothing", True, TypeError, "label_smoothing must be a real number, got bool"),
    ("lse_square_scale", -1.0, ValueError, "lse_square_scale must be >= 0, got -1.0"),
    ("lse_square_scale", float("inf"), ValueError, "lse_square_scale must be finite, got inf"),
    ("softcap", 0.0, ValueError, "softcap must be a finite number > 0, or None for no cap; got 0.0"),
    ("softcap", float("inf"), ValueError, "softcap must be a finite number > 0, or None for no cap; got inf"),
    ("softcap", float("nan"), ValueError, "softcap must be a finite number > 0, or None for no cap; got nan"),
    ("ignore_index", 1.5, TypeError, "ignore_index must be an int, got float"),
    ("chunk_size", 0, ValueError, "chunk_size must be a number of rows >= 1"),
    ("scale", float("-inf"), ValueError, "scale must be finite, got -inf"),
]


def test_dynamic_options_are_symbolic_and_still_checked():
    """Numbers given to a function compiled with dynamic=True are traced as symbolic ones: in range (two sets of
    values: a float reaching a custom op is specialised there, so the second recompiles) every op gives float64's
    values; out of range, each raises eager's error naming the argument, from the trace (without fullgraph, dynamo
    runs the frame eagerly where the trace raised)."""
    inputs = _options_inputs()
    logits, target, hidden, linear_weight, blocks = inputs
    torch._dynamo.reset()
    strict = torch.compile(_options_call, fullgraph=True, dynamic=True, backend="aot_eager")
    for options in (GOOD_OPTIONS, dict(GOOD_OPTIONS, ignore_index=4, label_smoothing=0.2, lse_square_scale=0.02,
                                       softcap=6.0, chunk_size=5, scale=-0.25)):
        loss, linear, y = strict(*inputs, *options.values())
        ce_options = {name: options[name] for name in ("ignore_index", "label_smoothing", "lse_square_scale",
                                                       "softcap")}
        assert_close(loss, reference_cross_entropy(logits, target, **ce_options), torch.float32, f"{options}")
        assert_close(linear, reference_cross_entropy(hidden.double() @ linear_weight.double().t(), target,
                                                     **ce_options), torch.float32, f"linear {options}")
        assert_close(y, reference_blocksparse(blocks, LAYOUT, 16, options["scale"], False), torch.float32,
                     f"blocksparse {options}")
    torch._dynamo.reset()
    lenient = torch.compile(_options_call, dynamic=True, backend="aot_eager")
    lenient(*inputs, *GOOD_OPTIONS.values())
    for name, value, error, message in BAD_OPTIONS:
        with pytest.raises(error, match=message):
            lenient(*inputs, *dict(GOOD_OPTIONS, **{name: value}).values())


def test_validation_takes_symbolic_numbers():
    """torch.SymInt and torch.SymFloat (as a symbolic trace hands them over) pass the number checks, returned
    symbolic (a check of a symbolic float's finiteness is known true: symbolic floats are finite); bools still
    fail them."""
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from multisoft import _validate

    env = ShapeEnv()
    count = env.create_symintnode(env.create_symbol(5, ConstantSource("count")), hint=5)
    share = env.create_symfloatnode(env.create_unspecified_symbol(0.5, ConstantSource("share")), hint=0.5)
    assert isinstance(_validate.integer(count, "ignore_index"), torch.SymInt)
    assert isinstance(_validate.real(share, "label_smoothing"), torch.SymFloat)
    assert isinstance(_validate.real(count, "label_smoothing"), torch.SymFloat)
    assert isinstance(_validate.finite(share, "scale"), torch.SymFloat)
    assert isinstance(_validate.dim(count - 6, 3), torch.SymInt)
    with pytest.raises(TypeError, match="label_smoothing must be a real number, got bool"):
        _validate.real(True, "label_smoothing")
    with pytest.raises(TypeError, match="ignore_index must be an int, got bool"):
        _validate.integer(True, "ignore_index")


# -- a module holding Parameters, compiled


class Holding(torch.nn.Module):
    """A module whose ``forward(*inputs)`` is ``function(self, *inputs)``, holding ``parameters`` (name -> tensor,
    made nn.Parameters) and ``submodules``."""

    def __init__(self, function, parameters=None, **submodules):
        super().__init__()
        self.function = function
        for name, value in (parameters or {}).items():
            self.register_parameter(name, torch.nn.Parameter(value.to(DEVICE)))
        for name, module in submodules.items():
            self.add_module(name, module)

    def forward(self, *inputs):
        return self.function(self, *inputs)


def _softmax_case(backend, log, module):
    """softmax / log_softmax of a Parameter (3, 6, 5) along its middle dim, by the function or the nn module."""
    op, torch_op = (multisoft.log_softmax, torch.log_softmax) if log else (multisoft.softmax, torch.softmax)
    parameters = {"weight": torch.randn(3, 6, 5) * 2}
    if module:
        layer = (multisoft.nn.LogSoftmax if log else multisoft.nn.Softmax)(1, backend=backend)
        model = Holding(lambda self: self.layer(self.weight), parameters, layer=layer)
    else:
        model = Holding(lambda self: op(self.weight, 1, backend=backend), parameters)

    def reference(leaves):
        return torch_op(leaves["weight"], 1)

    def gradients(leaves, expected, incoming):
        return {"weight": (None, softmax_backward_magnitude(expected, incoming, 1, log))}

    return model, (), reference, gradients


def _cross_entropy_case(backend, probabilities, module):
    """cross_entropy of Parameter logits: class indices at the default options (the function), class
    probabilities with label smoothing, a softcap and the z-loss; the nn module on (N, C, d) logits with class
    weights and smoothing."""
    if module:
        weight = torch.rand(CLASSES, device=DEVICE) + 0.5
        options = dict(weight=weight, label_smoothing=0.1)
        parameters = {"logits": torch.randn(4, CLASSES, 3) * 2}
        target = torch.randint(0, CLASSES, (4, 3), device=DEVICE)
        target[1, 2] = -100
        loss = multisoft.nn.CrossEntropyLoss(backend=backend, **options)
        model = Holding(lambda self, t: self.loss(self.logits, t), parameters, loss=loss)
    else:
        parameters = {"logits": torch.randn(5, CLASSES) * 2}
        if probabilities:
            options = dict(label_smoothing=0.1, softcap=5.0, lse_square_scale=0.01)
            target = torch.softmax(torch.randn(5, CLASSES, device=DEVICE) * 2, 1)
        else:
            options = {}
            target = torch.tensor([1, 10, -100, 0, 7], device=DEVICE)
        model = Holding(lambda self, t: multisoft.cross_entropy(self.logits, t, backend=backend, **options),
                        parameters)

    def reference(leaves, t):
        return reference_cross_entropy(leaves["logits"], t, **options)

    return model, (target,), reference, None


def _linear_cross_entropy_case(backend, module):
    """linear_cross_entropy of hidden states through a Linear's weight and bias (Parameters), README's example: the
    function with a softcap, the nn module at its defaults."""
    lm_head = torch.nn.Linear(HIDDEN, CLASSES).to(DEVICE)
    hidden = torch.randn(7, HIDDEN)
    target = torch.randint(0, CLASSES, (7,), device=DEVICE)
    target[3] = -100
    options = {} if module else dict(softcap=5.0)
    if module:
        loss = multisoft.nn.LinearCrossEntropyLoss(backend=backend)
        model = Holding(lambda self, t: self.loss(self.input, self.lm_head.weight, t, self.lm_head.bias),
                        {"input": hidden}, lm_head=lm_head, loss=loss)
    else:
        model = Holding(lambda self, t: multisoft.linear_cross_entropy(
            self.input, self.lm_head.weight, t, linear_bias=self.lm_head.bias, backend=backend, **options),
            {"input": hidden}, lm_head=lm_head)

    def reference(leaves, t):
        logits = F.linear(leaves["input"], leaves["lm_head.weight"], leaves["lm_head.bias"])
        return reference_cross_entropy(logits, t, **options)

    def gradients(leaves, expected, incoming):
        logits = F.linear(leaves["input"], leaves["lm_head.weight"], leaves["lm_head.bias"]).detach()
        logits.requires_grad_()
        (grad_logits,) = torch.autograd.grad(reference_cross_entropy(logits, target, **options), logits, incoming)
        magnitudes = _linear_gradient_magnitudes(leaves, grad_logits.abs())
        return {name: (None, magnitude) for name, magnitude in magnitudes.items()}

    return model, (target,), reference, gradients


def _blocksparse_case(backend):
    """blocksparse_softmax of Parameter blocks, causal, at the default scale."""
    model = Holding(lambda self: multisoft.blocksparse_softmax(self.blocks, LAYOUT, 16, is_causal=True,
                                                               backend=backend),
                    {"blocks": torch.randn(1, 3, 16, 16) * 2})

    def reference(leaves):
        return reference_blocksparse(leaves["blocks"], LAYOUT, 16, 1.0, True)

    def gradients(leaves, expected, incoming):  # the reference forward is not differentiable: its backward's
        return {"blocks": reference_blocksparse_backward(expected, incoming, LAYOUT, 16, 1.0)}

    return model, (), reference, gradients


CASES = {
    # name -> (model, its inputs, reference(leaves, *inputs) in float64, gradients or None)
    "softmax": lambda backend: _softmax_case(backend, log=False, module=False),
    "log_softmax": lambda backend: _softmax_case(backend, log=True, module=False),
    "cross_entropy-indices": lambda backend: _cross_entropy_case(backend, probabilities=False, module=False),
    "cross_entropy-probabilities": lambda backend: _cross_entropy_case(backend, probabilities=True, module=False),
    "linear_cross_entropy": lambda backend: _linear_cross_entropy_case(backend, module=False),
    "blocksparse_softmax": _blocksparse_case,
    "nn.Softmax": lambda backend: _softmax_case(backend, log=False, module=True),
    "nn.LogSoftmax": lambda backend: _softmax_case(backend, log=True, module=True),
    "nn.CrossEntropyLoss": lambda backend: _cross_entropy_case(backend, probabilities=False, module=True),
    "nn.LinearCrossEntropyLoss": lambda backend: _linear_cross_entropy_case(backend, module=True),
}


@pytest.mark.parametrize("case", CASES)
@each_shape_mode
@on_each_backend
def test_compiled_module_holding_parameters(backend, dynamic, case):
    """Output and every Parameter's gradient (for a random incoming gradient) against float64 torch: the
    reference's own gradient, or where a case's ``gradients`` gives one (name -> (gradient or None, magnitude or
    None)), that, with the size of the terms it sums as the magnitude (``check.error_ratio``)."""
    model, inputs, reference, gradients = CASES[case](backend)
    assert all(type(p) is torch.nn.Parameter for p in model.parameters())
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, dynamic=dynamic, backend="aot_eager")
    out = compiled(*inputs)
    names, parameters = zip(*model.named_parameters())
    leaves = {name: p.detach().double().requires_grad_() for name, p in zip(names, parameters)}
    expected = reference(leaves, *inputs)
    assert_close(out, expected, torch.float32, f"{case} output")
    incoming = torch.rand_like(expected)
    grads = torch.autograd.grad(out, parameters, incoming.to(out.dtype))
    given = gradients(leaves, expected.detach(), incoming) if gradients else {}
    for name, grad in zip(names, grads):
        wanted, magnitude = given.get(name, (None, None))
        if wanted is None:
            (wanted,) = torch.autograd.grad(expected, leaves[name], incoming, retain_graph=True)
        assert grad.dtype == torch.float32
        assert_close(grad, wanted, torch.float32, f"{case} gradient of {name}", magnitude)
