"""Vocabulary-parallel cross-entropy (``--ops vocab_parallel``, alias ``vp``): a mean loss's forward+backward with
the classes split over 2 GPUs, each rank its V/2 contiguous columns (``multisoft.cross_entropy(...,
process_group=group)``: pass 1, one all-gather of (4, M) float32 row statistics, pass 2), against the unsplit call
on one GPU, with the all-gather alone timed apart.

The ranks are processes spawned for each backend (one per GPU, NCCL), each on its own device. Rank 0 makes the
logits and broadcasts them; every rank checks the split call's loss and its slice of the gradient against a
float64 reference before anything is timed (a call off by more than the dtype allows is noted and not timed). Then,
each in turn: the unsplit call on rank 0 alone (the other ranks idle), the split call on every rank, the all-gather
alone, each timed by ``timer(fn, group)`` on every rank in step; the split call's and the collective's time is the
slowest rank's. A failing case is its record's note and the run goes on. The tests run the same worker on the CPU
(gloo, a wall-clock timer).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable

from . import plan, timing
from .impls import backend_impl
from .records import VocabParallelRecord, describe_error

OP = "vocab_parallel"
RANKS = 2
SHAPES = [(16384, 151936)]  # (M rows, V classes)
QUICK_SHAPES = [(4096, 32000)]
NEEDS_DEVICES = f"needs {RANKS} CUDA devices"
TARGET = 0.55  # the split call's time (the slowest rank's) as a fraction of the unsplit call's, at most
SEED = 0
TIMEOUT_S = 300  # of each collective: a rank stuck longer ends its process group
WARMUP_CALLS = 3
TIMED_CALLS = 25
HOST_PROBE_HOLD_MS = 20.0  # the GPU held while the host's time to queue one call is measured
HOLD_MARGIN = 1.5  # the hold before each timed call, as a multiple of the slowest rank's time to queue a call
HOLD_EXTRA_MS = 0.2
WALL_CLOCK_CALLS = 3
REFERENCE_CHUNK_BYTES = 1 << 30  # float64 logits of one chunk of rows of the reference
LOSS_TOLERANCE = 1e-4  # relative: the loss is computed in float32 from the logits, whatever their dtype
GRADIENT_TOLERANCE = {"fp32": 1e-4, "bf16": 1e-2, "fp16": 2e-3}  # of the largest |gradient|: its dtype's rounding
RECORDS_FILE = "records.jsonl"
TIMING = (f"one process per GPU (NCCL), every rank in step: before each call the L2 cleared and the GPU held (a "
          f"sleep kernel, {HOLD_MARGIN:g}x the slowest rank's time to queue a call, + {HOLD_EXTRA_MS:g} ms) while "
          "the host queues a one-element all-reduce that starts the ranks together, then the call between CUDA "
          f"events; {WARMUP_CALLS} warm-up calls, the median of {TIMED_CALLS}; split and collective: the slowest "
          "rank's median")


def shape_label(shape: tuple) -> str:
    return "x".join(str(size) for size in shape)


def cases(quick: bool) -> list[tuple]:
    return list(QUICK_SHAPES if quick else SHAPES)


def widths(classes: int, ranks: int) -> list[int]:
    """Each rank's number of columns: as even as can be, the first ranks taking one more."""
    return [classes // ranks + (rank < classes % ranks) for rank in range(ranks)]


def devices_missing() -> str:
    """Why the split call cannot be timed here ("" when it can): fewer than RANKS CUDA devices, or no NCCL."""
    import torch
    import torch.distributed as dist

    if torch.cuda.device_count() < RANKS:
        return NEEDS_DEVICES
    if not dist.is_available() or not dist.is_nccl_available():
        return "needs NCCL (torch.distributed without it)"
    return ""


def environment_notes() -> dict:
    """The run's environment entries of this op: how it times, and the devices and NCCL it ran on."""
    import torch

    try:
        nccl = ".".join(str(part) for part in torch.cuda.nccl.version())
    except Exception:  # noqa: BLE001 - a torch built without NCCL
        nccl = "none"
    return {"vocab_parallel timing": TIMING,
            "vocab_parallel devices": f"CUDA devices: {torch.cuda.device_count()}, {RANKS} used; NCCL {nccl}"}


# -- the timers: timer(fn, group) -> this rank's milliseconds, called by every rank of the group in step


def cuda_event_ms(fn: Callable, group) -> float:
    """The median CUDA-event time of ``fn`` on this rank, every rank starting each call together (TIMING)."""
    import torch
    import torch.distributed as dist

    flush = torch.empty(timing.FLUSH_BYTES, dtype=torch.int8, device="cuda")
    start_line = torch.zeros(1, device="cuda")
    for _ in range(WARMUP_CALLS):
        fn()
    torch.cuda.synchronize()
    timing._hold_gpu(HOST_PROBE_HOLD_MS)
    begun = time.perf_counter()
    fn()
    host_ms = torch.tensor([(time.perf_counter() - begun) * 1e3], device="cuda")
    torch.cuda.synchronize()
    dist.all_reduce(host_ms, op=dist.ReduceOp.MAX, group=group)
    hold_ms = HOLD_MARGIN * host_ms.item() + HOLD_EXTRA_MS
    times = []
    for _ in range(TIMED_CALLS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        flush.zero_()
        timing._hold_gpu(hold_ms)
        dist.all_reduce(start_line, group=group)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def wall_clock_ms(fn: Callable, group) -> float:
    """The CPU's stand-in for cuda_event_ms: after a warm-up call, the median wall time of WALL_CLOCK_CALLS calls,
    each after a barrier."""
    import torch.distributed as dist

    fn()
    times = []
    for _ in range(WALL_CLOCK_CALLS):
        dist.barrier(group)
        begun = time.perf_counter()
        fn()
        times.append((time.perf_counter() - begun) * 1e3)
    return statistics.median(times)


# -- inputs and the float64 reference


def make_inputs(shape: tuple, dtype_name: str, device, seed: int = SEED) -> tuple:
    """Logits (M, V) of ``dtype_name``, unit variance, and random class targets (M,), drawn on ``device``."""
    import torch

    rows, classes = shape
    generator = torch.Generator(device=device).manual_seed(seed)
    logits = torch.randn(rows, classes, generator=generator, device=device,
                         dtype=getattr(torch, plan.DTYPES[dtype_name]))
    return logits, torch.randint(0, classes, (rows,), generator=generator, device=device)


def reference_errors(logits, target, start: int, loss: float, grad) -> tuple[float, float]:
    """The mean loss's relative error, and max |grad - expected| / max |expected| of the gradient of the columns
    [start, start + grad.shape[1]), against float64 computed from ``logits`` (all V columns) a chunk of rows at a
    time: expected = (softmax - onehot(target)) / M."""
    import torch

    rows, classes = logits.shape
    stop = start + grad.shape[1]
    total = torch.zeros((), dtype=torch.float64, device=logits.device)
    worst = scale = 0.0
    chunk = max(1, REFERENCE_CHUNK_BYTES // (classes * 8))
    for first in range(0, rows, chunk):
        last = min(first + chunk, rows)
        part, part_target = logits[first:last].double(), target[first:last]
        lse = torch.logsumexp(part, 1)
        total += (lse - part.gather(1, part_target[:, None])[:, 0]).sum()
        expected = part[:, start:stop].sub_(lse[:, None]).exp_()
        owned = (part_target >= start) & (part_target < stop)
        expected[owned.nonzero()[:, 0], part_target[owned] - start] -= 1.0
        expected.div_(rows)
        worst = max(worst, (grad[first:last].double() - expected).abs_().max().item())
        scale = max(scale, expected.abs().max().item())
    expected_loss = (total / rows).item()
    return abs(loss - expected_loss) / abs(expected_loss), worst / scale if scale else worst


def accuracy_note(dtype_name: str, what: str, loss_error: float, grad_error: float) -> str:
    """Why ``what``'s result is wrong ("" when it is right): an error past LOSS_TOLERANCE or the dtype's
    GRADIENT_TOLERANCE."""
    wrong = []
    if not loss_error <= LOSS_TOLERANCE:
        wrong.append(f"loss error {loss_error:.1e} > {LOSS_TOLERANCE:.0e}")
    if not grad_error <= GRADIENT_TOLERANCE[dtype_name]:
        wrong.append(f"gradient error {grad_error:.1e} > {GRADIENT_TOLERANCE[dtype_name]:.0e}")
    return f"not timed: {what} wrong: {', '.join(wrong)}" if wrong else ""


def training_step(x, target, backend: str, group=None) -> Callable:
    """One eager step of the mean loss: ``x.grad = None``, the loss (the split call with ``group``), its backward;
    it returns the loss."""
    import multisoft

    def step():
        x.grad = None
        loss = multisoft.cross_entropy(x, target, backend=backend, process_group=group)
        loss.backward()
        return loss
    return step


# -- one process per rank


def _together(group, attempt: Callable) -> tuple[str, list]:
    """Run ``attempt`` on this rank, then share with every rank what each returned: (the first rank's failure, ""
    when none failed; each rank's return value, None where it failed)."""
    import torch.distributed as dist

    note, value = "", None
    try:
        value = attempt()
    except Exception as error:  # noqa: BLE001 - out of memory, a failing kernel: the case's note
        note = describe_error(error)
        timing.recover()
    every = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, (note, value), group=group)
    first = next((f"rank {rank}: {text}" for rank, (text, _) in enumerate(every) if text), "")
    return first, [shared for _, shared in every]


def _measure_case(group, backend: str, shape: tuple, dtype_name: str, device, timer: Callable) -> VocabParallelRecord:
    """One case on this rank: the inputs, the check against float64, then the three timings (module docstring)."""
    import torch
    import torch.distributed as dist

    from ..vocab_parallel import all_gather_into

    rank, ranks = dist.get_rank(group), dist.get_world_size(group)
    rows, classes = shape
    start, width = sum(widths(classes, ranks)[:rank]), widths(classes, ranks)[rank]
    record = VocabParallelRecord(backend, dtype_name, shape_label(shape), ranks)
    state = {}

    def make():
        if rank == 0:
            state["logits"], state["target"] = make_inputs(shape, dtype_name, device)
        else:
            state["logits"] = torch.empty(shape, dtype=getattr(torch, plan.DTYPES[dtype_name]), device=device)
            state["target"] = torch.empty(rows, dtype=torch.int64, device=device)
        dist.broadcast(state["logits"], 0, group=group)
        dist.broadcast(state["target"], 0, group=group)
        state["part"] = state["logits"][:, start:start + width].contiguous().requires_grad_(True)
        state["split"] = training_step(state["part"], state["target"], backend, group)

    def check():
        """(the split loss, its errors) on every rank, and on rank 0 the unsplit loss and its errors."""
        logits, target, part = state.pop("logits"), state["target"], state["part"]
        loss = state["split"]().item()
        split_errors = reference_errors(logits, target, start, loss, part.grad)
        part.grad = None
        state["unsplit"] = lambda: None
        if rank != 0:
            return loss, split_errors, None, None
        whole = logits.requires_grad_(True)
        state["unsplit"] = training_step(whole, target, backend)
        unsplit_loss = state["unsplit"]().item()
        unsplit_errors = reference_errors(logits.detach(), target, 0, unsplit_loss, whole.grad)
        whole.grad = None
        return loss, split_errors, unsplit_loss, unsplit_errors

    def measure_times():
        local = torch.zeros((4, rows), dtype=torch.float32, device=device)
        gathered = torch.empty((4 * ranks, rows), dtype=torch.float32, device=device)
        return (timer(state["unsplit"], group), timer(state["split"], group),
                timer(lambda: all_gather_into(gathered, local, group), group))

    record.note, _ = _together(group, make)
    if not record.note:
        record.note, checked = _together(group, check)
    if not record.note:
        record.loss, _, record.unsplit_loss, unsplit_errors = checked[0]
        record.loss_error = checked[0][1][0]
        record.grad_error = max(errors[1] for _, errors, _, _ in checked)
        record.note = (accuracy_note(dtype_name, "the split call", record.loss_error, record.grad_error)
                       or accuracy_note(dtype_name, "the unsplit call", *unsplit_errors))
    if not record.note:
        record.note, times = _together(group, measure_times)
    if not record.note:
        record.unsplit_ms = times[0][0]
        split = [each[1] for each in times]
        record.split_ms, record.rank_ms = max(split), " ".join(f"{ms:.4g}" for ms in split)
        record.collective_ms = max(each[2] for each in times)
    state.clear()
    timing.recover()
    return record


def _worker(rank: int, world: int, folder: str, backend: str, case_list: list, device_type: str,
            timer: Callable) -> None:
    """One rank: its device, the process group, every case; rank 0 appends each record to RECORDS_FILE."""
    import torch
    import torch.distributed as dist

    if device_type == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        device = torch.device(device_type)
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo", init_method=f"file://{folder}/rendezvous",
                            rank=rank, world_size=world, timeout=datetime.timedelta(seconds=TIMEOUT_S))
    try:
        for shape, dtype_name in case_list:
            record = _measure_case(dist.group.WORLD, backend, tuple(shape), dtype_name, device, timer)
            if rank == 0:
                with open(Path(folder) / RECORDS_FILE, "a") as handle:
                    handle.write(json.dumps(dataclasses.asdict(record)) + "\n")
    finally:
        dist.destroy_process_group()


def _spawn_failure(error: BaseException) -> str:
    """The note of the cases a failed spawn left without a record: the last line of the rank's traceback."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return "error: " + (lines[-1] if lines else type(error).__name__)[:240]


def measure(backend: str, case_list: list[tuple], world: int = RANKS, device_type: str = "cuda",
            timer: Callable | None = None) -> list[VocabParallelRecord]:
    """A record per ((M, V), dtype name) of ``case_list``, measured in ``world`` spawned processes on
    ``device_type`` ("cuda": NCCL, one GPU each, cuda_event_ms; "cpu": gloo, wall_clock_ms) by ``timer``."""
    import torch.multiprocessing as mp

    timer = timer or (cuda_event_ms if device_type == "cuda" else wall_clock_ms)
    failure = ""
    with tempfile.TemporaryDirectory(prefix="multisoft-vocab-parallel-") as folder:
        try:
            mp.spawn(_worker, args=(world, folder, backend, list(case_list), device_type, timer), nprocs=world,
                     join=True)
        except Exception as error:  # noqa: BLE001 - a rank that died: the cases it left get the reason
            failure = _spawn_failure(error)
        path = Path(folder) / RECORDS_FILE
        lines = path.read_text().splitlines() if path.exists() else []
    found = [VocabParallelRecord(**json.loads(line)) for line in lines]
    by_case = {(record.shape, record.dtype): record for record in found}
    return [by_case.get((shape_label(shape), dtype_name))
            or VocabParallelRecord(backend, dtype_name, shape_label(shape), world,
                                   note=failure or "error: the ranks wrote no record")
            for shape, dtype_name in case_list]


def run_cases(runner, backends: list[str], shapes: list[tuple], dtypes: list[str]) -> list[VocabParallelRecord]:
    """Every backend, then every dtype and shape: one spawn per backend of the cases it can run; the others (all
    of them with fewer than RANKS GPUs) get the reason and nothing runs."""
    if not shapes:
        return []
    missing = devices_missing()
    records = []
    for backend in backends:
        runner.progress.step(f"{OP} {backend}")
        notes = {(shape, dtype_name): missing or runner.skip_reason(backend_impl(backend), OP, dtype_name)
                 for dtype_name in dtypes for shape in shapes}
        pending = [case for case, note in notes.items() if not note]
        measured = {}
        if pending:
            timing.recover()  # the parent's cached GPU memory back to the driver, for the ranks
            measured = dict(zip(pending, measure(backend, pending)))
        for (shape, dtype_name), note in notes.items():
            records.append(measured.get((shape, dtype_name))
                           or VocabParallelRecord(backend, dtype_name, shape_label(shape), RANKS, note=note))
    return records
