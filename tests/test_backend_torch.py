"""The PyTorch backends: ``torch`` (torch's own ops, the automatic fallback) and ``reference`` (float64, by name only).

What the agreement tests cannot see: that the automatic choice never takes the
reference, that ``torch`` computes 16-bit inputs in float32 (a float16 row whose
float16 sum of exponentials overflows still comes out right), that it works a
chunk of rows at a time (the chunk shrunk here so that every op crosses chunk
boundaries, and no temporary of the logits' size is allocated), that invalid
targets give NaN without a host synchronisation, and the block-sparse contract
for non-finite values, against dense float64 ``torch.softmax``.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import multisoft
import multisoft_torch
from harness import DEVICE, ON_GPU, activation, assert_close
from multisoft import _registry
from multisoft._blocksparse import lookup_table
from multisoft.check import DTYPES, error_ratio
from multisoft_torch import _chunks

BOTH = ["torch", "reference"]


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of CHUNK elements on every device, so that small tensors span several chunks."""
    monkeypatch.setattr(_chunks, "CHUNK_ELEMENTS", CHUNK)
    monkeypatch.setattr(_chunks, "GPU_CHUNK_ELEMENTS", CHUNK)


CHUNK = 3000  # three rows of 1000 elements: 37 rows make 13 chunks, the last of one row


def _softmax64(x, log):
    return torch.log_softmax(x.double(), -1) if log else torch.softmax(x.double(), -1)


# -- choosing the backends


def test_descriptions():
    import multisoft_reference

    assert multisoft_torch.NAME == "torch" and multisoft_torch.PRIORITY == 0
    assert getattr(multisoft_torch, "AUTOMATIC", True) is True
    assert multisoft_reference.NAME == "reference" and multisoft_reference.AUTOMATIC is False
    assert multisoft_reference.PRIORITY < multisoft_torch.PRIORITY
    for module in (multisoft_torch, multisoft_reference):
        for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
            assert module.unavailable_reason(DEVICE, dtype) is None


def test_backends_lists_both_and_which_are_automatic():
    described = {b.name: b for b in multisoft.backends(DEVICE, torch.float64)}
    assert described["torch"].available and described["torch"].automatic
    assert described["reference"].available and not described["reference"].automatic
    assert described["reference"].version == torch.__version__
    names = [b.name for b in multisoft.backends()]
    assert names == _registry.backend_names()
    assert names.index("torch") < names.index("reference")
    assert "reference" in multisoft.available_backends()
    with pytest.raises(TypeError, match="dtype"):
        multisoft.backends(DEVICE, "float32")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_automatic_choice_never_picks_reference(monkeypatch, dtype):
    """Not even when nothing else can run: then the automatic choice fails, naming the device."""
    monkeypatch.delenv(_registry.ENV_VAR, raising=False)
    assert _registry.resolve(DEVICE, dtype).name != "reference"
    for backend in multisoft.backends(DEVICE, dtype):
        if backend.name != "reference":
            monkeypatch.setattr(_registry.get_backend(backend.name).module, "unavailable_reason",
                                lambda device, dtype: "switched off for this test")
    _registry.clear_caches()
    with pytest.raises(multisoft.BackendUnavailableError, match="no installed backend can run"):
        multisoft.softmax(torch.randn(2, 3, device=DEVICE, dtype=dtype), -1)
    # by name it still runs: as the argument, in use_backend, and in $MULTISOFT_BACKEND, alone or in a list
    x = torch.randn(2, 3, device=DEVICE, dtype=dtype)
    expected = torch.softmax(x.double(), -1).to(dtype)
    assert torch.equal(multisoft.softmax(x, -1, backend="reference"), expected)
    with multisoft.use_backend("reference"):
        assert torch.equal(multisoft.softmax(x, -1), expected)
    for listed in ("reference", "torch, reference"):
        monkeypatch.setenv(_registry.ENV_VAR, listed)
        assert _registry.resolve(DEVICE, dtype).name == "reference"


