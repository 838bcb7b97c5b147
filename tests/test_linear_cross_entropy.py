"""multisoft.linear_cross_entropy against float64: F.linear in float64, then the float64 cross-entropy.

The reference's logits come from the same (rounded) input, weight and bias in
float64, and its gradients flow back through that float64 F.linear. The
function is defined as the cross-entropy of ``F.linear``'s logits in the
input's dtype: for 16-bit inputs each of those logits is rounded by up to
2**-9 (bf16) or 2**-12 (fp16) of itself, which exp() turns into a relative
error of p of |logit| times that, more than the dtype's tolerance once logits
pass ~4. That rounding belongs to the definition, not to the implementation,
so for 16-bit inputs the reference's logits take the values torch's own
F.linear gives in that dtype (its gradient still flows through the float64
F.linear). Everything after the logits (the cross-entropy, the matmuls of the
gradients and their accumulation over chunks) is then held to the dtype's
tolerances of ``tests/harness.py``. The gradients are sums over V (grad_input)
or over the rows (grad_weight, grad_bias) of products, each rounded once per
chunk: each is compared against the size of the terms it sums
(``|dlogits| @ |W|``, ``|dlogits|.T @ |input|``, ``|dlogits|.sum(0)``, the
harness's ``magnitude``), since the rounding of a sum of products is a relative
error of those terms, not of what is left after they cancel. Losses and lse are
held to the dtype's tolerances as they are.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import multisoft
from harness import DEVICE, assert_close, on_each_backend
from multisoft import _linear_chunks
from multisoft.check import reference_cross_entropy

each_reduction = pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
CLASSES, HIDDEN = 37, 16

CASES = {
    "plain-2d": dict(shape=(13,), chunk_size=5),
    "weighted-ignored-3d": dict(shape=(3, 5), chunk_size=4, weighted=True, ignore_index=-100, bias=True),
    "smoothing-softcap-z-loss": dict(shape=(11,), chunk_size=11, label_smoothing=0.1, softcap=4.0,
                                     lse_square_scale=0.01, bias=True),
    "everything-lse-3d": dict(shape=(2, 7), chunk_size=3, weighted=True, ignore_index=5, label_smoothing=0.15,
                              softcap=5.0, lse_square_scale=0.02, bias=True, return_lse=True),
}


def _inputs(shape, dtype=torch.float32, bias=False, weighted=False, ignore_index=-100, **_):
    """Hidden states, an output layer whose logits are of order 3, targets with every third row ignored."""
    x = torch.randn(*shape, HIDDEN, device=DEVICE).to(dtype).requires_grad_()
    linear_weight = (torch.randn(CLASSES, HIDDEN, device=DEVICE) * (3.0 / HIDDEN ** 0.5)).to(dtype).requires_grad_()
    linear_bias = torch.randn(CLASSES, device=DEVICE).to(dtype).requires_grad_() if bias else None
    target = torch.randint(0, CLASSES, shape, device=DEVICE)
    target.view(-1)[::3] = ignore_index
    weight = torch.rand(CLASSES, device=DEVICE) + 0.5 if weighted else None
    return x, linear_weight, linear_bias, target, weight


def _options(spec, weight, reduction):
    return dict(weight=weight, reduction=reduction, ignore_index=spec.get("ignore_index", -100),
                label_smoothing=spec.get("label_smoothing", 0.0), lse_square_scale=spec.get("lse_square_scale", 0.0),
                softcap=spec.get("softcap"), return_lse=spec.get("return_lse", False))


def _reference(x, linear_weight, linear_bias, target, options):
    """(leaves in float64, logits in float64, loss, lse or None) from F.linear and the float64 cross-entropy;
    16-bit logits valued as torch's F.linear rounds them (module docstring)."""
    leaves = [t.detach().double().requires_grad_() if t is not None else None for t in (x, linear_weight,
                                                                                        linear_bias)]
    logits = F.linear(*leaves).reshape(-1, linear_weight.shape[0])
    if x.dtype in (torch.float16, torch.bfloat16):
        rounded = F.linear(x.detach(), linear_weight.detach(), None if linear_bias is None else linear_bias.detach())
        logits = logits + (rounded.double().reshape(logits.shape) - logits).detach()
    out = reference_cross_entropy(logits, target.reshape(-1), **options)
    loss, lse = out if options.get("return_lse") else (out, None)
    if options["reduction"] == "none":
        loss = loss.reshape(target.shape)
    return leaves, logits, loss, lse.reshape(target.shape) if lse is not None else None


