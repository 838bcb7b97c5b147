"""multisoft.linear_log_probs on every backend that implements log_probs: values and the gradients of input,
linear_weight and linear_bias for any incoming gradients, against float64 (``reference_log_probs`` of
``reference_linear_logits``), chunked or not; options, errors, autocast and torch.compile."""

from __future__ import annotations

import zlib

import pytest
import torch
import torch.nn.functional as F

import multisoft
from harness import DEVICE, assert_close, on_backends_implementing
from multisoft.check import (DTYPES, linear_gradient_magnitudes, reference_linear_logits, reference_log_probs,
                             reference_log_probs_gradient)

each_dtype = pytest.mark.parametrize("dtype", DTYPES, ids=str)
# (input's shape, classes, target's shape, chunk_size, bias, temperature, softcap)
CASES = [((10, 16), 37, (10,), 4, True, 1.0, None), ((2, 5, 8), 50, (2, 5, 3), None, False, 0.7, 12.0),
         ((7, 12), 5, (7, 2), 3, True, 1.5, None)]


def _inputs(shape, classes, target_shape, bias, dtype):
    generator = torch.Generator().manual_seed(zlib.crc32(repr((shape, classes, target_shape, str(dtype))).encode()))
    hidden = shape[-1]
    x = torch.randn(shape, generator=generator).to(dtype).to(DEVICE)
    weight = (torch.randn(classes, hidden, generator=generator) * (3 / hidden ** 0.5)).to(dtype).to(DEVICE)
    linear_bias = torch.randn(classes, generator=generator).to(dtype).to(DEVICE) if bias else None
    target = torch.randint(0, classes, target_shape, generator=generator)
    target.view(-1)[::4] = -100
    grad_ids = torch.randn(target_shape, generator=generator)
    grad_entropy = torch.randn(shape[:-1], generator=generator)
    return x, weight, linear_bias, target.to(DEVICE), grad_ids.to(DEVICE), grad_entropy.to(DEVICE)


@on_backends_implementing("log_probs")
@each_dtype
def test_values_and_gradients_against_float64(backend, dtype):
    for shape, classes, target_shape, chunk_size, bias, temperature, softcap in CASES:
        x, weight, linear_bias, target, grad_ids, grad_entropy = _inputs(shape, classes, target_shape, bias, dtype)
        leaves = [t.clone().requires_grad_() if t is not None else None for t in (x, weight, linear_bias)]
        options = dict(temperature=temperature, softcap=softcap)
        picked, entropy = multisoft.linear_log_probs(leaves[0], leaves[1], target, linear_bias=leaves[2],
                                                     return_entropy=True, chunk_size=chunk_size, backend=backend,
                                                     **options)
        assert picked.shape == target.shape and entropy.shape == shape[:-1]
        wanted = [t for t in leaves if t is not None]
        grads = torch.autograd.grad((picked, entropy), wanted, (grad_ids, grad_entropy))
        float64_leaves, logits = reference_linear_logits(x, weight, linear_bias)
        rows_target = target.reshape(logits.shape[0], -1)
        expected_picked, expected_entropy = reference_log_probs(logits, rows_target, return_entropy=True, **options)
        label = f"{shape} V={classes} K={target_shape} chunk={chunk_size} bias={bias}"
        size = logits.detach().abs().amax(-1, keepdim=True) / temperature + 1.0  # u_t - lse, lse - sum p u
        assert_close(picked.reshape(rows_target.shape), expected_picked, dtype, f"log_probs {label}",
                     expected_picked.abs() + size)
        assert_close(entropy.reshape(-1), expected_entropy, dtype, f"entropy {label}",
                     expected_entropy.abs() + size.squeeze(-1))
        total = (expected_picked * grad_ids.reshape(rows_target.shape).double()).sum() + (
            expected_entropy * grad_entropy.reshape(-1).double()).sum()
        expected_grads = torch.autograd.grad(total, [t for t in float64_leaves if t is not None])
        _, logits_size = reference_log_probs_gradient(logits, rows_target, grad_ids.reshape(rows_target.shape),
                                                      grad_entropy.reshape(-1), **options)
        magnitudes = linear_gradient_magnitudes(logits_size, x, weight)
        for name, grad, expected, magnitude in zip(("input", "weight", "bias"), grads, expected_grads, magnitudes):
            assert grad.dtype == dtype
            assert_close(grad, expected, dtype, f"{name} gradient {label}", magnitude.reshape(expected.shape))


