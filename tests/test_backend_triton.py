"""Triton backend specifics: availability rules, each kernel path (forced by setting multisoft_triton._tuning;
cross-entropy's paths are tests/kernel_paths.py's, on which tests/test_contract.py checks the contract), streams
and devices. Expected values are multisoft.check's float64 references (for cross-entropy, tests/harness.py's
`cross_entropy_contract` and `row_stats_contract`, the backend contract in float64), compared at its tolerances by
tests/harness.py's assert_close."""

import pytest
import torch

from harness import DEVICE, assert_close, assert_row_stats, cross_entropy_contract, row_stats_contract
from kernel_paths import force, forced_paths
from multisoft import LossOptions
from multisoft.check import (reference_blocksparse, reference_blocksparse_backward, reference_slice_gradient,
                             reference_softmax, reference_softmax_backward, softmax_backward_magnitude)

multisoft_triton = pytest.importorskip("multisoft_triton")

RUNS = multisoft_triton.unavailable_reason(DEVICE, torch.float32) is None
needs_kernels = pytest.mark.skipif(not RUNS, reason="triton cannot run here (no CUDA, no TRITON_INTERPRET=1)")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available() or not RUNS, reason="needs CUDA and triton")


def test_description():
    assert multisoft_triton.NAME == "triton"
    assert multisoft_triton.PRIORITY == 300
    assert "multisoft[triton]" in multisoft_triton.INSTALL
    assert multisoft_triton.DTYPES == (torch.float32, torch.float16, torch.bfloat16)


def test_cpu_needs_the_interpreter(monkeypatch):
    """On the CPU it runs only under the interpreter (TRITON_INTERPRET=1, which simulated() reports), and only
    the DTYPES."""
    pytest.importorskip("triton")
    assert multisoft_triton.version()
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not multisoft_triton.simulated()
    assert "TRITON_INTERPRET" in multisoft_triton.unavailable_reason(torch.device("cpu"), torch.float32)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not multisoft_triton.simulated()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert multisoft_triton.simulated()
    for dtype in multisoft_triton.DTYPES:
        assert multisoft_triton.unavailable_reason(torch.device("cpu"), dtype) is None
    assert multisoft_triton.unavailable_reason(torch.device("cpu"), torch.float64) is not None


def _run_cross_entropy(logits, target, weight, grad_logits, grad_scale, options=LossOptions()):
    """The triton forward under ``options`` (a LossOptions) with every per-row output filled with a sentinel
    first; returns (loss, lse, row_weight)."""
    from multisoft_triton import cross_entropy

    stats = torch.full((3, logits.shape[0]), 12345.0, device=logits.device)
    cross_entropy.forward(logits, target, weight, *stats, grad_logits, grad_scale, options)
    return stats


CE_PATHS = forced_paths("triton")   # tile: 2 rows of up to 64 classes a program; loop: chunks of 16 classes


@pytest.fixture
def ce_path(request, monkeypatch):
    """Forces the cross-entropy kernel path (tests/kernel_paths.py) for tiny rows and checks, after the test, that
    every class-index forward launch took it."""
    assert_took = force(monkeypatch, "triton", request.param)
    yield request.param
    assert_took()


# (weighted, label_smoothing, softcap, lse_square_scale, ignore_index)
CE_OPTIONS = {
    "plain": (False, 0.0, 0.0, 0.0, -100),
    "weight-smoothing": (True, 0.2, 0.0, 0.0, -100),
    "everything": (True, 0.1, 3.0, 0.02, -100),
}


@needs_kernels
@pytest.mark.parametrize("ce_path", CE_PATHS, indirect=True)
def test_cross_entropy_of_large_logits_is_exact(ce_path):
    """float32 logits near 5000, where lse rounded to float32 is off by up to 2.4e-4: the loss and the gradient
    (p = exp(u - max) / sum, not exp(u - lse)) still match float64 at float32's tolerances."""
    rows, classes = 4, 37
    logits = torch.randn(rows, classes, device=DEVICE) * 2 + 5000
    target = torch.tensor([3, 36, 20, 9], device=DEVICE)
    weight = torch.rand(classes, device=DEVICE) + 0.5
    grad = torch.empty_like(logits)
    grad_scale = torch.ones(rows, device=DEVICE)
    options = LossOptions(ignore_index=-100, label_smoothing=0.1)
    loss, _, _ = _run_cross_entropy(logits, target, weight, grad, grad_scale, options)
    expected = cross_entropy_contract(logits, target, weight, grad_scale, options)
    assert_close(loss, expected.loss, torch.float32, "loss")
    assert_close(grad, expected.grad, torch.float32, "gradient")


