"""The front: backend resolution, validation errors, helpers, autograd, torch.library and torch.compile."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest
import torch
import torch.nn.functional as F

import multisoft
from multisoft import _registry
from multisoft.check import reference_cross_entropy

# -- resolution: argument > use_backend > environment > default


@pytest.fixture
def ran(monkeypatch):
    """Names of the backends whose softmax kernel ran, in order."""
    calls = []
    real = _registry.Backend.kernels

    def kernels(self, op):
        calls.append(self.name)
        return real(_registry.get_backend("torch"), op)

    monkeypatch.setattr(_registry.Backend, "kernels", kernels)
    monkeypatch.setattr(_registry.Backend, "unavailable_reason", lambda self, device, dtype: None)
    monkeypatch.delenv(_registry.ENV_VAR, raising=False)
    return calls


def _fake_names():
    names = [n for n in _registry.backend_names() if n != "torch"]
    if not names:
        pytest.skip("needs a second backend package installed")
    return names[0]


def test_resolution_order(ran, monkeypatch):
    other = _fake_names()
    x = torch.randn(2, 3)
    multisoft.softmax(x, -1)
    assert ran[-1] == _registry.backend_names()[0], "default: the highest-priority backend that can run"
    monkeypatch.setenv(_registry.ENV_VAR, "torch")
    multisoft.softmax(x, -1)
    assert ran[-1] == "torch", "environment beats the default"
    with multisoft.use_backend(other):
        multisoft.softmax(x, -1)
        assert ran[-1] == other, "use_backend beats the environment"
        multisoft.softmax(x, -1, backend="torch")
        assert ran[-1] == "torch", "the argument beats use_backend"
        with multisoft.use_backend("torch"):
            multisoft.softmax(x, -1)
            assert ran[-1] == "torch", "the innermost use_backend wins"
        multisoft.softmax(x, -1)
        assert ran[-1] == other
    monkeypatch.setenv(_registry.ENV_VAR, f"nonexistent_but_listed_later, {other}")
    with pytest.raises(ValueError, match="unknown backend"):
        multisoft.softmax(x, -1)
    monkeypatch.setenv(_registry.ENV_VAR, f"{other},torch")
    multisoft.softmax(x, -1)
    assert ran[-1] == other, "a priority list takes the first that can run"


def test_environment_priority_list_skips_what_cannot_run(monkeypatch):
    monkeypatch.setenv(_registry.ENV_VAR, "cupy,torch")
    assert _registry.get_backend("cupy").unavailable_reason(torch.device("cpu"), torch.float32) is not None
    x = torch.randn(3, 4)
    torch.testing.assert_close(multisoft.softmax(x, -1), torch.softmax(x, -1))
    assert _registry.resolve(x.device, x.dtype).name == "torch"
    monkeypatch.setenv(_registry.ENV_VAR, "cupy")
    with pytest.raises(multisoft.BackendUnavailableError, match="cupy"):
        multisoft.softmax(x, -1)


def test_a_bad_environment_variable_is_named_in_the_error(monkeypatch):
    """A name in $MULTISOFT_BACKEND that is not a backend, or the one it names that cannot run, is reported as the
    variable's fault (with its value), not as if ``backend=`` were wrong; ``backend=`` is reported as itself."""
    x = torch.randn(2, 3)
    for value in ("foo", "torch, foo"):
        monkeypatch.setenv(_registry.ENV_VAR, value)
        with pytest.raises(ValueError, match=rf"^environment variable MULTISOFT_BACKEND={value!r}: unknown backend "
                                             r"'foo'; known backends: .*torch"):
            multisoft.softmax(x, -1)
    monkeypatch.setenv(_registry.ENV_VAR, "torch")
    monkeypatch.setattr(_registry.get_backend("torch").module, "unavailable_reason", lambda device, dtype: "no CUDA")
    with pytest.raises(multisoft.BackendUnavailableError,
                       match=r"^MULTISOFT_BACKEND='torch': backend 'torch' cannot run on cpu .*: no CUDA"):
        multisoft.softmax(x, -1)
    monkeypatch.setenv(_registry.ENV_VAR, "reference")
    with pytest.raises(ValueError, match="^unknown backend 'foo'") as raised:
        multisoft.softmax(x, -1, backend="foo")
    assert _registry.ENV_VAR not in str(raised.value)