def _assert_gradients(got, leaves, logits, outputs, incoming, dtype):
    """Each leaf's gradient against float64, at the dtype's tolerances of the terms it sums (module docstring)."""
    wanted = [leaf for leaf in leaves if leaf is not None]
    expected = torch.autograd.grad(outputs, wanted + [logits], incoming, retain_graph=True)
    # the size of d logits: the terms through the loss and through lse, each summed as it is computed
    size = sum(torch.autograd.grad(o, logits, g, retain_graph=True)[0].abs() for o, g in zip(outputs, incoming))
    x64, w64, _ = leaves
    magnitudes = [size @ w64.detach().abs(), size.t() @ x64.detach().reshape(-1, HIDDEN).abs(), size.sum(0)]
    for name, grad, want, magnitude, leaf in zip(("input", "linear_weight", "linear_bias"), got, expected,
                                                 magnitudes, leaves):
        if leaf is None:
            continue
        assert grad.dtype == dtype and grad.shape == want.shape, name
        assert_close(grad, want, dtype, f"gradient of {name}", magnitude.reshape(want.shape))


@pytest.mark.parametrize("case", list(CASES), ids=str)
@each_reduction
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@on_each_backend
def test_against_float64(backend, dtype, reduction, case):
    """Loss (and lse), and the gradients of input, linear_weight and linear_bias for an incoming gradient other
    than 1: ``loss * 3.5`` for a reduced loss, a different one per row for reduction="none" (and lse)."""
    spec = CASES[case]
    x, linear_weight, linear_bias, target, weight = _inputs(dtype=dtype, **spec)
    options = _options(spec, weight, reduction)
    out = multisoft.linear_cross_entropy(x, linear_weight, target, linear_bias=linear_bias, backend=backend,
                                         chunk_size=spec["chunk_size"], **options)
    loss, lse = out if options["return_lse"] else (out, None)
    leaves, logits, expected, expected_lse = _reference(x, linear_weight, linear_bias, target, options)
    stats_dtype = torch.promote_types(dtype, torch.float32)
    assert loss.dtype == stats_dtype and loss.shape == expected.shape
    assert_close(loss, expected, dtype, "loss")
    outputs, incoming, expected_outputs = [loss * 3.5], [torch.ones_like(expected)], [expected * 3.5]
    if reduction == "none":
        per_row = torch.rand_like(expected) + 0.5
        outputs, incoming, expected_outputs = [loss], [per_row], [expected]
    if lse is not None:
        assert lse.dtype == stats_dtype and lse.shape == target.shape
        assert_close(lse, expected_lse, dtype, "lse")
        outputs.append(lse)
        incoming.append(torch.randn_like(expected_lse))
        expected_outputs.append(expected_lse)
    got = torch.autograd.grad(outputs, [t for t in (x, linear_weight, linear_bias) if t is not None],
                              [g.to(o.dtype) for g, o in zip(incoming, outputs)])
    got = list(got) + [None] * (3 - len(got))
    _assert_gradients(got, leaves, logits, expected_outputs, incoming, dtype)


@pytest.mark.parametrize("chunk_size", [1, 4, 5, 13, 64, None], ids=str)
def test_chunk_sizes(chunk_size):
    """Every chunking, including chunks that do not divide the rows and one chunk of all of them, gives the
    float64 loss and gradients (backward() with its gradient of 1, into .grad)."""
    x, linear_weight, linear_bias, target, weight = _inputs((13,), bias=True, weighted=True)
    options = _options({}, weight, "mean")
    loss = multisoft.linear_cross_entropy(x, linear_weight, target, linear_bias=linear_bias, backend="torch",
                                          chunk_size=chunk_size, **options)
    loss.backward()
    leaves, logits, expected, _ = _reference(x, linear_weight, linear_bias, target, options)
    assert_close(loss, expected, torch.float32, "loss")
    _assert_gradients([x.grad, linear_weight.grad, linear_bias.grad], leaves, logits, [expected],
                      [torch.ones_like(expected)], torch.float32)


