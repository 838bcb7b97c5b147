"""What the agreement tests run on: the device, the backends available there (`on_each_backend`), tolerances,
references.

A backend joins the harness by being installed and able to run on the test
device: no test code names it.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import pytest
import torch

import multisoft
from multisoft import LossOptions
from multisoft.check import TOLERANCES, error_ratio, reference_cross_entropy

DEVICE = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
ON_GPU = DEVICE.type == "cuda"
SELECTION_VARIABLE = "MULTISOFT_TEST_BACKENDS"
NATIVE_ON_CPU = ("torch", "reference")  # torch's own ops: neither interpreted nor simulated on the CPU


def backends_under_test() -> list[str]:
    """Every installed backend that can run on DEVICE (those chosen only by name, such as ``reference``, too), or
    those of them that $MULTISOFT_TEST_BACKENDS lists; a name there that is not installed, or a list of which
    none can run here, is a ValueError rather than a run that tests nothing."""
    installed = multisoft.backends(DEVICE)
    only = [n.strip() for n in os.environ.get(SELECTION_VARIABLE, "").split(",") if n.strip()]
    unknown = [n for n in only if n not in {b.name for b in installed}]
    if unknown:
        raise ValueError(f"{SELECTION_VARIABLE} names {', '.join(map(repr, unknown))}, not an installed backend; "
                         f"installed: {', '.join(b.name for b in installed)}")
    names = [b.name for b in installed if b.available and (not only or b.name in only)]
    if only and not names:
        reasons = "; ".join(f"{b.name}: {b.unavailable_reason}" for b in installed if b.name in only)
        raise ValueError(f"no backend that {SELECTION_VARIABLE}={','.join(only)!r} lists can run on {DEVICE} "
                         f"({reasons})")
    return names


BACKENDS = backends_under_test()
on_each_backend = pytest.mark.parametrize("backend", BACKENDS)  # the one parametrization over the backends


def backend_params(backends: list[str], *ops: str) -> list:
    """``backends`` as pytest parameters, each one that does not implement all of ``ops`` (of
    ``multisoft._registry.OPS``) marked skipped with the ops it lacks: a backend may implement a subset."""
    implements = {b.name: b.ops for b in multisoft.backends(DEVICE)}
    params = []
    for name in backends:
        lacking = [op for op in ops if op not in implements[name]]
        reason = f"backend {name!r} does not implement {', '.join(lacking)}"
        params.append(pytest.param(name, marks=pytest.mark.skip(reason=reason)) if lacking else name)
    return params


def on_backends_implementing(*ops):
    """Parametrize ``backend`` over BACKENDS; one that does not implement each of ``ops`` is skipped, saying so."""
    return pytest.mark.parametrize("backend", backend_params(BACKENDS, *ops))


def simulated(backend: str) -> bool:
    """True when ``backend`` runs on the CPU under an interpreter or simulator: keep shapes small."""
    return not ON_GPU and backend not in NATIVE_ON_CPU


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str,
                 magnitude: torch.Tensor | None = None) -> None:
    """Elementwise |actual - expected| <= atol + rtol * magnitude (default |expected|), the dtype's tolerances."""
    max_error, ratio = error_ratio(actual, expected, dtype, magnitude)
    atol, rtol = TOLERANCES[dtype]
    assert ratio <= 1.0, f"{what}: max error {max_error:.3g} is {ratio:.3g} x the tolerance (atol={atol}, rtol={rtol})"


def float16_gradient_error_ratio(actual: torch.Tensor, expected: torch.Tensor, logits: torch.Tensor) -> float:
    """The largest |actual - expected| over its bound, for a float16 cross-entropy gradient against float64: float16's
    rtol (2e-3) * |expected| + two subnormal steps (2**-23) + half a float32 step of the row's largest |logit|
    (2**-24 * max |x| over the row of ``logits``, whole rows even where ``actual`` is a slice of their classes):
    a kernel computes p = exp(x - lse) in float32, and at the target p - 1, near 0 for a confident row, keeps the
    rounding of the lse (torch's own op computed in float32 reaches 0.3 of this bound, in float16 300 times it)."""
    lse_rounding = 2.0 ** -24 * logits.detach().double().abs().amax(-1, keepdim=True)
    bound = 2e-3 * expected.abs() + 2.0 ** -23 + lse_rounding
    return ((actual.double() - expected).abs() / bound).max().item()


