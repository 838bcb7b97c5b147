"""multisoft.log_probs and linear_log_probs with process_group (vocabulary-parallel), on gloo groups of CPU
processes: every rank's log-probabilities and entropy are the whole rows' (float64 ``reference_log_probs`` of the
unsplit logits), its gradient is its slice of the unsplit one (the input's, for linear_log_probs, the whole of it on
every rank), with ranks of uneven widths and a rank that holds no class; one all-gather a forward (a chunk), and
the backward of log_probs communicates nothing.

Each test spawns its processes once and runs its cases there; a rank collects its failures and raises them
together, which torch.multiprocessing.spawn raises in the test.
"""

from __future__ import annotations

import datetime
import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from multisoft.check import error_ratio, reference_linear_logits, reference_log_probs

WIDTHS = {2: (9, 14), 3: (10, 0, 13)}   # uneven slices of 23 classes; a rank of three holds none


def _check(failures, what, actual, expected, magnitude=None):
    _, ratio = error_ratio(actual, expected, torch.float32, magnitude)
    if not ratio <= 1.0:
        failures.append(f"{what}: {ratio:.3g} x the float32 tolerance")


def _counting_gathers(calls):
    """Wraps torch.distributed's all-gathers so that each call is appended to ``calls``."""
    for name in ("all_gather_single", "all_gather_into_tensor", "all_reduce"):
        original = getattr(dist, name, None)
        if original is None:
            continue

        def counted(*args, _name=name, _original=original, **kwargs):
            calls.append(_name)
            return _original(*args, **kwargs)
        setattr(dist, name, counted)


def _cases(rank, widths, backend, failures):
    import multisoft

    group, start = dist.group.WORLD, sum(widths[:rank])
    columns = slice(start, start + widths[rank])
    generator = torch.Generator().manual_seed(11)
    classes, hidden = sum(widths), 8
    x = torch.randn(2, 5, hidden, generator=generator)
    weight = torch.randn(classes, hidden, generator=generator)
    bias = torch.randn(classes, generator=generator)
    target = torch.randint(0, classes, (2, 5, 2), generator=generator)
    target[0, 0, 1] = -100
    grad_ids = torch.randn(2, 5, 2, generator=generator)
    grad_entropy = torch.randn(2, 5, generator=generator)
    logits = F.linear(x, weight, bias)
    calls = []
    _counting_gathers(calls)
    for temperature, softcap in ((1.0, None), (0.7, 9.0)):
        label = f"rank {rank} of {len(widths)} T={temperature} softcap={softcap} backend={backend}"
        options = dict(temperature=temperature, softcap=softcap)
        full = logits.double().requires_grad_()
        expected, expected_entropy = reference_log_probs(full, target, return_entropy=True, **options)
        (expected_grad,) = torch.autograd.grad((expected * grad_ids.double()).sum()
                                               + (expected_entropy * grad_entropy.double()).sum(), full)
        size = full.detach().abs().amax(-1, keepdim=True) / temperature + 1.0
        # on logits
        local = logits[..., columns].clone().requires_grad_()
        calls.clear()
        picked, entropy = multisoft.log_probs(local, target, return_entropy=True, backend=backend,
                                              process_group=group, **options)
        gathers_forward = len(calls)
        torch.autograd.backward((picked, entropy), (grad_ids, grad_entropy))
        if gathers_forward != 2 or len(calls) != 2:  # the slice's widths, then the statistics; nothing backward
            failures.append(f"log_probs, {label}: collectives {calls}")
        _check(failures, f"log_probs, {label}", picked, expected, expected.abs() + size)
        _check(failures, f"entropy, {label}", entropy, expected_entropy, expected_entropy.abs() + size.squeeze(-1))
        _check(failures, f"gradient, {label}", local.grad, expected_grad[..., columns],
               expected_grad[..., columns].abs() + 1e-3)
        # fused with the output layer, in chunks of 3 rows
        leaves = [t.clone().requires_grad_() for t in (x, weight[columns], bias[columns])]
        calls.clear()
        picked, entropy = multisoft.linear_log_probs(leaves[0], leaves[1], target, linear_bias=leaves[2],
                                                     return_entropy=True, chunk_size=3, backend=backend,
                                                     process_group=group, **options)
        chunks = -(-10 // 3)
        if calls != [calls[0]] * (1 + chunks):
            failures.append(f"linear_log_probs forward, {label}: collectives {calls}")
        torch.autograd.backward((picked, entropy), (grad_ids, grad_entropy))
        float64_leaves, float64_logits = reference_linear_logits(x, weight, bias)
        expected, expected_entropy = reference_log_probs(float64_logits, target.reshape(10, 2), return_entropy=True,
                                                         **options)
        expected_grads = torch.autograd.grad((expected * grad_ids.reshape(10, 2).double()).sum()
                                             + (expected_entropy * grad_entropy.reshape(10).double()).sum(),
                                             float64_leaves)
        _check(failures, f"linear log_probs, {label}", picked.reshape(10, 2), expected,
               expected.abs() + size.reshape(10, 1))
        for name, grad, want in zip(("input", "weight", "bias"), (t.grad for t in leaves),
                                    (expected_grads[0], expected_grads[1][columns], expected_grads[2][columns])):
            _check(failures, f"linear {name} gradient, {label}", grad, want, want.abs() + 1e-3)


def _worker(rank, world, rendezvous, backends):
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    failures = []
    for backend in backends:
        _cases(rank, WIDTHS[world], backend, failures)
    dist.destroy_process_group()
    if failures:
        raise AssertionError("\n".join(failures))
    sys.stdout.flush()
    os._exit(0)  # no interpreter finalization with gloo's threads still about (tests/test_vocab_parallel.py)


@pytest.mark.parametrize("world", [2, 3])
def test_gloo_matches_the_unsplit_call(tmp_path, world):
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    mp.spawn(_worker, args=(world, str(tmp_path / "rendezvous"), ("torch", "reference")), nprocs=world, join=True)