@needs_kernels
@pytest.mark.parametrize("ce_path", CE_PATHS, indirect=True)
def test_cross_entropy_softcap_past_float32_is_no_cap(ce_path):
    """A softcap of 1e39 (inf in float32): the same bits as no softcap, for the gradient too."""
    logits = torch.randn(3, 37, device=DEVICE) * 3
    target = torch.tensor([5, -100, 30], device=DEVICE)
    grad_scale = torch.rand(3, device=DEVICE)
    grads = torch.empty(2, 3, 37, device=DEVICE)
    uncapped = LossOptions(ignore_index=-100, label_smoothing=0.1, softcap=0.0, lse_square_scale=0.01)
    huge = _run_cross_entropy(logits, target, None, grads[0], grad_scale, uncapped._replace(softcap=1e39))
    plain = _run_cross_entropy(logits, target, None, grads[1], grad_scale, uncapped)
    assert torch.equal(huge, plain) and torch.equal(grads[0], grads[1])
    expected = cross_entropy_contract(logits, target, None, grad_scale, uncapped).grad
    assert_close(grads[1], expected, torch.float32, "gradient")


@needs_kernels
@pytest.mark.parametrize("ce_path", CE_PATHS, indirect=True)
@pytest.mark.parametrize("target_dtype", [torch.int64, torch.int32], ids=str)
def test_cross_entropy_invalid_targets_give_nan_gradient_rows(ce_path, target_dtype):
    """Targets C, -1 and far outside (not ignore_index): Triton writes NaN into their gradient rows, which the
    contract leaves open (NaN preferred); tests/test_contract.py checks the rest of such a call on each path (NaN
    loss, the other rows, nothing written out of bounds)."""
    rows, classes = 6, 37
    logits = torch.randn(rows, classes, device=DEVICE)
    far = 2**40 if target_dtype == torch.int64 else 2**30
    target = torch.tensor([0, classes, -1, far, -far, classes - 1], dtype=target_dtype, device=DEVICE)
    grad = torch.empty_like(logits)
    grad_scale = torch.ones(rows, device=DEVICE)
    options = LossOptions(ignore_index=-100, label_smoothing=0.1, softcap=0.0, lse_square_scale=0.01)
    loss, _, _ = _run_cross_entropy(logits, target, None, grad, grad_scale, options)
    assert loss[1:5].isnan().all() and grad[1:5].isnan().all()
    valid = [0, 5]
    expected = cross_entropy_contract(logits, target, None, grad_scale, options)
    assert_close(grad[valid], expected.grad[valid], torch.float32, "gradient")


@needs_kernels
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_cross_entropy_long_rows(weighted, smoothing):
    """Rows past the tile at the tuned chunk sizes, streamed twice by one program for the gradient, once without:
    a first chunk of -inf only, scattered -inf logits, an ignored row and a last chunk that is mostly masked."""
    from multisoft_triton import _tuning

    loop_block = _tuning.CE_LOOP_GRAD_CONFIGS[4][0]
    rows, classes = 5, 3 * loop_block + 5
    assert classes > _tuning.CE_TILE_MAX
    logits = torch.randn(rows, classes, device=DEVICE) * 3
    logits[1, :loop_block] = float("-inf")
    logits[3, ::11] = float("-inf")
    target = torch.tensor([7, classes - 1, -100, 12, 2 * loop_block], device=DEVICE)
    weight = torch.rand(classes, device=DEVICE) + 0.5 if weighted else None
    grad = torch.empty_like(logits)
    grad_scale = torch.rand(rows, device=DEVICE)
    options = LossOptions(ignore_index=-100, label_smoothing=smoothing)
    loss, lse, _ = _run_cross_entropy(logits, target, weight, grad, grad_scale, options)
    expected = cross_entropy_contract(logits, target, weight, grad_scale, options)
    finite = logits.isfinite().all(1)  # smoothing sums every logit: -inf ones give an infinite loss
    keep = finite | (smoothing == 0.0)
    assert_close(lse, expected.lse, torch.float32, "lse")
    assert_close(loss[keep], expected.loss[keep], torch.float32, "loss")
    assert loss[2] == 0
    if smoothing:
        assert torch.isinf(loss[~finite]).all()
    assert_close(grad, expected.grad, torch.float32, "gradient")
    loss, lse, _ = _run_cross_entropy(logits, target, weight, None, None, options)   # CE_LOOP_CONFIGS
    assert_close(lse, expected.lse, torch.float32, "lse without the gradient")
    assert_close(loss[keep], expected.loss[keep], torch.float32, "loss without the gradient")


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", [(7, 37), (9, 5)], ids=str)
def test_scale(shape, dtype, monkeypatch):
    """One factor of 1: the buffer's bits unchanged (NaN among them); one factor of 2.5, NaN, inf; a factor a
    row (1, 0, -3, inf among them); programs of 16 elements (one row cut in 3, or 2 rows a program)."""
    from multisoft_triton import _tuning, cross_entropy

    monkeypatch.setattr(_tuning, "CE_SCALE_BLOCK", 16)
    rows, classes = shape
    grad = torch.randn(shape, device=DEVICE).to(dtype)
    grad[1, 2] = float("nan")
    grad[2, 0] = 0.0
    bits = grad.view(torch.int32 if dtype == torch.float32 else torch.int16).clone()
    cross_entropy.scale(grad, torch.ones(1, device=DEVICE))
    assert torch.equal(grad.view(bits.dtype), bits)
    for value in (2.5, float("nan"), float("inf")):
        scaled = grad.clone()
        cross_entropy.scale(scaled, torch.full((1,), value, device=DEVICE))
        assert_close(scaled, grad.double() * value, dtype, f"factor {value}")
    factors = torch.rand(rows, device=DEVICE) * 4 - 2
    factors[:4] = torch.tensor([1.0, 0.0, -3.0, float("inf")])
    scaled = grad.clone()
    cross_entropy.scale(scaled, factors)
    assert_close(scaled, grad.double() * factors.double()[:, None], dtype, "a factor a row")