def test_compiled_code_keeps_the_backend_chosen_when_it_was_traced(ran, monkeypatch):
    """What the README and use_backend's docstring say: under torch.compile the choice by use_backend and
    $MULTISOFT_BACKEND is made at trace time and kept (no guard, no recompilation) until the code is traced again."""
    compiled = torch.compile(lambda t: multisoft.softmax(t, -1), fullgraph=True, backend="eager")
    x = torch.randn(3, 5)
    torch.compiler.reset()
    try:
        monkeypatch.setenv(_registry.ENV_VAR, "reference")
        torch.testing.assert_close(compiled(x), torch.softmax(x, -1))
        assert ran[-1] == "reference"
        monkeypatch.setenv(_registry.ENV_VAR, "torch")
        compiled(x)
        assert ran[-1] == "reference", "the variable changed after tracing: the graph keeps its backend"
        with multisoft.use_backend("torch"):
            compiled(x)
        assert ran[-1] == "reference", "use_backend after tracing: the graph keeps its backend"
        torch.compiler.reset()
        compiled(x)
        assert ran[-1] == "torch", "traced again: the variable as it is now"
    finally:
        torch.compiler.reset()


def test_use_backend_is_thread_local():
    seen = {}

    def worker():
        seen["inner"] = _registry._current.get()

    with multisoft.use_backend("torch"):
        thread = threading.Thread(target=worker)
        thread.start()
        thread.join()
        assert _registry._current.get() == "torch"
    assert seen["inner"] is None
    assert _registry._current.get() is None


def test_unknown_backend_lists_known_ones():
    with pytest.raises(ValueError, match=r"unknown backend 'nope'.*torch"):
        multisoft.softmax(torch.randn(2, 2), -1, backend="nope")
    with pytest.raises(ValueError, match="unknown backend"):
        with multisoft.use_backend("nope"):
            pass


def test_named_backend_that_cannot_run_raises_with_reason(monkeypatch):
    backend = _registry.get_backend("torch")
    monkeypatch.setattr(backend.module, "unavailable_reason", lambda device, dtype: "no CUDA device")
    with pytest.raises(multisoft.BackendUnavailableError, match="no CUDA device"):
        multisoft.softmax(torch.randn(2, 2), -1, backend="torch")


def test_missing_framework_says_how_to_install(monkeypatch):
    backend = _registry.get_backend("torch")
    monkeypatch.setattr(backend.module, "version", lambda: None)
    with pytest.raises(multisoft.BackendUnavailableError, match="not installed.*pip install"):
        multisoft.softmax(torch.randn(2, 2), -1, backend="torch")


def test_automatic_choice_falls_back_to_torch_on_cpu(monkeypatch):
    monkeypatch.delenv(_registry.ENV_VAR, raising=False)
    x = torch.randn(4, 5, dtype=torch.float64)
    torch.testing.assert_close(multisoft.softmax(x, -1), torch.softmax(x, -1))
    assert "torch" in multisoft.available_backends()
    assert "torch" in multisoft.available_backends("cross_entropy")
    with pytest.raises(ValueError, match="op must be one of"):
        multisoft.available_backends("matmul")


def test_import_is_light():
    # torch._dynamo imports Triton where it is installed, before `multisoft check --simulate` can set
    # TRITON_INTERPRET: a decorator such as torch.compiler.disable at import time would break that too
    code = ("import sys, multisoft; heavy = [m for m in ('triton', 'numba', 'cupy', 'torch._dynamo') "
            "if m in sys.modules]; assert not heavy, heavy")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_info_runs():
    out = subprocess.run([sys.executable, "-m", "multisoft", "info"], check=True, capture_output=True, text=True)
    assert "torch" in out.stdout and "available" in out.stdout


# -- validation


