"""Vocabulary-parallel linear cross-entropy (``linear_cross_entropy(..., process_group=)``).

Each rank holds a contiguous slice of the output layer's rows (and bias); the hidden states, targets and class
weights are the same on every rank. Gloo on the CPU with 2 and 3 processes and uneven slices (torch and
reference backends, Triton under its interpreter in one small plan), NCCL where 2 CUDA devices exist (every
backend that runs there). Every case compares each rank's loss, lse, ``input``'s gradient (the whole of it, on
every rank) and its slice of the gradients of ``linear_weight`` and ``linear_bias`` with the unsplit
``multisoft.linear_cross_entropy`` on the same backend AND with float64 (``F.linear`` in float64, then the
float64 cross-entropy of multisoft/check.py), at the tolerances of tests/test_linear_cross_entropy.py: every
option and reduction, float32 and bfloat16, (M, H) and (B, T, H) inputs, several chunks of rows, a padded
vocabulary (one rank's bias all -inf), a rank with no classes, ``nn.LinearCrossEntropyLoss``, the collectives
called, and the argument errors that need a group.

As in tests/test_vocab_parallel.py each test spawns its processes once and runs all its cases there: a rank
records every failing case and raises them together at the end (tests/distributed_harness.py: the spawning,
joining and reporting both files share).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import multisoft
from distributed_harness import (GATHERS, REDUCTIONS, WIDTHS, WIDTHS_WITH_AN_EMPTY_RANK, Ranks, Report, cannot_run,
                                 counting_collectives, exit_at_once, incoming_gradient, join_group,
                                 no_host_synchronisation, raises, spawn)
from harness import assert_close, backends_under_test, simulated
from multisoft._registry import get_backend
from multisoft.check import reference_cross_entropy

HIDDEN = 8

CASES = {
    # shape: the target's (input is that and HIDDEN); chunk_size below the rows: several chunks, the last shorter
    "plain": dict(shape=(7,), chunk_size=3),
    # masked: the last rank's bias is -inf (a padded vocabulary), no target there
    "weighted-ignored-masked": dict(shape=(2, 4), chunk_size=3, weighted=True, bias=True, masked=True),
    "smoothing": dict(shape=(7,), chunk_size=2, label_smoothing=0.1, bias=True),
    "softcap-z-loss": dict(shape=(3, 3), chunk_size=4, softcap=3.0, lse_square_scale=0.02),
    "everything": dict(shape=(2, 5), chunk_size=3, weighted=True, ignore_index=2, label_smoothing=0.15, softcap=4.0,
                       lse_square_scale=0.01, bias=True),
}


def _slices(widths):
    """Every rank's (start, width) among the classes."""
    return [(sum(widths[:rank]), width) for rank, width in enumerate(widths)]


def _inputs(spec, dtype, widths, device, seed):
    """Hidden states, the whole output layer (logits of order 3) and bias, targets (every third ignored) and
    class weights, the same on every rank (seeded)."""
    classes = sum(widths)
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(*spec["shape"], HIDDEN, generator=generator)
    linear_weight = torch.randn(classes, HIDDEN, generator=generator) * (3.0 / HIDDEN ** 0.5)
    linear_bias = torch.randn(classes, generator=generator) if spec.get("bias") else None
    predicted = classes - widths[-1] if spec.get("masked") else classes
    target = torch.randint(0, predicted, spec["shape"], generator=generator)
    target.view(-1)[1::3] = spec.get("ignore_index", -100)
    if spec.get("masked"):
        linear_bias[predicted:] = -float("inf")
    weight = torch.rand(classes, generator=generator) + 0.5 if spec.get("weighted") else None
    move = [t if t is None else t.to(device, dtype) for t in (x, linear_weight, linear_bias)]
    return (*move, target.to(device), None if weight is None else weight.to(device))


def _options(spec, weight, reduction, return_lse):
    return dict(weight=weight, ignore_index=spec.get("ignore_index", -100), reduction=reduction,
                label_smoothing=spec.get("label_smoothing", 0.0), softcap=spec.get("softcap"),
                lse_square_scale=spec.get("lse_square_scale", 0.0), return_lse=return_lse)