@on_each_backend
def test_one_chunk_of_logits_at_a_time_in_place(backend, cross_entropy_calls):
    """Each kernel call gets one chunk's logits, all in the same buffer, as its own gradient buffer (in place):
    nothing of size M x V is allocated. The last chunk holds the remaining rows."""
    x, linear_weight, _, target, _ = _inputs((23,))
    multisoft.linear_cross_entropy(x, linear_weight, target, backend=backend, chunk_size=8).backward()
    kernel_calls = [(args[0], args[6]) for _, args in cross_entropy_calls]
    assert [logits.shape for logits, _ in kernel_calls] == [(8, CLASSES), (8, CLASSES), (7, CLASSES)]
    assert all(grad is logits for logits, grad in kernel_calls)
    assert len({logits.data_ptr() for logits, _ in kernel_calls}) == 1


@on_each_backend
def test_no_grad_computes_only_the_loss(backend, cross_entropy_calls):
    """torch.no_grad, inference mode, and inputs that do not require grad: no gradient buffer, nothing saved."""
    x, linear_weight, linear_bias, target, _ = _inputs((9,), bias=True)
    with torch.no_grad():
        loss = multisoft.linear_cross_entropy(x, linear_weight, target, linear_bias=linear_bias, backend=backend,
                                              chunk_size=4)
    with torch.inference_mode():
        multisoft.linear_cross_entropy(x, linear_weight, target, backend=backend, reduction="none")
    multisoft.linear_cross_entropy(x.detach(), linear_weight.detach(), target, backend=backend, softcap=2.0)
    assert [args[6] for _, args in cross_entropy_calls] == [None] * 5
    assert loss.grad_fn is None
    _, _, expected, _ = _reference(x, linear_weight, linear_bias, target, _options({}, None, "mean"))
    assert_close(loss, expected, torch.float32, "loss without grad")


@pytest.mark.parametrize("requires", ["input", "linear_weight", "linear_bias"])
def test_only_some_arguments_require_grad(requires):
    x, linear_weight, linear_bias, target, _ = _inputs((10,), bias=True)
    tensors = {"input": x, "linear_weight": linear_weight, "linear_bias": linear_bias}
    for name, tensor in tensors.items():
        tensor.requires_grad_(name == requires)
    loss = multisoft.linear_cross_entropy(x, linear_weight, target, linear_bias=linear_bias, backend="torch",
                                          chunk_size=3)
    (grad,) = torch.autograd.grad(loss, tensors[requires])
    leaves, _, expected, _ = _reference(x, linear_weight, linear_bias, target, _options({}, None, "mean"))
    index = list(tensors).index(requires)
    (want,) = torch.autograd.grad(expected, leaves[index])
    assert_close(grad, want, torch.float32, f"gradient of {requires}", want.abs() + 1.0)


@on_each_backend
def test_reduction_none_summed_and_a_loss_used_twice(backend):
    """reduction="none" then .sum() (one incoming value at stride 0 for every row), and a gradient of lse alone."""
    x, linear_weight, _, target, _ = _inputs((2, 6))
    loss, lse = multisoft.linear_cross_entropy(x, linear_weight, target, reduction="none", return_lse=True,
                                               backend=backend, chunk_size=5)
    (grad,) = torch.autograd.grad(loss.sum() * 2.0, x, retain_graph=True)
    (grad_through_lse,) = torch.autograd.grad(lse.sum(), linear_weight)
    leaves, _, expected, expected_lse = _reference(x, linear_weight, None, target,
                                                   dict(_options({}, None, "none"), return_lse=True))
    (want,) = torch.autograd.grad(expected.sum() * 2.0, leaves[0], retain_graph=True)
    (want_through_lse,) = torch.autograd.grad(expected_lse.sum(), leaves[1])
    assert_close(grad, want, torch.float32, "gradient of input", want.abs() + 1.0)
    assert_close(grad_through_lse, want_through_lse, torch.float32, "lse's gradient of linear_weight",
                 want_through_lse.abs() + 1.0)


