"""A block-sparse layout written in place after its look-up table was cached, and BlockSparseLayout.

A call must give the result for the layout as it is when the call is made, or raise: never the result of the
contents that the cached table was built from. Writes through ``.data`` and through a NumPy view do not bump
``layout._version``. Every expected value is float64 dense torch (masked scores, softmax, then the layout's
blocks taken by hand in ``layout.nonzero()`` order), never multisoft's helpers.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import multisoft
from harness import BACKENDS, DEVICE, ON_GPU, assert_close, on_each_backend
from multisoft.check import _softmax_backward_terms


B = 16
FIRST = [[[1, 1], [1, 0]]]                       # 3 blocks
REWRITES = {"same_count": [[[1, 0], [1, 1]]],    # 3 blocks elsewhere: the cached table fits x's shape
            "other_count": [[[1, 0], [0, 1]]]}   # 2 blocks


def _write(layout, contents, how):
    """Writes that leave layout._version as it was."""
    new = torch.tensor(contents, dtype=layout.dtype)
    if how == "data":
        layout.data[...] = new.to(layout.device)
    else:
        layout.numpy()[...] = new.numpy()
    assert torch.equal(layout.cpu(), new)


def _mask(layout, m, n, is_causal):
    mask = layout.bool().repeat_interleave(B, 1).repeat_interleave(B, 2)
    if is_causal:
        mask = mask & torch.ones(m, n, dtype=torch.bool, device=layout.device).tril()
    return mask


def _blocks(dense, layout):
    """The blocks of dense (Z, H, M, N) under layout, in layout.nonzero() order, by hand."""
    return torch.stack([dense[:, h, r * B:(r + 1) * B, c * B:(c + 1) * B]
                        for h, r, c in layout.cpu().nonzero().tolist()], 1)


def _dense(blocks, layout):
    """Dense (Z, H, M, N) zeros with the blocks put back under layout, by hand."""
    heads, rows, cols = layout.shape
    dense = blocks.new_zeros(blocks.shape[0], heads, rows * B, cols * B, dtype=torch.float64)
    for i, (h, r, c) in enumerate(layout.cpu().nonzero().tolist()):
        dense[:, h, r * B:(r + 1) * B, c * B:(c + 1) * B] = blocks[:, i]
    return dense


def _expected_softmax(dense, layout, scale, is_causal=False):
    mask = _mask(layout.cpu(), *dense.shape[-2:], is_causal).to(dense.device)
    scores = (scale * dense.double()).masked_fill(~mask, float("-inf"))
    return _blocks(torch.softmax(scores, -1).masked_fill(~mask, 0.0), layout)


def _expected_backward(y, dy, layout, scale):
    """(dx, the size of its terms) in float64 from y and dy, dense."""
    dx, magnitude = _softmax_backward_terms(_dense(y, layout), _dense(dy, layout), -1, False)
    return _blocks(scale * dx, layout), _blocks(abs(scale) * magnitude, layout)


def _check_forward_and_backward(dense, layout_argument, layout_now, backend, scale=0.5, is_causal=False):
    """blocksparse_softmax of layout_now's blocks of dense, and its gradient, against float64 results."""
    x = _blocks(dense, layout_now).requires_grad_()
    y = multisoft.blocksparse_softmax(x, layout_argument, B, scale=scale, is_causal=is_causal, backend=backend)
    assert_close(y, _expected_softmax(dense, layout_now, scale, is_causal), torch.float32, "forward")
    dy = torch.randn_like(y)
    (dx,) = torch.autograd.grad(y, x, dy)
    expected, magnitude = _expected_backward(y, dy, layout_now, scale)
    assert_close(dx, expected, torch.float32, "backward", magnitude)


# -- a layout tensor written in place


@pytest.mark.parametrize("rewrite", sorted(REWRITES))
@pytest.mark.parametrize("how", ["data", "numpy"])
@on_each_backend
def test_layout_written_in_place_gives_the_result_of_its_new_contents(backend, how, rewrite):
    layout = torch.tensor(FIRST)
    dense = torch.randn(1, 1, 2 * B, 2 * B, device=DEVICE)
    _check_forward_and_backward(dense, layout, layout.clone(), backend, is_causal=True)
    _write(layout, REWRITES[rewrite], how)
    _check_forward_and_backward(dense, layout, layout.clone(), backend, is_causal=True)


