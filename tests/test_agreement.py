"""Every op, forward and backward, on every available backend, against a float64 reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import multisoft
from harness import DEVICE, ON_GPU, activation, assert_close, on_backends_implementing, simulated
from multisoft._registry import OPS
from multisoft.check import (DTYPES, reference_blocksparse, reference_blocksparse_backward, reference_cross_entropy,
                             reference_softmax, reference_softmax_backward, softmax_backward_magnitude)


def _skip_big(backend, numel, limit=300_000):
    if simulated(backend) and numel > limit:
        pytest.skip("too large for the CPU interpreter/simulator")


# -- softmax / log_softmax

SOFTMAX_SHAPES = [
    (1, 1), (3, 1), (1, 7), (5, 130), (33, 1000), (2, 4097), (2, 70_000),
    (64, 1023), (4, 32_768), (2, 131_072), (2, 262_144), (3, 1_048_576),
]


@pytest.mark.parametrize("shape", SOFTMAX_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
@on_backends_implementing("softmax")
def test_softmax(backend, log, dtype, shape):
    _skip_big(backend, shape[0] * shape[1])
    x = (torch.randn(shape, device=DEVICE) * 3).to(dtype).requires_grad_()
    op = multisoft.log_softmax if log else multisoft.softmax
    y = op(x, -1, backend=backend)
    assert y.dtype == dtype and y.shape == x.shape
    expected = reference_softmax(x, -1, log)
    assert_close(y, expected, dtype, "forward")
    dy = torch.randn(shape, device=DEVICE).to(dtype)
    (dx,) = torch.autograd.grad(y, x, dy)
    assert_close(dx, reference_softmax_backward(y, dy, -1, log), dtype, "backward",
                 softmax_backward_magnitude(y, dy, -1, log))


@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
@on_backends_implementing("softmax")
def test_softmax_non_contiguous_and_other_dims(backend, log):
    op = multisoft.log_softmax if log else multisoft.softmax
    x = torch.randn(6, 50, 9, device=DEVICE, requires_grad=True)
    for dim in (0, 1, -1):
        y = op(x, dim, backend=backend)
        assert_close(y, reference_softmax(x, dim, log), torch.float32, f"dim={dim}")
    t = torch.randn(40, 30, device=DEVICE).t()
    assert not t.is_contiguous()
    assert_close(op(t, -1, backend=backend), reference_softmax(t, -1, log), torch.float32, "transposed")
    s = torch.randn(20, 64, device=DEVICE)[:, ::2]
    assert_close(op(s, -1, backend=backend), reference_softmax(s, -1, log), torch.float32, "strided")
    dy = torch.randn(6, 50, 9, device=DEVICE)
    y = op(x, 1, backend=backend)
    (dx,) = torch.autograd.grad(y, x, dy)
    assert_close(dx, reference_softmax_backward(y, dy, 1, log), torch.float32, "backward dim=1",
                 softmax_backward_magnitude(y, dy, 1, log))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
@on_backends_implementing("softmax")
def test_softmax_infinities(backend, log, dtype):
    n = 3000
    x = torch.randn(5, n, device=DEVICE).to(dtype)
    x[0, ::3] = float("-inf")           # some entries -inf
    x[1, 1:] = float("-inf")            # one finite entry
    x[2] = float("-inf")                # all -inf: NaN, like torch
    x[3, 10] = 60000.0 if dtype == torch.float16 else 1e30  # one huge entry
    x = x.requires_grad_()
    op = multisoft.log_softmax if log else multisoft.softmax
    y = op(x, -1, backend=backend)
    assert_close(y, reference_softmax(x, -1, log), dtype, "forward")
    dy = torch.randn(5, n, device=DEVICE).to(dtype)
    (dx,) = torch.autograd.grad(y, x, dy)
    finite = [0, 1, 3, 4]
    assert_close(dx[finite], reference_softmax_backward(y, dy, -1, log)[finite], dtype, "backward",
                 softmax_backward_magnitude(y, dy, -1, log)[finite])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
@on_backends_implementing("softmax")
def test_softmax_large_offsets(backend, log, dtype):
    """Rows of x + c for large c: kernels round the shift of their exponentials (CuPy's 16-bit ones switch
    their scale at |max| = 2^20), and close neighbours, ties and all-equal rows must still come out right."""
    offsets = [300.0, -3000.0, 60000.0] + ([] if dtype == torch.float16 else [2.0**20, -(2.0**21), 1e30])
    op = multisoft.log_softmax if log else multisoft.softmax
    for n in (1000, 4096) if simulated(backend) else (1000, 4096, 70_000, 262_144):
        x = torch.randn(len(offsets), n, device=DEVICE) * 3 + torch.tensor(offsets, device=DEVICE)[:, None]
        x = x.to(dtype)
        assert_close(op(x, -1, backend=backend), reference_softmax(x, -1, log), dtype, f"{n} columns")


# -- cross_entropy

CE_CASES = {
    "1x1": dict(shape=(1, 1)),
    "1d": dict(shape=(17,)),
    "5x7": dict(shape=(5, 7)),
    "37x1000-int32": dict(shape=(37, 1000), target_dtype=torch.int32),
    "33x1000-weight-smooth": dict(shape=(33, 1000), weight=True, label_smoothing=0.1),
    "20x513-ignore": dict(shape=(20, 513), ignore=0.3),
    "20x513-ignore-idx3": dict(shape=(20, 513), ignore=0.3, ignore_index=3, weight=True),
    "8x300-all-ignored": dict(shape=(8, 300), ignore=1.0),
    "3x40x5-spatial": dict(shape=(3, 40, 5), weight=True, label_smoothing=0.2),
    "4x70000": dict(shape=(4, 70_000), label_smoothing=0.05),
    "2x131072": dict(shape=(2, 131_072), weight=True),
    "64x32000": dict(shape=(64, 32_000), ignore=0.1),
    "16x262144": dict(shape=(16, 262_144), label_smoothing=0.1),
    "smooth-1.0": dict(shape=(6, 100), label_smoothing=1.0, weight=True),
    "33x1000-softcap-z-loss-weight-smooth-ignore": dict(shape=(33, 1000), weight=True, label_smoothing=0.1,
                                                        ignore=0.2, softcap=5.0, lse_square_scale=1e-3),
    "3x40x5-spatial-softcap-z-loss": dict(shape=(3, 40, 5), softcap=3.0, lse_square_scale=1e-2),
    "2x131072-softcap": dict(shape=(2, 131_072), softcap=30.0),
}


def _ce_inputs(shape, dtype, target_dtype=torch.int64, weight=False, ignore=0.0, ignore_index=-100, **_):
    classes = shape[1] if len(shape) >= 2 else shape[0]
    logits = (torch.randn(shape, device=DEVICE) * 2).to(dtype).requires_grad_()
    target_shape = shape[:1] + shape[2:] if len(shape) >= 2 else ()
    target = torch.randint(0, classes, target_shape, device=DEVICE)
    if ignore:
        target = torch.where(torch.rand(target_shape, device=DEVICE) < ignore, ignore_index, target)
    w = torch.rand(classes, device=DEVICE) + 0.5 if weight else None
    return logits, target.to(target_dtype), w


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("case", list(CE_CASES), ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@on_backends_implementing("cross_entropy")
def test_cross_entropy(backend, dtype, case, reduction):
    spec = CE_CASES[case]
    _skip_big(backend, int(torch.tensor(spec["shape"]).prod()))
    logits, target, weight = _ce_inputs(dtype=dtype, **spec)
    kwargs = dict(weight=weight, ignore_index=spec.get("ignore_index", -100), reduction=reduction,
                  label_smoothing=spec.get("label_smoothing", 0.0), softcap=spec.get("softcap"),
                  lse_square_scale=spec.get("lse_square_scale", 0.0))
    loss = multisoft.cross_entropy(logits, target, backend=backend, **kwargs)
    logits64 = logits.detach().double().requires_grad_()
    expected = reference_cross_entropy(logits64, target, **kwargs)
    assert loss.dtype == torch.promote_types(dtype, torch.float32), "the loss of 16-bit logits is float32"
    assert_close(loss, expected, dtype, "loss")
    grad_out = (torch.rand_like(expected) + 0.5).to(loss.dtype)
    (grad,) = torch.autograd.grad(loss, logits, grad_out)
    (grad_expected,) = torch.autograd.grad(expected, logits64, grad_out.double())
    assert_close(grad, grad_expected, dtype, "gradient")


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@on_backends_implementing("cross_entropy")
def test_cross_entropy_inplace_backward(backend, dtype, reduction):
    """The forward writes the gradient into the logits (bumping their version); the backward scales it there by
    the incoming gradient, and it becomes the logits' .grad without a copy. A float16 mean's forward writes the
    gradient times the mean's denominator, which the backward divides out (multisoft._loss_rules.folds_mean)."""
    logits, target, weight = _ce_inputs((24, 3000), dtype, weight=True, ignore=0.2)
    kwargs = dict(weight=weight, label_smoothing=0.1, reduction=reduction, softcap=20.0, lse_square_scale=1e-3)
    expected_logits = logits.detach().double().requires_grad_()
    expected = reference_cross_entropy(expected_logits, target, **kwargs)
    expected.sum().backward()
    leaf, buffer = activation(logits)
    version = buffer._version
    loss = multisoft.cross_entropy(buffer, target, backend=backend, inplace_backward=True, **kwargs)
    assert_close(loss, expected, dtype, "loss")
    assert buffer._version > version, "the forward's write must bump the logits' version"
    written = expected_logits.grad
    if dtype == torch.float16 and reduction == "mean":
        written = written * (weight[target.clamp(min=0)] * (target != -100)).sum().double()
    assert_close(buffer.detach(), written, dtype, "the gradient the forward wrote into the logits")
    loss.sum().backward()
    assert_close(leaf.grad, expected_logits.grad, dtype, "gradient")
    assert leaf.grad.data_ptr() == buffer.data_ptr(), "the gradient must live in the logits buffer"
    # a non-unit incoming gradient scales the gradient
    leaf, buffer = activation(logits)
    (3.0 * multisoft.cross_entropy(buffer, target, backend=backend, inplace_backward=True, **kwargs)).sum().backward()
    assert_close(leaf.grad, 3.0 * expected_logits.grad, dtype, "gradient x3")