def activation(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(leaf, logits): a leaf that requires grad holding ``values``, and a copy of it that is an activation, as a
    model's logits are (``inplace_backward=True`` refuses a leaf that requires grad, as torch refuses an in-place
    op there). A gradient written into the logits reaches ``leaf.grad`` through clone's backward without a copy."""
    leaf = values.detach().clone().requires_grad_(True)
    return leaf, leaf.clone()


class CrossEntropyRows(NamedTuple):
    """What a backend's cross_entropy ``forward`` writes, in float64 (see ``cross_entropy_contract``)."""
    loss: torch.Tensor
    lse: torch.Tensor
    row_weight: torch.Tensor
    grad: torch.Tensor
    magnitude: torch.Tensor


def cross_entropy_contract(logits, target, weight=None, grad_scale=None,
                           options: LossOptions = LossOptions()) -> CrossEntropyRows:
    """The tests' one float64 oracle of the backends' cross_entropy ``forward`` (backends/README.md), row by row,
    on the logits' device: (loss, lse, row_weight, grad, magnitude), under ``options``, the record the kernel
    takes (its ``reduction`` plays no part: the kernels write per-row values).

    A row whose target is in [0, C): loss and lse are ``multisoft.check.reference_cross_entropy`` (reduction
    "none", the capped logits, the z-loss), grad is ``grad_scale[i]`` (1 without) times torch's float64 gradient
    of that loss, row_weight is w[t]. A row whose target is ``ignore_index``: loss 0, row_weight 0, gradient 0. A
    target outside [0, C) otherwise: loss and gradient NaN, row_weight NaN (the contract leaves it open). lse is
    every row's logsumexp of the capped logits. magnitude is the size of the gradient's terms,
    ``|grad_scale| |du/dx| (p_j |(1 - eps) w[t] + eps / C W + 2 s lse| + (1 - eps) w[t] [j == t] + eps / C w_j)``,
    the bound ``assert_close`` takes for a difference of terms."""
    ignore_index, label_smoothing = options.ignore_index, options.label_smoothing
    softcap, lse_square_scale = options.softcap, options.lse_square_scale
    x = logits.detach().double()
    rows, classes = x.shape
    target = target.to(x.device).long()
    weight = None if weight is None else weight.to(x)
    w = torch.ones(classes, dtype=torch.float64, device=x.device) if weight is None else weight.double()
    scale = torch.ones(rows, dtype=torch.float64, device=x.device) if grad_scale is None else grad_scale.to(x)
    ignored = target == ignore_index
    valid = ~ignored & (target >= 0) & (target < classes)
    nan = float("nan")
    reference_options = dict(weight=weight, ignore_index=ignore_index, reduction="none",
                             label_smoothing=label_smoothing, softcap=softcap or None,
                             lse_square_scale=lse_square_scale)
    x_valid = x[valid].requires_grad_()
    loss_valid = reference_cross_entropy(x_valid, target[valid], **reference_options)
    loss = torch.full((rows,), nan, dtype=torch.float64, device=x.device)
    loss[ignored] = 0.0
    loss[valid] = loss_valid.detach()
    grad = torch.full_like(x, nan)
    grad[ignored] = 0.0
    if valid.any():
        (grad[valid],) = torch.autograd.grad(loss_valid, x_valid, scale[valid])
    u = softcap * torch.tanh(x / softcap) if softcap else x
    lse = torch.logsumexp(u, 1)
    t = torch.where(valid, target, 0)
    w_t = torch.where(valid, w[t], 0.0)
    row_weight = torch.where(ignored, 0.0, torch.where(valid, w_t, nan))
    eps = label_smoothing
    coefficient = (1 - eps) * w_t + eps / classes * w.sum() + 2 * lse_square_scale * lse
    is_target = torch.nn.functional.one_hot(t, classes).double()
    terms = torch.softmax(u, 1) * coefficient.abs()[:, None] + (1 - eps) * w_t[:, None] * is_target + eps / classes * w
    du_dx = 1 - (u / softcap) ** 2 if softcap else torch.ones_like(u)
    return CrossEntropyRows(loss, lse, row_weight, grad, scale.abs()[:, None] * terms * du_dx.abs())


