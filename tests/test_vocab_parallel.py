"""Vocabulary-parallel cross-entropy (``process_group=``): each rank holds a contiguous slice of the classes.

Gloo on the CPU with 2 and 3 processes and uneven slices (torch and reference backends, Triton under its
interpreter), NCCL where 2 CUDA devices exist (every backend that runs there). Every case compares each rank's
loss, lse and slice of the gradient with the unsplit multisoft call on the same backend AND with the float64
reference of multisoft/check.py, at the dtype's tolerances: every option and reduction, float32 and bfloat16, a
row whose slice on one rank is all -inf, targets outside the classes, (N, C, d) logits, in place, the returned
lse differentiated, ``nn.CrossEntropyLoss``, a DTensor sharded on the classes, a rank with no classes, and the
argument errors that need a group.

Every spawned process imports torch, so each test spawns its processes once and runs all its cases there: a
rank records every failing case and raises them together at the end, which torch.multiprocessing.spawn raises
here (tests/distributed_harness.py: the spawning, joining and reporting this file shares with
tests/test_linear_vocab_parallel.py).
"""

from __future__ import annotations

import gc
import re
import weakref

import pytest
import torch
import torch.distributed as dist

import multisoft
from distributed_harness import (GATHERS, REDUCTIONS, WIDTHS, WIDTHS_WITH_AN_EMPTY_RANK, Ranks, Report, cannot_run,
                                 counting_collectives, exit_at_once, incoming_gradient, join_group,
                                 no_host_synchronisation, raises, spawn)
from harness import assert_close, backends_under_test, float16_gradient_error_ratio, simulated
from multisoft._registry import get_backend
from multisoft.check import reference_cross_entropy

ROWS = 7
NAN, INF = float("nan"), float("inf")

CASES = {
    # masked: row 0's classes on the last rank are all -inf (a padded vocabulary), its target on rank 0
    "plain": dict(masked=True),
    "weighted-ignored": dict(weighted=True, masked=True),
    # class 0's weight infinite and no target of class 0: an ignored row (-100 indexes class 0) takes no weight
    "infinite-weight-ignored": dict(weighted=True, infinite_weight=True),
    "smoothing": dict(label_smoothing=0.1),
    "weighted-smoothing": dict(weighted=True, label_smoothing=0.2),
    "softcap-z-loss": dict(softcap=3.0, lse_square_scale=0.02, masked=True),
    "everything": dict(weighted=True, ignore_index=2, label_smoothing=0.15, softcap=4.0, lse_square_scale=0.01),
}
SIMULATED_CASES = ("plain", "everything")   # for numba under its simulator: each call is slow there


def _inputs(spec, dtype, widths, device, seed, rows=ROWS):
    """The whole logits (rows, V), targets (some ignored) and weights, the same on every rank (seeded)."""
    classes = sum(widths)
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, classes, generator=generator) * 3.0
    target = torch.randint(0, classes, (rows,), generator=generator)
    target[1::3] = spec.get("ignore_index", -100)
    if spec.get("masked"):
        logits[0, classes - widths[-1]:] = -INF
        target[0] = 0
    weight = torch.rand(classes, generator=generator) + 0.5 if spec.get("weighted") else None
    if spec.get("infinite_weight"):
        weight[0] = INF
        target[target == 0] = 1
    return (logits.to(dtype).to(device), target.to(device), None if weight is None else weight.to(device))


def _options(spec, weight, reduction):
    return dict(weight=weight, ignore_index=spec.get("ignore_index", -100), reduction=reduction,
                label_smoothing=spec.get("label_smoothing", 0.0), softcap=spec.get("softcap"),
                lse_square_scale=spec.get("lse_square_scale", 0.0))