def _check_softmax(x, log):
    from multisoft_triton import softmax

    out = torch.empty_like(x)
    softmax.forward(x, out, log)
    assert_close(out, reference_softmax(x, -1, log), x.dtype, "forward")
    dy = torch.randn_like(x)
    dx = torch.empty_like(x)
    softmax.backward(out, dy, dx, log)
    assert_close(dx, reference_softmax_backward(out, dy, -1, log), x.dtype, "backward",
                 softmax_backward_magnitude(out, dy, -1, log))


@needs_kernels
@pytest.mark.parametrize("log", [False, True])
def test_long_rows_loop_path(log, monkeypatch):
    from multisoft_triton import _tuning

    monkeypatch.setattr(_tuning, "SPLIT_CONFIGS", ())
    x = torch.randn(2, 70001, device=DEVICE) * 4
    x[0, ::7] = float("-inf")
    _check_softmax(x, log)


@needs_cuda
@pytest.mark.parametrize("columns", [32768, 32769, 131072, 262147, 1 << 20])
@pytest.mark.parametrize("log", [False, True])
def test_long_rows_split_path(columns, log):
    x = torch.randn(3, columns, device="cuda") * 4
    x[1, ::5] = float("-inf")
    _check_softmax(x, log)


@needs_cuda
def test_launches_on_the_current_stream():
    from multisoft_triton import softmax

    x = torch.randn(256, 4096, device="cuda")
    out = torch.full_like(x, float("nan"))
    softmax.forward(x, torch.empty_like(x), False)  # compile first: the side stream must still be asleep below
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(500_000_000)
        softmax.forward(x, out, False)
    seen_early = out.clone()
    torch.cuda.current_stream().synchronize()
    assert seen_early.isnan().all(), "the kernel did not wait for the side stream"
    side.synchronize()
    assert_close(out, reference_softmax(x, -1, False), torch.float32, "softmax")


@pytest.mark.skipif(torch.cuda.device_count() < 2 or not RUNS, reason="needs two CUDA devices")
def test_second_device():
    from multisoft_triton import cross_entropy

    torch.cuda.set_device(0)
    logits = torch.randn(64, 32000, device="cuda:1")
    target = torch.randint(0, 32000, (64,), device="cuda:1")
    stats = torch.empty(3, 64, device="cuda:1")
    grad = torch.empty_like(logits)
    cross_entropy.forward(logits, target, None, *stats, grad, torch.ones(64, device="cuda:1"), LossOptions())
    cross_entropy.scale(grad, torch.full((1,), 0.5, device="cuda:1"))
    expected = cross_entropy_contract(logits, target, grad_scale=torch.full((64,), 0.5))
    assert_close(stats[0], expected.loss, torch.float32, "loss")
    assert_close(grad, expected.grad, torch.float32, "gradient")
    _check_softmax(torch.randn(5, 300000, device="cuda:1"), False)


@needs_cuda
@pytest.mark.parametrize("columns", [32768, 131075, 262144])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("log", [False, True])
@pytest.mark.parametrize("capped", [True, False], ids=["maxnreg", "uncapped"])
@pytest.mark.parametrize("held", [False, True], ids=["default", "held"])
def test_long_rows_split_path_special_rows(columns, dtype, log, capped, held, monkeypatch):
    """Rows of -inf only, a NaN, every third entry -inf, values near -300 with a first chunk of -inf only,
    with the split forward's register cap (SPLIT_FORWARD_MAXNREG: some values wait in local memory) and
    without; `held`: every dtype's chunks held in registers (no SPLIT_STREAM)."""
    from multisoft_triton import _tuning

    if not capped:
        monkeypatch.setattr(_tuning, "SPLIT_FORWARD_MAXNREG", {})
    if held:
        monkeypatch.setattr(_tuning, "SPLIT_STREAM", {})
    x = (torch.randn(5, columns, device="cuda") * 4).to(dtype)
    x[1] = float("-inf")
    x[2, 1000] = float("nan")
    x[3, 5::3] = float("-inf")
    x[4] -= 300
    x[4, :16384] = float("-inf")  # a whole chunk of every SPLIT_CONFIGS size
    _check_softmax(x, log)