@pytest.mark.parametrize("rewrite", sorted(REWRITES))
@pytest.mark.parametrize("how", ["data", "numpy"])
@on_each_backend
def test_backward_function_after_the_layout_was_written_in_place(backend, how, rewrite):
    layout = torch.tensor(FIRST)

    def probabilities_and_gradient():
        """A y that is a softmax of the layout as it is (float64 dense torch), an incoming dy, blocks of both."""
        dense = torch.randn(2, 1, 2 * B, 2 * B, device=DEVICE)
        y = _expected_softmax(dense, layout, 1.0).float()
        return y, torch.randn_like(y)

    multisoft.blocksparse_softmax_backward(*probabilities_and_gradient(), layout, B, scale=0.7, backend=backend)
    _write(layout, REWRITES[rewrite], how)
    y, dy = probabilities_and_gradient()
    dx = multisoft.blocksparse_softmax_backward(y, dy, layout, B, scale=0.7, backend=backend)
    expected, magnitude = _expected_backward(y, dy, layout, 0.7)
    assert_close(dx, expected, torch.float32, "blocksparse_softmax_backward", magnitude)


@on_each_backend
def test_layout_given_another_shape_through_data(backend):
    layout = torch.tensor(FIRST)
    dense = torch.randn(1, 1, 2 * B, 2 * B, device=DEVICE)
    multisoft.blocksparse_softmax(_blocks(dense, layout), layout, B, backend=backend)
    layout.data = torch.tensor([[[1, 0, 1], [0, 1, 1]]])
    dense = torch.randn(1, 1, 2 * B, 3 * B, device=DEVICE)
    _check_forward_and_backward(dense, layout, layout.clone(), backend)


@pytest.mark.parametrize("how", ["data", "numpy"])
def test_dense_helpers_follow_a_layout_written_in_place(how):
    """blocksparse_from_dense and blocksparse_to_dense place the blocks of the layout as it is now."""
    layout = torch.tensor(FIRST)
    dense = torch.randn(2, 1, 2 * B, 2 * B, device=DEVICE)
    multisoft.blocksparse_to_dense(multisoft.blocksparse_from_dense(dense, layout, B), layout, B)
    for contents in (REWRITES["same_count"], REWRITES["other_count"]):
        _write(layout, contents, how)
        blocks = multisoft.blocksparse_from_dense(dense, layout, B)
        assert torch.equal(blocks, _blocks(dense, layout))
        back = multisoft.blocksparse_to_dense(blocks, layout, B, fill=-3.0)
        mask = _mask(layout, 2 * B, 2 * B, False).to(DEVICE).expand_as(dense)
        assert torch.equal(back[mask], dense[mask]) and (back[~mask] == -3.0).all()