def test_harness_runs_both_and_rejects_a_backend_it_does_not_know(monkeypatch):
    import harness

    monkeypatch.delenv(harness.SELECTION_VARIABLE, raising=False)
    under_test = harness.backends_under_test()
    assert "torch" in under_test and "reference" in under_test
    assert not harness.simulated("torch") and not harness.simulated("reference")
    monkeypatch.setenv(harness.SELECTION_VARIABLE, "reference, torhc")
    with pytest.raises(ValueError, match="'torhc'"):
        harness.backends_under_test()
    monkeypatch.setenv(harness.SELECTION_VARIABLE, "reference")
    assert harness.backends_under_test() == ["reference"]


def test_reference_by_name_is_float64_rounded_once():
    """The reference computes in float64 and rounds once: exactly float64 torch's result in the input's dtype."""
    x = (torch.randn(7, 300, device=DEVICE) * 3).requires_grad_()
    for log in (False, True):
        op = multisoft.log_softmax if log else multisoft.softmax
        assert torch.equal(op(x, -1, backend="reference"), _softmax64(x.detach(), log).float())
    target = torch.randint(0, 300, (7,), device=DEVICE)
    loss = multisoft.cross_entropy(x, target, reduction="none", label_smoothing=0.1, backend="reference")
    expected = F.cross_entropy(x.detach().double(), target, reduction="none", label_smoothing=0.1)
    assert torch.equal(loss, expected.float())


def test_reference_gives_nan_for_invalid_targets_and_float64_elsewhere(targets_unchecked_on_the_cpu):
    """A target outside [0, C) that is not ignore_index gives its row a NaN loss and a NaN gradient row (the backend
    contract: never an exception, which would need the targets read on the host); every other row is float64
    torch's result rounded once, and so is its gradient (of a sum: the forward's gradient, scaled by 1; a
    reduction="none" gradient is computed in the backward from the forward's float32 max and sum of exponentials,
    whose rounding it then carries)."""
    logits = torch.randn(4, 10, device=DEVICE) * 3
    target = torch.tensor([0, 10, -100, -1], device=DEVICE)
    valid, invalid = [0, 2], [1, 3]
    buffer = logits.clone().requires_grad_()
    loss = multisoft.cross_entropy(buffer.detach(), target, reduction="none", backend="reference")
    multisoft.cross_entropy(buffer, target, reduction="sum", backend="reference").backward()
    assert loss[invalid].isnan().all(), loss
    assert buffer.grad[invalid].isnan().all(), buffer.grad[invalid]
    logits64 = logits[valid].double().requires_grad_()
    expected = F.cross_entropy(logits64, target[valid], reduction="none")
    expected.sum().backward()
    assert torch.equal(loss[valid], expected.float()), (loss[valid], expected)
    assert torch.equal(buffer.grad[valid], logits64.grad.float())


# -- torch computes 16-bit inputs in float32


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_16_bit_rows_are_computed_in_float32(dtype):
    """70,000 equal logits: their float16 sum of exponentials (70,000) overflows float16's 65,504, and a bfloat16
    sum stops growing at 256 (a 1 added to 256 rounds away). Computed in float32 and rounded once, each result is
    float64's rounded to the dtype; the cross-entropy loss is float32 for 16-bit logits (as under autocast), so it
    is float64's rounded to float32, and its gradient float64's rounded to the logits' dtype."""
    columns = 70_000
    x = torch.full((2, columns), 3.0, device=DEVICE, dtype=dtype)
    x[1] = -2.0
    for log in (False, True):
        op = multisoft.log_softmax if log else multisoft.softmax
        y = op(x, -1, backend="torch")
        assert torch.equal(y, _softmax64(x, log).to(dtype)), (log, y[:, :3])
    logits = x.clone().requires_grad_()
    target = torch.tensor([5, 60_000], device=DEVICE)
    loss = multisoft.cross_entropy(logits, target, reduction="none", backend="torch")
    logits64 = x.double().requires_grad_()
    expected = F.cross_entropy(logits64, target, reduction="none")
    assert torch.allclose(expected, torch.full((2,), math.log(columns), dtype=torch.float64, device=DEVICE))
    assert loss.dtype == torch.float32 and torch.equal(loss, expected.float()), loss
    loss.sum().backward()
    expected.sum().backward()
    assert torch.equal(logits.grad, logits64.grad.to(dtype))


