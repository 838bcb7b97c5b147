"""A user swaps a torch.nn.functional call for multisoft's: the same arguments, the same answers, the same errors.

Also the in-place cross-entropy's contract with autograd: its write into the logits is visible to autograd (the
version counter), so every misuse raises, on every backend.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import multisoft
from harness import DEVICE, assert_close, backends_under_test
from multisoft.check import DTYPES, reference_cross_entropy

BACKENDS = backends_under_test()
on_each_backend = pytest.mark.parametrize("backend", BACKENDS)


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
        with pytest.raises(ValueError, match="logits has no classes"):
            multisoft.cross_entropy(logits, target)


def test_no_rows_give_torchs_answers():
    logits, target = torch.randn(0, 5), torch.zeros(0, dtype=torch.long)
    for reduction in ("none", "mean", "sum"):
        torch.testing.assert_close(multisoft.cross_entropy(logits, target, reduction=reduction),
                                   F.cross_entropy(logits, target, reduction=reduction), equal_nan=True)


@on_each_backend
def test_weight_and_the_rest_positionally_as_in_torch(backend):
    logits = torch.randn(7, 30, device=DEVICE)
    target = torch.randint(0, 30, (7,), device=DEVICE)
    target[2] = 5
    weight = torch.rand(30, device=DEVICE) + 0.5
    loss = multisoft.cross_entropy(logits, target, weight, 5, "sum", 0.1, backend=backend)
    expected = F.cross_entropy(logits.double(), target, weight.double(), ignore_index=5, reduction="sum",
                               label_smoothing=0.1)
    assert_close(loss, expected, torch.float32, "loss")


@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
@on_each_backend
def test_integer_input_with_a_floating_dtype(backend, log):
    x = torch.randint(-5, 5, (3, 20), device=DEVICE)
    op, torch_op = (multisoft.log_softmax, torch.log_softmax) if log else (multisoft.softmax, torch.softmax)
    y = op(x, 1, dtype=torch.float32, backend=backend)
    assert y.dtype == torch.float32
    assert_close(y, torch_op(x.double(), 1), torch.float32, "forward")
    with pytest.raises(TypeError, match="x must have a floating dtype"):
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
    with pytest.raises(ValueError, match="logits' shape"):
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