def _compare(what, whole, target, options, backend, ranks, return_lse, seed):
    """Loss, lse and this rank's slice of the gradient (through the loss, and through the lse with
    ``return_lse``) against the unsplit call on the same backend and against the float64 reference."""
    dtype = whole.dtype
    part = ranks.part(whole).detach().clone().requires_grad_()
    result = multisoft.cross_entropy(part, target, backend=backend, return_lse=return_lse,
                                     process_group=ranks.group, **options)
    unsplit_logits = whole.detach().clone().requires_grad_()
    unsplit = multisoft.cross_entropy(unsplit_logits, target, backend=backend, return_lse=return_lse, **options)
    logits64 = whole.detach().double().requires_grad_()
    expected = reference_cross_entropy(logits64, target, return_lse=True, **options)
    outputs, unsplit = (result, unsplit) if return_lse else ((result,), (unsplit,))
    assert outputs[0].dtype == unsplit[0].dtype, f"{what}: loss dtype {outputs[0].dtype} != {unsplit[0].dtype}"
    for name, value, unsplit_value, reference in zip(("loss", "lse"), outputs, unsplit, expected):
        assert_close(value, unsplit_value, dtype, f"{what}: {name} against the unsplit call")
        assert_close(value, reference, dtype, f"{what}: {name} against float64")
    incoming = [incoming_gradient(value, seed + i) for i, value in enumerate(outputs)]
    (grad,) = torch.autograd.grad(outputs, part, incoming)
    (unsplit_grad,) = torch.autograd.grad(unsplit, unsplit_logits, incoming)
    through = [torch.autograd.grad(reference, logits64, g.double(), retain_graph=True)[0]
               for reference, g in zip(expected, incoming)]
    # with the lse: the sum of two gradients each rounded to the dtype, an error of the terms' size
    magnitude = ranks.part(sum(t.abs() for t in through))
    assert_close(grad, ranks.part(unsplit_grad), dtype, f"{what}: gradient against the unsplit call", magnitude)
    assert_close(grad, ranks.part(sum(through)), dtype, f"{what}: gradient against float64", magnitude)


def _every_option(report, ranks, backends, dtypes, cases, device):
    for backend in backends:
        runnable = [dtype for dtype in dtypes if get_backend(backend).unavailable_reason(device, dtype) is None]
        if not runnable:
            report(f"{backend} on {device}", cannot_run, backend, dtypes, device)
        for dtype in runnable:
            for case in cases:
                spec = CASES[case]
                for reduction in REDUCTIONS:
                    seed = len(report.checked)
                    whole, target, weight = _inputs(spec, dtype, ranks.widths, device, seed)
                    options = _options(spec, weight, reduction)
                    for return_lse in (False, True):
                        what = f"{backend} {dtype} {case} {reduction} return_lse={return_lse}"
                        report(what, _compare, what, whole, target, options, backend, ranks, return_lse, seed)


def _three_dimensional(report, ranks, backend, device):
    """(N, C, d) logits sliced on dim 1 (a strided slice), int32 targets, every option, reduced and not."""
    spec = CASES["everything"]
    generator = torch.Generator().manual_seed(11)
    classes = sum(ranks.widths)
    whole = (torch.randn(3, classes, 4, generator=generator) * 3.0).to(device)
    target = torch.randint(0, classes, (3, 4), generator=generator).to(device, torch.int32)
    target[0, 1] = spec["ignore_index"]
    weight = (torch.rand(classes, generator=generator) + 0.5).to(device)
    for reduction in ("mean", "none"):
        options = _options(spec, weight, reduction)
        part = ranks.part(whole).clone().requires_grad_()
        loss, lse = multisoft.cross_entropy(part, target, backend=backend, return_lse=True,
                                            process_group=ranks.group, **options)
        logits64 = whole.double().requires_grad_()
        expected, expected_lse = reference_cross_entropy(logits64, target, return_lse=True, **options)
        assert_close(loss, expected, torch.float32, f"(N, C, d) {reduction}: loss")
        assert_close(lse, expected_lse, torch.float32, f"(N, C, d) {reduction}: lse")
        incoming = incoming_gradient(loss, 5)
        (grad,) = torch.autograd.grad(loss, part, incoming)
        (expected_grad,) = torch.autograd.grad(expected, logits64, incoming.double())
        assert_close(grad, ranks.part(expected_grad), torch.float32, f"(N, C, d) {reduction}: gradient")


