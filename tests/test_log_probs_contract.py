"""The ``log_probs`` kernels of every backend that implements them (backends/README.md, ``log_probs.py``), called
directly as the front calls them: the forward's row statistics, the backward's gradient from them and the incoming
gradients, against float64 (multisoft/check.py's ``reference_log_probs`` and its autograd), nothing written or read
out of bounds, and a row's results bitwise the same whatever the batch around it.

Shapes stay small where the Triton interpreter or numba's simulator runs them (``simulated``).
"""

from __future__ import annotations

import zlib

import pytest
import torch

from harness import DEVICE, assert_close, on_backends_implementing, simulated
from multisoft import LossOptions
from multisoft._registry import get_backend
from multisoft.check import DTYPES, reference_log_probs, reference_log_probs_gradient

each_dtype = pytest.mark.parametrize("dtype", DTYPES, ids=str)
NAN, INF = float("nan"), float("inf")
GUARD = 8
OUTPUT_SENTINEL = -777.0
ID_SENTINEL = 2**30 + 7
# (classes, softcap, temperature): a row narrower than a warp, tiles with a ragged end, and rows a kernel loops over
CASES = [(1, 0.0, 1.0), (5, 0.0, 0.7), (64, 20.0, 1.0), (257, 0.0, 1.7), (1000, 15.0, 0.6)]
GPU_CASES = [(4099, 0.0, 1.3), (70000, 30.0, 0.9)]


def _cases(backend):
    return CASES if simulated(backend) else CASES + GPU_CASES


