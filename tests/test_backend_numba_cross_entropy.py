"""The numba backend's cross-entropy kernels called directly, what tests/test_contract.py does not check: the
gradient rows of invalid targets and the row statistics on each forward path (tuned: rows held in registers while
the gradient is written, "cached"; looping: rows read and re-read a few elements a thread a step; the paths are
tests/kernel_paths.py's, on which tests/test_contract.py checks the rest of the contract), the gradient of a slice
over several blocks, scale, and rows of a vocabulary's size on a GPU; against the float64 oracles of the backend
contract (backends/README.md) in tests/harness.py, float32 and bfloat16."""

from __future__ import annotations

import importlib.util

import pytest
import torch

import multisoft_numba
from harness import DEVICE, ON_GPU, assert_close, assert_row_stats, cross_entropy_contract, row_stats_contract
from kernel_paths import force, paths
from multisoft import LossOptions
from multisoft.check import reference_slice_gradient

HAVE_NUMBA_CUDA = importlib.util.find_spec("numba_cuda") is not None
pytestmark = pytest.mark.skipif(not HAVE_NUMBA_CUDA or not (ON_GPU or multisoft_numba.simulated()),
                                reason="needs numba-cuda and a CUDA device or the simulator (NUMBA_ENABLE_CUDASIM=1)")

DTYPES = [torch.float32, torch.bfloat16]
PATHS = list(paths("numba"))   # tuned (cached, for these rows, with a gradient) and looping
# (classes, unaligned data, weighted, options): rows read in vectors, one element at a time (odd row length; data
# one element past an aligned address), and every option at once.
CASES = {
    "plain": (40, True, False, LossOptions(label_smoothing=0.0, softcap=0.0, lse_square_scale=0.0)),
    "weight_smoothing": (37, False, True, LossOptions(label_smoothing=0.1, softcap=0.0, lse_square_scale=0.0)),
    "everything": (40, False, True, LossOptions(label_smoothing=0.2, softcap=3.0, lse_square_scale=1e-2)),
}


def _inputs(classes, unaligned, weighted, dtype, rows=5):
    logits = (torch.randn(rows, classes, device=DEVICE) * 3).to(dtype)
    if unaligned:   # the same values one element past an aligned address
        logits = torch.empty(rows * classes + 1, dtype=dtype, device=DEVICE)[1:].view(rows, classes).copy_(logits)
    target = torch.tensor([3, -100, classes - 1, 0, 7][:rows], device=DEVICE)
    weight = torch.rand(classes, device=DEVICE) + 0.5 if weighted else None
    return logits, target, weight


def _outputs(rows):
    return tuple(torch.full((rows,), 7.0, device=DEVICE) for _ in range(3))


def _run(logits, target, weight, grad_logits, grad_scale, options):
    """The numba forward under ``options`` (a LossOptions) into fresh per-row outputs: (loss, lse, row_weight)."""
    from multisoft_numba import cross_entropy
    loss, lse, row_weight = _outputs(logits.shape[0])
    cross_entropy.forward(logits, target, weight, loss, lse, row_weight, grad_logits, grad_scale, options)
    return loss, lse, row_weight


def _assert_agrees(got, expected, dtype, what):
    loss, lse, row_weight, grad = got
    loss64, lse64, row_weight64, grad64, magnitude = expected
    assert_close(loss, loss64, torch.float32, f"{what}: loss")
    assert_close(lse, lse64, torch.float32, f"{what}: lse")
    known = ~torch.isnan(row_weight64)
    assert_close(row_weight[known], row_weight64[known], torch.float32, f"{what}: row_weight")
    if grad is not None:
        assert_close(grad, grad64, dtype, f"{what}: grad_logits", magnitude)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_invalid_targets_give_nan_gradient_rows(dtype, path, monkeypatch):
    """Targets past either end (not ignore_index, here the class 2): numba writes NaN into their gradient rows, as
    into their losses; the contract leaves those rows open (NaN preferred), and tests/test_contract.py checks the
    rest of such a call on each path (the other rows, nothing written out of bounds)."""
    assert_took = force(monkeypatch, "numba", path)
    rows, classes = 7, 37
    logits = torch.randn(rows, classes, device=DEVICE).to(dtype)
    grad = torch.full_like(logits, 7.0)
    target = torch.tensor([3, classes, -1, 5, 2**40, -(2**40), 2], device=DEVICE)   # ignore_index 2
    options = LossOptions(ignore_index=2, label_smoothing=0.1, softcap=0.0, lse_square_scale=1e-2)
    loss, _, _ = _run(logits, target, None, grad, torch.ones(rows, device=DEVICE), options)
    invalid = [1, 2, 4, 5]
    assert torch.isnan(loss[invalid]).all() and torch.isnan(grad[invalid]).all()
    assert torch.isfinite(grad[[0, 3]]).all() and (grad[6] == 0).all()
    assert_took()