@pytest.mark.parametrize("call, error, pattern", [
    (lambda: multisoft.softmax(torch.arange(4), -1), TypeError, "input must have a floating dtype"),
    (lambda: multisoft.softmax([1.0, 2.0]), TypeError, "input must be a torch.Tensor"),
    (lambda: multisoft.softmax(torch.randn(2, 3), dim=2), ValueError, "dim=2 is out of range"),
    (lambda: multisoft.softmax(torch.randn(2, 3), dim=1.0), TypeError, "dim must be an int"),
    (lambda: multisoft.log_softmax(torch.randn(2, 3), -1, dtype=torch.int32), TypeError, "dtype must be"),
    (lambda: multisoft.cross_entropy(torch.arange(6).view(2, 3), torch.zeros(2, dtype=torch.long)),
     TypeError, "input must have a floating dtype"),
    (lambda: multisoft.cross_entropy(torch.randn(2, 3), torch.zeros(2, dtype=torch.int16)), TypeError,
     "target must hold class"),
    (lambda: multisoft.cross_entropy(torch.randn(2, 3), torch.zeros(2)), ValueError,
     "target of class probabilities must have the input's shape"),
    (lambda: multisoft.cross_entropy(torch.randn(2, 3), torch.zeros(3, dtype=torch.long)),
     ValueError, r"target must have shape \(2,\)"),
    (lambda: multisoft.cross_entropy(torch.randn(2, 3, 4), torch.zeros(2, 3, dtype=torch.long)),
     ValueError, r"target must have shape \(2, 4\)"),
    (lambda: multisoft.cross_entropy(torch.randn(2, 3), torch.zeros(2, dtype=torch.long), reduction="avg"),
     ValueError, "reduction must be one of"),
    (lambda: multisoft.cross_entropy(torch.randn(2, 3), torch.zeros(2, dtype=torch.long), label_smoothing=1.5),
     ValueError, r"label_smoothing must be in \[0, 1\]"),
    (lambda: multisoft.cross_entropy(torch.randn(2, 3), torch.zeros(2, dtype=torch.long), weight=torch.ones(4)),
     ValueError, r"weight must have shape \(3,\)"),
    (lambda: multisoft.cross_entropy(torch.randn(2, 3), torch.zeros(2, dtype=torch.long), ignore_index=1.5),
     TypeError, "ignore_index must be an int"),
    (lambda: multisoft.cross_entropy(torch.randn(2, 3), torch.zeros(2, dtype=torch.long), weight=torch.ones(3),
                                     backend="torch", inplace_backward="yes"),
     TypeError, "inplace_backward must be a bool"),
    (lambda: multisoft.cross_entropy(torch.randn(2, 3), torch.zeros(2, dtype=torch.long), softcap=0.0),
     ValueError, "softcap must be a finite number > 0"),
    (lambda: multisoft.cross_entropy(torch.randn(2, 3), torch.zeros(2, dtype=torch.long), softcap=-1.0),
     ValueError, "softcap must be a finite number > 0"),
    (lambda: multisoft.cross_entropy(torch.randn(2, 3), torch.zeros(2, dtype=torch.long), softcap=float("inf")),
     ValueError, "softcap must be a finite number > 0"),
    (lambda: multisoft.cross_entropy(torch.randn(2, 3), torch.zeros(2, dtype=torch.long), softcap=float("nan")),
     ValueError, "softcap must be a finite number > 0"),
    (lambda: multisoft.cross_entropy(torch.randn(2, 3), torch.zeros(2, dtype=torch.long), softcap="30"),
     TypeError, "softcap must be a real number"),
    (lambda: multisoft.cross_entropy(torch.randn(2, 3), torch.zeros(2, dtype=torch.long), softcap=True),
     TypeError, "softcap must be a real number"),
    (lambda: multisoft.cross_entropy(torch.randn(2, 3), torch.zeros(2, dtype=torch.long), lse_square_scale=-1e-4),
     ValueError, "lse_square_scale must be >= 0"),
    (lambda: multisoft.cross_entropy(torch.randn(2, 3), torch.zeros(2, dtype=torch.long),
                                     lse_square_scale=float("inf")), ValueError, "lse_square_scale must be finite"),
    (lambda: multisoft.cross_entropy(torch.randn(2, 3), torch.zeros(2, dtype=torch.long), lse_square_scale=None),
     TypeError, "lse_square_scale must be a real number"),
    (lambda: multisoft.cross_entropy(torch.randn(2, 3), torch.zeros(2, dtype=torch.long), return_lse=1),
     TypeError, "return_lse must be a bool"),
    (lambda: multisoft.cross_entropy(torch.randn(2, 3), torch.zeros(2, dtype=torch.long), process_group="world"),
     TypeError, "process_group must be a torch.distributed ProcessGroup or None, got str"),
    (lambda: multisoft.nn.CrossEntropyLoss(process_group=0)(torch.randn(2, 3), torch.zeros(2, dtype=torch.long)),
     TypeError, "process_group must be a torch.distributed ProcessGroup or None, got int"),
    (lambda: multisoft.blocksparse_softmax(torch.randn(1, 1, 16, 16), torch.ones(1, 1), 16),
     ValueError, "layout must be 3-D"),
    (lambda: multisoft.blocksparse_softmax(torch.randn(1, 1, 16, 16), torch.full((1, 1, 1), 2), 16),
     ValueError, "layout must hold only 0 and 1"),
    (lambda: multisoft.blocksparse_softmax(torch.randn(1, 1, 16, 16), torch.ones(1, 1, 1), 16),
     TypeError, "layout must be an integer or bool"),
    (lambda: multisoft.blocksparse_softmax(torch.randn(1, 1, 24, 24), torch.ones(1, 1, 1, dtype=torch.long), 24),
     ValueError, "block must be one of"),
    (lambda: multisoft.blocksparse_softmax(torch.randn(1, 2, 16, 16), torch.ones(1, 1, 1, dtype=torch.long), 16),
     ValueError, r"x must have shape \(Z, 1, 16, 16\)"),
    (lambda: multisoft.blocksparse_softmax(torch.randn(1, 1, 16, 16), torch.ones(1, 1, 1, dtype=torch.long), 16,
                                           is_causal=1), TypeError, "is_causal must be a bool"),
    (lambda: multisoft.blocksparse_softmax(torch.randn(1, 1, 16, 16), torch.ones(1, 1, 1, dtype=torch.long), 16,
                                           scale=float("inf")), ValueError, "scale must be finite"),
    (lambda: multisoft.blocksparse_softmax_backward(torch.randn(1, 1, 16, 16), torch.randn(1, 1, 16, 16),
                                                    torch.ones(1, 1, 1, dtype=torch.long), 16, scale=float("nan")),
     ValueError, "scale must be finite"),
    (lambda: multisoft.blocksparse_from_dense(torch.randn(1, 1, 20, 32), torch.ones(1, 1, 2, dtype=torch.long), 16),
     ValueError, "does not match layout"),
])
def test_bad_input_gets_a_clear_error(call, error, pattern):
    with pytest.raises(error, match=pattern):
        call()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_tensors_on_different_devices():
    with pytest.raises(ValueError, match="target is on"):
        multisoft.cross_entropy(torch.randn(2, 3, device="cuda"), torch.zeros(2, dtype=torch.long))


