"""A user swaps a torch.nn.functional call for multisoft's: the same arguments, the same answers, the same errors.

Also the in-place cross-entropy's contract with autograd: its write into the logits is visible to autograd (the
version counter), so every misuse raises, on every backend.
"""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch
import torch.nn.functional as F

import multisoft
from harness import DEVICE, assert_close, on_each_backend
from multisoft.check import DTYPES, reference_cross_entropy


# -- inplace_backward and autograd


def _linear_logits(rows=6, hidden=8, classes=40):
    h = torch.randn(rows, hidden, device=DEVICE, requires_grad=True)
    w = torch.randn(hidden, classes, device=DEVICE, requires_grad=True)
    target = torch.randint(0, classes, (rows,), device=DEVICE)
    return h, w, target


@on_each_backend
def test_inplace_backward_raises_when_the_logits_are_saved_elsewhere(backend):
    h, w, target = _linear_logits()
    logits = h @ w
    loss = (logits ** 2).mean() + multisoft.cross_entropy(logits, target, inplace_backward=True, backend=backend)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


@on_each_backend
def test_inplace_backward_bumps_the_version_and_a_second_backward_raises(backend):
    h, w, target = _linear_logits()
    logits = h @ w
    version = logits._version
    loss = multisoft.cross_entropy(logits, target, inplace_backward=True, backend=backend)
    assert logits._version > version, "the forward wrote the gradient into the logits"
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="multisoft.cross_entropy computes its gradient in the forward"):
        loss.backward()


@on_each_backend
def test_inplace_backward_refuses_a_leaf_that_requires_grad(backend):
    """The forward would overwrite a parameter's values with its gradient (the optimizer then steps from garbage):
    refused by name, as torch refuses an in-place op on a leaf that requires grad or a view of one, before any
    kernel runs; the values stay. Under no_grad nothing is written, and it runs."""
    weight = torch.nn.Parameter(torch.randn(6, 40, device=DEVICE))
    target = torch.randint(0, 40, (6,), device=DEVICE)
    before = weight.detach().clone()
    for logits, rows, what in ((weight, target, "a leaf tensor"), (weight[:3], target[:3], "a view of a leaf"),
                               (weight.view(2, 3, 40).transpose(1, 2), target.view(2, 3), "a view of a leaf")):
        with pytest.raises(ValueError, match=f"inplace_backward=True would overwrite the logits, {what}"):
            multisoft.cross_entropy(logits, rows, inplace_backward=True, backend=backend)
    with pytest.raises(ValueError, match="inplace_backward=True would overwrite the logits, a leaf"):
        multisoft.nn.CrossEntropyLoss(inplace_backward=True, backend=backend)(weight, target)
    assert torch.equal(weight.detach(), before)
    with torch.no_grad():
        loss = multisoft.cross_entropy(weight, target, inplace_backward=True, backend=backend)
    assert torch.equal(weight.detach(), before)
    assert_close(loss, F.cross_entropy(before.double(), target), torch.float32, "loss under no_grad")


@on_each_backend
def test_inplace_backward_used_correctly_gives_the_right_gradients(backend):
    h, w, target = _linear_logits()
    multisoft.cross_entropy(h @ w, target, inplace_backward=True, backend=backend).backward()
    h64, w64 = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    F.cross_entropy(h64 @ w64, target).backward()
    assert_close(h.grad, h64.grad, torch.float32, "dh")
    assert_close(w.grad, w64.grad, torch.float32, "dW")


# -- shapes and signatures


def test_zero_classes_raise():
    for logits, target in [(torch.randn(4, 0), torch.zeros(4, dtype=torch.long)),
                           (torch.randn(0), torch.tensor(0)),
                           (torch.randn(2, 0, 3), torch.zeros(2, 3, dtype=torch.long))]:
        with pytest.raises(ValueError, match="input has no classes"):
            multisoft.cross_entropy(logits, target)


