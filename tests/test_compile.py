"""torch.compile(fullgraph=True) of multisoft's ops with dynamic shapes.

``dynamic=True`` traces every number as a symbolic one, the defaults of the ops' options included: argument
validation must take those, and still raise for a bad value, naming it. ``aot_eager``: the custom ops run as in
eager, and AOT autograd builds the backward graph. Every compiled test starts from ``torch._dynamo.reset()``:
cases share their functions' code objects, and past dynamo's recompile limit a ``fullgraph=True`` call fails.
"""

from __future__ import annotations

import pytest
import torch

import multisoft
from harness import DEVICE, assert_close
from multisoft.check import reference_blocksparse, reference_blocksparse_backward, reference_cross_entropy

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