def _targets_outside_the_classes(report, ranks, backend, device):
    """A target outside [0, V) (not ignore_index): on the CPU torch's IndexError on every rank, before any
    collective (the group stays usable); elsewhere a NaN loss and a NaN gradient row, the other rows exact."""
    whole, target, weight = _inputs(CASES["weighted-ignored"], torch.float32, ranks.widths, device, 3)
    classes = whole.shape[1]
    bad = torch.tensor([2, 4], device=device)
    target[bad] = torch.tensor([classes + 3, -7], device=device)
    good = torch.ones(ROWS, dtype=torch.bool, device=device)
    good[bad] = False
    options = _options(CASES["weighted-ignored"], weight, "none")
    part = ranks.part(whole).clone().requires_grad_()
    if device.type == "cpu":
        for reduction in ("none", "mean"):
            with pytest.raises(IndexError, match=f"^Target {classes + 3} is out of bounds.$"):
                multisoft.cross_entropy(part, target, backend=backend, process_group=ranks.group,
                                        **{**options, "reduction": reduction})
        target[bad] = -100
        loss = multisoft.cross_entropy(part, target, backend=backend, process_group=ranks.group, **options)
        expected = reference_cross_entropy(whole.double(), target, **options)
        assert_close(loss, expected, torch.float32, "loss after a refused call")
        return
    loss = multisoft.cross_entropy(part, target, backend=backend, process_group=ranks.group, **options)
    incoming = incoming_gradient(loss, 4)
    (grad,) = torch.autograd.grad(loss, part, incoming)
    assert loss[bad].isnan().all(), f"losses of targets outside the classes: {loss[bad].tolist()}"
    assert grad[bad].isnan().all(), "the gradient rows of targets outside the classes are not all NaN"
    logits64 = whole.double().requires_grad_()
    expected = reference_cross_entropy(logits64[good], target[good], **options)
    (expected_grad,) = torch.autograd.grad(expected, logits64, incoming[good].double())
    assert_close(loss[good], expected, torch.float32, "loss of the other rows")
    assert_close(grad[good], ranks.part(expected_grad)[good], torch.float32, "gradient of the other rows")
    summed = multisoft.cross_entropy(ranks.part(whole), target, backend=backend, process_group=ranks.group,
                                     **{**options, "reduction": "sum"})
    assert summed.isnan(), f"a sum over a target outside the classes is {summed.item()}, not NaN"


def _in_place(report, ranks, backend, device):
    """inplace_backward: the forward writes this rank's slice of the gradient into the logits (scaled as the
    unsplit call scales it); the backward scales it there; without autograd the logits are only read."""
    for dtype in (torch.float32, torch.bfloat16):
        spec = CASES["everything"]
        whole, target, weight = _inputs(spec, dtype, ranks.widths, device, 21)
        for reduction in ("mean", "sum"):
            options = _options(spec, weight, reduction)
            leaf = ranks.part(whole).clone().requires_grad_()
            with torch.no_grad():
                multisoft.cross_entropy(leaf, target, backend=backend, inplace_backward=True,
                                        process_group=ranks.group, **options)
            assert torch.equal(leaf.detach(), ranks.part(whole)), "without autograd the logits changed"
            with pytest.raises(ValueError, match="would overwrite the logits, a leaf tensor that requires grad"):
                multisoft.cross_entropy(leaf, target, backend=backend, inplace_backward=True,
                                        process_group=ranks.group, **options)
            assert torch.equal(leaf.detach(), ranks.part(whole)), "a refused call changed the logits"
            buffer = leaf.clone()  # an activation, as a model's logits are
            logits64 = whole.double().requires_grad_()
            (expected,) = torch.autograd.grad(reference_cross_entropy(logits64, target, **options), logits64)
            loss = multisoft.cross_entropy(buffer, target, backend=backend, inplace_backward=True,
                                           process_group=ranks.group, **options)
            assert_close(buffer.detach(), ranks.part(expected), dtype, f"in place {dtype} {reduction}: forward")
            (2.5 * loss).backward()
            assert leaf.grad.data_ptr() == buffer.data_ptr(), "the gradient is not the logits' memory"
            assert_close(leaf.grad, 2.5 * ranks.part(expected), dtype, f"in place {dtype} {reduction}: backward")