@pytest.mark.skipif(not hasattr(F, "linear_cross_entropy"), reason="this torch has no F.linear_cross_entropy")
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_equals_torchs_linear_cross_entropy(reduction):
    """torch's own F.linear_cross_entropy (float32, weights, ignored rows, smoothing, bias) gives the same."""
    x, linear_weight, linear_bias, target, weight = _inputs((3, 5), bias=True, weighted=True)
    kwargs = dict(linear_bias=linear_bias, weight=weight, reduction=reduction, label_smoothing=0.1)
    ours = multisoft.linear_cross_entropy(x, linear_weight, target, backend="torch", chunk_size=4, **kwargs)
    theirs = F.linear_cross_entropy(x.reshape(-1, HIDDEN), linear_weight, target.reshape(-1), ignore_index=-100,
                                    **kwargs)
    assert_close(ours, theirs.reshape(ours.shape), torch.float32, "loss")
    incoming = torch.rand_like(ours) + 0.5
    got = torch.autograd.grad(ours, (x, linear_weight, linear_bias), incoming)
    want = torch.autograd.grad(theirs, (x, linear_weight, linear_bias), incoming.reshape(theirs.shape))
    for name, g, w in zip(("input", "linear_weight", "linear_bias"), got, want):
        assert_close(g, w, torch.float32, f"gradient of {name}", w.abs() + 1.0)


def test_second_and_double_backward_raise():
    x, linear_weight, _, target, _ = _inputs((6,))
    loss = multisoft.linear_cross_entropy(x, linear_weight, target, backend="torch")
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="multisoft.linear_cross_entropy computes its gradient in the forward"):
        loss.backward()
    loss = multisoft.linear_cross_entropy(x, linear_weight, target, backend="torch")
    with pytest.raises(RuntimeError, match="multisoft.linear_cross_entropy does not support double backward"):
        torch.autograd.grad(loss, x, create_graph=True)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_torch_compile_fullgraph(reduction):
    """torch.compile(fullgraph=True) (aot_eager: the custom ops run as in eager) gives the float64 loss and
    gradients, with every option and a gradient through lse."""
    weight = torch.rand(CLASSES, device=DEVICE) + 0.5
    options = dict(weight=weight, reduction=reduction, ignore_index=3, label_smoothing=0.1, softcap=5.0,
                   lse_square_scale=0.01, return_lse=True)

    def model(x, linear_weight, linear_bias, target):
        loss, lse = multisoft.linear_cross_entropy(x * 1, linear_weight, target, linear_bias=linear_bias,
                                                   backend="torch", chunk_size=4, **options)
        return loss.sum() * 2.0 + (lse * lse).mean()

    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    x, linear_weight, linear_bias, target, _ = _inputs((2, 5), bias=True, ignore_index=3)
    got = compiled(x, linear_weight, linear_bias, target)
    grads = torch.autograd.grad(got, (x, linear_weight, linear_bias))
    leaves, _, loss64, lse64 = _reference(x, linear_weight, linear_bias, target, options)
    want = loss64.sum() * 2.0 + (lse64 * lse64).mean()
    want_grads = torch.autograd.grad(want, leaves)
    assert_close(got, want, torch.float32, "compiled loss")
    for name, g, w in zip(("input", "linear_weight", "linear_bias"), grads, want_grads):
        assert_close(g, w, torch.float32, f"compiled gradient of {name}", w.abs() + 1.0)
    with torch.no_grad():
        assert_close(compiled(x, linear_weight, linear_bias, target), want, torch.float32, "compiled, no grad")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@on_each_backend