def test_no_rows_give_torchs_answers():
    logits, target = torch.randn(0, 5), torch.zeros(0, dtype=torch.long)
    for reduction in ("none", "mean", "sum"):
        torch.testing.assert_close(multisoft.cross_entropy(logits, target, reduction=reduction),
                                   F.cross_entropy(logits, target, reduction=reduction), equal_nan=True)


def _positional_or_keyword(function):
    """(name, default) of each parameter a call can give by position or by name, in order."""
    return [(p.name, p.default) for p in inspect.signature(function).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


SAME_SIGNATURES = {  # multisoft's -> torch's
    "softmax": (multisoft.softmax, F.softmax),
    "log_softmax": (multisoft.log_softmax, F.log_softmax),
    "cross_entropy": (multisoft.cross_entropy, F.cross_entropy),
    "linear_cross_entropy": (multisoft.linear_cross_entropy, getattr(F, "linear_cross_entropy", None)),
    "nn.Softmax": (multisoft.nn.Softmax.__init__, torch.nn.Softmax.__init__),
    "nn.Softmax.forward": (multisoft.nn.Softmax.forward, torch.nn.Softmax.forward),
    "nn.LogSoftmax.forward": (multisoft.nn.LogSoftmax.forward, torch.nn.LogSoftmax.forward),
    "nn.CrossEntropyLoss": (multisoft.nn.CrossEntropyLoss.__init__, torch.nn.CrossEntropyLoss.__init__),
    "nn.CrossEntropyLoss.forward": (multisoft.nn.CrossEntropyLoss.forward, torch.nn.CrossEntropyLoss.forward),
}


@pytest.mark.parametrize("name", SAME_SIGNATURES)
def test_torchs_parameter_names_positions_and_defaults(name):
    """Every parameter a call to torch's function can give by position or by name is multisoft's too, in the same
    place with the same default; multisoft's own options are keyword-only. Where torch has no
    F.linear_cross_entropy (2.13 has one), multisoft's are checked against the names that one takes by position:
    input, linear_weight, target."""
    ours, theirs = SAME_SIGNATURES[name]
    if theirs is None:
        assert name == "linear_cross_entropy"
        assert _positional_or_keyword(ours) == [("input", inspect.Parameter.empty),
                                                ("linear_weight", inspect.Parameter.empty),
                                                ("target", inspect.Parameter.empty)]
        return
    assert _positional_or_keyword(ours) == _positional_or_keyword(theirs)


@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
@on_each_backend
def test_softmax_calls_by_torchs_names_and_positions(backend, log):
    """F.softmax(input=, dim=), F.softmax(input, dim, _stacklevel, dtype), torch.softmax(input, dim, dtype) and
    the modules' forward(input=) give torch's values; a dtype given twice, or a third argument that is neither,
    raises naming it."""
    ours, functional, function = ((multisoft.log_softmax, F.log_softmax, torch.log_softmax) if log
                                  else (multisoft.softmax, F.softmax, torch.softmax))
    module = (multisoft.nn.LogSoftmax if log else multisoft.nn.Softmax)(1, backend=backend)
    x = torch.randn(3, 20, device=DEVICE) * 3
    integers = torch.randint(-5, 5, (3, 20), device=DEVICE)
    calls = {  # what: (ours, torch's on float64)
        "input=, dim=": (ours(input=x, dim=1, backend=backend), functional(input=x.double(), dim=1)),
        "_stacklevel third": (ours(x, 1, 3, backend=backend), functional(x.double(), 1, 3)),
        "_stacklevel=": (ours(x, 0, _stacklevel=4, backend=backend), functional(x.double(), 0, _stacklevel=4)),
        "F's dtype fourth": (ours(integers, 1, 3, torch.float32, backend=backend), functional(integers.double(), 1)),
        "torch's dtype third": (ours(integers, 1, torch.float32, backend=backend), function(integers.double(), 1)),
        "module(input=)": (module(input=x), functional(x.double(), 1)),
    }
    for what, (got, expected) in calls.items():
        assert got.dtype == torch.float32, what
        assert_close(got, expected, torch.float32, what)
    name = "log_softmax" if log else "softmax"
    with pytest.raises(TypeError, match=f"{name} got two dtypes"):
        ours(x, 1, torch.float32, torch.float32, backend=backend)
    with pytest.raises(TypeError, match="_stacklevel must be an int, got str"):
        ours(x, 1, "3", backend=backend)


@on_each_backend
def test_cross_entropy_calls_by_torchs_names_and_positions(backend):
    """F.cross_entropy's arguments by name and by position (size_average and reduce fourth and sixth, as torch's:
    deprecated, they override reduction as torch maps them, with a warning); the module's forward(input=,
    target=); linear_cross_entropy by F.linear_cross_entropy's names. A call in the order that leaves size_average
    and reduce out (ignore_index fourth) raises naming size_average, rather than run with other options."""
    logits = torch.randn(7, 30, device=DEVICE)
    target = torch.randint(0, 30, (7,), device=DEVICE)
    target[2] = 5
    weight = torch.rand(30, device=DEVICE) + 0.5
    logits64, weight64 = logits.double(), weight.double()
    expected = F.cross_entropy(logits64, target, weight64, None, 5, None, "sum", 0.1)
    by_name = multisoft.cross_entropy(input=logits, target=target, weight=weight, size_average=None, ignore_index=5,
                                      reduce=None, reduction="sum", label_smoothing=0.1, backend=backend)
    assert_close(by_name, expected, torch.float32, "by name")
    by_position = multisoft.cross_entropy(logits, target, weight, None, 5, None, "sum", 0.1, backend=backend)
    assert_close(by_position, expected, torch.float32, "by position")
    module = multisoft.nn.CrossEntropyLoss(weight, None, 5, None, "sum", 0.1, backend=backend)
    assert_close(module(input=logits, target=target), expected, torch.float32, "module(input=, target=)")
    for size_average, reduce in ((False, None), (None, False), (True, True), (False, True)):
        with pytest.warns(UserWarning, match="size_average and reduce are deprecated"):
            ours = multisoft.cross_entropy(logits, target, weight, size_average, 5, reduce, backend=backend)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            theirs = F.cross_entropy(logits64, target, weight64, size_average, 5, reduce)
        assert_close(ours, theirs, torch.float32, f"size_average={size_average}, reduce={reduce}")
    with pytest.raises(TypeError, match="size_average must be a bool or None"):
        multisoft.cross_entropy(logits, target, weight, 5, "sum", 0.1, backend=backend)
    hidden, linear_weight = torch.randn(7, 4, device=DEVICE), torch.randn(30, 4, device=DEVICE)
    ours = multisoft.linear_cross_entropy(input=hidden, linear_weight=linear_weight, target=target, weight=weight,
                                          reduction="sum", ignore_index=5, label_smoothing=0.1, backend=backend)
    theirs = F.cross_entropy(hidden.double() @ linear_weight.double().t(), target, weight64, ignore_index=5,
                             reduction="sum", label_smoothing=0.1)
    assert_close(ours, theirs, torch.float32, "linear_cross_entropy by name")


@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
def test_implicit_dim_warning_names_the_frame_torchs_does(log):
    """F.softmax's _stacklevel picks the frame its implicit-dim warning names; multisoft's, given the same, names
    the same frame (here a line in this file), and its module the one torch's module names."""
    x = torch.randn(2, 3)
    ours, theirs = (multisoft.log_softmax, F.log_softmax) if log else (multisoft.softmax, F.softmax)

    def located(call):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            call()
        (warning,) = [w for w in caught if "Implicit dimension choice" in str(w.message)]
        return warning.filename, warning.lineno

    def through_one_frame(op, *level):  # level 3 names the line below, 4 the caller's (in `located`)
        return op(x, None, *level)

    for level in ((), (3,), (4,)):
        assert located(lambda: through_one_frame(ours, *level)) == located(lambda: through_one_frame(theirs, *level))
    assert located(lambda: through_one_frame(ours))[0] == __file__
    modules = (multisoft.nn.LogSoftmax(), torch.nn.LogSoftmax()) if log else (multisoft.nn.Softmax(),
                                                                              torch.nn.Softmax())
    assert located(lambda: modules[0](x)) == located(lambda: modules[1](x))


# -- torch.func


def _ops_under_a_transform():
    """op name -> a function of one tensor that calls it, and that tensor."""
    x = torch.randn(3, 7)
    target = torch.tensor([0, 6, 2])
    layout = torch.tensor([[[1, 0], [1, 1]]])
    blocks = torch.randn(1, 3, 16, 16)
    return {
        "softmax": (lambda t: multisoft.softmax(t, -1, backend="torch"), x),
        "log_softmax": (lambda t: multisoft.log_softmax(t, -1, backend="torch"), x),
        "cross_entropy": (lambda t: multisoft.cross_entropy(t, target, reduction="none", backend="torch"), x),
        "cross_entropy-probabilities": (lambda t: multisoft.cross_entropy(t, torch.softmax(x, 1), reduction="none",
                                                                          backend="torch"), x),
        "linear_cross_entropy": (lambda t: multisoft.linear_cross_entropy(t, x, target, reduction="none",
                                                                          backend="torch"), torch.randn(3, 7)),
        "blocksparse_softmax": (lambda t: multisoft.blocksparse_softmax(t, layout, 16, backend="torch"), blocks),
        "blocksparse_softmax_backward": (lambda t: multisoft.blocksparse_softmax_backward(
            torch.softmax(blocks, -1), t, layout, 16, backend="torch"), blocks),
        "nn.Softmax": (multisoft.nn.Softmax(-1, backend="torch"), x),
        "nn.CrossEntropyLoss": (lambda t: multisoft.nn.CrossEntropyLoss(backend="torch")(t, target), x),
    }


TRANSFORMS = {
    "grad": lambda f, t: torch.func.grad(lambda u: f(u).sum())(t),
    "vmap": lambda f, t: torch.func.vmap(f)(t.unsqueeze(0)),
    "jvp": lambda f, t: torch.func.jvp(f, (t,), (torch.ones_like(t),)),
    "jacrev": lambda f, t: torch.func.jacrev(lambda u: f(u).sum())(t),
}


@pytest.mark.parametrize("transform", TRANSFORMS)
@pytest.mark.parametrize("op", list(_ops_under_a_transform()))
def test_torch_func_transforms_raise_naming_the_op(op, transform):
    """Inside a torch.func transform every op raises NotImplementedError saying so, before any kernel runs."""
    function, tensor = _ops_under_a_transform()[op]
    name = op.split("-")[0].replace("nn.CrossEntropyLoss", "cross_entropy").replace("nn.Softmax", "softmax")
    with pytest.raises(NotImplementedError, match=rf"multisoft\.{name} does not support torch\.func transforms"):
        TRANSFORMS[transform](function, tensor)


class _Head(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lm_head = torch.nn.Linear(4, 9)
        self.loss = multisoft.nn.LinearCrossEntropyLoss(backend="torch")

    def forward(self, hidden, target):
        return self.loss(hidden, self.lm_head.weight, target, self.lm_head.bias)


def test_functional_call_is_not_a_transform():
    """torch.func.functional_call runs a module with other parameters: multisoft's ops run there, and autograd
    gives those parameters their gradients."""
    hidden, target = torch.randn(5, 4), torch.tensor([0, 8, 3, 3, 1])
    weight, bias = torch.randn(9, 4, requires_grad=True), torch.randn(9, requires_grad=True)
    loss = torch.func.functional_call(_Head(), {"lm_head.weight": weight, "lm_head.bias": bias}, (hidden, target))
    loss.backward()
    weight64, bias64 = weight.detach().double().requires_grad_(), bias.detach().double().requires_grad_()
    expected = F.cross_entropy(F.linear(hidden.double(), weight64, bias64), target)
    expected.backward()
    assert_close(loss, expected, torch.float32, "loss")
    assert_close(weight.grad, weight64.grad, torch.float32, "weight.grad")
    assert_close(bias.grad, bias64.grad, torch.float32, "bias.grad")


@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
@on_each_backend
def test_integer_input_with_a_floating_dtype(backend, log):
    x = torch.randint(-5, 5, (3, 20), device=DEVICE)
    op, torch_op = (multisoft.log_softmax, torch.log_softmax) if log else (multisoft.softmax, torch.softmax)
    y = op(x, 1, dtype=torch.float32, backend=backend)
    assert y.dtype == torch.float32
    assert_close(y, torch_op(x.double(), 1), torch.float32, "forward")
    with pytest.raises(TypeError, match="input must have a floating dtype"):
        op(x, 1, backend=backend)


def test_backend_must_be_a_name():
    x = torch.randn(2, 3)
    layout = torch.ones(1, 1, 1, dtype=torch.long)
    blocks = torch.randn(1, 1, 16, 16)
    calls = [lambda: multisoft.softmax(x, -1, backend=1), lambda: multisoft.log_softmax(x, -1, backend=1),
             lambda: multisoft.cross_entropy(x, torch.tensor([0, 1]), backend=1),
             lambda: multisoft.blocksparse_softmax(blocks, layout, 16, backend=1),
             lambda: multisoft.blocksparse_softmax_backward(blocks, blocks, layout, 16, backend=1)]
    for call in calls:
        with pytest.raises(TypeError, match="backend must be a backend name"):
            call()


# -- class-probability targets


PROBABILITY_CASES = {
    "2d": dict(shape=(9, 37)),
    "1d": dict(shape=(23,)),
    "weight-smooth": dict(shape=(9, 37), weight=True, label_smoothing=0.2),
    "spatial-weight": dict(shape=(3, 11, 4), weight=True),
    "softcap-z-loss-weight-smooth": dict(shape=(9, 37), weight=True, label_smoothing=0.1, softcap=4.0,
                                         lse_square_scale=0.01),
    "spatial-softcap-z-loss": dict(shape=(3, 11, 4), softcap=2.0, lse_square_scale=0.1),
}


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("case", PROBABILITY_CASES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@on_each_backend
def test_class_probability_targets(backend, dtype, case, reduction):
    spec = PROBABILITY_CASES[case]
    shape, class_dim = spec["shape"], 0 if len(spec["shape"]) == 1 else 1
    logits = (torch.randn(shape, device=DEVICE) * 2).to(dtype).requires_grad_()
    target = torch.softmax(torch.randn(shape, device=DEVICE) * 2, class_dim)
    weight = torch.rand(shape[class_dim], device=DEVICE) + 0.5 if spec.get("weight") else None
    kwargs = dict(weight=weight, reduction=reduction, label_smoothing=spec.get("label_smoothing", 0.0),
                  softcap=spec.get("softcap"), lse_square_scale=spec.get("lse_square_scale", 0.0))
    loss, lse = multisoft.cross_entropy(logits, target, backend=backend, return_lse=True, **kwargs)
    logits64 = logits.detach().double().requires_grad_()
    expected, expected_lse = reference_cross_entropy(logits64, target, return_lse=True, **kwargs)
    assert loss.shape == expected.shape and loss.dtype == torch.promote_types(dtype, torch.float32)
    assert lse.shape == expected_lse.shape and lse.dtype == loss.dtype
    assert_close(loss, expected, dtype, "loss")
    assert_close(lse, expected_lse, dtype, "lse")
    grad_out, grad_lse = torch.rand_like(expected).to(loss.dtype), torch.rand_like(expected_lse).to(loss.dtype)
    (grad,) = torch.autograd.grad((loss, lse), logits, (grad_out, grad_lse))
    (expected_grad,) = torch.autograd.grad((expected, expected_lse), logits64, (grad_out.double(), grad_lse.double()))
    assert_close(grad, expected_grad, dtype, "gradient")


def test_class_probability_targets_refuse_what_torch_refuses():
    logits = torch.randn(4, 6)
    with pytest.raises(ValueError, match="ignore_index"):
        multisoft.cross_entropy(logits, torch.rand(4, 6), ignore_index=1)
    with pytest.raises(ValueError, match="input's shape"):
        multisoft.cross_entropy(logits, torch.rand(4, 5))
    with pytest.raises(ValueError, match="inplace_backward"):
        multisoft.cross_entropy(logits.requires_grad_() * 1.0, torch.rand(4, 6), inplace_backward=True)


@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
@on_each_backend
def test_softmax_under_autocast_gives_torchs_dtype(backend, log):
    """Under torch.autocast on DEVICE a 16-bit x gives the dtype torch's op gives there (float32 on CUDA, whose
    autocast runs softmax in float32; unchanged on the CPU) and the values of that computation, and where that is
    float32 the gradient of it too (a 16-bit softmax's is the agreement tests'); dtype= still decides when given."""
    x = (torch.randn(4, 40, device=DEVICE) * 4).to(torch.bfloat16).requires_grad_()
    op, torch_op = (multisoft.log_softmax, torch.log_softmax) if log else (multisoft.softmax, torch.softmax)
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        y = op(x, -1, backend=backend)
        want_dtype = torch_op(x.detach(), -1).dtype
        assert op(x, -1, dtype=torch.bfloat16, backend=backend).dtype == torch.bfloat16
    assert y.dtype == want_dtype
    x64 = x.detach().double().requires_grad_()
    y64 = torch_op(x64, -1)
    assert_close(y, y64, want_dtype, "forward")
    if want_dtype != torch.float32:
        return
    v = torch.randn(4, 40, device=DEVICE)
    (y * v).sum().backward()
    (y64 * v.double()).sum().backward()
    assert x.grad.dtype == torch.bfloat16
    assert_close(x.grad, x64.grad, torch.bfloat16, "gradient")


# -- double backward


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
@on_each_backend
def test_softmax_double_backward(backend, log, compiled):
    """Eager, and through torch.compile's custom ops (the backward op has a gradient of its own)."""
    x = torch.randn(5, 33, device=DEVICE, requires_grad=True)
    v, u = torch.randn(5, 33, device=DEVICE), torch.randn(5, 33, device=DEVICE)
    op, torch_op = (multisoft.log_softmax, torch.log_softmax) if log else (multisoft.softmax, torch.softmax)

    def ours(t):
        return op(t, -1, backend=backend)

    if compiled:
        torch._dynamo.reset()
        ours = torch.compile(ours, backend="eager", fullgraph=True)
    (g,) = torch.autograd.grad((ours(x) * v).sum(), x, create_graph=True)
    (gg,) = torch.autograd.grad((g * u).sum(), x)
    x64 = x.detach().double().requires_grad_()
    (g64,) = torch.autograd.grad((torch_op(x64, -1) * v.double()).sum(), x64, create_graph=True)
    (gg64,) = torch.autograd.grad((g64 * u.double()).sum(), x64)
    assert_close(g, g64, torch.float32, "first gradient")
    assert_close(gg, gg64, torch.float32, "second gradient", gg64.abs() + 1)


@pytest.mark.parametrize("inplace_backward", [False, True], ids=["buffer", "inplace"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
@on_each_backend
def test_cross_entropy_double_backward_raises(backend, reduction, inplace_backward):
    """The gradient is computed in the forward and the logits are not kept: create_graph=True raises, saying so."""
    logits = torch.randn(6, 25, device=DEVICE, requires_grad=True)
    target = torch.randint(0, 25, (6,), device=DEVICE)
    loss = multisoft.cross_entropy(logits * 1, target, reduction=reduction, inplace_backward=inplace_backward,
                                   backend=backend)
    with pytest.raises(RuntimeError, match="multisoft.cross_entropy does not support double backward"):
        torch.autograd.grad(loss.sum(), logits, create_graph=True)


@on_each_backend
def test_double_backward_errors_say_so(backend):
    layout = torch.ones(1, 2, 2, dtype=torch.long)
    blocks = torch.randn(1, 4, 16, 16, device=DEVICE, requires_grad=True)
    y = multisoft.blocksparse_softmax(blocks, layout, 16, backend=backend)
    (g,) = torch.autograd.grad((y * torch.randn_like(y)).sum(), blocks, create_graph=True)
    with pytest.raises(RuntimeError, match="blocksparse_softmax does not support double backward"):
        torch.autograd.grad(g.sum(), blocks)


# -- multisoft.nn


def test_nn_modules_have_docstrings_and_torchs_positional_order():
    for module in (multisoft.nn.Softmax, multisoft.nn.LogSoftmax, multisoft.nn.CrossEntropyLoss):
        assert module.__doc__ and module.__name__.replace("Loss", "") in module.__doc__
    weight = torch.rand(6) + 0.5
    ours = multisoft.nn.CrossEntropyLoss(weight, None, 2, None, "sum", 0.1)
    theirs = torch.nn.CrossEntropyLoss(weight, None, 2, None, "sum", 0.1)
    logits, target = torch.randn(5, 6), torch.tensor([0, 2, 5, 2, 1])
    torch.testing.assert_close(ours(logits, target), theirs(logits, target))
    with pytest.warns(UserWarning, match="size_average and reduce are deprecated"):
        legacy = multisoft.nn.CrossEntropyLoss(reduce=False)
    assert legacy.reduction == "none"
    probabilities = torch.softmax(torch.randn(5, 6), 1)
    ours, theirs = multisoft.nn.CrossEntropyLoss(weight), torch.nn.CrossEntropyLoss(weight)
    torch.testing.assert_close(ours(logits, probabilities), theirs(logits, probabilities))


# -- corners where a swap for torch could differ without a word


@pytest.mark.parametrize("shape", [(5,), (3, 5), (2, 3, 4), (2, 3, 4, 5)], ids=str)
@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
def test_no_dim_is_torchs_implicit_choice_with_its_warning(log, shape):
    """F.softmax(x) without dim takes dim 0 for 1- and 3-D x, else 1, and warns; so do multisoft's function and
    module (whose dim defaults to None, as torch's does)."""
    x = torch.randn(shape, device=DEVICE)
    torch_op, ours = (F.log_softmax, multisoft.log_softmax) if log else (F.softmax, multisoft.softmax)
    module = multisoft.nn.LogSoftmax() if log else multisoft.nn.Softmax()
    with pytest.warns(UserWarning, match="Implicit dimension choice"):
        expected = torch_op(x)
    for call in (lambda: ours(x, backend="torch"), lambda: module(x)):
        with pytest.warns(UserWarning, match="Implicit dimension choice"):
            torch.testing.assert_close(call(), expected)


@on_each_backend
def test_an_empty_softmax_is_part_of_autograd_as_torchs(backend):
    """No elements: torch's own op, so that its gradient can itself be differentiated (create_graph)."""
    x = torch.empty(0, 5, device=DEVICE, requires_grad=True)
    (g,) = torch.autograd.grad(multisoft.softmax(x, -1, backend=backend), x, torch.empty(0, 5, device=DEVICE),
                               create_graph=True)
    assert g.requires_grad and g.shape == (0, 5)


@on_each_backend
def test_int32_targets_with_an_ignore_index_beyond_int32(backend):
    """An ignore_index no int32 target can equal ignores nothing (compared in int32 it would wrap: 2**32 + 1 would
    ignore class 1); beyond int64 it is refused."""
    logits = torch.randn(3, 5, device=DEVICE, requires_grad=True)
    target = torch.tensor([0, 1, 2], device=DEVICE)
    for ignore_index in (2**32 + 1, 2**32 - 1, -2**40):
        for reduction in ("none", "mean"):
            ours = multisoft.cross_entropy(logits, target.int(), ignore_index=ignore_index, reduction=reduction,
                                           backend=backend)
            theirs = F.cross_entropy(logits.detach().double(), target, ignore_index=ignore_index,
                                     reduction=reduction)
            assert_close(ours, theirs, torch.float32, f"ignore_index={ignore_index} {reduction}")
    hidden, linear_weight = torch.randn(3, 4, device=DEVICE), torch.randn(5, 4, device=DEVICE)
    ours = multisoft.linear_cross_entropy(hidden, linear_weight, target.int(), ignore_index=2**32 + 1,
                                          reduction="none", backend=backend)
    assert_close(ours, F.cross_entropy((hidden @ linear_weight.T).double(), target, reduction="none"),
                 torch.float32, "linear_cross_entropy")
    with pytest.raises(ValueError, match="ignore_index must fit in int64"):
        multisoft.cross_entropy(logits, target, ignore_index=2**63, backend=backend)


@on_each_backend
def test_a_weight_that_requires_grad_gets_it_or_raises(backend):
    """Class probabilities: the weight gets torch's gradient. Class indices: refused, as torch refuses them, not
    left without a gradient."""
    logits = torch.randn(4, 7, device=DEVICE, requires_grad=True)
    weight = (torch.rand(7, device=DEVICE) + 0.5).requires_grad_()
    probabilities = torch.softmax(torch.randn(4, 7, device=DEVICE), 1)
    multisoft.cross_entropy(logits, probabilities, weight=weight, label_smoothing=0.1, backend=backend).backward()
    logits64, weight64 = logits.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    F.cross_entropy(logits64, probabilities.double(), weight=weight64, label_smoothing=0.1).backward()
    assert_close(weight.grad, weight64.grad, torch.float32, "weight.grad")
    assert_close(logits.grad, logits64.grad, torch.float32, "logits.grad")
    target = torch.tensor([0, 6, 2, 1], device=DEVICE)
    for frozen_logits in (logits, logits.detach()):
        with pytest.raises(ValueError, match="weight requires grad"):
            multisoft.cross_entropy(frozen_logits, target, weight=weight, backend=backend)
    with pytest.raises(ValueError, match="weight requires grad"):
        multisoft.linear_cross_entropy(torch.randn(4, 3, device=DEVICE, requires_grad=True),
                                       torch.randn(7, 3, device=DEVICE), target, weight=weight, backend=backend)
    with torch.no_grad():
        multisoft.cross_entropy(logits, target, weight=weight, backend=backend)


@on_each_backend
def test_a_mean_over_target_weights_that_sum_to_zero_is_nan(backend):
    """torch's weighted mean is 0 / 0 there, even where label smoothing adds a positive sum (over 0: +inf)."""
    logits = torch.randn(3, 5, device=DEVICE, requires_grad=True)
    target = torch.zeros(3, dtype=torch.long, device=DEVICE)
    weight = torch.tensor([0.0, 1, 1, 1, 1], device=DEVICE)
    for smoothing in (0.0, 0.1):
        theirs = F.cross_entropy(logits.detach(), target, weight=weight, label_smoothing=smoothing)
        assert theirs.isnan()
        ours = multisoft.cross_entropy(logits, target, weight=weight, label_smoothing=smoothing, backend=backend)
        assert ours.isnan(), f"label_smoothing={smoothing}: {ours.item()}"
        hidden = torch.randn(3, 4, device=DEVICE)
        lce = multisoft.linear_cross_entropy(hidden, torch.randn(5, 4, device=DEVICE), target, weight=weight,
                                             label_smoothing=smoothing, backend=backend)
        assert lce.isnan(), f"linear_cross_entropy, label_smoothing={smoothing}: {lce.item()}"


def test_linear_cross_entropy_takes_torchs_ignore_index_none():
    """F.linear_cross_entropy's ignore_index defaults to None, which means -100."""
    hidden, linear_weight = torch.randn(4, 3), torch.randn(6, 3)
    target = torch.tensor([0, -100, 5, 2])
    torch.testing.assert_close(
        multisoft.linear_cross_entropy(hidden, linear_weight, target, ignore_index=None, backend="torch"),
        multisoft.linear_cross_entropy(hidden, linear_weight, target, backend="torch"))
