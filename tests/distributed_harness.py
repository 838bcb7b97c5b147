"""What the vocabulary-parallel tests (tests/test_vocab_parallel.py, tests/test_linear_vocab_parallel.py) share:
spawning a group of processes and joining each to it, this rank's slice of the classes, recording every failing
check of a rank to raise them together, the collectives a call makes, and ending a worker. No tests here.

Every spawned process imports torch, so each test spawns its processes once (``spawn``) and runs all its cases
there: a rank records each failing case (``Report``) and raises them together at the end, which
torch.multiprocessing.spawn raises in the test.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import sys
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WIDTHS = {2: (5, 8), 3: (4, 7, 6)}     # the ranks' uneven slices of 13 and 17 classes, by world size
WIDTHS_WITH_AN_EMPTY_RANK = (6, 0, 5)
REDUCTIONS = ("mean", "sum", "none")
GATHERS = ("all_gather_single", "all_gather_into_tensor")   # the all-gathers a rank's statistics may take
COLLECTIVES = ("all_gather_single", "all_gather_into_tensor", "all_gather", "all_reduce", "reduce_scatter_tensor",
               "reduce_scatter", "all_to_all_single", "broadcast", "reduce", "gather", "scatter", "barrier", "send",
               "recv", "isend", "irecv")


class Ranks:
    """This rank's view of a group and its slice of the classes: [start, start + width) along ``class_dim`` of
    the whole tensor (the logits' dim 1, an output layer's rows: dim 0)."""

    def __init__(self, group, widths, class_dim: int = 1):
        self.group, self.widths, self.class_dim = group, widths, class_dim
        self.rank = dist.get_rank(group)
        self.start = sum(widths[:self.rank])
        self.width = widths[self.rank]

    def part(self, whole: torch.Tensor, dim: int | None = None) -> torch.Tensor:
        """This rank's slice of ``whole`` along ``dim`` (default ``class_dim``)."""
        return whole.narrow(self.class_dim if dim is None else dim, self.start, self.width)


def incoming_gradient(like: torch.Tensor, seed: int) -> torch.Tensor:
    """An incoming gradient of ``like``'s shape, the same on every rank: one value of 2.5, or one per element."""
    if like.ndim == 0:
        return torch.full_like(like, 2.5)
    generator = torch.Generator().manual_seed(seed)
    return (torch.rand(like.shape, generator=generator) + 0.5).to(like.device, like.dtype)


def raises(error, pattern, call, *args, **kwargs):
    """``call(*args, **kwargs)`` raises ``error`` whose message matches ``pattern``."""
    with pytest.raises(error, match=pattern):
        call(*args, **kwargs)


def cannot_run(backend, dtypes, device):
    """The failure recorded where a backend of the plan can run none of its dtypes: nothing would be checked."""
    raise AssertionError(f"{backend} cannot run any of {dtypes} on {device}: nothing was checked")


@contextlib.contextmanager
def counting_collectives(calls: list):
    """Appends the name of every torch.distributed collective called (the outermost, where one calls another)."""
    originals = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}
    depth = [0]

    def counting(name, collective):
        def call(*args, **kwargs):
            if not depth[0]:
                calls.append(name)
            depth[0] += 1
            try:
                return collective(*args, **kwargs)
            finally:
                depth[0] -= 1
        return call

    try:
        for name, collective in originals.items():
            setattr(dist, name, counting(name, collective))
        yield
    finally:
        for name, collective in originals.items():
            setattr(dist, name, collective)


@contextlib.contextmanager
def no_host_synchronisation(device):
    """On CUDA, any operation that waits for the device raises (torch's sync debug mode)."""
    if device.type != "cuda":
        yield
        return
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


class Report:
    """Runs checks, records each failure (with its traceback) instead of stopping at the first."""

    def __init__(self, rank):
        self.rank, self.checked, self.failures = rank, [], []

    def __call__(self, what, check, *args):
        self.checked.append(what)
        try:
            check(*args)
        except Exception:  # every failure of every case, reported together at the end
            self.failures.append(f"[rank {self.rank}] {what}:\n{traceback.format_exc()}")

    def raise_failures(self):
        if self.failures:
            raise AssertionError(f"{len(self.failures)} of {len(self.checked)} checks failed:\n"
                                 + "\n".join(self.failures))


def spawn(worker, tmp_path, world: int, plan: dict) -> None:
    """Runs ``worker(rank, world, rendezvous, plan)`` in ``world`` new processes (a module-level function: it is
    pickled by name) and waits for them; a rank's exception is raised here."""
    mp.spawn(worker, args=(world, str(tmp_path / "rendezvous"), plan), nprocs=world, join=True)


def join_group(rank, world, rendezvous, plan):
    """Joins this spawned process to the group (``plan``: its torch.distributed backend, and "cuda" for a GPU of
    its own per rank, else the CPU); returns its device."""
    # torch._dynamo, which multisoft's first vocabulary-parallel call imports (torch.compiler.disable), keeps the
    # default group alive past dist.destroy_process_group() when first imported while that group exists (torch
    # 2.13); a gloo group alive at the interpreter's exit can abort the process
    # (test_vocab_parallel.py's test_gloo_a_destroyed_group_is_not_kept_alive)
    import torch._dynamo  # noqa: F401
    if plan["device"] == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        device = torch.device("cpu")
    dist.init_process_group(plan["distributed_backend"], init_method=f"file://{rendezvous}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=plan["timeout_s"]))
    return device


def exit_at_once():
    """Ends a worker whose checks passed without the interpreter's finalization. A DTensor's collectives leave
    torch holding the default group after ``dist.destroy_process_group()`` (torch 2.13, without multisoft too),
    so its gloo threads run into the finalization, where one dropping a finished collective's tensors aborts the
    process ("terminate called without an active exception"). A failed check raises before this."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