def _float16_under_a_loss_scale(report, ranks, backend, device):
    """float16 mean: each rank's slice of the gradient holds S / N * (p - [j == t]) to float16's rounding under a
    loss scale S = N, where p / N alone would round to 0 (as multisoft.cross_entropy without process_group)."""
    rows, classes = 256, sum(ranks.widths)
    generator = torch.Generator().manual_seed(51)
    whole = torch.randn(rows, classes, generator=generator)
    target = torch.randint(0, classes, (rows,), generator=generator)
    whole[torch.arange(rows), target] += 10.0
    whole, target = whole.half().to(device), target.to(device)
    logits64 = whole.double().requires_grad_()
    (expected,) = torch.autograd.grad(reference_cross_entropy(logits64, target) * rows, logits64)
    part = ranks.part(whole).clone().requires_grad_()
    (multisoft.cross_entropy(part, target, backend=backend, process_group=ranks.group) * rows).backward()
    expected = ranks.part(expected)
    ratio = float16_gradient_error_ratio(part.grad, expected, logits64)
    assert ratio <= 1.0, f"float16 under a loss scale: max error {ratio:.3g} x the bound"


def _module(report, ranks, backend, device):
    spec = CASES["everything"]
    whole, target, weight = _inputs(spec, torch.float32, ranks.widths, device, 31)
    module = multisoft.nn.CrossEntropyLoss(weight, ignore_index=2, label_smoothing=0.15, softcap=4.0,
                                           lse_square_scale=0.01, backend=backend, process_group=ranks.group)
    expected = reference_cross_entropy(whole, target, **_options(spec, weight, "mean"))
    assert_close(module(ranks.part(whole), target), expected, torch.float32, "nn.CrossEntropyLoss")


