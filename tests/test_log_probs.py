"""multisoft.log_probs through the public API on every backend that implements it: values and gradients against
float64 (multisoft/check.py's ``reference_log_probs``), options, errors, and torch.compile."""

from __future__ import annotations

import zlib

import pytest
import torch

import multisoft
from harness import DEVICE, assert_close, on_backends_implementing
from multisoft.check import DTYPES, reference_log_probs, reference_log_probs_gradient

each_dtype = pytest.mark.parametrize("dtype", DTYPES, ids=str)
# (logits' shape, target's shape, temperature, softcap): one id a row and K ids a row, (M, V) and (B, T, V)
CASES = [((5, 37), (5,), 1.0, None), ((2, 3, 64), (2, 3), 0.7, 20.0), ((4, 300), (4, 3), 1.6, None),
         ((3, 1), (3,), 0.5, None)]


def _generator(*key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def _inputs(shape, target_shape, dtype, key):
    generator = _generator(shape, target_shape, str(dtype), key)
    logits = (torch.randn(shape, generator=generator) * 3.0).to(dtype).to(DEVICE)
    target = torch.randint(0, shape[-1], target_shape, generator=generator).to(DEVICE)
    return logits, target


@on_backends_implementing("log_probs")
@each_dtype
@pytest.mark.parametrize("incoming", ["both", "log_probs", "entropy"])
def test_values_and_gradients_against_float64(backend, dtype, incoming):
    """Log-probabilities, entropy, and the gradient of any incoming gradients of either or both."""
    for shape, target_shape, temperature, softcap in CASES:
        logits, target = _inputs(shape, target_shape, dtype, "agreement")
        leaf = logits.clone().requires_grad_()
        options = dict(temperature=temperature, softcap=softcap)
        picked, entropy = multisoft.log_probs(leaf, target, return_entropy=True, backend=backend, **options)
        expected_picked, expected_entropy = reference_log_probs(logits, target, return_entropy=True, **options)
        label = f"{shape} -> {target_shape} T={temperature} softcap={softcap}"
        assert picked.shape == target.shape and entropy.shape == shape[:-1], label
        assert picked.dtype == entropy.dtype == torch.float32
        assert_close(picked, expected_picked, dtype, f"log_probs {label}", expected_picked.abs() + 1.0)
        assert_close(entropy, expected_entropy, dtype, f"entropy {label}", expected_entropy.abs() + 1.0)
        generator = _generator("incoming", shape, incoming)
        grad_ids = torch.randn(target.shape, generator=generator).to(DEVICE) if incoming != "entropy" else None
        grad_entropy = torch.randn(entropy.shape, generator=generator).to(DEVICE) if incoming != "log_probs" \
            else None
        outputs = [o for o, g in ((picked, grad_ids), (entropy, grad_entropy)) if g is not None]
        grads = [g for g in (grad_ids, grad_entropy) if g is not None]
        torch.autograd.backward(outputs, grads)
        expected, size = reference_log_probs_gradient(logits, target, grad_ids, grad_entropy, **options)
        assert leaf.grad.dtype == dtype
        assert_close(leaf.grad, expected, dtype, f"gradient ({incoming}) {label}", size)


@on_backends_implementing("log_probs")
def test_ignored_ids_and_masked_classes(backend):
    """An id equal to ignore_index (0 here, a class) gives 0 and no gradient; -inf logits (masked classes) keep the
    entropy finite, and their gradient is 0."""
    logits, target = _inputs((4, 40), (4, 2), torch.float32, "ignored")
    logits[1, ::2] = float("-inf")
    target[1] = torch.tensor([1, 0])
    target[2, 0] = 0
    leaf = logits.clone().requires_grad_()
    picked, entropy = multisoft.log_probs(leaf, target, ignore_index=0, return_entropy=True, backend=backend)
    assert picked[1, 1] == 0 and picked[2, 0] == 0
    expected_picked, expected_entropy = reference_log_probs(logits, target, ignore_index=0, return_entropy=True)
    assert_close(picked, expected_picked, torch.float32, "log_probs", expected_picked.abs() + 1.0)
    assert torch.isfinite(entropy).all()
    assert_close(entropy, expected_entropy, torch.float32, "entropy", expected_entropy.abs() + 1.0)
    (picked.sum() + entropy.sum()).backward()
    assert torch.isfinite(leaf.grad).all()
    assert (leaf.grad[1, ::2] == 0).all()
    expected, size = reference_log_probs_gradient(logits, target, torch.ones(4, 2, device=DEVICE),
                                                  torch.ones(4, device=DEVICE), ignore_index=0)
    assert_close(leaf.grad, expected, torch.float32, "gradient", size)


@on_backends_implementing("log_probs")
def test_nan_and_infinite_rows_give_nan_as_torch(backend):
    """A row holding NaN or +inf, or all -inf, gives NaN log-probabilities and entropy, as torch's log_softmax."""
    logits, target = _inputs((4, 16), (4,), torch.float32, "nan")
    logits[0, 3] = float("nan")
    logits[1, 5] = float("inf")
    logits[2] = float("-inf")
    picked, entropy = multisoft.log_probs(logits, target, return_entropy=True, backend=backend)
    assert picked[:3].isnan().all() and entropy[:3].isnan().all()
    assert torch.isfinite(picked[3]) and torch.isfinite(entropy[3])
    assert torch.log_softmax(logits, -1).gather(1, target.unsqueeze(1))[:3].isnan().all()


def test_bad_arguments_raise_before_any_kernel():
    logits, target = _inputs((3, 10), (3,), torch.float32, "errors")
    for temperature in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="temperature must be a finite number > 0"):
            multisoft.log_probs(logits, target, temperature=temperature)
    with pytest.raises(TypeError, match="temperature must be a real number"):
        multisoft.log_probs(logits, target, temperature="hot")
    with pytest.raises(ValueError, match="softcap must be a finite number > 0"):
        multisoft.log_probs(logits, target, softcap=0.0)
    with pytest.raises(TypeError, match="target must hold class ids as int64 or int32"):
        multisoft.log_probs(logits, target.float())
    with pytest.raises(ValueError, match=r"target must have shape \(3,\) \(one id a row\)"):
        multisoft.log_probs(logits, target[:2])
    with pytest.raises(TypeError, match="logits must have a floating dtype"):
        multisoft.log_probs(target, target)
    with pytest.raises(ValueError, match="logits must have shape"):
        multisoft.log_probs(logits[0, 0], target[0])
    with pytest.raises(TypeError, match="return_entropy must be a bool"):
        multisoft.log_probs(logits, target, return_entropy=1)
    with pytest.raises(TypeError, match="ignore_index must be an int"):
        multisoft.log_probs(logits, target, ignore_index=1.5)