def test_empty_tensors_give_empty_results():
    assert multisoft.softmax(torch.randn(0, 5), -1).shape == (0, 5)
    assert multisoft.log_softmax(torch.randn(3, 0), -1).shape == (3, 0)
    loss = multisoft.cross_entropy(torch.randn(0, 5), torch.zeros(0, dtype=torch.long), reduction="none")
    assert loss.shape == (0,)
    assert multisoft.cross_entropy(torch.randn(0, 5), torch.zeros(0, dtype=torch.long), reduction="sum") == 0
    layout = torch.zeros(1, 2, 2, dtype=torch.long)
    assert multisoft.blocksparse_softmax(torch.randn(3, 0, 16, 16), layout, 16).shape == (3, 0, 16, 16)


def test_empty_inputs_take_part_in_autograd():
    """As with torch's ops, the result of an empty input that requires grad can be differentiated (an empty
    gradient), and the result is not the input itself."""
    layout = torch.zeros(1, 2, 2, dtype=torch.long)
    cases = ((lambda t: multisoft.softmax(t, -1), torch.randn(0, 5)),
             (lambda t: multisoft.log_softmax(t, -1), torch.randn(3, 0)),
             (lambda t: multisoft.softmax(t, -1, dtype=torch.float64), torch.randn(0, 5)),
             (lambda t: multisoft.blocksparse_softmax(t, layout, 16), torch.randn(3, 0, 16, 16)),
             (lambda t: multisoft.cross_entropy(t, torch.zeros(0, dtype=torch.long), reduction="sum"),
              torch.randn(0, 5)))
    for fn, x in cases:
        x.requires_grad_()
        y = fn(x)
        assert y is not x
        y.sum().backward()
        assert x.grad is not None and x.grad.shape == x.shape