def test_what_a_call_with_a_cached_layout_runs_to_find_its_table():
    """An unchanged CPU layout costs one torch.equal on the host; a BlockSparseLayout nothing."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from multisoft._blocksparse import lookup_table

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(str(func))
            return func(*args, **(kwargs or {}))

    layout = torch.tensor(FIRST)
    fixed = multisoft.BlockSparseLayout(layout, B)
    first, owned = lookup_table(layout, B, DEVICE), lookup_table(fixed, B, DEVICE)
    with Ops() as ops:
        assert lookup_table(layout, B, DEVICE) is first and lookup_table(fixed, B, DEVICE) is owned
    assert ops.names == ["aten.equal.default"]


# -- BlockSparseLayout


@pytest.mark.parametrize("how", ["data", "numpy"])
@on_each_backend
def test_block_sparse_layout_is_read_once(backend, how):
    source = torch.tensor(FIRST)
    kept = source.clone()
    fixed = multisoft.BlockSparseLayout(source, B)
    dense = torch.randn(1, 1, 2 * B, 2 * B, device=DEVICE)
    _check_forward_and_backward(dense, fixed, kept, backend)
    for contents in (REWRITES["same_count"], REWRITES["other_count"]):   # no effect on what it read
        _write(source, contents, how)
        _check_forward_and_backward(dense, fixed, kept, backend, is_causal=True)
    y = _expected_softmax(dense, kept, 1.0).float()
    dy = torch.randn_like(y)
    expected, magnitude = _expected_backward(y, dy, kept, 1.0)
    assert_close(multisoft.blocksparse_softmax_backward(y, dy, fixed, B, backend=backend), expected, torch.float32,
                 "blocksparse_softmax_backward", magnitude)


def test_block_sparse_layout_with_the_dense_helpers_and_its_description():
    source = torch.tensor([[[1, 0, 1], [0, 1, 0]], [[0, 0, 1], [1, 1, 1]]], dtype=torch.uint8)
    kept = source.clone()
    fixed = multisoft.BlockSparseLayout(source, B)
    source.zero_()
    assert fixed.block == B and fixed.shape == (2, 2, 3) and fixed.nnz == 7
    assert repr(fixed) == "BlockSparseLayout(heads=2, block_rows=2, block_cols=3, block=16, nnz=7)"
    copy = fixed.tensor()
    assert torch.equal(copy, kept) and copy.dtype == torch.uint8
    copy.zero_()   # a copy: writing it changes nothing either
    dense = torch.randn(3, 2, 2 * B, 3 * B, device=DEVICE)
    blocks = multisoft.blocksparse_from_dense(dense, fixed, B)
    assert torch.equal(blocks, _blocks(dense, kept))
    back = multisoft.blocksparse_to_dense(blocks, fixed, B, fill=-7.0)
    mask = _mask(kept, 2 * B, 3 * B, False).to(DEVICE).expand_as(dense)
    assert torch.equal(back[mask], dense[mask]) and (back[~mask] == -7.0).all()


@pytest.mark.parametrize("call, error, pattern", [
    (lambda fixed: multisoft.blocksparse_softmax(torch.randn(1, 3, 32, 32), fixed, 32),
     ValueError, "block must be the BlockSparseLayout's block, 16, got 32"),
    (lambda fixed: multisoft.blocksparse_softmax_backward(torch.randn(1, 3, 16, 16), torch.randn(1, 3, 16, 16),
                                                          fixed, 64), ValueError, "block must be the BlockSparse"),
    (lambda fixed: multisoft.blocksparse_from_dense(torch.randn(1, 1, 64, 64), fixed, 32),
     ValueError, "block must be the BlockSparseLayout's block"),
    (lambda fixed: multisoft.blocksparse_to_dense(torch.randn(1, 3, 16, 16), fixed, 16.0),
     TypeError, "block must be an int"),
    (lambda fixed: multisoft.blocksparse_softmax(torch.randn(1, 2, 16, 16), fixed, 16),
     ValueError, r"x must have shape \(Z, 3, 16, 16\)"),
    (lambda fixed: multisoft.blocksparse_softmax(torch.randn(1, 3, 16, 16), fixed.tensor().tolist(), 16),
     TypeError, "layout must be a torch.Tensor or a multisoft.BlockSparseLayout, got list"),
    (lambda fixed: multisoft.BlockSparseLayout(torch.ones(2, 2), 16), ValueError, "layout must be 3-D"),
    (lambda fixed: multisoft.BlockSparseLayout(torch.full((1, 1, 1), 2), 16), ValueError, "only 0 and 1"),
    (lambda fixed: multisoft.BlockSparseLayout(torch.ones(1, 1, 1), 16), TypeError, "integer or bool"),
    (lambda fixed: multisoft.BlockSparseLayout(torch.ones(1, 1, 1, dtype=torch.long), 24),
     ValueError, "block must be one of"),
    (lambda fixed: multisoft.BlockSparseLayout([[[1]]], 16), TypeError, "layout must be a torch.Tensor, got list"),
])
def test_block_sparse_layout_bad_arguments(call, error, pattern):
    fixed = multisoft.BlockSparseLayout(torch.tensor(FIRST), B)
    with pytest.raises(error, match=pattern):
        call(fixed)


# -- torch.compile


def test_compiled_call_follows_a_cpu_layout_written_between_calls():
    torch._dynamo.reset()
    layout = torch.tensor(FIRST)

    def step(x):
        return multisoft.blocksparse_softmax(x, layout, B, scale=0.5, backend="torch") * 1.0

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    dense = torch.randn(2, 1, 2 * B, 2 * B, device=DEVICE)
    for contents, how in ((FIRST, None), (REWRITES["same_count"], "data"), (REWRITES["other_count"], "numpy"),
                          ([[[1, 1], [1, 1]]], "data")):
        if how is not None:
            _write(layout, contents, how)
        x = _blocks(dense, layout).requires_grad_()
        y = compiled(x)
        assert_close(y, _expected_softmax(dense, layout, 0.5), torch.float32, f"compiled forward, {contents}")
        dy = torch.randn_like(y)
        (dx,) = torch.autograd.grad(y, x, dy)
        expected, magnitude = _expected_backward(y, dy, layout, 0.5)
        assert_close(dx, expected, torch.float32, f"compiled backward, {contents}", magnitude)


def test_compiled_backward_refuses_a_layout_written_since_its_forward():
    """The compiled backward reads the layout again: a write between the forward and it raises, rather than
    differentiate with another layout than the forward's."""
    torch._dynamo.reset()
    layout = torch.tensor(FIRST)
    compiled = torch.compile(lambda x: multisoft.blocksparse_softmax(x, layout, B, backend="torch") * 1.0,
                             fullgraph=True, backend="aot_eager")
    x = torch.randn(1, 3, B, B, device=DEVICE, requires_grad=True)
    y = compiled(x)
    _write(layout, REWRITES["same_count"], "data")
    with pytest.raises(ValueError, match="layout was written in place between a torch.compile'd"):
        y.sum().backward()