class RowStats(NamedTuple):
    """What a backend's cross_entropy ``forward`` writes into ``row_stats``, in float64 (see ``row_stats_contract``)."""
    m: torch.Tensor
    total: torch.Tensor
    weighted_sum: torch.Tensor
    weighted_sum_magnitude: torch.Tensor
    summed: bool


def row_stats_contract(logits, weight=None, options: LossOptions = LossOptions()) -> RowStats:
    """The tests' one float64 oracle of ``forward``'s ``row_stats`` (backends/README.md), computed from the inputs
    alone, on the logits' device, for every row whatever its target: (m, S, sum_j w_j u_j, the size of that sum's
    terms, whether the kernel sums it).

    u is the capped logits (``options.softcap``), m each row's max of u, S = sum_j exp(u_j - m), 0 for a row of
    -inf (m = -inf: nothing to add where the front combines the slices' statistics), NaN for a row holding a NaN.
    sum_j w_j u_j (w the weight or ones) only under label smoothing; without, the contract's 0 (``summed``
    False). ``weighted_sum_magnitude`` is sum_j |w_j u_j|, the bound ``assert_row_stats`` takes for that sum."""
    x = logits.detach().double()
    softcap = options.softcap
    u = softcap * torch.tanh(x / softcap) if softcap else x
    m = u.max(1).values
    total = torch.exp(u - torch.where(m == -float("inf"), 0.0, m)[:, None]).sum(1)
    w = torch.ones(u.shape[1], dtype=torch.float64, device=u.device) if weight is None else weight.to(u)
    summed = options.label_smoothing != 0.0
    weighted = (w * u).sum(1) if summed else torch.zeros_like(m)
    magnitude = (w * u).abs().sum(1) if summed else torch.zeros_like(m)
    return RowStats(m, total, weighted, magnitude, summed)


def assert_row_stats(row_stats: torch.Tensor, expected: RowStats, what: str) -> None:
    """The one bound of ``row_stats`` (3, M) against ``row_stats_contract``, at float32's tolerances (the
    statistics are float32 whatever the logits' dtype):

    - m within the tolerance of |m|: it is one of the capped logits (exact without a cap, tanh's rounding with);
    - S within the tolerance of S: a sum of positive terms, so float32 accumulation keeps a relative error;
    - sum_j w_j u_j, under label smoothing, within the tolerance of sum_j |w_j u_j|: its terms have either sign, and
      float arithmetic promises a relative error of the terms, not of what is left after they cancel; without
      label smoothing exactly 0, as the contract says (nothing is summed, so nothing may be off).

    Equal infinities and NaNs match (``assert_close``)."""
    assert_close(row_stats[0], expected.m, torch.float32, f"{what}: m")
    assert_close(row_stats[1], expected.total, torch.float32, f"{what}: S")
    if expected.summed:
        assert_close(row_stats[2], expected.weighted_sum, torch.float32, f"{what}: sum w * u",
                     expected.weighted_sum_magnitude)
    else:
        zeros = torch.zeros_like(row_stats[2])
        assert torch.equal(row_stats[2], zeros), f"{what}: sum w * u is 0 without label smoothing: {row_stats[2]}"