def test_kernels_never_see_an_empty_tensor(monkeypatch):
    """The torch.library ops (what torch.compile calls) with empty inputs return empty results without calling a
    backend: the contract promises backends non-empty tensors."""
    import multisoft._blocksparse as blocksparse_front
    import multisoft._softmax as softmax_front

    class Refuses:
        def kernels(self, op):
            raise AssertionError(f"a {op} kernel was called with an empty tensor")

    for module in (blocksparse_front, softmax_front):
        monkeypatch.setattr(module, "get_backend", lambda name: Refuses())
    empty = torch.randn(0, 5)
    assert softmax_front.softmax_forward_op(empty, False, "torch").shape == (0, 5)
    assert softmax_front.softmax_backward_op(empty, empty, True, "torch").shape == (0, 5)
    layout = torch.ones(1, 2, 2, dtype=torch.long)
    blocks = torch.randn(0, 4, 16, 16)
    assert blocksparse_front.blocksparse_forward_op(blocks, layout, 16, 1.0, True, "torch").shape == blocks.shape
    assert blocksparse_front.blocksparse_backward_op(blocks, blocks, layout, 16, 1.0, "torch").shape == blocks.shape
    assert multisoft.blocksparse_softmax_backward(blocks, blocks, layout, 16, backend="torch").shape == blocks.shape


def test_zero_dim_softmax():
    x = torch.tensor(3.0)
    assert multisoft.softmax(x, 0).item() == 1.0 and multisoft.log_softmax(x, 0).item() == 0.0


# -- semantics beyond the harness


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_dtype_argument_casts_first(dtype):
    x = torch.randn(4, 9, dtype=torch.float64)
    y = multisoft.softmax(x, -1, dtype=dtype, backend="torch")
    assert y.dtype == dtype
    torch.testing.assert_close(y, torch.softmax(x, -1, dtype=dtype))


def test_cross_entropy_of_16_bit_logits_is_float32_like_torch_under_autocast():
    logits = torch.randn(7, 11, dtype=torch.bfloat16)
    target = torch.randint(0, 11, (7,))
    for reduction in ("mean", "sum", "none"):
        loss = multisoft.cross_entropy(logits, target, reduction=reduction, backend="torch")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            expected = F.cross_entropy(logits, target, reduction=reduction)
        assert loss.dtype == expected.dtype == torch.float32 and loss.shape == expected.shape


def test_cross_entropy_inplace_backward_writes_the_gradient_in_the_forward():
    """inplace_backward: without autograd the forward only reads the logits; with it, the forward writes the
    gradient into them and the backward scales it there by the incoming gradient."""
    logits = torch.randn(6, 9, dtype=torch.float64)
    target = torch.randint(0, 9, (6,))
    leaf = logits.clone().requires_grad_()
    buffer = leaf.clone()  # an activation, as a model's logits are
    with torch.no_grad():
        loss = multisoft.cross_entropy(leaf, target, backend="torch", inplace_backward=True)
    torch.testing.assert_close(loss, F.cross_entropy(logits, target))
    assert torch.equal(leaf.detach(), logits)
    expected_logits = logits.clone().requires_grad_()
    F.cross_entropy(expected_logits, target, reduction="sum").backward()
    loss = multisoft.cross_entropy(buffer, target, reduction="sum", backend="torch", inplace_backward=True)
    torch.testing.assert_close(buffer.detach(), expected_logits.grad)
    (2.5 * loss).backward()
    torch.testing.assert_close(leaf.grad, 2.5 * expected_logits.grad)
    assert leaf.grad.data_ptr() == buffer.data_ptr() and torch.equal(buffer.detach(), leaf.grad)