@needs_cuda
@pytest.mark.parametrize("stream", [(8192, 2048, 4, 1), (8192, 2048, 4, 3), (4096, 1024, 4, 3)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_rows_streaming_split_forward(stream, dtype, monkeypatch):
    """The split forward streaming its chunk twice (SPLIT_STREAM): partial last chunks, rows of -inf
    only, NaN."""
    from multisoft_triton import _tuning, softmax

    monkeypatch.setattr(_tuning, "SPLIT_STREAM", {dtype.itemsize: stream})
    for columns in (32769, 131075, 262144):
        x = (torch.randn(4, columns, device="cuda") * 4).to(dtype)
        x[1] = float("-inf")
        x[2, 1000] = float("nan")
        x[3, 5::3] = float("-inf")
        for log in (False, True):
            out = torch.empty_like(x)
            softmax.forward(x, out, log)
            assert_close(out, reference_softmax(x, -1, log), x.dtype, f"{columns} log={log}")


def _special_rows(rows, columns, dtype):
    """Random rows, then a row of -inf only, a NaN, and every third entry -inf."""
    x = (torch.randn(rows, columns, device=DEVICE) * 4).to(dtype)
    x[1] = float("-inf")
    x[2, columns // 3] = float("nan")
    x[3, 5::3] = float("-inf")
    return x


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("programs_per_row_block", [1, 3])
def test_forward_of_persistent_programs_that_prefetch_rows(dtype, programs_per_row_block, monkeypatch):
    """The forward tile as persistent programs that load their next row before storing the current one
    (PREFETCH_FROM): more rows than programs and fewer, a row count no multiple of the programs, rows of
    -inf only, a NaN, every third entry -inf. Without a GPU the thresholds come down to rows the interpreter
    runs quickly."""
    from multisoft_triton import _tuning, softmax

    calls = []
    kernel = softmax._fwd_prefetch_kernel
    monkeypatch.setattr(softmax, "_fwd_prefetch_kernel",
                        type("Spy", (), {"__getitem__": lambda _, grid: calls.append(grid) or kernel[grid]})())
    if torch.cuda.is_available():
        block, shapes = 32768, [(5, 32768), (1000, 20000), (4, 32001)]
    else:
        block, shapes = 64, [(10, 64), (7, 37), (4, 50)]
    monkeypatch.setattr(_tuning, "PREFETCH_FROM", {dtype.itemsize: block})
    monkeypatch.setattr(_tuning, "PREFETCH_SM_ELEMENTS", programs_per_row_block * block)
    for rows, columns in shapes:
        for log in (False, True):
            _check_softmax(_special_rows(rows, columns, dtype), log)
    assert len(calls) == 2 * len(shapes)


@needs_kernels
@pytest.mark.parametrize("raw", [True, False], ids=["raw", "floats"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_16bit_backward_held_as_loaded_or_as_floats(dtype, raw, monkeypatch):
    """The backward's 16-bit tiles (and, on a GPU, split chunks) held as loaded and widened again after
    the reduction (RAW_FROM), or held as floats: both match float64."""
    from multisoft_triton import _tuning

    monkeypatch.setattr(_tuning, "RAW_FROM", {"backward tile": 0, "backward split": 0} if raw else {})
    shapes = [(6, 1000), (4, 4100)] + ([(5, 32768), (4, 131075)] if torch.cuda.is_available() else [])
    for rows, columns in shapes:
        for log in (False, True):
            _check_softmax(_special_rows(rows, columns, dtype), log)


@needs_kernels
@pytest.mark.parametrize("kernels, is_causal", [("rows", False), ("rows", True), ("one-row-programs", True),
                                                ("across", False), ("across", True),
                                                ("backward-tiles", False), ("backward-tiles", True)],
                         ids=["rows-full", "rows-causal", "one-row-programs-causal", "across-full", "across-causal",
                              "backward-tiles-full", "backward-tiles-causal"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_blocksparse_buckets_of_row_lengths(dtype, is_causal, kernels, monkeypatch):
    """Block-rows of 1..45 blocks (and an empty one), in shuffled columns (causal: some rows fully masked, some
    masked from a block on), on the row kernels holding 8 blocks (most rows streamed): both directions at 4 rows a
    program, the forward with a scale of each sign; the causal forward at one row a program (the interpreter runs
    4x the programs: one mask, not both); the forward with its rows across a warp's lanes (8 float32 or 16 bf16 rows
    a program, 4 blocks of each held), a scale of each sign; the backward on the tile and loop kernels (TILES_FROM
    0), in launches by length, the longest on the loop path."""
    import multisoft
    from multisoft._blocksparse import lookup_table
    from multisoft_triton import _tuning, blocksparse

    tiles = kernels == "backward-tiles"   # the backward on the tile and loop kernels, or on the row kernel
    monkeypatch.setattr(_tuning, "TILES_FROM", {4: 0, 2: 0} if tiles else {4: float("inf"), 2: float("inf")})
    if kernels == "one-row-programs":
        monkeypatch.setattr(_tuning, "FORWARD_ONE_ROW_FROM", {4: 16, 2: 16})
    across = kernels == "across"   # the forward's rows across lanes on this layout (mean row 384) or never
    monkeypatch.setattr(_tuning, "FORWARD_ACROSS_UNTIL", {4: 1e9, 2: 1e9} if across else {4: 0, 2: 0})
    monkeypatch.setattr(_tuning, "FORWARD_ACROSS_BLOCKS", {4: 4, 2: 4})
    monkeypatch.setattr(_tuning, "ROW_HELD", 128)
    monkeypatch.setattr(_tuning, "ROW_MIN_BLOCKS", {4: 1, 2: 1})
    monkeypatch.setattr(_tuning, "BUCKETS_SAVE", {4: 0.0, 2: 0.0})
    monkeypatch.setattr(_tuning, "BLOCKSPARSE_TILE_MAX", 512)  # rows of more than 32 blocks of 16 take the loop path
    block, heads, block_rows, block_cols = 16, 2, 12, 48
    lengths = torch.arange(block_rows) * 4 + 1   # 1 to 45: every launch's bucket (1, 8, 16, 32, the loop path)
    layout = (torch.arange(block_cols)[None, None, :] < lengths[None, :, None]).expand(heads, -1, -1).long()
    layout = layout[:, :, torch.randperm(block_cols)].contiguous()  # columns shuffled: lengths stay
    layout[1, 3] = 0
    lut = lookup_table(layout, block, DEVICE)
    launches = blocksparse._schedule(lut, 0.0)
    assert len(launches) >= 4 and any(not tile for _, _, (tile, _, _) in launches)
    x = (torch.randn(2, lut.nnz, block, block, device=DEVICE) * 2).to(dtype)
    if tiles:   # the interpreter is slow: each case runs only the kernels it is about
        y = reference_blocksparse(x, layout, block, 0.5, is_causal).to(dtype)
    else:
        # the streamed parts' max is a min for a negative scale; 0: the kernel forms the scores
        for scale in (-0.5, 0.0, 0.5) if kernels in ("rows", "across") else (0.5,):
            y = multisoft.blocksparse_softmax(x, layout, block, scale=scale, is_causal=is_causal, backend="triton")
            assert_close(y, reference_blocksparse(x, layout, block, scale, is_causal), dtype, f"forward, scale {scale}")
    if kernels in ("one-row-programs", "across"):   # the backward takes ROW_WARPS rows a program whatever the layout
        return
    dy = torch.randn_like(y)
    dx = multisoft.blocksparse_softmax_backward(y, dy, layout, block, scale=0.5, backend="triton")
    expected, magnitude = reference_blocksparse_backward(y, dy, layout, block, 0.5)
    assert_close(dx, expected, dtype, "backward", magnitude)


def test_blocksparse_backward_row_kernels_hold_by_the_mean_row():
    """The backward's row kernels hold 512 elements of each row (at least 8 float32 or 4 16-bit blocks, at most the
    power of two covering the mean row), 1024 from a mean row of 2048."""
    from multisoft._blocksparse import lookup_table
    from multisoft_triton import blocksparse

    def layout(block_cols, blocks_per_row):
        return (torch.arange(block_cols)[None, None, :] < blocks_per_row).expand(2, 8, -1).long()

    for block, cols, per_row, size, held in ((16, 256, 64, 4, 32), (64, 64, 16, 4, 8), (128, 32, 9, 4, 8),
                                             (128, 32, 9, 2, 4), (64, 64, 32, 2, 16), (64, 64, 3, 4, 4),
                                             (16, 8, 1, 2, 1)):
        lut = lookup_table(layout(cols, per_row), block, "cpu")
        assert blocksparse._row_blocks(lut, size) == held, (block, per_row, size)


def test_blocksparse_backward_takes_the_tile_kernels_for_long_float32_rows(monkeypatch):
    """The backward takes the row kernel, ROW_WARPS rows a program, but for float32 layouts whose mean row is
    2048 elements or more (TILES_FROM), which take the tile and loop kernels; 16-bit layouts never do."""
    from multisoft._blocksparse import lookup_table
    from multisoft_triton import blocksparse

    taken = []
    monkeypatch.setattr(blocksparse, "_launch_rows",
                        lambda kernel, *args, rows, **constexprs: taken.append((kernel, rows, constexprs["RAW"])))
    monkeypatch.setattr(blocksparse, "_launch_tiles", lambda kernels, *args: taken.append(kernels))

    def backward(block, per_row, dtype):
        layout = (torch.arange(64)[None, None, :] < per_row).expand(2, 8, -1).long()
        y = torch.empty(1, 16 * per_row, block, block, dtype=dtype)
        blocksparse.backward(y, y, y, lookup_table(layout, block, "cpu"), 0.5)
        return taken.pop()

    assert backward(64, 31, torch.float32) == (blocksparse._bwd_rows_kernel, 4, False)     # mean row 1984
    assert backward(64, 32, torch.float32) == (blocksparse._bwd_tile_kernel, blocksparse._bwd_loop_kernel)
    assert backward(16, 64, torch.float32) == (blocksparse._bwd_rows_kernel, 4, False)     # 1024
    assert backward(128, 16, torch.float32) == (blocksparse._bwd_tile_kernel, blocksparse._bwd_loop_kernel)
    assert backward(128, 16, torch.bfloat16) == (blocksparse._bwd_rows_kernel, 4, True)
    assert backward(64, 32, torch.float16) == (blocksparse._bwd_rows_kernel, 4, True)


def test_blocksparse_forward_takes_row_kernels_in_log2_units(monkeypatch):
    """The forward takes the row kernel on every layout, 4 rows a program, 1 for float32 blocks of 64 or more, 16-bit
    blocks of 128, and where the mean row is 2048 or more; it gets c = scale * log2 e and the scale's sign (c = 1 for a
    zero scale, whose scores the kernel forms). Where the mean row is FORWARD_ACROSS_UNTIL or less, it takes the row
    kernel with its rows across a warp's lanes: one warp, B * size / 16 lanes a row, FORWARD_ACROSS_BLOCKS held."""
    from multisoft._blocksparse import lookup_table
    from multisoft_triton import _tuning, blocksparse

    taken, acrosses = [], []
    monkeypatch.setattr(_tuning, "FORWARD_ACROSS_UNTIL", {4: 0, 2: 0})

    def spy(kernel, lut, tensors, c, *extra, rows, warps=None, blocks=None, across=False, **constexprs):
        taken.append((kernel, c, rows, constexprs["SIGN"], constexprs["CAUSAL"]))
        acrosses.append((across, warps, blocks if across else None))

    monkeypatch.setattr(blocksparse, "_launch_rows", spy)

    def launch(block, per_row, scale=1.0, causal=False, dtype=torch.bfloat16):
        layout = (torch.arange(64)[None, None, :] < per_row).expand(2, 8, -1).long()
        x = torch.empty(1, 16 * per_row, block, block, dtype=dtype)
        blocksparse.forward(x, x, lookup_table(layout, block, "cpu"), scale, causal)
        return taken.pop()

    assert launch(64, 7) == (blocksparse._fwd_rows_kernel, blocksparse.LOG2E, 4, 1, False)
    assert launch(16, 64, causal=True)[2:] == (4, 1, True) and launch(64, 31)[2] == 4
    assert launch(64, 32)[2] == 1 and launch(128, 15, causal=True)[2] == 1 and launch(128, 2)[2] == 1
    assert launch(32, 7, dtype=torch.float32)[2] == 4 and launch(64, 7, dtype=torch.float32)[2] == 1
    assert launch(64, 7, scale=-0.5)[1:4] == (-0.5 * blocksparse.LOG2E, 4, -1)
    assert launch(64, 7, scale=0.0)[1:4] == (1.0, 4, 0)
    assert set(acrosses) == {(False, None, None)}
    monkeypatch.setattr(_tuning, "FORWARD_ACROSS_UNTIL", {4: 512, 2: 512})
    monkeypatch.setattr(_tuning, "FORWARD_ACROSS_BLOCKS", {4: 4, 2: 2})
    assert launch(64, 7)[2] == 4 and acrosses[-1] == (True, 1, 2)           # 8 lanes a row of bf16 blocks of 64
    assert launch(16, 31)[2] == 16 and acrosses[-1] == (True, 1, 2)         # 2 lanes: 16 rows (448 elements)
    assert launch(64, 7, dtype=torch.float32)[2] == 2 and acrosses[-1] == (True, 1, 4)
    assert launch(128, 4, dtype=torch.float32)[2] == 1 and acrosses[-1] == (True, 1, 4)   # 32 lanes a row
    assert launch(64, 1)[2] == 4 and acrosses[-1] == (True, 1, 1)           # no more blocks than the mean row's
    assert launch(64, 9)[2] == 4 and acrosses[-1][0] is False                # 576 elements: the row kernel


def test_blocksparse_schedule_groups_rows_by_length_only_when_it_pays():
    from multisoft._blocksparse import lookup_table
    from multisoft_triton import blocksparse

    causal = torch.ones(2, 64, 64, dtype=torch.long).tril()         # block-rows of 1..64 blocks
    lut = lookup_table(causal, 16, "cpu")
    launches = blocksparse._schedule(lut, 0.3)
    assert [plan[1] for _, _, plan in launches] == [1, 2, 4, 8, 16, 32, 64]
    assert sum(groups for _, groups, _ in launches) == 2 * 64
    tables = torch.cat([table for table, _, _ in launches])        # (first block, blocks) per block-row
    block_row_at = {start: g for g, start in enumerate(lut.offsets.tolist()[:-1])}
    block_rows = [block_row_at[start] for start in tables[:, 0].tolist()]
    assert sorted(block_rows) == list(range(128))
    assert tables[:, 1].tolist() == [g % 64 + 1 for g in block_rows]
    uniform = torch.ones(2, 64, 64, dtype=torch.long)
    uniform[:, ::2, 24:] = 0   # 24 or 64 blocks: padding 24 to 32 saves 25 %, too little for two launches
    uniform[1, 5] = 0                                                 # an empty block-row is not launched
    (launch,) = blocksparse._schedule(lookup_table(uniform, 16, "cpu"), 0.3)
    assert launch[1] == 127 and (launch[0][:, 1] > 0).all()


@needs_kernels
def test_blocksparse_batch_split_over_launches(monkeypatch):
    """Z beyond a grid axis: the batch is launched in parts (here parts of 2)."""
    import multisoft
    from multisoft_triton import blocksparse

    monkeypatch.setattr(blocksparse, "MAX_GRID_Z", 2)
    layout = torch.ones(1, 3, 3, dtype=torch.long).tril()
    x = torch.randn(5, int(layout.sum()), 16, 16, device=DEVICE)
    y = multisoft.blocksparse_softmax(x, layout, 16, is_causal=True, backend="triton")
    assert_close(y, reference_blocksparse(x, layout, 16, 1.0, True), torch.float32, "forward")


class _StandInCompiled:
    """What a compiled Triton kernel offers `launch`: its launcher and the metadata it passes."""

    function, packed_metadata = "function", "metadata"

    def __init__(self, log):
        self.log = log

    def launch_metadata(self, grid, stream, *args):
        return None

    def run(self, *args):
        self.log.append(("direct", args))


class _StandInKernel:
    """A JITFunction as `launch` sees it: kernel[grid](*args, **kwargs) compiles (here: records) and returns the
    compiled kernel; arg_names lists every parameter, constexprs included."""

    arg_names = ["x_ptr", "n", "BLOCK", "LOG"]

    def __init__(self):
        self.log = []

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.log.append(("triton", grid, args, kwargs))
            return _StandInCompiled(self.log)
        return run


def test_launch_reuses_a_compiled_kernel_only_for_the_same_specialisation(monkeypatch):
    """The first call of a specialisation goes through triton; repeats go straight to the launcher with every
    parameter in order; a new alignment, an int that changes its specialisation (1, a multiple of 16, past int32)
    or another constexpr goes through triton again."""
    pytest.importorskip("triton")
    from multisoft_triton import _launch

    monkeypatch.setattr(_launch, "_DIRECT", True)
    monkeypatch.setattr(_launch, "_ready", {})
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(_launch, "_current_stream", lambda device: 1234)
    kernel = _StandInKernel()
    x = torch.zeros(64)
    _launch.launch(kernel, (4,), x, 20, BLOCK=32, LOG=False, num_warps=4)
    _launch.launch(kernel, (5,), x, 36, BLOCK=32, LOG=False, num_warps=4)   # same specialisation
    assert [entry[0] for entry in kernel.log] == ["triton", "direct"]
    assert kernel.log[1][1] == (5, 1, 1, 1234, "function", "metadata", None, *kernel.log[1][1][7:9], x, 36, 32, False)
    for args, kwargs in [((x[1:], 36), {}),                   # unaligned pointer
                         ((x, 1), {}), ((x, 48), {}), ((x, 2**31), {}),
                         ((x, 36), {"BLOCK": 64}), ((x, 36), {"LOG": True}), ((x, 36), {"num_warps": 8})]:
        before = len(kernel.log)
        _launch.launch(kernel, (4,), *args, **{"BLOCK": 32, "LOG": False, "num_warps": 4, **kwargs})
        assert kernel.log[before][0] == "triton", (args, kwargs)
    _launch.launch(kernel, (4,), x, 2**31 + 16, BLOCK=32, LOG=False, num_warps=4)   # as 2**31: int64, 16 | n
    assert kernel.log[-1][0] == "direct"
    _launch.launch(kernel, (4,), x, 2**31 + 17, BLOCK=32, LOG=False, num_warps=4)
    assert kernel.log[-1][0] == "triton"


@needs_cuda
def test_repeated_launches_follow_each_call_specialisation():
    """Calls that alternate shapes, alignments and dtypes through the launch cache each match float64."""
    from multisoft_triton import softmax

    for n, offset, dtype in [(1000, 0, torch.float32), (1024, 0, torch.float32), (1000, 1, torch.float32),
                             (1024, 1, torch.float32), (1024, 0, torch.bfloat16), (1, 0, torch.float32),
                             (1000, 0, torch.float32), (1024, 1, torch.float32)] * 2:
        base = torch.randn(8 * n + offset, device=DEVICE).to(dtype)
        x = base[offset:].view(8, n)
        out = torch.empty_like(x)
        softmax.forward(x, out, False)
        assert_close(out, reference_softmax(x, -1, False), dtype, f"softmax of {n} columns at offset {offset}")


# -- cross-entropy over a slice of the classes (vocabulary-parallel): row_stats and gradient


@needs_kernels
@pytest.mark.parametrize("options", ["weight-smoothing", "everything", "plain"], ids=str)
@pytest.mark.parametrize("ce_path", CE_PATHS, indirect=True)
def test_cross_entropy_row_stats_on_each_path(ce_path, options):
    """forward(..., row_stats) on the tile and the loop kernel: m, S, sum w u of every row (a row of -inf only, a
    row whose first chunk is -inf, a NaN row, an ignored row) against float64; loss, lse, row_weight and the
    gradient bit for bit as without row_stats."""
    from multisoft_triton import cross_entropy

    weighted, smoothing, softcap, lse_square_scale, ignore_index = CE_OPTIONS[options]
    rows, classes = 6, 40
    logits = torch.randn(rows, classes, device=DEVICE) * 3
    logits[0] = float("-inf")
    logits[1, :20] = float("-inf")
    logits[2, 7] = float("nan")
    target = torch.tensor([1, 30, 2, ignore_index, 39, 0], device=DEVICE)
    weight = torch.rand(classes, device=DEVICE) + 0.5 if weighted else None
    grad_scale = torch.rand(rows, device=DEVICE) + 0.5
    options = LossOptions(ignore_index=ignore_index, label_smoothing=smoothing, softcap=softcap,
                          lse_square_scale=lse_square_scale)
    plain_grad, stats_grad = torch.empty_like(logits), torch.empty_like(logits)
    plain = _run_cross_entropy(logits, target, weight, plain_grad, grad_scale, options)
    with_stats = torch.full((3, rows), 12345.0, device=DEVICE)
    row_stats = torch.full((3, rows), 12345.0, device=DEVICE)
    cross_entropy.forward(logits, target, weight, *with_stats, stats_grad, grad_scale, options, row_stats=row_stats)
    torch.testing.assert_close(with_stats, plain, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(stats_grad, plain_grad, rtol=0, atol=0, equal_nan=True)
    assert_row_stats(row_stats, row_stats_contract(logits, weight, options), f"row_stats, {ce_path} path")
    if not softcap:   # (capped, -inf is -softcap)
        assert row_stats[0, 0] == -float("inf") and row_stats[1, 0] == 0
    assert torch.isnan(row_stats[:2, 2]).all()


def _check_slice_gradient(dtype, rows, classes, weighted, softcap, in_place):
    """gradient of a slice of wider float64 rows (m and S of the whole rows) against the formula; every target kind
    (in the slice, below, past, ignore_index, beyond 32 bits)."""
    from multisoft_triton import cross_entropy

    wide = (torch.randn(rows, classes + 30, device=DEVICE, dtype=torch.float64) * 3).to(dtype).double()
    wide[:, 0] += 5.0
    u = softcap * torch.tanh(wide / softcap) if softcap else wide
    m = u.max(1).values
    row_max_sum = torch.stack([m, torch.exp(u - m[:, None]).sum(1)]).float()
    logits = wide[:, 10:10 + classes].to(dtype).contiguous()
    original = logits.clone()
    kinds = [0, classes - 1, classes // 2, -1, classes, -100, 2**40]
    target = torch.tensor([kinds[i % len(kinds)] for i in range(rows)], device=DEVICE)
    weight = torch.rand(classes, device=DEVICE) + 0.5 if weighted else None
    coefficients = torch.rand(3, rows, device=DEVICE) + torch.tensor([[0.5], [0.5], [0.0]], device=DEVICE)
    grad = logits if in_place else torch.full_like(logits, 7.0)
    cross_entropy.gradient(logits, target, weight, row_max_sum, coefficients, grad, LossOptions(softcap=softcap))
    expected, magnitude = reference_slice_gradient(original, target, weight, row_max_sum, coefficients, softcap)
    assert_close(grad, expected, dtype, f"gradient {rows}x{classes}", magnitude)
    if not in_place:
        assert torch.equal(logits, original)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("weighted, softcap, in_place", [(False, 0.0, False), (True, 3.0, True), (True, 0.0, False)])
def test_cross_entropy_gradient_tiles(dtype, weighted, softcap, in_place, monkeypatch):
    """gradient in programs of 16 columns, 32 elements: a row cut among several programs (a last one mostly masked),
    two short rows a program, a row of one column."""
    from multisoft_triton import _tuning

    monkeypatch.setattr(_tuning, "CE_GRADIENT_BLOCK", {4: 16, 2: 16})
    monkeypatch.setattr(_tuning, "CE_GRADIENT_ELEMENTS", {4: 32, 2: 32})
    for rows, classes in ((7, 53), (9, 5), (3, 1)):
        _check_slice_gradient(dtype, rows, classes, weighted, softcap, in_place)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cross_entropy_slice_at_the_tuned_sizes(dtype):
    """gradient at the tuned program sizes on vocabulary-slice rows (several programs a row, and one program of
    several rows), and row_stats on the tile and the loop kernel."""
    from multisoft_triton import _tuning, cross_entropy

    block = _tuning.CE_GRADIENT_BLOCK[dtype.itemsize]
    for rows, classes in ((7, 3 * block + 5), (33, 100), (2, 16032)):
        _check_slice_gradient(dtype, rows, classes, True, 0.0, False)
        _check_slice_gradient(dtype, rows, classes, False, 30.0, True)
    for classes in (1000, 3 * _tuning.CE_LOOP_GRAD_CONFIGS[dtype.itemsize][0] + 5):
        logits = (torch.randn(5, classes, device=DEVICE) * 3).to(dtype)
        logits[3, 5] = float("nan")
        target = torch.tensor([0, -100, classes - 1, 4, classes], device=DEVICE)
        weight = torch.rand(classes, device=DEVICE) + 0.5
        for grad in (None, torch.empty_like(logits)):
            grad_scale = None if grad is None else torch.rand(5, device=DEVICE)
            row_stats = torch.full((3, 5), 12345.0, device=DEVICE)
            outputs = torch.empty(3, 5, device=DEVICE)
            options = LossOptions(ignore_index=-100, label_smoothing=0.1)
            cross_entropy.forward(logits, target, weight, *outputs, grad, grad_scale, options, row_stats=row_stats)
            assert_row_stats(row_stats, row_stats_contract(logits, weight, options), f"row_stats, {classes} classes")
            assert torch.isnan(row_stats[:, 3]).all()