def _reference(x, linear_weight, linear_bias, target, options, widths):
    """(leaves in float64, logits in float64, loss, lse): F.linear and the float64 cross-entropy. 16-bit logits
    take the values each rank's F.linear of its slice gives in that dtype (as tests/test_linear_cross_entropy.py
    explains); their gradient flows through the float64 F.linear."""
    leaves = [t if t is None else t.detach().double().requires_grad_() for t in (x, linear_weight, linear_bias)]
    logits = F.linear(*leaves).reshape(-1, linear_weight.shape[0])
    if x.dtype in (torch.float16, torch.bfloat16):
        rounded = torch.cat([F.linear(x, linear_weight.narrow(0, start, width),
                                      None if linear_bias is None else linear_bias.narrow(0, start, width))
                             for start, width in _slices(widths)], -1)
        correction = rounded.double().reshape(logits.shape) - logits.detach()
        logits = logits + torch.where(correction.isnan(), 0.0, correction)  # -inf - -inf where masked
    loss, lse = reference_cross_entropy(logits, target.reshape(-1), **{**options, "return_lse": True})
    if options["reduction"] == "none":
        loss = loss.reshape(target.shape)
    return leaves, logits, loss, lse.reshape(target.shape)


def _leaves(*tensors):
    return [t if t is None else t.detach().clone().requires_grad_() for t in tensors]


def _compare(what, spec, dtype, reduction, return_lse, backend, ranks, device, seed):
    """Loss, lse and the gradients (through the loss, and through the lse with ``return_lse``) against the
    unsplit call on the same backend and against float64."""
    x, whole_weight, whole_bias, target, weight = _inputs(spec, dtype, ranks.widths, device, seed)
    options = _options(spec, weight, reduction, return_lse)
    mine = _leaves(x, ranks.part(whole_weight), None if whole_bias is None else ranks.part(whole_bias))
    result = multisoft.linear_cross_entropy(mine[0], mine[1], target, linear_bias=mine[2], backend=backend,
                                            chunk_size=spec["chunk_size"], process_group=ranks.group, **options)
    unsplit_leaves = _leaves(x, whole_weight, whole_bias)
    unsplit = multisoft.linear_cross_entropy(unsplit_leaves[0], unsplit_leaves[1], target,
                                             linear_bias=unsplit_leaves[2], backend=backend,
                                             chunk_size=spec["chunk_size"], **options)
    leaves64, logits64, loss64, lse64 = _reference(x, whole_weight, whole_bias, target, options, ranks.widths)
    outputs, unsplit = (list(result), list(unsplit)) if return_lse else ([result], [unsplit])
    expected = [loss64, lse64][:len(outputs)]
    assert outputs[0].dtype == unsplit[0].dtype, f"{what}: loss dtype {outputs[0].dtype} != {unsplit[0].dtype}"
    for name, value, unsplit_value, reference in zip(("loss", "lse"), outputs, unsplit, expected):
        assert value.shape == reference.shape, f"{what}: {name} of shape {tuple(value.shape)}"
        assert_close(value, unsplit_value, dtype, f"{what}: {name} against the unsplit call")
        assert_close(value, reference, dtype, f"{what}: {name} against float64")

    incoming = [incoming_gradient(value, seed + i) for i, value in enumerate(outputs)]
    present = [i for i, leaf in enumerate(mine) if leaf is not None]
    grads = torch.autograd.grad(outputs, [mine[i] for i in present], incoming)
    unsplit_grads = torch.autograd.grad(unsplit, [unsplit_leaves[i] for i in present], incoming)
    incoming64 = [g.double() for g in incoming]
    expected_grads = torch.autograd.grad(expected, [leaves64[i] for i in present], incoming64, retain_graph=True)
    # each gradient sums products: held to the dtype's tolerance of the size of its terms (|dlogits| @ |W|, ...)
    size = sum(torch.autograd.grad(o, logits64, g, retain_graph=True)[0].abs() for o, g in zip(expected, incoming64))
    magnitudes = [(size @ leaves64[1].detach().abs()).reshape(x.shape),
                  size.t() @ leaves64[0].detach().reshape(-1, HIDDEN).abs(), size.sum(0)]
    for i, grad, unsplit_grad, expected_grad in zip(present, grads, unsplit_grads, expected_grads):
        name = ("input", "linear_weight", "linear_bias")[i]
        sliced = (lambda whole: whole) if i == 0 else ranks.part  # input's gradient: all of it, on every rank
        assert grad.dtype == dtype and grad.shape == sliced(expected_grad).shape, f"{what}: gradient of {name}"
        magnitude = sliced(magnitudes[i])
        assert_close(grad, sliced(unsplit_grad), dtype, f"{what}: gradient of {name} against the unsplit call",
                     magnitude)
        assert_close(grad, sliced(expected_grad), dtype, f"{what}: gradient of {name} against float64", magnitude)