def test_all_ignored_mean_is_nan_like_torch():
    logits = torch.randn(4, 5, requires_grad=True)
    target = torch.full((4,), -100)
    loss = multisoft.cross_entropy(logits, target, backend="torch")
    assert torch.isnan(loss) and torch.isnan(F.cross_entropy(logits, target))


def test_nn_modules_drop_in():
    x = torch.randn(3, 4, 5)
    torch.testing.assert_close(multisoft.nn.Softmax(dim=1)(x), torch.nn.Softmax(dim=1)(x))
    torch.testing.assert_close(multisoft.nn.LogSoftmax(dim=-1)(x), torch.nn.LogSoftmax(dim=-1)(x))
    weight = torch.rand(4) + 0.5
    target = torch.randint(0, 4, (3, 5))
    ours = multisoft.nn.CrossEntropyLoss(weight=weight, label_smoothing=0.1)(x, target)
    theirs = torch.nn.CrossEntropyLoss(weight=weight, label_smoothing=0.1)(x, target)
    torch.testing.assert_close(ours, theirs)


def test_dense_helpers_round_trip_and_order():
    block = 16
    layout = torch.tensor([[[1, 0, 1], [0, 1, 0]], [[0, 0, 1], [1, 1, 1]]])
    dense = torch.randn(2, 2, 2 * block, 3 * block)
    blocks = multisoft.blocksparse_from_dense(dense, layout, block)
    assert blocks.shape == (2, int(layout.sum()), block, block)
    for i, (h, r, c) in enumerate(layout.nonzero().tolist()):   # layout.nonzero() order, by hand
        torch.testing.assert_close(blocks[:, i], dense[:, h, r * block:(r + 1) * block, c * block:(c + 1) * block])
    back = multisoft.blocksparse_to_dense(blocks, layout, block, fill=-7.0)
    mask = layout.repeat_interleave(block, 1).repeat_interleave(block, 2).bool()
    torch.testing.assert_close(back[:, mask], dense[:, mask])
    assert (back[:, ~mask] == -7.0).all()


def test_lookup_table_is_cached_and_follows_layout_changes():
    layout = torch.tensor([[[1, 1], [0, 1]]])
    first = multisoft._blocksparse.lookup_table(layout, 16)
    assert multisoft._blocksparse.lookup_table(layout, 16) is first
    assert first.offsets.tolist() == [0, 2, 3] and first.columns.tolist() == [0, 1, 1] and first.max_blocks == 2
    assert first.mean_blocks == 1.5  # 3 blocks over 2 block-rows
    layout[0, 1, 0] = 1
    second = multisoft._blocksparse.lookup_table(layout, 16)
    assert second.nnz == 4 and second.offsets.tolist() == [0, 2, 4]


def test_lookup_table_lists_each_block_rows_blocks_by_ascending_column():
    """Backends rely on it (numba's causal mask keeps a prefix of each row)."""
    layout = (torch.rand(3, 9, 40) < 0.4).long()
    lut = multisoft._blocksparse.lookup_table(layout, 16)
    offsets, columns = lut.offsets.tolist(), lut.columns.tolist()
    for g in range(3 * 9):
        row = columns[offsets[g]:offsets[g + 1]]
        assert row == sorted(row) and row == layout.view(27, 40)[g].nonzero().flatten().tolist()


def test_lookup_table_causal_prefix_is_what_the_mask_keeps():
    layout = (torch.rand(2, 7, 9) < 0.5).long()
    layout[0, 3, 3] = 1
    layout[1, 4, 4] = 0
    block = 16
    lut = multisoft._blocksparse.lookup_table(layout, block)
    offsets, columns, causal = lut.offsets.tolist(), lut.columns.tolist(), lut.causal.tolist()
    assert len(causal) == 2 * 7
    for g in range(2 * 7):
        r = g % 7
        row_columns = [c for c in columns[offsets[g]:offsets[g + 1]] for _ in range(block)]
        for i in (0, 5, block - 1):
            kept = sum(c * block + j % block <= r * block + i for j, c in enumerate(row_columns))
            assert (causal[g] >> 1) * block + (causal[g] & 1) * (i + 1) == kept, (g, i)
    assert causal[3] & 1 == 1 and causal[7 + 4] & 1 == 0


# -- autograd, torch.library, torch.compile