def test_under_autocast_a_float32_output_layer_takes_16bit_hidden_states(backend, dtype):
    """Under torch.autocast, as with F.linear: input, linear_weight and linear_bias are cast to the autocast dtype
    (the usual mixed-precision setup: 16-bit hidden states, a float32 output layer); the loss is float32 and the
    float32 weight and bias get float32 gradients, through the cast, equal to those of the 16-bit values."""
    spec = CASES["weighted-ignored-3d"]
    x, linear_weight, linear_bias, target, weight = _inputs(dtype=dtype, **spec)
    master_weight = linear_weight.detach().float().requires_grad_()
    master_bias = linear_bias.detach().float().requires_grad_()
    options = _options(spec, weight, "sum")
    with torch.autocast(DEVICE.type, dtype=dtype):
        loss = multisoft.linear_cross_entropy(x, master_weight, target, linear_bias=master_bias, backend=backend,
                                              chunk_size=spec["chunk_size"], **options)
    assert loss.dtype == torch.float32
    leaves, logits, expected, _ = _reference(x, linear_weight, linear_bias, target, options)
    assert_close(loss, expected, dtype, "loss")
    (loss * 3.5).backward()
    assert master_weight.grad.dtype == master_bias.grad.dtype == torch.float32
    got = [x.grad, master_weight.grad.to(dtype), master_bias.grad.to(dtype)]
    _assert_gradients(got, leaves, logits, [expected * 3.5], [torch.ones_like(expected)], dtype)
    with pytest.raises(TypeError, match="linear_weight must have the input's dtype"):
        multisoft.linear_cross_entropy(x, master_weight, target, backend=backend)  # outside autocast, as F.linear


def test_nn_module():
    weight = torch.rand(CLASSES, device=DEVICE) + 0.5
    module = multisoft.nn.LinearCrossEntropyLoss(weight, ignore_index=2, label_smoothing=0.1, softcap=4.0,
                                                 lse_square_scale=0.01, backend="torch", chunk_size=3)
    assert "chunk_size=3" in repr(module) and "softcap=4.0" in repr(module)
    x, linear_weight, linear_bias, target, _ = _inputs((8,), bias=True, ignore_index=2)
    loss = module(x, linear_weight, target, linear_bias)
    _, _, expected, _ = _reference(x, linear_weight, linear_bias, target,
                                   dict(weight=weight, ignore_index=2, label_smoothing=0.1, softcap=4.0,
                                        lse_square_scale=0.01, reduction="mean"))
    assert_close(loss, expected, torch.float32, "loss")


def test_no_rows():
    x = torch.randn(0, HIDDEN, requires_grad=True)
    linear_weight = torch.randn(CLASSES, HIDDEN, requires_grad=True)
    target = torch.zeros(0, dtype=torch.long)
    assert multisoft.linear_cross_entropy(x, linear_weight, target, reduction="sum", backend="torch").item() == 0
    assert multisoft.linear_cross_entropy(x, linear_weight, target, backend="torch").isnan()
    assert multisoft.linear_cross_entropy(x, linear_weight, target, reduction="none", backend="torch").shape == (0,)


@each_reduction
@on_each_backend
def test_hidden_size_zero(backend, reduction):
    """Hidden states of size 0: every logit is the bias (0 without one), as with F.linear, so each row's loss is
    log(V) - bias_t + logsumexp(bias) - log(V); input and linear_weight get empty gradients, the bias its own."""
    x = torch.randn(6, 0, device=DEVICE, requires_grad=True)
    linear_weight = torch.randn(CLASSES, 0, device=DEVICE, requires_grad=True)
    linear_bias = torch.randn(CLASSES, device=DEVICE, requires_grad=True)
    target = torch.randint(0, CLASSES, (6,), device=DEVICE)
    for bias in (None, linear_bias):
        loss = multisoft.linear_cross_entropy(x, linear_weight, target, linear_bias=bias, reduction=reduction,
                                              backend=backend, chunk_size=4)
        leaves, _, expected, _ = _reference(x, linear_weight, bias, target, _options({}, None, reduction))
        assert_close(loss, expected, torch.float32, f"loss (bias: {bias is not None})")
        incoming = torch.rand_like(expected) + 0.5
        got = torch.autograd.grad(loss, [t for t in (x, linear_weight, bias) if t is not None],
                                  incoming.to(loss.dtype))
        want = torch.autograd.grad(expected, [t for t in leaves if t is not None], incoming)
        assert got[0].shape == x.shape and got[1].shape == linear_weight.shape
        if bias is not None:
            assert_close(got[2], want[2], torch.float32, "gradient of linear_bias")