def test_compiled_call_with_a_block_sparse_layout():
    torch._dynamo.reset()
    source = torch.tensor(FIRST)
    kept = source.clone()
    fixed = multisoft.BlockSparseLayout(source, B)

    def step(x, layout):
        return multisoft.blocksparse_softmax(x, layout, B, scale=0.5, backend="torch") * 1.0

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    dense = torch.randn(2, 1, 2 * B, 2 * B, device=DEVICE)
    for contents in (None, REWRITES["same_count"]):
        if contents is not None:
            _write(source, contents, "data")
        x = _blocks(dense, kept).requires_grad_()
        y = compiled(x, fixed)
        assert_close(y, _expected_softmax(dense, kept, 0.5), torch.float32, "compiled forward")
        dy = torch.randn_like(y)
        (dx,) = torch.autograd.grad(y, x, dy)
        expected, magnitude = _expected_backward(y, dy, kept, 0.5)
        assert_close(dx, expected, torch.float32, "compiled backward", magnitude)


# -- a layout on a GPU: compared on the device, never waited for

GPU_BACKENDS = [name for name in BACKENDS if name != "reference"] if ON_GPU else []
on_gpu = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device")


@on_gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_common_call_with_a_gpu_layout_does_not_synchronise(backend):
    layout = torch.tensor(FIRST, device=DEVICE)
    dense = torch.randn(2, 1, 2 * B, 2 * B, device=DEVICE)
    x = _blocks(dense, layout).requires_grad_()
    multisoft.blocksparse_softmax(x, layout, B, backend=backend).sum().backward()   # builds and caches
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        y = multisoft.blocksparse_softmax(x, layout, B, scale=0.5, backend=backend)
        dy = torch.randn_like(y)
        (dx,) = torch.autograd.grad(y, x, dy)
        blocks = multisoft.blocksparse_from_dense(dense, layout, B)
        back = multisoft.blocksparse_to_dense(blocks, layout, B)
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    assert_close(y, _expected_softmax(dense, layout, 0.5), torch.float32, "forward")
    expected, magnitude = _expected_backward(y, dy, layout, 0.5)
    assert_close(dx, expected, torch.float32, "backward", magnitude)
    assert torch.equal(blocks, _blocks(dense, layout)) and torch.equal(back, _dense(blocks, layout).float())


@on_gpu
def test_gpu_layout_written_to_another_block_count_names_the_layout():
    """x fits the layout as it is now but not the cached table: the layout is read again (on this error path only)
    and the error says it changed, rather than blame x; an x that fits neither is still blamed."""
    layout = torch.tensor(FIRST, device=DEVICE)
    multisoft.blocksparse_softmax(torch.randn(1, 3, B, B, device=DEVICE), layout, B, backend="torch")
    with pytest.raises(ValueError, match=r"x must have shape \(Z, 3, 16, 16\)"):
        multisoft.blocksparse_softmax(torch.randn(1, 4, B, B, device=DEVICE), layout, B, backend="torch")
    _write(layout, REWRITES["other_count"], "data")
    with pytest.raises(ValueError, match=r"layout \(on cuda:0\) was written in place after its look-up table"):
        multisoft.blocksparse_softmax(torch.randn(1, 2, B, B, device=DEVICE), layout, B, backend="torch")
    torch.cuda.synchronize()   # nothing was left queued that fails


_WRITTEN_GPU_LAYOUT = """
import torch, multisoft
layout = torch.tensor({first}, device="cuda")
x = torch.randn(2, 3, {block}, {block}, device="cuda")


def call(x):
    return multisoft.blocksparse_softmax(x, layout, {block}, backend="torch")


if "{mode}" == "compiled":
    call = torch.compile(call, fullgraph=True, backend="aot_eager")
if "{mode}" == "graph":
    for _ in range(2):
        call(x)   # builds the table before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call(x)

    def call(x):
        graph.replay()

for _ in range(2):
    call(x)
torch.cuda.synchronize()
print("unchanged layout: no assertion", flush=True)
layout.data[...] = torch.tensor({rewrite}, device="cuda")
call(x)
torch.cuda.synchronize()
print("written layout: no assertion", flush=True)
"""


@on_gpu
@pytest.mark.parametrize("mode", ["eager", "compiled", "graph"])
def test_gpu_layout_written_in_place_fails_a_device_side_assertion(mode):
    """In a subprocess: a device-side assertion leaves the CUDA context unusable."""
    script = _WRITTEN_GPU_LAYOUT.format(first=FIRST, rewrite=REWRITES["same_count"], block=B, mode=mode)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert "unchanged layout: no assertion" in run.stdout, run.stdout + run.stderr
    assert run.returncode != 0 and "written layout: no assertion" not in run.stdout, run.stdout + run.stderr
    assert "device-side assert triggered" in run.stderr, run.stderr
