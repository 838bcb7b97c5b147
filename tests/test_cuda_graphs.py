"""CUDA graphs and torch.compile(mode="reduce-overhead") on every backend that runs on the GPU.

A forward+backward captured with torch.cuda.graph and replayed on new inputs must equal the same call run eagerly on
those inputs; so must a function compiled with mode="reduce-overhead" (which captures CUDA graphs itself). The
launch paths cache compiled kernels and streams per call signature: inside a capture they must launch on the
capturing stream, and a replay must read the inputs' memory as it is then.
"""

import pytest
import torch

import multisoft
from harness import ON_GPU, backends_under_test

pytestmark = pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a CUDA device")

GPU_BACKENDS = [name for name in backends_under_test() if name != "reference"] if ON_GPU else []


def _softmax_step(backend):
    def step(x, dy):
        y = multisoft.softmax(x, -1, backend=backend)
        (dx,) = torch.autograd.grad(y, x, dy)
        return y, dx
    return step


def _cross_entropy_step(backend):
    def step(logits, target):
        loss = multisoft.cross_entropy(logits, target, backend=backend)
        (grad,) = torch.autograd.grad(loss, logits)
        return loss, grad
    return step


def _log_probs_step(backend):
    def step(logits, target):
        picked, entropy = multisoft.log_probs(logits, target, temperature=0.7, return_entropy=True, backend=backend)
        (grad,) = torch.autograd.grad(picked.sum() - 0.1 * entropy.sum(), logits)
        return picked, grad
    return step


def _inputs(kind, seed, dtype):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    if kind == "softmax":
        x = torch.randn(64, 1000, device="cuda", generator=generator).to(dtype).requires_grad_()
        return x, torch.randn(64, 1000, device="cuda", generator=generator).to(dtype)
    logits = (3 * torch.randn(64, 5000, device="cuda", generator=generator)).to(dtype).requires_grad_()
    target = torch.randint(0, 5000, (64,) if kind == "cross_entropy" else (64, 2), device="cuda",
                           generator=generator)
    target[::7] = -100
    return logits, target


STEPS = {"softmax": _softmax_step, "cross_entropy": _cross_entropy_step, "log_probs": _log_probs_step}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", sorted(STEPS))
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_graph_replay_equals_eager(backend, kind, dtype):
    step = STEPS[kind](backend)
    static = _inputs(kind, 0, dtype)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):   # warm up (compile, plan, cache) off the capture, as torch's docs ask
        for _ in range(2):
            step(*static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = step(*static)
    for seed in (1, 2):
        fresh = _inputs(kind, seed, dtype)
        with torch.no_grad():
            for held, new in zip(static, fresh):
                held.copy_(new)
        graph.replay()
        expected = step(*fresh)
        for got, want in zip(outputs, expected):
            torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("kind", sorted(STEPS))
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_reduce_overhead_compile_equals_eager(backend, kind):
    torch._dynamo.reset()
    step = STEPS[kind](backend)

    def loss_and_grad(first, second):
        if kind == "softmax":
            y = multisoft.softmax(first, -1, backend=backend)
            return y, (y * second).sum()
        if kind == "log_probs":
            picked, entropy = multisoft.log_probs(first, second, temperature=0.7, return_entropy=True,
                                                  backend=backend)
            return picked, picked.sum() - 0.1 * entropy.sum()
        loss = multisoft.cross_entropy(first, second, backend=backend)
        return loss, loss

    compiled = torch.compile(loss_and_grad, mode="reduce-overhead", fullgraph=True)
    for seed in range(4):   # the first calls record, later ones replay the captured graph
        first, second = _inputs(kind, seed, torch.float32)
        out, scalar = compiled(first, second)
        (grad,) = torch.autograd.grad(scalar, first)
        want_out, want_grad = step(first.detach().requires_grad_(), second)   # softmax: dy = second, as above
        torch.testing.assert_close(out.clone(), want_out.detach(), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(grad, want_grad, rtol=1e-6, atol=1e-6)