@on_backends_implementing("cross_entropy")
def test_cross_entropy_invalid_targets_never_read_out_of_bounds(backend, targets_unchecked_on_the_cpu):
    """Targets outside [0, C) give their row a NaN loss, read in bounds; the other rows are right (on the CPU,
    beneath the front's IndexError)."""
    classes = 1000
    logits = torch.randn(6, classes, device=DEVICE, requires_grad=True)
    target = torch.tensor([0, classes, -1, 10**9, -(10**9), 5], device=DEVICE)
    loss = multisoft.cross_entropy(logits, target, reduction="none", backend=backend)
    loss.sum().backward()
    if ON_GPU:
        torch.cuda.synchronize()
    assert torch.isnan(loss[1:5]).all(), loss
    valid = torch.tensor([0, 5])
    expected = reference_cross_entropy(logits[valid].detach(), target[valid], reduction="none")
    assert_close(loss[valid], expected, torch.float32, "valid rows")


@pytest.mark.skipif(ON_GPU, reason="targets on the CPU only: on a GPU checking them would synchronise")
@on_backends_implementing("cross_entropy")
def test_cross_entropy_targets_outside_the_classes_on_the_cpu_raise_as_torchs(backend):
    """On the CPU a class-index target outside [0, C) that is not ignore_index raises torch's IndexError, before
    any kernel runs, for cross_entropy, linear_cross_entropy and the nn module, whatever the reduction; one equal
    to ignore_index does not."""
    logits = torch.randn(3, 5, requires_grad=True)
    for bad in (5, -1, 10**9):
        target = torch.tensor([0, bad, -100])
        with pytest.raises(IndexError) as torchs:
            F.cross_entropy(logits, target)
        for reduction in ("mean", "none"):
            with pytest.raises(IndexError, match=f"^{torchs.value}$"):
                multisoft.cross_entropy(logits, target, reduction=reduction, backend=backend)
            with pytest.raises(IndexError, match=f"^{torchs.value}$"):
                multisoft.linear_cross_entropy(torch.randn(3, 4), torch.randn(5, 4), target, reduction=reduction,
                                               backend=backend)
        with pytest.raises(IndexError, match=f"^{torchs.value}$"):
            multisoft.nn.CrossEntropyLoss(backend=backend)(logits, target.int())
    assert multisoft.cross_entropy(logits, torch.tensor([0, 7, 1]), ignore_index=7, backend=backend).isfinite()