@on_backends_implementing("log_probs")
def test_the_same_as_log_probs_of_the_logits(backend):
    """One chunk or several: the values of log_probs of F.linear's logits (float32: bitwise but for the matmul's
    own rounding, which here is the same matmul)."""
    x, weight, linear_bias, target, _, _ = _inputs((9, 16), 30, (9,), True, torch.float32)
    expected = multisoft.log_probs(F.linear(x, weight, linear_bias), target, temperature=0.9, backend=backend)
    for chunk_size in (None, 9, 4, 1):
        picked = multisoft.linear_log_probs(x, weight, target, linear_bias=linear_bias, temperature=0.9,
                                            chunk_size=chunk_size, backend=backend)
        torch.testing.assert_close(picked, expected, rtol=1e-6, atol=1e-6)


def test_bad_arguments_raise_before_any_kernel():
    x, weight, linear_bias, target, _, _ = _inputs((4, 8), 10, (4,), True, torch.float32)
    with pytest.raises(ValueError, match="temperature must be a finite number > 0"):
        multisoft.linear_log_probs(x, weight, target, temperature=0.0)
    with pytest.raises(ValueError, match=r"linear_weight must have shape \(V, 8\)"):
        multisoft.linear_log_probs(x, weight[:, :4], target)
    with pytest.raises(ValueError, match=r"target must have shape \(4,\) \(one id a row\)"):
        multisoft.linear_log_probs(x, weight, target[:3])
    with pytest.raises(TypeError, match="linear_weight must have the input's dtype"):
        multisoft.linear_log_probs(x, weight.double(), target)
    with pytest.raises(ValueError, match="chunk_size must be a number of rows >= 1"):
        multisoft.linear_log_probs(x, weight, target, chunk_size=0)
    with pytest.raises(ValueError, match="linear_weight has no rows"):
        multisoft.linear_log_probs(x, weight[:0], target)


def test_no_rows():
    picked, entropy = multisoft.linear_log_probs(torch.randn(0, 8), torch.randn(10, 8),
                                                 torch.zeros(0, dtype=torch.long), return_entropy=True,
                                                 backend="torch")
    assert picked.shape == (0,) and entropy.shape == (0,)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_compiled_fullgraph_matches_eager(dynamic):
    """A GRPO-like loss with nn.Parameters under torch.compile(fullgraph=True): the eager values and gradients."""
    torch._dynamo.reset()
    x, weight, linear_bias, target, grad_ids, _ = _inputs((2, 6, 8), 21, (2, 6), True, torch.float32)
    x, weight, linear_bias, target, advantages = (t.cpu() for t in (x, weight, linear_bias, target, grad_ids))

    def loss_of(hidden, lm_head, bias):
        picked, entropy = multisoft.linear_log_probs(hidden, lm_head, target, linear_bias=bias, temperature=0.8,
                                                     return_entropy=True, chunk_size=5, backend="torch")
        return -(picked * advantages).mean() - 0.01 * entropy.mean()

    results = []
    for run in (loss_of, torch.compile(loss_of, fullgraph=True, dynamic=dynamic)):
        params = [torch.nn.Parameter(t.clone()) for t in (x, weight, linear_bias)]
        loss = run(*params)
        loss.backward()
        results.append((loss.detach(), *(p.grad for p in params)))
    for compiled, eager in zip(results[1], results[0]):
        torch.testing.assert_close(compiled, eager, rtol=1e-6, atol=1e-7)