def test_default_chunk_rows():
    """An eighth of the rows or CHUNK_BYTES of logits, whichever is fewer rows, never below MIN_CHUNK_ROWS
    (nor above the rows)."""
    rows_in_budget = _linear_chunks.CHUNK_BYTES // (128000 * 2)
    assert _linear_chunks.default_chunk_rows(65536, 128000, 2) == rows_in_budget
    assert _linear_chunks.default_chunk_rows(16384, 32000, 2) == 16384 // 8
    assert _linear_chunks.default_chunk_rows(4096, 1000, 4) == _linear_chunks.MIN_CHUNK_ROWS
    assert _linear_chunks.default_chunk_rows(300, 1000, 4) == 300
    assert _linear_chunks.default_chunk_rows(8192, 10 ** 7, 4) == _linear_chunks.MIN_CHUNK_ROWS


BAD_ARGUMENTS = [
    (dict(input=torch.randn(4)), ValueError, "input must have shape"),
    (dict(input=torch.ones(4, HIDDEN, dtype=torch.long)), TypeError, "input must have a floating dtype"),
    (dict(linear_weight=torch.randn(CLASSES, HIDDEN + 1)), ValueError, "linear_weight must have shape"),
    (dict(linear_weight=torch.randn(CLASSES, HIDDEN, dtype=torch.float64)), TypeError,
     "linear_weight must have the input's dtype"),
    (dict(linear_bias=torch.randn(CLASSES + 1)), ValueError, "linear_bias must have shape"),
    (dict(linear_bias=torch.randn(CLASSES, dtype=torch.float16)), TypeError, "linear_bias must have the input's"),
    (dict(target=torch.zeros(5, dtype=torch.long)), ValueError, "target must have shape"),
    (dict(target=torch.rand(4)), TypeError, "target must hold class indices"),
    (dict(weight=torch.rand(CLASSES + 1)), ValueError, "weight must have shape"),
    (dict(reduction="avg"), ValueError, "reduction must be one of"),
    (dict(label_smoothing=1.5), ValueError, "label_smoothing must be in"),
    (dict(lse_square_scale=-1.0), ValueError, "lse_square_scale must be >= 0"),
    (dict(softcap=0.0), ValueError, "softcap must be a finite number > 0"),
    (dict(ignore_index=1.5), TypeError, "ignore_index must be an int"),
    (dict(return_lse=1), TypeError, "return_lse must be a bool"),
    (dict(chunk_size=0), ValueError, "chunk_size must be a number of rows >= 1"),
    (dict(chunk_size=2.0), TypeError, "chunk_size must be an int"),
    (dict(backend=3), TypeError, "backend must be a backend name"),
    (dict(linear_weight=torch.randn(0, HIDDEN)), ValueError, "linear_weight has no rows"),
]


@pytest.mark.parametrize("change, error, message", BAD_ARGUMENTS, ids=[m for _, _, m in BAD_ARGUMENTS])
def test_bad_arguments(change, error, message):
    arguments = dict(input=torch.randn(4, HIDDEN), linear_weight=torch.randn(CLASSES, HIDDEN),
                     target=torch.zeros(4, dtype=torch.long))
    arguments.update(change)
    with pytest.raises(error, match=message):
        multisoft.linear_cross_entropy(**arguments)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs two devices")
def test_devices_must_match():
    with pytest.raises(ValueError, match="linear_weight is on"):
        multisoft.linear_cross_entropy(torch.randn(4, HIDDEN, device="cuda"), torch.randn(CLASSES, HIDDEN),
                                       torch.zeros(4, dtype=torch.long, device="cuda"))
