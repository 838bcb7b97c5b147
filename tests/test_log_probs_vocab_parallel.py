"""multisoft.log_probs and linear_log_probs with process_group (vocabulary-parallel), on gloo groups of CPU
processes: every rank's log-probabilities and entropy are the whole rows' (float64 ``reference_log_probs`` of the
unsplit logits), its gradient is its slice of the unsplit one (the input's, for linear_log_probs, the whole of it on
every rank), with ranks of uneven widths and a rank that holds no class; one all-gather a forward (a chunk), and
the backward of log_probs communicates nothing.

Each test spawns its processes once and runs its cases there (tests/distributed_harness.py); a rank collects its
failures and raises them together, which torch.multiprocessing.spawn raises in the test.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from distributed_harness import GATHERS, Ranks, Report, counting_collectives, exit_at_once, join_group, spawn
from multisoft.check import error_ratio, reference_linear_logits, reference_log_probs

WIDTHS = {2: (9, 14), 3: (10, 0, 13)}   # uneven slices of 23 classes; a rank of three holds none


def _close(actual, expected, magnitude=None):
    _, ratio = error_ratio(actual, expected, torch.float32, magnitude)
    assert ratio <= 1.0, f"{ratio:.3g} x the float32 tolerance"


def _equal(actual, expected):
    assert actual == expected, f"{actual} != {expected}"


def _cases(report, ranks, backend):
    import multisoft

    group, columns = ranks.group, slice(ranks.start, ranks.start + ranks.width)
    widths = ranks.widths
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
    for temperature, softcap in ((1.0, None), (0.7, 9.0)):
        label = f"{len(widths)} ranks T={temperature} softcap={softcap} backend={backend}"
        options = dict(temperature=temperature, softcap=softcap)
        full = logits.double().requires_grad_()
        expected, expected_entropy = reference_log_probs(full, target, return_entropy=True, **options)
        (expected_grad,) = torch.autograd.grad((expected * grad_ids.double()).sum()
                                               + (expected_entropy * grad_entropy.double()).sum(), full)
        size = full.detach().abs().amax(-1, keepdim=True) / temperature + 1.0
        # on logits
        local = logits[..., columns].clone().requires_grad_()
        calls.clear()
        with counting_collectives(calls):
            picked, entropy = multisoft.log_probs(local, target, return_entropy=True, backend=backend,
                                                  process_group=group, **options)
            forward_calls = list(calls)
            torch.autograd.backward((picked, entropy), (grad_ids, grad_entropy))
        # the slice's widths, then the statistics; nothing in the backward
        report(f"log_probs collectives, {label}", _equal, (len(forward_calls), len(calls)), (2, 2))
        report(f"log_probs, {label}", _close, picked, expected, expected.abs() + size)
        report(f"entropy, {label}", _close, entropy, expected_entropy, expected_entropy.abs() + size.squeeze(-1))
        report(f"gradient, {label}", _close, local.grad, expected_grad[..., columns],
               expected_grad[..., columns].abs() + 1e-3)
        # fused with the output layer, in chunks of 3 rows
        leaves = [t.clone().requires_grad_() for t in (x, weight[columns], bias[columns])]
        calls.clear()
        with counting_collectives(calls):
            picked, entropy = multisoft.linear_log_probs(leaves[0], leaves[1], target, linear_bias=leaves[2],
                                                         return_entropy=True, chunk_size=3, backend=backend,
                                                         process_group=group, **options)
            forward_calls = list(calls)
            torch.autograd.backward((picked, entropy), (grad_ids, grad_entropy))
        chunks = -(-10 // 3)  # the widths, a gather a chunk; then one all-reduce of the input's gradient
        report(f"linear_log_probs collectives, {label}", _equal,
               (len(forward_calls), all(name in GATHERS for name in forward_calls), calls[len(forward_calls):]),
               (1 + chunks, True, ["all_reduce"]))
        float64_leaves, float64_logits = reference_linear_logits(x, weight, bias)
        expected, expected_entropy = reference_log_probs(float64_logits, target.reshape(10, 2), return_entropy=True,
                                                         **options)
        expected_grads = torch.autograd.grad((expected * grad_ids.reshape(10, 2).double()).sum()
                                             + (expected_entropy * grad_entropy.reshape(10).double()).sum(),
                                             float64_leaves)
        report(f"linear log_probs, {label}", _close, picked.reshape(10, 2), expected,
               expected.abs() + size.reshape(10, 1))
        for name, grad, want in zip(("input", "weight", "bias"), (t.grad for t in leaves),
                                    (expected_grads[0], expected_grads[1][columns], expected_grads[2][columns])):
            report(f"linear {name} gradient, {label}", _close, grad, want, want.abs() + 1e-3)


def _worker(rank, world, rendezvous, plan):
    join_group(rank, world, rendezvous, plan)
    report = Report(rank)
    ranks = Ranks(dist.group.WORLD, WIDTHS[world])
    for backend in plan["backends"]:
        _cases(report, ranks, backend)
    dist.destroy_process_group()
    report.raise_failures()
    exit_at_once()


@pytest.mark.parametrize("world", [2, 3])
def test_gloo_matches_the_unsplit_call(tmp_path, world):
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    spawn(_worker, tmp_path, world, dict(distributed_backend="gloo", device="cpu", timeout_s=120,
                                         backends=("torch", "reference")))