def _every_option(report, ranks, backends, plan, device):
    for backend in backends:
        runnable = [dtype for dtype in plan["dtypes"] if get_backend(backend).unavailable_reason(device, dtype) is None]
        if not runnable:
            report(f"{backend} on {device}", cannot_run, backend, plan["dtypes"], device)
        for dtype in runnable:
            for case in plan["cases"]:
                for reduction in plan["reductions"]:
                    for return_lse in plan["return_lse"]:
                        seed = len(report.checked)
                        what = f"{backend} {dtype} {case} {reduction} return_lse={return_lse}"
                        report(what, _compare, what, CASES[case], dtype, reduction, return_lse, backend, ranks,
                               device, seed)


def _collectives(report, ranks, backend, device):
    """Once the slices are known, with 3 chunks of rows: a reduced loss's forward runs one all-gather of the
    ranks' widths (checked against those each rank cached), one all-gather a chunk and one all-reduce (input's
    gradient), its backward nothing; reduction="none" gathers in the forward only
    and all-reduces once in the backward; so does a gradient through the lse of a reduced loss. On CUDA no host
    synchronisation. Every rank returns the same loss."""
    spec = CASES["everything"]
    x, whole_weight, whole_bias, target, weight = _inputs(spec, torch.float32, ranks.widths, device, 71)
    mine = _leaves(x, ranks.part(whole_weight), ranks.part(whole_bias))
    chunks = -(-target.numel() // spec["chunk_size"])

    def forward(reduction):
        return multisoft.linear_cross_entropy(mine[0], mine[1], target, linear_bias=mine[2], backend=backend,
                                              chunk_size=spec["chunk_size"], process_group=ranks.group,
                                              **_options(spec, weight, reduction, True))

    for reduction in ("mean", "none"):  # learns the slices, compiles and tunes the kernels, unmeasured
        loss, lse = forward(reduction)
        (loss.sum() + lse.sum()).backward()
    for reduction, through_lse, backward_calls in (("mean", False, []), ("sum", True, ["all_reduce"]),
                                                   ("none", False, ["all_reduce"]),
                                                   ("none", True, ["all_reduce"])):
        calls = []
        with counting_collectives(calls), no_host_synchronisation(device):
            loss, lse = forward(reduction)
            forward_calls = list(calls)
            (loss.sum() + (lse.sum() if through_lse else 0.0)).backward()
        what = f"{reduction}, lse differentiated: {through_lse}"
        gathers = [call for call in forward_calls if call in GATHERS]
        assert len(gathers) == 1 + chunks, \
            f"{what}: the forward gathered {len(gathers)} times, not once and once a chunk"
        expected_forward = gathers + (["all_reduce"] if reduction != "none" else [])
        assert forward_calls == expected_forward, f"{what}: the forward called {forward_calls}"
        assert calls[len(forward_calls):] == backward_calls, f"{what}: the backward called {calls[len(forward_calls):]}"
    losses = torch.empty(len(ranks.widths), dtype=loss.dtype, device=device)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(losses, forward("mean")[0].detach().reshape(1), group=ranks.group)
    assert (losses == losses[0]).all(), f"the ranks' losses differ: {losses.tolist()}"


def _module(report, ranks, backend, device):
    """nn.LinearCrossEntropyLoss(process_group=...): loss and gradients as the function's."""
    spec = CASES["everything"]
    x, whole_weight, whole_bias, target, weight = _inputs(spec, torch.float32, ranks.widths, device, 31)
    module = multisoft.nn.LinearCrossEntropyLoss(weight, ignore_index=2, label_smoothing=0.15, softcap=4.0,
                                                 lse_square_scale=0.01, backend=backend, chunk_size=3,
                                                 process_group=ranks.group)
    mine = _leaves(x, ranks.part(whole_weight), ranks.part(whole_bias))
    loss = module(mine[0], mine[1], target, mine[2])
    leaves64, logits64, expected, _ = _reference(x, whole_weight, whole_bias, target,
                                                 _options(spec, weight, "mean", False), ranks.widths)
    assert_close(loss, expected, torch.float32, "nn.LinearCrossEntropyLoss: loss")
    loss.backward()
    expected_grads = torch.autograd.grad(expected, leaves64)
    for name, leaf, want, sliced in zip(("input", "linear_weight", "linear_bias"), mine, expected_grads,
                                        (lambda whole: whole, ranks.part, ranks.part)):
        assert_close(leaf.grad, sliced(want), torch.float32, f"nn.LinearCrossEntropyLoss: gradient of {name}",
                     sliced(want).abs() + 1.0)


def _argument_errors(report, ranks, backend, device):
    """Errors that need the group's slices, raised on every rank alike (no rank left waiting in a collective)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    x, whole_weight, whole_bias, target, weight = _inputs(CASES["everything"], torch.float32, ranks.widths, device,
                                                          51)
    part = ranks.part(whole_weight)
    classes = whole_weight.shape[0]
    call = multisoft.linear_cross_entropy
    raises(ValueError, rf"weight must have shape \({classes},\)", call, x, part, target,
           weight=ranks.part(weight), process_group=ranks.group, backend=backend)
    raises(ValueError, rf"linear_bias must have shape \({ranks.width},\)", call, x, part, target,
           linear_bias=whole_bias, process_group=ranks.group, backend=backend)
    raises(TypeError, "process_group must be a torch.distributed ProcessGroup", call, x, part, target,
           process_group="world", backend=backend)
    if device.type == "cpu":  # torch's IndexError for a target outside the V classes, before any collective
        outside = target.clone()
        outside[1] = classes
        raises(IndexError, f"Target {classes} is out of bounds", call, x, part, outside, process_group=ranks.group,
               backend=backend)
    mesh = init_device_mesh(device.type, (len(ranks.widths),))
    sharded = distribute_tensor(whole_weight, mesh, [Shard(0)])
    raises(TypeError, "linear_weight is a DTensor", call, x, sharded, target, process_group=ranks.group,
           backend=backend)
    empty = dist.new_group(list(range(len(ranks.widths))))
    raises(ValueError, "linear_weight has no rows on any rank of process_group", call, x,
           whole_weight[:0], target, process_group=empty, backend=backend)


def _empty_rank(report, widths, backend, device):
    """A rank with no classes, in a new group (its slices are learned afresh): it still takes part, gets the
    loss and input's whole gradient; its gradients of linear_weight and linear_bias are empty."""
    ranks = Ranks(dist.new_group(list(range(len(widths)))), widths, class_dim=0)   # slices of the layer's rows
    for reduction in REDUCTIONS:
        what = f"a rank without classes, {reduction}"
        _compare(what, CASES["everything"], torch.float32, reduction, True, backend, ranks, device, 61)


EXTRAS = (_collectives, _module, _argument_errors)


def _worker(rank, world, rendezvous, plan):
    device = join_group(rank, world, rendezvous, plan)
    try:
        report = Report(rank)
        ranks = Ranks(dist.group.WORLD, WIDTHS[world], class_dim=0)   # slices of the output layer's rows
        _every_option(report, ranks, plan["backends"], plan, device)
        for backend in plan["backends"] if plan["extras"] else ():
            for check in EXTRAS:
                report(f"{backend} {check.__name__}", check, report, ranks, backend, device)
            if world == 3:
                report(f"{backend} _empty_rank", _empty_rank, report, WIDTHS_WITH_AN_EMPTY_RANK, backend, device)
        report.raise_failures()
    finally:
        dist.destroy_process_group()
    exit_at_once()


def _spawn(tmp_path, world, **plan):
    plan = {**dict(device="cpu", distributed_backend="gloo", dtypes=(torch.float32, torch.bfloat16),
                   cases=tuple(CASES), reductions=REDUCTIONS, return_lse=(False, True), extras=True,
                   timeout_s=300), **plan}
    spawn(_worker, tmp_path, world, plan)


@pytest.mark.parametrize("world", [2, 3])
def test_gloo_torch_and_reference_backends_match_the_unsplit_call(tmp_path, world):
    _spawn(tmp_path, world, backends=("torch", "reference"))


def test_gloo_triton_interpreted_matches_the_unsplit_call(tmp_path):
    """Triton under its interpreter (its kernels on the CPU), one small plan: every option at once."""
    if torch.cuda.is_available():
        pytest.skip("with GPUs the NCCL test runs the GPU backends")
    if "triton" not in backends_under_test() or not simulated("triton"):
        pytest.skip("triton is not selected here, or its simulation is off (--no-simulate)")
    _spawn(tmp_path, 2, backends=("triton",), dtypes=(torch.float32,), cases=("everything",),
           reductions=("mean", "none"), return_lse=(True,), extras=False)


@pytest.mark.skipif(torch.cuda.device_count() < 2 or not dist.is_nccl_available(),
                    reason="needs 2 CUDA devices and NCCL")
def test_nccl_every_backend_matches_the_unsplit_call(tmp_path):
    _spawn(tmp_path, 2, device="cuda", distributed_backend="nccl", backends=tuple(backends_under_test()))


def test_process_group_must_be_a_group():
    """Checked before anything is communicated (no group needs to exist)."""
    x, linear_weight = torch.randn(4, HIDDEN), torch.randn(5, HIDDEN)
    with pytest.raises(TypeError, match="process_group must be a torch.distributed ProcessGroup or None, got int"):
        multisoft.linear_cross_entropy(x, linear_weight, torch.zeros(4, dtype=torch.long), process_group=3)