def test_gradcheck_reference_float64():
    x = torch.randn(3, 7, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: multisoft.softmax(t, -1, backend="torch"), (x,))
    assert torch.autograd.gradcheck(lambda t: multisoft.log_softmax(t, 0, backend="torch"), (x,))
    layout = torch.tensor([[[1, 1], [1, 0]]])
    blocks = torch.randn(1, 3, 16, 16, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda t: multisoft.blocksparse_softmax(t, layout, 16, scale=0.3, is_causal=True, backend="torch"),
        (blocks,), atol=1e-6)


def test_opcheck_registered_ops():
    from multisoft import LossOptions, _blocksparse as blocksparse, _cross_entropy as cross_entropy, _softmax as softmax

    x = torch.randn(4, 9, requires_grad=True)
    torch.library.opcheck(softmax.softmax_forward_op, (x, True, "torch"))
    torch.library.opcheck(softmax.softmax_backward_op,
                          (torch.softmax(x, -1).detach(), torch.randn(4, 9), False, "torch"))
    target = torch.tensor([1, -100, 8, 0])
    weight = torch.rand(9)
    for reduction in ("mean", "none"):
        torch.library.opcheck(cross_entropy.cross_entropy_forward_op,
                              (x, target, weight, *LossOptions(-100, reduction, 0.1, 3.0, 0.01), True, True, "torch"))
    torch.library.opcheck(cross_entropy.cross_entropy_forward_op,
                          (x.detach(), target, None, *LossOptions(reduction="sum"), False, False, "torch"))
    torch.library.opcheck(cross_entropy.cross_entropy_rows_op,
                          (x, target, weight, *LossOptions(-100, "none", 0.1, 3.0, 0.01), "torch"))
    torch.library.opcheck(cross_entropy.cross_entropy_rows_op, (x, target, None, *LossOptions(), "torch"))
    torch.library.opcheck(cross_entropy.cross_entropy_scale_op, (torch.randn(4, 9), torch.rand(4), "torch"))
    torch.library.opcheck(cross_entropy.cross_entropy_scale_op, (torch.randn(4, 9), torch.rand(1), "torch"))
    layout = torch.tensor([[[1, 0], [1, 1]]])
    blocks = torch.randn(2, 3, 16, 16, requires_grad=True)
    torch.library.opcheck(blocksparse.blocksparse_forward_op, (blocks, layout, 16, 0.5, True, "torch"))
    torch.library.opcheck(blocksparse.blocksparse_backward_op,
                          (blocks.detach(), torch.randn(2, 3, 16, 16), layout, 16, 0.5, "torch"))


def test_torch_compile_fullgraph_no_graph_break():
    layout = torch.tensor([[[1, 0], [1, 1]]])

    def model(x, logits, target, blocks):
        a = multisoft.softmax(x * 2, -1, backend="torch").sum()
        b = multisoft.log_softmax(x, 0, backend="torch").sum()
        c, lse = multisoft.cross_entropy(logits, target, label_smoothing=0.1, softcap=4.0, lse_square_scale=0.01,
                                         return_lse=True, backend="torch")
        d = multisoft.blocksparse_softmax(blocks, layout, 16, is_causal=True, backend="torch").sum()
        return a + b + c + d + lse.sum()

    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    x = torch.randn(5, 6, requires_grad=True)
    logits = torch.randn(5, 10, requires_grad=True)
    target = torch.tensor([1, 2, -100, 4, 9])
    blocks = torch.randn(1, 3, 16, 16, requires_grad=True)
    got = compiled(x, logits, target, blocks)
    grads = torch.autograd.grad(got, (x, logits, blocks))
    want = model(x, logits, target, blocks)
    want_grads = torch.autograd.grad(want, (x, logits, blocks))
    torch.testing.assert_close(got, want)
    for g, w in zip(grads, want_grads):
        torch.testing.assert_close(g, w)
    options = dict(label_smoothing=0.1, softcap=4.0, lse_square_scale=0.01)
    expected_ce = reference_cross_entropy(logits.detach(), target, **options)
    torch.testing.assert_close(multisoft.cross_entropy(logits, target, backend="torch", **options).double(),
                               expected_ce)