def _seeded(*key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def _logits(rows, classes, dtype, key, minus_infinity=True):
    """Rows of spread-out logits on the test device; with ``minus_infinity`` some -inf (masked classes) in row 0."""
    generator = _seeded("logits", rows, classes, str(dtype), key)
    x = (torch.randn(rows, classes, generator=generator) * 3.0).to(dtype)
    if minus_infinity and classes > 2:
        x[0, 1::3] = -INF
    return x.to(DEVICE)


def _guarded(values=None, shape=None, dtype=None, fill=NAN, sentinel=OUTPUT_SENTINEL):
    """(buffer, view): the view inside GUARD sentinels either side, holding ``values`` or ``fill``."""
    if values is not None:
        shape, dtype = values.shape, values.dtype
    numel = int(torch.Size(shape).numel())
    buffer = torch.full((2 * GUARD + numel,), sentinel, dtype=dtype, device=DEVICE)
    view = buffer[GUARD:GUARD + numel].view(shape)
    if values is not None:
        view.copy_(values)
    else:
        view.fill_(fill)
    return buffer, view


def _assert_guards(buffer, sentinel, what):
    ends = torch.cat((buffer[:GUARD], buffer[-GUARD:])).cpu()
    same = (ends == sentinel) | (ends.isnan() & torch.tensor(sentinel != sentinel))
    assert same.all(), f"{what}: written or changed outside its elements: {ends.tolist()}"


def _kernels(backend):
    return get_backend(backend).kernels("log_probs")


def _skip_unless_runs(backend, dtype):
    reason = get_backend(backend).unavailable_reason(DEVICE, dtype)
    if reason is not None:
        pytest.skip(f"{backend} cannot run {dtype} on {DEVICE}: {reason}")


def _stats_dtype(dtype):
    return torch.promote_types(dtype, torch.float32)


def _forward(backend, logits, options):
    """The kernel's (3, M) row statistics, its inputs and outputs guarded by sentinels."""
    input_buffer, x = _guarded(logits, sentinel=NAN)
    before = input_buffer.clone()
    stats_buffer, row_stats = _guarded(shape=(3, logits.shape[0]), dtype=_stats_dtype(logits.dtype))
    _kernels(backend).forward(x, row_stats, options)
    assert torch.equal(input_buffer.isnan(), before.isnan()) and torch.equal(
        input_buffer.nan_to_num(), before.nan_to_num()), "the forward wrote into the logits"
    _assert_guards(stats_buffer, OUTPUT_SENTINEL, "row_stats")
    return row_stats.clone()


def _derived(row_stats):
    """(lse, entropy) as the front takes them from (m, S, E)."""
    row_max, row_sum, spread = row_stats.double()
    log_sum = row_sum.log()
    return row_max + log_sum, log_sum - spread


@on_backends_implementing("log_probs")
@each_dtype
def test_forward_statistics(backend, dtype):
    """lse = m + log S and the entropy log S - E against float64, for every case (masked classes included)."""
    _skip_unless_runs(backend, dtype)
    for classes, softcap, temperature in _cases(backend):
        logits = _logits(6, classes, dtype, "forward")
        options = LossOptions(softcap=softcap, temperature=temperature)
        lse, entropy = _derived(_forward(backend, logits, options))
        capped = softcap * torch.tanh(logits.double() / softcap) if softcap else logits.double()
        u = capped / temperature
        expected_lse = torch.logsumexp(u, -1)
        _, expected_entropy = reference_log_probs(logits, torch.zeros(6, dtype=torch.long, device=DEVICE),
                                                  softcap=softcap or None, temperature=temperature,
                                                  return_entropy=True)
        label = f"{classes} classes softcap={softcap} temperature={temperature}"
        assert_close(lse, expected_lse, dtype, f"lse, {label}")
        # the entropy is log S - E: float32 promises a relative error of those terms, not of their difference
        magnitude = expected_lse.abs() + (expected_lse - expected_entropy).abs()
        assert_close(entropy, expected_entropy, dtype, f"entropy, {label}", magnitude)


@on_backends_implementing("log_probs")
@each_dtype
@pytest.mark.parametrize("ids_a_row", [1, 3])
@pytest.mark.parametrize("in_place", [False, True], ids=["out", "in_place"])
def test_backward_gradient(backend, dtype, ids_a_row, in_place):
    """The gradient of any incoming gradients of K log-probabilities a row (duplicates and ignored ids among them)
    and of the entropy, from the forward's statistics, against float64 autograd; in place of the logits too."""
    _skip_unless_runs(backend, dtype)
    rows = 6
    for classes, softcap, temperature in _cases(backend):
        logits = _logits(rows, classes, dtype, "backward")
        options = LossOptions(softcap=softcap, temperature=temperature)
        row_stats = _forward(backend, logits, options)
        generator = _seeded("ids", classes, ids_a_row)
        ids = torch.randint(0, classes, (rows, ids_a_row), generator=generator)
        ids[1, 0] = -1                       # an ignored id
        if ids_a_row > 1:
            ids[2, 1] = ids[2, 0]            # the same id twice in a row
        if classes > 2:
            ids[0, 0] = 1                    # a masked (-inf) class, as a sampled id never is but a caller may pass
        grad_ids = torch.randn(rows, ids_a_row, generator=generator).where(ids >= 0, 0.0)
        grad_entropy = torch.randn(rows, generator=generator)
        ids, grad_ids, grad_entropy = ids.to(DEVICE), grad_ids.to(DEVICE), grad_entropy.to(DEVICE)
        compute = _stats_dtype(dtype)
        coefficients = torch.stack((grad_ids.sum(-1), grad_entropy)).to(compute)
        id_buffer, id_view = _guarded(ids, sentinel=ID_SENTINEL)
        if in_place:
            grad_buffer, grad = _guarded(logits)
            x = grad
        else:
            input_buffer, x = _guarded(logits, sentinel=NAN)
            before = input_buffer.clone()
            grad_buffer, grad = _guarded(shape=logits.shape, dtype=dtype)
        _kernels(backend).backward(x, id_view, row_stats, grad_ids.to(compute).contiguous(), coefficients, grad,
                                   options)
        _assert_guards(grad_buffer, OUTPUT_SENTINEL, "grad_logits")
        _assert_guards(id_buffer, ID_SENTINEL, "target")
        if not in_place:
            assert torch.equal(input_buffer.nan_to_num(), before.nan_to_num()), "the backward wrote into the logits"
        expected, size = reference_log_probs_gradient(logits, ids, grad_ids, grad_entropy, ignore_index=-1,
                                                      softcap=softcap or None, temperature=temperature)
        label = f"{classes} classes softcap={softcap} temperature={temperature} K={ids_a_row} in_place={in_place}"
        assert not grad.isnan().any(), f"NaN in the gradient, {label}"
        if classes > 2:
            masked = torch.zeros(classes, dtype=torch.bool, device=DEVICE)
            masked[1::3] = True
            masked[ids[0].clamp(min=0)] = False  # row 0's ids: their gradient is the incoming one
            assert (grad[0][masked] == 0).all(), f"a -inf logit's gradient is not 0, {label}"
        assert_close(grad, expected, dtype, f"gradient, {label}", size)


@on_backends_implementing("log_probs")
@each_dtype
def test_a_nan_reaches_the_row(backend, dtype):
    """A NaN logit makes its row's lse and entropy NaN, and only its row's."""
    _skip_unless_runs(backend, dtype)
    for classes, softcap, temperature in _cases(backend)[1:]:
        logits = _logits(3, classes, dtype, "nan", minus_infinity=False)
        logits[1, classes // 2] = NAN
        lse, entropy = _derived(_forward(backend, logits, LossOptions(softcap=softcap, temperature=temperature)))
        assert lse[1].isnan() or entropy[1].isnan(), f"{classes} classes: a NaN logit gave {lse[1]}, {entropy[1]}"
        assert not lse[[0, 2]].isnan().any() and not entropy[[0, 2]].isnan().any()


@on_backends_implementing("log_probs")
@each_dtype
def test_rows_are_the_same_whatever_the_batch(backend, dtype):
    """A row's statistics and gradient are bitwise the same alone, among other rows, and at another position of a
    batch of another size (backends/README.md: no launch parameter that changes a row's arithmetic depends on M)."""
    if backend in ("torch", "reference"):
        pytest.skip(f"{backend}: torch's own reductions choose their order from the tensor's shape")
    _skip_unless_runs(backend, dtype)
    for classes, softcap, temperature in _cases(backend):
        options = LossOptions(softcap=softcap, temperature=temperature)
        batch = _logits(37 if simulated(backend) else 1031, classes, dtype, "batch", minus_infinity=False)
        row = batch[5:6].clone()
        other = _logits(9, classes, dtype, "other", minus_infinity=False)
        other[7] = row[0]
        grads = []
        for logits, index in ((batch, 5), (row, 0), (other, 7)):
            row_stats = _forward(backend, logits, options)
            ids = torch.zeros(logits.shape[0], 1, dtype=torch.long, device=DEVICE)
            ids[index, 0] = classes // 2
            grad_ids = torch.zeros(logits.shape[0], 1, device=DEVICE, dtype=row_stats.dtype)
            grad_ids[index, 0] = 0.75
            coefficients = torch.zeros(2, logits.shape[0], device=DEVICE, dtype=row_stats.dtype)
            coefficients[:, index] = torch.tensor([0.75, -0.5])
            grad = torch.empty_like(logits)
            _kernels(backend).backward(logits, ids, row_stats, grad_ids, coefficients, grad, options)
            grads.append((row_stats[:, index].clone(), grad[index].clone()))
        label = f"{classes} classes softcap={softcap} temperature={temperature}"
        for (stats, grad), where in zip(grads[1:], ("alone", "at row 7 of 9")):
            assert torch.equal(stats, grads[0][0]), f"row statistics differ {where}, {label}"
            assert torch.equal(grad, grads[0][1]), f"gradient differs {where}, {label}"