# -- a NaN anywhere in a row

NAN_SHAPES = [(37, 37), (16, 1000), (4, 70_000)]


def _nan_rows(shape, dtype) -> torch.Tensor:
    """Random rows; every other row holds one NaN, its column moving across the row from one such row to the
    next (so that it lands in a different thread's share, beside values, padding or nothing else); the last row
    is -inf but for one NaN."""
    rows, cols = shape
    x = torch.randn(shape, device=DEVICE) * 3
    nan_rows = torch.arange(0, rows - 1, 2)
    x[nan_rows, (nan_rows * 7919 + nan_rows // 2) % cols] = float("nan")
    x[-1] = -float("inf")
    x[-1, cols // 3] = float("nan")
    return x.to(dtype)


@pytest.mark.parametrize("shape", NAN_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@on_backends_implementing("softmax", "cross_entropy")
def test_a_nan_anywhere_in_a_row_makes_the_row_nan(backend, dtype, shape):
    """softmax, log_softmax and cross-entropy (loss and gradient) of a row holding a NaN are NaN throughout, as
    torch's are, wherever in the row the NaN sits; the other rows are unharmed."""
    _skip_big(backend, shape[0] * shape[1])
    x = _nan_rows(shape, dtype)
    for log in (False, True):
        name = "log_softmax" if log else "softmax"
        op = multisoft.log_softmax if log else multisoft.softmax
        leaf = x.clone().requires_grad_()
        y = op(leaf, -1, backend=backend)
        assert_close(y, reference_softmax(x, -1, log), dtype, f"{name} forward")
        dy = torch.randn(shape, device=DEVICE).to(dtype)
        (dx,) = torch.autograd.grad(y, leaf, dy)
        assert_close(dx, reference_softmax_backward(y, dy, -1, log), dtype, f"{name} backward",
                     softmax_backward_magnitude(y, dy, -1, log))
    target = torch.randint(0, shape[1], (shape[0],), device=DEVICE)
    leaf = x.clone().requires_grad_()
    loss = multisoft.cross_entropy(leaf, target, reduction="none", backend=backend)
    expected_leaf = x.detach().double().requires_grad_()
    expected = reference_cross_entropy(expected_leaf, target, reduction="none")
    assert_close(loss, expected, loss.dtype, "cross_entropy loss")
    grad_loss = torch.rand(shape[0], device=DEVICE) + 0.5
    (gradient,) = torch.autograd.grad(loss, leaf, grad_loss)
    (expected_gradient,) = torch.autograd.grad(expected, expected_leaf, grad_loss.double())
    assert_close(gradient, expected_gradient, dtype, "cross_entropy gradient")


@pytest.mark.parametrize("classes", [37, 9000], ids=lambda c: f"C{c}")
@on_backends_implementing("cross_entropy")
def test_a_positive_infinity_makes_the_cross_entropy_row_nan(backend, classes):
    """A logit of +inf makes torch's log_softmax NaN throughout its row, so its cross-entropy (class indices or
    probabilities) and its gradient row are NaN, as torch's are; the other rows are unharmed."""
    _skip_big(backend, 3 * classes)
    x = torch.randn(3, classes, device=DEVICE)
    x[0, classes // 2] = float("inf")
    x[1, 1] = float("inf")
    x[1, 2] = float("-inf")
    for target in (torch.tensor([0, 1, 2], device=DEVICE), torch.softmax(torch.randn(3, classes, device=DEVICE), 1)):
        kind = "probabilities" if target.is_floating_point() else "class indices"
        leaf = x.clone().requires_grad_()
        loss = multisoft.cross_entropy(leaf, target, reduction="none", backend=backend)
        expected_leaf = x.double().requires_grad_()
        expected = reference_cross_entropy(expected_leaf, target, reduction="none")
        assert torch.isnan(expected[:2]).all(), "torch's own loss of a row holding +inf is NaN"
        assert_close(loss, expected, torch.float32, f"loss ({kind})")
        ones = torch.ones(3, dtype=torch.float64, device=DEVICE)
        (gradient,) = torch.autograd.grad(loss, leaf, ones.float())
        (expected_gradient,) = torch.autograd.grad(expected, expected_leaf, ones)
        assert_close(gradient, expected_gradient, torch.float32, f"gradient ({kind})")


@pytest.mark.parametrize("softcap", [None, 5.0], ids=["uncapped", "softcap"])
@pytest.mark.parametrize("classes", [37, 9000], ids=lambda c: f"C{c}")
@on_backends_implementing("cross_entropy")
def test_the_lse_of_a_row_holding_an_infinity_is_torchs_logsumexp(backend, classes, softcap):
    """return_lse gives torch.logsumexp of the (capped) logits for rows holding infinities: +inf for a row holding
    +inf, though its loss and gradient are NaN, and -inf for a row of -inf only; a softcap caps either infinity to
    a finite logit, and the lse is then finite. Class indices and probabilities, each by the forward alone and by
    the forward that also writes the gradient."""
    _skip_big(backend, 4 * classes)
    x = torch.randn(4, classes, device=DEVICE)
    x[0, classes // 2] = float("inf")
    x[1, 1] = float("inf")
    x[1, 2] = float("-inf")
    x[2] = float("-inf")
    indices = torch.tensor([0, 1, 2, 3], device=DEVICE)
    probabilities = torch.softmax(torch.randn(4, classes, device=DEVICE), 1)
    for target in (indices, probabilities):
        kind = "probabilities" if target.is_floating_point() else "class indices"
        expected_leaf = x.double().requires_grad_()
        expected, expected_lse = reference_cross_entropy(expected_leaf, target, reduction="none", softcap=softcap,
                                                         return_lse=True)
        if softcap is None:
            inf = float("inf")
            assert expected_lse[:3].tolist() == [inf, inf, -inf], "torch's logsumexp of these rows"
        else:
            assert torch.isfinite(expected_lse).all(), "torch's logsumexp of capped logits"
        ones = torch.ones(4, dtype=torch.float64, device=DEVICE)
        (expected_gradient,) = torch.autograd.grad(expected, expected_leaf, ones)
        for wants_gradient in (False, True):
            what = f"({kind}, {'with' if wants_gradient else 'without'} the gradient)"
            leaf = x.clone().requires_grad_(wants_gradient)
            loss, lse = multisoft.cross_entropy(leaf, target, reduction="none", softcap=softcap, return_lse=True,
                                                backend=backend)
            assert_close(lse, expected_lse, torch.float32, f"lse {what}")
            assert_close(loss, expected, torch.float32, f"loss {what}")
            if wants_gradient:
                (gradient,) = torch.autograd.grad(loss, leaf, ones.float())
                assert_close(gradient, expected_gradient, torch.float32, f"gradient {what}")


# -- block-sparse softmax


def _layout(heads, block_rows, block_cols, density, empty_row=True, upper_only_row=True):
    layout = (torch.rand(heads, block_rows, block_cols) < density).long()
    layout[:, :, 0] = 1
    if empty_row and block_rows > 1:
        layout[0, 1] = 0                     # a block-row with no blocks
    if upper_only_row and block_rows > 2 and block_cols > 3:
        layout[-1, 2] = 0
        layout[-1, 2, 3] = 1                 # only above the diagonal: fully masked when causal
    return layout


BLOCKSPARSE_CASES = {
    "b16-small": dict(block=16, heads=2, block_rows=4, block_cols=4, density=0.5, z=2),
    "b16-wide": dict(block=16, heads=1, block_rows=3, block_cols=80, density=0.6, z=1),
    "b32": dict(block=32, heads=2, block_rows=6, block_cols=6, density=0.5, z=2),
    "b64": dict(block=64, heads=3, block_rows=8, block_cols=8, density=0.4, z=2),
    "b128": dict(block=128, heads=2, block_rows=8, block_cols=8, density=0.3, z=2),
    "b16-very-wide": dict(block=16, heads=1, block_rows=2, block_cols=4096, density=0.9, z=1),
}


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", list(BLOCKSPARSE_CASES), ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@on_backends_implementing("blocksparse")
def test_blocksparse_softmax(backend, dtype, case, is_causal):
    spec = BLOCKSPARSE_CASES[case]
    block = spec["block"]
    layout = _layout(spec["heads"], spec["block_rows"], spec["block_cols"], spec["density"])
    nnz = int(layout.sum())
    _skip_big(backend, spec["z"] * nnz * block * block, limit=70_000)
    x = (torch.randn(spec["z"], nnz, block, block, device=DEVICE) * 2).to(dtype).requires_grad_()
    scale = 0.7
    y = multisoft.blocksparse_softmax(x, layout, block, scale=scale, is_causal=is_causal, backend=backend)
    expected = reference_blocksparse(x.detach(), layout, block, scale, is_causal)
    assert_close(y, expected, dtype, "forward")
    dy = torch.randn_like(x)
    (dx,) = torch.autograd.grad(y, x, dy)
    dx_expected, magnitude = reference_blocksparse_backward(y, dy, layout, block, scale)
    assert_close(dx, dx_expected, dtype, "backward", magnitude)
    dx_direct = multisoft.blocksparse_softmax_backward(y, dy, layout, block, scale=scale, backend=backend)
    assert_close(dx_direct, dx_expected, dtype, "blocksparse_softmax_backward", magnitude)


@pytest.mark.parametrize("scale", [-0.7, 0.0], ids=["negative", "zero"])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@on_backends_implementing("blocksparse")
def test_blocksparse_softmax_scale_of_either_sign(backend, dtype, is_causal, scale):
    """A negative scale flips which element is the row's max; a zero one gives every unmasked element the same
    share (masked ones stay 0)."""
    layout = _layout(2, 6, 6, 0.5)
    x = (torch.randn(2, int(layout.sum()), 32, 32, device=DEVICE) * 2).to(dtype).requires_grad_()
    y = multisoft.blocksparse_softmax(x, layout, 32, scale=scale, is_causal=is_causal, backend=backend)
    assert_close(y, reference_blocksparse(x.detach(), layout, 32, scale, is_causal), dtype, "forward")
    dy = torch.randn_like(x)
    (dx,) = torch.autograd.grad(y, x, dy)
    dx_expected, magnitude = reference_blocksparse_backward(y, dy, layout, 32, scale)
    assert_close(dx, dx_expected, dtype, "backward", magnitude)


# -- tensors of more than 2**31 elements: every kernel's offsets in 64 bits. bfloat16, so the rows checked also start
#    past 2**32 bytes; only those rows are compared, against the float64 reference.

def _rows_past_2_31(rows, columns):
    first = -(-(2**31) // columns)
    assert first < rows
    return slice(first, None)


def _large_inputs_on(backend):
    if backend == "reference":
        pytest.skip("the float64 reference of 2**31 elements needs more GPU memory than the test has")


@pytest.mark.parametrize("shape", [(2**21 + 64, 1024), (2**14 + 16, 131_072)], ids=lambda s: "x".join(map(str, s)))
@on_backends_implementing("softmax")
def test_softmax_past_2_31_elements(backend, shape, one_large_test_at_a_time):
    _large_inputs_on(backend)
    x = torch.randn(shape, device=DEVICE, dtype=torch.bfloat16).requires_grad_()
    y = multisoft.softmax(x, -1, backend=backend)
    dy = torch.randn_like(y)
    (dx,) = torch.autograd.grad(y, x, dy)
    tail = _rows_past_2_31(*shape)
    assert_close(y[tail], reference_softmax(x.detach()[tail], -1, False), torch.bfloat16, "forward")
    y, dy = y[tail], dy[tail]
    assert_close(dx[tail], reference_softmax_backward(y, dy, -1, False), torch.bfloat16, "backward",
                 softmax_backward_magnitude(y, dy, -1, False))


@on_backends_implementing("cross_entropy")
def test_cross_entropy_past_2_31_elements(backend, one_large_test_at_a_time):
    _large_inputs_on(backend)
    shape = (2**14 + 16, 131_072)
    logits = torch.randn(shape, device=DEVICE, dtype=torch.bfloat16).requires_grad_()
    target = torch.randint(0, shape[1], (shape[0],), device=DEVICE)
    loss = multisoft.cross_entropy(logits, target, reduction="none", label_smoothing=0.1, backend=backend)
    grad_out = torch.rand(shape[0], device=DEVICE) + 0.5
    (grad,) = torch.autograd.grad(loss, logits, grad_out)
    tail = _rows_past_2_31(*shape)
    logits64 = logits.detach()[tail].double().requires_grad_()
    expected = reference_cross_entropy(logits64, target[tail], reduction="none", label_smoothing=0.1)
    assert_close(loss[tail], expected, torch.bfloat16, "loss")
    (grad_expected,) = torch.autograd.grad(expected, logits64, grad_out[tail].double())
    assert_close(grad[tail], grad_expected, torch.bfloat16, "gradient")


@on_backends_implementing("blocksparse")
def test_blocksparse_softmax_past_2_31_elements(backend, one_large_test_at_a_time):
    """Batch entry 8 of 9 starts at element 2**31 (a full 16 x 64 x 64 layout of 64 x 64 blocks: 2**28 elements
    an entry); causal, so the rows run from 1 to 4096 elements."""
    _large_inputs_on(backend)
    block, layout = 64, torch.ones(16, 64, 64, dtype=torch.int64)
    x = torch.randn(9, int(layout.sum()), block, block, device=DEVICE, dtype=torch.bfloat16).requires_grad_()
    assert 8 * x[0].numel() == 2**31
    y = multisoft.blocksparse_softmax(x, layout, block, scale=0.5, is_causal=True, backend=backend)
    dy = torch.randn_like(y)
    (dx,) = torch.autograd.grad(y, x, dy)
    assert_close(y[8:], reference_blocksparse(x.detach()[8:], layout, block, 0.5, True), torch.bfloat16, "forward")
    dx_expected, magnitude = reference_blocksparse_backward(y[8:], dy[8:], layout, block, 0.5)
    assert_close(dx[8:], dx_expected, torch.bfloat16, "backward", magnitude)


# -- device and stream


def _every_op(backend, device):
    """Each op forward and backward on `device`, checked against the float64 reference."""
    x = torch.randn(3, 300_000, device=device, requires_grad=True)  # long enough for the multi-program paths
    y = multisoft.softmax(x, -1, backend=backend)
    dy = torch.randn_like(y)
    (dx,) = torch.autograd.grad(y, x, dy)
    assert y.device == x.device and dx.device == x.device
    checks = [(y, reference_softmax(x, -1, False), None, "softmax"),
              (dx, reference_softmax_backward(y, dy, -1, False), softmax_backward_magnitude(y, dy, -1, False),
               "softmax backward")]
    logits = torch.randn(64, 32000, device=device, requires_grad=True)
    target = torch.randint(0, 32000, (64,), device=device)
    loss = multisoft.cross_entropy(logits, target, reduction="none", backend=backend)
    checks.append((loss, reference_cross_entropy(logits.detach(), target, reduction="none"), None, "cross_entropy"))
    layout = _layout(2, 6, 6, 0.5)
    blocks = torch.randn(2, int(layout.sum()), 32, 32, device=device, requires_grad=True)
    p = multisoft.blocksparse_softmax(blocks, layout, 32, scale=0.5, is_causal=True, backend=backend)
    dp = torch.randn_like(p)
    (dblocks,) = torch.autograd.grad(p, blocks, dp)
    checks.append((p, reference_blocksparse(blocks.detach(), layout, 32, 0.5, True), None, "blocksparse"))
    expected, magnitude = reference_blocksparse_backward(p, dp, layout, 32, 0.5)
    checks.append((dblocks, expected, magnitude, "blocksparse backward"))
    return checks


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
@on_backends_implementing(*OPS)
def test_tensors_on_the_second_device(backend):
    """Every op runs on its tensors' device, whatever the current device is."""
    with torch.cuda.device(0):
        checks = _every_op(backend, torch.device("cuda:1"))
    torch.cuda.synchronize(1)
    for actual, expected, magnitude, what in checks:
        assert_close(actual, expected, torch.float32, f"cuda:1 {what}", magnitude)


@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device")
@on_backends_implementing(*OPS)
def test_runs_on_the_current_stream(backend):
    """On a side stream whose queue starts with slow torch work, every op's kernels queue behind it."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        a = torch.randn(4096, 4096, device=DEVICE)
        for _ in range(20):
            a = a @ a.T / 64  # keeps the side stream busy while the ops below are queued
        checks = _every_op(backend, DEVICE)
        results = [(actual * 1, expected, magnitude, what) for actual, expected, magnitude, what in checks]
    side.synchronize()
    for actual, expected, magnitude, what in results:
        assert_close(actual, expected, torch.float32, f"side stream {what}", magnitude)