# -- chunks


def test_chunks_cover_every_row_once(small_chunks):
    for rows, columns in [(1, 1), (37, 1000), (3, 3000), (4, 3001), (10, 1)]:
        chunks = _chunks.slices(rows, columns, DEVICE)
        assert [i for c in chunks for i in range(rows)[c]] == list(range(rows))
        assert all(c.stop - c.start == max(1, CHUNK // columns) for c in chunks[:-1])
    assert len(_chunks.slices(37, 1000, DEVICE)) == 13


@pytest.mark.parametrize("dtype", DTYPES + (torch.float64,), ids=str)
@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
def test_softmax_across_chunks(small_chunks, log, dtype):
    tolerance = dtype if dtype != torch.float64 else torch.float32
    x = (torch.randn(37, 1000, device=DEVICE) * 3).to(dtype)
    x[4, ::7] = float("-inf")
    x[36, 1:] = float("-inf")    # the last chunk's one row: one finite element
    x = x.requires_grad_()
    op = multisoft.log_softmax if log else multisoft.softmax
    y = op(x, -1, backend="torch")
    assert_close(y, _softmax64(x.detach(), log), tolerance, "forward")
    dy = torch.randn(37, 1000, device=DEVICE).to(dtype)
    (dx,) = torch.autograd.grad(y, x, dy)
    y64, dy64 = y.detach().double(), dy.double()
    if log:
        expected = dy64 - y64.exp() * dy64.sum(-1, keepdim=True)
        magnitude = dy64.abs() + y64.exp() * dy64.abs().sum(-1, keepdim=True)
    else:
        expected = y64 * (dy64 - (y64 * dy64).sum(-1, keepdim=True))
        magnitude = y64 * (dy64.abs() + (y64 * dy64).abs().sum(-1, keepdim=True))
    assert_close(dx, expected, tolerance, "backward", magnitude)


def _ce_case(dtype, rows=37, classes=1000):
    logits = (torch.randn(rows, classes, device=DEVICE) * 2).to(dtype)
    target = torch.randint(0, classes, (rows,), device=DEVICE)
    target[::5] = -100
    target[-1] = classes - 1     # the last chunk's one row
    weight = torch.rand(classes, device=DEVICE) + 0.5
    return logits, target, weight


@pytest.mark.parametrize("inplace", [False, True], ids=["new-gradient", "inplace"])
@pytest.mark.parametrize("dtype", DTYPES + (torch.float64,), ids=str)
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
def test_cross_entropy_across_chunks(small_chunks, weighted, dtype, inplace):
    """Loss and gradient of rows spread over many chunks against float64 torch. The forward computes the gradient:
    with a gradient buffer of its own it leaves the logits as they are; in place it has overwritten them, after
    the forward already, with the gradient of the losses' sum (reduction "none" scales no row), which the backward
    then multiplies by the incoming gradient."""
    tolerance = dtype if dtype != torch.float64 else torch.float32
    logits, target, weight = _ce_case(dtype)
    kwargs = dict(weight=weight if weighted else None, label_smoothing=0.1, reduction="none")
    leaf, buffer = activation(logits)
    loss = multisoft.cross_entropy(buffer, target, backend="torch", inplace_backward=inplace, **kwargs)
    logits64 = logits.double().requires_grad_()
    expected = F.cross_entropy(logits64, target, **{**kwargs, "weight": weight.double() if weighted else None})
    assert_close(loss, expected, tolerance, "loss")
    if inplace:
        (gradient_of_sum,) = torch.autograd.grad(expected.sum(), logits64, retain_graph=True)
        assert_close(buffer.detach(), gradient_of_sum, tolerance, "gradient written over the logits by the forward")
    else:
        assert torch.equal(buffer.detach(), logits), "with a gradient buffer the forward leaves the logits as they are"
    grad_out = torch.rand(logits.shape[0], device=DEVICE) + 0.5
    loss.backward(grad_out.to(dtype))
    expected.backward(grad_out.to(dtype).double())
    assert_close(leaf.grad, logits64.grad, tolerance, "gradient")
    assert (leaf.grad.data_ptr() == buffer.data_ptr()) == inplace


@pytest.mark.parametrize("offset", [1e4, -3000.0, 3e5], ids=["1e4", "-3000", "3e5"])
@pytest.mark.parametrize("backend", BOTH)
def test_cross_entropy_of_large_logits(backend, offset):
    """Logits near 10^4: log-sum-exp rounded to float32 is off by up to 0.0005, more than a loss of about 10 may
    be; each loss is (max - x) + log(sum), whose terms are exact or small. Long rows, with label smoothing."""
    logits = torch.randn(4, 70_000, device=DEVICE) * 3 + offset
    target = torch.randint(0, 70_000, (4,), device=DEVICE)
    weight = torch.rand(70_000, device=DEVICE) + 0.5
    for kwargs in (dict(), dict(weight=weight, label_smoothing=0.1)):
        loss = multisoft.cross_entropy(logits, target, reduction="none", backend=backend, **kwargs)
        expected = F.cross_entropy(logits.double(), target, reduction="none",
                                   **{**kwargs, "weight": weight.double() if kwargs else None})
        assert_close(loss, expected, torch.float32, f"loss {kwargs}")


def _peak_bytes_allocated(run) -> int:
    """The most CPU memory that ``run`` held allocated at once, from the profiler's allocation records."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    if not events:
        pytest.skip("this torch's profiler records no allocations")
    live = peak = 0
    for event in events:
        live += event.nbytes()
        peak = max(peak, live)
    return peak


@pytest.mark.skipif(ON_GPU, reason="measures CPU allocations (the GPU's are in test_bench's memory table)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("inplace", [False, True], ids=["new-gradient", "inplace"])
def test_cross_entropy_allocates_nothing_of_the_logits_size_but_the_gradient(small_chunks, inplace, dtype):
    """The forward computes the gradient in its pass over the logits: it holds the gradient (none in place) and a
    few float32 chunks at most. The backward only scales that gradient where it lies: it holds no more than a few
    chunks' worth either (in fact nothing of the logits' size)."""
    logits, target, weight = _ce_case(dtype, rows=64, classes=4096)
    leaf, buffer = activation(logits)
    losses = []
    forward_peak = _peak_bytes_allocated(lambda: losses.append(multisoft.cross_entropy(
        buffer, target, weight=weight, label_smoothing=0.1, backend="torch", inplace_backward=inplace)))
    backward_peak = _peak_bytes_allocated(lambda: losses[0].backward())
    logits_bytes = logits.numel() * logits.element_size()
    gradient = 0 if inplace else logits_bytes
    chunks = 8 * 4 * 4096 + 64 * 1024  # a chunk is one row of 4096 (CHUNK elements round down to one row)
    assert chunks < logits_bytes / 2 and forward_peak <= gradient + chunks, (forward_peak, gradient)
    assert backward_peak <= chunks, backward_peak
    assert (leaf.grad.data_ptr() == buffer.data_ptr()) == inplace


@pytest.mark.parametrize("reduction", ["none", "mean"])
def test_invalid_targets_give_nan_without_a_host_synchronisation(small_chunks, monkeypatch, reduction,
                                                                 targets_unchecked_on_the_cpu):
    """Targets outside [0, C) that are not ignore_index: NaN loss and gradient rows, the others right; no value
    is read back to the host (every way a tensor's value reaches Python raises), but for the one read the backend
    contract grants a backend whose tensors are on the CPU: ``scale``'s one-element factor, read with ``item`` to
    return at once when it is exactly 1. A factor on any other device is never read."""
    classes = 1000
    logits = torch.randn(9, classes, device=DEVICE, requires_grad=True)
    target = torch.tensor([0, classes, -1, 10**9, -(10**9), 5, -100, 7, classes + 3], device=DEVICE)
    valid, invalid = [0, 5, 6, 7], [1, 2, 3, 4, 8]
    kernels = _registry.get_backend("torch").kernels("cross_entropy")
    scale = kernels.scale
    readable = []  # the factor that the running scale may read on the host, or None: nothing may be read

    def scale_whose_cpu_factor_may_be_read(grad_logits, factor):
        on_cpu = factor.device.type == "cpu" and factor.shape == (1,)
        readable.append(factor if on_cpu else None)
        try:
            return scale(grad_logits, factor)
        finally:
            readable.pop()

    def no_sync(method):
        read = getattr(torch.Tensor, method)

        def refuse(tensor, *args, **kwargs):
            if method == "item" and readable and tensor is readable[-1]:
                return read(tensor, *args, **kwargs)
            raise AssertionError(f"the torch backend read a tensor's value on the host ({method})")

        return refuse

    with monkeypatch.context() as patch:
        patch.setattr(kernels, "scale", scale_whose_cpu_factor_may_be_read)
        for method in ("__bool__", "item", "tolist", "__int__", "__float__", "__index__"):
            patch.setattr(torch.Tensor, method, no_sync(method))
        if ON_GPU:
            torch.cuda.set_sync_debug_mode("error")
        try:
            loss = multisoft.cross_entropy(logits, target, reduction=reduction, backend="torch")
            grad_out = torch.rand_like(loss) + 0.5
            (grad,) = torch.autograd.grad(loss, logits, grad_out)
        finally:
            if ON_GPU:
                torch.cuda.set_sync_debug_mode("default")
    assert grad[invalid].isnan().all()
    if reduction == "mean":
        assert loss.isnan()
        return
    assert loss[invalid].isnan().all() and loss[6] == 0
    logits64 = logits.detach()[valid].double().requires_grad_()
    expected = F.cross_entropy(logits64, target[valid], reduction="none")
    assert_close(loss[valid], expected, torch.float32, "valid rows")
    expected.backward(grad_out[valid].double())
    assert_close(grad[valid], logits64.grad, torch.float32, "valid rows' gradient")


# -- block-sparse: the non-finite contract, against dense float64 torch.softmax over each row's unmasked elements


def _blocksparse_expected(x, layout, block, scale, is_causal):
    dense = multisoft.blocksparse_to_dense(x.double(), layout, block)
    stored = multisoft.blocksparse_to_dense(torch.ones_like(x, dtype=torch.float64), layout, block) > 0
    m, n = dense.shape[-2:]
    unmasked = stored & ~torch.ones(m, n, dtype=torch.bool, device=x.device).triu(1) if is_causal else stored
    y = torch.softmax((scale * dense).masked_fill(~unmasked, float("-inf")), -1).masked_fill(~unmasked, 0.0)
    return multisoft.blocksparse_from_dense(y, layout, block)


def _blocksparse_backward_expected(y, dy, layout, block, scale):
    y64 = multisoft.blocksparse_to_dense(y.double(), layout, block)
    dy64 = multisoft.blocksparse_to_dense(dy.double(), layout, block)
    dot = (y64 * dy64).sum(-1, keepdim=True)
    dx = torch.where(y64 == 0, 0.0, scale * y64 * (dy64 - dot))
    magnitude = abs(scale) * y64.abs() * (dy64.abs() + (y64 * dy64).abs().sum(-1, keepdim=True))
    return multisoft.blocksparse_from_dense(dx, layout, block), multisoft.blocksparse_from_dense(magnitude, layout,
                                                                                                 block)


def _plant_non_finite(x, layout, block):
    """NaN, +inf, -inf, a row of all -inf, and in the second batch entry the same in other rows."""
    lut = lookup_table(layout, block)
    first = lut.offsets.tolist()
    blocks_of = {g: list(range(first[g], first[g + 1])) for g in range(len(first) - 1) if first[g + 1] > first[g]}
    groups = list(blocks_of)
    for z in range(x.shape[0]):
        g = groups[z % len(groups)], groups[(z + 1) % len(groups)], groups[(z + 2) % len(groups)]
        x[z, blocks_of[g[0]][-1], 1, 0] = float("nan")
        x[z, blocks_of[g[1]][0], 2, 1] = float("inf")
        x[z, blocks_of[g[1]][0], 3, 1] = float("-inf")
        for k in blocks_of[g[2]]:
            x[z, k, 4] = float("-inf")
    return x


@pytest.mark.parametrize("scale", [0.7, -0.7, 0.0], ids=["positive", "negative", "zero"])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("backend", BOTH)
def test_blocksparse_non_finite_contract(small_chunks, backend, dtype, is_causal, scale):
    block = 16
    layout = (torch.rand(2, 4, 5) < 0.5).long()
    layout[:, :, 0] = 1
    layout[1, 2] = 0
    layout[1, 2, 3] = 1          # only above the diagonal: every row fully masked when causal
    x = (torch.randn(2, int(layout.sum()), block, block, device=DEVICE) * 2).to(dtype)
    x = _plant_non_finite(x, layout, block).requires_grad_()
    y = multisoft.blocksparse_softmax(x, layout, block, scale=scale, is_causal=is_causal, backend=backend)
    expected = _blocksparse_expected(x.detach(), layout, block, scale, is_causal)
    assert expected.isnan().any()
    assert torch.equal(y.isnan(), expected.isnan()), "NaN exactly where dense torch.softmax gives it"
    assert_close(y, expected, dtype, "forward")
    dy = torch.randn_like(y)
    (dx,) = torch.autograd.grad(y, x, dy)
    dx_expected, magnitude = _blocksparse_backward_expected(y, dy, layout, block, scale)
    assert torch.equal(dx.isnan(), dx_expected.isnan())
    assert (dx[y == 0] == 0).all(), "the gradient is 0 wherever the output is"
    assert_close(dx, dx_expected, dtype, "backward", magnitude)


def test_blocksparse_chunks_hold_whole_block_rows_apart(small_chunks):
    """A block-row's blocks spread over several chunks (CHUNK holds 11 blocks of 16 x 16; a block-row of the
    wide layout has 40): its max and sum are gathered over all of them before any output is written."""
    block, layout = 16, torch.ones(1, 2, 40, dtype=torch.int64)
    assert len(_chunks.slices(3 * 80, block * block, DEVICE)) > 3
    x = (torch.randn(3, 80, block, block, device=DEVICE) * 3).requires_grad_()
    for is_causal in (False, True):
        y = multisoft.blocksparse_softmax(x, layout, block, scale=0.5, is_causal=is_causal, backend="torch")
        assert_close(y, _blocksparse_expected(x.detach(), layout, block, 0.5, is_causal), torch.float32, "forward")
        dy = torch.randn_like(y)
        (dx,) = torch.autograd.grad(y, x, dy)
        expected, magnitude = _blocksparse_backward_expected(y, dy, layout, block, 0.5)
        assert_close(dx, expected, torch.float32, "backward", magnitude)


def test_error_ratio_sees_a_wrong_nan():
    """The comparisons above rely on error_ratio treating NaN against a number as an error."""
    nan = torch.tensor([float("nan")])
    assert error_ratio(nan, torch.tensor([0.5]), torch.float32)[1] > 1