def _dtensor(report, ranks, backend, device):
    """A DTensor sharded on the classes (torch's chunking, so other slices than ``ranks``'): plain tensors back,
    the gradient a DTensor whose local shard is this rank's slice of the whole gradient."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh(device.type, (len(ranks.widths),))
    spec = CASES["everything"]
    whole, target, weight = _inputs(spec, torch.float32, ranks.widths, device, 41)
    for placement in (Shard(1), Shard(-1)):
        sharded = distribute_tensor(whole, mesh, [placement]).requires_grad_()
        options = _options(spec, weight, "mean")
        loss, lse = multisoft.cross_entropy(sharded, target, backend=backend, return_lse=True, **options)
        assert type(loss) is torch.Tensor and type(lse) is torch.Tensor, "a DTensor call returns plain tensors"
        logits64 = whole.double().requires_grad_()
        expected = reference_cross_entropy(logits64, target, **options)
        assert_close(loss, expected, torch.float32, f"DTensor {placement}: loss")
        loss.backward()
        (expected_grad,) = torch.autograd.grad(expected, logits64)
        # torch 2.13 hands back a gradient sharded as the logits are, torch 2.11 a replicated one: compare the
        # whole gradient either way
        assert_close(sharded.grad.full_tensor(), expected_grad, torch.float32, f"DTensor {placement}: gradient")
    replicated = distribute_tensor(whole, mesh, [Replicate()])
    raises(ValueError, "sharded on its class dimension", multisoft.cross_entropy, replicated, target)
    raises(ValueError, "target is a DTensor but input is not", multisoft.cross_entropy, ranks.part(whole),
           distribute_tensor(target, mesh, [Replicate()]), process_group=ranks.group)


def _communication(report, ranks, backend, device):
    """Once the slices are known: two all-gathers in the forward (the ranks' widths, checked against those each
    rank cached, then the rows' statistics), none in the backward, and on CUDA no host synchronisation in
    either."""
    spec = CASES["everything"]
    whole, target, weight = _inputs(spec, torch.float32, ranks.widths, device, 71)
    options = _options(spec, weight, "mean")
    part = ranks.part(whole).clone().requires_grad_()

    def forward():
        return multisoft.cross_entropy(part, target, backend=backend, process_group=ranks.group, return_lse=True,
                                       **options)

    loss, lse = forward()  # learns the slices, and compiles and tunes the kernels, outside the measurement
    (loss + lse.sum()).backward()
    calls = []
    with counting_collectives(calls), no_host_synchronisation(device):
        loss, lse = forward()
        forward_calls = list(calls)
        (loss + lse.sum()).backward()
    assert len(forward_calls) == 2 and all(call in GATHERS for call in forward_calls), \
        f"the forward called {forward_calls}, not two all-gathers"
    assert calls == forward_calls, f"the backward called {calls[len(forward_calls):]}"


def _a_slicing_changed_on_some_ranks(report, ranks, backend, device):
    """A rank whose width changes after the first call while the others' stay: a ValueError on every rank that
    says so, raised after the same collectives everywhere (the group stays usable: the first slicing still
    works). Widths that change on every rank at once are a new slicing, learned afresh. CPU (gloo) only: on a GPU
    the check is a device-side assertion, which leaves the process unable to use its GPU."""
    group = dist.new_group(list(range(len(ranks.widths))))  # its slices learned afresh
    options = _options(CASES["plain"], None, "mean")

    def loss_of(widths, seed):
        whole, target, _ = _inputs(CASES["plain"], torch.float32, widths, device, seed)
        slicing = Ranks(group, widths)
        loss = multisoft.cross_entropy(slicing.part(whole), target, backend=backend, process_group=group,
                                       **options)
        assert_close(loss, reference_cross_entropy(whole.double(), target, **options), torch.float32,
                     f"loss with widths {widths}")

    loss_of(ranks.widths, 81)
    changed = (ranks.widths[0] + 1,) + ranks.widths[1:]
    with pytest.raises(ValueError, match=re.escape(f"slicing of the classes changed on some ranks and not on "
                                                   f"others since an earlier call: the ranks' widths are now "
                                                   f"{list(changed)}, but rank 1 had {list(ranks.widths)}")):
        loss_of(changed, 82)
    loss_of(ranks.widths, 83)
    loss_of(ranks.widths[1:] + ranks.widths[:1], 84)  # every rank's width changes
    loss_of(ranks.widths, 85)


def _argument_errors(report, ranks, backend, device):
    whole, target, weight = _inputs(CASES["weighted-ignored"], torch.float32, ranks.widths, device, 51)
    part = ranks.part(whole)
    classes = whole.shape[1]
    raises(ValueError, rf"weight must have shape \({classes},\)", multisoft.cross_entropy, part, target,
           ranks.part(weight, 0), process_group=ranks.group, backend=backend)
    raises(ValueError, "target must hold class indices", multisoft.cross_entropy, part,
           torch.softmax(part, -1), process_group=ranks.group, backend=backend)


def _empty_rank(report, widths, backend, device):
    """A rank with no classes, in a new group (its slices are learned afresh): it still takes part and gets the
    loss; its gradient is empty."""
    group = dist.new_group(list(range(len(widths))))
    ranks = Ranks(group, widths)
    spec = CASES["everything"]
    whole, target, weight = _inputs(spec, torch.float32, widths, device, 61)
    for reduction in REDUCTIONS:
        _compare(f"a rank without classes, {reduction}", whole, target, _options(spec, weight, reduction), backend,
                 ranks, True, 62)


def _worker(rank, world, rendezvous, plan):
    device = join_group(rank, world, rendezvous, plan)
    try:
        report = Report(rank)
        ranks = Ranks(dist.group.WORLD, WIDTHS[world])
        _every_option(report, ranks, plan["backends"], plan["dtypes"], plan["cases"], device)
        for backend in plan["backends"] if plan["extras"] else ():
            for check in (_three_dimensional, _targets_outside_the_classes, _in_place, _float16_under_a_loss_scale,
                          _module, _dtensor, _argument_errors, _communication):
                report(f"{backend} {check.__name__}", check, report, ranks, backend, device)
            if plan["device"] == "cpu":
                report(f"{backend} _a_slicing_changed_on_some_ranks", _a_slicing_changed_on_some_ranks, report,
                       ranks, backend, device)
            if plan["device"] == "cuda":
                stream = torch.cuda.Stream()
                with torch.cuda.stream(stream):
                    report(f"{backend} on a side stream", _every_option, report, ranks, [backend],
                           [torch.float32], ["everything"], device)
                torch.cuda.current_stream().wait_stream(stream)
        if world == 3 and plan["extras"]:
            for backend in plan["backends"]:
                report(f"{backend} _empty_rank", _empty_rank, report, WIDTHS_WITH_AN_EMPTY_RANK, backend, device)
        report.raise_failures()
    finally:
        dist.destroy_process_group()
    exit_at_once()


def _spawn(tmp_path, world, **plan):
    plan = {**dict(device="cpu", distributed_backend="gloo", dtypes=(torch.float32, torch.bfloat16),
                   cases=tuple(CASES), extras=True, timeout_s=300), **plan}
    spawn(_worker, tmp_path, world, plan)


@pytest.mark.parametrize("world", [2, 3])
def test_gloo_torch_and_reference_backends_match_the_unsplit_call(tmp_path, world):
    _spawn(tmp_path, world, backends=("torch", "reference"))


# Triton's interpreter is fast enough at these sizes for every check; numba's simulator gets a few
SIMULATED_PLANS = {"triton": {}, "numba": dict(dtypes=(torch.float32,), cases=SIMULATED_CASES, extras=False)}


@pytest.mark.parametrize("backend", list(SIMULATED_PLANS))
def test_gloo_simulated_gpu_backend_matches_the_unsplit_call(tmp_path, backend):
    """Triton under its interpreter, numba under its CUDA simulator (the GPU backends on the CPU)."""
    if torch.cuda.is_available():
        pytest.skip("with GPUs the NCCL test runs the GPU backends")
    if backend not in backends_under_test() or not simulated(backend):
        pytest.skip(f"{backend} is not selected here, or its simulation is off (--no-simulate)")
    if not hasattr(get_backend(backend).kernels("cross_entropy"), "gradient"):
        pytest.skip(f"multisoft_{backend}.cross_entropy has no gradient() yet (the vocabulary-parallel pass 2)")
    _spawn(tmp_path, 2, backends=(backend,), **SIMULATED_PLANS[backend])


@pytest.mark.skipif(torch.cuda.device_count() < 2 or not dist.is_nccl_available(),
                    reason="needs 2 CUDA devices and NCCL")
def test_nccl_every_backend_matches_the_unsplit_call(tmp_path):
    _spawn(tmp_path, 2, device="cuda", distributed_backend="nccl", backends=tuple(backends_under_test()))


def _release_worker(rank, world, rendezvous, plan):
    device = join_group(rank, world, rendezvous, plan)
    groups = [dist.group.WORLD, dist.new_group(list(range(world)))]
    logits = torch.randn(3, WIDTHS[world][rank], device=device)
    for group in groups:
        multisoft.cross_entropy(logits, torch.tensor([0, 1, 2], device=device), backend="torch", process_group=group)
    alive = [weakref.ref(group) for group in groups]
    del groups, group
    dist.destroy_process_group()
    gc.collect()
    assert [ref() is None for ref in alive] == [True, True], "a process group outlived dist.destroy_process_group()"


def test_gloo_a_destroyed_group_is_not_kept_alive(tmp_path):
    """multisoft keeps no process group alive after ``dist.destroy_process_group()`` (the default group nor a new
    one): a group kept alive keeps its communication threads running into the interpreter's exit, where one that
    drops a finished collective's tensors aborts the process ("terminate called without an active exception")."""
    spawn(_release_worker, tmp_path, 2, dict(device="cpu", distributed_backend="gloo", timeout_s=120))
