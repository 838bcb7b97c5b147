"""Forward-mode AD (torch.autograd.forward_ad): softmax and log_softmax give torch's tangent on every backend; the
other ops refuse a tangent by name rather than drop it (a kernel writes through raw pointers, so a tangent that
went past it would silently read as zero)."""

from __future__ import annotations

import pytest
import torch
import torch.autograd.forward_ad as forward_ad

import multisoft
from harness import DEVICE, assert_close, backends_under_test

BACKENDS = backends_under_test()


def _tangent(f, x, t):
    with forward_ad.dual_level():
        return forward_ad.unpack_dual(f(forward_ad.make_dual(x, t))).tangent


@pytest.mark.parametrize("requires_grad", [False, True], ids=["plain", "requires-grad"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_softmax_tangent_is_torchs(backend, log, dtype, requires_grad):
    """Along a middle dim of a 3-D x, with and without autograd on x; against torch's tangent in float64."""
    x = torch.randn(3, 5, 4, device=DEVICE).to(dtype)
    t = torch.randn(3, 5, 4, device=DEVICE).to(dtype)
    op = multisoft.log_softmax if log else multisoft.softmax
    torch_op = torch.log_softmax if log else torch.softmax
    ours = _tangent(lambda d: op(d, 1, backend=backend), x.clone().requires_grad_(requires_grad), t)
    assert ours is not None, "the tangent was dropped"
    assert ours.dtype == dtype
    assert_close(ours, _tangent(lambda d: torch_op(d, 1), x.double(), t.double()), dtype, "tangent")


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_other_ops_refuse_a_tangent(backend):
    logits, t = torch.randn(4, 6, device=DEVICE), torch.randn(4, 6, device=DEVICE)
    target = torch.tensor([0, 5, 2, 1], device=DEVICE)
    layout = torch.ones(1, 1, 1, dtype=torch.long)
    blocks = torch.randn(1, 1, 16, 16, device=DEVICE)
    with forward_ad.dual_level():
        dual = forward_ad.make_dual(logits, t)
        with pytest.raises(NotImplementedError, match="multisoft.cross_entropy does not support forward-mode AD"):
            multisoft.cross_entropy(dual, target, backend=backend)
        with pytest.raises(NotImplementedError, match="linear_cross_entropy .*linear_weight carries a tangent"):
            multisoft.linear_cross_entropy(torch.randn(4, 3, device=DEVICE),
                                           forward_ad.make_dual(torch.randn(6, 3, device=DEVICE),
                                                                torch.randn(6, 3, device=DEVICE)),
                                           target, backend=backend)
        with pytest.raises(NotImplementedError, match="blocksparse_softmax does not support"):
            multisoft.blocksparse_softmax(forward_ad.make_dual(blocks, torch.randn_like(blocks)), layout, 16,
                                          backend=backend)
        # a tensor without a tangent inside a dual level still runs
        loss = multisoft.cross_entropy(logits, target, backend=backend)
    torch.testing.assert_close(loss, torch.nn.functional.cross_entropy(logits, target), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_forward_over_reverse_is_torchs(backend, log):
    """The tangent of the gradient (a Hessian-vector product): the backward runs in torch ops when a tangent
    reaches it, so that the tangent goes through."""
    x, t, g = (torch.randn(3, 5, device=DEVICE) for _ in range(3))
    op = multisoft.log_softmax if log else multisoft.softmax
    torch_op = torch.log_softmax if log else torch.softmax

    def gradient_and_its_tangent(f, x, t, g):
        x = x.clone().requires_grad_()
        with forward_ad.dual_level():
            (dx,) = torch.autograd.grad(f(forward_ad.make_dual(x, t)), x, g)
            return forward_ad.unpack_dual(dx)

    ours = gradient_and_its_tangent(lambda d: op(d, -1, backend=backend), x, t, g)
    theirs = gradient_and_its_tangent(lambda d: torch_op(d, -1), x.double(), t.double(), g.double())
    assert_close(ours.primal, theirs.primal, torch.float32, "gradient")
    assert ours.tangent is not None, "the gradient's tangent was dropped"
    assert_close(ours.tangent, theirs.tangent, torch.float32, "the gradient's tangent")