def test_an_id_out_of_range_on_the_cpu_raises():
    """IndexError, as multisoft.cross_entropy's (and F.cross_entropy's) for a target outside the classes."""
    logits = torch.randn(2, 5)
    for ids in (torch.tensor([1, 5]), torch.tensor([[1, 2], [-3, 0]])):
        with pytest.raises(IndexError, match="is out of bounds"):
            multisoft.log_probs(logits, ids, backend="torch")


def test_no_rows_and_no_grad():
    """No rows give empty results; without autograd the values are the same as with it."""
    picked, entropy = multisoft.log_probs(torch.randn(0, 7), torch.zeros(0, dtype=torch.long), return_entropy=True,
                                          backend="torch")
    assert picked.shape == (0,) and entropy.shape == (0,)
    logits, target = _inputs((3, 9), (3,), torch.float32, "no grad")
    leaf = logits.clone().requires_grad_()
    with torch.no_grad():
        quiet = multisoft.log_probs(leaf, target, backend="torch")
    assert torch.equal(quiet, multisoft.log_probs(leaf, target, backend="torch").detach())


def test_double_backward_raises():
    leaf = torch.randn(3, 9, requires_grad=True)
    picked = multisoft.log_probs(leaf, torch.tensor([1, 2, 3]), backend="torch")
    with pytest.raises(RuntimeError, match="multisoft.log_probs does not support double backward"):
        torch.autograd.grad(picked.sum(), leaf, create_graph=True)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_compiled_fullgraph_matches_eager(dynamic):
    """torch.compile(fullgraph=True) of a GRPO-like loss on nn.Parameter logits: the same values and gradient as
    eager (the torch backend, on the CPU)."""
    torch._dynamo.reset()
    logits, target = _inputs((2, 3, 33), (2, 3), torch.float32, "compiled")
    logits, target = logits.cpu(), target.cpu()
    advantages = torch.randn(2, 3, generator=_generator("advantages"))

    def loss_of(weights):
        picked, entropy = multisoft.log_probs(weights, target, temperature=0.8, return_entropy=True,
                                              backend="torch")
        return -(picked * advantages).mean() - 0.01 * entropy.mean()

    results = []
    for run in (loss_of, torch.compile(loss_of, fullgraph=True, dynamic=dynamic)):
        weights = torch.nn.Parameter(logits.cpu().clone())
        loss = run(weights)
        loss.backward()
        results.append((loss.detach(), weights.grad))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(results[1][1], results[0][1], rtol=1e-6, atol=1e-7)