def _gradient_like(dtype, rows=5, classes=40):
    """Gradient values with the specials a scale must carry: NaN, infinities, signed zeros, a subnormal, and a
    signalling NaN (any arithmetic on it, or a 16-bit round trip, quiets it: it shows whether an element was
    touched)."""
    grad = torch.randn(rows, classes, device=DEVICE)
    grad[0, :6] = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-40])
    grad = grad.to(dtype)
    signalling_nan = 0x7F81 if dtype == torch.bfloat16 else 0x7F800001
    _bits_view(grad)[0, 6] = signalling_nan
    return grad


def _bits_view(t):
    return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


def _bits(t):
    return _bits_view(t).clone()


def _force_several_blocks(monkeypatch):
    """Several blocks along a row, fewer blocks than rows (they walk the rows)."""
    from multisoft_numba import _tuning
    monkeypatch.setattr(_tuning, "CE_SCALE_UNROLL", 4)
    monkeypatch.setattr(_tuning, "CE_SCALE_BLOCKS_PER_SM", 2)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_scale_by_one_leaves_the_buffer_bit_identical(dtype, monkeypatch):
    from multisoft_numba import cross_entropy
    _force_several_blocks(monkeypatch)
    grad = _gradient_like(dtype)
    before = _bits(grad)
    cross_entropy.scale(grad, torch.ones(1, device=DEVICE))
    assert torch.equal(_bits(grad), before)
    cross_entropy.scale(grad, torch.ones(grad.shape[0], device=DEVICE))
    assert torch.equal(_bits(grad), before)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")   # the simulator's 0 * inf
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_scale_by_one_factor_and_by_a_factor_a_row(dtype, monkeypatch):
    """One factor for every row, a factor a row (one of them 1, one 0, and inf on the row that holds zeros: 0 * inf
    gives NaN), a stride-0 broadcast of one factor to every row, and NaN; against float64."""
    from multisoft_numba import cross_entropy
    _force_several_blocks(monkeypatch)
    rows = 5
    factors = {
        "one": torch.full((1,), -2.5, device=DEVICE),
        "per row": torch.tensor([float("inf"), 1.0, 0.0, 3.0, -0.125], device=DEVICE),
        "broadcast": torch.full((1,), 0.75, device=DEVICE).expand(rows),
        "nan": torch.full((1,), float("nan"), device=DEVICE),
    }
    for what, factor in factors.items():
        grad = _gradient_like(dtype, rows)
        expected = grad.double() * (factor.double()[:, None] if factor.numel() == rows else factor.double())
        cross_entropy.scale(grad, factor)
        assert_close(grad, expected, dtype, f"scale by {what}")
    assert torch.isnan(grad).all()


@pytest.mark.skipif(not ON_GPU or multisoft_numba.simulated(), reason="needs a CUDA device")
@pytest.mark.parametrize("classes", [32000, 131072, 50257])   # cached; looping in vectors; looping one at a time
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_vocabulary_sized_rows_on_the_gpu(dtype, classes):
    """Rows of a language model's vocabulary with every option: the gradient into a new buffer and in place (bit
    for bit the same), no gradient, then scale by one (untouched) and by a factor a row."""
    from multisoft_numba import cross_entropy
    _, _, _, options = CASES["everything"]
    rows = 16
    logits = (torch.randn(rows, classes, device=DEVICE) * 4).to(dtype)
    target = torch.randint(0, classes, (rows,), device=DEVICE)
    target[1] = -100
    weight = torch.rand(classes, device=DEVICE) + 0.5
    grad_scale = torch.rand(rows, device=DEVICE) + 0.5
    expected = cross_entropy_contract(logits, target, weight, grad_scale, options)
    grad = torch.empty_like(logits)
    stats = _run(logits, target, weight, grad, grad_scale, options)
    _assert_agrees((*stats, grad), expected, dtype, f"{classes} classes")
    _assert_agrees((*_run(logits, target, weight, None, None, options), None), expected, dtype, "no gradient")
    in_place = logits.clone()
    _run(in_place, target, weight, in_place, grad_scale, options)
    assert torch.equal(in_place, grad)
    before = _bits(grad)
    cross_entropy.scale(grad, torch.ones(1, device=DEVICE))
    assert torch.equal(_bits(grad), before)
    factor = torch.rand(rows, device=DEVICE) * 4 - 2
    cross_entropy.scale(grad, factor)
    factor64 = factor.double()[:, None]
    assert_close(grad, expected[3] * factor64, dtype, "scaled by a factor a row", expected[4] * factor64.abs())


# -- a slice of the classes (vocabulary-parallel): row_stats and gradient


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_row_stats_on_each_path(dtype, path, case, monkeypatch):
    """forward(..., row_stats) on each path, with and without the gradient: each row's m, S and sum w u
    (compensated; 0 without label smoothing) against float64, a NaN row among them; loss, lse, row_weight and the
    gradient bit for bit as without row_stats."""
    from multisoft_numba import cross_entropy
    assert_took = force(monkeypatch, "numba", path)
    classes, unaligned, weighted, options = CASES[case]
    logits, target, weight = _inputs(classes, unaligned, weighted, dtype)
    logits[4, 2] = float("nan")
    rows = logits.shape[0]
    grad_scale = torch.rand(rows, device=DEVICE) + 0.5
    for with_grad in (False, True):
        plain_grad, stats_grad = torch.full_like(logits, 7.0), torch.full_like(logits, 7.0)
        plain = _run(logits, target, weight, plain_grad if with_grad else None, grad_scale if with_grad else None,
                     options)
        outputs = _outputs(rows)
        row_stats = torch.full((3, rows), 12345.0, device=DEVICE)
        cross_entropy.forward(logits, target, weight, *outputs, stats_grad if with_grad else None,
                              grad_scale if with_grad else None, options, row_stats=row_stats)
        for name, value, expected in zip(("loss", "lse", "row_weight"), outputs, plain):
            torch.testing.assert_close(value, expected, rtol=0, atol=0, equal_nan=True, msg=name)
        torch.testing.assert_close(stats_grad, plain_grad, rtol=0, atol=0, equal_nan=True)
        assert_row_stats(row_stats, row_stats_contract(logits, weight, options),
                         f"row_stats, {path}, gradient {with_grad}")
        assert torch.isnan(row_stats[:2, 4]).all()
    assert_took()


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gradient_of_a_slice_over_several_blocks(dtype, case, monkeypatch):
    """gradient with 4 elements a thread and at most 4 threads a block: a row spread over several blocks (x), rows
    over blocks (y); vectors or one element at a time (unaligned, odd rows); in place and into a new buffer; the
    whole row's m and S from a wider float64 row; targets in the slice, outside it and ignore_index."""
    from multisoft_numba import _tuning, cross_entropy
    monkeypatch.setattr(_tuning, "CE_GRADIENT_UNROLL", 4)
    monkeypatch.setattr(_tuning, "CE_GRADIENT_THREADS", 4)
    classes, unaligned, weighted, options = CASES[case]
    softcap = options.softcap
    rows = 5
    wide = (torch.randn(rows, classes + 20, device=DEVICE, dtype=torch.float64) * 3).to(dtype).double()
    wide[:, -1] += 5.0
    u = softcap * torch.tanh(wide / softcap) if softcap else wide
    m = u.max(1).values
    row_max_sum = torch.stack([m, torch.exp(u - m[:, None]).sum(1)]).float()
    target = torch.tensor([0, classes - 1, -1, classes, -100], device=DEVICE)
    weight = torch.rand(classes, device=DEVICE) + 0.5 if weighted else None
    coefficients = torch.rand(3, rows, device=DEVICE) + torch.tensor([[0.5], [0.5], [0.0]], device=DEVICE)
    for in_place in (False, True):
        logits = _inputs(classes, unaligned, False, dtype)[0]
        logits.copy_(wide[:, 5:5 + classes])
        original = logits.clone()
        grad = logits if in_place else torch.full_like(logits, 7.0)
        cross_entropy.gradient(logits, target, weight, row_max_sum, coefficients, grad, LossOptions(softcap=softcap))
        expected, magnitude = reference_slice_gradient(original, target, weight, row_max_sum, coefficients, softcap)
        assert_close(grad, expected, dtype, f"gradient in_place={in_place}", magnitude)
        if not in_place:
            assert torch.equal(logits, original), "the logits changed"
